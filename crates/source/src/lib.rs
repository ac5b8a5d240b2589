//! kproxy-source: where cluster objects come from. Every source (manifest files,
//! the Kubernetes API) writes into one [`StateHandle`]; the sync loop reads it. One
//! code path after the source.
//!
//! - [`manifests`]: read a file or directory of manifests into a `ClusterState`.
//! - [`watch`]: keep a `StateHandle` in step with a manifest file or directory.
//! - [`kube`]: the Kubernetes API watchers.

#![forbid(unsafe_code)]

#[cfg(feature = "fake-api")]
pub mod fake_api;
pub mod kube;
pub mod manifests;
pub mod watch;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use kproxy_core::ClusterState;
use tokio::sync::Notify;

/// Shared handle to the one `ClusterState`: sources write through [`StateHandle::update`],
/// the sync loop waits on [`StateHandle::changed`] and reads with [`StateHandle::with`].
/// Nothing is programmed before [`StateHandle::is_ready`]: every source has listed once.
#[derive(Clone, Default)]
pub struct StateHandle(Arc<Inner>);

#[derive(Default)]
struct Inner {
    state: Mutex<ClusterState>,
    notify: Notify,
    ready: AtomicBool,
    /// A source that stopped making progress (see [`StateHandle::set_source_stalled`]).
    stalled: AtomicBool,
    /// Called after every `update` that leaves changes pending, in the source's task
    /// (see [`StateHandle::on_update`]).
    on_update: std::sync::OnceLock<Box<dyn Fn(tokio::time::Instant) + Send + Sync>>,
    /// When the API answered again after failures, until the sync loop sees the state
    /// converged (see [`StateHandle::note_api_returned`]).
    api_returned: Mutex<Option<tokio::time::Instant>>,
    /// Manifest documents (or List items) not read at the last rescan.
    unread_documents: std::sync::atomic::AtomicUsize,
    /// A file or document could not be read or parsed at the last rescan, so the state
    /// may lack objects nobody named (see [`StateHandle::input_lost`]).
    input_lost: AtomicBool,
    /// Rescans of the manifest source since start (`kproxy_manifest_rescans_total`).
    rescans: std::sync::atomic::AtomicU64,
}

impl StateHandle {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, ClusterState> {
        // A panic while holding the lock leaves a consistent ClusterState (each method
        // of it is all-or-nothing), so a poisoned lock is still usable.
        self.0.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Mutates the state and wakes the sync loop.
    pub fn update<R>(&self, f: impl FnOnce(&mut ClusterState) -> R) -> R {
        self.update_received(tokio::time::Instant::now(), f)
    }

    /// [`StateHandle::update`] for input the source received at `received` (a watch
    /// event's arrival), which the update hook is given.
    pub fn update_received<R>(
        &self,
        received: tokio::time::Instant,
        f: impl FnOnce(&mut ClusterState) -> R,
    ) -> R {
        let (r, pending) = {
            let mut state = self.lock();
            let r = f(&mut state);
            (r, !state.changes().is_empty())
        };
        if pending && let Some(hook) = self.0.on_update.get() {
            hook(received);
        }
        self.0.notify.notify_one();
        r
    }

    /// Sets a function called after every `update` that leaves changes pending, with the
    /// instant the update's input was received (once; later calls are ignored and
    /// return false). The daemon uses it to note when a
    /// change was queued — upstream's `QueuedUpdate` — at the moment it arrives, not when
    /// the sync loop gets to it, so `/livez` sees a loop that stopped taking changes.
    /// An update that changed nothing (a relist finding what the state holds) is not a
    /// queued change, as upstream queues only when its change trackers hold one: noting
    /// it would stamp the next real change's way as starting then (a relist after an
    /// API outage showed `queued` 13.6 s).
    pub fn on_update(&self, f: impl Fn(tokio::time::Instant) + Send + Sync + 'static) -> bool {
        self.0.on_update.set(Box::new(f)).is_ok()
    }

    /// Reads (or takes changes from) the state without waking anyone.
    pub fn with<R>(&self, f: impl FnOnce(&mut ClusterState) -> R) -> R {
        f(&mut self.lock())
    }

    /// How many manifest documents or List items could not be read (did not parse, no
    /// kind, an unknown kind) at the manifest source's last rescan; 0 for the API source.
    pub fn unread_documents(&self) -> usize {
        self.0.unread_documents.load(Ordering::Relaxed)
    }

    /// Records how many documents the manifest source's last rescan could not read
    /// (read back by [`StateHandle::unread_documents`]).
    pub fn set_unread_documents(&self, n: usize) {
        self.0.unread_documents.store(n, Ordering::Relaxed);
    }

    /// Whether the source's last read lost objects it cannot name: a file or document
    /// that could not be read or parsed (`LoadProblem::loses_unknown_objects`). Before
    /// its first sync, `kproxy run` does not program such a state over tables that hold
    /// Services; false for the API source.
    pub fn input_lost(&self) -> bool {
        self.0.input_lost.load(Ordering::SeqCst)
    }

    pub fn set_input_lost(&self, lost: bool) {
        self.0.input_lost.store(lost, Ordering::SeqCst);
    }

    /// How many times the manifest source has looked at its files since start: an idle
    /// directory is rescanned only every `--sync-period` (at most 10 s).
    pub fn rescans(&self) -> u64 {
        self.0.rescans.load(Ordering::Relaxed)
    }

    pub fn note_rescan(&self) {
        self.0.rescans.fetch_add(1, Ordering::Relaxed);
    }

    /// Marks the initial listing complete and wakes the sync loop.
    pub fn mark_ready(&self) {
        self.0.ready.store(true, Ordering::SeqCst);
        self.0.notify.notify_one();
    }

    /// A source marks itself stalled while a read runs far longer than it should (a hung
    /// filesystem): the daemon turns this into an unhealthy `/livez`, since the state it
    /// programs is no longer following the source.
    pub fn set_source_stalled(&self, stalled: bool) {
        self.0.stalled.store(stalled, Ordering::SeqCst);
    }

    pub fn is_source_stalled(&self) -> bool {
        self.0.stalled.load(Ordering::SeqCst)
    }

    /// The API answered again after failing, at `at`; called after what that answer
    /// brought (a relist) is applied, so the sync loop can time the way from the API's
    /// return to converged rules. The earliest unsettled return is kept.
    pub fn note_api_returned(&self, at: tokio::time::Instant) {
        let mut r = self
            .0
            .api_returned
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        r.get_or_insert(at);
        drop(r);
        self.0.notify.notify_one();
    }

    /// Takes the unsettled API return, if any (the sync loop, once converged).
    pub fn take_api_returned(&self) -> Option<tokio::time::Instant> {
        self.0
            .api_returned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    pub fn is_ready(&self) -> bool {
        self.0.ready.load(Ordering::SeqCst)
    }

    /// Resolves after the next `update` or `mark_ready` (or at once if one happened
    /// since the last wait).
    pub async fn changed(&self) {
        self.0.notify.notified().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn the_update_hook_runs_after_updates_that_leave_changes_pending_and_is_set_once() {
        let h = StateHandle::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        assert!(h.on_update(move |_| {
            c.fetch_add(1, Ordering::SeqCst);
        }));
        assert!(!h.on_update(|_| {}), "a second hook is refused");
        h.with(|_| ());
        assert_eq!(calls.load(Ordering::SeqCst), 0, "reads are not updates");
        h.update(|_| ());
        assert_eq!(
            calls.load(Ordering::SeqCst),
            0,
            "an update that leaves nothing pending queues nothing"
        );
        h.update(|s| s.mark_all_changed());
        h.update(|_| ());
        assert_eq!(calls.load(Ordering::SeqCst), 2, "changes still pending");
        h.with(|s| s.take_changes());
        h.update(|_| ());
        assert_eq!(calls.load(Ordering::SeqCst), 2, "taken by a sync");
    }
}
