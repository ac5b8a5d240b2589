//! `network_programming_duration_seconds` ([`ProgrammingLatency`]): from each
//! EndpointSlice's last-change-trigger-time to the end of the sync that programmed it,
//! the loop's observer of how long a change took to reach the kernel.

use std::collections::HashMap;

use crate::metrics::Metrics;

/// `network_programming_duration_seconds`: for each EndpointSlice whose
/// `endpoints.kubernetes.io/last-change-trigger-time` is new since the last sync, the
/// time from that trigger to the end of the sync that programmed it.
#[derive(Default)]
pub(super) struct ProgrammingLatency {
    seen: HashMap<(String, String), String>,
    /// The first sync only records: trigger times from before kproxy started would
    /// measure kproxy's downtime, not programming latency.
    primed: bool,
}

impl ProgrammingLatency {
    pub(super) fn observe(
        &mut self,
        metrics: &Metrics,
        state: &kproxy_core::ClusterState,
        changed: &[kproxy_core::model::ServiceName],
    ) {
        let now = jiff::Timestamp::now();
        for name in changed {
            for slice in state.slices_of(name) {
                let Some(t) = slice.last_change_trigger_time.as_deref() else {
                    continue;
                };
                let key = (name.namespace.to_string(), slice.name.clone());
                if self.seen.get(&key).is_some_and(|old| old == t) {
                    continue;
                }
                self.seen.insert(key, t.to_string());
                if !self.primed {
                    continue;
                }
                if let Ok(ts) = t.parse::<jiff::Timestamp>() {
                    let secs = now.duration_since(ts).as_secs_f64();
                    if secs >= 0.0 {
                        metrics.network_programming.observe(secs);
                    }
                }
            }
        }
        self.primed = true;
        if self.seen.len() > 4 * state.slice_count() + 1024 {
            self.seen.clear();
        }
    }
}
