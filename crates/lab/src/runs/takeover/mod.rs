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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;

use crate::LabError;
use crate::cluster::Cluster;
use crate::config::RolloutConfig;
use crate::controlplane::{self, ControlPlane};
use crate::fabric::{Fabric, NodeNet};
use crate::k8s::{K8sLab, RealControlPlane};
use crate::kproxyd::{KproxySource, Kproxyd};
use crate::lb::LoadBalancer;
use crate::restart::{Counts, Disturbance, Phase, Via, tally};
use crate::timeline::{Clock, Recorder};

pub mod recorded;

#[derive(Clone, Debug, Serialize)]
pub struct TakeoverPhase {
    pub name: String,
    /// The fewest nodes the load balancer had in its pool during the phase.
    pub min_pool: usize,
    pub by_path: BTreeMap<Via, Counts>,
    pub failed_by_kind: BTreeMap<String, usize>,
    /// At the phase's end, on the phase's node: what of kube-proxy's is left after a
    /// takeover (`ip kube-proxy`, `IPv4 nat/KUBE-SERVICES`, ...), what of kproxy's after
    /// the way back (`ip kproxy`, ...). Empty when the handover is complete.
    pub left: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TakeoverReport {
    pub from: String,
    /// `real` (the process, on k8s-lab) or `recorded`.
    pub kube_proxy: String,
    pub nodes: usize,
    pub phases: Vec<TakeoverPhase>,
    pub failures: usize,
}

pub fn render_text(r: &TakeoverReport) -> String {
    let mut s = format!(
        "takeover from kube-proxy ({} mode, {}), {} nodes\n| phase | path | new conns | failed | keep-alive reqs | established broken | other failed | fewest nodes in LB pool | left on the node |\n|---|---|---|---|---|---|---|---|---|\n",
        r.from, r.kube_proxy, r.nodes
    );
    for p in &r.phases {
        for (path, c) in &p.by_path {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                p.name,
                path.as_str(),
                c.new_sent,
                c.new_failed,
                c.keepalive_sent,
                c.established_broken,
                c.keepalive_other_failed,
                p.min_pool,
                if p.left.is_empty() {
                    "-".to_string()
                } else {
                    p.left.join(", ")
                }
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

/// What of kube-proxy's is on this node: its nftables tables (`ip`/`ip6 kube-proxy`)
/// and the iptables chains upstream's cleanup removes (IPv4 and IPv6, iptables-nft,
/// the lab's iptables), named `FAMILY TABLE/CHAIN`. An error when a listing fails: an
/// unreadable node is not a clean one.
fn kube_proxy_objects(node: &NodeNet) -> Result<Vec<String>, LabError> {
    use kproxy_core::takeover::{XtBackend, is_kube_proxy_chain, parse_iptables_save};
    let mut left: Vec<String> = nft_tables(node)?
        .into_iter()
        .filter(|t| t == "ip kube-proxy" || t == "ip6 kube-proxy")
        .collect();
    for (family, cmd) in [
        (kproxy_core::model::IpFamily::IPv4, "iptables-save"),
        (kproxy_core::model::IpFamily::IPv6, "ip6tables-save"),
    ] {
        let text = node.ns.exec(cmd, &[])?;
        let tables = parse_iptables_save(XtBackend::Nft, family, &text)
            .map_err(|e| LabError::Invalid(format!("{cmd} in {}: {e}", node.name)))?;
        for t in tables {
            left.extend(
                t.chains
                    .iter()
                    .filter(|c| is_kube_proxy_chain(&t.name, c))
                    .map(|c| format!("{} {}/{c}", family.as_str(), t.name)),
            );
        }
    }
    Ok(left)
}

/// What a phase reports as left on its node: the objects, or why they are unknown.
fn left_or_error(listed: Result<Vec<String>, LabError>) -> Vec<String> {
    listed.unwrap_or_else(|e| vec![format!("(could not list: {e})")])
}

/// kproxy's nftables tables on this node (`FAMILY NAME`).
fn kproxy_tables(node: &NodeNet) -> Result<Vec<String>, LabError> {
    Ok(nft_tables(node)?
        .into_iter()
        .filter(|t| {
            t.split_once(' ')
                .is_some_and(|(_, n)| n.starts_with("kproxy"))
        })
        .collect())
}

fn nft_tables(node: &NodeNet) -> Result<Vec<String>, LabError> {
    Ok(
        kproxy_core::takeover::parse_nft_tables(&node.ns.exec("nft", &["list", "tables"])?)
            .into_iter()
            .map(|t| format!("{} {}", t.family, t.name))
            .collect(),
    )
}

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
    progress: crate::scenario::Progress,
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
    crate::scenario::on_lab_runtime(run_async(cfg, kproxy, opts, progress))
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

/// Where the cluster and kube-proxy come from.
enum Source {
    /// k8s-lab's API server and kcm, upstream kube-proxy.
    Real {
        lab: K8sLab,
        cp: Box<RealControlPlane>,
    },
    /// The lab's emulated control plane (each node's manifest directory) and kube-proxy
    /// as recorded.
    Recorded { dirs: Vec<PathBuf> },
}

/// kube-proxy on one node: the process, or its recorded health servers (its recorded
/// rules are in the kernel, where they stay when it stops, as real kube-proxy's do).
enum OnNode {
    Real(KubeProxy),
    Recorded(recorded::HealthStandIn),
}

impl OnNode {
    /// SIGTERM, as a DaemonSet's pod deletion does.
    fn stop(&mut self) {
        match self {
            OnNode::Real(k) => k.stop(),
            OnNode::Recorded(h) => h.stop(),
        }
    }
}

impl Source {
    /// kube-proxy starts on `node` (the `n`th time there).
    fn start_kube_proxy(
        &self,
        node: &NodeNet,
        mode: &str,
        workdir: &Path,
        n: usize,
    ) -> Result<OnNode, LabError> {
        match self {
            Source::Real { lab, .. } => {
                Ok(OnNode::Real(KubeProxy::start(lab, node, mode, workdir, n)?))
            }
            // Its sync writes its rules; its health servers then answer.
            Source::Recorded { .. } => {
                recorded::load(node, mode)?;
                Ok(OnNode::Recorded(recorded::HealthStandIn::start(
                    node,
                    recorded::health_answers(node, mode)?,
                )?))
            }
        }
    }

    fn kproxy_source<'a>(&'a self, i: usize) -> KproxySource<'a> {
        match self {
            Source::Real { lab, .. } => KproxySource::Kubeconfig(&lab.proxy_kubeconfig),
            Source::Recorded { dirs } => KproxySource::Manifests(&dirs[i]),
        }
    }
}

async fn run_async(
    cfg: &RolloutConfig,
    kproxy: &Path,
    opts: &TakeoverOptions,
    progress: crate::scenario::Progress<'_>,
) -> Result<TakeoverReport, LabError> {
    let mode = opts.mode.as_str();
    let hold = opts.hold;
    let back = opts.back;
    let clock = Clock::new(cfg.time_scale);
    let rec = Recorder::new(clock.clone());
    let hc = cfg.load_balancer.effective_health_check()?;
    let lab = if opts.recorded {
        None
    } else {
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
        Some(lab)
    };
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
    let limit = clock.real(
        cfg.pod.readiness_probe.initial_delay_seconds
            + cfg.pod.readiness_probe.period_seconds * 4.0
            + hc.interval_seconds * (hc.healthy_threshold as f64 + 2.0)
            + 30.0,
    ) + Duration::from_secs(30);
    let mut kube_proxies: Vec<Option<OnNode>> = Vec::new();
    let (source, cluster) = match lab {
        Some(lab) => {
            let cp = RealControlPlane::start(
                lab.clone(),
                &fabric,
                cfg.publish_not_ready_addresses,
                true,
                rec.clone(),
            )
            .await?;
            for n in &fabric.nodes {
                kube_proxies.push(Some(OnNode::Real(KubeProxy::start(
                    &lab, n, mode, &workdir, 1,
                )?)));
            }
            let api: Arc<dyn crate::cluster::PodApi> = cp.writer.clone();
            let cluster = Cluster::new(fabric.clone(), api, rec.clone(), cfg.pod, cfg.deployment);
            cp.start_agent(cluster.clone(), rec.clone());
            cp.rollout(&cluster, &clock, 1, limit).await?;
            let source = Source::Real {
                lab,
                cp: Box::new(cp),
            };
            (source, cluster)
        }
        None => {
            let (cp, dirs) = ControlPlane::start_for_nodes(
                &fabric,
                &workdir,
                cfg.publish_not_ready_addresses,
                clock.real(cfg.propagation_delay_seconds),
                rec.clone(),
            )?;
            let cluster = Cluster::new(
                fabric.clone(),
                Arc::new(cp),
                rec.clone(),
                cfg.pod,
                cfg.deployment,
            );
            cluster.rollout(1, limit).await?;
            // The recorded rules are kube-proxy's for this state: every pod ready.
            let source = Source::Recorded { dirs };
            for n in &fabric.nodes {
                kube_proxies.push(Some(source.start_kube_proxy(n, mode, &workdir, 1)?));
            }
            (source, cluster)
        }
    };
    let mut lb = LoadBalancer::for_lab_service(&fabric, cfg.load_balancer.mode, hc, rec.clone())?;
    let mut min_pool = usize::MAX;
    wait(
        "the load balancer to see every node healthy (kube-proxy's health-check node ports)",
        limit,
        &lb,
        &mut min_pool,
        || lb.healthy().iter().all(|h| *h),
    )
    .await?;
    if let (Some(dir), Source::Real { lab, .. }) = (&opts.record_rules, &source) {
        let version = Command::new(lab.dir.join("bin/kube-proxy"))
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
    }
    let from = if opts.recorded { "recorded" } else { "real" };
    progress(&format!(
        "kube-proxy ({mode}, {from}) on every node, pods ready, pool complete; starting both loads"
    ));
    let loads = crate::restart::start_both_loads(&fabric, cfg, &clock)?;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut names = Vec::new();
    let mut windows: Vec<Phase> = Vec::new();
    let mut pools = Vec::new();
    let mut lefts = Vec::new();
    let mut daemons: Vec<Option<Kproxyd>> = fabric.nodes.iter().map(|_| None).collect();
    let mut phase = |name: String, start_ms: f64, end_ms: f64, pool: usize, left: Vec<String>| {
        names.push(name);
        pools.push(pool);
        lefts.push(left);
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
            Vec::new(),
        );
        for (i, node) in fabric.nodes.iter().enumerate() {
            let start = clock.now_ms();
            let mut pool = usize::MAX;
            if let Some(mut k) = kube_proxies[i].take() {
                k.stop();
            }
            let wall = SystemTime::now();
            let d =
                Kproxyd::start_from(kproxy, node, source.kproxy_source(i), &workdir, true, &[])?;
            let log = d.event_log.clone();
            daemons[i] = Some(d);
            wait(
                &format!("{}: kproxy synced and kube-proxy's rules gone", node.name),
                Duration::from_secs(60),
                &lb,
                &mut pool,
                || {
                    crate::kproxyd::synced_after(&log, wall)
                        && kube_proxy_objects(node).is_ok_and(|l| l.is_empty())
                },
            )
            .await?;
            hold_for(hold, &lb, &mut pool).await;
            progress(&format!("{}: taken over", node.name));
            phase(
                format!("takeover {}", node.name),
                start,
                clock.now_ms(),
                pool,
                left_or_error(kube_proxy_objects(node)),
            );
        }
        if back {
            for (i, node) in fabric.nodes.iter().enumerate() {
                let start = clock.now_ms();
                let mut pool = usize::MAX;
                if let Some(mut d) = daemons[i].take() {
                    d.stop();
                }
                kube_proxies[i] = Some(source.start_kube_proxy(node, mode, &workdir, 2)?);
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
                phase(
                    format!("back {}", node.name),
                    start,
                    clock.now_ms(),
                    pool,
                    left_or_error(kproxy_tables(node)),
                );
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
    if let Source::Real { cp, .. } = &source
        && let Err(e) = cp.stop().await
    {
        progress(&format!("cleaning the API server's objects: {e}"));
    }
    result?;
    let phases: Vec<TakeoverPhase> = windows
        .into_iter()
        .zip(names)
        .zip(pools)
        .zip(lefts)
        .map(|(((w, name), pool), left)| TakeoverPhase {
            name,
            min_pool: pool,
            by_path: w.by_path,
            failed_by_kind: w.failed_by_kind,
            left,
        })
        .collect();
    let failures = phases
        .iter()
        .flat_map(|p| p.by_path.values())
        .map(Counts::failures)
        .sum();
    Ok(TakeoverReport {
        from: mode.to_string(),
        kube_proxy: from.to_string(),
        nodes: cfg.nodes,
        phases,
        failures,
    })
}
