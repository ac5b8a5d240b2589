//! The issue-32 flood, measured: `serve` runs the health servers for N eTP=Local
//! Services (one health-check node port each, on 127.0.0.1:32000+i, plus `/healthz` on
//! 127.0.0.1:10256), with or without the shared connection budget; `flood` opens M idle
//! connections to every port, tops them up every 2 s, probes every port and `/healthz`
//! once a second and samples the server's open descriptors. Run both in one network
//! namespace, the server under the issue's `nofile` of 20,000 (crates/health/BENCHMARKS.md
//! has the commands and the figures).
//!
//! `flood serve PORTS BUDGET` (BUDGET 0: none, as before the shared connection budget) prints
//! its pid; `flood flood PORTS CONNS SECS PID FIRST COUNT` floods ports FIRST..FIRST+COUNT (one
//! process cannot hold more descriptors than its own limit: split the flood over several) and
//! probes all PORTS.

#![expect(clippy::disallowed_types, reason = "a measurement: wall time")]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kproxy_health::fixtures::{plan, svc};
use kproxy_health::{Health, HealthConfig, Semantics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const FIRST_PORT: u16 = 32000;
const HEALTHZ: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10256);

fn port(i: usize) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), FIRST_PORT + i as u16)
}

fn arg(i: usize) -> usize {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("argument {i}: see the module doc"))
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    match std::env::args().nth(1).as_deref() {
        Some("serve") => rt.block_on(serve(arg(2), arg(3))),
        Some("flood") => rt.block_on(flood(
            arg(2),
            arg(3),
            arg(4),
            arg(5),
            arg(6)..arg(6) + arg(7),
        )),
        _ => panic!("flood serve|flood …: see the module doc"),
    }
}

async fn serve(ports: usize, budget: usize) {
    let mut registry = prometheus_client::registry::Registry::default();
    let cfg = HealthConfig {
        healthz_bind_address: Some(HEALTHZ),
        semantics: Semantics::Upstream,
        sync_period: Duration::from_secs(30),
        connection_budget: (budget > 0).then_some(budget),
    };
    let h = Health::start(cfg, &mut registry).await.expect("start");
    // Names must be 'static: leaked once, at start.
    let services: Vec<_> = (0..ports)
        .map(|i| {
            let name: &'static str = Box::leak(format!("svc-{i}").into_boxed_str());
            svc("ns", name, port(i).port(), &["10.244.0.5"])
        })
        .collect();
    let p = plan(&services);
    h.plan_computed(&p);
    h.plan_applied(&p);
    h.reconciled().await;
    println!("{}", std::process::id());
    std::future::pending::<()>().await;
}

/// Keeps one idle connection open to `addr`, reconnecting at the next 2 s tick when
/// the server closes it.
async fn idle(addr: SocketAddr) {
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        if let Ok(mut s) = TcpStream::connect(addr).await {
            let mut b = [0u8; 64];
            let _ = s.read(&mut b).await;
        }
    }
}

/// One probe: time to a complete status line, or `None` (no answer within 10 s).
async fn probe(addr: SocketAddr, path: &str) -> Option<Duration> {
    let t = Instant::now();
    let go = async {
        let mut s = TcpStream::connect(addr).await.ok()?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.ok()?;
        out.starts_with(b"HTTP/1.1 ").then_some(())
    };
    tokio::time::timeout(Duration::from_secs(10), go)
        .await
        .ok()??;
    Some(t.elapsed())
}

fn fds(pid: usize) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

async fn flood(
    ports: usize,
    conns: usize,
    secs: usize,
    pid: usize,
    flooded: std::ops::Range<usize>,
) {
    for i in flooded.clone() {
        for _ in 0..conns {
            tokio::spawn(idle(port(i)));
        }
    }
    let start = Instant::now();
    let (mut times, mut failed, mut max_fds) = (Vec::new(), 0usize, 0usize);
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while start.elapsed() < Duration::from_secs(secs as u64) {
        tick.tick().await;
        max_fds = max_fds.max(fds(pid));
        let targets: Vec<(SocketAddr, &str)> = (0..ports)
            .map(|i| (port(i), "/"))
            .chain([(HEALTHZ, "/healthz")])
            .collect();
        let probes: Vec<_> = targets
            .into_iter()
            .map(|(a, p)| tokio::spawn(async move { probe(a, p).await }))
            .collect();
        for p in probes {
            match p.await.expect("probe task") {
                Some(t) => times.push(t),
                None => failed += 1,
            }
        }
        max_fds = max_fds.max(fds(pid));
    }
    times.sort();
    let q = |f: f64| {
        times
            .get(((times.len() as f64 - 1.0) * f).round() as usize)
            .map_or(f64::NAN, |t| t.as_secs_f64() * 1e3)
    };
    println!(
        "ports {flooded:?} × {conns} idle connections, {secs} s: server fds max {max_fds}; probes of {ports} ports and /healthz answered {} of {} (p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms)",
        times.len(),
        times.len() + failed,
        q(0.5),
        q(0.99),
        q(1.0)
    );
}
