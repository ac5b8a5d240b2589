//! The lab Service: its names, addresses and ports, the port its pods serve on, and
//! the Service object itself as both control planes create it. The one place these
//! numbers are written; the world and the reports read them from here.

use std::net::Ipv4Addr;

use serde_json::{Value, json};

pub const SERVICE_NAMESPACE: &str = "lab";
pub const SERVICE_NAME: &str = "web";
pub const CLUSTER_IP: &str = "10.96.0.10";
pub const SERVICE_PORT: u16 = 80;
pub const NODE_PORT: u16 = 30080;
pub const HEALTH_CHECK_NODE_PORT: u16 = 32000;
/// kproxy's `/healthz` on every node (`--healthz-bind-address nodeIP:10256`), which
/// load balancers of eTP-Cluster Services probe (KEP-3836).
pub const PROXY_HEALTHZ_PORT: u16 = 10256;
/// The port every pod of the Deployment serves on (the Service's targetPort).
pub const POD_PORT: u16 = 8080;
/// The load balancer's address: the Service's `status.loadBalancer` and where the client sends.
pub const VIP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);

/// The cluster autoscaler's scale-down taint (upstream `ToBeDeletedTaint`); kproxy reads
/// it as `kproxy_core::ingest::TAINT_TO_BE_DELETED`.
pub const TAINT_TO_BE_DELETED: &str = kproxy_core::ingest::TAINT_TO_BE_DELETED;

/// The lab's Service, as both control planes create it (the real one applies it; its
/// status goes through the status subresource, see [`lab_service_status`]).
pub fn lab_service(publish_not_ready_addresses: bool, etp_local: bool) -> Value {
    let mut svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": SERVICE_NAME, "namespace": SERVICE_NAMESPACE},
        "spec": {
            "type": "LoadBalancer",
            "clusterIP": CLUSTER_IP, "clusterIPs": [CLUSTER_IP], "ipFamilies": ["IPv4"],
            "selector": {"app": SERVICE_NAME},
            "ports": [{"name": "http", "protocol": "TCP", "port": SERVICE_PORT,
                       "targetPort": POD_PORT, "nodePort": NODE_PORT}],
            "externalTrafficPolicy": "Local",
            "internalTrafficPolicy": "Cluster",
            "healthCheckNodePort": HEALTH_CHECK_NODE_PORT,
            "publishNotReadyAddresses": publish_not_ready_addresses,
            "sessionAffinity": "None"
        }
    });
    if !etp_local {
        // eTP Cluster: no health check node port; load balancers probe each node's
        // kproxy `/healthz` (10256) instead (KEP-3836).
        svc["spec"]["externalTrafficPolicy"] = json!("Cluster");
        if let Some(spec) = svc["spec"].as_object_mut() {
            spec.remove("healthCheckNodePort");
        }
    }
    svc
}

/// The lab Service's status: the emulated load balancer's VIP.
pub fn lab_service_status() -> Value {
    json!({"loadBalancer": {"ingress": [{"ip": VIP.to_string(), "ipMode": "VIP"}]}})
}
