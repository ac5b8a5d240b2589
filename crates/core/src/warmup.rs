//! The endpoint warm-up hold (issue 49). A pod without a readiness probe is Ready when
//! its container runs, often before its server listens (68–463 ms on a loaded node), and
//! a proxy that programs it at once sends new connections into a closed port. So an
//! endpoint that becomes ready after the planner's first complete view of the cluster
//! (new, or not ready → ready) is held for [`crate::PlanConfig::endpoint_warmup`] before
//! new connections go to it, counting as not ready meanwhile: a Service whose other
//! endpoints are terminating keeps its serving-terminating fallback.
//!
//! No hold where it would leave a list that had an endpoint empty (the Cluster or the
//! Local list of one port of one family): a hold must never turn a connection into a
//! reject or a drop. An endpoint once sent traffic (its hold released, or never held)
//! is not held again until it stops being ready. Removals and ready → not ready stay
//! immediate (they are not holds). Endpoints the first plan sees are never held: a
//! restarted kproxy adopting a running cluster holds nothing.
//!
//! Pure: the caller gives the time ([`Clock`]). When an endpoint was first seen ready is
//! kept in the planner's previous plan of its Service (each held endpoint's [`Hold`]),
//! the one store of it: a hold lives exactly as long as the plan that shows it.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use serde::Serialize;

use crate::categorize::{Categorized, Context, categorize};
use crate::model::ServiceName;
use crate::plan::{EndpointState, ServicePlan, ServicePortPlan};

pub use crate::hold::{Hold, Moment};

/// What deciding holds needs besides the endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Clock {
    pub now: Moment,
    /// The warm-up ([`crate::PlanConfig::endpoint_warmup`]); zero: no hold.
    pub period: Duration,
    /// The planner has made its first complete plan: an endpoint seen ready from now on
    /// is new.
    pub primed: bool,
}

impl Clock {
    /// No hold: a plan from scratch, which is a first view of the cluster.
    pub const OFF: Clock = Clock {
        now: Moment(0),
        period: Duration::ZERO,
        primed: false,
    };

    pub(crate) fn holds(&self) -> bool {
        self.primed && !self.period.is_zero()
    }
}

/// Decides which of one port's endpoints are held (`endpoints` sorted by address,
/// `before` the same port's plan before this one) and categorises them.
pub(crate) fn hold_and_categorize(
    endpoints: &mut [EndpointState],
    before: Option<&ServicePortPlan>,
    clock: &Clock,
    ctx: &Context,
) -> Categorized {
    if !clock.holds() {
        return categorize(endpoints, ctx);
    }
    let mut any = false;
    for e in endpoints.iter_mut() {
        e.warmup = candidate(e, before, clock).map(Box::new);
        any |= e.warmup.is_some();
    }
    if !any {
        return categorize(endpoints, ctx);
    }
    let held = categorize(endpoints, ctx);
    let holds: Vec<Option<Box<Hold>>> = endpoints.iter_mut().map(|e| e.warmup.take()).collect();
    let unheld = categorize(endpoints, ctx);
    if empties(&held.cluster, &unheld.cluster) || empties(&held.local, &unheld.local) {
        // The held endpoints are the only ones this traffic has: they take it now.
        return unheld;
    }
    for (e, h) in endpoints.iter_mut().zip(holds) {
        e.warmup = h;
    }
    held
}

/// The hold `e` would have: a new one when it has just become ready, the one it had
/// until its release, none once it took traffic.
fn candidate(e: &EndpointState, before: Option<&ServicePortPlan>, clock: &Clock) -> Option<Hold> {
    if !e.conditions.ready || e.conditions.terminating {
        return None;
    }
    match before.and_then(|p| p.endpoint(e.addr)) {
        Some(was) if was.conditions.ready => was
            .warmup
            .as_deref()
            .copied()
            .filter(|h| h.release > clock.now),
        _ => Some(Hold {
            ready_since: clock.now,
            release: clock.now.after(clock.period),
        }),
    }
}

/// A list that had endpoints and would have none.
fn empties<T>(held: &Option<Vec<T>>, unheld: &Option<Vec<T>>) -> bool {
    held.as_ref().is_some_and(Vec::is_empty) && unheld.as_ref().is_some_and(|l| !l.is_empty())
}

/// The endpoints one Service's plan holds, by IP (a pod's ports are held together), and
/// the earliest release among them.
pub fn holds(plan: &ServicePlan) -> BTreeMap<IpAddr, Hold> {
    let mut out = BTreeMap::new();
    for e in plan.ports.iter().flat_map(|p| &p.endpoints) {
        if let Some(h) = e.warmup.as_deref() {
            out.entry(e.addr.ip).or_insert(*h);
        }
    }
    out
}

/// The earliest release of a Service plan's holds.
pub fn next_release(plan: &ServicePlan) -> Option<Moment> {
    plan.ports
        .iter()
        .flat_map(|p| &p.endpoints)
        .filter_map(|e| e.warmup.as_ref().map(|h| h.release))
        .min()
}

/// Why a hold ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReleaseReason {
    /// The warm-up elapsed.
    Elapsed,
    /// Holding it any longer would leave its traffic no endpoint (the others went).
    Needed,
    /// It is no longer ready, or gone (or its Service is).
    Gone,
}

impl ReleaseReason {
    pub const ALL: [ReleaseReason; 3] = [
        ReleaseReason::Elapsed,
        ReleaseReason::Needed,
        ReleaseReason::Gone,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ReleaseReason::Elapsed => "elapsed",
            ReleaseReason::Needed => "needed",
            ReleaseReason::Gone => "gone",
        }
    }
}

/// A hold that began or ended in one re-plan (the event log's `endpoint_held` and
/// `endpoint_released`, the holds metric).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Held {
        service: ServiceName,
        ip: IpAddr,
        hold: Hold,
    },
    Released {
        service: ServiceName,
        ip: IpAddr,
        hold: Hold,
        reason: ReleaseReason,
    },
}

/// What changed in one Service's holds from `before` to `after` (its plans), at `now`.
pub fn events(
    service: &ServiceName,
    before: Option<&ServicePlan>,
    after: Option<&ServicePlan>,
    now: Moment,
    out: &mut Vec<Event>,
) {
    let old = before.map(holds).unwrap_or_default();
    let new = after.map(holds).unwrap_or_default();
    for (ip, hold) in &new {
        if !old.contains_key(ip) {
            out.push(Event::Held {
                service: service.clone(),
                ip: *ip,
                hold: *hold,
            });
        }
    }
    for (ip, hold) in old {
        if new.contains_key(&ip) {
            continue;
        }
        let ready = after.is_some_and(|p| {
            p.ports
                .iter()
                .flat_map(|p| &p.endpoints)
                .any(|e| e.addr.ip == ip && e.conditions.ready && !e.conditions.terminating)
        });
        let reason = if !ready {
            ReleaseReason::Gone
        } else if hold.release <= now {
            ReleaseReason::Elapsed
        } else {
            ReleaseReason::Needed
        };
        out.push(Event::Released {
            service: service.clone(),
            ip,
            hold,
            reason,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn moments_read_as_utc_dates() {
        assert_eq!(Moment(0).to_string(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            Moment(1_795_892_645_123).to_string(),
            "2026-11-28T19:04:05.123Z"
        );
        assert_eq!(
            Moment(951_782_400_000).to_string(),
            "2000-02-29T00:00:00.000Z"
        );
        assert_eq!(Moment(5).after(Duration::from_secs(1)), Moment(1005));
        assert_eq!(Moment(5).since(Moment(9)), Duration::ZERO);
    }
}
