//! kproxy: the binary. Parses the command line, then hands off to one module per
//! subcommand. Exit codes: 0 ok, 1 failure (or `--strict` problems), 2 usage.

mod allocator;
mod cluster;
mod cmd_cleanup;
mod cmd_connectivity;
mod cmd_explain;
mod cmd_install;
mod cmd_plan;
mod cmd_preflight;
mod cmd_run;
mod cmd_status;
mod cmd_sync;
mod cmd_sysctl;
mod cmd_top;
mod cmd_trace;
mod common;
mod connectivity;
mod daemon;
mod event_log;
mod exposition;
mod fdlimit;
mod input_guard;
mod kernel_limits;
mod kernel_trace;
mod kernel_watch;
mod metrics;
mod pacing;
mod shutdown;
mod status;
mod takeover;
mod tasks;
mod traffic;
mod warmup;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "kproxy",
    version,
    about = "A Kubernetes Service proxy for Linux nodes"
)]
struct Cli {
    /// Log format: text (coloured only on a terminal) or json (one object per line).
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t,
        value_name = "FORMAT"
    )]
    logging_format: common::LoggingFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the NodePlan: what this node does with every Service port.
    Plan(cmd_plan::Args),
    /// Explain, for one Service, which endpoints each kind of traffic uses and why.
    Explain(cmd_explain::Args),
    /// The node agent: watch the cluster (API or manifests), program nftables, serve health checks and metrics.
    Run(Box<cmd_run::Args>),
    /// Plan from manifests and program nftables once (`--once`), for scripts.
    Sync(cmd_sync::Args),
    /// Write the conntrack sysctls of the config once and exit (a privileged init container's job).
    Sysctl(cmd_sysctl::Args),
    /// Check this node (and, with --kubeconfig, the API server) for what kproxy needs: one line per check, exit 1 on a failure.
    Preflight(cmd_preflight::Args),
    /// Remove everything kproxy made in nftables (its own tables only).
    Cleanup(cmd_cleanup::Args),
    /// The fate of one new connection on this node: DNAT (to which endpoints), DROP, REJECT or NONE.
    Trace(cmd_trace::Args),
    /// Deploy test workloads in a scratch namespace and check every Service path from every node and a pod on it: a table (node × check), exit 1 on a failure.
    ConnectivityTest(cmd_connectivity::Args),
    /// Per-Service rates on this node (new connections, rejects, drops, fallback), from the kernel's counters, refreshed like top.
    Top(cmd_top::Args),
    /// The whole cluster from the API server: kproxy's rollout and, per node, its pod's health, last sync and counters (exit 1 unless every node is healthy and the rollout complete).
    Status(Box<cmd_status::Args>),
    /// Print deploy/'s manifests for this cluster (API server address, pod CIDR, kube-proxy's settings inferred, each named in a header) for `kubectl apply -f -`; exit 1 with the reason when a value cannot be inferred.
    Install(Box<cmd_install::Args>),
    /// Check workloads' rollout settings against the load balancer in front of them.
    #[cfg(feature = "lint")]
    Lint(kproxy_lint::cli::LintArgs),
    /// Build a small cluster in network namespaces and run experiments on it (root).
    #[cfg(feature = "lab")]
    Lab(kproxy_lab::cli::LabArgs),
}

fn main() -> ExitCode {
    let mut command = Cli::command();
    if cluster::invoked_as_kubectl_plugin() {
        // As kubectl runs it: usage and errors name `kubectl kproxy`.
        command = command.bin_name("kubectl kproxy");
    }
    let cli = Cli::from_arg_matches(&command.get_matches()).unwrap_or_else(|e| e.exit());
    common::init_logging(cli.logging_format);
    let result = match cli.command {
        Command::Plan(a) => cmd_plan::run(a),
        Command::Explain(a) => cmd_explain::run(a),
        Command::Trace(a) => cmd_trace::run(a),
        Command::Top(a) => cmd_top::run(a),
        Command::Status(a) => cmd_status::run(*a),
        Command::Install(a) => cmd_install::run(*a),
        Command::ConnectivityTest(a) => cmd_connectivity::run(a),
        Command::Run(a) => cmd_run::run(*a),
        Command::Sync(a) => cmd_sync::run(a),
        Command::Cleanup(a) => cmd_cleanup::run(a),
        Command::Sysctl(a) => cmd_sysctl::run(a),
        Command::Preflight(a) => cmd_preflight::run(a),
        #[cfg(feature = "lint")]
        Command::Lint(a) => kproxy_lint::cli::run(a),
        #[cfg(feature = "lab")]
        Command::Lab(a) => kproxy_lab::cli::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kproxy: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
