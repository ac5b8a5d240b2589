//! What N node proxies cost one real API server (issue 38, docs/scale.md): N simulated
//! kproxy nodes, each kproxy's real API source (its own client, connections and
//! reflectors; lists, watches, fold, state) and planner, in one process; the kernel left
//! out. With `--compare KUBE_PROXY`, the same for N upstream kube-proxy processes, each
//! in a network namespace of its own (its own nftables rules) behind a socat bridge.
//!
//! ```text
//! K8S_LAB=$FLEET_LAB API_PORT=6643 ETCD_PORT=2579 KCM_PORT=10357 start.sh start
//! cargo run -p kproxy-source --example fleet -- --lab $FLEET_LAB \
//!   --nodes 50 --services 1000 --endpoints 10 [--flips 20] [--restart] \
//!   [--json-watches] [--no-client-retry] \
//!   [--compare $FLEET_LAB/bin/kube-proxy --compare-nodes 20]
//! ```
//!
//! `--no-client-retry` builds the nodes' clients as `kproxy run` builds its own
//! (`kube::client_from`: no kube retry layer, TCP keepalive): the refusal reaches the
//! reflector, which waits `Retry-After` × [1, 2) capped at 60 s. Without it the nodes
//! keep kube's retry layer (which sleeps exactly the `Retry-After` of a 429, up to 15
//! times), as kproxy did before (docs/scale.md, "429s after a restart").
//!
//! Per column it prints: the time until every node's first sync; per change of the
//! probe EndpointSlice (100 endpoints, one endpoint's readiness flipped, `--flips`
//! times): the bytes the API server encoded per node (`apiserver_watch_events_sizes`,
//! the body bytes of the watch events) and the bytes the nodes' sockets received (TLS
//! and HTTP included, `ss`), and the API server's CPU seconds; its RSS. With
//! `--restart` (kproxy column): the API server is killed (SIGKILL) and started again
//! while the nodes watch; it prints the time from its `/readyz` to every node holding a
//! change written right after, the requests by verb and code since its start (its
//! `/metrics`), its peak RSS, and how many nodes' plans changed during the outage (must
//! be 0: static stability).
//!
//! The objects (namespace `fleet`, Services `s-0…`, one EndpointSlice each, `probe`
//! with 100 endpoints) are created once; existing ones are kept. Root (namespaces,
//! nft) only for `--compare`.

#![expect(
    clippy::disallowed_types,
    reason = "a bench of a real API server: wall time"
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kproxy_core::PlanConfig;
use kproxy_core::ingest::Ownership;
use kproxy_core::planner::Planner;
use kproxy_source::kube::{self as source, KubeSourceConfig};
use serde_json::{Value, json};

const NAMESPACE: &str = "fleet";
const PROBE: &str = "probe";
const PROBE_ENDPOINTS: usize = 100;

struct Args {
    lab: PathBuf,
    nodes: usize,
    services: usize,
    endpoints: usize,
    flips: usize,
    restart: bool,
    json_watches: bool,
    /// Build each node's client without kube's retry layer (`Config::default_retry`):
    /// a 429 then reaches the reflector, which waits `Retry-After` × [1, 2).
    no_client_retry: bool,
    compare: Option<PathBuf>,
    compare_nodes: Option<usize>,
}

const USAGE: &str = "usage: fleet --lab K8S_LAB [--nodes N] [--services S] [--endpoints E] [--flips F] [--restart] [--json-watches] [--no-client-retry] [--compare KUBE_PROXY [--compare-nodes N]]
  (a running k8s-lab instance: --lab DIR, or K8S_LAB; docs/scale.md says how to start one)";

/// The command line, or what is wrong with it. `--help` is `Ok(None)`.
fn parse_args(argv: impl IntoIterator<Item = String>) -> Result<Option<Args>, String> {
    let mut a = Args {
        lab: PathBuf::from(std::env::var("K8S_LAB").unwrap_or_default()),
        nodes: 10,
        services: 1000,
        endpoints: 10,
        flips: 20,
        restart: false,
        json_watches: false,
        no_client_retry: false,
        compare: None,
        compare_nodes: None,
    };
    let mut it = argv.into_iter();
    let num = |v: Option<String>, what: &str| -> Result<usize, String> {
        v.and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("{what} takes a number"))
    };
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--lab" => a.lab = PathBuf::from(it.next().ok_or("--lab takes a directory")?),
            "--nodes" => a.nodes = num(it.next(), "--nodes")?,
            "--services" => a.services = num(it.next(), "--services")?,
            "--endpoints" => a.endpoints = num(it.next(), "--endpoints")?,
            "--flips" => a.flips = num(it.next(), "--flips")?,
            "--restart" => a.restart = true,
            "--json-watches" => a.json_watches = true,
            "--no-client-retry" => a.no_client_retry = true,
            "--compare" => {
                a.compare = Some(PathBuf::from(
                    it.next().ok_or("--compare takes kube-proxy's path")?,
                ))
            }
            "--compare-nodes" => a.compare_nodes = Some(num(it.next(), "--compare-nodes")?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !a.lab.join("kubeconfig").exists() {
        return Err(format!(
            "--lab (or K8S_LAB) must name a k8s-lab directory holding a kubeconfig; {:?} does not",
            a.lab
        ));
    }
    Ok(Some(a))
}

/// The command line: usage on `--help` (exit 0) or on a mistake (exit 2), never a panic.
fn args() -> Args {
    match parse_args(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            std::process::exit(0)
        }
        Err(e) => {
            eprintln!("fleet: {e}\n{USAGE}");
            std::process::exit(2)
        }
    }
}

/// The k8s-lab instance: its kubeconfigs, port and API server process.
struct Lab {
    dir: PathBuf,
    port: u16,
}

impl Lab {
    fn admin(&self) -> PathBuf {
        self.dir.join("kubeconfig")
    }
    fn proxy(&self) -> PathBuf {
        self.dir.join("kubeconfig-proxy")
    }
    fn apiserver_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("run/kube-apiserver.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }
    /// utime + stime of the API server, in seconds.
    fn apiserver_cpu(&self) -> f64 {
        let pid = self.apiserver_pid().expect("the API server's pid file");
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("its /proc stat");
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .expect("a stat line")
            .1
            .split_whitespace()
            .collect();
        let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
        ticks / 100.0
    }
    /// (VmRSS, VmHWM) of the API server in MiB.
    fn apiserver_rss(&self) -> (f64, f64) {
        let pid = self.apiserver_pid().expect("the API server's pid file");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let kib = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        (kib("VmRSS:") / 1024.0, kib("VmHWM:") / 1024.0)
    }
    fn kubectl(&self, args: &[&str]) -> String {
        kproxy_test_support::run(
            Command::new("kubectl")
                .arg(format!("--kubeconfig={}", self.admin().display()))
                .args(args),
        )
    }
    /// The API server's /metrics, as admin.
    fn metrics(&self) -> String {
        self.kubectl(&["get", "--raw", "/metrics"])
    }
    fn ready(&self) -> bool {
        Command::new("kubectl")
            .arg(format!("--kubeconfig={}", self.admin().display()))
            .args(["get", "--raw", "/readyz"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

/// The sum of a metric's samples whose labels contain all of `labels`.
fn metric_sum(metrics: &str, name: &str, labels: &[&str]) -> f64 {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// Bytes received by the established TCP connections to the API server's port owned
/// by processes named `owner` (and, with `pid`, that process).
fn socket_bytes(port: u16, owner: &str, pid: Option<u32>) -> u64 {
    let out = Command::new("ss")
        .args(["-tinpH", "state", "established"])
        .arg(format!("( dport = :{port} )"))
        .output()
        .expect("ss (iproute2)");
    let text = String::from_utf8_lossy(&out.stdout);
    // ss prints each socket on a line, its counters on the next.
    let lines: Vec<&str> = text.lines().collect();
    let mut total = 0;
    for (i, line) in lines.iter().enumerate() {
        let owned = line.contains(&format!("((\"{owner}\""))
            && pid.is_none_or(|p| line.contains(&format!("pid={p},")));
        if !owned {
            continue;
        }
        let counters = lines.get(i + 1).copied().unwrap_or("");
        for field in line.split_whitespace().chain(counters.split_whitespace()) {
            if let Some(v) = field.strip_prefix("bytes_received:") {
                total += v.parse::<u64>().unwrap_or(0);
            }
        }
    }
    total
}

fn service(name: &str, port: u16) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"selector": {"app": name}, "ports": [{"name": "http", "port": port, "targetPort": 8080}]}})
}

fn slice(name: &str, endpoints: usize, base: u32, first_ready: bool) -> Value {
    let endpoints: Vec<Value> = (0..endpoints)
        .map(|i| {
            let ip = std::net::Ipv4Addr::from(base + i as u32);
            let ready = i != 0 || first_ready;
            json!({"addresses": [ip.to_string()],
                   "conditions": {"ready": ready, "serving": ready, "terminating": false},
                   "nodeName": format!("pod-node-{}", i % 100)})
        })
        .collect();
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-a"), "namespace": NAMESPACE,
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]})
}

/// Creates the namespace, `services` Services with one slice of `endpoints` each, and
/// the probe; objects already there are kept.
async fn populate(lab: &Lab, services: usize, endpoints: usize) {
    let client = source::client(Some(&lab.admin()))
        .await
        .expect("admin client");
    let post = |url: String, body: Value| {
        let client = client.clone();
        async move {
            let req = http::Request::post(url)
                .header("content-type", "application/json")
                .body(body.to_string().into_bytes())
                .expect("a request");
            match client.request_text(req).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => panic!("creating an object: {e}"),
            }
        }
    };
    post(
        "/api/v1/namespaces".into(),
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}),
    )
    .await;
    let existing = client
        .request_text(
            http::Request::get(format!(
                "/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices?limit=1"
            ))
            .body(Vec::new())
            .expect("a request"),
        )
        .await
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v["metadata"]["remainingItemCount"].as_u64())
        .unwrap_or(0) as usize;
    let t0 = Instant::now();
    let objects = (0..services)
        .skip(existing.saturating_sub(1))
        .flat_map(|i| {
            let name = format!("s-{i}");
            // 10.128.0.0/9: room for 8M endpoint addresses.
            let base = u32::from(std::net::Ipv4Addr::new(10, 128, 0, 1)) + (i * endpoints) as u32;
            [
                (
                    format!("/api/v1/namespaces/{NAMESPACE}/services"),
                    service(&name, 80),
                ),
                (
                    format!("/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"),
                    slice(&name, endpoints, base, true),
                ),
            ]
        });
    futures::stream::iter(objects)
        .map(|(url, body)| post(url, body))
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    post(
        format!("/api/v1/namespaces/{NAMESPACE}/services"),
        service(PROBE, 80),
    )
    .await;
    let base = u32::from(std::net::Ipv4Addr::new(10, 127, 0, 1));
    post(
        format!("/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"),
        slice(PROBE, PROBE_ENDPOINTS, base, true),
    )
    .await;
    eprintln!(
        "populated {services} Services × {endpoints} endpoints (+ the probe) in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
}

/// Flips the readiness of the probe's first endpoint (a JSON patch of one condition).
fn flip(lab: &Lab, ready: bool) {
    let patch = format!(
        r#"[{{"op":"replace","path":"/endpoints/0/conditions/ready","value":{ready}}},{{"op":"replace","path":"/endpoints/0/conditions/serving","value":{ready}}}]"#
    );
    lab.kubectl(&[
        "-n",
        NAMESPACE,
        "patch",
        "endpointslice",
        &format!("{PROBE}-a"),
        "--type=json",
        "-p",
        &patch,
    ]);
}

/// One simulated node: its plan's changes as counters the driver reads.
#[derive(Default)]
struct NodeView {
    ready: AtomicBool,
    /// Plan updates that changed the probe's plan.
    probe_changes: AtomicU64,
    /// Plan updates that changed anything.
    plan_changes: AtomicU64,
}

async fn node(
    lab_proxy: PathBuf,
    name: String,
    json_watches: bool,
    no_client_retry: bool,
    view: Arc<NodeView>,
) -> anyhow_free::Result {
    let credentials = source::Credentials::file(&lab_proxy, "--lab");
    let mut config = source::client_config(
        &credentials,
        None,
        Some(source::bounded::DEFAULT_CONNECT_TIMEOUT),
    )
    .await
    .map_err(|e| e.to_string())?;
    // kproxy's own client (`kube::client_from`: no retry layer, TCP keepalive); with
    // kube's retry layer only for the comparison runs of docs/scale.md that had it.
    let client = if no_client_retry {
        source::client_from(config).map_err(|e| e.to_string())?
    } else {
        config.default_retry = true;
        kube::Client::try_from(config).map_err(|e| e.to_string())?
    };
    let (writer, mut reader) = kproxy_source::store();
    let cfg = KubeSourceConfig {
        node_name: name.clone(),
        ownership: Ownership::default(),
        page_size: None,
        json_lists: json_watches,
        watch_idle: None,
    };
    let source = tokio::spawn(source::run(client, cfg, writer));
    let mut planner = Planner::new(name, PlanConfig::default());
    let probe = kproxy_core::model::ServiceName::new(NAMESPACE, PROBE);
    loop {
        let status = reader.changed().await;
        if source.is_finished() {
            return Err("the source ended".into());
        }
        if !status.ready {
            continue;
        }
        let update = reader.take(|st, changes, _| planner.apply(st, changes));
        if !update.is_empty() {
            view.plan_changes.fetch_add(1, Ordering::SeqCst);
        }
        if update.services.contains(&probe) {
            view.probe_changes.fetch_add(1, Ordering::SeqCst);
        }
        view.ready.store(true, Ordering::SeqCst);
    }
}

/// Errors as text: the example has no error type of its own.
mod anyhow_free {
    pub type Result = std::result::Result<(), String>;
}

/// Waits until `done` holds, polling every 10 ms; panics after `limit`.
fn wait(limit: Duration, what: &str, done: impl Fn() -> bool) -> Duration {
    wait_every(limit, Duration::from_millis(10), what, done)
}

fn wait_every(limit: Duration, every: Duration, what: &str, done: impl Fn() -> bool) -> Duration {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(every);
    }
    t0.elapsed()
}

/// What one column measured.
#[derive(Default)]
struct Column {
    name: String,
    nodes: usize,
    first_sync_s: Option<f64>,
    event_bytes_per_node: f64,
    socket_bytes_per_node: f64,
    cpu_s_per_change: f64,
    rss_mib: f64,
    restart: Option<Restart>,
}

struct Restart {
    ready_to_synced_s: f64,
    requests: BTreeMap<String, f64>,
    peak_rss_mib: f64,
    plans_changed: u64,
}

fn slice_event_bytes(m: &str) -> f64 {
    metric_sum(
        m,
        "apiserver_watch_events_sizes_sum",
        &[r#"resource="endpointslices""#],
    )
}

/// The watch event bytes per flip that go to the API server's own watchers (its
/// informers watch EndpointSlices too), measured before the nodes start: subtracted
/// from the fleet's.
fn baseline_flip_bytes(lab: &Lab) -> f64 {
    let m0 = lab.metrics();
    for ready in [false, true] {
        flip(lab, ready);
        std::thread::sleep(Duration::from_millis(500));
    }
    (slice_event_bytes(&lab.metrics()) - slice_event_bytes(&m0)) / 2.0
}

/// Flips the probe `flips` times, each after every node saw the last (`seen(k)`: all
/// nodes hold flip k), and measures the API server's side per change.
fn measure_flips(
    lab: &Lab,
    flips: usize,
    nodes: usize,
    owner: (&str, Option<u32>),
    baseline: f64,
    poll: Duration,
    seen: impl Fn(u64) -> bool,
) -> (f64, f64, f64) {
    // The API server's CPU while the fleet watches and nothing changes: subtracted at
    // its rate over the flips' wall time, which differs between the columns.
    let idle0 = lab.apiserver_cpu();
    std::thread::sleep(Duration::from_secs(10));
    let idle_rate = (lab.apiserver_cpu() - idle0) / 10.0;
    let m0 = lab.metrics();
    let b0 = socket_bytes(lab.port, owner.0, owner.1);
    let c0 = lab.apiserver_cpu();
    let t0 = Instant::now();
    for k in 1..=flips {
        flip(lab, k % 2 == 0);
        wait_every(
            Duration::from_secs(120),
            poll,
            "every node sees the flip",
            || seen(k as u64),
        );
    }
    let c1 = lab.apiserver_cpu() - idle_rate * t0.elapsed().as_secs_f64();
    eprintln!(
        "API server CPU: {:.1} ms/s idle, {:.2} s in {:.1} s of flips",
        idle_rate * 1000.0,
        c1 - c0,
        t0.elapsed().as_secs_f64()
    );
    let b1 = socket_bytes(lab.port, owner.0, owner.1);
    let m1 = lab.metrics();
    let per = (flips * nodes) as f64;
    (
        (slice_event_bytes(&m1) - slice_event_bytes(&m0) - baseline * flips as f64) / per,
        (b1 - b0) as f64 / per,
        (c1 - c0) / flips as f64,
    )
}

fn kproxy_column(lab: &Lab, a: &Args, runtime: &tokio::runtime::Runtime) -> Column {
    let name = if a.json_watches {
        "kproxy (JSON lists and watches)"
    } else {
        "kproxy"
    };
    let views: Vec<Arc<NodeView>> = (0..a.nodes).map(|_| Arc::default()).collect();
    let baseline = baseline_flip_bytes(lab);
    let tasks: Vec<_> = views
        .iter()
        .enumerate()
        .map(|(i, v)| {
            runtime.spawn(node(
                lab.proxy(),
                format!("fleet-node-{i}"),
                a.json_watches,
                a.no_client_retry,
                v.clone(),
            ))
        })
        .collect();
    let all = |f: &dyn Fn(&NodeView) -> bool| views.iter().all(|v| f(v));
    let first = wait(Duration::from_secs(600), "every node's first sync", || {
        all(&|v| v.ready.load(Ordering::SeqCst))
    });
    eprintln!(
        "{name}: {} nodes synced in {:.2} s",
        a.nodes,
        first.as_secs_f64()
    );
    std::thread::sleep(Duration::from_secs(2));
    let base: Vec<u64> = views
        .iter()
        .map(|v| v.probe_changes.load(Ordering::SeqCst))
        .collect();
    let seen = |k: u64| {
        views
            .iter()
            .zip(&base)
            .all(|(v, b)| v.probe_changes.load(Ordering::SeqCst) >= b + k)
    };
    let (event_bytes, socket_bytes, cpu) = measure_flips(
        lab,
        a.flips,
        a.nodes,
        ("fleet", Some(std::process::id())),
        baseline,
        Duration::from_millis(10),
        seen,
    );
    let rss = lab.apiserver_rss().0;
    let restart = a.restart.then(|| restart(lab, &views));
    for t in tasks {
        t.abort();
    }
    Column {
        name: name.into(),
        nodes: a.nodes,
        first_sync_s: Some(first.as_secs_f64()),
        event_bytes_per_node: event_bytes,
        socket_bytes_per_node: socket_bytes,
        cpu_s_per_change: cpu,
        rss_mib: rss,
        restart,
    }
}

/// Kills the API server (SIGKILL), starts it again with the lab's start.sh, and
/// measures the fleet's way back.
fn restart(lab: &Lab, views: &[Arc<NodeView>]) -> Restart {
    let before: Vec<u64> = views
        .iter()
        .map(|v| v.plan_changes.load(Ordering::SeqCst))
        .collect();
    let pid = lab.apiserver_pid().expect("the API server's pid");
    let killed = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(killed, "kill -KILL {pid} (the lab's API server)");
    std::thread::sleep(Duration::from_secs(5));
    // The team's shared folder sits beside the repository (README, "The tests");
    // `KPROXY_SHARED` names another, as for `.ci/run`.
    let shared = std::env::var("KPROXY_SHARED")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared").to_string());
    let started = Command::new(format!("{shared}/tools/k8s-lab/start.sh"))
        .arg("start")
        .env("K8S_LAB", &lab.dir)
        .env("API_PORT", lab.port.to_string())
        .envs(std::env::vars().filter(|(k, _)| k == "ETCD_PORT" || k == "KCM_PORT"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("start.sh");
    assert!(started.success(), "start.sh start failed");
    wait(Duration::from_secs(120), "/readyz", || lab.ready());
    let ready_at = Instant::now();
    // During the outage and the relists after it, no node's plan may change.
    let changed_in_outage = views
        .iter()
        .zip(&before)
        .filter(|(v, b)| v.plan_changes.load(Ordering::SeqCst) != **b)
        .count() as u64;
    let marks: Vec<u64> = views
        .iter()
        .map(|v| v.probe_changes.load(Ordering::SeqCst))
        .collect();
    // A change written at once: every node holds it when its watches are back.
    let was_ready = lab
        .kubectl(&[
            "-n",
            NAMESPACE,
            "get",
            "endpointslice",
            &format!("{PROBE}-a"),
            "-o",
            "jsonpath={.endpoints[0].conditions.ready}",
        ])
        .trim()
        == "true";
    flip(lab, !was_ready);
    wait(
        Duration::from_secs(300),
        "every node back after the restart",
        || {
            views
                .iter()
                .zip(&marks)
                .all(|(v, m)| v.probe_changes.load(Ordering::SeqCst) > *m)
        },
    );
    let synced = ready_at.elapsed().as_secs_f64();
    let plans_changed = changed_in_outage
        + views
            .iter()
            .zip(&before)
            .filter(|(v, b)| v.plan_changes.load(Ordering::SeqCst) > **b + 1)
            .count() as u64;
    std::thread::sleep(Duration::from_secs(3));
    let m = lab.metrics();
    let mut requests = BTreeMap::new();
    for line in m
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let label = |k: &str| {
            line.split_once(&format!("{k}=\""))
                .and_then(|(_, r)| r.split_once('"'))
                .map(|(v, _)| v.to_string())
                .unwrap_or_default()
        };
        let resource = label("resource");
        if !["services", "endpointslices", "nodes", "servicecidrs"].contains(&resource.as_str()) {
            continue;
        }
        let v: f64 = line
            .rsplit_once(' ')
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0.0);
        *requests
            .entry(format!("{} {} {}", label("verb"), resource, label("code")))
            .or_insert(0.0) += v;
    }
    for line in m.lines().filter(|l| {
        l.starts_with("apiserver_longrunning_requests{") && l.contains("verb=\"WATCH\"")
    }) {
        let resource = line
            .split_once("resource=\"")
            .and_then(|(_, r)| r.split_once('"'))
            .map(|(v, _)| v.to_string())
            .unwrap_or_default();
        if ["services", "endpointslices", "nodes", "servicecidrs"].contains(&resource.as_str()) {
            let v: f64 = line
                .rsplit_once(' ')
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or(0.0);
            *requests
                .entry(format!("open WATCH {resource}"))
                .or_insert(0.0) += v;
        }
    }
    Restart {
        ready_to_synced_s: synced,
        requests,
        peak_rss_mib: lab.apiserver_rss().1,
        plans_changed,
    }
}

/// N upstream kube-proxies, each in a network namespace of its own behind socat.
fn kube_proxy_column(lab: &Lab, binary: &Path, nodes: usize, flips: usize) -> Column {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock = dir.path().join("api.sock");
    let baseline = baseline_flip_bytes(lab);
    let mut procs = Vec::new();
    procs.push(
        Command::new("socat")
            .arg(format!("UNIX-LISTEN:{},fork,unlink-early", sock.display()))
            .arg(format!("TCP:127.0.0.1:{},nodelay", lab.port))
            .spawn()
            .expect("socat"),
    );
    let namespaces: Vec<String> = (0..nodes)
        .map(|i| format!("fleet-kp-{}-{i}", std::process::id()))
        .collect();
    for (i, ns) in namespaces.iter().enumerate() {
        let ok = Command::new("ip")
            .args(["netns", "add", ns])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "ip netns add {ns}");
        let _ = Command::new("ip")
            .args(["netns", "exec", ns, "ip", "link", "set", "lo", "up"])
            .status();
        procs.push(
            Command::new("ip")
                .args(["netns", "exec", ns, "socat"])
                .arg(format!(
                    "TCP-LISTEN:{},bind=127.0.0.1,fork,reuseaddr,nodelay",
                    lab.port
                ))
                .arg(format!("UNIX-CONNECT:{}", sock.display()))
                .spawn()
                .expect("socat in the namespace"),
        );
        let log = std::fs::File::create(dir.path().join(format!("kube-proxy-{i}.log"))).unwrap();
        procs.push(
            Command::new("ip")
                .args(["netns", "exec", ns])
                .arg(binary)
                .arg(format!("--kubeconfig={}", lab.proxy().display()))
                .args([
                    "--proxy-mode=nftables",
                    &format!("--hostname-override=fleet-kp-{i}"),
                    "--bind-address=127.0.0.1",
                    "--metrics-bind-address=127.0.0.1:10249",
                    "--healthz-bind-address=127.0.0.1:10256",
                    "--conntrack-max-per-core=0",
                    "--conntrack-tcp-timeout-established=0",
                    "--conntrack-tcp-timeout-close-wait=0",
                    "--v=1",
                ])
                .stderr(log)
                .spawn()
                .expect("kube-proxy"),
        );
    }
    // Each kube-proxy's own metrics (in its namespace): its first sync, and the
    // EndpointSlice changes it took in.
    let metric = |ns: &str, name: &str| -> Option<f64> {
        let out = Command::new("ip")
            .args(["netns", "exec", ns, "curl", "-s", "--max-time", "2"])
            .arg("http://127.0.0.1:10249/metrics")
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .any(|l| l.starts_with(name))
            .then(|| metric_sum(&text, name, &[]))
    };
    let first = wait_every(
        Duration::from_secs(900),
        Duration::from_millis(500),
        "every kube-proxy's first sync",
        || {
            namespaces.iter().all(|ns| {
                metric(ns, "kubeproxy_sync_proxy_rules_last_timestamp_seconds")
                    .is_some_and(|t| t > 0.0)
            })
        },
    );
    eprintln!(
        "kube-proxy: {nodes} nodes synced in {:.2} s",
        first.as_secs_f64()
    );
    let changes = || -> Vec<f64> {
        namespaces
            .iter()
            .map(|ns| {
                metric(ns, "kubeproxy_sync_proxy_rules_endpoint_changes_total").unwrap_or(0.0)
            })
            .collect()
    };
    std::thread::sleep(Duration::from_secs(2));
    let base = changes();
    std::thread::sleep(Duration::from_secs(2));
    let (event_bytes, socket_bytes, cpu) =
        // Polling 50 namespaces' metrics after every flip loads the machine: each flip
        // gets 1 s, and every kube-proxy must have taken in all of them at the end.
        measure_flips(lab, flips, nodes, ("socat", None), baseline, Duration::from_millis(500), |k| {
            if (k as usize) < flips {
                std::thread::sleep(Duration::from_secs(1));
                return true;
            }
            changes().iter().zip(&base).all(|(c, b)| *c >= b + k as f64)
        });
    let rss = lab.apiserver_rss().0;
    for mut p in procs.into_iter().rev() {
        let _ = p.kill();
        let _ = p.wait();
    }
    for ns in &namespaces {
        let _ = Command::new("ip").args(["netns", "del", ns]).status();
    }
    Column {
        name: "kube-proxy v1.36.2".into(),
        nodes,
        first_sync_s: Some(first.as_secs_f64()),
        event_bytes_per_node: event_bytes,
        socket_bytes_per_node: socket_bytes,
        cpu_s_per_change: cpu,
        rss_mib: rss,
        restart: None,
    }
}

fn print(columns: &[Column], a: &Args) {
    println!(
        "\nfleet: {} Services × {} endpoints, probe slice {PROBE_ENDPOINTS} endpoints, {} flips",
        a.services, a.endpoints, a.flips
    );
    println!(
        "{:<44}{}",
        "",
        columns
            .iter()
            .map(|c| format!("{:>34}", c.name))
            .collect::<String>()
    );
    let row = |label: &str, f: &dyn Fn(&Column) -> String| {
        println!(
            "{label:<44}{}",
            columns
                .iter()
                .map(|c| format!("{:>34}", f(c)))
                .collect::<String>()
        );
    };
    row("nodes", &|c| c.nodes.to_string());
    row("first sync of every node (s)", &|c| {
        c.first_sync_s.map_or("–".into(), |s| format!("{s:.2}"))
    });
    row("watch event bytes per node per change", &|c| {
        format!("{:.0}", c.event_bytes_per_node)
    });
    row("socket bytes per node per change (TLS)", &|c| {
        format!("{:.0}", c.socket_bytes_per_node)
    });
    row("API server CPU per change (ms)", &|c| {
        format!("{:.1}", c.cpu_s_per_change * 1000.0)
    });
    row("API server RSS (MiB)", &|c| format!("{:.0}", c.rss_mib));
    row("restart: /readyz → every node synced (s)", &|c| {
        c.restart
            .as_ref()
            .map_or("–".into(), |r| format!("{:.2}", r.ready_to_synced_s))
    });
    row("restart: peak API server RSS (MiB)", &|c| {
        c.restart
            .as_ref()
            .map_or("–".into(), |r| format!("{:.0}", r.peak_rss_mib))
    });
    row("restart: nodes whose plan changed", &|c| {
        c.restart
            .as_ref()
            .map_or("–".into(), |r| r.plans_changed.to_string())
    });
    for c in columns {
        if let Some(r) = &c.restart {
            println!(
                "\n{}: requests since the API server's restart (verb resource code: count; \
                 a watch counts when it ends), and watches open",
                c.name
            );
            for (k, v) in &r.requests {
                println!("  {k:<36}{v:>8.0}");
            }
        }
    }
}

fn main() {
    let a = args();
    let admin = std::fs::read_to_string(Path::new(&a.lab).join("kubeconfig")).expect("kubeconfig");
    let port: u16 = admin
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: https://127.0.0.1:"))
        .and_then(|p| p.trim().parse().ok())
        .expect("the kubeconfig's server port");
    let lab = Lab {
        dir: a.lab.clone(),
        port,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(populate(&lab, a.services, a.endpoints));
    let mut columns = vec![kproxy_column(&lab, &a, &runtime)];
    if let Some(binary) = &a.compare {
        columns.push(kube_proxy_column(
            &lab,
            binary,
            a.compare_nodes.unwrap_or(a.nodes),
            a.flips,
        ));
    }
    print(&columns, &a);
}
