//! Writing the conntrack settings of the `conntrack` section into the kernel, for
//! `kproxy sysctl` (a privileged init container's one-shot, so the long-running
//! container stays unprivileged) and for `kproxy run` (which tries the same at start and
//! watches what it found set). What to write is kproxy-config's
//! [`kproxy_config::conntrack_sysctls`]; here only the reading and writing.
//!
//! The timeouts are per network namespace and written in the namespace kproxy runs in,
//! which is the node's network wherever that is (a hostNetwork pod, a node that is itself
//! a namespace). `nf_conntrack_max` and the hash table size are one value for the machine
//! and only writable from the initial namespace: they are written only when this process
//! shares PID 1's network namespace.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use kproxy_config::{ConfigFlags, ConntrackSysctl, ProxyConfig};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub config: ConfigFlags,
}

/// What became of one setting.
#[derive(Debug)]
pub enum Outcome {
    /// The kernel already had it.
    Found,
    /// Written now.
    Set { was: Option<u64> },
    /// Machine-wide and this process is not in the host's network namespace.
    NotHostNetns,
    /// Could not be read back or written (a read-only `/proc/sys` in an unprivileged
    /// container, a missing module parameter).
    Failed(String),
}

/// True when this process runs in the host's network namespace (the one of PID 1).
pub(crate) fn in_host_netns() -> bool {
    match (
        std::fs::read_link("/proc/self/ns/net"),
        std::fs::read_link("/proc/1/ns/net"),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

fn read_value(path: &str) -> Option<u64> {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
}

/// Writes every conntrack setting of `cfg` this process may write and the kernel does
/// not already have; returns each setting with what became of it.
pub fn apply(cfg: &ProxyConfig) -> Vec<(ConntrackSysctl, Outcome)> {
    let host = in_host_netns();
    let ncpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    kproxy_config::conntrack_sysctls(&cfg.conntrack, ncpu)
        .into_iter()
        .map(|s| {
            let outcome = if !s.writable_from(host) {
                Outcome::NotHostNetns
            } else {
                let was = read_value(&s.path);
                if was.is_some_and(|v| s.satisfied_by(v)) {
                    Outcome::Found
                } else {
                    match std::fs::write(&s.path, s.value.to_string()) {
                        Ok(()) => Outcome::Set { was },
                        Err(e) => Outcome::Failed(e.to_string()),
                    }
                }
            };
            (s, outcome)
        })
        .collect()
}

/// `kproxy run`'s start: writes what it can, logs the rest; returns the settings kproxy
/// owns (set now or found set), to be watched for changes by others.
pub fn apply_at_start(cfg: &ProxyConfig) -> Vec<ConntrackSysctl> {
    let mut owned = Vec::new();
    for (s, outcome) in apply(cfg) {
        match outcome {
            Outcome::Found => owned.push(s),
            Outcome::Set { was } => {
                tracing::info!(path = %s.path, value = s.value, ?was, "set conntrack sysctl");
                owned.push(s);
            }
            Outcome::NotHostNetns => tracing::info!(
                path = %s.path,
                value = s.value,
                "machine-wide: left alone outside the host's network namespace"
            ),
            Outcome::Failed(e) => tracing::warn!(
                path = %s.path,
                value = s.value,
                error = %e,
                "cannot set conntrack sysctl (read-only in an unprivileged container: deploy/'s init container `kproxy sysctl` sets it; docs/deploy.md)"
            ),
        }
    }
    owned
}

/// `kproxy sysctl`: one line per setting on standard output; exit 1 when one this
/// process should have written could not be.
pub fn run(args: Args) -> Result<ExitCode> {
    let (cfg, warnings) = kproxy_config::load(&args.config).context("loading the configuration")?;
    for w in &warnings {
        tracing::warn!(field = %w.path, "{}", w.message);
    }
    let mut failed: Vec<PathBuf> = Vec::new();
    for (s, outcome) in apply(&cfg) {
        let what = match outcome {
            Outcome::Found => "already set".to_string(),
            Outcome::Set { was: Some(v) } => format!("set (was {v})"),
            Outcome::Set { was: None } => "set".to_string(),
            Outcome::NotHostNetns => {
                "left alone: machine-wide, and this is not the host's network namespace".to_string()
            }
            Outcome::Failed(e) => {
                failed.push(PathBuf::from(&s.path));
                format!("FAILED: {e}")
            }
        };
        let op = if s.raise_only { ">=" } else { "=" };
        println!("{} {op} {}: {what}", s.path, s.value);
    }
    if failed.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!(
            "kproxy sysctl: {} setting(s) not written ({}); run privileged, or set the values to 0 in the config's conntrack section to leave them to the node",
            failed.len(),
            failed
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(ExitCode::from(1))
    }
}
