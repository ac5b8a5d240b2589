//! `kproxy lab takeover --from nftables|iptables [--back]` (docs/migrate.md): the lab cluster
//! on the real control plane (k8s-lab: kube-apiserver and kube-controller-manager
//! v1.36.2) with upstream kube-proxy v1.36.2 (`$K8S_LAB/bin/kube-proxy`) on every node,
//! the emulated load balancer in front of the eTP=Local Service and the two loads of
//! `kproxy lab restart` (through the VIP, and from node 1 to the cluster IP). Then node
//! by node: kube-proxy stops (SIGTERM: its rules stay), `kproxy run --kubeconfig`
//! starts and takes the node over; with `--back`, node by node the reverse: kproxy
//! stops, kube-proxy starts, `kproxy cleanup --after-kube-proxy-synced` removes
//! kproxy's tables. Failures are counted per phase (a request counts in the phase it
//! started in), with the fewest nodes the load balancer had in its pool.
//!
//! With `--recorded` kube-proxy is not a process but its recording ([`recorded`]): the
//! lab's emulated control plane (no K8S_LAB), each node's rules as real kube-proxy
//! v1.36.2 wrote them for this cluster loaded before kproxy starts, its health servers
//! replayed by a stand-in that "stops" when kube-proxy would. The same phases run;
//! CI runs this mode (crates/kproxy/tests/lab_takeover.rs).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use crate::LabError;
use crate::report::held::{Phase, TakeoverPhase, TakeoverReport, failures};
use crate::runs::held::HeldLab;
use crate::runs::{Progress, blocking, on_lab_runtime, poll};
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::run::Disturbance;
use crate::scenario::service::PROXY_HEALTHZ_PORT;
use crate::world::cluster::{Cluster, PodApi};
use crate::world::fabric::Fabric;
use crate::world::k8s::{K8sLab, RealControlPlane};
use crate::world::kproxyd::{self, Kproxyd};
use crate::world::lb::LoadBalancer;
use kube_proxy::{
    KubeProxy, OnNode, Source, kproxy_tables, kube_proxy_objects, kube_proxy_programmed,
    left_or_error,
};

mod kube_proxy;
pub mod recorded;

/// What to run: kube-proxy's mode, where kube-proxy comes from, and whether to go back.
#[derive(Clone, Debug)]
pub struct TakeoverOptions {
    /// `nftables` or `iptables`.
    pub mode: String,
    pub back: bool,
    /// Load after each node's change, before the next.
    pub hold: Duration,
    /// kube-proxy as recorded (the emulated control plane, no K8S_LAB) instead of real
    /// kube-proxy on the k8s-lab control plane.
    pub recorded: bool,
    /// Real mode: write each node's rules and health answers here before the first
    /// takeover (`DIR/MODE/NODE.*`, what the recorded mode loads).
    pub record_rules: Option<PathBuf>,
}

pub fn run(
    cfg: &RolloutConfig,
    kproxy: &Path,
    opts: &TakeoverOptions,
    progress: Progress,
) -> Result<TakeoverReport, LabError> {
    cfg.validate()?;
    if opts.recorded && opts.record_rules.is_some() {
        return Err(LabError::Invalid(
            "--record-rules records real kube-proxy: not with --recorded".into(),
        ));
    }
    if opts.recorded && cfg.nodes != recorded::RECORDED_NODES {
        return Err(LabError::Invalid(format!(
            "--recorded replays kube-proxy's rules of the {n}-node lab cluster: --nodes must be {n}",
            n = recorded::RECORDED_NODES
        )));
    }
    on_lab_runtime(run_async(cfg, kproxy, opts, progress))
}

/// Polls `cond` every 50 ms up to `limit`, noting the LB pool's size.
async fn wait(
    what: &str,
    limit: Duration,
    lb: &LoadBalancer,
    min_pool: &mut usize,
    mut cond: impl FnMut() -> bool,
) -> Result<(), LabError> {
    poll(what, limit, Duration::from_millis(50), || {
        *min_pool = (*min_pool).min(lb.healthy().iter().filter(|h| **h).count());
        Ok(cond())
    })
    .await
}

async fn hold_for(hold: Duration, lb: &LoadBalancer, min_pool: &mut usize) {
    let end = Instant::now() + hold;
    let _ = wait("", hold + Duration::from_secs(1), lb, min_pool, || {
        Instant::now() >= end
    })
    .await;
}

async fn run_async(
    cfg: &RolloutConfig,
    kproxy: &Path,
    opts: &TakeoverOptions,
    progress: Progress<'_>,
) -> Result<TakeoverReport, LabError> {
    let mode = opts.mode.as_str();
    let k8s_lab = if opts.recorded {
        None
    } else {
        Some(real_k8s_lab()?)
    };
    let lab = HeldLab::build(cfg, Duration::from_secs(30))?;
    progress(&format!(
        "network up: {} nodes ({})",
        cfg.nodes, lab.fabric.prefix
    ));
    let (source, cluster, kube_proxies) = bring_up(cfg, &lab, k8s_lab, mode).await?;
    let mut lb = lab.load_balancer(cfg)?;
    let mut min_pool = usize::MAX;
    wait(
        "the load balancer to see every node healthy (kube-proxy's health-check node ports)",
        lab.limit,
        &lb,
        &mut min_pool,
        || lb.healthy().iter().all(|h| *h),
    )
    .await?;
    if let (Some(dir), Source::Real { lab: k8s_lab, .. }) = (&opts.record_rules, &source) {
        record_rules(k8s_lab, &lab.fabric, mode, dir, progress)?;
    }
    let from = if opts.recorded { "recorded" } else { "real" };
    progress(&format!(
        "kube-proxy ({mode}, {from}) on every node, pods ready, pool complete; starting both loads"
    ));
    let loads = lab.start_loads(cfg).await?;
    let mut handover = Handover {
        lab: &lab,
        lb: &lb,
        source: &source,
        kproxy,
        mode,
        hold: opts.hold,
        progress,
        daemons: lab.fabric.nodes.iter().map(|_| None).collect(),
        kube_proxies,
        phases: Phases::default(),
    };
    let result = handover.run(opts.back).await;
    let Handover {
        mut phases,
        mut daemons,
        kube_proxies,
        ..
    } = handover;
    loads.stop_into(&mut phases.windows);
    for d in daemons.iter_mut().flatten() {
        blocking(|| d.stop());
    }
    drop(kube_proxies);
    lb.stop();
    cluster.shutdown().await;
    if let Source::Real { cp, .. } = &source
        && let Err(e) = cp.stop().await
    {
        progress(&format!("cleaning the API server's objects: {e}"));
    }
    result?;
    let phases = phases.finish();
    let failures = failures(phases.iter().map(|p| &p.by_path));
    Ok(TakeoverReport {
        from: mode.to_string(),
        kube_proxy: from.to_string(),
        nodes: cfg.nodes,
        phases,
        failures,
    })
}

/// The k8s-lab instance of real kube-proxy's mode, with its kube-proxy binary.
fn real_k8s_lab() -> Result<K8sLab, LabError> {
    let lab = K8sLab::from_env().map_err(|e| {
        LabError::Invalid(format!(
            "{e}; or --recorded: kube-proxy's recorded rules, no K8S_LAB"
        ))
    })?;
    if !lab.dir.join("bin/kube-proxy").exists() {
        return Err(LabError::Invalid(format!(
            "{}: no bin/kube-proxy",
            lab.dir.display()
        )));
    }
    Ok(lab)
}

/// The control plane and the Deployment's pods up, kube-proxy on every node: the real
/// control plane with kube-proxy processes when `k8s_lab` is given, else the emulated
/// one with kube-proxy's recording (loaded once every pod is ready, the state it was
/// recorded in).
async fn bring_up(
    cfg: &RolloutConfig,
    lab: &HeldLab,
    k8s_lab: Option<K8sLab>,
    mode: &str,
) -> Result<(Source, std::sync::Arc<Cluster>, Vec<Option<OnNode>>), LabError> {
    let workdir = &lab.workdir.path;
    let mut kube_proxies = Vec::new();
    match k8s_lab {
        Some(k8s_lab) => {
            let cp = RealControlPlane::start(
                k8s_lab.clone(),
                &lab.fabric,
                cfg.publish_not_ready_addresses,
                true,
                lab.rec.clone(),
            )
            .await?;
            for n in &lab.fabric.nodes {
                kube_proxies.push(Some(OnNode::Real(KubeProxy::start(
                    &k8s_lab, n, mode, workdir, 1,
                )?)));
            }
            let api: std::sync::Arc<dyn PodApi> = cp.writer.clone();
            let cluster = lab.cluster(cfg, api);
            cp.start_agent(cluster.clone(), lab.rec.clone());
            cp.rollout(&cluster, &lab.clock, 1, lab.limit).await?;
            let source = Source::Real {
                lab: k8s_lab,
                cp: Box::new(cp),
            };
            Ok((source, cluster, kube_proxies))
        }
        None => {
            let (cp, dirs) = lab.emulated_control_plane(cfg)?;
            let cluster = lab.cluster(cfg, std::sync::Arc::new(cp));
            cluster.rollout(1, lab.limit).await?;
            // The recorded rules are kube-proxy's for this state: every pod ready.
            let source = Source::Recorded { dirs };
            for n in &lab.fabric.nodes {
                kube_proxies.push(Some(source.start_kube_proxy(n, mode, workdir, 1)?));
            }
            Ok((source, cluster, kube_proxies))
        }
    }
}

/// Real kube-proxy's rules and health answers of every node, written under `dir`
/// (what the recorded mode loads).
fn record_rules(
    k8s_lab: &K8sLab,
    fabric: &Fabric,
    mode: &str,
    dir: &Path,
    progress: Progress<'_>,
) -> Result<(), LabError> {
    let version = std::process::Command::new(k8s_lab.dir.join("bin/kube-proxy"))
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .map_err(|e| LabError::Io {
            what: "kube-proxy --version".into(),
            source: e,
        })?;
    for n in &fabric.nodes {
        recorded::capture(n, mode, &version, dir)?;
    }
    progress(&format!(
        "recorded every node's kube-proxy rules and health answers into {}",
        dir.join(mode).display()
    ));
    Ok(())
}

/// The phases of a takeover as they end: each one's window (for the loads' records)
/// and its name, the fewest nodes in the LB's pool, what was left on its node.
#[derive(Default)]
struct Phases {
    windows: Vec<Phase>,
    named: Vec<(String, usize, Vec<String>)>,
}

impl Phases {
    fn push(&mut self, name: String, start_ms: f64, end_ms: f64, pool: usize, left: Vec<String>) {
        self.windows
            .push(Phase::window(Disturbance::None, start_ms, end_ms, None));
        self.named.push((name, pool, left));
    }

    fn finish(self) -> Vec<TakeoverPhase> {
        self.windows
            .into_iter()
            .zip(self.named)
            .map(|(w, (name, min_pool, left))| TakeoverPhase {
                name,
                min_pool,
                by_path: w.by_path,
                failed_by_kind: w.failed_by_kind,
                left,
            })
            .collect()
    }
}

/// The handover, node by node, under load: what it changes and what it keeps.
struct Handover<'a> {
    lab: &'a HeldLab,
    lb: &'a LoadBalancer,
    source: &'a Source,
    kproxy: &'a Path,
    mode: &'a str,
    hold: Duration,
    progress: Progress<'a>,
    /// kproxy on each node, once it has taken the node over.
    daemons: Vec<Option<Kproxyd>>,
    /// kube-proxy on each node, until kproxy takes the node over.
    kube_proxies: Vec<Option<OnNode>>,
    phases: Phases,
}

impl Handover<'_> {
    /// The baseline, then every node taken over, then (`back`) every node given back.
    async fn run(&mut self, back: bool) -> Result<(), LabError> {
        let start = self.lab.clock.now_ms();
        let mut pool = usize::MAX;
        hold_for(self.hold, self.lb, &mut pool).await;
        self.phases.push(
            format!("kube-proxy ({}) everywhere", self.mode),
            start,
            self.lab.clock.now_ms(),
            pool,
            Vec::new(),
        );
        for i in 0..self.lab.fabric.nodes.len() {
            self.take_over(i).await?;
        }
        if back {
            for i in 0..self.lab.fabric.nodes.len() {
                self.give_back(i).await?;
            }
        }
        Ok(())
    }

    /// Node `i`: kube-proxy stops (its rules stay), kproxy starts and takes over.
    async fn take_over(&mut self, i: usize) -> Result<(), LabError> {
        let node = &self.lab.fabric.nodes[i];
        let start = self.lab.clock.now_ms();
        let mut pool = usize::MAX;
        if let Some(mut k) = self.kube_proxies[i].take() {
            blocking(|| k.stop());
        }
        let wall = SystemTime::now();
        let d = Kproxyd::start_from(
            self.kproxy,
            node,
            self.source.kproxy_source(i),
            &self.lab.workdir.path,
            true,
            &[],
        )?;
        let log = d.event_log.clone();
        self.daemons[i] = Some(d);
        wait(
            &format!("{}: kproxy synced and kube-proxy's rules gone", node.name),
            Duration::from_secs(60),
            self.lb,
            &mut pool,
            || {
                kproxyd::synced_after(&log, wall)
                    && blocking(|| kube_proxy_objects(node).is_ok_and(|l| l.is_empty()))
            },
        )
        .await?;
        hold_for(self.hold, self.lb, &mut pool).await;
        (self.progress)(&format!("{}: taken over", node.name));
        let left = blocking(|| left_or_error(kube_proxy_objects(node)));
        self.phases.push(
            format!("takeover {}", node.name),
            start,
            self.lab.clock.now_ms(),
            pool,
            left,
        );
        Ok(())
    }

    /// Node `i`: kproxy stops, kube-proxy starts, and once kube-proxy has synced
    /// `kproxy cleanup --after-kube-proxy-synced` removes kproxy's tables.
    async fn give_back(&mut self, i: usize) -> Result<(), LabError> {
        let node = &self.lab.fabric.nodes[i];
        let start = self.lab.clock.now_ms();
        let mut pool = usize::MAX;
        if let Some(mut d) = self.daemons[i].take() {
            blocking(|| d.stop());
        }
        self.kube_proxies[i] =
            Some(
                self.source
                    .start_kube_proxy(node, self.mode, &self.lab.workdir.path, 2)?,
            );
        let mode = self.mode;
        wait(
            &format!("{}: kube-proxy programmed", node.name),
            Duration::from_secs(60),
            self.lb,
            &mut pool,
            || blocking(|| kube_proxy_programmed(node, mode)),
        )
        .await?;
        let out = tokio::process::Command::new("ip")
            .args(["netns", "exec", node.ns.name()])
            .arg(self.kproxy)
            .arg("cleanup")
            .arg(format!(
                "--after-kube-proxy-synced={}:{}",
                node.ip, PROXY_HEALTHZ_PORT
            ))
            .output()
            .await
            .map_err(|e| LabError::Io {
                what: "kproxy cleanup".into(),
                source: e,
            })?;
        if !out.status.success() {
            return Err(LabError::Invalid(format!(
                "{}: kproxy cleanup: {}",
                node.name,
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        hold_for(self.hold, self.lb, &mut pool).await;
        (self.progress)(&format!("{}: back to kube-proxy", node.name));
        let left = blocking(|| left_or_error(kproxy_tables(node)));
        self.phases.push(
            format!("back {}", node.name),
            start,
            self.lab.clock.now_ms(),
            pool,
            left,
        );
        Ok(())
    }
}
