//! `PlanConfig`: the settings that change *decisions* (which endpoints, masquerade or
//! not, which addresses take NodePorts). Settings that only change *how* a decision
//! reaches the kernel (mark bits, sync periods) live with the dataplane.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::model::DrainSignal;

/// How kproxy tells traffic from this node's pods apart (upstream `detectLocalMode`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "mode", content = "value")]
pub enum LocalDetectorConfig {
    /// No detector: nothing is treated as coming from a local pod.
    #[default]
    None,
    /// Sources inside these cluster CIDRs are pods (`ClusterCIDR`).
    ClusterCidr(Vec<IpNet>),
    /// Sources inside the Node's `spec.podCIDRs` are local pods (`NodeCIDR`).
    NodeCidr,
    /// Packets arriving on an interface with this name prefix are from local pods.
    InterfaceNamePrefix(String),
    /// Packets arriving on this bridge are from local pods.
    BridgeInterface(String),
}

/// Which node addresses accept NodePort traffic (upstream `nodePortAddresses`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "mode", content = "value")]
pub enum NodePortAddressesConfig {
    /// The node's primary IP of each family (nftables-mode default).
    #[default]
    Primary,
    /// Every local address inside one of these CIDRs. A CIDR of prefix length 0 means
    /// every local non-loopback address of that family.
    Cidrs(Vec<IpNet>),
}

/// Planner settings. `Default` is upstream's current (v1.33+) behaviour.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PlanConfig {
    /// Mark every packet to a cluster IP for masquerade (`masqueradeAll`).
    pub masquerade_all: bool,
    pub local_detector: LocalDetectorConfig,
    pub node_port_addresses: NodePortAddressesConfig,
    /// Addresses of this node, discovered by the edge (interfaces); used to resolve
    /// `nodePortAddresses` CIDRs and the "from this host" short-circuit. When empty the
    /// Node object's `status.addresses` are used.
    pub node_ips: Vec<IpAddr>,
    /// Failover to serving+terminating endpoints (KEP-1669). `false` reproduces
    /// kube-proxy before v1.26 (the `ProxyTerminatingEndpoints` gate off).
    pub proxy_terminating_endpoints: bool,
    /// Honour `hints.forNodes` (the `PreferSameTrafficDistribution` gate, on from 1.34).
    pub prefer_same_node_hints: bool,
    /// `/healthz` reports the node not eligible (503) while its Node is being deleted or
    /// tainted `ToBeDeletedByClusterAutoscaler` (KEP-3836, the
    /// `KubeProxyDrainingTerminatingNodes` gate, on by default from 1.30). `false`
    /// reproduces kube-proxy without KEP-3836 (before 1.28; by default before 1.30): the
    /// Node never affects `/healthz`.
    #[serde(default = "yes")]
    pub drain_terminating_nodes: bool,
    /// Drain signals of the Node that do not turn `/healthz` to 503
    /// (`--ignore-drain-signal`; docs/health.md, "Drain signals").
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub ignored_drain_signals: BTreeSet<DrainSignal>,
    /// Allow an external or load-balancer IP equal to a Service's cluster IP or to a
    /// node address (CVE-2020-8554; refused by default, see `crate::conflicts`).
    pub allow_external_ip_overlap: bool,
    /// The cluster's service CIDRs (`--service-cluster-ip-range` style). New connections
    /// to an address inside them that no Service owns are dropped (upstream
    /// `cluster-ips-check`); empty: nothing is dropped.
    #[serde(default)]
    pub service_cidrs: Vec<IpNet>,
    /// How long an endpoint that becomes ready while kproxy runs is held back from new
    /// connections (`crate::warmup`; `kproxy run --endpoint-warmup`). Zero, upstream's
    /// behaviour and this default: no hold.
    #[serde(default)]
    pub endpoint_warmup: std::time::Duration,
}

fn yes() -> bool {
    true
}

impl PlanConfig {
    /// Whether a drain signal the Node shows makes this node not eligible for
    /// eTP-Cluster load balancers: not when ignored, nor, for KEP-3836's signals, with
    /// the `KubeProxyDrainingTerminatingNodes` gate off.
    pub fn counts(&self, signal: DrainSignal) -> bool {
        !self.ignored_drain_signals.contains(&signal)
            && (self.drain_terminating_nodes || !signal.kep_3836())
    }
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            masquerade_all: false,
            local_detector: LocalDetectorConfig::None,
            node_port_addresses: NodePortAddressesConfig::Primary,
            node_ips: Vec::new(),
            proxy_terminating_endpoints: true,
            prefer_same_node_hints: true,
            drain_terminating_nodes: true,
            ignored_drain_signals: BTreeSet::new(),
            allow_external_ip_overlap: false,
            service_cidrs: Vec::new(),
            endpoint_warmup: std::time::Duration::ZERO,
        }
    }
}

/// Linux interface names (1–15 bytes), limited to the alphabet Linux names commonly use
/// so a name sits in an nftables string without escaping: the one check for the
/// interface settings of [`LocalDetectorConfig`], wherever they come from.
pub fn check_interface_name(s: &str) -> Result<(), String> {
    let shown = || format!("{:?}", s.escape_debug().to_string());
    if s.is_empty() {
        return Err("an interface name may not be empty".into());
    }
    if s.len() > 15 {
        return Err(format!("{} is longer than an interface name (15)", shown()));
    }
    if !s
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(format!(
            "{}: an interface name has only letters, digits, '-', '_' and '.'",
            shown()
        ));
    }
    Ok(())
}

/// Words nft reads as keywords where a table name stands (`add table ip inet` is a
/// syntax error, or worse, another meaning): families, object types and verbs.
const NFT_KEYWORDS: &[&str] = &[
    "ip",
    "ip6",
    "inet",
    "arp",
    "bridge",
    "netdev",
    "table",
    "tables",
    "chain",
    "chains",
    "rule",
    "rules",
    "set",
    "sets",
    "map",
    "maps",
    "element",
    "flowtable",
    "flowtables",
    "counter",
    "counters",
    "quota",
    "quotas",
    "limit",
    "limits",
    "ct",
    "meter",
    "meters",
    "add",
    "create",
    "insert",
    "replace",
    "delete",
    "destroy",
    "list",
    "flush",
    "reset",
    "rename",
    "describe",
    "import",
    "export",
    "monitor",
    "handle",
    "index",
    "position",
    "hook",
    "type",
    "priority",
    "policy",
    "device",
    "devices",
    "flags",
    "accept",
    "drop",
    "reject",
    "queue",
    "continue",
    "return",
    "jump",
    "goto",
    "define",
    "include",
    "filter",
    "nat",
    "route",
    "counter",
    "log",
    "dnat",
    "snat",
    "masquerade",
    "redirect",
    "meta",
    "tcp",
    "udp",
    "sctp",
    "icmp",
    "icmpv6",
    "ether",
    "vlan",
    "comment",
    "synproxy",
    "secmark",
    "secmarks",
    "ruleset",
    "timeout",
    "size",
    "elements",
];

/// An nftables table name kproxy may use (`--nft-table`, `DataplaneConfig::table`):
/// 1-32 characters of `[A-Za-z0-9_-]` starting with a letter (it sits in a script
/// unquoted, and in a netlink attribute), and not an nft keyword. The one rule, checked
/// where the flag is parsed and again by the dataplane.
pub fn check_nft_table_name(s: &str) -> Result<(), String> {
    let ok = !s.is_empty()
        && s.len() <= 32
        && s.starts_with(|c: char| c.is_ascii_alphabetic())
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !ok {
        return Err(format!(
            "table name {s:?}: want 1-32 of [A-Za-z0-9_-], starting with a letter"
        ));
    }
    let lower = s.to_ascii_lowercase();
    if NFT_KEYWORDS.contains(&lower.as_str()) {
        return Err(format!("table name {s:?} is an nft keyword"));
    }
    // kube-proxy's own: the takeover removes them as kube-proxy's (kproxy then removed
    // its freshly programmed tables 80 ms after writing them).
    let kube_proxy = crate::takeover::NFT_TABLE;
    if lower == kube_proxy
        || lower
            .strip_prefix(kube_proxy)
            .is_some_and(|rest| rest.starts_with('-'))
    {
        return Err(format!(
            "table name {s:?} is kube-proxy's ({kube_proxy}, {kube_proxy}-*): kproxy would remove it as kube-proxy's rules"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn interface_names() {
        use super::check_interface_name as check;
        for ok in ["eth0", "veth.1_a-b", "fifteen-chars15"] {
            assert_eq!(check(ok), Ok(()), "{ok}");
        }
        for bad in ["", "sixteen-chars-16", "eth 0", "eth0;", "é"] {
            assert!(check(bad).is_err(), "{bad:?}");
        }
    }
}
