//! `NodePlan`: the complete desired state of one node, and nothing else. Every
//! consumer (nftables, health servers, `explain`, `trace`, metrics) reads this; none
//! re-decides policy. The planner that builds it is `crate::planner`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use serde::Serialize;

use crate::model::{
    Conditions, DrainSignal, EndpointAddr, IpFamily, Placement, Protocol, ServiceName,
    ServicePortName, TrafficPolicy,
};

/// The desired state of one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    /// This node's name (`--node` / hostname override).
    pub node: String,
    /// The node's `topology.kubernetes.io/zone`, `None` when unknown.
    pub zone: Option<String>,
    /// Whether an eTP-Cluster load balancer may use this node (`/healthz` nodeEligible):
    /// false while the Node shows a drain signal that counts (`node_drain_signals` is
    /// not empty). `true` when the Node object is unknown (nothing says otherwise).
    pub node_eligible: bool,
    /// The Node's drain signals that count (`PlanConfig::counts`), in
    /// [`DrainSignal::OF_NODE`] order: tainted `ToBeDeletedByClusterAutoscaler`, being
    /// deleted (`deletionTimestamp`), deleted, `DrainInProgress`,
    /// `GracefulNodeShutdownInProgress` (docs/health.md, "Drain signals").
    pub node_drain_signals: Vec<DrainSignal>,
    /// Per-family node facts the dataplane needs; always both families, IPv4 first.
    pub families: Vec<FamilyPlan>,
    /// Every proxied Service, keyed by `ns/name`. An unchanged Service keeps the same
    /// `Arc` across incremental re-plans, so consumers diff by pointer first.
    pub services: BTreeMap<ServiceName, Arc<ServicePlan>>,
    /// Frontends refused to a Service because another claims them, or because they would
    /// capture a cluster IP or node address (`crate::conflicts`); sorted by Service. The
    /// plans in `services` already lack them. Empty: no conflict.
    pub conflicts: Vec<crate::frontend::Conflict>,
    /// Cluster IPs programmed although no API server would allocate them now (another
    /// Node's address, outside the service CIDRs), as upstream programs them
    /// (`crate::conflicts::cluster_ip_warnings`); sorted by Service.
    pub cluster_ip_warnings: Vec<crate::frontend::ClusterIpWarning>,
}

impl NodePlan {
    /// Every service port of every Service, both families, in (service, port, family) order.
    pub fn service_ports(&self) -> impl Iterator<Item = &ServicePortPlan> {
        self.services.values().flat_map(|s| s.ports.iter())
    }

    /// Health-check node ports this node must serve, in service order.
    pub fn health_checks(&self) -> impl Iterator<Item = &HealthCheck> {
        self.services
            .values()
            .filter_map(|s| s.health_check.as_ref())
    }

    pub fn family(&self, family: IpFamily) -> &FamilyPlan {
        // Invariant: the planner always fills both families, IPv4 first.
        &self.families[family.index()]
    }
}

/// Node facts of one family that decide what the dataplane matches.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FamilyPlan {
    pub family: IpFamily,
    /// This node's addresses of this family (primary first).
    pub node_ips: Vec<IpAddr>,
    /// Destination addresses on which NodePorts are served.
    pub node_port_addresses: NodePortAddresses,
    /// How "from a local pod" is recognised; `None` ⇒ no `LocalPod` rules appear.
    pub local_pods: LocalPods,
    /// Service CIDRs of this family: a new connection to an address inside them that is
    /// no Service's frontend is dropped.
    pub service_cidrs: Vec<IpNet>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "addresses")]
pub enum NodePortAddresses {
    /// Any local, non-loopback address of this family (nodePortAddresses match-all).
    AllLocal,
    /// Only these addresses (may be empty: NodePorts are then not served on this family).
    Only(Vec<IpAddr>),
    /// Any local, non-loopback address inside one of these CIDRs (an explicit
    /// nodePortAddresses list). Kept as CIDRs, not resolved to addresses, so the kernel
    /// (`fib daddr type local`) and `trace` (the node's addresses) select the same
    /// addresses whichever addresses the Node object lists.
    Cidrs(Vec<IpNet>),
}

impl NodePortAddresses {
    /// Whether a packet to `ip` may hit a NodePort; `is_local` says whether `ip` is one
    /// of this node's addresses.
    pub fn selects(&self, ip: &IpAddr, is_local: bool) -> bool {
        match self {
            NodePortAddresses::AllLocal => is_local && !ip.is_loopback(),
            NodePortAddresses::Only(list) => list.contains(ip),
            NodePortAddresses::Cidrs(cidrs) => {
                is_local && !ip.is_loopback() && cidrs.iter().any(|c| c.contains(ip))
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "kind", content = "value")]
pub enum LocalPods {
    None,
    /// Source address within one of these CIDRs.
    Cidrs(Vec<IpNet>),
    /// Input interface name starts with this prefix.
    InterfacePrefix(String),
    /// Input interface is this bridge.
    Bridge(String),
}

/// One Service on this node: its ports (both families) and its health-check node port.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePlan {
    pub service: ServiceName,
    /// Sorted by (port name, protocol, family).
    pub ports: Vec<ServicePortPlan>,
    /// `Some` iff type LoadBalancer, eTP Local and `healthCheckNodePort` ≠ 0.
    pub health_check: Option<HealthCheck>,
}

impl ServicePlan {
    /// The plan of one port of one family (`ports` is sorted by these).
    pub fn port(
        &self,
        port_name: &str,
        protocol: Protocol,
        family: IpFamily,
    ) -> Option<&ServicePortPlan> {
        self.ports
            .binary_search_by(|p| {
                (p.service_port.port_name.as_str(), p.protocol, p.family)
                    .cmp(&(port_name, protocol, family))
            })
            .ok()
            .map(|i| &self.ports[i])
    }
}

/// What a health-check node port answers for one Service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthCheck {
    pub service: ServiceName,
    pub health_check_node_port: u16,
    /// Distinct IPs of this node's *ready* endpoints of the Service, any port, counted
    /// per family, the larger family's count ([`local_ready_count`]). Serving+terminating
    /// endpoints do not count (KEP-1669 drain signal).
    pub local_endpoints: u32,
}

/// The IPs of this node's *ready* endpoints among `endpoints` (give one family's), not
/// counting those held for warm-up: the set a health-check node port counts. The one definition of "local ready endpoints",
/// used by the planner and the health servers.
pub fn local_ready_ips<'a>(
    endpoints: impl IntoIterator<Item = &'a EndpointState>,
) -> BTreeSet<IpAddr> {
    endpoints
        .into_iter()
        .filter(|e| e.is_local && e.is_ready())
        .map(|e| e.addr.ip)
        .collect()
}

/// The health-check count from each family's [`local_ready_ips`] (or a subset of them):
/// the largest family's, as a dual-stack Service's pods have one IP per family.
pub fn local_ready_count(per_family: impl IntoIterator<Item = BTreeSet<IpAddr>>) -> u32 {
    per_family
        .into_iter()
        .map(|ips| u32::try_from(ips.len()).unwrap_or(u32::MAX))
        .max()
        .unwrap_or(0)
}

/// How traffic to one frontend family of one service port is handled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ServicePortPlan {
    pub service_port: ServicePortName,
    pub family: IpFamily,
    pub protocol: Protocol,
    /// `spec.ports[].port`: the port of the cluster IP, external IPs and LB IPs.
    pub port: u16,
    pub cluster_ip: IpAddr,
    /// `None`: no NodePort rules.
    pub node_port: Option<u16>,
    /// externalIPs of this family.
    pub external_ips: Vec<IpAddr>,
    /// VIP-mode load-balancer ingress IPs of this family.
    pub load_balancer_ips: Vec<IpAddr>,
    /// `Some` when `loadBalancerSourceRanges` has entries of this family: new connections
    /// to the LB IPs from a source outside `allowed_sources` are dropped. Never applies
    /// to the cluster IP, NodePorts or external IPs.
    pub firewall: Option<Firewall>,
    /// The effective policies (eTP is Cluster unless the port is externally accessible).
    pub internal_traffic_policy: TrafficPolicy,
    pub external_traffic_policy: TrafficPolicy,
    /// `Some(timeoutSeconds)` for ClientIP session affinity.
    pub session_affinity_timeout: Option<u32>,
    /// Which topology filter produced `cluster_endpoints`.
    pub topology: TopologyMode,
    /// Endpoints for Cluster-policy traffic. `None`: no traffic of this port uses Cluster
    /// policy. `Some(empty)`: it does, but nothing qualifies.
    pub cluster_endpoints: Option<Vec<EndpointAddr>>,
    /// Endpoints for Local-policy traffic (this node only). `None`/empty as above.
    pub local_endpoints: Option<Vec<EndpointAddr>>,
    /// Union of the two: the endpoints this node must be able to DNAT to.
    pub all_reachable_endpoints: Vec<EndpointAddr>,
    /// Usable endpoints exist somewhere in the cluster: false ⇒ REJECT, true with an
    /// empty applicable list ⇒ DROP.
    pub has_any_endpoints: bool,
    /// `cluster_endpoints` / `local_endpoints` is categorisation's serving+terminating
    /// fallback: no ready endpoint qualified (`crate::categorize`). Read by `explain`.
    #[serde(skip)]
    pub cluster_uses_terminating: bool,
    #[serde(skip)]
    pub local_uses_terminating: bool,
    /// Traffic to the cluster IP, rules in match order (first match wins).
    pub internal: Vec<TrafficRule>,
    /// Traffic to the NodePort, external IPs and LB IPs, rules in match order. Empty
    /// when the port has none of those frontends.
    pub external: Vec<TrafficRule>,
    /// Every endpoint known for this port with its state, sorted by address: what
    /// `explain` reasons over and what conntrack cleanup calls "serving".
    pub endpoints: Vec<EndpointState>,
}

impl ServicePortPlan {
    /// The endpoint list a `Forward` verdict refers to.
    pub fn endpoints_for(&self, set: EndpointSet) -> &[EndpointAddr] {
        match set {
            EndpointSet::Cluster => self.cluster_endpoints.as_deref().unwrap_or(&[]),
            EndpointSet::Local => self.local_endpoints.as_deref().unwrap_or(&[]),
        }
    }

    /// Whether the `set` list is the serving+terminating fallback.
    pub fn uses_terminating(&self, set: EndpointSet) -> bool {
        match set {
            EndpointSet::Cluster => self.cluster_uses_terminating,
            EndpointSet::Local => self.local_uses_terminating,
        }
    }

    /// The endpoint at `addr` (`endpoints` is sorted by address).
    pub fn endpoint(&self, addr: EndpointAddr) -> Option<&EndpointState> {
        self.endpoints
            .binary_search_by(|e| e.addr.cmp(&addr))
            .ok()
            .map(|i| &self.endpoints[i])
    }

    /// Whether `ep` is on this node (`endpoints` is sorted by address).
    pub fn is_local_endpoint(&self, ep: EndpointAddr) -> bool {
        self.endpoints
            .binary_search_by(|e| e.addr.cmp(&ep))
            .is_ok_and(|i| self.endpoints[i].is_local)
    }

    /// The endpoints whose hairpin connections (a pod reaching itself through this
    /// Service) are masqueraded: the reachable ones on this node. Upstream's nftables
    /// proxier (v1.36) fills its `hairpin-connections` set from local endpoints only, so a
    /// pod of another node whose connection to a cluster IP is routed through this node
    /// back to itself keeps its address (and its own stack drops the packet). In a real
    /// cluster that pod's traffic is proxied by its own node.
    pub fn hairpin_endpoints(&self) -> impl Iterator<Item = EndpointAddr> + '_ {
        self.all_reachable_endpoints
            .iter()
            .copied()
            .filter(|ep| self.is_local_endpoint(*ep))
    }

    /// Endpoints that conntrack cleanup keeps flows to: serving ones, whatever `ready`
    /// says (upstream's reconciler keys on serving).
    pub fn serving_endpoints(&self) -> impl Iterator<Item = EndpointAddr> + '_ {
        self.endpoints
            .iter()
            .filter(|e| e.conditions.serving)
            .map(|e| e.addr)
    }

    /// True when the port has any external frontend (NodePort, external IP, LB IP).
    pub fn externally_accessible(&self) -> bool {
        self.node_port.is_some()
            || !self.external_ips.is_empty()
            || !self.load_balancer_ips.is_empty()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Firewall {
    /// Source CIDRs allowed (from loadBalancerSourceRanges of this family), plus the LB
    /// IPs themselves as /32 or /128 when this node's primary IP is inside a range.
    pub allowed_sources: Vec<IpNet>,
}

/// The topology filter applied to the Cluster list (docs/upstream-semantics.md §b.4).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "mode", content = "value")]
pub enum TopologyMode {
    /// All ready endpoints.
    #[default]
    None,
    /// Ready endpoints hinted for this zone.
    PreferSameZone(String),
    /// Ready endpoints hinted for this node.
    PreferSameNode,
}

/// Which packets a rule matches. Rules are tried in order; the last is always `Any`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum SourceClass {
    /// From a pod on this node, per the family's `local_pods` detector.
    LocalPod,
    /// From one of this node's own addresses (`fib saddr type local`).
    ThisNode,
    Any,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum EndpointSet {
    Cluster,
    Local,
}

/// What happens to a new connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "action", rename_all = "camelCase")]
pub enum Verdict {
    /// DNAT to one endpoint of the set (affinity first, then uniform random). The set is
    /// never empty.
    Forward {
        endpoints: EndpointSet,
        masquerade: bool,
    },
    /// Silently dropped: endpoints exist, but none for this traffic.
    Drop,
    /// Rejected (ICMP port unreachable / TCP reset): no usable endpoint anywhere.
    Reject,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TrafficRule {
    pub from: SourceClass,
    pub verdict: Verdict,
}

/// One endpoint of a service port as the planner saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointState {
    pub addr: EndpointAddr,
    pub is_local: bool,
    pub conditions: Conditions,
    /// The slice endpoint's node, zone and hints (shared, not copied).
    #[serde(flatten)]
    pub placement: Arc<Placement>,
    /// Ready in its slice, but held back from new connections until its warm-up ends
    /// (`crate::warmup`): every list of the plan counts it as not ready. `None`: not held.
    /// Boxed: rare, and 8 bytes per endpoint of every plan instead of 24.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup: Option<Box<crate::hold::Hold>>,
}

impl EndpointState {
    /// Ready for new connections: ready in its slice and not held for warm-up. What
    /// categorisation and the health-check count read; `conditions.ready` stays the
    /// slice's.
    pub fn is_ready(&self) -> bool {
        self.conditions.ready && self.warmup.is_none()
    }
}

/// The JSON contract of `kproxy plan -o json` (docs/plan-json.md): the services map is
/// flattened into `servicePorts` and `healthChecks`.
impl Serialize for NodePlan {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        #[serde(rename_all = "camelCase")]
        struct View<'a> {
            node: &'a str,
            zone: &'a Option<String>,
            node_eligible: bool,
            #[serde(skip_serializing_if = "<[_]>::is_empty")]
            node_drain_signals: &'a [DrainSignal],
            families: &'a [FamilyPlan],
            service_ports: Vec<&'a ServicePortPlan>,
            health_checks: Vec<&'a HealthCheck>,
            conflicts: &'a [crate::frontend::Conflict],
            cluster_ip_warnings: &'a [crate::frontend::ClusterIpWarning],
        }
        View {
            node: &self.node,
            zone: &self.zone,
            node_eligible: self.node_eligible,
            node_drain_signals: &self.node_drain_signals,
            families: &self.families,
            service_ports: self.service_ports().collect(),
            health_checks: self.health_checks().collect(),
            conflicts: &self.conflicts,
            cluster_ip_warnings: &self.cluster_ip_warnings,
        }
        .serialize(s)
    }
}
