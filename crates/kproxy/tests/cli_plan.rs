//! `kproxy plan`, `kproxy explain` and `kproxy sync --dry-run` on the example cluster
//! and on broken input, through the real binary.

use std::process::Command;

use serde_json::Value;

mod common;

fn kproxy(args: &[&str]) -> (i32, String, String) {
    let mut full = vec![env!("CARGO_BIN_EXE_kproxy")];
    full.extend_from_slice(args);
    kproxy_at(&full)
}

/// Runs `argv` (a kproxy command line, perhaps behind `ip netns exec`) from the
/// repository root.
fn kproxy_at(argv: &[&str]) -> (i32, String, String) {
    let out = Command::new(argv[0])
        .args(&argv[1..])
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
fn plan_json_of_the_example_cluster_matches_the_snapshot() {
    let (code, out, err) = kproxy(&[
        "plan",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("valid JSON");
    insta::assert_json_snapshot!("plan_node_a", v);
}

#[test]
fn plan_json_has_the_documented_contract_fields() {
    let (_, out, _) = kproxy(&[
        "plan",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-c",
        "-o",
        "json",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["node"], "node-c");
    let ports = v["servicePorts"].as_array().unwrap();
    let web = ports
        .iter()
        .find(|p| p["servicePort"] == "shop/web:http/TCP")
        .unwrap();
    for key in [
        "family",
        "clusterEndpoints",
        "localEndpoints",
        "allReachableEndpoints",
        "hasAnyEndpoints",
        "internal",
        "external",
    ] {
        assert!(web.get(key).is_some(), "missing {key}");
    }
    // node-c holds only a terminating, non-serving pod: external traffic from outside is
    // dropped (endpoints exist elsewhere), and the health check says 503.
    assert_eq!(web["localEndpoints"], serde_json::json!([]));
    assert_eq!(
        web["external"].as_array().unwrap().last().unwrap()["verdict"]["action"],
        "drop"
    );
    assert_eq!(v["healthChecks"][0]["localEndpoints"], 0);
    // iTP Local on a node without an agent: cluster-IP traffic is dropped, not rejected.
    let agent = ports
        .iter()
        .find(|p| p["servicePort"] == "monitoring/node-agent:metrics/TCP")
        .unwrap();
    assert_eq!(agent["internal"][0]["verdict"]["action"], "drop");
    // Dual-stack: one entry per family, IPv6 endpoints bracketed.
    let api6 = ports
        .iter()
        .find(|p| p["servicePort"] == "shop/api:grpc/TCP" && p["family"] == "IPv6")
        .unwrap();
    assert_eq!(api6["clusterEndpoints"][0], "[fd00:10:244:1::30]:9000");
}

#[test]
fn explain_says_why_each_endpoint_is_not_used() {
    let (code, out, err) = kproxy(&[
        "explain",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "web",
        "-n",
        "shop",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("terminating, and 1 ready endpoint(s) exist"),
        "{out}"
    );
    assert!(
        out.contains("on node-b, and externalTrafficPolicy is Local"),
        "{out}"
    );
    assert!(out.contains("health-check node port 32000: 503"), "{out}");
    let (code, _, err) = kproxy(&[
        "explain",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "shop/nope",
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("shop/nope"), "{err}");
}

/// README's example: node-a sends outside traffic to its terminating pod while its
/// health check says 503; node-c, with no serving pod, drops it, and the reason matches
/// the lab's load balancer (a retransmitted SYN stays on its node: no retry elsewhere).
#[test]
fn readmes_explain_example_shows_what_readme_says() {
    let explain = |node: &str| {
        let (code, out, err) = kproxy(&[
            "explain",
            "--manifests",
            "examples/cluster",
            "--node",
            node,
            "shop/web",
        ]);
        assert_eq!(code, 0, "{err}");
        out
    };
    let a = explain("node-a");
    assert!(
        a.contains("from anywhere else: 1 endpoint(s) by Local policy")
            && a.contains("✓ 10.244.1.5:8080 — serving and terminating: failover")
            && a.contains("health-check node port 32000: 503"),
        "{a}"
    );
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    assert!(
        readme.contains("explain --manifests examples/cluster --node node-a shop/web"),
        "README's example is node-a's"
    );
    let c = explain("node-c");
    assert!(
        c.contains("from anywhere else: DROP")
            && c.contains("keeps a retransmitted SYN on the node it chose"),
        "{c}"
    );
    assert!(!c.contains("retries another node"), "{c}");
}

#[test]
fn the_plan_table_explains_its_columns() {
    let (code, out, err) = kproxy(&[
        "plan",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
    ]);
    assert_eq!(code, 0, "{err}");
    let header = out.lines().nth(1).unwrap();
    for column in ["NODEP", "CLUSTER", "LOCAL", "ALL", "POLICY i/e", "EXTERNAL"] {
        assert!(header.contains(column), "{header}");
        assert!(
            out.lines().any(|l| l.starts_with(&format!("{column} "))),
            "{column} has a line in the legend:\n{out}"
        );
    }
    assert!(out.contains("localEndpoints=0 → 503"), "{out}");
    assert!(
        out.contains("localEndpoints (health-check node ports) counts only READY endpoints"),
        "{out}"
    );
}

#[test]
fn broken_objects_are_reported_and_skipped_and_strict_fails() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("mixed.yaml"),
        "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: shop}\nspec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: '', port: 8080}]\nendpoints: [{addresses: [10.244.0.1]}, {addresses: [not-an-ip]}]\n---\napiVersion: v1\nkind: Service\nmetadata: {name: bad, namespace: shop}\nspec: {clusterIP: 10.96.0.11, ports: [{port: nope}]}\n",
    )
    .unwrap();
    let path = dir.path().to_str().unwrap();
    let (code, out, err) = kproxy(&["plan", "--manifests", path, "--node", "n1", "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("mixed.yaml: document 2: Service shop/bad: .spec.ports[0].port"),
        "{err}"
    );
    assert!(
        err.contains("EndpointSlice shop/web-1: .endpoints[1].addresses[0]: not an IP address"),
        "{err}"
    );
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["servicePorts"][0]["clusterEndpoints"],
        serde_json::json!(["10.244.0.1:8080"])
    );
    let (code, _, _) = kproxy(&["plan", "--manifests", path, "--node", "n1", "--strict"]);
    assert_eq!(code, 1);
    let (code, _, err) = kproxy(&["plan", "--manifests", "/nonexistent", "--node", "n1"]);
    assert_eq!(code, 1, "{err}");
}

#[test]
fn trace_answers_per_node_for_the_lb_ip() {
    let args = |node: &'static str| {
        [
            "trace",
            "--manifests",
            "examples/cluster",
            "--node",
            node,
            "--src",
            "198.51.100.7",
            "--dst",
            "203.0.113.10",
            "--dport",
            "80",
            "-o",
            "json",
        ]
    };
    let (code, out, err) = kproxy(&args("node-a"));
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["verdict"], "DNAT");
    assert_eq!(v["masquerade"], false, "eTP Local keeps the client address");
    assert!(!v["endpoints"].as_array().unwrap().is_empty());
    // node-c has no serving local endpoint: the LB's traffic there is dropped.
    let (_, out, _) = kproxy(&args("node-c"));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["verdict"], "DROP");
    // An address kproxy does not own is not touched.
    let (_, out, _) = kproxy(&[
        "trace",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "--src",
        "10.244.1.9",
        "--dst",
        "10.1.2.3",
        "--dport",
        "80",
        "--proto",
        "udp",
        "-o",
        "json",
    ]);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["verdict"], "NONE");
    // A bad protocol is a usage error.
    let (code, _, _) = kproxy(&[
        "trace",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "--src",
        "1.2.3.4",
        "--dst",
        "1.2.3.5",
        "--dport",
        "80",
        "--proto",
        "ICMP",
    ]);
    assert_eq!(code, 2);
}

#[test]
fn config_file_changes_the_plan_and_a_wrong_mode_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(&good, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nnftables:\n  masqueradeAll: true\n").unwrap();
    let (code, out, err) = kproxy(&[
        "plan",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "-o",
        "json",
        "--config",
        good.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    let web = v["servicePorts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["servicePort"] == "shop/web:http/TCP")
        .unwrap()
        .clone();
    assert_eq!(web["internal"][0]["verdict"]["masquerade"], true, "{web}");

    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: iptables\n").unwrap();
    let (code, _, err) = kproxy(&[
        "plan",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "--config",
        bad.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(err.contains("mode") && err.contains("iptables"), "{err}");
}

/// `kproxy sync --dry-run`: the script a full sync would apply, with `--config`'s
/// settings, programming nothing (no root needed).
fn dry_run(extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "sync",
        "--dry-run",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "--nft-table",
        "kproxy-dry-run-test",
    ];
    args.extend_from_slice(extra);
    kproxy(&args)
}

#[test]
fn sync_dry_run_prints_both_families_full_script_with_the_default_mark() {
    let (code, out, err) = dry_run(&[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("add table ip kproxy-dry-run-test"), "{out}");
    assert!(out.contains("add table ip6 kproxy-dry-run-test"), "{out}");
    // masqueradeBit 14, upstream's default.
    assert!(out.contains("meta mark | 0x4000"), "{out}");
}

#[test]
fn sync_dry_run_takes_the_masquerade_bit_from_the_config_file() {
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

#[test]
fn a_service_cidr_manifest_reaches_each_familys_plan() {
    let dir = tempfile::tempdir().expect("tempdir");
    for f in std::fs::read_dir(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/cluster"
    ))
    .expect("examples/cluster")
    {
        let f = f.expect("dir entry").path();
        std::fs::copy(&f, dir.path().join(f.file_name().expect("file name"))).expect("copy");
    }
    std::fs::write(
        dir.path().join("servicecidr.yaml"),
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata:\n  name: kubernetes\n\
         spec:\n  cidrs: [10.96.0.0/16, 'fd00:10:96::/112']\n",
    )
    .expect("write servicecidr.yaml");
    let dir_arg = dir.path().to_str().expect("utf-8 path");
    let (code, out, err) = kproxy(&[
        "plan",
        "--manifests",
        dir_arg,
        "--node",
        "node-a",
        "-o",
        "json",
    ]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("valid JSON");
    let cidrs: Vec<(String, Value)> = v["families"]
        .as_array()
        .expect("families")
        .iter()
        .map(|f| {
            (
                f["family"].as_str().unwrap_or("").to_string(),
                f["serviceCidrs"].clone(),
            )
        })
        .collect();
    assert_eq!(
        cidrs,
        vec![
            ("IPv4".to_string(), serde_json::json!(["10.96.0.0/16"])),
            ("IPv6".to_string(), serde_json::json!(["fd00:10:96::/112"])),
        ]
    );
}

/// A cluster IP outside the ServiceCIDRs (upstream's `TestNodePorts/ipv6` Service) made
/// `sync --once` refuse the Service and exit 1 (issue 52). Upstream programs it: so does
/// kproxy, with a warning naming the object and field, and it exits 0. Root: a namespace
/// of its own.
#[test]
fn sync_once_programs_a_cluster_ip_outside_the_service_cidrs_and_exits_0() {
    if !common::can_run() {
        return;
    }
    let ns = common::Netns::new("cidr");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("svc.yaml"),
        "apiVersion: networking.k8s.io/v1\nkind: ServiceCIDR\nmetadata: {name: kubernetes}\nspec: {cidrs: [172.30.0.0/16, \"fd00:10:96::/112\"]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: svc1, namespace: ns1}\nspec:\n  type: NodePort\n  ipFamilies: [IPv6]\n  clusterIP: \"fd00:172:30::41\"\n  ports:\n  - {name: p80, port: 80, protocol: TCP, nodePort: 3001}\n",
    )
    .unwrap();
    let m = dir.path().to_str().unwrap();
    let (code, _, err) = kproxy_at(&[
        "ip",
        "netns",
        "exec",
        &ns.0,
        env!("CARGO_BIN_EXE_kproxy"),
        "sync",
        "--once",
        "--manifests",
        m,
        "--node",
        "test-node",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("kproxy: warning: ")
            && err.contains("ns1/svc1: cluster IP fd00:172:30::41 (.spec.clusterIP) programmed")
            && err.contains("outside the service CIDRs (fd00:10:96::/112)")
            && err.contains("do not change the exit status"),
        "{err}"
    );
    let out = Command::new("ip")
        .args([
            "netns", "exec", &ns.0, "nft", "list", "table", "ip6", "kproxy",
        ])
        .output()
        .expect("nft list table");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("fd00:172:30::41"), "{table}");
}

/// With kproxy's tables in the kernel, `sync --dry-run` prints the delta `sync --once`
/// would adopt them with (empty when nothing changed), and changes nothing. Root: a
/// namespace of its own.
#[test]
fn sync_dry_run_shows_the_adoption_delta_when_the_tables_exist() {
    if !common::can_run() {
        return;
    }
    let ns = common::Netns::new("dry");
    let in_ns = |args: &[&str]| {
        let mut full = vec!["ip", "netns", "exec", &ns.0, env!("CARGO_BIN_EXE_kproxy")];
        full.extend_from_slice(args);
        kproxy_at(&full)
    };
    let sync = |mode: &str, node: &str| {
        in_ns(&[
            "sync",
            mode,
            "--manifests",
            "examples/cluster",
            "--node",
            node,
        ])
    };
    let ruleset = || {
        let out = Command::new("ip")
            .args(["netns", "exec", &ns.0, "nft", "list", "ruleset"])
            .output()
            .expect("nft list ruleset");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let (code, _, err) = sync("--once", "node-a");
    assert_eq!(code, 0, "{err}");
    let before = ruleset();
    // Same state: adopted with an empty delta.
    let (code, out, err) = sync("--dry-run", "node-a");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("would adopt them"), "{err}");
    assert!(out.trim().is_empty(), "{out}");
    // Another node: other endpoints are local, a delta, still no table replaced.
    let (code, out, err) = sync("--dry-run", "node-b");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("would adopt them"), "{err}");
    assert!(!out.trim().is_empty(), "{err}");
    assert!(!out.contains("delete table"), "{out}");
    assert_eq!(ruleset(), before, "--dry-run changed the kernel");
}

/// `trace --kernel` on a node's namespace: agrees with the plan after `sync --once`;
/// after `nft delete element` of the row the packet uses, the kernel's fate differs,
/// the element is named and the exit code is 1. Without kproxy's tables, or without
/// CAP_NET_ADMIN, a clear error. Root: a namespace of its own.
#[test]
fn trace_kernel_agrees_then_names_a_deleted_element() {
    if !common::can_run() {
        return;
    }
    let ns = common::Netns::new("ktrace");
    let in_ns = |prefix: &[&str], args: &[&str]| {
        let mut full = vec!["ip", "netns", "exec", &ns.0];
        full.extend_from_slice(prefix);
        full.push(env!("CARGO_BIN_EXE_kproxy"));
        full.extend_from_slice(args);
        kproxy_at(&full)
    };
    // `trace --kernel` of a packet from `src` to `dst`, port 80, run behind `prefix` in
    // the namespace.
    let trace_to = |prefix: &[&str], src: &str, dst: &str, extra: &[&str]| {
        let mut args = vec![
            "trace",
            "--kernel",
            "--manifests",
            "examples/cluster",
            "--node",
            "node-a",
            "--src",
            src,
            "--dst",
            dst,
            "--dport",
            "80",
        ];
        args.extend_from_slice(extra);
        in_ns(prefix, &args)
    };
    let trace = |extra: &[&str]| trace_to(&[], "198.51.100.7", "10.96.0.10", extra);
    let (code, _, err) = trace(&[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("no kproxy tables (ip kproxy, ip6 kproxy) in this network namespace: is kproxy running here?"),
        "{err}"
    );
    // Tables of that name that kproxy did not make: named, not evaluated.
    ns.exec(&["nft", "add table ip kproxy { comment \"someone else's\"; }"]);
    let (code, out, err) = trace(&[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        out.contains("kernel (ip kproxy): cannot be evaluated: comment Some(\"someone else's\")")
            && out.contains("differs:    table ip kproxy: comment Some(\"someone else's\")"),
        "{out}{err}"
    );
    ns.exec(&["nft", "delete table ip kproxy"]);
    let (code, _, err) = in_ns(
        &[],
        &[
            "sync",
            "--once",
            "--manifests",
            "examples/cluster",
            "--node",
            "node-a",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let (code, out, err) = trace(&["-o", "json"]);
    assert_eq!(code, 0, "{out}{err}");
    let v: Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(v["agrees"], true, "{out}");
    assert_eq!(v["kernel"]["outcomes"][0]["fate"], "DNAT", "{out}");
    assert_eq!(
        v["kernel"]["outcomes"][0]["endpoint"], v["plan"]["endpoints"][0],
        "{out}"
    );
    let ep = v["plan"]["endpoints"][0]
        .as_str()
        .expect("an endpoint")
        .to_string();
    let (ip, port) = ep.rsplit_once(':').expect("ip:port");
    // shop/web's one Cluster-policy endpoint: the dispatch map of one row.
    ns.exec(&[
        "nft",
        "delete element ip kproxy dnat-c-1 { 10.96.0.10 . tcp . 80 . 0 }",
    ]);
    let (code, out, err) = trace(&[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("NONE (kproxy leaves it untouched)"), "{out}");
    assert!(
        out.contains("NO: the kernel's fate differs from the plan's"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "map dnat-c-1: element 10.96.0.10 . tcp . 80 . 0 : {ip} . {port} is in the plan, not in the kernel"
        )),
        "{out}"
    );
    // Without CAP_NET_ADMIN.
    let (code, _, err) = trace_to(
        &["setpriv", "--bounding-set=-net_admin"],
        "198.51.100.7",
        "10.96.0.10",
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("needs CAP_NET_ADMIN"), "{err}");
    // A connection has one family.
    let (code, _, err) = trace_to(&[], "198.51.100.7", "fd00::10", &[]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("different IP families"), "{err}");
    // A family whose table is absent.
    ns.exec(&["nft", "delete table ip6 kproxy"]);
    let (code, _, err) = trace_to(&[], "fd00:198::7", "fd00::10", &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("table ip6 kproxy is absent in this network namespace while kproxy's other table exists: fd00::10 is of no family kproxy programs here"),
        "{err}"
    );
}

/// `kubectl kproxy trace --kernel` cannot read a node's kernel from a workstation: it
/// refuses before reading anything, with the command that answers in kproxy's pod on
/// that node.
#[test]
fn trace_kernel_as_the_kubectl_plugin_names_the_command_on_the_node() {
    let dir = tempfile::tempdir().unwrap();
    let plugin = dir.path().join("kubectl-kproxy");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kproxy"), &plugin).unwrap();
    let plugin = plugin.to_str().unwrap();
    let (code, out, err) = kproxy_at(&[
        plugin,
        "trace",
        "--kernel",
        "--node",
        "node-b",
        "--src",
        "198.51.100.7",
        "--dst",
        "203.0.113.10",
        "--dport",
        "80",
        "--proto",
        "udp",
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("cannot read node node-b's kernel"), "{err}");
    assert!(
        err.contains("--field-selector spec.nodeName=node-b -o name)\" -- kproxy trace --kernel --config /var/lib/kproxy/config.yaml --src 198.51.100.7 --dst 203.0.113.10 --dport 80 --proto UDP"),
        "{err}"
    );
}
