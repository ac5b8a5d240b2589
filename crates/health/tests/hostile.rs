//! Hostile clients against a health-check port: half requests (slowloris), oversized
//! and too many headers, garbage, and 10,000 idle connections. The server must keep
//! answering a well-behaved probe, with bounded resources (own test binary: it needs
//! many file descriptors).

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use common::{get, health_config, in_netns, t0};
use kproxy_health::fixtures::{plan, svc};
use kproxy_health::{Health, HealthConfig, ManualClock, Semantics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PORT: u16 = 31900;

fn addr() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), PORT)
}

async fn start() -> Health {
    start_with(kproxy_health::http::Limits::default()).await
}

/// A health server (no `/healthz`) with `limits`, serving Service `a/b` on [`PORT`].
async fn start_with(limits: kproxy_health::http::Limits) -> Health {
    let mut registry = prometheus_client::registry::Registry::default();
    let cfg = health_config(None, Semantics::Upstream);
    let h = Health::start_with(cfg, &mut registry, ManualClock::new(t0()), limits)
        .await
        .unwrap();
    let p = plan(&[svc("a", "b", PORT, &["10.244.0.5"])]);
    h.plan_computed(&p);
    h.plan_applied(&p);
    h.reconciled().await;
    h
}

/// Sends raw bytes, returns whatever comes back until the server closes.
async fn raw(bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr()).await.unwrap();
    // The server may close before reading everything (431): a reset is fine.
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

#[test]
fn oversized_and_malformed_requests_are_refused_and_the_probe_still_works() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        let h = start().await;
        let big = format!(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        let r = raw(big.as_bytes()).await;
        assert!(
            r.is_empty() || r.starts_with("HTTP/1.1 431"),
            "oversized header: {r:?}"
        );
        let many: String = (0..200).map(|i| format!("X-H{i}: v\r\n")).collect();
        let r = raw(format!("GET / HTTP/1.1\r\nHost: x\r\n{many}\r\n").as_bytes()).await;
        assert!(
            r.is_empty() || r.starts_with("HTTP/1.1 431"),
            "too many headers: {r:?}"
        );
        let r = raw(b"\x16\x03\x01\x02\x00garbage-not-http\r\n\r\n").await;
        assert!(
            r.is_empty() || r.starts_with("HTTP/1.1 400"),
            "garbage: {r:?}"
        );
        assert_eq!(get(addr(), "/").await.status, 200);
        h.shutdown().await;
    });
}

#[test]
fn slowloris_and_ten_thousand_idle_connections_do_not_starve_a_probe() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    // Room for the client sockets plus the server's own: raise the soft limit to the
    // hard one (and the hard one too where allowed).
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    if setrlimit(Resource::RLIMIT_NOFILE, 40_000, 40_000.max(hard)).is_err() {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    // 10,000 when the limit allows (it does on CI: root), else as many as fit.
    let n = 10_000usize.min((soft as usize).saturating_sub(2_000));
    if n < 1_000 {
        // Root can always raise the hard limit: there, a low limit is a failure, not a
        // reason to skip (.ci/run runs as root).
        assert!(
            !nix::unistd::geteuid().is_root(),
            "RLIMIT_NOFILE {soft} could not be raised as root"
        );
        // Cannot exceed the server's 512-connection bound meaningfully: say so loudly.
        eprintln!(
            "SKIPPED: RLIMIT_NOFILE {} (hard limit not raisable) is too low for the idle-connection flood",
            soft
        );
        return;
    }
    in_netns(move || async move {
        let h = start().await;
        // Half requests that never finish.
        let mut slow = Vec::new();
        for _ in 0..300 {
            let mut s = TcpStream::connect(addr()).await.unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                .await
                .unwrap();
            slow.push(s);
        }
        assert_eq!(get(addr(), "/").await.status, 200, "probe during slowloris");

        // 10,000 idle connections on top.
        let mut idle = Vec::with_capacity(n);
        while idle.len() < n {
            let batch: Vec<_> = (0..250).map(|_| TcpStream::connect(addr())).collect();
            for c in futures_lite(batch).await {
                idle.push(c.expect("connect"));
            }
        }
        let r = get(addr(), "/").await;
        assert_eq!(r.status, 200, "probe after {n} idle connections");
        // The server kept its own connection count bounded (512 per server): the
        // process holds the client ends plus at most that many server ends.
        let fds = std::fs::read_dir("/proc/self/fd").unwrap().count();
        assert!(
            fds < n + 300 + 300 + 600,
            "server connections are not bounded: {fds} fds open"
        );
        drop(idle);
        drop(slow);
        assert_eq!(get(addr(), "/").await.status, 200);
        h.shutdown().await;
    });
}

/// Awaits all futures concurrently (they only make progress when polled together).
async fn futures_lite<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output>
where
    F::Output: 'static,
{
    let mut pinned: Vec<_> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.expect("ready")).collect()
}

/// A client that never finishes its request head is disconnected after the header
/// read timeout (shortened here); a well-behaved probe on the same server still works.
#[test]
fn half_requests_are_disconnected_after_the_header_timeout() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        let h = start_with(kproxy_health::http::Limits {
            header_read_timeout: Duration::from_millis(300),
            ..Default::default()
        })
        .await;
        let mut half = TcpStream::connect(addr()).await.unwrap();
        half.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await
            .unwrap();
        let mut idle = TcpStream::connect(addr()).await.unwrap(); // sends nothing at all
        assert_eq!(get(addr(), "/").await.status, 200);
        for (what, s) in [
            ("half request", &mut half),
            ("silent connection", &mut idle),
        ] {
            let mut out = Vec::new();
            // Generous bound so a hang fails instead of blocking the run; no timing asserted.
            let closed =
                tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await;
            assert!(closed.is_ok(), "{what}: not disconnected");
            let text = String::from_utf8_lossy(&out);
            assert!(
                !text.starts_with("HTTP/1.1 200"),
                "{what}: answered {text:?}"
            );
        }
        h.shutdown().await;
    });
}

/// 45 eTP=Local Services flooded with idle connections on their health-check
/// node ports (512 accepted each) took kproxy to its 20,000-fd limit, and every port
/// stopped answering. Here, at a reduced scale, a shared budget of 40 connections is
/// exhausted several times over by idle connections spread over five ports and
/// `/healthz`: the servers hold at most the budget, the least recently active go first,
/// and every port and `/healthz` still answer a probe.
#[test]
fn a_flood_over_many_health_ports_stays_within_the_shared_budget() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    const BUDGET: usize = 40;
    const PER_PORT: usize = 30;
    in_netns(|| async {
        let mut registry = prometheus_client::registry::Registry::default();
        let healthz = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10256);
        let cfg = HealthConfig {
            healthz_bind_address: Some(healthz),
            semantics: Semantics::Upstream,
            sync_period: Duration::from_secs(30),
            connection_budget: Some(BUDGET),
        };
        let h = Health::start_with_clock(cfg, &mut registry, ManualClock::new(t0()))
            .await
            .unwrap();
        let names = ["a", "b", "c", "d", "e"];
        let ports: Vec<SocketAddr> = (0..names.len())
            .map(|i| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), PORT + i as u16))
            .collect();
        let services: Vec<_> = names
            .iter()
            .zip(&ports)
            .map(|(n, a)| svc("ns", n, a.port(), &["10.244.0.5"]))
            .collect();
        let p = plan(&services);
        h.plan_computed(&p);
        h.plan_applied(&p);
        h.reconciled().await;
        let budget = h.connection_budget().expect("configured");

        let mut idle = Vec::new();
        for a in ports.iter().chain([&healthz]) {
            for _ in 0..PER_PORT {
                idle.push(TcpStream::connect(a).await.unwrap());
            }
        }
        let clients = idle.len();
        // Wait until the servers have accepted the flood (the kernel completes the
        // handshakes before `accept`): the budget then has evicted the surplus.
        for _ in 0..3000 {
            if budget.evicted() as usize >= clients - BUDGET {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(budget.evicted() as usize, clients - BUDGET);
        assert_eq!(budget.open(), BUDGET);
        // The servers hold at most the budget of connections (plus evicted ones still
        // closing, a tenth at most): counted as established sockets on the servers'
        // ports in this test's own namespace (other tests of this binary share the
        // process's descriptor table, not the namespace).
        let our_ports: Vec<u16> = ports.iter().chain([&healthz]).map(|a| a.port()).collect();
        let ss = std::process::Command::new("ss")
            .args(["-Htn", "state", "established"])
            .output()
            .expect("ss (iproute2)");
        let server_ends = String::from_utf8_lossy(&ss.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().nth(2)?.rsplit_once(':'))
            .filter(|(_, port)| port.parse().is_ok_and(|p| our_ports.contains(&p)))
            .count();
        assert!(
            (BUDGET..=BUDGET + BUDGET / 10).contains(&server_ends),
            "{server_ends} server ends established for {clients} client connections, budget {BUDGET}"
        );
        // The first idle connection (least recently active) was closed by the server.
        let mut out = Vec::new();
        let closed =
            tokio::time::timeout(Duration::from_secs(30), idle[0].read_to_end(&mut out)).await;
        assert!(
            matches!(closed, Ok(Ok(0))),
            "the oldest idle connection is still open"
        );
        // Every port and /healthz answer a probe, the flood still holding its place.
        for a in &ports {
            assert_eq!(get(*a, "/").await.status, 200, "{a}");
        }
        assert_eq!(get(healthz, "/healthz").await.status, 200);
        assert!(budget.open() <= BUDGET);
        drop(idle);
        h.shutdown().await;
    });
}
