//! One rollout run end to end: fabric, control plane, kproxy per node, load
//! balancer, initial Deployment, load, one rolling update, settle, teardown. Returns
//! the raw request records and the event timeline; `report` turns them into words
//! and pictures.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::LabError;
use crate::cluster::{Cluster, PodApi};
use crate::config::RolloutConfig;
use crate::controlplane::{self, ControlPlane};
use crate::fabric::{self, Fabric};
use crate::k8s::{K8sLab, RealControlPlane};
use crate::kproxyd::{self, KproxySource, Kproxyd};
use crate::lb::{HealthCheck, LoadBalancer};
use crate::loadgen::{LoadGenerator, RequestRecord};
use crate::timeline::{Clock, Event, EventKind, Recorder};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Behaviour {
    /// kproxy as it ships: failover to serving-terminating endpoints.
    #[serde(rename = "kproxy")]
    Kproxy,
    /// kube-proxy before 1.26: `--proxy-terminating-endpoints=false`, and `/healthz`
    /// ignores the Node's scale-down taint (`kproxyd::PRE_126_FLAGS`).
    #[serde(rename = "pre-1.26")]
    Pre126,
}

impl Behaviour {
    pub fn as_str(self) -> &'static str {
        match self {
            Behaviour::Kproxy => "kproxy",
            Behaviour::Pre126 => "pre-1.26",
        }
    }
}

/// Everything one run produced. Times are real ms since the run's clock started.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub behaviour: Behaviour,
    pub control_plane: ControlPlaneKind,
    pub run: usize,
    pub time_scale: f64,
    pub nodes: Vec<String>,
    pub health_check: HealthCheck,
    pub records: Vec<RequestRecord>,
    pub events: Vec<Event>,
    pub load_start_ms: f64,
    pub rollout_start_ms: f64,
    pub rollout_end_ms: f64,
    pub load_end_ms: f64,
    /// The node drain the run performed instead of a rolling update (the Service was
    /// `externalTrafficPolicy: Cluster`); None: a rolling update of an eTP-Local Service.
    pub drain: Option<NodeDrain>,
}

pub type Progress<'a> = &'a (dyn Fn(&str) + Sync);

/// Which control plane runs the Deployment and EndpointSlice controllers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ControlPlaneKind {
    /// The lab's own emulation (`controlplane`, `cluster`); kproxy reads manifests.
    #[default]
    Emulated,
    /// kube-apiserver and kube-controller-manager of the k8s-lab instance named by
    /// `K8S_LAB`; kproxy watches the API (`k8s`).
    K8sLab,
}

impl ControlPlaneKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ControlPlaneKind::Emulated => "emulated",
            ControlPlaneKind::K8sLab => "k8s-lab",
        }
    }
}

/// A node drain by the cluster autoscaler (the matrix's node-drain row), run instead
/// of the rolling update, with an `externalTrafficPolicy: Cluster` Service whose load
/// balancer probes every node's kproxy `/healthz` (KEP-3836): the node is tainted
/// `ToBeDeletedByClusterAutoscaler`, its pods are evicted (the Deployment replaces
/// them on other nodes), and once they are gone and `delete_after_s` more has passed,
/// the node is deleted: its kproxy stops, its link is cut, its Node object goes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct NodeDrain {
    /// The drained node (1-based).
    pub node: usize,
    /// Nominal seconds from the drained node's last pod being gone to its deletion.
    pub delete_after_s: f64,
}

/// Chaos during the rolling update (the scenario matrix's extra rows). Each happens
/// once, when the rollout's second old pod becomes terminating (`KillKproxy`: when node
/// 1's last old pod does), so a pod is serving-terminating while it happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Chaos {
    /// Every node's kproxy stopped (SIGTERM) and started again: the new processes must
    /// pick up where the old ones left.
    #[value(name = "kproxy-restart")]
    #[serde(rename = "kproxy-restart")]
    RestartKproxy,
    /// Node 1's whole nftables ruleset flushed (`nft flush ruleset`, another process than
    /// kproxy): kproxy must restore its rules before traffic notices.
    #[value(name = "nft-flush")]
    #[serde(rename = "nft-flush")]
    FlushRuleset,
    /// Node 1's kproxy SIGKILLed (no shutdown path runs) and started again.
    #[value(name = "kproxy-kill")]
    #[serde(rename = "kproxy-kill")]
    KillKproxy,
    /// The API server (k8s-lab) killed for [`API_OUTAGE_S`], then started again with the
    /// same command line, once the terminating pod's EndpointSlice change is out (a
    /// change the API never published no proxy can act on): the rollout pauses, nodes
    /// keep their rules. kube-controller-manager goes down and comes back with it, as a
    /// production kcm (leader election on) does in an outage longer than its lease's
    /// renew deadline.
    ApiOutage,
    /// Every connection of node 1's kproxy to the API server reset (its API bridge):
    /// its watches must resume without losing a change.
    WatchCut,
}

/// Nominal seconds the API server stays down in [`Chaos::ApiOutage`] before it is
/// started again (its own start then adds real seconds: the timeline shows when it
/// answered again).
pub const API_OUTAGE_S: f64 = 30.0;

impl Chaos {
    /// Only the real control plane has an API server to kill or connections to cut.
    pub fn needs_real_api(self) -> bool {
        matches!(self, Chaos::ApiOutage | Chaos::WatchCut)
    }
}

/// Disturbances a run adds to the rolling update (the scenario matrix's extra rows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RunOptions {
    /// Chaos during the rolling update.
    pub chaos: Option<Chaos>,
    /// The control plane the run uses.
    pub control_plane: ControlPlaneKind,
    /// Drain a node instead of rolling the Deployment.
    pub drain: Option<NodeDrain>,
}

/// Does `chaos` to the running lab, recording it on the timeline.
async fn disturb(
    chaos: Chaos,
    fabric: &Fabric,
    daemons: &mut [Kproxyd],
    real: Option<&Arc<RealControlPlane>>,
    rec: &Recorder,
    tag: &str,
    progress: Progress<'_>,
) -> Result<(), LabError> {
    let node1 = fabric.nodes.first().map(|n| n.name.clone());
    match chaos {
        Chaos::FlushRuleset => {
            if let Some(node) = fabric.nodes.first() {
                node.ns.exec("nft", &["flush", "ruleset"])?;
                rec.record(
                    EventKind::RulesetFlushed,
                    Some(&node.name),
                    None,
                    "nft flush ruleset (another process)",
                );
                progress(&format!("{tag} flushed {}'s nftables ruleset", node.name));
            }
        }
        Chaos::RestartKproxy => {
            for d in daemons.iter_mut() {
                d.restart()?;
                rec.record(
                    EventKind::KproxyRestarted,
                    Some(&d.node),
                    None,
                    "kproxy stopped (SIGTERM) and started again",
                );
            }
            progress(&format!("{tag} restarted kproxy on every node"));
        }
        Chaos::KillKproxy => {
            if let Some(d) = daemons.first_mut() {
                d.kill_and_start()?;
                rec.record(
                    EventKind::KproxyKilled,
                    Some(&d.node),
                    None,
                    "kproxy SIGKILLed and started again",
                );
                progress(&format!(
                    "{tag} SIGKILLed {}'s kproxy and started it again",
                    d.node
                ));
            }
        }
        Chaos::ApiOutage | Chaos::WatchCut => {
            let real = real.ok_or_else(|| {
                LabError::Invalid(format!(
                    "{} needs --control-plane k8s-lab",
                    chaos_str(chaos)
                ))
            })?;
            if chaos == Chaos::WatchCut {
                let n = real.cut_api_connections(0);
                rec.record(
                    EventKind::ApiConnectionsCut,
                    node1.as_deref(),
                    None,
                    format!("{n} API connections of this node's kproxy reset"),
                );
                progress(&format!(
                    "{tag} reset {n} API connections of node 1's kproxy"
                ));
            } else {
                // The terminating pod's change published first (bounded: a slice that
                // never comes is the run's finding, not a reason to wait forever).
                let terminating_at = rec
                    .events()
                    .iter()
                    .filter(|e| e.kind == EventKind::PodTerminating)
                    .map(|e| e.t_ms)
                    .fold(0.0, f64::max);
                let published = || {
                    rec.events()
                        .iter()
                        .any(|e| e.kind == EventKind::SlicePublished && e.t_ms >= terminating_at)
                };
                let wait = Instant::now();
                while !published() && wait.elapsed() < Duration::from_secs(10) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let server = crate::k8s::LabProcess::find(&real.lab, "kube-apiserver")?;
                // kcm goes down with it, as a production kcm does: it runs with leader
                // election (the default; the k8s-lab's runs without), cannot renew its
                // lease for renewDeadline (10 s) of a 30 s outage, exits, and its kubelet
                // starts it again, to relist once the API answers. A kcm left running
                // through the outage instead resumes from informer caches it thinks are
                // stale and leaves terminations unpublished while its other controllers
                // go on (docs/lab.md, "Chaos cells").
                let kcm = crate::k8s::LabProcess::find(&real.lab, "kube-controller-manager")?;
                server.kill()?;
                kcm.kill()?;
                rec.record(
                    EventKind::ApiServerDown,
                    None,
                    None,
                    format!(
                        "kube-apiserver and kube-controller-manager killed for {API_OUTAGE_S} s nominal"
                    ),
                );
                progress(&format!(
                    "{tag} killed the API server for {API_OUTAGE_S} s nominal"
                ));
                tokio::time::sleep(rec.clock().real(API_OUTAGE_S)).await;
                server.start_again()?;
                let down = Instant::now();
                while crate::k8s::get_deployment(&real.client).await.is_err()
                    && down.elapsed() < Duration::from_secs(120)
                {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                rec.record(
                    EventKind::ApiServerUp,
                    None,
                    None,
                    format!(
                        "kube-apiserver answering again, {:.1} s after its start",
                        down.elapsed().as_secs_f64()
                    ),
                );
                progress(&format!("{tag} the API server answers again"));
                let starts = start_kcm_as_kubelet_would(&kcm, rec.clock()).await?;
                progress(&format!(
                    "{tag} kube-controller-manager running again ({starts} start(s))"
                ));
            }
        }
    }
    Ok(())
}

/// kcm started again once the API answers, and again after a kubelet's restart
/// backoff (10 s nominal) each time it exits within 5 s (real: its own start): a kcm
/// started while the API server's authorizer still warms up exits ("configmaps
/// extension-apiserver-authentication is forbidden"), and its kubelet restarts it.
/// How many starts it took.
async fn start_kcm_as_kubelet_would(
    kcm: &crate::k8s::LabProcess,
    clock: &crate::timeline::Clock,
) -> Result<u32, LabError> {
    const BACKOFF_S: f64 = 10.0;
    for starts in 1..=10 {
        let mut child = kcm.start_again()?;
        let started = Instant::now();
        let exited = loop {
            match child.try_wait() {
                Ok(Some(_)) => break true,
                Ok(None) if started.elapsed() >= Duration::from_secs(5) => break false,
                Ok(None) => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => {
                    return Err(LabError::Io {
                        what: "wait for kube-controller-manager".into(),
                        source: e,
                    });
                }
            }
        };
        if !exited {
            return Ok(starts);
        }
        tokio::time::sleep(clock.real(BACKOFF_S)).await;
    }
    Err(LabError::Invalid(
        "kube-controller-manager exited 10 times after the API outage; see its log in the k8s-lab's logs/".into(),
    ))
}

/// The chaos's name in the matrix and on the command line.
pub fn chaos_str(chaos: Chaos) -> &'static str {
    match chaos {
        Chaos::RestartKproxy => "kproxy-restart",
        Chaos::FlushRuleset => "nft-flush",
        Chaos::KillKproxy => "kproxy-kill",
        Chaos::ApiOutage => "api-outage",
        Chaos::WatchCut => "watch-cut",
    }
}

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

/// Runs `run` to its end on the lab's runtime (two workers, enough for the load, the
/// kubelets and the LB), then shuts the runtime down: kubelet tasks hold pods, and
/// dropping them (with their servers and namespaces) happens before this returns.
pub(crate) fn on_lab_runtime<T>(
    run: impl std::future::Future<Output = Result<T, LabError>>,
) -> Result<T, LabError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| LabError::Io {
            what: "lab runtime".into(),
            source: e,
        })?;
    let result = rt.block_on(run);
    rt.shutdown_timeout(Duration::from_secs(5));
    result
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

fn check_daemons(daemons: &mut [Kproxyd]) -> Result<(), LabError> {
    for d in daemons.iter_mut() {
        d.check_alive()?;
    }
    Ok(())
}

/// Wait until `cond` holds, checking the daemons; fail after `limit`.
pub(crate) async fn wait_for(
    what: &str,
    limit: Duration,
    daemons: &mut [Kproxyd],
    mut cond: impl FnMut() -> bool,
) -> Result<(), LabError> {
    let start = Instant::now();
    loop {
        if cond() {
            return Ok(());
        }
        check_daemons(daemons)?;
        if start.elapsed() > limit {
            return Err(LabError::Invalid(format!(
                "timed out after {limit:?} waiting for {what}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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
    let _late = crate::timeline::LatenessWatch::start(rec.clone());
    let hc = cfg.load_balancer.effective_health_check()?;
    let tag = format!("[{} run {}]", behaviour.as_str(), run + 1);

    let fabric = Arc::new(Fabric::build(cfg.nodes)?);
    let workdir = Workdir::create(&fabric.prefix)?;
    progress(&format!(
        "{tag} network up: {} nodes, LB and client namespaces ({})",
        cfg.nodes, fabric.prefix
    ));
    let dirs: Vec<PathBuf> = fabric
        .nodes
        .iter()
        .map(|n| workdir.path.join(&n.name))
        .collect();
    let (emulated, real, api) =
        start_control_plane(cfg, &opts, &fabric, &dirs, &clock, &rec).await?;
    progress(&format!(
        "{tag} control plane: {}",
        opts.control_plane.as_str()
    ));

    let mut daemons = Vec::new();
    for (n, dir) in fabric.nodes.iter().zip(&dirs) {
        let source = match &real {
            Some(r) => KproxySource::Kubeconfig(&r.lab.proxy_kubeconfig),
            None => KproxySource::Manifests(dir),
        };
        daemons.push(Kproxyd::start_from(
            kproxy,
            n,
            source,
            &workdir.path,
            behaviour == Behaviour::Kproxy,
            &[],
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
        d.stop();
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
    })
}

/// The run's control plane: the lab's emulation (returned too, for a node drain's
/// writes) or the k8s-lab instance's, and the API the kubelets write pods through.
async fn start_control_plane(
    cfg: &RolloutConfig,
    opts: &RunOptions,
    fabric: &Fabric,
    dirs: &[PathBuf],
    clock: &Clock,
    rec: &Recorder,
) -> Result<
    (
        Option<ControlPlane>,
        Option<Arc<RealControlPlane>>,
        Arc<dyn PodApi>,
    ),
    LabError,
> {
    match opts.control_plane {
        ControlPlaneKind::Emulated => {
            let cp = ControlPlane::start(
                controlplane::Objects::new(
                    cfg.nodes,
                    cfg.publish_not_ready_addresses,
                    opts.drain.is_none(),
                ),
                dirs.to_vec(),
                clock.real(cfg.propagation_delay_seconds),
                rec.clone(),
            )?;
            Ok((Some(cp.clone()), None, Arc::new(cp)))
        }
        ControlPlaneKind::K8sLab => {
            let lab = K8sLab::from_env()?;
            let r = RealControlPlane::start(
                lab,
                fabric,
                cfg.publish_not_ready_addresses,
                opts.drain.is_none(),
                rec.clone(),
            )
            .await?;
            let w = r.writer.clone();
            Ok((None, Some(Arc::new(r)), w))
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
            if self.opts.drain.is_some() {
                controlplane::PROXY_HEALTHZ_PORT
            } else {
                controlplane::HEALTH_CHECK_NODE_PORT
            },
            controlplane::NODE_PORT,
            controlplane::SERVICE_PORT,
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

        let load = LoadGenerator::start(
            self.fabric.client.name(),
            std::net::SocketAddr::from((fabric::VIP, controlplane::SERVICE_PORT)),
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
        wait_for(
            "the initial pods to become ready",
            self.step_limit,
            daemons,
            || initial.is_finished(),
        )
        .await?;
        initial
            .await
            .map_err(|e| LabError::Invalid(format!("rollout task: {e}")))??;
        wait_for(
            "the load balancer to see the nodes healthy",
            self.step_limit,
            daemons,
            || pool_complete(cluster, lb),
        )
        .await?;
        if self.opts.drain.is_some() {
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
        wait_for("the rolling update", limit, daemons, || {
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
            rollout.is_finished()
        })
        .await?;
        rollout
            .await
            .map_err(|e| LabError::Invalid(format!("rollout task: {e}")))??;
        let end_ms = self.clock.now_ms();
        rec.record(
            EventKind::RolloutDone,
            None,
            None,
            "all replicas of revision 2 available",
        );
        Ok((start_ms, end_ms))
    }

    /// Waits for the moment `chaos` happens: the rollout's second old pod terminating,
    /// or for [`Chaos::KillKproxy`] node 1's last old pod.
    async fn wait_for_chaos(
        &self,
        chaos: Chaos,
        cluster: &Arc<Cluster>,
        daemons: &mut [Kproxyd],
        rollout: &tokio::task::JoinHandle<Result<(), LabError>>,
        limit: Duration,
    ) -> Result<(), LabError> {
        let rec = self.rec;
        if chaos == Chaos::KillKproxy {
            // Node 1's last old pod: every pod of revision 1 there is deleting.
            let node1_last_old_terminating = || {
                let old: Vec<_> = cluster
                    .pods()
                    .into_iter()
                    .filter(|p| p.node_index == 0 && p.revision == 1)
                    .collect();
                !old.is_empty() && old.iter().all(|p| p.is_deleting())
            };
            return wait_for(
                "node 1's last old pod to become terminating",
                limit,
                daemons,
                || node1_last_old_terminating() || rollout.is_finished(),
            )
            .await;
        }
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

/// Write a drained node's change to the run's control plane: its scale-down taint, or
/// (`delete`) the deletion of its Node object.
async fn write_node_change(
    emulated: Option<&ControlPlane>,
    real: Option<&Arc<RealControlPlane>>,
    node: usize,
    delete: bool,
) -> Result<(), LabError> {
    match (emulated, real, delete) {
        (Some(cp), _, false) => cp.taint_node(node),
        (Some(cp), _, true) => cp.delete_node(node),
        (None, Some(r), false) => r.taint_node(node).await?,
        (None, Some(r), true) => r.delete_node(node).await?,
        (None, None, _) => {}
    }
    Ok(())
}

/// The node drain (see [`NodeDrain`]); returns when the drained node is deleted and
/// out of the load balancer's pool and the replacement pods are available: the
/// disturbance's start and end (real ms), reported as the "rollout" phase.
#[allow(clippy::too_many_arguments)]
async fn drain_node(
    d: NodeDrain,
    cluster: &Arc<Cluster>,
    emulated: Option<&ControlPlane>,
    real: Option<&Arc<RealControlPlane>>,
    fabric: &Fabric,
    lb: &LoadBalancer,
    daemons: &mut [Kproxyd],
    limit: Duration,
    tag: &str,
    progress: Progress<'_>,
) -> Result<(f64, f64), LabError> {
    let rec = &cluster.recorder;
    let clock = rec.clock().clone();
    let Some(net) = fabric.nodes.get(d.node.wrapping_sub(1)) else {
        return Err(LabError::Invalid(format!("node drain: no node {}", d.node)));
    };
    let name = net.name.clone();
    let start = clock.now_ms();
    rec.record(
        EventKind::RolloutStarted,
        None,
        None,
        format!("node drain of {name} (cluster autoscaler scale-down)"),
    );
    write_node_change(emulated, real, d.node, false).await?;
    rec.record(
        EventKind::NodeTainted,
        Some(&name),
        None,
        "tainted ToBeDeletedByClusterAutoscaler:NoSchedule",
    );
    // The lab's Deployment controller replaces evicted pods (a rollout to the same
    // revision); with the real control plane kcm does, and the lab waits for it.
    let (evicted, replace) = match real {
        None => (
            cluster.drain_node(d.node),
            spawn_rollout(cluster, None, 1, limit),
        ),
        Some(r) => {
            cluster.cordon(d.node);
            let evicted = r.evict_node_pods(d.node).await?;
            let (r, c) = (r.clone(), cluster.clone());
            (
                evicted,
                tokio::spawn(async move { r.wait_replaced(&c, limit).await }),
            )
        }
    };
    progress(&format!(
        "{tag} {name} tainted ToBeDeletedByClusterAutoscaler; evicted {}",
        evicted.join(", ")
    ));
    wait_for("the drained node's pods to be gone", limit, daemons, || {
        !cluster.pods().iter().any(|p| p.node_index == d.node)
    })
    .await?;
    tokio::time::sleep(clock.real(d.delete_after_s)).await;
    // The cloud instance goes: kube-proxy stops with it and nothing reaches the node.
    if let Some(k) = daemons.iter_mut().find(|k| k.node == name) {
        k.stop();
    }
    net.ns.ip(&["link", "set", "eth0", "down"])?;
    write_node_change(emulated, real, d.node, true).await?;
    rec.record(
        EventKind::NodeDeleted,
        Some(&name),
        None,
        "node deleted: kproxy stopped, link cut, Node object removed",
    );
    progress(&format!("{tag} {name} deleted"));
    wait_for("the replacement pods", limit, daemons, || {
        replace.is_finished()
    })
    .await?;
    replace
        .await
        .map_err(|e| LabError::Invalid(format!("replacement task: {e}")))??;
    wait_for(
        "the load balancer to take the deleted node out",
        limit,
        daemons,
        || !lb.pool().contains(&d.node),
    )
    .await?;
    let end = clock.now_ms();
    rec.record(
        EventKind::RolloutDone,
        None,
        None,
        format!("{name} out of the load balancer's pool; replacement pods available"),
    );
    Ok((start, end))
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

/// The run's scratch directory (manifests, kproxy logs); removed unless kept.
struct Workdir {
    path: PathBuf,
    keep: std::cell::Cell<bool>,
}

impl Workdir {
    fn create(prefix: &str) -> Result<Workdir, LabError> {
        let path = std::env::temp_dir().join(format!("kproxy-lab-{prefix}"));
        std::fs::create_dir_all(&path).map_err(|e| LabError::Io {
            what: format!("mkdir {}", path.display()),
            source: e,
        })?;
        Ok(Workdir {
            path,
            keep: std::cell::Cell::new(false),
        })
    }
    fn keep(&self) {
        self.keep.set(true);
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        if !self.keep.get() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
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
