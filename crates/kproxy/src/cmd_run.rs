//! `kproxy run`: the node agent. Wires a source (manifest files, or the Kubernetes API)
//! into the sync loop ([`crate::daemon`]), the nftables dataplane, the health servers
//! and the metrics server, and stops on SIGTERM / SIGINT leaving the rules in place
//! (SIGTERM after a drain period when the node is going away: [`crate::shutdown`]).
//! Every long-running task runs under one cancellation tree ([`crate::tasks`]): the
//! first to end stops the rest, the sync loop finishing a sync in flight, and the
//! health servers close last.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kproxy_config::{ConfigFlags, ProxyConfig};
use kproxy_core::NodePlan;
use kproxy_core::config::NodePortAddressesConfig;
use kproxy_core::ingest::Ownership;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::takeover::TakeoverMode;
use kproxy_health::{Health, HealthConfig, Semantics, ShutdownDrain};
use kproxy_nft::Dataplane as Nft;
use prometheus_client::registry::Registry;

use crate::daemon::{self, LoopConfig, SyncLoop, SyncOutcome};
use crate::metrics::{self, Metrics};
use crate::tasks::Tasks;

/// `--health-check-semantics`: the names are kproxy-health's ([`Semantics::as_str`]).
fn semantics_parser() -> impl clap::builder::TypedValueParser<Value = Semantics> {
    use clap::builder::TypedValueParser;
    let names = [Semantics::Truthful, Semantics::Upstream].map(Semantics::as_str);
    clap::builder::PossibleValuesParser::new(names)
        // Only the possible values get here, and each parses.
        .map(|s| Semantics::parse(&s).expect("a possible value"))
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
    /// Health-check node ports answer from the plan the dataplane applied, and 503
    /// while the proxy is unhealthy (`truthful`, kproxy's default), or exactly as
    /// upstream kube-proxy does, from the computed plan (`upstream`). docs/health.md.
    #[arg(long, default_value = "truthful", value_parser = semantics_parser())]
    pub health_check_semantics: Semantics,
    /// Append one JSON line per sync / failure / drift repair to this file.
    #[arg(long, value_name = "FILE")]
    pub event_log: Option<PathBuf>,
    /// How often to compare the kernel's rules with what kproxy programmed.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = kproxy_config::parse_go_duration)]
    pub verify_period: Duration,
    /// Only proxy Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,
    #[command(flatten)]
    pub nft: crate::common::NftTableFlag,
    /// With --manifests: how long a file must stay empty, missing, or without an object
    /// before that object is removed (so a truncate-then-write never reaches the kernel).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = kproxy_config::parse_go_duration)]
    pub manifest_remove_after: Duration,
    /// With --manifests: manifest files larger than this many bytes are not read.
    #[arg(long, value_name = "BYTES", default_value_t = kproxy_source::manifests::DEFAULT_MAX_FILE_BYTES)]
    pub manifest_max_file_bytes: u64,
    /// With --manifests: the apiserver's --service-node-port-range; node ports outside it
    /// are dropped from the manifests (with a warning).
    #[arg(long, value_name = "FIRST-LAST", default_value = "30000-32767", value_parser = kproxy_config::parse_port_range)]
    pub node_port_range: std::ops::RangeInclusive<u16>,
    #[command(flatten)]
    pub plan: crate::common::PlanFlags,
    /// Hold an endpoint that becomes ready while kproxy runs (a new pod, or not ready ->
    /// ready) this long before new connections go to it, as not ready, unless its
    /// traffic has no other endpoint: a pod without a readiness probe is Ready before its
    /// server listens. `0s` disables (docs/warmup.md).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = kproxy_config::parse_go_duration)]
    pub endpoint_warmup: Duration,
    /// Upstream kube-proxy's rules found on the node (docs/migrate.md): `auto` removes
    /// exactly what `kube-proxy --cleanup` removes once kproxy's tables are up and no
    /// kube-proxy runs; `off` leaves them (logged and counted); `force` removes them even
    /// while a kube-proxy runs.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = takeover_parser())]
    pub kube_proxy_takeover: TakeoverMode,
    /// Program the first sync even when the input holds no Service while kproxy's
    /// tables hold Services from an earlier run (their rules are then removed). Without
    /// it, such a start keeps the tables, logs an error and answers 503 on `/healthz`
    /// until the input holds a Service (docs/input.md).
    #[arg(long)]
    pub allow_empty: bool,
    /// Program the first sync even when a manifest file or document could not be read
    /// or parsed while kproxy's tables hold Services from an earlier run.
    #[arg(long)]
    pub allow_partial: bool,
    /// Traffic counters in the kernel, exported as `kproxy_service_*_total`
    /// (docs/traffic.md): `service` per Service port, `endpoint` also per endpoint,
    /// `off` none and no counters in the kernel (the default: at 10,000 Services × 10
    /// endpoints the 140,000 counters make the cold sync and a restart ≈ 10× and the
    /// 10 s reading ≈ 2 s, docs/traffic.md "Cost"; `service` suits a few thousand
    /// Service ports).
    #[arg(long, value_name = "LEVEL", default_value = "off")]
    pub traffic_metrics: crate::traffic::Level,
    /// At most this many traffic series; the rest are left out, logged and counted in
    /// `kproxy_traffic_metrics_capped_series`.
    #[arg(long, value_name = "N", default_value_t = 100_000)]
    pub traffic_metrics_max_series: usize,
    /// Whether SIGTERM drains before kproxy exits: `signalled` only when a drain signal
    /// of the Node already turns `/healthz` to 503 (a plain SIGTERM is kproxy's own
    /// rollout), `always`, or `never` (kube-proxy). During the drain kproxy keeps
    /// forwarding and `/healthz` answers 503; the rules stay either way (docs/health.md).
    #[arg(long, value_name = "WHEN", default_value = "signalled", value_parser = shutdown_drain_parser())]
    pub shutdown_drain: ShutdownDrain,
    /// How long load balancers get to see `/healthz` answer 503 before kproxy exits on
    /// SIGTERM, counted from the first drain signal (the largest detection window of
    /// `kproxy lint`'s presets, AWS NLB: 10 s x 2 + 6 s).
    #[arg(long, value_name = "DURATION", default_value = "26s", value_parser = kproxy_config::parse_go_duration)]
    pub shutdown_drain_period: Duration,
}

/// `--shutdown-drain`: the names are kproxy-health's ([`ShutdownDrain::NAMES`]).
fn shutdown_drain_parser() -> impl clap::builder::TypedValueParser<Value = ShutdownDrain> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(ShutdownDrain::NAMES)
        // Only the possible values get here, and each parses.
        .map(|s| ShutdownDrain::parse(&s).expect("a possible value"))
}

/// `--kube-proxy-takeover`: the names are kproxy-core's ([`TakeoverMode::NAMES`]).
pub(crate) fn takeover_parser() -> impl clap::builder::TypedValueParser<Value = TakeoverMode> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(TakeoverMode::NAMES)
        // Only the possible values get here, and each parses.
        .map(|s| TakeoverMode::parse(&s).expect("a possible value"))
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
    let h =
        std::fs::read_to_string("/proc/sys/kernel/hostname").context("reading the host name")?;
    Ok(h.trim().to_lowercase())
}

/// Every address on this host's interfaces (for nodePortAddresses CIDRs).
fn local_addresses() -> Vec<IpAddr> {
    match kproxy_health::local_addresses() {
        Ok(addrs) => {
            let mut ips: Vec<IpAddr> = addrs.into_iter().map(|a| a.ip).collect();
            ips.dedup();
            ips
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read this host's addresses for nodePortAddresses");
            Vec::new()
        }
    }
}

struct NftDataplane(Nft);

impl daemon::Dataplane for NftDataplane {
    // The planner's update is nft's delta; after a failure nft re-programs everything
    // by itself.
    fn sync(&mut self, plan: &NodePlan, update: &PlanUpdate) -> Result<SyncOutcome> {
        let r = self.0.sync(plan, update).context("programming nftables")?;
        Ok(SyncOutcome {
            // An adoption (a process's first sync into tables it found, sending only
            // the difference) reconciles the whole state, as a full sync does.
            full: r.full || r.adopted,
            unchanged: false,
            conntrack_deleted: r.conntrack_deleted,
            detail: serde_json::json!({
                "nft_ms": r.elapsed.as_secs_f64() * 1e3,
                "adopted": r.adopted,
                // Every change goes as nfnetlink batches; `none` when there was
                // nothing to change.
                "transport": if r.netlink_bytes > 0 { "netlink" } else { "none" },
                "bytes": r.netlink_bytes,
            }),
        })
    }

    fn verify(&mut self) -> Result<bool> {
        Ok(self.0.verify().context("verifying nftables")?.drift)
    }

    fn kernel_holds_more(&mut self, plan: &NodePlan) -> Option<(usize, usize)> {
        crate::input_guard::kernel_holds_more(plan, self.0.config())
    }
    fn kernel_holds_exactly(&mut self, plan: &NodePlan) -> bool {
        crate::input_guard::kernel_holds_exactly(plan, self.0.config())
    }

    fn repair(&mut self, plan: &NodePlan) -> Result<SyncOutcome> {
        let r = self.0.repair(plan).context("repairing nftables")?;
        Ok(SyncOutcome {
            full: r.full,
            unchanged: r.adopted && r.changes.is_empty(),
            conntrack_deleted: r.conntrack_deleted,
            detail: serde_json::json!({
                "nft_ms": r.elapsed.as_secs_f64() * 1e3,
                // Restored by a delta after reading the tables back (`delta`), the
                // first sync's path into absent tables (`tables`), or a replacement.
                "how": if r.adopted { "delta" } else if r.full { "replace" } else { "tables" },
                "changes": format!("{:?}", r.changes),
                "bytes": r.netlink_bytes,
            }),
        })
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let (cfg, warnings) = kproxy_config::load(&args.config).context("loading the configuration")?;
    for w in &warnings {
        tracing::warn!(field = %w.path, "{}", w.message);
    }
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
    args.plan.apply(&mut plan_cfg);
    plan_cfg.endpoint_warmup = args.endpoint_warmup;
    if matches!(
        plan_cfg.node_port_addresses,
        NodePortAddressesConfig::Cidrs(_)
    ) && plan_cfg.node_ips.is_empty()
    {
        plan_cfg.node_ips = local_addresses();
    }
    let sysctls = crate::cmd_sysctl::apply_at_start(&cfg);

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let wanted = crate::fdlimit::wanted_for(&cfg);
    let headroom =
        crate::fdlimit::raise_and_check(wanted, &mut registry).context("reading RLIMIT_NOFILE")?;
    let budget = crate::fdlimit::health_connection_budget(
        headroom.soft,
        cfg.metrics_bind_address
            .map(|_| metrics::SERVER_LIMITS.max_connections),
    );
    tracing::info!(
        nofile_before = headroom.before,
        nofile = headroom.soft,
        nofile_hard = headroom.hard,
        health_connection_budget = budget,
        "file descriptors: soft limit raised to the hard one; /healthz and the health-check node ports share a connection budget below it"
    );
    let health = Health::start(
        HealthConfig {
            healthz_bind_address: cfg.healthz_bind_address,
            semantics: args.health_check_semantics,
            sync_period: cfg.sync_period,
            connection_budget: Some(budget),
        },
        &mut registry,
    )
    .await
    .context("starting the health servers")?;
    registry.register_collector(Box::new(crate::fdlimit::FdCollector {
        budget: health.connection_budget(),
    }));
    let takeover_metrics = crate::takeover::TakeoverMetrics::register(&mut registry);
    // The source writes, the sync loop reads and hears the source's status.
    let (writer, reader) = kproxy_source::store();
    if args.manifests.is_some() {
        registry.register_collector(Box::new(metrics::ManifestCollector(reader.clone())));
    } else {
        registry.register_collector(Box::new(metrics::ApiCollector(reader.clone())));
    }
    let registry = Arc::new(registry);
    let traffic =
        crate::traffic::Traffic::new(args.traffic_metrics, args.traffic_metrics_max_series);
    let mut tasks = Tasks::new();
    if let Some(addr) = cfg.metrics_bind_address {
        let (registry, health, traffic) = (registry.clone(), health.clone(), traffic.clone());
        let held = metrics.endpoint_warmup_held.clone();
        // A metrics server that cannot start is logged, never fatal.
        tasks.spawn("the metrics server", move |stop| async move {
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                r = metrics::serve(addr, registry, health, traffic, held) => if let Err(e) = r {
                    tracing::error!(error = format!("{e:#}"), "metrics server stopped");
                },
            }
            stop.cancelled().await;
            Ok(())
        });
    }

    {
        let (health, metrics) = (health.clone(), metrics.clone());
        tasks.spawn("the kernel limits watch", move |stop| async move {
            crate::kernel_limits::watch(sysctls, health, metrics, stop).await;
            Ok(())
        });
    }

    let dataplane = NftDataplane(
        Nft::new(args.nft.dataplane(
            cfg.masquerade_bit,
            args.traffic_metrics != crate::traffic::Level::Off,
        ))
        .context("setting up the nftables dataplane")?,
    );
    if args.traffic_metrics != crate::traffic::Level::Off {
        let reader = dataplane.0.counter_reader();
        tasks.spawn("the traffic counters", move |stop| async move {
            crate::traffic::run(reader, traffic, stop).await;
            Ok(())
        });
    }

    let ownership = Ownership {
        service_proxy_name: args.service_proxy_name.clone(),
    };
    match &args.manifests {
        Some(path) => {
            let mut wc =
                kproxy_source::watch::WatchConfig::new(path.clone(), node.clone(), ownership);
            wc.rescan = Duration::from_secs(10).min(cfg.sync_period.max(Duration::from_secs(1)));
            wc.remove_after = args.manifest_remove_after;
            wc.limits.max_file_bytes = args.manifest_max_file_bytes;
            wc.limits.node_port_range = Some(args.node_port_range.clone());
            tasks.spawn_until_cancelled("the source", "the source stopped", async move {
                kproxy_source::watch::run(wc, writer)
                    .await
                    .map_err(anyhow::Error::from)
            });
        }
        None => {
            let client = kproxy_source::kube::client(cfg.kubeconfig.as_deref())
                .await
                .context("connecting to the API server")?;
            let kc = kproxy_source::kube::KubeSourceConfig {
                node_name: node.clone(),
                ownership,
                page_size: None,
                json_lists: cfg.content_type == kproxy_config::ContentType::Json,
                watch_idle: None,
            };
            tasks.spawn_until_cancelled("the source", "the source stopped", async move {
                kproxy_source::kube::run(client, kc, writer)
                    .await
                    .map_err(anyhow::Error::from)
            });
        }
    };

    {
        let health = health.clone();
        let drain = crate::shutdown::DrainConfig {
            mode: args.shutdown_drain,
            period: args.shutdown_drain_period,
        };
        tasks.spawn("the signal handler", move |stop| async move {
            crate::shutdown::handle_signals(health, drain, stop).await;
            Ok(())
        });
    }

    tracing::info!(%node, source = if args.manifests.is_some() { "manifests" } else { "kubernetes" }, "kproxy starting");
    let loop_cfg = LoopConfig {
        node_name: node,
        plan: plan_cfg,
        pacing: crate::pacing::Pacing::for_min_sync_period(cfg.min_sync_period),
        sync_period: cfg.sync_period,
        verify_period: args.verify_period,
        event_log: args.event_log.clone(),
        allow: kproxy_core::input_guard::Allow {
            empty: args.allow_empty,
            partial: args.allow_partial,
        },
        input_name: match &args.manifests {
            Some(p) => format!("the manifests in {}", p.display()),
            None => "the API server's lists".to_string(),
        },
        table: args.nft.nft_table.clone(),
    };
    // Subscribed before the first sync, so nothing another process does after it is
    // missed; a node without the notification group still runs (the periodic
    // verification remains).
    let watch = crate::kernel_watch::KernelWatch::start(
        &args.nft.nft_table,
        health.clone(),
        metrics.clone(),
    );
    let takeover = crate::takeover::Takeover {
        mode: args.kube_proxy_takeover,
        table: args.nft.nft_table.clone(),
        healthz_configured: cfg.healthz_bind_address.is_some(),
        health: health.clone(),
        metrics: metrics.clone(),
        own: takeover_metrics,
    };
    let mut sync_loop = SyncLoop::new(
        loop_cfg,
        reader,
        dataplane,
        Arc::new(health.clone()),
        metrics,
    )?;
    match watch {
        Ok(w) => sync_loop = sync_loop.watch_kernel(w),
        Err(e) => tracing::warn!(
            error = format!("{e:#}"),
            "cannot watch nftables: changes by other processes are repaired by the periodic verification only"
        ),
    }
    tasks.spawn("the kube-proxy takeover", |stop| async move {
        crate::takeover::run(takeover, stop.clone()).await;
        // Done: stays out of the way until the others stop.
        stop.cancelled().await;
        Ok(())
    });
    tasks.spawn("the sync loop", |stop| async move {
        // The dataplane is dropped: the rules stay in place.
        sync_loop.run(stop).await.map(drop)
    });
    // Every task has returned (the sync loop after finishing a sync in flight) before
    // the health servers close.
    let result = tasks.run().await;
    health.shutdown().await;
    result.map(|()| ExitCode::SUCCESS)
}
