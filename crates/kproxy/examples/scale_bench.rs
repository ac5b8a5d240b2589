//! One node at scale from manifests (issue 48), in one run per size, in a throwaway
//! network namespace (root): S selector-less ClusterIP Services × E endpoints (default
//! 100,000 × 10: a million endpoints), one EndpointSlice each, as JSON Lists of 5,000
//! Services a file; then
//!
//! - `kproxy sync --once` cold (tables absent): wall, kproxy's own "synced … in" time,
//!   peak RSS, kernel slab growth (`SUnreclaim` of /proc/meminfo, whole machine);
//! - the same again with nothing changed (a restart's adoption);
//! - `kproxy run` on the same directory (adopting), then: one endpoint change × N
//!   (a small file of its own rewritten; write → the kernel commit of the sync that
//!   names it and sends the kernel bytes, from the event log's `committed_unix_us`;
//!   `--endpoint-warmup 0s`, so the change is not held back), a burst of 1,000 changes (one
//!   file rewritten: write → the commit that carried the last of them), a new Service,
//!   its deletion, and its tables deleted behind its back (`kproxy cleanup`: what `nft
//!   flush ruleset` does to them) → the `kernel_repaired` event; the daemon's peak RSS;
//! - throughout the cold sync, the adoption and the repair, another nftables user in
//!   the same namespace adding one rule every 10 ms to its own table (`ip
//!   scale-neighbour`, over nfnetlink, each add acknowledged): its slowest add is the
//!   stall kproxy's transactions imposed on it (the kernel's nftables lock); for the
//!   repair, the adds that began while `kproxy cleanup` deleted the tables apart from
//!   those that began after;
//! - the kernel log's `rcu` / `soft lockup` / `hung task` lines that appeared.
//!
//! ```text
//! cargo build --release -p kproxy --bin kproxy --example scale_bench
//! target/release/examples/scale_bench [100000x10] [--changes 200] [--burst 1000] \
//!   [--traffic-metrics service|endpoint|off] [--keep]
//! ```
//!
//! `--traffic-metrics` is passed to every `kproxy sync --once` and `kproxy run` (default
//! `off`, the daemon's: no counters in the tables; `service`: named counter objects per
//! port and their objref maps), so a pair of runs shows what the counters cost at scale.
//!
//! The machine's load goes beside every figure (`uptime`); the namespace and the
//! manifests are removed at the end (`--keep` keeps the manifests).

#![expect(
    clippy::disallowed_types,
    reason = "a bench of real processes: wall time"
)]

#[path = "support/mod.rs"]
mod support;

use kproxy_test_support::nft_neighbour::Neighbour;
use support::{Netns, Proc, ip4, kproxy_binary, load, status_kib, unix_us};

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const NODE: &str = "node-0";
const PER_FILE: usize = 5000;

/// `SUnreclaim` and the like: a `Name: N kB` field of /proc/meminfo, in KiB.
fn meminfo_kib(field: &str) -> u64 {
    support::proc_kib("/proc/meminfo", field)
}

/// Kernel log lines that say the kernel stalled.
fn stall_lines() -> Vec<String> {
    let out = Command::new("dmesg")
        .output()
        .map(|o| o.stdout)
        .unwrap_or_default();
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("rcu") && l.contains("stall")
                || l.contains("soft lockup")
                || l.contains("hung task")
                || l.contains("blocked for more than")
        })
        .map(str::to_string)
        .collect()
}

/// A Service and its slice as JSON list items; `step` moves its first endpoint.
fn service_items(
    out: &mut String,
    ns: &str,
    name: &str,
    cip: &str,
    eps: usize,
    first_ep: usize,
    step: usize,
) {
    let _ = write!(
        out,
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","namespace":"{ns}"}},"spec":{{"type":"ClusterIP","clusterIP":"{cip}","clusterIPs":["{cip}"],"ipFamilies":["IPv4"],"ports":[{{"name":"http","port":80,"targetPort":8080,"protocol":"TCP"}}]}}}},"#
    );
    let _ = write!(
        out,
        r#"{{"apiVersion":"discovery.k8s.io/v1","kind":"EndpointSlice","metadata":{{"name":"{name}-x","namespace":"{ns}","labels":{{"kubernetes.io/service-name":"{name}"}}}},"addressType":"IPv4","ports":[{{"name":"http","port":8080,"protocol":"TCP"}}],"endpoints":["#
    );
    for e in 0..eps {
        let n = first_ep + e;
        if e > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            r#"{{"addresses":["{}"],"nodeName":"node-{}","conditions":{{"ready":true}}}}"#,
            // The first endpoint's address moves with `step`: one endpoint changed.
            ip4(
                0x0a00_0000 + u32::from(e == 0 && step % 2 == 1) * 0x0040_0000,
                n + 1
            ),
            n % 100
        );
    }
    out.push_str("]},");
}

fn list(items: String) -> String {
    format!(
        r#"{{"apiVersion":"v1","kind":"List","items":[{}]}}"#,
        items.trim_end_matches(',')
    )
}

/// Writes `path` whole (a new file renamed over the old: the watcher sees one change).
fn write(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

/// The probe Service's file: one Service whose endpoints move with `step`.
fn probe(eps: usize, step: usize) -> String {
    let mut s = String::new();
    service_items(&mut s, "bench", "probe", "10.95.255.1", eps, 0, step);
    list(s)
}

/// The burst file: 1,000 Services whose endpoints move with `step`.
fn burst(n: usize, eps: usize, step: usize) -> String {
    let mut s = String::new();
    for i in 0..n {
        service_items(
            &mut s,
            "burst",
            &format!("b-{i}"),
            &ip4(0x0a5f_0000, i + 10),
            eps,
            i * eps,
            step,
        );
    }
    list(s)
}

/// Another nftables user: a thread in the namespace adding one rule every 10 ms to its
/// own table (`ip scale-neighbour`) over nfnetlink, each acknowledged; its `stop` says
/// the slowest add seen.
fn start_neighbour(ns: &str) -> Neighbour {
    Neighbour::start(ns, "scale-neighbour", Duration::from_millis(10))
}

/// `kproxy ARGS` in the namespace to its end: wall time, its stdout and stderr, and its
/// peak RSS (polled).
fn once(ns: &str, args: &[&str]) -> (Duration, String, u64) {
    let t = Instant::now();
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns])
        .arg(kproxy_binary())
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env("RUST_LOG", "warn")
        .spawn()
        .expect("spawn kproxy");
    let pid = child.id();
    let reader = {
        let mut out = child.stdout.take().expect("stdout");
        let mut err = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            use std::io::Read;
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            let _ = err.read_to_string(&mut s);
            s
        })
    };
    let mut hwm = 0;
    while child.try_wait().expect("wait").is_none() {
        hwm = hwm.max(status_kib(pid, "VmHWM:"));
        std::thread::sleep(Duration::from_millis(20));
    }
    let wall = t.elapsed();
    (wall, reader.join().expect("reader"), hwm)
}

/// kproxy's own "synced … in N ms".
fn synced_ms(out: &str) -> f64 {
    out.lines()
        .find_map(|l| {
            let rest = l.split(" in ").nth(1)?;
            rest.split(" ms").next()?.trim().parse().ok()
        })
        .unwrap_or(f64::NAN)
}

/// The event log's events after line `from`.
fn events(path: &Path, from: usize) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .skip(from)
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Waits for an event after line `from` that `done` accepts; its `committed_unix_us`
/// (or the time it was seen), and the line count after it.
fn wait_event(
    path: &Path,
    from: usize,
    limit: Duration,
    mut done: impl FnMut(&serde_json::Value) -> bool,
) -> (u64, usize) {
    let t = Instant::now();
    loop {
        let evs = events(path, from);
        for (i, e) in evs.iter().enumerate() {
            assert!(e["event"] != "sync_failed", "sync failed: {e}");
            if done(e) {
                let at = e["committed_unix_us"].as_u64().unwrap_or_else(unix_us);
                return (at, from + i + 1);
            }
        }
        assert!(t.elapsed() < limit, "no such event within {limit:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn names(e: &serde_json::Value, name: &str) -> bool {
    e["event"] == "synced"
        && e["changed"]
            .as_array()
            .is_some_and(|c| c.iter().any(|n| n == name))
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// What one run measures at one size.
struct Opts {
    changes: usize,
    burst: usize,
    traffic_metrics: String,
    keep: bool,
}

fn run(services: usize, eps: usize, o: &Opts) {
    let (changes, burst_n, keep) = (o.changes, o.burst, o.keep);
    let name = format!("kpscale-{}", std::process::id());
    let _ns = Netns::new(name.clone());
    let tm = o.traffic_metrics.as_str();

    let dir = tempfile::tempdir().expect("tempdir");
    let m = dir.path().join("m");
    std::fs::create_dir(&m).expect("mkdir");
    let t = Instant::now();
    let node = format!(
        r#"{{"apiVersion":"v1","kind":"Node","metadata":{{"name":"{NODE}"}},"status":{{"addresses":[{{"type":"InternalIP","address":"10.200.0.1"}}]}}}}"#
    );
    std::fs::write(m.join("00-node.json"), node).expect("write");
    let mut bytes = 0;
    for (k, from) in (0..services).step_by(PER_FILE).enumerate() {
        let mut s = String::new();
        for i in from..(from + PER_FILE).min(services) {
            let ns = format!("ns-{}", i % 50);
            service_items(
                &mut s,
                &ns,
                &format!("svc-{i}"),
                &ip4(0x0a60_0000, i + 1),
                eps,
                i * eps,
                0,
            );
        }
        let text = list(s);
        bytes += text.len();
        std::fs::write(m.join(format!("{k:03}.json")), text).expect("write");
    }
    let probe_file = m.join("probe.json");
    write(&probe_file, &probe(eps, 0));
    let burst_file = m.join("burst.json");
    write(&burst_file, &burst(burst_n, eps, 0));
    println!(
        "{services}x{eps}: manifests {:.0} MB in {} files, written in {:.1} s",
        bytes as f64 / 1e6,
        services.div_ceil(PER_FILE) + 3,
        t.elapsed().as_secs_f64()
    );
    let m_arg = m.to_str().expect("utf-8 path");
    let sync_args = [
        "sync",
        "--once",
        "--manifests",
        m_arg,
        "--node",
        NODE,
        "--traffic-metrics",
        tm,
    ];
    println!("{services}x{eps}: --traffic-metrics {tm} (load {})", load());
    let stalls_before = stall_lines().len();

    // Cold, with the neighbour adding rules.
    let slab0 = meminfo_kib("SUnreclaim:");
    let load0 = load();
    let neighbour = start_neighbour(&name);
    let (cold, out, cold_rss) = once(&name, &sync_args);
    let adds = neighbour.stop();
    let cold_stall = adds.worst();
    let slab1 = meminfo_kib("SUnreclaim:");
    assert!(out.contains("synced"), "cold sync: {out}");
    let cold_ms = synced_ms(&out);
    let endpoints = (services + burst_n + 1) * eps;
    let slab = slab1.saturating_sub(slab0);
    println!(
        "{services}x{eps}: cold sync --once: wall {:.2} s, synced in {cold_ms:.0} ms, peak RSS {:.0} MiB, slab +{:.0} MiB ({:.0} bytes per endpoint); neighbour's slowest add {:.1} ms of {} (load {load0})",
        cold.as_secs_f64(),
        cold_rss as f64 / 1024.0,
        slab as f64 / 1024.0,
        slab as f64 * 1024.0 / endpoints as f64,
        cold_stall.as_secs_f64() * 1e3,
        adds.len(),
    );

    // Adoption: the same again, nothing changed.
    let load1 = load();
    let neighbour = start_neighbour(&name);
    let (adopt, out, adopt_rss) = once(&name, &sync_args);
    let adopt_stall = neighbour.stop().worst();
    let adopt_ms = synced_ms(&out);
    println!(
        "{services}x{eps}: restart (sync --once again, adopting): wall {:.2} s, synced in {adopt_ms:.0} ms ({:.2}× the cold), peak RSS {:.0} MiB; neighbour's slowest add {:.1} ms (load {load1})",
        adopt.as_secs_f64(),
        adopt_ms / cold_ms,
        adopt_rss as f64 / 1024.0,
        adopt_stall.as_secs_f64() * 1e3,
    );

    // The daemon on the same directory (it adopts), then changes.
    let ev = dir.path().join("events.jsonl");
    let log = std::fs::File::create(dir.path().join("kproxy.log")).expect("create log");
    let mut daemon = Proc(
        Command::new("ip")
            .args(["netns", "exec", &name])
            .arg(kproxy_binary())
            .args(["run", "--manifests", m_arg, "--node", NODE])
            .args(["--traffic-metrics", tm, "--event-log"])
            .arg(&ev)
            // The endpoint change measured is the one that reaches the kernel: with the
            // warm-up (default 1 s) the sync naming the new endpoint sends nothing, and
            // the change lands a second later, as `endpoint_released`.
            .args(["--endpoint-warmup", "0s"])
            .args(["--healthz-bind-address", "127.0.0.1:10256"])
            .args(["--metrics-bind-address", "127.0.0.1:10249"])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn kproxy run"),
    );
    let pid = daemon.0.id();
    let t = Instant::now();
    let (_, mut at) = wait_event(&ev, 0, Duration::from_secs(900), |e| e["event"] == "synced");
    println!(
        "{services}x{eps}: kproxy run, start → first sync (adopting): {:.2} s (load {})",
        t.elapsed().as_secs_f64(),
        load()
    );
    if let Ok(Some(status)) = daemon.0.try_wait() {
        panic!("kproxy run exited: {status}");
    }

    // One endpoint change at a time.
    let (mut lat, mut received, mut commit) = (Vec::new(), Vec::new(), Vec::new());
    for step in 1..=changes {
        let t0 = unix_us();
        write(&probe_file, &probe(eps, step));
        let (c, next) = wait_event(&ev, at, Duration::from_secs(60), |e| {
            names(e, "bench/probe") && e["detail"]["bytes"].as_u64().unwrap_or(0) > 0
        });
        at = next;
        lat.push(c.saturating_sub(t0) as f64 / 1e3);
        // The daemon's own split of it: the source's delivery (file event → the sync
        // loop) and the kernel commit.
        let e = &events(&ev, next - 1)[0]["change_ms"];
        received.push(e["received"].as_f64().unwrap_or(f64::NAN));
        commit.push(e["commit"].as_f64().unwrap_or(f64::NAN));
        std::thread::sleep(Duration::from_millis(30));
    }
    lat.sort_by(f64::total_cmp);
    println!(
        "{services}x{eps}: one endpoint change (file written → kernel commit), {changes}: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms (load {})",
        pct(&lat, 0.5),
        pct(&lat, 0.99),
        lat.last().copied().unwrap_or(f64::NAN),
        load()
    );
    received.sort_by(f64::total_cmp);
    commit.sort_by(f64::total_cmp);
    println!(
        "{services}x{eps}:   of which the manifest source's delivery p50 {:.1} / p99 {:.1} ms, the kernel commit p50 {:.2} / p99 {:.2} ms (the event log's change_ms)",
        pct(&received, 0.5),
        pct(&received, 0.99),
        pct(&commit, 0.5),
        pct(&commit, 0.99),
    );

    // A burst: every Service of the burst file changed at once.
    let t0 = unix_us();
    write(&burst_file, &burst(burst_n, eps, 1));
    let mut seen = 0;
    let (c, next) = wait_event(&ev, at, Duration::from_secs(120), |e| {
        if e["event"] == "synced" {
            seen += e["services_changed"].as_u64().unwrap_or(0) as usize;
        }
        seen >= burst_n
    });
    at = next;
    println!(
        "{services}x{eps}: a burst of {burst_n} Services changed (one file written → the commit carrying the last): {:.1} ms",
        c.saturating_sub(t0) as f64 / 1e3
    );

    // A new Service, then its deletion.
    let new_file = m.join("new.json");
    let mut s = String::new();
    service_items(&mut s, "bench", "new", "10.95.255.2", eps, 0, 0);
    let t0 = unix_us();
    write(&new_file, &list(s));
    let (c, next) = wait_event(&ev, at, Duration::from_secs(60), |e| names(e, "bench/new"));
    at = next;
    let added = c.saturating_sub(t0) as f64 / 1e3;
    let t0 = unix_us();
    std::fs::remove_file(&new_file).expect("rm");
    let (c, next) = wait_event(&ev, at, Duration::from_secs(60), |e| names(e, "bench/new"));
    at = next;
    println!(
        "{services}x{eps}: a new Service: {added:.1} ms; its deletion: {:.1} ms (file → commit)",
        c.saturating_sub(t0) as f64 / 1e3
    );

    // Its tables deleted behind its back, with the neighbour adding rules.
    std::thread::sleep(Duration::from_millis(500));
    let load2 = load();
    let neighbour = start_neighbour(&name);
    std::thread::sleep(Duration::from_millis(100));
    let t0 = unix_us();
    let (_, out, _) = once(&name, &["cleanup"]);
    let deleted = unix_us();
    let deleted_at = Instant::now();
    let (c, _) = wait_event(&ev, at, Duration::from_secs(900), |e| {
        e["event"] == "kernel_repaired"
    });
    std::thread::sleep(Duration::from_millis(100));
    let adds = neighbour.stop();
    // The delete's own transaction (another process's, in production: `nft flush
    // ruleset`) apart from kproxy's repair after it.
    let (delete_stall, repair_stall) =
        (adds.worst_before(deleted_at), adds.worst_since(deleted_at));
    assert!(
        out.is_empty() || !out.contains("error"),
        "kproxy cleanup: {out}"
    );
    println!(
        "{services}x{eps}: tables deleted behind its back (kproxy cleanup) → repaired: {:.1} ms after the delete returned ({:.1} ms after it started); neighbour's slowest add during the delete {:.1} ms, after it (the repair) {:.1} ms (load {load2})",
        c.saturating_sub(deleted) as f64 / 1e3,
        c.saturating_sub(t0) as f64 / 1e3,
        delete_stall.as_secs_f64() * 1e3,
        repair_stall.as_secs_f64() * 1e3,
    );
    println!(
        "{services}x{eps}: kproxy run peak RSS {:.0} MiB, now {:.0} MiB",
        status_kib(pid, "VmHWM:") as f64 / 1024.0,
        status_kib(pid, "VmRSS:") as f64 / 1024.0
    );
    drop(daemon);
    let stalls = stall_lines();
    println!(
        "{services}x{eps}: kernel log lines of rcu stalls, soft lockups, hung tasks since the start: {}",
        stalls.len().saturating_sub(stalls_before)
    );
    for l in stalls.iter().skip(stalls_before) {
        println!("  {l}");
    }
    if keep {
        println!("  kept {}", dir.keep().display());
    }
}

fn main() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "scale_bench needs root (network namespaces, nftables)"
    );
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str, default: usize| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let opts = Opts {
        changes: flag("--changes", 200),
        burst: flag("--burst", 1000),
        traffic_metrics: args
            .iter()
            .position(|a| a == "--traffic-metrics")
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| "off".to_string()),
        keep: args.iter().any(|a| a == "--keep"),
    };
    let mut sizes: Vec<(usize, usize)> = args
        .iter()
        .filter_map(|a| {
            let (s, e) = a.split_once('x')?;
            Some((s.parse().ok()?, e.parse().ok()?))
        })
        .collect();
    if sizes.is_empty() {
        sizes.push((100_000, 10));
    }
    for (s, e) in sizes {
        run(s, e, &opts);
    }
}
