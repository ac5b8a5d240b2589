//! The manifests in deploy/ are valid: every document parses into its k8s-openapi type
//! and survives a round trip through it without losing a field (k8s-openapi types do
//! not deny unknown fields, so a typo such as `hostNetwrok` would otherwise pass
//! silently). The ConfigMap's KubeProxyConfiguration loads through
//! `kproxy_config::load` without warnings, and the DaemonSet has the properties the
//! deployment relies on.

use std::path::{Path, PathBuf};

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kproxy_config::{ConfigFlags, load};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// Every key of `original` is in `typed` with an equal value (numbers compared as
/// numbers); `path` names the first difference.
fn subset(original: &Value, typed: &Value, path: &str) -> Result<(), String> {
    match (original, typed) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let p = format!("{path}.{k}");
                match b.get(k) {
                    Some(w) => subset(v, w, &p)?,
                    None if v.is_null() => {}
                    None => {
                        return Err(format!(
                            "{p}: not a field of the type (unknown or misspelled)"
                        ));
                    }
                }
            }
            Ok(())
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .try_for_each(|(i, (v, w))| subset(v, w, &format!("{path}[{i}]"))),
        (Value::Number(a), Value::Number(b)) if a.as_f64() == b.as_f64() => Ok(()),
        (a, b) if a == b => Ok(()),
        (a, b) => Err(format!("{path}: {a} became {b}")),
    }
}

fn typed<T: DeserializeOwned + Serialize>(doc: &Value, what: &str) -> T {
    let t: T = serde_path_to_error::deserialize(doc.clone())
        .unwrap_or_else(|e| panic!("{what}: {}: {}", e.path(), e.inner()));
    let back = serde_json::to_value(&t).expect("serialize");
    if let Err(e) = subset(doc, &back, "") {
        panic!("{what}: {e}");
    }
    t
}

#[derive(Default)]
struct Objects {
    service_accounts: Vec<ServiceAccount>,
    cluster_roles: Vec<ClusterRole>,
    bindings: Vec<ClusterRoleBinding>,
    config_maps: Vec<ConfigMap>,
    daemon_sets: Vec<DaemonSet>,
}

fn read_all() -> Objects {
    let mut out = Objects::default();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy_dir())
        .expect("deploy/ exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in deploy/");
    for file in files {
        let text = std::fs::read_to_string(&file).expect("read manifest");
        let docs: Vec<Value> = serde_saphyr::from_multiple(&text)
            .unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for (i, doc) in docs.into_iter().enumerate().filter(|(_, d)| !d.is_null()) {
            let kind = doc
                .get("kind")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            let what = format!("{} document {i} ({kind})", file.display());
            match kind.as_str() {
                "ServiceAccount" => out.service_accounts.push(typed(&doc, &what)),
                "ClusterRole" => out.cluster_roles.push(typed(&doc, &what)),
                "ClusterRoleBinding" => out.bindings.push(typed(&doc, &what)),
                "ConfigMap" => out.config_maps.push(typed(&doc, &what)),
                "DaemonSet" => out.daemon_sets.push(typed(&doc, &what)),
                other => panic!("{what}: unexpected kind {other:?}; add it to this test"),
            }
        }
    }
    out
}

impl Objects {
    /// The one DaemonSet's pod template spec.
    fn pod(&self) -> &k8s_openapi::api::core::v1::PodSpec {
        self.daemon_sets[0]
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .expect("the DaemonSet has a pod template spec")
    }
}

#[test]
fn every_manifest_is_a_valid_kubernetes_object() {
    let o = read_all();
    assert_eq!(
        (
            o.service_accounts.len(),
            o.cluster_roles.len(),
            o.bindings.len(),
            o.config_maps.len(),
            o.daemon_sets.len()
        ),
        (1, 1, 1, 1, 1)
    );
}

#[test]
fn rbac_is_least_privilege_and_bound_to_the_daemonsets_account() {
    let o = read_all();
    let rules = o.cluster_roles[0].rules.clone().unwrap_or_default();
    let mut grants: Vec<String> = Vec::new();
    for r in &rules {
        for g in r.api_groups.clone().unwrap_or_default() {
            for res in r.resources.clone().unwrap_or_default() {
                for v in &r.verbs {
                    grants.push(format!("{g}/{res}:{v}"));
                }
            }
        }
    }
    grants.sort();
    assert_eq!(
        grants,
        [
            "/events:create",
            "/events:patch",
            "/nodes:list",
            "/nodes:watch",
            "/services:list",
            "/services:watch",
            "discovery.k8s.io/endpointslices:list",
            "discovery.k8s.io/endpointslices:watch",
            "events.k8s.io/events:create",
            "events.k8s.io/events:patch",
            "networking.k8s.io/servicecidrs:list",
            "networking.k8s.io/servicecidrs:watch",
        ]
    );
    let b = &o.bindings[0];
    assert_eq!(
        b.role_ref.name,
        o.cluster_roles[0].metadata.name.clone().unwrap()
    );
    let subject = &b.subjects.as_ref().unwrap()[0];
    let sa = &o.service_accounts[0].metadata;
    assert_eq!(
        (Some(&subject.name), subject.namespace.as_ref()),
        (sa.name.as_ref(), sa.namespace.as_ref())
    );
    let pod = o.daemon_sets[0]
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap();
    assert_eq!(pod.service_account_name.as_ref(), sa.name.as_ref());
}

#[test]
fn the_daemonset_runs_kproxy_like_kube_proxy() {
    let o = read_all();
    let ds = &o.daemon_sets[0];
    let spec = ds.spec.as_ref().unwrap();
    let update = spec.update_strategy.as_ref().unwrap();
    assert_eq!(update.type_.as_deref(), Some("RollingUpdate"));
    assert_eq!(
        update.rolling_update.as_ref().unwrap().max_unavailable,
        Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1))
    );
    let pod = o.pod();
    assert_eq!(pod.host_network, Some(true));
    // The takeover sees a running kube-proxy process (docs/migrate.md).
    assert_eq!(pod.host_pid, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists")
                && t.key.is_none()
                && t.effect.is_none())
    );
    let c = &pod.containers[0];
    assert_eq!(
        c.command.as_deref().unwrap(),
        ["kproxy", "run", "--config", "/var/lib/kproxy/config.yaml"]
    );
    let probe_path = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let g = p.as_ref().unwrap().http_get.as_ref().unwrap();
        (g.path.clone().unwrap(), g.port.clone())
    };
    let port = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(10256);
    assert_eq!(
        probe_path(&c.liveness_probe),
        ("/livez".to_string(), port.clone())
    );
    assert_eq!(
        probe_path(&c.readiness_probe),
        ("/healthz".to_string(), port)
    );
    let sc = c.security_context.as_ref().unwrap();
    assert_ne!(sc.privileged, Some(true));
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.add.as_deref().unwrap(), ["NET_ADMIN", "NET_RAW"]);
    assert_eq!(caps.drop.as_deref().unwrap(), ["ALL"]);
    let mounts = c.volume_mounts.as_ref().unwrap();
    // No hostPath: kproxy loads no module, and a node without /lib/modules (a kernel with
    // everything built in) fails a hostPath volume of type Directory (found on
    // a real kubelet).
    assert!(
        pod.volumes
            .as_ref()
            .unwrap()
            .iter()
            .all(|v| v.host_path.is_none()),
        "a hostPath volume in the DaemonSet"
    );
    let cfg_mount = mounts
        .iter()
        .find(|m| m.mount_path == "/var/lib/kproxy")
        .unwrap();
    let vol = pod
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == cfg_mount.name)
        .unwrap();
    assert_eq!(
        vol.config_map.as_ref().unwrap().name,
        o.config_maps[0].metadata.name.clone().unwrap()
    );
    let node_name = c
        .env
        .as_ref()
        .unwrap()
        .iter()
        .find(|e| e.name == "NODE_NAME")
        .unwrap();
    let field = node_name
        .value_from
        .as_ref()
        .unwrap()
        .field_ref
        .as_ref()
        .unwrap();
    assert_eq!(field.field_path, "spec.nodeName");
    // The selector selects the template.
    let labels = spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .clone()
        .unwrap();
    for (k, v) in spec.selector.match_labels.clone().unwrap() {
        assert_eq!(labels.get(&k), Some(&v));
    }
}

#[test]
fn a_privileged_init_container_sets_the_conntrack_sysctls_kproxy_stays_unprivileged() {
    let o = read_all();
    let pod = o.pod();
    let kproxy = &pod.containers[0];
    let init = pod
        .init_containers
        .as_ref()
        .and_then(|c| c.iter().find(|c| c.name == "conntrack-sysctls"))
        .expect("an init container conntrack-sysctls");
    // The same binary and the same config file as the long-running container, so the
    // ConfigMap's `conntrack` section is the one place the values live.
    assert_eq!(init.image, kproxy.image);
    let cmd = kproxy.command.as_deref().unwrap();
    assert_eq!(
        init.command.as_deref().unwrap(),
        ["kproxy", "sysctl", &cmd[2], &cmd[3]]
    );
    let mount = |c: &k8s_openapi::api::core::v1::Container| {
        let m = c
            .volume_mounts
            .as_ref()
            .unwrap()
            .iter()
            .find(|m| cmd[3].starts_with(&m.mount_path))
            .expect("the config file's directory is mounted");
        (m.name.clone(), m.mount_path.clone())
    };
    assert_eq!(mount(init), mount(kproxy));
    // Privileged: container runtimes mount /proc/sys read-only otherwise.
    assert_eq!(
        init.security_context.as_ref().unwrap().privileged,
        Some(true)
    );
    let sc = kproxy.security_context.as_ref().unwrap();
    assert_eq!(
        (sc.privileged, sc.allow_privilege_escalation),
        (Some(false), Some(false))
    );
    // It writes what the shipped config asks for: upstream's defaults.
    let data = o.config_maps[0].data.clone().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, &data["config.yaml"]).unwrap();
    let (cfg, _) = load(&ConfigFlags {
        config: Some(path),
        ..Default::default()
    })
    .unwrap();
    let names: Vec<(String, u64)> = kproxy_config::conntrack_sysctls(&cfg.conntrack, 1)
        .into_iter()
        .map(|s| (s.path.rsplit('/').next().unwrap().to_string(), s.value))
        .collect();
    assert_eq!(
        names,
        [
            ("nf_conntrack_max".to_string(), 131072),
            ("hashsize".to_string(), 32768),
            ("nf_conntrack_tcp_timeout_established".to_string(), 86400),
            ("nf_conntrack_tcp_timeout_close_wait".to_string(), 3600),
        ]
    );
}

#[test]
fn the_configmaps_configuration_loads_cleanly() {
    let o = read_all();
    let data = o.config_maps[0].data.clone().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, &data["config.yaml"]).unwrap();
    let (cfg, warnings) = load(&ConfigFlags {
        config: Some(path),
        ..Default::default()
    })
    .expect("the shipped config loads");
    assert!(warnings.is_empty(), "{warnings:?}");
    // It points at the kubeconfig shipped next to it, in the mounted directory.
    assert_eq!(
        cfg.kubeconfig.as_deref(),
        Some(Path::new("/var/lib/kproxy/kubeconfig.conf"))
    );
    assert!(data.contains_key("kubeconfig.conf"));
    assert_eq!(
        cfg.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        cfg.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    let kc = kube::config::Kubeconfig::from_yaml(&data["kubeconfig.conf"])
        .expect("the shipped kubeconfig parses");
    let user = kc.auth_infos[0].auth_info.as_ref().unwrap();
    assert_eq!(
        user.token_file.as_deref(),
        Some("/var/run/secrets/kubernetes.io/serviceaccount/token")
    );
}

#[test]
fn a_misspelled_field_is_caught_by_the_round_trip() {
    let doc: Value = serde_json::json!({"apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": "x", "namespce": "kube-system"}});
    let t: ServiceAccount = serde_json::from_value(doc.clone()).unwrap();
    let err = subset(&doc, &serde_json::to_value(&t).unwrap(), "").unwrap_err();
    assert!(err.contains(".metadata.namespce"), "{err}");
}
