//! Pods: a tiny HTTP/1.1 server per pod, running on its own OS thread that has
//! entered the pod's network namespace (so its sockets live there) with its own
//! current-thread runtime, answering every request with the pod's name.
//!
//! The server obeys the signals the kubelet emulation sends (see `cluster`):
//! - SIGTERM, by profile:
//!   - `graceful`: stops accepting new connections, finishes in-flight requests,
//!     answers the next request on each keep-alive connection with
//!     `Connection: close`, closes connections idle for `idle_close`, stays ready,
//!     and exits once no connection is left.
//!   - `fail-readiness-on-term`: the readiness check fails at once (the
//!     ingress-nginx `wait-shutdown` behaviour in
//!     seed 2, summed up in docs/lint-rules.md); otherwise keeps
//!     accepting and serving (with `Connection: close`) until killed.
//!   - `exit-on-term`: the process ends at once, resetting open connections.
//! - SIGKILL: every open connection is reset (SO_LINGER 0, as the kernel does for a
//!   killed process with unread data) and the listener is closed.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::LabError;
use crate::scenario::service::POD_PORT;
use crate::scenario::workload::PodProfile;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodSignal {
    Run,
    Term,
    Kill,
}

/// State shared between the server thread and the kubelet emulation.
#[derive(Debug, Default)]
pub struct PodShared {
    /// What the readiness check answers right now.
    pub probe_ok: AtomicBool,
    /// The server has ended (exited by itself or killed).
    pub exited: AtomicBool,
    /// The server has bound its port (at once, or after its listen delay).
    pub listening: AtomicBool,
    pub open_conns: AtomicUsize,
    pub served: AtomicUsize,
}

/// A running pod server. Dropping it kills the server (resetting connections) and
/// joins its thread.
pub struct PodServer {
    pub name: String,
    pub shared: Arc<PodShared>,
    ctl: watch::Sender<PodSignal>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PodServer {
    /// Start the server inside namespace `netns_name`, listening on 0.0.0.0:8080.
    /// Returns once the listener is bound.
    pub fn start(
        name: &str,
        netns_name: &str,
        profile: PodProfile,
        idle_close: Duration,
    ) -> Result<PodServer, LabError> {
        PodServer::start_listening_after(name, netns_name, profile, idle_close, Duration::ZERO)
    }

    /// [`PodServer::start`], the server binding its port `listen_delay` after the start
    /// (an application that needs time before it listens; connections meanwhile are
    /// refused). With a delay it returns at once; a bind that fails later ends the
    /// server (`exited`), as a container that crashes.
    pub fn start_listening_after(
        name: &str,
        netns_name: &str,
        profile: PodProfile,
        idle_close: Duration,
        listen_delay: Duration,
    ) -> Result<PodServer, LabError> {
        let shared = Arc::new(PodShared::default());
        shared.probe_ok.store(true, Ordering::SeqCst);
        let (ctl, ctl_rx) = watch::channel(PodSignal::Run);
        let (bound_tx, bound_rx) = std::sync::mpsc::channel::<Result<(), LabError>>();
        let ns = netns_name.to_string();
        let pod_name: Arc<str> = Arc::from(name);
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("pod-{name}"))
            .spawn(move || {
                let setup =
                    (|| -> Result<(tokio::runtime::Runtime, std::net::TcpListener), LabError> {
                        crate::world::netns::enter_netns_by_name(&ns)?;
                        std::thread::sleep(listen_delay);
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .map_err(|e| LabError::Io {
                                what: "pod runtime".into(),
                                source: e,
                            })?;
                        let l = std::net::TcpListener::bind(SocketAddr::from((
                            Ipv4Addr::UNSPECIFIED,
                            POD_PORT,
                        )))
                        .map_err(|e| LabError::Io {
                            what: format!("pod {ns} bind :{POD_PORT}"),
                            source: e,
                        })?;
                        l.set_nonblocking(true).map_err(|e| LabError::Io {
                            what: "pod listener nonblocking".into(),
                            source: e,
                        })?;
                        Ok((rt, l))
                    })();
                match setup {
                    Err(e) => {
                        sh.exited.store(true, Ordering::SeqCst);
                        let _ = bound_tx.send(Err(e));
                    }
                    Ok((rt, l)) => {
                        sh.listening.store(true, Ordering::SeqCst);
                        let _ = bound_tx.send(Ok(()));
                        rt.block_on(async move {
                            match TcpListener::from_std(l) {
                                Ok(listener) => {
                                    serve(
                                        pod_name,
                                        listener,
                                        profile,
                                        idle_close,
                                        sh.clone(),
                                        ctl_rx,
                                    )
                                    .await
                                }
                                Err(e) => eprintln!("kproxy lab: pod listener: {e}"),
                            }
                            sh.exited.store(true, Ordering::SeqCst);
                        });
                    }
                }
            })
            .map_err(|e| LabError::Io {
                what: "spawn pod thread".into(),
                source: e,
            })?;
        let server = PodServer {
            name: name.to_string(),
            shared,
            ctl,
            thread: Some(thread),
        };
        if listen_delay.is_zero() {
            bound_rx.recv().map_err(|_| {
                LabError::Invalid(format!("pod {name}: server thread ended before binding"))
            })??;
        }
        Ok(server)
    }

    pub fn signal(&self, s: PodSignal) {
        // send_replace never fails even without receivers (the server may be gone).
        self.ctl.send_replace(s);
    }

    pub fn exited(&self) -> bool {
        self.shared.exited.load(Ordering::SeqCst)
    }

    /// Kill (if still running) and wait for the thread to end.
    pub fn join(&mut self) {
        self.signal(PodSignal::Kill);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        self.join();
    }
}

async fn serve(
    name: Arc<str>,
    listener: TcpListener,
    profile: PodProfile,
    idle_close: Duration,
    shared: Arc<PodShared>,
    mut ctl: watch::Receiver<PodSignal>,
) {
    let mut listener = Some(listener);
    let mut terminating = false;
    loop {
        let sig = *ctl.borrow_and_update();
        match sig {
            PodSignal::Kill => break,
            PodSignal::Term if !terminating => {
                terminating = true;
                match profile {
                    PodProfile::Graceful => listener = None,
                    PodProfile::FailReadinessOnTerm => {
                        shared.probe_ok.store(false, Ordering::SeqCst)
                    }
                    PodProfile::ExitOnTerm => break,
                }
            }
            _ => {}
        }
        if terminating && listener.is_none() && shared.open_conns.load(Ordering::SeqCst) == 0 {
            // Graceful exit: nothing left to serve.
            return;
        }
        tokio::select! {
            acc = async { match &listener { Some(l) => l.accept().await, None => std::future::pending().await } } => {
                if let Ok((stream, _)) = acc {
                    shared.open_conns.fetch_add(1, Ordering::SeqCst);
                    let (n, sh, c) = (name.clone(), shared.clone(), ctl.clone());
                    tokio::spawn(async move {
                        connection(n, stream, idle_close, sh.clone(), c, profile).await;
                        sh.open_conns.fetch_sub(1, Ordering::SeqCst);
                    });
                }
            }
            r = ctl.changed() => { if r.is_err() { break; } }
            // Re-check the graceful exit condition now and then.
            _ = tokio::time::sleep(Duration::from_millis(20)), if terminating => {}
        }
    }
    // Killed (or exit-on-term): close the listener, then wait for every connection
    // task to reset its socket.
    drop(listener);
    let _ = ctl_kill_all(&shared).await;
}

async fn ctl_kill_all(shared: &PodShared) -> bool {
    for _ in 0..200 {
        if shared.open_conns.load(Ordering::SeqCst) == 0 {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    false
}

fn reset(stream: TcpStream) {
    // Linger 0: close sends a RST instead of a FIN.
    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
    drop(stream);
}

/// Serve one connection: HTTP/1.1 GETs, keep-alive unless told otherwise.
async fn connection(
    name: Arc<str>,
    mut stream: TcpStream,
    idle_close: Duration,
    shared: Arc<PodShared>,
    mut ctl: watch::Receiver<PodSignal>,
    profile: PodProfile,
) {
    let mut buf = Vec::with_capacity(1024);
    // The client address as the pod sees it (to check it is preserved end to end).
    let peer = stream
        .peer_addr()
        .map(|a| a.ip().to_string())
        .unwrap_or_default();
    loop {
        let sig = *ctl.borrow_and_update();
        let dying =
            sig == PodSignal::Kill || (sig == PodSignal::Term && profile == PodProfile::ExitOnTerm);
        if dying {
            reset(stream);
            return;
        }
        let terminating = sig == PodSignal::Term;
        // Read one request head.
        let head_end = loop {
            if let Some(p) = find_head_end(&buf) {
                break Some(p);
            }
            let mut chunk = [0u8; 2048];
            let idle = if terminating && buf.is_empty() {
                idle_close
            } else {
                Duration::from_secs(3600)
            };
            tokio::select! {
                r = tokio::time::timeout(idle, stream.read(&mut chunk)) => match r {
                    Err(_) => break None, // idle after SIGTERM: close gracefully
                    Ok(Ok(0)) | Ok(Err(_)) => break None,
                    Ok(Ok(n)) => {
                        buf.extend_from_slice(&chunk[..n]);
                        if buf.len() > 16 * 1024 { break None; }
                    }
                },
                r = ctl.changed() => {
                    if r.is_err() { reset(stream); return; }
                    let s = *ctl.borrow();
                    if s == PodSignal::Kill || (s == PodSignal::Term && profile == PodProfile::ExitOnTerm) {
                        reset(stream);
                        return;
                    }
                    if s == PodSignal::Term && buf.is_empty() {
                        // Restart the read with the idle timeout of a terminating server.
                        continue;
                    }
                }
            }
        };
        let Some(end) = head_end else {
            let _ = stream.shutdown().await;
            return;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        buf.drain(..end + 4);
        let client_close = head
            .lines()
            .any(|l| l.starts_with("connection:") && l.contains("close"));
        let term_now = *ctl.borrow() == PodSignal::Term;
        let close = client_close || terminating || term_now;
        let body = format!("{name}\n");
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nx-pod: {name}\r\nx-client: {peer}\r\ncontent-length: {}\r\n{}\r\n{body}",
            body.len(),
            if close { "connection: close\r\n" } else { "" }
        );
        // Write the answer to the request already read, unless SIGKILL comes first.
        // Only SIGKILL may interrupt it: a SIGTERM (or any other change) arriving
        // while the answer is written must not abort the write, or the request that
        // was read is dropped and the client sees the connection close without an
        // answer (the "closed" failure a graceful server never causes).
        let written = {
            let write = stream.write_all(resp.as_bytes());
            tokio::pin!(write);
            loop {
                tokio::select! {
                    biased;
                    r = &mut write => break Some(r.is_ok()),
                    r = ctl.changed() => {
                        if r.is_err() || *ctl.borrow() == PodSignal::Kill {
                            break None;
                        }
                    }
                }
            }
        };
        match written {
            None => {
                reset(stream);
                return;
            }
            Some(false) => return,
            Some(true) => {
                shared.served.fetch_add(1, Ordering::Relaxed);
            }
        }
        if close {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request the server has read when SIGTERM arrives is answered (with
    /// `Connection: close`), never dropped. SIGTERM is sent at a sweep of small
    /// delays after the request, so that it lands at every point of the server's
    /// handling of it (before the read, between read and answer, after).
    #[test]
    fn a_request_read_when_sigterm_arrives_is_answered() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            for i in 0..400u32 {
                let (ctl, ctl_rx) = watch::channel(PodSignal::Run);
                let mut client = TcpStream::connect(addr).await.expect("connect");
                let (server, _) = listener.accept().await.expect("accept");
                let task = tokio::spawn(connection(
                    Arc::from("p"),
                    server,
                    Duration::from_secs(5),
                    Arc::new(PodShared::default()),
                    ctl_rx,
                    PodProfile::Graceful,
                ));
                tokio::time::sleep(Duration::from_millis(1)).await;
                client
                    .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                    .await
                    .expect("write");
                let until =
                    std::time::Instant::now() + Duration::from_nanos(u64::from(i % 100) * 500);
                while std::time::Instant::now() < until {
                    std::hint::spin_loop();
                }
                ctl.send_replace(PodSignal::Term);
                // Read the whole answer (or until the server closes).
                let mut got = Vec::new();
                let mut chunk = [0u8; 1024];
                while !got.ends_with(b"\r\n\r\np\n") {
                    match client.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got.extend_from_slice(&chunk[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&got);
                assert!(
                    text.starts_with("HTTP/1.1 200 OK"),
                    "attempt {i}: the request was dropped, got {text:?}"
                );
                drop(client);
                task.await.expect("connection task");
            }
        });
    }

    #[test]
    fn head_end_is_found() {
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\n"), Some(14));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n"), None);
    }
}
