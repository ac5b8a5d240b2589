//! `kproxy run`'s view of the kernel limits that drop Service traffic without any rule
//! changing (kproxy-nft's [`limits`]): once a second, the conntrack table (entries and
//! limit as gauges; the kernel's insertion failures, drops and early drops mirrored as
//! counters), the health servers told whether the table is full (truthful: 503 while
//! it is), and the sysctls kproxy set at start compared with their values now
//! (`kproxy_sysctl_changed{sysctl}`). Each change of state is logged once.

use std::time::Duration;

use kproxy_health::Health;
use kproxy_nft::ConntrackTable;
use prometheus_client::metrics::counter::Counter;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Metrics, SysctlLabel};

const PERIOD: Duration = Duration::from_secs(1);

/// Samples until `stop`; `sysctls` are the settings kproxy set or found set.
pub async fn watch(
    sysctls: Vec<kproxy_config::ConntrackSysctl>,
    health: Health,
    metrics: std::sync::Arc<Metrics>,
    stop: CancellationToken,
) {
    let mut last: Option<ConntrackTable> = None;
    let mut unreadable_logged = false;
    let mut changed: Vec<bool> = vec![false; sysctls.len()];
    let mut tick = tokio::time::interval(PERIOD);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match kproxy_nft::conntrack_table() {
            Ok(now) => {
                observe(last.as_ref(), &now, &metrics);
                if last.is_none_or(|l| l.full() != now.full()) {
                    health.conntrack_full(now.full());
                    if now.full() {
                        tracing::error!(
                            entries = now.entries,
                            max = now.max,
                            "the conntrack table is full: new connections are dropped (nf_conntrack_max)"
                        );
                    } else if last.is_some() {
                        tracing::info!(
                            entries = now.entries,
                            max = now.max,
                            "the conntrack table has room again"
                        );
                    }
                }
                if let Some(l) = last
                    && now.insert_failed > l.insert_failed
                {
                    tracing::warn!(
                        failed = now.insert_failed - l.insert_failed,
                        "conntrack insertions failed in the last second"
                    );
                }
                last = Some(now);
            }
            Err(e) => {
                if !unreadable_logged {
                    tracing::debug!(error = %e, "conntrack statistics not readable (yet)");
                    unreadable_logged = true;
                }
            }
        }
        for (s, was) in sysctls.iter().zip(changed.iter_mut()) {
            let differs = kproxy_nft::read_sysctl(&s.path).is_ok_and(|v| !s.satisfied_by(v));
            if differs != *was {
                *was = differs;
                if differs {
                    tracing::warn!(sysctl = %s.path, want = s.value, "a sysctl kproxy set was changed by someone else");
                }
            }
            metrics
                .sysctl_changed
                .get_or_create(&SysctlLabel {
                    sysctl: s.path.clone(),
                })
                .set(i64::from(differs));
        }
    }
}

/// Moves the metrics from the previous sample `last` to `now`: gauges set, counters
/// mirrored by the kernel's increase (a first sample counts everything since boot).
fn observe(last: Option<&ConntrackTable>, now: &ConntrackTable, m: &Metrics) {
    m.conntrack_entries
        .set(i64::try_from(now.entries).unwrap_or(i64::MAX));
    m.conntrack_max
        .set(i64::try_from(now.max).unwrap_or(i64::MAX));
    let mirror = |c: &Counter, before: Option<u64>, after: u64| {
        c.inc_by(after.saturating_sub(before.unwrap_or(0)));
    };
    mirror(
        &m.conntrack_insert_failed,
        last.map(|l| l.insert_failed),
        now.insert_failed,
    );
    mirror(&m.conntrack_drop, last.map(|l| l.drop), now.drop);
    mirror(
        &m.conntrack_early_drop,
        last.map(|l| l.early_drop),
        now.early_drop,
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn counters_mirror_the_kernels_and_gauges_follow() {
        let mut registry = Registry::default();
        let m = Metrics::register(&mut registry);
        let a = ConntrackTable {
            entries: 5,
            max: 100,
            insert_failed: 7,
            drop: 1,
            early_drop: 0,
        };
        observe(None, &a, &m);
        let b = ConntrackTable {
            entries: 100,
            insert_failed: 9,
            ..a
        };
        observe(Some(&a), &b, &m);
        let text = crate::metrics::encode(&registry);
        for line in [
            "kproxy_conntrack_entries 100",
            "kproxy_conntrack_max 100",
            "kproxy_conntrack_insert_failed_total 9",
            "kproxy_conntrack_drop_total 1",
            "kproxy_conntrack_early_drop_total 0",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(b.full());
    }
}
