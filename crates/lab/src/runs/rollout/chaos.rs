//! Chaos during a rolling update (`--chaos`, the matrix's chaos rows): what each
//! [`Chaos`] does to the running lab, recorded on the run's timeline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::LabError;
use crate::runs::{Progress, blocking};
use crate::scenario::run::{API_OUTAGE_S, Chaos};
use crate::world::fabric::Fabric;
use crate::world::k8s::RealControlPlane;
use crate::world::k8s::deployment::get_deployment;
use crate::world::k8s::process::LabProcess;
use crate::world::kproxyd::Kproxyd;
use crate::world::timeline::{Clock, EventKind, Recorder};

/// Does `chaos` to the running lab, recording it on the timeline.
pub(super) async fn disturb(
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
        Chaos::NftFlush => {
            if let Some(node) = fabric.nodes.first() {
                blocking(|| node.ns.exec("nft", &["flush", "ruleset"]))?;
                rec.record(
                    EventKind::RulesetFlushed,
                    Some(&node.name),
                    None,
                    "nft flush ruleset (another process)",
                );
                progress(&format!("{tag} flushed {}'s nftables ruleset", node.name));
            }
        }
        Chaos::KproxyRestart => {
            for d in daemons.iter_mut() {
                blocking(|| d.restart())?;
                rec.record(
                    EventKind::KproxyRestarted,
                    Some(&d.node),
                    None,
                    "kproxy stopped (SIGTERM) and started again",
                );
            }
            progress(&format!("{tag} restarted kproxy on every node"));
        }
        Chaos::KproxyKill => {
            if let Some(d) = daemons.first_mut() {
                blocking(|| d.kill_and_start())?;
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
                LabError::Invalid(format!("{chaos} needs --control-plane k8s-lab"))
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
                let server = LabProcess::find(&real.lab, "kube-apiserver")?;
                // kcm goes down with it, as a production kcm does: it runs with leader
                // election (the default; the k8s-lab's runs without), cannot renew its
                // lease for renewDeadline (10 s) of a 30 s outage, exits, and its kubelet
                // starts it again, to relist once the API answers. A kcm left running
                // through the outage instead resumes from informer caches it thinks are
                // stale and leaves terminations unpublished while its other controllers
                // go on (docs/lab.md, "Chaos cells").
                let kcm = LabProcess::find(&real.lab, "kube-controller-manager")?;
                blocking(|| server.kill().and_then(|()| kcm.kill()))?;
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
                while get_deployment(&real.client).await.is_err()
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
async fn start_kcm_as_kubelet_would(kcm: &LabProcess, clock: &Clock) -> Result<u32, LabError> {
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
