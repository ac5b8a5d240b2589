//! The client of the one-shot tools (`kproxy plan`, `explain`, `trace`): every API call
//! bounded in time and bytes, and a failure to connect said by its cause. Owns the
//! limits ([`CallLimits`], their defaults), the tower layer that enforces them on each
//! request and its body ([`Bounds`]), and the classification of connection failures
//! ([`ConnectFailure`]).
//!
//! The idle bound is the connection's (kube's `read_timeout`, restarted by every byte
//! read and by the request's write): only the socket sees each byte of a response's
//! head. The rest is a layer: a server that answers one byte per second never trips
//! an idle bound, and kube has no deadline for a response's body; an endless body is
//! read until memory runs out. `kproxy run` does not use this client:
//! its watches are meant to stay open for minutes (their idle bound is the watch's
//! own), and its lists are retried with backoff.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame};
use tokio::time::{Instant, Sleep};
use tower::{BoxError, Layer, Service};

use super::SourceError;

/// DNS, TCP and the TLS handshake: client-go's TLS handshake bound, a third of its
/// dialer's 30 s (a blackholed address is known to be one long before that).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// One API call from sending the request to the last byte of its body. A page of
/// 5,000 objects from a loaded API server takes seconds; a minute is slack for that.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// No byte from the server for this long: it is not working on the answer.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// The kubeconfig's exec credential plugin (`aws eks get-token`, `gke-gcloud-auth-plugin`,
/// kubelogin): time for a browser login, not for a hang.
pub const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_secs(60);
/// All the bytes one tool run reads from the API server. A 10k-Service × 10-endpoint
/// cluster lists in about 20 MB of protobuf; an endless body stops here, not at the
/// machine's memory. This bounds bytes, not memory: what the tool holds is the state
/// ingested from them, several times their size (an endless list of Services: 100 MB
/// read, 650 MB resident; at the old 1 GiB default, 3 GB before the request timeout).
/// 256 MiB is 10× the protobuf of that cluster and keeps an endless list under about
/// 2 GB; a larger cluster's tools take a larger `--max-read-bytes`.
pub const DEFAULT_MAX_READ_BYTES: u64 = 256 << 20;

/// The bounds on the tools' calls to the API server. `None`: no bound (a flag's `0`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallLimits {
    pub connect: Option<Duration>,
    pub request: Option<Duration>,
    pub idle: Option<Duration>,
    pub exec: Option<Duration>,
    /// Bytes of response bodies, all calls together.
    pub max_read_bytes: u64,
}

impl Default for CallLimits {
    fn default() -> Self {
        CallLimits {
            connect: Some(DEFAULT_CONNECT_TIMEOUT),
            request: Some(DEFAULT_REQUEST_TIMEOUT),
            idle: Some(DEFAULT_IDLE_TIMEOUT),
            exec: Some(DEFAULT_EXEC_TIMEOUT),
            max_read_bytes: DEFAULT_MAX_READ_BYTES,
        }
    }
}

/// Why a TCP or TLS connection to the API server could not be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConnectFailure {
    #[error(
        "connection refused: nothing listens at that address and port (is the API server up, and is this the right cluster?)"
    )]
    Refused,
    #[error("no route to the server's address ({0})")]
    Unreachable(String),
    #[error("its host name does not resolve (DNS: {0})")]
    Dns(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error(
        "no answer to the connection attempt within --connect-timeout (a firewall dropping packets, or an address nothing answers at)"
    )]
    Timeout,
    #[error("{0}")]
    Other(String),
}

/// A bounded call that failed: the server (and the path) and why.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("cannot connect to the API server {server}: {failure}")]
    Connect {
        server: String,
        failure: ConnectFailure,
    },
    #[error("{server}{path}: no byte from the API server for {after:?} (--idle-timeout)")]
    Idle {
        server: String,
        path: String,
        after: Duration,
    },
    #[error("{server}{path}: no complete answer within {after:?} (--request-timeout)")]
    Request {
        server: String,
        path: String,
        after: Duration,
    },
    #[error(
        "{server}{path}: the API server sent more than {limit} bytes in all (--max-read-bytes)"
    )]
    TooLarge {
        server: String,
        path: String,
        limit: u64,
    },
}

/// What a TLS failure means to the person who reads it.
fn tls_failure(e: &rustls::Error) -> ConnectFailure {
    use rustls::{CertificateError, Error};
    let why = match e {
        Error::InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature,
        ) => {
            "the server's certificate is not signed by a CA this kubeconfig trusts (its certificate-authority / certificate-authority-data)"
        }
        Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => "the server's certificate does not name the host in the kubeconfig's server URL",
        Error::InvalidCertificate(
            CertificateError::Expired | CertificateError::ExpiredContext { .. },
        ) => "the server's certificate has expired",
        _ => "the handshake failed",
    };
    ConnectFailure::Tls(format!("{why} ({e})"))
}

/// The cause of a failed connection, from an error and its sources; `None` when the
/// error is not about connecting.
pub fn connect_failure(error: &(dyn std::error::Error + 'static)) -> Option<ConnectFailure> {
    use std::io::ErrorKind;
    let mut connecting = false;
    let mut dns = false;
    let mut chain = Vec::new();
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(h) = e.downcast_ref::<hyper_util::client::legacy::Error>() {
            connecting |= h.is_connect();
        }
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls_failure(tls));
        }
        let io = e.downcast_ref::<std::io::Error>();
        if let Some(io) = io {
            match io.kind() {
                ErrorKind::ConnectionRefused => return Some(ConnectFailure::Refused),
                ErrorKind::HostUnreachable | ErrorKind::NetworkUnreachable => {
                    return Some(ConnectFailure::Unreachable(io.to_string()));
                }
                ErrorKind::TimedOut if connecting => return Some(ConnectFailure::Timeout),
                _ if dns => return Some(ConnectFailure::Dns(io.to_string())),
                _ => {}
            }
        }
        let text = e.to_string();
        // hyper-util's resolver error has no public type: "dns error".
        dns |= text == "dns error";
        if chain.last() != Some(&text) {
            chain.push(text);
        }
        // An io::Error's source() skips the error it wraps (rustls's, another io::Error).
        current = match io {
            Some(io) => io
                .get_ref()
                .map(|i| i as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    if dns {
        return Some(ConnectFailure::Dns(chain.join(": ")));
    }
    connecting.then(|| ConnectFailure::Other(chain.join(": ")))
}

/// Whether the error, or one of its sources, is an I/O timeout: the connection's idle
/// bound expired.
fn timed_out(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        let io = e.downcast_ref::<std::io::Error>();
        if io.is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut) {
            return true;
        }
        current = match io {
            Some(io) => io
                .get_ref()
                .map(|i| i as &(dyn std::error::Error + 'static)),
            None => e.source(),
        };
    }
    false
}

/// The bytes all bodies of one client may still bring.
#[derive(Debug)]
struct Budget {
    limit: u64,
    read: AtomicU64,
}

impl Budget {
    /// Counts `n` bytes read; false once more than the limit has been read.
    fn take(&self, n: usize) -> bool {
        let n = n as u64;
        self.read.fetch_add(n, Ordering::Relaxed).saturating_add(n) <= self.limit
    }
}

/// The layer that bounds every call of a client by [`CallLimits`] (its connect and
/// idle bounds are the connector's, set in [`client`]; the layer names them).
#[derive(Clone, Debug)]
pub struct Bounds {
    server: Arc<str>,
    request: Option<Duration>,
    idle: Option<Duration>,
    budget: Arc<Budget>,
}

impl Bounds {
    pub fn new(server: &str, limits: &CallLimits) -> Bounds {
        Bounds {
            server: server.trim_end_matches('/').into(),
            request: limits.request,
            idle: limits.idle,
            budget: Arc::new(Budget {
                limit: limits.max_read_bytes,
                read: AtomicU64::new(0),
            }),
        }
    }
}

impl<S> Layer<S> for Bounds {
    type Service = Bounded<S>;

    fn layer(&self, inner: S) -> Bounded<S> {
        Bounded {
            inner,
            bounds: self.clone(),
        }
    }
}

/// A service whose calls are bounded ([`Bounds`]).
pub struct Bounded<S> {
    inner: S,
    bounds: Bounds,
}

/// One call: where it went and when it started, for its deadline and its errors.
#[derive(Clone, Debug)]
struct Call {
    bounds: Bounds,
    path: String,
    deadline: Option<Instant>,
}

enum Expired {
    Idle,
    Request,
}

impl Call {
    fn error(&self, expired: Expired) -> CallError {
        let (server, path) = (self.bounds.server.to_string(), self.path.clone());
        match expired {
            Expired::Idle => CallError::Idle {
                server,
                path,
                after: self.bounds.idle.unwrap_or_default(),
            },
            Expired::Request => CallError::Request {
                server,
                path,
                after: self.bounds.request.unwrap_or_default(),
            },
        }
    }

    fn too_large(&self) -> CallError {
        CallError::TooLarge {
            server: self.bounds.server.to_string(),
            path: self.path.clone(),
            limit: self.bounds.budget.limit,
        }
    }

    /// The inner service's or the body's error, said by its cause when it is a failed
    /// connection or the connection's idle bound; other errors (kube's own, an auth
    /// layer's) pass unchanged.
    fn failed(&self, error: BoxError) -> BoxError {
        if let Some(failure) = connect_failure(&*error) {
            return Box::new(CallError::Connect {
                server: self.bounds.server.to_string(),
                failure,
            });
        }
        if timed_out(&*error) {
            return Box::new(self.error(Expired::Idle));
        }
        error
    }
}

impl<S, Req, B> Service<http::Request<Req>> for Bounded<S>
where
    S: Service<http::Request<Req>, Response = http::Response<B>>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    type Response = http::Response<BoundedBody<B>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: http::Request<Req>) -> Self::Future {
        let call = Call {
            bounds: self.bounds.clone(),
            path: req.uri().path().to_string(),
            deadline: self.bounds.request.map(|r| Instant::now() + r),
        };
        let answer = self.inner.call(req);
        Box::pin(async move {
            let res = match call.deadline {
                Some(deadline) => match tokio::time::timeout_at(deadline, answer).await {
                    Ok(res) => res,
                    Err(_) => return Err(call.error(Expired::Request).into()),
                },
                None => answer.await,
            };
            let res = res.map_err(|e| call.failed(e.into()))?;
            Ok(res.map(|body| BoundedBody::new(body, call)))
        })
    }
}

/// A response body read within the call's deadline and the client's byte budget.
pub struct BoundedBody<B> {
    inner: B,
    call: Call,
    deadline: Option<Pin<Box<Sleep>>>,
}

impl<B> BoundedBody<B> {
    fn new(inner: B, call: Call) -> Self {
        let deadline = call.deadline.map(|d| Box::pin(tokio::time::sleep_until(d)));
        BoundedBody {
            inner,
            call,
            deadline,
        }
    }
}

impl<B> Body for BoundedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        // Checked on every frame too: a body that is always ready never yields to the
        // timers.
        if this.call.deadline.is_some_and(|d| Instant::now() >= d) {
            return Poll::Ready(Some(Err(this.call.error(Expired::Request).into())));
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && !this.call.bounds.budget.take(data.len())
                {
                    return Poll::Ready(Some(Err(this.call.too_large().into())));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(this.call.failed(e.into())))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if let Some(d) = &mut this.deadline
                    && d.as_mut().poll(cx).is_ready()
                {
                    return Poll::Ready(Some(Err(this.call.error(Expired::Request).into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The tools' client: `config` with the connect timeout of `limits`, every call
/// bounded by the rest ([`Bounds`]). The exec plugin, if any, has run already
/// ([`super::kubeconfig::run_exec_plugin`]).
pub fn client(mut config: kube::Config, limits: &CallLimits) -> Result<kube::Client, SourceError> {
    config.connect_timeout = limits.connect;
    config.read_timeout = limits.idle;
    config.write_timeout = limits.idle;
    // Else the time a pooled connection sat unused would count against the next answer.
    config.reset_reader_on_write = true;
    // A refusal for load reaches the list's own retry, which caps the server's delay
    // (`reflect::server_delay`), not kube's, which sleeps any `Retry-After` it is given.
    config.default_retry = false;
    let bounds = Bounds::new(&config.cluster_url.to_string(), limits);
    let builder = kube::client::ClientBuilder::try_from(config).map_err(SourceError::Client)?;
    Ok(builder.with_layer(&bounds).build())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io;

    #[test]
    fn connection_failures_are_named_by_their_cause() {
        let io = |kind| io::Error::new(kind, "x");
        assert_eq!(
            connect_failure(&io(io::ErrorKind::ConnectionRefused)),
            Some(ConnectFailure::Refused)
        );
        assert_eq!(
            connect_failure(&io::Error::from_raw_os_error(libc::EHOSTUNREACH)),
            Some(ConnectFailure::Unreachable(
                io::Error::from_raw_os_error(libc::EHOSTUNREACH).to_string()
            ))
        );
        assert!(matches!(
            connect_failure(&io::Error::from_raw_os_error(libc::ENETUNREACH)),
            Some(ConnectFailure::Unreachable(_))
        ));
        let tls = io::Error::new(
            io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer),
        );
        let Some(ConnectFailure::Tls(why)) = connect_failure(&tls) else {
            panic!("{tls}")
        };
        assert!(
            why.contains("not signed by a CA this kubeconfig trusts"),
            "{why}"
        );
        // A timeout that is not a connection's (a body's read) is not a connect failure.
        assert_eq!(connect_failure(&io(io::ErrorKind::TimedOut)), None);
        assert_eq!(connect_failure(&io(io::ErrorKind::Other)), None);
    }

    #[test]
    fn the_budget_counts_every_body_together() {
        let b = Budget {
            limit: 10,
            read: AtomicU64::new(0),
        };
        assert!(b.take(6));
        assert!(b.take(4));
        assert!(!b.take(1));
    }
}
