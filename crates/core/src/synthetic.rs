//! Synthetic clusters for benchmarks and property tests: N Services × M endpoints over K
//! nodes, with a deterministic mix of policies, terminating endpoints, hints and
//! external frontends. Built straight into the validated model (no YAML), so a
//! benchmark measures the planner, not the parser.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use crate::model::{
    ClusterIps, Conditions, EndpointSlice, IpFamily, Node, Placement, Protocol, Service,
    ServiceName, ServicePort, ServiceType, SliceEndpoint, SlicePort, TrafficPolicy,
};
use crate::state::ClusterState;

/// Shape of a synthetic cluster.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub services: usize,
    pub endpoints_per_service: usize,
    pub nodes: usize,
    /// One in this many Services is a LoadBalancer with eTP Local (0 = none).
    pub etp_local_every: usize,
    /// One in this many endpoints is serving+terminating (0 = none).
    pub terminating_every: usize,
    /// One in this many Services carries zone hints (0 = none).
    pub hinted_every: usize,
}

impl Spec {
    pub fn new(services: usize, endpoints_per_service: usize) -> Spec {
        Spec {
            services,
            endpoints_per_service,
            nodes: 100,
            etp_local_every: 10,
            terminating_every: 7,
            hinted_every: 5,
        }
    }
}

pub fn node_name(i: usize) -> String {
    format!("node-{i}")
}

pub fn node(i: usize) -> Node {
    Node {
        name: node_name(i),
        zone: Some(format!("zone-{}", i % 3)),
        labels: BTreeMap::new(),
        addresses: vec![IpAddr::V4(Ipv4Addr::new(
            10,
            200,
            (i / 250) as u8,
            (i % 250 + 1) as u8,
        ))],
        pod_cidrs: Vec::new(),
        deleting: false,
        to_be_deleted_by_autoscaler: false,
        ..Node::default()
    }
}

/// The `i`-th Service (cluster IPs from 10.96.0.0/12 upward).
pub fn service(spec: &Spec, i: usize) -> Service {
    let etp_local = spec.etp_local_every != 0 && i.is_multiple_of(spec.etp_local_every);
    let n = i as u32 + 1;
    let cluster_ips = ClusterIps::from_iter([(
        IpFamily::IPv4,
        IpAddr::V4(Ipv4Addr::from(0x0a60_0000u32 + n)),
    )]);
    Service {
        name: ServiceName::new(format!("ns-{}", i % 50), format!("svc-{i}")),
        service_type: if etp_local {
            ServiceType::LoadBalancer
        } else {
            ServiceType::ClusterIP
        },
        cluster_ips,
        ports: vec![ServicePort {
            name: "http".into(),
            protocol: Protocol::TCP,
            port: 80,
            // Unique frontends: a shared one would be a conflict (`crate::conflicts`).
            node_port: etp_local.then_some(30000 + (i % 35_000) as u16),
        }],
        external_ips: Vec::new(),
        load_balancer_ips: if etp_local {
            vec![IpAddr::V4(Ipv4Addr::from(0xc612_0000u32 + n))]
        } else {
            Vec::new()
        },
        load_balancer_source_ranges: Vec::new(),
        external_traffic_policy: if etp_local {
            TrafficPolicy::Local
        } else {
            TrafficPolicy::Cluster
        },
        internal_traffic_policy: TrafficPolicy::Cluster,
        health_check_node_port: etp_local.then_some(32000 + (i % 700) as u16),
        session_affinity_timeout: None,
        traffic_distribution: None,
        created: None,
    }
}

/// The slice of the `i`-th Service; `generation` varies the endpoints' conditions so a
/// benchmark can apply a real change.
pub fn slice(spec: &Spec, i: usize, generation: usize) -> EndpointSlice {
    let hinted = spec.hinted_every != 0 && i.is_multiple_of(spec.hinted_every);
    let endpoints = (0..spec.endpoints_per_service)
        .map(|j| {
            let k = i * spec.endpoints_per_service + j;
            let terminating = spec.terminating_every != 0
                && (k + generation).is_multiple_of(spec.terminating_every);
            let node = k % spec.nodes.max(1);
            SliceEndpoint {
                ip: IpAddr::V4(Ipv4Addr::from(0x0af4_0000u32 + k as u32)),
                conditions: Conditions {
                    ready: !terminating,
                    serving: true,
                    terminating,
                },
                placement: Placement {
                    node_name: Some(node_name(node).into()),
                    zone: Some(format!("zone-{}", node % 3).into()),
                    zone_hints: hinted.then(|| vec![format!("zone-{}", node % 3)].into()),
                    node_hints: None,
                }
                .shared(),
            }
        })
        .collect();
    EndpointSlice {
        name: format!("svc-{i}-abcde"),
        service: ServiceName::new(format!("ns-{}", i % 50), format!("svc-{i}")),
        family: IpFamily::IPv4,
        ports: vec![SlicePort {
            name: "http".into(),
            protocol: Protocol::TCP,
            port: 8080,
        }],
        endpoints,
        last_change_trigger_time: None,
    }
}

/// A whole cluster, seen from `node-0`.
pub fn cluster(spec: &Spec) -> ClusterState {
    let mut state = ClusterState::new();
    state.set_node(Some(node(0)));
    for i in 0..spec.services {
        state.upsert_service(service(spec, i));
        state.upsert_slice(slice(spec, i, 0));
    }
    state
}
