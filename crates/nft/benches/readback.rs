//! Reading kproxy's tables back (a restart's adoption, a repair, a verification): the
//! wall time of one read of the IPv4 table after a cold sync, and per set the kernel's
//! dump cost — its messages and the elements its walk visited (each dump round walks
//! the set from its start and skips what it sent before, `dump::RawSet::dump_visits`).
//! Plain ClusterIP Services (no eTP=Local, no terminating endpoints, no hints), so
//! almost every row is in one endpoint count's dispatch group. Run (root: a throwaway
//! network namespace):
//!
//! ```text
//! cargo bench -p kproxy-nft --bench readback -- 10000x10 40000x10
//! ```
//!
//! Reading at N and 4N rows says whether the read grows linearly (≈ 4×) or with the
//! square of the largest set (≈ 16×). `KPROXY_BENCH_COUNTERS=1` runs with the traffic
//! counters (`DataplaneConfig::counters`): their objects (each asked for by name,
//! `dump::ObjectRead`) and objref maps are read back too, and the counters alone are
//! read as `kproxy top` and the daemon's metrics read them (`read_counters`).

mod common;

use std::time::Instant;

use kproxy_core::PlanConfig;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::synthetic::{self, Spec};
use kproxy_nft::internals::dump;
use kproxy_nft::{Dataplane, DataplaneConfig};

fn run(services: usize, eps: usize) {
    let spec = Spec {
        etp_local_every: 0,
        terminating_every: 0,
        hinted_every: 0,
        ..Spec::new(services, eps)
    };
    let state = synthetic::cluster(&spec);
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let cfg = DataplaneConfig {
        conntrack_cleanup: false,
        counters: std::env::var_os("KPROXY_BENCH_COUNTERS").is_some(),
        ..DataplaneConfig::default()
    };
    kproxy_nft::cleanup(&cfg).expect("cleanup");
    let t = Instant::now();
    let mut dp = Dataplane::new(cfg.clone()).expect("config");
    dp.sync(&plan, &PlanUpdate::WHOLE).expect("cold sync");
    let cold = t.elapsed();
    let mut reads = Vec::new();
    let mut table = None;
    for _ in 0..3 {
        let t = Instant::now();
        table = dump::read_table(kproxy_nft::Family::Ip, &cfg.table).expect("read");
        reads.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let table = table.expect("the table exists");
    reads.sort_by(f64::total_cmp);
    let (elements, messages, visits) = table.sets.values().fold((0, 0, 0), |(e, m, v), s| {
        (
            e + s.elements.iter().count(),
            m + s.dump_messages,
            v + s.dump_visits,
        )
    });
    println!(
        "readback {services}x{eps}: cold sync {:.0} ms; read of table ip: min {:.1} ms, median {:.1} ms; {elements} elements in {} sets, {messages} dump messages, {visits} elements visited ({:.1} per element)",
        cold.as_secs_f64() * 1e3,
        reads[0],
        reads[1],
        table.sets.len(),
        visits as f64 / elements.max(1) as f64,
    );
    let mut sets: Vec<_> = table.sets.iter().collect();
    sets.sort_by_key(|(_, s)| std::cmp::Reverse(s.elements.iter().count()));
    for (name, s) in sets.iter().take(4) {
        println!(
            "readback {services}x{eps}:   {name}: {} elements, {} messages, {} visited",
            s.elements.iter().count(),
            s.dump_messages,
            s.dump_visits
        );
    }
    println!(
        "readback {services}x{eps}:   largest set: {} elements; sets: {}; named objects: {} ({}: {} messages, {} objects visited)",
        sets.first().map_or(0, |(_, s)| s.elements.iter().count()),
        table.sets.len(),
        table.objects.len(),
        if table.object_read.by_name {
            "by name"
        } else {
            "dumped"
        },
        table.object_read.messages,
        table.object_read.visits,
    );
    if cfg.counters {
        // The daemon's and `kproxy top`'s reading: the counters alone.
        let mut reads = Vec::new();
        let mut n = 0;
        for _ in 0..3 {
            let t = Instant::now();
            n = kproxy_nft::read_counters(&cfg.table)
                .expect("counters")
                .len();
            reads.push(t.elapsed().as_secs_f64() * 1e3);
        }
        reads.sort_by(f64::total_cmp);
        println!(
            "readback {services}x{eps}:   read_counters (both families): {n} counters, min {:.1} ms, median {:.1} ms",
            reads[0], reads[1]
        );
        // The daemon's reading (`CounterReader`): the names it created or read known.
        let mut reads = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            n = dp.read_counters().expect("counters").len();
            reads.push(t.elapsed().as_secs_f64() * 1e3);
        }
        reads.sort_by(f64::total_cmp);
        println!(
            "readback {services}x{eps}:   Dataplane::read_counters (names known): {n} counters, min {:.1} ms, median {:.1} ms",
            reads[0], reads[1]
        );
    }
    drop(dp);
    kproxy_nft::cleanup(&cfg).expect("cleanup");
}

fn main() {
    let sizes = common::sizes(&[(10000, 10), (40000, 10)]);
    common::in_throwaway_netns("kpnread", move || {
        for (s, e) in sizes {
            run(s, e);
        }
    });
}
