//! Where `plan`, `explain` and `trace` read the cluster from: manifest files, or the API
//! server once (`kproxy_source::kube::list_once`: the same lists, decoding and fold as
//! `kproxy run`, no watch), with the node's KubeProxyConfiguration from `--config` or
//! from the ConfigMap deploy/ installs. Owns which credentials are used (`--kubeconfig`,
//! `$KUBECONFIG`, `~/.kube/config` as kubectl, the pod's service account), the default
//! namespace they bring, and the flags that bound the calls to the API server.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use kproxy_config::{ConfigFlags, ProxyConfig};
use kproxy_core::{ClusterState, NodePlan, PlanConfig};
use kproxy_source::kube::bounded::{self, CallLimits};
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
    /// Read the cluster from the API server of this kubeconfig. Default: as kubectl,
    /// $KUBECONFIG (`:`-separated, the files that exist, merged), else the --config
    /// file's clientConnection.kubeconfig, else ~/.kube/config (as `kubectl kproxy`:
    /// ~/.kube/config first), else the pod's service account.
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
    #[command(flatten)]
    pub calls: CallFlags,
}

/// The bounds on every call to the API server (`kproxy_source::kube::bounded`); 0: no
/// bound. The defaults are `CallLimits::default()`'s (a test holds them equal).
#[derive(Args, Clone, Debug)]
#[command(next_help_heading = "API server calls (without --manifests)")]
pub struct CallFlags {
    /// Connecting to the API server: DNS, TCP and the TLS handshake; also the wait for
    /// a kubeconfig that is not a regular file (a FIFO).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = kproxy_config::parse_go_duration)]
    pub connect_timeout: Duration,
    /// One API call, from sending the request to the last byte of the answer
    /// (kubectl's flag).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = kproxy_config::parse_go_duration)]
    pub request_timeout: Duration,
    /// No byte from the API server for this long ends the call.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = kproxy_config::parse_go_duration)]
    pub idle_timeout: Duration,
    /// The kubeconfig's exec credential plugin must print its credential within this;
    /// it is killed after.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = kproxy_config::parse_go_duration)]
    pub exec_timeout: Duration,
    /// The most bytes read from the API server, all answers together (256 MiB). It
    /// bounds bytes, not memory: the state built from them takes several times more.
    #[arg(long, value_name = "BYTES", default_value_t = bounded::DEFAULT_MAX_READ_BYTES)]
    pub max_read_bytes: u64,
}

impl CallFlags {
    pub fn limits(&self) -> CallLimits {
        let bound = |d: Duration| (!d.is_zero()).then_some(d);
        CallLimits {
            connect: bound(self.connect_timeout),
            request: bound(self.request_timeout),
            idle: bound(self.idle_timeout),
            exec: bound(self.exec_timeout),
            max_read_bytes: self.max_read_bytes,
        }
    }
}

/// A bounded client for the API server the credentials name (chosen as [`credentials`]
/// says: `kubeconfig`, `$KUBECONFIG`, the configuration's `config_kubeconfig`, …),
/// with the words that name the server and where its address came from, and the
/// kubeconfig context's namespace (`None` in a pod).
pub async fn connect(
    kubeconfig: Option<&Path>,
    context: Option<&str>,
    config_kubeconfig: Option<&Path>,
    calls: &CallFlags,
) -> Result<(kube::Client, String, Option<String>)> {
    let env = std::env::var_os("KUBECONFIG");
    let sources = CredentialSources {
        flag: kubeconfig,
        kubeconfig_env: env.as_deref(),
        plugin: invoked_as_kubectl_plugin(),
        config_kubeconfig,
        home_kubeconfig: home_kubeconfig(),
        in_cluster: std::env::var_os("KUBERNETES_SERVICE_HOST").is_some(),
    };
    let credentials = credentials(&sources, Path::exists).map_err(anyhow::Error::msg)?;
    let limits = calls.limits();
    let mut client_config = api::client_config(&credentials, context, limits.connect)
        .await
        .context("no --manifests: reading the cluster from the API server")?;
    let namespace =
        (credentials != Credentials::InCluster).then(|| client_config.default_namespace.clone());
    api::kubeconfig::run_exec_plugin(&mut client_config, limits.exec).await?;
    // Which server, and from where: what to change when it is the wrong one.
    let server = format!(
        "reading the cluster from {} (credentials: {credentials}{})",
        client_config.cluster_url,
        context
            .map(|c| format!(", context {c}"))
            .unwrap_or_default()
    );
    let client =
        bounded::client(client_config, &limits).context("building the Kubernetes client")?;
    Ok((client, server, namespace))
}

/// Which API server an operator's command (`status`, `install`, `connectivity-test`)
/// talks to, with the bounds on its calls: kubectl's credentials, no `--config` file.
#[derive(Args, Clone, Debug)]
pub struct ApiArgs {
    /// The kubeconfig to use (default: as kubectl: $KUBECONFIG, ~/.kube/config, else
    /// the pod's service account).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use instead of its current context.
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
    #[command(flatten)]
    pub calls: CallFlags,
}

impl ApiArgs {
    /// As [`connect`] without --config, then the API server reached (`/version`), its
    /// error naming the server and how to pick another cluster: the client and the
    /// server's address.
    pub async fn reach(&self) -> Result<(kube::Client, String)> {
        let (client, server, _) = connect(
            self.kubeconfig.as_deref(),
            self.context.as_deref(),
            None,
            &self.calls,
        )
        .await?;
        api::reach(&client).await.with_context(|| {
            format!("{server}; another cluster: --kubeconfig FILE, $KUBECONFIG or --context NAME")
        })?;
        Ok((client, server))
    }
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

/// What [`credentials`] decides from: the flag, the environment and the files there.
#[derive(Clone, Debug, Default)]
pub struct CredentialSources<'a> {
    pub flag: Option<&'a Path>,
    /// `$KUBECONFIG`.
    pub kubeconfig_env: Option<&'a OsStr>,
    /// Run as `kubectl kproxy`: kubectl's ~/.kube/config before the configuration's.
    pub plugin: bool,
    /// The --config file's clientConnection.kubeconfig.
    pub config_kubeconfig: Option<&'a Path>,
    /// `~/.kube/config`, when it exists.
    pub home_kubeconfig: Option<PathBuf>,
    /// `KUBERNETES_SERVICE_HOST` is set: in a pod.
    pub in_cluster: bool,
}

/// Which credentials reach the API server, as kubectl chooses: `--kubeconfig`; else
/// `$KUBECONFIG`'s files that exist (`exists`), merged; else the --config file's
/// clientConnection.kubeconfig (as `kproxy run`) and `~/.kube/config` (kubectl's
/// default, first as the plugin); else the pod's service account. `Err`: what to give.
pub fn credentials(
    from: &CredentialSources<'_>,
    exists: impl Fn(&Path) -> bool,
) -> Result<Credentials, String> {
    if let Some(path) = from.flag {
        return Ok(Credentials::file(path, "--kubeconfig"));
    }
    if let Some(value) = from.kubeconfig_env.filter(|v| !v.is_empty()) {
        let listed: Vec<PathBuf> = std::env::split_paths(value)
            .filter(|p| !p.as_os_str().is_empty())
            .collect();
        let files: Vec<PathBuf> = listed.iter().filter(|p| exists(p)).cloned().collect();
        if files.is_empty() {
            return Err(format!(
                "$KUBECONFIG names no file that exists ({}): set it to your kubeconfig, give --kubeconfig FILE, or read manifests with --manifests PATH",
                value.to_string_lossy()
            ));
        }
        return Ok(Credentials::Kubeconfig {
            files,
            origin: "$KUBECONFIG".into(),
        });
    }
    let config = from
        .config_kubeconfig
        .map(|p| Credentials::file(p, "--config's clientConnection.kubeconfig"));
    let home = from
        .home_kubeconfig
        .as_deref()
        .map(|p| Credentials::file(p, "~/.kube/config"));
    let found = if from.plugin {
        home.or(config)
    } else {
        config.or(home)
    };
    match found {
        Some(c) => Ok(c),
        None if from.in_cluster => Ok(Credentials::InCluster),
        None => Err(
            "no API server to read from: give --kubeconfig FILE or set KUBECONFIG (there is no ~/.kube/config, and this is not a pod: KUBERNETES_SERVICE_HOST is unset), or read manifests with --manifests PATH"
                .into(),
        ),
    }
}

/// `~/.kube/config`, when it exists.
fn home_kubeconfig() -> Option<PathBuf> {
    let path = Path::new(&std::env::var_os("HOME")?).join(".kube/config");
    path.exists().then_some(path)
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
        let (client, server, namespace) = connect(
            self.kubeconfig.as_deref(),
            self.context.as_deref(),
            file_config.as_ref().and_then(|c| c.kubeconfig.as_deref()),
            &self.calls,
        )
        .await?;
        api::reach(&client).await.with_context(|| {
            format!("{server}; another cluster: --kubeconfig FILE, $KUBECONFIG or --context NAME; no cluster: --manifests PATH")
        })?;
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
            watch_idle: None,
        };
        let snapshot = api::list_once(client, source).await.context(server)?;
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
            files: Vec::new(),
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
    fn credentials_are_chosen_as_kubectl_chooses() {
        let (flag, file, home) = (
            Path::new("/flag"),
            Path::new("/config"),
            PathBuf::from("/home/.kube/config"),
        );
        let k = |p: &Path, origin: &str| Credentials::file(p, origin);
        let exists = |p: &Path| !p.starts_with("/missing");
        let env = OsStr::new("/missing/a:/b::/c:/missing/d");
        let all = CredentialSources {
            flag: Some(flag),
            kubeconfig_env: Some(env),
            plugin: true,
            config_kubeconfig: Some(file),
            home_kubeconfig: Some(home.clone()),
            in_cluster: true,
        };
        let pick = |s: &CredentialSources<'_>| credentials(s, exists);
        assert_eq!(pick(&all), Ok(k(flag, "--kubeconfig")));
        let no_flag = CredentialSources {
            flag: None,
            ..all.clone()
        };
        assert_eq!(
            pick(&no_flag),
            Ok(Credentials::Kubeconfig {
                files: vec!["/b".into(), "/c".into()],
                origin: "$KUBECONFIG".into()
            }),
            "the files that exist, in order, empty entries ignored"
        );
        let none_exist = CredentialSources {
            kubeconfig_env: Some(OsStr::new("/missing/a:/missing/b")),
            ..no_flag.clone()
        };
        let err = pick(&none_exist).unwrap_err();
        assert!(
            err.contains("$KUBECONFIG names no file that exists (/missing/a:/missing/b)"),
            "{err}"
        );
        assert!(err.contains("--kubeconfig FILE"), "{err}");
        let empty_env = CredentialSources {
            kubeconfig_env: Some(OsStr::new("")),
            ..no_flag.clone()
        };
        assert_eq!(
            pick(&empty_env),
            Ok(k(&home, "~/.kube/config")),
            "the plugin: kubectl's first"
        );
        let plain = CredentialSources {
            plugin: false,
            ..empty_env.clone()
        };
        assert_eq!(
            pick(&plain),
            Ok(k(file, "--config's clientConnection.kubeconfig"))
        );
        let no_config = CredentialSources {
            config_kubeconfig: None,
            ..plain.clone()
        };
        assert_eq!(pick(&no_config), Ok(k(&home, "~/.kube/config")));
        let pod = CredentialSources {
            home_kubeconfig: None,
            ..no_config.clone()
        };
        assert_eq!(pick(&pod), Ok(Credentials::InCluster));
        let nothing = CredentialSources {
            in_cluster: false,
            ..pod
        };
        let err = pick(&nothing).unwrap_err();
        for hint in ["--kubeconfig FILE", "KUBECONFIG", "--manifests PATH"] {
            assert!(err.contains(hint), "{err}");
        }
    }

    #[test]
    fn the_call_flags_defaults_are_the_libraries() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            calls: CallFlags,
        }
        let cli = <Cli as clap::Parser>::parse_from(["kproxy"]);
        assert_eq!(cli.calls.limits(), CallLimits::default());
        let cli = <Cli as clap::Parser>::parse_from([
            "kproxy",
            "--request-timeout",
            "0",
            "--idle-timeout",
            "1.5s",
        ]);
        assert_eq!(
            cli.calls.limits().request,
            None,
            "0: no bound, as kubectl's"
        );
        assert_eq!(cli.calls.limits().idle, Some(Duration::from_millis(1500)));
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
