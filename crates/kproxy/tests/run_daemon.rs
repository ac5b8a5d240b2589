//! `kproxy run` end to end, as root, in network namespaces this test creates: the real
//! daemon on the manifest source programs nftables, answers the health-check node port,
//! serves metrics, follows manifest changes (a pod becoming terminating), and leaves its
//! rules in place on SIGTERM.

#![expect(
    clippy::disallowed_types,
    reason = "times a real kproxy process: wall time"
)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{
    Daemon, DaemonLog, NODE, Netns, SERVICE, can_run, eventually, fabric, http_get, manifests,
    sigterm, slice, write_atomic,
};

fn start_daemon(node: &Netns, dir: &Path, table: &str, events: &Path, log: &DaemonLog) -> Daemon {
    Daemon(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &node.0,
                env!("CARGO_BIN_EXE_kproxy"),
                "run",
            ])
            .args([
                "--manifests",
                dir.to_str().unwrap(),
                "--hostname-override",
                "node-a",
            ])
            .args([
                "--healthz-bind-address",
                "127.0.0.1:10256",
                "--metrics-bind-address",
                "127.0.0.1:10249",
            ])
            .args([
                "--min-sync-period",
                "50ms",
                "--sync-period",
                "5s",
                "--nft-table",
                table,
            ])
            .args(["--event-log", events.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(log.stderr())
            .spawn()
            .expect("start kproxy run"),
    )
}

/// A client in the node namespace opening a new connection to the cluster IP every
/// 20 ms (and probing the health-check node port with it, when asked), counting failures.
struct Load {
    done: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(u32, u32, u32)>,
}

impl Load {
    fn start(node: &Netns, probe_health: bool) -> Load {
        let done = Arc::new(AtomicBool::new(false));
        let done2 = done.clone();
        let path = format!("/var/run/netns/{}", node.0);
        let thread = std::thread::spawn(move || {
            let file = std::fs::File::open(&path).expect("open netns");
            nix::sched::setns(file.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
            let (mut sent, mut failed, mut unhealthy) = (0u32, 0u32, 0u32);
            while !done2.load(Ordering::SeqCst) {
                sent += 1;
                if http_get("10.96.0.10:80".parse().unwrap(), "/")
                    != Some((200, "pod-1".to_string()))
                {
                    failed += 1;
                }
                if probe_health
                    && http_get("10.200.0.11:32000".parse().unwrap(), "/").map(|(c, _)| c)
                        != Some(200)
                {
                    unhealthy += 1;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (sent, failed, unhealthy)
        });
        Load { done, thread }
    }

    /// (sent, failed connections, health probes not 200)
    fn stop(self) -> (u32, u32, u32) {
        self.done.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

#[test]
fn run_programs_follows_changes_serves_health_and_metrics_and_keeps_rules_on_sigterm() {
    if !can_run() {
        return;
    }
    let fab = fabric('a');
    let node = &fab.node;
    let dir = manifests();
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpt";
    let daemon = start_daemon(node, dir.path(), table, &events, &log);
    // The cluster IP reaches the pod; the health-check node port says 200 with 1 endpoint.
    let body = eventually(node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });
    assert_eq!(body, (200, "pod-1".to_string()));
    let (code, hc) = eventually(node, "the health-check node port", || {
        http_get("10.200.0.11:32000".parse().unwrap(), "/")
    });
    assert_eq!(code, 200, "{hc}");
    let hc: serde_json::Value = serde_json::from_str(&hc).expect("health JSON");
    assert_eq!(hc["localEndpoints"], 1);
    assert_eq!(hc["service"]["namespace"], "shop");

    // The pod starts terminating: the health check says 503 while the cluster IP still
    // reaches the serving+terminating pod (failover to terminating endpoints).
    write_atomic(dir.path(), "slice.yaml", &slice(false));
    eventually(node, "the health check to fail", || {
        http_get("10.200.0.11:32000".parse().unwrap(), "/").filter(|(c, _)| *c == 503)
    });
    let still = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
    assert_eq!(
        still,
        Some((200, "pod-1".to_string())),
        "serving+terminating endpoint keeps serving"
    );

    // Proxy health and metrics.
    let (code, _) = eventually(node, "/healthz", || {
        http_get("127.0.0.1:10256".parse().unwrap(), "/healthz")
    });
    assert_eq!(code, 200);
    let (code, metrics) = eventually(node, "/metrics", || {
        http_get("127.0.0.1:10249".parse().unwrap(), "/metrics")
    });
    assert_eq!(code, 200);
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_proxy_healthz_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from\n{metrics}");
    }
    // kube-proxy's mode URL, which upstream's e2e "should check kube-proxy urls" reads.
    let mode = node.run(|| http_get("127.0.0.1:10249".parse().unwrap(), "/proxyMode"));
    assert_eq!(mode, Some((200, "nftables".to_string())));

    // The event log recorded the syncs.
    let log = std::fs::read_to_string(&events).unwrap();
    let synced: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "synced")
        .collect();
    assert!(synced.len() >= 2, "{log}");
    assert_eq!(synced[0]["full"], true);

    // SIGTERM: exit 0, rules stay.
    let mut daemon = daemon;
    let status = sigterm(&mut daemon);
    assert!(status.success(), "{status:?}");
    node.exec(&["nft", "list", "table", "ip", table]);
    let still = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
    assert_eq!(
        still,
        Some((200, "pod-1".to_string())),
        "traffic keeps flowing with kproxy stopped"
    );
}

/// A client keeps requests flowing while `kproxy run` is stopped and started
/// again; the restarted daemon adopts its tables in one transaction, so new connections
/// succeed throughout and an established connection survives.
#[test]
fn restart_under_load_loses_nothing() {
    if !can_run() {
        return;
    }
    let fab = fabric('b');
    let dir = manifests();
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpr";
    let mut daemon = start_daemon(&fab.node, dir.path(), table, &events, &log);
    eventually(&fab.node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });

    // An established keep-alive connection, opened before the restart.
    let mut kept = fab
        .node
        .run(|| TcpStream::connect("10.96.0.10:80").expect("connect"));
    kept.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let ask = |s: &mut TcpStream| -> bool {
        let req = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut buf = [0u8; 256];
        s.write_all(req).is_ok()
            && s.read(&mut buf)
                .is_ok_and(|n| n > 0 && buf[..n].ends_with(b"pod-1"))
    };
    assert!(ask(&mut kept));

    // New connections, one every 20 ms, from a thread in the node namespace.
    let load = Load::start(&fab.node, false);

    std::thread::sleep(Duration::from_millis(300));
    assert!(sigterm(&mut daemon).success());
    std::thread::sleep(Duration::from_millis(300));
    let _daemon = start_daemon(&fab.node, dir.path(), table, &events, &log);
    // Wait for the restarted daemon's first (full) sync.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(&events).unwrap_or_default();
        let fulls = log
            .lines()
            .filter(|l| l.contains("\"synced\"") && l.contains("\"full\":true"))
            .count();
        if fulls >= 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted daemon never synced:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let (sent, failed, _) = load.stop();
    assert!(sent > 20, "the load generator ran ({sent} requests)");
    assert_eq!(
        failed, 0,
        "{failed} of {sent} new connections failed across the restart"
    );
    assert!(
        ask(&mut kept),
        "the established connection survived the restart"
    );
}

/// The manifests rewritten the way editors and `>` redirections write them —
/// truncated to 0 bytes first, then a partial write that keeps the first document and
/// cuts the next one mid-line, then the whole text — never reach the kernel: new
/// connections to the cluster IP and the health-check node port keep working throughout.
#[test]
fn truncated_and_partial_manifest_writes_under_run_lose_no_connection() {
    if !can_run() {
        return;
    }
    let fab = fabric('c');
    let dir = tempfile::tempdir().unwrap();
    let all = format!("{NODE}---{SERVICE}---{}", slice(true));
    write_atomic(dir.path(), "all.yaml", &all);
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpw";
    let mut daemon = start_daemon(&fab.node, dir.path(), table, &events, &log);
    eventually(&fab.node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });
    eventually(&fab.node, "the health-check node port to say 200", || {
        http_get("10.200.0.11:32000".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });

    // New connections to the cluster IP and probes of the health-check node port, one
    // each every 20 ms, from a thread in the node namespace.
    let load = Load::start(&fab.node, true);

    let file = dir.path().join("all.yaml");
    // The first document whole, the Service's cut in the middle of its flow mapping.
    let cut = all.find("metadata: {name: web").expect("service metadata") + 15;
    for _ in 0..3 {
        std::fs::write(&file, "").unwrap();
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&file, &all[..cut]).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&file, &all).unwrap();
        std::thread::sleep(Duration::from_millis(500));
    }
    let (sent, failed, unhealthy) = load.stop();
    assert!(sent > 20, "the load generator ran ({sent} requests)");
    assert_eq!(
        failed, 0,
        "{failed} of {sent} new connections to the cluster IP failed during the rewrites"
    );
    assert_eq!(
        unhealthy, 0,
        "{unhealthy} of {sent} health-check probes were not 200 during the rewrites"
    );
    assert!(sigterm(&mut daemon).success());
}

/// A health-check node port that cannot listen on the Node's primary
/// address (absent from the host) is reported with the Service and the reason: in the
/// metric, on the daemon's `/health-check-node-ports`, and by `kproxy explain --server`.
#[test]
fn a_health_check_port_on_an_absent_node_address_is_reported_in_metrics_and_explain() {
    if !can_run() {
        return;
    }
    let fab = fabric('h');
    let node = &fab.node;
    let dir = manifests();
    // The Node's primary address is not configured on the node namespace.
    write_atomic(
        dir.path(),
        "node.yaml",
        &NODE.replace("10.200.0.11", "10.200.0.99"),
    );
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let mut daemon = start_daemon(node, dir.path(), "kph", &events, &log);
    let (code, state) = eventually(node, "the health-check port to be reported", || {
        http_get(
            "127.0.0.1:10249".parse().unwrap(),
            "/health-check-node-ports",
        )
        .filter(|(_, body)| body.contains("address_absent"))
    });
    assert_eq!(code, 200, "{state}");
    let state: serde_json::Value = serde_json::from_str(&state).expect("JSON");
    let port = &state["healthCheckNodePorts"][0];
    assert_eq!(port["service"], "shop/web", "{state}");
    assert_eq!(port["listening"], serde_json::json!([]), "{state}");
    assert_eq!(
        port["unbound"][0]["address"], "10.200.0.99:32000",
        "{state}"
    );
    let (_, metrics) = node
        .run(|| http_get("127.0.0.1:10249".parse().unwrap(), "/metrics"))
        .expect("/metrics");
    let counted = r#"kproxy_health_check_node_port_bind_failures_total{namespace="shop",name="web",port="32000",reason="address_absent"} 1"#;
    assert!(metrics.lines().any(|l| l == counted), "{metrics}");

    let explain = Command::new("ip")
        .args([
            "netns",
            "exec",
            &node.0,
            env!("CARGO_BIN_EXE_kproxy"),
            "explain",
        ])
        .args([
            "--manifests",
            dir.path().to_str().unwrap(),
            "--node",
            "node-a",
        ])
        .args(["shop/web", "--server", "http://127.0.0.1:10249"])
        .output()
        .expect("kproxy explain");
    let out = String::from_utf8_lossy(&explain.stdout);
    assert!(
        explain.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&explain.stderr)
    );
    assert!(
        out.contains("NOT listening on 10.200.0.99:32000: the node address is not on this host (address_absent)"),
        "{out}"
    );
    assert!(sigterm(&mut daemon).success());
}
