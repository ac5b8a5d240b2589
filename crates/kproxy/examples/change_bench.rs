//! Change latency of `kproxy run` against the in-process fake API server (root): a
//! watch event queued on the fake server (the write "acknowledged") → the kernel commit
//! of the first sync whose `synced` event names the changed Service
//! (`committed_unix_us`), for isolated changes and for a burst; and how many syncs
//! carried the burst (the coalescing). kproxy runs in a throwaway network namespace
//! (removed on exit) with the fake server on that namespace's loopback, its default
//! pacing, nftables table `kpcb`.
//!
//! ```text
//! cargo build -p kproxy --bin kproxy --example change_bench
//! target/debug/examples/change_bench [1000x10] [--changes 200] [--burst 500]
//! ```
//!
//! Each change flips the readiness of one endpoint of a Service's slice (a MODIFIED
//! event): a delta sync of that Service. Isolated changes wait for their commit and
//! 30 ms more (beyond the pacing's 20 ms interval). The burst queues its events back to
//! back; it reports the time from the first event to the commit that carried the last
//! of them, and the syncs that carried any.

#![expect(
    clippy::disallowed_types,
    reason = "times a real kproxy process against the wall clock"
)]

mod support;

use support::{Netns, Proc};

use std::collections::BTreeSet;
use std::io::{Read, Seek};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kproxy_source::fake_api::{self, FakeApi};
use serde_json::{Value, json};

const NODE: &str = "node-0";
const TABLE: &str = "kpcb";

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_micros() as u64
}

fn service(i: usize) -> Value {
    let ip = support::ip4(0x0a60_0000 + 10, i);
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc-{i}"), "namespace": "bench", "resourceVersion": "5", "uid": format!("uid-{i}")},
        "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                 "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "sessionAffinity": "None",
                 "internalTrafficPolicy": "Cluster",
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
    })
}

/// Service `i`'s slice of `eps` endpoints; endpoint 0 ready iff `first_ready`.
fn slice(i: usize, eps: usize, rv: u64, first_ready: bool) -> Value {
    let endpoints: Vec<Value> = (0..eps)
        .map(|e| {
            let ready = e != 0 || first_ready;
            json!({"addresses": [support::ip4(0x0af4_0000, i * eps + e)],
                   "nodeName": format!("node-{}", e % 100),
                   "conditions": {"ready": ready, "serving": ready, "terminating": false}})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc-{i}-abcde"), "namespace": "bench", "resourceVersion": rv.to_string(),
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}"),
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}]
    })
}

fn node() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "resourceVersion": "7", "labels": {"kubernetes.io/hostname": NODE}},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.200.0.10"}]}
    })
}

/// The event log, read as it grows.
struct Events {
    path: PathBuf,
    offset: u64,
    partial: String,
}

impl Events {
    /// The `synced` events written since the last call.
    fn synced(&mut self) -> Vec<Value> {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        f.seek(std::io::SeekFrom::Start(self.offset)).unwrap();
        let mut text = String::new();
        self.offset += f.read_to_string(&mut text).unwrap() as u64;
        self.partial.push_str(&text);
        let cut = self.partial.rfind('\n').map_or(0, |i| i + 1);
        let whole: String = self.partial.drain(..cut).collect();
        whole
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["event"] == "synced")
            .collect()
    }

    /// Waits until syncs have carried every Service of `want`; the commit time of each
    /// sync that carried any, with how many of them it carried.
    fn until_carried(&mut self, mut want: BTreeSet<String>) -> Vec<(u64, usize)> {
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut carried = Vec::new();
        while !want.is_empty() {
            assert!(
                Instant::now() < deadline,
                "{} changes never synced",
                want.len()
            );
            for e in self.synced() {
                let names: Vec<String> = match e["changed"].as_array() {
                    Some(a) => a
                        .iter()
                        .filter_map(|n| n.as_str().map(String::from))
                        .collect(),
                    // A full sync carries everything.
                    None => want.iter().cloned().collect(),
                };
                let n = names.iter().filter(|n| want.remove(*n)).count();
                if n > 0 {
                    carried.push((
                        e["committed_unix_us"].as_u64().expect("committed_unix_us"),
                        n,
                    ));
                }
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        carried
    }
}

fn quantiles(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    format!(
        "p50 {:.1} ms, p90 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        q(0.5),
        q(0.9),
        q(0.99),
        q(1.0)
    )
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut services, mut eps, mut changes, mut burst) = (1000usize, 10usize, 200usize, 500usize);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> usize {
            args.next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{what} N"))
        };
        match a.as_str() {
            "--changes" => changes = num("--changes"),
            "--burst" => burst = num("--burst"),
            size => {
                let (s, e) = size
                    .split_once('x')
                    .expect("usage: change_bench [NxE] [--changes N] [--burst N]");
                services = s.parse().expect("N");
                eps = e.parse().expect("E");
            }
        }
    }
    assert!(
        burst <= services && changes > 0,
        "the burst touches distinct Services"
    );
    let kproxy = support::kproxy_binary();

    let ns = Netns::new(format!("kp-cb-{}", std::process::id()));
    let api = Arc::new(FakeApi::new());
    api.services
        .set_list("10", (0..services).map(service).collect());
    api.slices.set_list(
        "10",
        (0..services).map(|i| slice(i, eps, 6, true)).collect(),
    );
    api.nodes.set_list("10", vec![node()]);
    let listener = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0").expect("bind"));
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    {
        let _entered = rt.enter();
        fake_api::spawn(
            tokio::net::TcpListener::from_std(listener).unwrap(),
            api.clone(),
        );
    }

    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, fake_api::kubeconfig(addr)).unwrap();
    let events_path = dir.path().join("events.jsonl");
    let log = dir.path().join("kproxy.log");
    let started = Instant::now();
    let _kproxy = Proc(
        Command::new("ip")
            .args(["netns", "exec", &ns.0])
            .arg(&kproxy)
            .args(["run", "--kubeconfig", kubeconfig.to_str().unwrap()])
            .args(["--hostname-override", NODE, "--nft-table", TABLE])
            .args(["--healthz-bind-address", "127.0.0.1:10256"])
            .args(["--metrics-bind-address", "127.0.0.1:10249"])
            .args(["--event-log", events_path.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start kproxy"),
    );
    let mut events = Events {
        path: events_path,
        offset: 0,
        partial: String::new(),
    };
    while events.synced().is_empty() {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "no first sync: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "{services} Services x {eps} endpoints, fake API, {}: first sync after {:.2} s",
        kproxy.display(),
        started.elapsed().as_secs_f64()
    );

    let mut rv = 100u64;
    let mut ready = vec![true; services];
    let mut flip = |i: usize, rv: &mut u64| -> (String, u64) {
        *rv += 1;
        ready[i] = !ready[i];
        let at = unix_us(SystemTime::now());
        api.slices.event("MODIFIED", slice(i, eps, *rv, ready[i]));
        (format!("bench/svc-{i}"), at)
    };

    let mut isolated = Vec::new();
    for k in 0..changes {
        let (name, at) = flip((k * 7919) % services, &mut rv);
        let carried = events.until_carried(BTreeSet::from([name]));
        isolated.push(carried[0].0.saturating_sub(at) as f64 / 1e3);
        std::thread::sleep(Duration::from_millis(30));
    }
    println!(
        "isolated: {changes} changes, queued event → kernel commit: {}",
        quantiles(isolated)
    );

    let mut names = BTreeSet::new();
    let first = unix_us(SystemTime::now());
    for i in 0..burst {
        names.insert(flip(i, &mut rv).0);
    }
    let queued = unix_us(SystemTime::now());
    let carried = events.until_carried(names);
    let last = carried.iter().map(|c| c.0).max().unwrap_or(first);
    println!(
        "burst: {burst} changes queued in {:.1} ms; first queued → last committed {:.1} ms; carried by {} syncs ({})",
        queued.saturating_sub(first) as f64 / 1e3,
        last.saturating_sub(first) as f64 / 1e3,
        carried.len(),
        carried
            .iter()
            .map(|c| c.1.to_string())
            .collect::<Vec<_>>()
            .join(" + ")
    );
}
