//! `kproxy run` on the Kubernetes API source, end to end, as root: the real binary in a
//! node network namespace this test creates, fed by the fake Kubernetes API server
//! (`kproxy_source::fake_api`) listening on the loopback of that same namespace (the
//! listener is bound from a thread that entered the namespace; the server's tasks run
//! on a runtime owned by the test, so stopping that runtime is a real API outage). The
//! kubeconfig points at the fake server. Checks use real packets through real nftables
//! rules and real HTTP to the health servers; every wait polls (no duration asserted).
//!
//! Covered:
//! 1. the first sync waits until Services, EndpointSlices and the Node are listed; then
//!    the cluster IP reaches the pod and the eTP-Local health-check node port says 200;
//!    another proxy's Service is not programmed;
//! 2. watch events (an endpoint turning terminating, its slice deleted) change the
//!    health-check answer and the dataplane;
//! 3. an API outage keeps the rules (traffic flows) and the proxy healthy; when the
//!    server returns, a 410 makes the daemon relist, and it follows later events;
//!    SIGTERM with the API away stops the daemon and leaves the rules;
//! 4. the Node's ToBeDeletedByClusterAutoscaler taint, deletionTimestamp or deletion
//!    turns `/healthz` to 503 (nodeEligible false) while `/livez` stays 200;
//! 5. `--service-proxy-name` reaches the selectors and only that proxy's Services are
//!    programmed.

#![expect(
    clippy::disallowed_types,
    reason = "times a real kproxy process: wall time"
)]

mod common;

use std::io::ErrorKind;
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{
    Daemon, Fabric, HEALTHZ, Netns, can_run, eventually, fabric, http_get, kproxy_run, wait_exit,
};
use kproxy_source::fake_api::{self, FakeApi, gone};
use serde_json::{Value, json};

const CLUSTER_IP: &str = "10.96.0.10:80";
const HEALTH_CHECK: &str = "10.200.0.11:32000";

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

// ---------------------------------------------------------------- API objects (real API JSON)

fn service(rv: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop", "resourceVersion": rv, "uid": "uid-web"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                 "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack", "sessionAffinity": "None",
                 "externalTrafficPolicy": "Local", "internalTrafficPolicy": "Cluster", "healthCheckNodePort": 32000,
                 "selector": {"app": "web"},
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080, "nodePort": 30080}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.10", "ipMode": "VIP"}]}}
    })
}

/// The slice of `web` with the one pod 10.244.1.5 on node-a; `ready: false` makes it a
/// terminating pod that still serves.
fn slice(rv: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-1", "namespace": "shop", "resourceVersion": rv,
                     "labels": {"kubernetes.io/service-name": "web",
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.244.1.5"], "nodeName": "node-a",
                       "conditions": {"ready": ready, "serving": true, "terminating": !ready},
                       "targetRef": {"kind": "Pod", "namespace": "shop", "name": "web-5"}}],
        "ports": [{"name": "http", "protocol": "TCP", "port": 8080}]
    })
}

fn node_object(rv: &str) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-a", "resourceVersion": rv,
                     "labels": {"kubernetes.io/hostname": "node-a", "topology.kubernetes.io/zone": "zone-a"}},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.200.0.11"}, {"type": "Hostname", "address": "node-a"}]}
    })
}

/// A ClusterIP Service (10.96.0.11) with an endpoint, labelled for another proxy: the
/// fake server ignores selectors, so kproxy must leave it alone by itself.
fn other_proxys(api: &FakeApi) {
    let svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "other", "namespace": "shop", "resourceVersion": "8",
                     "labels": {"service.kubernetes.io/service-proxy-name": "other-proxy"}},
        "spec": {"type": "ClusterIP", "clusterIP": "10.96.0.11", "clusterIPs": ["10.96.0.11"],
                 "ipFamilies": ["IPv4"], "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
    });
    let mut slice = slice("9", true);
    slice["metadata"]["name"] = json!("other-1");
    slice["metadata"]["labels"] = json!({"kubernetes.io/service-name": "other",
                                         "service.kubernetes.io/service-proxy-name": "other-proxy"});
    let mut services = api.services.list_items();
    services.push(svc);
    api.services.set_list("10", services);
    let mut slices = api.slices.list_items();
    slices.push(slice);
    api.slices.set_list("10", slices);
}

fn cluster(api: &FakeApi) {
    api.services.set_list("10", vec![service("5")]);
    api.slices.set_list("10", vec![slice("6", true)]);
    api.nodes.set_list("10", vec![node_object("7")]);
}

// ---------------------------------------------------------------- the fake API server

/// The fake API server on 127.0.0.1 of a namespace, on a runtime of its own: `stop`
/// shuts the runtime down, which closes the listener and every open connection (watch
/// streams included), as an API server going away does.
struct ApiServer {
    api: Arc<FakeApi>,
    ns: String,
    addr: SocketAddr,
    rt: Option<tokio::runtime::Runtime>,
}

impl ApiServer {
    fn start(ns: &Netns, api: Arc<FakeApi>) -> ApiServer {
        let mut s = ApiServer {
            api,
            ns: ns.0.clone(),
            addr: addr("127.0.0.1:0"),
            rt: None,
        };
        s.serve(ns);
        s
    }

    /// Binds `self.addr` (a fresh port the first time, the same one after a `stop`) in
    /// the namespace and serves on it.
    fn serve(&mut self, ns: &Netns) {
        assert_eq!(ns.0, self.ns);
        let want = self.addr;
        // std's bind sets SO_REUSEADDR: the port comes back despite TIME_WAIT sockets.
        let listener =
            ns.run(move || std::net::TcpListener::bind(want).expect("bind the fake API server"));
        listener.set_nonblocking(true).unwrap();
        self.addr = listener.local_addr().unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        {
            let _guard = rt.enter();
            fake_api::spawn(
                tokio::net::TcpListener::from_std(listener).unwrap(),
                self.api.clone(),
            );
        }
        self.rt = Some(rt);
    }

    fn stop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

// ---------------------------------------------------------------- the daemon

/// `kproxy run` against the fake API server; its log goes to a file, printed if the
/// test fails. The daemon is killed on drop.
struct Run {
    daemon: Daemon,
    log: PathBuf,
    events: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.daemon.0.kill();
        let _ = self.daemon.0.wait();
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let events = std::fs::read_to_string(&self.events).unwrap_or_default();
            eprintln!("---- kproxy run log ----\n{log}---- event log ----\n{events}----");
        }
    }
}

fn start_daemon(
    node: &Netns,
    api: &ApiServer,
    table: &str,
    sync_period: &str,
    extra: &[&str],
) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, fake_api::kubeconfig(api.addr)).unwrap();
    let events = dir.path().join("events.jsonl");
    let log = dir.path().join("kproxy.log");
    let child = kproxy_run(node, &["--kubeconfig", kubeconfig.to_str().unwrap()])
        .args(["--min-sync-period", "50ms", "--sync-period", sync_period])
        .args([
            "--nft-table",
            table,
            "--event-log",
            events.to_str().unwrap(),
        ])
        .args(extra)
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("start kproxy run");
    Run {
        daemon: Daemon(child),
        log,
        events,
        _dir: dir,
    }
}

/// The `synced` events of the event log so far.
fn synced(events: &Path) -> Vec<Value> {
    std::fs::read_to_string(events)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["event"] == "synced")
        .collect()
}

/// Polls `cond` (outside any namespace) for up to `secs`.
fn wait(what: &str, secs: u64, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Polls an HTTP GET in the node namespace until its status is `code`; the body as JSON.
fn wait_status(node: &Netns, what: &str, to: &'static str, path: &'static str, code: u16) -> Value {
    let (_, body) = eventually(node, what, move || {
        http_get(addr(to), path).filter(|(c, _)| *c == code)
    });
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {body}"))
}

fn get(node: &Netns, to: &'static str, path: &'static str) -> Option<(u16, String)> {
    node.run(move || http_get(addr(to), path))
}

fn refused(to: SocketAddr) -> bool {
    matches!(TcpStream::connect_timeout(&to, Duration::from_secs(2)), Err(e) if e.kind() == ErrorKind::ConnectionRefused)
}

fn pod_answer() -> Option<(u16, String)> {
    Some((200, "pod-1".to_string()))
}

/// A fabric, the fake API server with `setup` applied in its node namespace, and the
/// daemon.
fn start(
    tag: char,
    table: &str,
    sync_period: &str,
    extra: &[&str],
    setup: impl FnOnce(&FakeApi),
) -> (Fabric, ApiServer, Run) {
    let fab = fabric(tag);
    let api = Arc::new(FakeApi::new());
    setup(&api);
    let server = ApiServer::start(&fab.node, api);
    let run = start_daemon(&fab.node, &server, table, sync_period, extra);
    (fab, server, run)
}

// ---------------------------------------------------------------- tests

#[test]
fn first_sync_waits_for_all_three_kinds_then_watch_events_change_rules_and_health_checks() {
    if !can_run() {
        return;
    }
    // The EndpointSlice list is held back (a slow API server).
    let (fab, server, run) = start('k', "kpk1", "5s", &[], |api| {
        cluster(api);
        other_proxys(api);
        api.slices.open.send_replace(false);
    });
    let (node, api) = (&fab.node, &server.api);
    // Services and the Node are listed (their watches started); the slice list is pending.
    wait(
        "the Service and Node watches and the slice list",
        30,
        || {
            !api.services.watches().is_empty()
                && !api.nodes.watches().is_empty()
                && api.slices.lists() >= 1
        },
    );
    // Upstream's selectors reached the server.
    assert_eq!(
        api.services.requests()[0]
            .get("labelSelector")
            .map(String::as_str),
        Some("!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name")
    );
    assert_eq!(
        api.nodes.requests()[0]
            .get("fieldSelector")
            .map(String::as_str),
        Some("metadata.name=node-a")
    );
    // No sync yet: no event, no table, /healthz not yet 200 (truthful: nothing applied),
    // /livez 200.
    assert!(
        synced(&run.events).is_empty(),
        "synced before the EndpointSlices were listed"
    );
    let table = Command::new("ip")
        .args([
            "netns", "exec", &node.0, "nft", "list", "table", "ip", "kpk1",
        ])
        .output()
        .unwrap();
    assert!(
        !table.status.success(),
        "table programmed before the first sync"
    );
    wait_status(
        node,
        "/healthz before the first sync",
        HEALTHZ,
        "/healthz",
        503,
    );
    wait_status(node, "/livez before the first sync", HEALTHZ, "/livez", 200);

    // The slices arrive: the first sync programs the rules.
    api.slices.open.send_replace(true);
    let body = eventually(node, "the cluster IP to answer", || {
        http_get(addr(CLUSTER_IP), "/")
    });
    assert_eq!(Some(body), pod_answer());
    let hc = wait_status(node, "the health-check node port", HEALTH_CHECK, "/", 200);
    assert_eq!(hc["localEndpoints"], 1, "{hc}");
    assert_eq!(hc["service"]["name"], "web");
    let healthz = wait_status(
        node,
        "/healthz after the first sync",
        HEALTHZ,
        "/healthz",
        200,
    );
    assert_eq!(healthz["nodeEligible"], true, "{healthz}");
    let first = &synced(&run.events)[0];
    assert_eq!(first["full"], true, "{first}");
    assert_eq!(first["health_checks"][0]["localEndpoints"], 1, "{first}");
    // Only this proxy's Service is programmed.
    let table = Command::new("ip")
        .args([
            "netns", "exec", &node.0, "nft", "list", "table", "ip", "kpk1",
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("10.96.0.10"), "{table}");
    assert!(
        !table.contains("10.96.0.11"),
        "another proxy's Service programmed:\n{table}"
    );

    // A watch event: the pod starts terminating. The health check says 503 while the
    // cluster IP still reaches the serving, terminating pod.
    api.slices.event("MODIFIED", slice("11", false));
    let hc = wait_status(node, "the health check to fail", HEALTH_CHECK, "/", 503);
    assert_eq!(hc["localEndpoints"], 0, "{hc}");
    assert_eq!(
        get(node, CLUSTER_IP, "/"),
        pod_answer(),
        "a serving, terminating endpoint keeps serving"
    );

    // The slice is deleted: the cluster IP has no endpoint and rejects new connections.
    api.slices.event("DELETED", slice("12", false));
    eventually(node, "the cluster IP to reject", || {
        refused(addr(CLUSTER_IP)).then_some(())
    });
    let hc = wait_status(
        node,
        "the health check without endpoints",
        HEALTH_CHECK,
        "/",
        503,
    );
    assert_eq!(hc["localEndpoints"], 0, "{hc}");

    // And back: a new slice is added, traffic flows again.
    api.slices.event("ADDED", slice("13", true));
    let body = eventually(node, "the cluster IP to answer again", || {
        http_get(addr(CLUSTER_IP), "/")
    });
    assert_eq!(Some(body), pod_answer());
    wait_status(
        node,
        "the health check to pass again",
        HEALTH_CHECK,
        "/",
        200,
    );
    assert_eq!(api.slices.lists(), 1, "watch events, no relist");
}

#[test]
fn an_api_outage_keeps_rules_and_health_and_the_daemon_relists_when_the_api_returns() {
    if !can_run() {
        return;
    }
    // A short syncPeriod: periodic syncs show time passing, and the health timeout
    // (2 × syncPeriod) is short.
    let (fab, mut server, run) = start('o', "kpk2", "500ms", &[], cluster);
    let node = &fab.node;
    let body = eventually(node, "the cluster IP to answer", || {
        http_get(addr(CLUSTER_IP), "/")
    });
    assert_eq!(Some(body), pod_answer());
    wait_status(node, "the health-check node port", HEALTH_CHECK, "/", 200);
    let api = server.api.clone();
    wait("the three watches", 30, || {
        !api.services.watches().is_empty()
            && !api.slices.watches().is_empty()
            && !api.nodes.watches().is_empty()
    });

    // The API server goes away: listener and watch connections closed.
    server.stop();
    let api_addr = server.addr;
    eventually(node, "the API server to refuse connections", move || {
        refused(api_addr).then_some(())
    });
    let before = synced(&run.events).len();

    // The rules stay: traffic flows, the health check still says 200.
    assert_eq!(
        get(node, CLUSTER_IP, "/"),
        pod_answer(),
        "traffic flows during the outage"
    );
    let hc = wait_status(
        node,
        "the health check during the outage",
        HEALTH_CHECK,
        "/",
        200,
    );
    assert_eq!(hc["serviceProxyHealthy"], true, "{hc}");
    // Periodic syncs go on. After more than 2 × syncPeriod of outage the proxy is still
    // healthy: an unreachable API queues no change, so nothing turns stale (upstream's rule,
    // docs/upstream-semantics.md §d.2; staleness itself is covered by crates/health
    // with a clock).
    wait("three periodic syncs during the outage", 30, || {
        synced(&run.events).len() >= before + 3
    });
    wait_status(node, "/livez during the outage", HEALTHZ, "/livez", 200);
    wait_status(node, "/healthz during the outage", HEALTHZ, "/healthz", 200);
    assert_eq!(
        get(node, CLUSTER_IP, "/"),
        pod_answer(),
        "traffic still flows"
    );

    // Meanwhile the pod started terminating, and the server's watch cache no longer
    // holds the daemon's resourceVersion: the resumed slice watch gets 410 Gone.
    let slice_lists = api.slices.lists();
    api.slices.set_list("20", vec![slice("19", false)]);
    api.slices.event("ERROR", gone());
    server.serve(node);

    // The daemon relists the slices and follows the change made during the outage.
    wait("the slice relist", 60, || api.slices.lists() > slice_lists);
    let hc = wait_status(
        node,
        "the health check after the relist",
        HEALTH_CHECK,
        "/",
        503,
    );
    assert_eq!(hc["localEndpoints"], 0, "{hc}");
    assert_eq!(
        get(node, CLUSTER_IP, "/"),
        pod_answer(),
        "the serving, terminating pod still serves"
    );
    // Then new events on the watch that follows the relist (from the list's version).
    wait("the slice watch after the relist", 30, || {
        api.slices
            .watches()
            .last()
            .and_then(|w| w.get("resourceVersion").cloned())
            .as_deref()
            == Some("20")
    });
    api.slices.event("MODIFIED", slice("21", true));
    let hc = wait_status(
        node,
        "the health check after a post-outage event",
        HEALTH_CHECK,
        "/",
        200,
    );
    assert_eq!(hc["localEndpoints"], 1, "{hc}");
    wait_status(node, "/livez after the outage", HEALTHZ, "/livez", 200);

    // SIGTERM while the API is away again: the daemon stops (watches backing off do
    // not hold it), says so in the event log, and the rules stay.
    server.stop();
    let mut run = run;
    common::send_sigterm(&run.daemon);
    let status = wait_exit(&mut run.daemon, 20);
    assert!(status.success(), "{status:?}");
    let last = std::fs::read_to_string(&run.events).unwrap();
    let last: Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    assert_eq!(last["event"], "stopped", "{last}");
    assert_eq!(
        get(node, CLUSTER_IP, "/"),
        pod_answer(),
        "traffic flows with kproxy stopped"
    );
}

#[test]
fn a_node_being_drained_or_deleted_fails_healthz_through_the_api() {
    if !can_run() {
        return;
    }
    let (fab, server, _run) = start('n', "kpk3", "5s", &[], cluster);
    let (node, api) = (&fab.node, &server.api);
    let healthz = wait_status(node, "/healthz", HEALTHZ, "/healthz", 200);
    assert_eq!(healthz["nodeEligible"], true, "{healthz}");

    // The cluster autoscaler marks the node for deletion.
    let mut tainted = node_object("11");
    tainted["spec"]["taints"] = json!([{"key": "ToBeDeletedByClusterAutoscaler", "value": "1732270000", "effect": "NoSchedule"}]);
    api.nodes.event("MODIFIED", tainted);
    let healthz = wait_status(
        node,
        "/healthz to fail on the taint",
        HEALTHZ,
        "/healthz",
        503,
    );
    assert_eq!(healthz["nodeEligible"], false, "{healthz}");
    wait_status(node, "/livez", HEALTHZ, "/livez", 200);
    assert_eq!(
        get(node, CLUSTER_IP, "/"),
        pod_answer(),
        "traffic flows on a draining node"
    );

    // The taint goes away: eligible again.
    api.nodes.event("MODIFIED", node_object("12"));
    let healthz = wait_status(node, "/healthz back to 200", HEALTHZ, "/healthz", 200);
    assert_eq!(healthz["nodeEligible"], true, "{healthz}");

    // The Node is being deleted (held by a finalizer).
    let mut deleting = node_object("13");
    deleting["metadata"]["deletionTimestamp"] = json!("2026-11-22T23:00:00Z");
    deleting["metadata"]["finalizers"] = json!(["example.com/hold"]);
    api.nodes.event("MODIFIED", deleting.clone());
    let healthz = wait_status(
        node,
        "/healthz to fail on deletion",
        HEALTHZ,
        "/healthz",
        503,
    );
    assert_eq!(healthz["nodeEligible"], false, "{healthz}");
    wait_status(node, "/livez", HEALTHZ, "/livez", 200);

    // The finalizer is released and the Node deleted; then it registers again, which
    // makes it eligible (events of one watch are applied in order).
    deleting["metadata"]["resourceVersion"] = json!("14");
    api.nodes.event("DELETED", deleting);
    api.nodes.event("ADDED", node_object("15"));
    let healthz = wait_status(
        node,
        "/healthz after re-registration",
        HEALTHZ,
        "/healthz",
        200,
    );
    assert_eq!(healthz["nodeEligible"], true, "{healthz}");

    // Deleted at once (no finalizer: the last version has no deletionTimestamp). The
    // Node is gone: not eligible, never "unknown, so eligible".
    api.nodes.event("DELETED", node_object("16"));
    let healthz = wait_status(
        node,
        "/healthz once the Node is deleted",
        HEALTHZ,
        "/healthz",
        503,
    );
    assert_eq!(healthz["nodeEligible"], false, "{healthz}");
    // The node keeps its address: traffic and the health-check node port go on.
    assert_eq!(
        get(node, CLUSTER_IP, "/"),
        pod_answer(),
        "traffic flows after the Node's deletion"
    );
    let hc = wait_status(node, "the health-check node port", HEALTH_CHECK, "/", 200);
    assert_eq!(hc["localEndpoints"], 1, "{hc}");
}

#[test]
fn a_service_proxy_name_makes_the_daemon_proxy_that_proxys_services_only() {
    if !can_run() {
        return;
    }
    let (fab, server, _run) = start(
        'p',
        "kpk4",
        "5s",
        &["--service-proxy-name", "other-proxy"],
        |api| {
            cluster(api);
            other_proxys(api);
        },
    );
    let (node, api) = (&fab.node, &server.api);
    let body = eventually(node, "the other proxy's cluster IP", || {
        http_get(addr("10.96.0.11:80"), "/")
    });
    assert_eq!(Some(body), pod_answer());
    let selector =
        "!service.kubernetes.io/headless,service.kubernetes.io/service-proxy-name=other-proxy";
    for res in [&api.services, &api.slices] {
        assert_eq!(
            res.requests()[0].get("labelSelector").map(String::as_str),
            Some(selector)
        );
    }
    // The fake server ignores selectors: web (no label) reached kproxy and was skipped.
    let table = Command::new("ip")
        .args([
            "netns", "exec", &node.0, "nft", "list", "table", "ip", "kpk4",
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&table.stdout);
    assert!(table.contains("10.96.0.11"), "{table}");
    assert!(
        !table.contains("10.96.0.10"),
        "a Service without the label programmed:\n{table}"
    );
}
