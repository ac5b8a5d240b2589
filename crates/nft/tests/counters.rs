//! The traffic counters with real packets through real rules (crates/nft/src/counters.rs):
//! a known number of new TCP and UDP connections through each frontend kind, each
//! counter checked to the unit; the rejects, source-range drops, no-local drops and
//! the terminating fallback likewise; and the counters' survival across element-only
//! changes, chain rewrites, a full replacement, restarts (a new dataplane adopting the
//! tables) and a flush by another process (restored from the last reading).

mod common;

use std::collections::BTreeMap;

use common::fabric::{Fabric, From, Outcome};
use common::*;
use kproxy_core::config::LocalDetectorConfig;
use kproxy_core::model::Protocol;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::{NodePlan, PlanConfig};
use kproxy_nft::{CounterKind, Dataplane, DataplaneConfig, KernelCounter, parse_counter_name};

const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nspec: {podCIDRs: [10.244.1.0/24]}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.1}]}\n";

/// ready, serving, terminating
type Cond = (bool, bool, bool);
const READY: Cond = (true, true, false);
const SERVING_TERMINATING: Cond = (false, true, true);

/// `ns/web`: LoadBalancer 203.0.113.10, external IP 203.0.113.50, cluster IP
/// 10.96.0.10; ports http 80/TCP (NodePort 30080) and dns 53/UDP (NodePort 30053), both
/// to 8080 on `endpoints` (pod, node, conditions).
fn manifest(etp: &str, endpoints: &[(&str, &str, Cond)], extra: &str) -> String {
    let mut m = NODE.to_string();
    m += &format!(
        "---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: ns}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalIPs: [203.0.113.50]\n  externalTrafficPolicy: {etp}\n  ports:\n  - {{name: http, port: 80, protocol: TCP, nodePort: 30080}}\n  - {{name: dns, port: 53, protocol: UDP, nodePort: 30053}}\n{extra}status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.10}}]}}}}\n"
    );
    if !endpoints.is_empty() {
        m += "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080, protocol: TCP}, {name: dns, port: 8080, protocol: UDP}]\nendpoints:\n";
        for (pod, node, (r, s, t)) in endpoints {
            let addr = common::fabric::PODS
                .iter()
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

fn plan(etp: &str, endpoints: &[(&str, &str, Cond)], extra: &str) -> NodePlan {
    let cfg = PlanConfig {
        local_detector: LocalDetectorConfig::InterfaceNamePrefix("kpv".into()),
        ..PlanConfig::default()
    };
    plan_from_yaml(&manifest(etp, endpoints, extra), "node-a", &cfg)
}

fn fabric() -> Fabric {
    Fabric::with_config(DataplaneConfig {
        conntrack_cleanup: false,
        counters: true,
        ..DataplaneConfig::default()
    })
}

/// kproxy's counters in the node namespace, by name.
fn counters(f: &Fabric) -> BTreeMap<String, KernelCounter> {
    f.node
        .run(|| kproxy_nft::read_counters("kproxy").expect("read counters"))
        .into_iter()
        .map(|c| (c.name.clone(), c))
        .collect()
}

/// The packets of `ns/web`'s counter of `kind` on port `port` (`http`, `dns`).
fn count(all: &BTreeMap<String, KernelCounter>, port: &str, kind: CounterKind) -> u64 {
    let found: Vec<u64> = all
        .values()
        .filter(|c| {
            parse_counter_name(&c.name).is_some_and(|p| {
                p.namespace == "ns" && p.service == "web" && p.port == port && p.kind == kind
            })
        })
        .map(|c| c.packets)
        .collect();
    assert_eq!(found.len(), 1, "one {kind:?} counter of {port}: {all:#?}");
    found[0]
}

fn endpoint(pod: &str) -> CounterKind {
    let addr = common::fabric::PODS
        .iter()
        .find(|(n, _)| *n == pod)
        .expect("pod")
        .1;
    CounterKind::Endpoint(kproxy_core::model::EndpointAddr::new(ip(addr), 8080))
}

/// Every frontend kind of `ns/web` for `proto`: (address, port).
fn frontends(proto: Protocol) -> [(&'static str, u16); 4] {
    match proto {
        Protocol::UDP => [
            ("10.96.0.10", 53),
            ("10.200.0.1", 30053),
            ("203.0.113.10", 53),
            ("203.0.113.50", 53),
        ],
        _ => [
            ("10.96.0.10", 80),
            ("10.200.0.1", 30080),
            ("203.0.113.10", 80),
            ("203.0.113.50", 80),
        ],
    }
}

#[test]
fn new_connections_are_counted_per_endpoint_through_every_frontend_kind() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = fabric();
    let p = plan(
        "Cluster",
        &[("a", "node-a", READY), ("r", "node-b", READY)],
        "",
    );
    f.sync(&p);
    for (proto, port) in [(Protocol::TCP, "http"), (Protocol::UDP, "dns")] {
        let mut answered: BTreeMap<String, u64> = BTreeMap::new();
        let mut sent = 0;
        for (dst, dport) in frontends(proto) {
            // From outside (prerouting), and the cluster IP from the node (output).
            let sources: &[From] = if dst == "10.96.0.10" {
                &[From::Client, From::Node, From::Pod(1)]
            } else {
                &[From::Client]
            };
            for from in sources {
                for _ in 0..5 {
                    sent += 1;
                    match f.probe(*from, ip(dst), dport, proto) {
                        Outcome::Answer { pod, .. } => *answered.entry(pod).or_default() += 1,
                        o => panic!("{from:?} -> {dst}:{dport}/{proto}: {o:?}"),
                    }
                }
            }
        }
        let all = counters(&f);
        let a = count(&all, port, endpoint("a"));
        let r = count(&all, port, endpoint("r"));
        assert_eq!(
            (a, r),
            (
                answered.get("a").copied().unwrap_or(0),
                answered.get("r").copied().unwrap_or(0)
            ),
            "{proto}: endpoint counters against the answers ({sent} sent)"
        );
        assert_eq!(a + r, sent, "{proto}");
        assert_eq!(
            count(&all, port, CounterKind::New),
            sent,
            "{proto}: the port's"
        );
        for kind in [
            CounterKind::Rejected,
            CounterKind::NoLocal,
            CounterKind::Fallback,
        ] {
            assert_eq!(count(&all, port, kind), 0, "{proto} {kind:?}");
        }
    }
}

#[test]
fn rejects_source_range_drops_no_local_drops_and_the_fallback_are_counted() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = fabric();
    // No endpoint at all: every new connection is rejected, at every frontend.
    f.sync(&plan("Cluster", &[], ""));
    for (proto, port) in [(Protocol::TCP, "http"), (Protocol::UDP, "dns")] {
        let mut sent = 0;
        for (dst, dport) in frontends(proto) {
            for _ in 0..3 {
                sent += 1;
                let got = f.probe(From::Client, ip(dst), dport, proto);
                assert_eq!(got, Outcome::Refused, "{dst}:{dport}/{proto}");
            }
        }
        let all = counters(&f);
        assert_eq!(count(&all, port, CounterKind::Rejected), sent, "{proto}");
        assert_eq!(count(&all, port, CounterKind::NoLocal), 0, "{proto}");
    }

    // eTP=Local, the only endpoint on another node: outside traffic to the LB IP, the
    // external IP and the NodePort is dropped here (each probe's one SYN; a UDP probe
    // sends two datagrams, each a new connection attempt), the cluster IP forwards.
    f.sync(&plan("Local", &[("r", "node-b", READY)], ""));
    let mut syns = 0;
    for (dst, dport) in &frontends(Protocol::TCP)[1..] {
        for _ in 0..2 {
            syns += 1;
            let got = f.probe(From::Client, ip(dst), *dport, Protocol::TCP);
            assert_eq!(got, Outcome::Timeout, "{dst}:{dport}");
        }
    }
    let mut datagrams = 0;
    for (dst, dport) in &frontends(Protocol::UDP)[1..] {
        datagrams += 2;
        let got = f.probe(From::Client, ip(dst), *dport, Protocol::UDP);
        assert_eq!(got, Outcome::Timeout, "{dst}:{dport}");
    }
    let all = counters(&f);
    assert_eq!(count(&all, "http", CounterKind::NoLocal), syns);
    assert_eq!(count(&all, "dns", CounterKind::NoLocal), datagrams);

    // loadBalancerSourceRanges without the client's network: its connections to the
    // LB IP are dropped by the source-range rule (counted there, nowhere else).
    f.sync(&plan(
        "Cluster",
        &[("a", "node-a", READY)],
        "  loadBalancerSourceRanges: [192.0.2.0/24]\n",
    ));
    for _ in 0..4 {
        let got = f.probe(From::Client, ip("203.0.113.10"), 80, Protocol::TCP);
        assert_eq!(got, Outcome::Timeout);
    }
    let all = counters(&f);
    assert_eq!(count(&all, "http", CounterKind::SourceRange), 4);
    assert_eq!(count(&all, "http", CounterKind::NoLocal), syns, "kept");

    // Only a serving, terminating endpoint: the fallback sends every new connection to
    // it, and counts each.
    f.sync(&plan(
        "Cluster",
        &[("a", "node-a", SERVING_TERMINATING)],
        "",
    ));
    let before = counters(&f);
    let mut sent = 0;
    for (dst, dport) in frontends(Protocol::TCP) {
        for _ in 0..3 {
            sent += 1;
            let got = f.probe(From::Client, ip(dst), dport, Protocol::TCP);
            assert!(
                matches!(&got, Outcome::Answer { pod, .. } if pod == "a"),
                "{got:?}"
            );
        }
    }
    let all = counters(&f);
    assert_eq!(
        count(&all, "http", CounterKind::Fallback) - count(&before, "http", CounterKind::Fallback),
        sent
    );
    assert_eq!(
        count(&all, "http", endpoint("a")) - count(&before, "http", endpoint("a")),
        sent
    );
}

#[test]
fn counters_survive_deltas_rewrites_replacements_restarts_and_a_flush() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let f = fabric();
    let one = [("a", "node-a", READY)];
    let two = [("a", "node-a", READY), ("b", "node-a", READY)];
    let ranges =
        |n: usize| format!("  loadBalancerSourceRanges: [198.51.100.0/24, 192.0.2.{n}/32]\n");
    let mut moving = Moving::new(
        "node-a",
        &PlanConfig {
            local_detector: LocalDetectorConfig::InterfaceNamePrefix("kpv".into()),
            ..PlanConfig::default()
        },
    );
    let sync = |moving: &mut Moving, text: String| {
        let (plan, update) = moving.step(&text);
        let (plan, dp) = (plan.clone(), f.dp.clone());
        f.node
            .run(move || dp.lock().unwrap().sync(&plan, &update).expect("sync"))
    };
    sync(&mut moving, manifest("Cluster", &one, ""));
    for _ in 0..7 {
        assert!(matches!(
            f.probe(From::Client, ip("10.96.0.10"), 80, Protocol::TCP),
            Outcome::Answer { .. }
        ));
    }
    let a = endpoint("a");
    let start = counters(&f);
    assert_eq!(count(&start, "http", a), 7);
    let name = |all: &BTreeMap<String, KernelCounter>| {
        all.values()
            .find(|c| parse_counter_name(&c.name).is_some_and(|p| p.port == "http" && p.kind == a))
            .cloned()
            .expect("endpoint a's counter")
    };
    let first = name(&start);
    assert!(first.since.is_some(), "{first:?}");
    let unchanged = |what: &str| {
        let now = name(&counters(&f));
        assert_eq!(
            (now.packets, now.since),
            (first.packets, first.since),
            "{what}"
        );
    };

    // 100 element-only changes: endpoint b in and out (the first creates the
    // dispatch group of two endpoints, which then stays).
    for i in 0..100 {
        let eps: &[_] = if i % 2 == 0 { &two } else { &one };
        let r = sync(&mut moving, manifest("Cluster", eps, ""));
        let c = r.changes;
        assert!(!r.full && c.chains_changed == 0, "{i}: {r:?}");
        assert!(
            i == 0 || (c.chains_added == 0 && c.elements_added > 0),
            "{i}: {r:?}"
        );
    }
    unchanged("100 element-only changes");
    // 10 chain rewrites: the LB source ranges (the external chain, created by the
    // first) change.
    for i in 0..=10 {
        let r = sync(&mut moving, manifest("Cluster", &one, &ranges(i)));
        assert!(i == 0 || r.changes.chains_changed > 0, "{i}: {r:?}");
    }
    unchanged("10 chain rewrites");
    // A full replacement (one transaction deleting and creating the tables).
    let p = plan("Cluster", &one, &ranges(10));
    {
        let (p, dp) = (p.clone(), f.dp.clone());
        let r = f.node.run(move || {
            let mut dp = dp.lock().unwrap();
            dp.force_full_sync();
            dp.sync(&p, &PlanUpdate::WHOLE).expect("replacement")
        });
        assert!(r.full && !r.adopted, "{r:?}");
    }
    unchanged("a full replacement");
    // Three restarts: a new dataplane (another process, another binary) adopts them.
    for i in 0..3 {
        let p = p.clone();
        let r = f.node.run(move || {
            let mut dp = Dataplane::new(DataplaneConfig {
                conntrack_cleanup: false,
                counters: true,
                ..DataplaneConfig::default()
            })
            .unwrap();
            dp.sync(&p, &PlanUpdate::WHOLE).expect("adoption")
        });
        assert!(r.adopted && r.changes.is_empty(), "restart {i}: {r:?}");
    }
    unchanged("three restarts");

    // A flush by another process: the repair restores the counters from the values
    // kproxy last read (the traffic since that reading is lost), and says so.
    {
        let dp = f.dp.clone();
        f.node
            .run(move || dp.lock().unwrap().read_counters().expect("read"));
    }
    for _ in 0..3 {
        assert!(matches!(
            f.probe(From::Client, ip("10.96.0.10"), 80, Protocol::TCP),
            Outcome::Answer { .. }
        ));
    }
    assert_eq!(name(&counters(&f)).packets, 10);
    f.node.exec("nft flush ruleset");
    assert!(counters(&f).is_empty());
    let r = {
        let (p, dp) = (p.clone(), f.dp.clone());
        f.node
            .run(move || dp.lock().unwrap().repair(&p).expect("repair"))
    };
    assert!(r.counters_restored.contains(&first.name), "{r:?}");
    let after = name(&counters(&f));
    assert_eq!(after.packets, 7, "the last reading: {after:?}");
    assert!(
        after.since >= first.since && after.since.is_some(),
        "{after:?}"
    );
    // And it counts on from there.
    assert!(matches!(
        f.probe(From::Client, ip("10.96.0.10"), 80, Protocol::TCP),
        Outcome::Answer { .. }
    ));
    assert_eq!(name(&counters(&f)).packets, 8);
}
