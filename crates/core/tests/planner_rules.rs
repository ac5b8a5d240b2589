//! Service-level rules of docs/upstream-semantics.md §a and §c that the shared
//! conformance tables do not cover, one named test per rule, written as Kubernetes YAML through
//! the real manifest → ingest → plan path.

mod common;

use kproxy_core::config::{LocalDetectorConfig, NodePortAddressesConfig};
use kproxy_core::plan::{EndpointSet, NodePlan, ServicePortPlan, SourceClass, Verdict};
use kproxy_core::trace::{Packet, TraceVerdict, trace};
use kproxy_core::{ClusterState, PlanConfig};

const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a, labels: {topology.kubernetes.io/zone: z1}}\nspec: {podCIDRs: [10.244.1.0/24]}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.11}, {type: InternalIP, address: 10.200.1.11}]}\n";

fn slice(svc: &str, eps: &[(&str, &str, bool, bool, bool)]) -> String {
    let mut s = format!(
        "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: {svc}-x, namespace: ns, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: IPv4\nports: [{{name: p, port: 8080, protocol: TCP}}]\nendpoints:\n"
    );
    for (ip, node, ready, serving, terminating) in eps {
        s += &format!(
            "- {{addresses: [{ip}], nodeName: {node}, conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}}}\n"
        );
    }
    s
}

fn plan_with(docs: &[String], cfg: &PlanConfig) -> NodePlan {
    kproxy_core::plan(&state_of(docs), "node-a", cfg)
}

fn plan(docs: &[String]) -> NodePlan {
    plan_with(docs, &PlanConfig::default())
}

fn port<'a>(p: &'a NodePlan, svc: &str) -> &'a ServicePortPlan {
    p.service_ports()
        .find(|sp| &*sp.service_port.service.name == svc)
        .unwrap_or_else(|| panic!("no port for {svc}"))
}

fn svc(name: &str, extra_spec: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns}}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{{name: p, port: 80, protocol: TCP{}}}]\n{extra_spec}",
        if extra_spec.contains("NodePort") || extra_spec.contains("LoadBalancer") {
            ", nodePort: 30080"
        } else {
            ""
        }
    )
}

fn pkt(src: &str, dst: &str, dport: u16) -> Packet {
    Packet {
        src: src.parse().unwrap(),
        dst: dst.parse().unwrap(),
        dport,
        proto: kproxy_core::model::Protocol::TCP,
        in_interface: None,
    }
}

#[test]
fn external_name_and_headless_services_are_not_proxied() {
    let p = plan(&[
        "apiVersion: v1\nkind: Service\nmetadata: {name: en, namespace: ns}\nspec: {type: ExternalName, externalName: x.example, clusterIP: 10.96.0.9}\n".into(),
        "apiVersion: v1\nkind: Service\nmetadata: {name: hl, namespace: ns}\nspec: {clusterIP: None, ports: [{port: 80}]}\n".into(),
        "apiVersion: v1\nkind: Service\nmetadata: {name: other, namespace: ns, labels: {service.kubernetes.io/service-proxy-name: cilium}}\nspec: {clusterIP: 10.96.0.8, ports: [{port: 80}]}\n".into(),
    ]);
    assert!(
        p.services.is_empty(),
        "{:?}",
        p.services.keys().collect::<Vec<_>>()
    );
}

#[test]
fn etp_local_on_a_cluster_ip_service_without_external_ips_is_ignored() {
    let p = plan(&[
        svc("s", "  externalTrafficPolicy: Local\n"),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ]);
    let sp = port(&p, "s");
    assert_eq!(
        sp.external_traffic_policy,
        kproxy_core::model::TrafficPolicy::Cluster
    );
    assert!(sp.local_endpoints.is_none());
    assert!(sp.external.is_empty());
}

#[test]
fn etp_local_applies_to_cluster_ip_service_with_external_ips() {
    let p = plan(&[
        svc(
            "s",
            "  externalIPs: [192.0.2.7]\n  externalTrafficPolicy: Local\n",
        ),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ]);
    let sp = port(&p, "s");
    assert_eq!(sp.local_endpoints.as_deref(), Some(&[][..]));
    let t = trace(&p, &pkt("198.51.100.9", "192.0.2.7", 80), &[]);
    assert_eq!(t.verdict, TraceVerdict::Drop, "{}", t.reason);
}

#[test]
fn lb_without_node_port_and_without_ip_is_not_externally_accessible() {
    let p = plan(&[
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: ns}\nspec: {type: LoadBalancer, clusterIP: 10.96.0.10, allocateLoadBalancerNodePorts: false, externalTrafficPolicy: Local, healthCheckNodePort: 32000, ports: [{name: p, port: 80}]}\n".into(),
        slice("s", &[("10.244.1.5", "node-a", true, true, false), ("10.244.2.5", "node-b", true, true, false)]),
    ]);
    let sp = port(&p, "s");
    assert!(sp.local_endpoints.is_none());
    assert_eq!(sp.cluster_endpoints.as_ref().map(Vec::len), Some(2));
    // Still a health check: the Service is an eTP-Local LoadBalancer with a port.
    assert_eq!(p.health_checks().next().map(|h| h.local_endpoints), Some(1));
}

#[test]
fn health_check_node_port_is_ignored_for_etp_cluster() {
    let p = plan(&[svc(
        "s",
        "  type: LoadBalancer\n  externalTrafficPolicy: Cluster\n  healthCheckNodePort: 32000\n",
    )]);
    assert_eq!(p.health_checks().count(), 0);
}

#[test]
fn health_check_counts_distinct_local_ready_ips_not_terminating_ones() {
    let p = plan(&[
        svc(
            "s",
            "  type: LoadBalancer\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n",
        ),
        slice(
            "s",
            &[
                ("10.244.1.5", "node-a", true, true, false),
                ("10.244.1.6", "node-a", false, true, true),
                ("10.244.2.5", "node-b", true, true, false),
            ],
        ),
    ]);
    assert_eq!(p.health_checks().next().map(|h| h.local_endpoints), Some(1));
}

#[test]
fn proxy_mode_lb_ingress_is_not_captured_and_vip_mode_is() {
    let p = plan(&[format!(
        "{}status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.1, ipMode: Proxy}}, {{ip: 203.0.113.2, ipMode: VIP}}, {{ip: 203.0.113.3}}, {{hostname: lb.example}}]}}}}\n",
        svc("s", "  type: LoadBalancer\n")
    )]);
    let ips: Vec<String> = port(&p, "s")
        .load_balancer_ips
        .iter()
        .map(|i| i.to_string())
        .collect();
    assert_eq!(ips, ["203.0.113.2", "203.0.113.3"]);
}

#[test]
fn source_ranges_are_trimmed_filtered_per_family_and_apply_to_lb_ips_only() {
    let p = plan(&[
        format!(
            "{}status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.2}}]}}}}\n",
            svc(
                "s",
                "  type: LoadBalancer\n  loadBalancerSourceRanges: [' 198.51.100.0/24 ', 'fd00::/64']\n"
            )
        ),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ]);
    let sp = port(&p, "s");
    let fw = sp.firewall.as_ref().expect("firewall");
    assert_eq!(
        fw.allowed_sources
            .iter()
            .map(|n| n.to_string())
            .collect::<Vec<_>>(),
        ["198.51.100.0/24"]
    );
    assert_eq!(
        trace(&p, &pkt("192.0.2.1", "203.0.113.2", 80), &[]).verdict,
        TraceVerdict::Drop
    );
    assert_eq!(
        trace(&p, &pkt("198.51.100.7", "203.0.113.2", 80), &[]).verdict,
        TraceVerdict::Dnat
    );
    // NodePorts bypass loadBalancerSourceRanges.
    assert_eq!(
        trace(&p, &pkt("192.0.2.1", "10.200.0.11", 30080), &[]).verdict,
        TraceVerdict::Dnat
    );
}

#[test]
fn node_ip_inside_a_source_range_also_allows_the_vips_as_sources() {
    let p = plan(&[format!(
        "{}status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.2}}]}}}}\n",
        svc(
            "s",
            "  type: LoadBalancer\n  loadBalancerSourceRanges: [10.200.0.0/24]\n"
        )
    )]);
    let fw = port(&p, "s").firewall.clone().expect("firewall");
    assert!(
        fw.allowed_sources
            .iter()
            .any(|n| n.to_string() == "203.0.113.2/32")
    );
}

#[test]
fn leading_zero_ipv4_addresses_are_read_as_decimal() {
    let p = plan(&[
        "apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: ns}\nspec: {clusterIP: 10.096.000.010, ports: [{name: p, port: 80}]}\n".into(),
        slice("s", &[("10.244.002.005", "node-b", true, true, false)]),
    ]);
    let sp = port(&p, "s");
    assert_eq!(sp.cluster_ip.to_string(), "10.96.0.10");
    assert_eq!(
        sp.cluster_endpoints.as_ref().unwrap()[0].to_string(),
        "10.244.2.5:8080"
    );
}

#[test]
fn a_service_port_with_node_port_zero_has_no_node_port_rules() {
    let p = plan(&["apiVersion: v1\nkind: Service\nmetadata: {name: s, namespace: ns}\nspec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{name: p, port: 80, nodePort: 0}]}\n".into()]);
    assert_eq!(port(&p, "s").node_port, None);
}

#[test]
fn no_endpoints_anywhere_rejects_every_frontend() {
    let p = plan(&[svc(
        "s",
        "  type: NodePort\n  externalTrafficPolicy: Local\n",
    )]);
    let sp = port(&p, "s");
    assert_eq!(sp.internal[0].verdict, Verdict::Reject);
    assert_eq!(sp.external[0].verdict, Verdict::Reject);
    assert_eq!(
        trace(&p, &pkt("198.51.100.1", "10.200.0.11", 30080), &[]).verdict,
        TraceVerdict::Reject
    );
}

#[test]
fn etp_cluster_external_traffic_is_always_masqueraded() {
    let p = plan(&[
        svc("s", "  type: NodePort\n"),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ]);
    let sp = port(&p, "s");
    assert_eq!(
        sp.external,
        vec![kproxy_core::plan::TrafficRule {
            from: SourceClass::Any,
            verdict: Verdict::Forward {
                endpoints: EndpointSet::Cluster,
                masquerade: true
            },
        }]
    );
}

#[test]
fn etp_local_short_circuits_local_pods_and_the_node_to_cluster_endpoints() {
    let cfg = PlanConfig {
        local_detector: LocalDetectorConfig::NodeCidr,
        ..PlanConfig::default()
    };
    let p = plan_with(
        &[
            svc("s", "  type: NodePort\n  externalTrafficPolicy: Local\n"),
            slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
        ],
        &cfg,
    );
    // A pod on this node reaches the NodePort although this node has no endpoint,
    // without masquerade; the node itself is masqueraded; outsiders are dropped.
    let from_pod = trace(&p, &pkt("10.244.1.9", "10.200.0.11", 30080), &[]);
    assert_eq!(
        (from_pod.verdict, from_pod.masquerade),
        (TraceVerdict::Dnat, false),
        "{}",
        from_pod.reason
    );
    let from_node = trace(&p, &pkt("10.200.0.11", "10.200.0.11", 30080), &[]);
    assert_eq!(
        (from_node.verdict, from_node.masquerade),
        (TraceVerdict::Dnat, true)
    );
    assert_eq!(
        trace(&p, &pkt("198.51.100.1", "10.200.0.11", 30080), &[]).verdict,
        TraceVerdict::Drop
    );
}

#[test]
fn without_a_local_detector_cluster_ip_traffic_is_not_masqueraded_and_with_one_outsiders_are() {
    let docs = [
        svc("s", ""),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ];
    let none = plan(&docs);
    assert!(!trace(&none, &pkt("10.200.0.99", "10.96.0.10", 80), &[]).masquerade);
    let cidr = plan_with(
        &docs,
        &PlanConfig {
            local_detector: LocalDetectorConfig::ClusterCidr(vec![
                "10.244.0.0/16".parse().unwrap(),
            ]),
            ..PlanConfig::default()
        },
    );
    assert!(trace(&cidr, &pkt("10.200.0.99", "10.96.0.10", 80), &[]).masquerade);
    assert!(!trace(&cidr, &pkt("10.244.3.3", "10.96.0.10", 80), &[]).masquerade);
    let all = plan_with(
        &docs,
        &PlanConfig {
            masquerade_all: true,
            ..PlanConfig::default()
        },
    );
    assert!(trace(&all, &pkt("10.244.3.3", "10.96.0.10", 80), &[]).masquerade);
}

#[test]
fn node_ports_are_served_only_on_node_port_addresses() {
    let docs = [
        svc("s", "  type: NodePort\n"),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ];
    // Default (primary): the secondary node IP is not touched.
    let p = plan(&docs);
    assert_eq!(
        trace(&p, &pkt("198.51.100.1", "10.200.0.11", 30080), &[]).verdict,
        TraceVerdict::Dnat
    );
    assert_eq!(
        trace(&p, &pkt("198.51.100.1", "10.200.1.11", 30080), &[]).verdict,
        TraceVerdict::None
    );
    let cidrs = PlanConfig {
        node_port_addresses: NodePortAddressesConfig::Cidrs(vec!["10.200.1.0/24".parse().unwrap()]),
        ..PlanConfig::default()
    };
    let p = plan_with(&docs, &cidrs);
    assert_eq!(
        trace(&p, &pkt("198.51.100.1", "10.200.0.11", 30080), &[]).verdict,
        TraceVerdict::None
    );
    assert_eq!(
        trace(&p, &pkt("198.51.100.1", "10.200.1.11", 30080), &[]).verdict,
        TraceVerdict::Dnat
    );
}

/// A nodePortAddresses CIDR selects every local address inside it,
/// including secondary addresses the Node object does not list (what the kernel's
/// `fib daddr type local` sees), never loopback; a list without a CIDR of a family
/// selects every local address of that family (upstream `NewNodePortAddresses`).
#[test]
fn node_port_cidrs_select_every_local_address_inside_them() {
    use kproxy_core::model::IpFamily;
    use kproxy_core::plan::NodePortAddresses;
    let docs = [
        svc("s", "  type: NodePort\n"),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ];
    let cidrs = PlanConfig {
        node_port_addresses: NodePortAddressesConfig::Cidrs(vec![
            "198.51.100.0/24".parse().unwrap(),
            "10.200.0.0/24".parse().unwrap(),
            "127.0.0.0/8".parse().unwrap(),
        ]),
        ..PlanConfig::default()
    };
    let p = plan_with(&docs, &cidrs);
    // The host's addresses: 198.51.100.7 is not in the Node object.
    let locals: Vec<std::net::IpAddr> = ["10.200.0.11", "10.200.1.11", "198.51.100.7", "127.0.0.1"]
        .iter()
        .map(|a| a.parse().unwrap())
        .collect();
    for (dst, want) in [
        ("198.51.100.7", TraceVerdict::Dnat), // secondary, inside a CIDR
        ("10.200.0.11", TraceVerdict::Dnat),  // primary, inside a CIDR
        ("10.200.1.11", TraceVerdict::None),  // local, outside every CIDR
        ("198.51.100.8", TraceVerdict::None), // inside a CIDR, not local
        ("127.0.0.1", TraceVerdict::None),    // loopback never takes NodePorts
    ] {
        assert_eq!(
            trace(&p, &pkt("192.0.2.1", dst, 30080), &locals).verdict,
            want,
            "{dst}"
        );
    }
    // The plan does not depend on which addresses the planner was told about.
    let told = plan_with(
        &docs,
        &PlanConfig {
            node_ips: locals.clone(),
            ..cidrs.clone()
        },
    );
    assert_eq!(
        told.family(IpFamily::IPv4).node_port_addresses,
        p.family(IpFamily::IPv4).node_port_addresses
    );
    assert_eq!(
        p.family(IpFamily::IPv6).node_port_addresses,
        NodePortAddresses::AllLocal
    );
}

/// With masqueradeAll, a local pod's connection to an eTP:Local
/// NodePort takes the short-circuit to the Cluster endpoints unmasqueraded (upstream's
/// masqueradeAll rule matches the cluster IP only); the cluster IP itself and this
/// node's own connections are still masqueraded.
#[test]
fn masquerade_all_leaves_the_local_pod_short_circuit_unmasqueraded() {
    let docs = [
        svc("s", "  type: NodePort\n  externalTrafficPolicy: Local\n"),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ];
    let p = plan_with(
        &docs,
        &PlanConfig {
            masquerade_all: true,
            local_detector: LocalDetectorConfig::ClusterCidr(vec![
                "10.244.0.0/16".parse().unwrap(),
            ]),
            ..PlanConfig::default()
        },
    );
    // (source, destination, port) → (verdict, masquerade)
    for (src, dst, dport, want) in [
        (
            "10.244.1.3",
            "10.200.0.11",
            30080,
            (TraceVerdict::Dnat, false),
        ),
        ("10.244.1.3", "10.96.0.10", 80, (TraceVerdict::Dnat, true)),
        (
            "10.200.0.11",
            "10.200.0.11",
            30080,
            (TraceVerdict::Dnat, true),
        ),
        (
            "198.51.100.1",
            "10.200.0.11",
            30080,
            (TraceVerdict::Drop, false),
        ),
    ] {
        let t = trace(&p, &pkt(src, dst, dport), &[]);
        assert_eq!((t.verdict, t.masquerade), want, "{src} -> {dst}:{dport}");
    }
}

#[test]
fn a_cluster_ip_on_an_undefined_port_is_rejected() {
    let p = plan(&[
        svc("s", ""),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ]);
    assert_eq!(
        trace(&p, &pkt("10.244.1.3", "10.96.0.10", 81), &[]).verdict,
        TraceVerdict::Reject
    );
    assert_eq!(
        trace(&p, &pkt("10.244.1.3", "10.96.0.11", 80), &[]).verdict,
        TraceVerdict::None
    );
}

/// With the service CIDRs known, a new connection to an address
/// inside them that no Service owns is dropped; a live cluster IP on an undefined port
/// is still rejected; addresses outside the CIDRs are untouched.
#[test]
fn an_unallocated_address_inside_the_service_cidrs_is_dropped() {
    let docs = [
        svc("s", ""),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ];
    let p = plan_with(
        &docs,
        &PlanConfig {
            service_cidrs: vec![
                "10.96.0.0/16".parse().unwrap(),
                "fd00:96::/112".parse().unwrap(),
            ],
            ..PlanConfig::default()
        },
    );
    for (dst, port, want) in [
        ("10.96.0.11", 80, TraceVerdict::Drop),
        ("10.96.0.10", 81, TraceVerdict::Reject),
        ("10.96.0.10", 80, TraceVerdict::Dnat),
        ("10.97.0.1", 80, TraceVerdict::None),
    ] {
        assert_eq!(
            trace(&p, &pkt("10.244.1.3", dst, port), &[]).verdict,
            want,
            "{dst}:{port}"
        );
    }
    // Without the CIDRs nothing is dropped.
    assert_eq!(
        trace(&plan(&docs), &pkt("10.244.1.3", "10.96.0.11", 80), &[]).verdict,
        TraceVerdict::None
    );
}

#[test]
fn pre_1_26_behaviour_has_no_terminating_failover() {
    let docs = [
        svc("s", "  type: NodePort\n  externalTrafficPolicy: Local\n"),
        slice(
            "s",
            &[
                ("10.244.1.5", "node-a", false, true, true),
                ("10.244.2.5", "node-b", true, true, false),
            ],
        ),
    ];
    let now = plan(&docs);
    assert_eq!(
        trace(&now, &pkt("198.51.100.1", "10.200.0.11", 30080), &[]).verdict,
        TraceVerdict::Dnat
    );
    let old = plan_with(
        &docs,
        &PlanConfig {
            proxy_terminating_endpoints: false,
            ..PlanConfig::default()
        },
    );
    assert_eq!(
        trace(&old, &pkt("198.51.100.1", "10.200.0.11", 30080), &[]).verdict,
        TraceVerdict::Drop
    );
}

#[test]
fn session_affinity_timeout_defaults_to_three_hours() {
    let p = plan(&[svc("s", "  sessionAffinity: ClientIP\n")]);
    assert_eq!(port(&p, "s").session_affinity_timeout, Some(10800));
}

#[test]
fn duplicate_endpoint_across_slices_prefers_the_non_terminating_copy() {
    let a = slice("s", &[("10.244.1.5", "node-a", false, true, true)]);
    let b = slice("s", &[("10.244.1.5", "node-a", true, true, false)])
        .replace("name: s-x", "name: s-y");
    let p = plan(&[svc("s", ""), a, b]);
    let sp = port(&p, "s");
    assert_eq!(sp.endpoints.len(), 1);
    assert!(sp.endpoints[0].conditions.ready);
}

/// The state of [`NODE`] and `docs`.
fn state_of(docs: &[String]) -> ClusterState {
    let mut text = NODE.to_string();
    for d in docs {
        text += "---\n";
        text += d;
    }
    common::state_of_yaml(&text)
}

#[test]
fn service_cidr_objects_and_the_setting_are_unioned_and_replanned_incrementally() {
    use kproxy_core::model::ServiceCidr;
    let docs = [
        svc("s", ""),
        slice("s", &[("10.244.2.5", "node-b", true, true, false)]),
    ];
    let mut st = state_of(&docs);
    let cfg = PlanConfig {
        service_cidrs: vec!["10.97.0.0/16".parse().unwrap()],
        ..PlanConfig::default()
    };
    let mut planner = kproxy_core::Planner::new("node-a", cfg.clone());
    planner.update(&mut st);
    let verdict = |p: &NodePlan, dst: &str| trace(p, &pkt("10.244.1.3", dst, 80), &[]).verdict;
    // Only the setting so far.
    assert_eq!(verdict(planner.plan(), "10.97.0.1"), TraceVerdict::Drop);
    assert_eq!(verdict(planner.plan(), "10.96.0.11"), TraceVerdict::None);

    assert!(st.upsert_service_cidr(ServiceCidr {
        name: "kubernetes".into(),
        cidrs: vec![
            "10.96.0.1/16".parse().unwrap(),
            "fd00:96::/112".parse().unwrap()
        ],
    }));
    let up = planner.update(&mut st);
    assert!(up.node, "a ServiceCIDR change re-plans the families");
    assert_eq!(*planner.plan(), kproxy_core::plan(&st, "node-a", &cfg));
    assert_eq!(verdict(planner.plan(), "10.96.0.11"), TraceVerdict::Drop);
    assert_eq!(verdict(planner.plan(), "10.97.0.1"), TraceVerdict::Drop);
    assert_eq!(verdict(planner.plan(), "10.96.0.10"), TraceVerdict::Dnat);
    assert_eq!(
        planner.plan().families[1].service_cidrs,
        vec!["fd00:96::/112".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(
        planner.plan().families[0].service_cidrs,
        vec![
            "10.96.0.0/16".parse::<ipnet::IpNet>().unwrap(),
            "10.97.0.0/16".parse().unwrap()
        ],
        "host bits truncated, union sorted"
    );

    // Re-applying the same object changes nothing.
    assert!(!st.upsert_service_cidr(ServiceCidr {
        name: "kubernetes".into(),
        cidrs: vec![
            "10.96.0.1/16".parse().unwrap(),
            "fd00:96::/112".parse().unwrap()
        ],
    }));
    assert!(planner.update(&mut st).is_empty());

    assert!(st.delete_service_cidr("kubernetes"));
    let up = planner.update(&mut st);
    assert!(up.node);
    assert_eq!(*planner.plan(), kproxy_core::plan(&st, "node-a", &cfg));
    assert_eq!(verdict(planner.plan(), "10.96.0.11"), TraceVerdict::None);

    // A relist that brings the object back is a change too.
    let mut relisted = state_of(&docs);
    relisted.upsert_service_cidr(ServiceCidr {
        name: "kubernetes".into(),
        cidrs: vec!["10.96.0.0/16".parse().unwrap()],
    });
    st.replace(relisted);
    assert!(planner.update(&mut st).node);
    assert_eq!(*planner.plan(), kproxy_core::plan(&st, "node-a", &cfg));
    assert_eq!(verdict(planner.plan(), "10.96.0.11"), TraceVerdict::Drop);
}

/// KEP-3836: a Node tainted `ToBeDeletedByClusterAutoscaler` is not eligible for
/// eTP-Cluster load balancers (`/healthz` 503); with the
/// `KubeProxyDrainingTerminatingNodes` gate off (kube-proxy before 1.28) the Node never
/// affects eligibility.
#[test]
fn autoscaler_taint_makes_the_node_ineligible_unless_the_draining_gate_is_off() {
    // The same Node again, now tainted: the later object replaces the first.
    let tainted = NODE.replace(
        "spec: {podCIDRs: [10.244.1.0/24]}",
        "spec: {podCIDRs: [10.244.1.0/24], taints: [{key: ToBeDeletedByClusterAutoscaler, value: \"1732270000\", effect: NoSchedule}]}",
    );
    assert_ne!(tainted, NODE);
    let st = state_of(&[tainted]);
    let on = PlanConfig::default();
    assert!(on.drain_terminating_nodes, "the gate is on by default");
    assert!(!kproxy_core::plan(&st, "node-a", &on).node_eligible);
    let off = PlanConfig {
        drain_terminating_nodes: false,
        ..PlanConfig::default()
    };
    assert!(kproxy_core::plan(&st, "node-a", &off).node_eligible);
    assert!(plan(&[]).node_eligible, "an untainted node is eligible");
}

/// KEP-5683: the Node conditions `DrainInProgress` and `GracefulNodeShutdownInProgress`
/// with status "True", read from a manifest, make the node not eligible and are named in
/// the plan; "False" and "Unknown" say nothing; `--ignore-drain-signal` opts out, and the
/// KEP-3836 gate does not. Fails if the manifest path drops the conditions.
#[test]
fn drain_conditions_make_the_node_ineligible_unless_ignored() {
    use kproxy_core::model::DrainSignal::{self, DrainInProgress, GracefulNodeShutdownInProgress};
    let with = |conditions: &str| {
        let node = NODE.replace(
            "status: {addresses:",
            &format!("status: {{conditions: [{conditions}], addresses:"),
        );
        assert_ne!(node, NODE);
        state_of(&[node])
    };
    let signals = |st: &ClusterState, ignored: &[DrainSignal], gate: bool| {
        let cfg = PlanConfig {
            ignored_drain_signals: ignored.iter().copied().collect(),
            drain_terminating_nodes: gate,
            ..PlanConfig::default()
        };
        let p = kproxy_core::plan(st, "node-a", &cfg);
        assert_eq!(p.node_eligible, p.node_drain_signals.is_empty());
        p.node_drain_signals
    };
    let both = with(
        "{type: Ready, status: \"True\"}, {type: DrainInProgress, status: \"True\", reason: Drain}, {type: GracefulNodeShutdownInProgress, status: \"True\"}",
    );
    assert_eq!(
        signals(&both, &[], true),
        [DrainInProgress, GracefulNodeShutdownInProgress]
    );
    assert_eq!(
        signals(&both, &[], false),
        [DrainInProgress, GracefulNodeShutdownInProgress],
        "the KEP-3836 gate is not these signals' opt-out"
    );
    assert_eq!(
        signals(&both, &[DrainInProgress], true),
        [GracefulNodeShutdownInProgress]
    );
    assert_eq!(
        signals(
            &both,
            &[DrainInProgress, GracefulNodeShutdownInProgress],
            true
        ),
        []
    );
    let not_true = with(
        "{type: DrainInProgress, status: \"False\"}, {type: GracefulNodeShutdownInProgress, status: Unknown}",
    );
    assert_eq!(signals(&not_true, &[], true), []);
    assert!(signals(&state_of(&[]), &[], true).is_empty());
}

/// The plan JSON names the drain signals that count (`nodeDrainSignals`, absent when
/// none does).
#[test]
fn the_plan_json_names_the_drain_signals() {
    let node = NODE.replace(
        "status: {addresses:",
        "status: {conditions: [{type: DrainInProgress, status: \"True\"}], addresses:",
    );
    let v = serde_json::to_value(kproxy_core::plan(
        &state_of(&[node]),
        "node-a",
        &PlanConfig::default(),
    ))
    .unwrap();
    assert_eq!(v["nodeEligible"], false);
    assert_eq!(
        v["nodeDrainSignals"],
        serde_json::json!(["drainInProgress"])
    );
    let v = serde_json::to_value(plan(&[])).unwrap();
    assert_eq!(v["nodeEligible"], true);
    assert!(v.get("nodeDrainSignals").is_none());
}
