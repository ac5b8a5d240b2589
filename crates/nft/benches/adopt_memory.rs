//! Heap of a restart that adopts kproxy's tables, beside a cold first sync, at 10k
//! Services × 10 endpoints (or the sizes given): what `kproxy run` holds at its peak
//! when it starts on a node whose tables are already programmed. Run (root: a throwaway
//! network namespace): `cargo bench -p kproxy-nft --bench adopt_memory [-- 10000x10]`.
//!
//! Each figure is the peak heap above what was live before the sync (the plan), through
//! the counting allocator of `crates/core/benches/support/memory.rs`; the Dataplane and
//! its records are part of it, as they are of the process.

mod common;
#[allow(dead_code, reason = "this bench reads the heap counters, not VmRSS")]
#[path = "../../core/benches/support/memory.rs"]
mod memory;

use kproxy_core::PlanConfig;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::synthetic::{self, Spec};
use kproxy_nft::{Dataplane, DataplaneConfig};

use memory::{live, mib, peak, reset_peak};

/// Peak heap above the live bytes while one new Dataplane syncs `plan`, and what it
/// keeps afterwards.
fn first_sync(cfg: &DataplaneConfig, plan: &kproxy_core::NodePlan) -> (f64, f64, Dataplane, bool) {
    let base = live();
    reset_peak();
    let mut dp = Dataplane::new(cfg.clone()).expect("config");
    let r = dp.sync(plan, &PlanUpdate::WHOLE).expect("sync");
    let kept = live().saturating_sub(base);
    (mib(peak().saturating_sub(base)), mib(kept), dp, r.adopted)
}

fn run(services: usize, eps: usize) {
    let spec = Spec::new(services, eps);
    let state = synthetic::cluster(&spec);
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let cfg = DataplaneConfig::default();
    kproxy_nft::cleanup(&cfg).expect("cleanup");
    let (cold, cold_kept, dp, adopted) = first_sync(&cfg, &plan);
    assert!(!adopted, "the first sync finds no tables");
    drop(dp);
    let (restart, restart_kept, dp, adopted) = first_sync(&cfg, &plan);
    assert!(adopted, "the restart adopts the tables");
    drop(dp);
    println!(
        "adopt_memory {services}x{eps}: first sync's peak heap above the plan: cold \
         {cold:.1} MiB (kept {cold_kept:.1}), restart adopting {restart:.1} MiB (kept \
         {restart_kept:.1})"
    );
    kproxy_nft::cleanup(&cfg).expect("cleanup");
}

fn main() {
    let sizes = common::sizes(&[(10000, 10)]);
    common::in_throwaway_netns("kpnadopt", move || {
        for (s, e) in sizes {
            run(s, e);
        }
    });
}
