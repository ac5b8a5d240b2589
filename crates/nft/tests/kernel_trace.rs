//! `kproxy trace --kernel` held to `kproxy trace` on the differential test's random
//! cluster states (crates/nft/tests/differential.rs, whose packets go through real
//! rules): the evaluator (`kproxy_nft::evaluate`) run on the desired tables, and on
//! the tables the real dataplane programmed into a network namespace, read back and
//! adopted as `trace --kernel` reads them, gives `trace`'s fate for every probe of
//! every state; and an element deleted from the kernel changes the kernel's fate and
//! is named.
//!
//! Cases: `KPROXY_DIFF_CASES` (default 32), seed `KPROXY_DIFF_SEED`, as the
//! differential test.

mod common;

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use common::cases::{
    Case, Svc, case, config, env_count, failure, host_addresses, manifests, one_service, plain,
    probes, seeded_rng, state,
};
use common::fabric::source;
use common::{Netns, ip};
use kproxy_core::model::IpFamily;
use kproxy_core::trace::{Packet, trace};
use kproxy_core::{NodePlan, PlanConfig};
use kproxy_nft::{Dataplane, DataplaneConfig, KernelTable, Table, desired};
use kproxy_nft::{Evaluation, divergence, evaluate};
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// The plans of a case: the kernel's as `kproxy sync --once` makes it (node addresses
/// from the Node object), trace's as `kproxy trace --node-addresses <every host
/// address>` makes it (as the differential test).
fn plans(c: &Case) -> Result<(NodePlan, NodePlan), String> {
    let st = state(&manifests(c))?;
    let kernel = kproxy_core::plan(&st, "node-a", &config(c));
    let traced = kproxy_core::plan(
        &st,
        "node-a",
        &PlanConfig {
            node_ips: host_addresses(),
            ..config(c)
        },
    );
    Ok((kernel, traced))
}

/// Every probe of the differential test, as a packet.
fn packets(c: &Case) -> Vec<Packet> {
    probes(c)
        .into_iter()
        .map(|(from, dst, dport, proto)| {
            let (src, in_interface) = source(from, dst.is_ipv6());
            Packet {
                src,
                dst,
                dport,
                proto,
                in_interface,
            }
        })
        .collect()
}

fn family_index(ip: &IpAddr) -> usize {
    usize::from(IpFamily::of(ip) == IpFamily::IPv6)
}

/// The probes whose evaluation under `tables` (IPv4, IPv6) is not trace's fate.
fn disagreements(c: &Case, plan: &NodePlan, tables: &[Table; 2]) -> Vec<String> {
    let locals = host_addresses();
    let mut out = Vec::new();
    for p in packets(c) {
        let t = trace(plan, &p, &locals);
        let ev = evaluate(&tables[family_index(&p.dst)], &p, &locals);
        if !ev.agrees_with(&t) {
            out.push(format!(
                "{} -> {}:{}/{} via {:?}: trace {:?} {:?} masq={} ({}); table {:?}",
                p.src,
                p.dst,
                p.dport,
                p.proto,
                p.in_interface,
                t.verdict,
                t.endpoints,
                t.masquerade,
                t.reason,
                ev.outcomes
            ));
        }
    }
    out
}

fn runner(cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config {
            cases,
            max_shrink_iters: 100,
            failure_persistence: None,
            ..Config::default()
        },
        seeded_rng("KPROXY_DIFF_SEED", 16),
    )
}

fn run(runner: &mut TestRunner, check: impl Fn(&Case) -> Result<(), String>) {
    let result = runner.run(&case(), |c| check(&c).map_err(TestCaseError::fail));
    if let Err(e) = result {
        let detail = failure(&e);
        panic!("the evaluator and trace disagree:\n{detail}");
    }
}

/// Pure: the desired tables of each random state evaluate to trace's fate.
#[test]
fn desired_tables_evaluate_as_trace_on_random_clusters() {
    let mut r = runner(env_count("KPROXY_DIFF_CASES", 32) * 4);
    run(&mut r, |c| {
        let (_, plan) = plans(c)?;
        let tables = desired(&plan, &DataplaneConfig::default());
        let bad = disagreements(c, &plan, &tables);
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("\n"))
        }
    });
}

/// A namespace holding kproxy's tables, programmed by the real dataplane.
struct Node {
    ns: Netns,
    dp: Arc<Mutex<Dataplane>>,
}

impl Node {
    fn new(tag: &str) -> Node {
        Node {
            ns: Netns::new(tag),
            dp: Arc::new(Mutex::new(
                Dataplane::new(DataplaneConfig::default()).expect("config"),
            )),
        }
    }

    fn sync(&self, plan: &NodePlan) {
        let (dp, plan) = (self.dp.clone(), plan.clone());
        self.ns.run(move || {
            dp.lock()
                .expect("dp")
                .sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("sync")
        });
    }

    /// kproxy's tables as `trace --kernel` reads them for `plan`: read back and
    /// adopted in the terms of `plan`'s tables; with those desired tables.
    fn kernel(&self, plan: &NodePlan) -> Result<([Table; 2], [Table; 2]), String> {
        let want = desired(plan, &DataplaneConfig::default());
        let w = want.clone();
        let got = self.ns.run(move || {
            w.map(|d| {
                match KernelTable::read(d.family(), d.name()).map(|t| t.map(|t| t.adopt(&d))) {
                    Ok(Some(Ok(t))) => Ok(t),
                    Ok(Some(Err(e))) => Err(format!("not adoptable: {e}")),
                    Ok(None) => Err(format!("table {} absent", d.family())),
                    Err(e) => Err(format!("reading: {e}")),
                }
            })
        });
        let [a, b] = got;
        Ok(([a?, b?], want))
    }
}

/// Root: the tables the dataplane programmed for each random state, read back, give
/// trace's fate for every probe, and differ from the plan in nothing a probe touches.
#[test]
fn kernel_trace_equals_trace_on_random_clusters() {
    if !common::root() {
        return;
    }
    let node = Node::new("ktrace");
    let mut r = runner(env_count("KPROXY_DIFF_CASES", 32));
    run(&mut r, |c| {
        let (kernel_plan, plan) = plans(c)?;
        node.sync(&kernel_plan);
        let (kernel, want) = node.kernel(&plan)?;
        let mut bad = disagreements(c, &plan, &kernel);
        let locals = host_addresses();
        for p in packets(c) {
            let i = family_index(&p.dst);
            let ev = evaluate(&kernel[i], &p, &locals);
            let named = divergence(&kernel[i], &want[i], &ev.touched).map_err(|e| e.to_string())?;
            if !named.is_empty() {
                bad.push(format!(
                    "{} -> {}:{}: differs: {named:?}",
                    p.src, p.dst, p.dport
                ));
            }
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(bad.join("\n"))
        }
    });
}

fn fates(ev: &Evaluation) -> Vec<String> {
    ev.outcomes
        .iter()
        .map(|o| {
            format!(
                "{} {:?} {:?}",
                o.share,
                o.fate,
                o.endpoint.map(|e| e.to_string())
            )
        })
        .collect()
}

/// Root: an element deleted from the kernel (`nft delete element`) changes the
/// kernel's fate of the packets that use it, and is what `divergence` names.
/// One ClusterIP Service (10.96.0.10:80) with three ready endpoints, IPv4 only: its
/// plans ([`plans`]), and a new TCP connection to it from outside (in on `ext0`).
fn three_ready_endpoints() -> (NodePlan, NodePlan, Packet) {
    let case = Case {
        ipv4_only: true,
        ..one_service(Svc {
            endpoints: (0..3).map(|pod| (pod, (Some(true), None, None))).collect(),
            ..plain(0)
        })
    };
    let pkt = Packet {
        src: ip("198.51.100.2"),
        dst: ip(&common::cases::v4_cluster_ip(0)),
        dport: 80,
        proto: kproxy_core::model::Protocol::TCP,
        in_interface: Some("ext0".into()),
    };
    let (kernel_plan, plan) = plans(&case).expect("valid case");
    (kernel_plan, plan, pkt)
}

#[test]
fn a_deleted_element_changes_the_kernel_fate_and_is_named() {
    if !common::root() {
        return;
    }
    let (kernel_plan, plan, pkt) = three_ready_endpoints();
    let node = Node::new("kdel");
    node.sync(&kernel_plan);
    let locals = host_addresses();
    let t = trace(&plan, &pkt, &locals);
    assert_eq!(t.endpoints.len(), 3, "{t:?}");
    let (kernel, _) = node.kernel(&plan).expect("read back");
    let before = evaluate(&kernel[0], &pkt, &locals);
    assert!(before.agrees_with(&t), "{:?}", fates(&before));
    // The row that picks the second endpoint.
    let row = format!("{} . tcp . 80 . 1", pkt.dst);
    node.ns.exec(&format!(
        "nft delete element ip kproxy dnat-c-3 {{ {row} }}"
    ));
    let (kernel, want) = node.kernel(&plan).expect("read back");
    let after = evaluate(&kernel[0], &pkt, &locals);
    assert!(!after.agrees_with(&t), "{:?}", fates(&after));
    let dropped = t.endpoints[1];
    assert!(
        after.outcomes.iter().all(|o| o.endpoint != Some(dropped)),
        "{:?}",
        fates(&after)
    );
    assert!(
        fates(&after).iter().any(|f| f.starts_with("1/3 None")),
        "a third of new connections find no row: {:?}",
        fates(&after)
    );
    let mut touched = after.touched.clone();
    touched.extend(evaluate(&want[0], &pkt, &locals).touched);
    let named = divergence(&kernel[0], &want[0], &touched).expect("diff");
    let ep = format!("{} . {}", dropped.ip, dropped.port);
    assert_eq!(
        named,
        [format!(
            "map dnat-c-3: element {row} : {ep} is in the plan, not in the kernel"
        )]
    );
}

/// Root: a rule forged under kproxy's own `kp:` id (issue 42, item 2) is told by what
/// it does, not by its name. For each forgery — the dispatch rule turned into a DNAT to
/// an outside address, the `services` verdict-map rule turned into `drop`, the dispatch
/// rule's `numgen` modulus changed from 3 to 7 — `trace --kernel` disagrees with the
/// plan and names the chain; and the running dataplane's verification, its repair (the
/// kernel watch's path) and a new dataplane's adoption (a restart, `sync --once`) each
/// put the plan's rule back.
#[test]
fn a_rule_forged_under_kproxys_id_is_named_and_repaired() {
    if !common::root() {
        return;
    }
    let (kernel_plan, plan, pkt) = three_ready_endpoints();
    let locals = host_addresses();
    let t = trace(&plan, &pkt, &locals);
    assert_eq!(t.endpoints.len(), 3, "{t:?}");
    let dispatch = "dnat ip to ip daddr . meta l4proto . th dport . numgen random mod";
    // (chain, the text of the rule forged, its replacement)
    let forgeries = [
        (
            "disp-c-3",
            format!("{dispatch} 3 map @dnat-c-3"),
            "meta l4proto tcp dnat to 6.6.6.6:6666".to_string(),
        ),
        (
            "services",
            "ip daddr . meta l4proto . th dport vmap @service-ips".to_string(),
            "drop".to_string(),
        ),
        (
            "disp-c-3",
            format!("{dispatch} 3 map @dnat-c-3"),
            format!("{dispatch} 7 map @dnat-c-3"),
        ),
    ];
    for (chain, real, forged) in &forgeries {
        let node = Node::new("kforge");
        node.sync(&kernel_plan);
        let forge = || {
            let raw = node
                .ns
                .run(|| kproxy_nft::internals::dump::read_table(kproxy_nft::Family::Ip, "kproxy"))
                .expect("dump")
                .expect("table");
            let want = desired(&kernel_plan, &DataplaneConfig::default());
            let rule = want[0].chains()[*chain]
                .rules
                .iter()
                .find(|r| r.to_string() == *real)
                .unwrap_or_else(|| panic!("{chain} has no rule {real}"));
            let id = format!("kp:{}", rule.id());
            let handle = raw.chains[*chain]
                .rules
                .iter()
                .find(|r| r.comment.as_deref() == Some(id.as_str()))
                .expect("the rule in the kernel")
                .handle;
            if !forged.contains("mod 7") {
                node.ns.exec(&format!(
                    "nft replace rule ip kproxy {chain} handle {handle} {forged} comment \\\"{id}\\\""
                ));
                return;
            }
            // nft 1.0.6 refuses a rule on a `typeof` map it did not declare in the same
            // batch ("conflicting protocols specified: ip vs. th"): this one goes over
            // netlink, the chain's one rule replaced.
            let mut rule = rule.clone();
            let Some(kproxy_nft::internals::rule::Expr::DnatMap { sel, .. }) =
                rule.exprs.first_mut()
            else {
                panic!("{real} is not a dispatch rule");
            };
            *sel.last_mut().expect("numgen") = kproxy_nft::internals::rule::Sel::Numgen(7);
            assert_eq!(rule.to_string(), *forged);
            let tx = kproxy_nft::Transaction {
                ops: vec![kproxy_nft::internals::model::Op::FlushChain {
                    family: kproxy_nft::internals::model::Family::Ip,
                    table: "kproxy".into(),
                    name: chain.to_string(),
                }],
                ..Default::default()
            };
            let mut batch = kproxy_nft::internals::netlink::Batch::transaction(&tx).expect("flush");
            batch
                .add_rule_tagged(
                    kproxy_nft::internals::model::Family::Ip,
                    "kproxy",
                    chain,
                    &rule,
                    &id,
                )
                .expect("encodes");
            node.ns.run(move || {
                kproxy_nft::internals::netlink::Writer::open()
                    .expect("socket")
                    .send(batch)
                    .expect("forged")
            });
        };
        let agrees = || {
            let (kernel, want) = node.kernel(&plan).expect("read back");
            let ev = evaluate(&kernel[0], &pkt, &locals);
            let mut touched = ev.touched.clone();
            touched.extend(evaluate(&want[0], &pkt, &locals).touched);
            let named = divergence(&kernel[0], &want[0], &touched).expect("diff");
            (ev.agrees_with(&t), fates(&ev), named)
        };
        let listing = || node.ns.exec("nft list table ip kproxy");
        let listed = listing();
        let named_chain = format!("chain {chain}: its rules in the kernel are not the plan's");
        let before = agrees();
        assert!(
            before.0 && before.2.is_empty(),
            "{forged}: before: {before:?}"
        );

        // trace --kernel, then the periodic verification.
        forge();
        let (ok, fates_seen, named) = agrees();
        assert!(!ok, "{forged}: trace --kernel agrees: {fates_seen:?}");
        assert!(named.contains(&named_chain), "{forged}: {named:?}");
        let dp = node.dp.clone();
        let report = node
            .ns
            .run(move || dp.lock().expect("dp").verify().expect("verify"));
        assert!(report.drift, "{forged}: {report:?}");
        assert!(
            report.differences.contains(&format!("chain {chain}")),
            "{forged}: {report:?}"
        );
        assert!(
            agrees().0,
            "{forged}: after the verification: {:?}",
            agrees()
        );
        assert_eq!(listing(), listed, "{forged}: after the verification");

        // The kernel watch's repair.
        forge();
        let (dp, p) = (node.dp.clone(), kernel_plan.clone());
        let r = node
            .ns
            .run(move || dp.lock().expect("dp").repair(&p).expect("repair"));
        assert_eq!(r.changes.chains_changed, 1, "{forged}: {r:?}");
        assert!(agrees().0, "{forged}: after the repair: {:?}", agrees());
        assert_eq!(listing(), listed, "{forged}: after the repair");

        // A restart's adoption (and `sync --once`).
        forge();
        let p = kernel_plan.clone();
        let r = node.ns.run(move || {
            Dataplane::new(DataplaneConfig::default())
                .expect("config")
                .sync(&p, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("sync")
        });
        assert!(r.adopted, "{forged}: {r:?}");
        assert_eq!(r.changes.chains_changed, 1, "{forged}: {r:?}");
        assert!(agrees().0, "{forged}: after the adoption: {:?}", agrees());
        assert_eq!(listing(), listed, "{forged}: after the adoption");
    }
}
