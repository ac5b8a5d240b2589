//! Small plans for tests of this crate and of its callers: a node with health-checked
//! Services whose local endpoints are given by IP. Built by the real planner from a
//! cluster state, so a fixture cannot describe a plan the planner would never produce.
//! Behind the `test-util` feature (and this crate's own tests); not used by the servers.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use kproxy_core::config::NodePortAddressesConfig;
use kproxy_core::model::{
    ClusterIps, Conditions, EndpointSlice, IpFamily, Node, Placement, Protocol, Service,
    ServiceName, ServicePort, ServiceType, SliceEndpoint, SlicePort, TrafficPolicy,
};
use kproxy_core::{ClusterState, NodePlan, PlanConfig};

/// The node every fixture plans for.
pub const NODE: &str = "node-a";
/// One eTP-Local LoadBalancer Service: `ns/name`, its healthCheckNodePort, and the IPs
/// of its local endpoints with whether each is ready (terminating when not ready).
#[derive(Clone, Debug)]
pub struct Svc {
    pub namespace: &'static str,
    pub name: &'static str,
    pub port: u16,
    pub local: Vec<(IpAddr, bool)>,
}

pub fn svc(namespace: &'static str, name: &'static str, port: u16, ready_ips: &[&str]) -> Svc {
    Svc {
        namespace,
        name,
        port,
        local: ready_ips
            .iter()
            .map(|s| (s.parse().expect("fixture IP"), true))
            .collect(),
    }
}

impl Svc {
    /// Adds a local endpoint that is serving but terminating (not ready).
    pub fn terminating(mut self, ip: &str) -> Svc {
        self.local.push((ip.parse().expect("fixture IP"), false));
        self
    }
}

/// A node with no known address (both families match-all), eligible.
pub fn plan(services: &[Svc]) -> Arc<NodePlan> {
    plan_with(services, true, NodePortAddressesConfig::Primary, &[])
}

/// The plan of node [`NODE`] whose Node object has `node_ips` (the first of each family
/// is its primary address) and is being deleted unless `node_eligible`.
pub fn plan_with(
    services: &[Svc],
    node_eligible: bool,
    node_port_addresses: NodePortAddressesConfig,
    node_ips: &[IpAddr],
) -> Arc<NodePlan> {
    let mut state = ClusterState::new();
    state.set_node(Some(Node {
        name: NODE.into(),
        zone: None,
        labels: BTreeMap::new(),
        addresses: node_ips.to_vec(),
        pod_cidrs: Vec::new(),
        deleting: !node_eligible,
        to_be_deleted_by_autoscaler: false,
        ..Node::default()
    }));
    for (i, s) in services.iter().enumerate() {
        let name = ServiceName::new(s.namespace, s.name);
        let i = u16::try_from(i).expect("fixture Service count");
        let families: Vec<IpFamily> = IpFamily::ALL
            .into_iter()
            .filter(|f| f == &IpFamily::IPv4 || s.local.iter().any(|(ip, _)| f.contains(ip)))
            .collect();
        state.upsert_service(Service {
            name: name.clone(),
            service_type: ServiceType::LoadBalancer,
            cluster_ips: ClusterIps::from_iter(families.iter().map(|f| {
                let ip = match f {
                    IpFamily::IPv4 => IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10 + i as u8)),
                    IpFamily::IPv6 => IpAddr::V6(Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10 + i)),
                };
                (*f, ip)
            })),
            ports: vec![ServicePort {
                name: String::new(),
                protocol: Protocol::TCP,
                port: 80,
                node_port: Some(30080 + i),
            }],
            external_ips: Vec::new(),
            load_balancer_ips: Vec::new(),
            load_balancer_source_ranges: Vec::new(),
            external_traffic_policy: TrafficPolicy::Local,
            internal_traffic_policy: TrafficPolicy::Cluster,
            health_check_node_port: Some(s.port),
            session_affinity_timeout: None,
            traffic_distribution: None,
            created: None,
        });
        for family in families {
            state.upsert_slice(EndpointSlice {
                name: format!("{}-{}", s.name, family.as_str().to_lowercase()),
                service: name.clone(),
                family,
                ports: vec![SlicePort {
                    name: String::new(),
                    protocol: Protocol::TCP,
                    port: 8080,
                }],
                endpoints: s
                    .local
                    .iter()
                    .filter(|(ip, _)| family.contains(ip))
                    .map(|(ip, ready)| SliceEndpoint {
                        ip: *ip,
                        conditions: Conditions {
                            ready: *ready,
                            serving: true,
                            terminating: !*ready,
                        },
                        placement: Placement {
                            node_name: Some(NODE.into()),
                            ..Placement::default()
                        }
                        .shared(),
                    })
                    .collect(),
                last_change_trigger_time: None,
            });
        }
    }
    let config = PlanConfig {
        node_port_addresses,
        ..PlanConfig::default()
    };
    let plan = kproxy_core::plan(&state, NODE, &config);
    assert!(
        plan.conflicts.is_empty(),
        "fixture conflicts: {:?}",
        plan.conflicts
    );
    Arc::new(plan)
}
