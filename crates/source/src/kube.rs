//! The Kubernetes API source: four watchers (Services, EndpointSlices, this Node, ServiceCIDRs)
//! folded into the one store ([`crate::store`]), the same ClusterState the manifest source fills. Owns:
//! which objects are watched (upstream's label selectors, docs/upstream-semantics.md
//! §a.1/§f), when the first sync may happen (Services, EndpointSlices and the Node listed), and
//! how relists are applied (atomically per kind, see [`fold`]).
//!
//! Memory: objects are decoded one at a time as the bytes of a list page or a watch
//! arrive ([`split`] for JSON; Services and EndpointSlices are listed and watched in
//! protobuf, [`proto`]), into slim types holding only what ingest reads ([`slim`],
//! [`proto`]), and ingested at once; a relist buffers the ingested updates, not objects
//! ([`reflect`], [`fold`]). The initial list is streamed on a watch
//! (`sendInitialEvents`) where the API server offers it, else paged (docs/scale.md).
//!
//! [`list_once`] is the one-shot read of `kproxy plan`, `explain` and `trace`: the same
//! targets, lists, decoding and fold, each kind listed once, no watch.
//!
//! Failure model ([`reflect`]): a dropped watch resumes from the last resourceVersion,
//! 410 Gone relists, a 429 is asked again (the same request, not before its
//! `Retry-After`, jittered), errors are retried with client-go's backoff (0.8 s
//! doubling to 30 s, jittered), cut short for every kind once one of them hears from
//! the API again ([`reflect::Siblings`]). Meanwhile the last state stays in place, so the rules
//! already programmed keep serving.

pub mod bounded;
pub mod fold;
pub mod kubeconfig;
pub mod proto;
pub mod reflect;
pub mod slim;
pub mod split;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use kproxy_core::ClusterState;
use kproxy_core::ingest::{self, IngestError, Kind, Ownership};
use kproxy_core::state::Update;
use tokio::sync::mpsc;

use crate::Writer;
use fold::{Folder, Input};
use reflect::{Decoder, Target};

/// What the Kubernetes source needs to know.
#[derive(Clone, Debug, Default)]
pub struct KubeSourceConfig {
    /// This node's name (`--hostname-override`, else the host name): selects the Node
    /// watched and which endpoints are local.
    pub node_name: String,
    pub ownership: Ownership,
    /// Objects per list page; `None`: [`PAGE_SIZE`]. Tests page through small clusters
    /// with small pages.
    pub page_size: Option<u32>,
    /// List Services and EndpointSlices as JSON instead of protobuf (kube-proxy's
    /// `clientConnection.contentType: application/json`).
    pub json_lists: bool,
    /// How long a list or watch connection may stay silent before it is presumed dead
    /// ([`reflect::Target::idle`]); `None`: [`reflect::WATCH_IDLE`]. Tests that stop a
    /// server mid-watch use a short one.
    pub watch_idle: Option<std::time::Duration>,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(
        "node name {0:?} is not a valid Kubernetes node name (DNS subdomain: lower-case letters, digits, '-', '.'; at most 253)"
    )]
    InvalidNodeName(String),
    #[error(
        "service proxy name {0:?} is not a valid label value (1-63 letters, digits, '-', '_', '.', starting and ending alphanumeric)"
    )]
    InvalidServiceProxyName(String),
    // The sources' texts are in the messages, not also their chains: `{:#}` would
    // print each twice.
    #[error("cannot load kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("cannot read kubeconfig {path}: {why}")]
    KubeconfigRead { path: PathBuf, why: String },
    #[error("kubeconfig {origin}: {error}")]
    KubeconfigIn {
        origin: String,
        error: kube::config::KubeconfigError,
    },
    #[error("the kubeconfig's exec credential plugin {command:?}: {why}")]
    ExecPlugin { command: String, why: String },
    #[error("not running in a cluster: {0}")]
    InCluster(kube::config::InClusterError),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(kube::Error),
    #[error("{0}")]
    Unreachable(String),
    #[error("the Kubernetes watches ended")]
    WatchEnded,
    #[error("listing {kind} from the API server failed: {error}")]
    ListFailed { kind: Kind, error: String },
    #[error("reading ConfigMap {namespace}/{name}: {why}")]
    ConfigMap {
        namespace: String,
        name: String,
        why: String,
    },
}

/// Where the client's configuration comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Credentials {
    /// These kubeconfig files, merged as kubectl merges `$KUBECONFIG`'s (the first to
    /// set a value wins). `origin` names where the list came from (`--kubeconfig`,
    /// `$KUBECONFIG`…), for errors.
    Kubeconfig { files: Vec<PathBuf>, origin: String },
    /// The pod's service account (`KUBERNETES_SERVICE_HOST`, its token and CA).
    InCluster,
}

impl Credentials {
    /// One file, named by `origin`.
    pub fn file(path: &Path, origin: &str) -> Credentials {
        Credentials::Kubeconfig {
            files: vec![path.to_path_buf()],
            origin: origin.to_string(),
        }
    }
}

impl std::fmt::Display for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Kubeconfig { files, origin } => {
                let files: Vec<_> = files.iter().map(|p| p.display().to_string()).collect();
                write!(f, "{origin} ({})", files.join(":"))
            }
            Credentials::InCluster => f.write_str("the pod's service account"),
        }
    }
}

/// A client from a kubeconfig file, or the in-cluster configuration (service account
/// token and `KUBERNETES_SERVICE_HOST`) when `kubeconfig` is `None`, as kube-proxy.
/// `kproxy run`'s: unbounded calls, for its long-lived watches (the reflector bounds
/// their silence, [`reflect::WATCH_IDLE`]); TCP keepalive on its connections; no
/// retry layer of its own ([`client_from`]). The kubeconfig's exec credential plugin,
/// if any, must finish within [`bounded::DEFAULT_EXEC_TIMEOUT`] ([`build_within`]).
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, SourceError> {
    let credentials = match kubeconfig {
        Some(path) => Credentials::file(path, "--kubeconfig"),
        None => Credentials::InCluster,
    };
    let config = client_config(&credentials, None, Some(bounded::DEFAULT_CONNECT_TIMEOUT)).await?;
    build_within(config, bounded::DEFAULT_EXEC_TIMEOUT).await
}

/// TCP keepalive on the API server connections: the first probe after this much
/// silence (client-go's dialer's 30 s), then one every [`TCP_KEEPALIVE_INTERVAL`], the
/// connection dropped after [`TCP_KEEPALIVE_PROBES`] unanswered. A server host that
/// vanished, or a load balancer that forgot the connection, is known about a minute
/// later instead of never (a half-open connection sends no FIN or RST).
pub const TCP_KEEPALIVE: std::time::Duration = std::time::Duration::from_secs(30);
pub const TCP_KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
pub const TCP_KEEPALIVE_PROBES: u32 = 3;

/// The TCP connector of kproxy's API clients: keepalive as above.
pub fn tcp_connector() -> hyper_util::client::legacy::connect::HttpConnector {
    let mut http = hyper_util::client::legacy::connect::HttpConnector::new();
    http.enforce_http(false);
    http.set_keepalive(Some(TCP_KEEPALIVE));
    http.set_keepalive_interval(Some(TCP_KEEPALIVE_INTERVAL));
    http.set_keepalive_retries(Some(TCP_KEEPALIVE_PROBES));
    http
}

/// The client of `config`, built as kube builds its default one (base URI, TLS,
/// authentication, extra headers, connect/read/write timeouts) with two differences:
/// TCP keepalive ([`tcp_connector`]), and no retry layer. kube's (`RetryPolicy::
/// server_retry`) retried a 429 or 503 up to 15 times inside the request, sleeping
/// whatever `Retry-After` said with no cap and no log: one `Retry-After: 1000000000`
/// parked a watch for good. Every refusal now reaches the reflector, which caps and
/// jitters the server's delay in one place ([`reflect::server_delay`]). Runs the
/// kubeconfig's exec credential plugin, if any, as kube does (blocking; see
/// [`build_within`]). A proxy in the kubeconfig goes to kube's own builder (which
/// refuses it: kproxy builds kube without proxy support).
pub fn client_from(mut config: kube::Config) -> Result<kube::Client, SourceError> {
    use kube::client::ConfigExt;
    config.default_retry = false;
    if config.proxy_url.is_some() {
        return kube::Client::try_from(config).map_err(SourceError::Client);
    }
    let https = config
        .rustls_https_connector_with_connector(tcp_connector())
        .map_err(SourceError::Client)?;
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let client = hyper_util::client::legacy::Builder::new(hyper_util::rt::TokioExecutor::new())
        .build(connector);
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer().map_err(SourceError::Client)?)
        .layer(config.extra_headers_layer().map_err(SourceError::Client)?)
        .map_err(tower::BoxError::from)
        .service(client);
    Ok(kube::Client::new(service, config.default_namespace))
}

/// [`client_from`] on a blocking thread, waiting at most `wait`: building a client
/// runs the kubeconfig's exec credential plugin (`aws eks get-token`, kubelogin…)
/// synchronously, and a plugin that hangs hung `kproxy run` silently (330 s seen).
/// After `wait` the error names the plugin; the plugin itself is left to end.
pub async fn build_within(
    config: kube::Config,
    wait: std::time::Duration,
) -> Result<kube::Client, SourceError> {
    let command = config
        .auth_info
        .exec
        .as_ref()
        .and_then(|e| e.command.clone());
    // A thread of its own, not the blocking pool: the runtime waits for the pool's
    // threads when it shuts down, and a plugin that hangs must not keep kproxy from
    // exiting with the error.
    let (tx, rx) = tokio::sync::oneshot::channel();
    let runtime = tokio::runtime::Handle::current();
    std::thread::spawn(move || {
        let _entered = runtime.enter();
        let _ = tx.send(client_from(config));
    });
    match tokio::time::timeout(wait, rx).await {
        Ok(Ok(built)) => built,
        Ok(Err(_)) => Err(SourceError::Unreachable(
            "building the Kubernetes client: its thread ended".into(),
        )),
        Err(_) => Err(match command {
            Some(command) => SourceError::ExecPlugin {
                command,
                why: format!(
                    "did not finish within {wait:?}; it still runs, kproxy does not wait for it"
                ),
            },
            None => SourceError::Unreachable(format!(
                "building the Kubernetes client did not finish within {wait:?}"
            )),
        }),
    }
}

/// The client configuration `credentials` name, with `context` instead of the
/// kubeconfig's current context; a kubeconfig that is not a regular file is waited for
/// at most `wait` ([`kubeconfig::read`]). Its `default_namespace` is the context's
/// namespace (kubectl's default namespace), or the pod's namespace in a cluster.
pub async fn client_config(
    credentials: &Credentials,
    context: Option<&str>,
    wait: Option<std::time::Duration>,
) -> Result<kube::Config, SourceError> {
    let options = kube::config::KubeConfigOptions {
        context: context.map(str::to_string),
        ..Default::default()
    };
    match credentials {
        Credentials::Kubeconfig { files, .. } => {
            let kc = kubeconfig::read_merged(files, wait)?;
            kube::Config::from_custom_kubeconfig(kc, &options)
                .await
                .map_err(|error| SourceError::KubeconfigIn {
                    origin: credentials.to_string(),
                    error,
                })
        }
        Credentials::InCluster => kube::Config::incluster().map_err(SourceError::InCluster),
    }
}

/// The text of a failed call: a bounded client's own error ([`bounded::CallError`])
/// without kube's "ServiceError: " in front.
pub fn call_error_text(e: &kube::Error) -> String {
    match e {
        kube::Error::Service(inner) => inner.to_string(),
        other => other.to_string(),
    }
}

/// One small request (`GET /version`) before the reads: a server that cannot be
/// reached is said once, by its cause, not once per listed kind. Any HTTP answer
/// counts as reached (the lists say what a refusal means).
pub async fn reach(client: &kube::Client) -> Result<(), SourceError> {
    use http_body_util::BodyExt;
    let req = http::Request::get("/version")
        .body(kube::client::Body::empty())
        .map_err(|e| SourceError::Unreachable(e.to_string()))?;
    let res = client
        .send(req)
        .await
        .map_err(|e| SourceError::Unreachable(call_error_text(&e)))?;
    http_body_util::Limited::new(res.into_body(), 1 << 20)
        .collect()
        .await
        .map_err(|e| SourceError::Unreachable(format!("reading /version: {e}")))?;
    Ok(())
}

/// `GET path` (with its query) from the API server: the status and the body, whatever
/// the status (a proxied pod's 503 is an answer, not a failure), the body cut off with
/// an error beyond `max_bytes`. `Err`: the call failed (its cause, as
/// [`call_error_text`] says it) or the body was too large.
pub async fn get(
    client: &kube::Client,
    path: &str,
    max_bytes: usize,
) -> Result<(http::StatusCode, bytes::Bytes), String> {
    use http_body_util::BodyExt;
    let req = http::Request::get(path)
        .body(kube::client::Body::empty())
        .map_err(|e| format!("GET {path}: {e}"))?;
    let res = client.send(req).await.map_err(|e| call_error_text(&e))?;
    let status = res.status();
    let body = http_body_util::Limited::new(res.into_body(), max_bytes)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                format!("the answer is larger than {max_bytes} bytes")
            } else {
                format!("reading the answer: {e}")
            }
        })?
        .to_bytes();
    Ok((status, body))
}

/// Upstream's label selector for Services and EndpointSlices
/// (docs/upstream-semantics.md §a.1): skip headless and other proxies' objects; with
/// a service proxy name, take exactly that proxy's.
pub fn label_selector(ownership: &Ownership) -> String {
    match &ownership.service_proxy_name {
        None => format!(
            "!{},!{}",
            ingest::LABEL_HEADLESS,
            ingest::LABEL_SERVICE_PROXY_NAME
        ),
        Some(name) => format!(
            "!{},{}={name}",
            ingest::LABEL_HEADLESS,
            ingest::LABEL_SERVICE_PROXY_NAME
        ),
    }
}

/// The Node's field selector.
pub fn node_field_selector(node_name: &str) -> String {
    format!("metadata.name={node_name}")
}

/// DNS-1123 subdomain, as the API server requires of Node names.
fn valid_node_name(s: &str) -> bool {
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && alnum(b[0])
                && alnum(b[b.len() - 1])
                && b.iter().all(|&c| alnum(c) || c == b'-')
        })
}

/// A label value, as the API server requires (non-empty here: an empty name would be
/// ambiguous with "no service proxy name").
fn valid_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

impl KubeSourceConfig {
    /// Both strings reach a URL query and log lines: refuse what the API server would.
    pub fn validate(&self) -> Result<(), SourceError> {
        if !valid_node_name(&self.node_name) {
            return Err(SourceError::InvalidNodeName(self.node_name.clone()));
        }
        if let Some(name) = &self.ownership.service_proxy_name
            && !valid_label_value(name)
        {
            return Err(SourceError::InvalidServiceProxyName(name.clone()));
        }
        Ok(())
    }
}

/// The four watched collections, with upstream's selectors. ServiceCIDRs
/// (`networking.k8s.io/v1`, cluster-scoped, unselected as upstream) feed the drop of
/// traffic to unallocated service addresses; they do not gate the first sync.
pub fn targets(cfg: &KubeSourceConfig, page_size: u32) -> [Target; 4] {
    let labels = label_selector(&cfg.ownership);
    let target = |kind, url: &str, labels: Option<String>, fields: Option<String>| Target {
        kind,
        url: url.to_string(),
        label_selector: labels,
        field_selector: fields,
        page_size,
        protobuf: !cfg.json_lists,
        stream_lists: true,
        idle: cfg.watch_idle.unwrap_or(reflect::WATCH_IDLE),
    };
    [
        target(
            Kind::Service,
            "/api/v1/services",
            Some(labels.clone()),
            None,
        ),
        target(
            Kind::EndpointSlice,
            "/apis/discovery.k8s.io/v1/endpointslices",
            Some(labels),
            None,
        ),
        target(
            Kind::Node,
            "/api/v1/nodes",
            None,
            Some(node_field_selector(&cfg.node_name)),
        ),
        target(
            Kind::ServiceCidr,
            "/apis/networking.k8s.io/v1/servicecidrs",
            None,
            None,
        ),
    ]
}

/// Objects per list page. Each page is decoded object by object as its bytes arrive
/// ([`split`]), so the page size bounds no memory; it sets the number of round trips.
/// At 10k Services × 10 endpoints on a k8s-lab API server (1.36, lists served from
/// the watch cache), 500 per page (client-go's pager) took 1.7–2.1 s to list both
/// kinds, 5,000 per page 0.78–0.84 s, one unpaginated list 0.9 s (BENCHMARKS.md,
/// "kproxy run from the real API"). Pages still bound each request's work on API
/// servers that answer paginated lists from etcd.
pub const PAGE_SIZE: u32 = 5000;

/// Aborts the spawned reflectors when the source is dropped (cancelled).
struct AbortOnDrop<T = ()>(Vec<tokio::task::JoinHandle<T>>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Runs until cancelled (drop the future): reflectors for Services and EndpointSlices
/// (label selector as upstream, §f; with a service proxy name, the Services carrying
/// it) and this Node (field selector `metadata.name`), each decoding its objects on its
/// own task. Marks the store ready once all three have been listed. Relists on 410
/// Gone, resumes dropped watches, retries errors with backoff; the last state stays in
/// place meanwhile.
pub async fn run(
    client: kube::Client,
    cfg: KubeSourceConfig,
    handle: Writer,
) -> Result<(), SourceError> {
    cfg.validate()?;
    let decoder = Decoder::new(cfg.ownership.clone(), cfg.node_name.clone())
        .counting_into(handle.skipped_counter());
    // Lists are paginated consistent reads (no resourceVersion), which API servers
    // since 1.31 serve from the watch cache.
    let (tx, mut rx) = mpsc::channel(1024);
    let siblings = reflect::Siblings::new();
    let _reflectors = AbortOnDrop(
        targets(&cfg, cfg.page_size.unwrap_or(PAGE_SIZE))
            .into_iter()
            .map(|t| {
                let reflector = reflect::run(
                    client.clone(),
                    t,
                    decoder.clone(),
                    tx.clone(),
                    siblings.clone(),
                );
                tokio::spawn(reflector)
            })
            .collect(),
    );
    drop(tx);
    let mut folder: Folder<Update> = Folder::new();
    let mut ready = false;
    // Per kind: since when it has heard nothing from the API; whether it lost objects
    // it could not decode.
    let mut failing: BTreeMap<Kind, tokio::time::Instant> = BTreeMap::new();
    let mut lost: BTreeSet<Kind> = BTreeSet::new();
    let mut quiet = reflect::Quiet::default();
    tracing::info!(node = %cfg.node_name, label_selector = %label_selector(&cfg.ownership), "watching the Kubernetes API");
    while let Some((kind, event, received)) = rx.recv().await {
        match event {
            Input::Returned(at) => {
                handle.api_returned(at);
                failing.remove(&kind);
                handle.set_api_failing_since(failing.values().min().copied());
                continue;
            }
            Input::Failing(since) => {
                failing.insert(kind, since);
                handle.set_api_failing_since(failing.values().min().copied());
                continue;
            }
            Input::Lost(true) => {
                lost.insert(kind);
                handle.set_input_lost(true);
                continue;
            }
            Input::Lost(false) => {
                lost.remove(&kind);
                handle.set_input_lost(!lost.is_empty());
                continue;
            }
            _ => {}
        }
        let relist = matches!(event, Input::InitDone);
        let folding = tokio::time::Instant::now();
        let found = fold_into(&mut folder, &handle, &cfg, kind, event, received);
        // Skipped objects name kind, object and field; a flood of them (a server
        // sending garbage) is one line per interval, counted in full.
        for w in &found.skipped {
            handle.count_skipped(1);
            match quiet.note(tokio::time::Instant::now()) {
                Some(more) => tracing::warn!(more_since_last_line = more, "skipped {w}"),
                None => tracing::debug!("skipped {w}"),
            }
        }
        for w in &found.warnings {
            tracing::warn!("{w}");
        }
        if relist {
            // What the list's end cost before anything may be planned (a first list is
            // already in the state: only what a broken attempt left is removed).
            let fold_ms = folding.elapsed().as_secs_f64() * 1e3;
            tracing::info!(%kind, fold_ms, "listed");
        }
        if !ready && folder.all_listed() {
            ready = true;
            tracing::info!("Services, EndpointSlices and the Node listed: first sync allowed");
            handle.mark_ready();
        }
    }
    // The reflectors only end when this receiver is dropped.
    Err(SourceError::WatchEnded)
}

/// What folding input into the state reported.
#[derive(Debug, Default)]
pub struct Found {
    /// Objects skipped: they could not be decoded or ingested.
    pub skipped: Vec<IngestError>,
    /// Pieces of kept objects dropped, objects refused when applied.
    pub warnings: Vec<IngestError>,
}

/// Folds one reflector input into the state `handle` writes: the one fold of [`run`] and
/// [`list_once`].
fn fold_into(
    folder: &mut Folder<Update>,
    handle: &Writer,
    cfg: &KubeSourceConfig,
    kind: Kind,
    event: Input<Update>,
    received: tokio::time::Instant,
) -> Found {
    let (change, skipped) = folder.step(kind, event);
    let warnings = match change {
        Some(change) => handle.update_received(received, |state| {
            fold::apply_change(state, change, &cfg.ownership, &cfg.node_name)
        }),
        None => Vec::new(),
    };
    Found { skipped, warnings }
}

/// One read of the cluster: the state, what folding reported, and the kinds that
/// could not be listed without that stopping the read.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub state: ClusterState,
    pub found: Found,
    /// ServiceCIDRs, when their list failed (an API server without the resource): as
    /// in [`run`], they never keep the other kinds from being used.
    pub unlisted: Vec<(Kind, String)>,
}

/// Lists Services, EndpointSlices, the Node and ServiceCIDRs once each, concurrently,
/// with [`run`]'s targets, list and decoding ([`reflect::list_once`]) and its fold,
/// and returns when all are listed: no watch, no retry. A Service, EndpointSlice or
/// Node list that fails fails the read ([`SourceError::ListFailed`]); a ServiceCIDR
/// list that fails is reported in [`Snapshot::unlisted`].
pub async fn list_once(
    client: kube::Client,
    cfg: KubeSourceConfig,
) -> Result<Snapshot, SourceError> {
    cfg.validate()?;
    let decoder = Decoder::new(cfg.ownership.clone(), cfg.node_name.clone());
    let (tx, mut rx) = mpsc::channel(1024);
    let (kinds, tasks): (Vec<Kind>, Vec<_>) = targets(&cfg, cfg.page_size.unwrap_or(PAGE_SIZE))
        .into_iter()
        .map(|t| {
            let kind = t.kind;
            let task = reflect::list_once(client.clone(), t, decoder.clone(), tx.clone());
            (kind, tokio::spawn(task))
        })
        .unzip();
    let mut lists = AbortOnDrop(tasks);
    drop(tx);
    let (handle, _) = crate::store();
    let mut folder: Folder<Update> = Folder::new();
    let mut snapshot = Snapshot::default();
    while let Some((kind, event, received)) = rx.recv().await {
        let found = fold_into(&mut folder, &handle, &cfg, kind, event, received);
        snapshot.found.skipped.extend(found.skipped);
        snapshot.found.warnings.extend(found.warnings);
    }
    for (kind, task) in kinds.into_iter().zip(lists.0.iter_mut()) {
        let error = match task.await {
            Ok(Ok(())) => continue,
            Ok(Err(error)) => error,
            Err(e) => format!("the list task ended: {e}"),
        };
        // kube's "ServiceError: " (before a request's error, and a body's) adds nothing
        // to the bounded client's own message.
        let error = error.replace("ServiceError: ", "");
        if kind == Kind::ServiceCidr {
            snapshot.unlisted.push((kind, error));
        } else {
            return Err(SourceError::ListFailed { kind, error });
        }
    }
    snapshot.state = handle.update(std::mem::take);
    Ok(snapshot)
}

/// A ConfigMap holds at most 1 MiB (etcd's object limit); its JSON is read to
/// this many bytes and no further.
pub const MAX_CONFIG_MAP_BYTES: usize = 4 << 20;

/// The value of the first of `keys` that ConfigMap `namespace/name` holds, with that
/// key; `None` when the ConfigMap does not exist or holds none of them. The body is
/// read to [`MAX_CONFIG_MAP_BYTES`] at most.
pub async fn config_map_value(
    client: kube::Client,
    namespace: &str,
    name: &str,
    keys: &[&str],
) -> Result<Option<(String, String)>, SourceError> {
    use http_body_util::BodyExt;
    use k8s_openapi::api::core::v1::ConfigMap;
    let err = |why: String| SourceError::ConfigMap {
        namespace: namespace.to_string(),
        name: name.to_string(),
        why,
    };
    let req = kube::core::Request::new(format!("/api/v1/namespaces/{namespace}/configmaps"))
        .get(name, &kube::api::GetParams::default())
        .map_err(|e| err(e.to_string()))?;
    let res = client
        .send(req.map(kube::client::Body::from))
        .await
        .map_err(|e| err(call_error_text(&e)))?;
    let status = res.status();
    if status == http::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    let body = http_body_util::Limited::new(res.into_body(), MAX_CONFIG_MAP_BYTES)
        .collect()
        .await
        .map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                err(format!(
                    "the answer is larger than {MAX_CONFIG_MAP_BYTES} bytes (a ConfigMap holds at most 1 MiB)"
                ))
            } else {
                err(format!("reading the answer: {e}"))
            }
        })?
        .to_bytes();
    if !status.is_success() {
        let message = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_string());
        return Err(err(format!("{status}: {message}")));
    }
    let cm: ConfigMap = serde_json::from_slice(&body)
        .map_err(|e| err(format!("the answer is not a ConfigMap: {e}")))?;
    let mut data = cm.data.unwrap_or_default();
    Ok(keys
        .iter()
        .find_map(|k| data.remove(*k).map(|v| (k.to_string(), v))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API connections had no TCP keepalive: a server host gone without a FIN or
    /// RST left them ESTABLISHED for good (423 s seen). Every connection kproxy's
    /// clients open now probes after 30 s of silence.
    #[tokio::test]
    async fn api_connections_have_tcp_keepalive() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: http::Uri = format!("http://{}", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        let mut connector = tcp_connector();
        let io = tower::Service::call(&mut connector, uri).await.unwrap();
        let sock = socket2::SockRef::from(io.inner());
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), TCP_KEEPALIVE);
        assert_eq!(
            sock.tcp_keepalive_interval().unwrap(),
            TCP_KEEPALIVE_INTERVAL
        );
        assert_eq!(sock.tcp_keepalive_retries().unwrap(), TCP_KEEPALIVE_PROBES);
    }

    /// An exec credential plugin that hangs hung `kproxy run` silently (330 s seen):
    /// building the client now ends after the bound with an error naming the plugin.
    #[tokio::test]
    async fn an_exec_plugin_that_hangs_ends_with_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"http://127.0.0.1:9\"}\n\
             users:\n- name: u\n  user:\n    exec: {apiVersion: client.authentication.k8s.io/v1, command: sleep, args: [\"5\"], interactiveMode: Never}\n\
             contexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\n",
        )
        .unwrap();
        let config = client_config(&Credentials::file(&kubeconfig, "--kubeconfig"), None, None)
            .await
            .unwrap();
        let built = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            build_within(config, std::time::Duration::from_millis(300)),
        )
        .await
        .expect("the bound ends the wait, not the plugin");
        let Err(e) = built else {
            panic!("a plugin that hangs built a client")
        };
        let e = e.to_string();
        assert!(
            e.contains("\"sleep\"") && e.contains("did not finish"),
            "{e}"
        );
    }

    #[test]
    fn selectors_are_upstreams() {
        assert_eq!(
            label_selector(&Ownership::default()),
            "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
        );
        assert_eq!(
            label_selector(&Ownership {
                service_proxy_name: Some("kproxy".into())
            }),
            "!service.kubernetes.io/headless,service.kubernetes.io/service-proxy-name=kproxy"
        );
        assert_eq!(node_field_selector("node-a"), "metadata.name=node-a");
    }

    #[test]
    fn names_that_reach_selectors_are_validated() {
        let cfg = |node: &str, spn: Option<&str>| KubeSourceConfig {
            node_name: node.into(),
            ownership: Ownership {
                service_proxy_name: spn.map(str::to_string),
            },
            page_size: None,
            json_lists: false,
            watch_idle: None,
        };
        for (node, spn, ok) in [
            ("node-a", None, true),
            ("ip-10-0-0-1.ec2.internal", None, true),
            ("Node-A", None, false),
            ("", None, false),
            ("a,metadata.name=b", None, false),
            ("node-", None, false),
            ("node-a", Some("kproxy"), true),
            ("node-a", Some("my_proxy.v1"), true),
            ("node-a", Some(""), false),
            ("node-a", Some("x,!y"), false),
            ("node-a", Some("-x"), false),
        ] {
            assert_eq!(cfg(node, spn).validate().is_ok(), ok, "{node:?} {spn:?}");
        }
        assert!(!valid_node_name(&"a".repeat(254)));
        assert!(!valid_label_value(&"a".repeat(64)));
    }
}
