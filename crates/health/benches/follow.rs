//! What the sync loop hands to health per sync at 10k Services × 10 endpoints after one
//! EndpointSlice change: before `PlanUpdate`, a clone of the whole plan (`Arc::new(plan
//! .clone())`, shared by health's computed and applied slots); now `decide::follow`
//! moving health's two views by the planner's `PlanUpdate`. The re-plan itself is
//! outside both measurements. Run: `cargo bench -p kproxy-health --bench follow`.

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kproxy_core::synthetic::{self, Spec};
use kproxy_core::{PlanConfig, Planner};
use kproxy_health::decide;

fn handover(c: &mut Criterion) {
    let spec = Spec::new(10_000, 10);
    let mut state = synthetic::cluster(&spec);
    let mut planner = Planner::new("node-0", PlanConfig::default());
    let first = planner.update(&mut state);
    let (mut computed, mut applied) = (None, None);
    decide::follow(&mut computed, planner.plan(), &first);
    decide::follow(&mut applied, planner.plan(), &first);
    // Setup (the change and the re-plan) and routine share them: RefCell.
    let world = std::cell::RefCell::new((state, planner, 0usize));
    let changed = || {
        let mut w = world.borrow_mut();
        let (state, planner, generation) = &mut *w;
        *generation += 1;
        // Service 4240 is an eTP-Local LoadBalancer: it has a health check.
        state.upsert_slice(synthetic::slice(&spec, 4240, *generation));
        planner.update(state)
    };
    let mut g = c.benchmark_group("health_handover_one_change_10000x10");
    g.bench_function("whole_plan_clone_before", |b| {
        b.iter_batched(
            changed,
            |_update| std::sync::Arc::new(world.borrow().1.plan().clone()),
            BatchSize::SmallInput,
        )
    });
    g.bench_function("follow_plan_update_now", |b| {
        b.iter_batched(
            changed,
            |update| {
                let w = world.borrow();
                decide::follow(&mut computed, w.1.plan(), &update);
                decide::follow(&mut applied, w.1.plan(), &update);
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, handover);
criterion_main!(benches);
