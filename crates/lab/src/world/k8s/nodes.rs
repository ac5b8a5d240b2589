//! The lab's Nodes on the real API server, as a kubelet keeps them: each Node object
//! (with the scale-down taint of a node drain), its Ready status and its Lease,
//! renewed every 5 s, and the lab Service created beside them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use kube::api::{Api, Patch, PatchParams};
use serde_json::{Value, json};

use super::{FIELD_MANAGER, api_err, now_rfc3339};
use crate::LabError;
use crate::scenario::service::{
    SERVICE_NAME, SERVICE_NAMESPACE, TAINT_TO_BE_DELETED, lab_service, lab_service_status,
};
use crate::world::fabric;
use crate::world::timeline::{EventKind, Recorder};

/// What the lab changed about its Nodes (a node drain): the lab owns these fields.
#[derive(Clone, Debug, Default)]
pub struct NodeChanges {
    /// Node (1-based) → the `ToBeDeletedByClusterAutoscaler` taint's value (Unix s).
    pub tainted: BTreeMap<usize, i64>,
    /// Nodes whose object the lab deleted (no heartbeat recreates them).
    pub deleted: std::collections::BTreeSet<usize>,
    /// Node (1-based) → a drain condition of KEP-5683 (its type) set "True".
    pub conditions: BTreeMap<usize, &'static str>,
}

fn node_object(i: usize, changes: &NodeChanges) -> Value {
    let name = fabric::node_name(i);
    let mut spec =
        json!({"podCIDR": format!("10.244.{i}.0/24"), "podCIDRs": [format!("10.244.{i}.0/24")]});
    if let Some(t) = changes.tainted.get(&i) {
        spec["taints"] = json!([{"key": TAINT_TO_BE_DELETED,
            "value": t.to_string(), "effect": "NoSchedule"}]);
    }
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
        "spec": spec
    })
}

fn node_status(i: usize, since: &str, changes: &NodeChanges) -> Value {
    let name = fabric::node_name(i);
    let now = now_rfc3339();
    let mut conditions = vec![json!({
        "type": "Ready", "status": "True", "reason": "KubeletReady",
        "message": "kproxy lab kubelet is posting ready status",
        "lastHeartbeatTime": now, "lastTransitionTime": since
    })];
    if let Some(kind) = changes.conditions.get(&i) {
        conditions.push(json!({
            "type": kind, "status": "True", "reason": "KproxyLab",
            "lastHeartbeatTime": now, "lastTransitionTime": now
        }));
    }
    json!({"status": {
        "addresses": [
            {"type": "InternalIP", "address": fabric::node_ip(i).to_string()},
            {"type": "Hostname", "address": name}
        ],
        "conditions": conditions
    }})
}

fn lease_object(i: usize) -> Value {
    let name = fabric::node_name(i);
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": "kube-node-lease"},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}
    })
}

pub(super) async fn beat(
    client: &kube::Client,
    nodes: usize,
    since: &str,
    changes: &Mutex<NodeChanges>,
) -> Result<(), LabError> {
    let napi: Api<Node> = Api::all(client.clone());
    let lapi: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "kube-node-lease");
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    for i in 1..=nodes {
        let name = fabric::node_name(i);
        let (object, status) = {
            let c = changes.lock().expect("node changes lock");
            if c.deleted.contains(&i) {
                continue;
            }
            (node_object(i, &c), node_status(i, since, &c))
        };
        napi.patch(&name, &pp, &Patch::Apply(object))
            .await
            .map_err(api_err(format!("apply node {name}")))?;
        napi.patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
            .await
            .map_err(api_err(format!("node {name} status")))?;
        lapi.patch(&name, &pp, &Patch::Apply(lease_object(i)))
            .await
            .map_err(api_err(format!("lease {name}")))?;
    }
    Ok(())
}

/// Create the lab's Nodes (Ready) and the Service (with the load balancer's
/// address in its status), as `world::controlplane::render_manifests` describes them.
pub async fn prepare(
    client: &kube::Client,
    nodes: usize,
    publish_not_ready_addresses: bool,
    etp_local: bool,
) -> Result<String, LabError> {
    let since = now_rfc3339();
    beat(client, nodes, &since, &Mutex::default()).await?;
    let svc: Api<Service> = Api::namespaced(client.clone(), SERVICE_NAMESPACE);
    let spec = lab_service(publish_not_ready_addresses, etp_local);
    svc.patch(
        SERVICE_NAME,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(spec),
    )
    .await
    .map_err(api_err("apply service"))?;
    svc.patch_status(
        SERVICE_NAME,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": lab_service_status()})),
    )
    .await
    .map_err(api_err("service status"))?;
    Ok(since)
}

/// Keep every lab Node Ready: status heartbeat and Lease renewal every 5 s (the
/// kubelet's defaults are 10 s, kcm's grace period 40-50 s).
pub async fn heartbeat(
    client: kube::Client,
    nodes: usize,
    since: String,
    changes: Arc<Mutex<NodeChanges>>,
    rec: Recorder,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    loop {
        tick.tick().await;
        if let Err(e) = beat(&client, nodes, &since, &changes).await {
            rec.record(EventKind::Note, None, None, format!("node heartbeat: {e}"));
        }
    }
}
