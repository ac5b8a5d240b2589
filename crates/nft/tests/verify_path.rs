//! The periodic verification reads the kernel back over netlink and never asks `nft` to
//! list anything: `nft -j` of kproxy's tables took ~10 s at 10k Services × 10
//! endpoints, and the sync loop waits for a verification, so every verifyPeriod a
//! change waited that long. Intact tables run no `nft` at all; drift is named from the
//! read-back and repaired by the delta from it (never a listing).
//!
//! The test runs a child test process whose PATH starts with a directory holding an
//! `nft` that logs each call and runs the real one (PATH is process-wide; changing it
//! in this process would reach the other tests).

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use kproxy_core::planner::PlanUpdate;
use kproxy_nft::{Dataplane, DataplaneConfig};

const CHILD: &str = "KPROXY_VERIFY_PATH_LOG";

/// A directory removed when dropped (the test fails or not).
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn calls(log: &Path) -> usize {
    std::fs::read_to_string(log).map_or(0, |s| s.lines().count())
}

#[test]
fn verifying_intact_tables_runs_no_nft_and_drift_is_still_named_and_repaired() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let dir =
        TempDir(std::env::temp_dir().join(format!("kproxy-verify-path-{}", std::process::id())));
    std::fs::create_dir_all(dir.path()).unwrap();
    let real = sh("command -v nft");
    let wrapper = dir.path().join("nft");
    let log = dir.path().join("calls");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"$*\" >> {}\nexec {} \"$@\"\n",
            log.display(),
            real.trim()
        ),
    )
    .unwrap();
    sh(&format!("chmod +x {}", wrapper.display()));
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_verifies_with_logged_nft",
            "--ignored",
            "--nocapture",
        ])
        .env("PATH", path)
        .env(CHILD, &log)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("1 passed"),
        "the child test ran: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
#[ignore = "run by verifying_intact_tables_runs_no_nft_and_drift_is_still_named_and_repaired"]
fn child_verifies_with_logged_nft() {
    let log = std::path::PathBuf::from(std::env::var_os(CHILD).expect("run by the parent test"));
    let ns = Netns::new("verify");
    ns.run(move || {
        let plan = plan_from_yaml(&example_cluster(), "node-a", &Default::default());
        let mut dp = Dataplane::new(DataplaneConfig::default()).unwrap();
        dp.sync(&plan, &PlanUpdate::WHOLE).unwrap();
        let before = calls(&log);
        for _ in 0..3 {
            assert!(!dp.verify().unwrap().drift);
        }
        assert_eq!(
            calls(&log),
            before,
            "verifying intact tables ran nft: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        // Someone else edits kproxy's table: named from the read-back and repaired as
        // the kernel watch repairs, by the delta from what the kernel holds (element
        // only here: over netlink, no `nft` at all; at most one `nft -f` otherwise).
        sh("nft flush map ip kproxy service-ips");
        let before = calls(&log);
        assert_drift(&mut dp, &["map service-ips"]);
        let log_text = std::fs::read_to_string(&log).unwrap_or_default();
        let repair: Vec<&str> = log_text.lines().skip(before).collect();
        assert!(
            repair.iter().all(|c| *c == "-f -") && repair.len() <= 1,
            "the repair, and nothing listed: {repair:?}"
        );
        assert!(!dp.verify().unwrap().drift, "repaired");
    });
}
