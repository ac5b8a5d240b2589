//! `kproxy lab restart`: is a restart or an upgrade of kproxy itself
//! hitless? The lab cluster (fabric, control plane, a kproxy per node, the emulated
//! load balancer in front of an eTP=Local LoadBalancer Service, a Deployment with one
//! pod per node) carries two loads — one from the client through the LB's VIP, one from
//! node 1 itself to the cluster IP — each opening new connections at a steady rate and
//! holding keep-alive ones. Then, one after another, node 1's kproxy is
//! (a) stopped with SIGTERM and started again, (b) killed with SIGKILL and started
//! again, (c) replaced by a different build (a copy of the binary at another path, as a
//! DaemonSet update does). Each phase lasts from the disturbance until the new process
//! has synced, then `hold` more. Every request is counted in the phase it started in.
//!
//! Functional core: [`tally`] (records → per-phase, per-path counts) and
//! [`render_text`]. Imperative shell: [`run`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::LabError;
use crate::cluster::Cluster;
use crate::config::RolloutConfig;
use crate::controlplane::{self, ControlPlane};
use crate::fabric::{self, Fabric};
use crate::kproxyd::Kproxyd;
use crate::lb::LoadBalancer;
use crate::loadgen::{ConnKind, LoadGenerator, RequestRecord};
use crate::scenario::wait_for;
use crate::timeline::{Clock, Recorder};

/// What is done to node 1's kproxy at the start of a phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disturbance {
    /// Nothing: the reference the other phases compare with.
    None,
    Sigterm,
    Sigkill,
    /// SIGTERM, then a different binary (another path) with the same arguments.
    Upgrade,
}

impl Disturbance {
    pub const ALL: [Disturbance; 4] = [
        Disturbance::None,
        Disturbance::Sigterm,
        Disturbance::Sigkill,
        Disturbance::Upgrade,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Disturbance::None => "baseline",
            Disturbance::Sigterm => "sigterm",
            Disturbance::Sigkill => "sigkill",
            Disturbance::Upgrade => "upgrade",
        }
    }
}

/// The two loads of a takeover or restart run: new and keep-alive connections through
/// the load balancer from the client, and through the cluster IP from node 1.
pub(crate) fn start_both_loads(
    fabric: &Fabric,
    cfg: &RolloutConfig,
    clock: &Clock,
) -> Result<[(Via, LoadGenerator); 2], LabError> {
    // A node reaches the Service range by its default route on a real cluster; the
    // lab's nodes have none, so node 1 gets one for the range (DNAT in the output hook
    // then re-routes to the chosen pod).
    fabric.nodes[0].ns.ip(&[
        "route",
        "add",
        "10.96.0.0/16",
        "via",
        &fabric::LB_FABRIC_IP.to_string(),
    ])?;
    let cip: std::net::IpAddr = controlplane::CLUSTER_IP
        .parse()
        .map_err(|e| LabError::Invalid(format!("cluster IP: {e}")))?;
    Ok([
        (
            Via::Lb,
            LoadGenerator::start(
                fabric.client.name(),
                SocketAddr::from((fabric::VIP, controlplane::SERVICE_PORT)),
                cfg.load.clone(),
                clock.start(),
            )?,
        ),
        (
            Via::ClusterIp,
            LoadGenerator::start(
                fabric.nodes[0].ns.name(),
                SocketAddr::new(cip, controlplane::SERVICE_PORT),
                cfg.load.clone(),
                clock.start(),
            )?,
        ),
    ])
}

/// Where a load enters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Via {
    /// Client → LB VIP → a node's NodePort (eTP=Local).
    Lb,
    /// Node 1's own network namespace → the cluster IP.
    ClusterIp,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Lb => "lb",
            Via::ClusterIp => "cluster-ip",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub new_sent: usize,
    pub new_failed: usize,
    pub keepalive_sent: usize,
    /// Failed requests on a connection that had already carried one: an established
    /// connection broken.
    pub established_broken: usize,
    /// Other keep-alive failures (the first request of a connection).
    pub keepalive_other_failed: usize,
}

impl Counts {
    pub fn failures(&self) -> usize {
        self.new_failed + self.established_broken + self.keepalive_other_failed
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub disturbance: Disturbance,
    pub start_ms: f64,
    pub end_ms: f64,
    /// From the disturbance to the new process's first sync (none for the baseline).
    pub converged_ms: Option<f64>,
    pub by_path: BTreeMap<Via, Counts>,
    /// Failures by outcome, both paths.
    pub failed_by_kind: BTreeMap<String, usize>,
}

#[derive(Clone, Debug, Serialize)]
pub struct RestartReport {
    pub nodes: usize,
    pub hold_seconds: f64,
    pub phases: Vec<Phase>,
    pub failures: usize,
}

/// Counts the records of `path` into the phases whose window holds their start.
/// Pure.
pub fn tally(phases: &mut [Phase], path: Via, records: &[RequestRecord]) {
    for r in records {
        let Some(p) = phases
            .iter_mut()
            .find(|p| r.start_ms >= p.start_ms && r.start_ms < p.end_ms)
        else {
            continue; // before the first phase or after the last
        };
        let c = p.by_path.entry(path).or_default();
        let ok = r.outcome.is_ok();
        match r.conn {
            ConnKind::New => {
                c.new_sent += 1;
                c.new_failed += usize::from(!ok);
            }
            ConnKind::KeepAlive => {
                c.keepalive_sent += 1;
                if !ok && r.reused {
                    c.established_broken += 1;
                } else if !ok {
                    c.keepalive_other_failed += 1;
                }
            }
        }
        if !ok {
            *p.failed_by_kind
                .entry(r.outcome.as_str().to_string())
                .or_default() += 1;
        }
    }
}

pub fn render_text(r: &RestartReport) -> String {
    let mut s = format!(
        "kproxy restart under load: {} nodes, node 1's kproxy disturbed, {:.1} s held after each new process synced\n",
        r.nodes, r.hold_seconds
    );
    s.push_str("phase     path        new conns (failed)  keep-alive reqs  established broken  other failed  converged\n");
    for p in &r.phases {
        for (path, c) in &p.by_path {
            s.push_str(&format!(
                "{:<9} {:<11} {:>9} ({:>3})      {:>9}        {:>6}              {:>6}        {}\n",
                p.disturbance.as_str(),
                path.as_str(),
                c.new_sent,
                c.new_failed,
                c.keepalive_sent,
                c.established_broken,
                c.keepalive_other_failed,
                p.converged_ms
                    .map_or("-".to_string(), |m| format!("{m:.0} ms")),
            ));
        }
        if !p.failed_by_kind.is_empty() {
            s.push_str(&format!("          failures: {:?}\n", p.failed_by_kind));
        }
    }
    s.push_str(&format!(
        "total failures: {}{}\n",
        r.failures,
        if r.failures == 0 { " (hitless)" } else { "" }
    ));
    s
}

/// The wall clock in ms since the epoch (kproxy's event log uses it).
fn unix_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1000.0
}

/// The time of the first `synced` event in `log` at or after `since_unix_ms`.
fn synced_since(log: &Path, since_unix_ms: f64) -> Option<f64> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "synced")
        .filter_map(|v| v["t_unix_ms"].as_f64())
        .find(|&t| t >= since_unix_ms)
}

/// Runs the scenario with `cfg`'s cluster and load (its rollout settings unused),
/// `hold` after each new process synced.
pub fn run(
    cfg: &RolloutConfig,
    kproxy: &Path,
    hold: Duration,
    progress: crate::scenario::Progress,
) -> Result<RestartReport, LabError> {
    cfg.validate()?;
    crate::scenario::on_lab_runtime(run_async(cfg, kproxy, hold, progress))
}

async fn run_async(
    cfg: &RolloutConfig,
    kproxy: &Path,
    hold: Duration,
    progress: crate::scenario::Progress<'_>,
) -> Result<RestartReport, LabError> {
    let clock = Clock::new(cfg.time_scale);
    let rec = Recorder::new(clock.clone());
    let hc = cfg.load_balancer.effective_health_check()?;
    let fabric = Arc::new(Fabric::build(cfg.nodes)?);
    let workdir = std::env::temp_dir().join(format!("kproxy-lab-{}", fabric.prefix));
    std::fs::create_dir_all(&workdir).map_err(|e| LabError::Io {
        what: format!("mkdir {}", workdir.display()),
        source: e,
    })?;
    let _cleanup = RemoveDir(workdir.clone());
    // The "different build": the binary copied to another path.
    let next = workdir.join("kproxy-next");
    std::fs::copy(kproxy, &next).map_err(|e| LabError::Io {
        what: format!("copy {} to {}", kproxy.display(), next.display()),
        source: e,
    })?;
    progress(&format!(
        "network up: {} nodes, LB and client ({})",
        cfg.nodes, fabric.prefix
    ));
    let (cp, dirs) = ControlPlane::start_for_nodes(
        &fabric,
        &workdir,
        cfg.publish_not_ready_addresses,
        clock.real(cfg.propagation_delay_seconds),
        rec.clone(),
    )?;
    let mut daemons = Vec::new();
    for (n, dir) in fabric.nodes.iter().zip(&dirs) {
        daemons.push(Kproxyd::start(kproxy, n, dir, &workdir, true, &[])?);
    }
    let mut lb = LoadBalancer::for_lab_service(&fabric, cfg.load_balancer.mode, hc, rec.clone())?;
    let cluster = Cluster::new(
        fabric.clone(),
        Arc::new(cp.clone()),
        rec.clone(),
        cfg.pod,
        cfg.deployment,
    );
    let limit = clock.real(
        cfg.pod.readiness_probe.initial_delay_seconds
            + cfg.pod.readiness_probe.period_seconds * 4.0
            + hc.interval_seconds * (hc.healthy_threshold as f64 + 2.0)
            + 30.0,
    ) + Duration::from_secs(20);
    let c2 = cluster.clone();
    let initial = tokio::spawn(async move { c2.rollout(1, limit).await });
    wait_for("the pods to become ready", limit, &mut daemons, || {
        initial.is_finished()
    })
    .await?;
    initial
        .await
        .map_err(|e| LabError::Invalid(format!("rollout task: {e}")))??;
    wait_for(
        "the load balancer to see every node healthy",
        limit,
        &mut daemons,
        || lb.healthy().iter().all(|h| *h),
    )
    .await?;
    progress("pods ready, load balancer pool complete; starting both loads");

    let loads = start_both_loads(&fabric, cfg, &clock)?;
    // Warm-up: keep-alive connections open, conntrack entries in place.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut phases = Vec::new();
    for dist in Disturbance::ALL {
        let start_ms = clock.now_ms();
        let wall = unix_ms(SystemTime::now());
        let d = &mut daemons[0];
        match dist {
            Disturbance::None => {}
            Disturbance::Sigterm => d.restart()?,
            Disturbance::Sigkill => d.kill_and_start()?,
            Disturbance::Upgrade => d.replace(&next)?,
        }
        let converged_ms = if dist == Disturbance::None {
            None
        } else {
            let log = daemons[0].event_log.clone();
            let mut synced = None;
            wait_for(
                &format!("node 1's new kproxy to sync ({})", dist.as_str()),
                Duration::from_secs(30),
                &mut daemons,
                || {
                    synced = synced_since(&log, wall);
                    synced.is_some()
                },
            )
            .await?;
            synced.map(|t| t - wall)
        };
        tokio::time::sleep(hold).await;
        let (sent, failed) = loads.iter().fold((0, 0), |(s, f), (_, l)| {
            let (a, b) = l.counts();
            (s + a, f + b)
        });
        progress(&format!(
            "{}: converged {}; {sent} requests so far, {failed} failed",
            dist.as_str(),
            converged_ms.map_or("-".into(), |m| format!("in {m:.0} ms"))
        ));
        phases.push(Phase {
            disturbance: dist,
            start_ms,
            end_ms: clock.now_ms(),
            converged_ms,
            by_path: BTreeMap::new(),
            failed_by_kind: BTreeMap::new(),
        });
    }
    for (path, load) in loads {
        let records = load.stop();
        tally(&mut phases, path, &records);
    }
    for d in daemons.iter_mut() {
        d.check_alive()?;
        d.stop();
    }
    lb.stop();
    cluster.shutdown().await;
    let failures = phases
        .iter()
        .flat_map(|p| p.by_path.values())
        .map(Counts::failures)
        .sum();
    Ok(RestartReport {
        nodes: cfg.nodes,
        hold_seconds: hold.as_secs_f64(),
        phases,
        failures,
    })
}

/// Removes the run's scratch directory when the run ends, however it ends.
pub(crate) struct RemoveDir(pub(crate) PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loadgen::Outcome;

    fn rec(start_ms: f64, conn: ConnKind, outcome: Outcome, reused: bool) -> RequestRecord {
        RequestRecord {
            start_ms,
            end_ms: start_ms + 1.0,
            outcome,
            conn,
            pod: None,
            reused,
            conn_pod: None,
        }
    }

    fn phase(d: Disturbance, start_ms: f64, end_ms: f64) -> Phase {
        Phase {
            disturbance: d,
            start_ms,
            end_ms,
            converged_ms: None,
            by_path: BTreeMap::new(),
            failed_by_kind: BTreeMap::new(),
        }
    }

    #[test]
    fn records_count_in_the_phase_they_started_in() {
        let mut phases = vec![
            phase(Disturbance::None, 0.0, 100.0),
            phase(Disturbance::Sigkill, 100.0, 200.0),
        ];
        let records = [
            rec(-5.0, ConnKind::New, Outcome::Refused, false), // warm-up: not counted
            rec(10.0, ConnKind::New, Outcome::Ok, false),
            rec(99.9, ConnKind::KeepAlive, Outcome::Ok, true),
            rec(100.0, ConnKind::New, Outcome::Refused, false),
            rec(150.0, ConnKind::KeepAlive, Outcome::Reset, true),
            rec(160.0, ConnKind::KeepAlive, Outcome::Timeout, false),
            rec(250.0, ConnKind::New, Outcome::Refused, false), // after: not counted
        ];
        tally(&mut phases, Via::Lb, &records);
        let base = phases[0].by_path[&Via::Lb];
        assert_eq!(
            (base.new_sent, base.keepalive_sent, base.failures()),
            (1, 1, 0)
        );
        let k = phases[1].by_path[&Via::Lb];
        assert_eq!(
            (
                k.new_sent,
                k.new_failed,
                k.keepalive_sent,
                k.established_broken,
                k.keepalive_other_failed
            ),
            (1, 1, 2, 1, 1)
        );
        assert_eq!(phases[1].failed_by_kind["refused"], 1);
        assert_eq!(phases[1].failed_by_kind["reset"], 1);
        assert!(
            render_text(&RestartReport {
                nodes: 3,
                hold_seconds: 1.0,
                phases,
                failures: 3
            })
            .contains("sigkill   lb")
        );
    }
}
