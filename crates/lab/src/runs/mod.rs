//! The runs: each drives the world through one scenario and hands back what it
//! recorded. `rollout` is one rolling update (or node drain) under load, `matrix` many
//! rollouts beside lint's verdicts, `restart` and `takeover` the held runs (one pod per
//! node under two loads, changed phase by phase, on the skeleton in `held`).
//!
//! What every run shares is here: the lab's runtime, the scratch directory, the wait
//! that watches the daemons, the progress callback.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::LabError;
use crate::world::kproxyd::Kproxyd;

pub mod held;
pub mod matrix;
pub mod restart;
pub mod rollout;
pub mod takeover;

/// Where a run tells the person what it is doing (one line at a time).
pub type Progress<'a> = &'a (dyn Fn(&str) + Sync);

/// Runs `run` to its end on the lab's runtime (two workers, enough for the load, the
/// kubelets and the LB), then shuts the runtime down: kubelet tasks hold pods, and
/// dropping them (with their servers and namespaces) happens before this returns.
pub(crate) fn on_lab_runtime<T>(
    run: impl std::future::Future<Output = Result<T, LabError>>,
) -> Result<T, LabError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| LabError::Io {
            what: "lab runtime".into(),
            source: e,
        })?;
    let result = rt.block_on(run);
    rt.shutdown_timeout(Duration::from_secs(5));
    result
}

pub(crate) fn check_daemons(daemons: &mut [Kproxyd]) -> Result<(), LabError> {
    for d in daemons.iter_mut() {
        d.check_alive()?;
    }
    Ok(())
}

/// Runs `f`, a blocking call (a process signalled and waited for, `ip` or `nft` run),
/// from a task of the lab's runtime without stalling its other tasks (the kubelets'
/// probes, the control plane's publisher): the runtime hands them to another thread
/// while `f` runs. Only on the lab's runtime (multi-thread, [`on_lab_runtime`]).
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// Polls `step` every `period` until it says done; fails on its error, or after
/// `limit` naming `what`.
pub(crate) async fn poll(
    what: &str,
    limit: Duration,
    period: Duration,
    mut step: impl FnMut() -> Result<bool, LabError>,
) -> Result<(), LabError> {
    let start = Instant::now();
    loop {
        if step()? {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(LabError::Invalid(format!(
                "timed out after {limit:?} waiting for {what}"
            )));
        }
        tokio::time::sleep(period).await;
    }
}

/// Wait until `cond` holds, checking the daemons; fail after `limit`.
pub(crate) async fn wait_for(
    what: &str,
    limit: Duration,
    daemons: &mut [Kproxyd],
    mut cond: impl FnMut() -> bool,
) -> Result<(), LabError> {
    poll(what, limit, Duration::from_millis(20), || {
        if cond() {
            return Ok(true);
        }
        check_daemons(daemons).map(|()| false)
    })
    .await
}

/// Waits for `task` (a rollout, a drain's replacement pods) to end, checking the
/// daemons meanwhile and calling `beside` at every look (a progress line); the
/// task's result. `name` names the task if it panicked.
pub(crate) async fn finish(
    what: &str,
    name: &str,
    limit: Duration,
    daemons: &mut [Kproxyd],
    task: tokio::task::JoinHandle<Result<(), LabError>>,
    mut beside: impl FnMut(),
) -> Result<(), LabError> {
    wait_for(what, limit, daemons, || {
        beside();
        task.is_finished()
    })
    .await?;
    task.await
        .map_err(|e| LabError::Invalid(format!("{name} task: {e}")))?
}

/// The run's scratch directory (manifests, kproxy logs, kube-proxy's configuration);
/// removed when the run ends, however it ends, unless kept.
pub(crate) struct Workdir {
    pub(crate) path: PathBuf,
    keep: std::cell::Cell<bool>,
}

impl Workdir {
    /// `kproxy-lab-PREFIX` in the temporary directory, `PREFIX` the run's namespaces'.
    pub(crate) fn create(prefix: &str) -> Result<Workdir, LabError> {
        let path = std::env::temp_dir().join(format!("kproxy-lab-{prefix}"));
        std::fs::create_dir_all(&path).map_err(|e| LabError::Io {
            what: format!("mkdir {}", path.display()),
            source: e,
        })?;
        Ok(Workdir {
            path,
            keep: std::cell::Cell::new(false),
        })
    }

    pub(crate) fn keep(&self) {
        self.keep.set(true);
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        if !self.keep.get() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both of the lab runtime's workers inside blocking calls that wait for a task of
    /// the same runtime: the task still runs (without `blocking` it would wait behind
    /// them, and each call would give up empty-handed).
    #[test]
    fn blocking_calls_leave_the_runtime_running() {
        let got = on_lab_runtime(async {
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let rx = std::sync::Arc::new(std::sync::Mutex::new(rx));
            let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel();
            let waiters: Vec<_> = (0..2)
                .map(|_| {
                    let (rx, started_tx) = (rx.clone(), started_tx.clone());
                    tokio::spawn(async move {
                        let _ = started_tx.send(());
                        blocking(|| {
                            let rx = rx.lock().expect("receiver lock");
                            // A bound so that a stalled runtime fails the test rather
                            // than hanging it.
                            rx.recv_timeout(Duration::from_secs(20)).is_ok()
                        })
                    })
                })
                .collect();
            for _ in 0..2 {
                started.recv().await;
            }
            let sender = tokio::spawn(async move {
                for _ in 0..2 {
                    let _ = tx.send(());
                }
            });
            let mut got = Vec::new();
            for w in waiters {
                got.push(w.await.expect("waiter"));
            }
            sender.await.expect("sender");
            Ok(got)
        })
        .unwrap();
        assert_eq!(got, vec![true, true]);
    }
}
