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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::{NodePlan, PlanConfig, Planner};
use kproxy_source::{Pending, Reader, Status};
use serde_json::json;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::event_log::EventLog;
use crate::kernel_watch::{self, KernelWatch};
use crate::metrics::{Metrics, StageLabel};
use crate::pacing::{Pacer, Pacing};
use no_local::NoLocalCounts;
use programming_latency::ProgrammingLatency;

mod no_local;
mod programming_latency;
#[cfg(test)]
mod tests;

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
