//! `kproxy preflight` in network namespaces made to look like nodes: one holding
//! upstream kube-proxy's recorded nftables table (the kube-proxy line names its mode and
//! the takeover), one where the kernel refuses nftables to the process (every nftables
//! line fails with the kernel's refusal, exit 1). Root only; needs `nft` (to load
//! kube-proxy's recorded table: the test's set-up, not preflight's path) and `setpriv`.

mod common;

use std::process::{Command, Output};

use common::{Netns, can_run};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kube-proxy");

/// `kproxy preflight` inside `ns`, through `wrap` (e.g. `setpriv …`) when given.
fn preflight(ns: &Netns, wrap: &[&str]) -> (i32, String) {
    let out: Output = Command::new("ip")
        .args(["netns", "exec", &ns.0])
        .args(wrap)
        .arg(env!("CARGO_BIN_EXE_kproxy"))
        .arg("preflight")
        .output()
        .expect("run kproxy preflight");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    (
        out.status.code().unwrap_or(-1),
        format!("{stdout}\n--- stderr ---\n{stderr}"),
    )
}

fn line<'a>(out: &'a str, name: &str) -> &'a str {
    out.lines()
        .find(|l| {
            l.get(5..)
                .is_some_and(|rest| rest.starts_with(&format!("{name}: ")))
        })
        .unwrap_or_else(|| panic!("no {name} line:\n{out}"))
}

/// A namespace holding kube-proxy's nftables table: every nftables feature loads in the
/// scratch namespace, and the kube-proxy line names the mode and what the takeover does
/// (no kube-proxy runs: remove it once kproxy's own tables are up).
#[test]
fn kube_proxys_table_is_named_with_the_takeover() {
    if !can_run() {
        return;
    }
    let ns = Netns::new("preflight-kp");
    ns.exec(&["nft", "-f", &format!("{FIXTURES}/nftables.nft")]);
    let (code, out) = preflight(&ns, &[]);
    for feature in [
        "nf_tables",
        "nftables maps",
        "nftables fib",
        "nftables interval sets",
        "nftables dynamic sets",
        "nftables reject",
        "conntrack netlink",
    ] {
        assert!(line(&out, feature).starts_with("ok   "), "{out}");
    }
    let kp = line(&out, "kube-proxy");
    assert!(
        kp.starts_with("ok   kube-proxy: nftables mode rules on the node (nft table ip kube-proxy"),
        "{out}"
    );
    assert!(
        kp.contains("no kube-proxy runs: kproxy run will program its own tables first, then remove exactly these"),
        "{out}"
    );
    assert_eq!(code, 0, "{out}");
    // The node's rules are untouched: kube-proxy's table is still there, and no
    // preflight table was left in the node's namespace.
    let tables = Command::new("ip")
        .args(["netns", "exec", &ns.0, "nft", "list", "tables"])
        .output()
        .expect("nft list tables");
    let tables = String::from_utf8_lossy(&tables.stdout);
    assert!(tables.contains("table ip kube-proxy"), "{tables}");
    assert!(!tables.contains("preflight"), "{tables}");

    // Without kube-proxy's table the line says none is there.
    let clean = Netns::new("preflight-clean");
    let (_, out) = preflight(&clean, &[]);
    assert!(
        line(&out, "kube-proxy").starts_with("ok   kube-proxy: none on the node"),
        "{out}"
    );
}

/// The kernel refusing nftables (the process without CAP_NET_ADMIN, as in a pod that
/// was not given it): each nftables line fails with the kernel's words, and the exit
/// status is 1.
#[test]
fn a_refused_feature_fails_its_line_and_the_run() {
    if !can_run() {
        return;
    }
    let ns = Netns::new("preflight-nocap");
    let (code, out) = preflight(
        &ns,
        &[
            "setpriv",
            "--inh-caps=-net_admin",
            "--bounding-set=-net_admin",
        ],
    );
    let nf = line(&out, "nf_tables");
    assert!(
        nf.starts_with("FAIL nf_tables: tables in both families"),
        "{out}"
    );
    assert!(nf.contains("Operation not permitted"), "{out}");
    assert!(
        line(&out, "nftables dynamic sets").starts_with("FAIL "),
        "{out}"
    );
    assert!(
        line(&out, "conntrack netlink").starts_with("FAIL "),
        "{out}"
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("preflight: "), "{out}");
}
