//! Interference at scale, in a throwaway network namespace (root): how long
//! after another process's `nft` transaction the kernel watch ([`kproxy_nft::Monitor`])
//! has read it, and how long the repair from the record ([`Dataplane::repair`]) takes,
//! for a flushed ruleset (both tables gone: the first sync's path), one deleted
//! verdict-map element and one flushed base chain (both: read back, delta). Also what
//! being watched costs kproxy's own first sync (the kernel then announces every object).
//!
//! Run: `cargo bench -p kproxy-nft --bench interference` (10000x10, 5 rounds) or with
//! explicit sizes and rounds: `cargo bench -p kproxy-nft --bench interference -- 1000x10
//! rounds=3`.
//!
//! "detected" is the time from handing the script to an `nft -f -` child already started
//! (its process start is not timed) to the monitor reading the transaction's closing
//! generation message: an upper bound of the detection latency, as it includes `nft`'s
//! parsing, its cache fetch and the kernel transaction itself; beside it, the same time
//! from the `nft` child's exit (negative: read before `nft` had exited). "repair" is from
//! that reading to the tables restored.

mod common;

use std::io::Write as _;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use kproxy_core::planner::PlanUpdate;
use kproxy_core::synthetic::{self, Spec};
use kproxy_core::{PlanConfig, Planner};
use kproxy_nft::{Dataplane, DataplaneConfig};
use kproxy_nft::{Event, Monitor};

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A monitor on a thread of the calling thread's namespace, until dropped (its socket
/// closes, unsubscribed, within a second).
struct Watch {
    rx: mpsc::Receiver<Event>,
    stop: Arc<AtomicBool>,
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis(1200));
    }
}

fn watch() -> Watch {
    let mut mon = Monitor::open("kproxy").expect("subscribe");
    let (tx, rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    std::thread::spawn(move || {
        while !stopped.load(Ordering::SeqCst) {
            match mon.next_event() {
                Ok(Some(e)) => {
                    if tx.send(e).is_err() {
                        return;
                    }
                }
                Ok(None) => {}
                Err(e) => panic!("monitor: {e}"),
            }
        }
    });
    Watch { rx, stop }
}

/// Events read within `quiet` of each other (kproxy's own transactions must bring none).
fn drain(rx: &mpsc::Receiver<Event>, quiet: Duration) -> Vec<Event> {
    let mut seen = Vec::new();
    while let Ok(e) = rx.recv_timeout(quiet) {
        seen.push(e);
    }
    seen
}

fn stats(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!(
        "min {:.1} / median {:.1} / max {:.1}",
        v[0],
        v[v.len() / 2],
        v[v.len() - 1]
    )
}

/// The interfering script of a scenario's round.
type Script = fn(usize) -> String;

fn run(services: usize, eps: usize, rounds: usize) {
    let spec = Spec::new(services, eps);
    let mut state = synthetic::cluster(&spec);
    let mut planner = Planner::new("node-0", PlanConfig::default());
    planner.update(&mut state);
    let plan = planner.plan();
    let cfg = DataplaneConfig {
        conntrack_cleanup: false,
        ..DataplaneConfig::default()
    };

    // What being watched costs the first sync: cold syncs alternately without and with
    // a watcher (the machine's load moves; alternating lets both see it).
    let cold = |dp: &mut Dataplane| {
        kproxy_nft::cleanup(&cfg).expect("cleanup");
        let t = Instant::now();
        dp.force_full_sync();
        dp.sync(plan, &PlanUpdate::WHOLE).expect("sync");
        ms(t.elapsed())
    };
    let mut dp = Dataplane::new(cfg.clone()).expect("config");
    let (mut unwatched, mut watched) = (Vec::new(), Vec::new());
    for _ in 0..rounds.min(3) {
        unwatched.push(cold(&mut dp));
        let w = watch();
        watched.push(cold(&mut dp));
        drop(w);
    }
    let w = watch();
    watched.push(cold(&mut dp));
    // kproxy's own transactions (the sync's `nft` child and nfnetlink batches) are
    // never reported.
    let own = drain(&w.rx, Duration::from_millis(1500));
    println!(
        "{services}x{eps}: cold first sync unwatched {} ms, watched {} ms; events from kproxy's own transactions: {}",
        stats(unwatched),
        stats(watched),
        own.len()
    );
    let rx = &w.rx;

    let scenarios: [(&str, Script); 3] = [
        ("flush ruleset", |_| "flush ruleset".into()),
        ("delete one service-ips element", |r| {
            let ip = Ipv4Addr::from(0x0a60_0000u32 + r as u32 + 1);
            format!("delete element ip kproxy service-ips {{ {ip} . tcp . 80 }}")
        }),
        ("flush chain nat-output", |_| {
            "flush chain ip kproxy nat-output".into()
        }),
    ];
    for (name, command) in scenarios {
        let (mut after_start, mut after_exit, mut repair, mut total) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut how = String::new();
        for round in 0..rounds {
            let cmd = command(round);
            // `nft -f -` started and waiting for its script: its own start is not timed.
            let mut child = Command::new("nft")
                .args(["-f", "-"])
                .stdin(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("nft");
            let mut stdin = child.stdin.take().expect("piped");
            std::thread::sleep(Duration::from_millis(50));
            let t0 = Instant::now();
            stdin.write_all(cmd.as_bytes()).expect("script");
            drop(stdin);
            let out = child.wait_with_output().expect("nft");
            let exited = Instant::now();
            assert!(
                out.status.success(),
                "nft {cmd}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let detected = match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Event::Interference(i)) => i.detected,
                other => panic!("{name}: {other:?}"),
            };
            let r = dp.repair(plan).expect("repair");
            let repaired = Instant::now();
            after_start.push(ms(detected - t0));
            after_exit.push(if detected >= exited {
                ms(detected - exited)
            } else {
                -ms(exited - detected)
            });
            repair.push(ms(repaired - detected));
            total.push(ms(repaired - t0));
            how = format!(
                "adopted {}, full {}, {} elements added, {} chains changed, {:.2} MB netlink",
                r.adopted,
                r.full,
                r.changes.elements_added,
                r.changes.chains_changed,
                r.netlink_bytes as f64 / 1e6
            );
            let extra = drain(rx, Duration::from_millis(300));
            assert!(
                extra.is_empty(),
                "{name}: the repair was reported: {extra:?}"
            );
        }
        println!(
            "{services}x{eps}: {name} ({rounds} rounds): detected after the script was handed to nft {} ms, after nft exited {} ms | repair {} ms | script handed to nft to repaired {} ms | last repair: {how}",
            stats(after_start),
            stats(after_exit),
            stats(repair),
            stats(total)
        );
    }
    let v = dp.verify().expect("verify");
    assert!(!v.drift, "{:?}", v.differences);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let sizes = common::sizes(&[(10000, 10)]);
    let rounds = args
        .iter()
        .find_map(|a| a.strip_prefix("rounds=")?.parse().ok())
        .unwrap_or(5);
    common::in_throwaway_netns("kpnintf", move || {
        for (s, e) in sizes {
            run(s, e, rounds);
        }
    });
}
