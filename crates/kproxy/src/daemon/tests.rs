//! The sync loop's tests: the loop with a fake dataplane and fake health, under
//! paused time.

use super::*;
use std::collections::VecDeque;
use std::sync::Mutex;

use kproxy_core::model::ServiceName;
use kproxy_core::synthetic::{self, Spec};
use prometheus_client::registry::Registry;

/// What the fakes saw, in order, with the (paused) time since the test began.
#[derive(Clone, Debug, PartialEq)]
enum Seen {
    Computed(Vec<ServiceName>),
    Sync {
        ms: u64,
        full: bool,
        update: PlanUpdate,
        services: usize,
    },
    SyncFailed {
        ms: u64,
    },
    Applied(Vec<ServiceName>),
    HealthFailed,
    Repaired {
        services: usize,
    },
    KernelRepaired,
    InputHeld(bool),
    SourceStalled(bool),
}

/// What the fakes saw, the start, and how many changes health heard queued (apart
/// from the log: they arrive as the source writes, not in the loop's order).
#[derive(Clone)]
struct Log(
    Arc<Mutex<Vec<Seen>>>,
    Instant,
    Arc<std::sync::atomic::AtomicUsize>,
);

impl Log {
    fn push(&self, s: Seen) {
        self.0.lock().unwrap().push(s);
    }
    fn ms(&self) -> u64 {
        self.1.elapsed().as_millis() as u64
    }
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
    fn syncs(&self) -> usize {
        let seen = self.0.lock().unwrap();
        seen.iter()
            .filter(|s| matches!(s, Seen::Sync { .. } | Seen::SyncFailed { .. }))
            .count()
    }
}

/// Behaves like the nft dataplane where the loop can tell: the first sync and any
/// sync after a failure are full. `fail` scripts upcoming failures; `gate`, when
/// set, holds a sync until the test lets it go.
struct FakeDataplane {
    log: Log,
    fail: VecDeque<bool>,
    synced_once: bool,
    gate: Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>,
    /// What the kernel's tables hold beyond an empty input (set by the test).
    kernel_more: Arc<Mutex<Option<(usize, usize)>>>,
    /// Repairs find the kernel equal to the record (set by the test).
    repairs_unchanged: Arc<std::sync::atomic::AtomicBool>,
    /// The plan of the last successful sync.
    programmed: Option<NodePlan>,
}

impl Dataplane for FakeDataplane {
    fn sync(&mut self, plan: &NodePlan, update: &PlanUpdate) -> Result<SyncOutcome> {
        if let Some((started, release)) = &self.gate {
            started.send(()).unwrap();
            release.recv().unwrap();
        }
        let ms = self.log.ms();
        if self.fail.pop_front().unwrap_or(false) {
            self.synced_once = false;
            self.log.push(Seen::SyncFailed { ms });
            anyhow::bail!("scripted failure");
        }
        let full = !self.synced_once;
        self.synced_once = true;
        self.programmed = Some(plan.clone());
        self.log.push(Seen::Sync {
            ms,
            full,
            update: update.clone(),
            services: plan.services.len(),
        });
        Ok(SyncOutcome {
            full,
            ..Default::default()
        })
    }
    fn verify(&mut self) -> Result<bool> {
        Ok(false)
    }
    fn repair(&mut self, plan: &NodePlan) -> Result<SyncOutcome> {
        self.log.push(Seen::Repaired {
            services: plan.services.len(),
        });
        Ok(SyncOutcome {
            unchanged: self
                .repairs_unchanged
                .load(std::sync::atomic::Ordering::SeqCst),
            ..SyncOutcome::default()
        })
    }
    fn kernel_holds_more(&mut self, _plan: &NodePlan) -> Option<(usize, usize)> {
        *self.kernel_more.lock().unwrap()
    }
    fn kernel_holds_exactly(&mut self, _plan: &NodePlan) -> bool {
        false
    }
}

struct FakeHealth(Log);

impl HealthSink for FakeHealth {
    fn change_queued(&self) {
        self.0.2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
    fn computed(&self, _plan: &NodePlan, update: &PlanUpdate) {
        self.0.push(Seen::Computed(update.services.clone()));
    }
    fn applied(&self, _plan: &NodePlan, update: &PlanUpdate) {
        self.0.push(Seen::Applied(update.services.clone()));
    }
    fn sync_failed(&self) {
        self.0.push(Seen::HealthFailed);
    }
    fn kernel_repaired(&self) {
        self.0.push(Seen::KernelRepaired);
    }
    fn input_held(&self, held: bool) {
        self.0.push(Seen::InputHeld(held));
    }
    fn source_stalled(&self, since: Option<SystemTime>) {
        self.0.push(Seen::SourceStalled(since.is_some()));
    }
}

fn service(i: usize) -> kproxy_core::model::Service {
    synthetic::service(&Spec::new(100, 1), i)
}

fn name(i: usize) -> ServiceName {
    service(i).name.clone()
}

/// The update of Services `ids` (no node-level change).
fn of_services(ids: &[usize]) -> PlanUpdate {
    PlanUpdate {
        services: ids.iter().map(|&i| name(i)).collect(),
        node: false,
    }
}

/// A sync the fake dataplane saw: at `ms` (paused time), `full` or a delta, carrying
/// `update`, of a plan of `services` Services.
fn synced(ms: u64, full: bool, update: PlanUpdate, services: usize) -> Seen {
    Seen::Sync {
        ms,
        full,
        update,
        services,
    }
}

struct Harness {
    log: Log,
    registry: Registry,
    /// The source's side of the loop's store.
    writer: kproxy_source::Writer,
    /// Feeds the loop's kernel watch, as the nftables notifications would.
    kernel: tokio::sync::mpsc::UnboundedSender<crate::kernel_watch::Detected>,
    /// What the fake kernel's tables hold beyond an empty input.
    kernel_more: Arc<Mutex<Option<(usize, usize)>>>,
    /// The fake's repairs find the kernel equal to the record.
    repairs_unchanged: Arc<std::sync::atomic::AtomicBool>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<FakeDataplane>>,
}

/// A loop with an operator's minSyncPeriod of `min_sync` ms.
fn start(
    min_sync: u64,
    fail: &[bool],
    gate: Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>,
) -> Harness {
    let pacing = Pacing::MinSyncPeriod(Duration::from_millis(min_sync));
    start_logging(pacing, fail, gate, None)
}

/// The loop with minSyncPeriod `min_sync` ms and the fakes never failing, Service 0
/// in the state and its first sync done: where most tests begin.
async fn synced_with_service_0(min_sync: u64) -> Harness {
    let h = start(min_sync, &[], None);
    h.add(0);
    h.first_sync().await;
    h
}

/// The loop with no minSyncPeriod, writing its event log to `path`.
fn start_with_event_log(path: &std::path::Path) -> Harness {
    start_logging(
        Pacing::MinSyncPeriod(Duration::ZERO),
        &[],
        None,
        Some(path.to_path_buf()),
    )
}

/// The lines of the event log at `path` whose `event` is one `keep` takes.
fn events_where(path: &std::path::Path, keep: impl Fn(&str) -> bool) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|e| e["event"].as_str().is_some_and(&keep))
        .collect()
}

fn start_logging(
    pacing: Pacing,
    fail: &[bool],
    gate: Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>,
    event_log: Option<PathBuf>,
) -> Harness {
    start_planning(pacing, fail, gate, event_log, PlanConfig::default())
}

/// [`start_logging`] with the planner's settings `plan`.
fn start_planning(
    pacing: Pacing,
    fail: &[bool],
    gate: Option<(std::sync::mpsc::Sender<()>, std::sync::mpsc::Receiver<()>)>,
    event_log: Option<PathBuf>,
    plan: PlanConfig,
) -> Harness {
    let log = Log(Arc::default(), Instant::now(), Arc::default());
    let (writer, reader) = kproxy_source::store();
    let kernel_more = Arc::new(Mutex::new(None));
    let repairs_unchanged = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cfg = LoopConfig {
        node_name: synthetic::node_name(0),
        plan,
        pacing,
        sync_period: Duration::from_secs(3600),
        verify_period: Duration::from_secs(7200),
        event_log,
        allow: kproxy_core::input_guard::Allow::default(),
        input_name: "m".into(),
        table: "kproxy".into(),
    };
    let dataplane = FakeDataplane {
        log: log.clone(),
        fail: fail.iter().copied().collect(),
        synced_once: false,
        gate,
        kernel_more: kernel_more.clone(),
        repairs_unchanged: repairs_unchanged.clone(),
        programmed: None,
    };
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let (kernel, events) = tokio::sync::mpsc::unbounded_channel();
    let sync_loop = SyncLoop::new(
        cfg,
        reader,
        dataplane,
        Arc::new(FakeHealth(log.clone())),
        metrics.clone(),
    )
    .unwrap()
    .watch_kernel(KernelWatch::of(events, metrics));
    let stop = CancellationToken::new();
    let task = tokio::spawn(sync_loop.run(stop.clone()));
    Harness {
        log,
        registry,
        writer,
        kernel,
        kernel_more,
        repairs_unchanged,
        stop,
        task,
    }
}

impl Harness {
    /// The kernel watch reports another process's change (as lost notifications:
    /// what changed unknown).
    fn kernel_changed(&self) {
        self.kernel
            .send(crate::kernel_watch::Detected::now(kproxy_nft::Event::Lost))
            .unwrap();
    }
    /// The kernel watch reads another process's change to kproxy's tables.
    fn interference(&self) {
        self.kernel
            .send(crate::kernel_watch::Detected::now(
                kproxy_nft::Event::Interference(interference()),
            ))
            .unwrap();
    }
    /// Repairs (and comparisons) the dataplane ran.
    fn repairs(&self) -> usize {
        self.log
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|s| matches!(s, Seen::Repaired { .. }))
            .count()
    }
    fn add(&self, i: usize) {
        self.writer.update(|s| s.upsert_service(service(i)));
    }
    /// The source ready (its initial list read), and paused time run until the first
    /// sync attempt happened.
    async fn first_sync(&self) {
        self.writer.mark_ready();
        self.until_syncs(1).await;
    }
    /// Lets paused time run until `n` sync attempts happened.
    async fn until_syncs(&self, n: usize) {
        while self.log.syncs() < n {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    /// Lets paused time run until the fakes saw `what`.
    async fn until_seen(&self, what: &Seen) {
        while !self.log.0.lock().unwrap().contains(what) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    /// Stops the loop: what the fakes saw and the metrics' text.
    async fn finish(self) -> (Vec<Seen>, String) {
        let (log, text) = (self.log.clone(), crate::metrics::encode(&self.registry));
        self.stop().await;
        (log.take(), text)
    }
    async fn stop(self) -> FakeDataplane {
        self.stop.cancel();
        self.task.await.unwrap().unwrap()
    }
}

/// Notifications lost to other tables' churn, compared and found equal, took a
/// backoff step each: the next (real) change was repaired only after seconds, with
/// a false "Services on this node are broken" warning. Equal is no repair: no
/// step, no count; a real change after them (read as another process's) is
/// repaired at once. The comparisons themselves are spaced by the floor of
/// `pacing::lost_comparison_pause`, not by a backoff.
#[tokio::test(start_paused = true)]
async fn lost_notifications_found_equal_take_no_backoff_step() {
    let h = synced_with_repairs_unchanged().await;
    for round in 1..=5 {
        h.kernel_changed();
        while h.repairs() < round {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let compared_at = h.log.ms();
    h.repairs_unchanged
        .store(false, std::sync::atomic::Ordering::SeqCst);
    h.interference();
    while h.repairs() < 6 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let repaired_after = h.log.ms() - compared_at;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let (_, text) = h.finish().await;
    // 1 ms: `until_seen` polls in 1 ms steps.
    assert!(
        repaired_after <= 1,
        "repaired {repaired_after} ms after the change"
    );
    let floor = crate::pacing::LOST_COMPARISON_FLOOR.as_millis() as u64;
    assert!(
        compared_at <= 4 * floor + 10,
        "five comparisons took {compared_at} ms"
    );
    assert_repaired_once(&text);
    assert!(
        text.contains("kproxy_kernel_interference_backoff_seconds 0.0"),
        "{text}"
    );
}

/// Notifications lost without end (other tables' churn overrunning the receive
/// buffer) ran a comparison after each loss, back to back: each is a full read-back
/// of kproxy's tables (0.2–0.4 s at 10k Services × 10 endpoints), so up to a core.
/// Comparisons that find the tables equal are spaced (`pacing::lost_comparison_pause`);
/// a change that the watch reads as another process's is repaired at once all the
/// same.
#[tokio::test(start_paused = true)]
async fn comparisons_after_endless_lost_notifications_are_spaced() {
    let h = synced_with_repairs_unchanged().await;
    // A loss every millisecond for 10.05 s (the last one's comparison is owed,
    // waiting out the pause, when the change below comes).
    for _ in 0..10_050 {
        h.kernel_changed();
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let compared = h.repairs();
    // Another process's change, read as such, amid the losses.
    h.repairs_unchanged
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let before = h.log.ms();
    h.interference();
    while h.repairs() == compared {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let repaired_after = h.log.ms() - before;
    h.stop().await;
    eprintln!("{compared} comparisons in 10.05 s of endless lost notifications");
    let floor = crate::pacing::LOST_COMPARISON_FLOOR.as_millis() as usize;
    assert!(
        compared <= 10_050 / floor + 1,
        "{compared} comparisons in 10.05 s"
    );
    assert!(repaired_after <= 1, "repaired {repaired_after} ms after");
}

/// A loop that synced one Service, whose repairs find the kernel equal to the
/// record until the test says otherwise.
async fn synced_with_repairs_unchanged() -> Harness {
    let h = synced_with_service_0(0).await;
    h.repairs_unchanged
        .store(true, std::sync::atomic::Ordering::SeqCst);
    h
}

#[expect(
    clippy::disallowed_types,
    reason = "kproxy_nft stamps an interference on its blocking monitor thread"
)]
fn interference() -> kproxy_nft::Interference {
    kproxy_nft::Interference {
        pid: 42,
        process: "nft".into(),
        generation: 1,
        changes: kproxy_nft::Changes::default(),
        detected: std::time::Instant::now(),
    }
}

/// A restart on an empty input (a 0-byte file, an emptied directory, a volume not
/// yet populated) wiped every Service 8 ms after start. While kproxy's tables hold
/// Services, the first sync of an empty input (or of one that lost objects to a
/// parse failure) is held: nothing programmed, health told; a kernel change meanwhile
/// is not "repaired" from the refused plan; the first Service programs.
#[tokio::test(start_paused = true)]
async fn a_start_on_empty_or_lost_input_keeps_the_tables_until_the_input_is_whole() {
    let h = start(0, &[], None);
    *h.kernel_more.lock().unwrap() = Some((12, 3));
    h.writer.mark_ready();
    // Bounded (paused time): without the guard the first sync programs instead.
    tokio::time::timeout(
        Duration::from_secs(60),
        h.until_seen(&Seen::InputHeld(true)),
    )
    .await
    .unwrap_or_else(|_| panic!("never held: {:?}", h.log.0.lock().unwrap()));
    h.kernel_changed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.log.syncs(), 0, "{:?}", h.log.0.lock().unwrap());
    // A parse failure: a Service read, others maybe lost.
    h.writer.set_input_lost(true);
    h.add(0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.log.syncs(), 0, "{:?}", h.log.0.lock().unwrap());
    h.writer.set_input_lost(false);
    h.add(1);
    h.until_syncs(1).await;
    let seen = h.log.take();
    h.stop().await;
    assert!(
        !seen.iter().any(|s| matches!(s, Seen::Repaired { .. })),
        "{seen:?}"
    );
    let held: Vec<&Seen> = seen
        .iter()
        .filter(|s| matches!(s, Seen::InputHeld(_)))
        .collect();
    // Held for the empty input, again (another reason) for the lost one, then not.
    assert_eq!(
        held,
        [
            &Seen::InputHeld(true),
            &Seen::InputHeld(true),
            &Seen::InputHeld(false)
        ],
        "{seen:?}"
    );
    assert!(matches!(seen.last(), Some(Seen::Applied(_))), "{seen:?}");
    assert!(
        seen.iter().any(|s| matches!(
            s,
            Seen::Sync {
                full: true,
                services: 2,
                ..
            }
        )),
        "{seen:?}"
    );
}

/// With kproxy's tables absent (or holding no Service) an empty start has nothing to
/// lose: it programs (`--allow-empty` is the pure guard's, `input_guard`'s tests).
#[tokio::test(start_paused = true)]
async fn an_empty_start_without_services_in_the_tables_programs() {
    let h = start(0, &[], None);
    h.first_sync().await;
    h.stop().await;
}

/// Another process's change, as the kernel watch reports it, is repaired from the
/// programmed plan once the loop is between syncs (one reported before the first
/// sync waits for it), and health hears of the repair.
#[tokio::test(start_paused = true)]
async fn interference_is_repaired_between_syncs_and_health_hears_of_it() {
    let h = start(0, &[], None);
    h.kernel_changed();
    h.add(0);
    h.writer.mark_ready();
    h.until_seen(&Seen::KernelRepaired).await;
    let (seen, text) = h.finish().await;
    assert_eq!(
        seen[2..],
        [
            Seen::Applied(vec![name(0)]),
            Seen::Repaired { services: 1 },
            Seen::KernelRepaired,
        ],
        "{seen:?}"
    );
    assert_repaired_once(&text);
}

/// The metrics count one repair of another process's change.
fn assert_repaired_once(metrics: &str) {
    assert!(
        metrics.contains("kproxy_kernel_interference_repairs_total 1"),
        "{metrics}"
    );
}

/// A sync that fails because another process changed the tables while it was in
/// flight (a flush between its read and its commit) is retried at once as the
/// repair the kernel watch owes, not after the retry's backoff (100 ms here): the
/// tables are missing until it runs.
#[tokio::test(start_paused = true)]
async fn a_sync_that_met_interference_is_retried_at_once_as_the_repair() {
    // Each sync waits in the dataplane until the test lets it go.
    async fn in_flight(rx: std::sync::mpsc::Receiver<()>) -> std::sync::mpsc::Receiver<()> {
        tokio::task::spawn_blocking(move || {
            rx.recv().unwrap();
            rx
        })
        .await
        .unwrap()
    }
    let (started, started_rx) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    let h = start(0, &[false, true], Some((started, release_rx)));
    h.add(0);
    h.writer.mark_ready();
    let started_rx = in_flight(started_rx).await;
    release.send(()).unwrap();
    h.until_syncs(1).await;
    // A change, and while its sync is in flight another process's flush: that
    // sync fails.
    h.add(1);
    let started_rx = in_flight(started_rx).await;
    h.kernel_changed();
    release.send(()).unwrap();
    let _started_rx = in_flight(started_rx).await;
    release.send(()).unwrap();
    h.until_seen(&Seen::KernelRepaired).await;
    let (seen, text) = h.finish().await;
    let owed = of_services(&[1]);
    let Seen::SyncFailed { ms } = seen[4] else {
        panic!("{seen:?}");
    };
    assert_eq!(
        seen[3..],
        [
            Seen::Computed(vec![name(1)]),
            Seen::SyncFailed { ms },
            Seen::HealthFailed,
            Seen::Computed(vec![]),
            // Not 100 ms later (the retry's backoff): at once, and full.
            synced(ms, true, owed, 2),
            Seen::Applied(vec![name(1)]),
            Seen::KernelRepaired,
        ],
        "{seen:?}"
    );
    assert_repaired_once(&text);
}

/// Another process's change read while a change waits its turn (minSyncPeriod,
/// 1 s here): the tables are repaired at once, not after the wait and the delta
/// sync that would fail into them.
#[tokio::test(start_paused = true)]
async fn a_repair_owed_goes_while_a_change_waits_its_turn() {
    let h = synced_with_service_0(1000).await;
    h.add(1);
    tokio::time::sleep(Duration::from_millis(10)).await;
    h.kernel_changed();
    h.until_seen(&Seen::KernelRepaired).await;
    let repaired_ms = h.log.ms();
    h.until_syncs(2).await;
    let (seen, _) = h.finish().await;
    assert!(repaired_ms < 1000, "repaired at {repaired_ms} ms");
    assert_eq!(
        seen[3..],
        [
            Seen::Repaired { services: 1 },
            Seen::KernelRepaired,
            Seen::Computed(vec![name(1)]),
            synced(1000, false, of_services(&[1]), 2),
            Seen::Applied(vec![name(1)]),
        ],
        "{seen:?}"
    );
}

/// Another process's change read together with a change of the cluster: the
/// tables are repaired first, then the delta sync runs against them (a delta into
/// tables that were flushed fails, and the repair would wait for it).
#[tokio::test(start_paused = true)]
async fn a_repair_owed_goes_before_the_next_delta_sync() {
    let h = synced_with_service_0(0).await;
    h.add(1);
    h.kernel_changed();
    h.until_syncs(2).await;
    let log = h.log.clone();
    h.stop().await;
    let seen = log.take();
    assert_eq!(
        seen[3..6],
        [
            Seen::Repaired { services: 1 },
            Seen::KernelRepaired,
            Seen::Computed(vec![name(1)]),
        ],
        "{seen:?}"
    );
    assert!(
        matches!(seen[6], Seen::Sync { full: false, .. }),
        "{seen:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn an_api_return_is_timed_once_the_rules_match_the_state() {
    let count = |h: &Harness| {
        crate::metrics::encode(&h.registry)
            .lines()
            .find_map(|l| l.strip_prefix("kproxy_api_return_to_converged_seconds_count "))
            .map(str::to_string)
    };
    let h = synced_with_service_0(1000).await;
    // A relist that changed nothing: converged at once, nothing programmed.
    h.writer.api_returned(Instant::now());
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(count(&h).as_deref(), Some("1"));
    assert_eq!(h.log.syncs(), 1);
    // A relist that brought a change: converged only after the sync that carries it,
    // which waits for minSyncPeriod.
    h.add(1);
    h.writer.api_returned(Instant::now());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(count(&h).as_deref(), Some("1"));
    h.until_syncs(2).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(count(&h).as_deref(), Some("2"));
    h.stop().await;
}

/// An endpoint that becomes ready (not ready -> ready) is held for the warm-up, and
/// the loop re-plans when the hold ends though the source brings nothing new: its
/// Service is synced again at the release (paused time: not a millisecond before),
/// and the event log says when the hold began and why it ended.
#[tokio::test(start_paused = true)]
async fn a_warm_up_hold_ends_in_a_sync_at_its_release() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.jsonl");
    let plan = PlanConfig {
        endpoint_warmup: Duration::from_secs(1),
        ..PlanConfig::default()
    };
    let h = start_planning(
        Pacing::MinSyncPeriod(Duration::ZERO),
        &[],
        None,
        Some(events.clone()),
        plan,
    );
    let spec = Spec {
        etp_local_every: 0,
        hinted_every: 0,
        terminating_every: 7,
        ..Spec::new(100, 3)
    };
    // Service 1's third endpoint is terminating at generation 2, ready at 0.
    h.writer.update(|s| {
        s.upsert_service(synthetic::service(&spec, 1));
        s.upsert_slice(synthetic::slice(&spec, 1, 2));
    });
    h.first_sync().await;
    h.writer
        .update(|s| s.upsert_slice(synthetic::slice(&spec, 1, 0)));
    h.until_syncs(2).await;
    tokio::time::sleep(Duration::from_millis(990)).await;
    assert_eq!(h.log.syncs(), 2, "the hold is not released early");
    h.until_syncs(3).await;
    let seen = h.log.take();
    let svc = synthetic::service(&spec, 1).name;
    let last = seen.iter().rev().find_map(|s| match s {
        Seen::Sync { update, ms, .. } => Some((update, *ms)),
        _ => None,
    });
    let (update, ms) = last.expect("a sync");
    assert_eq!(update.services, std::slice::from_ref(&svc), "{seen:?}");
    // The release made it, not syncPeriod (an hour), the loop's only other timer.
    assert!(ms < 3_600_000, "{seen:?}");
    h.stop().await;
    let lines = events_where(&events, |e| e.starts_with("endpoint_"));
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["event"], "endpoint_held");
    assert_eq!(lines[0]["service"], svc.to_string());
    assert_eq!(lines[1]["event"], "endpoint_released");
    assert_eq!(lines[1]["reason"], "elapsed");
    assert_eq!(
        lines[1]["release_unix_ms"].as_u64().unwrap()
            - lines[1]["ready_since_unix_ms"].as_u64().unwrap(),
        1000
    );
}

/// Bursts of changes written while the loop is busy (each sync held in the
/// dataplane while the next burst is written), then a few while it is idle: the
/// loop ends with the plan of the state, long before syncPeriod (an hour) would
/// have forced a sync. A change lost between the writer and the loop (a wake
/// consumed during a sync and not looked for after it, a take that clears a later
/// change's notice) leaves the programmed plan behind the state.
#[tokio::test(start_paused = true)]
async fn bursts_written_while_the_loop_is_busy_end_with_the_plan_of_the_state() {
    let (started, started_rx) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    // No pacing: a wait for the pacing's turn could not pass (paused time does not
    // advance while the test waits for a sync on a blocking thread).
    let h = start(0, &[], Some((started, release_rx)));
    let spec = Spec::new(100, 1);
    h.add(0);
    h.writer.mark_ready();
    let mut started_rx = Some(started_rx);
    for round in 0..5usize {
        // A sync is in flight: the burst arrives while the loop is busy.
        let rx = started_rx.take().unwrap();
        let rx = tokio::task::spawn_blocking(move || {
            // Real time (paused time stands still here): fails rather than hangs.
            rx.recv_timeout(Duration::from_secs(20))
                .expect("no sync started for the changes written: a change was lost");
            rx
        })
        .await
        .unwrap();
        started_rx = Some(rx);
        for k in 0..40 {
            let i = 1 + (round * 37 + k * 11) % 90;
            h.writer.update(|s| match k % 4 {
                0 => {
                    s.delete_service(&name(i));
                }
                1 => {
                    s.upsert_slice(synthetic::slice(&spec, i, round * 100 + k));
                }
                _ => {
                    s.upsert_service(service(i));
                }
            });
        }
        // The loop hears the burst while its sync is in flight (health is told a
        // change is queued): the wake is spent before the sync ends.
        let queued = h.log.2.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..1000 {
            if h.log.2.load(std::sync::atomic::Ordering::SeqCst) > queued {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(
            h.log.2.load(std::sync::atomic::Ordering::SeqCst) > queued,
            "the loop did not hear the burst during its sync"
        );
        release.send(()).unwrap();
    }
    // From now on every sync goes through at once.
    let rx = started_rx.take().unwrap();
    let releaser = std::thread::spawn(move || {
        while rx.recv().is_ok() {
            if release.send(()).is_err() {
                break;
            }
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The first sync, then one per burst.
    let after_bursts = h.log.syncs();
    // A few while the loop is idle.
    for i in 91..95 {
        h.add(i);
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let state_plan = h.writer.update(|s| {
        assert!(s.changes().is_empty(), "changes left untaken");
        kproxy_core::plan(s, &synthetic::node_name(0), &PlanConfig::default())
    });
    let syncs = h.log.syncs();
    let programmed = h.stop().await.programmed;
    // The dataplane (and its gate) dropped: the releaser ends.
    releaser.join().unwrap();
    assert_eq!(after_bursts, 1 + 5, "each burst is one sync");
    assert!(syncs <= after_bursts + 4, "{syncs} syncs");
    assert_eq!(
        programmed.as_ref().map(|p| &p.services),
        Some(&state_plan.services),
        "the programmed plan is behind the state"
    );
}

/// The API source's "heard nothing since" reaches health when it starts and when
/// it ends (a throttled or failing watch was silent: `/healthz` said 200 and nothing
/// else).
#[tokio::test(start_paused = true)]
async fn an_api_source_that_hears_nothing_is_told_to_health() {
    let h = synced_with_service_0(0).await;
    h.writer
        .set_api_failing_since(Some(tokio::time::Instant::now()));
    h.until_seen(&Seen::SourceStalled(true)).await;
    h.writer.set_api_failing_since(None);
    h.until_seen(&Seen::SourceStalled(false)).await;
    h.stop().await;
}

/// A stalled source (a read far longer than it should take) is a failing sync to
/// health when it stalls, and again after each sync that succeeds meanwhile (the
/// rules are not caught up with a source that stopped), so `/livez` turns
/// unhealthy after 2 × syncPeriod; once it recovers, no more.
#[tokio::test(start_paused = true)]
async fn a_stalled_source_is_a_failing_sync_to_health_until_it_recovers() {
    let h = synced_with_service_0(0).await;
    h.writer.set_stalled(true);
    h.until_seen(&Seen::HealthFailed).await;
    // A sync meanwhile (of a change the source wrote as it stalled).
    h.add(1);
    h.until_syncs(2).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    h.writer.set_stalled(false);
    h.add(2);
    h.until_syncs(3).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let seen = h.log.take();
    h.stop().await;
    let told: Vec<&Seen> = seen
        .iter()
        .filter(|s| matches!(s, Seen::Applied(_) | Seen::HealthFailed))
        .collect();
    assert_eq!(
        told,
        [
            &Seen::Applied(vec![name(0)]),
            &Seen::HealthFailed,
            &Seen::Applied(vec![name(1)]),
            &Seen::HealthFailed,
            &Seen::Applied(vec![name(2)]),
        ],
        "{seen:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn changes_within_min_sync_period_coalesce_into_one_delta() {
    let h = synced_with_service_0(1000).await;
    for i in 1..=3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        h.add(i);
    }
    h.until_syncs(2).await;
    // Nothing more to do: no third sync in the next hour but the syncPeriod one.
    tokio::time::sleep(Duration::from_secs(600)).await;
    assert_eq!(h.log.syncs(), 2);
    let seen = h.log.take();
    h.stop().await;
    let all = of_services(&[0]);
    let three = of_services(&[1, 2, 3]);
    assert_eq!(
        seen,
        [
            Seen::Computed(all.services.clone()),
            synced(0, true, all.clone(), 1),
            Seen::Applied(all.services.clone()),
            Seen::Computed(three.services.clone()),
            // The first sync ended at 0 ms: the batch waits for 1000 ms.
            synced(1000, false, three.clone(), 4),
            Seen::Applied(three.services.clone()),
        ]
    );
}

/// For each change added at `at_ms[i]` (Service `i + 1`), the time (paused ms) of
/// the sync that carried it.
fn carried_at(seen: &[Seen], n: usize) -> Vec<u64> {
    (1..=n)
        .map(|i| {
            seen.iter()
                .find_map(|s| match s {
                    Seen::Sync { ms, update, .. } if update.services.contains(&name(i)) => {
                        Some(*ms)
                    }
                    _ => None,
                })
                .unwrap_or_else(|| panic!("change {i} was never synced"))
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn with_the_default_pacing_a_lone_change_is_synced_at_once() {
    let h = start_logging(Pacing::DEFAULT, &[], None, None);
    h.add(0);
    h.first_sync().await;
    // Flips every 300 ms, as a rollout's readiness changes arrive.
    let mut added = Vec::new();
    for i in 1..=10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        added.push(h.log.ms());
        h.add(i);
        h.until_syncs(i + 1).await;
    }
    let seen = h.log.take();
    h.stop().await;
    let carried = carried_at(&seen, added.len());
    for (a, c) in added.iter().zip(&carried) {
        // `until_syncs` polls in 1 ms steps.
        assert!(c - a <= 1, "added at {a} ms, synced at {c} ms");
    }
}

#[tokio::test(start_paused = true)]
async fn with_the_default_pacing_a_storm_is_coalesced_within_its_bound() {
    let h = start_logging(Pacing::DEFAULT, &[], None, None);
    h.first_sync().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    // 200 changes a second for one second.
    let mut added = Vec::new();
    for i in 1..=200 {
        added.push(h.log.ms());
        h.add(i);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let seen = h.log.take();
    let syncs = h.log.syncs();
    h.stop().await;
    let carried = carried_at(&seen, added.len());
    let Pacing::Bucket { burst, interval } = Pacing::DEFAULT else {
        unreachable!("the default is a bucket")
    };
    let bound = interval.as_millis() as u64 + 1;
    for (a, c) in added.iter().zip(&carried) {
        assert!(c - a <= bound, "added at {a} ms, synced at {c} ms");
    }
    // One second of storm: the burst, then one sync per interval (and the first).
    let most = 1 + burst as usize + (1000 / interval.as_millis() as usize) + 1;
    assert!(syncs <= most, "{syncs} syncs, at most {most} expected");
    assert!(syncs < 200 / 2, "a storm must be coalesced: {syncs} syncs");
}

#[tokio::test(start_paused = true)]
async fn a_failed_sync_retries_with_backoff_and_owes_every_change_since_the_last_success() {
    // Fails the second and third syncs: retries after 200 ms, then 400 ms.
    let h = start(200, &[false, true, true], None);
    h.first_sync().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    h.add(0);
    h.until_syncs(2).await;
    // A change during the backoff joins the retry.
    tokio::time::sleep(Duration::from_millis(50)).await;
    h.add(1);
    h.until_syncs(4).await;
    let seen = h.log.take();
    h.stop().await;
    let both = of_services(&[0, 1]);
    assert_eq!(
        seen[3..],
        [
            Seen::Computed(vec![name(0)]),
            // 1 ms late: `until_syncs` polls in 1 ms steps.
            Seen::SyncFailed { ms: 1001 },
            Seen::HealthFailed,
            Seen::Computed(vec![name(1)]),
            Seen::SyncFailed { ms: 1201 },
            Seen::HealthFailed,
            Seen::Computed(vec![]),
            // The dataplane re-programs everything after a failure; the loop hands
            // it and health every change since the last success.
            synced(1601, true, both.clone(), 2),
            Seen::Applied(both.services.clone()),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn sync_period_forces_a_sync_even_while_updates_change_nothing() {
    let h = synced_with_service_0(0).await;
    // A source re-listing the same object every 10 s: updates, no change.
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_secs(10)).await;
        h.add(0);
    }
    // 400 s with syncPeriod 3600 s: no sync; then the periodic one at 3600 s.
    assert_eq!(h.log.syncs(), 1);
    tokio::time::sleep(Duration::from_secs(3190)).await;
    h.until_syncs(2).await;
    let seen = h.log.take();
    h.stop().await;
    assert!(
        matches!(
            seen[4],
            Seen::Sync {
                ms: 3_600_000,
                full: false,
                ..
            }
        ),
        "{seen:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_finishes_the_sync_in_flight_reports_it_and_syncs_no_more() {
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (release_tx, release_rx) = std::sync::mpsc::channel();
    let h = start(0, &[], Some((started_tx, release_rx)));
    h.add(0);
    h.writer.mark_ready();
    tokio::task::spawn_blocking(move || started_rx.recv())
        .await
        .unwrap()
        .unwrap();
    // Cancelled mid-sync, and a change that will never be synced.
    h.stop.cancel();
    h.add(1);
    release_tx.send(()).unwrap();
    let seen_log = h.log.clone();
    let dataplane = h.stop().await;
    assert!(dataplane.synced_once);
    let seen = seen_log.take();
    assert_eq!(seen.len(), 3, "{seen:?}");
    assert!(matches!(seen[1], Seen::Sync { services: 1, .. }));
    assert_eq!(seen[2], Seen::Applied(vec![name(0)]));
}

#[tokio::test(start_paused = true)]
async fn shutdown_while_batching_does_not_sync_and_before_ready_returns_at_once() {
    let h = start(1000, &[], None);
    h.first_sync().await;
    h.add(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let log = h.log.clone();
    h.stop().await;
    assert_eq!(log.syncs(), 1);

    let h = start(0, &[], None);
    h.add(0);
    let log = h.log.clone();
    h.stop().await;
    assert_eq!(log.syncs(), 0);
}

/// A change's way starts when the source received it (a watch event's arrival),
/// not when it reached the state: the `received` stage and the total include it.
#[tokio::test(start_paused = true)]
async fn a_changes_way_starts_when_the_source_received_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.jsonl");
    let h = start_with_event_log(&path);
    h.add(0);
    h.first_sync().await;
    let received = Instant::now()
        .checked_sub(Duration::from_millis(40))
        .unwrap();
    h.writer
        .update_received(received, |s| s.upsert_service(service(1)));
    h.until_syncs(2).await;
    h.stop().await;
    let synced = events_where(&path, |e| e == "synced");
    let way = &synced[1]["change_ms"];
    let ms = |k: &str| way[k].as_f64().unwrap_or_else(|| panic!("{k} in {way}"));
    assert!(ms("received") >= 40.0, "{way}");
    assert!(ms("total") >= ms("received") + ms("queued"), "{way}");
}

/// A delta sync's event names what it changed (Services, their health checks), not
/// the whole cluster; a full sync lists every health check.
#[tokio::test(start_paused = true)]
async fn a_delta_sync_event_carries_the_change_not_the_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.jsonl");
    let h = start_with_event_log(&path);
    // Services 0, 10, 20, 30 are eTP-Local LoadBalancers with a health check.
    for i in [0, 5, 10, 20] {
        h.add(i);
    }
    h.first_sync().await;
    h.add(30);
    h.until_syncs(2).await;
    h.stop().await;
    let synced = events_where(&path, |e| e == "synced");
    assert_eq!(synced.len(), 2, "{synced:?}");
    let services = |e: &serde_json::Value, key: &str, field: &str| -> Vec<String> {
        e[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x[field].as_str().map_or(x.to_string(), str::to_string))
            .collect()
    };
    assert_eq!(synced[0]["full"], true);
    assert_eq!(synced[0]["changed"], serde_json::Value::Null);
    let all: Vec<String> = [0, 10, 20].map(|i| name(i).to_string()).into();
    assert_eq!(services(&synced[0], "health_checks", "service"), all);
    assert_eq!(synced[1]["full"], false);
    assert_eq!(
        synced[1]["changed"],
        serde_json::json!([name(30).to_string()])
    );
    assert_eq!(
        services(&synced[1], "health_checks", "service"),
        [name(30).to_string()]
    );
    let committed = synced[1]["committed_unix_us"].as_u64().unwrap();
    let oldest = synced[1]["oldest_change_unix_us"].as_u64().unwrap();
    assert!(0 < oldest && oldest <= committed, "{}", synced[1]);
}

#[test]
fn retry_backoff_grows_and_is_capped_by_sync_period() {
    let (min, period) = (Duration::from_millis(200), Duration::from_secs(5));
    let got: Vec<u128> = (1..=8)
        .map(|f| retry_after(f, min, period).as_millis())
        .collect();
    assert_eq!(got, [200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    assert_eq!(
        retry_after(1, Pacing::DEFAULT.retry_base(), period),
        Duration::from_millis(100)
    );
}
