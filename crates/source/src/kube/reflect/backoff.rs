//! The reflectors' backoff ([`Backoff`]): client-go's (0.8 s doubling to 30 s,
//! jittered), cut short when a sibling reflector of the same API server hears from it
//! again ([`Siblings`]); also the waits of lists and watches that end at once, and of
//! lists that held objects that could not be decoded, and the log lines that say so.

use std::sync::Arc;
use std::time::Duration;

use kproxy_core::ingest::Kind;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{Input, MAX_SERVER_DELAY, Sender, Stop, send, server_delay};

/// The reflectors of one API server. When one of them hears from the server again
/// after failing, the others waiting out a backoff retry at once: an API server back
/// from an outage is back for every kind, and a view left stale for the rest of a
/// sibling's backoff (up to 60 s at its cap) is a view that routes to pods that are
/// gone. client-go's reflectors each wait out their own backoff; this costs a
/// recovered server no more requests than the backoffs ending would, only sooner.
#[derive(Clone, Debug)]
pub struct Siblings(pub(super) Arc<watch::Sender<u64>>);

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
    pub(super) failures: u32,
    pub(super) since: Option<Instant>,
    /// When the API answered again after failures, until the state holds what that
    /// answer brought (a completed list, or a watch's first event).
    pub(super) returned: Option<Instant>,
    pub(super) seed: u64,
    pub(super) siblings: Arc<watch::Sender<u64>>,
    /// Marked seen at each attempt: a change means a sibling heard from the API since.
    pub(super) answered: watch::Receiver<u64>,
    /// Lists and watches in a row that ended at once (a 410 after every list, a watch
    /// the server closes as it opens it, a streamed list cut before its end): each
    /// waits [`Backoff::delay`] of this count ([`Backoff::churned`]).
    pub(super) churn: u32,
    /// Objects could not be decoded since the last list that decoded whole: the source
    /// was told ([`Input::Lost`]).
    pub(super) lost: bool,
    /// Lists in a row that held objects that could not be decoded.
    pub(super) undecodable_lists: u32,
    /// When to list again to retry them: the watch goes on meanwhile.
    pub(super) relist_at: Option<Instant>,
}

impl Backoff {
    pub(super) const BASE: Duration = Duration::from_millis(800);
    pub(super) const MAX: Duration = Duration::from_secs(30);

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
            churn: 0,
            lost: false,
            undecodable_lists: 0,
            relist_at: None,
        }
    }

    /// A list or watch request is about to go out: only a sibling's answer after this
    /// cuts the backoff that may follow it short.
    pub(super) fn attempt(&mut self) {
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

    pub(super) fn jitter(&mut self) -> f64 {
        // xorshift: enough to spread thousands of nodes' retries apart.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        (self.seed >> 11) as f64 / (1u64 << 53) as f64
    }

    pub(super) async fn failed(&mut self, kind: Kind, what: &str, error: &str) {
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
    pub(super) async fn sibling_answered(&mut self, delay: Duration) -> bool {
        if self.answered.has_changed().unwrap_or(false) {
            return true;
        }
        tokio::select! {
            _ = tokio::time::sleep(delay) => false,
            changed = self.answered.changed() => changed.is_ok(),
        }
    }

    /// The wait after a refusal for load: what the server asked for, capped and
    /// jittered ([`server_delay`]); without a `Retry-After`, the failure backoff. Not the
    /// larger of both: the backoff grows with each refusal of the same watch, and a
    /// fleet of restarted nodes refused by max-in-flight (`Retry-After: 1`) took 45 s to
    /// be back where asking again after the server's second took 17 s (docs/scale.md).
    /// Not cut short by a sibling's answer: the server said when.
    pub(super) fn throttled_delay(
        failures: u32,
        retry_after: Option<Duration>,
        jitter: f64,
    ) -> Duration {
        match retry_after {
            Some(asked) => server_delay(asked, jitter),
            None => Self::delay(failures, jitter),
        }
    }

    /// Whether this is the first failure of a run: the kind has heard nothing from the
    /// API since (the source's status says so until it does again).
    pub(super) fn failing_from_now(&self) -> bool {
        self.since.is_none()
    }

    pub(super) async fn throttled(
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
        let capped = retry_after.is_some_and(|a| a > MAX_SERVER_DELAY);
        if Self::loud(self.failures) || capped {
            tracing::warn!(%kind, failures = self.failures, failing_for_s = since.elapsed().as_secs(),
                retry_after_s = retry_after.map(|d| d.as_secs()), capped, retry_in_ms = delay.as_millis() as u64,
                %error, "{what} refused for load; keeping the last state and retrying the same request");
        } else {
            tracing::debug!(%kind, failures = self.failures, %error, "{what} refused for load again");
        }
        tokio::time::sleep(delay).await;
    }

    /// A list or watch ended at once (`why`), again: waits the failure backoff of the
    /// count in a row, so a server answering every list with a 410 or ending every watch
    /// as it opens it gets a few requests a minute, not thousands a second. Logged when
    /// the churn starts; [`Backoff::lasted`] logs its end.
    pub(super) async fn churned(&mut self, kind: Kind, why: &str) {
        self.churn += 1;
        let delay = Self::delay(self.churn, self.jitter());
        if self.churn == 1 {
            tracing::warn!(%kind, why = %why.escape_debug(), retry_in_ms = delay.as_millis() as u64,
                "a list or watch ended at once; backing off until one lasts (logged again when one does)");
        } else {
            tracing::debug!(%kind, churn = self.churn, why = %why.escape_debug(), "ended at once again");
        }
        tokio::time::sleep(delay).await;
    }

    /// `n` objects of a list or of watch events could not be decoded. They are not
    /// taken as deleted: each keeps its last good version (a relist counts its key as
    /// seen), and the source is told the input is partial ([`Input::Lost`], which the
    /// restart guard reads). The watch goes on; the kind is listed again after the
    /// failure backoff of the count of such lists in a row, until one decodes whole
    /// ([`Backoff::decoded_whole`]). An object garbled for good costs one list a minute
    /// at most, never the kind's changes.
    pub(super) async fn undecodable(
        &mut self,
        tx: &Sender,
        kind: Kind,
        n: u32,
    ) -> Result<(), Stop> {
        if self.relist_at.is_none() {
            self.undecodable_lists += 1;
            let delay = Self::delay(self.undecodable_lists, self.jitter());
            self.relist_at = Some(Instant::now() + delay);
            let log = self.undecodable_lists == 1;
            if log {
                tracing::warn!(%kind, objects = n, relist_in_ms = delay.as_millis() as u64,
                    "objects could not be decoded: their last good versions stay, the input is partial, and the kind is listed again");
            } else {
                tracing::debug!(%kind, objects = n, relist_in_ms = delay.as_millis() as u64, "objects could not be decoded again");
            }
        }
        if !self.lost {
            self.lost = true;
            send(tx, kind, Input::Lost(true)).await?;
        }
        Ok(())
    }

    /// A list decoded every object: the input of this kind is whole again.
    pub(super) async fn decoded_whole(&mut self, tx: &Sender, kind: Kind) -> Result<(), Stop> {
        self.undecodable_lists = 0;
        self.relist_at = None;
        if self.lost {
            self.lost = false;
            tracing::info!(%kind, "a list decoded every object again: the input is whole");
            send(tx, kind, Input::Lost(false)).await?;
        }
        Ok(())
    }

    /// A list or watch lasted: the churn, if any, is over.
    pub(super) fn lasted(&mut self, kind: Kind) {
        if self.churn > 0 {
            tracing::info!(%kind, ended_at_once = self.churn, "lists and watches last again");
            self.churn = 0;
        }
    }

    pub(super) fn succeeded(&mut self, kind: Kind) {
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
    pub(super) async fn settle_return(&mut self, tx: &Sender, kind: Kind) -> Result<(), Stop> {
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
