//! Where `plan`, `explain` and `trace` read the cluster from: manifest files, or the API
//! server once (`kproxy_source::kube::list_once`: the same lists, decoding and fold as
//! `kproxy run`, no watch), with the node's KubeProxyConfiguration from `--config` or
//! from the ConfigMap deploy/ installs. Owns which credentials are used (`--kubeconfig`,
//! kubectl's when run as the kubectl plugin, the pod's service account) and the default
//! namespace they bring.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use kproxy_config::{ConfigFlags, ProxyConfig};
use kproxy_core::{ClusterState, NodePlan, PlanConfig};
use kproxy_source::kube::{self as api, Credentials, KubeSourceConfig};

use crate::common::{InputArgs, LoadReport, plan_of};

/// The file name the binary answers to as a kubectl plugin (`kubectl kproxy …`).
pub const KUBECTL_PLUGIN_NAME: &str = "kubectl-kproxy";

/// The ConfigMap keys that hold a KubeProxyConfiguration: deploy/configmap.yaml's,
/// then kubeadm's `kube-proxy` ConfigMap's.
const CONFIG_MAP_KEYS: [&str; 2] = ["config.yaml", "config.conf"];

/// Whether the process was started under the kubectl plugin's name (argv[0]'s file
/// name, as kubectl runs `kubectl-kproxy` from PATH; a symlink to kproxy does).
pub fn is_kubectl_plugin(argv0: &OsStr) -> bool {
    Path::new(argv0).file_name() == Some(OsStr::new(KUBECTL_PLUGIN_NAME))
}

/// Whether this process runs as `kubectl-kproxy`.
pub fn invoked_as_kubectl_plugin() -> bool {
    std::env::args_os()
        .next()
        .is_some_and(|a| is_kubectl_plugin(&a))
}

/// The cluster source of `plan`, `explain` and `trace`.
#[derive(Args, Clone, Debug)]
pub struct ClusterArgs {
    /// Read the cluster from this manifest file or directory (recursive; .yaml, .yml,
    /// .json) instead of the API server.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["kubeconfig", "context", "config_map"])]
    pub manifests: Option<PathBuf>,
    /// Read the cluster from the API server of this kubeconfig. Default: kubectl's
    /// ($KUBECONFIG, else ~/.kube/config) as `kubectl kproxy`, else the --config file's
    /// clientConnection.kubeconfig, else the pod's service account.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use instead of its current context.
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
    /// This node's name (its Node object supplies zone, addresses and pod CIDRs).
    /// Default: the configuration's hostnameOverride, else $NODE_NAME (set in kproxy's
    /// pod).
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
    /// From the API server without --config: the ConfigMap holding the node's
    /// KubeProxyConfiguration (key config.yaml, or kubeadm's config.conf).
    #[arg(
        long,
        value_name = "NAMESPACE/NAME",
        default_value = "kube-system/kproxy"
    )]
    pub config_map: String,
    #[command(flatten)]
    pub input: InputArgs,
}

/// What was read: the state, the configuration and the node they are planned for.
pub struct Cluster {
    pub state: ClusterState,
    pub report: LoadReport,
    pub config: ProxyConfig,
    pub node: String,
    /// The kubeconfig context's namespace: kubectl's default namespace. `None` for
    /// manifests and in a pod.
    pub namespace: Option<String>,
}

impl Cluster {
    /// The node's plan, with `config` (this cluster's planner settings, adjusted).
    pub fn plan_with(&self, config: &PlanConfig) -> NodePlan {
        plan_of(&self.state, &self.node, config)
    }
}

/// Which credentials reach the API server: the flag; kubectl's as the plugin; the
/// configuration's clientConnection.kubeconfig (as `kproxy run`); the pod's service
/// account.
pub fn credentials(
    flag: Option<&Path>,
    plugin: bool,
    config_kubeconfig: Option<&Path>,
) -> Credentials {
    match (flag, plugin, config_kubeconfig) {
        (Some(path), _, _) => Credentials::Kubeconfig(path.to_path_buf()),
        (None, true, _) => Credentials::Kubectl,
        (None, false, Some(path)) => Credentials::Kubeconfig(path.to_path_buf()),
        (None, false, None) => Credentials::InCluster,
    }
}

/// The node's name: the flag, the configuration's hostnameOverride, else `NODE_NAME`.
fn node_name(flag: Option<&str>, cfg: &ProxyConfig, env: Option<String>) -> Result<String> {
    let name = flag
        .map(str::to_string)
        .or_else(|| cfg.hostname_override.clone())
        .or(env)
        .map(|n| n.trim().to_lowercase())
        .filter(|n| !n.is_empty());
    name.context("which node? give --node NAME (NODE_NAME is unset)")
}

/// `NAMESPACE/NAME` of `--config-map`.
fn split_config_map(s: &str) -> Result<(&str, &str)> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns, name))
        }
        _ => bail!("--config-map must be NAMESPACE/NAME, got {s:?}"),
    }
}

impl ClusterArgs {
    /// Reads the cluster once: the manifests, or the API server.
    pub fn read(&self) -> Result<Cluster> {
        match &self.manifests {
            Some(path) => {
                let config = self.input.proxy_config(ConfigFlags::default())?;
                let node = node_name(
                    self.node.as_deref(),
                    &config,
                    std::env::var("NODE_NAME").ok(),
                )?;
                let (state, report) = self.input.load(path, &node)?;
                Ok(Cluster {
                    state,
                    report,
                    config,
                    node,
                    namespace: None,
                })
            }
            None => {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .context("starting the async runtime")?;
                runtime.block_on(self.read_api())
            }
        }
    }

    async fn read_api(&self) -> Result<Cluster> {
        // --config first: its clientConnection.kubeconfig may say how to reach the API.
        let file_config = match &self.input.config {
            Some(_) => Some(self.input.proxy_config(ConfigFlags::default())?),
            None => None,
        };
        let credentials = credentials(
            self.kubeconfig.as_deref(),
            invoked_as_kubectl_plugin(),
            file_config.as_ref().and_then(|c| c.kubeconfig.as_deref()),
        );
        let client_config = api::client_config(&credentials, self.context.as_deref())
            .await
            .context("no --manifests: reading the cluster from the API server")?;
        let namespace = (credentials != Credentials::InCluster)
            .then(|| client_config.default_namespace.clone());
        let client =
            kube::Client::try_from(client_config).context("building the Kubernetes client")?;
        let mut problems = 0;
        let config = match file_config {
            Some(c) => c,
            None => {
                let (c, ok) = self.config_from_map(client.clone()).await?;
                problems += usize::from(!ok);
                c
            }
        };
        let node = node_name(
            self.node.as_deref(),
            &config,
            std::env::var("NODE_NAME").ok(),
        )?;
        let source = KubeSourceConfig {
            node_name: node.clone(),
            ownership: self.input.ownership(),
            page_size: None,
            json_lists: config.content_type == kproxy_config::ContentType::Json,
        };
        let snapshot = api::list_once(client, source)
            .await
            .context("reading the cluster from the API server")?;
        for w in &snapshot.found.skipped {
            eprintln!("kproxy: skipped: {w}");
        }
        for w in &snapshot.found.warnings {
            eprintln!("kproxy: warning: {w}");
        }
        for (kind, error) in &snapshot.unlisted {
            eprintln!(
                "kproxy: warning: {kind} not listed ({error}): the plan drops no traffic to unallocated service addresses"
            );
        }
        problems +=
            snapshot.found.skipped.len() + snapshot.found.warnings.len() + snapshot.unlisted.len();
        let report = LoadReport {
            strict_failed: self.input.strict && problems > 0,
            skipped: !snapshot.found.skipped.is_empty(),
            lost: false,
        };
        Ok(Cluster {
            state: snapshot.state,
            report,
            config,
            node,
            namespace,
        })
    }

    /// The configuration in `--config-map`, or upstream's defaults with a warning when
    /// it cannot be read (false: that was reported).
    async fn config_from_map(&self, client: kube::Client) -> Result<(ProxyConfig, bool)> {
        let (namespace, name) = split_config_map(&self.config_map)?;
        let found = api::config_map_value(client, namespace, name, &CONFIG_MAP_KEYS).await;
        let why = match found {
            Ok(Some((key, text))) => {
                let origin = format!("ConfigMap {namespace}/{name} key {key}");
                let (cfg, warnings) =
                    kproxy_config::load_str(&origin, &text, &ConfigFlags::default())
                        .with_context(|| format!("loading the configuration in {origin}"))?;
                return Ok((self.input.with_flags(cfg, &warnings), true));
            }
            Ok(None) => format!(
                "no ConfigMap {namespace}/{name} with a key {}",
                CONFIG_MAP_KEYS.join(" or ")
            ),
            Err(e) => e.to_string(),
        };
        eprintln!(
            "kproxy: warning: {why}: planning with upstream's default configuration (give --config FILE or --config-map NAMESPACE/NAME)"
        );
        Ok((self.input.with_flags(ProxyConfig::default(), &[]), false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plugin_is_known_by_its_file_name() {
        for (argv0, plugin) in [
            ("kubectl-kproxy", true),
            ("/usr/local/bin/kubectl-kproxy", true),
            ("./kubectl-kproxy", true),
            ("kproxy", false),
            ("/usr/bin/kproxy", false),
            ("kubectl-kproxy-old", false),
            ("/opt/kubectl-kproxy/kproxy", false),
        ] {
            assert_eq!(is_kubectl_plugin(OsStr::new(argv0)), plugin, "{argv0}");
        }
    }

    #[test]
    fn credentials_follow_the_flag_then_kubectl_then_the_configuration() {
        let (flag, file) = (Path::new("/flag"), Path::new("/config"));
        let k = |p: &Path| Credentials::Kubeconfig(p.to_path_buf());
        assert_eq!(credentials(Some(flag), true, Some(file)), k(flag));
        assert_eq!(credentials(Some(flag), false, None), k(flag));
        assert_eq!(credentials(None, true, Some(file)), Credentials::Kubectl);
        assert_eq!(credentials(None, false, Some(file)), k(file));
        assert_eq!(credentials(None, false, None), Credentials::InCluster);
    }

    #[test]
    fn the_node_is_the_flag_then_the_override_then_node_name() {
        let mut cfg = ProxyConfig::default();
        let env = || Some("Node-E".to_string());
        assert_eq!(node_name(Some("a"), &cfg, env()).unwrap(), "a");
        assert_eq!(node_name(None, &cfg, env()).unwrap(), "node-e");
        cfg.hostname_override = Some("node-o".into());
        assert_eq!(node_name(None, &cfg, env()).unwrap(), "node-o");
        let err = node_name(None, &ProxyConfig::default(), Some(" ".into())).unwrap_err();
        assert_eq!(
            err.to_string(),
            "which node? give --node NAME (NODE_NAME is unset)"
        );
    }

    #[test]
    fn config_map_names_are_namespace_slash_name() {
        assert_eq!(
            split_config_map("kube-system/kproxy").unwrap(),
            ("kube-system", "kproxy")
        );
        for bad in ["kproxy", "/kproxy", "kube-system/", "a/b/c"] {
            assert!(split_config_map(bad).is_err(), "{bad}");
        }
    }
}
