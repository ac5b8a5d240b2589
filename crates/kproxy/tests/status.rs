//! `kproxy status` end to end, as root: a real `kproxy run` (node-a) in a network
//! namespace this test creates, fed by the fake Kubernetes API server
//! (`kproxy_source::fake_api`) on the loopback of that namespace, which also serves
//! deploy/'s DaemonSet, kproxy's Pods and the pods' proxy subresource: a proxied GET
//! goes to the pod's IP as the API server's does, so node-a's `/healthz` and
//! `/metrics` are the real daemon's answers. node-b's pod has an IP nothing listens
//! on (the API server answers 503 "error trying to reach service"), node-c has no
//! kproxy pod, node-w is a Node the DaemonSet's nodeSelector leaves out.
//!
//! 1. While the Services are not listed yet, node-a's kproxy answers 503 (no rules
//!    programmed): `status -o json` exits 1 and says so per node.
//! 2. Once it has synced, node-a is healthy with its last sync and metrics; node-b and
//!    node-c still fail the run (the table's summary says which).
//! 3. With node-a alone and the rollout complete, `status` exits 0, also as `kubectl
//!    kproxy status` (the binary as `kubectl-kproxy`, kubectl's $KUBECONFIG); a rollout
//!    in progress alone makes it exit 1.

#![expect(
    clippy::disallowed_types,
    reason = "waits on a real kproxy process: wall time"
)]

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Daemon, DaemonLog, HEALTHZ, Netns, can_run, http_get, kproxy_run};
use kproxy_source::fake_api::{self, FakeApi};
use serde_json::{Value, json};

fn node(name: &str, linux: bool) -> Value {
    let labels = if linux {
        json!({"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"})
    } else {
        json!({"kubernetes.io/hostname": name, "kubernetes.io/os": "windows"})
    };
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "resourceVersion": "3", "labels": labels},
           "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
           "status": {"addresses": [{"type": "InternalIP", "address": "10.200.0.11"}]}})
}

/// deploy/'s DaemonSet as the API serves it, with `status`.
fn daemon_set(desired: i64) -> Value {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/daemonset.yaml"),
    )
    .unwrap();
    let mut ds: Value = serde_saphyr::from_str(&text).unwrap();
    ds["metadata"]["generation"] = json!(1);
    ds["status"] = json!({"observedGeneration": 1, "desiredNumberScheduled": desired,
        "currentNumberScheduled": desired, "updatedNumberScheduled": desired,
        "numberReady": desired, "numberAvailable": desired});
    ds
}

/// kproxy's pod on `node` with `ip` (hostNetwork: the node's address), labelled as
/// deploy/'s template labels it.
fn pod(name: &str, node: &str, ip: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "kube-system", "resourceVersion": "4",
                        "creationTimestamp": "2026-11-29T04:00:00Z",
                        "labels": {"app.kubernetes.io/name": "kproxy"}},
           "spec": {"nodeName": node, "hostNetwork": true,
                    "containers": [{"name": "kproxy", "image": "kproxy:0.1.0"}]},
           "status": {"phase": "Running", "podIP": ip,
                      "conditions": [{"type": "Ready", "status": "True"}]}})
}

fn service() -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": "web", "namespace": "shop", "resourceVersion": "5", "uid": "u"},
           "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                    "ipFamilies": ["IPv4"], "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}})
}

/// Polls `cond` for up to 30 s.
fn wait(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `kproxy status` in the namespace: its exit code and stdout.
fn status(ns: &Netns, kubeconfig: &Path, json: bool) -> (i32, String) {
    let mut cmd = ns.kproxy("status");
    cmd.args(["--kubeconfig", kubeconfig.to_str().unwrap()]);
    if json {
        cmd.args(["-o", "json"]);
    }
    let out = cmd.output().expect("kproxy status");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.code().is_some(),
        "status killed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap(), stdout)
}

fn json_status(ns: &Netns, kubeconfig: &Path) -> (i32, Value) {
    let (code, out) = status(ns, kubeconfig, true);
    let v = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    (code, v)
}

/// The row of `name` in a JSON report.
fn row<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["node"] == name)
        .unwrap_or_else(|| panic!("no row for {name}: {report}"))
}

#[test]
fn status_shows_every_node_healthy_unhealthy_unreachable_and_podless() {
    if !can_run() {
        return;
    }
    let ns = Netns::new("status");
    let api = Arc::new(FakeApi::new());
    api.nodes.set_list(
        "10",
        vec![
            node("node-a", true),
            node("node-b", true),
            node("node-c", true),
            node("node-w", false),
        ],
    );
    api.set_pods(vec![
        pod("kproxy-a", "node-a", "127.0.0.1"),
        pod("kproxy-b", "node-b", "127.0.0.2"),
    ]);
    api.set_daemon_set(daemon_set(3));
    api.services.set_list("10", vec![service()]);
    // The daemon's first sync waits for the Services' list.
    api.services.open.send_replace(false);

    let listener = ns.run(|| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    let addr = listener.local_addr().unwrap();
    // Its threads in the namespace too: the pods proxy connects from them.
    let name = ns.0.clone();
    let rt = fake_api::serve_on_runtime(listener, api.clone(), move || {
        kproxy_test_support::netns::enter(&name)
    })
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, fake_api::kubeconfig(addr)).unwrap();
    let log = DaemonLog::new();
    let table = format!("kpst{}", std::process::id() % 100_000);
    let _daemon = Daemon(
        kproxy_run(&ns, &["--kubeconfig", kubeconfig.to_str().unwrap()])
            .args(["--nft-table", &table, "--min-sync-period", "50ms"])
            .stderr(log.stderr())
            .spawn()
            .expect("start kproxy run"),
    );
    let healthz = |code: u16| {
        let ns = &ns;
        move || {
            ns.run(|| http_get(HEALTHZ.parse().unwrap(), "/healthz"))
                .is_some_and(|(c, _)| c == code)
        }
    };

    // 1. Not synced: 503 with its reason, the others as they are.
    wait(
        "kproxy run answering 503 before its first sync",
        healthz(503),
    );
    let (code, report) = json_status(&ns, &kubeconfig);
    assert_eq!(code, 1, "{report:#}");
    let a = row(&report, "node-a");
    assert_eq!(a["state"], "unhealthy", "{a:#}");
    assert_eq!(a["healthz"], 503);
    assert!(
        a["reasons"][0]
            .as_str()
            .unwrap()
            .starts_with("no rules programmed yet"),
        "{a:#}"
    );
    assert_eq!(a["lastSync"], Value::Null);
    let b = row(&report, "node-b");
    assert_eq!(b["state"], "unreachable", "{b:#}");
    assert!(
        b["reasons"][0]
            .as_str()
            .unwrap()
            .contains("127.0.0.2:10256"),
        "{b:#}"
    );
    assert_eq!(row(&report, "node-c")["state"], "noPod");
    assert_eq!(row(&report, "node-w")["state"], "notSelected");
    assert_eq!(report["daemonSet"]["complete"], true);
    assert_eq!(report["daemonSet"]["runningImages"]["kproxy:0.1.0"], 2);

    // 2. Synced: node-a healthy, read from its metrics too.
    api.services.open.send_replace(true);
    wait("kproxy run answering 200 once synced", healthz(200));
    let before = api
        .requests_served
        .load(std::sync::atomic::Ordering::SeqCst);
    let (code, report) = json_status(&ns, &kubeconfig);
    let requests = api
        .requests_served
        .load(std::sync::atomic::Ordering::SeqCst)
        - before;
    assert_eq!(code, 1, "node-b and node-c still fail it: {report:#}");
    let a = row(&report, "node-a");
    assert_eq!(
        (&a["state"], &a["healthz"]),
        (&json!("healthy"), &json!(200)),
        "{a:#}"
    );
    assert_eq!(a["image"], "kproxy:0.1.0");
    assert!(a["lastSyncAgeSeconds"].as_f64().unwrap() < 3600.0, "{a:#}");
    assert_eq!(a["kernelRules"], "intact");
    assert_eq!(a["metricsError"], Value::Null, "{a:#}");
    let m = &a["metrics"];
    assert!(m["lastSyncUnix"].as_f64().unwrap() > 0.0, "{m:#}");
    assert_eq!(m["frontendConflicts"], 0, "{m:#}");
    assert_eq!(m["driftRepairs"], 0, "{m:#}");
    assert_eq!(m["trafficCounters"], false, "{m:#}");
    assert_eq!(
        report["summary"]["line"],
        "1/3 nodes healthy (1 unreachable, 1 without a kproxy pod), rollout complete"
    );
    // /version, the DaemonSet, the Nodes, the Pods; node-a's /healthz and /metrics,
    // node-b's /healthz (the API server could not reach it: no /metrics asked).
    assert_eq!(requests, 7, "API requests of one status run");
    let (code, text) = status(&ns, &kubeconfig, false);
    assert_eq!(code, 1);
    assert!(
        text.ends_with(
            "\n1/3 nodes healthy (1 unreachable, 1 without a kproxy pod), rollout complete\n"
        ),
        "{text}"
    );
    assert!(text.contains("no kproxy pod"), "{text}");

    // 3. node-a alone, the rollout complete: exit 0.
    api.nodes.set_list("11", vec![node("node-a", true)]);
    api.set_pods(vec![pod("kproxy-a", "node-a", "127.0.0.1")]);
    api.set_daemon_set(daemon_set(1));
    let (code, report) = json_status(&ns, &kubeconfig);
    assert_eq!(code, 0, "{report:#}");
    assert_eq!(
        report["summary"]["line"],
        "1/1 nodes healthy, rollout complete"
    );
    assert_eq!(report["summary"]["ok"], true);
    // As kubectl runs it: `kubectl-kproxy status`, kubectl's $KUBECONFIG.
    let plugin = dir.path().join("kubectl-kproxy");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kproxy"), &plugin).unwrap();
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .arg(&plugin)
        .args(["status", "-o", "json"])
        .env("KUBECONFIG", &kubeconfig)
        .env("HOME", dir.path())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["summary"]["line"], "1/1 nodes healthy, rollout complete");
    // A rollout in progress alone fails it.
    let mut moving = daemon_set(1);
    moving["status"]["updatedNumberScheduled"] = json!(0);
    api.set_daemon_set(moving);
    let (code, report) = json_status(&ns, &kubeconfig);
    assert_eq!(code, 1, "{report:#}");
    assert_eq!(
        report["summary"]["line"],
        "1/1 nodes healthy, rollout in progress: 0 of 1 pods updated"
    );
    drop(rt);
}
