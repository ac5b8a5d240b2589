//! The planner's first endpoint change after its first plan, beside the next ones, at
//! 10k Services × 10 endpoints: the first once re-planned every Service (a config flag
//! outlived the first plan). `cargo run --release -p kproxy-core --example first_change`
#![expect(clippy::disallowed_types, reason = "a measurement: wall time")]

use std::time::Instant;

fn main() {
    let spec = kproxy_core::synthetic::Spec::new(10_000, 10);
    let mut state = kproxy_core::synthetic::cluster(&spec);
    let mut planner =
        kproxy_core::planner::Planner::new("node-0", kproxy_core::PlanConfig::default());
    let t = Instant::now();
    planner.update(&mut state);
    println!("first plan: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    for generation in 1..4 {
        state.upsert_slice(kproxy_core::synthetic::slice(&spec, 7, generation));
        let t = Instant::now();
        planner.update(&mut state);
        println!(
            "endpoint change {generation}: {:.3} ms (whole re-plans so far: {})",
            t.elapsed().as_secs_f64() * 1e3,
            planner.whole_plans()
        );
    }
}
