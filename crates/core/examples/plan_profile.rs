//! Plans a synthetic 2k × 10 cluster five times: a target for profilers
//! (`valgrind --tool=callgrind target/release/examples/plan_profile`).
fn main() {
    let spec = kproxy_core::synthetic::Spec::new(2_000, 10);
    let state = kproxy_core::synthetic::cluster(&spec);
    let cfg = kproxy_core::PlanConfig::default();
    let mut n = 0;
    for _ in 0..5 {
        n += kproxy_core::plan(&state, "node-0", &cfg).services.len();
    }
    println!("{n}");
}
