//! `kproxy run` end to end, as root, in network namespaces this test creates: the real
//! daemon on the manifest source programs nftables, answers the health-check node port,
//! serves metrics, follows manifest changes (a pod becoming terminating), and leaves its
//! rules in place on SIGTERM.

#![expect(
    clippy::disallowed_types,
    reason = "times a real kproxy process: wall time"
)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::{
    Daemon, DaemonLog, Load, NODE, Netns, SERVICE, can_run, eventually, explain_web, fabric,
    http_get, kproxy_run_through, manifests, sigterm, slice, write_atomic,
};

fn start_daemon(node: &Netns, dir: &Path, table: &str, events: &Path, log: &DaemonLog) -> Daemon {
    start_daemon_to(node, dir, table, events, log, &[])
}

/// `kproxy run` started through `prefix` (a command that execs the rest, such as
/// `setpriv …`).
fn start_daemon_to(
    node: &Netns,
    dir: &Path,
    table: &str,
    events: &Path,
    log: &DaemonLog,
    prefix: &[&str],
) -> Daemon {
    Daemon(
        kproxy_run_through(node, prefix, &["--manifests", dir.to_str().unwrap()])
            .args(["--min-sync-period", "50ms", "--sync-period", "5s"])
            .args([
                "--nft-table",
                table,
                "--event-log",
                events.to_str().unwrap(),
            ])
            .stderr(log.stderr())
            .spawn()
            .expect("start kproxy run"),
    )
}

#[test]
fn run_programs_follows_changes_serves_health_and_metrics_and_keeps_rules_on_sigterm() {
    if !can_run() {
        return;
    }
    let fab = fabric('a');
    let node = &fab.node;
    let dir = manifests();
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpt";
    let daemon = start_daemon(node, dir.path(), table, &events, &log);
    // The cluster IP reaches the pod; the health-check node port says 200 with 1 endpoint.
    let body = eventually(node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });
    assert_eq!(body, (200, "pod-1".to_string()));
    let (code, hc) = eventually(node, "the health-check node port", || {
        http_get("10.200.0.11:32000".parse().unwrap(), "/")
    });
    assert_eq!(code, 200, "{hc}");
    let hc: serde_json::Value = serde_json::from_str(&hc).expect("health JSON");
    assert_eq!(hc["localEndpoints"], 1);
    assert_eq!(hc["service"]["namespace"], "shop");

    // The pod starts terminating: the health check says 503 while the cluster IP still
    // reaches the serving+terminating pod (failover to terminating endpoints).
    write_atomic(dir.path(), "slice.yaml", &slice(false));
    eventually(node, "the health check to fail", || {
        http_get("10.200.0.11:32000".parse().unwrap(), "/").filter(|(c, _)| *c == 503)
    });
    let still = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
    assert_eq!(
        still,
        Some((200, "pod-1".to_string())),
        "serving+terminating endpoint keeps serving"
    );

    // Proxy health and metrics.
    let (code, _) = eventually(node, "/healthz", || {
        http_get("127.0.0.1:10256".parse().unwrap(), "/healthz")
    });
    assert_eq!(code, 200);
    let (code, metrics) = eventually(node, "/metrics", || {
        http_get("127.0.0.1:10249".parse().unwrap(), "/metrics")
    });
    assert_eq!(code, 200);
    for name in [
        "kubeproxy_sync_proxy_rules_duration_seconds_count",
        "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
        "kubeproxy_proxy_healthz_total",
    ] {
        assert!(metrics.contains(name), "{name} missing from\n{metrics}");
    }
    // kube-proxy's mode URL, which upstream's e2e "should check kube-proxy urls" reads.
    let mode = node.run(|| http_get("127.0.0.1:10249".parse().unwrap(), "/proxyMode"));
    assert_eq!(mode, Some((200, "nftables".to_string())));

    // The event log recorded the syncs.
    let log = std::fs::read_to_string(&events).unwrap();
    let synced: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "synced")
        .collect();
    assert!(synced.len() >= 2, "{log}");
    assert_eq!(synced[0]["full"], true);

    // SIGTERM: exit 0, rules stay.
    let mut daemon = daemon;
    let status = sigterm(&mut daemon);
    assert!(status.success(), "{status:?}");
    node.exec(&["nft", "list", "table", "ip", table]);
    let still = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
    assert_eq!(
        still,
        Some((200, "pod-1".to_string())),
        "traffic keeps flowing with kproxy stopped"
    );
}

/// A client keeps requests flowing while `kproxy run` is stopped and started
/// again; the restarted daemon adopts its tables in one transaction, so new connections
/// succeed throughout and an established connection survives.
#[test]
fn restart_under_load_loses_nothing() {
    if !can_run() {
        return;
    }
    let fab = fabric('b');
    let dir = manifests();
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpr";
    let mut daemon = start_daemon(&fab.node, dir.path(), table, &events, &log);
    eventually(&fab.node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });

    // An established keep-alive connection, opened before the restart.
    let mut kept = fab
        .node
        .run(|| TcpStream::connect("10.96.0.10:80").expect("connect"));
    kept.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let ask = |s: &mut TcpStream| -> bool {
        let req = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        let mut buf = [0u8; 256];
        s.write_all(req).is_ok()
            && s.read(&mut buf)
                .is_ok_and(|n| n > 0 && buf[..n].ends_with(b"pod-1"))
    };
    assert!(ask(&mut kept));

    // New connections, one every 20 ms, from a thread in the node namespace.
    let load = Load::start(&fab.node, false);

    std::thread::sleep(Duration::from_millis(300));
    assert!(sigterm(&mut daemon).success());
    std::thread::sleep(Duration::from_millis(300));
    let _daemon = start_daemon(&fab.node, dir.path(), table, &events, &log);
    // Wait for the restarted daemon's first (full) sync.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(&events).unwrap_or_default();
        let fulls = log
            .lines()
            .filter(|l| l.contains("\"synced\"") && l.contains("\"full\":true"))
            .count();
        if fulls >= 2 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the restarted daemon never synced:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let (sent, failed, _) = load.stop();
    assert!(sent > 20, "the load generator ran ({sent} requests)");
    assert_eq!(
        failed, 0,
        "{failed} of {sent} new connections failed across the restart"
    );
    assert!(
        ask(&mut kept),
        "the established connection survived the restart"
    );
}

/// The manifests rewritten the way editors and `>` redirections write them —
/// truncated to 0 bytes first, then a partial write that keeps the first document and
/// cuts the next one mid-line, then the whole text — never reach the kernel: new
/// connections to the cluster IP and the health-check node port keep working throughout.
#[test]
fn truncated_and_partial_manifest_writes_under_run_lose_no_connection() {
    if !can_run() {
        return;
    }
    let fab = fabric('c');
    let dir = tempfile::tempdir().unwrap();
    let all = format!("{NODE}---{SERVICE}---{}", slice(true));
    write_atomic(dir.path(), "all.yaml", &all);
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpw";
    let mut daemon = start_daemon(&fab.node, dir.path(), table, &events, &log);
    eventually(&fab.node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });
    eventually(&fab.node, "the health-check node port to say 200", || {
        http_get("10.200.0.11:32000".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });

    // New connections to the cluster IP and probes of the health-check node port, one
    // each every 20 ms, from a thread in the node namespace.
    let load = Load::start(&fab.node, true);

    let file = dir.path().join("all.yaml");
    // The first document whole, the Service's cut in the middle of its flow mapping.
    let cut = all.find("metadata: {name: web").expect("service metadata") + 15;
    for _ in 0..3 {
        std::fs::write(&file, "").unwrap();
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&file, &all[..cut]).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        std::fs::write(&file, &all).unwrap();
        std::thread::sleep(Duration::from_millis(500));
    }
    let (sent, failed, unhealthy) = load.stop();
    assert!(sent > 20, "the load generator ran ({sent} requests)");
    assert_eq!(
        failed, 0,
        "{failed} of {sent} new connections to the cluster IP failed during the rewrites"
    );
    assert_eq!(
        unhealthy, 0,
        "{unhealthy} of {sent} health-check probes were not 200 during the rewrites"
    );
    assert!(sigterm(&mut daemon).success());
}

/// A health-check node port that cannot listen on the Node's primary
/// address (absent from the host) is reported with the Service and the reason: in the
/// metric, on the daemon's `/health-check-node-ports`, and by `kproxy explain --server`.
#[test]
fn a_health_check_port_on_an_absent_node_address_is_reported_in_metrics_and_explain() {
    if !can_run() {
        return;
    }
    let fab = fabric('h');
    let node = &fab.node;
    let dir = manifests();
    // The Node's primary address is not configured on the node namespace.
    write_atomic(
        dir.path(),
        "node.yaml",
        &NODE.replace("10.200.0.11", "10.200.0.99"),
    );
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let mut daemon = start_daemon(node, dir.path(), "kph", &events, &log);
    let (code, state) = eventually(node, "the health-check port to be reported", || {
        http_get(
            "127.0.0.1:10249".parse().unwrap(),
            "/health-check-node-ports",
        )
        .filter(|(_, body)| body.contains("address_absent"))
    });
    assert_eq!(code, 200, "{state}");
    let state: serde_json::Value = serde_json::from_str(&state).expect("JSON");
    let port = &state["healthCheckNodePorts"][0];
    assert_eq!(port["service"], "shop/web", "{state}");
    assert_eq!(port["listening"], serde_json::json!([]), "{state}");
    assert_eq!(
        port["unbound"][0]["address"], "10.200.0.99:32000",
        "{state}"
    );
    let (_, metrics) = node
        .run(|| http_get("127.0.0.1:10249".parse().unwrap(), "/metrics"))
        .expect("/metrics");
    let counted = r#"kproxy_health_check_node_port_bind_failures_total{namespace="shop",name="web",port="32000",reason="address_absent"} 1"#;
    assert!(metrics.lines().any(|l| l == counted), "{metrics}");

    let explain = explain_web(node, dir.path(), "http://127.0.0.1:10249");
    let out = String::from_utf8_lossy(&explain.stdout);
    assert!(
        explain.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&explain.stderr)
    );
    assert!(
        out.contains("NOT listening on 10.200.0.99:32000: the node address is not on this host (address_absent)"),
        "{out}"
    );
    assert!(sigterm(&mut daemon).success());
}

/// A restart on broken input wiped the node: `run` stopped (rules stay), the manifests
/// replaced by a cut kubectl List, a 0-byte file, a YAML syntax error, a cut JSON, or an
/// emptied directory, and the restarted `run` deleted every frontend 8 ms after start
/// while `/healthz` said 200 (the 0-byte and empty cases logged nothing). Now each start
/// keeps the tables (the cluster IP still answers), logs an error, answers 503 on
/// `/healthz` with `inputHeld`, and programs once valid input appears.
#[test]
fn a_restart_on_broken_or_empty_input_keeps_the_tables_until_the_input_is_whole() {
    if !can_run() {
        return;
    }
    let fab = fabric('e');
    let node = &fab.node;
    let top = tempfile::tempdir().unwrap();
    let dir = top.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    let valid = |dir: &Path| {
        write_atomic(dir, "node.yaml", NODE);
        write_atomic(dir, "service.yaml", SERVICE);
        write_atomic(dir, "slice.yaml", &slice(true));
    };
    valid(&dir);
    let events = top.path().join("events.jsonl");
    let table = "kpe";
    let log = DaemonLog::new();
    let mut daemon = start_daemon(node, &dir, table, &events, &log);
    eventually(node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });
    let list_item = |doc: &str| -> String {
        doc.trim_start()
            .lines()
            .enumerate()
            .map(|(i, l)| format!("{}{l}\n", if i == 0 { "- " } else { "  " }))
            .collect()
    };
    let cut_list = format!("apiVersion: v1\nitems:\n{}", list_item(SERVICE));
    let cut_json = r#"{"apiVersion":"v1","kind":"List","items":[{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","#;
    let cases: [(&str, Option<(&str, &str)>); 5] = [
        (
            "a kubectl List cut before its kind",
            Some(("all.yaml", cut_list.as_str())),
        ),
        ("a 0-byte file", Some(("all.yaml", ""))),
        (
            "a YAML syntax error",
            Some(("all.yaml", "kind: [Service\n")),
        ),
        ("a cut JSON", Some(("all.json", cut_json))),
        ("an emptied directory", None),
    ];
    for (case, file) in &cases {
        assert!(sigterm(&mut daemon).success(), "{case}");
        for e in std::fs::read_dir(&dir).unwrap() {
            std::fs::remove_file(e.unwrap().path()).unwrap();
        }
        if let Some((name, text)) = file {
            std::fs::write(dir.join(name), text).unwrap();
        }
        // This start's part of the log.
        let before = std::fs::read_to_string(log.path())
            .unwrap_or_default()
            .len();
        daemon = start_daemon(node, &dir, table, &events, &log);
        let (code, body) = eventually(node, "/healthz to say the input is held", || {
            http_get("127.0.0.1:10256".parse().unwrap(), "/healthz")
                .filter(|(_, b)| b.contains("\"inputHeld\":true"))
        });
        assert_eq!(code, 503, "{case}: {body}");
        let still = node.run(|| http_get("10.96.0.10:80".parse().unwrap(), "/"));
        assert_eq!(
            still,
            Some((200, "pod-1".to_string())),
            "{case}: the rules stay"
        );
        let stderr = std::fs::read_to_string(log.path()).unwrap()[before..].to_string();
        assert!(
            stderr.contains("ERROR") && stderr.contains("not programming"),
            "{case}: {stderr}"
        );
    }
    // Valid input appears while held: programmed, /healthz 200.
    valid(&dir);
    let (_, body) = eventually(node, "/healthz to say 200 once the input is whole", || {
        http_get("127.0.0.1:10256".parse().unwrap(), "/healthz").filter(|(c, _)| *c == 200)
    });
    assert!(body.contains("\"inputHeld\":false"), "{body}");
    assert!(sigterm(&mut daemon).success());
}

/// One unrelated broken YAML file programmed fine on a fresh node, but after a restart
/// on the same files the guard held for good although the kernel's rules were exactly
/// what that input programs: endpoint changes never applied, `/healthz` 503, `/livez`
/// 503 by ~70 s, a restart loop. Now partial input whose plan the kernel holds exactly
/// is programmed (nothing changes in the kernel), `/healthz` says 200, and the next
/// endpoint change applies.
#[test]
fn a_restart_on_the_same_partial_input_is_not_held() {
    if !can_run() {
        return;
    }
    let fab = fabric('g');
    let node = &fab.node;
    let top = tempfile::tempdir().unwrap();
    let dir = top.path().join("m");
    std::fs::create_dir(&dir).unwrap();
    write_atomic(&dir, "node.yaml", NODE);
    write_atomic(&dir, "service.yaml", SERVICE);
    write_atomic(&dir, "slice.yaml", &slice(true));
    write_atomic(&dir, "unrelated.yaml", "kind: [Service\n");
    let events = top.path().join("events.jsonl");
    let table = "kpg";
    let log = DaemonLog::new();
    let mut daemon = start_daemon(node, &dir, table, &events, &log);
    eventually(node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });
    assert!(sigterm(&mut daemon).success());
    let mut daemon = start_daemon(node, &dir, table, &events, &log);
    let (_, body) = eventually(node, "/healthz 200 after the restart", || {
        http_get("127.0.0.1:10256".parse().unwrap(), "/healthz").filter(|(c, _)| *c == 200)
    });
    assert!(body.contains("\"inputHeld\":false"), "{body}");
    // The pod starts terminating: the change applies (its health check says 503).
    write_atomic(&dir, "slice.yaml", &slice(false));
    eventually(node, "the endpoint change to apply", || {
        http_get("10.200.0.11:32000".parse().unwrap(), "/").filter(|(c, _)| *c == 503)
    });
    let stderr = std::fs::read_to_string(log.path()).unwrap();
    assert!(!stderr.contains("not programming"), "{stderr}");
    assert!(sigterm(&mut daemon).success());
}

/// The table's text in the node namespace.
fn table_text(node: &Netns, table: &str) -> String {
    let out = Command::new("ip")
        .args([
            "netns", "exec", &node.0, "nft", "list", "table", "ip", table,
        ])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// One unreadable subdirectory froze `run` (every rescan failed: changes elsewhere
/// waited 70 s and more) and logged 88 warnings a second. It costs only itself: its
/// Services stay, a change elsewhere is programmed, and it is logged once.
#[test]
fn an_unreadable_subdirectory_under_run_costs_only_itself_and_is_logged_once() {
    if !can_run() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let fab = fabric('u');
    let node = &fab.node;
    let top = tempfile::tempdir().unwrap();
    let dir = top.path().join("m");
    std::fs::create_dir_all(dir.join("locked")).unwrap();
    write_atomic(&dir, "node.yaml", NODE);
    write_atomic(&dir, "service.yaml", SERVICE);
    write_atomic(&dir, "slice.yaml", &slice(true));
    let svc = |name: &str, ip: &str| {
        format!(
            "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: shop}}\nspec: {{clusterIP: {ip}, ports: [{{port: 80}}]}}\n"
        )
    };
    write_atomic(
        &dir.join("locked"),
        "other.yaml",
        &svc("other", "10.96.0.12"),
    );
    let events = top.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpu";
    let mut daemon = start_daemon_to(
        node,
        &dir,
        table,
        &events,
        &log,
        &["setpriv", "--bounding-set=-dac_override,-dac_read_search"],
    );
    let wait_table = |what: &str, f: &dyn Fn(&str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = table_text(node, table);
            if f(&text) {
                return text;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    wait_table("both Services", &|t| {
        t.contains("10.96.0.10") && t.contains("10.96.0.12")
    });
    let locked = dir.join("locked");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    write_atomic(&dir, "third.yaml", &svc("third", "10.96.0.13"));
    wait_table("the change beside it", &|t| t.contains("10.96.0.13"));
    // Past --manifest-remove-after, and more rescans.
    for i in 0..5 {
        std::thread::sleep(Duration::from_millis(300));
        write_atomic(
            &dir,
            "third.yaml",
            &svc("third", &format!("10.96.0.{}", 13 + i % 2)),
        );
    }
    std::thread::sleep(Duration::from_millis(500));
    let text = table_text(node, table);
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(
        text.contains("10.96.0.12"),
        "the unreadable directory's Service stays:\n{text}"
    );
    assert!(sigterm(&mut daemon).success());
    let stderr = std::fs::read_to_string(log.path()).unwrap();
    assert_eq!(
        stderr.matches("cannot list this directory").count(),
        1,
        "{stderr}"
    );
}

/// `kproxy run` and `kproxy cleanup` with no `nft` on `PATH` (issue 39): the first sync
/// programs the tables (a real connection to the cluster IP through them), a flushed
/// ruleset is repaired, and `cleanup` removes both tables, every write over nfnetlink.
/// `PATH` holds only `ip`; the daemon's first sync forked `nft` before.
#[test]
fn run_programs_repairs_and_cleanup_removes_with_no_nft_on_path() {
    if !can_run() {
        return;
    }
    let bin = tempfile::tempdir().unwrap();
    let ip = ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("the ip tool");
    std::os::unix::fs::symlink(ip, bin.path().join("ip")).unwrap();
    let path = format!("PATH={}", bin.path().display());
    let no_nft = ["env", path.as_str()];
    // The stripped PATH has no nft: what the daemon would have forked is not there.
    let found = Command::new("env")
        .args([path.as_str(), "sh", "-c", "command -v nft"])
        .output()
        .unwrap();
    assert!(!found.status.success(), "nft is on the stripped PATH");

    let fab = fabric('p');
    let node = &fab.node;
    let dir = manifests();
    let events = dir.path().join("events.jsonl");
    let log = DaemonLog::new();
    let table = "kpn";
    let mut daemon = start_daemon_to(node, dir.path(), table, &events, &log, &no_nft);
    let body = eventually(node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });
    assert_eq!(body, (200, "pod-1".to_string()));

    // Another process (the test's own nft) flushes the ruleset; kproxy restores it.
    node.exec(&["nft", "flush", "ruleset"]);
    let log_path = log.path().to_path_buf();
    eventually(node, "the repair to be logged", move || {
        std::fs::read_to_string(&log_path)
            .ok()
            .filter(|t| t.contains("kproxy's nftables tables repaired"))
    });
    let body = eventually(node, "the cluster IP to answer again", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/")
    });
    assert_eq!(body, (200, "pod-1".to_string()));
    assert!(table_text(node, table).contains("nat-prerouting"));
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(!text.contains("nft -f"), "{text}");

    let status = sigterm(&mut daemon);
    assert!(status.success(), "{status:?}");
    kproxy_test_support::run(
        node.kproxy_through(&no_nft, "cleanup")
            .args(["--nft-table", table]),
    );
    let tables = Command::new("ip")
        .args(["netns", "exec", &node.0, "nft", "list", "tables"])
        .output()
        .unwrap();
    let tables = String::from_utf8_lossy(&tables.stdout);
    assert!(!tables.contains(table), "{tables}");
}
