//! The sync loop of `kproxy run` as a library type, [`SyncLoop`]: waits until the
//! source has listed everything, then for every batch of changes (paced by
//! [`crate::pacing`]: at once when idle, coalesced during a storm or by an operator's
//! minSyncPeriod) re-plans what changed, tells the health servers what is queued, applies
//! the plan to the dataplane on a blocking thread, and tells the health servers what is
//! now programmed. Failed syncs retry with backoff; syncPeriod forces a sync attempt; a
//! long verifyPeriod compares the kernel with what was programmed. It stops when its
//! cancellation token fires (after finishing a sync in flight); the rules stay in place,
//! as kube-proxy leaves them, so traffic keeps flowing across a restart.
//!
//! The loop reads the source through the store's [`Reader`] only: it waits on the
//! source's [`Status`] (changes pending, ready, stalled, the API returned), hears it in
//! one place ([`SyncLoop::hear`], also while a blocking call runs), and takes the
//! changes with the stamp of the oldest. One owner of change: the planner's
//! [`PlanUpdate`] is the delta handed to the dataplane and to health, added up and
//! followed as `kproxy_core::update` says; the loop never clones a plan. The dataplane and health are traits, so
//! the loop is tested with fakes under paused time (tests below). Time is
//! `tokio::time::Instant` throughout for that reason.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use kproxy_core::model::IpFamily;
use kproxy_core::no_local::NoLocalEndpoints;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::update::Revisit;
use kproxy_core::{NodePlan, PlanConfig, Planner};
use kproxy_source::{Pending, Reader, Status};
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::kernel_watch::{self, KernelWatch};
use crate::metrics::{Metrics, NoLocalLabels, StageLabel};
use crate::pacing::{Pacer, Pacing};

/// What the loop needs from a dataplane. Implemented by kproxy-nft's `Dataplane`.
pub trait Dataplane: Send + 'static {
    /// Programs `plan`; `update` is every change since the last successful sync (the
    /// first call, and any call after a failure, must program everything). Blocking.
    fn sync(&mut self, plan: &NodePlan, update: &PlanUpdate) -> Result<SyncOutcome>;
    /// Compares the kernel with what was programmed and repairs it; true when it drifted.
    fn verify(&mut self) -> Result<bool>;
    /// Restores what another process changed, from what was programmed (`plan`, the
    /// plan last programmed, when nothing is). Blocking.
    fn repair(&mut self, plan: &NodePlan) -> Result<SyncOutcome>;
    /// Rules and set elements that kproxy's tables in the kernel hold beyond what `plan`
    /// without its Services leaves ([`crate::input_guard::kernel_holds_more`]); `None`
    /// when the tables are absent or hold no more. Blocking.
    fn kernel_holds_more(&mut self, plan: &NodePlan) -> Option<(usize, usize)>;
    /// Whether kproxy's tables in the kernel hold exactly what `plan` programs
    /// ([`crate::input_guard::kernel_holds_exactly`]). Blocking.
    fn kernel_holds_exactly(&mut self, plan: &NodePlan) -> bool;
}

#[derive(Debug, Default, Clone)]
pub struct SyncOutcome {
    pub full: bool,
    /// A repair that found kproxy's tables equal to its record: nothing was sent.
    pub unchanged: bool,
    pub conntrack_deleted: usize,
    /// Free-form counts for the event log (chains, elements, ...).
    pub detail: serde_json::Value,
}

/// What the loop tells the health servers. Implemented by kproxy-health's `Health`.
pub trait HealthSink: Send + Sync + 'static {
    /// A change reached the cluster state (upstream `QueuedUpdate`, as it arrives): a
    /// loop that stops taking changes turns `/livez` unhealthy after 2 × syncPeriod.
    fn change_queued(&self);
    /// A plan was computed; `update` is what changed since the previous computed plan.
    fn computed(&self, plan: &NodePlan, update: &PlanUpdate);
    /// A plan was programmed; `update` is what changed since the previous applied plan.
    fn applied(&self, plan: &NodePlan, update: &PlanUpdate);
    fn sync_failed(&self);
    /// The dataplane restored what another process changed in the kernel.
    fn kernel_repaired(&self);
    /// The first sync was held back (`true`): the input is empty or lost objects while
    /// kproxy's tables hold Services ([`kproxy_core::input_guard`]); `false` once programmed.
    fn input_held(&self, held: bool);
    /// Since when the source has heard nothing usable from the API server (`None`: it
    /// follows again): `/healthz`'s `sourceStalledSince`.
    fn source_stalled(&self, since: Option<SystemTime>);
}

impl HealthSink for kproxy_health::Health {
    fn change_queued(&self) {
        kproxy_health::Health::change_queued(self);
    }
    fn computed(&self, plan: &NodePlan, update: &PlanUpdate) {
        kproxy_health::Health::computed(self, plan, update);
    }
    fn applied(&self, plan: &NodePlan, update: &PlanUpdate) {
        kproxy_health::Health::applied(self, plan, update);
    }
    fn sync_failed(&self) {
        kproxy_health::Health::sync_failed(self);
    }
    fn kernel_repaired(&self) {
        kproxy_health::Health::kernel_repaired(self);
    }
    fn input_held(&self, held: bool) {
        kproxy_health::Health::input_held(self, held);
    }
    fn source_stalled(&self, since: Option<SystemTime>) {
        kproxy_health::Health::source_stalled(self, since);
    }
}

#[derive(Clone, Debug)]
pub struct LoopConfig {
    pub node_name: String,
    pub plan: PlanConfig,
    /// When a sync may start after the last one (minSyncPeriod, or kproxy's pacing).
    pub pacing: Pacing,
    pub sync_period: Duration,
    pub verify_period: Duration,
    pub event_log: Option<PathBuf>,
    /// What the first sync may program over kproxy's tables ([`kproxy_core::input_guard`]).
    pub allow: kproxy_core::input_guard::Allow,
    /// The input, for the guard's message: the manifests' path, or the API.
    pub input_name: String,
    /// kproxy's table name, for the guard's message.
    pub table: String,
}

/// When a sync ran and how long it took, for its metrics and its event.
/// The way of the oldest change a sync carried ([`Pending`], taken with the changes):
/// received (decode, ingest, into the state), queued (until planning starts, including
/// the pacing's batching), plan, commit (the kernel transaction).
struct SyncTiming {
    oldest_change: Option<Pending>,
    /// [`change_stages`] of the oldest change.
    stages: Option<[(&'static str, f64); 5]>,
    elapsed: Duration,
    committed_unix_us: u64,
}

/// The event log's `synced` line: what the sync changed, not the cluster: every health
/// check and no names after a full sync or a node-level change, else the changed
/// Services' names and health checks.
fn synced_event(
    plan: &NodePlan,
    outcome: &SyncOutcome,
    unapplied: &PlanUpdate,
    t: &SyncTiming,
) -> serde_json::Value {
    let whole = outcome.full || unapplied.node;
    let checks: Vec<&kproxy_core::plan::HealthCheck> = if whole {
        plan.health_checks().collect()
    } else {
        unapplied
            .services
            .iter()
            .filter_map(|n| plan.services.get(n)?.health_check.as_ref())
            .collect()
    };
    json!({
        "full": outcome.full,
        "services_changed": unapplied.services.len(),
        "changed": (!whole).then(|| unapplied
            .services
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>()),
        "committed_unix_us": t.committed_unix_us,
        "oldest_change_unix_us": t.oldest_change.map(|o| unix_us(o.received_at)),
        "elapsed_ms": t.elapsed.as_secs_f64() * 1e3,
        "conntrack_deleted": outcome.conntrack_deleted,
        "health_checks": checks.iter().map(|h| json!({
            "service": h.service.to_string(),
            "port": h.health_check_node_port,
            "localEndpoints": h.local_endpoints,
        })).collect::<Vec<_>>(),
        "detail": outcome.detail,
        "change_ms": t.stages.map(|st| st
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v * 1e3)))
            .collect::<serde_json::Map<_, _>>()),
    })
}

/// The way of the oldest change a sync carried, in seconds, per stage.
fn change_stages(
    oldest: Pending,
    start: Instant,
    planned: Instant,
    committed: Instant,
) -> [(&'static str, f64); 5] {
    let s = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
    [
        ("received", s(oldest.received, oldest.applied)),
        ("queued", s(oldest.applied, start)),
        ("plan", s(start, planned)),
        ("commit", s(planned, committed)),
        ("total", s(oldest.received, committed)),
    ]
}

use crate::event_log::EventLog;

fn unix_us(at: SystemTime) -> u64 {
    at.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as u64
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// The planner and the dataplane: what a sync runs on the blocking thread, moved there
/// and back so the plan is lent, not cloned.
struct Engine<D> {
    planner: Planner,
    dataplane: D,
}

/// The sync loop. [`SyncLoop::new`] wires it; [`SyncLoop::run`] runs it until its token
/// is cancelled.
pub struct SyncLoop<D, H> {
    cfg: LoopConfig,
    /// The store's read side: the state, its changes, and the source's status.
    source: Reader,
    /// The status as the loop last acted on it ([`SyncLoop::hear`]).
    heard: Status,
    /// The earliest return of the API not yet converged ([`SyncLoop::settle_api_return`]).
    api_returned: Option<Instant>,
    /// `None` only while a blocking call holds it (inside `on_engine`, which holds
    /// `&mut self` and is never dropped half-way).
    engine: Option<Engine<D>>,
    health: Arc<H>,
    metrics: Arc<Metrics>,
    events: EventLog,
    programming: ProgrammingLatency,
    no_local: NoLocalCounts,
    last_conflicts: Vec<kproxy_core::frontend::Conflict>,
    last_cluster_ip_warnings: Vec<kproxy_core::frontend::ClusterIpWarning>,
    last_sync: Option<Instant>,
    pacer: Pacer,
    failures: u32,
    /// Every change planned since the last successful sync: what the dataplane and
    /// health's applied view have not seen yet.
    unapplied: PlanUpdate,
    /// Other processes' changes to the tables, to repair ([`SyncLoop::watch_kernel`]).
    kernel: Option<KernelWatch>,
    /// A sync has succeeded in this process: the guard ([`kproxy_core::input_guard`]) no
    /// longer applies, the source's last-known-good keeps what it read.
    programmed_once: bool,
    /// Why the first sync is held back, while it is.
    held: Option<kproxy_core::input_guard::Refusal>,
    /// The planner's clock for endpoint warm-up holds.
    warmup_clock: crate::warmup::WarmupClock,
}

const ENGINE_HOME: &str = "the engine is home between blocking calls";

/// How one sync attempt ended.
enum Attempt {
    Synced,
    Failed {
        retry_in: Duration,
    },
    /// Not programmed: the input guard refused the state; the next change retries.
    Held,
}

impl<D: Dataplane, H: HealthSink> SyncLoop<D, H> {
    pub fn new(
        cfg: LoopConfig,
        source: Reader,
        dataplane: D,
        health: Arc<H>,
        metrics: Arc<Metrics>,
    ) -> Result<Self> {
        let events = EventLog::open(cfg.event_log.as_ref())?;
        let planner = Planner::new(cfg.node_name.clone(), cfg.plan.clone());
        let pacer = Pacer::new(cfg.pacing);
        Ok(SyncLoop {
            cfg,
            source,
            heard: Status::default(),
            api_returned: None,
            engine: Some(Engine { planner, dataplane }),
            health,
            metrics,
            events,
            programming: ProgrammingLatency::default(),
            no_local: NoLocalCounts::default(),
            last_conflicts: Vec::new(),
            last_cluster_ip_warnings: Vec::new(),
            last_sync: None,
            pacer,
            failures: 0,
            unapplied: PlanUpdate::default(),
            kernel: None,
            programmed_once: false,
            held: None,
            warmup_clock: crate::warmup::WarmupClock::start(),
        })
    }

    /// Repairs what other processes change in the kernel, as `watch` reports it.
    pub fn watch_kernel(mut self, watch: KernelWatch) -> Self {
        self.kernel = Some(watch);
        self
    }

    /// Runs until `stop` is cancelled; a sync in flight finishes first. Returns the
    /// dataplane so the caller can decide what to do with it (nothing: the rules stay).
    pub async fn run(mut self, stop: CancellationToken) -> Result<D> {
        while !self.source.status().ready {
            tokio::select! {
                status = self.source.changed() => self.hear(status),
                _ = stop.cancelled() => return Ok(self.into_dataplane()),
            }
        }
        tracing::info!(node = %self.cfg.node_name, "source synced; starting the sync loop");
        let mut need_sync = true; // the first sync always runs, even for an empty cluster
        let mut next_verify = Instant::now() + self.cfg.verify_period;
        loop {
            if !need_sync {
                let release = self.next_release();
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => break,
                    // Before a change: a delta sync into tables another process removed
                    // fails, and only then would the repair run.
                    repair = KernelWatch::next(&mut self.kernel) => {
                        if self.held.is_some() {
                            // Nothing programmed yet: no record to repair from, and the
                            // plan is the refused one. The guard decides again on what
                            // the kernel now holds.
                            let attempt = self.sync().await;
                            self.repaired_by_sync(repair, matches!(attempt, Attempt::Synced));
                        } else {
                            self.repair_kernel(repair).await;
                        }
                        continue;
                    }
                    status = self.source.changed() => {
                        self.hear(status);
                        // Not a change: an API return whose relist changed nothing, the
                        // source stalling, or a wake for changes a sync already took.
                        if status.pending.is_none() {
                            self.settle_api_return();
                            continue;
                        }
                    }
                    // From the last sync, so wakes without changes do not postpone it.
                    _ = tokio::time::sleep_until(
                        self.last_sync.unwrap_or_else(Instant::now) + self.cfg.sync_period
                    ) => {
                        tracing::debug!("syncPeriod elapsed");
                    }
                    _ = tokio::time::sleep_until(next_verify) => {
                        self.verify().await;
                        next_verify = Instant::now() + self.cfg.verify_period;
                        continue;
                    }
                    // An endpoint's warm-up hold ends: the planner re-plans its Service.
                    _ = tokio::time::sleep_until(release.unwrap_or(next_verify)), if release.is_some() => {
                        tracing::debug!("an endpoint's warm-up ends");
                    }
                }
            }
            // Batch as the pacing says; changes arriving meanwhile join this sync.
            let now = Instant::now();
            let earliest = self.pacer.earliest(now);
            if now < earliest {
                self.metrics.last_queued_timestamp.set(unix_now());
                // A repair owed goes while the change waits its turn (up to
                // minSyncPeriod): the delta would only fail into the removed tables,
                // and the repair wait behind it.
                while !stop.is_cancelled() && Instant::now() < earliest {
                    tokio::select! {
                        biased;
                        _ = stop.cancelled() => {}
                        repair = KernelWatch::next(&mut self.kernel) => {
                            self.repair_kernel(repair).await;
                        }
                        _ = tokio::time::sleep_until(earliest) => {}
                    }
                }
            }
            if stop.is_cancelled() {
                break;
            }
            need_sync = false;
            let mut attempt = self.sync().await;
            while let Attempt::Failed { retry_in } = attempt {
                tokio::select! {
                    biased;
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(retry_in) => {
                        need_sync = true;
                        break;
                    }
                    // Another process changed the tables (what the sync met: a flush
                    // between its read and its commit): the full sync owed since the
                    // failure is the repair, at once rather than after the retry's
                    // backoff and the pacing, with the rules missing meanwhile. The
                    // watch's own backoff paces it against a process that keeps at it.
                    repair = KernelWatch::next(&mut self.kernel) => {
                        attempt = self.sync().await;
                        self.repaired_by_sync(repair, matches!(attempt, Attempt::Synced));
                    }
                }
            }
            if stop.is_cancelled() {
                break;
            }
            if self.source.status().pending.is_some() {
                need_sync = true;
            } else if !need_sync {
                self.settle_api_return();
            }
        }
        tracing::info!("shutting down; nftables rules stay in place");
        self.events.emit("stopped", json!({}));
        Ok(self.into_dataplane())
    }

    /// When the planner's next warm-up hold ends (`kproxy_core::warmup`).
    fn next_release(&self) -> Option<Instant> {
        let planner = &self.engine.as_ref().expect(ENGINE_HOME).planner;
        planner.next_release().map(|m| self.warmup_clock.instant(m))
    }

    /// Once the rules match the state (nothing pending, nothing owed to the dataplane),
    /// an API return noted by the source is converged: time it.
    fn settle_api_return(&mut self) {
        if self.failures > 0 || !self.unapplied.is_empty() {
            return;
        }
        if let Some(at) = self.api_returned.take() {
            let secs = at.elapsed().as_secs_f64();
            self.metrics.api_return_to_converged.observe(secs);
            tracing::info!(seconds = secs, "converged after the API answered again");
            self.events
                .emit("api_return_converged", json!({ "seconds": secs }));
        }
    }

    fn into_dataplane(mut self) -> D {
        self.engine.take().expect(ENGINE_HOME).dataplane
    }

    async fn verify(&mut self) {
        let res = self.on_engine(|e| e.dataplane.verify()).await;
        match res {
            Ok(true) => {
                self.metrics.drift_repairs.inc();
                tracing::warn!("kernel rules drifted from what kproxy programmed; repaired");
                self.events.emit("drift_repaired", json!({}));
                // Not missed when the watch owes a repair of it (backing off).
                if self.kernel.as_ref().is_some_and(|w| !w.owes()) {
                    self.metrics.kernel_watch_missed.inc();
                    tracing::warn!("the nftables watch had not reported that drift");
                }
            }
            Ok(false) => {}
            Err(e) => tracing::warn!(error = format!("{e:#}"), "verification failed"),
        }
    }

    /// Restores kproxy's tables after other processes changed them, from the record;
    /// health says so once done. Runs only between syncs, where the planner's plan is
    /// the one programmed. A failed repair is owed again (after the backoff).
    async fn repair_kernel(&mut self, repair: kernel_watch::Repair) {
        let started = tokio::time::Instant::now();
        let res = self
            .on_engine(|e| e.dataplane.repair(e.planner.plan()))
            .await;
        let detail = match res {
            Ok(outcome) if outcome.unchanged => {
                self.found_unchanged(repair, started.elapsed());
                return;
            }
            Ok(outcome) => Some(outcome.detail),
            Err(e) => {
                tracing::error!(
                    error = format!("{e:#}"),
                    "repairing kproxy's nftables tables failed; retrying"
                );
                None
            }
        };
        self.repaired(repair, detail, "kproxy's nftables tables repaired");
    }

    /// A repair's comparison found kproxy's tables equal to the record (notifications
    /// lost to other tables' churn, or a change undone before the repair): no repair was
    /// made, so none is counted or logged as one, and the watch takes no backoff step
    /// (an overflow from foreign churn logged "Services on this node are broken" and
    /// delayed the repair of a real flush after it by 25.6 s).
    fn found_unchanged(&mut self, repair: kernel_watch::Repair, took: Duration) {
        self.health.kernel_repaired();
        tracing::info!(
            events = repair.events,
            process = repair.interference.as_ref().map(|i| i.process.as_str()),
            "kproxy's nftables tables equal what it programmed: nothing to repair"
        );
        self.events.emit(
            "kernel_unchanged",
            json!({
                "events": repair.events,
                "process": repair.interference.as_ref().map(|i| &i.process),
            }),
        );
        if let Some(w) = self.kernel.as_mut() {
            w.found_unchanged(took);
        }
    }

    /// A full sync ran in place of the owed `repair` (after a sync that met another
    /// process's change): health and the watch hear of it as of a repair.
    fn repaired_by_sync(&mut self, repair: kernel_watch::Repair, ok: bool) {
        self.repaired(
            repair,
            ok.then(|| json!({"how": "sync"})),
            "kproxy's nftables tables repaired by the full sync after the sync that met the change",
        );
    }

    /// A repair ran (`detail`: what it did) or failed (`None`, owed again after the
    /// backoff): metrics, health, the log and the event log hear of a success, the
    /// watch of either.
    fn repaired(
        &mut self,
        repair: kernel_watch::Repair,
        detail: Option<serde_json::Value>,
        what: &str,
    ) {
        let ok = detail.is_some();
        if let Some(detail) = detail {
            let since_detected = repair.detected.elapsed().as_secs_f64() * 1e3;
            self.metrics.kernel_repairs.inc();
            self.health.kernel_repaired();
            tracing::info!(
                events = repair.events,
                ms_since_detected = since_detected,
                %detail,
                "{what}"
            );
            self.events.emit(
                "kernel_repaired",
                json!({
                    "events": repair.events,
                    "ms_since_detected": since_detected,
                    "process": repair.interference.as_ref().map(|i| &i.process),
                    "pid": repair.interference.as_ref().map(|i| i.pid),
                    "detail": detail,
                }),
            );
        }
        if let Some(w) = self.kernel.as_mut() {
            w.repaired(repair, ok);
        }
    }

    /// Runs `f` on the engine on a blocking thread, hearing the source meanwhile (a
    /// change queued during a long commit or repair reaches health as it arrives).
    async fn on_engine<R: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut Engine<D>) -> R + Send + 'static,
    ) -> R {
        let engine = self.engine.take().expect(ENGINE_HOME);
        let job = blocking(engine, f);
        tokio::pin!(job);
        let (engine, r) = loop {
            tokio::select! {
                done = &mut job => break done,
                status = self.source.changed() => self.hear(status),
            }
        };
        self.engine = Some(engine);
        r
    }

    /// Acts on what the source's status says now that the loop had not heard: a change
    /// newly pending is queued with health (upstream's `QueuedUpdate`); a stalled
    /// source is a failing sync to health (its oldest change waits unapplied, so
    /// `/livez` turns unhealthy after 2 × syncPeriod); an API return is kept, earliest
    /// first, until the rules converge ([`SyncLoop::settle_api_return`]).
    fn hear(&mut self, now: Status) {
        let before = std::mem::replace(&mut self.heard, now);
        if now.pending.is_some() && now.pending != before.pending {
            self.health.change_queued();
        }
        if now.stalled && !before.stalled {
            self.health.sync_failed();
        }
        if now.api_failing_since != before.api_failing_since {
            // The instant as wall-clock time, for the `/healthz` body.
            let since = now.api_failing_since.map(|at| {
                let now = SystemTime::now();
                now.checked_sub(at.elapsed()).unwrap_or(now)
            });
            self.health.source_stalled(since);
        }
        if let Some(at) = now.api_returned
            && before.api_returned != Some(at)
        {
            self.api_returned.get_or_insert(at);
        }
    }

    /// One sync: re-plan what changed, apply, report.
    async fn sync(&mut self) -> Attempt {
        self.metrics.last_queued_timestamp.set(unix_now());
        let start = Instant::now();
        self.pacer.started(start);
        let oldest_change = self.plan_changes();
        let planned = Instant::now();
        if !self.programmed_once && self.hold_input().await {
            return Attempt::Held;
        }

        let unapplied = std::mem::take(&mut self.unapplied);
        let (unapplied, res) = self
            .on_engine(move |e| {
                let r = e.dataplane.sync(e.planner.plan(), &unapplied);
                (unapplied, r)
            })
            .await;
        let elapsed = start.elapsed();
        let committed_unix_us = unix_us(SystemTime::now());
        self.last_sync = Some(Instant::now());
        self.pacer.ended(Instant::now());
        match res {
            Ok(outcome) => {
                let timing = SyncTiming {
                    stages: oldest_change
                        .map(|o| change_stages(o, start, planned, start + elapsed)),
                    oldest_change,
                    elapsed,
                    committed_unix_us,
                };
                self.synced(&outcome, &unapplied, &timing);
                Attempt::Synced
            }
            Err(e) => self.sync_failed(&e, unapplied),
        }
    }

    /// Before this process's first successful sync: whether the input guard refuses the
    /// plan ([`kproxy_core::input_guard`]). A refusal keeps the tables as they are, is logged
    /// (again only when its reason changes), and health hears of it; the changes stay
    /// owed, so the next change (or syncPeriod) decides again.
    async fn hold_input(&mut self) -> bool {
        let lost = self.source.status().input_lost;
        let empty = self
            .engine
            .as_ref()
            .expect(ENGINE_HOME)
            .planner
            .plan()
            .services
            .is_empty();
        let allow = self.cfg.allow;
        let input = kproxy_core::input_guard::Input { empty, lost };
        let refusal = if (empty && !allow.empty) || (lost && !allow.partial) {
            let kernel = self
                .on_engine(move |e| {
                    let plan = e.planner.plan();
                    let more = e.dataplane.kernel_holds_more(plan);
                    // Only partial input over tables that hold more needs the
                    // comparison: the kernel may already hold exactly its plan.
                    let same = lost && more.is_some() && e.dataplane.kernel_holds_exactly(plan);
                    kproxy_core::input_guard::Kernel { more, same }
                })
                .await;
            kproxy_core::input_guard::refusal(input, kernel, allow, true)
        } else {
            None
        };
        if refusal == self.held {
            return refusal.is_some();
        }
        match refusal {
            Some(r) => {
                let message = r.message(&self.cfg.input_name, &self.cfg.table);
                tracing::error!(
                    "not programming; kproxy's tables stay as they are until the input is whole: {message}"
                );
                self.events
                    .emit("input_held", json!({ "reason": message, "flag": r.flag() }));
                self.health.input_held(true);
            }
            None => {
                tracing::info!("the input is whole again: programming");
                self.health.input_held(false);
            }
        }
        self.held = refusal;
        refusal.is_some()
    }

    /// The planning phase of a sync: the planner takes the state's changes, health
    /// hears of the computed plan, and the update joins what the dataplane owes.
    /// Returns the stamp of the oldest change taken.
    fn plan_changes(&mut self) -> Option<Pending> {
        let metrics = &self.metrics;
        let planner = &mut self.engine.as_mut().expect(ENGINE_HOME).planner;
        let now = self.warmup_clock.moment(Instant::now());
        let (update, oldest, service_events, slice_events) =
            self.source.take(|state, changes, oldest| {
                let counts = (changes.service_events, changes.slice_events);
                metrics.service_changes_pending.set(counts.0 as i64);
                metrics.endpoint_changes_pending.set(counts.1 as i64);
                (
                    planner.apply_at(state, changes, now),
                    oldest,
                    counts.0,
                    counts.1,
                )
            });
        let warmup_events = planner.take_warmup_events();
        if !warmup_events.is_empty() {
            crate::warmup::record(warmup_events, &mut self.events, metrics, now);
            metrics
                .endpoint_warmup_held
                .set(planner.plan(), planner.held_services());
        }
        metrics.service_changes_total.inc_by(service_events);
        metrics.endpoint_changes_total.inc_by(slice_events);
        metrics.service_changes_pending.set(0);
        metrics.endpoint_changes_pending.set(0);
        let plan = self.engine.as_ref().expect(ENGINE_HOME).planner.plan();
        self.health.computed(plan, &update);
        self.unapplied.merge(update);
        if plan.conflicts != self.last_conflicts {
            // Each conflict once when it appears, not at every sync.
            for c in plan
                .conflicts
                .iter()
                .filter(|c| !self.last_conflicts.contains(c))
            {
                tracing::warn!(conflict = %c, "frontend conflict");
            }
            metrics.frontend_conflicts.set(plan.conflicts.len() as i64);
            self.last_conflicts = plan.conflicts.clone();
        }
        if plan.cluster_ip_warnings != self.last_cluster_ip_warnings {
            for w in plan
                .cluster_ip_warnings
                .iter()
                .filter(|w| !self.last_cluster_ip_warnings.contains(w))
            {
                tracing::warn!(warning = %w, "cluster IP programmed with a warning");
            }
            metrics
                .cluster_ip_warnings
                .set(plan.cluster_ip_warnings.len() as i64);
            self.last_cluster_ip_warnings = plan.cluster_ip_warnings.clone();
        }
        oldest
    }

    /// After a sync the dataplane took: metrics, health and the programming latency
    /// follow the applied plan; the log and the event log say what changed.
    fn synced(&mut self, outcome: &SyncOutcome, unapplied: &PlanUpdate, t: &SyncTiming) {
        self.failures = 0;
        self.programmed_once = true;
        let metrics = &self.metrics;
        for (stage, secs) in t.stages.iter().flatten() {
            metrics
                .change_stages
                .get_or_create(&StageLabel { stage })
                .observe(*secs);
        }
        let secs = t.elapsed.as_secs_f64();
        metrics.sync_duration.observe(secs);
        if outcome.full {
            metrics.sync_full_duration.observe(secs);
        } else {
            metrics.sync_partial_duration.observe(secs);
        }
        metrics.last_sync_timestamp.set(unix_now());
        metrics
            .conntrack_deleted
            .inc_by(outcome.conntrack_deleted as u64);
        let plan = self.engine.as_ref().expect(ENGINE_HOME).planner.plan();
        self.no_local.follow(plan, unapplied);
        self.no_local.set(metrics, plan);
        self.health.applied(plan, unapplied);
        if self.heard.stalled {
            // Applied is not caught up: the source's state stopped following it.
            self.health.sync_failed();
        }
        let programming = &mut self.programming;
        self.source
            .read(|state| programming.observe(metrics, state, &unapplied.services));
        if outcome.full || !unapplied.is_empty() {
            tracing::info!(
                full = outcome.full,
                services_changed = unapplied.services.len(),
                elapsed_ms = secs * 1e3,
                "synced"
            );
        } else {
            tracing::debug!(elapsed_ms = secs * 1e3, "periodic sync: nothing changed");
        }
        self.events
            .emit("synced", synced_event(plan, outcome, unapplied, t));
    }

    /// After a sync the dataplane refused: the changes stay owed, retried after the
    /// backoff.
    fn sync_failed(&mut self, e: &anyhow::Error, unapplied: PlanUpdate) -> Attempt {
        self.failures += 1;
        self.metrics.nftables_sync_failures.inc();
        self.health.sync_failed();
        // The planner has consumed the changes; they stay owed to the dataplane and
        // health until a sync succeeds (the dataplane itself re-programs everything
        // after a failure).
        self.unapplied.merge(unapplied);
        let retry_in = retry_after(
            self.failures,
            self.cfg.pacing.retry_base(),
            self.cfg.sync_period,
        );
        tracing::error!(
            error = format!("{e:#}"),
            retry_in_ms = retry_in.as_millis() as u64,
            "sync failed"
        );
        self.events
            .emit("sync_failed", json!({ "error": format!("{e:#}") }));
        Attempt::Failed { retry_in }
    }
}

/// Exponential backoff from `base` ([`Pacing::retry_base`]), capped at syncPeriod.
fn retry_after(failures: u32, base: Duration, sync_period: Duration) -> Duration {
    let factor = 1u32 << failures.saturating_sub(1).min(10);
    (base * factor).min(sync_period.max(base))
}

async fn blocking<T: Send + 'static, R: Send + 'static>(
    mut t: T,
    f: impl FnOnce(&mut T) -> R + Send + 'static,
) -> (T, R) {
    match tokio::task::spawn_blocking(move || {
        let r = f(&mut t);
        (t, r)
    })
    .await
    {
        Ok(x) => x,
        // The dataplane panicked: the process cannot continue safely without it.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Upstream's `sync_proxy_rules_no_local_endpoints_total{traffic_policy, ip_family}`
/// of the applied plan: the decision is `kproxy_core::no_local`; the counts are kept per
/// Service and moved by each sync's changed Services, so a sync does not walk the
/// cluster. Only Services that count are held.
#[derive(Debug, Default)]
struct NoLocalCounts {
    /// IPv4, IPv6.
    total: [NoLocalEndpoints; 2],
    by_service: HashMap<kproxy_core::model::ServiceName, [NoLocalEndpoints; 2]>,
    primed: bool,
}

impl NoLocalCounts {
    fn of_service(svc: &kproxy_core::plan::ServicePlan) -> [NoLocalEndpoints; 2] {
        IpFamily::ALL.map(|f| kproxy_core::no_local::service_no_local_endpoints(svc, f))
    }

    /// Moves the counts to `plan` by `update` (every change since the plan they
    /// counted), as [`PlanUpdate::revisit`] says.
    fn follow(&mut self, plan: &NodePlan, update: &PlanUpdate) {
        let zero = [NoLocalEndpoints::default(); 2];
        let Revisit::Services(names) = update.revisit(self.primed) else {
            *self = NoLocalCounts {
                primed: true,
                ..NoLocalCounts::default()
            };
            for (name, svc) in &plan.services {
                let n = Self::of_service(svc);
                if n != zero {
                    self.add(name.clone(), n);
                }
            }
            return;
        };
        for name in names.iter() {
            if let Some(old) = self.by_service.remove(name) {
                for (t, o) in self.total.iter_mut().zip(old) {
                    *t -= o;
                }
            }
            if let Some(svc) = plan.services.get(name) {
                let n = Self::of_service(svc);
                if n != zero {
                    self.add(name.clone(), n);
                }
            }
        }
    }

    fn add(&mut self, name: kproxy_core::model::ServiceName, n: [NoLocalEndpoints; 2]) {
        for (t, x) in self.total.iter_mut().zip(n) {
            *t += x;
        }
        self.by_service.insert(name, n);
    }

    fn get(&self, family: IpFamily) -> NoLocalEndpoints {
        self.total[family.index()]
    }

    /// One gauge pair per family of the plan.
    fn set(&self, metrics: &Metrics, plan: &NodePlan) {
        for f in &plan.families {
            let n = self.get(f.family);
            for (traffic_policy, v) in [("internal", n.internal), ("external", n.external)] {
                metrics
                    .no_local_endpoints
                    .get_or_create(&NoLocalLabels {
                        traffic_policy,
                        ip_family: f.family.as_str(),
                    })
                    .set(i64::from(v));
            }
        }
    }
}

/// `network_programming_duration_seconds`: for each EndpointSlice whose
/// `endpoints.kubernetes.io/last-change-trigger-time` is new since the last sync, the
/// time from that trigger to the end of the sync that programmed it.
#[derive(Default)]
struct ProgrammingLatency {
    seen: HashMap<(String, String), String>,
    /// The first sync only records: trigger times from before kproxy started would
    /// measure kproxy's downtime, not programming latency.
    primed: bool,
}

impl ProgrammingLatency {
    fn observe(
        &mut self,
        metrics: &Metrics,
        state: &kproxy_core::ClusterState,
        changed: &[kproxy_core::model::ServiceName],
    ) {
        let now = jiff::Timestamp::now();
        for name in changed {
            for slice in state.slices_of(name) {
                let Some(t) = slice.last_change_trigger_time.as_deref() else {
                    continue;
                };
                let key = (name.namespace.to_string(), slice.name.clone());
                if self.seen.get(&key).is_some_and(|old| old == t) {
                    continue;
                }
                self.seen.insert(key, t.to_string());
                if !self.primed {
                    continue;
                }
                if let Ok(ts) = t.parse::<jiff::Timestamp>() {
                    let secs = now.duration_since(ts).as_secs_f64();
                    if secs >= 0.0 {
                        metrics.network_programming.observe(secs);
                    }
                }
            }
        }
        self.primed = true;
        if self.seen.len() > 4 * state.slice_count() + 1024 {
            self.seen.clear();
        }
    }
}

#[cfg(test)]
mod tests {
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
        let h = start(0, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        let owed = PlanUpdate {
            services: vec![name(1)],
            node: false,
        };
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
                Seen::Sync {
                    ms,
                    full: true,
                    update: owed,
                    services: 2
                },
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
        let h = start(1000, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
                Seen::Sync {
                    ms: 1000,
                    full: false,
                    update: PlanUpdate {
                        services: vec![name(1)],
                        node: false,
                    },
                    services: 2
                },
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
        let h = start(0, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        let h = start(1000, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        let log = std::fs::read_to_string(&events).unwrap();
        let lines: Vec<serde_json::Value> = log
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .filter(|v: &serde_json::Value| {
                v["event"]
                    .as_str()
                    .is_some_and(|e| e.starts_with("endpoint_"))
            })
            .collect();
        assert_eq!(lines.len(), 2, "{log}");
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
        let h = start(0, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        let h = start(0, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        let h = start(1000, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        let all = PlanUpdate {
            services: vec![name(0)],
            node: false,
        };
        let three = PlanUpdate {
            services: vec![name(1), name(2), name(3)],
            node: false,
        };
        assert_eq!(
            seen,
            [
                Seen::Computed(all.services.clone()),
                Seen::Sync {
                    ms: 0,
                    full: true,
                    update: all.clone(),
                    services: 1
                },
                Seen::Applied(all.services.clone()),
                Seen::Computed(three.services.clone()),
                // The first sync ended at 0 ms: the batch waits for 1000 ms.
                Seen::Sync {
                    ms: 1000,
                    full: false,
                    update: three.clone(),
                    services: 4
                },
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
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        h.writer.mark_ready();
        h.until_syncs(1).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        h.add(0);
        h.until_syncs(2).await;
        // A change during the backoff joins the retry.
        tokio::time::sleep(Duration::from_millis(50)).await;
        h.add(1);
        h.until_syncs(4).await;
        let seen = h.log.take();
        h.stop().await;
        let both = PlanUpdate {
            services: vec![name(0), name(1)],
            node: false,
        };
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
                Seen::Sync {
                    ms: 1601,
                    full: true,
                    update: both.clone(),
                    services: 2
                },
                Seen::Applied(both.services.clone()),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn sync_period_forces_a_sync_even_while_updates_change_nothing() {
        let h = start(0, &[], None);
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
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
        h.writer.mark_ready();
        h.until_syncs(1).await;
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

    /// A delta sync's event names what it changed (Services, their health checks), not
    /// the whole cluster; a full sync lists every health check.
    /// A change's way starts when the source received it (a watch event's arrival),
    /// not when it reached the state: the `received` stage and the total include it.
    #[tokio::test(start_paused = true)]
    async fn a_changes_way_starts_when_the_source_received_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let h = start_logging(
            Pacing::MinSyncPeriod(Duration::ZERO),
            &[],
            None,
            Some(path.clone()),
        );
        h.add(0);
        h.writer.mark_ready();
        h.until_syncs(1).await;
        let received = Instant::now()
            .checked_sub(Duration::from_millis(40))
            .unwrap();
        h.writer
            .update_received(received, |s| s.upsert_service(service(1)));
        h.until_syncs(2).await;
        h.stop().await;
        let text = std::fs::read_to_string(&path).unwrap();
        let synced: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|e| e["event"] == "synced")
            .collect();
        let way = &synced[1]["change_ms"];
        let ms = |k: &str| way[k].as_f64().unwrap_or_else(|| panic!("{k} in {way}"));
        assert!(ms("received") >= 40.0, "{way}");
        assert!(ms("total") >= ms("received") + ms("queued"), "{way}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_delta_sync_event_carries_the_change_not_the_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("events.jsonl");
        let h = start_logging(
            Pacing::MinSyncPeriod(Duration::ZERO),
            &[],
            None,
            Some(path.clone()),
        );
        // Services 0, 10, 20, 30 are eTP-Local LoadBalancers with a health check.
        for i in [0, 5, 10, 20] {
            h.add(i);
        }
        h.writer.mark_ready();
        h.until_syncs(1).await;
        h.add(30);
        h.until_syncs(2).await;
        h.stop().await;
        let synced: Vec<serde_json::Value> = std::fs::read_to_string(&path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|e| e["event"] == "synced")
            .collect();
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

    /// The no-local-endpoints gauges, moved by each sync's changed Services, equal a
    /// count of the whole plan.
    #[test]
    fn no_local_counts_follow_changes_as_a_recount_would() {
        let spec = Spec {
            etp_local_every: 2,
            ..Spec::new(40, 2)
        };
        let mut state = synthetic::cluster(&spec);
        let mut planner = Planner::new(synthetic::node_name(0), PlanConfig::default());
        let mut counts = NoLocalCounts::default();
        let recount = |plan: &NodePlan| {
            IpFamily::ALL.map(|f| kproxy_core::no_local::no_local_endpoints(plan, f))
        };
        let up = planner.update(&mut state);
        counts.follow(planner.plan(), &up);
        assert!(counts.total[0].external > 0, "{counts:?}");
        assert_eq!(counts.total, recount(planner.plan()));
        for step in 1..=30usize {
            let i = (step * 7) % spec.services;
            let svc = synthetic::service(&spec, i);
            match step % 3 {
                0 => {
                    if state.service(&svc.name).is_some() {
                        state.delete_service(&svc.name);
                    } else {
                        state.upsert_service(svc);
                    }
                }
                1 => {
                    state.delete_slice(&svc.name.namespace, &format!("svc-{i}-abcde"));
                }
                _ => {
                    state.upsert_slice(synthetic::slice(&spec, i, step));
                }
            }
            let up = planner.update(&mut state);
            counts.follow(planner.plan(), &up);
            assert_eq!(counts.total, recount(planner.plan()), "step {step}");
        }
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
}
