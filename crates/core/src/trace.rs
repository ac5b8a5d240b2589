//! The fate of one new connection under a plan, computed from the plan alone: which
//! frontend it hits, which rule matches its source, and the verdict. `kproxy trace`
//! prints it, and the dataplane tests check that the kernel does exactly this.

use std::net::IpAddr;

use serde::Serialize;

use crate::frontend::FrontendKind;
use crate::model::{EndpointAddr, IpFamily, Protocol};
use crate::plan::{LocalPods, NodePlan, ServicePortPlan, SourceClass, TrafficRule, Verdict};

/// A new connection as it arrives at the node (or leaves a process on it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub dport: u16,
    pub proto: Protocol,
    /// Input interface, for interface-based local-pod detectors; `None` when unknown
    /// or locally generated.
    pub in_interface: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum TraceVerdict {
    /// Translated to one endpoint of `endpoints`.
    Dnat,
    Drop,
    Reject,
    /// kproxy does not touch the packet.
    None,
}

/// What happens to the packet. `endpoints` is the set the random choice is made from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Trace {
    pub verdict: TraceVerdict,
    pub endpoints: Vec<EndpointAddr>,
    pub masquerade: bool,
    pub reason: String,
}

/// Traces `pkt` through `plan`. `local_addresses` are this node's own addresses (for
/// NodePorts on all local addresses and the "from this node" rule); when empty the
/// plan's node IPs are used.
pub fn trace(plan: &NodePlan, pkt: &Packet, local_addresses: &[IpAddr]) -> Trace {
    let family = IpFamily::of(&pkt.dst);
    if IpFamily::of(&pkt.src) != family {
        return none("source and destination are of different IP families");
    }
    let fam = plan.family(family);
    let locals: Vec<IpAddr> = if local_addresses.is_empty() {
        fam.node_ips.clone()
    } else {
        local_addresses.to_vec()
    };
    let is_local_addr = |ip: &IpAddr| locals.contains(ip);

    let mut cluster_ip_seen = false;
    for sp in plan.service_ports().filter(|sp| sp.family == family) {
        if sp.cluster_ip == pkt.dst {
            cluster_ip_seen = true;
        }
        if sp.protocol != pkt.proto {
            continue;
        }
        let frontend = if sp.cluster_ip == pkt.dst && sp.port == pkt.dport {
            FrontendKind::ClusterIp
        } else if sp.port == pkt.dport && sp.load_balancer_ips.contains(&pkt.dst) {
            FrontendKind::LoadBalancerIp
        } else if sp.port == pkt.dport && sp.external_ips.contains(&pkt.dst) {
            FrontendKind::ExternalIp
        } else if sp.node_port == Some(pkt.dport)
            && fam
                .node_port_addresses
                .selects(&pkt.dst, is_local_addr(&pkt.dst))
        {
            FrontendKind::NodePort
        } else {
            continue;
        };
        return trace_port(sp, frontend, pkt, &fam.local_pods, &locals);
    }
    if cluster_ip_seen {
        return Trace {
            verdict: TraceVerdict::Reject,
            endpoints: Vec::new(),
            masquerade: false,
            reason: format!(
                "{} is a cluster IP, but no Service defines port {}/{}",
                pkt.dst, pkt.dport, pkt.proto
            ),
        };
    }
    if fam.service_cidrs.iter().any(|c| c.contains(&pkt.dst)) {
        return Trace {
            verdict: TraceVerdict::Drop,
            endpoints: Vec::new(),
            masquerade: false,
            reason: format!(
                "{} is inside a service CIDR, but no Service owns it (unallocated cluster IP)",
                pkt.dst
            ),
        };
    }
    none("no Service frontend matches the destination")
}

fn none(reason: &str) -> Trace {
    Trace {
        verdict: TraceVerdict::None,
        endpoints: Vec::new(),
        masquerade: false,
        reason: reason.to_string(),
    }
}

/// Whether `class` matches the packet's source.
pub fn source_matches(
    class: SourceClass,
    pkt: &Packet,
    local_pods: &LocalPods,
    local_addresses: &[IpAddr],
) -> bool {
    match class {
        SourceClass::Any => true,
        SourceClass::ThisNode => local_addresses.contains(&pkt.src),
        SourceClass::LocalPod => match local_pods {
            LocalPods::None => false,
            LocalPods::Cidrs(cidrs) => cidrs.iter().any(|c| c.contains(&pkt.src)),
            LocalPods::InterfacePrefix(p) => pkt
                .in_interface
                .as_deref()
                .is_some_and(|i| i.starts_with(p.as_str())),
            LocalPods::Bridge(b) => pkt.in_interface.as_deref() == Some(b.as_str()),
        },
    }
}

fn trace_port(
    sp: &ServicePortPlan,
    frontend: FrontendKind,
    pkt: &Packet,
    local_pods: &LocalPods,
    locals: &[IpAddr],
) -> Trace {
    let what = format!(
        "{} {} of {}",
        frontend.describe(),
        frontend_addr(sp, frontend),
        sp.service_port
    );
    if frontend == FrontendKind::LoadBalancerIp
        && let Some(fw) = &sp.firewall
        && !fw.allowed_sources.iter().any(|n| n.contains(&pkt.src))
    {
        return Trace {
            verdict: TraceVerdict::Drop,
            endpoints: Vec::new(),
            masquerade: false,
            reason: format!(
                "{what}: source {} is outside loadBalancerSourceRanges",
                pkt.src
            ),
        };
    }
    let rules: &[TrafficRule] = if frontend == FrontendKind::ClusterIp {
        &sp.internal
    } else {
        &sp.external
    };
    let Some(rule) = rules
        .iter()
        .find(|r| source_matches(r.from, pkt, local_pods, locals))
    else {
        // Invariant: the planner always ends a rule list with `Any`.
        return none("no rule matched");
    };
    let source = match rule.from {
        SourceClass::LocalPod => format!("source {} is a pod on this node", pkt.src),
        SourceClass::ThisNode => format!("source {} is this node", pkt.src),
        SourceClass::Any => format!("source {}", pkt.src),
    };
    match rule.verdict {
        Verdict::Forward {
            endpoints,
            masquerade,
        } => {
            let list = sp.endpoints_for(endpoints).to_vec();
            // Hairpin: a local pod's connection to itself through the Service is
            // masqueraded (`ServicePortPlan::hairpin_endpoints`); it is certain only when
            // every candidate is the source.
            let hairpin = !list.is_empty()
                && list
                    .iter()
                    .all(|e| e.ip == pkt.src && sp.is_local_endpoint(*e));
            Trace {
                verdict: TraceVerdict::Dnat,
                masquerade: masquerade || hairpin,
                reason: format!(
                    "{what}: {source}: {:?}-policy endpoints ({}), {}",
                    endpoints,
                    list.len(),
                    if masquerade || hairpin {
                        "masqueraded"
                    } else {
                        "client address kept"
                    }
                ),
                endpoints: list,
            }
        }
        Verdict::Drop => Trace {
            verdict: TraceVerdict::Drop,
            endpoints: Vec::new(),
            masquerade: false,
            reason: format!("{what}: {source}: endpoints exist, but none usable for this traffic"),
        },
        Verdict::Reject => Trace {
            verdict: TraceVerdict::Reject,
            endpoints: Vec::new(),
            masquerade: false,
            reason: format!("{what}: {source}: no usable endpoint anywhere"),
        },
    }
}

fn frontend_addr(sp: &ServicePortPlan, frontend: FrontendKind) -> String {
    match frontend {
        FrontendKind::NodePort => format!("port {}", sp.node_port.unwrap_or(0)),
        FrontendKind::ClusterIp => EndpointAddr::new(sp.cluster_ip, sp.port).to_string(),
        _ => format!("port {}", sp.port),
    }
}
