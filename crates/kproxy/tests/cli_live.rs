//! `kproxy plan`, `explain` and `trace` reading the cluster from the API server (the fake
//! one, `kproxy_source::fake_api`, on 127.0.0.1) through the real binary, held to the
//! manifest path on the same objects (examples/cluster); the node's configuration from
//! the ConfigMap; and the binary as the kubectl plugin (`kubectl-kproxy`, a symlink),
//! with kubectl's kubeconfig and its context's namespace. No root needed.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use kproxy_source::fake_api::{self, FakeApi, StatusCode};
use serde_json::Value;

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

/// The fake API server, serving on its own runtime while the test runs the binary.
struct Api {
    api: Arc<FakeApi>,
    addr: SocketAddr,
    _runtime: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
}

impl Api {
    /// Serves every object of examples/cluster.
    fn with_examples() -> Api {
        let api = Arc::new(FakeApi::new());
        let (runtime, addr) = fake_api::serve_on_loopback(api.clone()).unwrap();
        let (mut services, mut slices, mut nodes) = (Vec::new(), Vec::new(), Vec::new());
        for object in example_objects() {
            match object["kind"].as_str() {
                Some("Service") => services.push(object),
                Some("EndpointSlice") => slices.push(object),
                Some("Node") => nodes.push(object),
                other => panic!("examples/cluster: unexpected kind {other:?}"),
            }
        }
        assert!(!services.is_empty() && !slices.is_empty() && nodes.len() == 3);
        api.services.set_list("10", services);
        api.slices.set_list("10", slices);
        // Every Node: kproxy ingests only its own (the real API also filters by the
        // field selector).
        api.nodes.set_list("10", nodes);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kubeconfig"), fake_api::kubeconfig(addr)).unwrap();
        Api {
            api,
            addr,
            _runtime: runtime,
            dir,
        }
    }

    fn kubeconfig(&self) -> String {
        self.dir.path().join("kubeconfig").display().to_string()
    }
}

/// Every object in examples/cluster, `kind: List` items flattened.
fn example_objects() -> Vec<Value> {
    let mut out = Vec::new();
    let dir = Path::new(REPO).join("examples/cluster");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let docs: Vec<Value> = if f.extension().is_some_and(|e| e == "json") {
            vec![serde_json::from_str(&text).unwrap()]
        } else {
            serde_saphyr::from_multiple(&text).unwrap()
        };
        for d in docs {
            match d["kind"].as_str() {
                Some("List") => out.extend(d["items"].as_array().unwrap().iter().cloned()),
                _ => out.push(d),
            }
        }
    }
    out
}

/// Runs `program` with `args` from the repository root: exit code, stdout, stderr.
fn run_at(program: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let out = Command::new(program)
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBECONFIG")
        .envs(env.iter().copied())
        .current_dir(REPO)
        .output()
        .expect("run kproxy");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn kproxy(args: &[&str]) -> (i32, String, String) {
    run_at(Path::new(env!("CARGO_BIN_EXE_kproxy")), args, &[])
}

/// One subcommand's stdout from the manifests and from the API: both must succeed.
fn both(api: &Api, command: &[&str]) -> (String, String) {
    let kubeconfig = api.kubeconfig();
    let mut from_files = command.to_vec();
    from_files.extend(["--manifests", "examples/cluster"]);
    let mut from_api = command.to_vec();
    from_api.extend(["--kubeconfig", &kubeconfig]);
    let (code, files, err) = kproxy(&from_files);
    assert_eq!(code, 0, "{from_files:?}: {err}");
    let (code, live, err) = kproxy(&from_api);
    assert_eq!(code, 0, "{from_api:?}: {err}");
    (files, live)
}

/// `explain shop/web` on node-a from examples/cluster: what the API must answer too.
fn explain_web_from_the_manifests() -> String {
    let args = [
        "explain",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "shop/web",
    ];
    let (code, out, err) = kproxy(&args);
    assert_eq!(code, 0, "{err}");
    out
}

/// The packets traced on every node: a client through the LB IP, a pod to the cluster
/// IP, a NodePort on node-a's address, an address no Service holds.
const PACKETS: [[&str; 3]; 4] = [
    ["198.51.100.7", "203.0.113.10", "80"],
    ["10.244.2.7", "10.96.0.10", "80"],
    ["198.51.100.7", "10.200.0.11", "30080"],
    ["10.244.2.7", "10.96.0.99", "80"],
];

#[test]
fn plan_explain_and_trace_from_the_api_agree_with_the_manifests() {
    let api = Api::with_examples();
    let mut explained = Vec::new();
    for node in NODES {
        let (files, live) = both(&api, &["plan", "-o", "json", "--node", node]);
        assert_eq!(files, live, "plan of {node}");
        let plan: Value = serde_json::from_str(&live).unwrap();
        assert!(
            plan["servicePorts"]
                .as_array()
                .is_some_and(|s| s.len() >= 3),
            "{live}"
        );

        let (files, live) = both(&api, &["explain", "--node", node, "shop/web"]);
        assert_eq!(files, live, "explain of {node}");
        explained.push(live);
        let (files, live) = both(
            &api,
            &["explain", "--node", node, "-n", "shop", "web", "-o", "json"],
        );
        assert_eq!(files, live, "explain -o json of {node}");

        for [src, dst, dport] in PACKETS {
            let args = [
                "trace", "--node", node, "--src", src, "--dst", dst, "--dport", dport,
            ];
            let (files, live) = both(&api, &args);
            assert_eq!(files, live, "{args:?}");
            assert!(live.starts_with("verdict:"), "{live}");
        }
    }
    // The nodes see shop/web differently (its only ready pod is on node-b): an answer
    // that ignored the source would not.
    assert_ne!(explained[0], explained[1]);
    assert_ne!(explained[1], explained[2]);
    // The API was read: each kind listed once per command (4 nodes' commands × …).
    assert!(api.api.services.lists() >= 3 * (3 + PACKETS.len()));
    assert!(api.api.slices.lists() >= 3 * (3 + PACKETS.len()));
    assert!(
        api.api.services.watches().is_empty(),
        "a one-shot read watches nothing"
    );
}

#[test]
fn the_configuration_comes_from_the_config_map_and_its_absence_is_said() {
    let api = Api::with_examples();
    let kubeconfig = api.kubeconfig();
    // A pod on node-b (not an endpoint) to the cluster IP: not masqueraded under the
    // defaults.
    let trace = [
        "trace",
        "--kubeconfig",
        &kubeconfig,
        "--node",
        "node-b",
        "--src",
        "10.244.2.50",
        "--dst",
        "10.96.0.10",
        "--dport",
        "80",
    ];
    let (code, out, err) = kproxy(&trace);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("masquerade: no"), "{out}");
    assert!(
        err.contains("no ConfigMap kube-system/kproxy with a key config.yaml or config.conf")
            && err.contains("planning with upstream's default configuration"),
        "{err}"
    );
    let (code, _, err) = kproxy(&[&trace[..], &["--strict"]].concat());
    assert_eq!(
        code, 1,
        "--strict fails on the missing configuration: {err}"
    );

    api.api.set_config_map(
        "kube-system",
        "kproxy",
        serde_json::json!({"config.yaml": "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\nnftables:\n  masqueradeAll: true\n"}),
    );
    let (code, out, err) = kproxy(&trace);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("masquerade: yes"), "{out}");
    assert!(!err.contains("ConfigMap"), "{err}");

    // kubeadm's kube-proxy ConfigMap, named by --config-map; --config wins over both.
    api.api.set_config_map(
        "kube-system",
        "kube-proxy",
        serde_json::json!({"config.conf": "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n"}),
    );
    let (code, out, err) =
        kproxy(&[&trace[..], &["--config-map", "kube-system/kube-proxy"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("masquerade: no"), "{out}");
    let file = api.dir.path().join("config.yaml");
    std::fs::write(&file, "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n").unwrap();
    let (code, out, err) =
        kproxy(&[&trace[..], &["--config", &file.display().to_string()]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("masquerade: no"), "{out}");
    let (code, _, err) = kproxy(&[&trace[..], &["--config-map", "kproxy"]].concat());
    assert_eq!(code, 1);
    assert!(
        err.contains("--config-map must be NAMESPACE/NAME, got \"kproxy\""),
        "{err}"
    );
}

#[test]
fn a_failing_list_or_no_source_is_a_clear_error() {
    let api = Api::with_examples();
    // An API server without ServiceCIDRs: said, and the rest is still used (as `run`).
    api.api.service_cidrs.fail_lists(StatusCode::NOT_FOUND);
    let kubeconfig = api.kubeconfig();
    let explain = || {
        kproxy(&[
            "explain",
            "--kubeconfig",
            &kubeconfig,
            "--node",
            "node-a",
            "shop/web",
        ])
    };
    let (code, out, err) = explain();
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("Service shop/web on node node-a"), "{out}");
    assert!(
        err.contains("ServiceCIDR not listed (list refused: 404"),
        "{err}"
    );
    api.api.slices.fail_lists(StatusCode::FORBIDDEN);
    let (code, out, err) = explain();
    assert_eq!(code, 1, "{out}");
    assert!(
        err.contains("listing EndpointSlice from the API server failed: list refused: 403"),
        "{err}"
    );
    // Neither manifests nor a kubeconfig (HOME has no .kube), outside a pod.
    let (code, _, err) = run_at(
        Path::new(env!("CARGO_BIN_EXE_kproxy")),
        &["explain", "--node", "node-a", "shop/web"],
        &[("HOME", api.dir.path().to_str().unwrap())],
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("no API server to read from: give --kubeconfig FILE or set KUBECONFIG"),
        "{err}"
    );
    let _ = api.addr;
}

#[test]
fn the_binary_answers_as_the_kubectl_plugin() {
    let api = Api::with_examples();
    let bin = api.dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    let plugin = bin.join("kubectl-kproxy");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kproxy"), &plugin).unwrap();
    // kubectl's kubeconfig, whose context's namespace is shop.
    let kubeconfig = api.dir.path().join("kubectl-config");
    std::fs::write(
        &kubeconfig,
        fake_api::kubeconfig(api.addr).replace(
            "context: {cluster: fake, user: u}",
            "context: {cluster: fake, user: u, namespace: shop}",
        ),
    )
    .unwrap();
    let env = [
        ("KUBECONFIG", kubeconfig.to_str().unwrap()),
        ("HOME", api.dir.path().to_str().unwrap()),
    ];
    let expected = explain_web_from_the_manifests();
    let (code, out, err) = run_at(&plugin, &["explain", "web", "--node", "node-a"], &env);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, expected, "the context's namespace is the default");
    let (code, out, err) = run_at(
        &plugin,
        &["explain", "-n", "shop", "web", "--node", "node-a"],
        &env,
    );
    assert_eq!((code, out.as_str()), (0, expected.as_str()), "{err}");
    let (code, _, err) = run_at(
        &plugin,
        &["explain", "-n", "default", "web", "--node", "node-a"],
        &env,
    );
    assert_eq!(code, 1);
    assert!(
        err.contains("Service default/web is not proxied on node node-a"),
        "{err}"
    );

    let (code, out, err) = run_at(&plugin, &["plan", "--node", "node-a", "-o", "yaml"], &env);
    assert_eq!(code, 0, "{err}");
    let yaml: Value = serde_saphyr::from_str(&out).unwrap();
    let (_, json, _) = kproxy(&[
        "plan",
        "--manifests",
        "examples/cluster",
        "--node",
        "node-a",
        "-o",
        "json",
    ]);
    assert_eq!(
        yaml,
        serde_json::from_str::<Value>(&json).unwrap(),
        "-o yaml is -o json's document"
    );

    let (code, out, err) = run_at(
        &plugin,
        &[
            "trace",
            "--node",
            "node-a",
            "--src",
            "198.51.100.7",
            "--dst",
            "203.0.113.10",
            "--dport",
            "80",
            "-o",
            "json",
        ],
        &env,
    );
    assert_eq!(code, 0, "{err}");
    let t: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(t["verdict"], "DNAT", "{out}");

    // Usage names the plugin as kubectl runs it.
    let (code, out, _) = run_at(&plugin, &["--help"], &env);
    assert_eq!(code, 0);
    assert!(out.contains("Usage: kubectl kproxy"), "{out}");
    // Without $KUBECONFIG, kubectl's ~/.kube/config.
    let home = api.dir.path().join("home");
    std::fs::create_dir_all(home.join(".kube")).unwrap();
    std::fs::copy(&kubeconfig, home.join(".kube/config")).unwrap();
    let (code, out, err) = run_at(
        &plugin,
        &["explain", "web", "--node", "node-a"],
        &[("HOME", home.to_str().unwrap())],
    );
    assert_eq!((code, out.as_str()), (0, expected.as_str()), "{err}");
}

/// Plain `kproxy` chooses its kubeconfig as kubectl: `$KUBECONFIG`'s files that exist,
/// merged in order; else ~/.kube/config; else an error that says what to give.
#[test]
fn kubeconfig_is_chosen_as_kubectl_chooses() {
    let api = Api::with_examples();
    let home = api.dir.path().join("empty-home");
    std::fs::create_dir(&home).unwrap();
    let expected = explain_web_from_the_manifests();
    let explain = |env: &[(&str, &str)]| {
        let mut env = env.to_vec();
        env.push(("HOME", home.to_str().unwrap()));
        run_at(
            Path::new(env!("CARGO_BIN_EXE_kproxy")),
            &["explain", "--node", "node-a", "shop/web"],
            &env,
        )
    };
    // The first file sets current-context; the second, whose own current context names
    // nothing, holds the cluster, user and context: only the merge reaches the server.
    let write = |name: &str, text: &str| {
        let path = api.dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    };
    let first = write(
        "first",
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n",
    );
    let second = write(
        "second",
        &fake_api::kubeconfig(api.addr).replace("current-context: c", "current-context: elsewhere"),
    );
    let missing = api.dir.path().join("missing").display().to_string();
    let value = format!("{missing}:{first}:{second}");
    let (code, out, err) = explain(&[("KUBECONFIG", &value)]);
    assert_eq!((code, out.as_str()), (0, expected.as_str()), "{err}");
    // None of them exists: said, with what to set.
    let (code, _, err) = explain(&[("KUBECONFIG", &missing)]);
    assert_eq!(code, 1);
    assert!(
        err.contains(&format!(
            "$KUBECONFIG names no file that exists ({missing})"
        )),
        "{err}"
    );
    // Nothing at all: what to give, once; not in-cluster's "environment variable not
    // found" three times.
    let (code, _, err) = explain(&[]);
    assert_eq!(code, 1);
    assert!(
        err.contains("give --kubeconfig FILE or set KUBECONFIG"),
        "{err}"
    );
    assert!(!err.contains("environment variable not found"), "{err}");
    // ~/.kube/config, as kubectl.
    std::fs::create_dir(home.join(".kube")).unwrap();
    std::fs::write(home.join(".kube/config"), fake_api::kubeconfig(api.addr)).unwrap();
    let (code, out, err) = explain(&[]);
    assert_eq!((code, out.as_str()), (0, expected.as_str()), "{err}");
}

/// A Service not found in the namespace asked: the namespaces that hold one of that
/// name, from the manifests and from the API.
#[test]
fn explain_names_the_namespaces_that_hold_a_service_of_that_name() {
    let api = Api::with_examples();
    let kubeconfig = api.kubeconfig();
    let hint = "Service default/web is not proxied on node node-a (unknown, headless, ExternalName, or another proxy's); a Service web exists in namespace shop: give -n shop";
    for source in [
        ["--manifests", "examples/cluster"],
        ["--kubeconfig", kubeconfig.as_str()],
    ] {
        let mut args = vec!["explain", "--node", "node-a", "-n", "default", "web"];
        args.extend(source);
        let (code, _, err) = kproxy(&args);
        assert_eq!(code, 1, "{args:?}");
        assert!(err.contains(hint), "{args:?}: {err}");
    }
}
