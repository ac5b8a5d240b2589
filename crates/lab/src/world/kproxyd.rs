//! The real kproxy daemon per node: `ip netns exec <node-ns> kproxy run ...` as a
//! child process, reading the node's manifest directory. Its event log (JSON lines)
//! feeds the run's timeline. Dropping the handle stops the process (SIGTERM, then
//! SIGKILL if it does not exit) so no daemon outlives the lab.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::LabError;
use crate::world::fabric::NodeNet;
use crate::world::timeline::{EventKind, Recorder};

/// Where a node's kproxy reads the cluster from.
#[derive(Clone, Copy, Debug)]
pub enum KproxySource<'a> {
    /// The embedded control plane's manifest directory (`--manifests`).
    Manifests(&'a Path),
    /// The real API server (`--kubeconfig`), reached through the node's API bridge.
    Kubeconfig(&'a Path),
}

/// The flags that give kproxy the behaviour of kube-proxy before 1.26 (the lab's
/// `pre-1.26` behaviour): no failover to serving-terminating endpoints (KEP-1669,
/// on by default from 1.26), a `/healthz` that ignores the Node's scale-down taint
/// and deletion (KEP-3836, from 1.28, on by default from 1.30) and the drain
/// conditions of KEP-5683 (no kube-proxy reads them), no drain on SIGTERM (none has
/// one), and no endpoint warm-up (kproxy's own, docs/warmup.md: kube-proxy sends a new
/// endpoint connections as soon as it syncs).
pub const PRE_126_FLAGS: [&str; 8] = [
    "--proxy-terminating-endpoints=false",
    "--feature-gates",
    "KubeProxyDrainingTerminatingNodes=false",
    "--ignore-drain-signal",
    "drainInProgress,gracefulNodeShutdownInProgress",
    "--shutdown-drain",
    "never",
    "--endpoint-warmup=0s",
];

/// How long `kproxy run --help` may take before the lab takes the flag as unknown: a
/// binary that hangs (another build, a wrapper waiting on something) must not hang the
/// lab's start with it.
const HELP_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether `kproxy run --help` lists `flag` (a release older than this one may not).
fn knows_flag(kproxy: &Path, flag: &str) -> bool {
    help_lists(kproxy, flag, HELP_TIMEOUT)
}

/// Whether `BINARY run --help` prints `flag` within `timeout`; a binary that does not
/// exit by then is killed, and the flag counts as unknown.
fn help_lists(binary: &Path, flag: &str, timeout: Duration) -> bool {
    use std::io::Read;
    let Ok(mut child) = Command::new(binary)
        .args(["run", "--help"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
    else {
        return false;
    };
    // Read while it runs: a help text larger than the pipe's buffer would block it. The
    // text comes over a channel, so that a child of the binary still holding the pipe
    // open cannot hold this past the deadline either.
    let Some(mut stdout) = child.stdout.take() else {
        return false;
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stdout.read_to_string(&mut text);
        let _ = tx.send(text);
    });
    let deadline = Instant::now() + timeout;
    let exited = loop {
        match child.try_wait() {
            Ok(Some(_)) => break true,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => break false,
        }
    };
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
        return false;
    }
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .is_ok_and(|text| text.contains(flag))
}

pub struct Kproxyd {
    pub node: String,
    pub event_log: PathBuf,
    pub log: PathBuf,
    /// `ip` and its arguments, kept for `restart`.
    argv: Vec<std::ffi::OsString>,
    child: Option<Child>,
}

impl Kproxyd {
    /// Start kproxy for `node`. `proxy_terminating_endpoints = false` gives the
    /// pre-1.26 behaviour ([`PRE_126_FLAGS`]).
    pub fn start(
        kproxy: &Path,
        node: &NodeNet,
        manifests: &Path,
        workdir: &Path,
        proxy_terminating_endpoints: bool,
        extra_args: &[String],
    ) -> Result<Kproxyd, LabError> {
        Self::start_from(
            kproxy,
            node,
            KproxySource::Manifests(manifests),
            workdir,
            proxy_terminating_endpoints,
            extra_args,
        )
    }

    /// `start` with the source named.
    pub fn start_from(
        kproxy: &Path,
        node: &NodeNet,
        source: KproxySource,
        workdir: &Path,
        proxy_terminating_endpoints: bool,
        extra_args: &[String],
    ) -> Result<Kproxyd, LabError> {
        let event_log = workdir.join(format!("{}-events.jsonl", node.name));
        let log = workdir.join(format!("{}.log", node.name));
        let mut argv: Vec<std::ffi::OsString> =
            vec!["netns".into(), "exec".into(), node.ns.name().into()];
        argv.push(kproxy.into());
        argv.push("run".into());
        let (flag, path) = match source {
            KproxySource::Manifests(p) => ("--manifests", p),
            KproxySource::Kubeconfig(p) => ("--kubeconfig", p),
        };
        argv.push(flag.into());
        argv.push(path.into());
        let hz = format!(
            "{}:{}",
            node.ip,
            crate::scenario::service::PROXY_HEALTHZ_PORT
        );
        for a in [
            "--hostname-override",
            &node.name,
            "--healthz-bind-address",
            &hz,
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--min-sync-period",
            "50ms",
            "--sync-period",
            "10s",
            "--cluster-cidr",
            "10.244.0.0/16",
            "--event-log",
        ] {
            argv.push(a.into());
        }
        argv.push(event_log.clone().into());
        // The rollout report sets the kernel's counts beside the load generator's
        // (report::kernel); the lab's few Services cost nothing to count. An older
        // release (`lab restart --kproxy OLD --upgrade-to NEW`) has no such flag.
        if knows_flag(kproxy, "--traffic-metrics") {
            argv.extend(["--traffic-metrics".into(), "service".into()]);
        }
        if !proxy_terminating_endpoints {
            argv.extend(PRE_126_FLAGS.iter().map(Into::into));
        }
        argv.extend(extra_args.iter().map(Into::into));
        let mut d = Kproxyd {
            node: node.name.clone(),
            event_log,
            log,
            argv,
            child: None,
        };
        d.spawn(false)?;
        Ok(d)
    }

    /// Start the process; `append` keeps the log of an earlier process (a restart).
    fn spawn(&mut self, append: bool) -> Result<(), LabError> {
        let logf = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(&self.log)
            .map_err(|e| LabError::Io {
                what: format!("open {}", self.log.display()),
                source: e,
            })?;
        let logf2 = logf.try_clone().map_err(|e| LabError::Io {
            what: "dup log fd".into(),
            source: e,
        })?;
        let child = Command::new("ip")
            .args(&self.argv)
            .stdin(Stdio::null())
            .stdout(Stdio::from(logf))
            .stderr(Stdio::from(logf2))
            .spawn()
            .map_err(|e| LabError::Io {
                what: format!("spawn kproxy for {}", self.node),
                source: e,
            })?;
        self.child = Some(child);
        Ok(())
    }

    /// Stop the daemon (SIGTERM, as a rolling restart of the DaemonSet does) and
    /// start it again with the same arguments. kproxy leaves its rules in place
    /// when it stops, so traffic keeps flowing while it is down; its health check
    /// node port does not answer until the new process serves it.
    pub fn restart(&mut self) -> Result<(), LabError> {
        self.stop();
        self.spawn(true)
    }

    /// Kill the daemon with SIGKILL (no shutdown path runs) and start it again with the
    /// same arguments.
    pub fn kill_and_start(&mut self) -> Result<(), LabError> {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.spawn(true)
    }

    /// Stop the daemon (SIGTERM) and start `kproxy` in its place with the same
    /// arguments, as a DaemonSet update does.
    pub fn replace(&mut self, kproxy: &Path) -> Result<(), LabError> {
        self.stop();
        // argv: netns exec NS KPROXY run ...
        self.argv[3] = kproxy.into();
        // A rollback to an older release: the flag it does not know goes, with its value.
        if !knows_flag(kproxy, "--traffic-metrics")
            && let Some(i) = self.argv.iter().position(|a| a == "--traffic-metrics")
        {
            self.argv.drain(i..(i + 2).min(self.argv.len()));
        }
        self.spawn(true)
    }

    /// Is the process still running? Err carries the tail of its log if not.
    pub fn check_alive(&mut self) -> Result<(), LabError> {
        let Some(c) = self.child.as_mut() else {
            return Ok(());
        };
        match c.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => {
                let tail = std::fs::read_to_string(&self.log).unwrap_or_default();
                let tail: String = tail
                    .lines()
                    .rev()
                    .take(15)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n");
                Err(LabError::Daemon {
                    node: self.node.clone(),
                    detail: format!("kproxy exited ({status}); log tail:\n{tail}"),
                })
            }
            Err(e) => Err(LabError::Io {
                what: "wait kproxy".into(),
                source: e,
            }),
        }
    }

    pub fn stop(&mut self) {
        self.stop_within(Duration::from_secs(3));
    }

    /// SIGTERM, then SIGKILL if the process has not exited within `limit` (a node
    /// shutdown waits out kproxy's drain period).
    pub fn stop_within(&mut self, limit: Duration) {
        let Some(mut c) = self.child.take() else {
            return;
        };
        // `ip netns exec` execs kproxy, so the child pid is kproxy itself.
        let pid = nix::unistd::Pid::from_raw(c.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
    }

    /// This node's traffic counters now, summed over its Service ports: (DNATed,
    /// rejected, dropped, fallback), read from the node's kernel by the same binary's
    /// `kproxy top -o json` (the rules stay when the daemon stops, so this works after
    /// `stop` too). Err: why not, in words.
    pub fn traffic_totals(&self) -> Result<[u64; 4], String> {
        // argv: netns exec NS KPROXY run ...
        let out = Command::new("ip")
            .args(&self.argv[..4])
            .args(["top", "-o", "json", "--interval", "0.05"])
            .output()
            .map_err(|e| format!("kproxy top: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "kproxy top: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).map_err(|e| format!("kproxy top's JSON: {e}"))?;
        let mut sum = [0u64; 4];
        for p in v["servicePorts"].as_array().into_iter().flatten() {
            for (i, k) in [
                "new_total",
                "rejects_total",
                "drops_total",
                "fallback_total",
            ]
            .iter()
            .enumerate()
            {
                sum[i] = sum[i].saturating_add(p[k].as_u64().unwrap_or(0));
            }
        }
        Ok(sum)
    }

    /// Copy this daemon's event log into the timeline. `wall_start` is the wall
    /// clock when the run's clock started.
    pub fn import_events(&self, recorder: &Recorder, wall_start: SystemTime) {
        let Ok(text) = std::fs::read_to_string(&self.event_log) else {
            return;
        };
        let start_ms = wall_start
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64()
            * 1000.0;
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let Some(t) = v["t_unix_ms"].as_f64() else {
                continue;
            };
            let ev = v["event"].as_str().unwrap_or("?");
            let kind = match ev {
                "synced" => EventKind::KproxySynced,
                "sync_failed" => EventKind::KproxySyncFailed,
                _ => EventKind::Note,
            };
            let mut detail = v.clone();
            if let Some(o) = detail.as_object_mut() {
                o.remove("t_unix_ms");
                o.remove("event");
            }
            let d = if detail.as_object().is_some_and(|o| o.is_empty()) {
                String::new()
            } else {
                detail.to_string()
            };
            recorder.record_at(
                t - start_ms,
                kind,
                Some(&self.node),
                None,
                format!("kproxy {ev} {d}").trim().to_string(),
            );
        }
    }
}

impl Drop for Kproxyd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The wall clock in ms since the epoch, as kproxy's event log writes it.
pub fn unix_ms(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1000.0
}

/// The wall times (ms since the epoch) of the `synced` lines in `event_log`, in order.
fn sync_times(event_log: &Path) -> Vec<f64> {
    let Ok(text) = std::fs::read_to_string(event_log) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "synced")
        .filter_map(|v| v["t_unix_ms"].as_f64())
        .collect()
}

/// Has the kproxy writing `event_log` logged a sync after wall time `t`? (Its
/// `synced` lines carry the wall time they were written.)
pub fn synced_after(event_log: &Path, t: SystemTime) -> bool {
    let t_ms = unix_ms(t);
    sync_times(event_log).into_iter().any(|s| s > t_ms)
}

/// The wall time (ms since the epoch) of the first sync logged at or after
/// `since_unix_ms`.
pub fn first_sync_since(event_log: &Path, since_unix_ms: f64) -> Option<f64> {
    sync_times(event_log)
        .into_iter()
        .find(|&t| t >= since_unix_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// An executable shell script in a directory of its own.
    fn script(dir: &tempfile::TempDir, body: &str) -> PathBuf {
        let path = dir.path().join("kproxy");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn a_help_that_never_ends_counts_as_not_knowing_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let hangs = script(&dir, "echo --traffic-metrics; exec sleep 600");
        assert!(!help_lists(
            &hangs,
            "--traffic-metrics",
            Duration::from_millis(300)
        ));
    }

    #[test]
    fn a_help_whose_child_keeps_the_pipe_open_ends_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let forks = script(&dir, "echo --traffic-metrics; sleep 5 &");
        assert!(!help_lists(
            &forks,
            "--traffic-metrics",
            Duration::from_millis(300)
        ));
    }

    #[test]
    fn a_help_that_lists_the_flag_knows_it() {
        let dir = tempfile::tempdir().unwrap();
        let knows = script(&dir, "echo '      --traffic-metrics <LEVEL>'");
        assert!(help_lists(&knows, "--traffic-metrics", HELP_TIMEOUT));
        assert!(!help_lists(&knows, "--endpoint-warmup", HELP_TIMEOUT));
        assert!(!help_lists(
            &dir.path().join("absent"),
            "--traffic-metrics",
            HELP_TIMEOUT
        ));
    }
}
