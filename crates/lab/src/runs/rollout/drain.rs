//! The node drain a run can do instead of a rolling update (the matrix's node-drain
//! row): the cluster autoscaler's taint, the eviction, the replacement pods, then
//! the node's deletion, on either control plane.

use std::sync::Arc;
use std::time::Duration;

use super::spawn_rollout;
use crate::LabError;
use crate::runs::{Progress, blocking, finish, wait_for};
use crate::scenario::run::NodeDrain;
use crate::world::cluster::Cluster;
use crate::world::controlplane::ControlPlane;
use crate::world::fabric::Fabric;
use crate::world::k8s::RealControlPlane;
use crate::world::kproxyd::Kproxyd;
use crate::world::lb::LoadBalancer;
use crate::world::timeline::EventKind;

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
        blocking(|| k.stop());
    }
    blocking(|| net.ns.ip(&["link", "set", "eth0", "down"]))?;
    write_node_change(emulated, real, d.node, true).await?;
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
