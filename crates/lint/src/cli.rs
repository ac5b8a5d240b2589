//! The `kproxy lint` command line: reads the paths, builds the load balancer profile from
//! the preset and the overriding flags, runs the rules, prints one report, and maps the
//! result to an exit status: 0 clean (warnings allowed unless `--deny-warnings`), 1
//! errors found, 2 usage (bad flags, unreadable path).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use kproxy_core::manifest::{Location, ManifestError};

use crate::input::Inventory;
use crate::lb::{LbOverrides, LbProfile};
use crate::report;
use crate::rules::{self, Options};

/// Which load balancer sits in front of the nodes.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LbKind {
    Gke,
    AwsNlb,
    Azure,
    /// Every --lb-* number given on the command line.
    Custom,
}

/// Report format.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Text,
    Json,
    Sarif,
}

#[derive(clap::Args, Debug)]
pub struct LintArgs {
    /// Manifest files, or directories searched recursively for *.yaml, *.yml and *.json;
    /// `-` reads standard input.
    #[arg(required = true, value_name = "PATH")]
    pub paths: Vec<PathBuf>,
    /// Load balancer preset (numbers and sources: docs/lint-rules.md).
    #[arg(long, value_enum, default_value = "gke")]
    pub lb: LbKind,
    /// Seconds between the load balancer's health checks of a node.
    #[arg(long, value_name = "S", value_parser = seconds)]
    pub lb_interval: Option<f64>,
    /// Failed health checks before the load balancer takes a node out.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub lb_unhealthy_threshold: Option<u32>,
    /// Seconds one health check may take.
    #[arg(long, value_name = "S", value_parser = seconds)]
    pub lb_timeout: Option<f64>,
    /// Seconds the load balancer keeps established connections on a node it took out
    /// (connection draining / deregistration delay).
    #[arg(long, value_name = "S", value_parser = seconds)]
    pub lb_drain: Option<f64>,
    /// Seconds until the load balancer sends traffic to a node that just got its first
    /// endpoint (registration plus healthy threshold).
    #[arg(long, value_name = "S", value_parser = seconds)]
    pub lb_registration: Option<f64>,
    /// Seconds from an endpoint change until every node's proxy (and, with
    /// externalTrafficPolicy Local, the node's health check) reflects it.
    #[arg(long, value_name = "S", value_parser = seconds, default_value = "1")]
    pub proxy_programming_time: f64,
    /// Nodes that can run the workloads (default: the Nodes found in PATH, else unknown).
    #[arg(long, value_name = "N")]
    pub nodes: Option<usize>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    pub output: Format,
    /// Exit 1 on warnings too.
    #[arg(long)]
    pub deny_warnings: bool,
}

fn seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if v.is_finite() && (0.0..=86_400.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s:?} is not between 0 and 86400 seconds"))
    }
}

/// Exit statuses.
pub const EXIT_CLEAN: u8 = 0;
pub const EXIT_FINDINGS: u8 = 1;
pub const EXIT_USAGE: u8 = 2;

pub fn run(args: LintArgs) -> anyhow::Result<ExitCode> {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let code = execute(
        &args,
        &mut stdout.lock(),
        &mut stderr.lock(),
        &mut std::io::stdin().lock(),
    )?;
    Ok(ExitCode::from(code))
}

/// The whole command with its streams passed in (tests call this). Returns the exit
/// status; `Err` only when writing the report fails.
pub fn execute(
    args: &LintArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
    stdin: &mut dyn Read,
) -> anyhow::Result<u8> {
    let (lb, lb_flags) = match profile(args) {
        Ok(p) => p,
        Err(msg) => {
            writeln!(err, "kproxy lint: {msg}").context("writing to stderr")?;
            return Ok(EXIT_USAGE);
        }
    };
    let mut inv = Inventory::default();
    for path in &args.paths {
        if let Err(e) = read_path(path, &mut inv, stdin) {
            writeln!(err, "kproxy lint: {e:#}").context("writing to stderr")?;
            return Ok(EXIT_USAGE);
        }
    }
    let nodes = args.nodes.or((inv.nodes > 0).then_some(inv.nodes));
    let opts = Options {
        lb,
        lb_flags,
        proxy_programming_seconds: args.proxy_programming_time,
        nodes,
    };
    let mut findings = rules::lint(&inv, &opts);
    for f in &mut findings {
        f.line = inv.line_of(&f.location);
    }
    let checked = rules::workloads_behind_load_balancers(&inv);
    if let Some(hint) = rules::nothing_checked_hint(&inv) {
        // On stderr: the report on stdout stays one format (JSON, SARIF) for scripts.
        writeln!(err, "kproxy lint: {hint}").context("writing to stderr")?;
    }
    let written = match args.output {
        Format::Text => out.write_all(report::text(&findings, &opts, checked).as_bytes()),
        Format::Json => writeln!(out, "{:#}", report::json(&findings, &opts, checked)),
        Format::Sarif => writeln!(out, "{:#}", report::sarif(&findings)),
    }
    .and_then(|()| out.flush());
    match written {
        // `kproxy lint … | head`: the reader has what it wanted; the verdict still stands.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other.context("writing the report")?,
    }
    let s = report::Summary::of(&findings);
    Ok(if s.errors > 0 || (args.deny_warnings && s.warnings > 0) {
        EXIT_FINDINGS
    } else {
        EXIT_CLEAN
    })
}

/// The preset with the overriding flags applied; `custom` needs every number.
/// The preset (with the flags applied), and the flags alone (they also win over Service
/// annotations).
fn profile(args: &LintArgs) -> Result<(LbProfile, LbOverrides), String> {
    let mut lb = match args.lb {
        LbKind::Gke => LbProfile::gke(),
        LbKind::AwsNlb => LbProfile::aws_nlb(),
        LbKind::Azure => LbProfile::azure(),
        LbKind::Custom => {
            let missing: Vec<&str> = [
                ("--lb-interval", args.lb_interval.is_none()),
                (
                    "--lb-unhealthy-threshold",
                    args.lb_unhealthy_threshold.is_none(),
                ),
                ("--lb-timeout", args.lb_timeout.is_none()),
                ("--lb-drain", args.lb_drain.is_none()),
                ("--lb-registration", args.lb_registration.is_none()),
            ]
            .into_iter()
            .filter_map(|(flag, missing)| missing.then_some(flag))
            .collect();
            if !missing.is_empty() {
                return Err(format!("--lb custom needs {}", missing.join(", ")));
            }
            LbProfile {
                name: "custom".into(),
                ..LbProfile::gke()
            }
        }
    };
    let flags = flags(args);
    flags.apply(&mut lb);
    Ok((lb, flags))
}

fn flags(args: &LintArgs) -> LbOverrides {
    LbOverrides {
        interval_seconds: args.lb_interval,
        unhealthy_threshold: args.lb_unhealthy_threshold,
        timeout_seconds: args.lb_timeout,
        drain_seconds: args.lb_drain,
        registration_seconds: args.lb_registration,
    }
}

/// Reads a file, a directory (recursively, manifests only, in name order) or `-`.
/// A missing or unreadable path is a usage error; unreadable content is a finding.
fn read_path(path: &Path, inv: &mut Inventory, stdin: &mut dyn Read) -> anyhow::Result<()> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        stdin
            .read_to_string(&mut text)
            .context("reading standard input")?;
        inv.add_file("<stdin>", &text);
        return Ok(());
    }
    let meta = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    if meta.is_dir() {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("reading directory {}", path.display()))?
            .map(|e| e.map(|e| e.path()))
            .collect::<Result<_, _>>()
            .with_context(|| format!("reading directory {}", path.display()))?;
        entries.sort();
        for p in entries {
            let is_manifest = p
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"));
            if p.is_dir() || is_manifest {
                read_path(&p, inv, stdin)?;
            }
        }
        return Ok(());
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let name = path.display().to_string();
    match String::from_utf8(bytes) {
        Ok(text) => inv.add_file(&name, &text),
        Err(e) => inv.errors.push(ManifestError {
            location: Location {
                file: name,
                document: 0,
                item: None,
            },
            what: "document".into(),
            field: ".".into(),
            reason: format!("not UTF-8 text: {}", e.utf8_error()),
        }),
    }
    Ok(())
}
