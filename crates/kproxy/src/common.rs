//! What several subcommands share: logging set-up, loading manifests for one node, the
//! input settings and the output formats.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use kproxy_core::ingest::Ownership;
use kproxy_core::model::{DrainSignal, ServiceName};
use kproxy_core::{ClusterState, NodePlan, PlanConfig};
use kproxy_source::manifests;

/// Log line format (`--logging-format`, as kube-proxy's flag).
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoggingFormat {
    /// Human-readable lines; coloured only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// The log filter when `KPROXY_LOG` is unset. kube-client's HTTP trace layer logs every
/// failed request at ERROR ("failed with error client error (Connect)"): while the API
/// server is down that is one line per retry of every watched kind, each a duplicate of
/// the reflector's own warning, which names the kind and the backoff and is logged only
/// on the 1st, 2nd, 4th, 8th… failure in a row. `KPROXY_LOG` replaces the whole filter.
pub const DEFAULT_LOG_FILTER: &str = "info,kube_client::client::builder=off";

/// Logs go to stderr, filtered by `KPROXY_LOG` (default [`DEFAULT_LOG_FILTER`]). Colour
/// codes are written only to a terminal: in a file or a pipe they are noise a collector
/// keeps.
pub fn init_logging(format: LoggingFormat) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_env("KPROXY_LOG")
        .unwrap_or_else(|_| DEFAULT_LOG_FILTER.into());
    let ansi = std::io::stderr().is_terminal();
    let _ =
        tracing::subscriber::set_global_default(subscriber(format, ansi, filter, std::io::stderr));
}

/// The subscriber [`init_logging`] installs, with its writer and colour choice given.
fn subscriber<W>(
    format: LoggingFormat,
    ansi: bool,
    filter: tracing_subscriber::EnvFilter,
    writer: W,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    match format {
        LoggingFormat::Text => Box::new(builder.with_ansi(ansi).finish()),
        LoggingFormat::Json => Box::new(
            builder
                .json()
                .flatten_event(true)
                .with_current_span(false)
                .finish(),
        ),
    }
}

#[cfg(test)]
mod logging_tests {
    use std::sync::{Arc, Mutex};

    use super::{DEFAULT_LOG_FILTER, LoggingFormat, subscriber};

    /// A writer the test reads back.
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn log_one(format: LoggingFormat, ansi: bool) -> String {
        let buf = Buf::default();
        let out = buf.clone();
        let sub = subscriber(format, ansi, "info".into(), move || out.clone());
        tracing::subscriber::with_default(sub, || {
            tracing::warn!(
                service = "shop/web",
                port = 8080,
                "health-check node port not bound"
            );
        });
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn text_has_colour_codes_only_when_asked() {
        let plain = log_one(LoggingFormat::Text, false);
        assert!(
            plain.contains("health-check node port not bound"),
            "{plain}"
        );
        assert!(
            !plain.contains('\x1b'),
            "colour codes in a non-terminal log: {plain:?}"
        );
        assert!(log_one(LoggingFormat::Text, true).contains('\x1b'));
    }

    /// The default filter drops kube-client's per-request ERROR lines (the reflector
    /// logs each failure itself) and nothing else at info.
    #[test]
    fn the_default_filter_drops_kube_clients_duplicate_request_errors() {
        let buf = Buf::default();
        let out = buf.clone();
        let sub = subscriber(
            LoggingFormat::Text,
            false,
            DEFAULT_LOG_FILTER.into(),
            move || out.clone(),
        );
        tracing::subscriber::with_default(sub, || {
            tracing::error!(target: "kube_client::client::builder", "failed with error client error (Connect)");
            tracing::warn!(target: "kproxy_source::kube::reflect", "watch failed; keeping the last state and retrying");
            tracing::error!(target: "kube_client::client::auth", "token file unreadable");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        assert!(!text.contains("client error (Connect)"), "{text}");
        assert!(text.contains("watch failed"), "{text}");
        assert!(text.contains("token file unreadable"), "{text}");
    }

    #[test]
    fn json_is_one_object_per_line_with_the_fields() {
        let out = log_one(LoggingFormat::Json, true);
        let line: serde_json::Value = serde_json::from_str(out.trim()).expect(&out);
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["message"], "health-check node port not bound");
        assert_eq!(line["service"], "shop/web");
        assert_eq!(line["port"], 8080);
        assert!(!out.contains('\x1b'));
    }
}

/// `--manifests PATH --node NAME` and the input settings: `kproxy sync`'s source.
#[derive(Args, Clone, Debug)]
pub struct ManifestArgs {
    /// A manifest file or directory (recursive; .yaml, .yml, .json).
    #[arg(long, value_name = "PATH")]
    pub manifests: PathBuf,
    /// This node's name (its Node object supplies zone, addresses and pod CIDRs).
    #[arg(long, value_name = "NAME")]
    pub node: String,
    #[command(flatten)]
    pub input: InputArgs,
}

/// `--nft-table`, as `run`, `sync` and `cleanup` take it.
#[derive(Args, Clone, Debug)]
pub struct NftTableFlag {
    /// Name of kproxy's nftables tables (`ip NAME`, `ip6 NAME`).
    #[arg(long, value_name = "NAME", default_value = "kproxy", value_parser = kproxy_config::parse_nft_table_name)]
    pub nft_table: String,
}

impl NftTableFlag {
    /// The dataplane settings of a command that programs this table or compares the
    /// kernel with it (`run`, `sync`, `trace`): the KubeProxyConfiguration's masquerade
    /// bit, and whether the tables hold traffic counters (`--traffic-metrics` other
    /// than `off`).
    pub fn dataplane(&self, masquerade_bit: u8, counters: bool) -> kproxy_nft::DataplaneConfig {
        kproxy_nft::DataplaneConfig {
            table: self.nft_table.clone(),
            masquerade_bit,
            counters,
            ..Default::default()
        }
    }
}

/// Planner settings that are flags of kproxy's own, not fields of the
/// KubeProxyConfiguration: shared by `run` and the commands that plan once.
#[derive(Args, Clone, Debug)]
pub struct PlanFlags {
    /// Program external and load-balancer IPs that equal a Service's cluster IP or a node
    /// address (refused by default: CVE-2020-8554, docs/input.md).
    #[arg(long)]
    pub allow_external_ip_overlap: bool,
    /// A drain signal of the Node that does not turn `/healthz` to 503 (repeatable, or
    /// comma-separated): autoscalerTaint, deletionTimestamp, nodeDeleted,
    /// drainInProgress, gracefulNodeShutdownInProgress (docs/health.md).
    #[arg(long, value_name = "SIGNAL", value_delimiter = ',', value_parser = drain_signal_parser())]
    pub ignore_drain_signal: Vec<DrainSignal>,
}

/// `--ignore-drain-signal`: the names are kproxy-core's ([`DrainSignal::as_str`]).
fn drain_signal_parser() -> impl clap::builder::TypedValueParser<Value = DrainSignal> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(DrainSignal::OF_NODE.map(DrainSignal::as_str))
        // Only the possible values get here, and each parses.
        .map(|s| DrainSignal::parse(&s).expect("a possible value"))
}

impl PlanFlags {
    /// The one place these flags enter the planner's configuration.
    pub fn apply(&self, plan: &mut PlanConfig) {
        plan.allow_external_ip_overlap = self.allow_external_ip_overlap;
        plan.ignored_drain_signals
            .extend(self.ignore_drain_signal.iter().copied());
    }
}

/// How objects become a plan, whatever source they come from: shared by `sync`,
/// `plan`, `explain` and `trace`.
#[derive(Args, Clone, Debug)]
pub struct InputArgs {
    /// Exit with status 1 if any object or file had to be skipped or trimmed.
    #[arg(long)]
    pub strict: bool,
    /// Only proxy Services labelled service.kubernetes.io/service-proxy-name=NAME.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,
    /// A KubeProxyConfiguration file whose planner settings apply (detectLocal,
    /// nodePortAddresses, masqueradeAll, feature gates).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The apiserver's --service-node-port-range: node ports outside it are dropped
    /// from the manifests (with a warning).
    #[arg(long, value_name = "FIRST-LAST", default_value = "30000-32767", value_parser = kproxy_config::parse_port_range)]
    pub node_port_range: std::ops::RangeInclusive<u16>,
    #[command(flatten)]
    pub plan: PlanFlags,
    /// Manifest files larger than this many bytes are not read.
    #[arg(long, value_name = "BYTES", default_value_t = manifests::DEFAULT_MAX_FILE_BYTES)]
    pub max_file_bytes: u64,
}

/// What loading the manifests ran into, beyond the state itself.
#[derive(Clone, Debug, Default)]
pub struct LoadReport {
    /// `--strict` and something was reported.
    pub strict_failed: bool,
    /// An object, document or file was skipped.
    pub skipped: bool,
    /// A file or document could not be read or parsed: objects may be missing that no
    /// report names, so the state must not replace a programmed one.
    pub lost: bool,
    /// The manifest files read (none from the API): where [`print_conflicts`] looks up
    /// the file of a refused cluster IP.
    pub files: Vec<PathBuf>,
}

impl InputArgs {
    /// Every setting of `--config` (upstream defaults without it) with `flags` and the
    /// flags of this command line, warnings printed.
    pub fn proxy_config(
        &self,
        flags: kproxy_config::ConfigFlags,
    ) -> Result<kproxy_config::ProxyConfig> {
        let flags = kproxy_config::ConfigFlags {
            config: self.config.clone(),
            ..flags
        };
        let (cfg, warnings) = kproxy_config::load(&flags)?;
        Ok(self.with_flags(cfg, &warnings))
    }

    /// `cfg` with the flags of this command line; its load's warnings printed.
    pub fn with_flags(
        &self,
        mut cfg: kproxy_config::ProxyConfig,
        warnings: &[kproxy_config::ConfigWarning],
    ) -> kproxy_config::ProxyConfig {
        for w in warnings {
            eprintln!("kproxy: warning: {}: {}", w.path, w.message);
        }
        self.plan.apply(&mut cfg.plan);
        cfg
    }

    pub fn ownership(&self) -> Ownership {
        Ownership {
            service_proxy_name: self.service_proxy_name.clone(),
        }
    }

    pub fn limits(&self) -> manifests::ReadLimits {
        manifests::ReadLimits {
            max_file_bytes: self.max_file_bytes,
            node_port_range: Some(self.node_port_range.clone()),
        }
    }

    /// Loads the manifests at `path` for `node`, prints every problem to stderr, and
    /// returns the state and what the problems amount to.
    pub fn load(&self, path: &Path, node: &str) -> Result<(ClusterState, LoadReport)> {
        let loaded = manifests::load_with(path, node, &self.ownership(), &self.limits());
        for p in &loaded.problems {
            eprintln!(
                "kproxy: {}: {p}",
                if p.skipped_object() {
                    "skipped"
                } else {
                    "warning"
                }
            );
        }
        if loaded.files.is_empty() && !loaded.problems.is_empty() {
            anyhow::bail!("no manifests could be read from {}", path.display());
        }
        let report = LoadReport {
            strict_failed: self.strict && !loaded.problems.is_empty(),
            skipped: loaded.problems.iter().any(|p| p.skipped_object()),
            lost: loaded.problems.iter().any(|p| p.loses_unknown_objects()),
            files: loaded.files,
        };
        Ok((loaded.state, report))
    }
}

impl ManifestArgs {
    /// Every setting of `--config` (upstream defaults without it) with the flags of
    /// this command line, warnings printed.
    pub fn proxy_config(&self) -> Result<kproxy_config::ProxyConfig> {
        self.input.proxy_config(Default::default())
    }

    pub fn plan_report(&self, config: &PlanConfig) -> Result<(NodePlan, LoadReport)> {
        let (state, report) = self.input.load(&self.manifests, &self.node)?;
        Ok((plan_of(&state, &self.node, config), report))
    }
}

/// The node's plan from `state`, with a warning when the state lacks its Node.
pub fn plan_of(state: &ClusterState, node: &str, config: &PlanConfig) -> NodePlan {
    if state.node().is_none() {
        eprintln!("kproxy: warning: no Node object named {node:?}: no zone, no node addresses");
    }
    kproxy_core::plan(state, node, config)
}

/// `-o` of `plan`, `explain` and `trace`: the answer for people, or as JSON or YAML
/// (the same document; for `plan`, the contract in docs/plan-json.md).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// Aligned columns (`plan`) or sentences (`explain`, `trace`).
    #[value(alias = "text")]
    Table,
    Json,
    Yaml,
}

/// Prints `value` as `-o json` or `-o yaml` asks; false for `-o table` (the caller
/// prints its own).
pub fn print_structured<T: serde::Serialize>(value: &T, output: Output) -> Result<bool> {
    match output {
        Output::Table => return Ok(false),
        Output::Json => println!("{}", serde_json::to_string_pretty(value)?),
        Output::Yaml => print!("{}", serde_saphyr::to_string(value)?),
    }
    Ok(true)
}

/// Where the Services whose cluster IP a conflict refuses or a warning names are written,
/// by Service, as `file: document N` (manifest mode: the API server checked the API's
/// objects). The files are read again only when there is such a conflict or warning, so
/// the good path pays nothing; a file unreadable by now is passed over (it was reported
/// when loaded).
pub fn conflict_locations(plan: &NodePlan, files: &[PathBuf]) -> BTreeMap<ServiceName, String> {
    use kproxy_core::manifest::Object;
    let wanted: BTreeSet<&ServiceName> = plan
        .conflicts
        .iter()
        .filter(|c| c.field.is_some())
        .map(|c| &c.service)
        .chain(plan.cluster_ip_warnings.iter().map(|w| &w.service))
        .collect();
    let mut found = BTreeMap::new();
    if wanted.is_empty() {
        return found;
    }
    for file in files {
        let Ok(bytes) = manifests::read_regular(file, manifests::DEFAULT_MAX_FILE_BYTES) else {
            continue;
        };
        kproxy_core::manifest::for_each_object(&file.display().to_string(), &bytes, &mut |r| {
            let Ok(located) = r else { return };
            let Object::Service(svc) = &located.object else {
                return;
            };
            let (Some(ns), Some(name)) = (&svc.metadata.namespace, &svc.metadata.name) else {
                return;
            };
            let key = ServiceName::new(ns.as_str(), name.as_str());
            if wanted.contains(&key) {
                found.insert(key, located.location.to_string());
            }
        });
    }
    found
}

/// One conflict or cluster IP warning of `service` as the tools print it: after its
/// Service's file and document when `locations` knows them.
pub fn conflict_line(
    service: &ServiceName,
    c: &impl std::fmt::Display,
    locations: &BTreeMap<ServiceName, String>,
) -> String {
    match locations.get(service) {
        Some(at) => format!("{at}: {c}"),
        None => c.to_string(),
    }
}

/// Prints the plan's frontend conflicts (all, or those of `service` as loser or owner)
/// under a heading; nothing when there are none. `files`: the manifest files read, to
/// name where a refused cluster IP is written.
pub fn print_conflicts(
    plan: &NodePlan,
    service: Option<&kproxy_core::model::ServiceName>,
    files: &[PathBuf],
) {
    use kproxy_core::frontend::ConflictReason;
    let involved = |c: &&kproxy_core::frontend::Conflict| {
        service.is_none_or(|s| {
            c.service == *s
                || matches!(&c.reason, ConflictReason::Claimed { owner } | ConflictReason::ClusterIpCapture { owner } if owner == s)
        })
    };
    let shown: Vec<&kproxy_core::frontend::Conflict> =
        plan.conflicts.iter().filter(involved).collect();
    let warned: Vec<&kproxy_core::frontend::ClusterIpWarning> = plan
        .cluster_ip_warnings
        .iter()
        .filter(|w| service.is_none_or(|s| w.service == *s))
        .collect();
    if shown.is_empty() && warned.is_empty() {
        return;
    }
    let locations = conflict_locations(plan, files);
    let lines: Vec<String> = shown
        .iter()
        .map(|c| format!("  {}", conflict_line(&c.service, c, &locations)))
        .collect();
    if !lines.is_empty() {
        println!(
            "\nfrontend conflicts (docs/input.md):\n{}",
            lines.join("\n")
        );
    }
    let lines: Vec<String> = warned
        .iter()
        .map(|w| format!("  {}", conflict_line(&w.service, w, &locations)))
        .collect();
    if !lines.is_empty() {
        println!(
            "\ncluster IP warnings (programmed; docs/input.md):\n{}",
            lines.join("\n")
        );
    }
}
