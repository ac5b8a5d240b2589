//! The drain signals end to end, as root, in network namespaces this test creates: the
//! real `kproxy run` on the manifest source answers 503 on `/healthz` for the Node's
//! drain conditions and its deletion, and on SIGTERM drains (503, the rules still
//! forwarding) before it exits, leaving its rules (docs/health.md, "Drain signals").

mod common;

use std::path::Path;

use common::{
    Daemon, DaemonLog, Load, NODE, Netns, can_run, eventually, fabric, http_get, kproxy_run,
    manifests, send_sigterm, wait_exit, write_atomic,
};

fn start(node: &Netns, dir: &Path, table: &str, log: &DaemonLog, extra: &[&str]) -> Daemon {
    Daemon(
        kproxy_run(node, &["--manifests", dir.to_str().unwrap()])
            .args(["--min-sync-period", "50ms", "--sync-period", "5s"])
            .args(["--manifest-remove-after", "200ms", "--nft-table", table])
            .args(extra)
            .stderr(log.stderr())
            .spawn()
            .expect("start kproxy run"),
    )
}

/// Waits until `/healthz` answers `code` naming the drain `signals`.
fn healthz_says(node: &Netns, code: u16, signals: &[&str], what: &str) {
    let want = serde_json::json!(signals);
    eventually(node, what, move || {
        let (c, body) = http_get("127.0.0.1:10256".parse().unwrap(), "/healthz")?;
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        (c == code && v["drainSignals"] == want).then_some(())
    });
}

/// Waits for the daemon to exit by itself (the drain period is not timed: the bound
/// only keeps a broken build from hanging the suite).
fn exit_of(daemon: &mut Daemon) -> std::process::ExitStatus {
    wait_exit(daemon, 300)
}

/// SIGTERM with `--shutdown-drain always`: `/healthz` answers 503 (`shutdown`) while the
/// rules stay and forward every new connection and the health-check node port keeps its
/// truthful 200; then kproxy exits by itself, and the rules remain.
#[test]
fn sigterm_drains_with_503_while_the_rules_forward_then_exits_leaving_them() {
    if !can_run() {
        return;
    }
    let fab = fabric('d');
    let node = &fab.node;
    let dir = manifests();
    let log = DaemonLog::new();
    let table = "kpdrain";
    let args = [
        "--shutdown-drain",
        "always",
        "--shutdown-drain-period",
        "20s",
    ];
    let mut daemon = start(node, dir.path(), table, &log, &args);
    eventually(node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });
    healthz_says(node, 200, &[], "/healthz 200");
    let load = Load::start(node, false);
    send_sigterm(&daemon);
    healthz_says(node, 503, &["shutdown"], "/healthz 503 after SIGTERM");
    // Still draining (it answered 503 just now): the node port keeps its answer, the
    // rules are there, /livez says the proxy is fine.
    let (code, _) = node
        .run(|| http_get("10.200.0.11:32000".parse().unwrap(), "/"))
        .expect("the health-check node port answers during the drain");
    assert_eq!(code, 200, "the node still has a ready endpoint");
    let livez = node.run(|| http_get("127.0.0.1:10256".parse().unwrap(), "/livez"));
    assert_eq!(livez.map(|(c, _)| c), Some(200));
    node.exec(&["nft", "list", "table", "ip", table]);
    let during = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
    assert_eq!(
        during,
        Some((200, "pod-1".to_string())),
        "a new connection during the drain"
    );

    let status = exit_of(&mut daemon);
    assert!(status.success(), "{status:?}");
    node.exec(&["nft", "list", "table", "ip", table]);
    let after = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
    assert_eq!(after, Some((200, "pod-1".to_string())), "the rules remain");
    let (sent, failed, _) = load.stop();
    assert!(sent > 20, "the load generator ran ({sent} requests)");
    assert_eq!(
        failed, 0,
        "{failed} of {sent} new connections failed across the drain and exit"
    );
}

/// The Node's signals through the manifest source: `DrainInProgress` turns `/healthz`
/// to 503 and back when it clears; the Node removed from the manifests turns it to 503
/// for good; a SIGTERM then (the default `--shutdown-drain signalled`) drains, and a
/// second signal ends the drain at once.
#[test]
fn node_signals_from_the_manifests_and_a_signalled_shutdown_drain() {
    if !can_run() {
        return;
    }
    let fab = fabric('g');
    let node = &fab.node;
    let dir = manifests();
    let log = DaemonLog::new();
    let table = "kpsignal";
    // A long period: the drain ends by the second signal, not by the timer.
    let mut daemon = start(
        node,
        dir.path(),
        table,
        &log,
        &["--shutdown-drain-period", "1h"],
    );
    healthz_says(node, 200, &[], "/healthz 200");

    let draining = NODE.replace(
        "status: {addresses:",
        "status: {conditions: [{type: DrainInProgress, status: \"True\"}], addresses:",
    );
    assert_ne!(draining, NODE);
    write_atomic(dir.path(), "node.yaml", &draining);
    healthz_says(
        node,
        503,
        &["drainInProgress"],
        "/healthz 503 on DrainInProgress",
    );
    let via_cluster_ip = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
    assert_eq!(via_cluster_ip, Some((200, "pod-1".to_string())));
    write_atomic(dir.path(), "node.yaml", NODE);
    healthz_says(node, 200, &[], "/healthz 200 once the drain is called off");

    std::fs::remove_file(dir.path().join("node.yaml")).unwrap();
    healthz_says(
        node,
        503,
        &["nodeDeleted"],
        "/healthz 503 on the Node's deletion",
    );
    send_sigterm(&daemon);
    healthz_says(
        node,
        503,
        &["nodeDeleted", "shutdown"],
        "the shutdown drain",
    );
    send_sigterm(&daemon);
    let status = exit_of(&mut daemon);
    assert!(status.success(), "{status:?}");
    node.exec(&["nft", "list", "table", "ip", table]);
}
