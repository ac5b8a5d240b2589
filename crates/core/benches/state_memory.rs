//! Peak memory of the ClusterState and of its NodePlan at 10k Services × 10
//! endpoints. Run: `cargo bench -p kproxy-core --bench state_memory`.
//! Reads VmRSS from /proc/self/status (Linux), so it measures real allocations.

use kproxy_core::PlanConfig;
use kproxy_core::synthetic::{self, Spec};

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(str::to_string)
        })
        .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn main() {
    // `cargo bench` passes --bench; nothing else to parse.
    let base = rss_kib();
    let spec = Spec::new(10_000, 10);
    let state = synthetic::cluster(&spec);
    let after_state = rss_kib();
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let after_plan = rss_kib();
    println!(
        "state_memory 10000x10: ClusterState {:.1} MiB, NodePlan {:.1} MiB ({} service ports)",
        (after_state - base) as f64 / 1024.0,
        (after_plan - after_state) as f64 / 1024.0,
        plan.service_ports().count()
    );
}
