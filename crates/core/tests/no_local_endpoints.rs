//! `sync_proxy_rules_no_local_endpoints_total` as a table through the
//! real manifest → ingest → plan path: counted only when the service port has usable
//! endpoints somewhere but none on this node, per traffic policy and family.

mod common;

use kproxy_core::PlanConfig;
use kproxy_core::model::IpFamily;
use kproxy_core::no_local::{NoLocalEndpoints, no_local_endpoints};

const NODE: &str = "apiVersion: v1\nkind: Node\nmetadata: {name: node-a}\nspec: {podCIDRs: [10.244.1.0/24]}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.11}]}\n";

/// `eps`: (ip, node, ready, serving, terminating).
fn slice(eps: &[(&str, &str, bool, bool, bool)]) -> String {
    let mut s = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: s-x, namespace: ns, labels: {kubernetes.io/service-name: s}}\naddressType: IPv4\nports: [{name: p, port: 8080, protocol: TCP}]\nendpoints:\n".to_string();
    for (ip, node, ready, serving, terminating) in eps {
        s += &format!(
            "- {{addresses: [{ip}], nodeName: {node}, conditions: {{ready: {ready}, serving: {serving}, terminating: {terminating}}}}}\n"
        );
    }
    s
}

fn counts(spec: &str, eps: &[(&str, &str, bool, bool, bool)]) -> NoLocalEndpoints {
    let port = if spec.contains("NodePort") || spec.contains("LoadBalancer") {
        ", nodePort: 30080"
    } else {
        ""
    };
    let mut text = format!(
        "{NODE}---\napiVersion: v1\nkind: Service\nmetadata: {{name: s, namespace: ns}}\nspec:\n  clusterIP: 10.96.0.10\n  ports: [{{name: p, port: 80, protocol: TCP{port}}}]\n{spec}"
    );
    if !eps.is_empty() {
        text += "---\n";
        text += &slice(eps);
    }
    let st = common::state_of_yaml(&text);
    let plan = kproxy_core::plan(&st, "node-a", &PlanConfig::default());
    assert_eq!(
        no_local_endpoints(&plan, IpFamily::IPv6),
        NoLocalEndpoints::default(),
        "an IPv4-only Service counts nothing for IPv6"
    );
    no_local_endpoints(&plan, IpFamily::IPv4)
}

const REMOTE: (&str, &str, bool, bool, bool) = ("10.244.2.5", "node-b", true, true, false);
const LOCAL: (&str, &str, bool, bool, bool) = ("10.244.1.5", "node-a", true, true, false);
const REMOTE_TERMINATING: (&str, &str, bool, bool, bool) =
    ("10.244.2.6", "node-b", false, true, true);
const REMOTE_NOT_SERVING: (&str, &str, bool, bool, bool) =
    ("10.244.2.7", "node-b", false, false, true);

fn n(internal: u32, external: u32) -> NoLocalEndpoints {
    NoLocalEndpoints { internal, external }
}

/// (name, Service spec lines, endpoints as (ip, node, ready, serving, terminating),
/// expected counts).
type Case<'a> = (
    &'a str,
    &'a str,
    &'a [(&'a str, &'a str, bool, bool, bool)],
    NoLocalEndpoints,
);

#[test]
fn table() {
    let itp_local = "  internalTrafficPolicy: Local\n";
    let etp_local_np = "  type: NodePort\n  externalTrafficPolicy: Local\n";
    let both = "  type: NodePort\n  externalTrafficPolicy: Local\n  internalTrafficPolicy: Local\n";
    let etp_local_cluster_ip = "  externalTrafficPolicy: Local\n";
    let cases: &[Case] = &[
        (
            "iTP Local, no endpoints at all: not counted",
            itp_local,
            &[],
            n(0, 0),
        ),
        (
            "iTP Local, only remote endpoints",
            itp_local,
            &[REMOTE],
            n(1, 0),
        ),
        (
            "iTP Local, a local endpoint",
            itp_local,
            &[REMOTE, LOCAL],
            n(0, 0),
        ),
        (
            "iTP Local, remote serving+terminating only: usable somewhere",
            itp_local,
            &[REMOTE_TERMINATING],
            n(1, 0),
        ),
        (
            "iTP Local, remote not serving only: no usable endpoints",
            itp_local,
            &[REMOTE_NOT_SERVING],
            n(0, 0),
        ),
        (
            "eTP Local NodePort, remote only",
            etp_local_np,
            &[REMOTE],
            n(0, 1),
        ),
        (
            "eTP Local NodePort, no endpoints",
            etp_local_np,
            &[],
            n(0, 0),
        ),
        (
            "eTP Local NodePort, local endpoint",
            etp_local_np,
            &[LOCAL],
            n(0, 0),
        ),
        (
            "both Local, remote only: counted under both labels",
            both,
            &[REMOTE],
            n(1, 1),
        ),
        (
            "eTP Local on a ClusterIP Service is not effective",
            etp_local_cluster_ip,
            &[REMOTE],
            n(0, 0),
        ),
        (
            "Cluster policies never count",
            "  type: NodePort\n",
            &[REMOTE],
            n(0, 0),
        ),
    ];
    let mut bad = Vec::new();
    for (name, spec, eps, want) in cases {
        let got = counts(spec, eps);
        if got != *want {
            bad.push(format!("{name}: got {got:?}, want {want:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
