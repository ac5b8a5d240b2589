//! The `kproxy lab` command line: `kproxy lab rollout` and
//! `kproxy lab sweep` (remove namespaces left by killed runs).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};

use crate::report::{self, RunResult};
use crate::runs::{matrix, restart, rollout, takeover};
use crate::scenario::balancer::{HealthCheck, LbMode, LbPreset};
use crate::scenario::matrix::{Selection, Setting};
use crate::scenario::rollout::{MAX_NODES, RolloutConfig};
use crate::scenario::run::{Behaviour, Chaos, ControlPlaneKind};
use crate::scenario::workload::{DeploymentSpec, PodProfile};
use crate::world::netns;

#[derive(clap::Args, Debug)]
pub struct LabArgs {
    #[command(subcommand)]
    pub command: LabCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum LabCommand {
    /// A rolling update behind an emulated cloud load balancer, every failed request counted
    /// (root).
    Rollout(Box<RolloutArgs>),
    /// The scenario matrix: pod profiles × the rolling-update guide's settings × LB presets ×
    /// both proxy behaviours, one real rollout per cell, each beside what `kproxy lint` says
    /// (root).
    Matrix(Box<MatrixArgs>),
    /// Restart, kill and upgrade node 1's kproxy under load through an eTP=Local LB and
    /// a cluster IP; failures counted per phase (root).
    Restart(Box<RestartArgs>),
    /// Node by node, upstream kube-proxy stops and kproxy takes over under load through
    /// an eTP=Local LB and a cluster IP, and with --back the reverse; real control plane
    /// and kube-proxy from K8S_LAB, or with --recorded kube-proxy's recorded rules on the
    /// emulated control plane (root; docs/migrate.md).
    Takeover(Box<TakeoverArgs>),
    /// Remove lab namespaces (and their processes) left behind by killed runs (root).
    Sweep,
}

#[derive(clap::Args, Debug)]
pub struct RestartArgs {
    #[command(flatten)]
    pub run: HeldRunArgs,
    /// The upgrade phase runs this build (e.g. this release, with `--kproxy` an older
    /// one whose tables are laid out differently) instead of a copy of `--kproxy`, and a
    /// rollback phase then runs `--kproxy` again.
    #[arg(long, value_name = "PATH")]
    pub upgrade_to: Option<PathBuf>,
}

/// What `lab restart` and `lab takeover` share: a cluster of one pod per node under
/// load, changed phase by phase.
#[derive(clap::Args, Debug)]
pub struct HeldRunArgs {
    /// Nodes in the lab cluster (one pod each).
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Real time = nominal time × this (pod readiness, LB health checks).
    #[arg(long, default_value_t = 0.15)]
    pub time_scale: f64,
    /// Seconds of load after each phase's change (a new process synced, a node
    /// taken over), before the next.
    #[arg(long, default_value_t = 3.0)]
    pub hold_seconds: f64,
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: OutputFormat,
    /// The kproxy binary to run on each node (default: this executable); `lab
    /// restart`'s upgrade phase runs a copy of it from another path.
    #[arg(long)]
    pub kproxy: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct TakeoverArgs {
    /// kube-proxy's mode on the nodes before the takeover.
    #[arg(long, value_parser = ["nftables", "iptables"])]
    pub from: String,
    /// After the takeover, go back to kube-proxy node by node.
    #[arg(long)]
    pub back: bool,
    /// kube-proxy as recorded from real kube-proxy v1.36.2 for this cluster
    /// (crates/lab/fixtures/kube-proxy): its rules loaded into each node, its health
    /// servers replayed; the emulated control plane, no K8S_LAB. 3 nodes.
    #[arg(long)]
    pub recorded: bool,
    /// Real kube-proxy: write each node's rules and health answers into DIR/MODE/
    /// once every node is healthy, before the first takeover (what --recorded loads).
    #[arg(long, value_name = "DIR", conflicts_with = "recorded")]
    pub record_rules: Option<PathBuf>,
    #[command(flatten)]
    pub run: HeldRunArgs,
}

#[derive(clap::Args, Debug, Default)]
pub struct MatrixArgs {
    /// The reduced matrix CI runs (graceful pods, gke, recommended / short preStop /
    /// kproxy restart / node drain, both behaviours); filters below narrow it further.
    #[arg(long)]
    pub reduced: bool,
    /// Pod profiles (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub profiles: Vec<PodProfile>,
    /// Settings (default: all).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub settings: Vec<Setting>,
    /// Load-balancer presets (default: gke, aws-nlb, azure).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub lb_presets: Vec<LbPreset>,
    /// Only kproxy behaviour (skip the pre-1.26 cells).
    #[arg(long)]
    pub kproxy_only: bool,
    /// Real time = nominal time × this.
    #[arg(long)]
    pub time_scale: Option<f64>,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: Option<OutputFormat>,
    /// The HTML report (matrix table, every cell's timeline).
    #[arg(long, default_value = "lab-out/kproxy-lab-matrix.html")]
    pub html: PathBuf,
    #[arg(long)]
    pub no_html: bool,
    /// The kproxy binary to run on each node (default: this executable).
    #[arg(long)]
    pub kproxy: Option<PathBuf>,
    /// Install missing tools (nftables, conntrack, iproute2) with apt-get.
    #[arg(long)]
    pub install_deps: bool,
    /// The control plane every cell runs on: the embedded emulation, or the real
    /// kube-apiserver and kube-controller-manager of the k8s-lab named by `K8S_LAB`.
    #[arg(long, value_enum, default_value = "emulated")]
    pub control_plane: ControlPlaneKind,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputFormat {
    Text,
    Json,
}

#[derive(clap::Args, Debug, Default)]
pub struct RolloutArgs {
    /// YAML file with any of the scenario's settings (see docs/lab.md); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run pre-1.26 behaviour and kproxy behaviour with the same seed, side by side.
    #[arg(long)]
    pub compare: bool,
    /// Repetitions (per behaviour).
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// false = kube-proxy before 1.26 (no failover to serving-terminating endpoints).
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub proxy_terminating_endpoints: Option<bool>,
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: Option<OutputFormat>,
    /// Print the full event timeline of every run in the text report.
    #[arg(long)]
    pub timeline: bool,
    /// The self-contained HTML report (per run: the timeline of nodes, pods and the
    /// LB pool with every failure, and each failure burst with its cause).
    #[arg(long, default_value = "lab-out/kproxy-lab-rollout.html")]
    pub html: PathBuf,
    /// Write no HTML report.
    #[arg(long)]
    pub no_html: bool,
    /// The kproxy binary to run on each node (default: this executable).
    #[arg(long)]
    pub kproxy: Option<PathBuf>,
    /// Install missing tools (nftables, conntrack, iproute2) with apt-get.
    #[arg(long)]
    pub install_deps: bool,
    /// Control plane(s), comma-separated: `emulated` (default) or `k8s-lab` (the real
    /// kube-apiserver and kube-controller-manager of the instance named by K8S_LAB);
    /// both runs every behaviour on each and the report compares them.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub control_plane: Vec<ControlPlaneKind>,
    /// Chaos during the rolling update (api-outage and watch-cut need `--control-plane
    /// k8s-lab`).
    #[arg(long, value_enum)]
    pub chaos: Option<Chaos>,

    #[arg(long)]
    pub nodes: Option<usize>,
    #[arg(long)]
    pub replicas: Option<u32>,
    #[arg(long)]
    pub max_surge: Option<u32>,
    #[arg(long)]
    pub max_unavailable: Option<u32>,
    #[arg(long)]
    pub min_ready_seconds: Option<f64>,
    #[arg(long)]
    pub one_pod_per_node: Option<bool>,
    #[arg(long, value_enum)]
    pub pod_profile: Option<PodProfile>,
    #[arg(long)]
    pub pre_stop: Option<f64>,
    #[arg(long)]
    pub termination_grace_period: Option<f64>,
    #[arg(long)]
    pub readiness_initial_delay: Option<f64>,
    #[arg(long)]
    pub readiness_period: Option<f64>,
    #[arg(long)]
    pub readiness_timeout: Option<f64>,
    #[arg(long)]
    pub readiness_success_threshold: Option<u32>,
    #[arg(long)]
    pub readiness_failure_threshold: Option<u32>,
    /// Real milliseconds from a pod's start to its server listening; the pod is Ready
    /// before (it models a pod without a readiness probe: docs/lab.md, "Ready before
    /// listening").
    #[arg(long, value_name = "MS")]
    pub listen_delay_ms: Option<u64>,
    /// The lab Service is externalTrafficPolicy Cluster, the load balancer probing each
    /// node's kproxy /healthz (default: Local, the health-check node port).
    #[arg(long)]
    pub etp_cluster: bool,
    #[arg(long, value_enum)]
    pub lb_preset: Option<LbPreset>,
    #[arg(long, value_enum)]
    pub lb_mode: Option<LbMode>,
    #[arg(long)]
    pub lb_interval: Option<f64>,
    #[arg(long)]
    pub lb_timeout: Option<f64>,
    #[arg(long)]
    pub lb_healthy_threshold: Option<u32>,
    #[arg(long)]
    pub lb_unhealthy_threshold: Option<u32>,
    #[arg(long)]
    pub lb_registration_delay: Option<f64>,
    /// Cut established flows this long after their node leaves the pool (0: never).
    #[arg(long)]
    pub lb_drain_timeout: Option<f64>,
    /// Requests per second on new connections (real time).
    #[arg(long)]
    pub rate: Option<f64>,
    #[arg(long)]
    pub keepalive_connections: Option<u32>,
    /// Requests per second on each keep-alive connection.
    #[arg(long)]
    pub keepalive_rate: Option<f64>,
    #[arg(long)]
    pub request_timeout_ms: Option<u64>,
    #[arg(long)]
    pub propagation_delay: Option<f64>,
    /// Real time = nominal time × this (default 0.1: the demo takes well under a minute).
    #[arg(long)]
    pub time_scale: Option<f64>,
    #[arg(long)]
    pub publish_not_ready_addresses: Option<bool>,
    #[arg(long)]
    pub warmup: Option<f64>,
    #[arg(long)]
    pub settle: Option<f64>,
    #[arg(long)]
    pub seed: Option<u64>,
}

/// Defaults, then the YAML file, then flags.
pub fn build_config(a: &RolloutArgs) -> anyhow::Result<RolloutConfig> {
    let mut c = match &a.config {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            RolloutConfig::from_yaml(&text).with_context(|| format!("in {}", p.display()))?
        }
        None => RolloutConfig::default(),
    };
    macro_rules! set {
        ($flag:expr, $field:expr) => {
            if let Some(v) = $flag {
                $field = v;
            }
        };
    }
    set!(a.nodes, c.nodes);
    set!(a.replicas, c.deployment.replicas);
    set!(a.max_surge, c.deployment.max_surge);
    set!(a.max_unavailable, c.deployment.max_unavailable);
    set!(a.min_ready_seconds, c.deployment.min_ready_seconds);
    set!(a.one_pod_per_node, c.deployment.one_pod_per_node);
    set!(a.pod_profile, c.pod.profile);
    set!(a.pre_stop, c.pod.pre_stop_sleep_seconds);
    set!(
        a.termination_grace_period,
        c.pod.termination_grace_period_seconds
    );
    set!(
        a.readiness_initial_delay,
        c.pod.readiness_probe.initial_delay_seconds
    );
    set!(a.readiness_period, c.pod.readiness_probe.period_seconds);
    set!(a.readiness_timeout, c.pod.readiness_probe.timeout_seconds);
    set!(
        a.readiness_success_threshold,
        c.pod.readiness_probe.success_threshold
    );
    set!(
        a.readiness_failure_threshold,
        c.pod.readiness_probe.failure_threshold
    );
    set!(a.listen_delay_ms, c.pod.listen_delay_ms);
    set!(a.lb_preset, c.load_balancer.preset);
    set!(a.lb_mode, c.load_balancer.mode);
    let custom = [
        a.lb_interval,
        a.lb_timeout,
        a.lb_registration_delay,
        a.lb_drain_timeout,
    ]
    .iter()
    .any(Option::is_some)
        || a.lb_healthy_threshold.is_some()
        || a.lb_unhealthy_threshold.is_some();
    if custom {
        let base = c
            .load_balancer
            .health_check
            .or_else(|| c.load_balancer.preset.health_check())
            .unwrap_or(HealthCheck {
                interval_seconds: 5.0,
                timeout_seconds: 1.0,
                healthy_threshold: 1,
                unhealthy_threshold: 2,
                registration_delay_seconds: 0.0,
                drain_timeout_seconds: 0.0,
            });
        c.load_balancer.health_check = Some(HealthCheck {
            interval_seconds: a.lb_interval.unwrap_or(base.interval_seconds),
            timeout_seconds: a.lb_timeout.unwrap_or(base.timeout_seconds),
            healthy_threshold: a.lb_healthy_threshold.unwrap_or(base.healthy_threshold),
            unhealthy_threshold: a.lb_unhealthy_threshold.unwrap_or(base.unhealthy_threshold),
            registration_delay_seconds: a
                .lb_registration_delay
                .unwrap_or(base.registration_delay_seconds),
            drain_timeout_seconds: a.lb_drain_timeout.unwrap_or(base.drain_timeout_seconds),
        });
    }
    set!(a.rate, c.load.new_connection_rate);
    set!(a.keepalive_connections, c.load.keepalive_connections);
    set!(a.keepalive_rate, c.load.keepalive_rate);
    set!(a.request_timeout_ms, c.load.request_timeout_ms);
    set!(a.propagation_delay, c.propagation_delay_seconds);
    set!(a.time_scale, c.time_scale);
    set!(a.publish_not_ready_addresses, c.publish_not_ready_addresses);
    set!(a.warmup, c.warmup_seconds);
    set!(a.settle, c.settle_seconds);
    set!(a.seed, c.seed);
    c.validate()?;
    Ok(c)
}

fn which(tool: &str) -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
        .unwrap_or(false)
}

/// Check for the tools the lab runs; install them with apt-get when asked.
fn ensure_tools(install: bool) -> anyhow::Result<()> {
    let needed = [
        ("ip", "iproute2"),
        ("nft", "nftables"),
        ("conntrack", "conntrack"),
    ];
    let missing: Vec<&str> = needed
        .iter()
        .filter(|(t, _)| !which(t))
        .map(|(_, p)| *p)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if install && which("apt-get") {
        eprintln!("kproxy lab: installing {}", missing.join(" "));
        // A fresh machine may have no package lists yet.
        let _ = std::process::Command::new("apt-get")
            .args(["update", "-q"])
            .status();
        let st = std::process::Command::new("apt-get")
            .args(["install", "-y"])
            .args(&missing)
            .status()
            .context("running apt-get")?;
        if st.success() {
            return Ok(());
        }
    }
    bail!(
        "missing tools; install them with: apt-get install -y {} (or rerun with --install-deps)",
        missing.join(" ")
    )
}

pub fn run(args: LabArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        LabCommand::Sweep => {
            if !crate::is_root() {
                bail!("kproxy lab sweep needs root (it deletes network namespaces)");
            }
            for n in netns::sweep_dead_runs() {
                println!("removed {n}");
            }
            Ok(ExitCode::SUCCESS)
        }
        LabCommand::Rollout(a) => rollout(&a),
        LabCommand::Matrix(a) => matrix(&a),
        LabCommand::Restart(a) => restart(&a),
        LabCommand::Takeover(a) => takeover(&a),
    }
}

/// The checked arguments of a held run: its config (one pod per node) and the kproxy
/// binary to run.
fn held_run(a: &HeldRunArgs) -> anyhow::Result<(RolloutConfig, PathBuf)> {
    let HeldRunArgs {
        nodes,
        time_scale,
        hold_seconds,
        ref kproxy,
        ..
    } = *a;
    if !(1..=MAX_NODES).contains(&nodes) {
        bail!("--nodes must be 1..={MAX_NODES}");
    }
    if !(hold_seconds.is_finite() && (0.5..=600.0).contains(&hold_seconds)) {
        bail!("--hold-seconds must be 0.5..=600");
    }
    let cfg = RolloutConfig {
        nodes,
        time_scale,
        deployment: DeploymentSpec {
            replicas: nodes as u32,
            ..RolloutConfig::default().deployment
        },
        ..RolloutConfig::default()
    };
    let kproxy = match kproxy {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("finding the kproxy executable")?,
    };
    Ok((cfg, kproxy))
}

fn takeover(a: &TakeoverArgs) -> anyhow::Result<ExitCode> {
    need_root("takeover")?;
    let (cfg, kproxy) = held_run(&a.run)?;
    let progress = |line: &str| eprintln!("{line}");
    let report = takeover::run(
        &cfg,
        &kproxy,
        &takeover::TakeoverOptions {
            mode: a.from.clone(),
            back: a.back,
            hold: std::time::Duration::from_secs_f64(a.run.hold_seconds),
            recorded: a.recorded,
            record_rules: a.record_rules.clone(),
        },
        &progress,
    )?;
    match a.run.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        _ => print!("{}", report::held::takeover_text(&report)),
    }
    Ok(if report.failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn restart(a: &RestartArgs) -> anyhow::Result<ExitCode> {
    need_root("restart")?;
    let (cfg, kproxy) = held_run(&a.run)?;
    let progress = |line: &str| eprintln!("{line}");
    let report = restart::run(
        &cfg,
        &kproxy,
        a.upgrade_to.as_deref(),
        std::time::Duration::from_secs_f64(a.run.hold_seconds),
        &progress,
    )?;
    match a.run.output {
        OutputFormat::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        _ => print!("{}", report::held::restart_text(&report)),
    }
    Ok(if report.failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Writes a report to `path` (creating its directory); its absolute path, to print.
fn write_report(path: &std::path::Path, page: &str) -> anyhow::Result<PathBuf> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, page).with_context(|| format!("writing {}", path.display()))?;
    Ok(std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()))
}

fn need_root(what: &str) -> anyhow::Result<()> {
    if !crate::is_root() {
        bail!(
            "kproxy lab {what} must run as root: it creates network namespaces, veth pairs and nftables rules \
             (all inside its own namespaces; the host's network is not touched). Try: sudo {} lab {what} ...",
            std::env::args().next().unwrap_or_else(|| "kproxy".into())
        );
    }
    Ok(())
}

/// The cells `a` selects.
pub fn selection(a: &MatrixArgs) -> Selection {
    let mut sel = if a.reduced {
        Selection::reduced()
    } else {
        Selection::full()
    };
    if !a.profiles.is_empty() {
        sel.profiles.retain(|p| a.profiles.contains(p));
        if !a.reduced {
            sel.profiles = a.profiles.clone();
        }
    }
    if !a.settings.is_empty() {
        sel.settings = if a.reduced {
            sel.settings
                .into_iter()
                .filter(|s| a.settings.contains(s))
                .collect()
        } else {
            a.settings.clone()
        };
    }
    if !a.lb_presets.is_empty() {
        sel.presets = a.lb_presets.clone();
    }
    if a.kproxy_only {
        sel.behaviours = vec![Behaviour::Kproxy];
    }
    sel
}

fn matrix(a: &MatrixArgs) -> anyhow::Result<ExitCode> {
    let mut base = RolloutConfig::default();
    if let Some(t) = a.time_scale {
        base.time_scale = t;
    }
    if let Some(s) = a.seed {
        base.seed = s;
    }
    base.validate()?;
    if a.lb_presets.contains(&LbPreset::Custom) {
        bail!(
            "--lb-presets: the matrix runs the gke, aws-nlb and azure presets (custom has no numbers)"
        );
    }
    let sel = selection(a);
    let cells = sel.cells();
    if cells.is_empty() {
        bail!("the filters select no cell");
    }
    need_root("matrix")?;
    ensure_tools(a.install_deps)?;
    if a.control_plane == ControlPlaneKind::K8sLab {
        // Fail before building anything when the instance is not there.
        crate::world::k8s::K8sLab::from_env()?;
    }
    let kproxy = match &a.kproxy {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("finding the kproxy executable")?,
    };
    let progress = |line: &str| eprintln!("{line}");
    let mut runs = Vec::new();
    let results = matrix::run_matrix(
        &sel,
        &base,
        &kproxy,
        a.control_plane,
        &progress,
        &mut |c, r| {
            eprintln!(
                "[matrix] {}: {} of {} lost, lint: {}; {}",
                c.id,
                c.lost,
                c.sent,
                c.lint
                    .iter()
                    .map(|f| f.rule.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                c.verdict.as_str()
            );
            runs.push(r.clone());
        },
    )?;
    if !a.no_html {
        let page = report::html::render(
            "kproxy lab matrix",
            &format!(
                "{} cells, time scale {} (times nominal). Each cell is one real rolling update (the node-drain row: a node drained and deleted by the cluster autoscaler instead) behind the emulated load balancer with the real kproxy daemon on every node; kproxy lint ran on the same settings' manifests, told the emulated load balancer's numbers.",
                results.len(),
                base.time_scale
            ),
            &runs,
            &results,
        );
        let path = write_report(&a.html, &page)?;
        eprintln!("kproxy lab: HTML report: {}", path.display());
    }
    if a.output == Some(OutputFormat::Json) {
        let doc = serde_json::json!({
            "time_scale": base.time_scale,
            "control_plane": a.control_plane,
            "cells": results,
            "html": (!a.no_html).then(|| a.html.display().to_string()),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", report::matrix::render_text(&results));
    }
    // A kproxy cell (exit-on-term pods aside: they reset their own connections)
    // whose losses break its row's claim fails the matrix.
    let bad = results.iter().any(|c| {
        c.cell.behaviour == Behaviour::Kproxy
            && c.cell.profile != PodProfile::ExitOnTerm
            && c.cell.setting.claim().broken_by(c.lost, c.lost_kept_alive)
    });
    Ok(if bad {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn rollout(a: &RolloutArgs) -> anyhow::Result<ExitCode> {
    let cfg = build_config(a)?;
    need_root("rollout")?;
    ensure_tools(a.install_deps)?;
    let kproxy = match &a.kproxy {
        Some(p) => p.clone(),
        None => std::env::current_exe().context("finding the kproxy executable")?,
    };
    if a.runs == 0 || a.runs > 100 {
        bail!("--runs must be 1..=100");
    }
    let behaviours: Vec<Behaviour> = if a.compare {
        vec![Behaviour::Pre126, Behaviour::Kproxy]
    } else if a.proxy_terminating_endpoints == Some(false) {
        vec![Behaviour::Pre126]
    } else {
        vec![Behaviour::Kproxy]
    };
    let mut planes = a.control_plane.clone();
    planes.dedup();
    if planes.is_empty() {
        planes.push(ControlPlaneKind::Emulated);
    }
    if planes.contains(&ControlPlaneKind::K8sLab) {
        // Fail before building anything when the instance is not there.
        crate::world::k8s::K8sLab::from_env()?;
    }
    let json = a.output == Some(OutputFormat::Json);
    let progress = |line: &str| eprintln!("{line}");
    let mut runs: Vec<RunResult> = Vec::new();
    for run in 0..a.runs {
        for cp in &planes {
            for b in &behaviours {
                if let Some(chaos) = a.chaos.filter(|c| c.needs_real_api())
                    && *cp == ControlPlaneKind::Emulated
                {
                    anyhow::bail!("--chaos {chaos} needs --control-plane k8s-lab");
                }
                let opts = crate::scenario::run::RunOptions {
                    control_plane: *cp,
                    chaos: a.chaos,
                    etp_cluster: a.etp_cluster,
                    ..Default::default()
                };
                let r = rollout::run_with(&cfg, *b, run, &kproxy, opts, &progress)
                    .with_context(|| format!("{} run {} ({})", b.as_str(), run + 1, cp.as_str()))?;
                runs.push(r);
            }
        }
    }
    let html = if a.no_html {
        None
    } else {
        let page = report::html::render(
            "kproxy lab rollout",
            &format!(
                "{} run(s), time scale {} (times nominal). Each run is a rolling update behind the emulated load balancer, with the real kproxy daemon on every node; times count from the start of the run (cluster set-up), as in the text report.",
                runs.len(),
                cfg.time_scale
            ),
            &runs,
            &[],
        );
        Some(write_report(&a.html, &page)?)
    };
    if json {
        let doc = report::json::render(&runs, &cfg, html.as_deref());
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print!("{}", report::text::render(&runs, a.timeline));
        print!("{}", report::compare::render_text(&runs));
        // Last, so it is what a terminal shows at the end.
        if let Some(path) = &html {
            println!(
                "
HTML report (open it in a browser): {}",
                path.display()
            );
        }
    }
    // The claim under test: kproxy behaviour loses nothing.
    let kproxy_lost = runs
        .iter()
        .any(|r| r.behaviour == Behaviour::Kproxy && r.records.iter().any(|x| !x.outcome.is_ok()));
    Ok(if kproxy_lost {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct T {
        #[command(flatten)]
        lab: LabArgs,
    }

    fn parse(args: &[&str]) -> RolloutArgs {
        let mut v = vec!["t"];
        v.extend_from_slice(args);
        match T::parse_from(v).lab.command {
            LabCommand::Rollout(a) => *a,
            _ => panic!("not rollout"),
        }
    }

    #[test]
    fn flags_override_defaults() {
        let a = parse(&[
            "rollout",
            "--pre-stop",
            "2",
            "--lb-preset",
            "aws-nlb",
            "--lb-interval",
            "4",
            "--pod-profile",
            "exit-on-term",
        ]);
        let c = build_config(&a).unwrap();
        assert_eq!(c.pod.pre_stop_sleep_seconds, 2.0);
        assert_eq!(c.pod.profile, PodProfile::ExitOnTerm);
        let hc = c.load_balancer.effective_health_check().unwrap();
        assert_eq!(hc.interval_seconds, 4.0);
        assert_eq!(hc.unhealthy_threshold, 2, "rest from the aws-nlb preset");
        let c = build_config(&parse(&["rollout", "--lb-drain-timeout", "30"])).unwrap();
        let hc = c.load_balancer.effective_health_check().unwrap();
        assert_eq!(
            (hc.drain_timeout_seconds, hc.interval_seconds),
            (30.0, 3.0),
            "gke + drain"
        );
    }

    #[test]
    fn pre_126_flag_parses() {
        let a = parse(&[
            "rollout",
            "--proxy-terminating-endpoints=false",
            "--compare",
            "--runs",
            "3",
            "-o",
            "json",
        ]);
        assert_eq!(a.proxy_terminating_endpoints, Some(false));
        assert!(a.compare);
        assert_eq!(a.runs, 3);
        assert_eq!(a.output, Some(OutputFormat::Json));
    }
}
