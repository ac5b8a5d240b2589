//! kube-proxy-compatible configuration: a `kubeproxy.config.k8s.io/v1alpha1`
//! KubeProxyConfiguration file (YAML or JSON) plus kube-proxy's command-line flags,
//! resolved into one [`ProxyConfig`]. Precedence as in kube-proxy: defaults, then the
//! file, then flags that were given explicitly.
//!
//! Owns: the schema of the file, upstream's defaults, which fields apply to an nftables
//! proxy (honoured), which do not (a [`ConfigWarning`] with the field's path when set to
//! anything but its zero value, so a kubeadm-generated file stays quiet), and the
//! conntrack sysctls derived from the `conntrack` section. Pure apart from reading the
//! file: the daemon applies the result.

#![forbid(unsafe_code)]

mod duration;
mod file;
mod names;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use kproxy_core::PlanConfig;
use kproxy_core::config::{LocalDetectorConfig, NodePortAddressesConfig};

pub use duration::parse_go_duration;
use file::{Conntrack, Nftables};
pub use file::{FieldUse, KubeProxyConfiguration, field_use};
pub use names::{parse_nft_table_name, parse_port_range};

/// Upstream's `ports.ProxyHealthzPort`.
pub const DEFAULT_HEALTHZ_PORT: u16 = 10256;
/// Upstream's `ports.ProxyStatusPort`.
pub const DEFAULT_METRICS_PORT: u16 = 10249;
pub const API_VERSION: &str = "kubeproxy.config.k8s.io/v1alpha1";
pub const KIND: &str = "KubeProxyConfiguration";

/// kube-proxy's flags that kproxy honours (same long names, same value syntax).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ConfigFlags {
    /// KubeProxyConfiguration file (kubeproxy.config.k8s.io/v1alpha1, YAML or JSON).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// kubeconfig file; in-cluster configuration when absent.
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Use this name as the Node's name instead of the host name.
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// Overrides kproxy's idea of the node's primary IP family for default addresses.
    #[arg(long, value_name = "IP")]
    pub bind_address: Option<String>,
    /// IP:PORT of the /healthz and /livez server; "" disables it.
    #[arg(long, value_name = "IP:PORT")]
    pub healthz_bind_address: Option<String>,
    /// IP:PORT of the /metrics server; "" disables it.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_bind_address: Option<String>,
    /// Pod CIDRs of the cluster (one per family), for --detect-local-mode ClusterCIDR.
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Option<String>,
    /// ClusterCIDR | NodeCIDR | InterfaceNamePrefix | BridgeInterface | None.
    #[arg(long, value_name = "MODE")]
    pub detect_local_mode: Option<String>,
    /// Interface name prefix of local pods (InterfaceNamePrefix mode).
    #[arg(long, value_name = "PREFIX")]
    pub pod_interface_name_prefix: Option<String>,
    /// Bridge of local pods (BridgeInterface mode).
    #[arg(long, value_name = "NAME")]
    pub pod_bridge_interface: Option<String>,
    /// CIDRs of node addresses that accept NodePorts, or `primary` (the default).
    #[arg(long, value_name = "CIDR[,..]|primary")]
    pub nodeport_addresses: Option<String>,
    /// SNAT all traffic sent to cluster IPs.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub masquerade_all: Option<bool>,
    /// Bit of the packet mark that flags traffic for masquerade (0-31).
    #[arg(long, value_name = "N")]
    pub masquerade_bit: Option<i64>,
    /// Minimum time between two syncs (Go duration: 100ms, 1s, 1m30s).
    #[arg(long, value_name = "DURATION")]
    pub min_sync_period: Option<String>,
    /// Period of the full resync (Go duration).
    #[arg(long, value_name = "DURATION")]
    pub sync_period: Option<String>,
    /// Feature gates, `Name=true|false,...`.
    #[arg(long, value_name = "K=V,..")]
    pub feature_gates: Option<String>,
    /// Fall back to serving terminating endpoints (KEP-1669); false = kube-proxy before 1.26.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub proxy_terminating_endpoints: Option<bool>,
}

/// The `conntrack` section, defaulted. Zero means "leave the kernel's value".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConntrackConfig {
    pub max_per_core: u32,
    pub min: u32,
    pub tcp_established_timeout: Duration,
    pub tcp_close_wait_timeout: Duration,
    pub tcp_be_liberal: bool,
    pub udp_timeout: Duration,
    pub udp_stream_timeout: Duration,
}

impl Default for ConntrackConfig {
    /// Upstream's v1alpha1 defaults.
    fn default() -> Self {
        ConntrackConfig {
            max_per_core: 32 * 1024,
            min: 128 * 1024,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// Everything resolved: what the daemon needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyConfig {
    pub hostname_override: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    /// `clientConnection.contentType`: the encoding asked for the Service and
    /// EndpointSlice lists.
    pub content_type: ContentType,
    pub bind_address: IpAddr,
    /// `None`: disabled.
    pub healthz_bind_address: Option<SocketAddr>,
    /// `None`: disabled.
    pub metrics_bind_address: Option<SocketAddr>,
    pub plan: PlanConfig,
    pub masquerade_bit: u8,
    /// minSyncPeriod as the operator set it (flag, or a non-zero value in the file);
    /// `None`: not set, and kproxy paces its syncs itself (docs/config.md, "Sync
    /// pacing"): at once when idle, coalesced during a storm.
    pub min_sync_period: Option<Duration>,
    pub sync_period: Duration,
    pub conntrack: ConntrackConfig,
    /// Every gate given (file, then flag), including those kproxy does not act on.
    pub feature_gates: BTreeMap<String, bool>,
}

impl Default for ProxyConfig {
    /// kube-proxy's defaults (nftables mode).
    fn default() -> Self {
        ProxyConfig {
            hostname_override: None,
            kubeconfig: None,
            content_type: ContentType::Protobuf,
            bind_address: IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            healthz_bind_address: Some(SocketAddr::from(([0, 0, 0, 0], DEFAULT_HEALTHZ_PORT))),
            metrics_bind_address: Some(SocketAddr::from(([127, 0, 0, 1], DEFAULT_METRICS_PORT))),
            plan: PlanConfig::default(),
            masquerade_bit: 14,
            min_sync_period: None,
            sync_period: Duration::from_secs(30),
            conntrack: ConntrackConfig::default(),
            feature_gates: BTreeMap::new(),
        }
    }
}

/// A field that was read but has no effect in kproxy, or that kproxy does not know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigWarning {
    /// `iptables.syncPeriod`, or a flag (`--feature-gates`).
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Not a regular file (a FIFO would hang the read, `/dev/zero` never end), or
    /// larger than a configuration is ([`MAX_CONFIG_BYTES`]).
    #[error("config file {path}: {why}")]
    Refused { path: PathBuf, why: String },
    /// A bad value in the file: the file and the field's path.
    #[error("{file}: {path}: {message}")]
    Field {
        file: String,
        path: String,
        message: String,
    },
    /// A bad flag value.
    #[error("{flag}: {message}")]
    Flag { flag: String, message: String },
}

/// Feature gates that change what kproxy does.
const GATE_PREFER_SAME_NODE: &str = "PreferSameTrafficDistribution";
const GATE_PROXY_TERMINATING: &str = "ProxyTerminatingEndpoints";
const GATE_DRAINING_NODES: &str = "KubeProxyDrainingTerminatingNodes";

/// Reads `flags.config` (if set) and resolves it with the flags.
pub fn load(flags: &ConfigFlags) -> Result<(ProxyConfig, Vec<ConfigWarning>), ConfigError> {
    match &flags.config {
        Some(path) => {
            let text = read_config(path)?;
            load_str(&path.display().to_string(), &text, flags)
        }
        None => resolve(None, flags),
    }
}

/// The largest `--config` file read: a KubeProxyConfiguration is a few KB, and one
/// mounted from a ConfigMap at most 1 MiB (etcd's object limit).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The text of config file `path`: a regular file (symlinks followed, as a ConfigMap
/// volume's are) of at most [`MAX_CONFIG_BYTES`], checked on the open file. A FIFO
/// hung the loader, `/dev/zero` grew it to 1 GB, a 2 GB sparse file to 2.1 GB.
fn read_config(path: &std::path::Path) -> Result<String, ConfigError> {
    use std::io::Read;
    let read = |source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    };
    let refused = |why: String| ConfigError::Refused {
        path: path.to_path_buf(),
        why,
    };
    // The kind before opening: opening a FIFO for reading blocks until a writer comes.
    let kind = std::fs::metadata(path).map_err(read)?.file_type();
    if !kind.is_file() {
        return Err(refused(format!(
            "not a regular file ({}); kproxy reads its configuration only from regular files",
            file_kind(&kind)
        )));
    }
    let file = std::fs::File::open(path).map_err(read)?;
    let meta = file.metadata().map_err(read)?;
    if !meta.is_file() || meta.len() > MAX_CONFIG_BYTES {
        return Err(refused(format!(
            "{} bytes, more than a configuration holds (at most {MAX_CONFIG_BYTES})",
            meta.len()
        )));
    }
    let mut text = String::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(read)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(refused(format!(
            "it grew past {MAX_CONFIG_BYTES} bytes while read"
        )));
    }
    Ok(text)
}

/// What a file that is not a regular one is, for the error.
fn file_kind(kind: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if kind.is_dir() {
        "a directory"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// As [`load`], with the file's text given (`file` names it in errors).
pub fn load_str(
    file: &str,
    text: &str,
    flags: &ConfigFlags,
) -> Result<(ProxyConfig, Vec<ConfigWarning>), ConfigError> {
    let (parsed, mut warnings) = file::parse(file, text)?;
    let (cfg, more) = resolve(Some((file, parsed)), flags)?;
    warnings.extend(more);
    Ok((cfg, warnings))
}

/// How kproxy asks the API server to encode the big lists (Services and
/// EndpointSlices); watches are JSON either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContentType {
    /// `application/vnd.kubernetes.protobuf`, kube-proxy's default: several times
    /// cheaper for the API server to encode and for kproxy to read.
    #[default]
    Protobuf,
    /// `application/json`.
    Json,
}

/// Where a value came from, for error messages.
#[derive(Clone, Copy)]
enum Origin<'a> {
    File(&'a str, &'a str),
    Flag(&'a str),
}

impl Origin<'_> {
    fn err(self, message: impl Into<String>) -> ConfigError {
        match self {
            Origin::File(file, path) => ConfigError::Field {
                file: file.to_string(),
                path: path.to_string(),
                message: message.into(),
            },
            Origin::Flag(flag) => ConfigError::Flag {
                flag: flag.to_string(),
                message: message.into(),
            },
        }
    }

    fn warn(self, message: impl Into<String>) -> ConfigWarning {
        let path = match self {
            Origin::File(_, path) => path.to_string(),
            Origin::Flag(flag) => flag.to_string(),
        };
        ConfigWarning {
            path,
            message: message.into(),
        }
    }
}

/// The flag's value when given, else the file's (each with its origin).
fn pick<'a, T>(
    flag: Option<T>,
    flag_name: &'a str,
    file_value: Option<T>,
    file: Option<&'a str>,
    path: &'a str,
) -> Option<(T, Origin<'a>)> {
    match (flag, file_value, file) {
        (Some(v), _, _) => Some((v, Origin::Flag(flag_name))),
        (None, Some(v), Some(file)) => Some((v, Origin::File(file, path))),
        _ => None,
    }
}

fn resolve(
    file: Option<(&str, KubeProxyConfiguration)>,
    flags: &ConfigFlags,
) -> Result<(ProxyConfig, Vec<ConfigWarning>), ConfigError> {
    let (name, f) = match file {
        Some((name, f)) => (Some(name), f),
        None => (None, KubeProxyConfiguration::default()),
    };
    let mut warnings = Vec::new();
    let mut cfg = ProxyConfig::default();

    check_mode(&f, name)?;
    resolve_feature_gates(&f, flags, name, &mut cfg, &mut warnings)?;
    resolve_addresses(&f, flags, name, &mut cfg)?;
    resolve_nftables(
        &f.nftables.clone().unwrap_or_default(),
        flags,
        name,
        &mut cfg,
    )?;
    cfg.plan.local_detector = resolve_local_detector(&f, flags, name, &mut warnings)?;
    if let Some(npa) = resolve_node_port_addresses(&f, flags, name, &mut warnings)? {
        cfg.plan.node_port_addresses = npa;
    }
    cfg.conntrack = resolve_conntrack(
        &f.conntrack.clone().unwrap_or_default(),
        name,
        &mut warnings,
    )?;
    Ok((cfg, warnings))
}

/// `mode`: kproxy is an nftables proxy; anything else is refused.
fn check_mode(f: &KubeProxyConfiguration, name: Option<&str>) -> Result<(), ConfigError> {
    if let Some(mode) = f.mode.as_deref()
        && !mode.is_empty()
        && mode != "nftables"
    {
        return Err(Origin::File(name.unwrap_or(""), "mode").err(format!(
            "proxy mode {:?} is not supported: kproxy is an nftables proxy; set mode: nftables (or leave it empty)",
            mode.escape_debug().to_string()
        )));
    }

    Ok(())
}

/// Feature gates: the file's, then the flag's on top; kproxy acts on two of them.
fn resolve_feature_gates(
    f: &KubeProxyConfiguration,
    flags: &ConfigFlags,
    name: Option<&str>,
    cfg: &mut ProxyConfig,
    warnings: &mut Vec<ConfigWarning>,
) -> Result<(), ConfigError> {
    let mut gates: Vec<(String, bool, Origin)> = Vec::new();
    if let (Some(g), Some(file)) = (&f.feature_gates, name) {
        gates.extend(
            g.iter()
                .map(|(k, v)| (k.clone(), *v, Origin::File(file, "featureGates"))),
        );
    }
    if let Some(s) = &flags.feature_gates {
        for (k, v) in parse_feature_gates(s)? {
            gates.push((k, v, Origin::Flag("--feature-gates")));
        }
    }
    for (k, v, origin) in gates {
        match k.as_str() {
            GATE_PREFER_SAME_NODE => cfg.plan.prefer_same_node_hints = v,
            GATE_PROXY_TERMINATING => cfg.plan.proxy_terminating_endpoints = v,
            GATE_DRAINING_NODES => cfg.plan.drain_terminating_nodes = v,
            _ => warnings.push(origin.warn(format!(
                "feature gate {:?} does not change kproxy's behaviour (kproxy acts on {GATE_PREFER_SAME_NODE}, {GATE_PROXY_TERMINATING} and {GATE_DRAINING_NODES})",
                k.escape_debug().to_string()
            ))),
        }
        cfg.feature_gates.insert(k, v);
    }
    if let Some(v) = flags.proxy_terminating_endpoints {
        cfg.plan.proxy_terminating_endpoints = v;
    }

    Ok(())
}

/// Where kproxy finds the API server and who it is, and where its servers listen:
/// kubeconfig, hostnameOverride, bindAddress, healthzBindAddress, metricsBindAddress.
fn resolve_addresses(
    f: &KubeProxyConfiguration,
    flags: &ConfigFlags,
    name: Option<&str>,
    cfg: &mut ProxyConfig,
) -> Result<(), ConfigError> {
    let kubeconfig_file = f
        .client_connection
        .as_ref()
        .and_then(|c| c.kubeconfig.clone())
        .filter(|s| !s.is_empty());
    cfg.kubeconfig = flags
        .kubeconfig
        .clone()
        .or(kubeconfig_file.map(PathBuf::from));
    let content_type = f
        .client_connection
        .as_ref()
        .and_then(|c| c.content_type.as_deref());
    cfg.content_type = match content_type.map(str::trim) {
        None | Some("") | Some("application/vnd.kubernetes.protobuf") => ContentType::Protobuf,
        Some("application/json") => ContentType::Json,
        Some(other) => {
            let origin = Origin::File(name.unwrap_or("config"), "clientConnection.contentType");
            return Err(origin.err(format!(
                "{:?} is neither application/vnd.kubernetes.protobuf nor application/json",
                other.escape_debug().to_string()
            )));
        }
    };

    let hostname_file = f.hostname_override.clone();
    cfg.hostname_override = flags
        .hostname_override
        .clone()
        .or(hostname_file)
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());

    if let Some((s, origin)) = pick(
        flags.bind_address.clone(),
        "--bind-address",
        f.bind_address.clone(),
        name,
        "bindAddress",
    ) && !s.is_empty()
    {
        cfg.bind_address = parse_ip(&s).ok_or_else(|| {
            origin.err(format!(
                "{:?} is not an IP address",
                s.escape_debug().to_string()
            ))
        })?;
    }
    let v6 = cfg.bind_address.is_ipv6();
    cfg.healthz_bind_address = Some(default_addr(v6, false));
    cfg.metrics_bind_address = Some(default_addr(v6, true));
    for (metrics, flag, path, file_value) in [
        (
            false,
            &flags.healthz_bind_address,
            "healthzBindAddress",
            &f.healthz_bind_address,
        ),
        (
            true,
            &flags.metrics_bind_address,
            "metricsBindAddress",
            &f.metrics_bind_address,
        ),
    ] {
        let flag_name = if metrics {
            "--metrics-bind-address"
        } else {
            "--healthz-bind-address"
        };
        let port = if metrics {
            DEFAULT_METRICS_PORT
        } else {
            DEFAULT_HEALTHZ_PORT
        };
        let addr = match pick(flag.clone(), flag_name, file_value.clone(), name, path) {
            // An empty flag disables the server; an empty field means the default.
            Some((s, Origin::Flag(_))) if s.trim().is_empty() => None,
            Some((s, _)) if s.trim().is_empty() => Some(default_addr(v6, metrics)),
            Some((s, origin)) => Some(parse_bind_address(&s, port).map_err(|m| origin.err(m))?),
            None => Some(default_addr(v6, metrics)),
        };
        if metrics {
            cfg.metrics_bind_address = addr;
        } else {
            cfg.healthz_bind_address = addr;
        }
    }

    Ok(())
}

/// The `nftables` section: masqueradeBit, masqueradeAll, syncPeriod, minSyncPeriod.
fn resolve_nftables(
    nft: &Nftables,
    flags: &ConfigFlags,
    name: Option<&str>,
    cfg: &mut ProxyConfig,
) -> Result<(), ConfigError> {
    if let Some((v, origin)) = pick(
        flags.masquerade_bit,
        "--masquerade-bit",
        nft.masquerade_bit,
        name,
        "nftables.masqueradeBit",
    ) {
        cfg.masquerade_bit = u8::try_from(v)
            .ok()
            .filter(|b| *b <= 31)
            .ok_or_else(|| origin.err(format!("{v} is not in the range [0, 31]")))?;
    }
    cfg.plan.masquerade_all = flags.masquerade_all.or(nft.masquerade_all).unwrap_or(false);
    // In the file, 0 means "default" (upstream's defaulting); a flag is taken as given.
    if let Some((s, origin)) = pick(
        flags.sync_period.clone(),
        "--sync-period",
        nft.sync_period.clone(),
        name,
        "nftables.syncPeriod",
    ) {
        let d = parse_go_duration(&s).map_err(|m| origin.err(m))?;
        match (d.is_zero(), origin) {
            (true, Origin::Flag(_)) => return Err(origin.err("must be greater than 0")),
            (true, Origin::File(..)) => {}
            (false, _) => cfg.sync_period = d,
        }
    }
    if let Some((s, origin)) = pick(
        flags.min_sync_period.clone(),
        "--min-sync-period",
        nft.min_sync_period.clone(),
        name,
        "nftables.minSyncPeriod",
    ) {
        let d = parse_go_duration(&s).map_err(|m| origin.err(m))?;
        if !d.is_zero() || matches!(origin, Origin::Flag(_)) {
            cfg.min_sync_period = Some(d);
        }
    }

    Ok(())
}

/// Local traffic detection: detectLocalMode with clusterCIDR or detectLocal.
fn resolve_local_detector(
    f: &KubeProxyConfiguration,
    flags: &ConfigFlags,
    name: Option<&str>,
    warnings: &mut Vec<ConfigWarning>,
) -> Result<LocalDetectorConfig, ConfigError> {
    let dl = f.detect_local.clone().unwrap_or_default();
    let cluster_cidrs = match pick(
        flags.cluster_cidr.clone(),
        "--cluster-cidr",
        f.cluster_cidr.clone(),
        name,
        "clusterCIDR",
    ) {
        Some((s, origin)) => parse_cidrs(&s).map_err(|m| origin.err(m))?,
        None => Vec::new(),
    };
    if cluster_cidrs.len() > 2
        || (cluster_cidrs.len() == 2
            && cluster_cidrs[0].addr().is_ipv4() == cluster_cidrs[1].addr().is_ipv4())
    {
        let origin = if flags.cluster_cidr.is_some() {
            Origin::Flag("--cluster-cidr")
        } else {
            Origin::File(name.unwrap_or(""), "clusterCIDR")
        };
        return Err(origin.err("at most one CIDR per IP family"));
    }
    let mode = pick(
        flags.detect_local_mode.clone(),
        "--detect-local-mode",
        f.detect_local_mode.clone(),
        name,
        "detectLocalMode",
    );
    let (mode, mode_origin) = match mode {
        Some((m, o)) if !m.is_empty() => (m, o),
        _ => (
            "ClusterCIDR".to_string(),
            Origin::File(name.unwrap_or(""), "detectLocalMode"),
        ),
    };
    let detector = match mode.as_str() {
        "ClusterCIDR" if cluster_cidrs.is_empty() => {
            if mode_origin_is_explicit(&mode_origin, flags, f) {
                warnings.push(
                    mode_origin
                        .warn("ClusterCIDR without a cluster CIDR: no traffic is treated as coming from local pods"),
                );
            }
            LocalDetectorConfig::None
        }
        "ClusterCIDR" => LocalDetectorConfig::ClusterCidr(cluster_cidrs),
        "NodeCIDR" => LocalDetectorConfig::NodeCidr,
        "None" => LocalDetectorConfig::None,
        "InterfaceNamePrefix" => {
            let (s, origin) = pick(
                flags.pod_interface_name_prefix.clone(),
                "--pod-interface-name-prefix",
                dl.interface_name_prefix.clone(),
                name,
                "detectLocal.interfaceNamePrefix",
            )
            .filter(|(s, _)| !s.is_empty())
            .ok_or_else(|| {
                mode_origin
                    .err("InterfaceNamePrefix needs detectLocal.interfaceNamePrefix (--pod-interface-name-prefix)")
            })?;
            kproxy_core::config::check_interface_name(&s).map_err(|m| origin.err(m))?;
            LocalDetectorConfig::InterfaceNamePrefix(s)
        }
        "BridgeInterface" => {
            let (s, origin) = pick(
                flags.pod_bridge_interface.clone(),
                "--pod-bridge-interface",
                dl.bridge_interface.clone(),
                name,
                "detectLocal.bridgeInterface",
            )
            .filter(|(s, _)| !s.is_empty())
            .ok_or_else(|| {
                mode_origin.err(
                    "BridgeInterface needs detectLocal.bridgeInterface (--pod-bridge-interface)",
                )
            })?;
            kproxy_core::config::check_interface_name(&s).map_err(|m| origin.err(m))?;
            LocalDetectorConfig::BridgeInterface(s)
        }
        other => {
            return Err(mode_origin.err(format!(
                "unknown mode {:?}: one of ClusterCIDR, NodeCIDR, InterfaceNamePrefix, BridgeInterface, None",
                other.escape_debug().to_string()
            )));
        }
    };
    Ok(detector)
}

/// nodePortAddresses (`None`: not set, the default stays).
fn resolve_node_port_addresses(
    f: &KubeProxyConfiguration,
    flags: &ConfigFlags,
    name: Option<&str>,
    warnings: &mut Vec<ConfigWarning>,
) -> Result<Option<NodePortAddressesConfig>, ConfigError> {
    let npa: Option<(Vec<String>, Origin)> =
        match (&flags.nodeport_addresses, &f.node_port_addresses, name) {
            (Some(s), _, _) => Some((
                s.split(',')
                    .map(|x| x.trim().to_string())
                    .filter(|x| !x.is_empty())
                    .collect(),
                Origin::Flag("--nodeport-addresses"),
            )),
            (None, Some(v), Some(file)) => {
                Some((v.clone(), Origin::File(file, "nodePortAddresses")))
            }
            _ => None,
        };
    npa.map(|(entries, origin)| parse_node_port_addresses(&entries, origin, warnings))
        .transpose()
}

/// The `conntrack` section (file only, as upstream's flags are deprecated).
fn resolve_conntrack(
    ct: &Conntrack,
    name: Option<&str>,
    warnings: &mut Vec<ConfigWarning>,
) -> Result<ConntrackConfig, ConfigError> {
    let ct_origin = |path: &'static str| Origin::File(name.unwrap_or(""), path);
    let non_negative =
        |v: Option<i64>, path: &'static str, default: u32| -> Result<u32, ConfigError> {
            match v {
                None => Ok(default),
                Some(v) => u32::try_from(v).map_err(|_| {
                    ct_origin(path).err(format!("{v} must be between 0 and {}", u32::MAX))
                }),
            }
        };
    let d = ConntrackConfig::default();
    // The kernel takes whole seconds: a timeout is written truncated to them, as
    // upstream does, and one under a second (truncated to 0, "leave it") is not
    // written at all; both are said, not done silently.
    let mut duration = |v: &Option<String>,
                        path: &'static str,
                        default: Duration|
     -> Result<Duration, ConfigError> {
        let Some(s) = v else { return Ok(default) };
        let d = parse_go_duration(s).map_err(|m| ct_origin(path).err(m))?;
        if d > Duration::ZERO && d.as_secs() == 0 {
            warnings.push(ct_origin(path).warn(format!(
                "{s} is under a second: the kernel takes whole seconds, so it is not written (the node's value stays)"
            )));
        } else if d.subsec_nanos() != 0 {
            warnings.push(ct_origin(path).warn(format!(
                "{s} is written as {} s: the kernel takes whole seconds",
                d.as_secs()
            )));
        }
        Ok(d)
    };
    Ok(ConntrackConfig {
        max_per_core: non_negative(ct.max_per_core, "conntrack.maxPerCore", d.max_per_core)?,
        min: non_negative(ct.min, "conntrack.min", d.min)?,
        tcp_established_timeout: duration(
            &ct.tcp_established_timeout,
            "conntrack.tcpEstablishedTimeout",
            d.tcp_established_timeout,
        )?,
        tcp_close_wait_timeout: duration(
            &ct.tcp_close_wait_timeout,
            "conntrack.tcpCloseWaitTimeout",
            d.tcp_close_wait_timeout,
        )?,
        tcp_be_liberal: ct.tcp_be_liberal.unwrap_or(false),
        udp_timeout: duration(&ct.udp_timeout, "conntrack.udpTimeout", Duration::ZERO)?,
        udp_stream_timeout: duration(
            &ct.udp_stream_timeout,
            "conntrack.udpStreamTimeout",
            Duration::ZERO,
        )?,
    })
}

/// Whether detectLocalMode ClusterCIDR was asked for (rather than being the default).
fn mode_origin_is_explicit(
    origin: &Origin,
    flags: &ConfigFlags,
    f: &KubeProxyConfiguration,
) -> bool {
    match origin {
        Origin::Flag(_) => flags.detect_local_mode.is_some(),
        Origin::File(..) => f
            .detect_local_mode
            .as_deref()
            .is_some_and(|m| !m.is_empty()),
    }
}

fn default_addr(v6: bool, metrics: bool) -> SocketAddr {
    match (v6, metrics) {
        (false, false) => SocketAddr::from(([0, 0, 0, 0], DEFAULT_HEALTHZ_PORT)),
        (false, true) => SocketAddr::from(([127, 0, 0, 1], DEFAULT_METRICS_PORT)),
        (true, false) => SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, DEFAULT_HEALTHZ_PORT)),
        (true, true) => SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, DEFAULT_METRICS_PORT)),
    }
}

/// An IP, accepting IPv4 octets with leading zeros as decimal (Go's ParseIPSloppy).
fn parse_ip(s: &str) -> Option<IpAddr> {
    kproxy_core::ingest::parse_ip(s.trim())
}

/// `IP:PORT`, `[IPv6]:PORT`, `:PORT` (all IPv4 addresses) or a bare IP (default port
/// appended, as upstream's AppendPortIfNeeded).
fn parse_bind_address(s: &str, default_port: u16) -> Result<SocketAddr, String> {
    let s = s.trim();
    let bad = || format!("{:?} is not IP:PORT", s.escape_debug().to_string());
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    if let Some(ip) = parse_ip(s.trim_start_matches('[').trim_end_matches(']')) {
        return Ok(SocketAddr::new(ip, default_port));
    }
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let ip = if host.is_empty() {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    } else {
        parse_ip(host).ok_or_else(bad)?
    };
    Ok(SocketAddr::new(ip, port))
}

/// Comma-separated CIDRs (host bits are cleared, as Go's ParseCIDR).
fn parse_cidrs(s: &str) -> Result<Vec<IpNet>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| {
            kproxy_core::ingest::parse_cidr(x)
                .ok_or_else(|| format!("{:?} is not a CIDR", x.escape_debug().to_string()))
        })
        .collect()
}

fn parse_node_port_addresses(
    entries: &[String],
    origin: Origin,
    warnings: &mut Vec<ConfigWarning>,
) -> Result<NodePortAddressesConfig, ConfigError> {
    let mut primary = false;
    let mut cidrs: Vec<IpNet> = Vec::new();
    for e in entries {
        match e.trim() {
            "" => {}
            "primary" => primary = true,
            "all" => cidrs
                .extend(["0.0.0.0/0", "::/0"].map(|c| c.parse::<IpNet>().expect("valid literal"))),
            "localhost" => {
                warnings.push(
                    origin.warn("localhost: NodePorts on loopback addresses are not served by an nftables proxy"),
                );
                cidrs.extend(
                    ["127.0.0.0/8", "::1/128"].map(|c| c.parse::<IpNet>().expect("valid literal")),
                );
            }
            c => cidrs.extend(parse_cidrs(c).map_err(|m| origin.err(m))?),
        }
    }
    match (primary, cidrs.is_empty()) {
        (_, true) => Ok(NodePortAddressesConfig::Primary),
        (false, false) => Ok(NodePortAddressesConfig::Cidrs(cidrs)),
        (true, false) => Err(origin.err(
            "kproxy cannot combine 'primary' with CIDRs yet: list the primary addresses' CIDRs explicitly, or use 'primary' alone",
        )),
    }
}

/// `Name=true,Other=false` as kube-proxy's --feature-gates.
fn parse_feature_gates(s: &str) -> Result<Vec<(String, bool)>, ConfigError> {
    let flag = Origin::Flag("--feature-gates");
    let mut out = Vec::new();
    for kv in s.split(',').map(str::trim).filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| {
            flag.err(format!(
                "{:?} is not Name=true|false",
                kv.escape_debug().to_string()
            ))
        })?;
        let k = k.trim();
        if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(flag.err(format!(
                "{:?} is not a feature gate name",
                k.escape_debug().to_string()
            )));
        }
        let v = match v.trim().to_ascii_lowercase().as_str() {
            "true" => true,
            "false" => false,
            _ => {
                return Err(flag.err(format!(
                    "{k}: {:?} is not true or false",
                    v.escape_debug().to_string()
                )));
            }
        };
        out.push((k.to_string(), v));
    }
    Ok(out)
}

/// Where a conntrack sysctl takes effect, which decides who may write it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SysctlScope {
    /// The network namespace of the writer (the TCP and UDP timeouts, `tcp_be_liberal`):
    /// written wherever kproxy runs, since that namespace is the node's network.
    NetworkNamespace,
    /// One value for the whole machine (`nf_conntrack_max`, the hash table size): only
    /// writable from the initial network namespace, and only written from there, so a
    /// proxy in a lab namespace never changes the host.
    Machine,
}

/// One conntrack setting kproxy wants: the file, the value and its scope.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConntrackSysctl {
    pub path: String,
    pub value: u64,
    pub scope: SysctlScope,
    /// Only raised, never lowered (upstream's hashsize: a larger table is kept).
    pub raise_only: bool,
}

impl ConntrackSysctl {
    /// Whether the kernel's `current` value already is what kproxy wants.
    pub fn satisfied_by(&self, current: u64) -> bool {
        if self.raise_only {
            current >= self.value
        } else {
            current == self.value
        }
    }

    /// Whether a writer in the initial network namespace (`in_host_netns`) or another
    /// one may write this setting.
    pub fn writable_from(&self, in_host_netns: bool) -> bool {
        in_host_netns || self.scope == SysctlScope::NetworkNamespace
    }
}

/// The machine-wide conntrack hash table size (a module parameter, not a sysctl).
pub const CONNTRACK_HASHSIZE: &str = "/sys/module/nf_conntrack/parameters/hashsize";

/// The conntrack settings upstream kube-proxy writes for the `conntrack` section, for
/// `ncpu` CPUs: `nf_conntrack_max = max(maxPerCore × ncpu, min)` unless maxPerCore is 0,
/// with the hash table raised to at least max/4; each timeout that is non-zero
/// (seconds); `tcp_be_liberal` when set. Pure: `kproxy sysctl` and `kproxy run` write
/// them (only where they differ, machine-wide ones only from the host's namespace).
pub fn conntrack_sysctls(c: &ConntrackConfig, ncpu: usize) -> Vec<ConntrackSysctl> {
    const NF: &str = "/proc/sys/net/netfilter";
    let netns = |name: &str, value| ConntrackSysctl {
        path: format!("{NF}/{name}"),
        value,
        scope: SysctlScope::NetworkNamespace,
        raise_only: false,
    };
    let mut out = Vec::new();
    if c.max_per_core > 0 {
        let max = (u64::from(c.max_per_core) * ncpu.max(1) as u64).max(u64::from(c.min));
        out.push(ConntrackSysctl {
            path: format!("{NF}/nf_conntrack_max"),
            value: max,
            scope: SysctlScope::Machine,
            raise_only: false,
        });
        out.push(ConntrackSysctl {
            path: CONNTRACK_HASHSIZE.to_string(),
            value: max / 4,
            scope: SysctlScope::Machine,
            raise_only: true,
        });
    }
    for (name, d) in [
        (
            "nf_conntrack_tcp_timeout_established",
            c.tcp_established_timeout,
        ),
        (
            "nf_conntrack_tcp_timeout_close_wait",
            c.tcp_close_wait_timeout,
        ),
        ("nf_conntrack_udp_timeout", c.udp_timeout),
        ("nf_conntrack_udp_timeout_stream", c.udp_stream_timeout),
    ] {
        // The kernel takes whole seconds; a sub-second value would round to "no timeout".
        if d.as_secs() > 0 {
            out.push(netns(name, d.as_secs()));
        }
    }
    if c.tcp_be_liberal {
        out.push(netns("nf_conntrack_tcp_be_liberal", 1));
    }
    out
}

#[cfg(test)]
mod tests;
