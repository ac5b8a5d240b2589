//! Test support: a private network namespace per test (so fixed health-check ports and
//! wildcard binds never touch the host or collide between tests), a raw HTTP/1.1
//! client, and metric scraping.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, SystemTime};

use kproxy_health::{HealthConfig, Semantics};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Runs `f` on a new thread that first moves into a fresh, anonymous network namespace
/// (only `lo`, brought up), on a current-thread runtime. The namespace has no name to
/// clean up: the kernel frees it when the thread and its sockets are gone, even when
/// the test panics. Child processes started from the thread (`ip`) inherit it.
pub fn in_netns<F, Fut, T>(f: F) -> T
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = T>,
    T: Send + 'static,
{
    let h = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .expect("unshare(CLONE_NEWNET): tests need root");
        ip(&["link", "set", "lo", "up"]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        rt.block_on(f())
    });
    match h.join() {
        Ok(v) => v,
        Err(e) => std::panic::resume_unwind(e),
    }
}

/// The settings of a test's `Health`: `/healthz` on `healthz` (none: no server),
/// `semantics`, a 30 s sync period and no connection budget.
pub fn health_config(healthz: Option<SocketAddr>, semantics: Semantics) -> HealthConfig {
    HealthConfig {
        healthz_bind_address: healthz,
        semantics,
        sync_period: Duration::from_secs(30),
        connection_budget: None,
    }
}

/// Runs `ip ARGS` in the calling thread's network namespace; panics on failure.
pub fn ip(args: &[&str]) {
    kproxy_test_support::run(Command::new("ip").args(args));
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    /// Lower-case names.
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("body is not JSON ({e}): {:?}", self.body))
    }
}

/// One request on a fresh connection (`Connection: close`), read to the end.
pub async fn request(addr: SocketAddr, method: &str, path: &str) -> std::io::Result<Resp> {
    let fut = async {
        let mut s = TcpStream::connect(addr).await?;
        s.write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        parse(&buf)
    };
    // A hang is a failure, not a stuck test run.
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request timed out"))?
}

pub async fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path)
        .await
        .unwrap_or_else(|e| panic!("GET {addr}{path}: {e}"))
}

/// True when nothing listens on `addr` (connection refused).
pub async fn refused(addr: SocketAddr) -> bool {
    match TcpStream::connect(addr).await {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => true,
        // Queued on a listener that was closing right then: not refused (yet).
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::ConnectionAborted
            ) =>
        {
            false
        }
        Err(e) => panic!("connect {addr}: unexpected error {e}"),
        Ok(_) => false,
    }
}

/// True once nothing listens on `addr`. A closed listener can stay open for a moment
/// when another thread of the test process forks a child (`ip`) right then: the child
/// holds a copy of every descriptor until it execs (close-on-exec).
pub async fn closed_soon(addr: SocketAddr) -> bool {
    for _ in 0..500 {
        if refused(addr).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

pub fn parse(buf: &[u8]) -> std::io::Result<Resp> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    let text = String::from_utf8_lossy(buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| bad("no end of headers"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().ok_or_else(|| bad("empty"))?;
    let status = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("bad status line"))?;
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Ok(Resp {
        status,
        headers,
        body: body.to_string(),
    })
}

/// The value of one sample line (`name{labels}` exactly as exposed), if present.
pub fn metric(registry: &Registry, series: &str) -> Option<f64> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("encode metrics");
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

pub fn t0() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_750_000_000)
}

/// Polls `cond` (after reconciling) until it holds or a generous deadline passes.
pub async fn eventually<F: FnMut() -> bool>(health: &kproxy_health::Health, mut cond: F) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        health.reconciled().await;
        if cond() {
            return true;
        }
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
