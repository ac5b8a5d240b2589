//! The validated cluster model: what kproxy keeps of Services, EndpointSlices and its
//! Node after ingestion (`crate::ingest`). Every value here has passed validation, so
//! names are legal Kubernetes names and addresses are parsed; nothing downstream
//! (nftables scripts, logs) re-validates them.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// An IP family. kproxy plans each family independently, as upstream runs one proxier
/// per family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum IpFamily {
    IPv4,
    IPv6,
}

impl IpFamily {
    pub const ALL: [IpFamily; 2] = [IpFamily::IPv4, IpFamily::IPv6];

    pub fn of(ip: &IpAddr) -> IpFamily {
        match ip {
            IpAddr::V4(_) => IpFamily::IPv4,
            IpAddr::V6(_) => IpFamily::IPv6,
        }
    }

    pub fn contains(self, ip: &IpAddr) -> bool {
        IpFamily::of(ip) == self
    }

    /// The family's place in per-family arrays (`[T; 2]`, IPv4 first, as [`Self::ALL`]):
    /// the one mapping from family to slot.
    pub const fn index(self) -> usize {
        match self {
            IpFamily::IPv4 => 0,
            IpFamily::IPv6 => 1,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::IPv4 => "IPv4",
            IpFamily::IPv6 => "IPv6",
        }
    }

    /// The nftables table family of this IP family, as nft writes it: `ip` / `ip6`.
    pub fn nft_family(self) -> &'static str {
        match self {
            IpFamily::IPv4 => "ip",
            IpFamily::IPv6 => "ip6",
        }
    }

    /// The IP family of an nftables table family word; `None` for the families that
    /// are not one IP family (`inet`, `arp`, `bridge`, `netdev`).
    pub fn of_nft_family(word: &str) -> Option<IpFamily> {
        IpFamily::ALL.into_iter().find(|f| f.nft_family() == word)
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// L4 protocol of a ServicePort. The API defaults a missing protocol to TCP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Protocol {
    TCP,
    UDP,
    SCTP,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::TCP => "TCP",
            Protocol::UDP => "UDP",
            Protocol::SCTP => "SCTP",
        }
    }

    /// The lower-case name nftables uses (`meta l4proto tcp`).
    pub fn nft_name(self) -> &'static str {
        match self {
            Protocol::TCP => "tcp",
            Protocol::UDP => "udp",
            Protocol::SCTP => "sctp",
        }
    }

    pub fn parse(s: &str) -> Option<Protocol> {
        match s {
            "TCP" => Some(Protocol::TCP),
            "UDP" => Some(Protocol::UDP),
            "SCTP" => Some(Protocol::SCTP),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `namespace/name` of a Service. Both parts are validated DNS labels. Shared strings,
/// because every port, plan and map key of a Service repeats its name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName {
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl ServiceName {
    pub fn new(namespace: impl Into<Arc<str>>, name: impl Into<Arc<str>>) -> Self {
        ServiceName {
            namespace: namespace.into(),
            name: name.into(),
        }
    }

    /// Parses `ns/name`.
    pub fn parse(s: &str) -> Option<ServiceName> {
        let (ns, name) = s.split_once('/')?;
        if ns.is_empty() || name.is_empty() || name.contains('/') {
            return None;
        }
        Some(ServiceName::new(ns, name))
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

impl Serialize for ServiceName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ServiceName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ServiceName::parse(&s)
            .ok_or_else(|| serde::de::Error::custom(format!("not ns/name: {s:?}")))
    }
}

/// The key that joins a Service port to EndpointSlice ports: (namespace, service name,
/// port *name*, protocol). Written `ns/name:portName/PROTOCOL`; an unnamed port is
/// `ns/name:/TCP`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName {
    pub service: ServiceName,
    pub port_name: String,
    pub protocol: Protocol,
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.service, self.port_name, self.protocol)
    }
}

impl Serialize for ServicePortName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ServicePortName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let bad = || serde::de::Error::custom(format!("not ns/name:port/PROTO: {s:?}"));
        let (svc, rest) = s.split_once(':').ok_or_else(bad)?;
        let (port_name, proto) = rest.rsplit_once('/').ok_or_else(bad)?;
        Ok(ServicePortName {
            service: ServiceName::parse(svc).ok_or_else(bad)?,
            port_name: port_name.to_string(),
            protocol: Protocol::parse(proto).ok_or_else(bad)?,
        })
    }
}

/// An endpoint address as kube-proxy identifies it: `ip:port`, IPv6 as `[ip]:port`.
/// Ordered numerically (IPv4 before IPv6, then address, then port). Upstream sorts by
/// the string form; the order only fixes which `numgen` index names which endpoint,
/// and numeric order is both cheaper (sorting is hot) and what people expect to read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointAddr {
    pub ip: IpAddr,
    pub port: u16,
}

impl EndpointAddr {
    pub fn new(ip: IpAddr, port: u16) -> Self {
        EndpointAddr { ip, port }
    }
}

impl fmt::Display for EndpointAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.ip {
            IpAddr::V4(ip) => write!(f, "{ip}:{}", self.port),
            IpAddr::V6(ip) => write!(f, "[{ip}]:{}", self.port),
        }
    }
}

impl Serialize for EndpointAddr {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for EndpointAddr {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let sa: std::net::SocketAddr = s
            .parse()
            .map_err(|_| serde::de::Error::custom(format!("not ip:port: {s:?}")))?;
        Ok(EndpointAddr::new(sa.ip(), sa.port()))
    }
}

/// externalTrafficPolicy / internalTrafficPolicy.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum TrafficPolicy {
    #[default]
    Cluster,
    Local,
}

impl TrafficPolicy {
    /// The field as Kubernetes writes it (absent or empty is Cluster); `None` for a value
    /// Kubernetes does not have.
    pub fn parse(v: Option<&str>) -> Option<TrafficPolicy> {
        match v {
            None | Some("") | Some("Cluster") => Some(TrafficPolicy::Cluster),
            Some("Local") => Some(TrafficPolicy::Local),
            Some(_) => None,
        }
    }

    /// Kubernetes' word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            TrafficPolicy::Cluster => "Cluster",
            TrafficPolicy::Local => "Local",
        }
    }
}

/// A Service's cluster IPs, at most one per family, iterated IPv4 first. Two slots
/// rather than a map: a `BTreeMap` node is about 200 bytes, 2 MiB at 10k Services.
/// Each remembers its place in `.spec.clusterIPs`, so a report names the field the
/// operator wrote. Serialized as the map it stands for (`{"IPv4": "10.96.0.1"}`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClusterIps {
    ips: [Option<IpAddr>; 2],
    /// The index in `.spec.clusterIPs` of each family's address.
    index: [u8; 2],
}

impl ClusterIps {
    /// Sets the family's cluster IP (replacing an earlier one of that family), as the
    /// next entry of `.spec.clusterIPs`.
    pub fn insert(&mut self, family: IpFamily, ip: IpAddr) {
        let index = match self.get(family) {
            Some(_) => usize::from(self.index[family.index()]),
            None => self.len(),
        };
        self.insert_at(family, ip, index);
    }

    /// Sets the family's cluster IP, read from `.spec.clusterIPs[index]`.
    pub fn insert_at(&mut self, family: IpFamily, ip: IpAddr, index: usize) {
        self.ips[family.index()] = Some(ip);
        self.index[family.index()] = u8::try_from(index).unwrap_or(u8::MAX);
    }

    pub fn get(&self, family: IpFamily) -> Option<IpAddr> {
        self.ips[family.index()]
    }

    /// The field the family's cluster IP was read from: `.spec.clusterIP` for the first
    /// (`.spec.clusterIPs[0]` is the same address by the API's contract), else
    /// `.spec.clusterIPs[i]`.
    pub fn field(&self, family: IpFamily) -> String {
        match self.index[family.index()] {
            0 => ".spec.clusterIP".to_string(),
            i => format!(".spec.clusterIPs[{i}]"),
        }
    }

    /// `(family, cluster IP)` pairs, IPv4 first.
    pub fn iter(&self) -> impl Iterator<Item = (IpFamily, IpAddr)> + '_ {
        IpFamily::ALL
            .into_iter()
            .filter_map(|f| self.get(f).map(|ip| (f, ip)))
    }

    pub fn len(&self) -> usize {
        self.ips.iter().flatten().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl FromIterator<(IpFamily, IpAddr)> for ClusterIps {
    fn from_iter<I: IntoIterator<Item = (IpFamily, IpAddr)>>(iter: I) -> Self {
        let mut ips = ClusterIps::default();
        for (family, ip) in iter {
            ips.insert(family, ip);
        }
        ips
    }
}

impl Serialize for ClusterIps {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

/// `spec.type` of a Service that kproxy proxies (ExternalName is never ingested).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub enum ServiceType {
    #[default]
    ClusterIP,
    NodePort,
    LoadBalancer,
}

/// A `spec.type` that names no proxied type: what [`ServiceType::parse`] found instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotAServiceType<'a> {
    /// `ExternalName`: a DNS alias, nothing to proxy.
    ExternalName,
    /// A type Kubernetes does not have.
    Unknown(&'a str),
}

impl ServiceType {
    /// `spec.type` as Kubernetes writes it (absent is ClusterIP).
    pub fn parse(v: Option<&str>) -> Result<ServiceType, NotAServiceType<'_>> {
        match v {
            None | Some("ClusterIP") => Ok(ServiceType::ClusterIP),
            Some("NodePort") => Ok(ServiceType::NodePort),
            Some("LoadBalancer") => Ok(ServiceType::LoadBalancer),
            Some("ExternalName") => Err(NotAServiceType::ExternalName),
            Some(other) => Err(NotAServiceType::Unknown(other)),
        }
    }
}

/// One entry of `spec.ports`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
    /// `None` when `nodePort` is absent or 0.
    pub node_port: Option<u16>,
}

/// A Service as kproxy needs it, validated. Family-specific lists hold both families;
/// the planner filters per family.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Service {
    pub name: ServiceName,
    pub service_type: ServiceType,
    /// Cluster IP per family, from `ipFamilies`/`clusterIPs` (or `clusterIP` on old objects).
    pub cluster_ips: ClusterIps,
    pub ports: Vec<ServicePort>,
    pub external_ips: Vec<IpAddr>,
    /// `status.loadBalancer.ingress[].ip`, without `ipMode: Proxy` entries.
    pub load_balancer_ips: Vec<IpAddr>,
    /// Trimmed and parsed; entries that do not parse are dropped with a warning.
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// As written in the spec (Cluster when unset); the planner decides where it applies.
    pub external_traffic_policy: TrafficPolicy,
    pub internal_traffic_policy: TrafficPolicy,
    /// `spec.healthCheckNodePort`, `None` when absent or 0.
    pub health_check_node_port: Option<u16>,
    /// `Some(timeoutSeconds)` for `sessionAffinity: ClientIP`.
    pub session_affinity_timeout: Option<u32>,
    /// `spec.trafficDistribution`, for display only: kube-proxy consumes hints, not this.
    pub traffic_distribution: Option<String>,
    /// `metadata.creationTimestamp` in Unix seconds: who wins a frontend conflict
    /// (`crate::conflicts`).
    pub created: Option<i64>,
}

/// Conditions of one endpoint after upstream's nil rules (ready/serving nil ⇒ true,
/// terminating nil ⇒ false).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

/// One endpoint of an EndpointSlice (only `addresses[0]` counts).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SliceEndpoint {
    pub ip: IpAddr,
    pub conditions: Conditions,
    #[serde(flatten)]
    pub placement: Arc<Placement>,
}

/// Where an endpoint runs and the topology hints it carries. A cluster has few distinct
/// placements (about one per node and hint pattern) but many endpoints, and every plan
/// of every port copies an endpoint's placement, so each distinct value is stored once
/// and shared: [`Placement::shared`]. At 100k endpoints this saves about 10 MiB of
/// state and 5 MiB of plan against per-endpoint fields.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Placement {
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    /// `hints.forZones[].name`; `None` when the endpoint has no zone hints.
    pub zone_hints: Option<Arc<[String]>>,
    /// `hints.forNodes[].name`; `None` when the endpoint has no node hints.
    pub node_hints: Option<Arc<[String]>>,
}

impl Placement {
    /// The shared copy of this value: the same `Arc` for equal placements while any is
    /// alive. Values compare by content, so sharing never changes a result.
    pub fn shared(self) -> Arc<Placement> {
        // A poisoned lock only means another thread panicked mid-insert; the map itself
        // is still a valid cache.
        let mut t = placements().lock().unwrap_or_else(|e| e.into_inner());
        if let Some(arc) = t.map.get(&self).and_then(Weak::upgrade) {
            return arc;
        }
        if t.map.len() >= t.sweep_at {
            t.map.retain(|_, w| w.strong_count() > 0);
            t.sweep_at = (t.map.len() * 2).max(PLACEMENTS_SWEEP_MIN);
        }
        let arc = Arc::new(self.clone());
        t.map.insert(self, Arc::downgrade(&arc));
        arc
    }
}

/// The table behind [`Placement::shared`]. Entries whose placement is gone are swept
/// when the table has doubled since the last sweep, so it stays proportional to the
/// live placements.
struct Placements {
    map: HashMap<Placement, Weak<Placement>>,
    sweep_at: usize,
}

const PLACEMENTS_SWEEP_MIN: usize = 1024;

fn placements() -> &'static Mutex<Placements> {
    static TABLE: OnceLock<Mutex<Placements>> = OnceLock::new();
    TABLE.get_or_init(|| {
        Mutex::new(Placements {
            map: HashMap::new(),
            sweep_at: PLACEMENTS_SWEEP_MIN,
        })
    })
}

/// One port of an EndpointSlice (ports without a name or number are dropped at ingestion).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct SlicePort {
    pub name: String,
    pub protocol: Protocol,
    pub port: u16,
}

/// An EndpointSlice of one Service and one address family.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSlice {
    /// The slice's own name (unique within the namespace).
    pub name: String,
    /// The Service it belongs to (label `kubernetes.io/service-name`).
    pub service: ServiceName,
    pub family: IpFamily,
    pub ports: Vec<SlicePort>,
    pub endpoints: Vec<SliceEndpoint>,
    /// `endpoints.kubernetes.io/last-change-trigger-time`, RFC 3339, unparsed (metrics only).
    pub last_change_trigger_time: Option<String>,
}

/// A `networking.k8s.io/v1` ServiceCIDR (cluster-scoped): ranges the API server
/// allocates cluster IPs from. The planner drops new connections to an address inside
/// the union of every ServiceCIDR's `spec.cidrs` (and `PlanConfig::service_cidrs`) that
/// no Service owns, as upstream kube-proxy does from v1.33 on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceCidr {
    pub name: String,
    pub cidrs: Vec<IpNet>,
}

/// What kproxy reads of its own Node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Node {
    pub name: String,
    /// `topology.kubernetes.io/zone`, `None` when absent or empty.
    pub zone: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// `status.addresses` of type InternalIP (then ExternalIP), in order: the first of
    /// each family is the node's primary IP for that family.
    pub addresses: Vec<IpAddr>,
    /// `spec.podCIDRs` (or `spec.podCIDR`), for the NodeCIDR local-traffic detector.
    pub pod_cidrs: Vec<IpNet>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// A taint with key `ToBeDeletedByClusterAutoscaler` is present.
    pub to_be_deleted_by_autoscaler: bool,
    /// The Node object is gone from the API or the manifests (this is the last version
    /// known before; see `ClusterState::node_gone`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub deleted: bool,
    /// The condition `DrainInProgress` has status `True` (KEP-5683).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub drain_in_progress: bool,
    /// The condition `GracefulNodeShutdownInProgress` has status `True` (KEP-5683).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub graceful_node_shutdown_in_progress: bool,
}

/// A sign that this node is about to leave the cluster, on which `/healthz` answers 503
/// so that load balancers of eTP-Cluster Services stop sending it new connections
/// before it goes (docs/health.md, "Drain signals"). Named as the JSON and the
/// `--ignore-drain-signal` flag name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DrainSignal {
    /// The taint `ToBeDeletedByClusterAutoscaler` (KEP-3836).
    AutoscalerTaint,
    /// `metadata.deletionTimestamp` set (KEP-3836).
    DeletionTimestamp,
    /// The Node object deleted.
    NodeDeleted,
    /// The condition `DrainInProgress` (KEP-5683).
    DrainInProgress,
    /// The condition `GracefulNodeShutdownInProgress` (KEP-5683).
    GracefulNodeShutdownInProgress,
    /// kproxy got SIGTERM and drains before it exits (`--shutdown-drain`).
    Shutdown,
}

impl DrainSignal {
    /// The signals a Node object shows (every one but [`DrainSignal::Shutdown`]).
    pub const OF_NODE: [DrainSignal; 5] = [
        DrainSignal::AutoscalerTaint,
        DrainSignal::DeletionTimestamp,
        DrainSignal::NodeDeleted,
        DrainSignal::DrainInProgress,
        DrainSignal::GracefulNodeShutdownInProgress,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DrainSignal::AutoscalerTaint => "autoscalerTaint",
            DrainSignal::DeletionTimestamp => "deletionTimestamp",
            DrainSignal::NodeDeleted => "nodeDeleted",
            DrainSignal::DrainInProgress => "drainInProgress",
            DrainSignal::GracefulNodeShutdownInProgress => "gracefulNodeShutdownInProgress",
            DrainSignal::Shutdown => "shutdown",
        }
    }

    pub fn parse(s: &str) -> Option<DrainSignal> {
        DrainSignal::OF_NODE
            .into_iter()
            .chain([DrainSignal::Shutdown])
            .find(|d| d.as_str() == s)
    }

    /// One of KEP-3836's signals, which kube-proxy also reads (the
    /// `KubeProxyDrainingTerminatingNodes` gate turns them off together).
    pub fn kep_3836(self) -> bool {
        matches!(
            self,
            DrainSignal::AutoscalerTaint
                | DrainSignal::DeletionTimestamp
                | DrainSignal::NodeDeleted
        )
    }
}

impl fmt::Display for DrainSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Node {
    /// The node's primary IP of a family: the first address of that family.
    pub fn primary_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.addresses
            .iter()
            .copied()
            .find(|ip| family.contains(ip))
    }

    /// The drain signals this Node shows, in [`DrainSignal::OF_NODE`] order (whether
    /// each counts is the planner's configuration: `PlanConfig::counts`).
    pub fn drain_signals(&self) -> impl Iterator<Item = DrainSignal> + '_ {
        DrainSignal::OF_NODE.into_iter().filter(|s| match s {
            DrainSignal::AutoscalerTaint => self.to_be_deleted_by_autoscaler,
            DrainSignal::DeletionTimestamp => self.deleting,
            DrainSignal::NodeDeleted => self.deleted,
            DrainSignal::DrainInProgress => self.drain_in_progress,
            DrainSignal::GracefulNodeShutdownInProgress => self.graceful_node_shutdown_in_progress,
            DrainSignal::Shutdown => false,
        })
    }

    /// A node that shows no drain signal (upstream "nodeEligible" with every signal
    /// counted).
    pub fn eligible(&self) -> bool {
        self.drain_signals().next().is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(node: &str) -> Placement {
        Placement {
            node_name: Some(node.into()),
            ..Placement::default()
        }
    }

    #[test]
    fn equal_placements_share_one_value_while_alive() {
        let a = on("shared-node-a").shared();
        let b = on("shared-node-a").shared();
        assert!(Arc::ptr_eq(&a, &b));
        assert!(!Arc::ptr_eq(&a, &on("shared-node-b").shared()));
        let hinted = Placement {
            zone_hints: Some(vec!["z".to_string()].into()),
            ..on("shared-node-a")
        };
        assert!(!Arc::ptr_eq(&a, &hinted.shared()));
        assert_eq!(*a, on("shared-node-a"));
    }

    #[test]
    fn dropped_placements_are_swept_and_rebuilt_equal() {
        // More distinct placements than a sweep threshold, all dropped: the table must
        // not keep serving dead entries, and a later call still yields an equal value.
        for i in 0..5000 {
            drop(on(&format!("swept-node-{i}")).shared());
        }
        let again = on("swept-node-7").shared();
        assert_eq!(again.node_name.as_deref(), Some("swept-node-7"));
        assert_eq!(Arc::strong_count(&again), 1);
        // Other tests may hold a few placements; dead ones must not all remain.
        let len = placements().lock().unwrap().map.len();
        assert!(len < 5000, "{len} entries kept for 5000 dropped placements");
    }
}
