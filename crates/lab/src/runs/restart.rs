//! `kproxy lab restart`: is a restart or an upgrade of kproxy itself
//! hitless? The lab cluster (fabric, control plane, a kproxy per node, the emulated
//! load balancer in front of an eTP=Local LoadBalancer Service, a Deployment with one
//! pod per node) carries two loads — one from the client through the LB's VIP, one from
//! node 1 itself to the cluster IP — each opening new connections at a steady rate and
//! holding keep-alive ones. Then, one after another, node 1's kproxy is
//! (a) stopped with SIGTERM and started again, (b) killed with SIGKILL and started
//! again, (c) replaced by a different build (a copy of the binary at another path, as a
//! DaemonSet update does; or, with `--upgrade-to`, another release, and then (d) rolled
//! back to the first binary). Each phase lasts from the disturbance until the new process
//! has synced, then `hold` more. Every request is counted in the phase it started in.
//!
//! The counting and the table are `report::held`'s; the cluster, the loads and the
//! bring-up `runs::held`'s. Here: the disturbances, and the wait for each new
//! process's first sync.

use std::path::Path;
use std::time::{Duration, SystemTime};

use crate::LabError;
use crate::report::held::{Phase, RestartReport, failures};
use crate::runs::held::HeldLab;
use crate::runs::{Progress, blocking, finish, on_lab_runtime, wait_for};
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::run::Disturbance;
use crate::world::kproxyd::{self, Kproxyd};

/// Runs the scenario with `cfg`'s cluster and load (its rollout settings unused),
/// `hold` after each new process synced.
pub fn run(
    cfg: &RolloutConfig,
    kproxy: &Path,
    upgrade_to: Option<&Path>,
    hold: Duration,
    progress: Progress,
) -> Result<RestartReport, LabError> {
    cfg.validate()?;
    on_lab_runtime(run_async(cfg, kproxy, upgrade_to, hold, progress))
}

async fn run_async(
    cfg: &RolloutConfig,
    kproxy: &Path,
    upgrade_to: Option<&Path>,
    hold: Duration,
    progress: Progress<'_>,
) -> Result<RestartReport, LabError> {
    let lab = HeldLab::build(cfg, Duration::from_secs(20))?;
    // The "different build": `upgrade_to`, or the binary copied to another path.
    let next = lab.workdir.path.join("kproxy-next");
    let from = upgrade_to.unwrap_or(kproxy);
    std::fs::copy(from, &next).map_err(|e| LabError::Io {
        what: format!("copy {} to {}", from.display(), next.display()),
        source: e,
    })?;
    progress(&format!(
        "network up: {} nodes, LB and client ({})",
        cfg.nodes, lab.fabric.prefix
    ));
    let (cp, dirs) = lab.emulated_control_plane(cfg)?;
    let mut daemons = Vec::new();
    for (n, dir) in lab.fabric.nodes.iter().zip(&dirs) {
        daemons.push(Kproxyd::start(
            kproxy,
            n,
            dir,
            &lab.workdir.path,
            true,
            &[],
        )?);
    }
    let mut lb = lab.load_balancer(cfg)?;
    let cluster = lab.cluster(cfg, std::sync::Arc::new(cp));
    let c2 = cluster.clone();
    let limit = lab.limit;
    let initial = tokio::spawn(async move { c2.rollout(1, limit).await });
    finish(
        "the pods to become ready",
        "rollout",
        limit,
        &mut daemons,
        initial,
        || {},
    )
    .await?;
    wait_for(
        "the load balancer to see every node healthy",
        limit,
        &mut daemons,
        || lb.healthy().iter().all(|h| *h),
    )
    .await?;
    progress("pods ready, load balancer pool complete; starting both loads");

    let loads = lab.start_loads(cfg).await?;
    let mut phases = Vec::new();
    let rollback = upgrade_to.map(|_| Disturbance::Rollback);
    for dist in Disturbance::ALL.into_iter().chain(rollback) {
        let start_ms = lab.clock.now_ms();
        let converged_ms = disturb(dist, &mut daemons, &next, kproxy).await?;
        tokio::time::sleep(hold).await;
        let (sent, failed) = loads.counts();
        progress(&format!(
            "{}: converged {}; {sent} requests so far, {failed} failed",
            dist.as_str(),
            converged_ms.map_or("-".into(), |m| format!("in {m:.0} ms"))
        ));
        phases.push(Phase::window(
            dist,
            start_ms,
            lab.clock.now_ms(),
            converged_ms,
        ));
    }
    loads.stop_into(&mut phases);
    for d in daemons.iter_mut() {
        d.check_alive()?;
        blocking(|| d.stop());
    }
    lb.stop();
    cluster.shutdown().await;
    let failures = failures(phases.iter().map(|p| &p.by_path));
    Ok(RestartReport {
        nodes: cfg.nodes,
        hold_seconds: hold.as_secs_f64(),
        phases,
        failures,
    })
}

/// Does `dist` to node 1's kproxy (`next`: the other build, `first`: the one every
/// node started with) and waits for the new process's first sync; the time that took
/// (ms), none for the baseline.
async fn disturb(
    dist: Disturbance,
    daemons: &mut [Kproxyd],
    next: &Path,
    first: &Path,
) -> Result<Option<f64>, LabError> {
    let wall = kproxyd::unix_ms(SystemTime::now());
    let d = &mut daemons[0];
    match dist {
        Disturbance::None => return Ok(None),
        Disturbance::Sigterm => blocking(|| d.restart())?,
        Disturbance::Sigkill => blocking(|| d.kill_and_start())?,
        Disturbance::Upgrade => blocking(|| d.replace(next))?,
        Disturbance::Rollback => blocking(|| d.replace(first))?,
    }
    let log = d.event_log.clone();
    let mut synced = None;
    wait_for(
        &format!("node 1's new kproxy to sync ({})", dist.as_str()),
        Duration::from_secs(30),
        daemons,
        || {
            synced = kproxyd::first_sync_since(&log, wall);
            synced.is_some()
        },
    )
    .await?;
    Ok(synced.map(|t| t - wall))
}
