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
    HEALTH_CHECK_NODE_PORT, NODE_PORT, SERVICE_NAME, SERVICE_NAMESPACE, TAINT_TO_BE_DELETED,
    lab_service, lab_service_status,
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

/// The Services of `services` other than the lab's own that hold one of the node
/// ports the lab Service asks for (its nodePort, and with eTP Local its
/// healthCheckNodePort; both are cluster-wide): one line per holder, saying what to
/// free. Empty when the ports are free. The API server would refuse the lab Service
/// with a bare 422 ("provided port is already allocated"); this names the holder.
pub fn node_ports_held(services: &[Service], etp_local: bool) -> Vec<String> {
    let mut wanted = vec![("nodePort", NODE_PORT)];
    if etp_local {
        wanted.push(("healthCheckNodePort", HEALTH_CHECK_NODE_PORT));
    }
    let mut held = Vec::new();
    for s in services {
        let ns = s.metadata.namespace.as_deref().unwrap_or("default");
        let name = s.metadata.name.as_deref().unwrap_or("");
        if ns == SERVICE_NAMESPACE && name == SERVICE_NAME {
            continue; // the lab's own, from an earlier run: applied over
        }
        let Some(spec) = &s.spec else { continue };
        let mut ports: Vec<i32> = spec
            .ports
            .iter()
            .flatten()
            .filter_map(|p| p.node_port)
            .collect();
        ports.extend(spec.health_check_node_port);
        for (field, port) in &wanted {
            if ports.contains(&i32::from(*port)) {
                held.push(format!(
                    "port {port} (the lab Service's {field}) is held by Service {ns}/{name}: free it with `kubectl -n {ns} delete service {name}` (or change its node port)"
                ));
            }
        }
    }
    held
}

/// Create the lab's Nodes (Ready) and the Service (with the load balancer's
/// address in its status), as `world::controlplane::render_manifests` describes them.
/// Refuses, naming the holders, when another Service holds the lab Service's node
/// ports.
pub async fn prepare(
    client: &kube::Client,
    nodes: usize,
    publish_not_ready_addresses: bool,
    etp_local: bool,
) -> Result<String, LabError> {
    let since = now_rfc3339();
    beat(client, nodes, &since, &Mutex::default()).await?;
    let all: Api<Service> = Api::all(client.clone());
    let existing = all
        .list(&kube::api::ListParams::default())
        .await
        .map_err(api_err("list services"))?;
    let held = node_ports_held(&existing.items, etp_local);
    if !held.is_empty() {
        return Err(LabError::Invalid(format!(
            "the lab Service's node ports are taken on this cluster (the lab uses fixed ports, which its load balancer and reports name):\n  {}",
            held.join("\n  ")
        )));
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn service(ns: &str, name: &str, node_ports: &[i32], hc: Option<i32>) -> Service {
        serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": name},
            "spec": {
                "ports": node_ports.iter().map(|p| json!({"port": 80, "nodePort": p})).collect::<Vec<_>>(),
                "healthCheckNodePort": hc,
            }
        }))
        .unwrap()
    }

    /// Another Service on the lab's nodePort or health-check node port is named with
    /// what to free; the lab's own Service (an earlier run's), other ports, and the
    /// health-check port under eTP Cluster (the lab asks for none) are not.
    #[test]
    fn the_holders_of_the_lab_node_ports_are_named() {
        let services = vec![
            service(SERVICE_NAMESPACE, SERVICE_NAME, &[30080], Some(32000)),
            service("shop", "web", &[30081, 30080], None),
            service("shop", "api", &[31000], Some(32000)),
            service("kube-system", "dns", &[], None),
        ];
        let held = node_ports_held(&services, true);
        assert_eq!(held.len(), 2, "{held:?}");
        assert!(
            held[0].starts_with("port 30080 (the lab Service's nodePort) is held by Service shop/web: free it with `kubectl -n shop delete service web`"),
            "{}",
            held[0]
        );
        assert!(
            held[1].starts_with(
                "port 32000 (the lab Service's healthCheckNodePort) is held by Service shop/api"
            ),
            "{}",
            held[1]
        );
        assert_eq!(node_ports_held(&services, false).len(), 1);
        assert!(node_ports_held(&services[..1], true).is_empty());
    }
}
