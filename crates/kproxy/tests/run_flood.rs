//! end to end as root in network namespaces this test creates: a flood
//! of idle connections to the metrics port of a real `kproxy run` started with a small
//! RLIMIT_NOFILE (soft 512, hard 1024). The daemon raises its soft limit to the hard
//! one and warns that it is low; the metrics server closes its oldest connections
//! instead of exhausting descriptors, so `/metrics`, `/healthz`, `/livez` and the
//! health-check node port keep answering during the flood. Own test binary: the test
//! process itself holds thousands of sockets.

#![expect(
    clippy::disallowed_types,
    reason = "times a real kproxy process: wall time"
)]

mod common;

use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, DaemonLog, Netns, can_run, eventually, fabric, http_get};

const MANIFESTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-a}
status: {addresses: [{type: InternalIP, address: 10.200.0.11}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ipFamilies: [IPv4]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.10}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- addresses: [10.244.1.5]
  nodeName: node-a
  conditions: {ready: true}
"#;

/// More idle connections than the daemon has descriptors (hard limit 1024).
const FLOOD: usize = 3_000;
const METRICS: &str = "127.0.0.1:10249";
const HEALTHZ: &str = "127.0.0.1:10256";
const HC_PORT: &str = "10.200.0.11:32000";

fn start_daemon(node: &Netns, dir: &Path, log: &DaemonLog) -> Daemon {
    let stderr = log.stderr();
    Daemon(
        Command::new("ip")
            .args(["netns", "exec", &node.0, "sh", "-c"])
            // Soft limit first: the hard one may not go below it.
            .arg(r#"ulimit -Sn 512 && ulimit -Hn 1024 && exec "$@""#)
            .args(["sh", env!("CARGO_BIN_EXE_kproxy"), "run"])
            .args(["--manifests", dir.to_str().unwrap()])
            .args(["--hostname-override", "node-a"])
            .args(["--healthz-bind-address", HEALTHZ])
            .args(["--metrics-bind-address", METRICS])
            .args(["--min-sync-period", "50ms", "--sync-period", "5s"])
            .args(["--nft-table", "kptflood"])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start kproxy run"),
    )
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// Everything a node's probes and scrapers need, answered now.
fn all_answer(node: &Netns, when: &str) {
    for (what, target, path) in [
        ("/healthz", HEALTHZ, "/healthz"),
        ("/livez", HEALTHZ, "/livez"),
        ("health-check node port", HC_PORT, "/"),
        ("/metrics", METRICS, "/metrics"),
    ] {
        let r = node.run(move || http_get(addr(target), path));
        assert!(
            matches!(r, Some((200, _))),
            "{what} {when}: {r:?} (a failed probe here means the flood starved the process)"
        );
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(usize::MAX)
}

#[test]
fn idle_connection_flood_on_the_metrics_port_starves_nothing() {
    if !can_run() {
        return;
    }
    // This process holds the flood's client ends: raise its own limit (root may).
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    let want = (FLOOD as u64 + 2_000).max(hard);
    setrlimit(Resource::RLIMIT_NOFILE, want, want).expect("raising RLIMIT_NOFILE as root");

    let fab = fabric('f');
    let node = &fab.node;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("all.yaml"), MANIFESTS).unwrap();
    let log = DaemonLog::new();
    let daemon = start_daemon(node, dir.path(), &log);
    let pid = daemon.0.id(); // `ip netns exec` and `sh` exec: this is kproxy's pid

    eventually(node, "the health-check node port", || {
        http_get(addr(HC_PORT), "/").filter(|(c, _)| *c == 200)
    });
    all_answer(node, "before the flood");

    // Start-up raised the soft limit to the hard one and warned that it is low.
    let (_, metrics) = node.run(|| http_get(addr(METRICS), "/metrics")).unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l == "kproxy_process_nofile_limit 1024"),
        "soft limit not raised to the hard one:\n{metrics}"
    );
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        text.contains("RLIMIT_NOFILE is low"),
        "no low-limit warning in:\n{text}"
    );

    // The flood: connections that never send a byte, three times the daemon's limit.
    let flood = node.run(|| {
        let mut held = Vec::with_capacity(FLOOD);
        let mut failed = 0usize;
        for _ in 0..FLOOD {
            match TcpStream::connect_timeout(&addr(METRICS), Duration::from_secs(2)) {
                Ok(s) => held.push(s),
                Err(_) => failed += 1,
            }
        }
        (held, failed)
    });
    let (held, failed) = flood;
    // An accepting server takes every connection (closing its oldest); one that ran
    // out of descriptors stops accepting and the backlog overflows.
    all_answer(node, &format!("with {} idle connections held", held.len()));
    assert_eq!(
        failed, 0,
        "connects to the metrics port failed during the flood"
    );

    // The daemon's descriptors stay bounded: the metrics server holds at most 64
    // connections, whatever the flood (polled: evicted sockets close asynchronously).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut fds = open_fds(pid);
    while fds > 400 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        fds = open_fds(pid);
    }
    assert!(fds <= 400, "kproxy holds {fds} descriptors under the flood");

    drop(held);
    all_answer(node, "after the flood");
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(
        !text.contains("Too many open files"),
        "descriptors ran out:\n{text}"
    );
}
