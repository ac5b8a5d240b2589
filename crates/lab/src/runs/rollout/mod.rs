//! One rollout run end to end: fabric, control plane, kproxy per node, load
//! balancer, initial Deployment, load, one rolling update, settle, teardown. Returns
//! the raw request records and the event timeline; `report` turns them into words
//! and pictures.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::LabError;
use crate::report::RunResult;
use crate::report::kernel::NodeCounts;
use crate::runs::{Progress, Workdir, blocking, check_daemons, finish, on_lab_runtime, wait_for};
use crate::scenario::balancer::HealthCheck;
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::run::{Behaviour, Chaos, ChaosMoment, ControlPlaneKind, RunOptions};
use crate::scenario::service::{
    HEALTH_CHECK_NODE_PORT, NODE_PORT, PROXY_HEALTHZ_PORT, SERVICE_PORT, VIP,
};
use crate::world::cluster::{Cluster, PodApi};
use crate::world::controlplane::ControlPlane;
use crate::world::fabric::Fabric;
use crate::world::k8s::{K8sLab, RealControlPlane};
use crate::world::kproxyd::{self, KproxySource, Kproxyd};
use crate::world::lb::LoadBalancer;
use crate::world::loadgen::{LoadGenerator, RequestRecord};
use crate::world::timeline::{Clock, EventKind, LatenessWatch, Recorder};
use chaos::disturb;
use drain::drain_node;

mod chaos;
mod drain;

/// Start the rolling update to `revision` with the run's Deployment controller.
fn spawn_rollout(
    cluster: &Arc<Cluster>,
    real: Option<&Arc<RealControlPlane>>,
    revision: u32,
    limit: Duration,
) -> tokio::task::JoinHandle<Result<(), LabError>> {
    let c2 = cluster.clone();
    match real {
        Some(r) => {
            let r = r.clone();
            let clock = cluster.recorder.clock().clone();
            tokio::spawn(async move { r.rollout(&c2, &clock, revision, limit).await })
        }
        None => tokio::spawn(async move { c2.rollout(revision, limit).await }),
    }
}

/// Run one rollout with `behaviour` and the disturbances of `opts`, using the kproxy
/// binary at `kproxy`.
pub fn run_with(
    cfg: &RolloutConfig,
    behaviour: Behaviour,
    run: usize,
    kproxy: &Path,
    opts: RunOptions,
    progress: Progress,
) -> Result<RunResult, LabError> {
    cfg.validate()?;
    on_lab_runtime(run_async(cfg, behaviour, run, kproxy, opts, progress))
}

async fn run_async(
    cfg: &RolloutConfig,
    behaviour: Behaviour,
    run: usize,
    kproxy: &Path,
    opts: RunOptions,
    progress: Progress<'_>,
) -> Result<RunResult, LabError> {
    let clock = Clock::new(cfg.time_scale);
    let wall_start = SystemTime::now();
    let rec = Recorder::new(clock.clone());
    let _late = LatenessWatch::start(rec.clone());
    let hc = cfg.load_balancer.effective_health_check()?;
    let tag = format!("[{} run {}]", behaviour.as_str(), run + 1);

    let fabric = Arc::new(Fabric::build(cfg.nodes)?);
    let workdir = Workdir::create(&fabric.prefix)?;
    progress(&format!(
        "{tag} network up: {} nodes, LB and client namespaces ({})",
        cfg.nodes, fabric.prefix
    ));
    let planes = start_control_plane(cfg, &opts, &fabric, &workdir.path, &rec).await?;
    progress(&format!(
        "{tag} control plane: {}",
        opts.control_plane.as_str()
    ));
    let ControlPlanes {
        emulated,
        real,
        api,
        dirs,
    } = planes;

    // kproxy's shutdown drain period, `--shutdown-drain-period`, on the lab's clock:
    // the load balancer's detection window and a second, as its 26 s default is for
    // the clouds' (a node shutdown's only time to leave the pool).
    let shutdown_drain = [
        "--shutdown-drain-period".to_string(),
        format!(
            "{}ms",
            clock.real(hc.detection_window_s() + 1.0).as_millis()
        ),
    ];
    let mut daemons = Vec::new();
    for (i, n) in fabric.nodes.iter().enumerate() {
        let source = match &real {
            Some(r) => KproxySource::Kubeconfig(&r.lab.proxy_kubeconfig),
            None => KproxySource::Manifests(&dirs[i]),
        };
        daemons.push(Kproxyd::start_from(
            kproxy,
            n,
            source,
            &workdir.path,
            behaviour == Behaviour::Kproxy,
            &shutdown_drain,
        )?);
    }
    let p = &cfg.pod.readiness_probe;
    let nominal_limit = p.initial_delay_seconds
        + p.period_seconds * (p.success_threshold as f64 + 2.0)
        + cfg.pod.termination_grace_period_seconds
        + cfg.deployment.min_ready_seconds
        + hc.interval_seconds * (hc.healthy_threshold as f64 + 2.0)
        + 30.0;
    let phase = Phase {
        cfg,
        opts,
        clock: &clock,
        rec: &rec,
        tag: &tag,
        progress,
        fabric: &fabric,
        real: real.as_ref(),
        wall_start,
        step_limit: clock.real(nominal_limit) + Duration::from_secs(20),
    };
    let result = phase
        .under_load(hc, api, emulated.as_ref(), &mut daemons)
        .await;
    for d in daemons.iter_mut() {
        blocking(|| d.stop());
        d.import_events(&rec, wall_start);
    }
    if let Some(r) = &real
        && let Err(e) = r.stop().await
    {
        progress(&format!(
            "{tag} warning: cleaning the k8s-lab namespace: {e}"
        ));
    }
    let times = match result {
        Ok(v) => v,
        Err(e) => {
            let mut kept: Vec<String> = daemons
                .iter()
                .map(|d| d.log.display().to_string())
                .collect();
            if let Ok(path) = write_timeline(&workdir.path, &rec, &[], wall_start, cfg.time_scale) {
                kept.push(path.display().to_string());
            }
            workdir.keep();
            return Err(LabError::Invalid(format!(
                "{e} (kproxy logs and the timeline kept: {})",
                kept.join(", ")
            )));
        }
    };
    let failed: Vec<&RequestRecord> = times
        .records
        .iter()
        .filter(|r| !r.outcome.is_ok())
        .collect();
    if keep_run(
        behaviour,
        failed.len(),
        std::env::var(KEEP_ENV).ok().as_deref(),
    ) {
        // A loss is diagnosed from kproxy's logs beside the lab's timeline: keep both.
        match write_timeline(&workdir.path, &rec, &failed, wall_start, cfg.time_scale) {
            Ok(path) => {
                workdir.keep();
                progress(&format!(
                    "{tag} {} requests failed: kproxy logs and the timeline kept in {} ({})",
                    failed.len(),
                    workdir.path.display(),
                    path.display()
                ));
            }
            Err(e) => progress(&format!("{tag} warning: keeping the timeline: {e}")),
        }
    }
    Ok(RunResult {
        behaviour,
        control_plane: opts.control_plane,
        run,
        time_scale: cfg.time_scale,
        nodes: fabric.nodes.iter().map(|n| n.name.clone()).collect(),
        health_check: hc,
        records: times.records,
        events: rec.events(),
        load_start_ms: times.load_start_ms,
        rollout_start_ms: times.rollout_start_ms,
        rollout_end_ms: times.rollout_end_ms,
        load_end_ms: times.load_end_ms,
        drain: opts.drain,
        kernel: times.kernel,
    })
}

/// The run's control plane: the lab's emulation (kept apart too, for a node drain's
/// writes) or the k8s-lab instance's, and the API the kubelets write pods through.
struct ControlPlanes {
    emulated: Option<ControlPlane>,
    real: Option<Arc<RealControlPlane>>,
    api: Arc<dyn PodApi>,
    /// The emulation's manifest directory of each node, in node order (none with the
    /// real control plane: kproxy watches the API).
    dirs: Vec<PathBuf>,
}

async fn start_control_plane(
    cfg: &RolloutConfig,
    opts: &RunOptions,
    fabric: &Fabric,
    workdir: &Path,
    rec: &Recorder,
) -> Result<ControlPlanes, LabError> {
    let etp_local = opts.etp_local();
    match opts.control_plane {
        ControlPlaneKind::Emulated => {
            let (cp, dirs) =
                ControlPlane::start_for_nodes(fabric, workdir, cfg, etp_local, rec.clone())?;
            Ok(ControlPlanes {
                emulated: Some(cp.clone()),
                real: None,
                api: Arc::new(cp),
                dirs,
            })
        }
        ControlPlaneKind::K8sLab => {
            let lab = K8sLab::from_env()?;
            let r = RealControlPlane::start(
                lab,
                fabric,
                cfg.publish_not_ready_addresses,
                etp_local,
                rec.clone(),
            )
            .await?;
            let api = r.writer.clone();
            Ok(ControlPlanes {
                emulated: None,
                real: Some(Arc::new(r)),
                api,
                dirs: Vec::new(),
            })
        }
    }
}

/// What the phases of one run share once the network, the control plane and the
/// daemons are up.
struct Phase<'a> {
    cfg: &'a RolloutConfig,
    opts: RunOptions,
    clock: &'a Clock,
    rec: &'a Recorder,
    tag: &'a str,
    progress: Progress<'a>,
    fabric: &'a Arc<Fabric>,
    real: Option<&'a Arc<RealControlPlane>>,
    wall_start: SystemTime,
    /// The longest one step (a pod's start or end, the LB's view of it) may take.
    step_limit: Duration,
}

/// The load's records and when the load and the rollout (or drain) started and ended.
struct Times {
    records: Vec<RequestRecord>,
    load_start_ms: f64,
    rollout_start_ms: f64,
    rollout_end_ms: f64,
    load_end_ms: f64,
    /// Each node's kernel counters over the load.
    kernel: Vec<NodeCounts>,
}

/// Every node's counters now ([`Kproxyd::traffic_totals`]).
fn read_counters(daemons: &[Kproxyd]) -> Vec<(String, Result<[u64; 4], String>)> {
    daemons
        .iter()
        .map(|d| (d.node.clone(), blocking(|| d.traffic_totals())))
        .collect()
}

/// What each node counted between two readings.
fn counted_between(
    before: Vec<(String, Result<[u64; 4], String>)>,
    after: Vec<(String, Result<[u64; 4], String>)>,
) -> Vec<NodeCounts> {
    before
        .into_iter()
        .zip(after)
        .map(|((node, b), (_, a))| match (b, a) {
            (Ok(b), Ok(a)) => {
                let d = |i: usize| a[i].saturating_sub(b[i]);
                NodeCounts {
                    node,
                    new: d(0),
                    rejected: d(1),
                    dropped: d(2),
                    fallback: d(3),
                    error: None,
                }
            }
            (Err(e), _) | (_, Err(e)) => NodeCounts {
                node,
                error: Some(e),
                ..NodeCounts::default()
            },
        })
        .collect()
}

/// Whether the load balancer sees every node with a ready pod as healthy.
fn pool_complete(cluster: &Cluster, lb: &LoadBalancer) -> bool {
    let h = lb.healthy();
    cluster
        .pods()
        .iter()
        .filter(|p| p.is_ready() && !p.is_deleting())
        .all(|p| h.get(p.node_index - 1).copied().unwrap_or(false))
}

impl Phase<'_> {
    /// The load balancer and the cluster up, then the load through the rollout (or
    /// the drain) until the pool is complete again and the run has settled.
    async fn under_load(
        &self,
        hc: HealthCheck,
        api: Arc<dyn PodApi>,
        emulated: Option<&ControlPlane>,
        daemons: &mut [Kproxyd],
    ) -> Result<Times, LabError> {
        let (cfg, rec, clock) = (self.cfg, self.rec, self.clock);
        let mut lb = LoadBalancer::start(
            self.fabric,
            cfg.load_balancer.mode,
            hc,
            // eTP Cluster has no health check node port: the LB probes kproxy's /healthz.
            if !self.opts.etp_local() {
                PROXY_HEALTHZ_PORT
            } else {
                HEALTH_CHECK_NODE_PORT
            },
            NODE_PORT,
            SERVICE_PORT,
            rec.clone(),
        )?;
        let cluster = Cluster::new(
            self.fabric.clone(),
            api,
            rec.clone(),
            cfg.pod,
            cfg.deployment,
        );
        if let Some(r) = self.real {
            r.start_agent(cluster.clone(), rec.clone());
        }
        self.bring_up(&cluster, &lb, daemons).await?;
        (self.progress)(&format!(
            "{} {} pods ready, load balancer pool complete; starting load",
            self.tag, cfg.deployment.replicas
        ));

        // kproxy's kernel counters, read again when the load stops: what the nodes
        // counted of it, for the report to set beside the load generator's failures.
        let counters_before = read_counters(daemons);
        let load = LoadGenerator::start(
            self.fabric.client.name(),
            std::net::SocketAddr::from((VIP, SERVICE_PORT)),
            cfg.load.clone(),
            clock.start(),
        )?;
        let load_start_ms = clock.now_ms();
        rec.record(EventKind::LoadStarted, None, None, "load generator started");
        tokio::time::sleep(clock.real(cfg.warmup_seconds)).await;

        let rollout_limit = self.step_limit * (cfg.deployment.replicas + 1);
        let (rollout_start_ms, rollout_end_ms) = if let Some(d) = self.opts.drain {
            drain_node(
                d,
                &cluster,
                emulated,
                self.real,
                self.fabric,
                &lb,
                daemons,
                rollout_limit,
                self.tag,
                self.progress,
            )
            .await?
        } else {
            self.rolling_update(&cluster, &load, daemons, rollout_limit)
                .await?
        };
        wait_for(
            "the load balancer pool to be complete again",
            self.step_limit,
            daemons,
            || pool_complete(&cluster, &lb),
        )
        .await?;
        tokio::time::sleep(clock.real(cfg.settle_seconds)).await;
        let records = load.stop();
        let load_end_ms = clock.now_ms();
        let kernel = counted_between(counters_before, read_counters(daemons));
        rec.record(
            EventKind::LoadStopped,
            None,
            None,
            "load generator stopped; in-flight requests finished",
        );
        check_daemons(daemons)?;
        let failed = records.iter().filter(|r| !r.outcome.is_ok()).count();
        (self.progress)(&format!(
            "{} done: {} requests, {failed} failed",
            self.tag,
            records.len()
        ));
        lb.stop();
        cluster.shutdown().await;
        Ok(Times {
            records,
            load_start_ms,
            rollout_start_ms,
            rollout_end_ms,
            load_end_ms,
            kernel,
        })
    }

    /// The initial Deployment (revision 1), then the load balancer seeing every node
    /// that has a pod as healthy (and, for a drain's eTP Cluster Service, every kproxy
    /// having programmed the endpoints).
    async fn bring_up(
        &self,
        cluster: &Arc<Cluster>,
        lb: &LoadBalancer,
        daemons: &mut [Kproxyd],
    ) -> Result<(), LabError> {
        let initial = spawn_rollout(cluster, self.real, 1, self.step_limit);
        finish(
            "the initial pods to become ready",
            "rollout",
            self.step_limit,
            daemons,
            initial,
            || {},
        )
        .await?;
        // Pods that are Ready before they listen (`listenDelayMs`): the cluster the
        // rollout starts from has been serving for long, so the load starts once they
        // listen.
        wait_for(
            "the initial pods to listen",
            self.step_limit,
            daemons,
            || cluster.pods().iter().all(|p| p.is_listening()),
        )
        .await?;
        wait_for(
            "the load balancer to see the nodes healthy",
            self.step_limit,
            daemons,
            || pool_complete(cluster, lb),
        )
        .await?;
        if !self.opts.etp_local() {
            // eTP Cluster: /healthz passes before the endpoints are programmed (the
            // health check node port of eTP Local waits for them); wait until the
            // EndpointSlice lists every replica ready and every node's kproxy synced
            // after that change reached it.
            let replicas = self.cfg.deployment.replicas as usize;
            let logs: Vec<PathBuf> = daemons.iter().map(|d| d.event_log.clone()).collect();
            wait_for(
                "every kproxy to program the endpoints",
                self.step_limit,
                daemons,
                || {
                    let last = self
                        .rec
                        .events()
                        .into_iter()
                        .rfind(|e| e.kind == EventKind::SlicePublished);
                    last.is_some_and(|e| {
                        let t = self.wall_start + Duration::from_secs_f64(e.t_ms / 1000.0);
                        e.detail.matches(":R").count() == replicas
                            && logs.iter().all(|l| kproxyd::synced_after(l, t))
                    })
                },
            )
            .await?;
        }
        Ok(())
    }

    /// The rolling update to revision 2, with the run's disturbances; returns when it
    /// started and ended.
    async fn rolling_update(
        &self,
        cluster: &Arc<Cluster>,
        load: &LoadGenerator,
        daemons: &mut [Kproxyd],
        limit: Duration,
    ) -> Result<(f64, f64), LabError> {
        let (cfg, rec, tag) = (self.cfg, self.rec, self.tag);
        let start_ms = self.clock.now_ms();
        rec.record(
            EventKind::RolloutStarted,
            None,
            None,
            "rolling update to revision 2",
        );
        (self.progress)(&format!("{tag} rolling update started"));
        let rollout = spawn_rollout(cluster, self.real, 2, limit);
        if let Some(chaos) = self.opts.chaos {
            self.wait_for_chaos(chaos, cluster, daemons, &rollout, limit)
                .await?;
            disturb(
                chaos,
                self.fabric,
                daemons,
                self.real,
                rec,
                tag,
                self.progress,
            )
            .await?;
        }
        let mut last_line = Instant::now();
        let progress_line = || {
            if last_line.elapsed() > Duration::from_secs(2) {
                last_line = Instant::now();
                let (sent, failed) = load.counts();
                let new = cluster
                    .pods()
                    .iter()
                    .filter(|p| p.revision == 2 && p.is_ready())
                    .count();
                (self.progress)(&format!(
                    "{tag}   {new}/{} new pods ready; {sent} requests sent, {failed} failed",
                    cfg.deployment.replicas
                ));
            }
        };
        finish(
            "the rolling update",
            "rollout",
            limit,
            daemons,
            rollout,
            progress_line,
        )
        .await?;
        let end_ms = self.clock.now_ms();
        rec.record(
            EventKind::RolloutDone,
            None,
            None,
            "all replicas of revision 2 available",
        );
        Ok((start_ms, end_ms))
    }

    /// Waits for the moment `chaos` happens ([`Chaos::moment`]).
    async fn wait_for_chaos(
        &self,
        chaos: Chaos,
        cluster: &Arc<Cluster>,
        daemons: &mut [Kproxyd],
        rollout: &tokio::task::JoinHandle<Result<(), LabError>>,
        limit: Duration,
    ) -> Result<(), LabError> {
        let rec = self.rec;
        match chaos.moment() {
            ChaosMoment::Node1LastOldPodTerminating => {
                // Node 1's last old pod: every pod of revision 1 there is deleting.
                let node1_last_old_terminating = || {
                    let old: Vec<_> = cluster
                        .pods()
                        .into_iter()
                        .filter(|p| p.node_index == 0 && p.revision == 1)
                        .collect();
                    !old.is_empty() && old.iter().all(|p| p.is_deleting())
                };
                wait_for(
                    "node 1's last old pod to become terminating",
                    limit,
                    daemons,
                    || node1_last_old_terminating() || rollout.is_finished(),
                )
                .await
            }
            ChaosMoment::SecondOldPodTerminating => {
                let step = 2.min(self.cfg.deployment.replicas as usize);
                let terminating = || {
                    rec.events()
                        .iter()
                        .filter(|e| e.kind == EventKind::PodTerminating)
                        .count()
                };
                wait_for(
                    "an old pod of the rollout's second step to become terminating",
                    limit,
                    daemons,
                    || terminating() >= step || rollout.is_finished(),
                )
                .await
            }
        }
    }
}

/// `1`: every run keeps kproxy's logs and its timeline; `0`: no run that ended keeps
/// them (tests that lose requests by design); unset: a run with kproxy behaviour that
/// lost requests keeps them. A run that ends in error always does.
pub const KEEP_ENV: &str = "KPROXY_LAB_KEEP";

/// Whether a run that ended with `failed` failed requests keeps its logs and timeline,
/// given [`KEEP_ENV`]. Pre-1.26 behaviour loses requests by design and its report says
/// why: its losses are no reason to keep.
fn keep_run(behaviour: Behaviour, failed: usize, keep: Option<&str>) -> bool {
    match keep {
        Some("0") => false,
        Some("1") => true,
        _ => behaviour == Behaviour::Kproxy && failed > 0,
    }
}

/// Writes the run's timeline and its failed requests to `timeline.json` in `dir`, next
/// to kproxy's logs; `wall_start_unix_ms` turns its run-relative times (real ms) into
/// the wall times the logs carry.
fn write_timeline(
    dir: &Path,
    rec: &Recorder,
    failed: &[&RequestRecord],
    wall_start: SystemTime,
    time_scale: f64,
) -> Result<PathBuf, LabError> {
    let wall_start_unix_ms = wall_start
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1e3)
        .unwrap_or(0.0);
    let text = serde_json::to_string_pretty(&serde_json::json!({
        "wall_start_unix_ms": wall_start_unix_ms,
        "time_scale": time_scale,
        "events": rec.events(),
        "failed_requests": failed,
    }))
    .map_err(|e| LabError::Invalid(format!("encoding the timeline: {e}")))?;
    let path = dir.join("timeline.json");
    std::fs::write(&path, text).map_err(|e| LabError::Io {
        what: format!("write {}", path.display()),
        source: e,
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_keeps_its_logs_when_kproxy_lost_requests_or_when_asked() {
        use Behaviour::{Kproxy, Pre126};
        for (behaviour, failed, keep, kept) in [
            (Kproxy, 0, None, false),
            (Kproxy, 3, None, true),
            (Pre126, 40, None, false),
            (Kproxy, 3, Some("0"), false),
            (Pre126, 0, Some("1"), true),
            (Kproxy, 3, Some("yes"), true),
        ] {
            assert_eq!(
                keep_run(behaviour, failed, keep),
                kept,
                "{behaviour:?} {failed} {keep:?}"
            );
        }
    }
}
