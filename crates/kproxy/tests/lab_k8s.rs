//! `kproxy lab rollout --control-plane k8s-lab`: the rolling update is
//! performed by a real kube-controller-manager (Deployment, ReplicaSet and
//! EndpointSlice controllers) behind a real kube-apiserver; every node's kproxy
//! watches that API. Opt-in: needs root and a running k8s-lab instance named by
//! K8S_LAB (kube-apiserver + kube-controller-manager; docs/lab.md, "The real control
//! plane", says how to start one). CI cannot build the lab, so the tests are
//! `#[ignore]`d with that reason: `cargo test` lists them as ignored, visibly, instead
//! of passing without running (a skip printed from inside a test is swallowed by the
//! test runner's capture, and the summary would count it as passed). Run them with
//! `--ignored`; then a missing K8S_LAB or root fails.
//!
//! K8S_LAB=../k8s-lab-NAME cargo test -p kproxy --test lab_k8s -- --ignored --test-threads 1

mod common;

use std::process::Command;
use std::sync::Mutex;

use serde_json::Value;

static SERIAL: Mutex<()> = Mutex::new(());

/// Asked for with `--ignored`: what the tests need must be there.
fn require_lab() {
    assert!(
        std::env::var_os("K8S_LAB").is_some(),
        "set K8S_LAB to a running k8s-lab instance (start.sh start && start.sh kcm) to run the lab against the real control plane"
    );
    assert!(kproxy_lab::is_root(), "kproxy lab needs root");
}

fn rollout(args: &[&str]) -> (i32, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_kproxy"))
        // Runs here lose requests by design: keep no log directory behind.
        .env("KPROXY_LAB_KEEP", "0")
        .args(["lab", "rollout", "-o", "json", "--no-html"])
        .args(args)
        .output()
        .expect("run kproxy lab rollout");
    let json = common::json_report(&out);
    (out.status.code().unwrap_or(-1), json)
}

fn failed(r: &Value) -> u64 {
    r["failed"].as_u64().expect("failed count")
}

fn events<'a>(r: &'a Value, kind: &str) -> Vec<&'a Value> {
    r["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["kind"] == kind)
        .collect()
}

/// The run really went through kcm: pods named by the ReplicaSet controller
/// (`web-<template hash>-<suffix>`, not the emulation's `web-r1-1`), the real
/// EndpointSlice controller published serving-terminating endpoints.
fn check_real_controllers(r: &Value) {
    assert_eq!(r["control_plane"], "k8s-lab", "{}", r["control_plane"]);
    let created = events(r, "pod_created");
    assert_eq!(created.len(), 6, "3 pods of revision 1, 3 of revision 2");
    for e in &created {
        let pod = e["pod"].as_str().expect("pod name");
        let parts: Vec<&str> = pod.split('-').collect();
        assert!(
            parts.len() == 3 && parts[0] == "web" && !parts[1].starts_with('r'),
            "pod {pod} was not named by the ReplicaSet controller"
        );
    }
    let slices = events(r, "slice_published");
    assert!(
        slices
            .iter()
            .any(|e| e["detail"].as_str().unwrap_or("").contains(":-ST")),
        "no serving-terminating endpoint published by the EndpointSlice controller"
    );
}

#[test]
#[ignore = "needs K8S_LAB (a k8s-lab instance: start.sh start && start.sh kcm) and root; run with --ignored"]
fn real_control_plane_rollout_loses_nothing_with_kproxy_and_requests_before_1_26() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_lab();
    let (code, v) = rollout(&["--control-plane", "k8s-lab", "--compare"]);
    let runs = v["runs"].as_array().expect("runs");
    assert_eq!(runs.len(), 2);
    for r in runs {
        check_real_controllers(r);
        let summary = format!("{} {} of {}", r["behaviour"], r["failed"], r["sent"]);
        match r["behaviour"].as_str() {
            Some("kproxy") => assert_eq!(failed(r), 0, "{summary}: {}", r["bursts"]),
            Some("pre-1.26") => assert!(failed(r) > 0, "{summary}: pre-1.26 should lose"),
            other => panic!("unexpected behaviour {other:?}"),
        }
    }
    assert_eq!(code, 0);
}

#[test]
#[ignore = "needs K8S_LAB (a k8s-lab instance: start.sh start && start.sh kcm) and root; run with --ignored"]
fn both_control_planes_side_by_side() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_lab();
    let (code, v) = rollout(&["--control-plane", "emulated,k8s-lab"]);
    let runs = v["runs"].as_array().expect("runs");
    let planes: Vec<&str> = runs
        .iter()
        .filter_map(|r| r["control_plane"].as_str())
        .collect();
    assert_eq!(planes, ["emulated", "k8s-lab"]);
    check_real_controllers(&runs[1]);
    let cmp = v["comparison"].as_array().expect("comparison");
    assert_eq!(cmp.len(), 1);
    let rows = cmp[0]["rows"].as_array().expect("rows");
    // Every step of the emulated rollout happened on the real control plane too.
    for step in ["step1", "step2", "step3"] {
        for what in ["old pod terminating #1", "new pod ready #1"] {
            let name = format!("{step} {what}");
            let row = rows
                .iter()
                .find(|r| r["what"] == name.as_str())
                .unwrap_or_else(|| panic!("no milestone {name} in {rows:?}"));
            assert!(
                row["emulated_s"].is_f64() && row["k8s_lab_s"].is_f64(),
                "{row}"
            );
        }
    }
    assert_eq!(code, 0);
}
