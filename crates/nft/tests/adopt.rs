//! Adoption at start: a new `Dataplane` finding kproxy's tables in
//! the kernel reads them back over netlink and sends only the difference. After it, the
//! kernel must equal what a cold sync of the same plan produces in a namespace of its
//! own (compared as normalized `nft -j` listings plus every rule's comment, in order).
//! Root only: each test makes its own network namespaces.

mod common;

use common::*;
use kproxy_core::{NodePlan, PlanConfig};
use kproxy_nft::{Dataplane, DataplaneConfig, SyncReport};
use serde_json::Value;

fn cfg() -> DataplaneConfig {
    no_conntrack_cleanup()
}

/// Plans with CIDR-based local traffic detection (an interval set), affinity (dynamic
/// sets), LB source ranges (anonymous sets in rules) and both families.
fn plan_of(text: &str) -> NodePlan {
    let pc = PlanConfig {
        local_detector: two_cluster_cidrs_a_family(),
        ..PlanConfig::default()
    };
    plan_from_yaml(text, "node-a", &pc)
}

/// The example cluster without the documents whose text contains any of `drop`.
fn cluster_without(drop: &[&str]) -> String {
    example_cluster()
        .split("\n---\n")
        .filter(|doc| !drop.iter().any(|d| doc.contains(d)))
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// What a table holds, for comparison: per object its normalized content, and the
/// comments of each chain's rules in order.
fn listing(ns: &Netns) -> Vec<String> {
    let mut out = Vec::new();
    for fam in ["ip", "ip6"] {
        let text = ns.exec(&format!("nft -j list table {fam} kproxy"));
        let json: Value = serde_json::from_str(&text).expect("nft -j output");
        for (k, v) in normalize(&json) {
            out.push(format!("{fam} {k} {v}"));
        }
        for item in json["nftables"].as_array().expect("nftables array") {
            if let Some(r) = item.get("rule") {
                out.push(format!(
                    "{fam} rule in {} comment {}",
                    r["chain"], r["comment"]
                ));
            }
        }
    }
    out
}

fn sync_in(ns: &Netns, plan: &NodePlan) -> SyncReport {
    let plan = plan.clone();
    ns.run(move || {
        Dataplane::new(cfg())
            .expect("config")
            .sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
            .expect("sync")
    })
}

fn assert_same_as_cold(ns: &Netns, plan: &NodePlan) {
    let cold = Netns::new("cold");
    let r = sync_in(&cold, plan);
    assert!(r.full && !r.adopted, "{r:?}");
    let (got, want) = (listing(ns), listing(&cold));
    let missing: Vec<_> = want.iter().filter(|l| !got.contains(l)).collect();
    let extra: Vec<_> = got.iter().filter(|l| !want.contains(l)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "kernel differs from a cold sync:\nmissing {missing:#?}\nextra {extra:#?}"
    );
}

#[test]
fn restart_with_nothing_changed_sends_an_empty_transaction() {
    if !root() {
        return;
    }
    let ns = Netns::new("adopt0");
    let plan = plan_of(&example_cluster());
    let first = sync_in(&ns, &plan);
    assert!(first.full && !first.adopted);
    let before = listing(&ns);
    // The plan has every kind of set adoption reads: interval, dynamic, verdict maps.
    for kind in ["set local-pods", "set aff-", "map service-ips", "map dnat-"] {
        assert!(
            before.iter().any(|l| l.contains(kind)),
            "no {kind} in {before:#?}"
        );
    }
    let again = sync_in(&ns, &plan);
    assert!(again.adopted && !again.full, "{again:?}");
    assert!(again.changes.is_empty(), "{:?}", again.changes);
    assert_eq!(again.netlink_bytes, 0);
    assert_eq!(listing(&ns), before);
    assert_same_as_cold(&ns, &plan);
    // Only elements differ: the difference goes as one nfnetlink batch.
    ns.exec("nft flush set ip kproxy cluster-ips && nft add element ip kproxy hairpin { 10.9.9.9 . 10.9.9.9 }");
    let r = sync_in(&ns, &plan);
    assert!(r.adopted, "{r:?}");
    assert_eq!(r.changes.elements_deleted, 1, "{:?}", r.changes);
    assert!(r.changes.elements_added >= 1, "{:?}", r.changes);
    assert!(r.netlink_bytes > 0, "{r:?}");
    assert_eq!(listing(&ns), before);
}

#[test]
fn restart_into_another_plan_sends_the_difference() {
    if !root() {
        return;
    }
    // Both ways: Services removed, and Services added, while kproxy was down.
    let full = plan_of(&example_cluster());
    let part = plan_of(&cluster_without(&[
        "name: web",
        "kubernetes.io/service-name: web",
    ]));
    assert_ne!(full.services.len(), part.services.len());
    for (from, to) in [(&full, &part), (&part, &full)] {
        let ns = Netns::new("adopt1");
        sync_in(&ns, from);
        let r = sync_in(&ns, to);
        assert!(r.adopted && !r.full, "{r:?}");
        assert!(!r.changes.is_empty(), "{:?}", r.changes);
        assert!(r.netlink_bytes > 0, "{r:?}");
        assert_same_as_cold(&ns, to);
    }
}

#[test]
fn a_chain_changed_behind_kproxys_back_is_refilled() {
    if !root() {
        return;
    }
    let ns = Netns::new("adopt2");
    let plan = plan_of(&example_cluster());
    sync_in(&ns, &plan);
    // A rule kproxy did not write (no tag), an element removed, one added.
    ns.exec("nft insert rule ip kproxy services counter");
    let list = ns.exec("nft list set ip kproxy cluster-ips");
    let ip = list
        .split(|c: char| c == '{' || c == '}' || c == ',' || c.is_whitespace())
        .find(|w| w.starts_with("10.96."))
        .expect("a cluster IP")
        .to_string();
    ns.exec(&format!(
        "nft delete element ip kproxy cluster-ips {{ {ip} }} && nft add element ip kproxy cluster-ips {{ 10.96.99.99 }}"
    ));
    let r = sync_in(&ns, &plan);
    assert!(r.adopted, "{r:?}");
    assert_eq!(r.changes.chains_changed, 1, "{:?}", r.changes);
    assert_eq!(
        (r.changes.elements_added, r.changes.elements_deleted),
        (1, 1),
        "{:?}",
        r.changes
    );
    assert_same_as_cold(&ns, &plan);
}

#[test]
fn a_table_kproxy_cannot_account_for_is_replaced() {
    if !root() {
        return;
    }
    let plan = plan_of(&example_cluster());
    let cases = [
        // Not kproxy's comment: someone else's table of that name.
        "nft add table ip kproxy && nft add table ip6 kproxy",
        // A base chain hooked elsewhere than declared.
        "nft add table ip kproxy \\{ comment \\\"rules for kproxy\\\"\\; \\} && nft add table ip6 kproxy \\{ comment \\\"rules for kproxy\\\"\\; \\} && nft add chain ip kproxy nat-output \\{ type nat hook input priority 0\\; \\}",
        // A set whose type differs from the declaration.
        "nft add table ip kproxy \\{ comment \\\"rules for kproxy\\\"\\; \\} && nft add table ip6 kproxy \\{ comment \\\"rules for kproxy\\\"\\; \\} && nft add set ip kproxy cluster-ips \\{ type ipv6_addr\\; comment \\\"active cluster IPs\\\"\\; \\}",
    ];
    for setup in cases {
        let ns = Netns::new("adopt3");
        ns.exec(setup);
        let r = sync_in(&ns, &plan);
        assert!(r.full && !r.adopted, "{setup}: {r:?}");
        assert_same_as_cold(&ns, &plan);
    }
}

#[test]
fn the_dump_reads_what_the_sync_wrote() {
    if !root() {
        return;
    }
    let ns = Netns::new("adopt4");
    let plan = plan_of(&example_cluster());
    sync_in(&ns, &plan);
    let [rs, _] = kproxy_nft::desired(&plan, &cfg());
    let raw = ns
        .run(|| kproxy_nft::internals::dump::read_table(kproxy_nft::Family::Ip, "kproxy"))
        .expect("dump")
        .expect("table present");
    assert_eq!(raw.comment.as_deref(), Some("rules for kproxy"));
    let chains: Vec<&String> = raw.chains.keys().collect();
    assert_eq!(chains, rs.chains().keys().collect::<Vec<_>>());
    let sets: Vec<&String> = raw.sets.keys().collect();
    assert_eq!(sets, rs.sets().keys().collect::<Vec<_>>());
    for (name, c) in rs.chains() {
        let tags: Vec<Option<String>> = raw.chains[name]
            .rules
            .iter()
            .map(|r| r.comment.clone())
            .collect();
        let want: Vec<Option<String>> = c
            .rules
            .iter()
            .map(|r| Some(format!("kp:{}", r.id())))
            .collect();
        assert_eq!(tags, want, "chain {name}");
        assert_eq!(raw.chains[name].hook.is_some(), c.hook.is_some());
    }
    // Read back into the model, the kernel equals the desired table, elements included.
    let kernel = kproxy_nft::internals::adopt::adopt(&raw, &rs).expect("adoptable");
    assert_eq!(kernel, rs);
    assert!(rs.sets().values().any(|s| !s.elements.is_empty()));
    assert!(
        kproxy_nft::internals::model::diff(&kernel, &rs)
            .unwrap()
            .is_empty()
    );
    let absent = ns
        .run(|| kproxy_nft::internals::dump::read_table(kproxy_nft::Family::Ip, "nosuch"))
        .expect("dump");
    assert_eq!(absent, None);
}
