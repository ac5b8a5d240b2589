//! Hostile and broken manifests: parsing never panics, and a valid object beside a
//! broken one is never lost. Names Kubernetes would reject never get past ingestion.

use kproxy_core::ClusterState;
use kproxy_core::ingest::Ownership;
use kproxy_core::manifest;
use proptest::prelude::*;

const VALID: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: good\n  namespace: ok\nspec:\n  clusterIP: 10.96.0.1\n  ports:\n  - port: 80\n";

const SLICE: &str = "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: good-x\n  namespace: ok\n  labels:\n    kubernetes.io/service-name: good\naddressType: IPv4\nports:\n- {name: '', port: 8080}\nendpoints:\n- addresses: [10.244.0.1]\n  nodeName: n1\n";

fn load(text: &str, file: &str) -> ClusterState {
    let parsed = manifest::parse(file, text);
    let mut st = ClusterState::new();
    for o in &parsed.objects {
        let _ = st.apply(&o.object, &Ownership::default(), "n1");
    }
    st
}

fn good_is_there(st: &ClusterState) -> bool {
    st.services().any(|s| s.name.to_string() == "ok/good")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_never_panics(s in "\\PC{0,400}") {
        let _ = manifest::parse("x.yaml", &s);
        let _ = manifest::parse("x.json", &s);
    }

    #[test]
    fn a_truncated_neighbour_never_costs_the_valid_object(cut in 0usize..SLICE.len(), before in any::<bool>()) {
        let broken = &SLICE[..cut];
        let text = if before { format!("{broken}\n---\n{VALID}") } else { format!("{VALID}---\n{broken}\n") };
        let st = load(&text, "x.yaml");
        prop_assert!(good_is_there(&st), "lost the valid Service next to:\n{broken}");
    }

    #[test]
    fn garbage_neighbour_never_costs_the_valid_object(garbage in "[ -~\\n:{}\\[\\]'\"&*!|>%@`-]{0,200}") {
        let text = format!("{VALID}---\n{garbage}\n");
        let st = load(&text, "x.yaml");
        prop_assert!(good_is_there(&st));
    }

    #[test]
    fn hostile_names_are_rejected_at_ingestion(name in "[a-z]{0,3}[^a-z0-9-]{1,3}[a-z]{0,3}") {
        let text = VALID.replace("name: good", &format!("name: {:?}", name));
        let st = load(&text, "x.yaml");
        prop_assert_eq!(st.service_count(), 0, "accepted {:?}", name);
    }
}

#[test]
fn yaml_alias_bombs_do_not_explode() {
    let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x, x]\n");
    let mut prev = 'a';
    for c in 'b'..='k' {
        text.push_str(&format!("{c}: &{c} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
        prev = c;
    }
    text.push_str(&format!("---\n{VALID}"));
    let st = load(&text, "bomb.yaml");
    assert!(good_is_there(&st));
}
