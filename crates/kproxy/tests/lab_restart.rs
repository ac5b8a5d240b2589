//! Acceptance test of `kproxy lab restart`: node 1's kproxy is
//! restarted (SIGTERM), killed (SIGKILL) and replaced by another binary while load
//! runs through an eTP=Local LB and a cluster IP; no new connection may fail and no
//! established one break. Needs root (network namespaces; nothing touches the host's
//! network). Bounded: a time-scaled cluster and 2 s of load per phase.

mod common;

use std::process::Command;

#[test]
fn restart_kill_and_upgrade_under_load_lose_nothing() {
    if !kproxy_test_support::root("kproxy lab: network namespaces, nftables") {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_kproxy"))
        .args(["lab", "restart", "-o", "json", "--hold-seconds", "2"])
        .output()
        .expect("run kproxy lab restart");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v = common::json_report(&out);
    let phases = v["phases"].as_array().expect("phases");
    let names: Vec<&str> = phases
        .iter()
        .map(|p| p["disturbance"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(names, ["none", "sigterm", "sigkill", "upgrade"]);
    for p in phases {
        let d = p["disturbance"].as_str().unwrap_or("?");
        if d != "none" {
            assert!(
                p["converged_ms"].as_f64().is_some(),
                "{d}: the new process never synced"
            );
        }
        common::assert_phase_lost_nothing(p, d, &stderr);
    }
    assert_eq!(v["failures"], 0);
    assert!(out.status.success(), "exit {:?}\n{stderr}", out.status);
}
