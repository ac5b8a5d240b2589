//! The one-shot read of `kproxy explain` and `kproxy trace` at scale, against the fake
//! API server (`kproxy_source::fake_api`, in this process, on 127.0.0.1): N Services ×
//! E endpoints, then each command run R times, wall time from spawn to exit (list,
//! plan, answer), and the kproxy process's CPU. The fake serves JSON lists (a real API
//! server answers Services and EndpointSlices in protobuf, which kproxy asks for) from
//! this process, on the same cores: kproxy's CPU is its own share of the wall time.
//!
//! ```text
//! cargo build [--release] -p kproxy
//! cargo run [--release] -p kproxy --example oneshot_bench -- 10000x10 [--runs 5]
//! ```

#![expect(
    clippy::disallowed_types,
    reason = "a bench of real processes: wall time"
)]

#[path = "support/mod.rs"]
mod support;

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use kproxy_source::fake_api::{self, FakeApi};
use serde_json::{Value, json};
use support::{children_cpu, ip4, kproxy_binary, slice_endpoints};

/// Service `i` in one of 50 namespaces; one in ten a LoadBalancer with
/// externalTrafficPolicy Local among the first 2,000 (the node-port range).
fn service(i: usize) -> Value {
    let mut spec = json!({"clusterIP": ip4(0x0a60_0000, i + 1), "clusterIPs": [ip4(0x0a60_0000, i + 1)],
        "ipFamilies": ["IPv4"], "type": "ClusterIP",
        "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]});
    if i.is_multiple_of(10) && i < 20_000 {
        spec["type"] = json!("LoadBalancer");
        spec["externalTrafficPolicy"] = json!("Local");
        spec["healthCheckNodePort"] = json!(30000 + i / 10);
        spec["ports"][0]["nodePort"] = json!(32000 + (i / 10) % 700);
    }
    json!({"apiVersion": "v1", "kind": "Service",
        "metadata": {"name": format!("svc-{i}"), "namespace": format!("ns-{}", i % 50),
                     "resourceVersion": "1", "uid": format!("uid-{i}")},
        "spec": spec})
}

fn slice(i: usize, eps: usize) -> Value {
    let endpoints = slice_endpoints(i, eps);
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("svc-{i}-x"), "namespace": format!("ns-{}", i % 50), "resourceVersion": "1",
                     "labels": {"kubernetes.io/service-name": format!("svc-{i}")}},
        "addressType": "IPv4", "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints})
}

/// One run: wall seconds from spawn to exit, and the process's CPU seconds.
fn time(bin: &Path, args: &[&str]) -> (f64, f64) {
    let cpu = children_cpu();
    let start = Instant::now();
    let out = Command::new(bin).args(args).output().expect("run kproxy");
    let took = start.elapsed().as_secs_f64();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (took, children_cpu() - cpu)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let scale = args.first().map_or("10000x10", String::as_str);
    let (services, eps) = scale
        .split_once('x')
        .and_then(|(s, e)| Some((s.parse::<usize>().ok()?, e.parse::<usize>().ok()?)))
        .expect("SERVICESxENDPOINTS, e.g. 10000x10");
    let runs = args
        .iter()
        .position(|a| a == "--runs")
        .and_then(|i| args.get(i + 1))
        .map_or(5, |r| r.parse().expect("--runs N"));
    let api = Arc::new(FakeApi::new());
    api.services
        .set_list("1", (0..services).map(service).collect());
    api.slices
        .set_list("1", (0..services).map(|i| slice(i, eps)).collect());
    api.nodes.set_list(
        "1",
        vec![json!({"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": "node-0", "resourceVersion": "1"},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.200.0.10"}]}})],
    );
    let (_server, addr) = fake_api::serve_on_loopback(api.clone()).expect("the fake API");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, fake_api::kubeconfig(addr)).unwrap();
    let kubeconfig = kubeconfig.display().to_string();
    let bin = kproxy_binary();
    let base = ["--kubeconfig", kubeconfig.as_str(), "--node", "node-0"];
    let explain: Vec<&str> = ["explain"]
        .into_iter()
        .chain(base)
        .chain(["ns-0/svc-0"])
        .collect();
    let trace: Vec<&str> = ["trace"]
        .into_iter()
        .chain(base)
        .chain(["--src", "10.244.0.9", "--dst", "10.96.0.1", "--dport", "80"])
        .collect();
    println!(
        "{services} Services x {eps} endpoints, fake API (JSON lists), {}",
        bin.display()
    );
    for (name, argv) in [("explain", &explain), ("trace", &trace)] {
        let (mut times, mut cpu): (Vec<f64>, Vec<f64>) =
            (0..runs).map(|_| time(&bin, argv)).unzip();
        times.sort_by(f64::total_cmp);
        cpu.sort_by(f64::total_cmp);
        println!(
            "kproxy {name}: wall min {:.3} s, median {:.3} s, max {:.3} s; its CPU median {:.3} s; over {runs} runs",
            times[0],
            times[times.len() / 2],
            times[times.len() - 1],
            cpu[cpu.len() / 2]
        );
    }
}
