//! `kproxy sync --dry-run` through the real binary: it prints the script a full sync
//! would apply, with the settings of `--config`, and programs nothing (no root needed).

use std::process::Command;

fn dry_run(extra: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kproxy"))
        .args([
            "sync",
            "--dry-run",
            "--manifests",
            "examples/cluster",
            "--node",
            "node-a",
            "--nft-table",
            "kproxy-dry-run-test",
        ])
        .args(extra)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .output()
        .expect("run kproxy");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn dry_run_prints_both_families_full_script_with_the_default_mark() {
    let (code, out, err) = dry_run(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("add table ip kproxy-dry-run-test"), "{out}");
    assert!(out.contains("add table ip6 kproxy-dry-run-test"), "{out}");
    // masqueradeBit 14, upstream's default.
    assert!(out.contains("meta mark | 0x4000"), "{out}");
}

#[test]
fn dry_run_takes_the_masquerade_bit_from_the_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.yaml");
    std::fs::write(
        &cfg,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nnftables: {masqueradeBit: 3}\n",
    )
    .unwrap();
    let (code, out, err) = dry_run(&["--config", cfg.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("meta mark | 0x8 "),
        "masqueradeBit 3 not used:\n{out}"
    );
    assert!(
        !out.contains("0x4000"),
        "the default mark is still there:\n{out}"
    );
}
