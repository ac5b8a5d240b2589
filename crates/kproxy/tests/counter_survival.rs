//! Issue 47 item 2, with real processes: the traffic counters of a running `kproxy run`
//! survive every way the process goes and comes back, and a flush by another process
//! costs only what kproxy had not read yet.
//!
//! A node namespace (common's [`fabric`]: a pod behind a veth serving on :8080) holds a
//! Service with the pod as endpoint (`shop/web`, 10.96.0.10:80) and one without endpoint
//! (`shop/empty`, 10.96.0.30:80, rejected). New TCP connections are sent from the node
//! to both, a known number each time; the counts are read from the kernel with
//! `kproxy top -o json` and from the daemon's `/metrics`. Between rounds kproxy goes
//! and comes back:
//!
//! 1. another binary: the first process runs a copy of the binary at another path (or,
//!    when `KPROXY_UPGRADE_FROM=/path/to/kproxy` is set, that binary: give the release
//!    build or an older build there to test an upgrade from it; it must have the
//!    traffic counters and the flags used below), stopped by SIGTERM, and this build
//!    takes over;
//! 2. SIGTERM and a start of the same binary;
//! 3. SIGKILL and a start;
//! 4. a takeover from kube-proxy: kube-proxy's recorded nftables rules
//!    (tests/fixtures/kube-proxy/nftables.nft, as `takeover.rs` loads them) are loaded
//!    while kproxy is stopped; the next kproxy deletes them and keeps its own counts.
//!
//! After each, the counters are exactly the sum of every connection sent (0 resets) and
//! each series' `_created` is the one it had at the start. Then `nft flush ruleset`
//! while kproxy runs: kproxy restores the values it last read (connections sent after
//! that reading are lost, as the kernel lost them), logs it, and `_created` moves.

#![expect(
    clippy::disallowed_types,
    reason = "waits on real processes and packets: wall time"
)]

mod common;

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{
    Daemon, DaemonLog, NODE, Netns, SERVICE, can_run, fabric, http_get, sigterm, slice,
    write_atomic,
};

const TABLE: &str = "kpsurv";
const KUBE_PROXY_RULES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/kube-proxy/nftables.nft"
);
const METRICS: &str = "127.0.0.1:10249";

/// A Service without endpoints: every new connection to it is rejected.
const EMPTY: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: shop}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.30
  clusterIPs: [10.96.0.30]
  ipFamilies: [IPv4]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
"#;

const WEB: &str = r#"{namespace="shop",service="web",port="http",protocol="TCP"}"#;
const EMPTY_SERIES: &str = r#"{namespace="shop",service="empty",port="http",protocol="TCP"}"#;

/// The node, its input, and where its daemons write.
struct Node {
    fab: common::Fabric,
    dir: tempfile::TempDir,
    events: PathBuf,
    log: DaemonLog,
}

impl Node {
    fn new() -> Node {
        let fab = fabric('s');
        let dir = tempfile::tempdir().unwrap();
        write_atomic(dir.path(), "node.yaml", NODE);
        write_atomic(dir.path(), "service.yaml", SERVICE);
        write_atomic(dir.path(), "empty.yaml", EMPTY);
        write_atomic(dir.path(), "slice.yaml", &slice(true));
        let events = dir.path().join("events.jsonl");
        Node {
            fab,
            dir,
            events,
            log: DaemonLog::new(),
        }
    }

    fn ns(&self) -> &Netns {
        &self.fab.node
    }

    /// `kproxy run` from `bin`, waiting for its first (full) sync. A long
    /// `--verify-period`: the flush round needs to know which reading kproxy last
    /// made, and a verification reads the counters too.
    fn start(&self, bin: &Path) -> Daemon {
        let fulls = self.full_syncs();
        let d = Daemon(
            Command::new("ip")
                .args(["netns", "exec", &self.ns().0])
                .arg(bin)
                .arg("run")
                .args(["--manifests", self.dir.path().to_str().unwrap()])
                .args(["--hostname-override", "node-a"])
                .args(["--healthz-bind-address", "127.0.0.1:10256"])
                .args(["--metrics-bind-address", METRICS])
                .args(["--min-sync-period", "50ms", "--sync-period", "5s"])
                .args(["--verify-period", "1h", "--nft-table", TABLE])
                .args(["--traffic-metrics", "service"])
                .args(["--event-log", self.events.to_str().unwrap()])
                .stdout(Stdio::null())
                .stderr(self.log.stderr())
                .spawn()
                .expect("start kproxy run"),
        );
        self.wait(&format!("{} synced", bin.display()), || {
            self.full_syncs() > fulls
        });
        d
    }

    /// Full syncs in the event log (one per daemon start).
    fn full_syncs(&self) -> usize {
        self.events_where(|l| l.contains("\"synced\"") && l.contains("\"full\":true"))
    }

    /// Repairs of kproxy's tables after another process changed them.
    fn repairs(&self) -> usize {
        self.events_where(|l| l.contains("\"event\":\"kernel_repaired\""))
    }

    fn events_where(&self, f: impl Fn(&str) -> bool) -> usize {
        std::fs::read_to_string(&self.events)
            .unwrap_or_default()
            .lines()
            .filter(|l| f(l))
            .count()
    }

    /// Polls `f` for up to 90 s (a counter reading for `/metrics` is every 10 s; a
    /// loaded CI machine once took longer than 25 s for one of these).
    fn wait(&self, what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(90);
        while !f() {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; kproxy's log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(self.log.path()).unwrap_or_default()
    }

    /// `new` connections to `shop/web` answered by the pod and `rejects` connections to
    /// `shop/empty` refused, each a new connection from the node.
    fn send(&self, new: u64, rejects: u64) {
        let failures = self.ns().run(move || {
            let mut failures = Vec::new();
            for _ in 0..new {
                let got = http_get("10.96.0.10:80".parse().unwrap(), "/");
                if got != Some((200, "pod-1".to_string())) {
                    failures.push(format!("web: {got:?}"));
                }
            }
            let to: SocketAddr = "10.96.0.30:80".parse().unwrap();
            for _ in 0..rejects {
                match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
                    Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
                    other => failures.push(format!("empty: {other:?} (expected refused)")),
                }
            }
            failures
        });
        assert!(failures.is_empty(), "{failures:?}\n{}", self.log_text());
    }

    /// The kernel's totals (new connections of `shop/web`, rejects of `shop/empty`),
    /// read by `kproxy top -o json`.
    fn kernel(&self) -> (u64, u64) {
        let out = kproxy_test_support::run(
            self.ns()
                .kproxy("top")
                .args(["-o", "json", "--interval", "0.05"])
                .args(["--nft-table", TABLE]),
        );
        let v: serde_json::Value = serde_json::from_str(&out).expect("top's JSON");
        let port = |svc: &str| {
            v["servicePorts"]
                .as_array()
                .and_then(|a| a.iter().find(|p| p["service"] == svc))
                .cloned()
                .unwrap_or_else(|| panic!("no {svc} in {v}"))
        };
        (
            port("web")["new_total"].as_u64().unwrap(),
            port("empty")["rejects_total"].as_u64().unwrap(),
        )
    }

    fn metrics(&self) -> String {
        self.ns()
            .run(|| http_get(METRICS.parse().unwrap(), "/metrics"))
            .map(|(_, t)| t)
            .unwrap_or_default()
    }

    /// Waits until `/metrics` shows `want` (web's new connections, empty's rejects);
    /// the series' `_created` (web's, empty's).
    fn metrics_at(&self, want: (u64, u64)) -> (u64, u64) {
        let found = std::sync::Mutex::new(None);
        self.wait(&format!("/metrics to show {want:?}"), || {
            let text = self.metrics();
            let got = (
                sample(&text, &format!("kproxy_service_new_connections_total{WEB}")),
                sample(
                    &text,
                    &format!("kproxy_service_rejected_total{EMPTY_SERIES}"),
                ),
            );
            let created = (
                sample(
                    &text,
                    &format!("kproxy_service_new_connections_created{WEB}"),
                ),
                sample(
                    &text,
                    &format!("kproxy_service_rejected_created{EMPTY_SERIES}"),
                ),
            );
            *found.lock().unwrap() = Some((got, created, text));
            got == (Some(want.0), Some(want.1))
        });
        let (_, created, text) = found.into_inner().unwrap().unwrap();
        match created {
            (Some(a), Some(b)) => (a, b),
            _ => panic!("no _created beside the totals:\n{text}"),
        }
    }

    /// Waits for the daemon's next reading of the counters (its read-time gauge
    /// changes), so the next ~10 s hold no reading.
    fn after_next_reading(&self) {
        let read = |t: &str| sample_f64(t, "kproxy_traffic_counters_read_seconds");
        let before = read(&self.metrics());
        self.wait("the next reading of the counters", || {
            let now = read(&self.metrics());
            now.is_some() && now != before
        });
    }

    fn tables(&self) -> String {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns().0, "nft", "list", "tables"])
            .output()
            .expect("nft list tables");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// The value of the series `series` (name and labels, exactly as exposed).
fn sample(text: &str, series: &str) -> Option<u64> {
    sample_f64(text, series).map(|v| v as u64)
}

fn sample_f64(text: &str, series: &str) -> Option<f64> {
    let series = format!("{series} ");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

fn sigkill(d: &mut Daemon) {
    d.0.kill().unwrap();
    d.0.wait().unwrap();
}

#[test]
fn counters_survive_restarts_upgrade_and_takeover_and_a_flush_restores_the_last_reading() {
    if !can_run() {
        return;
    }
    let node = Node::new();
    let this = PathBuf::from(env!("CARGO_BIN_EXE_kproxy"));
    // The first binary: the one asked for, or this build copied to another path.
    let copy_dir = tempfile::tempdir().unwrap();
    let first = match std::env::var_os("KPROXY_UPGRADE_FROM") {
        Some(p) => PathBuf::from(p),
        None => {
            let p = copy_dir.path().join("kproxy-other");
            std::fs::copy(&this, &p).expect("copy the binary");
            p
        }
    };

    let mut daemon = node.start(&first);
    let mut sent = (7u64, 3u64);
    node.send(sent.0, sent.1);
    assert_eq!(node.kernel(), sent, "the first process's counts");
    let created = node.metrics_at(sent);
    // More connections after `what`: the kernel and `/metrics` count on from the sum
    // of all sent, and `_created` stays.
    let mut counts_on = |new: u64, rejects: u64, what: &str| {
        node.send(new, rejects);
        sent = (sent.0 + new, sent.1 + rejects);
        assert_eq!(node.kernel(), sent, "after {what}");
        assert_eq!(node.metrics_at(sent), created, "_created after {what}");
        sent
    };

    // 1. Another binary: the first process stops, this build adopts its tables.
    assert!(sigterm(&mut daemon).success());
    daemon = node.start(&this);
    counts_on(5, 2, "another binary took over");

    // 2. SIGTERM, the same binary again.
    assert!(sigterm(&mut daemon).success());
    daemon = node.start(&this);
    counts_on(4, 1, "SIGTERM and a restart");

    // 3. SIGKILL: no shutdown path at all.
    sigkill(&mut daemon);
    daemon = node.start(&this);
    counts_on(6, 2, "SIGKILL and a restart");

    // 4. A takeover from kube-proxy: its tables appear while kproxy is stopped (no
    // traffic then: its pre-DNAT filter chains would reject the cluster IPs it knows).
    assert!(sigterm(&mut daemon).success());
    node.ns().exec(&["nft", "-f", KUBE_PROXY_RULES]);
    assert!(
        node.tables().contains("table ip kube-proxy"),
        "{}",
        node.tables()
    );
    daemon = node.start(&this);
    node.wait("kube-proxy's tables to go", || {
        let t = node.tables();
        !t.contains("kube-proxy") && t.contains(&format!("table ip {TABLE}"))
    });
    let read = counts_on(3, 2, "the takeover from kube-proxy");

    // 5. Another process flushes the ruleset. Right after a reading (the last one kproxy
    // makes before the flush), more connections are sent: the kernel counts them, then
    // loses everything; kproxy restores what it had read.
    node.after_next_reading();
    node.send(4, 1);
    assert_eq!(
        node.kernel(),
        (read.0 + 4, read.1 + 1),
        "counted before the flush"
    );
    let repairs = node.repairs();
    node.ns().exec(&["nft", "flush", "ruleset"]);
    node.wait("the repair of the flushed tables", || {
        node.repairs() > repairs
    });
    assert_eq!(
        node.kernel(),
        read,
        "restored from the last reading, not from 0 nor from what it never read"
    );
    assert!(
        node.log_text()
            .contains("the kernel had lost kproxy's traffic counters"),
        "the restore is logged:\n{}",
        node.log_text()
    );
    let more = (2, 1);
    node.send(more.0, more.1);
    let want = (read.0 + more.0, read.1 + more.1);
    assert_eq!(node.kernel(), want, "counting on from the restored values");
    let moved = node.metrics_at(want);
    assert!(
        moved.0 > created.0 && moved.1 > created.1,
        "_created moves at the restore: {created:?} -> {moved:?}"
    );
    drop(daemon);
}
