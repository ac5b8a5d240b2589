//! `kproxy status` at scale against the fake API server (`kproxy_source::fake_api`, in
//! this process, on 127.0.0.1): N Nodes, each with kproxy's Pod, deploy/'s DaemonSet,
//! and the pods proxy answered by the fake itself (no pod behind it: a truthful 200
//! `/healthz` body and a `/metrics` text of `--metrics-bytes`, by default the size a
//! real `kproxy run` serves with one Service and the traffic counters off, measured in
//! tests/status.rs's set-up). Reports, per run, the wall time from spawn to exit, the
//! status process's CPU, and the requests the API server served, with the load.
//!
//! The fake answers at once: a real API server adds its proxy's dial and the pod's
//! answer to each proxied request, so the wall time here is the floor; with a latency
//! L per proxied request, `--concurrency` C and two requests per pod, add about
//! N × 2 × L / C.
//!
//! ```text
//! cargo build [--release] -p kproxy
//! cargo run [--release] -p kproxy --example status_bench -- [5000] [--runs 3] \
//!   [--metrics-bytes 29238] [--status-arg ARG]...   # e.g. --status-arg --metrics-port=0
//! ```

#![expect(
    clippy::disallowed_types,
    reason = "a bench of real processes: wall time"
)]

#[path = "support/mod.rs"]
mod support;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kproxy_source::fake_api::{self, FakeApi, StatusCode};
use serde_json::{Value, json};
use support::{children_cpu, ip4, kproxy_binary, load};

fn node(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": format!("node-{i}"), "resourceVersion": "1",
                     "labels": {"kubernetes.io/hostname": format!("node-{i}"), "kubernetes.io/os": "linux"}},
        "spec": {"podCIDR": "10.244.0.0/24"},
        "status": {"addresses": [{"type": "InternalIP", "address": ip4(0x0ac8_0000, i + 1)}]}})
}

fn pod(i: usize) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("kproxy-{i}"), "namespace": "kube-system", "resourceVersion": "1",
                     "creationTimestamp": "2026-11-29T04:00:00Z",
                     "labels": {"app.kubernetes.io/name": "kproxy"}},
        "spec": {"nodeName": format!("node-{i}"), "hostNetwork": true,
                 "containers": [{"name": "kproxy", "image": "kproxy:0.1.0"}]},
        "status": {"phase": "Running", "podIP": ip4(0x0ac8_0000, i + 1),
                   "conditions": [{"type": "Ready", "status": "True"}]}})
}

/// A `/metrics` text of about `bytes`: the families status reads, then histogram
/// buckets as the daemon's fill the rest of its answer.
fn metrics(bytes: usize) -> String {
    let mut text = String::from(
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.7e9\n\
kubeproxy_sync_proxy_rules_nftables_sync_failures_total 0\n\
kproxy_frontend_conflicts 0\nkproxy_skipped_objects 0\nkproxy_dataplane_drift_repairs_total 0\n\
kproxy_kernel_interference_repairs_total 0\n\
kproxy_kube_proxy_rules_present{mode=\"nftables\"} 0\nkproxy_endpoint_warmup_holds_total 0\n",
    );
    let mut b = 0;
    while text.len() < bytes {
        text +=
            &format!("kubeproxy_network_programming_duration_seconds_bucket{{le=\"{b}.0\"}} 0\n");
        b += 1;
    }
    text + "# EOF\n"
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let nodes: usize = args
        .first()
        .filter(|a| !a.starts_with("--"))
        .map_or(5000, |n| n.parse().expect("N nodes"));
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let runs: usize = flag("--runs").map_or(3, |r| r.parse().expect("--runs N"));
    let metrics_bytes: usize =
        flag("--metrics-bytes").map_or(29_238, |b| b.parse().expect("--metrics-bytes N"));
    let status_args: Vec<&str> = args
        .iter()
        .enumerate()
        .filter(|(i, _)| *i > 0 && args[i - 1] == "--status-arg")
        .map(|(_, a)| a.as_str())
        .collect();

    let api = Arc::new(FakeApi::new());
    api.nodes.set_list("1", (0..nodes).map(node).collect());
    api.set_pods((0..nodes).map(pod).collect());
    let ds: Value = serde_saphyr::from_str(include_str!("../../../deploy/daemonset.yaml"))
        .expect("deploy/daemonset.yaml");
    let mut ds = ds;
    ds["metadata"]["generation"] = json!(1);
    ds["status"] = json!({"observedGeneration": 1, "desiredNumberScheduled": nodes,
        "updatedNumberScheduled": nodes, "numberReady": nodes, "numberAvailable": nodes});
    api.set_daemon_set(ds);
    let healthz =
        json!({"lastUpdated": "2026-11-29T04:59:30Z", "currentTime": "2026-11-29T05:00:00Z",
        "nodeEligible": true, "healthy": true, "status": {}, "syncedOnce": true,
        "oldestPendingChange": null, "consecutiveSyncFailures": 0, "kernelRules": "intact",
        "conntrackFull": false, "inputHeld": false, "drainSignals": [], "sourceStalledSince": null})
        .to_string();
    let metrics = metrics(metrics_bytes);
    api.set_pod_proxy(Arc::new(move |_pod, _port, path| match path {
        "/healthz" => Some((StatusCode::OK, healthz.clone())),
        "/metrics" => Some((StatusCode::OK, metrics.clone())),
        _ => None,
    }));
    let (_server, addr) = fake_api::serve_on_loopback(api.clone()).expect("the fake API");
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, fake_api::kubeconfig(addr)).unwrap();
    let bin = kproxy_binary();
    println!(
        "kproxy status: {nodes} nodes and pods, fake API (answers at once), /metrics {metrics_bytes} bytes, args {status_args:?}, {}",
        bin.display()
    );
    for run in 1..=runs {
        let served = api.requests_served.load(Ordering::SeqCst);
        let cpu = children_cpu();
        let start = Instant::now();
        let out = Command::new(&bin)
            .arg("status")
            .args(["--kubeconfig", kubeconfig.to_str().unwrap(), "-o", "json"])
            .args(&status_args)
            .output()
            .expect("run kproxy status");
        let took = start.elapsed().as_secs_f64();
        let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "status printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        println!(
            "run {run}: exit {:?}, wall {took:.2} s, status CPU {:.2} s, {} API requests, summary {:?}; load {}",
            out.status.code(),
            children_cpu() - cpu,
            api.requests_served.load(Ordering::SeqCst) - served,
            report["summary"]["line"].as_str().unwrap_or("?"),
            load()
        );
    }
}
