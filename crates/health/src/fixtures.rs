//! Small hand-built plans for tests of this crate and of its callers: a node with
//! health-checked Services whose local endpoints are given by IP. Not used by the
//! servers themselves.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use kproxy_core::NodePlan;
use kproxy_core::model::{
    Conditions, EndpointAddr, IpFamily, Placement, Protocol, ServiceName, ServicePortName,
    TrafficPolicy,
};
use kproxy_core::plan::{
    EndpointState, FamilyPlan, HealthCheck, LocalPods, NodePortAddresses, ServicePlan,
    ServicePortPlan, TopologyMode,
};

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

/// Both families match-all nodePortAddresses, node eligible.
pub fn plan(services: &[Svc]) -> Arc<NodePlan> {
    plan_with(
        services,
        true,
        [NodePortAddresses::AllLocal, NodePortAddresses::AllLocal],
        [vec![], vec![]],
    )
}

pub fn plan_with(
    services: &[Svc],
    node_eligible: bool,
    node_port_addresses: [NodePortAddresses; 2],
    node_ips: [Vec<IpAddr>; 2],
) -> Arc<NodePlan> {
    let [npa4, npa6] = node_port_addresses;
    let [ips4, ips6] = node_ips;
    let families = vec![
        FamilyPlan {
            family: IpFamily::IPv4,
            node_ips: ips4,
            node_port_addresses: npa4,
            local_pods: LocalPods::None,
            service_cidrs: Vec::new(),
        },
        FamilyPlan {
            family: IpFamily::IPv6,
            node_ips: ips6,
            node_port_addresses: npa6,
            local_pods: LocalPods::None,
            service_cidrs: Vec::new(),
        },
    ];
    let mut map = BTreeMap::new();
    for s in services {
        let name = ServiceName::new(s.namespace, s.name);
        let mut ports = Vec::new();
        for family in IpFamily::ALL {
            let endpoints: Vec<EndpointState> = s
                .local
                .iter()
                .filter(|(ip, _)| family.contains(ip))
                .map(|(ip, ready)| EndpointState {
                    addr: EndpointAddr::new(*ip, 8080),
                    is_local: true,
                    conditions: Conditions {
                        ready: *ready,
                        serving: true,
                        terminating: !*ready,
                    },
                    placement: Placement {
                        node_name: Some("node-a".into()),
                        ..Placement::default()
                    }
                    .shared(),
                })
                .collect();
            if endpoints.is_empty() && family == IpFamily::IPv6 {
                continue;
            }
            ports.push(ServicePortPlan {
                service_port: ServicePortName {
                    service: name.clone(),
                    port_name: String::new(),
                    protocol: Protocol::TCP,
                },
                family,
                protocol: Protocol::TCP,
                port: 80,
                cluster_ip: if family == IpFamily::IPv4 {
                    "10.96.0.10".parse().unwrap()
                } else {
                    "fd00::10".parse().unwrap()
                },
                node_port: Some(30080),
                external_ips: vec![],
                load_balancer_ips: vec![],
                firewall: None,
                internal_traffic_policy: TrafficPolicy::Cluster,
                external_traffic_policy: TrafficPolicy::Local,
                session_affinity_timeout: None,
                topology: TopologyMode::None,
                cluster_endpoints: None,
                local_endpoints: None,
                all_reachable_endpoints: vec![],
                has_any_endpoints: !endpoints.is_empty(),
                internal: vec![],
                external: vec![],
                endpoints,
            });
        }
        let ready = |f: IpFamily| {
            let mut ips: Vec<IpAddr> = s
                .local
                .iter()
                .filter(|(ip, r)| *r && f.contains(ip))
                .map(|(ip, _)| *ip)
                .collect();
            ips.sort();
            ips.dedup();
            ips.len() as u32
        };
        let local_endpoints = ready(IpFamily::IPv4).max(ready(IpFamily::IPv6));
        map.insert(
            name.clone(),
            Arc::new(ServicePlan {
                service: name.clone(),
                ports,
                health_check: Some(HealthCheck {
                    service: name,
                    health_check_node_port: s.port,
                    local_endpoints,
                }),
            }),
        );
    }
    Arc::new(NodePlan {
        node: "node-a".into(),
        zone: None,
        node_eligible,
        families,
        services: map,
        conflicts: Vec::new(),
    })
}
