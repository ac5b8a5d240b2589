//! The daemon's side of the endpoint warm-up hold (`kproxy_core::warmup` decides it):
//! the clock the planner reads, and what a hold that begins or ends tells the event log
//! (`endpoint_held`, `endpoint_released`), the log and the metrics
//! (`kproxy_endpoint_warmup_holds_total`, `kproxy_endpoint_warmup_releases_total`).

use kproxy_core::warmup::{Event, Moment};
use serde_json::json;
use tokio::time::Instant;

use crate::daemon::EventLog;
use crate::metrics::{Metrics, ReasonLabel};

/// The planner's clock: tokio's monotonic clock, anchored to the wall clock once, so a
/// [`Moment`] never goes back (a wall-clock step cannot shorten or stretch a hold) and
/// still reads as a date in `explain` and the event log.
#[derive(Clone, Copy, Debug)]
pub struct WarmupClock {
    at: Instant,
    unix_ms: u64,
}

impl WarmupClock {
    pub fn start() -> WarmupClock {
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or_default();
        WarmupClock {
            at: Instant::now(),
            unix_ms,
        }
    }

    pub fn moment(&self, now: Instant) -> Moment {
        let ms = now.saturating_duration_since(self.at).as_millis();
        Moment(
            self.unix_ms
                .saturating_add(u64::try_from(ms).unwrap_or(u64::MAX)),
        )
    }

    /// When `m` comes on tokio's clock (at the latest: a moment is whole milliseconds,
    /// so [`WarmupClock::moment`] of the instant is `m`, never a millisecond before).
    pub fn instant(&self, m: Moment) -> Instant {
        self.at + std::time::Duration::from_millis(m.0.saturating_sub(self.unix_ms))
    }
}

/// Logs and counts the holds a re-plan began and ended.
pub fn record(events: Vec<Event>, log: &mut EventLog, metrics: &Metrics, now: Moment) {
    for e in events {
        match e {
            Event::Held { service, ip, hold } => {
                metrics.endpoint_warmup_holds.inc();
                tracing::info!(
                    service = %service,
                    endpoint = %ip,
                    until = %hold.release,
                    "endpoint ready: held for warm-up before new connections go to it"
                );
                log.emit(
                    "endpoint_held",
                    json!({
                        "service": service.to_string(),
                        "ip": ip.to_string(),
                        "ready_since_unix_ms": hold.ready_since.0,
                        "release_unix_ms": hold.release.0,
                    }),
                );
            }
            Event::Released {
                service,
                ip,
                hold,
                reason,
            } => {
                metrics
                    .endpoint_warmup_releases
                    .get_or_create(&ReasonLabel {
                        reason: reason.as_str(),
                    })
                    .inc();
                tracing::info!(
                    service = %service,
                    endpoint = %ip,
                    reason = reason.as_str(),
                    "endpoint's warm-up hold ended"
                );
                log.emit(
                    "endpoint_released",
                    json!({
                        "service": service.to_string(),
                        "ip": ip.to_string(),
                        "reason": reason.as_str(),
                        "ready_since_unix_ms": hold.ready_since.0,
                        "release_unix_ms": hold.release.0,
                        "held_ms": now.since(hold.ready_since).as_millis() as u64,
                    }),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_release_is_due_at_its_instant_not_a_millisecond_before() {
        let clock = WarmupClock::start();
        let release = clock.moment(Instant::now()).after(std::time::Duration::from_millis(1000));
        let at = clock.instant(release);
        assert_eq!(clock.moment(at), release);
        assert!(clock.moment(at - std::time::Duration::from_micros(1)) < release);
    }
}
