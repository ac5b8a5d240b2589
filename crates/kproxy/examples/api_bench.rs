//! `kproxy run --kubeconfig` against a real API server, at scale (root): populates the
//! API with N Services × E endpoints, then starts kproxy in a throwaway network
//! namespace (the API bridged in through a unix socket) and reports the time from
//! process start to the first sync and to the first connection through a cluster IP,
//! the RSS after the first sync and settled, the peak RSS (VmHWM), the kernel's slab
//! growth (`SUnreclaim`, per endpoint) and the CPU seconds of kproxy and of the API
//! server (its pid file beside the kubeconfig) until that sync.
//!
//! Needs a running API server, e.g. a k8s-lab instance (docs/lab.md, "The real control
//! plane", says how to start one; `start.sh` is its start script):
//!
//! ```text
//! API_PORT=6452 ETCD_PORT=2393 KCM_PORT=10262 start.sh start
//! cargo build --release -p kproxy && cargo run --release -p kproxy --example api_bench -- \
//!   --kubeconfig $K8S_LAB/kubeconfig --proxy-kubeconfig $K8S_LAB/kubeconfig-proxy \
//!   10000x10 [--runs 3] [--skip-populate] [--churn SECONDS] [--rate PER_SECOND] \
//!   [--kproxy-arg ARG]...   # e.g. --kproxy-arg --min-sync-period=0s
//!   [--upstream $K8S_LAB/bin/kube-proxy | --compare-upstream $K8S_LAB/bin/kube-proxy]
//!   [--restart] [--flips N [--flip-every-ms MS] [--flip-churn PER_SECOND]]
//!   [--flip-local-count N]
//! ```
//!
//! `--flips N` then moves the probe Service's endpoint between two listeners that answer
//! with their own byte, N times, the next flip `--flip-every-ms` (default 300) after the
//! last was seen, optionally while `--flip-churn R` other slices are patched per second;
//! it reports the API's acknowledgement of each flip → the first new connection through
//! the cluster IP answered by the new endpoint (refused or timed-out connections prove
//! nothing). `--compare-upstream BINARY` runs everything for kproxy, then for upstream
//! kube-proxy on the same API, and prints the flip probe's two columns together.
//!
//! `--flip-local-count N` measures the change of a Service with internalTrafficPolicy
//! Local whose node-local endpoint count alternates 1 ↔ 2 (`bench/probe-local`, set
//! to one local endpoint before each kproxy starts, so that its first write is the
//! first change after start), N writes in every run, the next `--flip-every-ms` after
//! the kernel held the last: the API's acknowledgement of each write → the kernel commit
//! of the first sync naming the Service (kproxy's event log); the first change after
//! start on its own line, and with `--runs` > 1 all runs pooled.
//!
//! `--upstream BINARY` measures upstream kube-proxy (nftables mode, the k8s-lab's
//! flags) instead, in the same namespace, as the same user, against the same API, with
//! the same probe: its "first sync" is the first connection through the probe's cluster
//! IP (it writes no event log), and it has no timeline and no churn figures.
//!
//! `--churn S` then keeps the last run's kproxy up and flips one endpoint's readiness
//! (and adds a surge endpoint at an address of its own) in a different EndpointSlice
//! `--rate` times a second (default 100) for S seconds, one merge PATCH each, and
//! reports: writes acknowledged, the API's write latency, kproxy's
//! `kproxy_change_stage_duration_seconds` (a watch event received → in the state →
//! planned → kernel committed; p50/p99 from the histogram buckets, so bucket-bounded), the
//! pending-change gauges after the churn, kproxy's CPU time during it, and each write's
//! way end to end: acknowledged (and sent) → the kernel commit of the first sync whose
//! `synced` event names the written Service (`changed`, `committed_unix_us`).
//!
//! `--restart` then restarts the last run's kproxy as a DaemonSet update or a crash
//! would, into the tables it left: SIGTERM, then SIGKILL (each followed at once by a
//! new process; the binary is the same file, so "upgrade" is the same measurement).
//! A client in the namespace opens new connections through the probe's cluster IP
//! all along (one every ~2 ms, 200 ms timeout); each restart reports the new
//! process's start → first sync (adopting the kernel's tables: what it sent), its peak
//! RSS, and the connections that succeeded and failed from the signal until 5 s after
//! that sync.
//!
//! Objects already there (409) are kept, so a second call at the same scale only
//! measures — slowly: the API server allocates and releases a cluster IP for each
//! existing Service before refusing it (≈ 25/s on the k8s-lab), so pass
//! --skip-populate; for another scale wipe the lab first
//! (`start.sh wipe && start.sh start`). The objects are those of `daemon_bench`:
//! Services in 50 namespaces, one in ten of the first 10,000 a LoadBalancer with
//! externalTrafficPolicy Local (the node-port range holds no more), endpoints on 100
//! nodes, one in seven serving+terminating; plus `bench/probe`, whose endpoint is a
//! listener in the namespace. kproxy runs as system:kube-proxy (RBAC
//! system:node-proxier), as upstream's does. Each run starts with no kproxy tables.

#![expect(
    clippy::disallowed_types,
    reason = "a bench of real processes: wall time"
)]

#[path = "support/mod.rs"]
mod support;

use support::{
    Netns, Proc, cpu_ticks, ip4, kproxy_binary, proc_kib, sh, slice_endpoints, status_kib, unix_us,
};

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::core::Request;
use kube::core::params::{Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const PROBE_CLUSTER_IP: &str = "10.96.255.250";
const PROBE_POD_IP: &str = "10.250.0.2";
/// The flip probe's second endpoint (`--flips`): each probe endpoint answers a new
/// connection with its own byte, so a flip is seen only when the new one answers.
const PROBE_POD_IP_B: &str = "10.250.0.3";
const PROBE_ANSWERS: [(&str, u8); 2] = [(PROBE_POD_IP, b'A'), (PROBE_POD_IP_B, b'B')];
const NAMESPACES: usize = 50;

fn service(i: usize) -> (String, Value) {
    let ns = format!("ns-{}", i % NAMESPACES);
    let lb = i.is_multiple_of(10) && i < 10_000;
    let mut spec =
        json!({"ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]});
    if lb {
        spec["type"] = json!("LoadBalancer");
        spec["externalTrafficPolicy"] = json!("Local");
    }
    let body = json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc-{i}"), "namespace": ns}, "spec": spec});
    (format!("/api/v1/namespaces/{ns}/services"), body)
}

fn slice(i: usize, eps: usize) -> (String, Value) {
    let ns = format!("ns-{}", i % NAMESPACES);
    let endpoints = slice_endpoints(i, eps);
    let body = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc-{i}-x"), "namespace": ns,
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints});
    (
        format!("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"),
        body,
    )
}

fn fixed() -> Vec<(String, Value)> {
    let mut v: Vec<(String, Value)> = (0..NAMESPACES)
        .map(|k| format!("ns-{k}"))
        .chain(["bench".to_string()])
        .map(|ns| {
            (
                "/api/v1/namespaces".to_string(),
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
            )
        })
        .collect();
    v.push((
        "/api/v1/nodes".into(),
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-0"}}),
    ));
    v.push(("/api/v1/namespaces/bench/services".into(), json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "probe", "namespace": "bench"},
        "spec": {"clusterIP": PROBE_CLUSTER_IP, "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}})));
    v.push(("/apis/discovery.k8s.io/v1/namespaces/bench/endpointslices".into(), json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "probe-x", "namespace": "bench", "labels": {"kubernetes.io/service-name": "probe"}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [{"addresses": [PROBE_POD_IP], "nodeName": "node-0", "conditions": {"ready": true}}]})));
    v
}

/// Creates the objects, 32 requests in flight; an object already there is kept.
async fn create(client: &kube::Client, objects: Vec<(String, Value)>) -> (usize, usize) {
    let results: Vec<Result<bool, String>> = futures::stream::iter(objects)
        .map(|(path, body)| {
            let client = client.clone();
            async move {
                let req = Request::new(&path)
                    .create(&PostParams::default(), body.to_string().into_bytes())
                    .map_err(|e| e.to_string())?;
                match client.request_text(req).await {
                    Ok(_) => Ok(true),
                    Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
                    // A Service with a fixed cluster IP that is already there is refused
                    // for its IP (422) before its name is found taken (409).
                    Err(e) => {
                        let name = body["metadata"]["name"].as_str().unwrap_or_default();
                        let get = Request::new(&path)
                            .get(name, &Default::default())
                            .map_err(|e| e.to_string())?;
                        match client.request_text(get).await {
                            Ok(_) => Ok(false),
                            Err(_) => Err(e.to_string()),
                        }
                    }
                }
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let mut created = 0;
    let mut existing = 0;
    for r in results {
        match r {
            Ok(true) => created += 1,
            Ok(false) => existing += 1,
            Err(e) => panic!("populating the API: {e}"),
        }
    }
    (created, existing)
}

fn populate(kubeconfig: &Path, services: usize, eps: usize) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = kproxy_source::kube::client(Some(kubeconfig))
            .await
            .expect("admin client");
        let t = Instant::now();
        create(&client, fixed()).await;
        let (c1, e1) = create(&client, (0..services).map(service).collect()).await;
        let (c2, e2) = create(&client, (0..services).map(|i| slice(i, eps)).collect()).await;
        eprintln!(
            "populated in {:.0} s: {c1} Services and {c2} EndpointSlices created, {} already there",
            t.elapsed().as_secs_f64(),
            e1 + e2
        );
    });
}

fn api_port(kubeconfig: &Path) -> u16 {
    let text = std::fs::read_to_string(kubeconfig).expect("read the proxy kubeconfig");
    text.lines()
        .find_map(|l| l.trim().strip_prefix("server:"))
        .and_then(|s| s.trim().rsplit(':').next())
        .and_then(|p| p.trim_end_matches('/').parse().ok())
        .expect("server: https://127.0.0.1:PORT in the kubeconfig")
}

/// VmRSS of a process sampled every 2 ms (from its start) until stopped: where in the
/// first sync the peak falls.
struct Sampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Duration, u64)>>,
}

impl Sampler {
    fn start(pid: u32, t0: Instant) -> Sampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                samples.push((t0.elapsed(), status_kib(pid, "VmRSS:")));
                std::thread::sleep(Duration::from_millis(2));
            }
            samples
        });
        Sampler { stop, thread }
    }

    fn finish(self) -> Vec<(Duration, u64)> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("sampler")
    }
}

/// Seconds since midnight UTC of a log line's RFC 3339 timestamp
/// (`2026-11-24T03:52:10.123456Z ...`).
fn log_time_of_day(line: &str) -> Option<f64> {
    let t = line.split_whitespace().next()?.split_once('T')?.1;
    let t = t.trim_end_matches('Z');
    let mut f = t.split(':');
    let (h, m, s): (f64, f64, f64) = (
        f.next()?.parse().ok()?,
        f.next()?.parse().ok()?,
        f.next()?.parse().ok()?,
    );
    Some(h * 3600.0 + m * 60.0 + s)
}

/// The phases of the first sync from kproxy's log, each with its time from process
/// start, the RSS then and the highest RSS sampled since the previous one.
fn timeline(log: &Path, start_of_day: f64, samples: &[(Duration, u64)]) -> String {
    // In match order: the first-sync-allowed line also says "listed".
    const MARKS: [&str; 6] = [
        "kproxy starting",
        "watching the Kubernetes API",
        "first sync allowed",
        "listed",
        "starting the sync loop",
        "synced",
    ];
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let mut out = Vec::new();
    let mut from = Duration::ZERO;
    for line in text.lines() {
        let Some(mark) = MARKS.iter().find(|m| line.contains(*m)) else {
            continue;
        };
        let Some(tod) = log_time_of_day(line) else {
            continue;
        };
        let at = Duration::from_secs_f64((tod - start_of_day).rem_euclid(86_400.0));
        let in_phase = samples.iter().filter(|(t, _)| *t > from && *t <= at);
        let max = in_phase.map(|s| s.1).max().unwrap_or(0);
        let now = samples
            .iter()
            .rev()
            .find(|(t, _)| *t <= at)
            .map_or(0, |s| s.1);
        let what = match line.split("kind=").nth(1) {
            Some(kind) if *mark == "listed" => format!("{} listed", kind.trim()),
            _ => mark.to_string(),
        };
        out.push(format!(
            "{:.3} s {what}: RSS {:.1} MiB (max since previous {:.1})",
            at.as_secs_f64(),
            now as f64 / 1024.0,
            max as f64 / 1024.0
        ));
        if *mark == "synced" {
            // The first sync (plan, then nft) is where the peak is: its RSS curve.
            let mut windows = vec![0u64; ((at - from).as_millis() / 50) as usize + 1];
            for (t, rss) in samples.iter().filter(|(t, _)| *t > from && *t <= at) {
                let w = &mut windows[((*t - from).as_millis() / 50) as usize];
                *w = (*w).max(*rss);
            }
            let curve: Vec<String> = windows
                .iter()
                .map(|k| format!("{:.0}", *k as f64 / 1024.0))
                .collect();
            out.push(format!(
                "first sync RSS, max per 50 ms, MiB: {}",
                curve.join(" ")
            ));
            break;
        }
        from = at;
    }
    out.join("\n    ")
}

struct Run {
    first_sync: Duration,
    /// CPU seconds (user + system) of the proxy from its start to its first sync, and
    /// of the API server meanwhile (when its pid file is found beside the kubeconfig):
    /// the work, which on a loaded machine says more than the wall time.
    cpu_s: f64,
    api_cpu_s: Option<f64>,
    first_connect: Duration,
    rss_sync: u64,
    rss_settled: u64,
    hwm: u64,
    /// The kernel's unreclaimable slab (`SUnreclaim`, the whole machine) 5 s after the
    /// first sync less before the proxy started, in KiB: its tables' memory, give or
    /// take what else the machine did meanwhile.
    slab_kib: i64,
    timeline: String,
    /// The first `synced` event's line from the event log.
    sync_event: String,
}

/// Upstream kube-proxy (nftables mode) with the flags the k8s-lab starts it with: the
/// same API, user, node and namespace as kproxy, conntrack sysctls left alone.
fn upstream_command(binary: &Path, proxy_kubeconfig: &Path) -> Command {
    let mut c = Command::new(binary);
    c.arg(format!("--kubeconfig={}", proxy_kubeconfig.display()))
        .args([
            "--proxy-mode=nftables",
            "--hostname-override=node-0",
            "--bind-address=127.0.0.1",
            "--metrics-bind-address=127.0.0.1:10249",
            "--healthz-bind-address=127.0.0.1:10256",
            "--conntrack-max-per-core=0",
            "--conntrack-tcp-timeout-established=0",
            "--conntrack-tcp-timeout-close-wait=0",
            "--v=1",
        ]);
    c
}

/// How long a proxy may take to serve the probe: upstream's first sync at scale takes
/// minutes.
const SERVE_WITHIN: Duration = Duration::from_secs(1200);

fn measure(
    proxy_kubeconfig: &Path,
    extra: &[String],
    upstream: Option<&Path>,
    ns: &str,
    dir: &Path,
    run: usize,
) -> (Run, Proc) {
    let events = dir.join(format!("events-{run}.jsonl"));
    let stderr = std::fs::File::create(dir.join(format!("kproxy-{run}.log"))).expect("log");
    let t0 = Instant::now();
    let start_of_day = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
        .rem_euclid(86_400.0);
    let command = match upstream {
        Some(binary) => upstream_command(binary, proxy_kubeconfig),
        None => {
            let mut c = Command::new(kproxy_binary());
            c.arg("run")
                .arg("--kubeconfig")
                .arg(proxy_kubeconfig)
                .args(["--hostname-override", "node-0", "--event-log"])
                .arg(&events)
                .args(["--healthz-bind-address", "127.0.0.1:10256"])
                .args(["--metrics-bind-address", "127.0.0.1:10249"])
                .args(extra)
                // Info: the timeline reads the phases from the log.
                .env("KPROXY_LOG", "info");
            c
        }
    };
    let slab0 = proc_kib("/proc/meminfo", "SUnreclaim:");
    let program = command.get_program().to_owned();
    let args: Vec<_> = command.get_args().map(|a| a.to_owned()).collect();
    let envs: Vec<_> = command
        .get_envs()
        .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
        .collect();
    let mut daemon = Proc(
        Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(program)
            .args(args)
            .envs(envs)
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn the proxy"),
    );
    let pid = daemon.0.id();
    let api_pid: Option<u32> = proxy_kubeconfig
        .parent()
        .and_then(|d| std::fs::read_to_string(d.join("run/kube-apiserver.pid")).ok())
        .and_then(|p| p.trim().parse().ok());
    let api_cpu0 = api_pid.map(cpu_ticks);
    let sampler = Sampler::start(pid, t0);
    // The probe connects from the start: the first success is when the rules serve.
    let ns_name = ns.to_string();
    let prober = std::thread::spawn(move || {
        Netns::enter(&ns_name);
        let dst: SocketAddr = format!("{PROBE_CLUSTER_IP}:80").parse().expect("addr");
        loop {
            if TcpStream::connect_timeout(&dst, Duration::from_millis(200)).is_ok() {
                return Instant::now();
            }
            assert!(
                t0.elapsed() < SERVE_WITHIN,
                "no connection within {SERVE_WITHIN:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let mut prober = Some(prober);
    let mut connected = None;
    let (first_sync, sync_event) = loop {
        if upstream.is_some() {
            // No event log: the first sync is when the probe gets through.
            let at = prober.take().expect("joined once").join().expect("prober");
            connected = Some(at);
            break (at - t0, String::new());
        }
        let log = std::fs::read_to_string(&events).unwrap_or_default();
        if let Some(l) = log.lines().find(|l| l.contains("\"event\":\"synced\"")) {
            break (t0.elapsed(), l.to_string());
        }
        if let Ok(Some(status)) = daemon.0.try_wait() {
            panic!("kproxy exited with {status} before its first sync (see {run} log in {dir:?})");
        }
        assert!(
            t0.elapsed() < SERVE_WITHIN,
            "no sync within {SERVE_WITHIN:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let rss_sync = status_kib(pid, "VmRSS:");
    let cpu_s = cpu_ticks(pid) as f64 / 100.0;
    let api_cpu_s = api_pid
        .zip(api_cpu0)
        .map(|(p, c0)| cpu_ticks(p).saturating_sub(c0) as f64 / 100.0);
    let samples = sampler.finish();
    let timeline = timeline(
        &dir.join(format!("kproxy-{run}.log")),
        start_of_day,
        &samples,
    );
    let first_connect = match (connected, prober) {
        (Some(at), _) => at,
        (None, Some(p)) => p.join().expect("prober"),
        (None, None) => unreachable!("the prober is joined once"),
    } - t0;
    std::thread::sleep(Duration::from_secs(5));
    let rss_settled = status_kib(pid, "VmRSS:");
    let hwm = status_kib(pid, "VmHWM:");
    let slab_kib = proc_kib("/proc/meminfo", "SUnreclaim:") as i64 - slab0 as i64;
    (
        Run {
            first_sync,
            cpu_s,
            api_cpu_s,
            first_connect,
            rss_sync,
            rss_settled,
            hwm,
            slab_kib,
            timeline,
            sync_event,
        },
        daemon,
    )
}

/// Quantile `q` of a Prometheus histogram (`le` bounds and cumulative counts): the
/// upper bound of the bucket holding it.
fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let total = buckets.last().map_or(0.0, |b| b.1);
    buckets
        .iter()
        .find(|(_, c)| *c >= q * total)
        .map_or(f64::NAN, |(le, _)| *le)
}

fn metrics_text(ns: &str) -> String {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            ns,
            "curl",
            "-s",
            "http://127.0.0.1:10249/metrics",
        ])
        .output()
        .expect("curl the metrics");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stage_buckets(text: &str, stage: &str) -> Vec<(f64, f64)> {
    let prefix = "kproxy_change_stage_duration_seconds_bucket{";
    text.lines()
        .filter(|l| l.starts_with(prefix) && l.contains(&format!("stage=\"{stage}\"")))
        .filter_map(|l| {
            let le = l.split("le=\"").nth(1)?.split('"').next()?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, l.rsplit(' ').next()?.parse().ok()?))
        })
        .collect()
}

/// From kproxy's event log: each Service a delta sync named (`changed`) → the kernel
/// commit times of those syncs (`committed_unix_us`), each with the time kproxy's watch
/// received its oldest change (`oldest_change_unix_us`) when the sync carried that
/// Service alone (then the oldest change is this one).
fn commits(events: &Path) -> std::collections::HashMap<String, Vec<(u64, Option<u64>)>> {
    let text = std::fs::read_to_string(events).unwrap_or_default();
    let mut commits: std::collections::HashMap<String, Vec<(u64, Option<u64>)>> =
        Default::default();
    for e in text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        let (Some(at), Some(names)) = (e["committed_unix_us"].as_u64(), e["changed"].as_array())
        else {
            continue;
        };
        let state = e["oldest_change_unix_us"]
            .as_u64()
            .filter(|_| names.len() == 1);
        for n in names.iter().filter_map(Value::as_str) {
            commits.entry(n.to_string()).or_default().push((at, state));
        }
    }
    commits
}

/// The first commit of `svc` at or after `t` (µs), with its state time (see [`commits`]).
fn first_commit(
    commits: &std::collections::HashMap<String, Vec<(u64, Option<u64>)>>,
    svc: &str,
    t: u64,
) -> Option<(u64, Option<u64>)> {
    commits
        .get(svc)?
        .iter()
        .copied()
        .filter(|c| c.0 >= t)
        .min_by_key(|c| c.0)
}

/// Each write's way as the bench sees it: for the first `synced` event in kproxy's event
/// log that names the written Service and committed after the write was sent, the
/// kernel commit minus the write's acknowledgement (negative when the watch event and
/// the sync beat the API's answer to the client) and minus its sending; in ms. Writes
/// no sync names are counted as missing.
fn write_to_kernel(events: &Path, writes: &[(String, u64, u64)]) -> (Vec<f64>, Vec<f64>, usize) {
    let commits = commits(events);
    let (mut from_ack, mut from_sent, mut missing) = (Vec::new(), Vec::new(), 0);
    for (svc, sent, acked) in writes {
        match first_commit(&commits, svc, *sent) {
            Some((t, _)) => {
                from_ack.push((t as f64 - *acked as f64) / 1e3);
                from_sent.push((t - sent) as f64 / 1e3);
            }
            None => missing += 1,
        }
    }
    from_ack.sort_by(f64::total_cmp);
    from_sent.sort_by(f64::total_cmp);
    (from_ack, from_sent, missing)
}

#[allow(clippy::too_many_arguments)]
fn churn(
    kubeconfig: &Path,
    ns: &str,
    pid: u32,
    events: &Path,
    services: usize,
    eps: usize,
    secs: u64,
    rate: u64,
) {
    let before = metrics_text(ns);
    let ticks0 = cpu_ticks(pid);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let run_salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos() as usize);
    // When the API server delivers each change to a watcher of its own (the bench's, on
    // the host, no socat in between): "Service" → arrival times, in µs since the epoch.
    let delivered: std::sync::Arc<std::sync::Mutex<Vec<(String, u64)>>> = Default::default();
    let (writes, mut write_ms) = rt.block_on(async {
        let client = kproxy_source::kube::client(Some(kubeconfig))
            .await
            .expect("admin client");
        let slices = "/apis/discovery.k8s.io/v1/endpointslices";
        let list = Request::new(slices)
            .list(&kube::core::params::ListParams::default().limit(1))
            .expect("list request");
        let rv = serde_json::from_str::<Value>(&client.request_text(list).await.expect("list"))
            .ok()
            .and_then(|v| {
                v["metadata"]["resourceVersion"]
                    .as_str()
                    .map(str::to_string)
            })
            .expect("the list's resourceVersion");
        let watch = Request::new(slices)
            .watch(
                &kube::core::params::WatchParams::default().timeout(290),
                &rv,
            )
            .expect("watch request");
        let events = client
            .request_events::<kube::core::DynamicObject>(watch)
            .await
            .expect("watch");
        let sink = delivered.clone();
        tokio::spawn(async move {
            futures::pin_mut!(events);
            while let Some(Ok(e)) = events.next().await {
                let at = unix_us();
                if let kube::core::WatchEvent::Modified(o) = e
                    && let (Some(ns), Some(name)) = (o.metadata.namespace, o.metadata.name)
                {
                    let svc = name.strip_suffix("-x").unwrap_or(&name);
                    sink.lock().unwrap().push((format!("{ns}/{svc}"), at));
                }
            }
        });
        let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
        let mut tasks = Vec::new();
        for k in 0..(secs * rate) as usize {
            tick.tick().await;
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let (svc, req) = churn_write(k, services, eps, run_salt);
                let (t, sent) = (Instant::now(), unix_us());
                client
                    .request_text(req)
                    .await
                    .map(|_| (t.elapsed(), svc, sent, unix_us()))
            }));
        }
        let mut write_ms = Vec::new();
        let mut writes = Vec::new();
        for t in tasks {
            if let Ok(Ok((d, svc, sent, acked))) = t.await {
                write_ms.push(d.as_secs_f64() * 1e3);
                writes.push((svc, sent, acked));
            }
        }
        (writes, write_ms)
    });
    let acked = writes.len();
    std::thread::sleep(Duration::from_secs(2));
    let ticks = cpu_ticks(pid) - ticks0;
    let after = metrics_text(ns);
    write_ms.sort_by(f64::total_cmp);
    let pct = |v: &[f64], q: f64| {
        v.get(((v.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    println!(
        "churn {rate}/s for {secs} s: {acked} writes acknowledged; API write latency p50 {:.1} ms, p99 {:.1} ms; kproxy CPU {:.1} s ({:.0} % of one core)",
        pct(&write_ms, 0.5),
        pct(&write_ms, 0.99),
        ticks as f64 / 100.0,
        ticks as f64 / secs as f64
    );
    for stage in ["received", "queued", "plan", "commit", "total"] {
        let (b, a) = (stage_buckets(&before, stage), stage_buckets(&after, stage));
        let diff: Vec<(f64, f64)> = a
            .iter()
            .map(|(le, c)| (*le, c - b.iter().find(|x| x.0 == *le).map_or(0.0, |x| x.1)))
            .collect();
        println!(
            "  stage {stage}: {} syncs, p50 ≤ {:.2} ms, p99 ≤ {:.2} ms",
            diff.last().map_or(0.0, |d| d.1),
            bucket_quantile(&diff, 0.5) * 1e3,
            bucket_quantile(&diff, 0.99) * 1e3
        );
    }
    for l in after.lines().filter(|l| l.contains("changes_pending")) {
        println!("  after: {l}");
    }
    let (from_ack, from_sent, missing) = write_to_kernel(events, &writes);
    let delivered = std::mem::take(&mut *delivered.lock().unwrap());
    let d = api_delivery(events, &writes, &delivered);
    let beat = from_ack.iter().filter(|x| **x < 0.0).count();
    println!(
        "  write → kernel (the first sync naming the written Service, from kproxy's event log; {} writes matched, {missing} not named by any sync): acknowledged → kernel p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({beat} committed before the client had the API's answer: counted as ≤ 0); sent → kernel p50 {:.2} ms, p99 {:.2} ms",
        from_ack.len(),
        pct(&from_ack, 0.5),
        pct(&from_ack, 0.99),
        from_ack.last().copied().unwrap_or(f64::NAN),
        pct(&from_sent, 0.5),
        pct(&from_sent, 0.99),
    );
    let line = |v: &[f64]| {
        format!(
            "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            pct(v, 0.5),
            pct(v, 0.99),
            v.last().copied().unwrap_or(f64::NAN)
        )
    };
    println!(
        "  the API's own delivery ({} writes seen by the bench's watch): acknowledged → delivered to a watcher {}; that delivery → kproxy's kernel commit {}",
        d.ack_to_watch.len(),
        line(&d.ack_to_watch),
        line(&d.watch_to_kernel)
    );
    println!(
        "  of which, for the {} writes whose sync carried that Service alone: delivery → received by kproxy's watch {}; received → kernel commit {}",
        d.watch_to_received.len(),
        line(&d.watch_to_received),
        line(&d.received_to_kernel)
    );
}

/// The `k`-th churn write: one merge PATCH of a bench EndpointSlice, and its Service.
fn churn_write(
    k: usize,
    services: usize,
    eps: usize,
    run_salt: usize,
) -> (String, http::Request<Vec<u8>>) {
    let i = (k * 7919) % services;
    let ns = format!("ns-{}", i % NAMESPACES);
    let mut endpoints = slice(i, eps).1["endpoints"].clone();
    // One endpoint flips between its original readiness and the opposite on every pass
    // over the slices. That alone can equal what an earlier run left (the flipped
    // endpoint used to be picked by pid % eps: when two runs' picks met, every write was
    // a no-op the API server does not even pass on, and the run recorded no syncs), so
    // each write also adds one surge endpoint at an address of its own (10.245.x.y from
    // the run's start time and the write's number): every write is a real change.
    let e = k % eps;
    let flip = (k / services).is_multiple_of(2);
    let ready = endpoints[e]["conditions"]["ready"].as_bool() == Some(true);
    endpoints[e]["conditions"]["ready"] = json!(ready != flip);
    if let Some(list) = endpoints.as_array_mut() {
        list.push(json!({
            "addresses": [ip4(0x0af5_0000, (run_salt + k) % 65_000 + 1)],
            "nodeName": "node-1",
            "conditions": {"ready": true, "serving": true, "terminating": false}
        }));
    }
    let body = json!({"endpoints": endpoints});
    let req = Request::new(format!(
        "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
    ))
    .patch(
        &format!("svc-{i}-x"),
        &PatchParams::default(),
        &Patch::Merge(body),
    )
    .expect("patch request");
    (format!("{ns}/svc-{i}"), req)
}

/// `--flips N`: the probe Service's one endpoint is moved between the two probe
/// listeners (which answer with their own byte) N times, `every` apart after each is
/// seen; with `churn` > 0, other slices are patched that many times a second all along.
/// A flip is seen when a new connection through the probe's cluster IP is answered by
/// the new endpoint: a refused or timed-out connection proves nothing. Returns, per
/// flip, the time from the API's acknowledgement of the write to that answer, in ms
/// (`None`: not seen within a minute).
fn flip_probe(
    kubeconfig: &Path,
    ns: &str,
    n: usize,
    every: Duration,
    churn: u64,
    services: usize,
    eps: usize,
) -> Vec<Option<f64>> {
    use std::sync::mpsc;
    const SEEN_WITHIN: Duration = Duration::from_secs(60);
    // The prober, inside the namespace: for each target byte, connects until that
    // byte answers and returns when (µs since the epoch).
    let (want_tx, want_rx) = mpsc::channel::<u8>();
    let (seen_tx, seen_rx) = mpsc::channel::<(Option<u64>, String)>();
    let ns_name = ns.to_string();
    std::thread::spawn(move || {
        Netns::enter(&ns_name);
        let dst: SocketAddr = format!("{PROBE_CLUSTER_IP}:80").parse().expect("addr");
        for want in want_rx {
            let t = Instant::now();
            // What the attempts before the answer met, for the slow flips' report.
            let mut outcomes: std::collections::BTreeMap<String, usize> = Default::default();
            let seen = loop {
                if t.elapsed() > SEEN_WITHIN {
                    break None;
                }
                let mut c = match TcpStream::connect_timeout(&dst, Duration::from_millis(100)) {
                    Ok(c) => c,
                    Err(e) => {
                        *outcomes
                            .entry(format!("connect: {:?}", e.kind()))
                            .or_default() += 1;
                        continue;
                    }
                };
                let _ = c.set_read_timeout(Some(Duration::from_millis(100)));
                let mut b = [0u8; 1];
                match std::io::Read::read_exact(&mut c, &mut b) {
                    Ok(()) if b[0] == want => break Some(unix_us()),
                    Ok(()) => {
                        let from = c.local_addr().map(|a| a.port()).unwrap_or(0);
                        *outcomes
                            .entry(format!("the old endpoint answered ({})", b[0] as char))
                            .or_default() += 1;
                        if outcomes.len() < 8 && t.elapsed() > Duration::from_secs(2) {
                            *outcomes
                                .entry(format!("late, from port {from}"))
                                .or_default() += 1;
                            // What the kernel holds while the old endpoint still answers.
                            if let Some(dir) = std::env::var_os("API_BENCH_STALL_DIR") {
                                let dir = PathBuf::from(dir);
                                let out = |cmd: &[&str]| {
                                    Command::new(cmd[0])
                                        .args(&cmd[1..])
                                        .output()
                                        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                                        .unwrap_or_default()
                                };
                                let at = unix_us();
                                let port = from.to_string();
                                let conntrack = [
                                    "conntrack",
                                    "-L",
                                    "-p",
                                    "tcp",
                                    "--orig-dst",
                                    PROBE_CLUSTER_IP,
                                ];
                                let port_only =
                                    [&conntrack[..], &["--orig-port-src", &port]].concat();
                                for (what, cmd) in [
                                    (
                                        "nft",
                                        &["nft", "list", "map", "ip", "kproxy", "dnat-c-1"][..],
                                    ),
                                    ("port", &port_only[..]),
                                    ("conntrack", &conntrack[..]),
                                ] {
                                    let _ = std::fs::write(
                                        dir.join(format!("stall-{at}-{what}.txt")),
                                        out(cmd),
                                    );
                                }
                            }
                        }
                    }
                    Err(e) => *outcomes.entry(format!("read: {:?}", e.kind())).or_default() += 1,
                }
            };
            if seen_tx.send((seen, format!("{outcomes:?}"))).is_err() {
                return;
            }
        }
    });
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = kproxy_source::kube::client(Some(kubeconfig))
            .await
            .expect("admin client");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let background = (churn > 0).then(|| {
            let (client, stop) = (client.clone(), stop.clone());
            let salt = unix_us() as usize;
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / churn));
                let mut k = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    tick.tick().await;
                    let (_, req) = churn_write(k, services, eps, salt);
                    let client = client.clone();
                    tokio::spawn(async move { client.request_text(req).await });
                    k += 1;
                }
            })
        });
        let mut latencies = Vec::new();
        // Flip 0 puts the probe on A, from whatever an earlier run left; not counted.
        for k in 0..=n {
            let (ip, byte) = PROBE_ANSWERS[k % 2];
            let body = json!({"endpoints": [{"addresses": [ip], "nodeName": "node-0",
                                              "conditions": {"ready": true}}]});
            let req = Request::new("/apis/discovery.k8s.io/v1/namespaces/bench/endpointslices")
                .patch("probe-x", &PatchParams::default(), &Patch::Merge(body))
                .expect("patch request");
            client.request_text(req).await.expect("flip the probe");
            let acked = unix_us();
            want_tx.send(byte).expect("prober");
            let (seen, outcomes) = tokio::task::block_in_place(|| seen_rx.recv().expect("prober"));
            if k > 0 {
                let l = seen.map(|at| (at as f64 - acked as f64) / 1e3);
                if l.is_none_or(|ms| ms > 1500.0) {
                    eprintln!(
                        "    flip {k}: acknowledged at {acked} µs (unix), seen after {l:?} ms; before: {outcomes}"
                    );
                }
                latencies.push(l);
            }
            tokio::time::sleep(every).await;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(b) = background {
            let _ = b.await;
        }
        latencies
    })
}

fn local_count_summary(latencies: &[Option<f64>]) -> String {
    latency_summary(
        latencies,
        "local endpoint count changes (1 ↔ 2), {missed} not held within 10 s; acknowledged → kernel (event log)",
    )
}

/// `--flip-local-count`'s Service, `bench/probe-local`: internalTrafficPolicy Local,
/// its node-local endpoints (on `node-0`, kproxy's node) the two probe listeners, one or
/// both, beside one endpoint on another node that stays.
const LOCAL_PROBE: &str = "bench/probe-local";
const LOCAL_PROBE_CLUSTER_IP: &str = "10.96.255.249";
const LOCAL_PROBE_REMOTE_IP: &str = "10.250.1.9";

/// The local probe's endpoints with `local` (1 or 2) of them on kproxy's node.
fn local_probe_endpoints(local: usize) -> Value {
    let mut endpoints: Vec<Value> = PROBE_ANSWERS[..local]
        .iter()
        .map(|(ip, _)| json!({"addresses": [ip], "nodeName": "node-0", "conditions": {"ready": true}}))
        .collect();
    endpoints.push(
        json!({"addresses": [LOCAL_PROBE_REMOTE_IP], "nodeName": "node-1",
                          "conditions": {"ready": true}}),
    );
    Value::Array(endpoints)
}

fn local_probe_patch(local: usize) -> http::Request<Vec<u8>> {
    Request::new("/apis/discovery.k8s.io/v1/namespaces/bench/endpointslices")
        .patch(
            "probe-local-x",
            &PatchParams::default(),
            &Patch::Merge(json!({"endpoints": local_probe_endpoints(local)})),
        )
        .expect("patch request")
}

/// Before kproxy starts: the local probe's Service and slice exist (created if absent)
/// with one local endpoint, so that the probe's first write is kproxy's first change.
fn local_probe_reset(kubeconfig: &Path) {
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = kproxy_source::kube::client(Some(kubeconfig))
            .await
            .expect("admin client");
        let service = json!({"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "probe-local", "namespace": "bench"},
            "spec": {"clusterIP": LOCAL_PROBE_CLUSTER_IP, "internalTrafficPolicy": "Local",
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]}});
        let slice = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "probe-local-x", "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": "probe-local"}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": local_probe_endpoints(1)});
        create(
            &client,
            vec![
                ("/api/v1/namespaces/bench/services".into(), service),
                (
                    "/apis/discovery.k8s.io/v1/namespaces/bench/endpointslices".into(),
                    slice,
                ),
            ],
        )
        .await;
        client
            .request_text(local_probe_patch(1))
            .await
            .expect("reset the iTP=Local probe to one local endpoint");
    });
}

/// `--flip-local-count N`: the local probe's node-local endpoint count goes 1 → 2 → 1 …
/// N times, the next write `every` after the kernel held the last. A write counts when
/// kproxy's event log has a sync naming `bench/probe-local`, committed after the write
/// was sent (its `committed_unix_us` is taken when the kernel acknowledged the batch).
/// Returns, per write, that commit minus the API's acknowledgement, in ms (negative when
/// the commit beat the API's answer to the client; `None`: no such sync within 10 s),
/// and the first write's `synced` event.
fn local_count_probe(
    kubeconfig: &Path,
    events: &Path,
    n: usize,
    every: Duration,
) -> (Vec<Option<f64>>, Option<String>) {
    const HELD_WITHIN: Duration = Duration::from_secs(10);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = kproxy_source::kube::client(Some(kubeconfig))
            .await
            .expect("admin client");
        let mut latencies = Vec::new();
        let mut first = None;
        for k in 1..=n {
            let local = if k % 2 == 1 { 2 } else { 1 };
            let sent = unix_us();
            client
                .request_text(local_probe_patch(local))
                .await
                .expect("flip the iTP=Local probe's local endpoint count");
            let acked = unix_us();
            let t = Instant::now();
            let committed = loop {
                if let Some((at, _)) = first_commit(&commits(events), LOCAL_PROBE, sent) {
                    break Some(at);
                }
                if t.elapsed() > HELD_WITHIN {
                    break None;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            if k == 1 {
                first = committed.and_then(|at| {
                    std::fs::read_to_string(events)
                        .unwrap_or_default()
                        .lines()
                        .find(|l| {
                            serde_json::from_str::<Value>(l)
                                .is_ok_and(|e| e["committed_unix_us"].as_u64() == Some(at))
                        })
                        .map(str::to_string)
                });
            }
            let l = committed.map(|at| (at as f64 - acked as f64) / 1e3);
            if l.is_none_or(|ms| ms > 5.0) {
                eprintln!("    local count write {k} (→ {local}): acknowledged → kernel {l:?} ms");
            }
            latencies.push(l);
            tokio::time::sleep(every).await;
        }
        (latencies, first)
    })
}

/// One column of the flip probe: count, then p50 / p90 / p99 / max in ms.
fn flip_summary(latencies: &[Option<f64>]) -> String {
    latency_summary(
        latencies,
        "flips, {missed} not seen within 60 s; acknowledged → new endpoint answers",
    )
}

/// Count, then p50 / p90 / p99 / max in ms; `what` names the unit and the way
/// measured, `{missed}` in it standing for the `None`s.
fn latency_summary(latencies: &[Option<f64>], what: &str) -> String {
    let mut seen: Vec<f64> = latencies.iter().flatten().copied().collect();
    seen.sort_by(f64::total_cmp);
    let missed = latencies.len() - seen.len();
    let pct = |q: f64| {
        seen.get(((seen.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    format!(
        "{} {}: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        latencies.len(),
        what.replace("{missed}", &missed.to_string()),
        pct(0.5),
        pct(0.9),
        pct(0.99),
        seen.last().copied().unwrap_or(f64::NAN)
    )
}

/// Per write, from the bench's own watch, in ms, each sorted: acknowledged → delivered
/// to that watcher; that delivery → kproxy's kernel commit (the first sync naming the
/// Service after the write was sent); and, where that sync carried this Service alone,
/// the delivery → kproxy's watch receiving it, and that receipt → the commit. kproxy's
/// watch goes through socat into its namespace, so "delivery → received" is mostly that
/// hop.
struct Delivery {
    ack_to_watch: Vec<f64>,
    watch_to_kernel: Vec<f64>,
    watch_to_received: Vec<f64>,
    received_to_kernel: Vec<f64>,
}

fn api_delivery(
    events: &Path,
    writes: &[(String, u64, u64)],
    delivered: &[(String, u64)],
) -> Delivery {
    let mut seen: std::collections::HashMap<&str, Vec<u64>> = Default::default();
    for (svc, at) in delivered {
        seen.entry(svc.as_str()).or_default().push(*at);
    }
    let commits = commits(events);
    let ms = |a: u64, b: u64| (b as f64 - a as f64) / 1e3;
    let mut d = Delivery {
        ack_to_watch: Vec::new(),
        watch_to_kernel: Vec::new(),
        watch_to_received: Vec::new(),
        received_to_kernel: Vec::new(),
    };
    for (svc, sent, acked) in writes {
        let Some(w) = seen
            .get(svc.as_str())
            .and_then(|v| v.iter().copied().filter(|x| x >= sent).min())
        else {
            continue;
        };
        d.ack_to_watch.push(ms(*acked, w));
        if let Some((k, state)) = first_commit(&commits, svc, *sent) {
            d.watch_to_kernel.push(ms(w, k));
            if let Some(st) = state {
                d.watch_to_received.push(ms(w, st));
                d.received_to_kernel.push(ms(st, k));
            }
        }
    }
    for v in [
        &mut d.ack_to_watch,
        &mut d.watch_to_kernel,
        &mut d.watch_to_received,
        &mut d.received_to_kernel,
    ] {
        v.sort_by(f64::total_cmp);
    }
    d
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut kubeconfig = None;
    let mut proxy_kubeconfig = None;
    let mut runs = 3;
    let mut skip_populate = false;
    let mut churn_secs = 0;
    let mut rate = 100;
    let mut extra = Vec::new();
    let mut upstream = None;
    let mut scale = None;
    let mut restart = false;
    let mut flips = 0;
    let mut flip_every = Duration::from_millis(300);
    let mut flip_churn = 0;
    let mut flip_local = 0;
    let mut compare_upstream = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--kubeconfig" => kubeconfig = args.next().map(PathBuf::from),
            "--proxy-kubeconfig" => proxy_kubeconfig = args.next().map(PathBuf::from),
            "--runs" => runs = args.next().and_then(|r| r.parse().ok()).expect("--runs N"),
            "--skip-populate" => skip_populate = true,
            "--restart" => restart = true,
            "--churn" => {
                churn_secs = args
                    .next()
                    .and_then(|r| r.parse().ok())
                    .expect("--churn SECONDS")
            }
            "--kproxy-arg" => extra.extend(args.next()),
            "--upstream" => upstream = args.next().map(PathBuf::from),
            "--compare-upstream" => compare_upstream = args.next().map(PathBuf::from),
            "--flips" => flips = args.next().and_then(|r| r.parse().ok()).expect("--flips N"),
            "--flip-every-ms" => {
                flip_every = args
                    .next()
                    .and_then(|r| r.parse().ok())
                    .map(Duration::from_millis)
                    .expect("--flip-every-ms MS")
            }
            "--flip-local-count" => {
                flip_local = args
                    .next()
                    .and_then(|r| r.parse().ok())
                    .expect("--flip-local-count N")
            }
            "--flip-churn" => {
                flip_churn = args
                    .next()
                    .and_then(|r| r.parse().ok())
                    .expect("--flip-churn PER_SECOND")
            }
            "--rate" => {
                rate = args
                    .next()
                    .and_then(|r| r.parse().ok())
                    .expect("--rate PER_SECOND")
            }
            s => scale = Some(s.to_string()),
        }
    }
    let (Some(kubeconfig), Some(proxy_kubeconfig), Some(scale)) =
        (kubeconfig, proxy_kubeconfig, scale)
    else {
        eprintln!(
            "usage: api_bench --kubeconfig ADMIN --proxy-kubeconfig PROXY NxE [--runs R] [--skip-populate] [--churn S] [--rate R] [--kproxy-arg ARG]... [--upstream KUBE_PROXY | --compare-upstream KUBE_PROXY] [--restart] [--flips N [--flip-every-ms MS] [--flip-churn PER_SECOND]] [--flip-local-count N [--flip-every-ms MS]]"
        );
        std::process::exit(2);
    };
    let (services, eps) = scale
        .split_once('x')
        .and_then(|(s, e)| Some((s.parse::<usize>().ok()?, e.parse::<usize>().ok()?)))
        .expect("scale as SERVICESxENDPOINTS, e.g. 10000x10");
    if !skip_populate {
        populate(&kubeconfig, services, eps);
    }

    let name = format!("apb-{}", std::process::id());
    let ns = Netns::new(name.clone());
    let exec = |args: &[&str]| ns.exec(args);
    ns.probe_veth("apb", PROBE_POD_IP, "10.96.0.0/16");

    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().to_path_buf();
    // API_BENCH_KEEP=1 keeps the event logs and the proxies' logs for a closer look.
    let _tmp = if std::env::var_os("API_BENCH_KEEP").is_some() {
        eprintln!("keeping the logs in {}", tmp.keep().display());
        None
    } else {
        Some(tmp)
    };
    let port = api_port(&proxy_kubeconfig);
    let sock = dir.as_path().join("api.sock");
    // TCP_NODELAY on both TCP sides: with Nagle, socat's small writes of watch events
    // waited for the peer's delayed ACK (40 ms on loopback), which showed as a p99 of
    // ≈ 37 ms between the API's delivery and kproxy's state.
    let _host_side = Proc(
        Command::new("socat")
            .arg(format!("UNIX-LISTEN:{},fork,unlink-early", sock.display()))
            .arg(format!("TCP:127.0.0.1:{port},nodelay"))
            .spawn()
            .expect("socat (apt-get install socat)"),
    );
    let _ns_side = Proc(
        Command::new("ip")
            .args(["netns", "exec", &name, "socat"])
            .arg(format!(
                "TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr,nodelay"
            ))
            .arg(format!("UNIX-CONNECT:{}", sock.display()))
            .spawn()
            .expect("socat in the namespace"),
    );
    exec(&[
        "ip",
        "addr",
        "add",
        &format!("{PROBE_POD_IP_B}/24"),
        "dev",
        "apb1",
    ]);
    for (ip, byte) in PROBE_ANSWERS {
        let ns_name = name.clone();
        std::thread::spawn(move || {
            Netns::enter(&ns_name);
            let l = TcpListener::bind((ip, 8080)).expect("bind probe listener");
            for mut c in l.incoming().flatten() {
                let _ = std::io::Write::write_all(&mut c, &[byte]);
            }
        });
    }
    std::thread::sleep(Duration::from_millis(300));

    let proxies: Vec<Option<PathBuf>> = match compare_upstream {
        Some(b) => vec![None, Some(b)],
        None => vec![upstream],
    };
    let mut flipped = Vec::new();
    let (mut local_all, mut local_first) = (Vec::new(), Vec::new());
    for upstream in &proxies {
        let upstream = upstream.as_deref();
        for run in 0..runs {
            exec(&["nft", "flush", "ruleset"]);
            if flip_local > 0 && upstream.is_none() {
                local_probe_reset(&kubeconfig);
            }
            let (r, daemon) = measure(
                &proxy_kubeconfig,
                &extra,
                upstream,
                &name,
                dir.as_path(),
                run,
            );
            let mib = |k: u64| k as f64 / 1024.0;
            let who = if upstream.is_some() {
                "upstream kube-proxy"
            } else {
                "kproxy"
            };
            println!(
                "{who} {services}x{eps} run {run}: start → first sync {:.2} s, → first connection through a cluster IP {:.2} s | RSS after the first sync {:.1} MiB, settled (5 s) {:.1} MiB, peak (VmHWM) {:.1} MiB | kernel slab +{:.1} MiB ({:.0} bytes per endpoint)",
                r.first_sync.as_secs_f64(),
                r.first_connect.as_secs_f64(),
                mib(r.rss_sync),
                mib(r.rss_settled),
                mib(r.hwm),
                r.slab_kib as f64 / 1024.0,
                r.slab_kib as f64 * 1024.0 / (services * eps).max(1) as f64
            );
            if upstream.is_none() {
                println!("    {}", r.timeline);
                let detail = serde_json::from_str::<Value>(&r.sync_event)
                    .map(|e| format!("{} ms, {}", e["elapsed_ms"], e["detail"]))
                    .unwrap_or_default();
                println!("    the first sync (plan + nft): {detail}");
                println!(
                    "    CPU from start to the first sync: kproxy {:.2} s, API server {}",
                    r.cpu_s,
                    r.api_cpu_s.map_or("–".into(), |c| format!("{c:.2} s"))
                );
            }
            if flip_local > 0 && upstream.is_none() {
                let (l, first) = local_count_probe(
                    &kubeconfig,
                    &dir.as_path().join(format!("events-{run}.jsonl")),
                    flip_local,
                    flip_every,
                );
                println!(
                    "kproxy iTP=Local probe run {run}: first change after start: acknowledged → kernel {:?} ms; its sync: {}",
                    l.first().copied().flatten(),
                    first.as_deref().unwrap_or("none")
                );
                println!("    {}", local_count_summary(&l));
                local_first.push(l.first().copied().flatten());
                local_all.extend(l);
            }
            if run + 1 == runs && churn_secs > 0 && upstream.is_none() {
                churn(
                    &kubeconfig,
                    &name,
                    daemon.0.id(),
                    &dir.as_path().join(format!("events-{run}.jsonl")),
                    services,
                    eps,
                    churn_secs,
                    rate,
                );
            }
            let mut daemon = daemon;
            if run + 1 == runs && restart && upstream.is_none() {
                for (i, signal) in ["TERM", "KILL"].into_iter().enumerate() {
                    daemon = restart_once(
                        &proxy_kubeconfig,
                        &extra,
                        &name,
                        dir.as_path(),
                        daemon,
                        signal,
                        runs + i,
                    );
                }
            }
            if run + 1 == runs && flips > 0 {
                let who = if upstream.is_some() {
                    "upstream kube-proxy"
                } else {
                    "kproxy"
                };
                let l = flip_probe(
                    &kubeconfig,
                    &name,
                    flips,
                    flip_every,
                    flip_churn,
                    services,
                    eps,
                );
                println!("{who} flip probe: {}", flip_summary(&l));
                flipped.push((who, l));
            }
            drop(daemon);
        }
    }
    if runs > 1 && flip_local > 0 {
        println!(
            "iTP=Local probe, {services}x{eps}, {runs} runs of a fresh kproxy, pooled: {}",
            local_count_summary(&local_all)
        );
        println!(
            "    of which the first change after start: {}",
            latency_summary(
                &local_first,
                "first changes, {missed} not held within 10 s; acknowledged → kernel"
            )
        );
    }
    if flipped.len() > 1 {
        println!(
            "flip probe, {services}x{eps}, a flip every {} ms after the last was seen, {flip_churn} other changes/s:",
            flip_every.as_millis()
        );
        for (who, l) in &flipped {
            println!("  {who:>20}: {}", flip_summary(l));
        }
    }
    exec(&["nft", "flush", "ruleset"]);
}

/// New connections through the probe's cluster IP, opened one after another from
/// inside the namespace until stopped: (succeeded, failed).
struct Client {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<(u64, u64)>,
}

impl Client {
    fn start(ns: &str) -> Client {
        use std::sync::atomic::Ordering;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let ns = ns.to_string();
        let thread = std::thread::spawn(move || {
            Netns::enter(&ns);
            let dst: SocketAddr = format!("{PROBE_CLUSTER_IP}:80").parse().expect("addr");
            let t0 = Instant::now();
            let (mut ok, mut failed) = (0, 0);
            while !flag.load(Ordering::Relaxed) {
                match TcpStream::connect_timeout(&dst, Duration::from_millis(200)) {
                    Ok(_) => ok += 1,
                    Err(e) => {
                        failed += 1;
                        if failed <= 5 {
                            eprintln!(
                                "    failed connection {:.3} s after the client started: {e}",
                                t0.elapsed().as_secs_f64()
                            );
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            (ok, failed)
        });
        Client { stop, thread }
    }

    fn finish(self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("client thread")
    }
}

/// Stops `old` with `signal` and starts a new kproxy at once into the tables it left;
/// prints what the client saw. Returns the new process.
fn restart_once(
    proxy_kubeconfig: &Path,
    extra: &[String],
    ns: &str,
    dir: &Path,
    mut old: Proc,
    signal: &str,
    run: usize,
) -> Proc {
    let client = Client::start(ns);
    std::thread::sleep(Duration::from_millis(500));
    eprintln!("    SIG{signal} 0.5 s after the client started");
    let t = Instant::now();
    sh(&["kill", &format!("-{signal}"), &old.0.id().to_string()]);
    let _ = old.0.wait();
    let stopped = t.elapsed();
    let (r, new) = measure(proxy_kubeconfig, extra, None, ns, dir, run);
    let (ok, failed) = client.finish();
    let detail = serde_json::from_str::<Value>(&r.sync_event)
        .map(|e| e["detail"].to_string())
        .unwrap_or_default();
    println!(
        "kproxy restart by SIG{signal}: old process gone in {:.0} ms; new process start → first sync {:.2} s ({detail}); peak (VmHWM) {:.1} MiB | new connections from the signal to 5 s after that sync: {ok} succeeded, {failed} failed",
        stopped.as_secs_f64() * 1000.0,
        r.first_sync.as_secs_f64(),
        r.hwm as f64 / 1024.0,
    );
    new
}
