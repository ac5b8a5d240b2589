//! One kind's list-then-watch loop against the API server (client-go's reflector, in
//! kproxy's terms). Owns: the initial list, streamed on a watch (`sendInitialEvents`)
//! where the server offers it, else paged; decoding each object on its own as its
//! bytes arrive (one object's bytes in memory at a time, never a page or a list of
//! objects; protobuf or JSON, as the server answers, for lists and watch events alike);
//! resuming a dropped watch from the last resourceVersion, relisting on 410 Gone,
//! asking a request refused for load (429) again after its `Retry-After` without
//! losing the watch's place, and backing off on errors without flooding the log.
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
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::fold::{self, Input, Key};
use super::proto;
use super::slim::{self, Coordinates};
use super::split::Splitter;

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
}

/// How objects become updates: what ingest needs besides the object.
#[derive(Clone, Debug)]
pub struct Decoder {
    pub ownership: Ownership,
    pub node_name: String,
}

impl Decoder {
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
        let object = decoded.map_err(|e| fold::decode_warning(kind, &key, &e.field, &e.reason))?;
        let (update, warnings) = Update::of(&object, &self.ownership, &self.node_name)?;
        for w in &warnings {
            tracing::warn!("{w}");
        }
        Ok(update)
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
    /// request, the watch from the same version, not sooner than it asked
    /// ([`Backoff::throttled`]). kube's client retries a 429 or 503 up to 15 times
    /// itself (RetryLayer, `RetryPolicy::server_retry`, sleeping exactly the
    /// `Retry-After`); this is the refusal that outlasts those retries.
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

/// The reflectors of one API server. When one of them hears from the server again
/// after failing, the others waiting out a backoff retry at once: an API server back
/// from an outage is back for every kind, and a view left stale for the rest of a
/// sibling's backoff (up to 60 s at its cap) is a view that routes to pods that are
/// gone. client-go's reflectors each wait out their own backoff; this costs a
/// recovered server no more requests than the backoffs ending would, only sooner.
#[derive(Clone, Debug)]
pub struct Siblings(Arc<watch::Sender<u64>>);

impl Siblings {
    pub fn new() -> Self {
        Siblings(Arc::new(watch::Sender::new(0)))
    }
}

impl Default for Siblings {
    fn default() -> Self {
        Self::new()
    }
}

/// Client-go's reflector backoff: 0.8 s doubling to 30 s, with up to 100% jitter, cut
/// short when a sibling reflector hears from the API again ([`Siblings`]). The first
/// failure of a run is logged as a warning, then only every doubling of the count, so
/// an API outage costs a handful of lines, not one per retry.
pub struct Backoff {
    failures: u32,
    since: Option<Instant>,
    /// When the API answered again after failures, until the state holds what that
    /// answer brought (a completed list, or a watch's first event).
    returned: Option<Instant>,
    seed: u64,
    siblings: Arc<watch::Sender<u64>>,
    /// Marked seen at each attempt: a change means a sibling heard from the API since.
    answered: watch::Receiver<u64>,
}

impl Backoff {
    const BASE: Duration = Duration::from_millis(800);
    const MAX: Duration = Duration::from_secs(30);

    /// A backoff of its own, with no sibling.
    pub fn new() -> Self {
        Self::among(&Siblings::new())
    }

    /// A backoff cut short when one of `siblings` hears from the API again.
    pub fn among(siblings: &Siblings) -> Self {
        use std::hash::{BuildHasher, RandomState};
        Backoff {
            failures: 0,
            since: None,
            returned: None,
            seed: RandomState::new().hash_one(Instant::now()),
            siblings: siblings.0.clone(),
            answered: siblings.0.subscribe(),
        }
    }

    /// A list or watch request is about to go out: only a sibling's answer after this
    /// cuts the backoff that may follow it short.
    fn attempt(&mut self) {
        self.answered.borrow_and_update();
    }

    /// The delay before the next attempt after a failure: base·2ⁿ capped at the max,
    /// times a factor in [1, 2).
    pub fn delay(failures: u32, jitter: f64) -> Duration {
        let exp = Self::BASE.saturating_mul(1 << failures.saturating_sub(1).min(16));
        exp.min(Self::MAX).mul_f64(1.0 + jitter.clamp(0.0, 1.0))
    }

    /// Whether the `failures`-th failure in a row is logged at warning level.
    pub fn loud(failures: u32) -> bool {
        failures.is_power_of_two()
    }

    fn jitter(&mut self) -> f64 {
        // xorshift: enough to spread thousands of nodes' retries apart.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        (self.seed >> 11) as f64 / (1u64 << 53) as f64
    }

    async fn failed(&mut self, kind: Kind, what: &str, error: &str) {
        self.failures += 1;
        let since = *self.since.get_or_insert_with(Instant::now);
        let delay = Self::delay(self.failures, self.jitter());
        let error = error.escape_debug().to_string();
        if Self::loud(self.failures) {
            tracing::warn!(%kind, failures = self.failures, failing_for_s = since.elapsed().as_secs(),
                retry_in_ms = delay.as_millis() as u64, %error,
                "{what} failed; keeping the last state and retrying");
        } else {
            tracing::debug!(%kind, failures = self.failures, %error, "{what} failed again");
        }
        if self.sibling_answered(delay).await {
            tracing::info!(%kind, failures = self.failures,
                "another watch of this API server is answered again; retrying at once");
        }
    }

    /// Waits out `delay`, or less when a sibling hears from the API (true), including
    /// since this reflector's last attempt went out.
    async fn sibling_answered(&mut self, delay: Duration) -> bool {
        if self.answered.has_changed().unwrap_or(false) {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => false,
            changed = self.answered.changed() => changed.is_ok(),
        }
    }

    /// The wait after a refusal for load: the larger of what the server asked for,
    /// spread by the jitter over [1, 2)× so a fleet told the same second does not come
    /// back in it, and the failure backoff. Not cut short by a sibling's answer: the
    /// server said when.
    fn throttled_delay(failures: u32, retry_after: Option<Duration>, jitter: f64) -> Duration {
        let asked = retry_after
            .unwrap_or_default()
            .mul_f64(1.0 + jitter.clamp(0.0, 1.0));
        asked.max(Self::delay(failures, jitter))
    }

    async fn throttled(
        &mut self,
        kind: Kind,
        what: &str,
        retry_after: Option<Duration>,
        error: &str,
    ) {
        self.failures += 1;
        let since = *self.since.get_or_insert_with(Instant::now);
        let delay = Self::throttled_delay(self.failures, retry_after, self.jitter());
        let error = error.escape_debug().to_string();
        if Self::loud(self.failures) {
            tracing::warn!(%kind, failures = self.failures, failing_for_s = since.elapsed().as_secs(),
                retry_after_s = retry_after.map(|d| d.as_secs()), retry_in_ms = delay.as_millis() as u64,
                %error, "{what} refused for load; keeping the last state and retrying the same request");
        } else {
            tracing::debug!(%kind, failures = self.failures, %error, "{what} refused for load again");
        }
        tokio::time::sleep(delay).await;
    }

    fn succeeded(&mut self, kind: Kind) {
        if let Some(since) = self.since.take() {
            tracing::info!(%kind, failures = self.failures, after_s = since.elapsed().as_secs_f64(),
                "the API answers again");
            self.returned.get_or_insert_with(Instant::now);
            self.siblings.send_modify(|n| *n = n.wrapping_add(1));
            // Its own news cuts no backoff of its own.
            self.answered.borrow_and_update();
        }
        self.failures = 0;
    }

    /// Tells the source the API is back, once the state holds what its answer brought:
    /// the sync loop times the way from here to converged rules.
    async fn settle_return(&mut self, tx: &Sender, kind: Kind) -> Result<(), Stop> {
        match self.returned.take() {
            Some(at) => send(tx, kind, Input::Returned(at)).await,
            None => Ok(()),
        }
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
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
        let stop = match &mut version {
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
                if !rv.is_empty() {
                    version = Some(rv);
                }
                if let (None, Stop::Invalid(why)) = (&version, &stop) {
                    tracing::info!(%kind, why = %why.escape_debug(),
                        "the API server does not stream lists (sendInitialEvents); listing in pages");
                    stream_lists = false;
                    continue;
                }
                stop
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
                    continue;
                }
                Err(stop) => stop,
            },
            Some(rv) => {
                let start = Start::Version;
                watch(
                    &client,
                    &request,
                    &target,
                    &decoder,
                    &tx,
                    start,
                    rv,
                    &mut backoff,
                )
                .await
            }
        };
        match stop {
            Stop::Closed => return,
            Stop::Resume => {}
            Stop::Broken(error) => {
                tracing::info!(%kind, error = %error.escape_debug(), "watch connection broke; resuming");
            }
            Stop::Relist(why) => {
                tracing::info!(%kind, why = %why.escape_debug(), "relisting");
                version = None;
            }
            Stop::Failed(error) | Stop::Invalid(error) => {
                let what = if version.is_none() { "list" } else { "watch" };
                backoff.failed(kind, what, &error).await;
            }
            Stop::Throttled { retry_after, error } => {
                backoff.throttled(kind, "watch", retry_after, &error).await;
            }
        }
    }
}

/// Lists `target` once, with no watch after it and no retry: the one-shot read of
/// `kproxy plan`, `explain` and `trace` ([`super::list_once`]), through the same
/// [`list`] as [`run`]. The error says why the list failed.
pub async fn list_once(
    client: kube::Client,
    target: Target,
    decoder: Decoder,
    tx: Sender,
) -> Result<(), String> {
    let request = kube::core::Request::new(target.url.clone());
    match list(&client, &request, &target, &decoder, &tx, None).await {
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
            let e = fold::decode_warning(kind, &key, ".", "not a JSON object");
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
            let e = fold::decode_warning(kind, &key, ".", "not UTF-8 text");
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
        let res = client
            .send(req.map(kube::client::Body::from))
            .await
            .map_err(api_error)?;
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
        while let Some(frame) = body.frame().await {
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
            let e = fold::decode_warning(kind, &key, ".", "undecodable protobuf metadata");
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

/// The longest `Retry-After` honoured as given: a larger (or broken) value must not
/// park a reflector for hours.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(60);

/// A `Retry-After` header's wait: delay-seconds (what the API server sends) capped at
/// [`MAX_RETRY_AFTER`]; `None` for an HTTP date or garbage (the backoff decides).
fn retry_after(value: &str) -> Option<Duration> {
    let seconds: u64 = value.trim().parse().ok()?;
    Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER))
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
            tracing::warn!(%kind, event = %other.escape_debug(), "unknown watch event type skipped");
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
                        Err(e) => tracing::warn!(%kind, error = %e, "malformed watch event skipped"),
                    }
                }
                pending.drain(..at);
                Ok(())
            }
            Stream::Protobuf(framer) => framer
                .feed(chunk, |frame| match proto::watch_event(frame) {
                    Ok(e) => event(RawEvent::Protobuf(e)),
                    Err(e) => {
                        tracing::warn!(%kind, error = %e.escape_debug(), "malformed watch event skipped");
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
    let res = match client.send(req.map(kube::client::Body::from)).await {
        Ok(r) => r,
        Err(e) => return api_error(e),
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
        let chunk = match body.frame().await {
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
        let fed = stream.feed(kind, &chunk, |event| {
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
        for input in events.drain(..) {
            let done = matches!(input, Some(Input::InitDone));
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fails `backoff` `n` times in a row without waiting (virtual time stands still
    /// while it sleeps in a task of its own): its next delay is then base·2ⁿ or more.
    fn failed_before(backoff: &mut Backoff, n: u32) {
        backoff.failures = n;
        backoff.since = Some(Instant::now());
    }

    /// After an outage every reflector of the API server is backing off; the first to
    /// be answered again brings the others back at that moment, not at the end of their
    /// own (longer) backoff. Virtual time: the instants are exact.
    #[tokio::test(start_paused = true)]
    async fn a_sibling_answered_again_cuts_the_backoff_short() {
        let siblings = Siblings::new();
        let mut services = Backoff::among(&siblings);
        let mut slices = Backoff::among(&siblings);
        failed_before(&mut services, 0);
        failed_before(&mut slices, 4);
        slices.attempt();
        let start = Instant::now();
        let waiting = tokio::spawn(async move {
            slices
                .failed(Kind::EndpointSlice, "watch", "connection refused")
                .await;
            Instant::now()
        });
        services.attempt();
        services
            .failed(Kind::Service, "watch", "connection refused")
            .await;
        services.attempt();
        services.succeeded(Kind::Service);
        let answered = Instant::now();
        let woke = waiting.await.expect("the slices' backoff ends");
        assert_eq!(
            woke, answered,
            "the slices retry when the services are answered"
        );
        assert!(
            woke - start < Backoff::delay(5, 0.0),
            "{:?} is the slices' own backoff",
            woke - start
        );
        // Its own return cuts no backoff of its own.
        services.attempt();
        let before = Instant::now();
        services.failed(Kind::Service, "watch", "refused").await;
        assert!(Instant::now() - before >= Backoff::delay(1, 0.0));
    }

    /// A sibling answered while this reflector's request was out: its failure is not
    /// waited out (the API is back); answers before the request went out do not count.
    #[tokio::test(start_paused = true)]
    async fn an_answer_during_a_failing_attempt_retries_at_once() {
        let siblings = Siblings::new();
        let mut node = Backoff::among(&siblings);
        let mut services = Backoff::among(&siblings);
        failed_before(&mut services, 2);
        services.succeeded(Kind::Service);
        // Before the node's attempt: waited out.
        node.attempt();
        let before = Instant::now();
        node.failed(Kind::Node, "list", "refused").await;
        assert!(Instant::now() - before >= Backoff::delay(1, 0.0));
        // During it: not.
        node.attempt();
        failed_before(&mut services, 2);
        services.succeeded(Kind::Service);
        let before = Instant::now();
        node.failed(Kind::Node, "list", "refused").await;
        assert_eq!(Instant::now(), before);
        // A reflector of its own waits its backoff out.
        let mut alone = Backoff::new();
        failed_before(&mut alone, 3);
        alone.attempt();
        let before = Instant::now();
        alone.failed(Kind::Node, "list", "refused").await;
        assert!(Instant::now() - before >= Backoff::delay(4, 0.0));
    }

    #[test]
    fn retry_after_is_seconds_capped_and_garbage_is_none() {
        for (value, expect) in [
            ("1", Some(1)),
            (" 7 ", Some(7)),
            ("0", Some(0)),
            ("3600", Some(60)),
            ("Wed, 21 Oct 2026 07:28:00 GMT", None),
            ("-1", None),
            ("", None),
        ] {
            assert_eq!(
                retry_after(value),
                expect.map(Duration::from_secs),
                "{value:?}"
            );
        }
    }

    /// A refusal for load waits at least what the server asked for, spread over up to
    /// twice that by the jitter, and never less than the failure backoff.
    #[test]
    fn a_throttled_request_waits_what_the_server_asked_spread_by_the_jitter() {
        let asked = Some(Duration::from_secs(5));
        assert_eq!(
            Backoff::throttled_delay(1, asked, 0.0),
            Duration::from_secs(5)
        );
        assert_eq!(
            Backoff::throttled_delay(1, asked, 0.5),
            Duration::from_millis(7500)
        );
        // A short Retry-After after many failures: the backoff is longer.
        assert_eq!(
            Backoff::throttled_delay(10, Some(Duration::from_secs(1)), 0.0),
            Backoff::MAX
        );
        assert_eq!(
            Backoff::throttled_delay(1, None, 0.0),
            Backoff::delay(1, 0.0)
        );
    }

    /// JSON watch lines cut anywhere by the chunks give the same events; blank lines
    /// and malformed ones are skipped.
    #[test]
    fn json_watch_lines_cut_anywhere_give_the_same_events() {
        let body = b"{\"type\":\"ADDED\",\"object\":{\"a\":1}}\n\n garbage\n{\"type\":\"BOOKMARK\",\"object\":{}}\n";
        for cut in 0..body.len() {
            let mut stream = Stream::Json(Vec::new());
            let mut seen = Vec::new();
            for chunk in [&body[..cut], &body[cut..]] {
                stream
                    .feed(Kind::Service, chunk, |e| {
                        if let RawEvent::Json(e) = e {
                            seen.push((e.kind.to_string(), e.object.get().to_string()));
                        }
                        true
                    })
                    .unwrap();
            }
            assert_eq!(
                seen,
                [
                    ("ADDED".to_string(), "{\"a\":1}".to_string()),
                    ("BOOKMARK".to_string(), "{}".to_string())
                ],
                "cut at {cut}"
            );
        }
    }

    /// The JSON twin of the recorded streamed list: only its last event, the bookmark,
    /// ends the initial events.
    #[test]
    fn the_json_bookmark_that_ends_the_initial_events() {
        let body = include_str!("testdata/watch-initial-services.json");
        let ends: Vec<bool> = body
            .lines()
            .map(|l| {
                let e: Event<'_> = serde_json::from_str(l).unwrap();
                json_ends_initial_events(e.object.get())
            })
            .collect();
        assert!(ends.len() > 1);
        assert_eq!(ends.iter().filter(|e| **e).count(), 1);
        assert_eq!(ends.last(), Some(&true));
    }

    #[test]
    fn a_broken_watch_resumes_at_once_only_when_it_had_been_running() {
        for (lasted_ms, at_once) in [(0, false), (999, false), (1000, true), (600_000, true)] {
            let stop = stream_broke("reset".into(), Duration::from_millis(lasted_ms));
            assert_eq!(
                matches!(stop, Stop::Broken(_)),
                at_once,
                "{lasted_ms} ms: {stop:?}"
            );
            assert_eq!(matches!(stop, Stop::Failed(_)), !at_once);
        }
    }
}
