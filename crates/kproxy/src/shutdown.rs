//! How `kproxy run` stops on a signal: SIGINT at once; SIGTERM, when it means the node
//! is going away, after a drain period in which kproxy keeps forwarding (the sync loop
//! and every server keep running) while `/healthz` answers 503, so eTP-Cluster load
//! balancers stop sending new connections before the proxy is gone. Either way the
//! rules stay. Whether and how long to drain is `kproxy_health::decide::shutdown_drain`
//! (pure); this module owns the signals and the timer (docs/health.md, "Drain signals").

use std::time::{Duration, SystemTime};

use kproxy_health::{Health, ShutdownDrain};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// `--shutdown-drain` and `--shutdown-drain-period`.
#[derive(Clone, Copy, Debug)]
pub struct DrainConfig {
    pub mode: ShutdownDrain,
    pub period: Duration,
}

/// Which signal arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Received {
    Term,
    Int,
}

struct Signals {
    term: Signal,
    int: Signal,
}

impl Signals {
    fn new() -> Option<Signals> {
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(term), Ok(int)) => Some(Signals { term, int }),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM / SIGINT");
                None
            }
        }
    }

    async fn next(&mut self) -> Received {
        tokio::select! {
            _ = self.term.recv() => Received::Term,
            _ = self.int.recv() => Received::Int,
        }
    }
}

/// The signal handler task: returns (stopping every task) on SIGINT, or on SIGTERM once
/// its drain is over, or when `stop` is cancelled. A second signal ends a drain at once.
pub async fn handle_signals(health: Health, drain: DrainConfig, stop: CancellationToken) {
    let Some(mut signals) = Signals::new() else {
        stop.cancelled().await;
        return;
    };
    let first = tokio::select! {
        _ = stop.cancelled() => return,
        r = signals.next() => r,
    };
    if first == Received::Int {
        tracing::info!("SIGINT: stopping; the rules stay");
        return;
    }
    let since = health.draining_since();
    let Some(period) =
        kproxy_health::decide::shutdown_drain(drain.mode, drain.period, since, SystemTime::now())
    else {
        tracing::info!(
            draining_since = since.map(kproxy_health::decide::rfc3339),
            "SIGTERM: stopping; the rules stay"
        );
        return;
    };
    health.shut_down();
    tracing::info!(
        drain_seconds = period.as_secs_f64(),
        draining_since = since.map(kproxy_health::decide::rfc3339),
        "SIGTERM: draining (/healthz answers 503, the rules forward) before stopping; the rules stay"
    );
    tokio::select! {
        _ = tokio::time::sleep(period) => tracing::info!("drain period over: stopping"),
        r = signals.next() => tracing::info!(signal = ?r, "a second signal: stopping now"),
        _ = stop.cancelled() => {}
    }
}
