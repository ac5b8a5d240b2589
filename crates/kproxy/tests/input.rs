//! Issue 17 at the binary: `sync --once` never programs a state that lost objects to a
//! parse failure, and conflicts reach `plan` and `explain`. These run before any
//! nftables call, so they need no root.

use std::process::Command;

const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop, creationTimestamp: \"2020-01-01T00:00:00Z\"}\nspec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{name: http, port: 80, nodePort: 30080}]}\n";
const THIEF: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: aaa, namespace: aaa, creationTimestamp: \"2024-01-01T00:00:00Z\"}\nspec: {type: NodePort, clusterIP: 10.96.0.11, externalIPs: [10.96.0.10], ports: [{name: http, port: 80, nodePort: 30080}]}\n";

fn kproxy(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kproxy"))
        .args(args)
        .output()
        .expect("running kproxy")
}

#[test]
fn sync_once_programs_nothing_when_a_file_does_not_parse() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("good.yaml"), SVC).unwrap();
    std::fs::write(dir.path().join("bad.yaml"), "kind: [unclosed\n").unwrap();
    let out = kproxy(&[
        "sync",
        "--once",
        "--manifests",
        dir.path().to_str().unwrap(),
        "--node",
        "n",
        "--nft-table",
        "kproxy_input_never",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("bad.yaml") && stderr.contains("not programming"),
        "{stderr}"
    );
}

#[test]
fn nft_table_keywords_are_refused_at_the_flag() {
    let out = kproxy(&["cleanup", "--nft-table", "inet"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nft keyword"));
}

#[test]
fn plan_and_explain_show_who_lost_a_frontend() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), format!("{SVC}---\n{THIEF}")).unwrap();
    let m = dir.path().to_str().unwrap();
    let out = kproxy(&["plan", "--manifests", m, "--node", "n", "-o", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = v["conflicts"].as_array().expect("conflicts");
    let summary: Vec<(String, String)> = c
        .iter()
        .map(|c| {
            (
                c["frontend"]["kind"].as_str().unwrap().into(),
                c["reason"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            ("externalIp".to_string(), "clusterIpCapture".to_string()),
            ("nodePort".to_string(), "claimed".to_string())
        ]
    );
    assert!(c.iter().all(|c| c["service"] == "aaa/aaa"));
    let out = kproxy(&["explain", "--manifests", m, "--node", "n", "shop/web"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("frontend conflicts") && text.contains("belongs to shop/web"),
        "{text}"
    );
}
