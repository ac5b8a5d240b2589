//! The times of a warm-up hold ([`Hold`], on the daemon's clock as [`Moment`]s): data a
//! plan carries for each held endpoint (`crate::plan`), decided by `crate::warmup`. Apart
//! from both so that the plan's types need nothing of the decision.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A point in time on the planner's caller's clock, in milliseconds since the Unix
/// epoch. The daemon reads its monotonic clock anchored to the wall clock once at start,
/// so a moment never goes back and still reads as a date.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Moment(pub u64);

impl Moment {
    /// `d` later (milliseconds, saturating).
    pub fn after(self, d: Duration) -> Moment {
        let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Moment(self.0.saturating_add(ms))
    }

    /// How long from `earlier` to this moment (zero when `earlier` is later).
    pub fn since(self, earlier: Moment) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

/// RFC 3339 in UTC with milliseconds (`2026-11-28T19:04:05.123Z`).
impl fmt::Display for Moment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (secs, ms) = (self.0 / 1000, self.0 % 1000);
        let (days, rem) = (secs / 86_400, secs % 86_400);
        // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
        let z = days as i64 + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let day = doy - (153 * mp + 2) / 5 + 1;
        let month = if mp < 10 { mp + 3 } else { mp - 9 };
        let year = yoe + era * 400 + i64::from(month <= 2);
        write!(
            f,
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
            rem / 3600,
            rem % 3600 / 60,
            rem % 60
        )
    }
}

/// Why an endpoint is held: when it was first seen ready, and when new connections may
/// go to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Hold {
    /// The plan's `now` when the endpoint was first seen ready.
    pub ready_since: Moment,
    /// `ready_since` + the warm-up: from then on it takes new connections.
    #[serde(rename = "releaseAt")]
    pub release: Moment,
}
