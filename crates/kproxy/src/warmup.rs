//! The daemon's side of the endpoint warm-up hold (`kproxy_core::warmup` decides it):
//! the clock the planner reads; what a hold that begins or ends tells the event log
//! (`endpoint_held`, `endpoint_released`), the log and the metrics
//! (`kproxy_endpoint_warmup_holds_total`, `kproxy_endpoint_warmup_releases_total`); and
//! the endpoints held now, served as JSON at [`ENDPOINT_WARMUP_PATH`] on the metrics
//! address for `kproxy plan|explain --server`.

use kproxy_core::model::ServiceName;
use kproxy_core::warmup::{Event, Moment};
use serde_json::{Value, json};
use tokio::time::Instant;

use crate::event_log::EventLog;
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

pub use crate::metrics::ENDPOINT_WARMUP_PATH;

/// Lines saying which endpoints of `service` (every Service: `None`) a daemon holds,
/// from its [`ENDPOINT_WARMUP_PATH`] answer; `kproxy plan|explain --server` print them.
pub fn held_lines(answer: &Value, service: Option<&ServiceName>, server: &str) -> String {
    use std::fmt::Write as _;
    let wanted = service.map(ToString::to_string);
    let held: Vec<&Value> = answer
        .get("held")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|h| {
            wanted.is_none() || h.get("service").and_then(Value::as_str) == wanted.as_deref()
        })
        .collect();
    let mut out = format!("endpoints held for warm-up by the running kproxy ({server}):\n");
    if held.is_empty() {
        out.push_str("  none\n");
    }
    let moment = |v: Option<&Value>| {
        v.and_then(Value::as_u64)
            .map(|ms| Moment(ms).to_string())
            .unwrap_or_else(|| "?".into())
    };
    for h in held {
        let s = |k: &str| h.get(k).and_then(Value::as_str).unwrap_or("?");
        let _ = writeln!(
            out,
            "  {} {} {}: no new connection until {} (ready since {})",
            s("servicePort"),
            s("family"),
            s("endpoint"),
            moment(h.get("releaseAt")),
            moment(h.get("readySince")),
        );
    }
    out
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
        let release = clock
            .moment(Instant::now())
            .after(std::time::Duration::from_millis(1000));
        let at = clock.instant(release);
        assert_eq!(clock.moment(at), release);
        assert!(clock.moment(at - std::time::Duration::from_micros(1)) < release);
    }
}
