//! The ruleset kproxy writes over nfnetlink is the one `nft -f` of the rendered text
//! writes (issue 39, item 5), on the differential test's random cluster states
//! (`common::cases`: Services of every type, both traffic policies and families, source
//! ranges, affinity, node-port CIDRs, every local-traffic detector). Both directions,
//! in a network namespace of its own:
//!
//! - nft first: `nft -f` of [`kproxy_nft::internals::render`], listed (`nft list ruleset`); a new
//!   dataplane reads those tables back over nfnetlink and finds its record in them (an
//!   adoption that sends nothing);
//! - nfnetlink first: the dataplane's first sync into absent tables, then its
//!   one-transaction replacement, each listed and compared with nft's listing; `nft -f`
//!   of the rendered text over them then lists the same again.
//!
//! Cases: `KPROXY_SAME_CASES` (default 64), seed `KPROXY_SAME_SEED` (a fixed default;
//! `random` for a fresh one).

mod common;

use common::cases::{case, config, env_count, manifests, seeded_rng, state};
use common::{Netns, nft_in};
use kproxy_core::planner::PlanUpdate;
use kproxy_nft::internals::render;
use kproxy_nft::{Dataplane, DataplaneConfig};
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// `nft list ruleset`, with the elements of each set in one order: a hash set lists
/// in its hash's order, which a set's random seed makes differ between two writes of
/// the same elements.
fn listing(ns: &Netns) -> String {
    normalize(&nft_in(ns, &["list", "ruleset"], None))
}

fn normalize(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        // A counter's comment is since when it counts (set by the dataplane when it
        // sends, not by the script).
        if line
            .trim_start()
            .starts_with("comment \"kproxy counts since ")
        {
            continue;
        }
        let Some((head, rest)) = line.split_once("elements = { ") else {
            out.push_str(line);
            out.push('\n');
            continue;
        };
        let mut body = rest.to_string();
        while !body.trim_end().ends_with('}') {
            let Some(next) = lines.next() else { break };
            body.push(' ');
            body.push_str(next.trim());
        }
        let body = body.trim_end().trim_end_matches('}');
        let mut elems: Vec<&str> = body
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .collect();
        elems.sort_unstable();
        out.push_str(head);
        out.push_str("elements = { ");
        out.push_str(&elems.join(", "));
        out.push_str(" }\n");
    }
    out
}

fn sync(
    ns: &Netns,
    plan: &kproxy_core::NodePlan,
    replace: bool,
    cfg: &DataplaneConfig,
) -> kproxy_nft::SyncReport {
    let (plan, cfg) = (plan.clone(), cfg.clone());
    ns.run(move || {
        let mut dp = Dataplane::new(cfg).expect("config");
        if replace {
            dp.force_full_sync();
        }
        dp.sync(&plan, &PlanUpdate::WHOLE).expect("sync")
    })
}

#[test]
fn normalized_listings_sort_elements_only() {
    let a = "table ip t {\n\tset s {\n\t\ttype ipv4_addr\n\t\telements = { 10.0.0.2, 10.0.0.1,\n\t\t\t     10.0.0.3 }\n\t}\n}\n";
    let b = "table ip t {\n\tset s {\n\t\ttype ipv4_addr\n\t\telements = { 10.0.0.1, 10.0.0.3, 10.0.0.2 }\n\t}\n}\n";
    assert_eq!(normalize(a), normalize(b));
    assert!(normalize(a).contains("elements = { 10.0.0.1, 10.0.0.2, 10.0.0.3 }"));
    assert_ne!(normalize(a), normalize(&b.replace("10.0.0.2", "10.0.0.9")));
}

#[test]
fn the_ruleset_written_over_nfnetlink_is_the_one_nft_writes() {
    same(DataplaneConfig::default(), 64);
}

/// The same with the traffic counters (counter objects, objref maps, `ct original`
/// keys, `counter name` rules).
#[test]
fn with_traffic_counters_the_ruleset_written_over_nfnetlink_is_the_one_nft_writes() {
    same(
        DataplaneConfig {
            counters: true,
            ..DataplaneConfig::default()
        },
        16,
    );
}

fn same(dp_cfg: DataplaneConfig, default_cases: u32) {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let ns = Netns::new("same");
    let cases = env_count("KPROXY_SAME_CASES", default_cases);
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases,
            max_shrink_iters: 50,
            failure_persistence: None,
            ..Config::default()
        },
        seeded_rng("KPROXY_SAME_SEED", 39),
    );
    let result = runner.run(&case(), |c| {
        let st = state(&manifests(&c)).map_err(TestCaseError::fail)?;
        let plan = kproxy_core::plan(&st, "node-a", &config(&c));
        let script = render(&plan, &dp_cfg);
        let fail = |what: &str, a: &str, b: &str| {
            Err(TestCaseError::fail(format!(
                "{what}:\n--- nft -f ---\n{a}\n--- nfnetlink ---\n{b}"
            )))
        };

        // nft first; nfnetlink's reader finds the record in nft's tables.
        ns.run(|| kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup"));
        nft_in(&ns, &[], Some(&script));
        let by_nft = listing(&ns);
        let adopted = sync(&ns, &plan, false, &dp_cfg);
        if !(adopted.adopted && adopted.changes.is_empty()) {
            return Err(TestCaseError::fail(format!(
                "nft's tables do not read back as the record: {adopted:?}"
            )));
        }

        // nfnetlink first: the first sync into absent tables, then the replacement.
        ns.run(|| kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup"));
        let first = sync(&ns, &plan, false, &dp_cfg);
        if !first.full || first.adopted {
            return Err(TestCaseError::fail(format!("not a first sync: {first:?}")));
        }
        let by_netlink = listing(&ns);
        if by_netlink != by_nft {
            return fail("first sync", &by_nft, &by_netlink);
        }
        sync(&ns, &plan, true, &dp_cfg);
        let replaced = listing(&ns);
        if replaced != by_nft {
            return fail("replacement", &by_nft, &replaced);
        }
        // nft over nfnetlink's tables (its script deletes and recreates them) lists the
        // same again.
        nft_in(&ns, &[], Some(&script));
        let again = listing(&ns);
        if again != by_netlink {
            return fail("nft -f over nfnetlink's tables", &again, &by_netlink);
        }
        Ok(())
    });
    eprintln!("sameness: {cases} cases");
    if let Err(e) = result {
        panic!("{e}");
    }
}
