//! Frontend takeover. Every combination of two Services claiming the same
//! frontend (cluster IP, external IP, LB IP, node port), each in both creation orders:
//! the older Service keeps it whatever the names, the newer is reported, and the planner
//! (incremental or not) agrees.

mod common;

use kproxy_core::frontend::{ConflictReason, FrontendKind};
use kproxy_core::ingest::Ownership;
use kproxy_core::manifest;
use kproxy_core::planner::Planner;
use kproxy_core::{ClusterState, NodePlan, PlanConfig};

const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.1}]}\n";

/// A Service `name` created at `created` with `spec` (YAML flow mapping body).
fn svc(name: &str, created: &str, spec: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: ns, creationTimestamp: \"{created}\"}}\nspec: {{ports: [{{name: p, port: 80, protocol: TCP, nodePort: NP}}], {spec}}}\n"
    )
}

fn state(docs: &[String]) -> ClusterState {
    common::state_of_yaml(&format!("{NODE}---\n{}", docs.join("---\n")))
}

fn plan_both_ways(docs: &[String], cfg: &PlanConfig) -> NodePlan {
    let mut st = state(docs);
    let full = kproxy_core::plan(&st, "node-a", cfg);
    // The incremental planner, fed the same objects, reaches the same plan.
    let mut planner = Planner::new("node-a", cfg.clone());
    planner.update(&mut st);
    assert_eq!(planner.plan(), &full, "incremental and full plans differ");
    full
}

const OLD: &str = "2020-01-01T00:00:00Z";
const NEW: &str = "2024-01-01T00:00:00Z";

/// (what B claims, what A has, the kind B loses)
fn cases() -> Vec<(&'static str, &'static str, &'static str, FrontendKind)> {
    vec![
        (
            "same cluster IP",
            "type: NodePort, clusterIP: 10.96.0.10",
            "type: NodePort, clusterIP: 10.96.0.10",
            FrontendKind::ClusterIp,
        ),
        (
            "same external IP and port",
            "type: NodePort, clusterIP: 10.96.0.10, externalIPs: [192.0.2.7]",
            "type: NodePort, clusterIP: 10.96.0.11, externalIPs: [192.0.2.7]",
            FrontendKind::ExternalIp,
        ),
        (
            "same node port",
            "type: NodePort, clusterIP: 10.96.0.10",
            "type: NodePort, clusterIP: 10.96.0.11",
            FrontendKind::NodePort,
        ),
    ]
}

#[test]
fn the_older_service_keeps_a_shared_frontend_whatever_the_names() {
    for (case, a_spec, b_spec, kind) in cases() {
        for (a_age, b_age, winner) in [(OLD, NEW, "a"), (NEW, OLD, "b")] {
            // Node ports are unique per Service except where the case shares them.
            let a = svc("a", a_age, a_spec).replace("NP", "30080");
            let b_np = if kind == FrontendKind::NodePort {
                "30080"
            } else {
                "30081"
            };
            let b = svc("b", b_age, b_spec).replace("NP", b_np);
            let plan = plan_both_ways(&[a, b], &PlanConfig::default());
            let loser = if winner == "a" { "b" } else { "a" };
            assert_eq!(plan.conflicts.len(), 1, "{case}: {:?}", plan.conflicts);
            let c = &plan.conflicts[0];
            assert_eq!(&*c.service.name, loser, "{case}");
            assert_eq!(c.frontend.kind, kind, "{case}");
            assert!(
                matches!(&c.reason, ConflictReason::Claimed { owner } if &*owner.name == winner),
                "{case}: {c:?}"
            );
            assert!(c.to_string().contains("belongs to ns/"), "{c}");
            // The winner is programmed untouched; the loser lacks exactly the frontend.
            let ports = |n: &str| {
                plan.service_ports()
                    .filter(|p| &*p.service_port.service.name == n)
                    .collect::<Vec<_>>()
            };
            assert_eq!(ports(winner).len(), 1, "{case}");
            match kind {
                FrontendKind::ClusterIp => assert!(ports(loser).is_empty(), "{case}"),
                FrontendKind::ExternalIp => assert!(ports(loser)[0].external_ips.is_empty()),
                FrontendKind::NodePort => assert_eq!(ports(loser)[0].node_port, None),
                FrontendKind::LoadBalancerIp | FrontendKind::HealthCheckNodePort => {
                    unreachable!()
                }
            }
        }
    }
}

#[test]
fn same_age_goes_to_the_name_that_sorts_first() {
    let a = svc("a", OLD, "type: NodePort, clusterIP: 10.96.0.10").replace("NP", "30080");
    let b = svc("b", OLD, "type: NodePort, clusterIP: 10.96.0.11").replace("NP", "30080");
    let plan = plan_both_ways(&[b, a], &PlanConfig::default());
    assert_eq!(&*plan.conflicts[0].service.name, "b");
}

/// CVE-2020-8554: an external IP (or LB IP) equal to another Service's cluster IP or a
/// node address captures that traffic. Refused by default whatever the port; allowed
/// with the setting, and then only an exact address+port clash is a conflict.
#[test]
fn external_and_lb_ips_may_not_capture_cluster_ips_or_node_addresses() {
    let victim = svc("victim", OLD, "clusterIP: 10.96.0.10").replace(", nodePort: NP", "");
    let by_external = svc(
        "thief",
        NEW,
        "clusterIP: 10.96.0.11, externalIPs: [10.96.0.10, 10.200.0.1, 192.0.2.1]",
    )
    .replace(", nodePort: NP", "");
    let plan = plan_both_ways(
        &[victim.clone(), by_external.clone()],
        &PlanConfig::default(),
    );
    let reasons: Vec<_> = plan
        .conflicts
        .iter()
        .map(|c| (c.frontend.ip.unwrap().to_string(), c.reason.clone()))
        .collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(
        matches!(&reasons[0], (ip, ConflictReason::ClusterIpCapture { owner }) if ip == "10.96.0.10" && &*owner.name == "victim")
    );
    assert!(matches!(&reasons[1], (ip, ConflictReason::NodeIpCapture) if ip == "10.200.0.1"));
    let thief = plan
        .service_ports()
        .find(|p| &*p.service_port.service.name == "thief")
        .unwrap();
    assert_eq!(
        thief.external_ips,
        ["192.0.2.1".parse::<std::net::IpAddr>().unwrap()]
    );

    // Even when the thief is older: the cluster IP is never given away.
    let older_thief = by_external.replace(NEW, "2000-01-01T00:00:00Z");
    let plan = plan_both_ways(&[victim.clone(), older_thief], &PlanConfig::default());
    assert_eq!(plan.conflicts.len(), 2);
    assert!(plan.conflicts.iter().all(|c| &*c.service.name == "thief"));

    // LB IPs, from status.
    let lb = format!(
        "{}status: {{loadBalancer: {{ingress: [{{ip: 10.96.0.10}}]}}}}\n",
        svc("lb", NEW, "type: LoadBalancer, clusterIP: 10.96.0.12").replace("NP", "30090")
    );
    let plan = plan_both_ways(&[victim.clone(), lb], &PlanConfig::default());
    assert_eq!(plan.conflicts.len(), 1);
    assert_eq!(
        plan.conflicts[0].frontend.kind,
        FrontendKind::LoadBalancerIp
    );

    // Allowed: the external IP equal to a cluster IP at the same port is still a clash
    // (older wins), the node address is used.
    let cfg = PlanConfig {
        allow_external_ip_overlap: true,
        ..PlanConfig::default()
    };
    let plan = plan_both_ways(&[victim, by_external], &cfg);
    assert_eq!(plan.conflicts.len(), 1, "{:?}", plan.conflicts);
    assert!(
        matches!(&plan.conflicts[0].reason, ConflictReason::Claimed { owner } if &*owner.name == "victim")
    );
}

/// A cluster IP equal to this node's address took all TCP to the node. It is
/// refused like the other reserved addresses, with or without the overlap setting.
#[test]
fn a_cluster_ip_equal_to_a_node_address_is_refused() {
    let bad = svc("bad", OLD, "clusterIP: 10.200.0.1").replace(", nodePort: NP", "");
    let good = svc("good", NEW, "clusterIP: 10.96.0.10").replace(", nodePort: NP", "");
    for allow in [false, true] {
        let cfg = PlanConfig {
            allow_external_ip_overlap: allow,
            ..PlanConfig::default()
        };
        let plan = plan_both_ways(&[bad.clone(), good.clone()], &cfg);
        assert_eq!(plan.conflicts.len(), 1, "{:?}", plan.conflicts);
        let c = &plan.conflicts[0];
        assert_eq!(
            (&*c.service.name, c.frontend.kind, &c.reason),
            ("bad", FrontendKind::ClusterIp, &ConflictReason::NodeAddress)
        );
        assert!(
            c.to_string().contains(
                "10.200.0.1:80/TCP (.spec.clusterIP) not programmed: it is an address of this node"
            ),
            "{c}"
        );
        let names: Vec<&str> = plan
            .service_ports()
            .map(|p| &*p.service_port.service.name)
            .collect();
        assert_eq!(names, ["good"]);
    }
}

/// A `healthCheckNodePort` equal to another Service's node port was reported
/// listening while the NodePort rule took its packets. It is a conflict like two equal
/// node ports: the older Service keeps the port.
#[test]
fn a_health_check_node_port_collides_with_another_services_node_port() {
    let lb = |age| {
        svc(
            "lb",
            age,
            "type: LoadBalancer, externalTrafficPolicy: Local, healthCheckNodePort: 30080, clusterIP: 10.96.0.10",
        )
        .replace("NP", "30090")
    };
    let np = |age| svc("np", age, "type: NodePort, clusterIP: 10.96.0.11").replace("NP", "30080");
    // The node port is older: the health check loses.
    let plan = plan_both_ways(&[lb(NEW), np(OLD)], &PlanConfig::default());
    assert_eq!(plan.conflicts.len(), 1, "{:?}", plan.conflicts);
    let c = &plan.conflicts[0];
    assert_eq!(
        (&*c.service.name, c.frontend.kind, c.frontend.port),
        ("lb", FrontendKind::HealthCheckNodePort, 30080)
    );
    assert!(matches!(&c.reason, ConflictReason::Claimed { owner } if &*owner.name == "np"));
    assert!(
        c.to_string().contains("health-check node port 30080/TCP"),
        "{c}"
    );
    let health = |plan: &NodePlan, n: &str| {
        plan.services
            .values()
            .find(|s| &*s.service.name == n)
            .unwrap()
            .health_check
            .is_some()
    };
    assert!(!health(&plan, "lb"));
    // The health check is older: the node port loses.
    let plan = plan_both_ways(&[lb(OLD), np(NEW)], &PlanConfig::default());
    assert_eq!(plan.conflicts.len(), 1, "{:?}", plan.conflicts);
    let c = &plan.conflicts[0];
    assert_eq!(
        (&*c.service.name, c.frontend.kind),
        ("np", FrontendKind::NodePort)
    );
    assert!(health(&plan, "lb"));
    let np_port = plan
        .service_ports()
        .find(|p| &*p.service_port.service.name == "np")
        .unwrap();
    assert_eq!(np_port.node_port, None);
    // The JSON of the plan names it.
    let json = serde_json::to_value(&plan.conflicts).unwrap();
    assert_eq!(json[0]["frontend"]["kind"], "nodePort");
    let plan = plan_both_ways(&[lb(NEW), np(OLD)], &PlanConfig::default());
    let json = serde_json::to_value(&plan.conflicts).unwrap();
    assert_eq!(json[0]["frontend"]["kind"], "healthCheckNodePort");
}

/// The incremental planner re-plans a Service whose conflict went away although the
/// Service itself did not change.
#[test]
fn removing_the_winner_gives_the_frontend_to_the_loser() {
    let a = svc("a", OLD, "type: NodePort, clusterIP: 10.96.0.10").replace("NP", "30080");
    let b = svc("b", NEW, "type: NodePort, clusterIP: 10.96.0.11").replace("NP", "30080");
    let mut st = state(&[a, b]);
    let mut planner = Planner::new("node-a", PlanConfig::default());
    planner.update(&mut st);
    assert_eq!(planner.plan().conflicts.len(), 1);
    let name = kproxy_core::model::ServiceName::new("ns", "a");
    st.delete_service(&name);
    let update = planner.update(&mut st);
    assert!(planner.plan().conflicts.is_empty());
    let names: Vec<&str> = update.services.iter().map(|s| &*s.name).collect();
    assert_eq!(names, ["a", "b"]);
    let b_port = planner.plan().service_ports().next().unwrap();
    assert_eq!(b_port.node_port, Some(30080));
}

/// An endpoint change of a conflict loser (the hot path, which skips re-resolving) keeps
/// its lost frontend lost, and the incremental plan equals the full one.
#[test]
fn an_endpoint_change_of_a_loser_keeps_its_conflict() {
    let a = svc("a", OLD, "type: NodePort, clusterIP: 10.96.0.10").replace("NP", "30080");
    let b = svc("b", NEW, "type: NodePort, clusterIP: 10.96.0.11").replace("NP", "30080");
    let mut st = state(&[a, b]);
    let mut planner = Planner::new("node-a", PlanConfig::default());
    planner.update(&mut st);
    let slice = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: b-1, namespace: ns, labels: {kubernetes.io/service-name: b}}\naddressType: IPv4\nendpoints: [{addresses: [10.244.0.5]}]\nports: [{name: p, port: 8080}]\n";
    for o in manifest::parse("s.yaml", slice).objects {
        st.apply(&o.object, &Ownership::default(), "node-a")
            .unwrap();
    }
    let update = planner.update(&mut st);
    assert_eq!(update.services.len(), 1);
    assert_eq!(
        planner.plan(),
        &kproxy_core::plan(&st, "node-a", &PlanConfig::default())
    );
    let b_port = planner
        .plan()
        .service_ports()
        .find(|p| &*p.service_port.service.name == "b")
        .unwrap();
    assert_eq!(b_port.node_port, None);
    assert_eq!(b_port.all_reachable_endpoints.len(), 1);
}

/// Another Node's address as a cluster IP, or one outside the ServiceCIDRs: upstream
/// kube-proxy programs both, and so does kproxy (issue 52; issue 42's refusal blackholed
/// them on every node). Each is a warning naming the object and the field; the Services
/// keep every port.
#[test]
fn another_nodes_address_or_a_cluster_ip_outside_the_service_cidrs_is_programmed_with_a_warning() {
    let node_b = "apiVersion: v1\nkind: Node\nmetadata: {name: node-b}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.2}, {type: InternalIP, address: fd00::2}]}\n".to_string();
    let cidr = "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16, fd00:96::/112]}\n".to_string();
    let np = |s: String| s.replace(", nodePort: NP", "");
    let other_node = np(svc("other-node", OLD, "clusterIP: 10.200.0.2"));
    let dual = np(svc(
        "dual",
        OLD,
        "clusterIP: 10.96.0.20, clusterIPs: [10.96.0.20, fd00::2], ipFamilies: [IPv4, IPv6], ipFamilyPolicy: RequireDualStack",
    ));
    let outside = np(svc("outside", OLD, "clusterIP: 192.0.2.10"));
    let good = np(svc("good", NEW, "clusterIP: 10.96.0.10"));
    let docs = [node_b.clone(), other_node, dual, outside, good];
    let warned = |plan: &NodePlan| -> Vec<(String, String, Option<String>, String)> {
        plan.cluster_ip_warnings
            .iter()
            .map(|w| {
                let reason = serde_json::to_value(w).unwrap()["reason"]
                    .as_str()
                    .unwrap()
                    .to_string();
                (
                    w.service.name.to_string(),
                    w.cluster_ip.to_string(),
                    w.field.clone(),
                    reason,
                )
            })
            .collect()
    };
    let ports = |plan: &NodePlan| -> Vec<String> {
        plan.service_ports()
            .map(|p| format!("{} {}", p.service_port.service.name, p.cluster_ip))
            .collect()
    };
    let every_port = [
        "dual 10.96.0.20",
        "dual fd00::2",
        "good 10.96.0.10",
        "other-node 10.200.0.2",
        "outside 192.0.2.10",
    ];

    // Without ServiceCIDRs, only the other Node's addresses are warned of.
    let plan = plan_both_ways(&docs, &PlanConfig::default());
    assert!(plan.conflicts.is_empty(), "{:?}", plan.conflicts);
    let other = || "otherNodeAddress".to_string();
    assert_eq!(
        warned(&plan),
        [
            (
                "dual".into(),
                "fd00::2".into(),
                Some(".spec.clusterIPs[1]".into()),
                other()
            ),
            (
                "other-node".into(),
                "10.200.0.2".into(),
                Some(".spec.clusterIP".into()),
                other()
            ),
        ]
    );
    assert_eq!(
        plan.cluster_ip_warnings[1].to_string(),
        "ns/other-node: cluster IP 10.200.0.2 (.spec.clusterIP) programmed, as upstream kube-proxy programs it, although it is an address of Node node-b: on the Service's ports, this node's traffic to that Node goes to the Service"
    );
    assert_eq!(ports(&plan), every_port);

    // With a ServiceCIDR, an address outside it is warned of too, and still programmed.
    let mut with_cidr = docs.to_vec();
    with_cidr.push(cidr);
    let plan = plan_both_ways(&with_cidr, &PlanConfig::default());
    assert!(plan.conflicts.is_empty(), "{:?}", plan.conflicts);
    let outside: Vec<_> = plan
        .cluster_ip_warnings
        .iter()
        .filter(|w| &*w.service.name == "outside")
        .collect();
    assert_eq!(outside.len(), 1, "{:?}", plan.cluster_ip_warnings);
    assert_eq!(
        outside[0].to_string(),
        "ns/outside: cluster IP 192.0.2.10 (.spec.clusterIP) programmed, as upstream kube-proxy programs it, although it is outside the service CIDRs (10.96.0.0/16), where no API server allocates a cluster IP now"
    );
    assert_eq!(ports(&plan), every_port);

    // The incremental planner follows the other Node: once it is gone, so is its warning.
    let mut st = state(&docs);
    let mut planner = Planner::new("node-a", PlanConfig::default());
    planner.update(&mut st);
    assert_eq!(planner.plan().cluster_ip_warnings.len(), 2);
    st.delete(kproxy_core::ingest::Kind::Node, "", "node-b", "node-a");
    planner.update(&mut st);
    assert!(
        planner.plan().cluster_ip_warnings.is_empty(),
        "{:?}",
        planner.plan().cluster_ip_warnings
    );
    assert_eq!(planner.plan().service_ports().count(), 5);
}
