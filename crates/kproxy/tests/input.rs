//! `sync --once` never programs a state that lost objects to a
//! parse failure, and conflicts reach `plan` and `explain`. These run before any
//! nftables call, so they need no root.

use std::process::Command;

mod common;

const SVC: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop, creationTimestamp: \"2020-01-01T00:00:00Z\"}\nspec: {type: NodePort, clusterIP: 10.96.0.10, ports: [{name: http, port: 80, nodePort: 30080}]}\n";
const THIEF: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: aaa, namespace: aaa, creationTimestamp: \"2024-01-01T00:00:00Z\"}\nspec: {type: NodePort, clusterIP: 10.96.0.11, externalIPs: [10.96.0.10], ports: [{name: http, port: 80, nodePort: 30080}]}\n";

fn kproxy(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kproxy"))
        .args(args)
        .output()
        .expect("running kproxy")
}

/// `sync --once` of the manifests in `dir`, into a table nothing else uses: for input it
/// must refuse before any nftables call.
fn sync_once_refused(dir: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let m = dir.to_str().unwrap();
    let mut args = vec!["sync", "--once", "--manifests", m, "--node", "n"];
    args.extend_from_slice(&["--nft-table", "kproxy_input_never"]);
    args.extend_from_slice(extra);
    kproxy(&args)
}

#[test]
fn sync_once_programs_nothing_when_a_file_does_not_parse() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("good.yaml"), SVC).unwrap();
    std::fs::write(dir.path().join("bad.yaml"), "kind: [unclosed\n").unwrap();
    let out = sync_once_refused(dir.path(), &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("bad.yaml") && stderr.contains("not programming"),
        "{stderr}"
    );
}

/// A `kubectl get -o yaml` dump cut short before its `kind: List` line, and a
/// misspelt kind, were read as "no objects": `sync --once --strict` exited 0, "synced 0".
#[test]
fn sync_once_programs_nothing_when_a_document_has_no_kind_or_an_unknown_one() {
    let cut = "apiVersion: v1\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: a, namespace: b}\n  spec: {clusterIP: 10.96.99.1, ports: [{port: 80}]}\n";
    for (text, want) in [
        (
            cut.to_string(),
            "c.yaml: document 0: document: .kind: no kind",
        ),
        (
            SVC.replace("kind: Service", "kind: Servic"),
            "did you mean Service?",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("c.yaml"), text).unwrap();
        let out = sync_once_refused(dir.path(), &["--strict"]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains(want) && stderr.contains("not programming"),
            "{stderr}"
        );
    }
}

/// `sync --once` on an empty directory or a 0-byte file removed every rule
/// kproxy had programmed (exit 0). It refuses, exit 2, unless `--allow-empty`.
#[test]
fn sync_once_does_not_wipe_the_kernels_services_with_an_empty_input() {
    if !common::can_run() {
        return;
    }
    let ns = common::Netns::new("empty");
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("m");
    std::fs::create_dir(&m).unwrap();
    std::fs::write(m.join("svc.yaml"), SVC).unwrap();
    let m = m.to_str().unwrap();
    let sync = |extra: &[&str]| {
        let out = ns
            .kproxy("sync")
            .args(["--once", "--manifests", m, "--node", "n"])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let has_service = || {
        let out = Command::new("ip")
            .args([
                "netns", "exec", &ns.0, "nft", "list", "table", "ip", "kproxy",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).contains("10.96.0.10")
    };
    assert_eq!(sync(&[]).0, Some(0));
    assert!(has_service());
    // A 0-byte file, then an empty directory.
    std::fs::write(dir.path().join("m/svc.yaml"), "").unwrap();
    let (code, stderr) = sync(&[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("hold no Service") && stderr.contains("--allow-empty"),
        "{stderr}"
    );
    assert!(has_service(), "the rules stay");
    std::fs::remove_file(dir.path().join("m/svc.yaml")).unwrap();
    assert_eq!(sync(&[]).0, Some(2));
    assert!(has_service(), "the rules stay");
    let (code, stderr) = sync(&["--allow-empty"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!has_service());
    // With nothing of kproxy's left to lose, an empty input is no longer refused.
    assert_eq!(sync(&[]).0, Some(0));
}

/// A frontend conflict dropped the loser's frontend and `sync --once` said
/// nothing (exit 0). It names the loser and exits 1; the rest is programmed.
#[test]
fn sync_once_exits_1_naming_the_loser_of_a_frontend_conflict() {
    if !common::can_run() {
        return;
    }
    let ns = common::Netns::new("conflict");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("a.yaml"), format!("{SVC}---\n{THIEF}")).unwrap();
    for mode in ["--once", "--dry-run"] {
        let out = ns
            .kproxy("sync")
            .args([mode, "--manifests", dir.path().to_str().unwrap()])
            .args(["--node", "n"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{mode}: {stderr}");
        assert!(
            stderr.contains("kproxy: conflict: aaa/aaa: node port 30080/TCP")
                && stderr.contains("belongs to shop/web"),
            "{mode}: {stderr}"
        );
    }
    let out = Command::new("ip")
        .args([
            "netns", "exec", &ns.0, "nft", "list", "table", "ip", "kproxy",
        ])
        .output()
        .unwrap();
    let rules = String::from_utf8_lossy(&out.stdout);
    assert!(
        rules.contains("10.96.0.10") && rules.contains("10.96.0.11"),
        "{rules}"
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

/// Runs kproxy without the capabilities that let root read any directory, so a
/// directory of mode 000 cannot be listed, as for any other user.
fn kproxy_without_dac(args: &[&str]) -> std::process::Output {
    Command::new("setpriv")
        .arg("--bounding-set=-dac_override,-dac_read_search")
        .arg(env!("CARGO_BIN_EXE_kproxy"))
        .args(args)
        .output()
        .expect("running kproxy under setpriv")
}

/// One unreadable subdirectory made `plan` exit 1 with every valid object lost. It
/// costs only itself: named once, the rest of the tree is planned.
#[test]
fn an_unreadable_subdirectory_costs_only_itself() {
    if !common::can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("locked")).unwrap();
    std::fs::write(dir.path().join("good.yaml"), SVC).unwrap();
    std::fs::write(
        dir.path().join("locked/other.yaml"),
        SVC.replace("name: web", "name: other")
            .replace("10.96.0.10", "10.96.0.12")
            .replace("30080", "30081"),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    let locked = dir.path().join("locked");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).unwrap();
    let m = dir.path().to_str().unwrap();
    let out = kproxy_without_dac(&["plan", "--manifests", m, "--node", "n", "-o", "json"]);
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: exit {:?}\n{stderr}", out.status));
    let mut services: Vec<String> = v["servicePorts"]
        .as_array()
        .expect("servicePorts")
        .iter()
        .map(|p| p["servicePort"].as_str().unwrap().to_string())
        .collect();
    services.dedup();
    assert_eq!(services, ["shop/web:http/TCP"], "{stderr}");
    assert_eq!(
        stderr.matches("locked: cannot list this directory").count(),
        1,
        "{stderr}"
    );
}

/// `--nft-table kube-proxy` was accepted: kproxy then removed its own tables as
/// kube-proxy's 80 ms after programming them, and `/healthz` stayed 200.
#[test]
fn kube_proxys_table_names_are_refused_at_the_flag() {
    for (cmd, name) in [
        ("run", "kube-proxy"),
        ("sync", "kube-proxy-x"),
        ("cleanup", "kube-proxy"),
    ] {
        let out = kproxy(&[cmd, "--nft-table", name]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cmd} {name}: {stderr}");
        assert!(stderr.contains("is kube-proxy's"), "{cmd} {name}: {stderr}");
    }
}

/// Another Node's address as a cluster IP, and a cluster IP outside the ServiceCIDRs,
/// were refused (issue 42, 10b), which blackholed Services upstream kube-proxy programs
/// (issue 52). Both are programmed, with a warning naming the file, the object and the
/// field: `plan` and `explain` say so.
#[test]
fn a_cluster_ip_on_another_node_or_outside_the_service_cidrs_is_programmed_with_a_warning_by_file_object_and_field()
 {
    let dir = tempfile::tempdir().unwrap();
    let nodes = "apiVersion: v1\nkind: Node\nmetadata: {name: n}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.1}]}\n---\napiVersion: v1\nkind: Node\nmetadata: {name: n2}\nstatus: {addresses: [{type: InternalIP, address: 10.200.0.2}]}\n---\napiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [10.96.0.0/16]}\n";
    std::fs::write(dir.path().join("nodes.yaml"), nodes).unwrap();
    let bad = |name: &str, ip: &str| {
        SVC.replace("name: web", &format!("name: {name}"))
            .replace("10.96.0.10", ip)
            .replace("nodePort: 30080", "nodePort: 30099")
            .replace("type: NodePort, ", "")
            .replace(", nodePort: 30099", "")
    };
    std::fs::write(
        dir.path().join("svc.yaml"),
        format!(
            "{SVC}---\n{}---\n{}",
            bad("hijack", "10.200.0.2"),
            bad("stray", "192.0.2.10")
        ),
    )
    .unwrap();
    let m = dir.path().to_str().unwrap();
    let file = dir.path().join("svc.yaml");
    let file = file.display();

    let out = kproxy(&["plan", "--manifests", m, "--node", "n"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains(&format!("{file}: document 1: shop/hijack: cluster IP 10.200.0.2 (.spec.clusterIP) programmed, as upstream kube-proxy programs it, although it is an address of Node n2")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("{file}: document 2: shop/stray: cluster IP 192.0.2.10 (.spec.clusterIP) programmed, as upstream kube-proxy programs it, although it is outside the service CIDRs (10.96.0.0/16)")),
        "{stdout}"
    );

    let out = kproxy(&["plan", "--manifests", m, "--node", "n", "-o", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["conflicts"], serde_json::json!([]));
    let reasons: Vec<(String, String, String)> = v["clusterIpWarnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["service"].as_str().unwrap().to_string(),
                c["field"].as_str().unwrap().to_string(),
                c["reason"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        reasons,
        [
            (
                "shop/hijack".into(),
                ".spec.clusterIP".into(),
                "otherNodeAddress".into()
            ),
            (
                "shop/stray".into(),
                ".spec.clusterIP".into(),
                "outsideServiceCidrs".into()
            ),
        ]
    );
    // Every port is programmed.
    let ports: Vec<&str> = v["servicePorts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["clusterIp"].as_str().unwrap())
        .collect();
    assert_eq!(ports, ["10.200.0.2", "192.0.2.10", "10.96.0.10"]);

    let out = kproxy(&["explain", "--manifests", m, "--node", "n", "shop/hijack"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("cluster IP warnings (programmed; docs/input.md):\n  {file}: document 1: shop/hijack: cluster IP 10.200.0.2 (.spec.clusterIP) programmed")),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
