//! The sync loop of `kproxy run`: waits until the source has listed everything, then
//! for every batch of changes (at most one sync per minSyncPeriod) re-plans what changed,
//! tells the health servers what is queued, applies the plan to the dataplane on a
//! blocking thread, and tells the health servers what is now programmed. Failed syncs
//! retry with backoff; syncPeriod forces a sync attempt; a long verifyPeriod compares the
//! kernel with what was programmed. On shutdown the rules stay in place, as kube-proxy
//! leaves them, so traffic keeps flowing across a restart.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use kproxy_core::{NodePlan, PlanConfig, Planner};
use kproxy_source::StateHandle;
use serde_json::json;
use tokio::sync::watch;

use crate::metrics::{Metrics, NoLocalLabels, StageLabel};

/// What the loop needs from a dataplane. Implemented by kproxy-nft's `Dataplane`.
pub trait Dataplane: Send + 'static {
    /// Programs `plan` (full the first time, then deltas). Blocking.
    fn sync(&mut self, plan: &NodePlan) -> Result<SyncOutcome>;
    /// Compares the kernel with what was programmed and repairs it; true when it drifted.
    fn verify(&mut self) -> Result<bool>;
}

#[derive(Debug, Default, Clone)]
pub struct SyncOutcome {
    pub full: bool,
    pub conntrack_deleted: usize,
    /// Free-form counts for the event log (chains, elements, ...).
    pub detail: serde_json::Value,
}

/// What the loop tells the health servers. Implemented by kproxy-health's `Health`.
pub trait HealthSink: Send + Sync + 'static {
    fn plan_computed(&self, plan: &Arc<NodePlan>);
    fn plan_applied(&self, plan: &Arc<NodePlan>);
    fn sync_failed(&self);
}

#[derive(Clone, Debug)]
pub struct LoopConfig {
    pub node_name: String,
    pub plan: PlanConfig,
    pub min_sync_period: Duration,
    pub sync_period: Duration,
    pub verify_period: Duration,
    pub event_log: Option<PathBuf>,
    /// Noted by the source's update hook; read by each sync.
    pub changes: ChangeClock,
}

/// When the oldest change not yet taken by a sync reached the state. The source notes
/// every update (`StateHandle::on_update`); a sync takes the instant, so each sync
/// reports the way of the oldest change it carried: queued (until planning starts,
/// including minSyncPeriod batching), plan, commit (the kernel transaction).
#[derive(Clone, Debug, Default)]
pub struct ChangeClock(Arc<Mutex<Option<Instant>>>);

impl ChangeClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn note(&self) {
        self.lock().get_or_insert_with(Instant::now);
    }

    pub fn take(&self) -> Option<Instant> {
        self.lock().take()
    }
}

/// The way of the oldest change a sync carried, in seconds, per stage.
fn change_stages(
    oldest: Instant,
    start: Instant,
    planned: Instant,
    committed: Instant,
) -> [(&'static str, f64); 4] {
    let s = |a: Instant, b: Instant| b.saturating_duration_since(a).as_secs_f64();
    [
        ("queued", s(oldest, start)),
        ("plan", s(start, planned)),
        ("commit", s(planned, committed)),
        ("total", s(oldest, committed)),
    ]
}

/// Appends one JSON object per line; a write failure is logged, never fatal.
pub struct EventLog(Option<std::fs::File>);

impl EventLog {
    pub fn open(path: Option<&PathBuf>) -> Result<EventLog> {
        let file = path
            .map(|p| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .with_context(|| format!("opening the event log {}", p.display()))
            })
            .transpose()?;
        Ok(EventLog(file))
    }

    pub fn emit(&mut self, event: &str, mut fields: serde_json::Value) {
        let Some(f) = self.0.as_mut() else { return };
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        if let Some(obj) = fields.as_object_mut() {
            obj.insert("t_unix_ms".into(), json!(now.as_millis() as u64));
            obj.insert("event".into(), json!(event));
        }
        let mut line = fields.to_string();
        line.push('\n');
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "cannot write the event log");
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Runs until `shutdown` flips to true. Returns the dataplane so the caller can decide
/// what to do with it (nothing: the rules stay).
pub async fn run<D: Dataplane, H: HealthSink>(
    cfg: LoopConfig,
    handle: StateHandle,
    mut dataplane: D,
    health: Arc<H>,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<D> {
    let mut events = EventLog::open(cfg.event_log.as_ref())?;
    while !handle.is_ready() {
        tokio::select! {
            _ = handle.changed() => {}
            _ = shutdown.changed() => return Ok(dataplane),
        }
    }
    tracing::info!(node = %cfg.node_name, "source synced; starting the sync loop");
    let mut planner = Planner::new(cfg.node_name.clone(), cfg.plan.clone());
    let mut programming = ProgrammingLatency::default();
    let mut last_conflicts: Vec<kproxy_core::conflicts::Conflict> = Vec::new();
    let mut last_sync: Option<Instant> = None;
    let mut need_sync = true; // the first sync always runs, even for an empty cluster
    let mut failures: u32 = 0;
    let mut next_verify = Instant::now() + cfg.verify_period;

    loop {
        if !need_sync {
            let wait_resync = tokio::time::sleep(cfg.sync_period);
            let wait_verify = tokio::time::sleep_until(next_verify.into());
            tokio::select! {
                _ = handle.changed() => {}
                _ = wait_resync => { tracing::debug!("syncPeriod elapsed"); }
                _ = wait_verify => {
                    next_verify = Instant::now() + cfg.verify_period;
                    let (dp, res) = blocking(dataplane, |d| d.verify()).await;
                    dataplane = dp;
                    match res {
                        Ok(true) => {
                            metrics.drift_repairs.inc();
                            tracing::warn!("kernel rules drifted from what kproxy programmed; repaired");
                            events.emit("drift_repaired", json!({}));
                        }
                        Ok(false) => {}
                        Err(e) => tracing::warn!(error = format!("{e:#}"), "verification failed"),
                    }
                    continue;
                }
                _ = shutdown.changed() => break,
            }
        }
        if *shutdown.borrow() {
            break;
        }
        // Batch: at most one sync per minSyncPeriod; changes arriving meanwhile join it.
        if let Some(t) = last_sync {
            let earliest = t + cfg.min_sync_period;
            if Instant::now() < earliest {
                metrics.last_queued_timestamp.set(unix_now());
                tokio::select! {
                    _ = tokio::time::sleep_until(earliest.into()) => {}
                    _ = shutdown.changed() => break,
                }
            }
        }
        metrics.last_queued_timestamp.set(unix_now());

        let oldest_change = cfg.changes.take();
        let start = Instant::now();
        let (update, service_events, slice_events) = handle.with(|state| {
            let c = state.changes();
            let counts = (c.service_events, c.slice_events);
            metrics.service_changes_pending.set(counts.0 as i64);
            metrics.endpoint_changes_pending.set(counts.1 as i64);
            (planner.update(state), counts.0, counts.1)
        });
        metrics.service_changes_total.inc_by(service_events);
        metrics.endpoint_changes_total.inc_by(slice_events);
        metrics.service_changes_pending.set(0);
        metrics.endpoint_changes_pending.set(0);
        need_sync = false;
        let plan = Arc::new(planner.plan().clone());
        let planned = Instant::now();
        health.plan_computed(&plan);
        if plan.conflicts != last_conflicts {
            // Each conflict once when it appears, not at every sync.
            for c in plan
                .conflicts
                .iter()
                .filter(|c| !last_conflicts.contains(c))
            {
                tracing::warn!(conflict = %c, "frontend conflict");
            }
            metrics.frontend_conflicts.set(plan.conflicts.len() as i64);
            last_conflicts = plan.conflicts.clone();
        }

        let plan2 = plan.clone();
        let (dp, res) = blocking(dataplane, move |d| d.sync(&plan2)).await;
        dataplane = dp;
        let elapsed = start.elapsed();
        last_sync = Some(Instant::now());
        match res {
            Ok(outcome) => {
                failures = 0;
                let stages =
                    oldest_change.map(|t| change_stages(t, start, planned, start + elapsed));
                for (stage, secs) in stages.iter().flatten() {
                    metrics
                        .change_stages
                        .get_or_create(&StageLabel { stage })
                        .observe(*secs);
                }
                metrics.sync_duration.observe(elapsed.as_secs_f64());
                if outcome.full {
                    metrics.sync_full_duration.observe(elapsed.as_secs_f64());
                } else {
                    metrics.sync_partial_duration.observe(elapsed.as_secs_f64());
                }
                metrics.last_sync_timestamp.set(unix_now());
                metrics
                    .conntrack_deleted
                    .inc_by(outcome.conntrack_deleted as u64);
                set_no_local_endpoints(&metrics, &plan);
                health.plan_applied(&plan);
                handle.with(|state| programming.observe(&metrics, state, &update.services));
                let level_info = outcome.full || !update.services.is_empty() || update.node;
                if level_info {
                    tracing::info!(
                        full = outcome.full,
                        services_changed = update.services.len(),
                        elapsed_ms = elapsed.as_secs_f64() * 1e3,
                        "synced"
                    );
                } else {
                    tracing::debug!(
                        elapsed_ms = elapsed.as_secs_f64() * 1e3,
                        "periodic sync: nothing changed"
                    );
                }
                events.emit(
                    "synced",
                    json!({
                        "full": outcome.full,
                        "services_changed": update.services.len(),
                        "elapsed_ms": elapsed.as_secs_f64() * 1e3,
                        "conntrack_deleted": outcome.conntrack_deleted,
                        "health_checks": plan.health_checks().map(|h| json!({
                            "service": h.service.to_string(),
                            "port": h.health_check_node_port,
                            "localEndpoints": h.local_endpoints,
                        })).collect::<Vec<_>>(),
                        "detail": outcome.detail,
                        "change_ms": stages.map(|st| st
                            .iter()
                            .map(|(k, v)| (k.to_string(), json!(v * 1e3)))
                            .collect::<serde_json::Map<_, _>>()),
                    }),
                );
            }
            Err(e) => {
                failures += 1;
                metrics.nftables_sync_failures.inc();
                health.sync_failed();
                // The planner has consumed the changes; force the next attempt to
                // re-send everything so nothing is lost.
                handle.with(|state| state.mark_all_changed());
                let backoff = retry_after(failures, cfg.min_sync_period, cfg.sync_period);
                tracing::error!(
                    error = format!("{e:#}"),
                    retry_in_ms = backoff.as_millis() as u64,
                    "sync failed"
                );
                events.emit("sync_failed", json!({ "error": format!("{e:#}") }));
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shutdown.changed() => break,
                }
                need_sync = true;
            }
        }
        if handle.with(|s| !s.changes().is_empty()) {
            need_sync = true;
        }
    }
    tracing::info!("shutting down; nftables rules stay in place");
    events.emit("stopped", json!({}));
    Ok(dataplane)
}

/// Exponential backoff from max(minSyncPeriod, 100 ms), capped at syncPeriod.
fn retry_after(failures: u32, min_sync: Duration, sync_period: Duration) -> Duration {
    let base = min_sync.max(Duration::from_millis(100));
    let factor = 1u32 << failures.saturating_sub(1).min(10);
    (base * factor).min(sync_period.max(base))
}

async fn blocking<D: Send + 'static, R: Send + 'static>(
    mut d: D,
    f: impl FnOnce(&mut D) -> Result<R> + Send + 'static,
) -> (D, Result<R>) {
    match tokio::task::spawn_blocking(move || {
        let r = f(&mut d);
        (d, r)
    })
    .await
    {
        Ok(x) => x,
        // The dataplane panicked: the process cannot continue safely without it.
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

/// Upstream's `sync_proxy_rules_no_local_endpoints_total{traffic_policy, ip_family}`:
/// the decision is `kproxy_core::no_local`; one gauge pair per family of the plan.
fn set_no_local_endpoints(metrics: &Metrics, plan: &NodePlan) {
    for f in &plan.families {
        let n = kproxy_core::no_local::no_local_endpoints(plan, f.family);
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

    #[test]
    fn retry_backoff_grows_and_is_capped_by_sync_period() {
        let (min, period) = (Duration::from_millis(200), Duration::from_secs(5));
        let got: Vec<u128> = (1..=8)
            .map(|f| retry_after(f, min, period).as_millis())
            .collect();
        assert_eq!(got, [200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(
            retry_after(1, Duration::ZERO, period),
            Duration::from_millis(100)
        );
    }
}
