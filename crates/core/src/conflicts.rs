//! Frontend conflicts: two Services that claim the same address, port and protocol on
//! this node (a cluster IP, an external IP, a load-balancer IP, or a node port), and
//! external or load-balancer IPs that would capture another Service's cluster IP or this
//! node's own address (CVE-2020-8554), and a cluster IP equal to one of this node's
//! addresses ([`cluster_ip_refusal`]). A health-check node port claims its port like a TCP
//! node port. Pure: the planner calls [`resolve`] on the plans
//! it built and programs only what survives; `plan`, `explain`, the logs and the
//! `kproxy_frontend_conflicts` metric show [`Conflict`]s (`crate::frontend` says what one
//! is).
//!
//! Cluster IPs that no API server would allocate now but upstream kube-proxy programs
//! (another Node's address, outside the known service CIDRs) are programmed too, with a
//! [`ClusterIpWarning`] ([`cluster_ip_warnings`]): a Service blackholed on every node is
//! worse than one programmed with a warning, and a cluster whose ServiceCIDRs changed
//! keeps Services allocated under the old ones (docs/input.md, "Cluster IPs").
//!
//! The rule (docs/input.md): a frontend goes to the Service created first
//! (`metadata.creationTimestamp`; a Service without one counts as newest), then to the
//! one whose `namespace/name` sorts first — the order in which the apiserver would have
//! allocated it. The other Service loses only that frontend: an external, LB IP or node
//! port is dropped from its port; a cluster IP lost costs the whole port (of that family),
//! since nothing of it can be reached unambiguously. Without the
//! `allow_external_ip_overlap` setting, an external or LB IP equal to any Service's cluster
//! IP or to one of this node's addresses is refused whatever the port.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

use crate::frontend::{
    ClusterIpWarning, ClusterIpWarningReason, Conflict, ConflictReason, Frontend, FrontendKind,
};
use crate::model::{IpFamily, Protocol, ServiceName};
use crate::plan::{NodePlan, ServicePlan, ServicePortPlan};

/// Who may claim first: created earlier (`None` last), then by name.
pub type Age = Option<i64>;

/// The addresses no cluster IP may take on this node.
///
/// An API server allocates cluster IPs inside its service CIDRs only, and node networks
/// lie outside them; manifests reach kproxy with no API server between, so kproxy checks
/// again what it can see (docs/input.md, "Cluster IPs").
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reserved {
    /// This node's addresses.
    pub node_ips: Vec<IpAddr>,
    /// Other Nodes' addresses, with the Node each belongs to.
    pub other_nodes: BTreeMap<IpAddr, String>,
    /// The service CIDRs of both families; a family without any is not checked.
    pub service_cidrs: Vec<IpNet>,
}

impl Reserved {
    /// This node's addresses and service CIDRs as `plan`'s families hold them, and
    /// `other_nodes`.
    pub fn of(plan: &NodePlan, other_nodes: BTreeMap<IpAddr, String>) -> Reserved {
        Reserved {
            node_ips: plan
                .families
                .iter()
                .flat_map(|f| f.node_ips.iter().copied())
                .collect(),
            other_nodes,
            service_cidrs: plan
                .families
                .iter()
                .flat_map(|f| f.service_cidrs.iter().copied())
                .collect(),
        }
    }
}

/// Why `ip` may not be a cluster IP on this node, or `None` when it may: one of this
/// node's addresses (its rules would take the node's own traffic to that address; upstream
/// programs it, kproxy does not).
pub fn cluster_ip_refusal(ip: IpAddr, reserved: &Reserved) -> Option<ConflictReason> {
    reserved
        .node_ips
        .contains(&ip)
        .then_some(ConflictReason::NodeAddress)
}

/// Why a cluster IP kproxy programs (as upstream does) deserves a warning, or `None`:
/// another Node's address, or outside the service CIDRs of its family when any are known.
pub fn cluster_ip_warning(ip: IpAddr, reserved: &Reserved) -> Option<ClusterIpWarningReason> {
    if let Some(node) = reserved.other_nodes.get(&ip) {
        return Some(ClusterIpWarningReason::OtherNodeAddress { node: node.clone() });
    }
    let family = IpFamily::of(&ip);
    let cidrs: Vec<IpNet> = reserved
        .service_cidrs
        .iter()
        .filter(|c| family.contains(&c.addr()))
        .copied()
        .collect();
    if !cidrs.is_empty() && !cidrs.iter().any(|c| c.contains(&ip)) {
        return Some(ClusterIpWarningReason::OutsideServiceCidrs {
            service_cidrs: cidrs,
        });
    }
    None
}

/// The warnings for the cluster IPs `services` program (after [`resolve`]): one per
/// Service and family, sorted. `field` gives the field a family's cluster IP was read
/// from.
pub fn cluster_ip_warnings(
    services: &BTreeMap<ServiceName, Arc<ServicePlan>>,
    field: impl Fn(&ServiceName, IpFamily) -> Option<String>,
    reserved: &Reserved,
) -> Vec<ClusterIpWarning> {
    let mut out = Vec::new();
    for (name, plan) in services {
        let mut seen = BTreeSet::new();
        for p in &plan.ports {
            if !seen.insert(p.cluster_ip) {
                continue;
            }
            if let Some(reason) = cluster_ip_warning(p.cluster_ip, reserved) {
                out.push(ClusterIpWarning {
                    service: name.clone(),
                    family: p.family,
                    cluster_ip: p.cluster_ip,
                    field: field(name, p.family),
                    reason,
                });
            }
        }
    }
    out.sort();
    out
}

/// The frontends one port plan claims.
pub fn frontends(p: &ServicePortPlan) -> impl Iterator<Item = Frontend> + '_ {
    let fe = move |kind, ip| Frontend {
        kind,
        family: p.family,
        ip,
        port: p.port,
        protocol: p.protocol,
    };
    std::iter::once(fe(FrontendKind::ClusterIp, Some(p.cluster_ip)))
        .chain(
            p.external_ips
                .iter()
                .map(move |ip| fe(FrontendKind::ExternalIp, Some(*ip))),
        )
        .chain(
            p.load_balancer_ips
                .iter()
                .map(move |ip| fe(FrontendKind::LoadBalancerIp, Some(*ip))),
        )
        .chain(p.node_port.map(|n| Frontend {
            kind: FrontendKind::NodePort,
            ip: None,
            port: n,
            ..fe(FrontendKind::NodePort, None)
        }))
}

/// The health-check node port's frontends: TCP on every node address of both families.
fn health_check_frontends(plan: &ServicePlan) -> impl Iterator<Item = Frontend> + '_ {
    plan.health_check.iter().flat_map(|h| {
        IpFamily::ALL.map(|family| Frontend {
            kind: FrontendKind::HealthCheckNodePort,
            family,
            ip: None,
            port: h.health_check_node_port,
            protocol: Protocol::TCP,
        })
    })
}

/// Every frontend a Service's plan claims: its ports' and its health-check node port's.
pub fn service_frontends(plan: &ServicePlan) -> impl Iterator<Item = Frontend> + '_ {
    plan.ports
        .iter()
        .flat_map(frontends)
        .chain(health_check_frontends(plan))
}

/// The key two claims collide on: what the kernel would match. An external IP and a
/// cluster IP at the same address and port collide; a node port collides with node ports
/// and health-check node ports (the NodePort rule takes the health check's packets).
fn collision_key(fe: &Frontend) -> (bool, IpFamily, Option<IpAddr>, u16, Protocol) {
    (
        matches!(
            fe.kind,
            FrontendKind::NodePort | FrontendKind::HealthCheckNodePort
        ),
        fe.family,
        fe.ip,
        fe.port,
        fe.protocol,
    )
}

/// Decides every conflict among `services` and returns the conflicts and, for each
/// Service that lost something, its plan without the lost frontends. `age` gives a
/// Service's creation time and `field` the field a family's cluster IP was read from;
/// `reserved` what no cluster IP may be.
pub fn resolve(
    services: &BTreeMap<ServiceName, Arc<ServicePlan>>,
    age: impl Fn(&ServiceName) -> Age,
    field: impl Fn(&ServiceName, IpFamily) -> Option<String>,
    reserved: &Reserved,
    allow_external_ip_overlap: bool,
) -> (Vec<Conflict>, BTreeMap<ServiceName, Arc<ServicePlan>>) {
    let node_ips = &reserved.node_ips;
    // Claim order: oldest first, then by name (the map is sorted by name; a stable sort
    // by age keeps that order among equals).
    let mut order: Vec<(&ServiceName, &Arc<ServicePlan>, Age)> =
        services.iter().map(|(n, p)| (n, p, age(n))).collect();
    order.sort_by_key(|(_, _, a)| (a.is_none(), *a));

    let cluster_ips: BTreeMap<IpAddr, &ServiceName> = if allow_external_ip_overlap {
        BTreeMap::new()
    } else {
        let mut m = BTreeMap::new();
        for (name, plan, _) in &order {
            for p in &plan.ports {
                m.entry(p.cluster_ip).or_insert(*name);
            }
        }
        m
    };

    let mut owner: BTreeMap<_, &ServiceName> = BTreeMap::new();
    let mut conflicts = Vec::new();
    for (name, plan, _) in &order {
        let claims = plan
            .ports
            .iter()
            .flat_map(|p| frontends(p).map(|fe| (p.service_port.port_name.as_str(), fe)));
        for (port_name, fe) in claims {
            let reason = match fe.kind {
                FrontendKind::ClusterIp => {
                    cluster_ip_refusal(fe.ip.expect("cluster IP frontends have an IP"), reserved)
                }
                FrontendKind::ExternalIp | FrontendKind::LoadBalancerIp
                    if !allow_external_ip_overlap =>
                {
                    let ip = fe.ip.expect("external and LB frontends have an IP");
                    match cluster_ips.get(&ip) {
                        Some(o) if *o != *name => Some(ConflictReason::ClusterIpCapture {
                            owner: (*o).clone(),
                        }),
                        _ if node_ips.contains(&ip) => Some(ConflictReason::NodeIpCapture),
                        _ => None,
                    }
                }
                _ => None,
            };
            let reason = reason.or_else(|| match owner.get(&collision_key(&fe)) {
                Some(o) if *o != *name => Some(ConflictReason::Claimed {
                    owner: (*o).clone(),
                }),
                Some(_) => None,
                None => {
                    owner.insert(collision_key(&fe), *name);
                    None
                }
            });
            if let Some(reason) = reason {
                conflicts.push(Conflict {
                    service: (*name).clone(),
                    port_name: port_name.to_string(),
                    frontend: fe,
                    field: (fe.kind == FrontendKind::ClusterIp)
                        .then(|| field(name, fe.family))
                        .flatten(),
                    reason,
                });
            }
        }
        // The health-check node port listens on every address of both families: it
        // claims its port in both, after the Service's own ports, or in neither.
        let taken = health_check_frontends(plan).find_map(|fe| {
            let o = owner.get(&collision_key(&fe))?;
            (*o != *name).then(|| (fe, (*o).clone()))
        });
        match taken {
            Some((frontend, o)) => conflicts.push(Conflict {
                service: (*name).clone(),
                port_name: String::new(),
                frontend,
                field: None,
                reason: ConflictReason::Claimed { owner: o },
            }),
            None => {
                for fe in health_check_frontends(plan) {
                    owner.insert(collision_key(&fe), *name);
                }
            }
        }
    }
    conflicts.sort_by(|a, b| {
        (&a.service, &a.port_name, &a.frontend).cmp(&(&b.service, &b.port_name, &b.frontend))
    });

    let mut patched: BTreeMap<ServiceName, Arc<ServicePlan>> = BTreeMap::new();
    for c in &conflicts {
        let plan = patched
            .entry(c.service.clone())
            .or_insert_with(|| services[&c.service].clone());
        remove_frontend(Arc::make_mut(plan), c);
    }
    (conflicts, patched)
}

/// `plan` without the frontends its `conflicts` refuse (those of other Services are
/// ignored).
pub fn patch(plan: &Arc<ServicePlan>, conflicts: &[Conflict]) -> Arc<ServicePlan> {
    let mut out = plan.clone();
    for c in conflicts.iter().filter(|c| c.service == plan.service) {
        remove_frontend(Arc::make_mut(&mut out), c);
    }
    out
}

fn remove_frontend(plan: &mut ServicePlan, c: &Conflict) {
    let fe = &c.frontend;
    let port_of = |p: &ServicePortPlan| {
        p.service_port.port_name == c.port_name
            && p.family == fe.family
            && p.protocol == fe.protocol
    };
    match fe.kind {
        FrontendKind::ClusterIp => plan.ports.retain(|p| !port_of(p)),
        FrontendKind::HealthCheckNodePort => plan.health_check = None,
        _ => {
            for p in plan.ports.iter_mut().filter(|p| port_of(p)) {
                match fe.kind {
                    FrontendKind::ExternalIp => p.external_ips.retain(|ip| Some(*ip) != fe.ip),
                    FrontendKind::LoadBalancerIp => {
                        p.load_balancer_ips.retain(|ip| Some(*ip) != fe.ip)
                    }
                    _ => p.node_port = None,
                }
                if !p.externally_accessible() {
                    p.external.clear();
                }
            }
        }
    }
}

/// [`resolve`] applied to a whole plan: replaces the losers' plans and records the
/// conflicts in `plan.conflicts` and the warnings in `plan.cluster_ip_warnings`. `other_nodes`: other Nodes' addresses.
pub fn apply(
    plan: &mut NodePlan,
    age: impl Fn(&ServiceName) -> Age,
    field: impl Fn(&ServiceName, IpFamily) -> Option<String>,
    other_nodes: BTreeMap<IpAddr, String>,
    allow_external_ip_overlap: bool,
) {
    let reserved = Reserved::of(plan, other_nodes);
    let (conflicts, patched) = resolve(
        &plan.services,
        age,
        &field,
        &reserved,
        allow_external_ip_overlap,
    );
    plan.services.extend(patched);
    plan.conflicts = conflicts;
    plan.cluster_ip_warnings = cluster_ip_warnings(&plan.services, field, &reserved);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn which_addresses_no_cluster_ip_may_take() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let reserved = Reserved {
            node_ips: vec![ip("10.200.0.1"), ip("fd00::1")],
            other_nodes: BTreeMap::from([
                (ip("10.200.0.2"), "node-b".to_string()),
                (ip("10.96.0.7"), "node-c".to_string()),
            ]),
            service_cidrs: vec![net("10.96.0.0/16")],
        };
        let outside = || {
            Some(ClusterIpWarningReason::OutsideServiceCidrs {
                service_cidrs: vec![net("10.96.0.0/16")],
            })
        };
        let other = |n: &str| Some(ClusterIpWarningReason::OtherNodeAddress { node: n.into() });
        // (address, refused, programmed with a warning); a refused address is never
        // programmed, so its warning is not asked.
        let rows: &[(&str, Option<ConflictReason>, Option<ClusterIpWarningReason>)] = &[
            ("10.96.0.10", None, None),
            ("10.200.0.1", Some(ConflictReason::NodeAddress), None),
            ("fd00::1", Some(ConflictReason::NodeAddress), None),
            // Upstream programs these: kproxy does too, with a warning.
            ("10.200.0.2", None, other("node-b")),
            // A Node's address inside the service CIDR is still that Node's.
            ("10.96.0.7", None, other("node-c")),
            ("192.0.2.1", None, outside()),
            // No IPv6 service CIDR is known: IPv6 is not range-checked.
            ("fd00:96::1", None, None),
        ];
        for (addr, refused, warned) in rows {
            assert_eq!(&cluster_ip_refusal(ip(addr), &reserved), refused, "{addr}");
            if refused.is_none() {
                assert_eq!(&cluster_ip_warning(ip(addr), &reserved), warned, "{addr}");
            }
        }
        // Nothing known, nothing refused or warned of.
        assert_eq!(
            cluster_ip_warning(ip("192.0.2.1"), &Reserved::default()),
            None
        );
    }
}
