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
    write_all(kproxy_config::conntrack_sysctls(&cfg.conntrack, ncpu), host)
}

/// Writes `settings` all or none: every file to write is opened first (a read-only
/// `/proc/sys`, a missing module parameter fail there), and a value the kernel refuses
/// when written puts back the ones written before it. A failing value left earlier
/// ones written, a node half-configured.
fn write_all(settings: Vec<ConntrackSysctl>, host: bool) -> Vec<(ConntrackSysctl, Outcome)> {
    use std::io::Write;
    let mut out: Vec<(ConntrackSysctl, Outcome)> = Vec::new();
    let mut to_write = Vec::new();
    for s in settings {
        if !s.writable_from(host) {
            out.push((s, Outcome::NotHostNetns));
            continue;
        }
        let was = read_value(&s.path);
        if was.is_some_and(|v| s.satisfied_by(v)) {
            out.push((s, Outcome::Found));
            continue;
        }
        to_write.push((s, was));
    }
    // Opened, not yet written: a failure here writes nothing.
    let opened: Vec<std::io::Result<std::fs::File>> = to_write
        .iter()
        .map(|(s, _)| std::fs::OpenOptions::new().write(true).open(&s.path))
        .collect();
    if let Some(first) = opened.iter().position(Result::is_err) {
        let why = format!("not written: {} cannot be", to_write[first].0.path);
        for ((s, _), f) in to_write.into_iter().zip(opened) {
            let e = match f {
                Err(e) => e.to_string(),
                Ok(_) => why.clone(),
            };
            out.push((s, Outcome::Failed(e)));
        }
        return out;
    }
    let mut written: Vec<(ConntrackSysctl, Option<u64>)> = Vec::new();
    for ((s, was), f) in to_write.into_iter().zip(opened) {
        let mut f = f.expect("every file opened");
        match f.write_all(s.value.to_string().as_bytes()) {
            Ok(()) => written.push((s, was)),
            Err(e) => {
                // Put back what was written before this one.
                let path = s.path.clone();
                for (w, was) in written.drain(..) {
                    if let Some(v) = was {
                        let _ = std::fs::write(&w.path, v.to_string());
                    }
                    out.push((
                        w,
                        Outcome::Failed(format!("put back: {path} could not be written")),
                    ));
                }
                out.push((s, Outcome::Failed(e.to_string())));
                return out;
            }
        }
    }
    out.extend(
        written
            .into_iter()
            .map(|(s, was)| (s, Outcome::Set { was })),
    );
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_config::SysctlScope;

    fn setting(path: &std::path::Path, value: u64) -> ConntrackSysctl {
        ConntrackSysctl {
            path: path.display().to_string(),
            value,
            scope: SysctlScope::NetworkNamespace,
            raise_only: false,
        }
    }

    /// A setting that could not be written left the ones before it written: now
    /// either every setting is written or none is.
    #[test]
    fn settings_are_written_all_or_none() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        std::fs::write(&a, "10\n").unwrap();
        let missing = dir.path().join("no/such/b");
        let out = write_all(vec![setting(&a, 30), setting(&missing, 40)], true);
        assert_eq!(std::fs::read_to_string(&a).unwrap(), "10\n", "{out:?}");
        assert!(
            out.iter().all(|(_, o)| matches!(o, Outcome::Failed(_))),
            "{out:?}"
        );
        // All writable: all written.
        let b = dir.path().join("b");
        std::fs::write(&b, "1\n").unwrap();
        let out = write_all(vec![setting(&a, 30), setting(&b, 40)], true);
        assert!(
            out.iter().all(|(_, o)| matches!(o, Outcome::Set { .. })),
            "{out:?}"
        );
        assert_eq!(std::fs::read_to_string(&a).unwrap().trim(), "30");
        assert_eq!(std::fs::read_to_string(&b).unwrap().trim(), "40");
    }
}
