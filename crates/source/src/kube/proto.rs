//! Kubernetes' protobuf encoding of the two big kinds, Services and EndpointSlices, in
//! lists and watches. Owns: splitting a protobuf list response into its items as the
//! bytes arrive ([`ListSplitter`], the twin of [`super::split`]), splitting a protobuf
//! watch stream into its events ([`WatchFramer`], [`watch_event`]), and decoding one
//! object into the k8s-openapi object ingest takes, keeping only what ingest reads
//! ([`decode`], the twin of [`super::slim::decode`]; the same for a list item and a
//! watch event's object), plus the `Status` of a refused request or an `ERROR` event.
//!
//! Why: the API server encodes protobuf several times faster than JSON and the body is
//! far smaller. Measured on the k8s-lab (kube-apiserver 1.36.2, 5k Services × 50
//! endpoints, `curl` with `limit=5000`): the EndpointSlice list is 67 MB and 1.4–2.2 s as
//! JSON, 10 MB and 0.13 s as protobuf. Watches too: every endpoint change is sent to
//! every node, so its bytes are multiplied by the fleet (docs/scale.md). Upstream
//! kube-proxy asks for protobuf for both.
//!
//! Wire format (apimachinery's `runtime/serializer/protobuf`): a list body is the 4
//! bytes `k8s\0`, then a `runtime.Unknown` message whose field 2 (`raw`) is the list
//! message: field 1 its `ListMeta`, field 2 each item. A watch body is a sequence of
//! frames, each a 4-byte big-endian length and a raw `meta.v1.WatchEvent` (field 1 the
//! type, field 2 a `RawExtension` whose bytes are the object as a list body holds one:
//! `k8s\0` + `runtime.Unknown`). Field numbers are those of upstream's
//! `generated.proto`; the tests decode bodies captured from a real kube-apiserver in
//! both encodings and require the same updates from each.
//!
//! The messages below are hand-written prost types holding only the fields kept; prost
//! skips every other field (`managedFields`, owner references, …) unread. A field
//! ingest reads that they do not hold is lost on a real cluster only: `proto/fields.rs`
//! fails when that happens (every field of a Service and an EndpointSlice, changed one
//! at a time, must ingest the same through this decoder, the JSON one and the whole
//! object). A field ingest starts reading goes here (its tag from upstream's
//! `generated.proto`), in [`super::slim`], and in that test's encoder.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kproxy_core::ingest::{ANNOTATION_LAST_CHANGE_TRIGGER_TIME, Kind};
use kproxy_core::manifest::Object;
use prost::Message;

use super::slim::{Coordinates, DecodeError};
use super::split::{MAX_VALUE_BYTES, SplitError};

/// The media type asked for.
pub const MEDIA_TYPE: &str = "application/vnd.kubernetes.protobuf";

/// What every protobuf body starts with.
const MAGIC: &[u8; 4] = b"k8s\0";

/// The kinds listed and watched in protobuf: the two whose lists are large and whose
/// changes are many. Nodes (one, by field selector) and ServiceCIDRs (a handful, rarely
/// changed) stay JSON.
pub fn lists_in_protobuf(kind: Kind) -> bool {
    matches!(kind, Kind::Service | Kind::EndpointSlice)
}

/// Where the splitter is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// Before the 4-byte magic.
    Magic,
    /// Among the `runtime.Unknown` envelope's fields.
    Envelope,
    /// Inside the envelope's `raw` field (the list message), with this many bytes of it
    /// still to come.
    List { remaining: u64 },
}

/// Splits a protobuf list body into its items: feed it the chunks in order, then call
/// [`ListSplitter::finish`]. Holds at most one field's bytes (an item) at a time.
pub struct ListSplitter {
    at: At,
    /// Bytes received and not yet consumed (a field cut by a chunk boundary).
    pending: Vec<u8>,
    /// The list's `ListMeta` message, once seen.
    metadata: Option<Vec<u8>>,
    saw_list: bool,
}

impl Default for ListSplitter {
    fn default() -> Self {
        ListSplitter {
            at: At::Magic,
            pending: Vec::new(),
            metadata: None,
            saw_list: false,
        }
    }
}

/// A field's key and where its value lies in the bytes parsed.
struct Field {
    number: u64,
    /// Bytes of the key (and of the length, for a length-delimited value).
    header: usize,
    /// Bytes of the value.
    len: u64,
    delimited: bool,
}

/// A varint at the start of `b`: its value and length; `None` if `b` ends inside it.
fn varint(b: &[u8]) -> Result<Option<(u64, usize)>, SplitError> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok(Some((v, i + 1)));
        }
    }
    if b.len() >= 10 {
        return Err(SplitError("a protobuf varint longer than 10 bytes".into()));
    }
    Ok(None)
}

/// The field whose key starts `b`; `None` if `b` ends before its value's extent is known.
fn field(b: &[u8]) -> Result<Option<Field>, SplitError> {
    let Some((key, n)) = varint(b)? else {
        return Ok(None);
    };
    let (number, wire) = (key >> 3, key & 7);
    let (header, len, delimited) = match wire {
        0 => match varint(&b[n..])? {
            Some((_, m)) => (n, m as u64, false),
            None => return Ok(None),
        },
        1 => (n, 8, false),
        5 => (n, 4, false),
        2 => match varint(&b[n..])? {
            Some((len, m)) => (n + m, len, true),
            None => return Ok(None),
        },
        other => {
            return Err(SplitError(format!(
                "protobuf wire type {other} (field {number}) is not used by Kubernetes"
            )));
        }
    };
    Ok(Some(Field {
        number,
        header,
        len,
        delimited,
    }))
}

impl ListSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes `chunk`, calling `item` with each complete item's bytes.
    pub fn feed(&mut self, chunk: &[u8], mut item: impl FnMut(&[u8])) -> Result<(), SplitError> {
        self.pending.extend_from_slice(chunk);
        let mut at = 0;
        let result = self.consume(&mut at, &mut item);
        self.pending.drain(..at);
        result
    }

    fn consume(&mut self, at: &mut usize, item: &mut impl FnMut(&[u8])) -> Result<(), SplitError> {
        loop {
            let rest = &self.pending[*at..];
            match self.at {
                At::Magic => {
                    if rest.len() < MAGIC.len() {
                        return Ok(());
                    }
                    if &rest[..MAGIC.len()] != MAGIC {
                        return Err(SplitError(
                            "not a Kubernetes protobuf body (no k8s\\0 prefix)".into(),
                        ));
                    }
                    *at += MAGIC.len();
                    self.at = At::Envelope;
                }
                At::Envelope => {
                    let Some(f) = field(rest)? else {
                        return Ok(());
                    };
                    if f.number == 2 && f.delimited {
                        // The list itself: its fields are read as they arrive.
                        *at += f.header;
                        self.saw_list = true;
                        self.at = At::List { remaining: f.len };
                        continue;
                    }
                    // typeMeta, contentEncoding, contentType: small, not read.
                    let Some(end) = whole(&f, rest.len())? else {
                        return Ok(());
                    };
                    *at += end;
                }
                At::List { remaining: 0 } => self.at = At::Envelope,
                At::List { remaining } => {
                    let Some(f) = field(rest)? else {
                        return Ok(());
                    };
                    let Some(end) = whole(&f, rest.len())? else {
                        return Ok(());
                    };
                    if end as u64 > remaining {
                        return Err(SplitError(
                            "a list field runs past the end of the list".into(),
                        ));
                    }
                    let value = &rest[f.header..end];
                    match (f.number, f.delimited) {
                        (2, true) => item(value),
                        (1, true) => self.metadata = Some(value.to_vec()),
                        _ => {}
                    }
                    *at += end;
                    self.at = At::List {
                        remaining: remaining - end as u64,
                    };
                }
            }
        }
    }

    /// The list's metadata, once the body has ended; an error if it ended early or
    /// held no list.
    pub fn finish(self) -> Result<ListMeta, SplitError> {
        if !self.pending.is_empty() || matches!(self.at, At::List { .. }) || !self.saw_list {
            return Err(SplitError(
                "the protobuf list body ended before the list did".into(),
            ));
        }
        match self.metadata {
            Some(m) => ListMeta::decode(m.as_slice())
                .map_err(|e| SplitError(format!("undecodable list metadata: {e}"))),
            None => Ok(ListMeta::default()),
        }
    }
}

/// The end of field `f` in bytes of which `available` have arrived: `None` until all
/// have. A value over [`MAX_VALUE_BYTES`] is an error, never an allocation.
fn whole(f: &Field, available: usize) -> Result<Option<usize>, SplitError> {
    if f.len > MAX_VALUE_BYTES as u64 {
        return Err(SplitError(format!(
            "a protobuf field of {} bytes (over {MAX_VALUE_BYTES}); not read",
            f.len
        )));
    }
    let end = f.header + f.len as usize;
    Ok((end <= available).then_some(end))
}

/// `meta.v1.ListMeta`: where to continue, and the version to watch from.
#[derive(Clone, PartialEq, Message)]
pub struct ListMeta {
    #[prost(string, optional, tag = "2")]
    pub resource_version: Option<String>,
    #[prost(string, optional, tag = "3")]
    pub continue_token: Option<String>,
}

/// `meta.v1.Status` of a refused request (the body of a 4xx/5xx answered in protobuf).
#[derive(Clone, PartialEq, Message)]
pub struct Status {
    #[prost(string, optional, tag = "3")]
    pub message: Option<String>,
    #[prost(string, optional, tag = "4")]
    pub reason: Option<String>,
    #[prost(int32, optional, tag = "6")]
    pub code: Option<i32>,
}

/// The `Status` in an error body, if it is one in protobuf.
pub fn status(body: &[u8]) -> Option<Status> {
    let envelope = Unknown::decode(body.strip_prefix(MAGIC)?).ok()?;
    Status::decode(envelope.raw?.as_slice()).ok()
}

#[derive(Clone, PartialEq, Message)]
struct Meta {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, optional, tag = "3")]
    namespace: Option<String>,
    /// Ingest reads it: the older of two Services claiming one frontend keeps it.
    #[prost(message, optional, tag = "8")]
    creation_timestamp: Option<Timestamp>,
    #[prost(message, optional, tag = "9")]
    deletion_timestamp: Option<Timestamp>,
    #[prost(btree_map = "string, string", tag = "11")]
    labels: BTreeMap<String, String>,
    #[prost(btree_map = "string, string", tag = "12")]
    annotations: BTreeMap<String, String>,
}

#[derive(Clone, PartialEq, Message)]
struct Timestamp {
    #[prost(int64, optional, tag = "1")]
    seconds: Option<i64>,
    #[prost(int32, optional, tag = "2")]
    nanos: Option<i32>,
}

impl Timestamp {
    fn into_time(self, field: &str) -> Result<Time, DecodeError> {
        k8s_openapi::jiff::Timestamp::new(self.seconds.unwrap_or(0), self.nanos.unwrap_or(0))
            .map(Time)
            .map_err(|e| DecodeError {
                field: field.into(),
                reason: e.to_string(),
            })
    }
}

impl Meta {
    fn into_object_meta(self) -> Result<ObjectMeta, DecodeError> {
        let deletion_timestamp = self
            .deletion_timestamp
            .map(|t| t.into_time(".metadata.deletionTimestamp"))
            .transpose()?;
        let creation_timestamp = self
            .creation_timestamp
            .map(|t| t.into_time(".metadata.creationTimestamp"))
            .transpose()?;
        let mut annotations = self.annotations;
        // Only the one annotation ingest reads is kept, as the JSON path keeps it.
        annotations.retain(|k, _| k == ANNOTATION_LAST_CHANGE_TRIGGER_TIME);
        Ok(ObjectMeta {
            name: self.name,
            namespace: self.namespace,
            labels: Some(self.labels).filter(|l| !l.is_empty()),
            annotations: Some(annotations).filter(|a| !a.is_empty()),
            creation_timestamp,
            deletion_timestamp,
            ..ObjectMeta::default()
        })
    }
}

#[derive(Clone, PartialEq, Message)]
struct Service {
    #[prost(message, optional, tag = "1")]
    metadata: Option<Meta>,
    #[prost(message, optional, tag = "2")]
    spec: Option<ServiceSpec>,
    #[prost(message, optional, tag = "3")]
    status: Option<ServiceStatus>,
}

#[derive(Clone, PartialEq, Message)]
struct ServiceSpec {
    #[prost(message, repeated, tag = "1")]
    ports: Vec<ServicePort>,
    #[prost(btree_map = "string, string", tag = "2")]
    selector: BTreeMap<String, String>,
    #[prost(string, optional, tag = "3")]
    cluster_ip: Option<String>,
    #[prost(string, optional, tag = "4")]
    type_: Option<String>,
    #[prost(string, repeated, tag = "5")]
    external_ips: Vec<String>,
    #[prost(string, optional, tag = "7")]
    session_affinity: Option<String>,
    #[prost(string, optional, tag = "8")]
    load_balancer_ip: Option<String>,
    #[prost(string, repeated, tag = "9")]
    load_balancer_source_ranges: Vec<String>,
    #[prost(string, optional, tag = "10")]
    external_name: Option<String>,
    #[prost(string, optional, tag = "11")]
    external_traffic_policy: Option<String>,
    #[prost(int32, optional, tag = "12")]
    health_check_node_port: Option<i32>,
    #[prost(bool, optional, tag = "13")]
    publish_not_ready_addresses: Option<bool>,
    #[prost(message, optional, tag = "14")]
    session_affinity_config: Option<SessionAffinityConfig>,
    #[prost(string, optional, tag = "17")]
    ip_family_policy: Option<String>,
    #[prost(string, repeated, tag = "18")]
    cluster_ips: Vec<String>,
    #[prost(string, repeated, tag = "19")]
    ip_families: Vec<String>,
    #[prost(bool, optional, tag = "20")]
    allocate_load_balancer_node_ports: Option<bool>,
    #[prost(string, optional, tag = "21")]
    load_balancer_class: Option<String>,
    #[prost(string, optional, tag = "22")]
    internal_traffic_policy: Option<String>,
    #[prost(string, optional, tag = "23")]
    traffic_distribution: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct ServicePort {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, optional, tag = "2")]
    protocol: Option<String>,
    #[prost(int32, optional, tag = "3")]
    port: Option<i32>,
    #[prost(message, optional, tag = "4")]
    target_port: Option<IntOrStr>,
    #[prost(int32, optional, tag = "5")]
    node_port: Option<i32>,
    #[prost(string, optional, tag = "6")]
    app_protocol: Option<String>,
}

/// `util.intstr.IntOrString`: `type` 0 is the integer, 1 the string.
#[derive(Clone, PartialEq, Message)]
struct IntOrStr {
    #[prost(int64, optional, tag = "1")]
    type_: Option<i64>,
    #[prost(int32, optional, tag = "2")]
    int_val: Option<i32>,
    #[prost(string, optional, tag = "3")]
    str_val: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct SessionAffinityConfig {
    #[prost(message, optional, tag = "1")]
    client_ip: Option<ClientIpConfig>,
}

#[derive(Clone, PartialEq, Message)]
struct ClientIpConfig {
    #[prost(int32, optional, tag = "1")]
    timeout_seconds: Option<i32>,
}

#[derive(Clone, PartialEq, Message)]
struct ServiceStatus {
    #[prost(message, optional, tag = "1")]
    load_balancer: Option<LoadBalancerStatus>,
}

#[derive(Clone, PartialEq, Message)]
struct LoadBalancerStatus {
    #[prost(message, repeated, tag = "1")]
    ingress: Vec<LoadBalancerIngress>,
}

#[derive(Clone, PartialEq, Message)]
struct LoadBalancerIngress {
    #[prost(string, optional, tag = "1")]
    ip: Option<String>,
    #[prost(string, optional, tag = "2")]
    hostname: Option<String>,
    #[prost(string, optional, tag = "3")]
    ip_mode: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct EndpointSlice {
    #[prost(message, optional, tag = "1")]
    metadata: Option<Meta>,
    #[prost(message, repeated, tag = "2")]
    endpoints: Vec<Endpoint>,
    #[prost(message, repeated, tag = "3")]
    ports: Vec<EndpointPort>,
    #[prost(string, optional, tag = "4")]
    address_type: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct Endpoint {
    #[prost(string, repeated, tag = "1")]
    addresses: Vec<String>,
    #[prost(message, optional, tag = "2")]
    conditions: Option<EndpointConditions>,
    #[prost(string, optional, tag = "3")]
    hostname: Option<String>,
    #[prost(string, optional, tag = "6")]
    node_name: Option<String>,
    #[prost(string, optional, tag = "7")]
    zone: Option<String>,
    #[prost(message, optional, tag = "8")]
    hints: Option<EndpointHints>,
}

#[derive(Clone, PartialEq, Message)]
struct EndpointConditions {
    #[prost(bool, optional, tag = "1")]
    ready: Option<bool>,
    #[prost(bool, optional, tag = "2")]
    serving: Option<bool>,
    #[prost(bool, optional, tag = "3")]
    terminating: Option<bool>,
}

#[derive(Clone, PartialEq, Message)]
struct EndpointHints {
    #[prost(message, repeated, tag = "1")]
    for_zones: Vec<Named>,
    #[prost(message, repeated, tag = "2")]
    for_nodes: Vec<Named>,
}

/// `ForZone` and `ForNode`: a name.
#[derive(Clone, PartialEq, Message)]
struct Named {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct EndpointPort {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, optional, tag = "2")]
    protocol: Option<String>,
    #[prost(int32, optional, tag = "3")]
    port: Option<i32>,
    #[prost(string, optional, tag = "4")]
    app_protocol: Option<String>,
}

/// A repeated field as k8s-openapi holds it: protobuf cannot tell an empty list from an
/// absent one, and ingest reads both alike.
fn list<T>(v: Vec<T>) -> Option<Vec<T>> {
    Some(v).filter(|v| !v.is_empty())
}

impl ServiceSpec {
    fn into_openapi(self) -> Result<corev1::ServiceSpec, DecodeError> {
        let ports = self
            .ports
            .into_iter()
            .enumerate()
            .map(|(i, p)| p.into_openapi(i))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(corev1::ServiceSpec {
            allocate_load_balancer_node_ports: self.allocate_load_balancer_node_ports,
            cluster_ip: self.cluster_ip,
            cluster_ips: list(self.cluster_ips),
            external_ips: list(self.external_ips),
            external_name: self.external_name,
            external_traffic_policy: self.external_traffic_policy,
            health_check_node_port: self.health_check_node_port,
            internal_traffic_policy: self.internal_traffic_policy,
            ip_families: list(self.ip_families),
            ip_family_policy: self.ip_family_policy,
            load_balancer_class: self.load_balancer_class,
            load_balancer_ip: self.load_balancer_ip,
            load_balancer_source_ranges: list(self.load_balancer_source_ranges),
            ports: list(ports),
            publish_not_ready_addresses: self.publish_not_ready_addresses,
            selector: Some(self.selector).filter(|s| !s.is_empty()),
            session_affinity: self.session_affinity,
            session_affinity_config: self.session_affinity_config.map(|c| {
                corev1::SessionAffinityConfig {
                    client_ip: c.client_ip.map(|ip| corev1::ClientIPConfig {
                        timeout_seconds: ip.timeout_seconds,
                    }),
                }
            }),
            traffic_distribution: self.traffic_distribution,
            type_: self.type_,
        })
    }
}

impl ServicePort {
    fn into_openapi(self, i: usize) -> Result<corev1::ServicePort, DecodeError> {
        let target_port = match self.target_port {
            None => None,
            Some(t) => Some(match t.type_.unwrap_or(0) {
                0 => IntOrString::Int(t.int_val.unwrap_or(0)),
                1 => IntOrString::String(t.str_val.unwrap_or_default()),
                other => {
                    return Err(DecodeError {
                        field: format!(".spec.ports[{i}].targetPort"),
                        reason: format!("IntOrString type {other} is neither 0 nor 1"),
                    });
                }
            }),
        };
        let port = self.port.ok_or_else(|| DecodeError {
            field: format!(".spec.ports[{i}].port"),
            reason: "missing".into(),
        })?;
        Ok(corev1::ServicePort {
            app_protocol: self.app_protocol,
            name: self.name,
            node_port: self.node_port,
            port,
            protocol: self.protocol,
            target_port,
        })
    }
}

impl Endpoint {
    fn into_openapi(self) -> discoveryv1::Endpoint {
        discoveryv1::Endpoint {
            addresses: self.addresses,
            conditions: self.conditions.map(|c| discoveryv1::EndpointConditions {
                ready: c.ready,
                serving: c.serving,
                terminating: c.terminating,
            }),
            hints: self.hints.map(|h| discoveryv1::EndpointHints {
                for_nodes: list(
                    h.for_nodes
                        .into_iter()
                        .map(|n| discoveryv1::ForNode {
                            name: n.name.unwrap_or_default(),
                        })
                        .collect(),
                ),
                for_zones: list(
                    h.for_zones
                        .into_iter()
                        .map(|z| discoveryv1::ForZone {
                            name: z.name.unwrap_or_default(),
                        })
                        .collect(),
                ),
            }),
            hostname: self.hostname,
            node_name: self.node_name,
            zone: self.zone,
            ..discoveryv1::Endpoint::default()
        }
    }
}

/// Splits a protobuf watch stream (`application/vnd.kubernetes.protobuf;stream=watch`)
/// into its frames as the bytes arrive: each a 4-byte big-endian length, then that many
/// bytes of one `meta.v1.WatchEvent` (apimachinery's `LengthDelimitedFramer` around the
/// raw protobuf serializer: no magic, no envelope). Holds at most one frame's bytes.
#[derive(Default)]
pub struct WatchFramer {
    pending: Vec<u8>,
}

impl WatchFramer {
    pub fn new() -> Self {
        Self::default()
    }

    /// Consumes `chunk`, calling `frame` with each complete frame's bytes; stops at the
    /// first frame for which `frame` returns false (the rest stays pending, unread).
    pub fn feed(
        &mut self,
        chunk: &[u8],
        mut frame: impl FnMut(&[u8]) -> bool,
    ) -> Result<(), SplitError> {
        self.pending.extend_from_slice(chunk);
        let mut at = 0;
        let mut result = Ok(());
        while let Some(header) = self.pending.get(at..at + 4) {
            let len = u32::from_be_bytes([header[0], header[1], header[2], header[3]]) as usize;
            if len > MAX_VALUE_BYTES {
                result = Err(SplitError(format!(
                    "a protobuf watch frame of {len} bytes (over {MAX_VALUE_BYTES}); not read"
                )));
                break;
            }
            let Some(bytes) = self.pending.get(at + 4..at + 4 + len) else {
                break;
            };
            at += 4 + len;
            if !frame(bytes) {
                break;
            }
        }
        self.pending.drain(..at);
        result
    }

    /// Whether the stream ended between frames (true) or inside one.
    pub fn at_boundary(&self) -> bool {
        self.pending.is_empty()
    }
}

/// `meta.v1.WatchEvent`: the event's type and its object, a `runtime.RawExtension`
/// holding the object in the ordinary protobuf encoding (`k8s\0` + `runtime.Unknown`).
#[derive(Clone, PartialEq, Message)]
struct WatchEventMessage {
    #[prost(string, optional, tag = "1")]
    type_: Option<String>,
    #[prost(message, optional, tag = "2")]
    object: Option<RawExtension>,
}

#[derive(Clone, PartialEq, Message)]
struct RawExtension {
    #[prost(bytes = "vec", optional, tag = "1")]
    raw: Option<Vec<u8>>,
}

/// `runtime.Unknown`: the envelope of one object (its `raw` is the object's message).
#[derive(Clone, PartialEq, Message)]
struct Unknown {
    #[prost(bytes = "vec", optional, tag = "2")]
    raw: Option<Vec<u8>>,
}

/// One watch event of a protobuf watch: its type (`ADDED`, `MODIFIED`, `DELETED`,
/// `BOOKMARK`, `ERROR`) and its object's message (an item as in a list, or a `Status`
/// for `ERROR`), decoded with [`coordinates`], [`decode`], [`status_of`].
#[derive(Debug, PartialEq)]
pub struct WatchEvent {
    pub type_: String,
    pub object: Vec<u8>,
}

/// Decodes one frame of a protobuf watch.
pub fn watch_event(frame: &[u8]) -> Result<WatchEvent, String> {
    let event = WatchEventMessage::decode(frame)
        .map_err(|e| format!("undecodable protobuf watch event: {e}"))?;
    let type_ = event.type_.unwrap_or_default();
    let raw = event.object.and_then(|o| o.raw).unwrap_or_default();
    let enveloped = raw
        .strip_prefix(MAGIC)
        .ok_or_else(|| format!("{type_} event whose object is not protobuf (no k8s\\0 prefix)"))?;
    let object = Unknown::decode(enveloped)
        .map_err(|e| format!("{type_} event with an undecodable object envelope: {e}"))?
        .raw
        .unwrap_or_default();
    Ok(WatchEvent { type_, object })
}

/// The `Status` of an `ERROR` watch event's object.
pub fn status_of(object: &[u8]) -> Option<Status> {
    Status::decode(object).ok()
}

/// The annotation of the bookmark that ends a watch's initial events (KEP-3157).
pub const INITIAL_EVENTS_END: &str = "k8s.io/initial-events-end";

/// Whether a `BOOKMARK` event's object carries [`INITIAL_EVENTS_END`] = "true".
pub fn ends_initial_events(object: &[u8]) -> bool {
    #[derive(Clone, PartialEq, Message)]
    struct Annotated {
        #[prost(message, optional, tag = "1")]
        metadata: Option<Annotations>,
    }
    #[derive(Clone, PartialEq, Message)]
    struct Annotations {
        #[prost(btree_map = "string, string", tag = "12")]
        annotations: BTreeMap<String, String>,
    }
    Annotated::decode(object)
        .ok()
        .and_then(|a| a.metadata)
        .is_some_and(|m| m.annotations.get(INITIAL_EVENTS_END).map(String::as_str) == Some("true"))
}

/// `meta` of any item, for its coordinates alone (what the watcher needs even of an
/// item that fails [`decode`]).
#[derive(Clone, PartialEq, Message)]
struct Outer {
    #[prost(message, optional, tag = "1")]
    metadata: Option<MetaCoordinates>,
}

#[derive(Clone, PartialEq, Message)]
struct MetaCoordinates {
    #[prost(string, optional, tag = "1")]
    name: Option<String>,
    #[prost(string, optional, tag = "3")]
    namespace: Option<String>,
    #[prost(string, optional, tag = "6")]
    resource_version: Option<String>,
}

/// The coordinates of one list item; `None` when its metadata is not decodable.
pub fn coordinates(item: &[u8]) -> Option<Coordinates> {
    let m = Outer::decode(item).ok()?.metadata.unwrap_or_default();
    Some(Coordinates {
        namespace: m.namespace,
        name: m.name,
        resource_version: m.resource_version,
    })
}

/// Decodes one list item of `kind` (a Service or an EndpointSlice) into the object
/// ingest takes.
pub fn decode(kind: Kind, item: &[u8]) -> Result<Object, DecodeError> {
    let undecodable = |e: prost::DecodeError| DecodeError {
        field: ".".into(),
        reason: format!("undecodable protobuf: {e}"),
    };
    match kind {
        Kind::Service => {
            let s = Service::decode(item).map_err(undecodable)?;
            Ok(Object::Service(Box::new(corev1::Service {
                metadata: s.metadata.unwrap_or_default().into_object_meta()?,
                spec: s.spec.map(ServiceSpec::into_openapi).transpose()?,
                status: s.status.map(|st| corev1::ServiceStatus {
                    load_balancer: st.load_balancer.map(|lb| corev1::LoadBalancerStatus {
                        ingress: list(
                            lb.ingress
                                .into_iter()
                                .map(|i| corev1::LoadBalancerIngress {
                                    hostname: i.hostname,
                                    ip: i.ip,
                                    ip_mode: i.ip_mode,
                                    ports: None,
                                })
                                .collect(),
                        ),
                    }),
                    conditions: None,
                }),
            })))
        }
        Kind::EndpointSlice => {
            let s = EndpointSlice::decode(item).map_err(undecodable)?;
            Ok(Object::EndpointSlice(Box::new(
                discoveryv1::EndpointSlice {
                    metadata: s.metadata.unwrap_or_default().into_object_meta()?,
                    address_type: s.address_type.ok_or_else(|| DecodeError {
                        field: ".addressType".into(),
                        reason: "missing".into(),
                    })?,
                    endpoints: s
                        .endpoints
                        .into_iter()
                        .map(Endpoint::into_openapi)
                        .collect(),
                    ports: list(
                        s.ports
                            .into_iter()
                            .map(|p| discoveryv1::EndpointPort {
                                app_protocol: p.app_protocol,
                                name: p.name,
                                port: p.port,
                                protocol: p.protocol,
                            })
                            .collect(),
                    ),
                },
            )))
        }
        Kind::Node | Kind::ServiceCidr => Err(DecodeError {
            field: ".".into(),
            reason: format!("{kind} lists are read as JSON, not protobuf"),
        }),
    }
}

#[cfg(test)]
mod fields;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kube::split::Splitter;
    use kproxy_core::ingest::Ownership;
    use kproxy_core::state::Update;

    const SERVICES_JSON: &[u8] = include_bytes!("testdata/services.json");
    const SERVICES_PB: &[u8] = include_bytes!("testdata/services.pb");
    const SLICES_JSON: &[u8] = include_bytes!("testdata/endpointslices.json");
    const SLICES_PB: &[u8] = include_bytes!("testdata/endpointslices.pb");

    fn proto_items(body: &[u8], chunks: &[usize]) -> (Vec<Vec<u8>>, Result<ListMeta, SplitError>) {
        let mut s = ListSplitter::new();
        let mut items = Vec::new();
        let mut from = 0;
        for &to in chunks.iter().chain([&body.len()]) {
            s.feed(&body[from..to], |i| items.push(i.to_vec())).unwrap();
            from = to;
        }
        (items, s.finish())
    }

    fn json_items(body: &[u8]) -> (Vec<Vec<u8>>, String) {
        let mut s = Splitter::new();
        let mut items = Vec::new();
        s.feed(body, |i| items.push(i.to_vec())).unwrap();
        let meta: serde_json::Value =
            serde_json::from_slice(&s.finish().unwrap().unwrap()).unwrap();
        (items, meta["resourceVersion"].as_str().unwrap().to_string())
    }

    fn update(o: &Object) -> Option<Update> {
        Update::of(o, &Ownership::default(), "node-a")
            .ok()
            .map(|(u, _)| u)
    }

    /// The same objects listed by a real API server as JSON and as protobuf decode to
    /// the same keys, resourceVersions and ingested updates (and, beyond what ingest
    /// reads, the same deletion timestamp).
    #[test]
    fn protobuf_and_json_lists_of_the_same_objects_give_the_same_updates() {
        for (kind, json, pb, expect) in [
            (Kind::Service, SERVICES_JSON, SERVICES_PB, 5),
            (Kind::EndpointSlice, SLICES_JSON, SLICES_PB, 5),
        ] {
            let (from_json, rv) = json_items(json);
            let (from_pb, meta) = proto_items(pb, &[]);
            let meta = meta.unwrap();
            assert_eq!(meta.resource_version.as_deref(), Some(rv.as_str()));
            assert_eq!(meta.continue_token.as_deref().unwrap_or(""), "");
            assert_eq!(from_pb.len(), expect, "{kind}");
            assert_eq!(from_json.len(), expect, "{kind}");
            let mut ingested = 0;
            for (j, p) in from_json.iter().zip(&from_pb) {
                let text = std::str::from_utf8(j).unwrap();
                let jc = Coordinates::of(text).unwrap();
                let pc = coordinates(p).unwrap();
                assert_eq!(jc.key(), pc.key());
                assert_eq!(jc.resource_version, pc.resource_version);
                let jo = crate::kube::slim::decode(kind, text).unwrap();
                let po = decode(kind, p).unwrap();
                let meta = |o: &Object| match o {
                    Object::Service(s) => s.metadata.clone(),
                    Object::EndpointSlice(s) => s.metadata.clone(),
                    _ => unreachable!("only these two kinds are listed"),
                };
                assert_eq!(meta(&jo).deletion_timestamp, meta(&po).deletion_timestamp);
                assert_eq!(update(&jo), update(&po), "{:?}", jc.key());
                ingested += usize::from(update(&po).is_some());
            }
            // The fixture's objects are ingestible (the ExternalName Service and the
            // FQDN slice too: ingest keeps them as what they are), so this compares
            // updates, not two errors.
            assert!(
                ingested >= expect - 1,
                "{kind}: {ingested} of {expect} ingested"
            );
        }
        let lb_v4 = proto_items(SLICES_PB, &[])
            .0
            .into_iter()
            .find(|i| coordinates(i).unwrap().name.as_deref() == Some("lb-v4"));
        let Ok(Object::EndpointSlice(s)) = decode(Kind::EndpointSlice, &lb_v4.unwrap()) else {
            panic!("lb-v4 decodes")
        };
        assert!(s.metadata.deletion_timestamp.is_some());
    }

    /// Chunks cut anywhere (inside the magic, a key, a length, an item) give the same
    /// items; a body cut before its list ends is an error, never a shorter list (cut
    /// after it, only the envelope's empty trailing fields are missing).
    #[test]
    fn chunk_boundaries_anywhere_and_cut_off_bodies() {
        let (whole, _) = proto_items(SLICES_PB, &[]);
        for cut in 1..SLICES_PB.len() {
            let (items, meta) = proto_items(SLICES_PB, &[cut]);
            assert_eq!(items, whole, "cut at {cut}");
            assert!(meta.is_ok());
            let (items, meta) = proto_items(&SLICES_PB[..cut], &[]);
            if meta.is_ok() {
                assert_eq!(items, whole, "a body cut at {cut} gave a shorter list");
                assert!(cut + 4 >= SLICES_PB.len(), "cut at {cut} passed");
            }
        }
        let bytewise: Vec<usize> = (1..SERVICES_PB.len()).collect();
        assert_eq!(
            proto_items(SERVICES_PB, &bytewise).0,
            proto_items(SERVICES_PB, &[]).0
        );
    }

    const WATCH_SERVICES_JSON: &[u8] = include_bytes!("testdata/watch-services.json");
    const WATCH_SERVICES_PB: &[u8] = include_bytes!("testdata/watch-services.pb");
    const WATCH_SLICES_JSON: &[u8] = include_bytes!("testdata/watch-endpointslices.json");
    const WATCH_SLICES_PB: &[u8] = include_bytes!("testdata/watch-endpointslices.pb");

    fn frames(body: &[u8], chunks: &[usize]) -> (Vec<Vec<u8>>, bool) {
        let mut framer = WatchFramer::new();
        let mut frames = Vec::new();
        let mut from = 0;
        for &to in chunks.iter().chain([&body.len()]) {
            framer
                .feed(&body[from..to], |f| {
                    frames.push(f.to_vec());
                    true
                })
                .unwrap();
            from = to;
        }
        (frames, framer.at_boundary())
    }

    /// One watch's events as (type, key, resourceVersion, update) from each encoding.
    type Seen = (String, Key, Option<String>, Option<Update>);
    use crate::kube::fold::Key;

    fn json_events(kind: Kind, body: &[u8]) -> Vec<Seen> {
        std::str::from_utf8(body)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                let object = v["object"].to_string();
                let c = Coordinates::of(&object).unwrap();
                let type_ = v["type"].as_str().unwrap().to_string();
                let u = matches!(type_.as_str(), "ADDED" | "MODIFIED")
                    .then(|| update(&crate::kube::slim::decode(kind, &object).unwrap()))
                    .flatten();
                (type_, c.key(), c.resource_version, u)
            })
            .collect()
    }

    fn pb_events(kind: Kind, body: &[u8]) -> Vec<Seen> {
        let (frames, whole) = frames(body, &[]);
        assert!(whole);
        frames
            .iter()
            .map(|f| {
                let e = watch_event(f).unwrap();
                let c = coordinates(&e.object).unwrap();
                let u = matches!(e.type_.as_str(), "ADDED" | "MODIFIED")
                    .then(|| update(&decode(kind, &e.object).unwrap()))
                    .flatten();
                (e.type_, c.key(), c.resource_version, u)
            })
            .collect()
    }

    /// The same changes watched from a real API server in JSON and in protobuf (testdata
    /// README) give the same events: types, keys, resourceVersions and ingested updates,
    /// a bookmark included.
    #[test]
    fn protobuf_and_json_watches_of_the_same_changes_give_the_same_events() {
        for (kind, json, pb) in [
            (Kind::Service, WATCH_SERVICES_JSON, WATCH_SERVICES_PB),
            (Kind::EndpointSlice, WATCH_SLICES_JSON, WATCH_SLICES_PB),
        ] {
            let from_json = json_events(kind, json);
            let from_pb = pb_events(kind, pb);
            assert_eq!(from_pb, from_json, "{kind}");
            let types: std::collections::BTreeSet<&str> =
                from_pb.iter().map(|e| e.0.as_str()).collect();
            for t in ["ADDED", "MODIFIED", "DELETED"] {
                assert!(types.contains(t), "{kind}: no {t} event recorded");
            }
            assert!(
                from_pb.iter().filter(|e| e.3.is_some()).count() >= 2,
                "{kind}: updates compared, not two Nones"
            );
        }
    }

    /// Frames cut anywhere by the chunks (inside the length, inside the event) give the
    /// same events; a stream cut inside a frame is not at a boundary.
    #[test]
    fn watch_frames_cut_anywhere() {
        let (whole, _) = frames(WATCH_SLICES_PB, &[]);
        for cut in 1..WATCH_SLICES_PB.len() {
            let (got, at_boundary) = frames(WATCH_SLICES_PB, &[cut]);
            assert_eq!(got, whole, "cut at {cut}");
            assert!(at_boundary);
            let (_, at_boundary) = frames(&WATCH_SLICES_PB[..cut], &[]);
            let ends_a_frame = {
                let mut at = 0;
                while at + 4 <= cut {
                    let len = u32::from_be_bytes(WATCH_SLICES_PB[at..at + 4].try_into().unwrap());
                    at += 4 + len as usize;
                }
                at == cut
            };
            assert_eq!(at_boundary, ends_a_frame, "cut at {cut}");
        }
    }

    #[test]
    fn a_watch_error_carries_its_status_and_bad_frames_are_errors() {
        let (frames, _) = frames(include_bytes!("testdata/watch-gone.pb"), &[]);
        let e = watch_event(&frames[0]).unwrap();
        assert_eq!(e.type_, "ERROR");
        let s = status_of(&e.object).unwrap();
        assert_eq!(s.code, Some(410));
        // A frame claiming 1 GiB is refused before anything is buffered for it.
        let mut framer = WatchFramer::new();
        assert!(framer.feed(&[0x40, 0, 0, 0], |_| true).is_err());
        // An event whose object is JSON inside a protobuf stream.
        let event = WatchEventMessage {
            type_: Some("ADDED".into()),
            object: Some(RawExtension {
                raw: Some(b"{}".to_vec()),
            }),
        };
        let e = watch_event(&event.encode_to_vec()).unwrap_err();
        assert!(e.contains("not protobuf"), "{e}");
        assert!(watch_event(b"\x0a\xff").is_err());
    }

    /// A streamed list (`sendInitialEvents`) from a real API server: ADDED events, then
    /// the one bookmark annotated as the end of the initial events.
    #[test]
    fn the_bookmark_that_ends_the_initial_events() {
        let (frames, whole) = frames(include_bytes!("testdata/watch-initial-services.pb"), &[]);
        assert!(whole);
        let events: Vec<WatchEvent> = frames.iter().map(|f| watch_event(f).unwrap()).collect();
        let (last, initial) = events.split_last().unwrap();
        assert_eq!(last.type_, "BOOKMARK");
        assert!(ends_initial_events(&last.object));
        assert!(!initial.is_empty());
        for e in initial {
            assert_eq!(e.type_, "ADDED");
            assert!(!ends_initial_events(&e.object));
        }
    }

    #[test]
    fn a_page_carries_its_continue_token() {
        let (items, meta) = proto_items(include_bytes!("testdata/services-page-1.pb"), &[]);
        assert_eq!(items.len(), 2);
        assert!(!meta.unwrap().continue_token.unwrap_or_default().is_empty());
    }

    #[test]
    fn the_status_of_a_refused_request() {
        let s = status(include_bytes!("testdata/notfound.pb")).unwrap();
        assert_eq!(s.code, Some(404));
        assert_eq!(s.reason.as_deref(), Some("NotFound"));
        assert_eq!(s.message.as_deref(), Some("services \"nope\" not found"));
        assert!(status(SERVICES_JSON).is_none());
    }

    #[test]
    fn bad_bodies_are_errors_not_allocations() {
        let mut s = ListSplitter::new();
        assert!(s.feed(b"{\"kind\":\"ServiceList\"}", |_| {}).is_err());
        // An item claiming 1 GiB: refused before anything is buffered for it.
        let mut body = b"k8s\0\x12\x80\x80\x80\x80\x04".to_vec();
        body.extend_from_slice(b"\x12\x80\x80\x80\x80\x04");
        let mut s = ListSplitter::new();
        let e = s.feed(&body, |_| panic!("no item")).unwrap_err();
        assert!(e.0.contains("over"), "{e:?}");
        // A group wire type (never used by Kubernetes).
        let mut s = ListSplitter::new();
        assert!(s.feed(b"k8s\0\x0b", |_| {}).is_err());
        // A list field running past the list's end.
        let mut s = ListSplitter::new();
        assert!(s.feed(b"k8s\0\x12\x02\x12\x05abcde", |_| {}).is_err());
    }

    #[test]
    fn a_bad_item_fails_alone_naming_what_is_wrong() {
        let (items, _) = proto_items(SERVICES_PB, &[]);
        // A ServicePort without its port: the field named.
        let mut svc = Service::decode(items[0].as_slice()).unwrap();
        let spec = svc.spec.get_or_insert_with(Default::default);
        spec.ports = vec![ServicePort {
            name: Some("p".into()),
            ..ServicePort::default()
        }];
        let e = decode(Kind::Service, &svc.encode_to_vec()).unwrap_err();
        assert_eq!(e.field, ".spec.ports[0].port");
        // Garbage: undecodable, and no coordinates to key it by.
        let e = decode(Kind::Service, b"\x0a\xff").unwrap_err();
        assert!(e.reason.contains("undecodable protobuf"), "{e:?}");
        assert!(coordinates(b"\x0a\xff").is_none());
    }
}
