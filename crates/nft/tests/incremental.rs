//! Incremental correctness: random sequences of cluster changes, planned by the planner
//! and applied through the delta path with the planner's update (as `kproxy run` does).
//! Without the kernel: the update-driven delta equals `model::diff` of the whole tables
//! before and after. In the kernel: after every step the tables must equal what a fresh
//! full sync of the same plan produces (`Dataplane::verify` reads both tables back over
//! netlink and diffs them against the record: rules by their `kp:` ids, sets by
//! declaration and typed elements).

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::*;
use kproxy_core::PlanConfig;
use kproxy_core::config::LocalDetectorConfig;
use kproxy_core::model::IpFamily;
use kproxy_core::planner::PlanUpdate;
use kproxy_nft::internals::FamilyRecord;
use kproxy_nft::internals::model::{Counts, Family, Op, Tuple, Value, diff};
use kproxy_nft::{Dataplane, DataplaneConfig, Table, Transaction};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct SvcSpec {
    present: bool,
    kind: u8,
    etp_local: bool,
    itp_local: bool,
    /// ClientIP affinity with this timeout (seconds), or none.
    affinity: Option<u32>,
    dual_stack: bool,
    ranges: bool,
    /// The TCP port is named `web` instead of `http` (a renamed port).
    renamed: bool,
    /// per pod: 0 absent, 1 ready, 2 serving-terminating, 3 terminating
    endpoints: [u8; 4],
}

fn svc_spec() -> impl Strategy<Value = SvcSpec> {
    (
        (any::<bool>(), 0u8..3, any::<bool>(), any::<bool>()),
        prop_oneof![Just(None), Just(Some(300)), Just(Some(10800))],
        (any::<bool>(), any::<bool>(), prop::bool::weighted(0.2)),
        [0u8..4, 0u8..4, 0u8..4, 0u8..4],
    )
        .prop_map(
            |(
                (present, kind, etp_local, itp_local),
                affinity,
                (dual_stack, ranges, renamed),
                endpoints,
            )| {
                SvcSpec {
                    present,
                    kind,
                    etp_local,
                    itp_local,
                    affinity,
                    dual_stack,
                    ranges,
                    renamed,
                    endpoints,
                }
            },
        )
}

fn manifest(specs: &[SvcSpec]) -> String {
    let mut m = String::from(
        "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nspec: {podCIDRs: [10.244.1.0/24]}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.1}, {type: InternalIP, address: \"fd00:200::1\"}]}\n",
    );
    let pods = [
        ("10.244.1.2", "fd00:244:1::2", "node-a"),
        ("10.244.1.3", "fd00:244:1::3", "node-a"),
        ("10.244.2.2", "fd00:244:2::2", "node-b"),
        ("10.244.3.2", "fd00:244:3::2", "node-c"),
    ];
    for (i, s) in specs.iter().enumerate() {
        if !s.present {
            continue;
        }
        let ty = ["ClusterIP", "NodePort", "LoadBalancer"][s.kind as usize];
        let ext = s.kind > 0;
        let mut spec = format!(
            "  type: {ty}\n  internalTrafficPolicy: {}\n",
            if s.itp_local { "Local" } else { "Cluster" }
        );
        if s.dual_stack {
            spec += &format!(
                "  ipFamilyPolicy: PreferDualStack\n  ipFamilies: [IPv4, IPv6]\n  clusterIP: 10.96.0.{n}\n  clusterIPs: [10.96.0.{n}, \"fd00:96::{n}\"]\n",
                n = i + 10
            );
        } else {
            spec += &format!("  clusterIP: 10.96.0.{}\n", i + 10);
        }
        if ext {
            spec += &format!(
                "  externalTrafficPolicy: {}\n",
                if s.etp_local { "Local" } else { "Cluster" }
            );
            spec += &format!("  externalIPs: [203.0.113.{}]\n", i + 50);
        }
        if let Some(t) = s.affinity {
            spec += &format!(
                "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {{clientIP: {{timeoutSeconds: {t}}}}}\n"
            );
        }
        if s.ranges && s.kind == 2 {
            spec += "  loadBalancerSourceRanges: [198.51.100.0/24]\n";
        }
        let np = |base: u16| {
            if ext {
                format!(", nodePort: {}", base + i as u16)
            } else {
                String::new()
            }
        };
        let http = if s.renamed { "web" } else { "http" };
        spec += &format!(
            "  ports:\n  - {{name: {http}, port: 80, protocol: TCP{}}}\n  - {{name: dns, port: 53, protocol: UDP{}}}\n",
            np(30000),
            np(31000)
        );
        let status = if s.kind == 2 {
            format!(
                "status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.{}}}]}}}}\n",
                i + 10
            )
        } else {
            String::new()
        };
        m += &format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: ns}}\nspec:\n{spec}{status}"
        );
        for (fam, idx) in [("IPv4", 0), ("IPv6", 1)] {
            if idx == 1 && !s.dual_stack {
                continue;
            }
            let lf = fam.to_lowercase();
            m += &format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{i}-{lf}, namespace: ns, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: {fam}\nports: [{{name: {http}, port: 8080, protocol: TCP}}, {{name: dns, port: 8053, protocol: UDP}}]\nendpoints:\n"
            );
            let mut any = false;
            for (p, st) in s.endpoints.iter().enumerate() {
                let (r, sv, t) = match st {
                    1 => (true, true, false),
                    2 => (false, true, true),
                    3 => (false, false, true),
                    _ => continue,
                };
                any = true;
                let addr = if idx == 0 {
                    pods[p].0.to_string()
                } else {
                    format!("\"{}\"", pods[p].1)
                };
                m += &format!(
                    "- {{addresses: [{addr}], nodeName: {}, conditions: {{ready: {r}, serving: {sv}, terminating: {t}}}}}\n",
                    pods[p].2
                );
            }
            if !any {
                m += "  []\n";
                m = m.replace("endpoints:\n  []\n", "endpoints: []\n");
            }
        }
    }
    m
}

fn config() -> PlanConfig {
    PlanConfig {
        local_detector: LocalDetectorConfig::ClusterCidr(vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd00:244::/32".parse().unwrap(),
        ]),
        ..PlanConfig::default()
    }
}

/// `manifest` with the Node's pod CIDRs of `variant` (a node-level change under the
/// NodeCIDR detector: the local-pod match of every Service's rules changes).
fn manifest_on_node(specs: &[SvcSpec], variant: u8) -> String {
    let cidrs = match variant {
        0 => "[10.244.1.0/24]",
        1 => "[10.244.0.0/16]",
        _ => "[10.244.1.0/24, 10.245.1.0/24]",
    };
    manifest(specs).replacen(
        "podCIDRs: [10.244.1.0/24]",
        &format!("podCIDRs: {cidrs}"),
        1,
    )
}

/// A transaction as what it does, independent of how its operations are grouped: the
/// objects it adds, flushes and deletes, each chain's rules in order, each set's deleted
/// keys and added elements (each key at most once), its counts, and whether it replaces.
#[derive(Debug, Default, PartialEq)]
struct Effect {
    replaces: bool,
    objects: BTreeSet<String>,
    rules: BTreeMap<String, Vec<String>>,
    deleted: BTreeMap<String, BTreeSet<Tuple>>,
    added: BTreeMap<String, BTreeMap<Tuple, Option<Value>>>,
    counts: Counts,
}

fn effect(tx: &Transaction) -> Effect {
    let mut e = Effect {
        replaces: tx.replaces,
        counts: tx.counts,
        ..Effect::default()
    };
    let at = |family: &Family, name: &str| format!("{} {name}", family.nft());
    for op in &tx.ops {
        match op {
            Op::AddRule {
                family,
                chain,
                rule,
                ..
            } => e
                .rules
                .entry(at(family, chain))
                .or_default()
                .push(rule.to_string()),
            Op::DeleteElements {
                family, set, keys, ..
            } => {
                let d = e.deleted.entry(at(family, set)).or_default();
                for k in keys {
                    assert!(d.insert(k.clone()), "{set}: {k} deleted twice");
                }
            }
            Op::AddElements {
                family, set, elems, ..
            } => {
                let a = e.added.entry(at(family, set)).or_default();
                for el in elems {
                    assert!(
                        a.insert(el.key.clone(), el.value.clone()).is_none(),
                        "{set}: {} added twice",
                        el.key
                    );
                }
            }
            other => {
                assert!(e.objects.insert(format!("{other:?}")), "{other:?} twice");
            }
        }
    }
    e
}

/// `wanted` with the dispatch groups of `before` it lacks, empty: the record keeps a
/// group whose last Service left, idle (`record::IDLE_DISPATCH_GROUPS`; these plans
/// have too few endpoint counts to reach that cap).
fn with_idle_groups(wanted: &Table, before: &Table) -> Table {
    let group = |name: &str| {
        ["disp-", "npdisp-", "dnat-", "npdnat-"]
            .iter()
            .any(|p| name.starts_with(p))
    };
    let mut t = wanted.clone();
    for (name, chain) in before.chains() {
        if group(name) && !t.chains().contains_key(name) {
            t.chains_mut().insert(name.clone(), chain.clone());
        }
    }
    for (name, set) in before.sets() {
        if group(name) && !t.sets().contains_key(name) {
            t.sets_mut().insert(
                name.clone(),
                kproxy_nft::internals::model::Set::new(set.decl.clone()),
            );
        }
    }
    t
}

/// One owner of change, checked without the kernel: the delta a sync sends, moved by
/// the planner's update alone (`kproxy_nft::internals::delta`), equals `model::diff` of the whole
/// tables of the previous plan and of the new one (each with the idle dispatch groups
/// the record keeps), and leaves the record equal to a fresh build plus those groups. Random steps add and remove Services, change their type, traffic
/// policies, affinity and its timeout, source ranges, families, a port's name and their
/// endpoints (frontends moving between dispatch groups), and the Node's pod CIDRs (a
/// node-level change under the NodeCIDR detector).
#[test]
fn delta_from_the_update_equals_the_full_diff() {
    let cfg = PlanConfig {
        local_detector: LocalDetectorConfig::NodeCidr,
        ..PlanConfig::default()
    };
    let dp_cfg = DataplaneConfig::default();
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    // A step: the Services (or the previous step's again), and the Node's pod CIDRs
    // (or the previous step's again).
    let steps = proptest::collection::vec(
        (
            proptest::collection::vec(svc_spec(), 6),
            prop::bool::weighted(0.3),
            prop::option::weighted(0.3, 0u8..3),
        ),
        2..8,
    );
    runner
        .run(&steps, |steps| {
            let mut cluster = Moving::new("node-a", &cfg);
            let mut recs: Option<[FamilyRecord; 2]> = None;
            let mut previous: Option<[Table; 2]> = None;
            let (mut specs, mut node) = (&steps[0].0, 0);
            for (n, (new_specs, same_services, new_node)) in steps.iter().enumerate() {
                if !same_services {
                    specs = new_specs;
                }
                node = new_node.unwrap_or(node);
                let (plan, update) = cluster.step(&manifest_on_node(specs, node));
                let fresh = kproxy_nft::desired(plan, &dp_cfg);
                let wanted = match &previous {
                    Some(old) if recs.is_some() => {
                        [0, 1].map(|i| with_idle_groups(&fresh[i], &old[i]))
                    }
                    _ => fresh.clone(),
                };
                let moved = match (recs.as_mut(), &previous) {
                    (Some(r), Some(old)) => {
                        let tx = kproxy_nft::internals::delta(r, plan, &update, &dp_cfg).unwrap();
                        let mut full = Transaction::default();
                        for (o, w) in old.iter().zip(&wanted) {
                            full.extend(diff(o, w).unwrap());
                        }
                        full.order();
                        match tx {
                            Some(tx) => {
                                prop_assert!(
                                    tx.ops.windows(2).all(|w| w[0].phase() <= w[1].phase()),
                                    "step {}: ops out of phase order",
                                    n
                                );
                                prop_assert_eq!(
                                    effect(&tx),
                                    effect(&full),
                                    "step {}: {:?}",
                                    n,
                                    update
                                );
                                true
                            }
                            // Only a full sync can apply it: exactly when the diff
                            // replaces a table.
                            None => {
                                prop_assert!(full.replaces, "step {}: no delta", n);
                                false
                            }
                        }
                    }
                    _ => false,
                };
                let wanted = if moved {
                    wanted
                } else {
                    // A full sync: the record afresh, no idle group.
                    recs = Some(IpFamily::ALL.map(|f| FamilyRecord::full(plan, &dp_cfg, f)));
                    fresh
                };
                let r = recs.as_ref().expect("set above");
                prop_assert_eq!(&r[0].assemble(), &wanted[0], "step {}: IPv4 record", n);
                prop_assert_eq!(&r[1].assemble(), &wanted[1], "step {}: IPv6 record", n);
                previous = Some(wanted);
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn delta_sync_equals_full_sync() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let ns = Netns::new("inc");
    ns.run(|| {
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
            cases: 6,
            ..ProptestConfig::default()
        });
        let steps = proptest::collection::vec(proptest::collection::vec(svc_spec(), 5), 2..6);
        runner
            .run(&steps, |steps| {
                let mut dp = Dataplane::new(DataplaneConfig::default()).unwrap();
                let mut cluster = Moving::new("node-a", &config());
                let mut previous: Option<[Table; 2]> = None;
                for (n, specs) in steps.iter().enumerate() {
                    let (plan, update) = cluster.step(&manifest(specs));
                    // A declaration that changed (an affinity timeout: its sets'
                    // `timeout`) cannot change in place: that sync replaces the tables.
                    let wanted = kproxy_nft::desired(plan, &DataplaneConfig::default());
                    let redeclared = previous.as_ref().is_some_and(|old| {
                        old.iter()
                            .zip(&wanted)
                            .any(|(o, w)| diff(o, w).unwrap().replaces)
                    });
                    previous = Some(wanted);
                    let expected_ports: usize = specs
                        .iter()
                        .filter(|s| s.present)
                        .map(|s| if s.dual_stack { 4 } else { 2 })
                        .sum();
                    prop_assert_eq!(plan.service_ports().count(), expected_ports);
                    let r = dp
                        .sync(plan, &update)
                        .map_err(|e| TestCaseError::fail(format!("step {n}: {e}")))?;
                    // Step 0 of a case finds the previous case's tables and adopts them
                    // (a delta from whatever that case left), or replaces them.
                    prop_assert_eq!(
                        r.full || r.adopted,
                        n == 0 || redeclared,
                        "step {} {:?}",
                        n,
                        r
                    );
                    prop_assert!(n == 0 || !r.adopted, "step {} {:?}", n, r);
                    let v = dp
                        .verify()
                        .map_err(|e| TestCaseError::fail(format!("verify: {e}")))?;
                    prop_assert!(
                        v.differences.is_empty(),
                        "step {}: kernel differs from a full sync in {:?}",
                        n,
                        v.differences
                    );
                }
                Ok(())
            })
            .unwrap();
    });
}

#[test]
fn verify_detects_and_repairs_drift() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let ns = Netns::new("drift");
    ns.run(|| {
        let specs: Vec<SvcSpec> = (0..3)
            .map(|i| SvcSpec {
                present: true,
                kind: i,
                etp_local: false,
                itp_local: false,
                affinity: (i == 1).then_some(300),
                dual_stack: true,
                ranges: true,
                renamed: false,
                endpoints: [1, 1, 2, 0],
            })
            .collect();
        let plan = plan_from_yaml(&manifest(&specs), "node-a", &config());
        assert_eq!(plan.service_ports().count(), 12);
        let mut dp = Dataplane::new(DataplaneConfig::default()).unwrap();
        dp.sync(&plan, &PlanUpdate::WHOLE).unwrap();
        assert!(!dp.verify().unwrap().drift);
        // Someone else edits kproxy's table behind its back.
        sh("nft flush map ip kproxy service-ips && nft add rule ip6 kproxy services accept");
        assert_drift(&mut dp, &["map service-ips", "chain services"]);
        assert!(!dp.verify().unwrap().drift, "repaired");
        // A chain kproxy did not make: named, removed.
        sh("nft add chain ip kproxy foreign");
        let v = dp.verify().unwrap();
        assert_eq!(v.differences, ["chain foreign"]);
        assert!(!dp.verify().unwrap().drift, "repaired");
        // The table deleted entirely: also drift, also repaired.
        sh("nft delete table ip kproxy");
        let v = dp.verify().unwrap();
        assert_eq!(v.differences, ["table ip kproxy"]);
        assert!(!dp.verify().unwrap().drift);
        // Nothing changed: nothing sent.
        let r = dp.sync(&plan, &PlanUpdate::default()).unwrap();
        assert!(!r.full && r.netlink_bytes == 0, "{r:?}");
        kproxy_nft::cleanup(dp.config()).unwrap();
    });
}

/// Shared elements with several owners: two Services claim the same external IP:port
/// (first in plan order wins) and share an endpoint (one hairpin element). Removing and
/// re-adding either must leave exactly what a full sync would.
#[test]
fn shared_elements_follow_their_owners() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    // Same endpoint IP (one hairpin element), different target ports (tells the owner
    // of the external IP's dispatch rows).
    let svc = |name: &str, cip: &str| {
        let tport = if name == "a" { 8080 } else { 8081 };
        format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  clusterIP: {cip}\n  externalIPs: [203.0.113.7]\n  ports: [{{name: http, port: 80, protocol: TCP}}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {name}-1, namespace: ns, labels: {{kubernetes.io/service-name: {name}}}}}\naddressType: IPv4\nports: [{{name: http, port: {tport}, protocol: TCP}}]\nendpoints:\n- {{addresses: [10.244.1.2], nodeName: node-a}}\n"
        )
    };
    let node = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.1}]}\n";
    let steps = [
        format!("{node}{}{}", svc("a", "10.96.0.1"), svc("b", "10.96.0.2")),
        format!("{node}{}", svc("b", "10.96.0.2")),
        format!("{node}{}{}", svc("a", "10.96.0.1"), svc("b", "10.96.0.2")),
        format!("{node}{}", svc("a", "10.96.0.1")),
        node.to_string(),
    ];
    let ns = Netns::new("shared");
    ns.run(move || {
        let mut dp = Dataplane::new(DataplaneConfig::default()).unwrap();
        let mut cluster = Moving::new("node-a", &PlanConfig::default());
        for (n, text) in steps.iter().enumerate() {
            let (plan, update) = cluster.step(text);
            let r = dp.sync(plan, &update).unwrap();
            assert_eq!(r.full, n == 0);
            let v = dp.verify().unwrap();
            assert!(v.differences.is_empty(), "step {n}: {:?}", v.differences);
            let owner = sh("nft list ruleset ip");
            let row = |port: u16| format!("203.0.113.7 . tcp . 80 . 0 : 10.244.1.2 . {port}");
            match n {
                0 | 2 => assert!(
                    owner.contains("203.0.113.7 . tcp . 80 : goto disp-c-1")
                        && owner.contains(&row(8080))
                        && !owner.contains(&row(8081)),
                    "{owner}"
                ),
                1 => assert!(
                    owner.contains(&row(8081)) && !owner.contains(&row(8080)),
                    "{owner}"
                ),
                _ => {}
            }
            let hairpin = sh("nft list set ip kproxy hairpin");
            assert_eq!(
                hairpin.contains("10.244.1.2 . 10.244.1.2"),
                n < 4,
                "step {n}: {hairpin}"
            );
        }
    });
}

/// A NodePort Service with Cluster policies, no affinity or source ranges.
fn plain(endpoints: [u8; 4], dual_stack: bool) -> SvcSpec {
    SvcSpec {
        present: true,
        kind: 1,
        etp_local: false,
        itp_local: false,
        affinity: None,
        dual_stack,
        ranges: false,
        renamed: false,
        endpoints,
    }
}

/// An eTP=Local LoadBalancer Service (external IP, LB IP, NodePort; TCP and UDP) whose
/// local endpoints on node-a go 1 → 2 → 0 → 1, beside Services that keep every
/// dispatch group it moves between in use (so no group is created or deleted).
fn etp_local_steps() -> Vec<Vec<SvcSpec>> {
    let lb = |endpoints: [u8; 4]| SvcSpec {
        kind: 2,
        etp_local: true,
        ..plain(endpoints, false)
    };
    // Local (node-a) endpoints are pods 0 and 1.
    let holders = [lb([1, 1, 1, 1]), lb([1, 0, 1, 1]), lb([0, 0, 1, 1])];
    [[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 0, 1, 1]]
        .into_iter()
        .map(|eps| std::iter::once(lb(eps)).chain(holders.clone()).collect())
        .collect()
}

/// A change of an eTP=Local Service's local endpoint count is element-only: its
/// frontends go through the shared eTP=Local dispatch (`ruleset::EtpLocal`), whose
/// maps' elements are re-pointed, so no chain, rule or set of its own changes (before,
/// its own `ext-…`/`np-…` chains named the dispatch groups in their rules). Without
/// the kernel: the record's delta of each step.
#[test]
fn an_etp_local_service_s_local_endpoint_count_changes_are_element_only() {
    let dp_cfg = DataplaneConfig::default();
    let mut cluster = Moving::new("node-a", &config());
    let steps = etp_local_steps();
    let (plan, _) = cluster.step(&manifest(&steps[0]));
    let mut recs = IpFamily::ALL.map(|f| FamilyRecord::full(plan, &dp_cfg, f));
    for (n, specs) in steps.iter().enumerate().skip(1) {
        let (plan, update) = cluster.step(&manifest(specs));
        assert_eq!(update.services.len(), 1, "step {n}: {update:?}");
        let tx = kproxy_nft::internals::delta(&mut recs, plan, &update, &dp_cfg)
            .unwrap()
            .expect("a delta");
        let structural: Vec<_> = tx
            .ops
            .iter()
            .filter(|op| !matches!(op, Op::AddElements { .. } | Op::DeleteElements { .. }))
            .map(Op::object)
            .collect();
        assert!(structural.is_empty(), "step {n}: {structural:?}");
        // The re-pointed element of the Local set's map (its NodePort's too).
        for map in ["etp-local-local", "etp-local-np-local"] {
            assert!(
                tx.ops.iter().any(|op| op.object().2 == Some(map)),
                "step {n}: {map} untouched: {:?}",
                tx.ops
            );
        }
        let fresh = kproxy_nft::desired(plan, &dp_cfg);
        assert_eq!(recs[0].assemble(), fresh[0], "step {n}: the record");
    }
}

/// Deltas that only add and delete elements (endpoints replaced, failing over to
/// serving-terminating ones, a port losing all endpoints and getting them back) go out
/// as nfnetlink batches, not `nft` scripts, and leave exactly what a full sync would —
/// IPv4 and IPv6, cluster IPs, external IPs and NodePorts. A batch the kernel refuses
/// fails the sync with the set named, and the next sync is a full one.
#[test]
fn element_only_deltas_go_over_netlink() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let spec = |endpoints: [u8; 4]| plain(endpoints, true);
    // s2 keeps one ready endpoint throughout, so the one-endpoint dispatch group exists
    // and s0 moving between 2, 1 and 0 endpoints changes elements only.
    let steps = [
        [[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0]],
        [[1, 0, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]],
        [[1, 0, 0, 0], [2, 2, 0, 0], [1, 0, 0, 0]],
        [[0, 0, 0, 0], [2, 3, 1, 1], [1, 0, 0, 0]],
        [[0, 1, 0, 1], [1, 1, 0, 0], [1, 0, 0, 0]],
    ];
    let ns = Netns::new("nl");
    ns.run(move || {
        let mut dp = Dataplane::new(DataplaneConfig::default()).unwrap();
        let mut cluster = Moving::new("node-a", &config());
        for (n, step) in steps.iter().enumerate() {
            let specs: Vec<SvcSpec> = step.iter().map(|e| spec(*e)).collect();
            let (plan, update) = cluster.step(&manifest(&specs));
            let r = dp.sync(plan, &update).unwrap();
            if n == 0 {
                // No table yet: tables (dormant), chains and elements by netlink, then
                // the tables woken: hooked, no flag left.
                assert!(r.full && r.netlink_bytes > 0, "{r:?}");
                for family in ["ip", "ip6"] {
                    let listed = sh(&format!("nft list table {family} kproxy"));
                    assert!(listed.contains(" hook prerouting "), "{listed}");
                    assert!(!listed.contains("dormant"), "{listed}");
                }
            } else {
                assert!(!r.full && r.netlink_bytes > 0, "step {n}: {r:?}");
                assert!(r.changes.elements_deleted > 0, "step {n}: {r:?}");
            }
            let v = dp.verify().unwrap();
            assert!(v.differences.is_empty(), "step {n}: {:?}", v.differences);
        }
        // The kernel refuses the next delta: an element it deletes is already gone.
        // (The local pod 10.244.1.3 leaves every Service: its hairpin pair goes, the
        // dispatch groups stay, so the delta is one batch.)
        sh("nft delete element ip kproxy hairpin { 10.244.1.3 . 10.244.1.3 }");
        let last = [spec([0, 0, 1, 1]), spec([1, 0, 0, 1]), spec([1, 0, 0, 0])];
        let (plan, update) = cluster.step(&manifest(&last));
        let e = dp.sync(plan, &update).unwrap_err().to_string();
        assert!(
            e.contains("delete element ip kproxy hairpin") && e.contains("No such file"),
            "{e}"
        );
        // The sync loop hands the same update again (it stays owed until a sync
        // succeeds); the dataplane re-programs everything by itself: the tables exist,
        // so it reads them back and sends the difference (an adoption), not one
        // transaction of every element.
        let r = dp.sync(plan, &update).unwrap();
        assert!(
            r.adopted && !r.full,
            "after a failed batch the next sync adopts: {r:?}"
        );
        assert!(r.netlink_bytes > 0, "{r:?}");
        assert!(dp.verify().unwrap().differences.is_empty());
        kproxy_nft::cleanup(dp.config()).unwrap();
    });
}

/// A rolling update moves a Service's endpoint count N → N−1 → N → …: only the first
/// step to a count the tables never held creates its dispatch group (a map and a
/// chain); the group left behind stays, idle, so every later step is element-only, and the
/// kernel holds what the record says throughout. A full sync (a new process adopting
/// the tables) drops the idle groups.
#[test]
fn a_rolling_update_moves_elements_only_after_its_first_step() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let spec = |endpoints: [u8; 4]| plain(endpoints, false);
    let (three, two) = ([1, 1, 1, 0], [1, 3, 1, 0]);
    let steps = [three, two, three, two, three, two];
    let ns = Netns::new("idle");
    ns.run(move || {
        let mut dp = Dataplane::new(DataplaneConfig::default()).unwrap();
        let mut cluster = Moving::new("node-a", &config());
        for (n, endpoints) in steps.iter().enumerate() {
            let (plan, update) = cluster.step(&manifest(&[spec(*endpoints)]));
            let r = dp.sync(plan, &update).unwrap();
            match n {
                0 => assert!(r.full, "{r:?}"),
                // The two-endpoint group is new: its map and chain created.
                1 => assert!(
                    !r.full && r.changes.sets_added > 0 && r.changes.chains_added > 0,
                    "step 1: {r:?}"
                ),
                _ => assert!(
                    !r.full
                        && r.netlink_bytes > 0
                        && r.changes.sets_added + r.changes.chains_added == 0,
                    "step {n}: a group the tables held idle, element-only: {r:?}"
                ),
            }
            let v = dp.verify().unwrap();
            assert!(v.differences.is_empty(), "step {n}: {:?}", v.differences);
        }
        let listed = sh("nft list table ip kproxy");
        for group in ["dnat-c-2", "dnat-c-3", "disp-c-2", "disp-c-3"] {
            assert!(listed.contains(group), "{group} kept:\n{listed}");
        }
        // A new process adopts the tables from a fresh record: the idle group goes.
        let (plan, _) = cluster.step(&manifest(&[spec(two)]));
        let mut next = Dataplane::new(DataplaneConfig::default()).unwrap();
        let r = next.sync(plan, &PlanUpdate::WHOLE).unwrap();
        assert!(r.adopted, "{r:?}");
        let listed = sh("nft list table ip kproxy");
        assert!(!listed.contains("dnat-c-3"), "idle group left:\n{listed}");
        assert!(listed.contains("dnat-c-2"), "{listed}");
        kproxy_nft::cleanup(next.config()).unwrap();
    });
}
