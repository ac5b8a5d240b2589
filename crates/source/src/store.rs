//! The one `ClusterState` between a source and the sync loop, and how the loop hears of
//! it: [`store`] makes one [`Writer`] (the source's, not `Clone`: one task folds every
//! input into the state, so writes have one order) and a [`Reader`] (the loop's; cheap
//! clones for metrics and tests). The reader sees the state only through `&`, and takes
//! the changes recorded in it together with the stamp of the oldest one.
//!
//! Everything else the loop hears from the source is one [`Status`] value on a
//! `tokio::sync::watch` the reader waits on ([`Reader::changed`]): changes pending
//! (with when the oldest was received and reached the state), listed once, stalled, the
//! API answering again, and the manifest source's counts. A wake is sent when changes
//! become pending, the source is ready, stalls or recovers, or the API returns; the
//! counts change silently (read at scrape time).
//!
//! The invariant that loses no change: [`Status::pending`] is `Some` exactly while the
//! state holds changes not taken, and both move under the state's lock. A change written
//! after [`Reader::take`] finds nothing pending, so it sets `pending` and wakes the
//! reader again; one written before is taken.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;

use kproxy_core::ClusterState;
use kproxy_core::state::Changes;
use tokio::sync::watch;
use tokio::time::Instant;

/// Makes the store: the source writes through the [`Writer`], the sync loop reads and
/// waits through the [`Reader`].
pub fn store() -> (Writer, Reader) {
    let (status, rx) = watch::channel(Status::default());
    let shared = Arc::new(Shared {
        state: Mutex::new(ClusterState::default()),
        status,
        skipped: Arc::new(AtomicU64::new(0)),
    });
    (
        Writer {
            shared: shared.clone(),
        },
        Reader { shared, status: rx },
    )
}

/// What the source says besides the objects, as of now ([`Reader::status`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Status {
    /// Every kind has been listed once (the manifests read once): the sync loop may
    /// program. Nothing is programmed before.
    pub ready: bool,
    /// The state holds changes not yet taken ([`Reader::take`]): when the oldest of them
    /// arrived.
    pub pending: Option<Pending>,
    /// A read runs far longer than it should (a hung filesystem): the state is no longer
    /// following the source, which `kproxy run` turns into an unhealthy `/livez`.
    pub stalled: bool,
    /// The API answered again after failing, at this instant (the latest such return),
    /// once what that answer brought (a relist) is in the state.
    pub api_returned: Option<Instant>,
    /// The source's last read lost objects it cannot name: a file or document that
    /// could not be read or parsed (`LoadProblem::loses_unknown_objects`), or for the
    /// API source an object that could not be decoded, until a list of its kind decodes
    /// whole. Before its first sync, `kproxy run` does not program such a state over
    /// tables that hold more than it plans (docs/input.md).
    pub input_lost: bool,
    /// The API source: since when one of its kinds has heard nothing usable from the
    /// API server (errors, refusals, throttling), the earliest of them; `None` while
    /// every kind follows. `/healthz` says it (`sourceStalledSince`).
    pub api_failing_since: Option<Instant>,
    /// Manifest documents or List items that could not be read (did not parse, no
    /// kind, an unknown kind) at the manifest source's last rescan; 0 for the API.
    pub unread_documents: usize,
    /// Times the manifest source looked at its files since start: an idle directory is
    /// rescanned only every `--sync-period` (at most 10 s).
    pub rescans: u64,
}

/// The oldest change not yet taken: when the source received it (a watch event's
/// arrival) and when it reached the state, and the wall-clock time of receipt (for the
/// event log, so a change's way can be lined up with timestamps taken outside kproxy).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pending {
    pub received: Instant,
    pub applied: Instant,
    pub received_at: SystemTime,
}

impl Pending {
    /// A change received at `received` reaching the state now.
    fn now(received: Instant) -> Pending {
        let applied = Instant::now();
        let received = received.min(applied);
        let now = SystemTime::now();
        Pending {
            received,
            applied,
            received_at: now.checked_sub(applied - received).unwrap_or(now),
        }
    }
}

struct Shared {
    state: Mutex<ClusterState>,
    status: watch::Sender<Status>,
    /// Watch events and objects the source skipped (malformed, of an unknown type,
    /// undecodable, refused by ingest): `kproxy_api_skipped_total`.
    skipped: Arc<AtomicU64>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ClusterState> {
        // A panic while holding the lock leaves a consistent ClusterState (each method
        // of it is all-or-nothing), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Changes `status` by `f`; receivers are woken when `f` says so.
    fn status(&self, f: impl FnOnce(&mut Status) -> bool) {
        self.status.send_if_modified(f);
    }
}

/// The source's side of the store. Not `Clone`: one task writes, so the order of
/// writes is the order of the source's input.
pub struct Writer {
    shared: Arc<Shared>,
}

impl Writer {
    /// Mutates the state; a change it leaves pending wakes the reader.
    pub fn update<R>(&self, f: impl FnOnce(&mut ClusterState) -> R) -> R {
        self.update_received(Instant::now(), f)
    }

    /// [`Writer::update`] for input the source received at `received` (a watch event's
    /// arrival): the oldest pending change's stamp ([`Status::pending`]).
    ///
    /// An update that changed nothing (a relist finding what the state holds) leaves
    /// nothing pending, as upstream queues only when its change trackers hold a change:
    /// a stamp for it would date the next real change's way from then (a relist after
    /// an API outage showed `queued` 13.6 s).
    pub fn update_received<R>(
        &self,
        received: Instant,
        f: impl FnOnce(&mut ClusterState) -> R,
    ) -> R {
        let mut state = self.shared.lock();
        let r = f(&mut state);
        let pending = !state.changes().is_empty();
        // Under the state's lock: `pending` moves with the changes (module doc).
        self.shared.status(|s| match (pending, s.pending) {
            (false, None) => false,
            (false, Some(_)) => {
                s.pending = None;
                false
            }
            (true, None) => {
                s.pending = Some(Pending::now(received));
                true
            }
            (true, Some(oldest)) => {
                if received < oldest.received {
                    s.pending = Some(Pending::now(received));
                }
                false
            }
        });
        drop(state);
        r
    }

    /// Marks the initial listing complete and wakes the reader.
    pub fn mark_ready(&self) {
        self.shared
            .status(|s| !std::mem::replace(&mut s.ready, true));
    }

    /// Marks the source stalled (a read runs far longer than it should) or recovered.
    pub fn set_stalled(&self, stalled: bool) {
        self.shared
            .status(|s| std::mem::replace(&mut s.stalled, stalled) != stalled);
    }

    /// The API answered again after failing, at `at`; called after what that answer
    /// brought (a relist) is applied, so the sync loop can time the way from the API's
    /// return to converged rules.
    pub fn api_returned(&self, at: Instant) {
        self.shared.status(|s| {
            s.api_returned = Some(at);
            true
        });
    }

    /// Whether the last read lost objects it cannot name ([`Status::input_lost`]).
    pub fn set_input_lost(&self, lost: bool) {
        self.shared.status(|s| {
            s.input_lost = lost;
            false
        });
    }

    /// How many documents the manifest source's last rescan could not read.
    pub fn set_unread_documents(&self, n: usize) {
        self.shared.status(|s| {
            s.unread_documents = n;
            false
        });
    }

    /// Since when the API source has heard nothing usable from the API server
    /// ([`Status::api_failing_since`]); wakes the reader when it changes.
    pub fn set_api_failing_since(&self, since: Option<Instant>) {
        self.shared
            .status(|s| std::mem::replace(&mut s.api_failing_since, since) != since);
    }

    /// `n` more events or objects skipped.
    pub fn count_skipped(&self, n: u64) {
        self.shared.skipped.fetch_add(n, Ordering::Relaxed);
    }

    /// The skipped count, for the decoders that skip events before they reach the
    /// writer.
    pub fn skipped_counter(&self) -> Arc<AtomicU64> {
        self.shared.skipped.clone()
    }

    /// The manifest source looked at its files once more.
    pub fn note_rescan(&self) {
        self.shared.status(|s| {
            s.rescans += 1;
            false
        });
    }
}

/// The sync loop's side of the store: the state through `&`, its changes taken whole,
/// and the [`Status`] to wait on.
#[derive(Clone)]
pub struct Reader {
    shared: Arc<Shared>,
    status: watch::Receiver<Status>,
}

impl Reader {
    /// The status as of now (does not count as seen for [`Reader::changed`]).
    pub fn status(&self) -> Status {
        *self.status.borrow()
    }

    /// Watch events and objects the source skipped since it started.
    pub fn skipped(&self) -> u64 {
        self.shared.skipped.load(Ordering::Relaxed)
    }

    /// Waits until the status changed since this reader last looked (at once if it
    /// did), and returns it. Never returns once the writer is gone (the source ended:
    /// the state stays as it was).
    pub async fn changed(&mut self) -> Status {
        if self.status.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        *self.status.borrow_and_update()
    }

    /// Reads the state.
    pub fn read<R>(&self, f: impl FnOnce(&ClusterState) -> R) -> R {
        f(&self.shared.lock())
    }

    /// Takes the changes recorded in the state since the last take, with the stamp of
    /// the oldest of them, and reads the state they lead to, in one step: a change
    /// written meanwhile waits for the next take (and wakes the reader).
    pub fn take<R>(&self, f: impl FnOnce(&ClusterState, Changes, Option<Pending>) -> R) -> R {
        let mut state = self.shared.lock();
        let changes = state.take_changes();
        let mut oldest = None;
        self.shared.status(|s| {
            oldest = s.pending.take();
            false
        });
        f(&state, changes, oldest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_core::synthetic::{self, Spec};
    use std::time::Duration;

    fn service(i: usize) -> kproxy_core::model::Service {
        synthetic::service(&Spec::new(10, 1), i)
    }

    /// A row: the step, what it does, (pending after it, the reader woken).
    type ChangeRow<'a> = (&'a str, &'a dyn Fn(&Writer, &Reader), (bool, bool));
    /// A row: the step, what it does, the reader woken.
    type StatusRow<'a> = (&'a str, &'a dyn Fn(&Writer), bool);

    /// Whether the reader has a wake waiting.
    fn woken(r: &mut Reader) -> bool {
        let woken = r.status.has_changed().unwrap();
        r.status.mark_unchanged();
        woken
    }

    #[test]
    fn pending_follows_the_changes_not_taken_and_wakes_only_when_they_appear() {
        let (w, mut r) = store();
        // (step, what it does, (pending after it, reader woken))
        #[rustfmt::skip]
        let steps: &[ChangeRow] = &[
            ("an update that changes nothing", &|w, _| w.update(|_| ()), (false, false)),
            ("a change", &|w, _| { w.update(|s| s.upsert_service(service(0))); }, (true, true)),
            ("another change while one is pending", &|w, _| { w.update(|s| s.upsert_service(service(1))); }, (true, false)),
            ("the same object again: still pending", &|w, _| { w.update(|s| s.upsert_service(service(1))); }, (true, false)),
            ("a read", &|_, r| r.read(|_| ()), (true, false)),
            ("the take", &|_, r| r.take(|_, c, _| assert_eq!(c.services.len(), 2)), (false, false)),
            ("a change after the take wakes again", &|w, _| { w.update(|s| s.upsert_service(service(2))); }, (true, true)),
            ("a writer that empties the state", &|w, _| { w.update(std::mem::take); }, (false, false)),
        ];
        for (step, f, (pending, wake)) in steps {
            f(&w, &r);
            assert_eq!(r.status().pending.is_some(), *pending, "{step}: pending");
            assert_eq!(
                r.read(|s| !s.changes().is_empty()),
                *pending,
                "{step}: the state's changes"
            );
            assert_eq!(woken(&mut r), *wake, "{step}: woken");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_take_hands_out_the_oldest_stamp_with_the_changes() {
        let (w, r) = store();
        let t0 = Instant::now();
        tokio::time::advance(Duration::from_millis(50)).await;
        w.update_received(t0 + Duration::from_millis(10), |s| {
            s.upsert_service(service(0))
        });
        // Received earlier, though written later: the older receipt is the stamp.
        w.update_received(t0, |s| s.upsert_service(service(1)));
        w.update(|s| s.upsert_service(service(2)));
        let (n, oldest) = r.take(|_, c, p| (c.services.len(), p));
        let oldest = oldest.expect("a stamp");
        assert_eq!(n, 3);
        assert_eq!(oldest.received, t0);
        assert_eq!(oldest.applied, t0 + Duration::from_millis(50));
        assert_eq!(r.take(|_, c, p| (c.services.len(), p)), (0, None));
    }

    #[test]
    fn the_status_wakes_for_what_the_loop_acts_on_and_not_for_counts() {
        let (w, mut r) = store();
        let at = Instant::now();
        // (step, what it does, reader woken)
        #[rustfmt::skip]
        let steps: &[StatusRow] = &[
            ("ready", &|w| w.mark_ready(), true),
            ("ready again", &|w| w.mark_ready(), false),
            ("stalled", &|w| w.set_stalled(true), true),
            ("still stalled", &|w| w.set_stalled(true), false),
            ("recovered", &|w| w.set_stalled(false), true),
            ("the API returned", &|w| w.api_returned(at), true),
            ("input lost", &|w| w.set_input_lost(true), false),
            ("unread documents", &|w| w.set_unread_documents(3), false),
            ("a rescan", &|w| w.note_rescan(), false),
        ];
        for (step, f, wake) in steps {
            f(&w);
            assert_eq!(woken(&mut r), *wake, "{step}");
        }
        let s = r.status();
        assert!(s.ready && !s.stalled && s.input_lost);
        assert_eq!(
            (s.api_returned, s.unread_documents, s.rescans),
            (Some(at), 3, 1)
        );
    }

    /// A writer on another thread and a reader taking as it wakes: whatever the
    /// interleaving, the reader ends having taken every change.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_change_is_lost_between_writer_and_reader() {
        let (w, mut r) = store();
        const N: usize = 2000;
        let writer = std::thread::spawn(move || {
            for i in 0..N {
                w.update(|s| {
                    s.upsert_service(synthetic::service(&Spec::new(N, 1), i));
                });
            }
            w
        });
        let mut taken = 0;
        while taken < N {
            let status = tokio::time::timeout(Duration::from_secs(60), r.changed())
                .await
                .unwrap_or_else(|_| panic!("a change was lost: {taken} of {N} taken"));
            if status.pending.is_some() {
                taken += r.take(|_, c, _| c.services.len());
            }
        }
        let _w = writer.join().unwrap();
        assert_eq!(taken, N);
        assert_eq!(r.read(|s| s.service_count()), N);
    }
}
