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
use std::time::{Duration, Instant};

use common::{
    Daemon, DaemonLog, HEALTHZ, METRICS, Netns, can_run, eventually, fabric, http_get,
    kproxy_run_through, manifests,
};

/// More idle connections than the daemon has descriptors (hard limit 1024).
const FLOOD: usize = 3_000;
const HC_PORT: &str = "10.200.0.11:32000";

fn start_daemon(node: &Netns, dir: &Path, log: &DaemonLog) -> Daemon {
    // Soft limit first: the hard one may not go below it.
    let ulimit = [
        "sh",
        "-c",
        r#"ulimit -Sn 512 && ulimit -Hn 1024 && exec "$@""#,
        "sh",
    ];
    Daemon(
        kproxy_run_through(node, &ulimit, &["--manifests", dir.to_str().unwrap()])
            .args(["--min-sync-period", "50ms", "--sync-period", "5s"])
            .args(["--nft-table", "kptflood"])
            .stderr(log.stderr())
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
    let dir = manifests();
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
