//! The endpoint warm-up hold end to end, as root: `kproxy run` on manifests programs
//! real nftables rules in a node namespace; a Service has one old endpoint (terminating
//! and still serving, or ready) and gets a new endpoint whose server binds its port only
//! 400 ms after kproxy programmed it (a pod Ready before it listens, issue 49). A client
//! opens a new connection to the cluster IP every 10 ms. With the warm-up no new
//! connection is refused; with `--endpoint-warmup 0s` some are. Connections are counted,
//! never timed.

#![expect(
    clippy::disallowed_types,
    reason = "drives a real kproxy process and a late server: wall time"
)]

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    Daemon, DaemonLog, NODE, Netns, can_run, eventually, explain_web, fabric, kproxy_run,
    pod_behind_veth, serve_forever, slice_of, write_atomic,
};

const SERVICE: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ipFamilies: [IPv4]
  ports: [{name: http, port: 80, targetPort: 8080, protocol: TCP}]
"#;

/// The old pod (10.244.1.5, terminating or not) and, when `new`, the new one
/// (10.244.2.5), ready.
fn slice(old_terminating: bool, new: bool) -> String {
    let old = ("10.244.1.5", !old_terminating, old_terminating);
    if new {
        slice_of(&[old, ("10.244.2.5", true, false)])
    } else {
        slice_of(&[old])
    }
}

fn start_daemon(node: &Netns, dir: &Path, events: &Path, log: &DaemonLog, warmup: &str) -> Daemon {
    Daemon(
        kproxy_run(node, &["--manifests", dir.to_str().unwrap()])
            .args([
                "--min-sync-period",
                "0s",
                "--sync-period",
                "30s",
                "--nft-table",
                "kpw",
            ])
            .args(["--endpoint-warmup", warmup])
            .args(["--event-log", events.to_str().unwrap()])
            .stderr(log.stderr())
            .spawn()
            .expect("start kproxy run"),
    )
}

/// What the client saw.
#[derive(Debug, Default)]
struct Seen {
    sent: u32,
    refused: u32,
    /// Other failures: timeouts, resets, short answers.
    other: u32,
    /// Answers by the new pod.
    from_new: u32,
}

/// A new connection to the cluster IP every 10 ms from the node namespace.
struct Load {
    done: Arc<AtomicBool>,
    seen: Arc<Mutex<Seen>>,
    thread: std::thread::JoinHandle<()>,
}

impl Load {
    fn start(node: &Netns) -> Load {
        let (done, seen) = (Arc::new(AtomicBool::new(false)), Arc::default());
        let (done2, seen2): (_, Arc<Mutex<Seen>>) = (done.clone(), Arc::clone(&seen));
        let thread = node.spawn(move || {
            let addr: SocketAddr = "10.96.0.10:80".parse().unwrap();
            while !done2.load(Ordering::SeqCst) {
                let outcome = request(addr);
                let mut s = seen2.lock().unwrap();
                s.sent += 1;
                match outcome {
                    Ok(body) if body == "pod-2" => s.from_new += 1,
                    Ok(body) if body == "pod-1" => {}
                    Ok(_) => s.other += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => s.refused += 1,
                    Err(_) => s.other += 1,
                }
                drop(s);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Load { done, seen, thread }
    }

    fn seen_new(&self) -> bool {
        self.seen.lock().unwrap().from_new > 0
    }

    fn stop(self) -> Seen {
        self.done.store(true, Ordering::SeqCst);
        self.thread.join().unwrap();
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

/// One request on a new connection: the answer's body, or why there was none.
fn request(addr: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut buf = String::new();
    s.read_to_string(&mut buf)?;
    Ok(buf.split("\r\n\r\n").nth(1).unwrap_or_default().to_string())
}

fn events(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn synced_count(path: &Path) -> usize {
    events(path)
        .iter()
        .filter(|e| e["event"] == "synced")
        .count()
}

/// One run: the old pod serving, the new one added, programmed, and listening 400 ms
/// after kproxy's sync that programmed it; the load throughout. Returns what the client
/// saw, the event log, and the daemon's metrics followed by what `kproxy explain
/// --server` said before the new pod listened.
fn run(old_terminating: bool, warmup: &str) -> (Seen, Vec<serde_json::Value>, String) {
    let fab = fabric('w');
    let node = &fab.node;
    // A second pod on the node, 10.244.2.5 behind its own veth, no server yet.
    let veth = format!("kw{}", std::process::id() % 100_000);
    let pod2 = pod_behind_veth(node, "wpod2", &veth, "10.244.2.1", "10.244.2.5");
    let dir = tempfile::tempdir().unwrap();
    let log_dir = tempfile::tempdir().unwrap();
    let events_path = log_dir.path().join("events.jsonl");
    write_atomic(dir.path(), "node.yaml", NODE);
    write_atomic(dir.path(), "service.yaml", SERVICE);
    write_atomic(dir.path(), "slice.yaml", &slice(false, false));
    let log = DaemonLog::new();
    let _daemon = start_daemon(node, dir.path(), &events_path, &log, warmup);
    eventually(node, "the cluster IP to reach the old pod", || {
        common::http_get("10.96.0.10:80".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });

    let load = Load::start(node);
    std::thread::sleep(Duration::from_millis(300));
    let before = synced_count(&events_path);
    write_atomic(dir.path(), "slice.yaml", &slice(old_terminating, true));
    let deadline = Instant::now() + Duration::from_secs(20);
    while synced_count(&events_path) == before {
        assert!(Instant::now() < deadline, "kproxy never synced the new pod");
        std::thread::sleep(Duration::from_millis(2));
    }
    // The new pod is programmed (held or not): its server binds 400 ms later. Meanwhile
    // `kproxy explain --server` asks the daemon what it holds.
    let bind_at = Instant::now() + Duration::from_millis(400);
    let explained = explain_web(node, dir.path(), "127.0.0.1:10249");
    let explained = format!(
        "{}{}",
        String::from_utf8_lossy(&explained.stdout),
        String::from_utf8_lossy(&explained.stderr)
    );
    std::thread::sleep(bind_at.saturating_duration_since(Instant::now()));
    let listener = pod2.run(|| TcpListener::bind("10.244.2.5:8080").expect("new pod listener"));
    let stop = serve_forever(listener, "pod-2");
    // Until the new pod takes connections (the hold released, or never held).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !load.seen_new() {
        assert!(
            Instant::now() < deadline,
            "the new pod never got a connection"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let seen = load.stop();
    stop.store(true, Ordering::SeqCst);
    let metrics = node
        .run(|| common::http_get("127.0.0.1:10249".parse().unwrap(), "/metrics"))
        .map(|(_, body)| body)
        .unwrap_or_default();
    (seen, events(&events_path), metrics + &explained)
}

#[test]
fn a_new_endpoint_that_listens_late_refuses_no_connection_while_held() {
    if !can_run() {
        return;
    }
    for old_terminating in [true, false] {
        let case = if old_terminating {
            "old pod terminating and serving"
        } else {
            "old pod ready"
        };
        // Held for 3 s: longer than the 400 ms the server takes, with room for a slow
        // machine between the sync and the bind.
        let (seen, log, metrics) = run(old_terminating, "3s");
        eprintln!("{case}, --endpoint-warmup 3s: {seen:?}");
        assert!(seen.sent >= 20, "{case}: {seen:?}");
        assert_eq!((seen.refused, seen.other), (0, 0), "{case}, held: {seen:?}");
        let held: Vec<&serde_json::Value> = log
            .iter()
            .filter(|e| e["event"] == "endpoint_held")
            .collect();
        assert_eq!(held.len(), 1, "{case}: {log:?}");
        assert_eq!(held[0]["ip"], "10.244.2.5");
        assert_eq!(held[0]["service"], "shop/web");
        let released: Vec<&serde_json::Value> = log
            .iter()
            .filter(|e| e["event"] == "endpoint_released")
            .collect();
        assert_eq!(released.len(), 1, "{case}: {log:?}");
        assert_eq!(released[0]["reason"], "elapsed");
        assert!(
            metrics.contains("kproxy_endpoint_warmup_holds_total 1\n"),
            "{case}: {metrics}"
        );
        assert!(
            metrics.contains("kproxy_endpoint_warmup_releases_total{reason=\"elapsed\"} 1\n"),
            "{case}: {metrics}"
        );
        assert!(
            metrics.contains("shop/web:http/TCP IPv4 10.244.2.5:8080: no new connection until"),
            "{case}: explain --server names the hold: {metrics}"
        );

        // Without the hold, the same pod is sent connections before it listens.
        let (seen, log, _) = run(old_terminating, "0s");
        eprintln!("{case}, --endpoint-warmup 0s: {seen:?}");
        assert!(seen.refused > 0, "{case}, no warm-up: {seen:?}");
        assert!(
            !log.iter().any(|e| e["event"] == "endpoint_held"),
            "{case}: {log:?}"
        );
    }
}
