//! Acceptance test of `kproxy lab matrix`: the reduced matrix CI runs, real
//! rollouts with the real kproxy daemon on every node, and its HTML report rendered
//! in a real headless browser. Needs root (network namespaces; nothing touches the
//! host's network). The full matrix is `kproxy lab matrix` (docs/lab.md).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn cell<'a>(cells: &'a [Value], id: &str) -> &'a Value {
    cells
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("no cell {id}"))
}

fn lost(c: &Value) -> u64 {
    c["lost"].as_u64().expect("lost")
}

fn describe(c: &Value) -> String {
    format!(
        "{}: {} of {} lost, verdict {}, lint {}, bursts {}",
        c["id"], c["lost"], c["sent"], c["verdict"], c["lint"], c["bursts"]
    )
}

#[test]
fn reduced_matrix_proves_the_prestop_rule_and_kproxy_survives_a_restart_drains_and_a_shutdown() {
    if !kproxy_test_support::root("kproxy lab: network namespaces, nftables") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let html = dir.path().join("matrix.html");
    let out = Command::new(env!("CARGO_BIN_EXE_kproxy"))
        // Cells here lose requests by design: keep no log directory behind.
        .env("KPROXY_LAB_KEEP", "0")
        .args([
            "lab",
            "matrix",
            "--reduced",
            "-o",
            "json",
            "--time-scale",
            "0.15",
        ])
        .arg("--html")
        .arg(&html)
        .output()
        .expect("run kproxy lab matrix");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON ({e}); exit {:?}\nstderr:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let cells = v["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), 14, "{stdout}");
    for c in cells {
        assert!(c["sent"].as_u64().unwrap_or(0) > 100, "{}", describe(c));
    }

    // Seed 2's settings behind gke: lint is clean on its rules and kproxy loses
    // nothing; pre-1.26 behaviour loses requests with the very same settings.
    let rec = cell(cells, "graceful/recommended/gke/kproxy");
    assert_eq!(lost(rec), 0, "{}", describe(rec));
    assert_eq!(rec["verdict"], "clean-confirmed", "{}", describe(rec));
    let pre = cell(cells, "graceful/recommended/gke/pre-1.26");
    assert!(lost(pre) > 0, "{}", describe(pre));

    // preStop 1 s: lint's prestop rule fires and the packets confirm it.
    let short = cell(cells, "graceful/short-prestop/gke/kproxy");
    assert!(lost(short) > 0, "{}", describe(short));
    assert_eq!(short["verdict"], "confirmed", "{}", describe(short));
    assert!(
        short["bursts"]
            .to_string()
            .contains("preStop sleep is shorter"),
        "{}",
        describe(short)
    );

    // Every node's kproxy restarted while a pod is serving-terminating: nothing lost.
    let restart = cell(cells, "graceful/kproxy-restart/gke/kproxy");
    assert_eq!(lost(restart), 0, "{}", describe(restart));

    // Node drain (eTP Cluster, the LB probes /healthz): without KEP-3836 the deleted
    // node keeps receiving new connections until the LB notices it is gone; with
    // kproxy the taint took it out first, so at most the requests on keep-alive
    // connections established through the node fail (one per connection: the
    // reconnect goes to a node in the pool), never a new connection.
    let new_conn_cause = "still sent it new connections";
    let pre = cell(cells, "graceful/node-drain/gke/pre-1.26");
    assert!(lost(pre) > 0, "{}", describe(pre));
    assert!(
        pre["bursts"].to_string().contains("kept answering 200"),
        "{}",
        describe(pre)
    );
    let drain = cell(cells, "graceful/node-drain/gke/kproxy");
    assert!(lost(drain) <= 4, "{}", describe(drain));
    assert!(
        !drain["bursts"].to_string().contains(new_conn_cause),
        "{}",
        describe(drain)
    );
    assert!(
        drain["lint"].as_array().is_some_and(Vec::is_empty),
        "{}",
        describe(drain)
    );
    // Pods Ready 400 ms before they listen (no readiness probe), eTP Cluster: kproxy's
    // endpoint warm-up holds each new pod while the others serve, so no connection is
    // refused; pre-1.26 behaviour (no warm-up) sends the new pod connections at once.
    let late = cell(cells, "graceful/ready-before-listen/gke/kproxy");
    assert_eq!(lost(late), 0, "{}", describe(late));
    let pre = cell(cells, "graceful/ready-before-listen/gke/pre-1.26");
    assert!(lost(pre) > 0, "{}", describe(pre));

    // The same drain told by the Node condition DrainInProgress (KEP-5683), and a
    // graceful node shutdown whose kproxy is SIGTERMed one LB interval after the
    // condition GracefulNodeShutdownInProgress, the node gone once kproxy exits: kproxy
    // loses no new connection (its shutdown drain holds the node until the LB has
    // taken it out); kube-proxy's behaviour (neither condition read, no drain period)
    // loses new connections to the node that vanished.
    for setting in ["node-drain-condition", "node-shutdown"] {
        let pre = cell(cells, &format!("graceful/{setting}/gke/pre-1.26"));
        assert!(lost(pre) > 0, "{}", describe(pre));
        assert!(
            pre["bursts"].to_string().contains(new_conn_cause),
            "{}",
            describe(pre)
        );
        let drain = cell(cells, &format!("graceful/{setting}/gke/kproxy"));
        let kept = drain["lost_kept_alive"].as_u64().expect("lost_kept_alive");
        assert_eq!(lost(drain), kept, "only keep-alive: {}", describe(drain));
        assert!(
            !drain["bursts"].to_string().contains(new_conn_cause),
            "{}",
            describe(drain)
        );
    }
    assert_eq!(out.status.code(), Some(0));

    check_in_browser(&html, cells);
}

/// Render the report in headless chromium and check the DOM it built shows every
/// cell's numbers and one failure mark per lost request.
fn check_in_browser(html: &Path, cells: &[Value]) {
    let Some(browser) = browser() else {
        eprintln!(
            "skipped the browser check: no chromium and `apt-get install -y chromium` failed"
        );
        return;
    };
    let profile = tempfile::tempdir().expect("profile dir");
    let out = Command::new("timeout")
        .arg("120")
        .arg(&browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--dump-dom",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("file://{}", html.display()))
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        dom.contains("Scenario matrix"),
        "chromium built no report DOM (exit {:?}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for c in cells {
        let id = c["id"].as_str().expect("id");
        assert!(dom.contains(id), "{id} shown");
        let sent = format!("<td class=\"num\">{}</td>", c["sent"]);
        assert!(dom.contains(&sent), "{id}: sent {} shown", c["sent"]);
    }
    let total_lost: u64 = cells.iter().map(lost).sum();
    let marks = dom.matches("class=\"fail\"").count() as u64;
    assert_eq!(marks, total_lost, "one failure mark per lost request");
}

fn browser() -> Option<PathBuf> {
    let find = || {
        ["chromium", "chromium-browser", "google-chrome"]
            .iter()
            .find_map(|b| {
                std::env::var_os("PATH").and_then(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join(b))
                        .find(|f| f.is_file())
                })
            })
    };
    if let Some(b) = find() {
        return Some(b);
    }
    eprintln!("installing chromium for the HTML report check");
    let _ = Command::new("apt-get").args(["update", "-qq"]).status();
    let ok = Command::new("apt-get")
        .args(["install", "-y", "-qq", "chromium"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .is_ok_and(|s| s.success());
    if ok { find() } else { None }
}
