//! Tables at scale (issue 48): reading kproxy's tables back stays linear in their
//! elements, and traffic flows through a dispatch group split into several maps. Root
//! only: each test makes its own network namespaces.
//!
//! Why a structural check and not a time: the kernel's element dump sends one ≈ 32 KiB
//! message per round, and each round walks the set from its start, skipping what it
//! sent before (`nf_tables_dump_set`). The reader counts that walk
//! (`RawSet::dump_visits`): per element read it is a constant while no set outgrows its
//! bound, and it grows with the largest set's size when one does — the cause of a
//! restart at 100k Services × 10 endpoints costing 87–105 s against a cold sync's 16–19.

mod common;

use std::net::IpAddr;
use std::time::Duration;

use common::fabric::{Fabric, From, Outcome};
use common::*;
use kproxy_core::model::Protocol;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::synthetic::{self, Spec};
use kproxy_core::{NodePlan, PlanConfig};
use kproxy_nft::internals::Shards;
use kproxy_nft::internals::dump::{self, RawTable};
use kproxy_nft::{Dataplane, DataplaneConfig, NftError, SyncReport};
use kproxy_test_support::nft_neighbour::Neighbour;

fn cfg() -> DataplaneConfig {
    no_conntrack_cleanup()
}

/// [`cfg`] with the traffic counters on.
fn counting() -> DataplaneConfig {
    DataplaneConfig {
        counters: true,
        ..cfg()
    }
}

/// Plain ClusterIP Services, every endpoint ready: one dispatch group of `eps` rows
/// per Service.
fn plain(services: usize, eps: usize) -> Spec {
    Spec {
        etp_local_every: 0,
        terminating_every: 0,
        hinted_every: 0,
        ..Spec::new(services, eps)
    }
}

/// The plan of [`plain`] Services on `node-0`.
fn plain_plan(services: usize, eps: usize) -> NodePlan {
    kproxy_core::plan(
        &synthetic::cluster(&plain(services, eps)),
        "node-0",
        &PlanConfig::default(),
    )
}

/// A new dataplane's first sync of `plan` with `cfg` (a start, or a restart).
fn first_sync(cfg: DataplaneConfig, plan: &NodePlan) -> Result<SyncReport, NftError> {
    Dataplane::new(cfg)
        .expect("config")
        .sync(plan, &PlanUpdate::WHOLE)
}

/// The kernel's element visits per element read, over the table's sets.
fn visits_per_element(t: &RawTable) -> f64 {
    let (visits, elements) = t.sets.values().fold((0u64, 0usize), |(v, e), s| {
        (v + s.dump_visits, e + s.elements.iter().count())
    });
    visits as f64 / elements as f64
}

/// Syncs `services` × 10 cold in a namespace of its own with `cfg`, reads the IPv4
/// table back, and adopts it with a new dataplane; the table as read.
fn cold_then_read(services: usize, cfg: fn() -> DataplaneConfig) -> RawTable {
    let ns = Netns::new("scale");
    let plan = plain_plan(services, 10);
    ns.run(move || {
        let r = first_sync(cfg(), &plan).expect("cold sync");
        assert!(r.full && !r.adopted, "{r:?}");
        let table = dump::read_table(kproxy_nft::Family::Ip, "kproxy")
            .expect("read")
            .expect("the table exists");
        // A restart with nothing changed adopts the sharded tables: nothing sent.
        let r = first_sync(cfg(), &plan).expect("restart");
        assert!(r.adopted && r.netlink_bytes == 0, "{r:?}");
        table
    })
}

/// Reading a table back at 4× the rows costs the kernel the same walk per element: no
/// set outgrows the dispatch maps' bound, so the dump's rounds stay few per set. With
/// the one map per endpoint count of before, 80,000 rows in one map made ≈ 4× the
/// visits per element of 20,000 (the square of the set).
#[test]
fn reading_the_tables_back_stays_linear_in_their_elements() {
    if !root() {
        return;
    }
    read_at_n_and_4n(cfg);
}

/// The tables of 2,000 and 8,000 Services × 10 with `cfg`, read back, after checking
/// that the larger cost the kernel the same element visits per element read (within
/// half) and that no set of either outgrew the dispatch maps' bound.
fn read_at_n_and_4n(cfg: fn() -> DataplaneConfig) -> (RawTable, RawTable) {
    let small = cold_then_read(2_000, cfg);
    let big = cold_then_read(8_000, cfg);
    let (at_n, at_4n) = (visits_per_element(&small), visits_per_element(&big));
    assert!(
        at_4n <= 1.5 * at_n,
        "visits per element read: {at_n:.1} at 2,000 Services, {at_4n:.1} at 8,000"
    );
    for t in [&small, &big] {
        let largest = t.sets.values().map(|s| s.elements.iter().count()).max();
        assert!(
            largest <= Some(2 * Shards::ROWS),
            "a set of {largest:?} elements"
        );
    }
    (small, big)
}

/// The traffic counters read back at 4× the Services cost the kernel the same per
/// object and per element: each counter object is asked for by name, once (the
/// object dump walks the table's objects from the first at every ≈ 32 KiB round:
/// 140,000 counters took 34 s), and no counter map outgrows the sets' bound.
#[test]
fn reading_the_counters_back_stays_linear_in_their_objects() {
    if !root() {
        return;
    }
    let (small, big) = read_at_n_and_4n(counting);
    for t in [&small, &big] {
        let read = t.object_read;
        assert!(read.by_name, "{read:?}");
        assert_eq!(read.visits, t.objects.len() as u64, "{read:?}");
        assert_eq!(t.counters.len(), t.objects.len());
    }
    assert!(big.objects.len() > 3 * small.objects.len());
}

/// Another program's objects in kproxy's table are not named by its elements or
/// rules: the reading sees the table hold more objects than those, reads them all by
/// the dump, and the adoption deletes the foreign ones; once they are gone the
/// counters are read by name again, and a counter deleted behind kproxy's back is
/// missing from the daemon's reading (its lookup answers ENOENT), not an error.
#[test]
fn another_programs_objects_are_read_by_the_dump_and_removed() {
    if !root() {
        return;
    }
    let ns = Netns::new("foreignobj");
    let plan = plain_plan(20, 2);
    let read = || {
        dump::read_table(kproxy_nft::Family::Ip, "kproxy")
            .expect("read")
            .expect("the table exists")
    };
    let p = plan.clone();
    let ours = ns.run(move || {
        first_sync(counting(), &p).expect("cold sync");
        read()
    });
    assert!(ours.object_read.by_name, "{:?}", ours.object_read);
    assert!(ours.counters.len() > 20, "{}", ours.counters.len());
    nft_in(
        &ns,
        &["add counter ip kproxy foreign; add quota ip kproxy foreign-quota 100 bytes"],
        None,
    );
    let p = plan.clone();
    let (theirs, adopted, gone) = ns.run(move || {
        let theirs = read();
        let mut dp = Dataplane::new(counting()).expect("config");
        let r = dp.sync(&p, &PlanUpdate::WHOLE).expect("restart");
        assert!(r.adopted, "{r:?}");
        let adopted = read();
        // A counter the dataplane knows, deleted behind its back (no element names a
        // port's fallback counter without a fallback set): its lookup by name answers
        // ENOENT, and the reading is still whole and by name.
        let fallback = adopted
            .counters
            .keys()
            .find(|n| n.starts_with("fallback-"))
            .expect("a fallback counter")
            .clone();
        sh(&format!("nft delete counter ip kproxy {fallback}"));
        let read: Vec<String> = dp
            .read_counters()
            .expect("the daemon's reading")
            .into_iter()
            .filter(|c| c.family == kproxy_nft::Family::Ip)
            .map(|c| c.name)
            .collect();
        assert!(!read.contains(&fallback));
        assert_eq!(read.len(), adopted.counters.len() - 1);
        (theirs, adopted, fallback)
    });
    assert!(gone.starts_with("fallback-"));
    assert!(!theirs.object_read.by_name, "{:?}", theirs.object_read);
    assert_eq!(theirs.objects.len(), ours.objects.len() + 2);
    assert!(theirs.counters.contains_key("foreign"));
    assert!(adopted.object_read.by_name, "{:?}", adopted.object_read);
    assert_eq!(adopted.objects, ours.objects);
}

/// A restart beside another nftables user that commits to a table of its own all the
/// while (a CNI plugin, a firewall) adopts kproxy's tables and sends nothing. The other
/// program's transactions move the namespace's ruleset generation during every reading
/// of kproxy's tables; a reading judged by the generation alone was read three times,
/// refused, and the tables replaced in one transaction of every element, which holds
/// the kernel's nftables lock, and every other writer, for its whole commit (9.3 s at
/// 100k Services × 10 endpoints). The reading is judged by whether a transaction named
/// kproxy's table (`monitor::ReadWatch`).
#[test]
fn a_restart_beside_a_busy_neighbour_adopts_and_sends_nothing() {
    if !root() {
        return;
    }
    let ns = Netns::new("busy");
    let plan = plain_plan(2_000, 10);
    let p = plan.clone();
    ns.run(move || {
        let r = first_sync(cfg(), &p).expect("cold sync");
        assert!(r.full && !r.adopted, "{r:?}");
    });
    let neighbour = Neighbour::start(&ns.name, "neighbour", Duration::ZERO);
    let r = ns.run(move || first_sync(cfg(), &plan));
    let adds = neighbour.stop().len();
    let r = r.expect("restart");
    assert!(adds > 10, "the neighbour added {adds} rules");
    assert!(
        r.adopted && !r.full && r.netlink_bytes == 0,
        "a restart beside a busy neighbour must adopt and send nothing: {r:?}"
    );
}

/// A reading during which kproxy's own table keeps changing is never taken: another
/// program adding rules to `ip kproxy` back to back makes every reading of it an
/// error (after three tries; the caller then replaces the tables), while the `ip6`
/// table, which nobody touches, reads as before under the same moving generation.
#[test]
fn a_reading_while_kproxys_table_changes_is_not_taken() {
    if !root() {
        return;
    }
    let ns = Netns::new("touched");
    let plan = plain_plan(2_000, 10);
    let v6 = ns.run(move || {
        first_sync(cfg(), &plan).expect("cold sync");
        dump::read_table(kproxy_nft::Family::Ip6, "kproxy")
            .expect("read")
            .expect("the ip6 table exists")
    });
    // The neighbour's rules go to a chain of its own in kproxy's `ip` table.
    let neighbour = Neighbour::start(&ns.name, "kproxy", Duration::ZERO);
    let (v4_during, v6_during) = ns.run(|| {
        (
            dump::read_table(kproxy_nft::Family::Ip, "kproxy"),
            dump::read_table(kproxy_nft::Family::Ip6, "kproxy"),
        )
    });
    let adds = neighbour.stop().len();
    assert!(adds > 10, "the neighbour added {adds} rules");
    let err = v4_during.expect_err("a reading of a table changing under it was taken");
    assert!(err.to_string().contains("kept changing"), "{err}");
    let v6_during = v6_during.expect("read").expect("the ip6 table exists");
    assert_eq!(v6_during.rule_count(), v6.rule_count());
    assert_eq!(v6_during.element_count(), v6.element_count());
}

/// Real packets through a dispatch group split into two maps: 9,000 one-endpoint
/// Services (9,000 rows in group 1: two maps), some in each map, answer from the pod
/// they name, and are counted by their endpoint's counter through `count-endpoints`,
/// split into two maps the same way (the traffic counters are on); a delta that moves
/// a Service of the second map to another pod keeps it there and the packets follow.
#[test]
fn packets_flow_through_every_map_of_a_split_dispatch_group() {
    if !root() {
        return;
    }
    let fabric = Fabric::with_config(counting());
    let spec = plain(9_000, 1);
    let mut state = synthetic::cluster(&spec);
    let pod = |name: &str| -> IpAddr {
        let (_, addr, _, _) = fabric.pods.iter().find(|p| p.0 == name).expect("pod");
        *addr
    };
    // The first 40 Services' one endpoint is pod a (its server answers on 8080, the
    // synthetic slices' port).
    let point = |state: &mut kproxy_core::ClusterState, i: usize, to: IpAddr| {
        let mut slice = synthetic::slice(&spec, i, 0);
        slice.endpoints[0].ip = to;
        state.upsert_slice(slice);
    };
    for i in 0..40 {
        point(&mut state, i, pod("a"));
    }
    let mut planner = kproxy_core::Planner::new("node-0", PlanConfig::default());
    planner.update(&mut state);
    let r = fabric.sync(planner.plan());
    assert!(r.full, "{r:?}");
    let [table, _] = fabric
        .dp
        .lock()
        .expect("dp")
        .programmed()
        .expect("programmed");
    let maps: Vec<&String> = table
        .sets()
        .keys()
        .filter(|n| n.starts_with("dnat-c-1"))
        .collect();
    assert_eq!(maps, ["dnat-c-1", "dnat-c-1-s1"]);
    // Which chain each of the 40 cluster IPs goes to.
    let cluster_ip = |i: usize| {
        let svc = synthetic::service(&spec, i);
        svc.cluster_ips
            .get(kproxy_core::model::IpFamily::IPv4)
            .expect("an IPv4 cluster IP")
    };
    let chain_of = |table: &kproxy_nft::Table, i: usize| -> String {
        let (key, value) = table.sets()["service-ips"]
            .elements
            .iter()
            .find(|(k, _)| k.to_string().starts_with(&format!("{} ", cluster_ip(i))))
            .expect("the cluster IP's element");
        format!("{key} {value:?}")
    };
    let in_second: Vec<usize> = (0..40)
        .filter(|&i| chain_of(&table, i).contains("disp-c-1-s1"))
        .collect();
    let in_first: Vec<usize> = (0..40)
        .filter(|&i| chain_of(&table, i).contains("\"disp-c-1\""))
        .collect();
    assert!(
        !in_second.is_empty() && !in_first.is_empty(),
        "first {in_first:?}, second {in_second:?}"
    );
    let counts: Vec<&String> = table
        .sets()
        .keys()
        .filter(|n| n.starts_with("count-endpoints"))
        .collect();
    assert_eq!(
        counts,
        [
            "count-endpoints",
            "count-endpoints-np",
            "count-endpoints-np-s1",
            "count-endpoints-s1"
        ]
    );
    let probed: Vec<usize> = in_first
        .iter()
        .take(3)
        .chain(in_second.iter().take(3))
        .copied()
        .collect();
    for &i in &probed {
        let got = fabric.probe(From::Client, cluster_ip(i), 80, Protocol::TCP);
        assert!(
            matches!(&got, Outcome::Answer { pod, .. } if pod == "a"),
            "Service {i} ({}): {got:?}",
            chain_of(&table, i)
        );
    }
    // Each probed Service's endpoint counted its connection, whichever map holds it.
    let counters = fabric
        .node
        .run(|| kproxy_nft::read_counters("kproxy").expect("read counters"));
    for &i in &probed {
        let name = synthetic::service(&spec, i).name;
        let counted: u64 = counters
            .iter()
            .filter(|c| {
                kproxy_nft::parse_counter_name(&c.name).is_some_and(|p| {
                    p.namespace == *name.namespace
                        && p.service == *name.name
                        && matches!(p.kind, kproxy_nft::CounterKind::Endpoint(_))
                })
            })
            .map(|c| c.packets)
            .sum();
        assert!(
            counted >= 1,
            "Service {i}: {counted} new connections counted"
        );
    }
    // A delta: a Service of the second map now points to pod b.
    let moved = in_second[0];
    point(&mut state, moved, pod("b"));
    let up = planner.update(&mut state);
    let plan = planner.plan().clone();
    let dp = fabric.dp.clone();
    let r = fabric
        .node
        .run(move || dp.lock().expect("dp").sync(&plan, &up).expect("delta"));
    assert!(!r.full && r.changes.sets_added == 0, "{r:?}");
    let got = fabric.probe(From::Client, cluster_ip(moved), 80, Protocol::TCP);
    assert!(
        matches!(&got, Outcome::Answer { pod, .. } if pod == "b"),
        "Service {moved} after the delta: {got:?}"
    );
}
