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
