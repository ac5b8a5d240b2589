//! The one task lifecycle of `kproxy run`: every long-running task (signal handler,
//! source, metrics server, sync loop) runs in one `JoinSet` under a child of
//! one cancellation token. The first task to end — a signal, a failed source, a loop
//! error — cancels the tree, and [`Tasks::run`] returns only once every task has returned,
//! with the first error. Tasks that own state to finish (the sync loop completes a sync
//! in flight) watch their token; foreign futures without a token (the sources) are
//! dropped when it fires.

use std::future::Future;

use anyhow::{Result, anyhow};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// How a task ended, for the report in [`Tasks::run`].
type Ended = (&'static str, Result<()>);

#[derive(Default)]
pub struct Tasks {
    root: CancellationToken,
    set: JoinSet<Ended>,
}

impl Tasks {
    pub fn new() -> Tasks {
        Tasks::default()
    }

    /// A task that stops itself when its token is cancelled.
    pub fn spawn<F, Fut>(&mut self, name: &'static str, task: F)
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        let fut = task(self.root.child_token());
        self.set.spawn(async move { (name, fut.await) });
    }

    /// A task without a token: dropped when the tree is cancelled. It should run until
    /// then; returning early (even `Ok`) is reported as `ends_early`.
    pub fn spawn_until_cancelled<Fut>(
        &mut self,
        name: &'static str,
        ends_early: &'static str,
        fut: Fut,
    ) where
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        let token = self.root.child_token();
        self.set.spawn(async move {
            let r = tokio::select! {
                biased;
                _ = token.cancelled() => Ok(()),
                r = fut => r.and(Err(anyhow!("{ends_early}"))),
            };
            (name, r)
        });
    }

    /// Waits for the first task to end, cancels the tree, waits for every task; returns
    /// the first error (a panic counts as one).
    pub async fn run(mut self) -> Result<()> {
        let mut first_err: Option<anyhow::Error> = None;
        while let Some(joined) = self.set.join_next().await {
            let (name, r) = match joined {
                Ok(ended) => ended,
                Err(e) => ("a task", Err(anyhow!("task failed: {e}"))),
            };
            match r {
                Ok(()) => tracing::debug!(task = name, "task ended"),
                Err(e) => {
                    let e = e.context(format!("{name} stopped"));
                    if first_err.is_none() {
                        first_err = Some(e);
                    } else {
                        tracing::warn!(error = format!("{e:#}"), "while shutting down");
                    }
                }
            }
            self.root.cancel();
        }
        first_err.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    fn log() -> Arc<Mutex<Vec<String>>> {
        Arc::default()
    }

    #[tokio::test(start_paused = true)]
    async fn a_failing_task_cancels_the_tree_and_every_task_finishes_first() {
        let seen = log();
        let mut tasks = Tasks::new();
        let s = seen.clone();
        tasks.spawn("loop", move |stop| async move {
            stop.cancelled().await;
            // Work that must finish before run returns (a sync in flight).
            tokio::time::sleep(Duration::from_secs(3)).await;
            s.lock().unwrap().push("loop finished".into());
            Ok(())
        });
        let s = seen.clone();
        tasks.spawn_until_cancelled("source", "the source stopped", async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            s.lock().unwrap().push("source failed".into());
            Err(anyhow!("watch broke"))
        });
        tasks.spawn_until_cancelled("metrics server", "unused", std::future::pending());
        let err = tasks.run().await.unwrap_err();
        assert_eq!(format!("{err:#}"), "source stopped: watch broke");
        assert_eq!(*seen.lock().unwrap(), ["source failed", "loop finished"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_signal_stops_everything_cleanly_and_an_early_ok_is_an_error() {
        let mut tasks = Tasks::new();
        tasks.spawn("signal", |_| async {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(())
        });
        tasks.spawn("loop", |stop| async move {
            stop.cancelled().await;
            Ok(())
        });
        tasks.run().await.unwrap();

        let mut tasks = Tasks::new();
        tasks.spawn_until_cancelled("source", "the source stopped", async { Ok(()) });
        tasks.spawn("loop", |stop| async move {
            stop.cancelled().await;
            Ok(())
        });
        let err = tasks.run().await.unwrap_err();
        assert_eq!(format!("{err:#}"), "source stopped: the source stopped");
    }
}
