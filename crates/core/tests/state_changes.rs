//! What a `ClusterState` counts as changed (its change events), on synthetic clusters:
//! objects, not Services, and a relist only what differs.

use kproxy_core::synthetic::{self, Spec};

#[test]
fn change_events_count_objects_not_services() {
    let spec = Spec::new(3, 2);
    let mut state = synthetic::cluster(&spec);
    let first = state.take_changes();
    assert_eq!((first.service_events, first.slice_events), (3, 3));

    state.upsert_slice(synthetic::slice(&spec, 1, 4));
    state.upsert_slice(synthetic::slice(&spec, 1, 4)); // identical: no event
    state.delete_service(&synthetic::service(&spec, 2).name);
    let c = state.take_changes();
    assert_eq!(
        (c.service_events, c.slice_events, c.services.len()),
        (1, 1, 2)
    );

    // A relist counts only what differs.
    let mut relisted = synthetic::cluster(&spec);
    relisted.upsert_slice(synthetic::slice(&spec, 0, 6));
    state.replace(relisted);
    let c = state.take_changes();
    assert_eq!(
        (c.service_events, c.slice_events),
        (1, 2),
        "service 2 back; slices 0 and 1 differ"
    );
}

/// Which changes re-plan every Service: the first plan, a Node change, a config change;
/// never an endpoint change, the first one after the first plan included (the config
/// flag once outlived the first plan and made that change a whole re-plan).
#[test]
fn only_the_first_plan_and_node_changes_re_plan_every_service() {
    use kproxy_core::planner::Planner;
    let spec = Spec::new(20, 2);
    let mut state = synthetic::cluster(&spec);
    let mut planner = Planner::new("node-0", kproxy_core::PlanConfig::default());
    type Change<'a> = &'a dyn Fn(&mut kproxy_core::state::ClusterState);
    // (step, what it changes, whole re-plans after it)
    let steps: [(&str, Change, u64); 4] = [
        ("the first plan", &|_| {}, 1),
        (
            "an endpoint change",
            &|s| {
                s.upsert_slice(synthetic::slice(&spec, 3, 1));
            },
            1,
        ),
        (
            "another endpoint change",
            &|s| {
                s.upsert_slice(synthetic::slice(&spec, 4, 1));
            },
            1,
        ),
        (
            "the Node changes",
            &|s| {
                s.set_node(None);
            },
            2,
        ),
    ];
    for (step, change, whole) in steps {
        change(&mut state);
        planner.update(&mut state);
        assert_eq!(planner.whole_plans(), whole, "{step}");
    }
}
