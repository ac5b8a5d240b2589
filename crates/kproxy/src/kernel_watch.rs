//! `kproxy run`'s watch on its own nftables tables. kproxy-nft's [`Monitor`] reads the
//! kernel's notifications on a thread of its own; each change another process made to
//! kproxy's tables is logged (what, which process), counted
//! (`kproxy_kernel_interference_total{what}`) and told to the health servers the moment
//! it is read ([`detected`]); then [`KernelWatch`] hands it to the sync loop, which
//! repairs the tables from its record (`crate::daemon::SyncLoop`), immediately after a
//! quiet spell and, while a process keeps changing them, backing off
//! ([`kproxy_nft::Backoff`]) so kproxy never spins against it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kproxy_health::Health;
use kproxy_nft::{Backoff, Event, Interference, Monitor};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::metrics::{Metrics, WhatLabel};

/// An event as the reading thread read it, and when: a repair's `detected` is the
/// moment the notification was read, not the moment the sync loop took it.
#[derive(Debug)]
pub struct Detected {
    pub event: Event,
    pub at: Instant,
}

impl Detected {
    /// `event`, read now.
    pub fn now(event: Event) -> Detected {
        Detected {
            event,
            at: Instant::now(),
        }
    }
}

/// A repair owed: the interference seen since the last repair (merged), or only lost
/// notifications (`interference: None`).
#[derive(Debug)]
pub struct Repair {
    pub interference: Option<Interference>,
    /// Transactions (and losses) merged into this repair.
    pub events: usize,
    /// When the first of them was read.
    pub detected: Instant,
}

impl Repair {
    fn of(d: Detected) -> Repair {
        Repair {
            interference: match d.event {
                Event::Interference(i) => Some(i),
                Event::Lost => None,
            },
            events: 1,
            detected: d.at,
        }
    }

    fn merge(&mut self, d: Detected) {
        self.events += 1;
        if let Event::Interference(i) = d.event {
            match &mut self.interference {
                Some(into) => into.merge(i),
                None => self.interference = Some(i),
            }
        }
    }
}

/// The sync loop's side of the watch: what is owed and when it is due.
pub struct KernelWatch {
    events: mpsc::UnboundedReceiver<Detected>,
    owed: Option<(Repair, Instant)>,
    backoff: Backoff,
    last_repair: Option<Instant>,
    /// Until when a repair owed for lost notifications alone waits, after a comparison
    /// found nothing to repair ([`crate::pacing::lost_comparison_pause`]).
    lost_paused_until: Option<Instant>,
    metrics: Arc<Metrics>,
}

impl KernelWatch {
    /// Subscribes in the calling thread's network namespace (the node's) and starts the
    /// reading thread, which calls [`detected`] for each event.
    pub fn start(table: &str, health: Health, metrics: Arc<Metrics>) -> Result<KernelWatch> {
        let mut monitor = Monitor::open(table).context("watching nftables notifications")?;
        let (tx, rx) = mpsc::unbounded_channel();
        let m = metrics.clone();
        // A thread starts in its creator's network namespace: it reads the node's.
        std::thread::Builder::new()
            .name("kproxy-nft-watch".into())
            .spawn(move || {
                let mut log = LogPace::default();
                while !tx.is_closed() {
                    match monitor.next_event() {
                        Ok(Some(event)) => {
                            let read = Detected::now(event);
                            detected(&read.event, &health, &m, &mut log);
                            if tx.send(read).is_err() {
                                break;
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            tracing::error!(error = %e, "the nftables watch stopped; the periodic verification remains");
                            break;
                        }
                    }
                }
            })
            .context("starting the nftables watch thread")?;
        Ok(KernelWatch::of(rx, metrics))
    }

    /// A watch fed by `events` (tests feed it by hand).
    pub fn of(events: mpsc::UnboundedReceiver<Detected>, metrics: Arc<Metrics>) -> KernelWatch {
        KernelWatch {
            events,
            owed: None,
            backoff: Backoff::default(),
            last_repair: None,
            lost_paused_until: None,
            metrics,
        }
    }

    /// The next repair, once it is due; never for a loop without a watch. Cancel-safe
    /// (what is owed stays here), so it can be one arm of the sync loop's `select!`.
    pub async fn next(watch: &mut Option<KernelWatch>) -> Repair {
        match watch {
            Some(w) => w.next_due().await,
            None => std::future::pending().await,
        }
    }

    async fn next_due(&mut self) -> Repair {
        loop {
            let Some((_, due)) = &self.owed else {
                let Some(event) = self.events.recv().await else {
                    // The reading thread stopped (logged there): nothing more comes.
                    return std::future::pending().await;
                };
                let delay = self.backoff.delay(self.last_repair.map(|t| t.elapsed()));
                let mut due = Instant::now() + delay;
                if matches!(event.event, Event::Lost)
                    && let Some(until) = self.lost_paused_until
                {
                    due = due.max(until);
                }
                self.owed = Some((Repair::of(event), due));
                self.announce(delay);
                continue;
            };
            let due = *due;
            tokio::select! {
                // What is already queued joins the repair before it starts.
                biased;
                event = self.events.recv() => match (event, &mut self.owed) {
                    (Some(event), Some((owed, due))) => {
                        // Another process's change does not wait out a pause that
                        // lost notifications alone took.
                        if owed.interference.is_none()
                            && matches!(event.event, Event::Interference(_))
                        {
                            let delay =
                                self.backoff.delay(self.last_repair.map(|t| t.elapsed()));
                            *due = (*due).min(Instant::now() + delay);
                        }
                        owed.merge(event);
                    }
                    _ => return std::future::pending().await,
                },
                _ = tokio::time::sleep_until(due) => {
                    let (repair, _) = self.owed.take().expect("owed above");
                    return repair;
                }
            }
        }
    }

    /// Says loudly when repairs are backing off (a process keeps changing the tables).
    fn announce(&self, delay: Duration) {
        self.metrics.kernel_repair_backoff.set(delay.as_secs_f64());
        if delay.is_zero() {
            return;
        }
        let who = self
            .owed
            .as_ref()
            .and_then(|(r, _)| r.interference.as_ref())
            .map(|i| format!("{} (pid {})", i.process, i.pid))
            .unwrap_or_else(|| "unknown".into());
        tracing::warn!(
            process = %who,
            repairs_in_a_row = self.backoff.streak,
            delay_ms = delay.as_millis() as u64,
            "another process keeps changing kproxy's nftables tables: backing off before repairing them again; Services on this node are broken until it stops"
        );
    }

    /// Whether a repair is owed (waiting out the backoff).
    pub fn owes(&self) -> bool {
        self.owed.is_some()
    }

    /// The repair's comparison, which took `took`, found the tables equal to the
    /// record: nothing was repaired, so no backoff step (lost notifications from other
    /// tables' churn are not a process fighting kproxy); but the next comparison for
    /// lost notifications alone waits ([`crate::pacing::lost_comparison_pause`]), so
    /// endless losses do not read the tables back to back.
    pub fn found_unchanged(&mut self, took: Duration) {
        self.metrics.kernel_repair_backoff.set(0.0);
        self.lost_paused_until = Some(Instant::now() + crate::pacing::lost_comparison_pause(took));
    }

    /// The repair ran (`ok`), or failed and is owed again, after the backoff.
    pub fn repaired(&mut self, repair: Repair, ok: bool) {
        self.backoff.repaired();
        self.last_repair = Some(Instant::now());
        self.lost_paused_until = None;
        if !ok {
            let delay = self.backoff.delay(Some(Duration::ZERO)).max(Backoff::FIRST);
            self.owed = Some((repair, Instant::now() + delay));
            self.metrics.kernel_repair_backoff.set(delay.as_secs_f64());
        }
    }
}

/// Logs at most one warning a second; the rest go to debug and are counted in the next.
#[derive(Default)]
struct LogPace {
    last: Option<Instant>,
    quiet: usize,
}

/// What happens the moment an event is read: log (what changed, which process),
/// count, and tell health (truthful node ports and, while a table is missing,
/// `/healthz` answer 503 until the repair).
fn detected(event: &Event, health: &Health, metrics: &Metrics, log: &mut LogPace) {
    let loud = log
        .last
        .is_none_or(|t| t.elapsed() >= Duration::from_secs(1));
    match event {
        Event::Interference(i) => {
            for kind in i.changes.counts.keys() {
                metrics
                    .kernel_interference
                    .get_or_create(&WhatLabel {
                        what: kind.as_str(),
                    })
                    .inc();
            }
            health.kernel_changed(i.tables_missing());
            let changes = i.changes.summary();
            if loud {
                tracing::warn!(
                    pid = i.pid,
                    process = %i.process,
                    generation = i.generation,
                    %changes,
                    examples = ?i.changes.examples,
                    tables_missing = i.tables_missing(),
                    also_since_last_warning = log.quiet,
                    "another process changed kproxy's nftables tables; repairing"
                );
            } else {
                tracing::debug!(pid = i.pid, process = %i.process, %changes, "another process changed kproxy's nftables tables");
            }
        }
        Event::Lost => {
            metrics
                .kernel_interference
                .get_or_create(&WhatLabel { what: "unknown" })
                .inc();
            if loud {
                tracing::warn!(
                    "nftables notifications were lost (receive buffer overrun); comparing kproxy's tables with its record"
                );
            }
        }
    }
    if loud {
        log.last = Some(Instant::now());
        log.quiet = 0;
    } else {
        log.quiet += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_nft::Changes;
    use prometheus_client::registry::Registry;

    #[expect(
        clippy::disallowed_types,
        reason = "kproxy_nft stamps an interference on its blocking monitor thread"
    )]
    fn interference(pid: u32) -> Event {
        Event::Interference(Interference {
            pid,
            process: "nft".into(),
            generation: 1,
            changes: Changes::default(),
            detected: std::time::Instant::now(),
        })
    }

    /// A first interference is repaired at once; one that keeps coming back waits
    /// longer each time, and everything that arrives while waiting joins one repair.
    /// A repair counts from when the notification was read, not from when the sync
    /// loop took it (the repair's logged "ms since detected").
    #[tokio::test(start_paused = true)]
    async fn a_repair_is_detected_when_its_notification_was_read() {
        let metrics = Metrics::register(&mut Registry::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let mut watch = Some(KernelWatch::of(rx, metrics));
        let read = Detected::now(interference(7));
        let at = read.at;
        tokio::time::advance(Duration::from_millis(40)).await;
        tx.send(read).unwrap();
        let r = KernelWatch::next(&mut watch).await;
        assert_eq!(r.detected, at);
        assert_eq!(r.detected.elapsed(), Duration::from_millis(40));
    }

    #[tokio::test(start_paused = true)]
    async fn repairs_back_off_while_fought_and_merge_what_waits() {
        let metrics = Metrics::register(&mut Registry::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let mut watch = Some(KernelWatch::of(rx, metrics));
        let start = Instant::now();
        let mut at = Vec::new();
        for round in 0..5u32 {
            for k in 0..3 {
                tx.send(Detected::now(interference(100 + round * 10 + k)))
                    .unwrap();
            }
            let r = KernelWatch::next(&mut watch).await;
            at.push((start.elapsed().as_millis() as u64, r.events));
            let pid = r.interference.as_ref().map(|i| i.pid);
            assert_eq!(
                pid,
                Some(100 + round * 10 + 2),
                "the latest process is named"
            );
            watch.as_mut().unwrap().repaired(r, true);
        }
        assert_eq!(at, [(0, 3), (100, 3), (300, 3), (700, 3), (1500, 3)]);
        // A failed repair is owed again.
        tx.send(Detected::now(Event::Lost)).unwrap();
        let r = KernelWatch::next(&mut watch).await;
        watch.as_mut().unwrap().repaired(r, false);
        let again = KernelWatch::next(&mut watch).await;
        assert!(again.interference.is_none());
    }
}
