//! A fake Kubernetes API server for tests (cargo feature `fake-api`): it speaks the real
//! list/watch protocol with real API JSON for Services, EndpointSlices and Nodes — lists
//! with a resourceVersion, chunked watch streams of ADDED/MODIFIED/DELETED/BOOKMARK/ERROR
//! lines — and, for a resource given protobuf, list pages and watch frames captured from
//! a real API server, served to a client that accepts protobuf (429 with `Retry-After`
//! too) — and lets a test script each response (slow lists, failing lists or watches, a
//! clean end of a watch, a dropped connection, a connection that goes silent, watches
//! that end as they open, garbage lines). It records the decoded
//! query of every request so a test can check selectors and resourceVersions.
//!
//! Other objects (namespaces, Services, pods, DaemonSets a tool creates or reads) are
//! kept in a generic store ([`objects::Objects`]: create, get, list, delete, pod logs),
//! and the pods' proxy subresource (`pods/NAME:PORT/proxy/PATH`, what `kproxy status`
//! reads) is forwarded to the stored pod's IP as the API server does, or answered by a
//! test's hook.
//!
//! It owns no network set-up: the caller binds the listener (so it can bind inside a
//! network namespace) and hands it to [`spawn`]. Not for production use.

pub mod objects;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::{Body, Bytes};
use axum::extract::State;
/// Re-exported so tests need no direct axum dependency.
pub use axum::http::StatusCode;
use axum::http::{HeaderMap, Method, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::{Notify, watch};

/// Locks a mutex of the fake server; a panicking test thread leaves plain data behind,
/// so a poisoned lock is still usable.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One step of a watch response.
pub enum Step {
    /// One line (an event, or garbage).
    Line(String),
    /// One protobuf watch frame (a `WatchEvent`'s bytes; the length prefix is added
    /// when served). Served only on a protobuf watch, as lines only on a JSON one.
    Frame(Bytes),
    /// End the response cleanly (as the server does at timeoutSeconds).
    Close,
    /// Abort the connection mid-stream (no final chunk): a dropped connection.
    Abort,
    /// Send nothing more and never end: the connection stays open and silent, as a
    /// half-open TCP connection (its server gone without a FIN or RST) looks to the
    /// client. Later steps go to the next watch connection.
    Stall,
}

/// The scripted steps of one resource's watch responses.
#[derive(Default)]
pub struct Steps {
    queue: Mutex<VecDeque<Step>>,
    /// Generation of the newest watch connection.
    current: AtomicU64,
    notify: Notify,
}

impl Steps {
    pub fn push(&self, step: Step) {
        lock(&self.queue).push_back(step);
        self.notify.notify_waiters();
    }

    /// Registers a new watch connection; older ones stop taking steps.
    fn connect(&self) -> u64 {
        let generation = self.current.fetch_add(1, Ordering::SeqCst) + 1;
        self.notify.notify_waiters();
        generation
    }

    /// The next step for connection `generation`; `None` once a newer one exists.
    async fn next(&self, generation: u64) -> Option<Step> {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.current.load(Ordering::SeqCst) != generation {
                return None;
            }
            if let Some(step) = lock(&self.queue).pop_front() {
                return Some(step);
            }
            notified.await;
        }
    }
}

/// What a list request answers.
pub struct ListReply {
    pub status: StatusCode,
    pub resource_version: String,
    pub items: Vec<Value>,
}

/// One resource (services, endpointslices, nodes, servicecidrs) of the fake server.
pub struct Resource {
    pub list_kind: &'static str,
    pub list: Mutex<ListReply>,
    /// Lists wait until this is true (a slow server).
    pub open: watch::Sender<bool>,
    /// Status of watch requests (non-200: the watch cannot start).
    pub watch_status: Mutex<StatusCode>,
    /// Steps not yet served, taken by the newest watch connection only (an older one,
    /// abandoned by the client, must not swallow them).
    pub steps: Arc<Steps>,
    /// Decoded query of every request, in order.
    pub requests: Mutex<Vec<BTreeMap<String, String>>>,
    /// Protobuf list pages (bodies captured from a real API server), served instead of
    /// `list` to a list request that accepts protobuf: the first page without a
    /// `continue` query, each next one for the token its predecessor carries.
    pub protobuf_pages: Mutex<Vec<(Option<String>, Bytes)>>,
    /// Watch requests that accept protobuf are answered in protobuf (`Step::Frame`s).
    pub protobuf_watches: std::sync::atomic::AtomicBool,
    /// The `Accept` header of every request, in order.
    pub accepts: Mutex<Vec<String>>,
    /// The next requests (lists, pages and watches) answer 429 with this `Retry-After`
    /// (seconds), each taking one.
    pub throttle: Mutex<VecDeque<u64>>,
    /// The same for requests of a list's next page (with a `continue` token) only.
    pub throttle_pages: Mutex<VecDeque<u64>>,
    /// Watches with `sendInitialEvents=true` are served (the list's items as ADDED
    /// lines, then the bookmark that ends them, then the steps); otherwise refused with
    /// 422 as by a server without the WatchList gate, and not recorded in `requests`.
    pub watch_lists: std::sync::atomic::AtomicBool,
    /// Watches with `sendInitialEvents=true` refused.
    pub refused_watch_lists: AtomicU64,
    /// Every watch (not a streamed list) ends as it opens: an empty 200 body.
    pub end_watches: std::sync::atomic::AtomicBool,
}

impl Resource {
    pub fn new(list_kind: &'static str) -> Resource {
        Resource {
            list_kind,
            list: Mutex::new(ListReply {
                status: StatusCode::OK,
                resource_version: "1".into(),
                items: Vec::new(),
            }),
            open: watch::Sender::new(true),
            watch_status: Mutex::new(StatusCode::OK),
            steps: Arc::new(Steps::default()),
            requests: Mutex::new(Vec::new()),
            protobuf_pages: Mutex::new(Vec::new()),
            protobuf_watches: std::sync::atomic::AtomicBool::new(false),
            accepts: Mutex::new(Vec::new()),
            throttle: Mutex::new(VecDeque::new()),
            throttle_pages: Mutex::new(VecDeque::new()),
            watch_lists: std::sync::atomic::AtomicBool::new(false),
            refused_watch_lists: AtomicU64::new(0),
            end_watches: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Serves `pages` (one protobuf list response each, in order) to list requests
    /// that accept protobuf.
    pub fn set_protobuf_pages(&self, pages: &[&[u8]]) {
        let mut token = None;
        let mut served = Vec::new();
        for page in pages {
            served.push((token.take(), Bytes::copy_from_slice(page)));
            let mut split = crate::kube::proto::ListSplitter::new();
            split
                .feed(page, |_| {})
                .expect("a protobuf list page (test data)");
            token = split
                .finish()
                .expect("a complete protobuf list page (test data)")
                .continue_token;
        }
        *lock(&self.protobuf_pages) = served;
    }

    /// What the next lists answer (200).
    pub fn set_list(&self, resource_version: &str, items: Vec<Value>) {
        *lock(&self.list) = ListReply {
            status: StatusCode::OK,
            resource_version: resource_version.into(),
            items,
        };
    }

    /// The items the next lists answer.
    pub fn list_items(&self) -> Vec<Value> {
        lock(&self.list).items.clone()
    }

    /// Lists answer `status` (with a Status object) until the next `set_list`.
    pub fn fail_lists(&self, status: StatusCode) {
        lock(&self.list).status = status;
    }

    /// Watch requests answer `status` (OK: they stream).
    pub fn set_watch_status(&self, status: StatusCode) {
        *lock(&self.watch_status) = status;
    }

    /// Queues a watch event `{"type": kind, "object": object}`.
    pub fn event(&self, kind: &str, object: Value) {
        self.line(json!({"type": kind, "object": object}).to_string());
    }

    /// Queues one raw line on the watch stream.
    pub fn line(&self, line: String) {
        self.steps.push(Step::Line(line));
    }

    /// Answers watch requests that accept protobuf in protobuf from now on.
    pub fn serve_protobuf_watches(&self) {
        self.protobuf_watches.store(true, Ordering::SeqCst);
    }

    /// Queues the frames of a protobuf watch body (as captured from a real API server:
    /// each a 4-byte big-endian length and a `WatchEvent`), one step each.
    pub fn frames(&self, body: &[u8]) {
        let mut framer = crate::kube::proto::WatchFramer::new();
        framer
            .feed(body, |frame| {
                self.steps.push(Step::Frame(Bytes::copy_from_slice(frame)));
                true
            })
            .expect("a protobuf watch body (test data)");
        assert!(
            framer.at_boundary(),
            "a whole protobuf watch body (test data)"
        );
    }

    /// The next `n` requests answer 429 Too Many Requests with `Retry-After: seconds`.
    pub fn throttle(&self, n: usize, seconds: u64) {
        lock(&self.throttle).extend(std::iter::repeat_n(seconds, n));
    }

    /// The next `n` requests of a list's next page answer 429 with `Retry-After: seconds`.
    pub fn throttle_pages(&self, n: usize, seconds: u64) {
        lock(&self.throttle_pages).extend(std::iter::repeat_n(seconds, n));
    }

    /// Serves streamed lists (`sendInitialEvents=true`) from now on.
    pub fn serve_watch_lists(&self) {
        self.watch_lists.store(true, Ordering::SeqCst);
    }

    /// Queues a clean end of the current watch response.
    pub fn close(&self) {
        self.steps.push(Step::Close);
    }

    /// Queues a dropped connection.
    pub fn abort(&self) {
        self.steps.push(Step::Abort);
    }

    /// Queues a stall: the current watch connection goes silent for good.
    pub fn stall(&self) {
        self.steps.push(Step::Stall);
    }

    /// Ends every watch as it opens (`true`), or serves them again (`false`).
    pub fn end_watches(&self, end: bool) {
        self.end_watches.store(end, Ordering::SeqCst);
    }

    pub fn requests(&self) -> Vec<BTreeMap<String, String>> {
        lock(&self.requests).clone()
    }

    /// How many lists started (a list of several pages counts once).
    pub fn lists(&self) -> usize {
        self.requests()
            .iter()
            .filter(|q| !q.contains_key("watch") && !q.contains_key("continue"))
            .count()
    }

    /// The queries of the watch requests, in order.
    pub fn watches(&self) -> Vec<BTreeMap<String, String>> {
        self.requests()
            .into_iter()
            .filter(|q| q.contains_key("watch"))
            .collect()
    }
}

/// A test's answer to a GET through the pods' proxy subresource: given the Pod object,
/// the port and the path (with its query), `Some((status, body))`, or `None` to
/// forward the request to the pod's IP as the API server does.
pub type PodProxy = dyn Fn(&Value, u16, &str) -> Option<(StatusCode, String)> + Send + Sync;

/// The fake API server's state: one [`Resource`] per kind kproxy watches, the
/// ConfigMaps a GET can read (`kproxy plan` reads the node's configuration from one),
/// and the store of every other object.
pub struct FakeApi {
    pub services: Resource,
    pub slices: Resource,
    pub nodes: Resource,
    pub service_cidrs: Resource,
    /// By (namespace, name): each a ConfigMap object as the API serves it.
    pub config_maps: Mutex<BTreeMap<(String, String), Value>>,
    /// Every other object: what a tool creates, reads and deletes.
    pub objects: objects::Objects,
    /// Answers GETs through the pods' proxy subresource instead of the pods (see
    /// [`PodProxy`]).
    pub pod_proxy: Mutex<Option<Arc<PodProxy>>>,
    /// Every request served, of any path.
    pub requests_served: AtomicU64,
}

impl Default for FakeApi {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeApi {
    pub fn new() -> FakeApi {
        FakeApi {
            services: Resource::new("ServiceList"),
            slices: Resource::new("EndpointSliceList"),
            nodes: Resource::new("NodeList"),
            service_cidrs: Resource::new("ServiceCIDRList"),
            config_maps: Mutex::new(BTreeMap::new()),
            objects: objects::Objects::default(),
            pod_proxy: Mutex::new(None),
            requests_served: AtomicU64::new(0),
        }
    }

    /// Stores `object` as the API serves it, at `{api}/namespaces/NS/{resource}/NAME`.
    fn store(&self, api: &str, resource: &str, object: Value) {
        let meta = &object["metadata"];
        let path = format!(
            "{api}/namespaces/{}/{resource}/{}",
            meta["namespace"].as_str().unwrap_or(""),
            meta["name"].as_str().unwrap_or("")
        );
        self.objects.insert(&path, object);
    }

    /// Serves `object`, a DaemonSet, by its namespace and name.
    pub fn set_daemon_set(&self, object: Value) {
        self.store("/apis/apps/v1", "daemonsets", object);
    }

    /// Serves `pods` (Pod objects) in place of the pods stored before: a namespace's list
    /// (by label selector), each by name, and the pods' proxy to each.
    pub fn set_pods(&self, pods: Vec<Value>) {
        let stored = self.objects.under("/api/v1/namespaces/");
        for (path, _) in stored.iter().filter(|(p, _)| p.contains("/pods/")) {
            self.objects.remove(path);
        }
        for pod in pods {
            self.store("/api/v1", "pods", pod);
        }
    }

    /// Answers proxied pod requests with `hook` (see [`PodProxy`]).
    pub fn set_pod_proxy(&self, hook: Arc<PodProxy>) {
        *lock(&self.pod_proxy) = Some(hook);
    }

    /// Serves ConfigMap `namespace/name` holding `data`.
    pub fn set_config_map(&self, namespace: &str, name: &str, data: Value) {
        let object = json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1"},
            "data": data});
        lock(&self.config_maps).insert((namespace.into(), name.into()), object);
    }
}

/// A GET of one ConfigMap: `/api/v1/namespaces/NS/configmaps/NAME`.
fn config_map(api: &FakeApi, path: &str) -> Option<Response> {
    let rest = path.strip_prefix("/api/v1/namespaces/")?;
    let (namespace, name) = rest.split_once("/configmaps/")?;
    let found = lock(&api.config_maps)
        .get(&(namespace.to_string(), name.to_string()))
        .cloned();
    Some(match found {
        Some(object) => axum::Json(object).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(status(StatusCode::NOT_FOUND, "NotFound")),
        )
            .into_response(),
    })
}

/// A GET through the pods' proxy subresource,
/// `/api/v1/namespaces/NS/pods/NAME:PORT/proxy/PATH`: the test's hook's answer, else the
/// pod's own (an HTTP/1.0 GET to its `status.podIP`), else a 503 Status saying why the
/// pod could not be reached, as the API server words it.
async fn pod_proxy(api: &FakeApi, uri: &Uri) -> Option<Response> {
    let rest = uri.path().strip_prefix("/api/v1/namespaces/")?;
    let (namespace, rest) = rest.split_once("/pods/")?;
    let (pod_port, path) = rest.split_once("/proxy")?;
    let (name, port) = pod_port.split_once(':')?;
    let port: u16 = port.parse().ok()?;
    let path = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let Some(pod) = api
        .objects
        .get(&format!("/api/v1/namespaces/{namespace}/pods/{name}"))
    else {
        let code = StatusCode::NOT_FOUND;
        return Some((code, axum::Json(status(code, "NotFound"))).into_response());
    };
    let hook = lock(&api.pod_proxy).clone();
    if let Some(answer) = hook.and_then(|h| h(&pod, port, &path)) {
        return Some(answer.into_response());
    }
    let ip = pod["status"]["podIP"].as_str().unwrap_or("");
    Some(match forward(ip, port, &path).await {
        Ok((code, body)) => (code, body).into_response(),
        Err(e) => {
            let code = StatusCode::SERVICE_UNAVAILABLE;
            let mut s = status(code, "ServiceUnavailable");
            s["message"] = json!(format!(
                "error trying to reach service: dial tcp {ip}:{port}: {e}"
            ));
            (code, axum::Json(s)).into_response()
        }
    })
}

/// `GET path` from `ip:port` over HTTP/1.0 (the server answers and closes): its status
/// and body.
async fn forward(ip: &str, port: u16, path: &str) -> std::io::Result<(StatusCode, String)> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let ip: std::net::IpAddr = ip
        .parse()
        .map_err(|_| std::io::Error::other(format!("no pod IP ({ip:?})")))?;
    let mut stream = tokio::net::TcpStream::connect((ip, port)).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {ip}:{port}\r\n\r\n").as_bytes())
        .await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    let answer = String::from_utf8_lossy(&answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse::<u16>().ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or_else(|| std::io::Error::other("not an HTTP answer"))?;
    Ok((code, body.to_string()))
}

/// A `Status` object as the API server sends it with an error.
pub fn status(code: StatusCode, reason: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("fake: {reason}"), "reason": reason, "code": code.as_u16()})
}

/// The object of the ERROR watch event for an expired resourceVersion (410 Gone).
pub fn gone() -> Value {
    status(StatusCode::GONE, "Expired")
}

/// The object of a BOOKMARK watch event.
pub fn bookmark(rv: &str, kind: &str, api_version: &str) -> Value {
    json!({"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": rv}})
}

/// A kubeconfig (http, no credentials) pointing at the fake server on `addr`.
pub fn kubeconfig(addr: SocketAddr) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"http://{addr}\"}}\n\
         users:\n- name: u\n  user: {{}}\ncontexts:\n- name: c\n  context: {{cluster: fake, user: u}}\ncurrent-context: c\n"
    )
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(v) => out.push(v),
                    Err(_) => out.extend_from_slice(&b[i..i + 3]),
                }
                i += 3;
                continue;
            }
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(uri: &Uri) -> BTreeMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// The request handler: lists and watches of the four cluster-wide collections, GETs
/// of ConfigMaps, the pods' proxy, and the other objects' store.
pub async fn serve(
    State(api): State<Arc<FakeApi>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    api.requests_served.fetch_add(1, Ordering::SeqCst);
    if method == Method::GET
        && let Some(response) = config_map(&api, uri.path())
    {
        return response;
    }
    if method == Method::GET
        && let Some(response) = pod_proxy(&api, &uri).await
    {
        return response;
    }
    let res = match uri.path() {
        "/api/v1/services" => &api.services,
        "/apis/discovery.k8s.io/v1/endpointslices" => &api.slices,
        "/api/v1/nodes" => &api.nodes,
        "/apis/networking.k8s.io/v1/servicecidrs" => &api.service_cidrs,
        path => {
            if let Some(response) = api.objects.serve(&method, path, &query(&uri), &body) {
                return response;
            }
            return (
                StatusCode::NOT_FOUND,
                axum::Json(status(StatusCode::NOT_FOUND, "NotFound")),
            )
                .into_response();
        }
    };
    let q = query(&uri);
    let watch_list = q.get("sendInitialEvents").map(String::as_str) == Some("true");
    if watch_list && !res.watch_lists.load(Ordering::SeqCst) {
        res.refused_watch_lists.fetch_add(1, Ordering::SeqCst);
        let code = StatusCode::UNPROCESSABLE_ENTITY;
        return (code, axum::Json(status(code, "Invalid"))).into_response();
    }
    lock(&res.requests).push(q.clone());
    let accept = headers
        .get("accept")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    lock(&res.accepts).push(accept.clone());
    let accepts_protobuf = accept.contains(crate::kube::proto::MEDIA_TYPE);
    let throttled = match lock(&res.throttle).pop_front() {
        Some(s) => Some(s),
        None if q.contains_key("continue") => lock(&res.throttle_pages).pop_front(),
        None => None,
    };
    if let Some(seconds) = throttled {
        let code = StatusCode::TOO_MANY_REQUESTS;
        return (
            code,
            [("retry-after", seconds.to_string())],
            axum::Json(status(code, "TooManyRequests")),
        )
            .into_response();
    }
    if q.get("watch").map(String::as_str) == Some("true") {
        let code = *lock(&res.watch_status);
        if code != StatusCode::OK {
            return (code, axum::Json(status(code, "InternalError"))).into_response();
        }
        if res.end_watches.load(Ordering::SeqCst) && !watch_list {
            return Response::builder()
                .header("content-type", "application/json")
                .body(Body::empty())
                .expect("static headers are valid");
        }
        let protobuf =
            accepts_protobuf && res.protobuf_watches.load(Ordering::SeqCst) && !watch_list;
        let steps = res.steps.clone();
        let generation = steps.connect();
        // A streamed list: the items as ADDED events, then the bookmark that ends them.
        let initial: Vec<Bytes> = if watch_list {
            let list = lock(&res.list);
            let mut lines: Vec<Bytes> = list
                .items
                .iter()
                .map(|o| Bytes::from(json!({"type": "ADDED", "object": o}).to_string() + "\n"))
                .collect();
            let mut end = bookmark(&list.resource_version, "", "");
            end["metadata"]["annotations"] = json!({"k8s.io/initial-events-end": "true"});
            lines.push(Bytes::from(
                json!({"type": "BOOKMARK", "object": end}).to_string() + "\n",
            ));
            lines
        } else {
            Vec::new()
        };
        let initial = futures::stream::iter(initial.into_iter().map(Ok::<_, std::io::Error>));
        let body = futures::stream::unfold(Some(steps), move |steps| async move {
            let steps = steps?;
            loop {
                let chunk = match steps.next(generation).await? {
                    Step::Line(l) if !protobuf => Bytes::from(l + "\n"),
                    Step::Frame(f) if protobuf => {
                        let len = u32::try_from(f.len()).expect("a frame under 4 GiB");
                        let mut framed = len.to_be_bytes().to_vec();
                        framed.extend_from_slice(&f);
                        Bytes::from(framed)
                    }
                    // A step of the other encoding: not for this watch.
                    Step::Line(_) | Step::Frame(_) => continue,
                    Step::Close => return None,
                    Step::Stall => {
                        std::future::pending::<()>().await;
                        return None;
                    }
                    Step::Abort => {
                        return Some((
                            Err(std::io::Error::other("connection dropped by the test")),
                            None,
                        ));
                    }
                };
                return Some((Ok::<_, std::io::Error>(chunk), Some(steps)));
            }
        });
        let body = futures::StreamExt::chain(initial, body);
        let content_type = if protobuf {
            "application/vnd.kubernetes.protobuf;stream=watch"
        } else {
            "application/json"
        };
        return Response::builder()
            .header("content-type", content_type)
            .body(Body::from_stream(body))
            .expect("static headers are valid");
    }
    let mut open = res.open.subscribe();
    let _ = open.wait_for(|o| *o).await;
    if accepts_protobuf {
        let pages = lock(&res.protobuf_pages);
        if let Some((_, page)) = pages.iter().find(|(t, _)| t.as_ref() == q.get("continue")) {
            // In 7-byte pieces, so the client meets keys, lengths and items cut apart.
            let pieces: Vec<Result<Bytes, std::io::Error>> = page
                .chunks(7)
                .map(|c| Ok(Bytes::copy_from_slice(c)))
                .collect();
            return Response::builder()
                .header("content-type", crate::kube::proto::MEDIA_TYPE)
                .body(Body::from_stream(futures::stream::iter(pieces)))
                .expect("static headers are valid");
        }
    }
    let list = lock(&res.list);
    if list.status != StatusCode::OK {
        return (
            list.status,
            axum::Json(status(list.status, "InternalError")),
        )
            .into_response();
    }
    let api_version = if res.list_kind == "EndpointSliceList" {
        "discovery.k8s.io/v1"
    } else {
        "v1"
    };
    // Pages as the API server does: `limit` objects, and a `continue` token (here the
    // offset of the next page) while more remain.
    let offset: usize = q
        .get("continue")
        .and_then(|c| c.parse().ok())
        .unwrap_or(0)
        .min(list.items.len());
    let end = q
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .map_or(list.items.len(), |l| (offset + l).min(list.items.len()));
    let mut metadata = json!({"resourceVersion": list.resource_version});
    if end < list.items.len() {
        metadata["continue"] = json!(end.to_string());
    }
    let body = json!({
        "kind": res.list_kind, "apiVersion": api_version,
        "metadata": metadata,
        "items": &list.items[offset..end],
    });
    axum::Json(body).into_response()
}

/// Serves `api` on `listener` (bound by the caller, possibly inside a network
/// namespace) until the task is aborted or its runtime shuts down.
pub fn spawn(
    listener: tokio::net::TcpListener,
    api: Arc<FakeApi>,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    let app = axum::Router::new().fallback(serve).with_state(api);
    tokio::spawn(async move { axum::serve(listener, app).await })
}

/// Serves `api` on a free port of 127.0.0.1, on a runtime of its own (one worker), for
/// tests and benches that run kproxy as a process: the runtime, which serves until it
/// is dropped, and the address.
pub fn serve_on_loopback(
    api: Arc<FakeApi>,
) -> std::io::Result<(tokio::runtime::Runtime, SocketAddr)> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    Ok((serve_on_runtime(listener, api, || {})?, addr))
}

/// Serves `api` on `listener` (bound by the caller, e.g. from a thread inside a network
/// namespace) on a runtime of its own (one worker) whose threads first run
/// `on_thread_start` (e.g. enter that namespace, so that the pods proxy connects to
/// pods from it): the runtime, which serves until it is dropped.
pub fn serve_on_runtime(
    listener: std::net::TcpListener,
    api: Arc<FakeApi>,
    on_thread_start: impl Fn() + Send + Sync + 'static,
) -> std::io::Result<tokio::runtime::Runtime> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .on_thread_start(on_thread_start)
        .enable_all()
        .build()?;
    {
        let _entered = runtime.enter();
        spawn(tokio::net::TcpListener::from_std(listener)?, api);
    }
    Ok(runtime)
}
