//! The pure fold of watch events into the ClusterState (`source::kube::fold`), driven
//! by tables of events: relists replace one kind in one change, decode failures keep
//! the last good version, readiness needs all three kinds.

use kproxy_core::ClusterState;
use kproxy_core::ingest::{Kind, Ownership};
use kproxy_core::manifest::Object;
use kproxy_source::kube::fold::{self, Change, Folder, Input, Key};
use serde_json::json;

const NODE: &str = "node-a";

fn svc(name: &str, port: u16) -> Object {
    let v = json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": "d"},
                   "spec": {"clusterIP": "10.96.0.10", "ports": [{"port": port}]}});
    Object::Service(Box::new(serde_json::from_value(v).unwrap()))
}

fn slice(name: &str, svc: &str) -> Object {
    let v = json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": name, "namespace": "d", "labels": {"kubernetes.io/service-name": svc}},
                   "addressType": "IPv4", "endpoints": [{"addresses": ["10.244.0.5"]}], "ports": [{"port": 8080}]});
    Object::EndpointSlice(Box::new(serde_json::from_value(v).unwrap()))
}

fn node(name: &str) -> Object {
    let v = json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    Object::Node(Box::new(serde_json::from_value(v).unwrap()))
}

fn key(ns: &str, name: &str) -> Key {
    (ns.to_string(), name.to_string())
}

fn ok(o: Object) -> Result<Object, kproxy_core::ingest::IngestError> {
    Ok(o)
}

fn bad(kind: Kind, name: &str) -> Result<Object, kproxy_core::ingest::IngestError> {
    Err(fold::decode_warning(
        kind,
        &key("d", name),
        ".spec.ports",
        "invalid type",
    ))
}

/// Feeds events, applying each change; returns the number of changes applied.
fn feed(folder: &mut Folder, state: &mut ClusterState, events: Vec<(Kind, Input)>) -> usize {
    let own = Ownership::default();
    let mut n = 0;
    for (kind, input) in events {
        let (change, _) = folder.step(kind, input);
        if let Some(c) = change {
            fold::apply_change(state, c, &own, NODE);
            n += 1;
        }
    }
    n
}

fn services(state: &ClusterState) -> Vec<String> {
    state
        .services()
        .map(|s| format!("{}:{}", s.name.name, s.ports[0].port))
        .collect()
}

fn slices(state: &ClusterState) -> Vec<String> {
    let mut v: Vec<String> = state
        .services_with_slices()
        .flat_map(|n| state.slices_of(n))
        .map(|s| s.name.clone())
        .collect();
    v.sort();
    v
}

fn listed(
    kind: Kind,
    objects: Vec<(&str, Result<Object, kproxy_core::ingest::IngestError>)>,
) -> Vec<(Kind, Input)> {
    let ns = if kind == Kind::Node { "" } else { "d" };
    let mut v = vec![(kind, Input::Init)];
    v.extend(
        objects
            .into_iter()
            .map(|(name, o)| (kind, Input::Listed(key(ns, name), o))),
    );
    v.push((kind, Input::InitDone));
    v
}

fn initial() -> (Folder, ClusterState) {
    let mut folder = Folder::new();
    let mut state = ClusterState::new();
    let mut events = listed(
        Kind::Service,
        vec![("a", ok(svc("a", 80))), ("b", ok(svc("b", 81)))],
    );
    events.extend(listed(
        Kind::EndpointSlice,
        vec![
            ("a-1", ok(slice("a-1", "a"))),
            ("b-1", ok(slice("b-1", "b"))),
        ],
    ));
    events.extend(listed(Kind::Node, vec![(NODE, ok(node(NODE)))]));
    assert_eq!(
        feed(&mut folder, &mut state, events),
        5,
        "a first list: one change per object as it arrives, none at its end"
    );
    (folder, state)
}

/// A kind's first list is applied object by object as it arrives (nothing is planned
/// before every kind is listed, so the state is built while the list streams in) and
/// its end costs nothing; a first list that broke off after applying objects is
/// buffered when it starts again, so that its end drops what only the broken attempt
/// held. A relist is buffered (`a_relist_replaces_one_kind_in_one_change`).
#[test]
fn a_first_list_is_applied_as_it_arrives_and_a_restarted_one_drops_what_it_lost() {
    let mut folder = Folder::new();
    let mut state = ClusterState::new();
    // The first attempt breaks off after a and b.
    let mut first = listed(
        Kind::Service,
        vec![("a", ok(svc("a", 80))), ("b", ok(svc("b", 81)))],
    );
    first.pop();
    assert_eq!(feed(&mut folder, &mut state, first), 2);
    assert_eq!(
        services(&state),
        ["a:80", "b:81"],
        "applied as they arrived"
    );
    assert!(!folder.listed(Kind::Service) && !folder.all_listed());
    // It starts again; b is gone meanwhile, c and a bad d came: buffered now.
    let mut again = listed(
        Kind::Service,
        vec![
            ("a", ok(svc("a", 8080))),
            ("c", ok(svc("c", 82))),
            ("d", bad(Kind::Service, "d")),
        ],
    );
    let done = again.pop().unwrap();
    assert_eq!(feed(&mut folder, &mut state, again), 0);
    assert_eq!(services(&state), ["a:80", "b:81"]);
    assert_eq!(feed(&mut folder, &mut state, vec![done]), 1);
    assert_eq!(
        services(&state),
        ["a:8080", "c:82"],
        "b, held only by the broken attempt, is dropped at the end"
    );
    assert!(folder.listed(Kind::Service));
    // A first list that broke off before any object stays unbuffered.
    let mut slices_first = listed(Kind::EndpointSlice, vec![]);
    slices_first.pop();
    slices_first.extend(listed(
        Kind::EndpointSlice,
        vec![("a-1", ok(slice("a-1", "a")))],
    ));
    assert_eq!(
        feed(&mut folder, &mut state, slices_first),
        1,
        "the object as it arrived, nothing at the end"
    );
    assert_eq!(slices(&state), ["a-1"]);
}

#[test]
fn readiness_needs_all_three_kinds_and_survives_relists() {
    let mut folder = Folder::new();
    let mut state = ClusterState::new();
    for (kind, ready_after) in [
        (Kind::Node, false),
        (Kind::Service, false),
        (Kind::EndpointSlice, true),
    ] {
        feed(&mut folder, &mut state, listed(kind, vec![]));
        assert!(folder.listed(kind));
        assert_eq!(folder.all_listed(), ready_after, "{kind}");
    }
    // A relist in progress does not take readiness back.
    feed(&mut folder, &mut state, vec![(Kind::Service, Input::Init)]);
    assert!(folder.all_listed());
}

#[test]
fn a_relist_replaces_one_kind_in_one_change() {
    let (mut folder, mut state) = initial();
    state.take_changes();
    // Buffered until InitDone: nothing happens to the state before.
    let mut events = listed(
        Kind::Service,
        vec![("a", ok(svc("a", 8080))), ("c", ok(svc("c", 82)))],
    );
    let done = events.pop().unwrap();
    assert_eq!(feed(&mut folder, &mut state, events), 0);
    assert_eq!(services(&state), ["a:80", "b:81"]);
    assert_eq!(feed(&mut folder, &mut state, vec![done]), 1);
    assert_eq!(services(&state), ["a:8080", "c:82"]);
    assert_eq!(slices(&state), ["a-1", "b-1"], "slices are another kind");
    assert!(state.node().is_some());
    let c = state.take_changes();
    assert_eq!(
        (c.service_events, c.slice_events),
        (3, 0),
        "a changed, b removed, c added"
    );
}

#[test]
fn decode_failures_keep_the_last_good_version() {
    let (mut folder, mut state) = initial();
    // A watch event that cannot be decoded: warned, no change.
    let (change, warnings) = folder.step(
        Kind::Service,
        Input::Apply(key("d", "a"), bad(Kind::Service, "a")),
    );
    assert!(change.is_none());
    assert_eq!(
        warnings[0].to_string(),
        "Service d/a: .spec.ports: invalid type"
    );
    // A relist where b cannot be decoded: b keeps its last version, the vanished a goes.
    feed(
        &mut folder,
        &mut state,
        listed(
            Kind::Service,
            vec![("b", bad(Kind::Service, "b")), ("c", ok(svc("c", 82)))],
        ),
    );
    assert_eq!(services(&state), ["b:81", "c:82"]);
}

#[test]
fn deletes_and_the_node() {
    let (mut folder, mut state) = initial();
    let events = vec![
        (Kind::EndpointSlice, Input::Delete(key("d", "a-1"))),
        (Kind::Service, Input::Delete(key("d", "nope"))),
        (Kind::Node, Input::Delete(key("", "other-node"))),
    ];
    feed(&mut folder, &mut state, events);
    assert_eq!(slices(&state), ["b-1"]);
    assert_eq!(services(&state).len(), 2);
    assert!(state.node().is_some(), "another node's delete is ignored");
    // A Node relist without this node: the node is gone, so it stays known but
    // deleted (not eligible), as upstream never turns a deleted Node eligible again.
    feed(&mut folder, &mut state, listed(Kind::Node, vec![]));
    assert!(state.node().is_some_and(|n| n.deleted && !n.eligible()));
    feed(
        &mut folder,
        &mut state,
        vec![(Kind::Node, Input::Apply(key("", NODE), ok(node(NODE))))],
    );
    assert!(
        state.node().is_some_and(|n| n.eligible()),
        "a Node that reappears is applied"
    );
    // A DELETED event: the same; a second one changes nothing.
    state.take_changes();
    let deleted = || vec![(Kind::Node, Input::Delete(key("", NODE)))];
    feed(&mut folder, &mut state, deleted());
    assert!(state.node().is_some_and(|n| n.deleted && n.name == NODE));
    assert!(state.take_changes().node, "the deletion is a Node change");
    feed(&mut folder, &mut state, deleted());
    assert!(!state.take_changes().node, "deleted twice: nothing changes");
}

#[test]
fn rejected_objects_are_reported_by_apply_change() {
    let mut state = ClusterState::new();
    let mut bad_ip = svc("x", 80);
    if let Object::Service(s) = &mut bad_ip {
        s.spec.as_mut().unwrap().cluster_ip = Some("not-an-ip".into());
    }
    let w = fold::apply_change(
        &mut state,
        Change::Apply(bad_ip),
        &Ownership::default(),
        NODE,
    );
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].to_string().starts_with("Service d/x: "), "{}", w[0]);
    assert_eq!(state.service_count(), 0);
}
