//! `kproxy lab takeover --from nftables|iptables [--back]` (issue 28): the lab cluster
//! on the real control plane (k8s-lab: kube-apiserver and kube-controller-manager
//! v1.36.2) with upstream kube-proxy v1.36.2 (`$K8S_LAB/bin/kube-proxy`) on every node,
//! the emulated load balancer in front of the eTP=Local Service and the two loads of
//! `kproxy lab restart` (through the VIP, and from node 1 to the cluster IP). Then node
//! by node: kube-proxy stops (SIGTERM: its rules stay), `kproxy run --kubeconfig`
//! starts and takes the node over; with `--back`, node by node the reverse: kproxy
//! stops, kube-proxy starts, `kproxy cleanup --after-kube-proxy-synced` removes
//! kproxy's tables. Failures are counted per phase (a request counts in the phase it
//! started in), with the fewest nodes the load balancer had in its pool.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::LabError;
use crate::cluster::Cluster;
use crate::config::RolloutConfig;
use crate::controlplane;
use crate::fabric::{Fabric, NodeNet};
use crate::k8s::{K8sLab, RealControlPlane};
use crate::kproxyd::{KproxySource, Kproxyd};
use crate::lb::LoadBalancer;
use crate::restart::{Counts, Disturbance, Phase, Via, tally};
use crate::timeline::{Clock, Recorder};

#[derive(Clone, Debug, Serialize)]
pub struct TakeoverPhase {
    pub name: String,
    /// The fewest nodes the load balancer had in its pool during the phase.
    pub min_pool: usize,
    pub by_path: BTreeMap<Via, Counts>,
    pub failed_by_kind: BTreeMap<String, usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TakeoverReport {
    pub from: String,
    pub nodes: usize,
    pub phases: Vec<TakeoverPhase>,
    pub failures: usize,
}

pub fn render_text(r: &TakeoverReport) -> String {
    let mut s = format!(
        "takeover from kube-proxy ({} mode), {} nodes\n| phase | path | new conns | failed | keep-alive reqs | established broken | other failed | fewest nodes in LB pool |\n|---|---|---|---|---|---|---|---|\n",
        r.from, r.nodes
    );
    for p in &r.phases {
        for (path, c) in &p.by_path {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
                p.name,
                path.as_str(),
                c.new_sent,
                c.new_failed,
                c.keepalive_sent,
                c.established_broken,
                c.keepalive_other_failed,
                p.min_pool
            ));
        }
    }
    s.push_str(&format!("total failures: {}\n", r.failures));
    s
}

/// Upstream kube-proxy in one node's namespace.
struct KubeProxy {
    child: Child,
}

impl KubeProxy {
    fn start(
        lab: &K8sLab,
        node: &NodeNet,
        mode: &str,
        workdir: &Path,
        n: usize,
    ) -> Result<KubeProxy, LabError> {
        let io = |what: String| move |e| LabError::Io { what, source: e };
        let cfg = workdir.join(format!("{}-kube-proxy-{n}.yaml", node.name));
        std::fs::write(
            &cfg,
            format!(
                "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
hostnameOverride: {}
clientConnection: {{kubeconfig: {}}}
clusterCIDR: 10.244.0.0/16
detectLocalMode: ClusterCIDR
healthzBindAddress: {}:{}
metricsBindAddress: 127.0.0.1:10249
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
",
                node.name,
                lab.proxy_kubeconfig.display(),
                node.ip,
                controlplane::PROXY_HEALTHZ_PORT
            ),
        )
        .map_err(io(format!("write {}", cfg.display())))?;
        let log_path = workdir.join(format!("{}-kube-proxy-{n}.log", node.name));
        let log = std::fs::File::create(&log_path)
            .map_err(io(format!("create {}", log_path.display())))?;
        let err = log.try_clone().map_err(io("log".into()))?;
        let child = Command::new("ip")
            .args(["netns", "exec", node.ns.name()])
            .arg(lab.dir.join("bin/kube-proxy"))
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(io("start kube-proxy".into()))?;
        Ok(KubeProxy { child })
    }

    fn stop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn in_ns(node: &NodeNet, args: &[&str]) -> String {
    Command::new("ip")
        .args(["netns", "exec", node.ns.name()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// kube-proxy has programmed the lab Service on this node.
fn kube_proxy_programmed(node: &NodeNet, mode: &str) -> bool {
    let needle = controlplane::CLUSTER_IP;
    match mode {
        "nftables" => in_ns(node, &["nft", "list", "table", "ip", "kube-proxy"])
            .contains(&format!("{needle} . tcp . {}", controlplane::SERVICE_PORT)),
        _ => in_ns(node, &["iptables-save", "-t", "nat"])
            .contains(&format!("-A KUBE-SERVICES -d {needle}/32")),
    }
}

/// Nothing of kube-proxy's on this node any more.
fn kube_proxy_gone(node: &NodeNet) -> bool {
    let tables = in_ns(node, &["nft", "list", "tables"]);
    let nat = in_ns(node, &["iptables-save"]);
    !tables
        .lines()
        .any(|l| l.trim() == "table ip kube-proxy" || l.trim() == "table ip6 kube-proxy")
        && !nat
            .lines()
            .any(|l| l.starts_with(":KUBE-SERVICES") || l.starts_with(":KUBE-PROXY-CANARY"))
}

pub fn run(
    cfg: &RolloutConfig,
    kproxy: &Path,
    mode: &str,
    back: bool,
    hold: Duration,
    progress: crate::scenario::Progress,
) -> Result<TakeoverReport, LabError> {
    cfg.validate()?;
    let rt = crate::scenario::lab_runtime()?;
    let result = rt.block_on(run_async(cfg, kproxy, mode, back, hold, progress));
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

/// Polls `cond` every 50 ms up to `limit`, noting the LB pool's size.
async fn wait(
    what: &str,
    limit: Duration,
    lb: &LoadBalancer,
    min_pool: &mut usize,
    mut cond: impl FnMut() -> bool,
) -> Result<(), LabError> {
    let start = Instant::now();
    loop {
        *min_pool = (*min_pool).min(lb.healthy().iter().filter(|h| **h).count());
        if cond() {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(LabError::Invalid(format!(
                "timed out after {limit:?} waiting for {what}"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
    mode: &str,
    back: bool,
    hold: Duration,
    progress: crate::scenario::Progress<'_>,
) -> Result<TakeoverReport, LabError> {
    let clock = Clock::new(cfg.time_scale);
    let rec = Recorder::new(clock.clone());
    let hc = cfg.load_balancer.effective_health_check()?;
    let lab = K8sLab::from_env()?;
    if !lab.dir.join("bin/kube-proxy").exists() {
        return Err(LabError::Invalid(format!(
            "{}: no bin/kube-proxy",
            lab.dir.display()
        )));
    }
    let fabric = Arc::new(Fabric::build(cfg.nodes)?);
    let workdir = std::env::temp_dir().join(format!("kproxy-lab-{}", fabric.prefix));
    std::fs::create_dir_all(&workdir).map_err(|e| LabError::Io {
        what: format!("mkdir {}", workdir.display()),
        source: e,
    })?;
    let _cleanup = crate::restart::RemoveDir(workdir.clone());
    progress(&format!(
        "network up: {} nodes ({})",
        cfg.nodes, fabric.prefix
    ));
    let real = RealControlPlane::start(
        lab.clone(),
        &fabric,
        cfg.publish_not_ready_addresses,
        true,
        rec.clone(),
    )
    .await?;
    let mut kube_proxies = Vec::new();
    for n in &fabric.nodes {
        kube_proxies.push(Some(KubeProxy::start(&lab, n, mode, &workdir, 1)?));
    }
    let mut lb = LoadBalancer::start(
        &fabric,
        cfg.load_balancer.mode,
        hc,
        controlplane::HEALTH_CHECK_NODE_PORT,
        controlplane::NODE_PORT,
        controlplane::SERVICE_PORT,
        rec.clone(),
    )?;
    let api: Arc<dyn crate::cluster::PodApi> = real.writer.clone();
    let cluster = Cluster::new(fabric.clone(), api, rec.clone(), cfg.pod, cfg.deployment);
    real.start_agent(cluster.clone(), rec.clone());
    let limit = clock.real(
        cfg.pod.readiness_probe.initial_delay_seconds
            + cfg.pod.readiness_probe.period_seconds * 4.0
            + hc.interval_seconds * (hc.healthy_threshold as f64 + 2.0)
            + 30.0,
    ) + Duration::from_secs(30);
    real.rollout(&cluster, &clock, 1, limit).await?;
    let mut min_pool = usize::MAX;
    wait(
        "the load balancer to see every node healthy (kube-proxy's health-check node ports)",
        limit,
        &lb,
        &mut min_pool,
        || lb.healthy().iter().all(|h| *h),
    )
    .await?;
    progress(&format!(
        "kube-proxy ({mode}) on every node, pods ready, pool complete; starting both loads"
    ));
    let loads = crate::restart::start_both_loads(&fabric, cfg, &clock)?;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut names = Vec::new();
    let mut windows: Vec<Phase> = Vec::new();
    let mut pools = Vec::new();
    let mut daemons: Vec<Option<Kproxyd>> = fabric.nodes.iter().map(|_| None).collect();
    let mut phase = |name: String, start_ms: f64, end_ms: f64, pool: usize| {
        names.push(name);
        pools.push(pool);
        windows.push(Phase {
            disturbance: Disturbance::None,
            start_ms,
            end_ms,
            converged_ms: None,
            by_path: BTreeMap::new(),
            failed_by_kind: BTreeMap::new(),
        });
    };
    let result: Result<(), LabError> = async {
        let start = clock.now_ms();
        let mut pool = usize::MAX;
        hold_for(hold, &lb, &mut pool).await;
        phase(
            format!("kube-proxy ({mode}) everywhere"),
            start,
            clock.now_ms(),
            pool,
        );
        for (i, node) in fabric.nodes.iter().enumerate() {
            let start = clock.now_ms();
            let mut pool = usize::MAX;
            if let Some(mut k) = kube_proxies[i].take() {
                k.stop();
            }
            let wall = SystemTime::now();
            let d = Kproxyd::start_from(
                kproxy,
                node,
                KproxySource::Kubeconfig(&lab.proxy_kubeconfig),
                &workdir,
                true,
                &[],
            )?;
            let log = d.event_log.clone();
            daemons[i] = Some(d);
            wait(
                &format!("{}: kproxy synced and kube-proxy's rules gone", node.name),
                Duration::from_secs(60),
                &lb,
                &mut pool,
                || crate::kproxyd::synced_after(&log, wall) && kube_proxy_gone(node),
            )
            .await?;
            hold_for(hold, &lb, &mut pool).await;
            progress(&format!("{}: taken over", node.name));
            phase(
                format!("takeover {}", node.name),
                start,
                clock.now_ms(),
                pool,
            );
        }
        if back {
            for (i, node) in fabric.nodes.iter().enumerate() {
                let start = clock.now_ms();
                let mut pool = usize::MAX;
                if let Some(mut d) = daemons[i].take() {
                    d.stop();
                }
                kube_proxies[i] = Some(KubeProxy::start(&lab, node, mode, &workdir, 2)?);
                wait(
                    &format!("{}: kube-proxy programmed", node.name),
                    Duration::from_secs(60),
                    &lb,
                    &mut pool,
                    || kube_proxy_programmed(node, mode),
                )
                .await?;
                let out = Command::new("ip")
                    .args(["netns", "exec", node.ns.name()])
                    .arg(kproxy)
                    .arg("cleanup")
                    .arg(format!(
                        "--after-kube-proxy-synced={}:{}",
                        node.ip,
                        controlplane::PROXY_HEALTHZ_PORT
                    ))
                    .output()
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
                hold_for(hold, &lb, &mut pool).await;
                progress(&format!("{}: back to kube-proxy", node.name));
                phase(format!("back {}", node.name), start, clock.now_ms(), pool);
            }
        }
        Ok(())
    }
    .await;
    for (path, load) in loads {
        let records = load.stop();
        tally(&mut windows, path, &records);
    }
    for d in daemons.iter_mut().flatten() {
        d.stop();
    }
    drop(kube_proxies);
    lb.stop();
    cluster.shutdown().await;
    if let Err(e) = real.stop().await {
        progress(&format!("cleaning the API server's objects: {e}"));
    }
    result?;
    let phases: Vec<TakeoverPhase> = windows
        .into_iter()
        .zip(names)
        .zip(pools)
        .map(|((w, name), pool)| TakeoverPhase {
            name,
            min_pool: pool,
            by_path: w.by_path,
            failed_by_kind: w.failed_by_kind,
        })
        .collect();
    let failures = phases
        .iter()
        .flat_map(|p| p.by_path.values())
        .map(Counts::failures)
        .sum();
    Ok(TakeoverReport {
        from: mode.to_string(),
        nodes: cfg.nodes,
        phases,
        failures,
    })
}
