//! Health metrics: upstream's `kubeproxy_proxy_healthz_total{code}` and
//! `kubeproxy_proxy_livez_total{code}`, and kproxy's own per health-check port state
//! (`kproxy_health_check_node_port_*`) so operators can alert on flapping and on ports
//! that cannot be bound.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use kproxy_core::model::ServiceName;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServiceLabels {
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PortLabels {
    pub namespace: String,
    pub name: String,
    pub port: u16,
}

/// A bind failure of one health-check node port, by [`crate::decide::BindFailure`] reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BindLabels {
    pub namespace: String,
    pub name: String,
    pub port: u16,
    pub reason: &'static str,
}

impl BindLabels {
    pub fn of(s: &ServiceName, port: u16, reason: &'static str) -> Self {
        BindLabels {
            namespace: s.namespace.to_string(),
            name: s.name.to_string(),
            port,
            reason,
        }
    }
}

impl ServiceLabels {
    pub fn of(s: &ServiceName) -> Self {
        ServiceLabels {
            namespace: s.namespace.to_string(),
            name: s.name.to_string(),
        }
    }
}

impl PortLabels {
    pub fn of(s: &ServiceName, port: u16) -> Self {
        PortLabels {
            namespace: s.namespace.to_string(),
            name: s.name.to_string(),
            port,
        }
    }
}

pub fn code(status: u16) -> &'static str {
    match status {
        200 => "200",
        503 => "503",
        404 => "404",
        _ => "other",
    }
}

#[derive(Clone, Default)]
pub struct Metrics {
    pub healthz: Family<CodeLabel, Counter>,
    pub livez: Family<CodeLabel, Counter>,
    /// 1 while every address of the port is bound, 0 while some bind is being retried.
    pub port_listening: Family<PortLabels, Gauge>,
    /// 1 while the port answers 200, 0 while it answers 503.
    pub port_healthy: Family<PortLabels, Gauge>,
    /// Answer changes 200↔503 per Service.
    pub transitions: Family<ServiceLabels, Counter>,
    /// Failed binds (and selected node addresses found absent) by reason.
    pub bind_failures: Family<BindLabels, Counter>,
    /// `healthzBindAddress` bind failures.
    pub healthz_bind_failures: Counter,
}

impl Metrics {
    pub fn register(&self, registry: &mut Registry) {
        let up = registry.sub_registry_with_prefix("kubeproxy");
        up.register(
            "proxy_healthz",
            "Cumulative proxy healthz HTTP status",
            self.healthz.clone(),
        );
        up.register(
            "proxy_livez",
            "Cumulative proxy livez HTTP status",
            self.livez.clone(),
        );
        let own = registry.sub_registry_with_prefix("kproxy");
        own.register(
            "health_check_node_port_listening",
            "1 while the health-check node port is bound on every selected address, 0 while a bind is retried",
            self.port_listening.clone(),
        );
        own.register(
            "health_check_node_port_healthy",
            "1 while the health-check node port answers 200, 0 while it answers 503",
            self.port_healthy.clone(),
        );
        own.register(
            "health_check_node_port_transitions",
            "Changes of a health-check node port answer between 200 and 503",
            self.transitions.clone(),
        );
        own.register(
            "health_check_node_port_bind_failures",
            "Failed attempts to bind a health-check node port (retried with backoff), by reason: address_absent (a selected node address is not on this host), port_in_use, other",
            self.bind_failures.clone(),
        );
        own.register(
            "proxy_healthz_bind_failures",
            "Failed attempts to bind healthzBindAddress (retried with backoff)",
            self.healthz_bind_failures.clone(),
        );
    }
}
