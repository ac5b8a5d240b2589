//! `kproxy install` through the real binary: `--defaults` prints deploy/ byte for byte;
//! against the fake API server (`kproxy_source::fake_api`, on 127.0.0.1) with a
//! kubeadm-style kube-proxy ConfigMap and the `default/kubernetes` EndpointSlice, the
//! printed manifests parse as YAML and carry the inferred server and pod CIDR (also as
//! `kubectl kproxy install`); with nothing to infer from, it refuses: exit 1, nothing on
//! stdout, the reasons on stderr. No root needed.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::Arc;

use kproxy_source::fake_api::{self, FakeApi};
use serde_json::{Value, json};

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

fn kproxy(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kproxy"));
    cmd.args(args)
        .env_remove("KUBECONFIG")
        .env("HOME", "/nonexistent");
    cmd.env_remove("KUBERNETES_SERVICE_HOST");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn defaults_print_deploy_byte_for_byte() {
    let files: Vec<String> = ["rbac.yaml", "configmap.yaml", "daemonset.yaml"]
        .iter()
        .map(|f| std::fs::read_to_string(Path::new(REPO).join("deploy").join(f)).unwrap())
        .collect();
    let out = kproxy(&["install", "--defaults"], &[]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8(out.stdout).unwrap(), files.join("---\n"));
}

/// The fake API, serving on its own runtime while the test runs the binary.
struct Api {
    api: Arc<FakeApi>,
    _runtime: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
}

impl Api {
    fn new() -> Api {
        let api = Arc::new(FakeApi::new());
        let (runtime, addr) = fake_api::serve_on_loopback(api.clone()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kubeconfig"), fake_api::kubeconfig(addr)).unwrap();
        Api {
            api,
            _runtime: runtime,
            dir,
        }
    }

    fn kubeconfig(&self) -> String {
        self.dir.path().join("kubeconfig").display().to_string()
    }
}

const KUBE_PROXY_CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
clientConnection:
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
clusterCIDR: 10.244.0.0/16
conntrack:
  maxPerCore: 0
iptables:
  masqueradeAll: true
mode: iptables
nodePortAddresses: null
";

const KUBE_PROXY_KUBECONFIG: &str = "apiVersion: v1
kind: Config
clusters:
- cluster:
    certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
    server: https://control-plane.lab.internal:6443
  name: default
contexts:
- context:
    cluster: default
    namespace: default
    user: default
  name: default
current-context: default
users:
- name: default
  user:
    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
";

fn api_server_slice() -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes", "namespace": "default",
            "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["192.168.50.10"], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]})
}

fn node(name: &str, cidr: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]}})
}

/// The printed manifests, as YAML documents.
fn documents(stdout: &[u8]) -> Vec<Value> {
    serde_saphyr::from_multiple(std::str::from_utf8(stdout).unwrap()).unwrap()
}

/// The ConfigMap's `config.yaml` and `kubeconfig.conf`, parsed.
fn config_map(docs: &[Value]) -> (Value, Value) {
    let cm = docs.iter().find(|d| d["kind"] == "ConfigMap").unwrap();
    let parse =
        |key: &str| -> Value { serde_saphyr::from_str(cm["data"][key].as_str().unwrap()).unwrap() };
    (parse("config.yaml"), parse("kubeconfig.conf"))
}

#[test]
fn the_manifests_carry_what_the_cluster_says() {
    let api = Api::new();
    api.api.set_config_map(
        "kube-system",
        "kube-proxy",
        json!({"config.conf": KUBE_PROXY_CONFIG, "kubeconfig.conf": KUBE_PROXY_KUBECONFIG}),
    );
    api.api.objects.insert(
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/kubernetes",
        api_server_slice(),
    );
    api.api
        .nodes
        .set_list("5", vec![node("node-a", "10.244.1.0/24")]);
    let out = kproxy(&["install", "--kubeconfig", &api.kubeconfig()], &[]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout.clone()).unwrap();
    let docs = documents(&out.stdout);
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "ConfigMap",
            "DaemonSet"
        ]
    );
    let (config, kubeconfig) = config_map(&docs);
    assert_eq!(
        kubeconfig["clusters"][0]["cluster"]["server"], "https://control-plane.lab.internal:6443",
        "kube-proxy's server first"
    );
    assert_eq!(config["clusterCIDR"], "10.244.0.0/16");
    assert_eq!(config["conntrack"]["maxPerCore"], 0, "carried");
    assert_eq!(config["mode"], "nftables", "kube-proxy's iptables dropped");
    assert_eq!(
        config["clientConnection"]["kubeconfig"], "/var/lib/kproxy/kubeconfig.conf",
        "kproxy's own mount, not kube-proxy's path"
    );
    assert_eq!(
        config["nftables"]["masqueradeAll"], false,
        "iptables.* is not nftables.*"
    );
    // The header names each value and its source, and what was dropped and why.
    for line in [
        "# API server (kubeconfig.conf server): https://control-plane.lab.internal:6443\n",
        "#   from ConfigMap kube-system/kube-proxy key kubeconfig.conf, server",
        "#   from ConfigMap kube-system/kube-proxy key config.conf, clusterCIDR\n",
        "#   conntrack.maxPerCore: 0\n",
        "#   mode: \"iptables\": proxy mode \"iptables\" is not supported",
        "#   iptables.masqueradeAll: true: does not apply to kproxy (nftables); use nftables.masqueradeAll\n",
    ] {
        assert!(text.contains(line), "{line:?} in\n{text}");
    }

    // Without the kubeconfig: the API servers' own address; the pod CIDR from the
    // Nodes. As the kubectl plugin, with kubectl's $KUBECONFIG.
    api.api.set_config_map(
        "kube-system",
        "kube-proxy",
        json!({"config.conf": "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"}),
    );
    let plugin = api.dir.path().join("kubectl-kproxy");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kproxy"), &plugin).unwrap();
    let out = Command::new(&plugin)
        .args(["install", "--image", "registry.example/kproxy:1.2.3"])
        .env("KUBECONFIG", api.kubeconfig())
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let docs = documents(&out.stdout);
    let (config, kubeconfig) = config_map(&docs);
    assert_eq!(
        kubeconfig["clusters"][0]["cluster"]["server"],
        "https://192.168.50.10:6443"
    );
    assert_eq!(config["clusterCIDR"], "10.244.0.0/16");
    let ds = docs.iter().find(|d| d["kind"] == "DaemonSet").unwrap();
    for c in ["initContainers", "containers"] {
        assert_eq!(
            ds["spec"]["template"]["spec"][c][0]["image"],
            "registry.example/kproxy:1.2.3"
        );
    }
}

#[test]
fn nothing_to_infer_from_is_refused() {
    let api = Api::new();
    api.api.nodes.set_list(
        "5",
        vec![
            json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a"}, "spec": {}}),
        ],
    );
    let out = kproxy(&["install", "--kubeconfig", &api.kubeconfig()], &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "nothing printed: {out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    for want in ["give --api-server https://HOST:PORT", "give --cluster-cidr"] {
        assert!(stderr.contains(want), "{want:?} in\n{stderr}");
    }
    // Given both, it prints.
    let out = kproxy(
        &[
            "install",
            "--kubeconfig",
            &api.kubeconfig(),
            "--api-server",
            "https://10.0.0.1:6443",
            "--cluster-cidr",
            "10.32.0.0/12",
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let (config, kubeconfig) = config_map(&documents(&out.stdout));
    assert_eq!(
        kubeconfig["clusters"][0]["cluster"]["server"],
        "https://10.0.0.1:6443"
    );
    assert_eq!(config["clusterCIDR"], "10.32.0.0/12");
}
