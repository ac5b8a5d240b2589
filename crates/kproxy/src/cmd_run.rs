//! `kproxy run`: the node agent. Wires a source (manifest files, or the Kubernetes API)
//! into the sync loop ([`crate::daemon`]), the nftables dataplane, the health servers
//! and the metrics server, and stops on SIGTERM / SIGINT leaving the rules in place.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use ipnet::IpNet;
use kproxy_core::NodePlan;
use kproxy_core::PlanConfig;
use kproxy_core::config::{LocalDetectorConfig, NodePortAddressesConfig};
use kproxy_core::ingest::Ownership;
use kproxy_health::{Health, HealthConfig, Semantics};
use kproxy_nft::{Dataplane as Nft, DataplaneConfig};
use kproxy_source::StateHandle;
use prometheus_client::registry::Registry;
use tokio::sync::watch;

use crate::daemon::{self, HealthSink, LoopConfig, SyncOutcome};
use crate::metrics::{self, Metrics};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum HealthSemantics {
    /// Health-check node ports answer from the plan the dataplane applied, and 503 while
    /// the proxy is unhealthy (kproxy's default).
    Truthful,
    /// Exactly upstream kube-proxy's answers (from the computed plan).
    Upstream,
}

/// kube-proxy's flags that `kproxy run` takes today (names as kube-proxy's).
#[derive(clap::Args, Debug, Clone)]
pub struct ConfigFlags {
    /// Path to a kubeconfig file (in-cluster configuration when absent).
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// This node's name, instead of the host name.
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// Address of /healthz and /livez; empty disables.
    #[arg(long, value_name = "IP:PORT", default_value = "0.0.0.0:10256")]
    pub healthz_bind_address: String,
    /// Address of /metrics; empty disables.
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:10249")]
    pub metrics_bind_address: String,
    /// Traffic from these CIDRs is from pods (detect-local-mode ClusterCIDR).
    #[arg(long, value_name = "CIDR,...", value_delimiter = ',')]
    pub cluster_cidr: Vec<IpNet>,
    /// Masquerade all traffic to cluster IPs.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", default_value = "false")]
    pub masquerade_all: bool,
    #[arg(long, value_name = "BIT", default_value = "14")]
    pub masquerade_bit: u8,
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = parse_duration)]
    pub min_sync_period: Duration,
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
    pub sync_period: Duration,
    /// false: behave as kube-proxy before 1.26 (no failover to serving-terminating endpoints).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", default_value = "true")]
    pub proxy_terminating_endpoints: bool,
}

/// What `kproxy run` needs from the configuration.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub hostname_override: Option<String>,
    pub kubeconfig: Option<PathBuf>,
    pub healthz_bind_address: Option<std::net::SocketAddr>,
    pub metrics_bind_address: Option<std::net::SocketAddr>,
    pub plan: PlanConfig,
    pub masquerade_bit: u8,
    pub min_sync_period: Duration,
    pub sync_period: Duration,
}

fn bind_address(flag: &str, what: &str) -> Result<Option<std::net::SocketAddr>> {
    if flag.trim().is_empty() {
        return Ok(None);
    }
    flag.trim().parse().map(Some).with_context(|| format!("--{what}: {flag:?} is not IP:PORT"))
}

impl ConfigFlags {
    fn resolve(&self) -> Result<ProxyConfig> {
        let plan = PlanConfig {
            masquerade_all: self.masquerade_all,
            local_detector: if self.cluster_cidr.is_empty() {
                LocalDetectorConfig::None
            } else {
                LocalDetectorConfig::ClusterCidr(self.cluster_cidr.clone())
            },
            proxy_terminating_endpoints: self.proxy_terminating_endpoints,
            ..PlanConfig::default()
        };
        if self.sync_period.is_zero() {
            bail!("--sync-period must be positive");
        }
        Ok(ProxyConfig {
            hostname_override: self.hostname_override.clone(),
            kubeconfig: self.kubeconfig.clone(),
            healthz_bind_address: bind_address(&self.healthz_bind_address, "healthz-bind-address")?,
            metrics_bind_address: bind_address(&self.metrics_bind_address, "metrics-bind-address")?,
            plan,
            masquerade_bit: self.masquerade_bit,
            min_sync_period: self.min_sync_period,
            sync_period: self.sync_period,
        })
    }
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigFlags,
    /// Read Nodes, Services and EndpointSlices from this manifest file or directory
    /// (watched for changes) instead of the Kubernetes API.
    #[arg(long, value_name = "PATH")]
    pub manifests: Option<PathBuf>,
    /// This node's name (same as --hostname-override).
    #[arg(long, value_name = "NAME")]
    pub node: Option<String>,
    #[arg(long, value_enum, default_value = "truthful")]
    pub health_check_semantics: HealthSemantics,
    /// Append one JSON line per sync / failure / drift repair to this file.
    #[arg(long, value_name = "FILE")]
    pub event_log: Option<PathBuf>,
    /// How often to compare the kernel's rules with what kproxy programmed.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = parse_duration)]
    pub verify_period: Duration,
    /// Only proxy Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,
    /// Name of kproxy's nftables tables (`ip NAME`, `ip6 NAME`).
    #[arg(long, value_name = "NAME", default_value = "kproxy")]
    pub nft_table: String,
}

/// Go-style durations as kube-proxy takes them: `100ms`, `1s`, `1m30s`, `2h`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let mut total = Duration::ZERO;
    let mut rest = s;
    if rest.is_empty() {
        return Err("empty duration".into());
    }
    while !rest.is_empty() {
        let num_len = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(rest.len());
        let (num, tail) = rest.split_at(num_len);
        let unit_len = tail.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}"))?;
        let secs = match unit {
            "ns" => n / 1e9,
            "us" | "µs" => n / 1e6,
            "ms" => n / 1e3,
            "s" => n,
            "m" => n * 60.0,
            "h" => n * 3600.0,
            _ => return Err(format!("invalid duration {s:?}: unit must be one of ns, us, ms, s, m, h")),
        };
        total += Duration::from_secs_f64(secs);
        rest = tail;
    }
    Ok(total)
}

/// The node name as kube-proxy picks it: the override, else `NODE_NAME`, else the host
/// name, lower-cased.
fn node_name(args: &Args, cfg: &ProxyConfig) -> Result<String> {
    if let Some(n) = args.node.clone().or_else(|| cfg.hostname_override.clone()) {
        return Ok(n.trim().to_lowercase());
    }
    if let Ok(n) = std::env::var("NODE_NAME")
        && !n.trim().is_empty()
    {
        return Ok(n.trim().to_lowercase());
    }
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").context("reading the host name")?;
    Ok(h.trim().to_lowercase())
}

/// Every address on this host's interfaces (for nodePortAddresses CIDRs).
fn local_addresses() -> Vec<IpAddr> {
    let mut out = Vec::new();
    if let Ok(addrs) = nix::ifaddrs::getifaddrs() {
        for a in addrs {
            let Some(sa) = a.address else { continue };
            if let Some(v4) = sa.as_sockaddr_in() {
                out.push(IpAddr::V4(v4.ip()));
            } else if let Some(v6) = sa.as_sockaddr_in6() {
                out.push(IpAddr::V6(v6.ip()));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// True when this process runs in the host's network namespace (the one of PID 1).
/// Global sysctls are only written there; in a lab namespace they would change the host.
fn in_host_netns() -> bool {
    match (std::fs::read_link("/proc/self/ns/net"), std::fs::read_link("/proc/1/ns/net")) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn apply_conntrack_sysctls(_cfg: &ProxyConfig) {
    if !in_host_netns() {
        tracing::info!("not in the host network namespace: leaving conntrack sysctls alone");
    }
}

struct NftDataplane(Nft);

impl daemon::Dataplane for NftDataplane {
    fn sync(&mut self, plan: &NodePlan) -> Result<SyncOutcome> {
        let r = self.0.sync(plan).context("programming nftables")?;
        Ok(SyncOutcome {
            full: r.full,
            conntrack_deleted: r.conntrack_deleted,
            detail: serde_json::json!({ "nft_ms": r.elapsed.as_secs_f64() * 1e3 }),
        })
    }

    fn verify(&mut self) -> Result<bool> {
        Ok(self.0.verify().context("verifying nftables")?.drift)
    }
}

struct HealthHandle(Health);

impl HealthSink for HealthHandle {
    fn plan_computed(&self, plan: &Arc<NodePlan>) {
        self.0.plan_computed(plan);
    }
    fn plan_applied(&self, plan: &Arc<NodePlan>) {
        self.0.plan_applied(plan);
    }
    fn sync_failed(&self) {
        self.0.sync_failed();
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let cfg = args.config.resolve()?;
    let node = node_name(&args, &cfg)?;
    if node.is_empty() {
        bail!("cannot tell this node's name: set --hostname-override or NODE_NAME");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_async(args, cfg, node))
}

async fn run_async(args: Args, cfg: ProxyConfig, node: String) -> Result<ExitCode> {
    let mut plan_cfg = cfg.plan.clone();
    if matches!(plan_cfg.node_port_addresses, NodePortAddressesConfig::Cidrs(_)) && plan_cfg.node_ips.is_empty() {
        plan_cfg.node_ips = local_addresses();
    }
    apply_conntrack_sysctls(&cfg);

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let health = Health::start(
        HealthConfig {
            healthz_bind_address: cfg.healthz_bind_address,
            semantics: match args.health_check_semantics {
                HealthSemantics::Truthful => Semantics::Truthful,
                HealthSemantics::Upstream => Semantics::Upstream,
            },
            sync_period: cfg.sync_period,
        },
        &mut registry,
    )
    .await
    .context("starting the health servers")?;
    let registry = Arc::new(registry);
    if let Some(addr) = cfg.metrics_bind_address {
        let registry = registry.clone();
        tokio::spawn(async move {
            if let Err(e) = metrics::serve(addr, registry).await {
                tracing::error!(error = format!("{e:#}"), "metrics server stopped");
            }
        });
    }

    let dataplane = NftDataplane(
        Nft::new(DataplaneConfig { table: args.nft_table.clone(), masquerade_bit: cfg.masquerade_bit, ..Default::default() })
            .context("setting up the nftables dataplane")?,
    );

    let handle = StateHandle::new();
    let ownership = Ownership { service_proxy_name: args.service_proxy_name.clone() };
    let source = match &args.manifests {
        Some(path) => {
            let wc = kproxy_source::watch::WatchConfig {
                path: path.clone(),
                node_name: node.clone(),
                ownership,
                rescan: Duration::from_secs(10).min(cfg.sync_period.max(Duration::from_secs(1))),
                settle: Duration::from_millis(10),
            };
            let h = handle.clone();
            tokio::spawn(async move { kproxy_source::watch::run(wc, h).await.map_err(anyhow::Error::from) })
        }
        None => bail!("--manifests is required: the Kubernetes API source is being wired in (issue 5)"),
    };

    let (stop_tx, stop_rx) = watch::channel(false);
    tokio::spawn(async move {
        wait_for_signal().await;
        let _ = stop_tx.send(true);
    });

    tracing::info!(%node, source = if args.manifests.is_some() { "manifests" } else { "kubernetes" }, "kproxy starting");
    let health_handle = Arc::new(HealthHandle(health.clone()));
    let loop_cfg = LoopConfig {
        node_name: node,
        plan: plan_cfg,
        min_sync_period: cfg.min_sync_period,
        sync_period: cfg.sync_period,
        verify_period: args.verify_period,
        event_log: args.event_log.clone(),
    };
    let sync_loop = daemon::run(loop_cfg, handle, dataplane, health_handle, metrics, stop_rx);
    tokio::pin!(sync_loop);
    let mut source = source;
    let result = tokio::select! {
        r = &mut sync_loop => r.map(|_| ()),
        r = &mut source => match r {
            Ok(Ok(())) => Err(anyhow::anyhow!("the source stopped")),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(anyhow::anyhow!("the source task failed: {e}")),
        },
    };
    source.abort();
    health.shutdown().await;
    result.map(|()| ExitCode::SUCCESS)
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM"),
                _ = int.recv() => tracing::info!("SIGINT"),
            }
        }
        _ => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        for (s, ms) in [("100ms", 100), ("1s", 1000), ("1m30s", 90_000), ("0", 0), ("1.5s", 1500), ("2h", 7_200_000)] {
            assert_eq!(parse_duration(s).unwrap().as_millis(), ms, "{s}");
        }
        for bad in ["", "5", "1x", "s", "1s2"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
