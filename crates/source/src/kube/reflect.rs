//! One kind's list-then-watch loop against the API server (client-go's reflector, in
//! kproxy's terms). Owns: the initial list, streamed on a watch (`sendInitialEvents`)
//! where the server offers it, else paged; decoding each object on its own as its
//! bytes arrive (one object's bytes in memory at a time, never a page or a list of
//! objects; protobuf or JSON, as the server answers, for lists and watch events alike);
//! resuming a dropped watch from the last resourceVersion, relisting on 410 Gone,
//! asking a request refused for load (429) again after its `Retry-After` (capped at
//! [`MAX_SERVER_DELAY`] and jittered, [`server_delay`]: the one place a server-given
//! delay becomes a wait) without losing the watch's place, and backing off on errors
//! without flooding the log. A connection silent for [`WATCH_IDLE`] is presumed dead
//! and left; lists and watches that end at once back off ([`Backoff::churned`]);
//! an object that cannot be decoded is never taken as deleted ([`Backoff::undecodable`]);
//! warnings that can repeat per event are rate-limited ([`Quiet`]).
//!
//! Every object goes out as a [`fold::Input`] carrying the ingested [`Update`] (or why
//! the object was skipped), over a bounded channel: a slow consumer slows the reader
//! down instead of growing a queue.

use std::time::Duration;

use kproxy_core::ingest::{IngestError, Kind, Ownership};
use kproxy_core::state::Update;
use kube::core::params::{ListParams, WatchParams};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::fold::{self, Input, Key};
use super::proto;
use super::slim::{self, Coordinates};
use super::split::Splitter;

mod backoff;

pub use backoff::{Backoff, Siblings};

/// What one reflector lists and watches.
#[derive(Clone, Debug)]
pub struct Target {
    pub kind: Kind,
    /// The collection's path, e.g. `/api/v1/services`.
    pub url: String,
    pub label_selector: Option<String>,
    pub field_selector: Option<String>,
    /// Objects per list page (0: no limit). Pages are decoded object by object as
    /// their bytes arrive, so this bounds the work of one request, not memory.
    pub page_size: u32,
    /// Ask for protobuf lists and watches (Services and EndpointSlices only; see
    /// [`proto`]).
    pub protobuf: bool,
    /// List by a watch that streams the initial state first (KEP-3157:
    /// `sendInitialEvents=true`), falling back to paged lists for good when the server
    /// refuses it. [`list_once`] always pages.
    pub stream_lists: bool,
    /// No byte of a response (its head, a watch event or bookmark, a list's next piece)
    /// for this long: the connection is presumed dead (a half-open TCP connection left
    /// by a failed-over load balancer or a vanished API server host sends no FIN or
    /// RST) and the request is abandoned: a watch resumes from its resourceVersion, a
    /// list is asked again after the backoff. [`WATCH_IDLE`] in `kproxy run`.
    pub idle: Duration,
}

/// [`Target::idle`] of `kproxy run`: twice the API server's bookmark period. The watch
/// cache sends a watch that allows bookmarks one roughly every minute (and one before
/// the watch's `timeoutSeconds`, 290 s here, ends it), so a connection silent for two
/// minutes is not delivering. On a server that sends no periodic bookmarks a quiet
/// watch is resumed every two minutes: one request from its resourceVersion, no relist.
pub const WATCH_IDLE: Duration = Duration::from_secs(120);

/// How objects become updates: what ingest needs besides the object. Counts the
/// objects it could not decode (not those ingest refused: the API server validated
/// them, a decode failure is bytes kproxy could not read), so the reflector knows a
/// list or an event lost an object it cannot name ([`Backoff::undecodable`]).
#[derive(Debug)]
pub struct Decoder {
    pub ownership: Ownership,
    pub node_name: String,
    undecodable: AtomicU32,
    /// Events and objects skipped (malformed, of an unknown type, undecodable or
    /// refused by ingest), all reflectors of a source together: the daemon's
    /// `kproxy_api_skipped_total`.
    skipped: Arc<AtomicU64>,
    /// The warnings about them, at most one line per [`Quiet::INTERVAL`].
    quiet: Mutex<Quiet>,
}

/// A clone counts its own undecodable objects and quiets its own warnings (one
/// decoder per reflector); the skipped count is shared.
impl Clone for Decoder {
    fn clone(&self) -> Self {
        Decoder {
            skipped: self.skipped.clone(),
            ..Decoder::new(self.ownership.clone(), self.node_name.clone())
        }
    }
}

impl Decoder {
    pub fn new(ownership: Ownership, node_name: String) -> Decoder {
        Decoder {
            ownership,
            node_name,
            undecodable: AtomicU32::new(0),
            skipped: Arc::new(AtomicU64::new(0)),
            quiet: Mutex::new(Quiet::default()),
        }
    }

    /// This decoder, counting what it skips into `skipped` (shared with its clones).
    pub fn counting_into(mut self, skipped: Arc<AtomicU64>) -> Decoder {
        self.skipped = skipped;
        self
    }

    /// An event or object skipped: counted, and warned about at most once per
    /// [`Quiet::INTERVAL`] (a server sending garbage must not flood the log: one WARN
    /// per malformed event was 2 M lines in 22 s).
    pub fn skip(&self, kind: Kind, what: &str, detail: &dyn std::fmt::Display) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
        let quiet = self
            .quiet
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .note(Instant::now());
        match quiet {
            Some(more) => tracing::warn!(%kind, more_since_last_line = more,
                "{what} skipped: {detail}"),
            None => tracing::debug!(%kind, "{what} skipped: {detail}"),
        }
    }

    /// The warning for an object that could not be decoded, counted.
    fn undecodable(&self, kind: Kind, key: &Key, field: &str, reason: &str) -> IngestError {
        self.undecodable.fetch_add(1, Ordering::Relaxed);
        fold::decode_warning(kind, key, field, reason)
    }

    /// Objects that could not be decoded since the last call.
    fn take_undecodable(&self) -> u32 {
        self.undecodable.swap(0, Ordering::Relaxed)
    }

    /// Decodes and ingests one object (JSON text): its key, and the update or why it is
    /// skipped. Warnings about dropped pieces of a kept object are logged here.
    pub fn decode(
        &self,
        kind: Kind,
        json: &str,
        coords: &Coordinates,
    ) -> Result<Update, IngestError> {
        self.ingest(kind, slim::decode(kind, json), coords)
    }

    /// Ingests one decoded object (or reports why it could not be decoded).
    pub fn ingest(
        &self,
        kind: Kind,
        decoded: Result<kproxy_core::manifest::Object, slim::DecodeError>,
        coords: &Coordinates,
    ) -> Result<Update, IngestError> {
        let key = coords.key();
        let object = decoded.map_err(|e| self.undecodable(kind, &key, &e.field, &e.reason))?;
        let (update, warnings) = Update::of(&object, &self.ownership, &self.node_name)?;
        for w in &warnings {
            tracing::warn!("{w}");
        }
        Ok(update)
    }
}

/// A rate limit for warnings that can repeat once per event: the first line, then at
/// most one per [`Quiet::INTERVAL`], each saying how many it stands for.
#[derive(Debug, Default)]
pub struct Quiet {
    last: Option<Instant>,
    suppressed: u64,
}

impl Quiet {
    pub const INTERVAL: Duration = Duration::from_secs(10);

    /// One more at `now`: `Some(n)` when it is logged (`n` not logged since the last
    /// line), `None` when it is only counted.
    pub fn note(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(last) if now.saturating_duration_since(last) < Self::INTERVAL => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }
}

/// Each input with the instant its bytes were received (a watch event's line, or the
/// end of a list), from which a change's way to the kernel is timed.
pub type Sender = mpsc::Sender<(Kind, Input<Update>, Instant)>;

/// Why a list or watch ended.
#[derive(Debug)]
enum Stop {
    /// 410 Gone, or an event that cannot be resumed after: list again at once.
    Relist(String),
    /// Anything else: retry (the watch from the same resourceVersion) after the backoff.
    Failed(String),
    /// The server ended the watch (its timeout): watch again from the same version.
    Resume,
    /// The connection of a watch that had been running broke (a reset, a restarted
    /// load balancer or API server in between): watch again from the same version at
    /// once, as after [`Stop::Resume`]; the backoff is for a watch that cannot start.
    Broken(String),
    /// The server refused the request for load (429, or a `Retry-After`): retry the same
    /// request, the watch from the same version, after what it asked, capped and
    /// jittered ([`server_delay`]). kproxy's clients have kube's own retry layer off
    /// ([`super::client_from`]), so every refusal reaches this one place.
    Throttled {
        retry_after: Option<Duration>,
        error: String,
    },
    /// The server refused the request as invalid (400, 422): for a streamed list, a
    /// server that does not offer it; otherwise as [`Stop::Failed`].
    Invalid(String),
    /// The receiver is gone: the source is shutting down.
    Closed,
}

fn api_error(e: kube::Error) -> Stop {
    match &e {
        kube::Error::Api(s) if s.code == 410 => Stop::Relist(format!("410 Gone: {}", s.message)),
        _ => Stop::Failed(e.to_string()),
    }
}

#[derive(Deserialize, Default)]
#[serde(default)]
struct ListMeta {
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
    #[serde(rename = "continue")]
    continue_token: Option<String>,
}

/// One watch event line; the object stays raw text borrowed from the line.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    #[serde(borrow)]
    object: &'a RawValue,
}

#[derive(Deserialize)]
struct StatusCode {
    #[serde(default)]
    code: u16,
    #[serde(default)]
    message: String,
}

/// How long a watch must have run for a broken connection to be resumed at once: a
/// path that accepts and resets every connection must not make the watch spin.
const HEALTHY_WATCH: Duration = Duration::from_secs(1);

/// Why a watch's stream ended with an error after `lasted`: a watch that had been
/// running is resumed at once, one that broke at its start goes through the backoff.
fn stream_broke(error: String, lasted: Duration) -> Stop {
    if lasted >= HEALTHY_WATCH {
        Stop::Broken(error)
    } else {
        Stop::Failed(error)
    }
}

/// Lists and watches `target` until the receiver of `tx` is dropped; its backoff is
/// cut short when one of `siblings` (the other reflectors of the same API server)
/// hears from the server again.
///
/// Besides the objects, it tells the source ([`Input::Failing`], [`Input::Returned`])
/// when the kind stops hearing from the API and when it hears again, and
/// ([`Input::Lost`]) when a list or event held objects it could not decode, until a
/// list decodes whole.
pub async fn run(
    client: kube::Client,
    target: Target,
    decoder: Decoder,
    tx: Sender,
    siblings: Siblings,
) {
    let kind = target.kind;
    let request = kube::core::Request::new(target.url.clone());
    let mut backoff = Backoff::among(&siblings);
    let mut version: Option<String> = None;
    let mut stream_lists = target.stream_lists;
    loop {
        backoff.attempt();
        let began = Instant::now();
        let listing = version.is_none();
        // Counted per attempt: a list's or a watch's own objects.
        decoder.take_undecodable();
        if listing {
            backoff.relist_at = None;
        }
        let (stop, listed) = match &mut version {
            None if stream_lists => {
                let mut rv = String::new();
                let start = Start::InitialEvents;
                let stop = watch(
                    &client,
                    &request,
                    &target,
                    &decoder,
                    &tx,
                    start,
                    &mut rv,
                    &mut backoff,
                )
                .await;
                // Past the initial events the watch went on as any other: resume it.
                let listed = !rv.is_empty();
                if listed {
                    version = Some(rv);
                }
                if let (None, Stop::Invalid(why)) = (&version, &stop) {
                    tracing::info!(%kind, why = %why.escape_debug(),
                        "the API server does not stream lists (sendInitialEvents); listing in pages");
                    stream_lists = false;
                    continue;
                }
                (stop, listed)
            }
            None => match list(
                &client,
                &request,
                &target,
                &decoder,
                &tx,
                Some(&mut backoff),
            )
            .await
            {
                Ok(rv) => {
                    backoff.succeeded(kind);
                    if backoff.settle_return(&tx, kind).await.is_err() {
                        return;
                    }
                    version = Some(rv);
                    (Stop::Resume, true)
                }
                Err(stop) => (stop, false),
            },
            Some(rv) => {
                let start = Start::Version;
                let stop = watch(
                    &client,
                    &request,
                    &target,
                    &decoder,
                    &tx,
                    start,
                    rv,
                    &mut backoff,
                )
                .await;
                (stop, false)
            }
        };
        // A paged list that completed goes on to its watch at once.
        if listing && listed && matches!(stop, Stop::Resume) && !stream_lists {
            continue;
        }
        let lasted = began.elapsed() >= HEALTHY_WATCH && (!listing || listed);
        if failing(&stop)
            && backoff.failing_from_now()
            && send(&tx, kind, Input::Failing(Instant::now()))
                .await
                .is_err()
        {
            return;
        }
        match stop {
            Stop::Closed => return,
            Stop::Resume | Stop::Broken(_) | Stop::Relist(_) if !lasted => {
                let why = match &stop {
                    Stop::Resume if listing => {
                        "the streamed list ended before its last object".to_string()
                    }
                    Stop::Resume => "the watch ended at once".to_string(),
                    Stop::Broken(e) | Stop::Relist(e) => e.clone(),
                    _ => String::new(),
                };
                if matches!(stop, Stop::Relist(_)) {
                    version = None;
                }
                backoff.churned(kind, &why).await;
            }
            Stop::Resume => backoff.lasted(kind),
            Stop::Broken(error) => {
                backoff.lasted(kind);
                tracing::info!(%kind, error = %error.escape_debug(), "watch connection broke; resuming");
            }
            Stop::Relist(why) => {
                backoff.lasted(kind);
                tracing::info!(%kind, why = %why.escape_debug(), "relisting");
                version = None;
            }
            Stop::Failed(error) | Stop::Invalid(error) => {
                let what = if listing { "list" } else { "watch" };
                backoff.failed(kind, what, &error).await;
            }
            Stop::Throttled { retry_after, error } => {
                backoff.throttled(kind, "watch", retry_after, &error).await;
            }
        }
    }
}

/// Whether the attempt that ended so heard nothing usable from the API: a failure, a
/// refusal, a throttling.
fn failing(stop: &Stop) -> bool {
    matches!(
        stop,
        Stop::Failed(_) | Stop::Invalid(_) | Stop::Throttled { .. }
    )
}

/// Lists `target` once, with no watch after it and no retry but a refusal for load's: the one-shot read of
/// `kproxy plan`, `explain` and `trace` ([`super::list_once`]), through the same
/// [`list`] as [`run`]. The error says why the list failed.
pub async fn list_once(
    client: kube::Client,
    target: Target,
    decoder: Decoder,
    tx: Sender,
) -> Result<(), String> {
    let request = kube::core::Request::new(target.url.clone());
    // A page refused for load is asked again after the server's delay, capped
    // ([`server_delay`]), within the tools' own bounds on each call.
    let mut backoff = Backoff::new();
    match list(
        &client,
        &request,
        &target,
        &decoder,
        &tx,
        Some(&mut backoff),
    )
    .await
    {
        // The receiver is gone: nobody waits for this list any more.
        Ok(_) | Err(Stop::Closed | Stop::Resume) => Ok(()),
        Err(
            Stop::Relist(error)
            | Stop::Failed(error)
            | Stop::Invalid(error)
            | Stop::Broken(error)
            | Stop::Throttled { error, .. },
        ) => Err(error),
    }
}

async fn send(tx: &Sender, kind: Kind, input: Input<Update>) -> Result<(), Stop> {
    send_received(tx, kind, input, Instant::now()).await
}

async fn send_received(
    tx: &Sender,
    kind: Kind,
    input: Input<Update>,
    received: Instant,
) -> Result<(), Stop> {
    tx.send((kind, input, received))
        .await
        .map_err(|_| Stop::Closed)
}

fn item(decoder: &Decoder, kind: Kind, json: &str) -> (Key, Result<Update, IngestError>) {
    match Coordinates::of(json) {
        Some(c) => (c.key(), decoder.decode(kind, json, &c)),
        None => {
            let key = Key::default();
            let e = decoder.undecodable(kind, &key, ".", "not a JSON object");
            (key, Err(e))
        }
    }
}

/// One item's key and decoded update, from its text.
fn item_bytes(decoder: &Decoder, kind: Kind, json: &[u8]) -> (Key, Result<Update, IngestError>) {
    match std::str::from_utf8(json) {
        Ok(text) => item(decoder, kind, text),
        Err(_) => {
            let key = Key::default();
            let e = decoder.undecodable(kind, &key, ".", "not UTF-8 text");
            (key, Err(e))
        }
    }
}

/// One complete list, page by page, each page's items decoded as its bytes arrive
/// ([`split`] for JSON, [`proto`] for protobuf, which the Service and EndpointSlice
/// lists ask for): `Init`, one `Listed` per object, `InitDone`. Returns the list's
/// resourceVersion, to watch from. With a `backoff`, a page refused for load is asked
/// again after the wait the server asked for, the pages before it kept.
async fn list(
    client: &kube::Client,
    request: &kube::core::Request,
    target: &Target,
    decoder: &Decoder,
    tx: &Sender,
    mut backoff: Option<&mut Backoff>,
) -> Result<String, Stop> {
    use http_body_util::BodyExt;
    let kind = target.kind;
    send(tx, kind, Input::Init).await?;
    let mut params = ListParams {
        label_selector: target.label_selector.clone(),
        field_selector: target.field_selector.clone(),
        limit: (target.page_size > 0).then_some(target.page_size),
        ..ListParams::default()
    };
    let mut decoded = Vec::new();
    loop {
        let mut req = request
            .list(&params)
            .map_err(|e| Stop::Failed(e.to_string()))?;
        if target.protobuf && proto::lists_in_protobuf(kind) {
            req.headers_mut().insert(
                http::header::ACCEPT,
                http::HeaderValue::from_static(ACCEPT_PROTOBUF),
            );
        }
        let res = answer(client, req, target.idle).await?;
        let res = match (refused("list", res).await, backoff.as_deref_mut()) {
            (Ok(res), _) => res,
            (Err(Stop::Throttled { retry_after, error }), Some(backoff)) => {
                backoff.throttled(kind, "list", retry_after, &error).await;
                continue;
            }
            (Err(stop), _) => return Err(stop),
        };
        let mut page = Page::for_content_type(res.headers().get(http::header::CONTENT_TYPE));
        let mut body = res.into_body();
        loop {
            let frame = tokio::time::timeout(target.idle, body.frame())
                .await
                .map_err(|_| {
                    Stop::Failed(format!(
                        "no byte of the list for {:?}: the connection is presumed dead",
                        target.idle
                    ))
                })?;
            let Some(frame) = frame else { break };
            let frame =
                frame.map_err(|e| Stop::Failed(format!("reading the list response: {e}")))?;
            let Some(chunk) = frame.data_ref() else {
                continue;
            };
            let protobuf = matches!(page, Page::Protobuf(_));
            page.feed(chunk, |item| {
                decoded.push(page_item(decoder, kind, protobuf, item))
            })
            .map_err(|e| Stop::Failed(e.to_string()))?;
            for (key, update) in decoded.drain(..) {
                send(tx, kind, Input::Listed(key, update)).await?;
            }
        }
        let metadata = page.finish()?;
        match metadata.continue_token.filter(|c| !c.is_empty()) {
            Some(token) => params.continue_token = Some(token),
            None => {
                send(tx, kind, Input::InitDone).await?;
                if let Some(backoff) = backoff {
                    match decoder.take_undecodable() {
                        0 => backoff.decoded_whole(tx, kind).await?,
                        n => backoff.undecodable(tx, kind, n).await?,
                    }
                }
                return metadata
                    .resource_version
                    .ok_or_else(|| Stop::Failed("list without a resourceVersion".into()));
            }
        }
    }
}

/// Protobuf first; JSON from a server that cannot (an aggregated API, a fake).
const ACCEPT_PROTOBUF: &str = "application/vnd.kubernetes.protobuf, application/json";

/// Whether the server answered in protobuf (a list or a watch), by its Content-Type.
fn answered_protobuf(content_type: Option<&http::HeaderValue>) -> bool {
    content_type
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with(proto::MEDIA_TYPE))
}

/// One list page being split, in the encoding the server answered with.
enum Page {
    Json(Splitter),
    Protobuf(proto::ListSplitter),
}

impl Page {
    fn for_content_type(content_type: Option<&http::HeaderValue>) -> Page {
        let protobuf = answered_protobuf(content_type);
        if protobuf {
            Page::Protobuf(proto::ListSplitter::new())
        } else {
            Page::Json(Splitter::new())
        }
    }

    fn feed(
        &mut self,
        chunk: &[u8],
        item: impl FnMut(&[u8]),
    ) -> Result<(), super::split::SplitError> {
        match self {
            Page::Json(s) => s.feed(chunk, item),
            Page::Protobuf(s) => s.feed(chunk, item),
        }
    }

    fn finish(self) -> Result<ListMeta, Stop> {
        match self {
            Page::Json(s) => match s.finish() {
                Ok(Some(text)) => serde_json::from_slice(&text)
                    .map_err(|e| Stop::Failed(format!("undecodable list metadata: {e}"))),
                Ok(None) => Ok(ListMeta::default()),
                Err(e) => Err(Stop::Failed(e.to_string())),
            },
            Page::Protobuf(s) => s
                .finish()
                .map(|m| ListMeta {
                    resource_version: m.resource_version,
                    continue_token: m.continue_token,
                })
                .map_err(|e| Stop::Failed(e.to_string())),
        }
    }
}

/// One page item's key and decoded update, from its bytes in the page's encoding.
fn page_item(
    decoder: &Decoder,
    kind: Kind,
    protobuf: bool,
    item: &[u8],
) -> (Key, Result<Update, IngestError>) {
    if !protobuf {
        return item_bytes(decoder, kind, item);
    }
    match proto::coordinates(item) {
        Some(c) => (c.key(), decoder.ingest(kind, proto::decode(kind, item), &c)),
        None => {
            let key = Key::default();
            let e = decoder.undecodable(kind, &key, ".", "undecodable protobuf metadata");
            (key, Err(e))
        }
    }
}

/// The response, or why the server refused the request: a `Status` in JSON or
/// protobuf (a 410 Gone relists; a 429, or any refusal with a `Retry-After`, is
/// [`Stop::Throttled`]), else the HTTP status alone.
async fn refused(
    what: &str,
    res: http::Response<kube::client::Body>,
) -> Result<http::Response<kube::client::Body>, Stop> {
    use http_body_util::BodyExt;
    let code = res.status();
    if !(code.is_client_error() || code.is_server_error()) {
        return Ok(res);
    }
    let retry_after = res
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|v| retry_after(v.to_str().ok()?));
    // An error body is a small Status; a larger one is not read past this.
    let body = http_body_util::Limited::new(res.into_body(), 1 << 20)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let message = match proto::status(&body) {
        Some(s) => s.message.unwrap_or_default(),
        None => serde_json::from_slice::<StatusCode>(&body)
            .map(|s| s.message)
            .unwrap_or_else(|_| String::from_utf8_lossy(&body).trim().to_string()),
    };
    let error = format!("{what} refused: {code}: {message}");
    if code == http::StatusCode::GONE {
        Err(Stop::Relist(format!("410 Gone: {message}")))
    } else if code == http::StatusCode::TOO_MANY_REQUESTS || retry_after.is_some() {
        Err(Stop::Throttled { retry_after, error })
    } else if code == http::StatusCode::BAD_REQUEST
        || code == http::StatusCode::UNPROCESSABLE_ENTITY
    {
        Err(Stop::Invalid(error))
    } else {
        Err(Stop::Failed(error))
    }
}

/// The longest wait a server's answer (`Retry-After`) buys: kproxy's cap on every
/// delay a server gives, as its own failure backoff's (30 s, jittered to 60 s).
pub const MAX_SERVER_DELAY: Duration = Duration::from_secs(60);

/// A `Retry-After` header's wait as given, in delay-seconds (what the API server
/// sends); `None` for an HTTP date or garbage (the backoff decides). Capped by
/// [`server_delay`], not here, so the log can say what was asked.
fn retry_after(value: &str) -> Option<Duration> {
    let seconds: u64 = value.trim().parse().ok()?;
    Some(Duration::from_secs(seconds))
}

/// The wait for a server's `asked` delay, with `jitter` in [0, 1): at least what it
/// asked and up to twice that, so a fleet told the same second does not come back in
/// it, never more than [`MAX_SERVER_DELAY`]; a longer ask (or one that reaches the cap
/// with its jitter) is spread over the cap's last quarter (45–60 s). The one place
/// kproxy turns a server-given delay into a wait.
pub fn server_delay(asked: Duration, jitter: f64) -> Duration {
    let jitter = jitter.clamp(0.0, 1.0);
    if asked >= MAX_SERVER_DELAY {
        return MAX_SERVER_DELAY.mul_f64(0.75 + 0.25 * jitter);
    }
    asked + (MAX_SERVER_DELAY - asked).min(asked).mul_f64(jitter)
}

/// Protobuf watch events first (the server answers `;stream=watch` frames); JSON lines
/// from a server that cannot.
const ACCEPT_PROTOBUF_WATCH: &str =
    "application/vnd.kubernetes.protobuf;stream=watch, application/json";

/// One watch event as received, in the encoding the server answered with.
enum RawEvent<'a> {
    /// A JSON line; the object stays raw text borrowed from the line.
    Json(Event<'a>),
    /// A protobuf frame, decoded: the type and the object's message.
    Protobuf(proto::WatchEvent),
}

/// Whether a JSON `BOOKMARK` event's object carries [`proto::INITIAL_EVENTS_END`] =
/// "true" (the twin of [`proto::ends_initial_events`]).
fn json_ends_initial_events(object: &str) -> bool {
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct Annotated {
        metadata: Annotations,
    }
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct Annotations {
        annotations: Option<std::collections::BTreeMap<String, String>>,
    }
    serde_json::from_str::<Annotated>(object).is_ok_and(|a| {
        a.metadata
            .annotations
            .and_then(|m| m.get(proto::INITIAL_EVENTS_END).cloned())
            .as_deref()
            == Some("true")
    })
}

/// What one watch event asks of the watch loop.
enum Next {
    /// Send this input on.
    Send(Input<Update>),
    /// A bookmark: `rv` moved, nothing to send; true if it ends the initial events.
    Bookmark(bool),
    /// Nothing (an unknown or malformed event, logged).
    Skip,
    Stop(Stop),
}

/// What `event` means for the state and the watch: updates `rv` from its object.
fn next(decoder: &Decoder, kind: Kind, event: RawEvent<'_>, rv: &mut String) -> Next {
    let (type_, coords) = match &event {
        RawEvent::Json(e) => (e.kind, Coordinates::of(e.object.get())),
        RawEvent::Protobuf(e) => (e.type_.as_str(), proto::coordinates(&e.object)),
    };
    match type_ {
        "ADDED" | "MODIFIED" | "DELETED" => {
            let Some(c) = coords else {
                return Next::Stop(Stop::Relist(format!("{type_} event without an object")));
            };
            match &c.resource_version {
                Some(v) => v.clone_into(rv),
                None => {
                    return Next::Stop(Stop::Relist(format!(
                        "{type_} event without a resourceVersion"
                    )));
                }
            }
            if type_ == "DELETED" {
                return Next::Send(Input::Delete(c.key()));
            }
            let update = match &event {
                RawEvent::Json(e) => decoder.decode(kind, e.object.get(), &c),
                RawEvent::Protobuf(e) => decoder.ingest(kind, proto::decode(kind, &e.object), &c),
            };
            Next::Send(Input::Apply(c.key(), update))
        }
        "BOOKMARK" => {
            if let Some(v) = coords.and_then(|c| c.resource_version) {
                *rv = v;
            }
            Next::Bookmark(match &event {
                RawEvent::Json(e) => json_ends_initial_events(e.object.get()),
                RawEvent::Protobuf(e) => proto::ends_initial_events(&e.object),
            })
        }
        "ERROR" => {
            let status = match &event {
                RawEvent::Json(e) => serde_json::from_str::<StatusCode>(e.object.get()).ok(),
                RawEvent::Protobuf(e) => proto::status_of(&e.object).map(|s| StatusCode {
                    code: s.code.unwrap_or(0).try_into().unwrap_or(0),
                    message: s.message.unwrap_or_default(),
                }),
            };
            Next::Stop(match status {
                Some(s) if s.code == 410 => Stop::Relist(format!("410 Gone: {}", s.message)),
                Some(s) => Stop::Failed(format!("watch error {}: {}", s.code, s.message)),
                None => Stop::Failed("undecodable watch error".into()),
            })
        }
        other => {
            let other = other.escape_debug().to_string();
            decoder.skip(kind, "a watch event of an unknown type", &other);
            Next::Skip
        }
    }
}

/// A watch response's body split into events as its bytes arrive: JSON lines, or
/// protobuf frames ([`proto::WatchFramer`]) when the server answered in protobuf.
enum Stream {
    Json(Vec<u8>),
    Protobuf(proto::WatchFramer),
}

impl Stream {
    fn for_content_type(content_type: Option<&http::HeaderValue>) -> Stream {
        let protobuf = answered_protobuf(content_type);
        if protobuf {
            Stream::Protobuf(proto::WatchFramer::new())
        } else {
            Stream::Json(Vec::new())
        }
    }

    /// Feeds `chunk`, calling `event` with each complete event until it returns false.
    fn feed(
        &mut self,
        decoder: &Decoder,
        kind: Kind,
        chunk: &[u8],
        mut event: impl FnMut(RawEvent<'_>) -> bool,
    ) -> Result<(), String> {
        match self {
            Stream::Json(pending) => {
                pending.extend_from_slice(chunk);
                if pending.len() > super::split::MAX_VALUE_BYTES {
                    return Err(format!(
                        "a watch event line over {} bytes",
                        super::split::MAX_VALUE_BYTES
                    ));
                }
                let mut at = 0;
                while let Some(n) = pending[at..].iter().position(|&b| b == b'\n') {
                    let line = &pending[at..at + n];
                    at += n + 1;
                    if line.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    match serde_json::from_slice::<Event<'_>>(line) {
                        Ok(e) => {
                            if !event(RawEvent::Json(e)) {
                                break;
                            }
                        }
                        Err(e) => decoder.skip(kind, "a malformed watch event", &e),
                    }
                }
                pending.drain(..at);
                Ok(())
            }
            Stream::Protobuf(framer) => framer
                .feed(chunk, |frame| match proto::watch_event(frame) {
                    Ok(e) => event(RawEvent::Protobuf(e)),
                    Err(e) => {
                        decoder.skip(kind, "a malformed watch event", &e.escape_debug());
                        true
                    }
                })
                .map_err(|e| e.0),
        }
    }
}

/// Where a watch starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Start {
    /// From `rv`: changes after it.
    Version,
    /// With the current state first, as a list would bring it (`sendInitialEvents`,
    /// `resourceVersionMatch=NotOlderThan`, no resourceVersion: a consistent read):
    /// `Init`, a `Listed` per object, `InitDone` at the bookmark annotated
    /// [`proto::INITIAL_EVENTS_END`], then changes as after [`Start::Version`].
    InitialEvents,
}

/// One watch request, until the server or an error ends it. Updates `rv` as events
/// arrive (from [`Start::InitialEvents`], only once they have all arrived: until then
/// `rv` stays empty). Services and EndpointSlices are watched in protobuf when the
/// target asks for protobuf ([`proto`]), the rest in JSON.
#[expect(
    clippy::too_many_arguments,
    reason = "the watch loop's context, passed down once"
)]
async fn watch(
    client: &kube::Client,
    request: &kube::core::Request,
    target: &Target,
    decoder: &Decoder,
    tx: &Sender,
    start: Start,
    rv: &mut String,
    backoff: &mut Backoff,
) -> Stop {
    use http_body_util::BodyExt;
    let kind = target.kind;
    let mut initial = start == Start::InitialEvents;
    let params = WatchParams {
        label_selector: target.label_selector.clone(),
        field_selector: target.field_selector.clone(),
        bookmarks: true,
        send_initial_events: initial,
        ..WatchParams::default()
    };
    let mut req = match request.watch(&params, rv) {
        Ok(r) => r,
        Err(e) => return Stop::Failed(e.to_string()),
    };
    if target.protobuf && proto::lists_in_protobuf(kind) {
        req.headers_mut().insert(
            http::header::ACCEPT,
            http::HeaderValue::from_static(ACCEPT_PROTOBUF_WATCH),
        );
    }
    let res = match answer(client, req, target.idle).await {
        Ok(r) => r,
        Err(stop) => return stop,
    };
    let res = match refused("watch", res).await {
        Ok(r) => r,
        Err(stop) => return stop,
    };
    // A resumed watch is back once it delivers (an event or a bookmark); a 410 instead
    // leaves the return to the relist that follows. A streamed list is back once its
    // initial events are all in.
    if !initial {
        backoff.succeeded(kind);
    } else if let Err(stop) = send(tx, kind, Input::Init).await {
        return stop;
    }
    // The version of the initial events, until they have all arrived.
    let mut listing = String::new();
    let started = Instant::now();
    let mut stream = Stream::for_content_type(res.headers().get(http::header::CONTENT_TYPE));
    let mut body = res.into_body();
    let mut events = Vec::new();
    loop {
        // Until the connection's idle bound, or the relist that retries objects that
        // could not be decoded, whichever comes first.
        let idle_at = Instant::now() + target.idle;
        let until = backoff.relist_at.map_or(idle_at, |r| r.min(idle_at));
        let Ok(frame) = tokio::time::timeout_at(until, body.frame()).await else {
            if until < idle_at {
                return Stop::Relist("listing again the objects that could not be decoded".into());
            }
            return Stop::Broken(format!(
                "no event or bookmark for {:?}: the connection is presumed dead",
                target.idle
            ));
        };
        let chunk = match frame {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(chunk) => chunk,
                Err(_) => continue,
            },
            // The server's timeout ended the watch: resume from `rv` at once.
            None => return Stop::Resume,
            Some(Err(e)) => {
                return stream_broke(format!("watch stream: {e}"), started.elapsed());
            }
        };
        let received = Instant::now();
        let mut stop = None;
        let fed = stream.feed(decoder, kind, &chunk, |event| {
            let at = if initial { &mut listing } else { &mut *rv };
            match next(decoder, kind, event, at) {
                Next::Send(Input::Apply(key, update)) if initial => {
                    events.push(Some(Input::Listed(key, update)));
                    true
                }
                Next::Send(Input::Delete(_)) if initial => {
                    stop = Some(Stop::Relist("DELETED among the initial events".into()));
                    false
                }
                Next::Send(input) => {
                    events.push(Some(input));
                    true
                }
                Next::Bookmark(end) => {
                    if initial && end {
                        initial = false;
                        *rv = std::mem::take(&mut listing);
                        events.push(Some(Input::InitDone));
                    } else {
                        events.push(None);
                    }
                    true
                }
                Next::Skip => true,
                Next::Stop(s) => {
                    stop = Some(s);
                    false
                }
            }
        });
        let mut listed_now = false;
        for input in events.drain(..) {
            let done = matches!(input, Some(Input::InitDone));
            listed_now |= done;
            if let Some(input) = input
                && let Err(stop) = send_received(tx, kind, input, received).await
            {
                return stop;
            }
            if done {
                backoff.succeeded(kind);
            }
            if initial {
                continue;
            }
            if let Err(stop) = backoff.settle_return(tx, kind).await {
                return stop;
            }
        }
        if let Some(stop) = stop {
            return stop;
        }
        if let Err(e) = fed {
            return Stop::Failed(format!("watch stream: {e}"));
        }
        // Once the initial events are in, or at once for a change.
        if !initial {
            let n = decoder.take_undecodable();
            let outcome = if n > 0 {
                backoff.undecodable(tx, kind, n).await
            } else if listed_now {
                backoff.decoded_whole(tx, kind).await
            } else {
                Ok(())
            };
            if let Err(stop) = outcome {
                return stop;
            }
        }
    }
}

/// The response head of `req`, within `idle` ([`Target::idle`]): an API server that
/// takes the request and never answers (or a connection dead on the way) is not
/// waited for.
async fn answer(
    client: &kube::Client,
    req: http::Request<Vec<u8>>,
    idle: Duration,
) -> Result<http::Response<kube::client::Body>, Stop> {
    match tokio::time::timeout(idle, client.send(req.map(kube::client::Body::from))).await {
        Ok(Ok(res)) => Ok(res),
        Ok(Err(e)) => Err(api_error(e)),
        Err(_) => Err(Stop::Failed(format!(
            "no answer within {idle:?}: the server or the connection to it is not answering"
        ))),
    }
}

#[cfg(test)]
mod tests;
