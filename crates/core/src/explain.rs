//! Explanations for people: the plan as a table, and for one Service, per port and per
//! kind of traffic, which endpoints are used and why each other endpoint is not. The
//! reasons are derived from the same `ServicePortPlan` the dataplane programs, never
//! from a second decision.

use std::fmt::Write;

use crate::model::{EndpointAddr, TrafficPolicy};
use crate::plan::{
    EndpointSet, EndpointState, NodePlan, ServicePlan, ServicePortPlan, SourceClass, TopologyMode,
    Verdict,
};

/// One line per service port and family, with its frontends and endpoint counts.
pub fn plan_table(plan: &NodePlan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "node {}{}{}",
        plan.node,
        plan.zone
            .as_deref()
            .map(|z| format!(" (zone {z})"))
            .unwrap_or_default(),
        if plan.node_eligible {
            String::new()
        } else {
            let signals: Vec<&str> = plan.node_drain_signals.iter().map(|d| d.as_str()).collect();
            format!(" [not eligible, draining: {}]", signals.join(", "))
        }
    );
    let _ = writeln!(
        out,
        "{:<40} {:<5} {:<26} {:>6} {:>7} {:>5} {:>4}  {:<14} EXTERNAL",
        "SERVICE PORT", "FAM", "CLUSTER IP", "NODEP", "CLUSTER", "LOCAL", "ALL", "POLICY i/e"
    );
    for p in plan.service_ports() {
        let count = |l: &Option<Vec<EndpointAddr>>| match l {
            None => "-".to_string(),
            Some(l) => l.len().to_string(),
        };
        let ext: Vec<String> = p
            .load_balancer_ips
            .iter()
            .map(|ip| format!("lb:{ip}"))
            .chain(p.external_ips.iter().map(|ip| format!("ext:{ip}")))
            .collect();
        let _ = writeln!(
            out,
            "{:<40} {:<5} {:<26} {:>6} {:>7} {:>5} {:>4}  {:<14} {}",
            p.service_port.to_string(),
            p.family.as_str(),
            EndpointAddr::new(p.cluster_ip, p.port).to_string(),
            p.node_port
                .map(|n| n.to_string())
                .unwrap_or_else(|| "-".into()),
            count(&p.cluster_endpoints),
            count(&p.local_endpoints),
            p.all_reachable_endpoints.len(),
            format!(
                "{:?}/{:?}",
                p.internal_traffic_policy, p.external_traffic_policy
            ),
            ext.join(",")
        );
    }
    let checks: Vec<_> = plan.health_checks().collect();
    if !checks.is_empty() {
        let _ = writeln!(out, "\nHEALTH-CHECK NODE PORTS");
        for h in checks {
            let _ = writeln!(
                out,
                "{:<40} :{:<5} localEndpoints={} → {}",
                h.service.to_string(),
                h.health_check_node_port,
                h.local_endpoints,
                if h.local_endpoints > 0 { "200" } else { "503" }
            );
        }
    }
    let held: Vec<(&ServicePortPlan, &EndpointState, crate::warmup::Hold)> = plan
        .service_ports()
        .flat_map(|p| {
            p.endpoints
                .iter()
                .filter_map(move |e| e.warmup.as_deref().map(|h| (p, e, *h)))
        })
        .collect();
    if !held.is_empty() {
        let _ = writeln!(out, "\nHELD FOR WARM-UP (ready, no new connection yet)");
        for (p, e, h) in held {
            let _ = writeln!(
                out,
                "{:<40} {:<5} {:<26} until {} (ready since {})",
                p.service_port.to_string(),
                p.family.as_str(),
                e.addr.to_string(),
                h.release,
                h.ready_since
            );
        }
    }
    out.push_str(PLAN_TABLE_LEGEND);
    out
}

/// What `plan_table`'s columns mean, printed under it.
const PLAN_TABLE_LEGEND: &str = "
NODEP       the NodePort (- none)
CLUSTER     endpoints that traffic under Cluster policy reaches from this node (- no traffic of this port uses Cluster policy)
LOCAL       endpoints on this node that traffic under Local policy reaches, serving-terminating ones included when no
            ready one is left (- no traffic uses Local policy)
ALL         every endpoint this node may forward to (CLUSTER and LOCAL together)
POLICY i/e  internalTrafficPolicy / externalTrafficPolicy
EXTERNAL    load-balancer (lb:) and external (ext:) IPs
HELD FOR WARM-UP  endpoints ready in their slice that kproxy run holds back from new connections until the time shown
            (--endpoint-warmup): they count as not ready; a plan from scratch (plan, explain) holds none
localEndpoints (health-check node ports) counts only READY endpoints on this node: terminating ones still serve
            (LOCAL) but answer 503, so the load balancer stops sending new connections while they drain.
";

/// A full explanation of one Service on this node.
pub fn explain_service(plan: &NodePlan, svc: &ServicePlan) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Service {} on node {}{}",
        svc.service,
        plan.node,
        plan.zone
            .as_deref()
            .map(|z| format!(" (zone {z})"))
            .unwrap_or_default()
    );
    if svc.ports.is_empty() {
        let _ = writeln!(out, "  no ports: nothing is proxied");
    }
    for p in &svc.ports {
        explain_port(&mut out, plan, p);
    }
    match &svc.health_check {
        Some(h) => {
            let _ = writeln!(
                out,
                "\nhealth-check node port {}: {} (localEndpoints={}: {})",
                h.health_check_node_port,
                if h.local_endpoints > 0 {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                },
                h.local_endpoints,
                if h.local_endpoints > 0 {
                    "this node has ready endpoints; the load balancer keeps sending new connections here"
                } else {
                    "no ready endpoint on this node (terminating ones do not count); the load balancer should stop sending new connections here"
                }
            );
        }
        None => {
            let _ = writeln!(
                out,
                "\nno health-check node port (only LoadBalancer Services with externalTrafficPolicy Local and a healthCheckNodePort have one)"
            );
        }
    }
    out
}

fn explain_port(out: &mut String, plan: &NodePlan, p: &ServicePortPlan) {
    let _ = writeln!(
        out,
        "\nport {} ({}), {} {}",
        p.service_port, p.family, p.protocol, p.port
    );
    let _ = writeln!(
        out,
        "  internalTrafficPolicy {:?}, externalTrafficPolicy {:?}{}{}",
        p.internal_traffic_policy,
        p.external_traffic_policy,
        match p.session_affinity_timeout {
            Some(t) => format!(", sessionAffinity ClientIP ({t}s)"),
            None => String::new(),
        },
        match &p.topology {
            TopologyMode::None => String::new(),
            TopologyMode::PreferSameZone(z) => format!(", topology: endpoints hinted for zone {z}"),
            TopologyMode::PreferSameNode =>
                ", topology: endpoints hinted for this node".to_string(),
        }
    );
    if p.endpoints.is_empty() {
        let _ = writeln!(out, "  no endpoints in any EndpointSlice for this port");
    }
    let mut frontends = vec![format!(
        "cluster IP {}",
        EndpointAddr::new(p.cluster_ip, p.port)
    )];
    let _ = writeln!(out, "  traffic to {}:", frontends.remove(0));
    for r in &p.internal {
        explain_rule(out, plan, p, r.from, r.verdict, false);
    }
    let mut ext = Vec::new();
    if let Some(np) = p.node_port {
        ext.push(format!("NodePort {np}"));
    }
    ext.extend(p.external_ips.iter().map(|ip| format!("external IP {ip}")));
    ext.extend(
        p.load_balancer_ips
            .iter()
            .map(|ip| format!("load-balancer IP {ip}")),
    );
    if !ext.is_empty() {
        let _ = writeln!(out, "  traffic to {}:", ext.join(", "));
        if let Some(fw) = &p.firewall {
            let nets: Vec<String> = fw.allowed_sources.iter().map(|n| n.to_string()).collect();
            let _ = writeln!(
                out,
                "    load-balancer IPs accept new connections only from {}",
                nets.join(", ")
            );
        }
        for r in &p.external {
            explain_rule(out, plan, p, r.from, r.verdict, true);
        }
    }
}

fn explain_rule(
    out: &mut String,
    plan: &NodePlan,
    p: &ServicePortPlan,
    from: SourceClass,
    verdict: Verdict,
    external: bool,
) {
    let who = match from {
        SourceClass::LocalPod => "from pods on this node",
        SourceClass::ThisNode => "from this node itself",
        SourceClass::Any => "from anywhere else",
    };
    match verdict {
        Verdict::Reject => {
            let _ = writeln!(
                out,
                "    {who}: REJECT — no ready or serving endpoint anywhere in the cluster"
            );
        }
        Verdict::Drop => {
            let _ = writeln!(
                out,
                "    {who}: DROP — endpoints exist elsewhere, but none on this node (policy Local): the connection times out{}",
                if external {
                    "; a load balancer keeps a retransmitted SYN on the node it chose, so it must stop choosing this node (what a 503 from the health-check node port tells it)"
                } else {
                    ""
                }
            );
            for e in &p.endpoints {
                let _ = writeln!(
                    out,
                    "      ✗ {} — {}",
                    e.addr,
                    why_not(plan, p, EndpointSet::Local, e)
                );
            }
        }
        Verdict::Forward {
            endpoints,
            masquerade,
        } => {
            let list = p.endpoints_for(endpoints);
            let _ = writeln!(
                out,
                "    {who}: {} endpoint(s) by {:?} policy, {}",
                list.len(),
                endpoints,
                if masquerade {
                    "source masqueraded to this node"
                } else {
                    "client source address kept"
                }
            );
            for e in &p.endpoints {
                if list.contains(&e.addr) {
                    let _ = writeln!(out, "      ✓ {} — {}", e.addr, why_used(p, endpoints, e));
                } else {
                    let _ = writeln!(
                        out,
                        "      ✗ {} — {}",
                        e.addr,
                        why_not(plan, p, endpoints, e)
                    );
                }
            }
        }
    }
}

fn location(e: &EndpointState) -> String {
    match &e.placement.node_name {
        Some(n) => format!("on {n}"),
        None => "on an unknown node".to_string(),
    }
}

/// Why endpoint `e` is in the `set` list of port `p`: ready, or categorisation's
/// failover (`ServicePortPlan::uses_terminating`).
fn why_used(p: &ServicePortPlan, set: EndpointSet, e: &EndpointState) -> String {
    let c = e.conditions;
    let state = if p.uses_terminating(set) {
        "serving and terminating: failover, no ready endpoint qualifies"
    } else if c.ready && c.terminating {
        "ready (terminating, but ready: publishNotReadyAddresses)"
    } else {
        "ready"
    };
    format!("{state}, {}", location(e))
}

/// Why endpoint `e` is not in the `set` list of port `p`.
pub fn why_not(
    plan: &NodePlan,
    p: &ServicePortPlan,
    set: EndpointSet,
    e: &EndpointState,
) -> String {
    let c = e.conditions;
    if let Some(h) = e.warmup.as_deref() {
        return format!(
            "ready since {}, held for warm-up until {} (its server may not listen yet; --endpoint-warmup), {}",
            h.ready_since,
            h.release,
            location(e)
        );
    }
    if !c.ready && !c.serving {
        return format!(
            "not serving{}, {}",
            if c.terminating { " (terminating)" } else { "" },
            location(e)
        );
    }
    if !c.ready && !c.terminating {
        return format!("not ready (serving but not terminating), {}", location(e));
    }
    if set == EndpointSet::Local && !e.is_local {
        let why = if p.internal_traffic_policy == TrafficPolicy::Local
            && p.external_traffic_policy != TrafficPolicy::Local
        {
            "internalTrafficPolicy is Local"
        } else if p.internal_traffic_policy != TrafficPolicy::Local {
            "externalTrafficPolicy is Local"
        } else {
            "traffic policy is Local"
        };
        return format!("{}, and {why}", location(e));
    }
    let list = p.endpoints_for(set);
    if !c.ready {
        // Serving and terminating, yet not chosen: categorisation found ready endpoints
        // for this policy, or did not fall back at all (failover switched off).
        return if !p.uses_terminating(set) && !list.is_empty() {
            format!("terminating, and {} ready endpoint(s) exist", list.len())
        } else {
            "terminating, and failover to terminating endpoints is off".to_string()
        };
    }
    match &p.topology {
        TopologyMode::PreferSameZone(z) if set == EndpointSet::Cluster => {
            match &e.placement.zone_hints {
                Some(h) => format!("hinted for zone {} (this node is in zone {z})", h.join(",")),
                None => "has no zone hint".to_string(),
            }
        }
        TopologyMode::PreferSameNode if set == EndpointSet::Cluster => {
            match &e.placement.node_hints {
                Some(h) => format!(
                    "hinted for node {} (this node is {})",
                    h.join(","),
                    plan.node
                ),
                None => "has no node hint".to_string(),
            }
        }
        _ => "not selected (local ready endpoints are preferred)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{self, Spec};
    use crate::{PlanConfig, plan};

    /// The failover reasons are categorisation's (`uses_terminating`), per setting.
    #[test]
    fn failover_reasons_come_from_categorisation() {
        let spec = Spec {
            terminating_every: 1,
            etp_local_every: 0,
            hinted_every: 0,
            ..Spec::new(1, 2)
        };
        let state = synthetic::cluster(&spec);
        let name = synthetic::service(&spec, 0).name;
        for (proxy_terminating_endpoints, want, port_uses) in [
            (
                true,
                "✓ 10.244.0.0:8080 — serving and terminating: failover, no ready endpoint qualifies",
                true,
            ),
            (
                false,
                // No fallback: nothing usable anywhere.
                "REJECT — no ready or serving endpoint anywhere in the cluster",
                false,
            ),
        ] {
            let cfg = PlanConfig {
                proxy_terminating_endpoints,
                ..PlanConfig::default()
            };
            let p = plan(&state, "node-0", &cfg);
            let svc = &p.services[&name];
            assert_eq!(
                svc.ports[0].uses_terminating(EndpointSet::Cluster),
                port_uses
            );
            let text = explain_service(&p, svc);
            assert!(text.contains(want), "{text}");
        }
    }
}
