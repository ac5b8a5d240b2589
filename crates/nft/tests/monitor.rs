//! The kernel watch and the repair, against the real kernel in a namespace of
//! the test's own: kproxy's own transactions (a first sync in steps, a repair) and its
//! reading (a verification) are never reported; another process's (`nft`)
//! are, with its name and what it changed, and only when they touch kproxy's tables;
//! `Dataplane::repair` restores from the record what was deleted (elements, a chain's
//! rules, the whole ruleset), after which a verification finds nothing. Root only.

mod common;

use common::*;
use kproxy_core::PlanConfig;
use kproxy_core::planner::PlanUpdate;
use kproxy_nft::{ChangeKind, Event, Interference, Monitor};
use kproxy_nft::{Dataplane, DataplaneConfig};

/// Everything the monitor reports until it has been quiet for a second.
fn until_quiet(mon: &mut Monitor) -> Vec<Event> {
    let mut seen = Vec::new();
    while let Some(e) = mon.next_event().expect("monitor") {
        seen.push(e);
    }
    seen
}

/// The next interference (waiting up to 20 s).
fn next_interference(mon: &mut Monitor) -> Interference {
    for _ in 0..20 {
        match mon.next_event().expect("monitor") {
            Some(Event::Interference(i)) => return i,
            Some(Event::Lost) => panic!("notifications lost"),
            None => {}
        }
    }
    panic!("no interference reported");
}

#[test]
fn other_processes_changes_are_reported_and_repaired_from_the_record() {
    if !root() {
        return;
    }
    let ns = Netns::new("mon");
    let plan = plan_from_yaml(&example_cluster(), "node-a", &PlanConfig::default());
    ns.run(move || {
        let mut mon = Monitor::open("kproxy").expect("subscribe");
        let mut dp = Dataplane::new(DataplaneConfig {
            conntrack_cleanup: false,
            ..DataplaneConfig::default()
        })
        .expect("config");
        let first = dp.sync(&plan, &PlanUpdate::WHOLE).expect("first sync");
        assert!(first.full && first.netlink_bytes > 0, "{first:?}");
        // Another table: none of kproxy's business.
        sh("nft add table ip other");
        assert!(!dp.verify().expect("verify").drift);
        let quiet = until_quiet(&mut mon);
        assert!(
            quiet.is_empty(),
            "kproxy's own transactions reported: {quiet:?}"
        );

        // Elements deleted by another process.
        sh("nft flush set ip kproxy cluster-ips");
        let i = next_interference(&mut mon);
        assert_eq!(i.process, "nft");
        assert!(i.pid > 0);
        assert!(!i.tables_missing());
        assert!(
            i.changes.counts[&ChangeKind::Element].1 >= 1,
            "{:?}",
            i.changes
        );
        let r = dp.repair(&plan).expect("repair");
        assert!(r.adopted && r.changes.elements_added >= 1, "{r:?}");
        assert!(r.netlink_bytes > 0, "{r:?}");

        // A chain's rules.
        sh("nft flush chain ip6 kproxy nat-output");
        let i = next_interference(&mut mon);
        assert_eq!(
            i.changes.counts.get(&ChangeKind::Rule),
            Some(&(0, 1)),
            "{:?}",
            i.changes
        );
        assert!(
            i.changes.examples[0].contains("nat-output"),
            "{:?}",
            i.changes
        );
        let r = dp.repair(&plan).expect("repair");
        assert!(r.adopted && r.changes.chains_changed >= 1, "{r:?}");

        // The whole ruleset: both tables gone, restored the first sync's way.
        sh("nft flush ruleset");
        let i = next_interference(&mut mon);
        assert!(i.tables_missing());
        assert_eq!(i.changes.tables_deleted.len(), 2, "{:?}", i.changes);
        let r = dp.repair(&plan).expect("repair");
        assert!(!r.adopted && !r.full && r.netlink_bytes > 0, "{r:?}");

        // Restored to the record, and none of the repairs was reported.
        let v = dp.verify().expect("verify");
        assert!(!v.drift, "{:?}", v.differences);
        let quiet = until_quiet(&mut mon);
        assert!(quiet.is_empty(), "kproxy's repairs reported: {quiet:?}");
    });
}

/// `nft rename chain ip kproxy services services2` was never repaired: the repair's
/// delta deleted a chain still jumped to (EBUSY) at every retry, and a restart's
/// adoption failed the same way; only `kproxy cleanup` recovered. A delta the kernel
/// refuses is followed by a replacement: repaired, and a restart programs.
#[test]
fn a_renamed_chain_is_repaired_and_a_restart_over_it_programs() {
    if !root() {
        return;
    }
    let ns = Netns::new("rename");
    let plan = plan_from_yaml(&example_cluster(), "node-a", &PlanConfig::default());
    ns.run(move || {
        let cfg = DataplaneConfig {
            conntrack_cleanup: false,
            ..DataplaneConfig::default()
        };
        let mut dp = Dataplane::new(cfg.clone()).expect("config");
        dp.sync(&plan, &PlanUpdate::WHOLE).expect("first sync");
        sh("nft rename chain ip kproxy services services2");
        dp.repair(&plan).expect("repair of a renamed chain");
        let v = dp.verify().expect("verify");
        assert!(!v.drift, "{:?}", v.differences);
        let listed = |t: &str| {
            let out = std::process::Command::new("nft")
                .args(["list", "table", "ip", t])
                .output()
                .expect("nft list");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        assert!(
            !listed("kproxy").contains("services2"),
            "{}",
            listed("kproxy")
        );

        // A restart over a renamed chain.
        sh("nft rename chain ip kproxy services services2");
        drop(dp);
        let mut dp = Dataplane::new(cfg).expect("config");
        dp.sync(&plan, &PlanUpdate::WHOLE)
            .expect("a restart's first sync over a renamed chain");
        let v = dp.verify().expect("verify");
        assert!(!v.drift, "{:?}", v.differences);
        assert!(
            !listed("kproxy").contains("services2"),
            "{}",
            listed("kproxy")
        );
    });
}

/// A foreign named counter in kproxy's table was "repaired" with 0 bytes and left in
/// place (issue 42, 10c): the kernel read listed no named objects. The read now
/// dumps them (NFT_MSG_GETOBJ), so verification names one as a difference, and the
/// repair, a verification's repair and a restart's adoption each delete it over
/// nfnetlink, also when a foreign rule in kproxy's chain still uses it.
#[test]
fn a_foreign_named_object_in_kproxys_table_is_named_and_removed() {
    if !root() {
        return;
    }
    let ns = Netns::new("objects");
    let plan = plan_from_yaml(&example_cluster(), "node-a", &PlanConfig::default());
    ns.run(move || {
        let cfg = DataplaneConfig {
            conntrack_cleanup: false,
            ..DataplaneConfig::default()
        };
        let ruleset = || sh("nft list ruleset");
        let mut dp = Dataplane::new(cfg.clone()).expect("config");
        dp.sync(&plan, &PlanUpdate::WHOLE).expect("first sync");

        // The repair the kernel watch runs.
        sh("nft add counter ip kproxy evil");
        sh("nft add quota ip6 kproxy evil-quota '{ over 1 mbytes }'");
        sh("nft add rule ip kproxy services counter name evil");
        assert!(ruleset().contains("counter evil"), "{}", ruleset());
        let r = dp.repair(&plan).expect("repair");
        assert_eq!(r.changes.objects_deleted, 2, "{:?}", r.changes);
        assert!(
            !r.changes.is_empty(),
            "a repair that deleted objects changed something"
        );
        let after = ruleset();
        assert!(
            !after.contains("evil") && !after.contains("counter name"),
            "{after}"
        );
        let v = dp.verify().expect("verify");
        assert!(!v.drift, "{:?}", v.differences);

        // Verification names it, and its repair removes it.
        sh("nft add counter ip kproxy evil");
        let v = dp.verify().expect("verify");
        assert!(v.drift);
        assert_eq!(v.differences, ["counter evil"]);
        assert!(!ruleset().contains("evil"), "{}", ruleset());

        // A restart's adoption (what `sync --once` does too).
        sh("nft add counter ip kproxy evil");
        drop(dp);
        let mut dp = Dataplane::new(cfg).expect("config");
        let r = dp.sync(&plan, &PlanUpdate::WHOLE).expect("restart");
        assert!(r.adopted, "adopted in place, not replaced");
        assert_eq!(r.changes.objects_deleted, 1, "{:?}", r.changes);
        assert!(!ruleset().contains("evil"), "{}", ruleset());
        assert!(!dp.verify().expect("verify").drift);
    });
}
