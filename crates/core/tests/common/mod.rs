//! What the core's integration tests share: Kubernetes YAML through the real
//! manifest → ingest path into a [`ClusterState`], as node-a sees it.

// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use kproxy_core::ClusterState;
use kproxy_core::ingest::Ownership;
use kproxy_core::manifest;

/// Applies every object of the YAML `text` to `st` as node-a's ingest does. The text
/// must parse whole and every object must be valid: a test's input is never partly read.
pub fn apply_yaml(st: &mut ClusterState, text: &str) {
    let parsed = manifest::parse("t.yaml", text);
    assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
    for o in &parsed.objects {
        st.apply(&o.object, &Ownership::default(), "node-a")
            .expect("valid object");
    }
}

/// The state of the YAML `text` alone (see [`apply_yaml`]).
pub fn state_of_yaml(text: &str) -> ClusterState {
    let mut st = ClusterState::new();
    apply_yaml(&mut st, text);
    st
}
