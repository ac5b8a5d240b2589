//! When the sync loop may start its next sync: [`Pacer`].
//!
//! Upstream kube-proxy spaces syncs at least minSyncPeriod (default 1 s) apart, from the
//! end of one to the start of the next (`pkg/proxy/runner`), because its syncs take
//! seconds at scale. kproxy's take milliseconds, so a lone change waiting out a second
//! is a second of traffic sent to a pod that is gone. Two policies:
//!
//! - [`Pacing::Bucket`], kproxy's default (minSyncPeriod not set): a token bucket. A
//!   change that finds a token syncs at once; a storm drains the bucket, after which
//!   syncs start at most once per `interval` and every change arriving meanwhile joins
//!   the next one. Worst case for a change: the sync running when it arrived, then
//!   `interval`, then its own sync.
//! - [`Pacing::MinSyncPeriod`], when an operator sets minSyncPeriod: upstream's rule,
//!   so they get at least the spacing they asked for.
//!
//! Time is `tokio::time::Instant` so the sync loop's tests run under paused time. A
//! hand-written bucket rather than a rate-limiting crate (governor) for that reason:
//! the crate keeps its own clock, which paused time cannot drive.

use std::time::Duration;

use tokio::time::Instant;

/// The least pause after a comparison that lost notifications alone prompted and that
/// found kproxy's tables equal to its record, before the next such comparison.
pub const LOST_COMPARISON_FLOOR: Duration = Duration::from_millis(100);

/// The longest such pause (the kernel watch's longest backoff).
pub const LOST_COMPARISON_CEILING: Duration = Duration::from_secs(30);

/// How long the kernel watch waits, after a comparison prompted by lost notifications
/// alone found nothing to repair, before another one prompted the same way: nine times
/// what that comparison took, so endless losses (other tables' churn overrunning the
/// receive buffer) cost at most a tenth of a core in read-backs (0.2–0.4 s each at 10k
/// Services × 10 endpoints), within [`LOST_COMPARISON_FLOOR`] and
/// [`LOST_COMPARISON_CEILING`]. A change read as another process's is not held by this
/// (`crate::kernel_watch`).
pub fn lost_comparison_pause(took: Duration) -> Duration {
    took.saturating_mul(9)
        .clamp(LOST_COMPARISON_FLOOR, LOST_COMPARISON_CEILING)
}

/// How syncs are spaced (docs/config.md, "Sync pacing").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pacing {
    /// Up to `burst` syncs back to back, then one per `interval`.
    Bucket { burst: u32, interval: Duration },
    /// At least this long from the end of one sync to the start of the next.
    MinSyncPeriod(Duration),
}

impl Pacing {
    /// kproxy's default: 4 syncs at once, then at most 50 a second. At 10k Services a
    /// sync of a few changed Services costs 0.4–2 ms (BENCHMARKS.md), so a storm costs at
    /// most ~10 % of a core, and no change waits more than 20 ms for its turn.
    pub const DEFAULT: Pacing = Pacing::Bucket {
        burst: 4,
        interval: Duration::from_millis(20),
    };

    /// The pacing for a configured minSyncPeriod (`None`: not set).
    pub fn for_min_sync_period(min_sync_period: Option<Duration>) -> Pacing {
        match min_sync_period {
            Some(d) => Pacing::MinSyncPeriod(d),
            None => Pacing::DEFAULT,
        }
    }

    /// The base of the retry backoff after a failed sync.
    pub fn retry_base(self) -> Duration {
        let floor = Duration::from_millis(100);
        match self {
            Pacing::Bucket { .. } => floor,
            Pacing::MinSyncPeriod(d) => d.max(floor),
        }
    }
}

/// Follows the syncs of one loop and says when the next may start.
#[derive(Debug)]
pub struct Pacer {
    pacing: Pacing,
    /// Bucket: tokens as of `refilled`.
    tokens: f64,
    refilled: Option<Instant>,
    /// MinSyncPeriod: when the last sync ended.
    last_end: Option<Instant>,
}

impl Pacer {
    pub fn new(pacing: Pacing) -> Pacer {
        let tokens = match pacing {
            Pacing::Bucket { burst, .. } => f64::from(burst.max(1)),
            Pacing::MinSyncPeriod(_) => 0.0,
        };
        Pacer {
            pacing,
            tokens,
            refilled: None,
            last_end: None,
        }
    }

    fn refill(&mut self, now: Instant) {
        let Pacing::Bucket { burst, interval } = self.pacing else {
            return;
        };
        if let Some(at) = self.refilled {
            let earned = if interval.is_zero() {
                f64::INFINITY
            } else {
                now.saturating_duration_since(at).as_secs_f64() / interval.as_secs_f64()
            };
            self.tokens = (self.tokens + earned).min(f64::from(burst.max(1)));
        }
        self.refilled = Some(now);
    }

    /// The earliest instant the next sync may start (`now` or later).
    pub fn earliest(&mut self, now: Instant) -> Instant {
        match self.pacing {
            Pacing::Bucket { interval, .. } => {
                self.refill(now);
                if self.tokens >= 1.0 {
                    now
                } else {
                    now + interval.mul_f64(1.0 - self.tokens)
                }
            }
            Pacing::MinSyncPeriod(d) => self.last_end.map_or(now, |end| (end + d).max(now)),
        }
    }

    /// A sync starts at `now`.
    pub fn started(&mut self, now: Instant) {
        self.refill(now);
        // A sync that started early (the first, or one forced by syncPeriod) may
        // leave the bucket below zero; the deficit delays the next one.
        self.tokens -= 1.0;
    }

    /// The sync that started last ended at `now`.
    pub fn ended(&mut self, now: Instant) {
        self.last_end = Some(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comparisons_after_lost_notifications_take_at_most_a_tenth_of_the_time() {
        for (took_ms, pause_ms) in [
            (0, 100),
            (1, 100),
            (11, 100),
            (12, 108),
            (300, 2_700),
            (3_000, 27_000),
            (10_000, 30_000),
        ] {
            assert_eq!(
                lost_comparison_pause(Duration::from_millis(took_ms)),
                Duration::from_millis(pause_ms),
                "took {took_ms} ms"
            );
        }
    }

    const MS: Duration = Duration::from_millis(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Runs syncs that take `took` each, for changes arriving at `arrivals` (ms from
    /// the start), the way the sync loop does: a change waits for the running sync,
    /// then for `earliest`, then rides the next sync with every change that arrived
    /// meanwhile. Returns each change's wait from arrival to the end of its sync (ms).
    fn waits(pacing: Pacing, arrivals: &[u64], took: u64) -> Vec<u64> {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(pacing);
        let mut waits = Vec::new();
        let mut free_at = t0; // the loop is idle from here
        let mut i = 0;
        while i < arrivals.len() {
            let first = t0 + ms(arrivals[i]);
            let ready = first.max(free_at);
            let start = pacer.earliest(ready);
            pacer.started(start);
            let end = start + ms(took);
            pacer.ended(end);
            // Every change that arrived before the sync started rides it.
            while i < arrivals.len() && t0 + ms(arrivals[i]) <= start {
                waits.push((end - (t0 + ms(arrivals[i]))).as_millis() as u64);
                i += 1;
            }
            free_at = end;
        }
        waits
    }

    #[test]
    fn a_lone_change_syncs_at_once_with_the_default_and_waits_out_a_min_sync_period() {
        // Flips every 300 ms: each change is alone.
        let flips: Vec<u64> = (0..10).map(|i| 1000 + i * 300).collect();
        assert!(waits(Pacing::DEFAULT, &flips, 2).iter().all(|w| *w == 2));
        // Upstream's rule with minSyncPeriod 1 s: after the first, changes wait for the
        // next sync a second after the last, up to the whole period.
        let upstream = waits(Pacing::MinSyncPeriod(Duration::from_secs(1)), &flips, 2);
        assert_eq!(upstream[0], 2);
        assert!(upstream[1..].iter().all(|w| *w > 100), "{upstream:?}");
        assert!(upstream.iter().all(|w| *w <= 2 + 1000 + 2), "{upstream:?}");
    }

    #[test]
    fn a_storm_is_coalesced_and_no_change_waits_more_than_the_stated_bound() {
        // 100 changes a second for 10 s, then 1,000 a second for 1 s.
        let mut arrivals: Vec<u64> = (0..1000).map(|i| i * 10).collect();
        arrivals.extend((0..1000).map(|i| 10_000 + i));
        let took = 2;
        let w = waits(Pacing::DEFAULT, &arrivals, took);
        assert_eq!(w.len(), arrivals.len());
        let Pacing::Bucket { interval, .. } = Pacing::DEFAULT else {
            unreachable!()
        };
        let bound = took + interval.as_millis() as u64 + took;
        assert!(w.iter().all(|x| *x <= bound), "max {:?}", w.iter().max());
        // Coalesced: at most one sync start per interval after the burst.
        let mut pacer = Pacer::new(Pacing::DEFAULT);
        let t0 = Instant::now();
        let mut starts = 0;
        let mut t = t0;
        while t < t0 + Duration::from_secs(1) {
            if pacer.earliest(t) == t {
                pacer.started(t);
                starts += 1;
            }
            t += MS;
        }
        assert!(starts <= 4 + 50, "{starts} syncs in one second");
    }

    #[test]
    fn min_sync_period_counts_from_the_end_of_the_last_sync() {
        let t0 = Instant::now();
        let mut p = Pacer::new(Pacing::MinSyncPeriod(Duration::from_secs(1)));
        assert_eq!(p.earliest(t0), t0, "the first sync is not delayed");
        p.started(t0);
        p.ended(t0 + ms(300));
        assert_eq!(p.earliest(t0 + ms(400)), t0 + ms(1300));
        assert_eq!(p.earliest(t0 + ms(2000)), t0 + ms(2000));
        let mut zero = Pacer::new(Pacing::MinSyncPeriod(Duration::ZERO));
        zero.started(t0);
        zero.ended(t0);
        assert_eq!(zero.earliest(t0), t0, "0s: no minimum");
    }

    #[test]
    fn the_retry_base_is_at_least_100ms_and_at_least_min_sync_period() {
        assert_eq!(Pacing::DEFAULT.retry_base(), ms(100));
        assert_eq!(Pacing::MinSyncPeriod(MS).retry_base(), ms(100));
        assert_eq!(
            Pacing::MinSyncPeriod(Duration::from_secs(2)).retry_base(),
            Duration::from_secs(2)
        );
    }
}
