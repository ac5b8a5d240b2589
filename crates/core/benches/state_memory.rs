//! Memory of the ClusterState and of its NodePlan at 10k Services × 10 endpoints (or
//! the `SERVICESxENDPOINTS` given), as live heap and as RSS growth
//! (`support/memory.rs`). Run: `cargo bench -p kproxy-core --bench state_memory
//! [-- 44000x1]`.

#[path = "support/memory.rs"]
mod memory;

use kproxy_core::PlanConfig;
use kproxy_core::synthetic::{self, Spec};

use memory::{live, mib, peak, reset_peak, rss_kib};

fn main() {
    // `cargo bench` passes --bench; a scale may follow.
    let (services, eps) = std::env::args()
        .skip(1)
        .find_map(|a| {
            let (s, e) = a.split_once('x')?;
            Some((s.parse().ok()?, e.parse().ok()?))
        })
        .unwrap_or((10_000, 10));
    let (base, live_base) = (rss_kib(), live());
    let spec = Spec::new(services, eps);
    let state = synthetic::cluster(&spec);
    let (after_state, live_state) = (rss_kib(), live());
    reset_peak();
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let (after_plan, live_plan, peak_plan) = (rss_kib(), live(), peak());
    println!(
        "state_memory {services}x{eps}: ClusterState {:.1} MiB RSS ({:.1} MiB live), \
         NodePlan {:.1} MiB RSS ({:.1} MiB live, peak while planning {:.1} MiB) \
         ({} service ports)",
        after_state.saturating_sub(base) as f64 / 1024.0,
        mib(live_state - live_base),
        after_plan.saturating_sub(after_state) as f64 / 1024.0,
        mib(live_plan - live_state),
        mib(peak_plan - live_state),
        plan.service_ports().count()
    );
}
