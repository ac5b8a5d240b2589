//! Acceptance test of `kproxy lab takeover --recorded --back` (docs/migrate.md, the
//! recorded rulesets): the lab cluster (3 nodes, one pod each, the emulated GKE load
//! balancer probing the eTP=Local Service's health-check node port, new and keep-alive
//! connections through the VIP and from node 1 to the cluster IP) with real kube-proxy
//! v1.36.2's rules for this cluster loaded into every node (crates/lab/fixtures/kube-proxy),
//! then node by node kproxy takes over, then node by node the way back. No new
//! connection may fail, no established one break, no node leave the load balancer's
//! pool, and after each takeover nothing of kube-proxy's may be left on the node (after
//! each way back, nothing of kproxy's). Needs root (network namespaces, nftables,
//! iptables); nothing touches the host's network.
//!
//! At real GKE timing (`--time-scale 1`: a probe every 3 s, out after 2 failures): the
//! health-check node port is closed for the start of one process per handover, far
//! below that window, so a pool dip is a real regression. At the lab's default 0.15
//! scale (0.45 s between probes) a slow start on a busy CI machine can cost a probe
//! pair without any connection failing; docs/migrate.md has both tables.

mod common;

use std::process::Command;
use std::sync::Mutex;

/// One lab at a time: both runs load the machine's two cores.
static ONE_LAB: Mutex<()> = Mutex::new(());

fn recorded_takeover_and_back(mode: &str) {
    if !kproxy_test_support::root("kproxy lab: network namespaces, nftables, iptables") {
        return;
    }
    let _one = ONE_LAB.lock().unwrap_or_else(|e| e.into_inner());
    let out = Command::new(env!("CARGO_BIN_EXE_kproxy"))
        .args([
            "lab",
            "takeover",
            "--from",
            mode,
            "--recorded",
            "--back",
            "--time-scale",
            "1",
            "--hold-seconds",
            "1",
            "-o",
            "json",
        ])
        .output()
        .expect("run kproxy lab takeover");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v = common::json_report(&out);
    assert_eq!(v["kube_proxy"], "recorded");
    assert_eq!(v["from"], mode);
    let phases = v["phases"].as_array().expect("phases");
    let names: Vec<&str> = phases
        .iter()
        .map(|p| p["name"].as_str().unwrap_or("?"))
        .collect();
    let everywhere = format!("kube-proxy ({mode}) everywhere");
    assert_eq!(
        names,
        [
            everywhere.as_str(),
            "takeover node-1",
            "takeover node-2",
            "takeover node-3",
            "back node-1",
            "back node-2",
            "back node-3"
        ]
    );
    for p in phases {
        let name = p["name"].as_str().unwrap_or("?");
        common::assert_phase_lost_nothing(p, name, &stderr);
        assert_eq!(
            p["min_pool"], 3,
            "{name}: a node left the LB pool\n{stderr}"
        );
        assert_eq!(
            p["left"].as_array().map(Vec::len),
            Some(0),
            "{name}: left on the node: {}",
            p["left"]
        );
    }
    assert_eq!(v["failures"], 0);
    assert!(out.status.success(), "exit {:?}\n{stderr}", out.status);
}

#[test]
fn recorded_kube_proxy_nftables_takeover_and_back_lose_nothing() {
    recorded_takeover_and_back("nftables");
}

#[test]
fn recorded_kube_proxy_iptables_takeover_and_back_lose_nothing() {
    recorded_takeover_and_back("iptables");
}
