//! Peak memory of the ClusterState and of its NodePlan at 10k Services × 10
//! endpoints. Run: `cargo bench -p kproxy-core --bench state_memory`.
//! Reads VmRSS from /proc/self/status (Linux), so it measures real allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use kproxy_core::PlanConfig;
use kproxy_core::synthetic::{self, Spec};

/// Counts live heap bytes, so the figures separate what the structures hold from what
/// the allocator keeps.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live_mib() -> f64 {
    LIVE.load(Ordering::Relaxed) as f64 / (1024.0 * 1024.0)
}

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
    let (base, live_base) = (rss_kib(), live_mib());
    let spec = Spec::new(10_000, 10);
    let state = synthetic::cluster(&spec);
    let (after_state, live_state) = (rss_kib(), live_mib());
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let (after_plan, live_plan) = (rss_kib(), live_mib());
    println!(
        "state_memory 10000x10: ClusterState {:.1} MiB RSS ({:.1} MiB live), \
         NodePlan {:.1} MiB RSS ({:.1} MiB live) ({} service ports)",
        (after_state - base) as f64 / 1024.0,
        live_state - live_base,
        (after_plan - after_state) as f64 / 1024.0,
        live_plan - live_state,
        plan.service_ports().count()
    );
}
