//! `kproxy run` end to end at scale, in a throwaway network namespace (root): the time
//! from start to the first successful sync (reading and parsing the manifests, planning,
//! programming nftables), the daemon's peak RSS, and first-packet latency (TCP connect
//! to a cluster IP, through the real rules) next to N synthetic Services.
//!
//! Run (the example drives the release binary, so build it first):
//!
//! ```text
//! cargo build --release -p kproxy && \
//!   cargo run --release -p kproxy --example daemon_bench -- 10x10 10000x10 30000x1
//! ```
//!
//! The manifests are what users write (YAML, one file per 1,000 Services): Services in
//! 50 namespaces, one in ten a LoadBalancer with externalTrafficPolicy Local (so it has
//! a health-check node port), endpoints spread over 100 nodes, one in seven
//! serving+terminating; plus one `bench/probe` Service whose endpoint is a listener in
//! the namespace, the target of the latency samples. Last, `/metrics` is scraped 5 times
//! after the traffic counters' first reading (its time and size), after the idle
//! daemon's CPU over the 11 s before them;
//! `DAEMON_BENCH_TRAFFIC=off|service|endpoint` sets `--traffic-metrics` (default `off`, as
//! `kproxy run`).

#![expect(
    clippy::disallowed_types,
    reason = "a bench of real processes: wall time"
)]

#[path = "support/mod.rs"]
mod support;

use support::{Netns, Proc, cpu_ticks, ip4, kproxy_binary, status_kib};

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PROBE_CLUSTER_IP: &str = "10.95.255.1";
const PROBE_POD_IP: &str = "10.250.0.2";
const SAMPLES: usize = 2000;

/// YAML for Services `from..to` and their EndpointSlices.
fn manifests(from: usize, to: usize, eps: usize) -> String {
    let mut y = String::new();
    for i in from..to {
        let ns = format!("ns-{}", i % 50);
        let lb = i % 10 == 0;
        let cip = ip4(0x0a60_0000, i + 1);
        let _ = write!(
            y,
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: svc-{i}, namespace: {ns}}}\nspec:\n  type: {}\n  clusterIP: {cip}\n  clusterIPs: [{cip}]\n  ipFamilies: [IPv4]\n",
            if lb { "LoadBalancer" } else { "ClusterIP" }
        );
        if lb {
            let k = i / 10;
            let _ = write!(
                y,
                "  externalTrafficPolicy: Local\n  healthCheckNodePort: {}\n  ports: [{{name: http, port: 80, targetPort: 8080, protocol: TCP, nodePort: {}}}]\nstatus: {{loadBalancer: {{ingress: [{{ip: {}}}]}}}}\n",
                40000 + k % 20000,
                20000 + k % 20000,
                ip4(0xcb00_7100, k + 1)
            );
        } else {
            y.push_str("  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]\n");
        }
        let _ = write!(
            y,
            "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: svc-{i}-x\n  namespace: {ns}\n  labels: {{kubernetes.io/service-name: svc-{i}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints:\n"
        );
        for e in 0..eps {
            let n = i * eps + e;
            let terminating = n % 7 == 6;
            let _ = write!(
                y,
                "- addresses: [{}]\n  nodeName: node-{}\n  conditions: {{ready: {}, serving: true, terminating: {terminating}}}\n",
                ip4(0x0af4_0000, n + 1),
                n % 100,
                !terminating
            );
        }
    }
    y
}

const FIXED: &str = r#"apiVersion: v1
kind: Node
metadata: {name: node-0}
status:
  addresses: [{type: InternalIP, address: 10.200.0.1}]
---
apiVersion: v1
kind: Service
metadata: {name: probe, namespace: bench}
spec:
  clusterIP: 10.95.255.1
  clusterIPs: [10.95.255.1]
  ipFamilies: [IPv4]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: probe-x
  namespace: bench
  labels: {kubernetes.io/service-name: probe}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.250.0.2]
  nodeName: node-0
  conditions: {ready: true}
"#;

fn wait_for_sync(events: &Path, daemon: &mut Proc, limit: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let log = std::fs::read_to_string(events).unwrap_or_default();
        if log.lines().any(|l| l.contains("\"event\":\"synced\"")) {
            return t.elapsed();
        }
        if let Some(failed) = log.lines().find(|l| l.contains("\"sync_failed\"")) {
            panic!("sync failed: {failed}");
        }
        if let Ok(Some(status)) = daemon.0.try_wait() {
            panic!("kproxy exited with {status} before its first sync");
        }
        assert!(t.elapsed() < limit, "no sync within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn run(services: usize, eps: usize) {
    let name = format!("kpb-{}-{services}x{eps}", std::process::id());
    let ns = Netns::new(name.clone());
    ns.probe_veth("kpb", PROBE_POD_IP, "10.95.0.0/16");

    let dir = tempfile::tempdir().expect("tempdir");
    let t = Instant::now();
    std::fs::write(dir.path().join("00-fixed.yaml"), FIXED).expect("write");
    let mut bytes = FIXED.len();
    for (k, from) in (0..services).step_by(1000).enumerate() {
        let y = manifests(from, (from + 1000).min(services), eps);
        bytes += y.len();
        std::fs::write(dir.path().join(format!("{k:03}.yaml")), y).expect("write");
    }
    let written = t.elapsed();
    let events = dir.path().join("events.jsonl");

    // The probe endpoint: a listener in the namespace that accepts and closes.
    let ns_name = name.clone();
    std::thread::spawn(move || {
        Netns::enter(&ns_name);
        let l = TcpListener::bind((PROBE_POD_IP, 8080)).expect("bind probe listener");
        for c in l.incoming() {
            drop(c);
        }
    });

    let manifests_dir = dir.path().join("m");
    std::fs::create_dir(&manifests_dir).expect("mkdir");
    for e in std::fs::read_dir(dir.path()).expect("readdir").flatten() {
        if e.path().extension().is_some_and(|x| x == "yaml") {
            std::fs::rename(e.path(), manifests_dir.join(e.file_name())).expect("mv");
        }
    }
    let stderr = std::fs::File::create(dir.path().join("kproxy.log")).expect("create kproxy.log");
    let mut daemon = Proc(
        Command::new("ip")
            .args(["netns", "exec", &ns.0])
            .arg(kproxy_binary())
            .args(["run", "--manifests"])
            .arg(&manifests_dir)
            .args(["--hostname-override", "node-0", "--event-log"])
            .arg(&events)
            .args(["--healthz-bind-address", "127.0.0.1:10256"])
            .args(["--metrics-bind-address", "127.0.0.1:10249"])
            .args([
                "--traffic-metrics",
                &std::env::var("DAEMON_BENCH_TRAFFIC").unwrap_or_else(|_| "off".into()),
            ])
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn kproxy"),
    );
    let pid = daemon.0.id();
    let first_sync = wait_for_sync(&events, &mut daemon, Duration::from_secs(600));
    // `ip netns exec` execs the binary, so the child's pid is kproxy's.
    let rss_after_sync = status_kib(pid, "VmRSS:");

    // First-packet latency: new TCP connections to the probe cluster IP, sequentially.
    let ns_name = name.clone();
    let mut samples = std::thread::spawn(move || {
        Netns::enter(&ns_name);
        let dst: SocketAddr = format!("{PROBE_CLUSTER_IP}:80").parse().expect("addr");
        let mut out = Vec::with_capacity(SAMPLES);
        for _ in 0..SAMPLES {
            let t = Instant::now();
            let s = TcpStream::connect_timeout(&dst, Duration::from_secs(2))
                .expect("connect through the rules");
            out.push(t.elapsed());
            drop(s);
        }
        out
    })
    .join()
    .expect("latency thread");
    samples.sort();
    let hwm = status_kib(pid, "VmHWM:");
    // The allocator hands freed pages back about a second after a burst
    // (src/allocator.rs), so the idle daemon's footprint is read a little later.
    std::thread::sleep(Duration::from_secs(3));
    let rss_settled = status_kib(pid, "VmRSS:");

    println!(
        "{services}x{eps}: manifests {:.1} MB (written in {} ms) | start → first sync {:.2} s | RSS after sync {:.1} MiB, 3 s after the samples {:.1} MiB, peak {:.1} MiB | first packet (connect) p50 {} µs, p99 {} µs over {SAMPLES}",
        bytes as f64 / 1e6,
        written.as_millis(),
        first_sync.as_secs_f64(),
        rss_after_sync as f64 / 1024.0,
        rss_settled as f64 / 1024.0,
        hwm as f64 / 1024.0,
        percentile(&samples, 0.5).as_micros(),
        percentile(&samples, 0.99).as_micros(),
    );
    let _ = std::io::stdout().flush();
    scrape(&name, pid, services, eps);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let _ = daemon.0.wait();
    if std::env::var_os("DAEMON_BENCH_KEEP").is_some() {
        println!("  kept {}", dir.keep().display());
    }
}

/// `/metrics` once the traffic counters were read (they are read every 10 s): 5 scrapes,
/// their wall time and size, and the daemon's own time to read the counters; before
/// them, the idle daemon's CPU over those 11 s (one reading of the counters in them).
fn scrape(ns: &str, pid: u32, services: usize, eps: usize) {
    let before = cpu_ticks(pid);
    std::thread::sleep(Duration::from_secs(11));
    let idle_ticks = cpu_ticks(pid).saturating_sub(before);
    // USER_HZ is 100 on every Linux the bench runs on.
    println!(
        "{services}x{eps}: idle CPU over 11 s {} ms (user + system)",
        idle_ticks * 10
    );
    let ns = ns.to_string();
    let (times, body) = std::thread::spawn(move || {
        Netns::enter(&ns);
        let mut times = Vec::new();
        let mut body = String::new();
        for _ in 0..5 {
            let t = Instant::now();
            let mut c = TcpStream::connect("127.0.0.1:10249").expect("metrics address");
            c.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
                .expect("request");
            body.clear();
            std::io::Read::read_to_string(&mut c, &mut body).expect("answer");
            times.push(t.elapsed());
        }
        (times, body)
    })
    .join()
    .expect("scrape thread");
    let mut times = times;
    times.sort();
    let series = body
        .lines()
        .filter(|l| l.starts_with("kproxy_service_") && l.contains("_total{"))
        .count();
    let read = body
        .lines()
        .find_map(|l| l.strip_prefix("kproxy_traffic_counters_read_seconds "))
        .unwrap_or("absent");
    println!(
        "{services}x{eps}: /metrics p50 {} ms, max {} ms, {:.2} MB, {series} kproxy_service_*_total series; the daemon's counter reading took {read} s",
        percentile(&times, 0.5).as_millis(),
        times.last().map_or(0, |t| t.as_millis()),
        body.len() as f64 / 1e6,
    );
}

fn main() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "daemon_bench needs root (network namespaces, nftables)"
    );
    let sizes: Vec<(usize, usize)> = {
        let args: Vec<String> = std::env::args()
            .skip(1)
            .filter(|a| !a.starts_with('-'))
            .collect();
        let args = if args.is_empty() {
            vec!["10x10".into(), "10000x10".into(), "30000x1".into()]
        } else {
            args
        };
        args.iter()
            .map(|a| {
                let (s, e) = a.split_once('x').expect("SIZE is SERVICESxENDPOINTS");
                (s.parse().expect("services"), e.parse().expect("endpoints"))
            })
            .collect()
    };
    for (s, e) in sizes {
        run(s, e);
    }
}
