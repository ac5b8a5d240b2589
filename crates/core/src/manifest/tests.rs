use super::*;

const GOOD_AND_BAD: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-bad, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.0.0.1], conditions: {ready: maybe}}]
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-good, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
endpoints: [{addresses: [10.0.0.2]}]
ports: [{port: 8080, name: ""}]
"#;

#[test]
fn a_broken_document_is_reported_with_its_field_and_its_neighbours_load() {
    let p = parse("web.yaml", GOOD_AND_BAD);
    assert_eq!(p.objects.len(), 2, "{:?}", p.errors);
    assert_eq!(p.errors.len(), 1);
    let e = &p.errors[0];
    assert_eq!(e.location.document, 1);
    assert_eq!(e.what, "EndpointSlice shop/web-bad");
    assert_eq!(e.field, ".endpoints[0].conditions.ready");
    assert!(
        e.to_string()
            .starts_with("web.yaml: document 1: EndpointSlice shop/web-bad"),
        "{e}"
    );
}

#[test]
fn kind_list_items_are_read() {
    let text = r#"{"apiVersion":"v1","kind":"List","items":[
            {"apiVersion":"v1","kind":"Service","metadata":{"name":"a","namespace":"d"},"spec":{"clusterIP":"10.96.0.1"}},
            {"apiVersion":"v1","kind":"Service","metadata":{"name":"b","namespace":"d"},"spec":{"ports":"nope"}}]}"#;
    let p = parse("x.json", text);
    assert_eq!(p.objects.len(), 1);
    assert_eq!(p.errors[0].location.item, Some(1));
    assert_eq!(p.errors[0].field, ".spec.ports");
}

#[test]
fn unparsable_yaml_document_does_not_hide_the_others() {
    let text = "kind: Service\napiVersion: v1\nmetadata: {name: a, namespace: d}\nspec: {clusterIP: 10.96.0.1}\n---\nkind: [unclosed\n---\nkind: Node\napiVersion: v1\nmetadata: {name: n1}\n";
    let p = parse("x.yaml", text);
    assert_eq!(p.objects.len(), 2, "{:?}", p.errors);
    assert_eq!(p.errors.len(), 1);
}

#[test]
fn document_markers_with_content_comments_and_directives_split_as_yaml_does() {
    let svc = "kind: Service\napiVersion: v1\nmetadata: {name: a, namespace: d}\nspec: {clusterIP: 10.96.0.1}\n";
    let node = "kind: Node\napiVersion: v1\nmetadata: {name: n1}\n";
    let inline = format!(
        "--- # first\n{svc}--- {{kind: Node, apiVersion: v1, metadata: {{name: n2}}}}\n---\n{node}"
    );
    let p = parse("x.yaml", &inline);
    assert_eq!((p.objects.len(), p.errors.len()), (3, 0), "{:?}", p.errors);
    let directive = format!("%YAML 1.2\n---\n{svc}...\n---\n{node}");
    let p = parse("x.yaml", &directive);
    assert_eq!((p.objects.len(), p.errors.len()), (2, 0), "{:?}", p.errors);
    // `----` and `---x` are not markers.
    let p = parse("x.yaml", &format!("{svc}---x: 1\n"));
    assert_eq!(p.objects.len(), 1, "{:?}", p.errors);
}
/// `kubectl get svc,endpointslices -A -o yaml` of `n` Services, as kubectl prints it.
fn kubectl_yaml_list(n: usize) -> String {
    let mut s = String::from("apiVersion: v1\nitems:\n");
    for i in 0..n {
        s.push_str(&format!(
                "- apiVersion: v1\n  kind: Service\n  metadata:\n    name: svc-{i}\n    namespace: ns\n    labels:\n      app: web\n  spec:\n    clusterIP: 10.96.{}.{}\n    ports:\n    - name: http\n      port: 80\n      protocol: TCP\n      targetPort: 8080\n    type: ClusterIP\n  status:\n    loadBalancer: {{}}\n- addressType: IPv4\n  apiVersion: discovery.k8s.io/v1\n  endpoints:\n  - addresses:\n    - 10.244.{}.{}\n    conditions:\n      ready: true\n  kind: EndpointSlice\n  metadata:\n    labels:\n      kubernetes.io/service-name: svc-{i}\n    name: svc-{i}-abcde\n    namespace: ns\n  ports:\n  - name: http\n    port: 8080\n    protocol: TCP\n",
                i / 250, i % 250, i / 250, i % 250
            ));
    }
    s.push_str("kind: List\nmetadata:\n  resourceVersion: \"\"\n");
    s
}

/// 3,000 Services in one `kind: List` exceeded the YAML parser's node
/// budget for one document, and the whole file was skipped.
#[test]
fn a_3000_service_yaml_list_loads_every_item() {
    let p = parse("all.yaml", &kubectl_yaml_list(3000));
    assert!(
        p.errors.is_empty(),
        "{:?}",
        &p.errors[..p.errors.len().min(3)]
    );
    assert_eq!(p.objects.len(), 6000);
    assert_eq!(p.objects[5999].location.item, Some(5999));
}

#[test]
fn a_broken_item_of_a_yaml_list_costs_only_that_item() {
    let text = kubectl_yaml_list(3).replace("    name: svc-1\n", "    name: [svc-1\n");
    let p = parse("all.yaml", &text);
    assert_eq!(p.objects.len(), 5, "{:?}", p.errors);
    assert_eq!(p.errors.len(), 1);
    assert_eq!(p.errors[0].location.item, Some(2));
}

#[test]
fn a_typed_json_list_with_items_before_kind_streams_and_names_its_items() {
    let text = r#"{"apiVersion":"v1","items":[{"metadata":{"name":"a","namespace":"d"},"spec":{"clusterIP":"10.96.0.1"}}],"kind":"ServiceList"}
        {"kind":"List","items":null}"#;
    let p = parse("x.json", text);
    assert_eq!((p.objects.len(), p.errors.len()), (1, 0), "{:?}", p.errors);
    assert!(matches!(p.objects[0].object, Object::Service(_)));
}

#[test]
fn duplicate_json_keys_are_an_error_as_in_yaml() {
    let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"a","name":"b","namespace":"d"}}"#;
    let p = parse("x.json", json);
    assert_eq!(p.objects.len(), 0);
    assert!(
        p.errors[0].reason.contains("duplicate key"),
        "{:?}",
        p.errors
    );
    let yaml = "apiVersion: v1\nkind: Service\nmetadata: {name: a, name: b, namespace: d}\n";
    assert_eq!(parse("x.yaml", yaml).errors.len(), 1);
}

/// `kubectl get -o yaml` prints `kind: List` after the items, so a dump
/// cut short has no kind; it, a typo of a kind and a kind-less object are reported
/// (file, document, what was found), never read as "no objects".
#[test]
fn documents_without_a_kind_or_with_an_unknown_one_are_reported() {
    let cut = "apiVersion: v1\nitems:\n- apiVersion: v1\n  kind: Service\n  metadata: {name: a, namespace: b}\n  spec: {clusterIP: 10.96.99.1, ports: [{port: 80}]}\n";
    let p = parse("c.yaml", cut);
    assert_eq!(p.objects.len(), 0);
    assert_eq!(p.errors.len(), 1, "{:?}", p.errors);
    let e = p.errors[0].to_string();
    assert!(
        e.starts_with(
            "c.yaml: document 0: document: .kind: no kind; found keys: apiVersion, items"
        ) && e.contains("cut short"),
        "{e}"
    );
    let doc = |k: &str, v: &str| {
        format!(
            "apiVersion: {v}\nkind: {k}\nmetadata: {{name: a, namespace: b}}\nspec: {{clusterIP: 10.96.99.1, ports: [{{port: 80}}]}}\n"
        )
    };
    for (kind, version, want) in [
        (
            "Servic",
            "v1",
            "unknown kind \"Servic\" (did you mean Service?)",
        ),
        ("service", "v1", "did you mean Service?"),
        (
            "EndpointSlices",
            "discovery.k8s.io/v1",
            "did you mean EndpointSlice?",
        ),
        ("Nodes", "example.com/v1", "did you mean Node?"),
        ("Sevrice", "apps/v1", "did you mean Service?"),
        (
            "Frobnicator",
            "v1",
            "unknown kind \"Frobnicator\" for apiVersion \"v1\"",
        ),
        ("Service", "v2", "Service of apiVersion \"v2\" is not read"),
        (
            "EndpointSlice",
            "discovery.k8s.io/v1beta1",
            "kproxy reads discovery.k8s.io/v1",
        ),
    ] {
        let p = parse("k.yaml", &doc(kind, version));
        assert_eq!(
            (p.objects.len(), p.errors.len()),
            (0, 1),
            "{kind} {version}"
        );
        let e = p.errors[0].to_string();
        assert!(
            e.contains("k.yaml: document 0") && e.contains(".kind") && e.contains(want),
            "{kind} {version}: {e}"
        );
    }
    // Kinds kproxy does not read are still skipped without a word.
    for (kind, version) in [
        ("Deployment", "apps/v1"),
        ("Role", "rbac.authorization.k8s.io/v1"),
        ("ConfigMap", "v1"),
        ("Ingress", "networking.k8s.io/v1"),
        ("Certificate", "cert-manager.io/v1"),
        ("ServiceList", "v1"),
    ] {
        let p = parse("k.yaml", &doc(kind, version));
        assert_eq!(
            (p.objects.len(), p.errors.len()),
            (0, 0),
            "{kind} {version}: {:?}",
            p.errors
        );
    }
    // A kind-less item of a List, an empty object, a scalar.
    let text = r#"{"apiVersion":"v1","kind":"List","items":[{},{"metadata":{"name":"x"}},"svc",{"apiVersion":"v1","kind":"Node","metadata":{"name":"n"}}]}"#;
    let p = parse("l.json", text);
    assert_eq!(p.objects.len(), 1);
    let items: Vec<_> = p
        .errors
        .iter()
        .map(|e| (e.location.item, e.reason.clone()))
        .collect();
    assert_eq!(items.len(), 3, "{items:?}");
    assert!(
        items[0].1.contains("empty object")
            && items[1].1.contains("found keys: metadata")
            && items[2].1.contains("scalar"),
        "{items:?}"
    );
    assert_eq!(
        items.iter().map(|i| i.0).collect::<Vec<_>>(),
        [Some(0), Some(1), Some(2)]
    );
}

/// A million kind-less items must not become a million reports.
#[test]
fn the_errors_of_one_file_are_listed_up_to_a_bound_and_counted_beyond() {
    let n = MAX_ERRORS_PER_FILE + 500;
    let text = format!(
        "{{\"apiVersion\":\"v1\",\"kind\":\"List\",\"items\":[{}]}}",
        vec!["{}"; n].join(",")
    );
    let p = parse("l.json", &text);
    assert_eq!(p.errors.len(), MAX_ERRORS_PER_FILE + 1);
    let last = p.errors.last().unwrap();
    assert!(last.reason.starts_with("500 more documents"), "{last}");
    assert_eq!(last.location.item, Some(MAX_ERRORS_PER_FILE));
}

/// Docs/input.md says a duplicate key costs the List item; in JSON it
/// stopped the stream and cost the whole List. An item over the node budget costs
/// only itself too.
#[test]
fn a_duplicate_key_or_an_overrun_in_a_json_list_item_costs_only_that_item() {
    let item = |name: &str| {
        format!(
            r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"{name}","namespace":"d"}},"spec":{{"clusterIP":"10.96.0.1"}}}}"#
        )
    };
    let dup = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"b","namespace":"d","name":"c"}}"#;
    let big = format!(
        r#"{{"apiVersion":"v1","kind":"Service","metadata":{{"name":"big","namespace":"d","labels":{{"x":[{}]}}}}}}"#,
        vec!["1"; MAX_NODES_PER_OBJECT].join(",")
    );
    let text = format!(
        r#"{{"apiVersion":"v1","items":[{},{dup},{big},{}],"kind":"List"}}
            {{"apiVersion":"v1","kind":"Node","metadata":{{"name":"n","name":"m"}}}}
            {}"#,
        item("a"),
        item("d"),
        item("e")
    );
    let p = parse("x.json", &text);
    let names: Vec<_> = p
        .objects
        .iter()
        .map(|o| match &o.object {
            Object::Service(s) => s.metadata.name.clone().unwrap(),
            o => panic!("{o:?}"),
        })
        .collect();
    assert_eq!(names, ["a", "d", "e"], "{:?}", p.errors);
    let errors: Vec<_> = p
        .errors
        .iter()
        .map(|e| {
            (
                e.location.document,
                e.location.item,
                e.what.as_str(),
                e.field.as_str(),
            )
        })
        .collect();
    assert_eq!(
        errors,
        [
            (0, Some(1), "Service d/b", ".metadata.name"),
            (0, Some(2), "Service d/big", ".metadata.labels.x[249992]"),
            (1, None, "Node n", ".metadata.name"),
        ]
    );
    assert!(p.errors[0].reason.contains("duplicate key"));
    assert!(p.errors[1].reason.contains("more than 250000 values"));
}

/// One bad byte cost a whole kubectl List (one YAML document).
#[test]
fn invalid_utf8_in_a_yaml_list_item_costs_only_that_item() {
    let mut bytes = kubectl_yaml_list(3).into_bytes();
    let at = String::from_utf8_lossy(&bytes)
        .find("name: svc-1\n")
        .unwrap()
        + 6;
    bytes[at] = 0xFF;
    let mut objects = 0;
    let mut errors = Vec::new();
    for_each_object("all.yaml", &bytes, &mut |r| match r {
        Ok(_) => objects += 1,
        Err(e) => errors.push(e),
    });
    assert_eq!(objects, 5, "{errors:?}");
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].location.item, Some(2));
    assert!(errors[0].reason.contains("invalid UTF-8"), "{errors:?}");
}

#[test]
fn invalid_utf8_costs_only_its_document() {
    let mut bytes = b"kind: Node\napiVersion: v1\nmetadata: {name: n1}\n---\n# caf".to_vec();
    bytes.push(0xE9);
    bytes.extend_from_slice(b"\nkind: Node\napiVersion: v1\nmetadata: {name: n2}\n---\nkind: Node\napiVersion: v1\nmetadata: {name: n3}\n");
    let mut objects = 0;
    let mut errors = Vec::new();
    for_each_object("x.yaml", &bytes, &mut |r| match r {
        Ok(_) => objects += 1,
        Err(e) => errors.push(e),
    });
    assert_eq!(objects, 2);
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].location.document, 1);
    assert!(errors[0].reason.contains("UTF-8"), "{errors:?}");
}
