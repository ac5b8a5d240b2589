//! Planner benchmarks: a full plan at 1k and 10k Services × 10 endpoints, and an
//! incremental re-plan after one EndpointSlice change at 10k (targets: full
//! ≤ 50 ms, one change ≤ 50 µs). Run: `cargo bench -p kproxy-core --bench plan`.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kproxy_core::synthetic::{self, Spec};
use kproxy_core::{PlanConfig, Planner};

fn full_plan(c: &mut Criterion) {
    let mut g = c.benchmark_group("plan_full");
    g.sample_size(20);
    for n in [1_000, 10_000] {
        let spec = Spec::new(n, 10);
        let state = synthetic::cluster(&spec);
        let cfg = PlanConfig::default();
        g.bench_function(format!("{n}x10"), |b| {
            b.iter_with_large_drop(|| kproxy_core::plan(&state, "node-0", &cfg))
        });
    }
    g.finish();
}

fn one_change(c: &mut Criterion) {
    let spec = Spec::new(10_000, 10);
    let mut state = synthetic::cluster(&spec);
    let mut planner = Planner::new("node-0", PlanConfig::default());
    planner.update(&mut state);
    let mut generation = 0;
    c.bench_function("replan_one_slice_change_10000x10", |b| {
        b.iter_batched(
            || {
                generation += 1;
                synthetic::slice(&spec, 4242, generation)
            },
            |slice| {
                state.upsert_slice(slice);
                let update = planner.update(&mut state);
                assert_eq!(update.services.len(), 1);
            },
            BatchSize::SmallInput,
        )
    });
}

criterion_group!(benches, full_plan, one_change);
criterion_main!(benches);
