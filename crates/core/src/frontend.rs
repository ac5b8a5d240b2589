//! Frontends: the address, port and protocol a Service claims on this node, of which
//! kind, and why one was refused to a Service (a [`Conflict`], part of the
//! [`NodePlan`](crate::plan::NodePlan)). `crate::conflicts` decides the conflicts; `crate::trace`
//! names the kind of frontend a packet hits.

use std::net::IpAddr;

use serde::Serialize;

use crate::model::{IpFamily, Protocol, ServiceName};

/// Which kind of frontend a claim is for (or a packet hits, in `crate::trace`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum FrontendKind {
    ClusterIp,
    ExternalIp,
    LoadBalancerIp,
    NodePort,
    /// A health-check node port (TCP, every node address): it collides with node ports.
    HealthCheckNodePort,
}

impl FrontendKind {
    /// The kind in words, as `plan`, `explain`, `trace` and the logs print it.
    pub fn describe(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "cluster IP",
            FrontendKind::ExternalIp => "external IP",
            FrontendKind::LoadBalancerIp => "load-balancer IP",
            FrontendKind::NodePort => "node port",
            FrontendKind::HealthCheckNodePort => "health-check node port",
        }
    }
}

/// One frontend: `ip` is `None` for a node port (every node address of the family).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Frontend {
    pub kind: FrontendKind,
    pub family: IpFamily,
    pub ip: Option<IpAddr>,
    pub port: u16,
    pub protocol: Protocol,
}

/// Why a frontend was not given to a Service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase", tag = "reason")]
pub enum ConflictReason {
    /// The same address, port and protocol belongs to `owner` (created earlier, or same
    /// age and sorting first).
    Claimed { owner: ServiceName },
    /// An external or LB IP equal to `owner`'s cluster IP (refused on any port).
    ClusterIpCapture { owner: ServiceName },
    /// An external or LB IP equal to one of this node's addresses.
    NodeIpCapture,
    /// A cluster IP equal to one of this node's addresses: its rules would take the
    /// node's own traffic (refused like the other reserved addresses, whatever
    /// `allow_external_ip_overlap` says).
    NodeAddress,
}

/// A frontend refused to a Service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Conflict {
    /// The Service that does not get the frontend.
    pub service: ServiceName,
    /// Its port (`spec.ports[].name`).
    pub port_name: String,
    pub frontend: Frontend,
    /// The Service's field the refused address was read from, for a cluster IP
    /// (`.spec.clusterIP`, `.spec.clusterIPs[1]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    #[serde(flatten)]
    pub reason: ConflictReason,
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fe = &self.frontend;
        let what = fe.kind.describe();
        let at = match fe.ip {
            Some(IpAddr::V6(ip)) => format!("[{ip}]:{}/{:?}", fe.port, fe.protocol),
            Some(ip) => format!("{ip}:{}/{:?}", fe.port, fe.protocol),
            None => format!("{}/{:?} ({})", fe.port, fe.protocol, fe.family),
        };
        write!(f, "{}: {what} {at}", self.service)?;
        if let Some(field) = &self.field {
            write!(f, " ({field})")?;
        }
        write!(f, " not programmed: ")?;
        match &self.reason {
            ConflictReason::Claimed { owner } => write!(f, "it belongs to {owner}"),
            ConflictReason::ClusterIpCapture { owner } => write!(
                f,
                "it is the cluster IP of {owner} (CVE-2020-8554; --allow-external-ip-overlap allows it)"
            ),
            ConflictReason::NodeIpCapture => write!(
                f,
                "it is an address of this node (CVE-2020-8554; --allow-external-ip-overlap allows it)"
            ),
            ConflictReason::NodeAddress => write!(
                f,
                "it is an address of this node, whose own traffic its rules would take"
            ),
        }
    }
}

/// Why a cluster IP that upstream kube-proxy programs is suspicious: kproxy programs it
/// too (a Service blackholed on every node is worse than one programmed with a warning)
/// and says so ([`ClusterIpWarning`]).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase", tag = "reason")]
pub enum ClusterIpWarningReason {
    /// A cluster IP equal to an address of another Node: on the Service's ports, its
    /// rules take this node's traffic to that node.
    OtherNodeAddress { node: String },
    /// A cluster IP outside every service CIDR of its family (ServiceCIDR objects and
    /// the configured ones): no API server allocates it there today (the ServiceCIDRs
    /// may have changed since, or a manifest set lists them loosely).
    OutsideServiceCidrs { service_cidrs: Vec<ipnet::IpNet> },
}

/// A cluster IP programmed although no API server would allocate it now: one per Service
/// and family, sorted by Service. `plan`, `explain`, `sync`, the logs and the
/// `kproxy_cluster_ip_warnings` metric show them (docs/input.md, "Cluster IPs").
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterIpWarning {
    pub service: ServiceName,
    pub family: IpFamily,
    pub cluster_ip: IpAddr,
    /// The Service's field the address was read from (`.spec.clusterIP`,
    /// `.spec.clusterIPs[1]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    #[serde(flatten)]
    pub reason: ClusterIpWarningReason,
}

impl std::fmt::Display for ClusterIpWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: cluster IP {}", self.service, self.cluster_ip)?;
        if let Some(field) = &self.field {
            write!(f, " ({field})")?;
        }
        write!(
            f,
            " programmed, as upstream kube-proxy programs it, although "
        )?;
        match &self.reason {
            ClusterIpWarningReason::OtherNodeAddress { node } => write!(
                f,
                "it is an address of Node {}: on the Service's ports, this node's traffic to that Node goes to the Service",
                node.escape_debug()
            ),
            ClusterIpWarningReason::OutsideServiceCidrs { service_cidrs } => {
                let cidrs: Vec<String> = service_cidrs.iter().map(|c| c.to_string()).collect();
                write!(
                    f,
                    "it is outside the service CIDRs ({}), where no API server allocates a cluster IP now",
                    cidrs.join(", ")
                )
            }
        }
    }
}
