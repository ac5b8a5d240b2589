//! Dataplane benchmarks in a throwaway network namespace: full sync (cold, and replacing
//! an existing table), one-endpoint-change syncs (delta path), and a restart that adopts
//! the tables (nothing changed; 100 Services changed) for synthetic clusters.
//! Reports wall time, the nfnetlink bytes sent and this process's CPU (every write is
//! an nfnetlink batch: the kernel's work on it is this process's system time).
//!
//! Run: `cargo bench -p kproxy-nft --bench sync` (sizes: 1000x10 10000x10) or with
//! explicit sizes: `cargo bench -p kproxy-nft --bench sync -- 5000x50 44000x1`.
//! `KPROXY_BENCH_DUMP=DIR` also writes each full script to `DIR/SxE.nft`;
//! `KPROXY_BENCH_CHANGES=N` makes N one-endpoint-change attempts instead of 15;
//! `KPROXY_BENCH_COLD_ONLY=1` stops after the cold full sync (for `perf record`);
//! `KPROXY_BENCH_COUNTERS=1` runs with the traffic counters (`DataplaneConfig::counters`).

mod common;

use std::time::{Duration, Instant};

use kproxy_core::planner::PlanUpdate;
use kproxy_core::synthetic::{self, Spec};
use kproxy_core::{PlanConfig, Planner};
use kproxy_nft::{Dataplane, DataplaneConfig};

/// User and system CPU of `who` so far.
fn cpu(who: nix::sys::resource::UsageWho) -> (Duration, Duration) {
    use nix::sys::resource::getrusage;
    let Ok(ru) = getrusage(who) else {
        return (Duration::ZERO, Duration::ZERO);
    };
    let tv = |t: nix::sys::time::TimeVal| {
        Duration::from_micros(t.tv_sec() as u64 * 1_000_000 + t.tv_usec() as u64)
    };
    (tv(ru.user_time()), tv(ru.system_time()))
}

struct Sample {
    wall: Duration,
    /// The transactions' wall time.
    nft_wall: Duration,
    netlink_bytes: usize,
    /// This process's own CPU (every thread; the kernel's work on its netlink batches
    /// is its system time).
    own_user: Duration,
    own_sys: Duration,
    /// The sync added, changed or deleted a chain or a set.
    structure: bool,
}

fn measure(dp: &mut Dataplane, plan: &kproxy_core::NodePlan, update: &PlanUpdate) -> Sample {
    let (ou0, os0) = cpu(nix::sys::resource::UsageWho::RUSAGE_SELF);
    let t = Instant::now();
    let r = dp.sync(plan, update).expect("sync");
    let wall = t.elapsed();
    let (ou1, os1) = cpu(nix::sys::resource::UsageWho::RUSAGE_SELF);
    let c = &r.changes;
    let structure =
        c.chains_added + c.chains_changed + c.chains_deleted + c.sets_added + c.sets_deleted > 0;
    Sample {
        wall,
        nft_wall: r.transaction,
        netlink_bytes: r.netlink_bytes,
        own_user: ou1 - ou0,
        own_sys: os1 - os0,
        structure,
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// The cold full sync's line.
fn cold_text(cold: &Sample) -> String {
    format!(
        "full cold: wall {} ms (transactions {} ms, {:.2} MB netlink, own user {} ms, sys {} ms)",
        ms(cold.wall),
        ms(cold.nft_wall),
        cold.netlink_bytes as f64 / 1e6,
        ms(cold.own_user),
        ms(cold.own_sys)
    )
}

fn run(services: usize, eps: usize) {
    let spec = Spec::new(services, eps);
    let mut state = synthetic::cluster(&spec);
    let mut planner = Planner::new("node-0", PlanConfig::default());
    planner.update(&mut state);
    let plan = planner.plan().clone();
    let cfg = DataplaneConfig {
        conntrack_cleanup: false,
        counters: std::env::var_os("KPROXY_BENCH_COUNTERS").is_some(),
        ..DataplaneConfig::default()
    };

    let cold_only = std::env::var_os("KPROXY_BENCH_COLD_ONLY").is_some();
    let t = Instant::now();
    let script = if cold_only {
        String::new()
    } else {
        kproxy_nft::internals::render(&plan, &cfg)
    };
    let render = t.elapsed();
    if let Some(dir) = std::env::var_os("KPROXY_BENCH_DUMP") {
        let path = std::path::Path::new(&dir).join(format!("{services}x{eps}.nft"));
        std::fs::write(&path, &script).expect("dump the script");
    }

    // Cold means no kproxy table at all (an earlier size leaves its tables behind).
    kproxy_nft::cleanup(&cfg).expect("remove the previous size's tables");
    let mut dp = Dataplane::new(cfg.clone()).expect("config");
    let cold = measure(&mut dp, &plan, &PlanUpdate::WHOLE);
    if cold_only {
        println!("{services}x{eps}: {}", cold_text(&cold));
        return;
    }
    dp.force_full_sync();
    let replace = measure(&mut dp, &plan, &PlanUpdate::WHOLE);
    println!(
        "{services}x{eps}: script {:.2} MB, render {} ms | {} | full replacing: wall {} ms (transaction {} ms, {:.2} MB netlink, own user {} ms, sys {} ms)",
        script.len() as f64 / 1e6,
        ms(render),
        cold_text(&cold),
        ms(replace.wall),
        ms(replace.nft_wall),
        replace.netlink_bytes as f64 / 1e6,
        ms(replace.own_user),
        ms(replace.own_sys)
    );

    let mut samples: Vec<(Duration, Sample)> = Vec::new();
    // More changes for a profile of the delta path (`perf record` on this bench).
    let changes: usize = std::env::var("KPROXY_BENCH_CHANGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15);
    for generation in 1..=changes {
        let i = (generation * 7919) % services;
        // Several generations are needed before a slice's conditions actually change.
        state.upsert_slice(synthetic::slice(&spec, i, generation));
        let t = Instant::now();
        let up = planner.update(&mut state);
        let plan_time = t.elapsed();
        if up.services.is_empty() {
            continue;
        }
        // The planner's update is the delta, as in `kproxy run`.
        let s = measure(&mut dp, planner.plan(), &up);
        samples.push((plan_time, s));
    }
    // The first delta after the full sync (issue 39.4: the first change after start),
    // then the ones that follow.
    let first_delta = samples.first().map(|(_, s)| s.wall);
    samples.sort_by_key(|(_, s)| s.wall);
    if samples.is_empty() {
        println!("{services}x{eps}: no change produced");
        return;
    }
    let p50 = &samples[samples.len() / 2];
    let p99 = &samples[(samples.len() * 99).div_ceil(100) - 1];
    let max = samples.last().expect("non-empty");
    let over_netlink = samples.iter().filter(|(_, s)| s.netlink_bytes > 0).count();
    println!(
        "{services}x{eps}: one endpoint change ({} samples, {over_netlink} as nfnetlink batches): p50 wall {} ms (render+diff {} ms, transaction {} ms, {} B netlink), max wall {} ms",
        samples.len(),
        ms(p50.1.wall),
        ms(p50.1.wall - p50.1.nft_wall),
        ms(p50.1.nft_wall),
        p50.1.netlink_bytes,
        ms(max.1.wall)
    );
    println!(
        "{services}x{eps}: one endpoint change, counters {}: p50 {} ms, p99 {} ms ({} samples)",
        if cfg.counters { "on" } else { "off" },
        ms(p50.1.wall),
        ms(p99.1.wall),
        samples.len()
    );
    if let Some(first) = first_delta {
        println!(
            "{services}x{eps}: the first endpoint change after the full sync: wall {} ms (the rest: p50 {} ms)",
            ms(first),
            ms(p50.1.wall)
        );
    }
    // An eTP=Local Service's local endpoint count on this node going 1 → 0 → 1 → 2 →
    // 1 → … (what a rollout does on a node that runs its pods). Service 0 is one
    // (`etp_local_every` divides 0); its endpoint 0 is on node-0, and "2" moves its
    // endpoint 1 there too. Its frontends go through the shared eTP=Local dispatch, so
    // a step re-points map elements; the first step to 2 creates the Local groups of 2
    // (no Service has two endpoints on node-0), later ones find them idle. Samples with
    // a chain or set change are counted as "with structure".
    // `KPROXY_BENCH_LOCAL_ROUNDS=N` takes N steps instead of 12.
    let rounds: usize = std::env::var("KPROXY_BENCH_LOCAL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12);
    let mut local_change = Vec::new();
    for round in 0..rounds {
        // Generation 1: endpoints 0 and 1 ready (at 0, endpoint 0 is terminating).
        let mut slice = synthetic::slice(&spec, 0, 1);
        let here = slice.endpoints[0].placement.clone();
        match round % 4 {
            0 => slice
                .endpoints
                .retain(|e| e.placement.node_name.as_deref() != Some("node-0")),
            2 if slice.endpoints.len() > 1 => slice.endpoints[1].placement = here,
            _ => {}
        }
        state.upsert_slice(slice);
        let up = planner.update(&mut state);
        if !up.services.is_empty() {
            local_change.push(measure(&mut dp, planner.plan(), &up));
        }
    }
    if !local_change.is_empty() {
        local_change.sort_by_key(|s| s.wall);
        let p50 = &local_change[local_change.len() / 2];
        let p90 = &local_change[local_change.len() * 9 / 10];
        println!(
            "{services}x{eps}: eTP=Local local endpoint count change 1 → 0 → 1 → 2 → … ({} samples, {} with structure): p50 wall {} ms (transaction {} ms, {} B netlink), p90 {} ms, max {} ms",
            local_change.len(),
            local_change.iter().filter(|s| s.structure).count(),
            ms(p50.wall),
            ms(p50.nft_wall),
            p50.netlink_bytes,
            ms(p90.wall),
            ms(local_change.last().expect("non-empty").wall)
        );
    }
    // A dispatch group the tables never held: a Service moves to an endpoint count no
    // Service had (20, 21, …), so its map and chain are declared (the first step of a
    // rollout to a new count; the structural delta that declares a set).
    let mut fresh = Vec::new();
    for round in 0..6usize {
        let i = 1 + round * 13;
        let mut slice = synthetic::slice(&spec, i, 0);
        let base = slice.endpoints[0].clone();
        slice.endpoints = (0..20 + round)
            .map(|j| {
                let mut e = base.clone();
                e.ip = std::net::IpAddr::V4(std::net::Ipv4Addr::from(
                    0x0b00_0000u32 + (round * 64 + j) as u32,
                ));
                e.conditions = kproxy_core::model::Conditions {
                    ready: true,
                    serving: true,
                    terminating: false,
                };
                e
            })
            .collect();
        state.upsert_slice(slice);
        let up = planner.update(&mut state);
        if !up.services.is_empty() {
            fresh.push(measure(&mut dp, planner.plan(), &up));
        }
    }
    if !fresh.is_empty() {
        let first = fresh[0].wall;
        fresh.sort_by_key(|s| s.wall);
        let p50 = &fresh[fresh.len() / 2];
        println!(
            "{services}x{eps}: a new dispatch group declared ({} samples): first {} ms, p50 wall {} ms (transaction {} ms, {} B netlink), max {} ms",
            fresh.len(),
            ms(first),
            ms(p50.wall),
            ms(p50.nft_wall),
            p50.netlink_bytes,
            ms(fresh.last().expect("non-empty").wall)
        );
    }
    // Restart: a new Dataplane reads the tables back and adopts them,
    // with nothing changed, then after 100 Services' endpoints changed while it was down.
    let restart = measure(
        &mut Dataplane::new(cfg.clone()).expect("config"),
        planner.plan(),
        &PlanUpdate::WHOLE,
    );
    for i in 0..100 {
        state.upsert_slice(synthetic::slice(&spec, (i * 97) % services, 100 + i));
    }
    planner.update(&mut state);
    let mut dp2 = Dataplane::new(cfg.clone()).expect("config");
    let t = Instant::now();
    let r = dp2.sync(planner.plan(), &PlanUpdate::WHOLE).expect("sync");
    let changed = t.elapsed();
    println!(
        "{services}x{eps}: restart adopting, nothing changed: wall {} ms ({} B sent) | 100 Services changed meanwhile: wall {} ms (adopted {}, {} elements added, {} deleted, {} chains changed, transaction {} ms)",
        ms(restart.wall),
        restart.netlink_bytes,
        ms(changed),
        r.adopted,
        r.changes.elements_added,
        r.changes.elements_deleted,
        r.changes.chains_changed,
        ms(r.transaction)
    );
    dp = dp2;
    // Verification of intact tables reads them back over netlink (the sync
    // loop waits for it every verifyPeriod); measured only on request.
    if std::env::var_os("KPROXY_BENCH_VERIFY").is_some() {
        let v = Instant::now();
        let report = dp.verify().expect("verify");
        println!(
            "{services}x{eps}: verify {} ms, drift {}",
            ms(v.elapsed()),
            report.drift
        );
    }
}

fn main() {
    let sizes = common::sizes(&[(1000, 10), (10000, 10)]);
    common::in_throwaway_netns("kpnbench", move || {
        for (s, e) in sizes {
            run(s, e);
        }
    });
}
