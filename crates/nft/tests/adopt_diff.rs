//! Adoption compares the kernel's elements set by set, packed as read, against the
//! record's offered in pieces (`crates/nft/src/readback.rs`), never holding either
//! side typed. Its transaction must be exactly the diff of the typed tables:
//! `diff(adopt(read_table(), desired), desired)`, which says everything and only what
//! changed (the tests of model/). Random cluster states (the differential test's
//! generator) are programmed into a namespace, then compared with other random states,
//! with elements added, removed and re-valued behind kproxy's back, both ways.
//! Root only (network namespaces). Cases: `KPROXY_ADOPT_CASES` (default 12), seed
//! `KPROXY_ADOPT_SEED`.

mod common;

use common::Netns;
use common::cases::{Case, case, config, env_count, manifests, seeded_rng, state};
use kproxy_core::NodePlan;
use kproxy_nft::internals::{dump, model};
use kproxy_nft::{Dataplane, DataplaneConfig, Transaction};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestRunner};

fn plan(c: &Case) -> NodePlan {
    let text = manifests(c);
    let s = state(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    kproxy_core::plan(&s, "node-a", &config(c))
}

fn cfg() -> DataplaneConfig {
    common::no_conntrack_cleanup()
}

/// Both ways of saying what moves this namespace's tables to `plan`: adoption's
/// (`first_sync_transaction`, set by set) and the typed tables' diff.
fn both(ns: &Netns, plan: &NodePlan) -> ((Transaction, bool), Option<Transaction>) {
    let plan = plan.clone();
    ns.run(move || {
        let cfg = cfg();
        let adoption = kproxy_nft::first_sync_transaction(&plan, &cfg);
        let mut typed = Transaction::default();
        for desired in kproxy_nft::desired(&plan, &cfg) {
            let raw = dump::read_table(desired.family(), &cfg.table)
                .expect("readable")
                .expect("programmed");
            let Ok(kernel) = kproxy_nft::internals::adopt::adopt(&raw, &desired) else {
                return (adoption, None);
            };
            let tx = model::diff(&kernel, &desired).expect("same table");
            if tx.replaces {
                return (adoption, None);
            }
            typed.extend(tx);
        }
        typed.order();
        (adoption, Some(typed))
    })
}

fn assert_same(ns: &Netns, plan: &NodePlan, what: &str) {
    let ((adopted, ok), typed) = both(ns, plan);
    match typed {
        Some(typed) => {
            assert!(ok, "{what}: adoption gave up where the typed diff did not");
            assert_eq!(adopted.ops, typed.ops, "{what}: operations differ");
            assert_eq!(adopted.counts, typed.counts, "{what}: counts differ");
        }
        None => assert!(!ok, "{what}: adoption adopted what the typed path cannot"),
    }
}

#[test]
fn adoption_set_by_set_equals_the_typed_diff() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let mut runner =
        TestRunner::new_with_rng(Config::default(), seeded_rng("KPROXY_ADOPT_SEED", 7));
    let strategy = case();
    for n in 0..env_count("KPROXY_ADOPT_CASES", 12) {
        let a = plan(&strategy.new_tree(&mut runner).expect("a case").current());
        let b = plan(&strategy.new_tree(&mut runner).expect("a case").current());
        let ns = Netns::new("adiff");
        let programmed = {
            let a = a.clone();
            ns.run(move || {
                let mut dp = Dataplane::new(cfg()).expect("config");
                dp.sync(&a, &kproxy_core::planner::PlanUpdate::WHOLE)
                    .expect("sync")
            })
        };
        assert!(!programmed.adopted);
        // Nothing changed; another state; the same state again.
        assert_same(&ns, &a, &format!("case {n}: the state programmed"));
        let (nothing, _) = both(&ns, &a);
        assert!(
            nothing.1 && nothing.0.ops.is_empty(),
            "case {n}: {:?}",
            nothing.0.counts
        );
        assert_same(&ns, &b, &format!("case {n}: another state"));
        // Behind kproxy's back: an element of every non-dynamic set and map removed,
        // a foreign one added where the key type allows, then both ways again.
        for set in ["service-ips", "cluster-ips", "hairpin"] {
            ns.exec(&format!(
                "nft flush set ip kproxy {set} 2>/dev/null || nft flush map ip kproxy {set} 2>/dev/null; true"
            ));
        }
        let _ = ns.exec("nft add element ip kproxy cluster-ips { 10.99.99.99 } 2>/dev/null; true");
        assert_same(
            &ns,
            &a,
            &format!("case {n}: tampered, to the state programmed"),
        );
        assert_same(&ns, &b, &format!("case {n}: tampered, to another state"));
    }
}
