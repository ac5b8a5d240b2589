//! How long `kproxy lint` takes on a large input: N namespaces, each with a Deployment,
//! a LoadBalancer Service and a PodDisruptionBudget (half of them misconfigured), read
//! from one multi-document YAML text. Prints the time to type the objects and to run the
//! rules. `cargo run -p kproxy-lint --example scale -- 2000`

#![expect(clippy::disallowed_types, reason = "a measurement: wall time")]

use std::time::Instant;

use kproxy_lint::input::Inventory;
use kproxy_lint::lb::LbProfile;
use kproxy_lint::rules::{self, Options};

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let mut text = String::new();
    for i in 0..n {
        let pre_stop = if i % 2 == 0 { 10 } else { 2 };
        text.push_str(&format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: ns-{i}}}\nspec: {{type: LoadBalancer, externalTrafficPolicy: Local, selector: {{app: web}}, ports: [{{port: 80, targetPort: 8080}}]}}\n---\n\
             apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: web, namespace: ns-{i}}}\nspec:\n  replicas: 3\n  selector: {{matchLabels: {{app: web}}}}\n  template:\n    metadata: {{labels: {{app: web}}}}\n    spec:\n      terminationGracePeriodSeconds: 45\n      containers:\n      - name: web\n        image: example.com/web:1\n        ports: [{{containerPort: 8080}}]\n        lifecycle: {{preStop: {{sleep: {{seconds: {pre_stop}}}}}}}\n        readinessProbe: {{httpGet: {{path: /healthz, port: 8080}}, initialDelaySeconds: 20}}\n---\n\
             apiVersion: policy/v1\nkind: PodDisruptionBudget\nmetadata: {{name: web, namespace: ns-{i}}}\nspec: {{maxUnavailable: 1, selector: {{matchLabels: {{app: web}}}}}}\n---\n"
        ));
    }
    let t = Instant::now();
    let (values, _) = kproxy_core::manifest::documents("scale.yaml", &text);
    let split = t.elapsed();
    drop(values);
    let t0 = Instant::now();
    let mut inv = Inventory::default();
    inv.add_file("scale.yaml", &text);
    let read = t0.elapsed();
    let opts = Options {
        lb: LbProfile::gke(),
        lb_flags: Default::default(),
        proxy_programming_seconds: 1.0,
        nodes: None,
    };
    let t1 = Instant::now();
    let findings = rules::lint(&inv, &opts);
    let lint = t1.elapsed();
    assert!(inv.errors.is_empty(), "{:?}", inv.errors.first());
    println!(
        "{n} namespaces ({} objects, {} KiB of YAML): split alone (kproxy_core::manifest::documents) {:?}; split+typed {:?}; rules {:?}; {} findings",
        inv.workloads.len() + inv.services.len() + inv.pdbs.len(),
        text.len() / 1024,
        split,
        read,
        lint,
        findings.len()
    );
}
