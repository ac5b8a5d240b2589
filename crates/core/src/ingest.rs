//! Ingestion: Kubernetes objects (k8s-openapi types) into the validated [`crate::model`],
//! implementing §a of docs/upstream-semantics.md. This is the one place that judges
//! outside input: names that Kubernetes would reject are refused here, so no later stage
//! (nftables scripts, logs) ever sees them. A problem confined to one field (one bad endpoint
//! address, one bad source range) drops that piece with a warning; a problem that makes the
//! whole object meaningless rejects the object. Neighbouring objects are never affected.
//!
//! A field read here reaches ingest from a real API server only if the API source's
//! decoders carry it: Services and EndpointSlices arrive in protobuf, decoded by
//! hand-written messages that hold only the fields listed there
//! (`kproxy-source`'s `kube/proto.rs`; JSON: `kube/slim.rs`). A new field read here goes
//! there too; `kube/proto/fields.rs` fails until it does (the manifest path, `plan` and
//! `trace` would all pass without it).

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use k8s_openapi::api::networking::v1 as networkingv1;
use serde::Serialize;

use crate::model::{
    ClusterIps, Conditions, EndpointSlice, IpFamily, Node, NotAServiceType, Placement, Protocol,
    Service, ServiceCidr, ServiceName, ServicePort, ServiceType, SliceEndpoint, SlicePort,
    TrafficPolicy,
};

/// Label that hands a Service to another proxy; upstream's watch excludes it.
pub const LABEL_SERVICE_PROXY_NAME: &str = "service.kubernetes.io/service-proxy-name";
/// Label that marks a headless Service; upstream's watch excludes it.
pub const LABEL_HEADLESS: &str = "service.kubernetes.io/headless";
/// Label that ties an EndpointSlice to its Service.
pub const LABEL_SERVICE_NAME: &str = "kubernetes.io/service-name";
pub const LABEL_ZONE: &str = "topology.kubernetes.io/zone";
pub const ANNOTATION_LAST_CHANGE_TRIGGER_TIME: &str =
    "endpoints.kubernetes.io/last-change-trigger-time";
pub const TAINT_TO_BE_DELETED: &str = "ToBeDeletedByClusterAutoscaler";
/// KEP-5683's Node conditions: a drain (`kubectl drain` or a controller) and the
/// kubelet's graceful node shutdown are under way.
pub const CONDITION_DRAIN_IN_PROGRESS: &str = "DrainInProgress";
pub const CONDITION_GRACEFUL_NODE_SHUTDOWN_IN_PROGRESS: &str = "GracefulNodeShutdownInProgress";

/// Which kind of object a report is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Kind {
    Service,
    EndpointSlice,
    Node,
    ServiceCidr,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::ServiceCidr => "ServiceCIDR",
        })
    }
}

/// `Kind namespace/name` of an object, for reports. Name parts are shown escaped.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct ObjectRef {
    pub kind: Kind,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl fmt::Display for ObjectRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |s: &Option<String>| match s {
            Some(s) => s.escape_debug().to_string(),
            None => "<unnamed>".to_string(),
        };
        match &self.namespace {
            Some(_) => write!(
                f,
                "{} {}/{}",
                self.kind,
                show(&self.namespace),
                show(&self.name)
            ),
            None => write!(f, "{} {}", self.kind, show(&self.name)),
        }
    }
}

/// A problem with one object: which object, which field, why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("{object}: {field}: {reason}")]
pub struct IngestError {
    pub object: ObjectRef,
    /// Field path, e.g. `.endpoints[2].addresses[0]`.
    pub field: String,
    pub reason: String,
}

/// An ingested object with the warnings about pieces of it that were dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ingested<T> {
    pub value: T,
    pub warnings: Vec<IngestError>,
}

/// Why a valid Service is not proxied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum NotProxied {
    ExternalName,
    Headless,
    /// Labelled `service.kubernetes.io/service-proxy-name` for another proxy.
    OtherProxy,
}

impl fmt::Display for NotProxied {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            NotProxied::ExternalName => "type ExternalName is not proxied",
            NotProxied::Headless => "headless Service (no cluster IP) is not proxied",
            NotProxied::OtherProxy => {
                "labelled service.kubernetes.io/service-proxy-name for another proxy"
            }
        })
    }
}

/// Outcome of ingesting a Service.
// Short-lived (one per object while ingesting); boxing would cost an allocation each.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServiceOutcome {
    Proxied(Ingested<Service>),
    NotProxied(ServiceName, NotProxied),
}

/// Which Services this proxy owns (docs/upstream-semantics.md §a.1): by default those *without* the
/// `service-proxy-name` label; with `--service-proxy-name X`, those labelled X.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ownership {
    pub service_proxy_name: Option<String>,
}

impl Ownership {
    pub fn owns(&self, labels: Option<&BTreeMap<String, String>>) -> bool {
        let value = labels.and_then(|l| l.get(LABEL_SERVICE_PROXY_NAME));
        match (&self.service_proxy_name, value) {
            (None, None) => true,
            (None, Some(_)) => false,
            (Some(mine), Some(v)) => v == mine,
            (Some(_), None) => false,
        }
    }
}

struct Ctx {
    object: ObjectRef,
    warnings: Vec<IngestError>,
}

impl Ctx {
    fn new(kind: Kind, meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Ctx {
        Ctx {
            object: ObjectRef {
                kind,
                namespace: meta.namespace.clone(),
                name: meta.name.clone(),
            },
            warnings: Vec::new(),
        }
    }
    fn err(&self, field: impl Into<String>, reason: impl Into<String>) -> IngestError {
        IngestError {
            object: self.object.clone(),
            field: field.into(),
            reason: reason.into(),
        }
    }
    fn warn(&mut self, field: impl Into<String>, reason: impl Into<String>) {
        let e = self.err(field, reason);
        self.warnings.push(e);
    }
}

/// A DNS-1123 label: what Kubernetes requires of namespaces and Service names.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// A DNS-1123 subdomain: EndpointSlice and Node names.
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// A port name as the API accepts it on Services and EndpointSlices: empty, or up to
/// 63 characters of `[a-z0-9-]` starting and ending alphanumeric.
pub fn is_port_name(s: &str) -> bool {
    s.is_empty() || is_dns_label(s)
}

/// A label value: up to 63 of `[A-Za-z0-9-_.]`, alphanumeric at both ends (may be empty).
pub fn is_label_value(s: &str) -> bool {
    s.is_empty()
        || (s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
            && s.as_bytes()[0].is_ascii_alphanumeric()
            && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric())
}

/// Parses an IP the way upstream's "sloppy" parser does: IPv4 octets with leading
/// zeros are read as decimal (`172.30.0.041` is `172.30.0.41`).
pub fn parse_ip(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip);
    }
    let parts: Vec<&str> = s.split('.').collect();
    if parts.len() != 4 {
        return None;
    }
    let mut octets = [0u8; 4];
    for (o, p) in octets.iter_mut().zip(&parts) {
        if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *o = p.parse().ok()?;
    }
    Some(IpAddr::V4(Ipv4Addr::from(octets)))
}

/// Parses a CIDR leniently (surrounding whitespace trimmed, leading-zero IPv4 octets),
/// normalised to its network address as upstream does.
pub fn parse_cidr(s: &str) -> Option<IpNet> {
    let s = s.trim();
    let (ip, len) = s.split_once('/')?;
    let ip = parse_ip(ip)?;
    let len: u8 = len.parse().ok()?;
    IpNet::new(ip, len).ok().map(|n| n.trunc())
}

/// Why `ip` cannot be a Service's cluster, external or load-balancer IP, as the
/// apiserver's `ValidateNonSpecialIP` judges (plus broadcast): traffic to such an address
/// would never leave the node, or would capture the node's own traffic (a cluster IP of
/// 127.0.0.1 broke every new TCP connection to the node's loopback).
pub fn special_ip(ip: &IpAddr) -> Option<&'static str> {
    match ip {
        _ if ip.is_unspecified() => Some("may not be unspecified (0.0.0.0, ::)"),
        _ if ip.is_loopback() => Some("may not be in the loopback range"),
        _ if ip.is_multicast() => Some("may not be a multicast address"),
        IpAddr::V4(v4) if v4.is_broadcast() => Some("may not be the broadcast address"),
        IpAddr::V4(v4) if v4.is_link_local() => {
            Some("may not be in the link-local range (169.254.0.0/16)")
        }
        IpAddr::V6(v6) if v6.is_unicast_link_local() => {
            Some("may not be in the link-local range (fe80::/10)")
        }
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => special_ip(&IpAddr::V4(v4)),
            None => None,
        },
        _ => None,
    }
}

/// Drops the node ports of `svc` outside `range` (the apiserver's
/// `--service-node-port-range`, which an API source never needs to check again), and a
/// health-check node port outside it or equal to one of the Service's node ports (it
/// would show as listening but the NodePort rule takes its packets). Returns what was
/// dropped, as warnings.
pub fn restrict_node_ports(
    svc: &mut Service,
    range: &std::ops::RangeInclusive<u16>,
) -> Vec<IngestError> {
    let object = ObjectRef {
        kind: Kind::Service,
        namespace: Some(svc.name.namespace.to_string()),
        name: Some(svc.name.name.to_string()),
    };
    let mut out = Vec::new();
    let mut warn = |field: String, reason: String| {
        out.push(IngestError {
            object: object.clone(),
            field,
            reason,
        })
    };
    let (lo, hi) = (range.start(), range.end());
    for (i, p) in svc.ports.iter_mut().enumerate() {
        if let Some(n) = p.node_port
            && !range.contains(&n)
        {
            warn(
                format!(".spec.ports[{i}].nodePort"),
                format!("{n} is outside the node port range {lo}-{hi}; NodePort ignored"),
            );
            p.node_port = None;
        }
    }
    if let Some(h) = svc.health_check_node_port {
        if !range.contains(&h) {
            warn(
                ".spec.healthCheckNodePort".into(),
                format!("{h} is outside the node port range {lo}-{hi}; ignored"),
            );
            svc.health_check_node_port = None;
        } else if svc.ports.iter().any(|p| p.node_port == Some(h)) {
            warn(
                ".spec.healthCheckNodePort".into(),
                format!("{h} is also a nodePort of this Service; ignored"),
            );
            svc.health_check_node_port = None;
        }
    }
    out
}

fn check_meta_name(
    ctx: &Ctx,
    namespaced: bool,
    subdomain: bool,
) -> Result<(String, String), IngestError> {
    let ns = if namespaced {
        match &ctx.object.namespace {
            Some(ns) if is_dns_label(ns) => ns.clone(),
            Some(_) => {
                return Err(ctx.err(
                    ".metadata.namespace",
                    "not a valid namespace (DNS-1123 label)",
                ));
            }
            None => return Err(ctx.err(".metadata.namespace", "missing")),
        }
    } else {
        String::new()
    };
    let valid = |n: &str| {
        if subdomain {
            is_dns_subdomain(n)
        } else {
            is_dns_label(n)
        }
    };
    match &ctx.object.name {
        Some(n) if valid(n) => Ok((ns, n.clone())),
        Some(_) => Err(ctx.err(
            ".metadata.name",
            if subdomain {
                "not a valid name (DNS-1123 subdomain)"
            } else {
                "not a valid name (DNS-1123 label)"
            },
        )),
        None => Err(ctx.err(".metadata.name", "missing")),
    }
}

fn port_number(v: i32) -> Option<u16> {
    u16::try_from(v).ok().filter(|p| *p != 0)
}

/// Ingests a Service (docs/upstream-semantics.md §a.1, §a.2). Every field read here must be
/// carried by the API decoders (module doc).
pub fn service(
    svc: &corev1::Service,
    ownership: &Ownership,
) -> Result<ServiceOutcome, IngestError> {
    let mut ctx = Ctx::new(Kind::Service, &svc.metadata);
    let (namespace, name) = check_meta_name(&ctx, true, false)?;
    let sname = ServiceName::new(namespace, name);
    let labels = svc.metadata.labels.as_ref();
    if !ownership.owns(labels) {
        return Ok(ServiceOutcome::NotProxied(sname, NotProxied::OtherProxy));
    }
    if labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS)) {
        return Ok(ServiceOutcome::NotProxied(sname, NotProxied::Headless));
    }
    let Some(spec) = &svc.spec else {
        return Err(ctx.err(".spec", "missing"));
    };
    let service_type = match ServiceType::parse(spec.type_.as_deref()) {
        Ok(t) => t,
        Err(NotAServiceType::ExternalName) => {
            return Ok(ServiceOutcome::NotProxied(sname, NotProxied::ExternalName));
        }
        Err(NotAServiceType::Unknown(other)) => {
            return Err(ctx.err(
                ".spec.type",
                format!("unknown type {:?}", other.escape_debug().to_string()),
            ));
        }
    };
    let primary = spec.cluster_ip.as_deref().unwrap_or("");
    if primary.is_empty() || primary == "None" {
        return Ok(ServiceOutcome::NotProxied(sname, NotProxied::Headless));
    }

    let cluster_ips = service_cluster_ips(spec, primary, &mut ctx)?;
    let ports = service_ports(spec, &mut ctx);
    let external_ips = spec
        .external_ips
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, s)| usable_ip(s.trim(), format!(".spec.externalIPs[{i}]"), &mut ctx))
        .collect();
    let load_balancer_ips = service_load_balancer_ips(svc, &mut ctx);
    let load_balancer_source_ranges = service_source_ranges(spec, &mut ctx);
    let external_traffic_policy = traffic_policy(
        spec.external_traffic_policy.as_deref(),
        ".spec.externalTrafficPolicy",
        &mut ctx,
    );
    let internal_traffic_policy = traffic_policy(
        spec.internal_traffic_policy.as_deref(),
        ".spec.internalTrafficPolicy",
        &mut ctx,
    );
    let health_check_node_port = service_health_check_node_port(spec, &mut ctx);
    let session_affinity_timeout = service_session_affinity(spec, &mut ctx);
    let traffic_distribution = spec
        .traffic_distribution
        .clone()
        .filter(|s| is_label_value(s));

    Ok(ServiceOutcome::Proxied(Ingested {
        value: Service {
            name: sname,
            service_type,
            cluster_ips,
            ports,
            external_ips,
            load_balancer_ips,
            load_balancer_source_ranges,
            external_traffic_policy,
            internal_traffic_policy,
            health_check_node_port,
            session_affinity_timeout,
            traffic_distribution,
            created: svc
                .metadata
                .creation_timestamp
                .as_ref()
                .map(|t| t.0.as_second()),
        },
        warnings: ctx.warnings,
    }))
}

/// Cluster IPs per family (docs/upstream-semantics.md §a.1): `.spec.ipFamilies` with
/// `.spec.clusterIPs`, or the primary `.spec.clusterIP` alone. A Service without a usable one
/// is an error.
fn service_cluster_ips(
    spec: &corev1::ServiceSpec,
    primary: &str,
    ctx: &mut Ctx,
) -> Result<ClusterIps, IngestError> {
    let mut cluster_ips = ClusterIps::default();
    let families = spec.ip_families.as_deref().unwrap_or(&[]);
    if families.is_empty() {
        let ip =
            parse_ip(primary).ok_or_else(|| ctx.err(".spec.clusterIP", "not an IP address"))?;
        if let Some(why) = special_ip(&ip) {
            return Err(ctx.err(".spec.clusterIP", why));
        }
        cluster_ips.insert(IpFamily::of(&ip), ip);
    } else {
        let ips: Vec<&str> = match &spec.cluster_ips {
            Some(v) if !v.is_empty() => v.iter().map(String::as_str).collect(),
            _ => vec![primary],
        };
        for (i, fam) in families.iter().enumerate() {
            let family = match fam.as_str() {
                "IPv4" => IpFamily::IPv4,
                "IPv6" => IpFamily::IPv6,
                _ => {
                    ctx.warn(
                        format!(".spec.ipFamilies[{i}]"),
                        "unknown IP family; ignored",
                    );
                    continue;
                }
            };
            let Some(s) = ips.get(i) else {
                ctx.warn(
                    format!(".spec.clusterIPs[{i}]"),
                    format!("missing for family {family}"),
                );
                continue;
            };
            match parse_ip(s) {
                Some(ip) if family.contains(&ip) => match special_ip(&ip) {
                    Some(why) => {
                        ctx.warn(format!(".spec.clusterIPs[{i}]"), format!("{why}; ignored"))
                    }
                    None => {
                        cluster_ips.insert_at(family, ip, i);
                    }
                },
                Some(_) => ctx.warn(
                    format!(".spec.clusterIPs[{i}]"),
                    format!("not an {family} address; ignored"),
                ),
                None => ctx.warn(
                    format!(".spec.clusterIPs[{i}]"),
                    "not an IP address; ignored",
                ),
            }
        }
        if cluster_ips.is_empty() {
            return Err(ctx.err(".spec.clusterIPs", "no usable cluster IP"));
        }
    }

    Ok(cluster_ips)
}

/// `.spec.ports`: a bad port is skipped with a warning, never the Service.
fn service_ports(spec: &corev1::ServiceSpec, ctx: &mut Ctx) -> Vec<ServicePort> {
    let mut ports = Vec::new();
    for (i, p) in spec.ports.iter().flatten().enumerate() {
        let field = format!(".spec.ports[{i}]");
        let pname = p.name.clone().unwrap_or_default();
        if !is_port_name(&pname) {
            ctx.warn(
                format!("{field}.name"),
                "not a valid port name; port ignored",
            );
            continue;
        }
        let Some(protocol) = port_protocol(p.protocol.as_deref(), &field, ctx) else {
            continue;
        };
        let Some(port) = port_number(p.port) else {
            ctx.warn(
                format!("{field}.port"),
                "not a port number (1-65535); port ignored",
            );
            continue;
        };
        let node_port = match p.node_port {
            None | Some(0) => None,
            Some(n) => match port_number(n) {
                Some(n) => Some(n),
                None => {
                    ctx.warn(
                        format!("{field}.nodePort"),
                        "not a port number; NodePort ignored",
                    );
                    None
                }
            },
        };
        if ports
            .iter()
            .any(|q: &ServicePort| q.name == pname && q.protocol == protocol)
        {
            ctx.warn(field, "duplicate (name, protocol); port ignored");
            continue;
        }
        ports.push(ServicePort {
            name: pname,
            protocol,
            port,
            node_port,
        });
    }

    ports
}

/// A port's protocol (default TCP); `None`, with a warning, for an unknown one.
fn port_protocol(v: Option<&str>, field: &str, ctx: &mut Ctx) -> Option<Protocol> {
    match v {
        None => Some(Protocol::TCP),
        Some(s) => {
            let proto = Protocol::parse(s);
            if proto.is_none() {
                ctx.warn(
                    format!("{field}.protocol"),
                    "unknown protocol; port ignored",
                );
            }
            proto
        }
    }
}

/// An IP a Service may be reached at (external or load-balancer IP); a bad one is
/// skipped with a warning naming `field`.
fn usable_ip(s: &str, field: String, ctx: &mut Ctx) -> Option<IpAddr> {
    match parse_ip(s) {
        Some(ip) => match special_ip(&ip) {
            Some(why) => {
                ctx.warn(field, format!("{why}; ignored"));
                None
            }
            None => Some(ip),
        },
        None => {
            ctx.warn(field, "not an IP address; ignored");
            None
        }
    }
}

/// `.status.loadBalancer.ingress[].ip`, except `ipMode: Proxy` ones (the load balancer
/// proxies: traffic never arrives for the LB IP).
fn service_load_balancer_ips(svc: &corev1::Service, ctx: &mut Ctx) -> Vec<IpAddr> {
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref());
    ingress
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(_, ing)| ing.ip_mode.as_deref() != Some("Proxy"))
        .filter_map(|(i, ing)| {
            let s = ing.ip.as_deref().filter(|s| !s.is_empty())?;
            usable_ip(s, format!(".status.loadBalancer.ingress[{i}].ip"), ctx)
        })
        .collect()
}

/// `.spec.loadBalancerSourceRanges`; a bad CIDR is skipped with a warning.
fn service_source_ranges(spec: &corev1::ServiceSpec, ctx: &mut Ctx) -> Vec<IpNet> {
    let mut load_balancer_source_ranges = Vec::new();
    for (i, s) in spec
        .load_balancer_source_ranges
        .iter()
        .flatten()
        .enumerate()
    {
        match parse_cidr(s) {
            Some(net) => load_balancer_source_ranges.push(net),
            None => ctx.warn(
                format!(".spec.loadBalancerSourceRanges[{i}]"),
                "not a CIDR; ignored",
            ),
        }
    }

    load_balancer_source_ranges
}

/// An external or internal traffic policy; unknown values are Cluster, with a warning.
fn traffic_policy(v: Option<&str>, field: &str, ctx: &mut Ctx) -> TrafficPolicy {
    TrafficPolicy::parse(v).unwrap_or_else(|| {
        ctx.warn(field, "unknown policy; treated as Cluster");
        TrafficPolicy::Cluster
    })
}

fn service_health_check_node_port(spec: &corev1::ServiceSpec, ctx: &mut Ctx) -> Option<u16> {
    match spec.health_check_node_port {
        None | Some(0) => None,
        Some(n) => match port_number(n) {
            Some(n) => Some(n),
            None => {
                ctx.warn(".spec.healthCheckNodePort", "not a port number; ignored");
                None
            }
        },
    }
}

/// ClientIP session affinity's timeout (default 10800 s); `None` without affinity.
fn service_session_affinity(spec: &corev1::ServiceSpec, ctx: &mut Ctx) -> Option<u32> {
    match spec.session_affinity.as_deref() {
        Some("ClientIP") => {
            let t = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds)
                .unwrap_or(10800);
            if !(1..=86400).contains(&t) {
                ctx.warn(
                    ".spec.sessionAffinityConfig.clientIP.timeoutSeconds",
                    "must be 1-86400; using 10800",
                );
                Some(10800)
            } else {
                Some(t as u32)
            }
        }
        _ => None,
    }
}

/// Outcome of ingesting an EndpointSlice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SliceOutcome {
    Used(Ingested<EndpointSlice>),
    /// A valid slice kproxy does not use (FQDN, or labelled for another proxy / headless).
    Ignored {
        namespace: String,
        name: String,
        reason: &'static str,
    },
}

/// Ingests an EndpointSlice (docs/upstream-semantics.md §a.3). Every field read here must be
/// carried by the API decoders (module doc).
pub fn endpoint_slice(
    slice: &discoveryv1::EndpointSlice,
    ownership: &Ownership,
) -> Result<SliceOutcome, IngestError> {
    let mut ctx = Ctx::new(Kind::EndpointSlice, &slice.metadata);
    let (namespace, name) = check_meta_name(&ctx, true, true)?;
    let labels = slice.metadata.labels.as_ref();
    if !ownership.owns(labels) {
        return Ok(SliceOutcome::Ignored {
            namespace,
            name,
            reason: "labelled for another proxy",
        });
    }
    if labels.is_some_and(|l| l.contains_key(LABEL_HEADLESS)) {
        return Ok(SliceOutcome::Ignored {
            namespace,
            name,
            reason: "belongs to a headless Service",
        });
    }
    let service_name = match labels.and_then(|l| l.get(LABEL_SERVICE_NAME)) {
        Some(s) if is_dns_label(s) => s.clone(),
        Some(s) if s.is_empty() => {
            return Err(ctx.err(format!(".metadata.labels[{LABEL_SERVICE_NAME}]"), "empty"));
        }
        Some(_) => {
            return Err(ctx.err(
                format!(".metadata.labels[{LABEL_SERVICE_NAME}]"),
                "not a valid Service name",
            ));
        }
        None => return Err(ctx.err(format!(".metadata.labels[{LABEL_SERVICE_NAME}]"), "missing")),
    };
    let family = match slice.address_type.as_str() {
        "IPv4" => IpFamily::IPv4,
        "IPv6" => IpFamily::IPv6,
        "FQDN" => {
            return Ok(SliceOutcome::Ignored {
                namespace,
                name,
                reason: "addressType FQDN is not proxied",
            });
        }
        _ => return Err(ctx.err(".addressType", "must be IPv4, IPv6 or FQDN")),
    };

    let ports = slice_ports(slice, &mut ctx);
    let endpoints = slice
        .endpoints
        .iter()
        .enumerate()
        .filter_map(|(i, e)| slice_endpoint(e, &format!(".endpoints[{i}]"), family, &mut ctx))
        .collect();

    let last_change_trigger_time = slice
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION_LAST_CHANGE_TRIGGER_TIME))
        .filter(|s| s.len() <= 64 && s.bytes().all(|b| b.is_ascii_graphic()))
        .cloned();

    Ok(SliceOutcome::Used(Ingested {
        value: EndpointSlice {
            name,
            service: ServiceName::new(namespace, service_name),
            family,
            ports,
            endpoints,
            last_change_trigger_time,
        },
        warnings: ctx.warnings,
    }))
}

/// `.ports` of an EndpointSlice: as upstream, a port without a name or a number is
/// skipped silently; an invalid one with a warning.
fn slice_ports(slice: &discoveryv1::EndpointSlice, ctx: &mut Ctx) -> Vec<SlicePort> {
    let mut ports = Vec::new();
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let field = format!(".ports[{i}]");
        // Upstream skips a port whose name is absent (nil) or whose number is absent/0.
        let Some(pname) = p.name.clone() else {
            continue;
        };
        if !is_port_name(&pname) {
            ctx.warn(
                format!("{field}.name"),
                "not a valid port name; port ignored",
            );
            continue;
        }
        let Some(port) = p.port.and_then(port_number) else {
            continue;
        };
        let Some(protocol) = port_protocol(p.protocol.as_deref(), &field, ctx) else {
            continue;
        };
        ports.push(SlicePort {
            name: pname,
            protocol,
            port,
        });
    }

    ports
}

/// One endpoint of an EndpointSlice (its first address, of the slice's family), or
/// `None` when it cannot be used (with a warning naming `field` when it is invalid).
fn slice_endpoint(
    e: &discoveryv1::Endpoint,
    field: &str,
    family: IpFamily,
    ctx: &mut Ctx,
) -> Option<SliceEndpoint> {
    let first = e.addresses.first()?;
    let ip = match parse_ip(first) {
        Some(ip) if family.contains(&ip) => ip,
        Some(_) => {
            ctx.warn(
                format!("{field}.addresses[0]"),
                format!("not an {family} address; endpoint ignored"),
            );
            return None;
        }
        None => {
            ctx.warn(
                format!("{field}.addresses[0]"),
                "not an IP address; endpoint ignored",
            );
            return None;
        }
    };
    let c = e.conditions.as_ref();
    let conditions = Conditions {
        ready: c.and_then(|c| c.ready).unwrap_or(true),
        serving: c.and_then(|c| c.serving).unwrap_or(true),
        terminating: c.and_then(|c| c.terminating).unwrap_or(false),
    };
    let node_name = match e.node_name.as_deref() {
        None | Some("") => None,
        Some(n) if is_dns_subdomain(n) => Some(n.into()),
        Some(_) => {
            ctx.warn(
                format!("{field}.nodeName"),
                "not a valid node name; treated as remote",
            );
            None
        }
    };
    let zone = match e.zone.as_deref() {
        None | Some("") => None,
        Some(z) if is_label_value(z) => Some(z.into()),
        Some(_) => {
            ctx.warn(format!("{field}.zone"), "not a valid zone; ignored");
            None
        }
    };
    let hints = e.hints.as_ref();
    let zone_hints = hint_names(
        hints
            .and_then(|h| h.for_zones.as_ref())
            .map(|z| z.iter().map(|z| z.name.clone()).collect()),
        &format!("{field}.hints.forZones"),
        ctx,
    );
    let node_hints = hint_names(
        hints
            .and_then(|h| h.for_nodes.as_ref())
            .map(|n| n.iter().map(|n| n.name.clone()).collect()),
        &format!("{field}.hints.forNodes"),
        ctx,
    );
    Some(SliceEndpoint {
        ip,
        conditions,
        placement: Placement {
            node_name,
            zone,
            zone_hints,
            node_hints,
        }
        .shared(),
    })
}

/// Topology hint names (`forZones` / `forNodes`, at `field`); invalid ones are skipped
/// with a warning, and a list left empty is no hint.
fn hint_names(
    list: Option<Vec<String>>,
    field: &str,
    ctx: &mut Ctx,
) -> Option<std::sync::Arc<[String]>> {
    let mut out = Vec::new();
    for (j, n) in list?.into_iter().enumerate() {
        if is_label_value(&n) && !n.is_empty() {
            out.push(n);
        } else {
            ctx.warn(
                format!("{field}[{j}].name"),
                "not a valid name; hint ignored",
            );
        }
    }
    if out.is_empty() {
        None
    } else {
        Some(out.into())
    }
}

/// Ingests a Node.
pub fn node(n: &corev1::Node) -> Result<Ingested<Node>, IngestError> {
    let mut ctx = Ctx::new(Kind::Node, &n.metadata);
    let (_, name) = check_meta_name(&ctx, false, true)?;
    let mut labels = BTreeMap::new();
    for (k, v) in n.metadata.labels.iter().flatten() {
        if is_label_value(v) && k.len() <= 317 && k.bytes().all(|b| b.is_ascii_graphic()) {
            labels.insert(k.clone(), v.clone());
        } else {
            ctx.warn(
                format!(".metadata.labels[{}]", k.escape_debug()),
                "not a valid label; ignored",
            );
        }
    }
    let zone = labels.get(LABEL_ZONE).filter(|z| !z.is_empty()).cloned();
    let mut addresses = Vec::new();
    if let Some(addrs) = n.status.as_ref().and_then(|s| s.addresses.as_ref()) {
        for kind in ["InternalIP", "ExternalIP"] {
            for (i, a) in addrs.iter().enumerate().filter(|(_, a)| a.type_ == kind) {
                match parse_ip(&a.address) {
                    Some(ip) if !addresses.contains(&ip) => addresses.push(ip),
                    Some(_) => {}
                    None => ctx.warn(
                        format!(".status.addresses[{i}].address"),
                        "not an IP address; ignored",
                    ),
                }
            }
        }
    }
    let mut pod_cidrs = Vec::new();
    let spec = n.spec.as_ref();
    let cidrs: Vec<String> = match spec.and_then(|s| s.pod_cidrs.clone()) {
        Some(v) if !v.is_empty() => v,
        _ => spec.and_then(|s| s.pod_cidr.clone()).into_iter().collect(),
    };
    for (i, c) in cidrs.iter().enumerate() {
        match parse_cidr(c) {
            Some(net) => pod_cidrs.push(net),
            None => ctx.warn(format!(".spec.podCIDRs[{i}]"), "not a CIDR; ignored"),
        }
    }
    let deleting = n.metadata.deletion_timestamp.is_some();
    let to_be_deleted_by_autoscaler = spec
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TAINT_TO_BE_DELETED));
    // KEP-5683: a condition counts only with status "True" ("False" and "Unknown" say
    // nothing is under way).
    let condition = |kind: &str| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == kind && c.status == "True"))
    };
    Ok(Ingested {
        value: Node {
            name,
            zone,
            labels,
            addresses,
            pod_cidrs,
            deleting,
            to_be_deleted_by_autoscaler,
            deleted: false,
            drain_in_progress: condition(CONDITION_DRAIN_IN_PROGRESS),
            graceful_node_shutdown_in_progress: condition(
                CONDITION_GRACEFUL_NODE_SHUTDOWN_IN_PROGRESS,
            ),
        },
        warnings: ctx.warnings,
    })
}

/// Ingests a ServiceCIDR (cluster-scoped). An entry of `spec.cidrs` that is not a CIDR
/// is dropped with a warning; the others still count.
pub fn service_cidr(c: &networkingv1::ServiceCIDR) -> Result<Ingested<ServiceCidr>, IngestError> {
    let mut ctx = Ctx::new(Kind::ServiceCidr, &c.metadata);
    let (_, name) = check_meta_name(&ctx, false, true)?;
    let mut cidrs = Vec::new();
    for (i, s) in c
        .spec
        .as_ref()
        .and_then(|s| s.cidrs.as_ref())
        .into_iter()
        .flatten()
        .enumerate()
    {
        match parse_cidr(s) {
            Some(net) => cidrs.push(net),
            None => ctx.warn(format!(".spec.cidrs[{i}]"), "not a CIDR; ignored"),
        }
    }
    Ok(Ingested {
        value: ServiceCidr { name, cidrs },
        warnings: ctx.warnings,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sloppy_ipv4_reads_leading_zeros_as_decimal() {
        assert_eq!(
            parse_ip("172.30.0.041"),
            Some("172.30.0.41".parse().unwrap())
        );
        assert_eq!(
            parse_ip("010.001.002.003"),
            Some("10.1.2.3".parse().unwrap())
        );
        assert_eq!(parse_ip("1.2.3.256"), None);
        assert_eq!(parse_ip("1.2.3"), None);
        assert_eq!(parse_ip("fd00::1"), Some("fd00::1".parse().unwrap()));
    }

    #[test]
    fn cidrs_are_trimmed_and_normalised() {
        assert_eq!(
            parse_cidr(" 10.0.0.5/8 "),
            Some("10.0.0.0/8".parse().unwrap())
        );
        assert_eq!(parse_cidr("bogus"), None);
    }

    #[test]
    fn names_that_kubernetes_rejects_are_rejected() {
        assert!(is_dns_label("web-1"));
        for bad in ["", "Web", "a_b", "-a", "a-", "a;b", "x\"y", &"a".repeat(64)] {
            assert!(!is_dns_label(bad), "{bad:?}");
        }
        assert!(is_dns_subdomain("web-abc.x"));
        assert!(!is_dns_subdomain("web..x"));
    }

    fn svc_with(spec: &str) -> corev1::Service {
        let text = format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: shop}}\nspec: {spec}\n"
        );
        serde_saphyr::from_str(&text).unwrap()
    }

    /// A cluster IP of 127.0.0.1 broke every new TCP connection to the node's
    /// loopback; 0.0.0.0, broadcast and multicast were accepted too.
    #[test]
    fn special_addresses_are_refused_as_service_ips() {
        for ip in [
            "127.0.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "169.254.1.1",
            "::1",
            "::",
            "ff02::1",
            "fe80::1",
            "::ffff:127.0.0.1",
        ] {
            let svc = svc_with(&format!("{{clusterIP: \"{ip}\", ports: [{{port: 80}}]}}"));
            let e = service(&svc, &Ownership::default()).unwrap_err();
            assert_eq!(e.field, ".spec.clusterIP", "{ip}");
            assert!(e.reason.starts_with("may not be"), "{ip}: {e}");

            let svc = svc_with(&format!(
                "{{clusterIP: 10.96.0.1, externalIPs: [\"{ip}\", 192.0.2.1], ports: [{{port: 80}}]}}"
            ));
            let ServiceOutcome::Proxied(i) = service(&svc, &Ownership::default()).unwrap() else {
                panic!()
            };
            assert_eq!(
                i.value.external_ips,
                ["192.0.2.1".parse::<IpAddr>().unwrap()],
                "{ip}"
            );
            assert_eq!(i.warnings[0].field, ".spec.externalIPs[0]");
        }
        let mut svc = svc_with("{clusterIP: 10.96.0.1, ports: [{port: 80}]}");
        svc.status = Some(
            serde_json::from_str(
                r#"{"loadBalancer":{"ingress":[{"ip":"127.0.0.2"},{"ip":"203.0.113.9"}]}}"#,
            )
            .unwrap(),
        );
        let ServiceOutcome::Proxied(i) = service(&svc, &Ownership::default()).unwrap() else {
            panic!()
        };
        assert_eq!(i.value.load_balancer_ips.len(), 1);
        assert_eq!(i.warnings[0].field, ".status.loadBalancer.ingress[0].ip");
    }

    #[test]
    fn node_ports_outside_the_range_and_a_health_port_equal_to_a_node_port_are_dropped() {
        let svc = svc_with(
            "{type: LoadBalancer, clusterIP: 10.96.0.1, externalTrafficPolicy: Local, healthCheckNodePort: 30001, ports: [{name: a, port: 80, nodePort: 22}, {name: b, port: 81, nodePort: 30001}]}",
        );
        let ServiceOutcome::Proxied(mut i) = service(&svc, &Ownership::default()).unwrap() else {
            panic!()
        };
        let w = restrict_node_ports(&mut i.value, &(30000..=32767));
        assert_eq!(i.value.ports[0].node_port, None);
        assert_eq!(i.value.ports[1].node_port, Some(30001));
        assert_eq!(i.value.health_check_node_port, None);
        let fields: Vec<&str> = w.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(
            fields,
            [".spec.ports[0].nodePort", ".spec.healthCheckNodePort"]
        );
        assert!(
            w[0].to_string()
                .starts_with("Service shop/web: .spec.ports[0].nodePort: 22 is outside"),
            "{}",
            w[0]
        );
    }
}
