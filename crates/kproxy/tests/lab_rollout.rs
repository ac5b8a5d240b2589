//! Acceptance tests of `kproxy lab rollout`: real rolling updates behind
//! the emulated load balancer, with the real kproxy daemon on every node, time
//! scaled. Needs root (network namespaces; nothing touches the host's network).
//! The runs are serialized: they share 2 cores with everything else.

mod common;

use std::path::Path;
use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

/// Time scale for the tests: large enough that scheduling noise on a busy 2-core
/// machine stays well inside the margins the scenarios are about.
const SCALE: &str = "0.15";

fn root() -> bool {
    kproxy_test_support::root("kproxy lab: network namespaces, nftables")
}

/// Run `kproxy lab rollout -o json` with `args`; returns (exit code, JSON).
fn rollout(args: &[&str], html: Option<&Path>) -> (i32, Value) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kproxy"));
    // Runs here lose requests by design: keep no log directory behind.
    cmd.env("KPROXY_LAB_KEEP", "0");
    cmd.args(["lab", "rollout", "-o", "json"]);
    if !args.contains(&"--time-scale") {
        cmd.args(["--time-scale", SCALE]);
    }
    match html {
        Some(path) => {
            cmd.arg("--html").arg(path);
        }
        None => {
            cmd.arg("--no-html");
        }
    }
    cmd.args(args);
    let out = cmd.output().expect("run kproxy lab rollout");
    let json = common::json_report(&out);
    (out.status.code().unwrap_or(-1), json)
}

fn runs(v: &Value) -> &Vec<Value> {
    v["runs"].as_array().expect("runs array")
}

fn n(v: &Value, k: &str) -> u64 {
    v[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {v}"))
}

/// The report's counts must equal the raw records it carries.
fn check_counts_match_records(run: &Value) {
    let records = run["records"].as_array().expect("records");
    let ok = records.iter().filter(|r| r["outcome"] == "ok").count() as u64;
    assert_eq!(n(run, "sent"), records.len() as u64);
    assert_eq!(n(run, "ok"), ok);
    assert_eq!(n(run, "failed"), records.len() as u64 - ok);
    let by_kind: u64 = run["failed_by_kind"]
        .as_object()
        .expect("kinds")
        .values()
        .map(|v| v.as_u64().unwrap_or(0))
        .sum();
    assert_eq!(by_kind, n(run, "failed"));
    assert!(
        n(run, "sent") > 100,
        "the load generator really sent load: {}",
        n(run, "sent")
    );
}

/// The report's kernel counters (issue 47 item 4): every node read, and the sums the
/// nodes' counts make.
fn kernel_counters(run: &Value) -> &Value {
    let k = &run["kernel_counters"];
    let nodes = k["nodes"]
        .as_array()
        .expect("the run read the nodes' kernel counters");
    assert_eq!(nodes.len(), 3, "{k}");
    assert!(nodes.iter().all(|n| n.get("error").is_none()), "{k}");
    let sum: u64 = nodes.iter().map(|x| n(x, "dropped")).sum();
    assert_eq!(sum, n(k, "kernel_dropped"), "{k}");
    k
}

fn failures_summary(run: &Value) -> String {
    format!(
        "{} run {}: {} of {} failed {}; bursts: {}",
        run["behaviour"],
        run["run"],
        run["failed"],
        run["sent"],
        run["failed_by_kind"],
        run["bursts"]
    )
}

#[test]
fn defaults_kproxy_behaviour_loses_nothing_over_five_rollouts() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !root() {
        return;
    }
    let (code, v) = rollout(&["--runs", "5"], None);
    let rs = runs(&v);
    assert_eq!(rs.len(), 5);
    for r in rs {
        assert_eq!(r["behaviour"], "kproxy");
        check_counts_match_records(r);
        assert_eq!(n(r, "failed"), 0, "{}", failures_summary(r));
        // The kernel saw every connection the load generator opened DNATed, none
        // rejected or dropped, and the terminating fallback carried some (the LB
        // sends to a node after its last pod became terminating).
        let k = kernel_counters(r);
        assert_eq!(n(k, "kernel_new"), n(k, "loadgen_connections"), "{k}");
        assert_eq!(
            (n(k, "kernel_rejected"), n(k, "kernel_dropped")),
            (0, 0),
            "{k}"
        );
        assert!(n(k, "kernel_fallback") > 0, "{k}");
    }
    assert_eq!(code, 0);
}

#[test]
fn pre_126_behaviour_loses_requests_in_every_run_and_the_report_says_why() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !root() {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, v) = rollout(
        &["--proxy-terminating-endpoints=false", "--runs", "2"],
        Some(&dir.path().join("report/rollout.html")),
    );
    let rs = runs(&v);
    assert_eq!(rs.len(), 2);
    for r in rs {
        assert_eq!(r["behaviour"], "pre-1.26");
        check_counts_match_records(r);
        assert!(
            n(r, "failed") > 0,
            "pre-1.26 behaviour should lose requests: {}",
            failures_summary(r)
        );
        let causes: Vec<&str> = r["bursts"]
            .as_array()
            .expect("bursts")
            .iter()
            .filter_map(|b| b["cause"].as_str())
            .collect();
        assert!(
            causes
                .iter()
                .any(|c| c.contains("after its last pod became terminating")),
            "a burst is explained by a node whose last pod was terminating: {causes:?}"
        );
        // The time-outs were the kernel's no-local drops: at least one dropped SYN
        // each (the retransmissions count again), and no fallback (pre-1.26 has none).
        let k = kernel_counters(r);
        assert!(
            n(k, "kernel_dropped") >= n(k, "loadgen_timed_out") && n(k, "loadgen_timed_out") > 0,
            "{k}"
        );
        assert_eq!(n(k, "kernel_fallback"), 0, "{k}");
    }
    // The HTML report exists where asked (its directory created), is named in the
    // JSON, and shows both runs with the timeline's legend.
    let html = dir.path().join("report/rollout.html");
    assert_eq!(v["html"], html.display().to_string());
    let page = std::fs::read_to_string(&html).expect("the HTML report");
    assert!(page.starts_with("<!DOCTYPE html>") && page.trim_end().ends_with("</html>"));
    assert!(page.contains("pre-1.26 run 1") && page.contains("pre-1.26 run 2"));
    assert!(page.contains("<b>Timeline:</b>"), "the legend");
}

#[test]
fn pre_stop_shorter_than_the_lb_detection_window_loses_requests_with_graceful_pods() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !root() {
        return;
    }
    // gke: up to 3 s × 2 failures before the node leaves the pool; 1 s of preStop is
    // far too short, so new connections reach a pod that stopped accepting.
    let (_, v) = rollout(&["--pre-stop", "1"], None);
    let r = &runs(&v)[0];
    check_counts_match_records(r);
    assert!(n(r, "failed") > 0, "{}", failures_summary(r));
}

/// Seed 2's inequality with `fail-readiness-on-term` pods, behind an LB slow enough
/// (20 s interval × 2) that it still sends new connections when readiness fails:
/// violated (5 + 5 × 1 < 45): the pod turns not serving while alive → loss;
/// satisfied (5 + 5 × 8 ≥ 45): killed before it turns not ready, after the LB
/// took its node out → no loss.
#[test]
fn fail_readiness_on_term_pods_lose_requests_only_when_seed_2_inequality_is_violated() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !root() {
        return;
    }
    let common = [
        "--pod-profile",
        "fail-readiness-on-term",
        "--pre-stop",
        "5",
        "--readiness-period",
        "5",
        "--termination-grace-period",
        "45",
        "--lb-preset",
        "custom",
        "--lb-interval",
        "20",
        "--lb-timeout",
        "1",
        "--lb-healthy-threshold",
        "1",
        "--lb-unhealthy-threshold",
        "2",
        "--time-scale",
        "0.1",
    ];
    let mut violated = common.to_vec();
    violated.extend(["--readiness-failure-threshold", "2"]);
    let (_, v) = rollout(&violated, None);
    let r = &runs(&v)[0];
    check_counts_match_records(r);
    assert!(
        n(r, "failed") > 0,
        "inequality violated: {}",
        failures_summary(r)
    );
    let causes = r["bursts"].to_string();
    assert!(causes.contains("readiness had already failed"), "{causes}");

    let mut satisfied = common.to_vec();
    satisfied.extend(["--readiness-failure-threshold", "9"]);
    let (_, v) = rollout(&satisfied, None);
    let r = &runs(&v)[0];
    check_counts_match_records(r);
    assert_eq!(
        n(r, "failed"),
        0,
        "inequality satisfied: {}",
        failures_summary(r)
    );
}
