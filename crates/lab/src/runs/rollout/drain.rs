//! The node drain a run can do instead of a rolling update (the matrix's node-drain
//! rows): the cluster autoscaler's taint or a drain condition, the eviction, the
//! replacement pods, then the node's deletion, on either control plane; or a graceful
//! node shutdown, whose kproxy is stopped at once and drains before it exits.

use std::sync::Arc;
use std::time::Duration;

use super::spawn_rollout;
use crate::LabError;
use crate::runs::{Progress, blocking, finish, wait_for};
use crate::scenario::run::{DrainBy, NodeDrain};
use crate::world::cluster::Cluster;
use crate::world::controlplane::ControlPlane;
use crate::world::fabric::Fabric;
use crate::world::k8s::RealControlPlane;
use crate::world::kproxyd::Kproxyd;
use crate::world::lb::LoadBalancer;
use crate::world::timeline::EventKind;

/// What the lab writes of a drained node to the control plane.
#[derive(Clone, Copy)]
enum NodeChange {
    /// The cluster autoscaler's scale-down taint.
    Taint,
    /// A KEP-5683 condition set "True".
    Condition(&'static str),
    /// The deletion of the Node object.
    Delete,
}

/// Write a drained node's change to the run's control plane.
async fn write_node_change(
    emulated: Option<&ControlPlane>,
    real: Option<&Arc<RealControlPlane>>,
    node: usize,
    change: NodeChange,
) -> Result<(), LabError> {
    match (emulated, real, change) {
        (Some(cp), _, NodeChange::Taint) => cp.taint_node(node),
        (Some(cp), _, NodeChange::Condition(kind)) => cp.set_node_condition(node, kind),
        (Some(cp), _, NodeChange::Delete) => cp.delete_node(node),
        (None, Some(r), NodeChange::Taint) => r.taint_node(node).await?,
        (None, Some(r), NodeChange::Condition(kind)) => r.set_node_condition(node, kind).await?,
        (None, Some(r), NodeChange::Delete) => r.delete_node(node).await?,
        (None, None, _) => {}
    }
    Ok(())
}

/// The node drain (see [`NodeDrain`]); returns when the drained node is deleted and
/// out of the load balancer's pool and the replacement pods are available: the
/// disturbance's start and end (real ms), reported as the "rollout" phase.
#[allow(clippy::too_many_arguments)]
pub(super) async fn drain_node(
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
    let (what, change, told) = match (d.by, d.by.condition()) {
        (DrainBy::AutoscalerTaint, _) | (_, None) => (
            "cluster autoscaler scale-down",
            NodeChange::Taint,
            "tainted ToBeDeletedByClusterAutoscaler:NoSchedule".to_string(),
        ),
        (DrainBy::Condition, Some(kind)) => (
            "drain",
            NodeChange::Condition(kind),
            format!("condition {kind}=True"),
        ),
        (DrainBy::Shutdown, Some(kind)) => (
            "graceful node shutdown",
            NodeChange::Condition(kind),
            format!("condition {kind}=True"),
        ),
    };
    rec.record(
        EventKind::RolloutStarted,
        None,
        None,
        format!("node drain of {name} ({what})"),
    );
    write_node_change(emulated, real, d.node, change).await?;
    rec.record(EventKind::NodeTainted, Some(&name), None, told.clone());
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
        "{tag} {name} {told}; evicted {}",
        evicted.join(", ")
    ));
    if d.by == DrainBy::Shutdown {
        // The kubelet's shutdown gives the node's pods `delete_after_s` (its
        // shutdownGracePeriod less shutdownGracePeriodCriticalPods: one LB interval, less
        // than the detection window), then stops kproxy (a critical pod), whose drain
        // period is all the rest the load balancer gets: the node goes when it exits.
        tokio::time::sleep(clock.real(d.delete_after_s)).await;
        if let Some(k) = daemons.iter_mut().find(|k| k.node == name) {
            rec.record(
                EventKind::KproxyStopped,
                Some(&name),
                None,
                "kproxy SIGTERMed (node shutdown)",
            );
            blocking(|| k.stop_within(limit));
            rec.record(EventKind::KproxyStopped, Some(&name), None, "kproxy exited");
        }
    } else {
        wait_for("the drained node's pods to be gone", limit, daemons, || {
            !cluster.pods().iter().any(|p| p.node_index == d.node)
        })
        .await?;
        tokio::time::sleep(clock.real(d.delete_after_s)).await;
        // The cloud instance goes: kube-proxy stops with it and nothing reaches the node.
        if let Some(k) = daemons.iter_mut().find(|k| k.node == name) {
            blocking(|| k.stop());
        }
    }
    blocking(|| net.ns.ip(&["link", "set", "eth0", "down"]))?;
    write_node_change(emulated, real, d.node, NodeChange::Delete).await?;
    rec.record(
        EventKind::NodeDeleted,
        Some(&name),
        None,
        "node deleted: kproxy stopped, link cut, Node object removed",
    );
    progress(&format!("{tag} {name} deleted"));
    finish(
        "the replacement pods",
        "replacement",
        limit,
        daemons,
        replace,
        || {},
    )
    .await?;
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
