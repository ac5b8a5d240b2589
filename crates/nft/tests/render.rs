//! Golden tests of rendered scripts (insta) for representative plans built through the
//! real manifest → plan path, and a check that every rendered script loads into a real
//! kernel (in a namespace of its own).

mod common;

use common::*;
use kproxy_core::PlanConfig;
use kproxy_core::config::{LocalDetectorConfig, NodePortAddressesConfig};
use kproxy_nft::{DataplaneConfig, render};

/// Affinity, source ranges, UDP, iTP Local, externalIPs, a Service without endpoints.
pub const MIXED: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-a}
spec: {podCIDRs: [10.244.1.0/24]}
status: {addresses: [{type: InternalIP, address: 10.200.0.1}]}
---
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: ns}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
  loadBalancerSourceRanges: [198.51.100.0/24]
  ports: [{name: dns, port: 53, protocol: UDP, nodePort: 30053}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.20}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-1, namespace: ns, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.1.2], nodeName: node-a, conditions: {ready: true}}
- {addresses: [10.244.2.2], nodeName: node-b, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: internal, namespace: ns}
spec:
  clusterIP: 10.96.0.21
  internalTrafficPolicy: Local
  externalIPs: [203.0.113.21]
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: internal-1, namespace: ns, labels: {kubernetes.io/service-name: internal}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.2.3], nodeName: node-b, conditions: {ready: true}}
- {addresses: [10.244.2.4], nodeName: node-b, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: ns}
spec:
  type: NodePort
  clusterIP: 10.96.0.22
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30022}]
"#;

fn mixed_config() -> PlanConfig {
    PlanConfig {
        local_detector: LocalDetectorConfig::InterfaceNamePrefix("kpv".into()),
        node_port_addresses: NodePortAddressesConfig::Cidrs(vec!["10.200.0.0/24".parse().unwrap()]),
        ..PlanConfig::default()
    }
}

fn example_config() -> PlanConfig {
    PlanConfig {
        local_detector: LocalDetectorConfig::ClusterCidr(vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd00:10:244::/48".parse().unwrap(),
        ]),
        ..PlanConfig::default()
    }
}

#[test]
fn golden_example_cluster() {
    let plan = plan_from_yaml(&example_cluster(), "node-a", &example_config());
    insta::assert_snapshot!(render(&plan, &DataplaneConfig::default()));
}

#[test]
fn golden_mixed() {
    let plan = plan_from_yaml(MIXED, "node-a", &mixed_config());
    insta::assert_snapshot!(render(&plan, &DataplaneConfig::default()));
}

#[test]
fn rendered_scripts_load_into_the_kernel() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let ns = Netns::new("load");
    let plans = [
        plan_from_yaml(&example_cluster(), "node-a", &example_config()),
        plan_from_yaml(&example_cluster(), "node-b", &PlanConfig::default()),
        plan_from_yaml(MIXED, "node-a", &mixed_config()),
        plan_from_yaml(
            MIXED,
            "node-b",
            &PlanConfig {
                masquerade_all: true,
                ..PlanConfig::default()
            },
        ),
    ];
    ns.run(move || {
        for plan in &plans {
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            // A replacement, not an adoption of the previous plan's tables.
            dp.force_full_sync();
            let r = dp
                .sync(plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("full sync loads");
            assert!(r.full);
            assert!(dp.verify().expect("verify").differences.is_empty());
        }
        kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup");
        kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup when absent");
    });
}

#[test]
fn hostile_names_are_rejected() {
    for bad in [
        "",
        "kproxy\"; flush ruleset",
        "1abc",
        "a b",
        &"x".repeat(40),
    ] {
        let cfg = DataplaneConfig {
            table: bad.to_string(),
            ..DataplaneConfig::default()
        };
        assert!(kproxy_nft::Dataplane::new(cfg).is_err(), "{bad:?}");
    }
    for bad in ["eth0\" accept", "veth*", "", "abcdefghijklmnop", "a\nb"] {
        assert!(kproxy_nft::validate_interface(bad).is_err(), "{bad:?}");
    }
    assert!(kproxy_nft::validate_interface("cbr0").is_ok());
}

/// A first sync into absent tables large enough to send its elements in several
/// nfnetlink transactions (≈ 15k elements, 4,096 a piece; the kernel's set hashes grow
/// between them) leaves exactly the record's tables in the kernel, woken: hooked, no
/// table flag left.
#[test]
fn a_first_sync_in_pieces_loads_the_whole_tables() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    use kproxy_core::synthetic::{Spec, cluster};
    let state = cluster(&Spec::new(1500, 10));
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let ns = Netns::new("pieces");
    ns.run(move || {
        let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
        let r = dp
            .sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
            .expect("first sync loads");
        assert!(r.full && !r.adopted, "{r:?}");
        assert!(r.changes.elements_added > 3 * 4096, "{r:?}");
        assert!(r.netlink_bytes > 0 && r.script_bytes > 0, "{r:?}");
        assert!(dp.verify().expect("verify").differences.is_empty());
        let listed = sh("nft list table ip kproxy");
        assert!(listed.contains(" hook prerouting "));
        assert!(!listed.contains("dormant"));
        kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup");
    });
}
