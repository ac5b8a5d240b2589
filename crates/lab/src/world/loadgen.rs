//! The load generator: a thread inside the client namespace with its own
//! current-thread runtime, sending HTTP GETs to the VIP at a steady rate on new
//! connections, plus a number of long-lived keep-alive connections. Every request
//! that starts produces exactly one record (start, end, outcome, answering pod),
//! including requests still in flight when the run stops: stopping waits for them
//! (each is bounded by the request timeout).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::LabError;
use crate::scenario::load::LoadSpec;
use crate::world::netns;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Ok,
    /// Connection refused (RST to the SYN, or ICMP port unreachable).
    Refused,
    /// Connection reset while the request was in flight.
    Reset,
    /// No answer within the request timeout (dropped packets).
    Timeout,
    /// The peer closed the connection without answering.
    Closed,
    /// ICMP host/network unreachable.
    Unreachable,
    /// HTTP 5xx.
    Http5xx,
    /// Another non-200 status or unparsable answer.
    HttpError,
}

impl Outcome {
    pub fn is_ok(self) -> bool {
        self == Outcome::Ok
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::Reset => "reset",
            Outcome::Timeout => "timeout",
            Outcome::Closed => "closed",
            Outcome::Unreachable => "unreachable",
            Outcome::Http5xx => "http_5xx",
            Outcome::HttpError => "http_error",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ConnKind {
    New,
    KeepAlive,
}

#[derive(Clone, Debug, Serialize)]
pub struct RequestRecord {
    /// Real ms since the run's clock started.
    pub start_ms: f64,
    pub end_ms: f64,
    pub outcome: Outcome,
    pub conn: ConnKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// Keep-alive requests only: the request went out on a connection that had
    /// already carried a request.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub reused: bool,
    /// Failed keep-alive requests on a reused connection: the pod that answered the
    /// connection's previous request (where the failed one was most likely sent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conn_pod: Option<String>,
}

pub struct LoadGenerator {
    stop: Arc<AtomicBool>,
    /// Requests started, counted apart from the records (to check the accounting).
    started: Arc<AtomicU64>,
    records: Arc<Mutex<Vec<RequestRecord>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl LoadGenerator {
    /// Start sending to `target` from inside namespace `netns_name`.
    pub fn start(
        netns_name: &str,
        target: SocketAddr,
        spec: LoadSpec,
        epoch: Instant,
    ) -> Result<LoadGenerator, LabError> {
        let stop = Arc::new(AtomicBool::new(false));
        let records = Arc::new(Mutex::new(Vec::new()));
        let started = Arc::new(AtomicU64::new(0));
        let (st, rec, ns, sta) = (
            stop.clone(),
            records.clone(),
            netns_name.to_string(),
            started.clone(),
        );
        let thread = netns::spawn_runtime_in_netns("lab-load", ns, move || {
            run_load(target, spec, epoch, st, rec, sta)
        })?;
        let g = LoadGenerator {
            stop,
            started,
            records,
            thread: Some(thread),
        };
        Ok(g)
    }

    /// (sent so far, failed so far), for progress lines.
    pub fn counts(&self) -> (usize, usize) {
        let r = self.records.lock().expect("records lock");
        (r.len(), r.iter().filter(|r| !r.outcome.is_ok()).count())
    }

    /// Stop starting requests, wait for those in flight, return every record.
    pub fn stop(self) -> Vec<RequestRecord> {
        self.stop_counted().1
    }

    /// Like `stop`, also returning how many requests were started.
    pub fn stop_counted(mut self) -> (u64, Vec<RequestRecord>) {
        self.finish();
        let recs = std::mem::take(&mut *self.records.lock().expect("records lock"));
        (self.started.load(Ordering::SeqCst), recs)
    }

    fn finish(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for LoadGenerator {
    fn drop(&mut self) {
        self.finish();
    }
}

fn ms(epoch: Instant) -> f64 {
    epoch.elapsed().as_secs_f64() * 1000.0
}

async fn run_load(
    target: SocketAddr,
    spec: LoadSpec,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    records: Arc<Mutex<Vec<RequestRecord>>>,
    started: Arc<AtomicU64>,
) {
    let timeout = Duration::from_millis(spec.request_timeout_ms.max(1));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..spec.keepalive_connections {
        let (st, rec, sta) = (stop.clone(), records.clone(), started.clone());
        let period = Duration::from_secs_f64(1.0 / spec.keepalive_rate.max(0.1));
        tasks.spawn(keepalive_loop(target, period, timeout, epoch, st, rec, sta));
    }
    if spec.new_connection_rate > 0.0 {
        let period = Duration::from_secs_f64(1.0 / spec.new_connection_rate);
        let mut tick = tokio::time::interval(period);
        // After a stall (noisy machine), do not burst to catch up: keep the rate.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while !stop.load(Ordering::SeqCst) {
            tick.tick().await;
            if stop.load(Ordering::SeqCst) {
                break;
            }
            let rec = records.clone();
            started.fetch_add(1, Ordering::SeqCst);
            tasks.spawn(async move {
                let start = ms(epoch);
                let (outcome, pod) = one_shot(target, timeout).await;
                let r = RequestRecord {
                    start_ms: start,
                    end_ms: ms(epoch),
                    outcome,
                    conn: ConnKind::New,
                    pod,
                    reused: false,
                    conn_pod: None,
                };
                rec.lock().expect("records lock").push(r);
            });
            // Reap finished tasks so the set does not grow.
            while tasks.try_join_next().is_some() {}
        }
    } else {
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    // In-flight requests finish (each bounded by the timeout) and are recorded.
    while tasks.join_next().await.is_some() {}
}

fn classify_io(e: &std::io::Error) -> Outcome {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::ConnectionRefused => Outcome::Refused,
        K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => Outcome::Reset,
        K::TimedOut => Outcome::Timeout,
        K::UnexpectedEof => Outcome::Closed,
        _ => match e.raw_os_error() {
            Some(libc::EHOSTUNREACH) | Some(libc::ENETUNREACH) => Outcome::Unreachable,
            _ => Outcome::Reset,
        },
    }
}

const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nHost: web.lab\r\nUser-Agent: kproxy-lab\r\n\r\n";

/// Read one response; returns (status, pod, server wants close).
async fn read_response(s: &mut TcpStream) -> Result<(u16, Option<String>, bool), Outcome> {
    let mut buf = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let mut lines = head.lines();
            let status: u16 = lines
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|c| c.parse().ok())
                .ok_or(Outcome::HttpError)?;
            let mut len = 0usize;
            let mut pod = None;
            let mut close = false;
            for l in lines {
                let lower = l.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    len = v.trim().parse().map_err(|_| Outcome::HttpError)?;
                } else if lower.starts_with("x-pod:") {
                    pod = Some(l[6..].trim().to_string());
                } else if lower.starts_with("connection:") && lower.contains("close") {
                    close = true;
                }
            }
            let need = end + 4 + len;
            while buf.len() < need {
                let n = s.read(&mut chunk).await.map_err(|e| classify_io(&e))?;
                if n == 0 {
                    return Err(Outcome::Closed);
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            return Ok((status, pod, close));
        }
        let n = s.read(&mut chunk).await.map_err(|e| classify_io(&e))?;
        if n == 0 {
            return Err(Outcome::Closed);
        }
        buf.extend_from_slice(&chunk[..n]);
        if buf.len() > 64 * 1024 {
            return Err(Outcome::HttpError);
        }
    }
}

fn status_outcome(status: u16) -> Outcome {
    match status {
        200 => Outcome::Ok,
        500..=599 => Outcome::Http5xx,
        _ => Outcome::HttpError,
    }
}

/// One request on a fresh connection.
async fn one_shot(target: SocketAddr, timeout: Duration) -> (Outcome, Option<String>) {
    let fut = async {
        let mut s = TcpStream::connect(target)
            .await
            .map_err(|e| classify_io(&e))?;
        s.write_all(b"GET / HTTP/1.1\r\nHost: web.lab\r\nUser-Agent: kproxy-lab\r\nConnection: close\r\n\r\n")
            .await
            .map_err(|e| classify_io(&e))?;
        read_response(&mut s).await
    };
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => (Outcome::Timeout, None),
        Ok(Err(o)) => (o, None),
        Ok(Ok((status, pod, _))) => (status_outcome(status), pod),
    }
}

async fn keepalive_loop(
    target: SocketAddr,
    period: Duration,
    timeout: Duration,
    epoch: Instant,
    stop: Arc<AtomicBool>,
    records: Arc<Mutex<Vec<RequestRecord>>>,
    started: Arc<AtomicU64>,
) {
    let mut conn: Option<TcpStream> = None;
    // The pod that answered the last request on `conn`.
    let mut last_pod: Option<String> = None;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.load(Ordering::SeqCst) {
        tick.tick().await;
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let start = ms(epoch);
        started.fetch_add(1, Ordering::SeqCst);
        let mut reused = conn.is_some();
        let fut = async {
            if conn.is_none() {
                reused = false;
                conn = Some(
                    TcpStream::connect(target)
                        .await
                        .map_err(|e| classify_io(&e))?,
                );
            }
            let s = conn.as_mut().expect("connection just set");
            s.write_all(REQUEST).await.map_err(|e| classify_io(&e))?;
            read_response(s).await
        };
        let (outcome, pod) = match tokio::time::timeout(timeout, fut).await {
            Err(_) => (Outcome::Timeout, None),
            Ok(Err(o)) => (o, None),
            Ok(Ok((status, pod, close))) => {
                if close {
                    conn = None;
                }
                (status_outcome(status), pod)
            }
        };
        let conn_pod = if reused && !outcome.is_ok() {
            last_pod.take()
        } else {
            None
        };
        last_pod = pod.clone();
        if !outcome.is_ok() || conn.is_none() {
            conn = None;
            last_pod = None;
        }
        let r = RequestRecord {
            start_ms: start,
            end_ms: ms(epoch),
            outcome,
            conn: ConnKind::KeepAlive,
            pod,
            reused,
            conn_pod,
        };
        records.lock().expect("records lock").push(r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_classified() {
        use std::io::{Error, ErrorKind};
        assert_eq!(
            classify_io(&Error::from(ErrorKind::ConnectionRefused)),
            Outcome::Refused
        );
        assert_eq!(
            classify_io(&Error::from(ErrorKind::ConnectionReset)),
            Outcome::Reset
        );
        assert_eq!(
            classify_io(&Error::from_raw_os_error(libc::EHOSTUNREACH)),
            Outcome::Unreachable
        );
        assert_eq!(status_outcome(503), Outcome::Http5xx);
        assert_eq!(status_outcome(404), Outcome::HttpError);
        assert_eq!(status_outcome(200), Outcome::Ok);
    }
}
