//! A bounded fuzz run (proptest corpus) over the manifest decoder and ingestion, run by
//! `cargo test` in CI: mutated bytes of a `kubectl -o yaml|json` List go through the
//! streaming decoder and `Update::of`. Properties: no panic, every error names the file,
//! and a mutation confined to one List item never costs another item.
//! `PROPTEST_CASES=100000 cargo test -p kproxy-core --test fuzz_manifests --release`
//! runs it longer.

use kproxy_core::ingest::Ownership;
use kproxy_core::manifest;
use kproxy_core::state::Update;
use proptest::prelude::*;

fn item(i: usize) -> String {
    format!(
        "- apiVersion: v1\n  kind: Service\n  metadata:\n    name: svc-{i}\n    namespace: ns\n  spec:\n    clusterIP: 10.96.0.{}\n    ports:\n    - name: http\n      port: 80\n      nodePort: {}\n    type: NodePort\n",
        i + 1,
        30000 + i
    )
}

fn list(items: &[String]) -> String {
    format!(
        "apiVersion: v1\nitems:\n{}kind: List\nmetadata: {{}}\n",
        items.concat()
    )
}

/// Decodes and ingests; returns the names of the Services that made it.
fn ingest(file: &str, bytes: &[u8]) -> Vec<String> {
    let mut names = Vec::new();
    manifest::for_each_object(file, bytes, &mut |r| match r {
        Ok(o) => {
            if let Ok((Update::Service(s), _)) = Update::of(&o.object, &Ownership::default(), "n") {
                names.push(s.name.to_string());
            }
        }
        Err(e) => assert_eq!(e.location.file, file, "{e}"),
    });
    names
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn mutated_bytes_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..16),
        json in any::<bool>(),
    ) {
        let text = list(&(0..4).map(item).collect::<Vec<_>>());
        let (file, mut bytes) = if json {
            let (values, _) = manifest::documents("x.yaml", &text);
            let items: Vec<_> = values.into_iter().map(|(_, v)| v).collect();
            ("x.json", serde_json::to_vec(&serde_json::json!({"apiVersion": "v1", "items": items, "kind": "List"})).unwrap())
        } else {
            ("x.yaml", text.into_bytes())
        };
        for (at, b) in edits {
            let i = at.index(bytes.len());
            bytes[i] = b;
        }
        let _ = ingest(file, &bytes);
    }

    #[test]
    fn a_mutation_inside_one_yaml_item_costs_at_most_that_item(
        victim in 0usize..4,
        edits in prop::collection::vec((any::<prop::sample::Index>(), "[ -~]"), 1..6),
    ) {
        let mut items: Vec<String> = (0..4).map(item).collect();
        // Mutate only the item's inner lines (its indentation stays), as a damaged item
        // inside a kubectl dump would be.
        let mut body: Vec<char> = items[victim].chars().collect();
        for (at, c) in edits {
            let i = 2 + at.index(body.len() - 2);
            if body[i] != '\n' && body[i - 1] != '\n' && body[i - 2] != '\n' {
                body[i] = c.chars().next().unwrap();
            }
        }
        items[victim] = body.into_iter().collect();
        let names = ingest("x.yaml", list(&items).as_bytes());
        for i in (0..4).filter(|i| *i != victim) {
            let name = format!("ns/svc-{i}");
            prop_assert!(names.contains(&name), "lost {} after damaging item {}:\n{}", name, victim, items[victim]);
        }
    }
}
