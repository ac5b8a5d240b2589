//! Real packets through real rules: every traffic source × policy combination ×
//! endpoint situation, on one fabric (one node namespace, re-synced per plan, so the
//! delta path is exercised too). For every packet sent, `kproxy_core::trace` must
//! predict exactly what the kernel did: the verdict, the backend set, and whether the
//! client address was preserved.

mod common;

use std::net::IpAddr;

use common::fabric::{CLIENT_IP, Fabric, From, NODE_ADDRS, Outcome};
use common::*;
use kproxy_core::config::LocalDetectorConfig;
use kproxy_core::model::Protocol;
use kproxy_core::trace::{Packet, TraceVerdict, trace};
use kproxy_core::{NodePlan, PlanConfig};

thread_local! {
    /// Mismatches `check` found, per test: libtest runs each test on its own thread, so
    /// one test's mismatch is never reported (or lost) under another's name.
    static FAILS: std::cell::RefCell<Vec<String>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn mismatch(msg: String) {
    FAILS.with(|f| f.borrow_mut().push(msg));
}

/// Fails the calling test with every mismatch `check` recorded for it.
fn assert_no_mismatches() {
    let fails = FAILS.with(|f| f.take());
    assert!(
        fails.is_empty(),
        "{} mismatches:\n{}",
        fails.len(),
        fails.join("\n")
    );
}

const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nspec: {podCIDRs: [10.244.1.0/24]}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.1}]}\n";

/// ready, serving, terminating
type Cond = (bool, bool, bool);
const READY: Cond = (true, true, false);
const SERVING_TERMINATING: Cond = (false, true, true);
const TERMINATING: Cond = (false, false, true);

struct Svc<'a> {
    etp: &'a str,
    itp: &'a str,
    /// (pod name, node, conditions)
    endpoints: &'a [(&'a str, &'a str, Cond)],
    extra: &'a str,
}

fn manifest(s: &Svc) -> String {
    let mut m = NODE.to_string();
    m += &format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: ns}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [203.0.113.50]\n  externalTrafficPolicy: {}\n  internalTrafficPolicy: {}\n  ports:\n  - {{name: http, port: 80, protocol: TCP, nodePort: 30080}}\n  - {{name: dns, port: 53, protocol: UDP, nodePort: 30053}}\n{}status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.10}}]}}}}\n",
        s.etp, s.itp, s.extra
    );
    if !s.endpoints.is_empty() {
        m += "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 8080, protocol: UDP}]\nendpoints:\n";
        for (pod, node, (r, s, t)) in s.endpoints {
            // `x` is an endpoint no fabric pod answers for (plan-only tests).
            let addr = common::fabric::PODS
                .iter()
                .chain(&[("x", "10.244.1.4")])
                .find(|(n, _)| n == pod)
                .expect("pod")
                .1;
            m += &format!(
                "- {{addresses: [{addr}], nodeName: {node}, conditions: {{ready: {r}, serving: {s}, terminating: {t}}}}}\n"
            );
        }
    }
    m
}

fn config() -> PlanConfig {
    PlanConfig {
        local_detector: LocalDetectorConfig::InterfaceNamePrefix("kpv".into()),
        ..PlanConfig::default()
    }
}

#[allow(clippy::too_many_arguments)]
/// Sends `tries` probes and checks each against the trace. Returns the pods that answered.
fn check(
    f: &Fabric,
    plan: &NodePlan,
    from: From,
    dst: &str,
    port: u16,
    proto: Protocol,
    tries: usize,
    label: &str,
) -> Vec<String> {
    let v6 = ip(dst).is_ipv6();
    let (src, iface) = if v6 { f.source6(from) } else { f.source(from) };
    let pkt = Packet {
        src,
        dst: ip(dst),
        dport: port,
        proto,
        in_interface: iface,
    };
    let locals: Vec<IpAddr> = NODE_ADDRS
        .iter()
        .chain(&common::fabric::NODE_ADDRS6)
        .map(|a| ip(a))
        .collect();
    let t = trace(plan, &pkt, &locals);
    let ctx = format!("{label}: {from:?} -> {dst}:{port}/{proto}: trace {t:?}");
    let mut answered = Vec::new();
    let tries = if matches!(t.verdict, TraceVerdict::Dnat) {
        tries
    } else {
        1
    };
    for _ in 0..tries {
        let got = f.probe(from, ip(dst), port, proto);
        match t.verdict {
            TraceVerdict::Dnat => {
                let Outcome::Answer { pod, seen } = &got else {
                    mismatch(format!("{ctx}: kernel gave {got:?}"));
                    continue;
                };
                let allowed: Vec<&str> = t
                    .endpoints
                    .iter()
                    .filter_map(|e| f.pod_name(e.ip))
                    .collect();
                assert!(
                    allowed.contains(&pod.as_str()),
                    "{ctx}: answered by {pod}, not in {allowed:?}"
                );
                // Hairpin: trace marks masquerade only when *every* candidate is the
                // source; when the random choice happens to pick the source itself the
                // kernel masquerades too (docs/upstream-semantics.md §c.6).
                let hairpin = f.pod_name(src) == Some(pod.as_str());
                assert_eq!(
                    *seen != src,
                    t.masquerade || hairpin,
                    "{ctx}: {pod} saw {seen}"
                );
                answered.push(pod.clone());
            }
            TraceVerdict::Drop => {
                if got != Outcome::Timeout {
                    mismatch(format!("{ctx}: kernel gave {got:?}"));
                }
            }
            TraceVerdict::Reject => {
                if got != Outcome::Refused {
                    mismatch(format!("{ctx}: kernel gave {got:?}"));
                }
            }
            TraceVerdict::None => {}
        }
    }
    answered
}

#[test]
fn policy_matrix() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    type Situation<'a> = (&'a str, &'a [(&'a str, &'a str, Cond)]);
    let situations: [Situation; 5] = [
        ("ready", &[("a", "node-a", READY), ("r", "node-b", READY)]),
        (
            "serving-terminating only",
            &[
                ("b", "node-a", SERVING_TERMINATING),
                ("r", "node-b", SERVING_TERMINATING),
            ],
        ),
        (
            "non-serving terminating only",
            &[("a", "node-a", TERMINATING), ("r", "node-b", TERMINATING)],
        ),
        ("none anywhere", &[]),
        ("none local", &[("r", "node-b", READY)]),
    ];
    let sources = [From::Pod(0), From::Node, From::Client];
    let mut probes = 0;
    for etp in ["Cluster", "Local"] {
        for itp in ["Cluster", "Local"] {
            for (sit, eps) in situations {
                let svc = Svc {
                    etp,
                    itp,
                    endpoints: eps,
                    extra: "",
                };
                let plan = plan_from_yaml(&manifest(&svc), "node-a", &config());
                f.sync(&plan);
                let label = format!("eTP {etp} iTP {itp} {sit}");
                for from in sources {
                    for (dst, port) in [
                        ("10.96.0.10", 80),
                        ("10.200.0.1", 30080),
                        ("203.0.113.50", 80),
                        ("203.0.113.10", 80),
                    ] {
                        check(&f, &plan, from, dst, port, Protocol::TCP, 2, &label);
                        probes += 1;
                    }
                    // UDP: cluster IP and NodePort.
                    for (dst, port) in [("10.96.0.10", 53), ("10.200.0.1", 30053)] {
                        check(&f, &plan, from, dst, port, Protocol::UDP, 1, &label);
                        probes += 1;
                    }
                }
            }
        }
    }
    assert!(probes > 300);
    assert_no_mismatches();
}

#[test]
fn random_choice_covers_the_set_affinity_sticks_and_hairpin_masquerades() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    let cfg = config();
    // Without affinity: both endpoints answer over enough new connections.
    let eps = [("a", "node-a", READY), ("r", "node-b", READY)];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &eps,
            extra: "",
        }),
        "node-a",
        &cfg,
    );
    f.sync(&plan);
    let seen = check(
        &f,
        &plan,
        From::Client,
        "10.96.0.10",
        80,
        Protocol::TCP,
        40,
        "random",
    );
    assert!(
        seen.iter().any(|p| p == "a") && seen.iter().any(|p| p == "r"),
        "{seen:?}"
    );

    // ClientIP affinity: every connection of one client goes to the same endpoint.
    let aff =
        "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}\n";
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &eps,
            extra: aff,
        }),
        "node-a",
        &cfg,
    );
    f.sync(&plan);
    for (from, dst, port) in [
        (From::Client, "10.96.0.10", 80),
        (From::Client, "203.0.113.10", 80),
        (From::Pod(1), "10.96.0.10", 80),
    ] {
        let seen = check(&f, &plan, from, dst, port, Protocol::TCP, 8, "affinity");
        assert!(
            seen.windows(2).all(|w| w[0] == w[1]),
            "affinity broken for {from:?}: {seen:?}"
        );
    }

    // Hairpin: pod a reaching itself through the Service is masqueraded.
    let only_a = [("a", "node-a", READY)];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &only_a,
            extra: "",
        }),
        "node-a",
        &cfg,
    );
    f.sync(&plan);
    let seen = check(
        &f,
        &plan,
        From::Pod(0),
        "10.96.0.10",
        80,
        Protocol::TCP,
        2,
        "hairpin",
    );
    assert_eq!(seen, ["a", "a"]);
    // Unknown port on a live cluster IP: REJECT.
    check(
        &f,
        &plan,
        From::Client,
        "10.96.0.10",
        81,
        Protocol::TCP,
        1,
        "cluster-ips-check",
    );
    assert_no_mismatches();
}

/// Endpoint counts changing through delta syncs (each change moves the frontends to
/// another dispatch group): every endpoint of the current set answers on every
/// frontend, UDP included, and nothing else does.
#[test]
fn endpoint_count_changes_move_dispatch_groups_and_every_endpoint_answers() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    let cfg = config();
    let all = [
        ("a", "node-a", READY),
        ("b", "node-a", READY),
        ("r", "node-b", READY),
    ];
    let steps: [&[(&str, &str, Cond)]; 5] = [&all[..1], &all, &all[1..], &all, &[all[2]]];
    for (n, eps) in steps.iter().enumerate() {
        let plan = plan_from_yaml(
            &manifest(&Svc {
                etp: "Cluster",
                itp: "Cluster",
                endpoints: eps,
                extra: "",
            }),
            "node-a",
            &cfg,
        );
        let r = f.sync(&plan);
        assert_eq!(r.full, n == 0, "step {n}: {r:?}");
        let want: Vec<&str> = eps.iter().map(|e| e.0).collect();
        for (from, dst, port, proto) in [
            (From::Client, "10.96.0.10", 80, Protocol::TCP),
            (From::Pod(0), "10.96.0.10", 53, Protocol::UDP),
            (From::Client, "203.0.113.10", 80, Protocol::TCP),
            (From::Client, NODE_ADDRS[0], 30080, Protocol::TCP),
        ] {
            let mut seen = check(&f, &plan, from, dst, port, proto, 12 * want.len(), "count");
            seen.sort();
            seen.dedup();
            assert_eq!(seen, want, "step {n}: {from:?} -> {dst}:{port}/{proto}");
        }
    }
    assert_no_mismatches();
}

/// An eTP=Local Service's local endpoints on this node going 1 → 2 → 0 → 1, beside
/// Services that hold every dispatch group it moves between: each step is one
/// nfnetlink batch of elements (no chain, rule or set changes: its frontends go through
/// the shared eTP=Local dispatch), and real packets meet each step's rules — outside
/// clients reach the local endpoints only (dropped while there are none), this node
/// and local pods reach every endpoint (the node masqueraded), as `trace` predicts.
#[test]
fn etp_local_endpoint_count_changes_are_element_only_and_packets_follow() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    let cfg = config();
    let (a, b, r) = (
        ("a", "node-a", READY),
        ("b", "node-a", READY),
        ("r", "node-b", READY),
    );
    // Holders of the dispatch groups of every step: (Cluster, Local) counts (3, 2),
    // (2, 1), (1, 0).
    let mut holders = String::new();
    for (i, eps) in [[a, b, r].as_slice(), &[a, r], &[r]].iter().enumerate() {
        let svc = manifest(&Svc {
            etp: "Local",
            itp: "Cluster",
            endpoints: eps,
            extra: "",
        });
        let svc = svc.strip_prefix(NODE).expect("the node first");
        holders += &svc
            .replace("name: web", &format!("name: hold{i}"))
            .replace("service-name: web", &format!("service-name: hold{i}"))
            .replace("10.96.0.10", &format!("10.96.0.{}", 20 + i))
            .replace("203.0.113.50", &format!("203.0.113.{}", 60 + i))
            .replace("203.0.113.10", &format!("203.0.113.{}", 70 + i))
            .replace("30080", &format!("{}", 31000 + i))
            .replace("30053", &format!("{}", 31100 + i));
    }
    let steps: [&[(&str, &str, Cond)]; 4] = [&[a, r], &[a, b, r], &[r], &[a, r]];
    for (n, eps) in steps.iter().enumerate() {
        let svc = manifest(&Svc {
            etp: "Local",
            itp: "Cluster",
            endpoints: eps,
            extra: "",
        });
        let plan = plan_from_yaml(&(svc + &holders), "node-a", &cfg);
        let rep = f.sync(&plan);
        if n == 0 {
            assert!(rep.full, "{rep:?}");
        } else {
            let c = &rep.changes;
            assert!(
                !rep.full
                    && rep.netlink_bytes > 0
                    && c.chains_added + c.chains_changed + c.chains_deleted == 0
                    && c.sets_added + c.sets_deleted == 0,
                "step {n}: not element-only: {rep:?}"
            );
        }
        let dp = f.dp.clone();
        let v = f
            .node
            .run(move || dp.lock().expect("dp").verify().expect("verify"));
        assert!(v.differences.is_empty(), "step {n}: {:?}", v.differences);
        let local: Vec<&str> = eps
            .iter()
            .filter(|e| e.1 == "node-a")
            .map(|e| e.0)
            .collect();
        let all: Vec<&str> = eps.iter().map(|e| e.0).collect();
        for (from, dst, port, proto, want) in [
            (From::Client, "203.0.113.10", 80, Protocol::TCP, &local),
            (From::Client, "203.0.113.50", 53, Protocol::UDP, &local),
            (From::Client, NODE_ADDRS[0], 30080, Protocol::TCP, &local),
            (From::Node, "203.0.113.10", 80, Protocol::TCP, &all),
            (From::Pod(1), "203.0.113.50", 80, Protocol::TCP, &all),
            (From::Pod(0), NODE_ADDRS[0], 30053, Protocol::UDP, &all),
        ] {
            let tries = 12 * want.len().max(1);
            let mut seen = check(&f, &plan, from, dst, port, proto, tries, "etp-local");
            seen.sort();
            seen.dedup();
            assert_eq!(&seen, want, "step {n}: {from:?} -> {dst}:{port}/{proto}");
        }
    }
    assert_no_mismatches();
}

#[test]
fn load_balancer_source_ranges() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    let eps = [("a", "node-a", READY), ("r", "node-b", READY)];
    for (ranges, label) in [
        ("[198.51.100.0/24]", "client inside"),
        ("[192.0.2.0/24]", "client outside"),
    ] {
        let extra = format!("  loadBalancerSourceRanges: {ranges}\n");
        let plan = plan_from_yaml(
            &manifest(&Svc {
                etp: "Cluster",
                itp: "Cluster",
                endpoints: &eps,
                extra: &extra,
            }),
            "node-a",
            &config(),
        );
        f.sync(&plan);
        for from in [From::Client, From::Pod(0), From::Node] {
            check(&f, &plan, from, "203.0.113.10", 80, Protocol::TCP, 2, label);
            // Source ranges never apply to NodePorts, external IPs or the cluster IP.
            check(
                &f,
                &plan,
                from,
                "10.200.0.1",
                30080,
                Protocol::TCP,
                1,
                label,
            );
            check(&f, &plan, from, "203.0.113.50", 80, Protocol::TCP, 1, label);
        }
    }
    let _ = CLIENT_IP;
    assert_no_mismatches();
}

#[test]
fn udp_conntrack_cleanup_deletes_stale_flows_and_keeps_live_ones() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    let cfg = config();
    let both = [("a", "node-a", READY), ("r", "node-b", READY)];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &both,
            extra: "",
        }),
        "node-a",
        &cfg,
    );
    f.sync(&plan);
    // Find one client flow that landed on `a` and one on `r` (the choice is random).
    let (mut to_a, mut to_r) = (None, None);
    for sport in 40000..40060u16 {
        if to_a.is_some() && to_r.is_some() {
            break;
        }
        match f.probe_from_port(From::Client, ip("10.96.0.10"), 53, Protocol::UDP, sport) {
            Outcome::Answer { pod, .. } if pod == "a" && to_a.is_none() => to_a = Some(sport),
            Outcome::Answer { pod, .. } if pod == "r" && to_r.is_none() => to_r = Some(sport),
            _ => {}
        }
    }
    let (to_a, to_r) = (to_a.expect("a flow to a"), to_r.expect("a flow to r"));
    let flows = || {
        f.node
            .run(|| kproxy_nft::internals::conntrack::list(false).expect("conntrack dump"))
            .into_iter()
            .filter(|fl| fl.orig_dst == ip("10.96.0.10") && fl.orig_dport == 53)
            .map(|fl| fl.orig_sport)
            .collect::<Vec<u16>>()
    };
    let before = flows();
    assert!(
        before.contains(&to_a) && before.contains(&to_r),
        "{before:?}"
    );

    // `a` goes away: its UDP flow is stale, the flow to `r` is live.
    let only_r = [("r", "node-b", READY)];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &only_r,
            extra: "",
        }),
        "node-a",
        &cfg,
    );
    let report = f.sync(&plan);
    assert!(!report.full);
    assert!(report.conntrack_deleted >= 1, "{report:?}");
    let after = flows();
    assert!(!after.contains(&to_a), "stale flow kept: {after:?}");
    assert!(after.contains(&to_r), "live flow deleted: {after:?}");
    // The same client port now reaches `r`.
    assert!(
        matches!(f.probe_from_port(From::Client, ip("10.96.0.10"), 53, Protocol::UDP, to_a), Outcome::Answer { pod, .. } if pod == "r")
    );
}

#[test]
fn stale_flow_decisions() {
    use kproxy_nft::internals::conntrack::{Flow, stale_flows};
    let eps = [
        ("a", "node-a", READY),
        ("b", "node-a", TERMINATING),
        ("r", "node-b", SERVING_TERMINATING),
        // Ready (or ready unset: nil means true) but not serving: cleanup follows serving.
        ("x", "node-b", (true, false, false)),
    ];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &eps,
            extra: "",
        }),
        "node-a",
        &config(),
    );
    let flow = |proto: u8, dst: &str, dport: u16, reply: &str, rport: u16| Flow {
        proto,
        orig_src: ip("198.51.100.2"),
        orig_dst: ip(dst),
        orig_sport: 40000,
        orig_dport: dport,
        reply_src: ip(reply),
        reply_sport: rport,
    };
    // (flow, stale?)
    let table = [
        (flow(17, "10.96.0.10", 53, "10.244.1.2", 8080), false), // ready endpoint
        (flow(17, "10.96.0.10", 53, "10.244.2.2", 8080), false), // serving-terminating still serves
        (flow(17, "10.96.0.10", 53, "10.244.1.3", 8080), true),  // not serving
        (flow(17, "10.96.0.10", 53, "10.244.1.4", 8080), true),  // ready, not serving
        (flow(17, "10.96.0.10", 53, "10.244.9.9", 8080), true),  // gone
        (flow(17, "10.96.0.10", 53, "10.244.1.2", 9999), true),  // right IP, wrong port
        (flow(17, "10.96.0.10", 53, "10.96.0.10", 53), true), // never DNATed (cached before endpoints)
        (flow(17, "203.0.113.10", 53, "10.244.9.9", 8080), true), // LB IP
        (flow(17, "203.0.113.50", 53, "10.244.9.9", 8080), true), // external IP
        (flow(17, "10.200.0.1", 30053, "10.244.9.9", 8080), true), // NodePort
        (flow(6, "10.96.0.10", 80, "10.244.9.9", 8080), false), // TCP is never touched
        (flow(17, "10.96.0.99", 53, "10.244.9.9", 8080), false), // not a frontend
    ];
    for (fl, stale) in table {
        assert_eq!(stale_flows(&plan, &[fl]).len() == 1, stale, "{fl:?}");
    }
    // A port without serving endpoints is skipped entirely.
    let none = [("a", "node-a", TERMINATING)];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &none,
            extra: "",
        }),
        "node-a",
        &config(),
    );
    assert!(stale_flows(&plan, &[flow(17, "10.96.0.10", 53, "10.244.9.9", 8080)]).is_empty());
}

#[test]
fn ipv6_dual_stack() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    let cfg = PlanConfig {
        local_detector: LocalDetectorConfig::InterfaceNamePrefix("kpv".into()),
        ..PlanConfig::default()
    };
    let svc = |etp: &str, v6_eps: &str| {
        format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nstatus: {{addresses: [{{type: InternalIP, address: 10.200.0.1}}, {{type: InternalIP, address: \"fd00:200::1\"}}]}}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: ns}}\nspec:\n  type: NodePort\n  externalTrafficPolicy: {etp}\n  ipFamilyPolicy: RequireDualStack\n  ipFamilies: [IPv4, IPv6]\n  clusterIP: 10.96.0.10\n  clusterIPs: [10.96.0.10, \"fd00:96::10\"]\n  ports:\n  - {{name: http, port: 80, protocol: TCP, nodePort: 30080}}\n  - {{name: dns, port: 53, protocol: UDP, nodePort: 30053}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-v4, namespace: ns, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}, {{name: dns, port: 8080, protocol: UDP}}]\nendpoints:\n- {{addresses: [10.244.1.2], nodeName: node-a}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-v6, namespace: ns, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv6\nports: [{{name: http, port: 8081, protocol: TCP}}, {{name: dns, port: 8081, protocol: UDP}}]\nendpoints: {v6_eps}\n"
        )
    };
    let both = "[{addresses: [\"fd00:244:1::2\"], nodeName: node-a}, {addresses: [\"fd00:244:2::2\"], nodeName: node-b}]";
    let remote_only = "[{addresses: [\"fd00:244:2::2\"], nodeName: node-b}]";
    let only_a = "[{addresses: [\"fd00:244:1::2\"], nodeName: node-a}]";
    for (etp, eps, label) in [
        ("Cluster", both, "v6 ready"),
        ("Cluster", only_a, "v6 hairpin"),
        ("Local", remote_only, "v6 none local"),
        ("Cluster", "[]", "v6 none"),
    ] {
        let plan = plan_from_yaml(&svc(etp, eps), "node-a", &cfg);
        f.sync(&plan);
        for from in [From::Pod(0), From::Node, From::Client] {
            for (dst, port, proto) in [
                ("fd00:96::10", 80, Protocol::TCP),
                ("fd00:200::1", 30080, Protocol::TCP),
                ("fd00:96::10", 53, Protocol::UDP),
                ("fd00:200::1", 30053, Protocol::UDP),
                ("10.96.0.10", 80, Protocol::TCP),
            ] {
                check(&f, &plan, from, dst, port, proto, 2, label);
            }
        }
    }
    assert_no_mismatches();
}

/// Upstream's nftables proxier test `TestNodePorts`, case "ipv6", in this fabric's
/// addresses: the Service's cluster IP (`fd00:172:30::41`) lies outside the IPv6
/// ServiceCIDR (`fd00:10:96::/112`). Upstream programs it: a pod reaches the cluster IP
/// unmasqueraded, an outside client and the node itself reach the NodePort masqueraded,
/// each on both endpoints (one local, one remote). kproxy refused the whole Service (issue
/// 52); it now programs it with a warning, and trace and the kernel both say DNAT.
#[test]
fn upstream_node_ports_ipv6_cluster_ip_outside_the_service_cidrs() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = Fabric::new();
    let cfg = config();
    let yaml = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.1}, {type: InternalIP, address: \"fd00:200::1\"}]}\n---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [172.30.0.0/16, \"fd00:10:96::/112\"]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: svc1, namespace: ns1}\nspec:\n  type: NodePort\n  ipFamilies: [IPv6]\n  clusterIP: \"fd00:172:30::41\"\n  clusterIPs: [\"fd00:172:30::41\"]\n  ports:\n  - {name: p80, port: 80, protocol: TCP, nodePort: 3001}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: svc1-1, namespace: ns1, labels: {kubernetes.io/service-name: svc1}}\naddressType: IPv6\nports: [{name: p80, port: 8081, protocol: TCP}]\nendpoints:\n- {addresses: [\"fd00:244:2::2\"]}\n- {addresses: [\"fd00:244:1::2\"], nodeName: node-a}\n";
    let plan = plan_from_yaml(yaml, "node-a", &cfg);
    assert!(plan.conflicts.is_empty(), "{:?}", plan.conflicts);
    assert_eq!(plan.cluster_ip_warnings.len(), 1, "{plan:?}");
    f.sync(&plan);
    let locals: Vec<IpAddr> = NODE_ADDRS
        .iter()
        .chain(&common::fabric::NODE_ADDRS6)
        .map(|a| ip(a))
        .collect();
    // (source, destination, port, masqueraded) as upstream's table has them.
    for (from, dst, port, masq) in [
        (From::Pod(0), "fd00:172:30::41", 80, false),
        (From::Client, "fd00:200::1", 3001, true),
        (From::Node, "fd00:200::1", 3001, true),
    ] {
        let (src, iface) = f.source6(from);
        let pkt = Packet {
            src,
            dst: ip(dst),
            dport: port,
            proto: Protocol::TCP,
            in_interface: iface,
        };
        let t = trace(&plan, &pkt, &locals);
        assert_eq!(t.verdict, TraceVerdict::Dnat, "{from:?} -> {dst}: {t:?}");
        let mut eps: Vec<String> = t.endpoints.iter().map(|e| e.ip.to_string()).collect();
        eps.sort();
        assert_eq!(eps, ["fd00:244:1::2", "fd00:244:2::2"], "{from:?} -> {dst}");
        // The pod's own address is a candidate: a hairpin masquerades that one only.
        assert_eq!(t.masquerade, masq, "{from:?} -> {dst}: {t:?}");
        let answered = check(
            &f,
            &plan,
            from,
            dst,
            port,
            Protocol::TCP,
            12,
            "TestNodePorts/ipv6",
        );
        assert!(!answered.is_empty(), "{from:?} -> {dst}: no answer");
    }
    assert_no_mismatches();
}

/// A restart adopts the tables left by the previous run with one atomic replacement:
/// while fresh `Dataplane`s (and forced full syncs) replace the tables again and again,
/// new connections keep succeeding and an existing UDP flow keeps its endpoint.
#[test]
fn full_replacement_never_leaves_a_gap() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let f = Arc::new(Fabric::new());
    let eps = [("a", "node-a", READY), ("r", "node-b", READY)];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &eps,
            extra: "",
        }),
        "node-a",
        &config(),
    );
    f.sync(&plan);
    // An established UDP flow: one client socket, kept across every replacement.
    let flow = f.client.run(|| {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind");
        s.connect("10.96.0.10:53").expect("connect");
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .expect("timeout");
        s
    });
    let ask = |s: &std::net::UdpSocket| -> String {
        s.send(b"hi").expect("send");
        let mut buf = [0u8; 64];
        let n = s.recv(&mut buf).expect("answer on the established flow");
        String::from_utf8_lossy(&buf[..n])
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let pinned = ask(&flow);

    let stop = Arc::new(AtomicBool::new(false));
    let prober = {
        let (f, stop) = (f.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                outcomes.push(f.probe(From::Client, ip("10.96.0.10"), 80, Protocol::TCP));
            }
            outcomes
        })
    };
    for round in 0..12 {
        if round % 2 == 0 {
            // A restart: a new process knows nothing, reads back what it finds and
            // adopts it (a delta; nothing changed).
            let plan = plan.clone();
            let r = f.node.run(move || {
                kproxy_nft::Dataplane::new(kproxy_nft::DataplaneConfig::default())
                    .expect("config")
                    .sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                    .expect("sync")
            });
            assert!(r.adopted && !r.full, "{r:?}");
        } else {
            f.dp.lock().expect("dp").force_full_sync();
            assert!(f.sync(&plan).full);
        }
        assert_eq!(ask(&flow), pinned, "round {round}: the UDP flow moved");
    }
    stop.store(true, Ordering::SeqCst);
    let outcomes = prober.join().expect("prober");
    assert!(outcomes.len() >= 5, "only {} probes", outcomes.len());
    let bad: Vec<_> = outcomes
        .iter()
        .filter(|o| !matches!(o, Outcome::Answer { .. }))
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} new connections failed: {bad:?}",
        bad.len(),
        outcomes.len()
    );
}

/// The way back to another proxy (`kproxy cleanup` once kube-proxy has synced,
/// docs/migrate.md): with the other proxy's rules in place, removing kproxy's tables
/// refuses no new connection. Deleting a table in one transaction is not seen at once by
/// a packet already inside its chains: the kernel can show it the table's rules with the
/// verdict maps' elements already gone, so the `service-ips` lookup misses and the
/// cluster-IP reject below it answers (the 1-in-7 refusal of `kproxy lab takeover
/// --from iptables --back` on a loaded machine). Cleanup therefore makes the tables
/// dormant first (their hooks go, the rules a packet in flight sees stay whole) and
/// deletes them after. The chains are padded by another process with rules that match
/// nothing, so that a packet spends long enough in them for the race to show in a few
/// dozen rounds (deleted in one transaction: 7–10 of ≈ 6,000 connections refused). The
/// probes run only between the padding and the end of the cleanup: while `nft` inserts
/// the 4,000 padding rules a SYN is now and then lost (and retransmitted), which is
/// that insert's doing, not kproxy's.
#[test]
fn cleanup_with_another_proxy_in_place_refuses_nothing() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let f = Arc::new(Fabric::new());
    let eps = [("a", "node-a", READY)];
    let plan = plan_from_yaml(
        &manifest(&Svc {
            etp: "Cluster",
            itp: "Cluster",
            endpoints: &eps,
            extra: "",
        }),
        "node-a",
        &config(),
    );
    // The other proxy (kube-proxy's place): its own DNAT of the Service, after kproxy's
    // (kproxy's nat chains run at dstnat - 1).
    f.node.exec(
        "printf \"table ip standin {\\n chain pre {\\n  type nat hook prerouting priority dstnat;\\n  ip daddr 10.96.0.10 tcp dport 80 dnat to 10.244.1.2:8080\\n }\\n}\\n\" | nft -f -",
    );
    struct Removed(std::path::PathBuf);
    impl Drop for Removed {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    let pad = Removed(
        std::env::temp_dir().join(format!("kproxy-test-padding-{}.nft", std::process::id())),
    );
    let text: String = (0..4000)
        .map(|i| {
            format!(
                "insert rule ip kproxy nat-prerouting ip daddr 192.0.2.{} tcp dport {} accept\n",
                i % 250 + 1,
                i + 1000
            )
        })
        .collect();
    std::fs::write(&pad.0, text).expect("write padding");
    let pad_cmd = format!("nft -f {}", pad.0.display());

    let stop = Arc::new(AtomicBool::new(false));
    // Probing while `open`; `busy` while a probe runs (set, then `open` checked again,
    // so closing and then waiting for `busy` to clear leaves no probe running).
    let open = Arc::new(AtomicBool::new(false));
    let busy = Arc::new(AtomicBool::new(false));
    let prober = {
        let (f, stop, open, busy) = (f.clone(), stop.clone(), open.clone(), busy.clone());
        std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                busy.store(true, Ordering::SeqCst);
                if open.load(Ordering::SeqCst) {
                    outcomes.push(f.probe(From::Client, ip("10.96.0.10"), 80, Protocol::TCP));
                    busy.store(false, Ordering::SeqCst);
                } else {
                    busy.store(false, Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            outcomes
        })
    };
    for _ in 0..40 {
        let plan = plan.clone();
        f.node.run(move || {
            kproxy_nft::Dataplane::new(kproxy_nft::DataplaneConfig::default())
                .expect("config")
                .sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("sync")
        });
        f.node.exec(&pad_cmd);
        open.store(true, Ordering::SeqCst);
        // Long enough for a few probes through kproxy's chains before the cleanup.
        std::thread::sleep(std::time::Duration::from_millis(50));
        f.node
            .run(|| kproxy_nft::cleanup(&kproxy_nft::DataplaneConfig::default()).expect("cleanup"));
        open.store(false, Ordering::SeqCst);
        while busy.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
    }
    stop.store(true, Ordering::SeqCst);
    let outcomes = prober.join().expect("prober");
    assert!(outcomes.len() >= 20, "only {} probes", outcomes.len());
    let bad: Vec<_> = outcomes
        .iter()
        .filter(|o| !matches!(o, Outcome::Answer { .. }))
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} new connections failed: {bad:?}",
        bad.len(),
        outcomes.len()
    );
}
