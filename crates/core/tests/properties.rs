//! Planner invariants under random clusters (proptest): determinism under input
//! order, incremental = from scratch, no terminating endpoint while a ready one
//! qualifies, chosen endpoints belong to the Service, Local lists hold only this
//! node's endpoints.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};

use kproxy_core::model::{
    ClusterIps, Conditions, EndpointSlice, IpFamily, Placement, Protocol, Service, ServiceName,
    ServicePort, ServiceType, SliceEndpoint, SlicePort, TrafficPolicy,
};
use kproxy_core::synthetic;
use kproxy_core::{ClusterState, PlanConfig, Planner};
use proptest::prelude::*;

#[derive(Clone, Debug)]
struct Ep {
    ip: u8,
    node: u8,
    ready: bool,
    serving: bool,
    terminating: bool,
    zone_hint: Option<u8>,
}

#[derive(Clone, Debug)]
struct Svc {
    itp_local: bool,
    etp_local: bool,
    lb: bool,
    slices: Vec<Vec<Ep>>,
}

fn ep() -> impl Strategy<Value = Ep> {
    (
        0u8..12,
        0u8..3,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::option::of(0u8..3),
    )
        .prop_map(|(ip, node, ready, serving, terminating, zone_hint)| Ep {
            ip,
            node,
            ready,
            serving,
            terminating,
            zone_hint,
        })
}

fn svc() -> impl Strategy<Value = Svc> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        proptest::collection::vec(proptest::collection::vec(ep(), 0..5), 0..3),
    )
        .prop_map(|(itp_local, etp_local, lb, slices)| Svc {
            itp_local,
            etp_local,
            lb,
            slices,
        })
}

fn build(svcs: &[Svc]) -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut services = Vec::new();
    let mut slices = Vec::new();
    for (i, s) in svcs.iter().enumerate() {
        let name = ServiceName::new("ns", format!("s{i}"));
        let cluster_ips = ClusterIps::from_iter([(
            IpFamily::IPv4,
            IpAddr::V4(Ipv4Addr::new(10, 96, 0, i as u8 + 1)),
        )]);
        services.push(Service {
            name: name.clone(),
            service_type: if s.lb {
                ServiceType::LoadBalancer
            } else {
                ServiceType::ClusterIP
            },
            cluster_ips,
            ports: vec![ServicePort {
                name: "p".into(),
                protocol: Protocol::TCP,
                port: 80,
                node_port: s.lb.then_some(30000 + i as u16),
            }],
            external_ips: vec![],
            load_balancer_ips: if s.lb {
                vec![IpAddr::V4(Ipv4Addr::new(203, 0, 113, i as u8 + 1))]
            } else {
                vec![]
            },
            load_balancer_source_ranges: vec![],
            external_traffic_policy: if s.etp_local {
                TrafficPolicy::Local
            } else {
                TrafficPolicy::Cluster
            },
            internal_traffic_policy: if s.itp_local {
                TrafficPolicy::Local
            } else {
                TrafficPolicy::Cluster
            },
            health_check_node_port: s.lb.then_some(32000 + i as u16),
            session_affinity_timeout: None,
            traffic_distribution: None,
            created: None,
        });
        for (j, eps) in s.slices.iter().enumerate() {
            slices.push(EndpointSlice {
                name: format!("s{i}-{j}"),
                service: name.clone(),
                family: IpFamily::IPv4,
                ports: vec![SlicePort {
                    name: "p".into(),
                    protocol: Protocol::TCP,
                    port: 8080,
                }],
                endpoints: eps
                    .iter()
                    .map(|e| SliceEndpoint {
                        ip: IpAddr::V4(Ipv4Addr::new(10, 244, e.node, e.ip)),
                        conditions: Conditions {
                            ready: e.ready,
                            serving: e.serving,
                            terminating: e.terminating,
                        },
                        placement: Placement {
                            node_name: Some(synthetic::node_name(e.node as usize).into()),
                            zone: None,
                            zone_hints: e.zone_hint.map(|z| vec![format!("zone-{z}")].into()),
                            node_hints: None,
                        }
                        .shared(),
                    })
                    .collect(),
                last_change_trigger_time: None,
            });
        }
    }
    (services, slices)
}

fn state_of(services: &[Service], slices: &[EndpointSlice]) -> ClusterState {
    let mut st = ClusterState::new();
    st.set_node(Some(synthetic::node(0)));
    for s in services {
        st.upsert_service(s.clone());
    }
    for s in slices {
        st.upsert_slice(s.clone());
    }
    st
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn plan_is_independent_of_input_order(svcs in proptest::collection::vec(svc(), 1..5), seed in any::<u64>()) {
        let (services, slices) = build(&svcs);
        let a = kproxy_core::plan(&state_of(&services, &slices), "node-0", &PlanConfig::default());
        let mut rs = services.clone();
        let mut rl = slices.clone();
        // A cheap deterministic shuffle.
        let n = rl.len().max(1);
        rl.rotate_left(seed as usize % n);
        rl.reverse();
        rs.reverse();
        let b = kproxy_core::plan(&state_of(&rs, &rl), "node-0", &PlanConfig::default());
        prop_assert_eq!(serde_json::to_string(&a).unwrap(), serde_json::to_string(&b).unwrap());
    }

    #[test]
    fn endpoint_choice_invariants(svcs in proptest::collection::vec(svc(), 1..5)) {
        let (services, slices) = build(&svcs);
        let plan = kproxy_core::plan(&state_of(&services, &slices), "node-0", &PlanConfig::default());
        for p in plan.service_ports() {
            let own: BTreeSet<_> = slices.iter().filter(|s| s.service == p.service_port.service)
                .flat_map(|s| s.endpoints.iter().map(|e| e.ip)).collect();
            for e in &p.all_reachable_endpoints {
                prop_assert!(own.contains(&e.ip), "{} chose {} which is not its endpoint", p.service_port, e);
            }
            let state = |a| p.endpoints.iter().find(|e| e.addr == a).unwrap();
            if let Some(local) = &p.local_endpoints {
                for a in local {
                    prop_assert!(state(*a).is_local, "{} local list has remote {}", p.service_port, a);
                }
                let any_local_ready = p.endpoints.iter().any(|e| e.is_local && e.conditions.ready);
                if any_local_ready {
                    prop_assert!(local.iter().all(|a| state(*a).conditions.ready));
                }
            }
            if let Some(cluster) = &p.cluster_endpoints {
                let any_ready = p.endpoints.iter().any(|e| e.conditions.ready);
                if any_ready {
                    prop_assert!(!cluster.is_empty());
                    prop_assert!(cluster.iter().all(|a| state(*a).conditions.ready),
                        "{}: a terminating endpoint chosen while a ready one qualifies", p.service_port);
                }
            }
        }
    }

    #[test]
    fn incremental_planning_equals_planning_from_scratch(
        before in proptest::collection::vec(svc(), 1..4),
        after in proptest::collection::vec(svc(), 1..4),
    ) {
        let (s1, l1) = build(&before);
        let (s2, l2) = build(&after);
        let mut st = state_of(&s1, &l1);
        let mut planner = Planner::new("node-0", PlanConfig::default());
        planner.update(&mut st);
        // Move the live state to `after` through single changes.
        for s in &s1 { if !s2.iter().any(|x| x.name == s.name) { st.delete_service(&s.name); } }
        for l in &l1 { if !l2.iter().any(|x| x.name == l.name) { st.delete_slice(&l.service.namespace, &l.name); } }
        for s in &s2 { st.upsert_service(s.clone()); }
        for l in &l2 { st.upsert_slice(l.clone()); }
        planner.update(&mut st);
        let fresh = kproxy_core::plan(&state_of(&s2, &l2), "node-0", &PlanConfig::default());
        prop_assert_eq!(planner.plan(), &fresh);
    }
}
