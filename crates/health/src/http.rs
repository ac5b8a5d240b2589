//! The HTTP shell: binding listeners, accepting connections and serving one handler
//! with hyper, with every per-connection resource bounded so that hostile clients
//! (half requests, huge headers, thousands of idle connections) cannot starve a
//! well-behaved load-balancer probe. The kproxy metrics server uses the same shell
//! (through [`Server::with_responder`]), so every HTTP server of the process has one
//! set of bounds.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::decide::Answer;

/// Limits of one server (all its listeners together).
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Open connections; beyond it the *oldest* is closed, so a flood of idle or
    /// half-open connections cannot lock out a new probe.
    pub max_connections: usize,
    /// Time to send a complete request head, also bounding keep-alive idleness.
    pub header_read_timeout: Duration,
    /// Read buffer per connection; a longer request head gets 431.
    pub max_buf_size: usize,
    pub max_headers: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 512,
            header_read_timeout: Duration::from_secs(10),
            max_buf_size: 8192,
            max_headers: 64,
        }
    }
}

/// One connection budget shared by several servers (every health-check node port and
/// `/healthz`): at most `max` connections open among them all, so a flood spread over
/// many ports cannot take the process to its `nofile` limit (45 ports × 512
/// idle connections reached 20,000 fds and every port stopped answering). At the bound
/// the connection least recently active (accepted, or last sent a request) is closed:
/// idle connections go first, and a new probe always gets in.
///
/// A connection told to close still holds its socket until its task runs. Under a fast
/// flood those pile up, so when they reach a tenth of the budget the servers stop
/// accepting until they are gone: the process holds at most 1.1 × the budget of
/// connection sockets, however fast a flood connects (the caller leaves that room below
/// `nofile`), without delaying a probe in the usual case.
#[derive(Debug)]
pub struct ConnectionBudget {
    max: usize,
    inner: Mutex<BudgetInner>,
    closed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct BudgetInner {
    /// The last activity's sequence number → the connection's eviction token.
    by_activity: BTreeMap<u64, CancellationToken>,
    /// Connections evicted whose sockets are not closed yet.
    closing: usize,
    next: u64,
    evicted: u64,
}

impl ConnectionBudget {
    pub fn new(max: usize) -> Arc<ConnectionBudget> {
        Arc::new(ConnectionBudget {
            max: max.max(1),
            inner: Mutex::default(),
            closed: tokio::sync::Notify::new(),
        })
    }

    /// Waits while a tenth of the budget is connections evicted and still closing.
    async fn room(&self) {
        let slack = (self.max / 10).max(1);
        loop {
            let closed = self.closed.notified();
            if self.lock().closing < slack {
                return;
            }
            closed.await;
        }
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Connections open now, not counting those being closed.
    pub fn open(&self) -> usize {
        self.lock().by_activity.len()
    }

    /// Connections evicted whose sockets are still being closed.
    pub fn closing(&self) -> usize {
        self.lock().closing
    }

    /// Connections closed to make room since the start.
    pub fn evicted(&self) -> u64 {
        self.lock().evicted
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BudgetInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes a place for a new connection, closing the least recently active ones
    /// while the budget is full; returns its activity key.
    fn admit(&self, token: CancellationToken) -> u64 {
        let mut b = self.lock();
        while b.by_activity.len() >= self.max {
            match b.by_activity.pop_first() {
                Some((_, oldest)) => {
                    oldest.cancel();
                    b.evicted += 1;
                    b.closing += 1;
                }
                None => break,
            }
        }
        b.next += 1;
        let key = b.next;
        b.by_activity.insert(key, token);
        key
    }

    /// The connection at `key` sent a request: it becomes the most recently active.
    fn touch(&self, key: &std::sync::atomic::AtomicU64) {
        use std::sync::atomic::Ordering;
        let mut b = self.lock();
        let old = key.load(Ordering::Relaxed);
        let Some(token) = b.by_activity.remove(&old) else {
            return;
        };
        b.next += 1;
        let new = b.next;
        b.by_activity.insert(new, token);
        key.store(new, Ordering::Relaxed);
    }

    /// The connection's socket is closed.
    fn release(&self, key: &std::sync::atomic::AtomicU64) {
        let k = key.load(std::sync::atomic::Ordering::Relaxed);
        let mut b = self.lock();
        if b.by_activity.remove(&k).is_none() {
            // Evicted: it was counted as closing.
            b.closing = b.closing.saturating_sub(1);
            drop(b);
            self.closed.notify_waiters();
        }
    }
}

/// Answers one request; must not block.
pub type Handler = Arc<dyn Fn(&http::request::Parts) -> Answer + Send + Sync>;

/// Answers one request with a complete response (any content type); must not block.
pub type Responder = Arc<dyn Fn(&http::request::Parts) -> Response<Full<Bytes>> + Send + Sync>;

/// Binds a listening TCP socket: SO_REUSEADDR (a restarted proxy rebinds at once even
/// with connections in TIME_WAIT), IPV6_V6ONLY on IPv6 (so `0.0.0.0` and `[::]` can
/// both be bound), close-on-exec, non-blocking.
pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.cloexec(),
        Some(Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    TcpListener::from_std(socket.into())
}

/// The answer as an HTTP response (common headers added here).
pub fn response(a: Answer) -> Response<Full<Bytes>> {
    let mut b = Response::builder()
        .status(a.status)
        .header("Content-Type", "application/json")
        .header("X-Content-Type-Options", "nosniff");
    if let Some(w) = a.endpoint_weight {
        b = b.header("X-Load-Balancing-Endpoint-Weight", w);
    }
    // Invariant: status codes are 200/404/503 and header values are ASCII.
    b.body(Full::new(Bytes::from(a.body)))
        .expect("valid response")
}

/// A plain response for a [`Responder`] (common headers added here).
pub fn body_response(
    status: http::StatusCode,
    content_type: &'static str,
    body: String,
) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header("Content-Type", content_type)
        .header("X-Content-Type-Options", "nosniff")
        .body(Full::new(Bytes::from(body)))
        // Invariant: a valid status code and static ASCII header values.
        .expect("valid response")
}

#[derive(Default)]
struct Connections {
    next: u64,
    open: BTreeMap<u64, CancellationToken>,
}

/// One running server: any number of listeners sharing a handler and limits.
pub struct Server {
    close: CancellationToken,
    drain: CancellationToken,
    tasks: TaskTracker,
    conns: Arc<Mutex<Connections>>,
    handler: Responder,
    limits: Limits,
    name: &'static str,
    budget: Option<Arc<ConnectionBudget>>,
}

impl Server {
    /// This server's connections also count against `budget`, shared with others.
    pub fn with_budget(mut self, budget: Option<Arc<ConnectionBudget>>) -> Server {
        self.budget = budget;
        self
    }

    /// A health server: `handler`'s answers as JSON responses.
    pub fn new(handler: Handler, limits: Limits) -> Server {
        let responder: Responder = Arc::new(move |req| response(handler(req)));
        Server::with_responder("health server", responder, limits)
    }

    /// Any server; `name` appears in its log lines.
    pub fn with_responder(name: &'static str, handler: Responder, limits: Limits) -> Server {
        Server {
            close: CancellationToken::new(),
            drain: CancellationToken::new(),
            tasks: TaskTracker::new(),
            conns: Arc::default(),
            handler,
            limits,
            name,
            budget: None,
        }
    }

    /// Starts accepting on `listener`; returns what stops this listener only (its
    /// connections stay until they end or the server closes).
    pub fn serve(&self, listener: TcpListener) -> Listener {
        let stop = self.close.child_token();
        let ctx = ConnCtx {
            close: self.close.clone(),
            drain: self.drain.clone(),
            tasks: self.tasks.clone(),
            conns: self.conns.clone(),
            handler: self.handler.clone(),
            limits: self.limits,
            name: self.name,
            budget: self.budget.clone(),
        };
        let task = self.tasks.spawn(accept_loop(listener, stop.clone(), ctx));
        Listener { stop, task }
    }

    /// Closes every listener and connection at once and waits until all sockets are
    /// closed (so the port can be bound again immediately).
    pub async fn close(self) {
        self.close.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }

    /// Stops accepting, lets in-flight requests finish (up to `grace`), then closes.
    pub async fn shutdown(self, grace: Duration) {
        self.drain.cancel();
        self.tasks.close();
        if tokio::time::timeout(grace, self.tasks.wait())
            .await
            .is_err()
        {
            self.close.cancel();
            self.tasks.wait().await;
        }
    }
}

/// One listening socket of a [`Server`].
pub struct Listener {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Listener {
    /// Stops accepting and waits until the socket is closed (so the address can be
    /// bound again, e.g. by a wildcard listener replacing specific ones).
    pub async fn close(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

#[derive(Clone)]
struct ConnCtx {
    close: CancellationToken,
    drain: CancellationToken,
    tasks: TaskTracker,
    conns: Arc<Mutex<Connections>>,
    handler: Responder,
    limits: Limits,
    name: &'static str,
    budget: Option<Arc<ConnectionBudget>>,
}

async fn accept_loop(listener: TcpListener, stop: CancellationToken, ctx: ConnCtx) {
    loop {
        if let Some(b) = &ctx.budget {
            tokio::select! {
                _ = b.room() => {}
                _ = stop.cancelled() => return,
                _ = ctx.drain.cancelled() => return,
            }
        }
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = stop.cancelled() => return,
            _ = ctx.drain.cancelled() => return,
        };
        match accepted {
            Ok((stream, _peer)) => {
                let _ = stream.set_nodelay(true);
                let token = CancellationToken::new();
                let id = {
                    let mut c = ctx.conns.lock().unwrap_or_else(|e| e.into_inner());
                    while c.open.len() >= ctx.limits.max_connections {
                        match c.open.pop_first() {
                            Some((_, oldest)) => oldest.cancel(),
                            None => break,
                        }
                    }
                    c.next += 1;
                    let id = c.next;
                    c.open.insert(id, token.clone());
                    id
                };
                let activity = ctx
                    .budget
                    .as_ref()
                    .map(|b| Arc::new(std::sync::atomic::AtomicU64::new(b.admit(token.clone()))));
                ctx.tasks
                    .spawn(serve_conn(stream, id, token, activity, ctx.clone()));
            }
            Err(e) => {
                // Out of file descriptors (or a transient error): back off briefly
                // instead of spinning; existing connections keep being served.
                tracing::warn!(error = %e, server = ctx.name, "accept failed");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                    _ = stop.cancelled() => return,
                }
            }
        }
    }
}

async fn serve_conn(
    stream: tokio::net::TcpStream,
    id: u64,
    evict: CancellationToken,
    activity: Option<Arc<std::sync::atomic::AtomicU64>>,
    ctx: ConnCtx,
) {
    let handler = ctx.handler.clone();
    let (budget, key) = (ctx.budget.clone(), activity.clone());
    let svc = service_fn(move |req: Request<Incoming>| {
        if let (Some(b), Some(k)) = (&budget, &key) {
            b.touch(k);
        }
        let (parts, _body) = req.into_parts();
        let resp = handler(&parts);
        async move { Ok::<_, Infallible>(resp) }
    });
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(ctx.limits.header_read_timeout)
        .max_buf_size(ctx.limits.max_buf_size)
        .max_headers(ctx.limits.max_headers)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(stream), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => {}
        _ = evict.cancelled() => {}
        _ = ctx.close.cancelled() => {}
        _ = ctx.drain.cancelled() => {
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = evict.cancelled() => {}
                _ = ctx.close.cancelled() => {}
            }
        }
    }
    ctx.conns
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .open
        .remove(&id);
    if let (Some(b), Some(k)) = (&ctx.budget, &activity) {
        b.release(k);
    }
}
