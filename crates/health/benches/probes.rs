//! Sustained probes per second one health-check node port answers, with latency
//! percentiles. The server runs on ONE thread (a current-thread runtime), the load
//! generator on another, both inside a private network namespace (root needed), over
//! loopback. Two shapes: keep-alive connections, and a new connection per probe (what
//! most cloud load balancers do).
//!
//! `cargo bench -p kproxy-health --bench probes` (env KPROXY_BENCH_SECS, default 3;
//! KPROXY_BENCH_CONNS, default 16).

#![expect(clippy::disallowed_types, reason = "a bench: wall time")]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kproxy_health::fixtures::{plan, svc};
use kproxy_health::{Health, HealthConfig, Semantics};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PORT: u16 = 32100;
const REQ_KEEPALIVE: &[u8] = b"GET / HTTP/1.1\r\nHost: probe\r\n\r\n";
const REQ_CLOSE: &[u8] = b"GET / HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n";

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Reads one response; returns its status.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<u16> {
    buf.clear();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end]).unwrap_or("");
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap_or(0))
                })
                .unwrap_or(0);
            if buf.len() >= end + 4 + len {
                return Ok(head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0));
            }
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn load(addr: SocketAddr, conns: usize, secs: u64, keepalive: bool) -> (u64, Vec<u32>) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for _ in 0..conns {
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut buf = Vec::with_capacity(1024);
            let mut conn = None;
            while Instant::now() < deadline {
                let t = Instant::now();
                if conn.is_none() {
                    let s = TcpStream::connect(addr).await.expect("connect");
                    s.set_nodelay(true).ok();
                    conn = Some(s);
                }
                let s = conn.as_mut().expect("connected");
                s.write_all(if keepalive { REQ_KEEPALIVE } else { REQ_CLOSE })
                    .await
                    .expect("write");
                let status = read_response(s, &mut buf).await.expect("read");
                assert_eq!(status, 200);
                lat.push(t.elapsed().as_micros() as u32);
                if !keepalive {
                    conn = None;
                }
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("load task"));
    }
    (all.len() as u64, all)
}

fn pct(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    f64::from(sorted[i]) / 1000.0
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo test` lists benches; nothing to list.
    }
    let secs = env("KPROXY_BENCH_SECS", 3);
    let conns = env("KPROXY_BENCH_CONNS", 16) as usize;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
        .expect("unshare(CLONE_NEWNET): the bench needs root");
    let out = std::process::Command::new("ip")
        .args(["link", "set", "lo", "up"])
        .output()
        .expect("ip");
    assert!(out.status.success());

    // Server: one thread, one current-thread runtime (threads inherit the namespace).
    let (ready_tx, ready_rx) = mpsc::channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let mut registry = prometheus_client::registry::Registry::default();
            let cfg = HealthConfig {
                healthz_bind_address: None,
                semantics: Semantics::Truthful,
                sync_period: Duration::from_secs(30),
                connection_budget: None,
            };
            let h = Health::start(cfg, &mut registry).await.expect("start");
            let p = plan(&[svc("default", "web", PORT, &["10.244.0.5", "10.244.0.6"])]);
            h.plan_computed(&p);
            h.plan_applied(&p);
            h.reconciled().await;
            ready_tx.send(()).expect("ready");
            let _ = stop_rx.await;
            h.shutdown().await;
        });
    });
    ready_rx.recv().expect("server ready");

    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), PORT);
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "health-check node port, server on 1 thread, {conns} client connections, {secs} s each"
    );
    for (name, keepalive) in [("keep-alive", true), ("new connection per probe", false)] {
        let t = Instant::now();
        let (n, mut lat) = client.block_on(load(addr, conns, secs, keepalive));
        let el = t.elapsed().as_secs_f64();
        lat.sort_unstable();
        println!(
            "{name:>26}: {:>8.0} req/s  p50 {:.3} ms  p99 {:.3} ms  p99.9 {:.3} ms  ({n} probes)",
            n as f64 / el,
            pct(&lat, 0.50),
            pct(&lat, 0.99),
            pct(&lat, 0.999)
        );
    }
    let _ = stop_tx.send(());
    server.join().expect("server thread");
}
