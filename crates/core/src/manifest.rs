//! Manifest text into Kubernetes objects: multi-document YAML, JSON, and `kind: List`
//! exactly as `kubectl get … -o yaml|json` prints. Pure: the caller reads the file and
//! passes its name for reports. A broken document, or a broken item of a List, is
//! reported and skipped; the rest of the file still loads. Unknown kinds are skipped
//! quietly.

use std::fmt;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// An object kproxy consumes.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Service(Box<corev1::Service>),
    EndpointSlice(Box<discoveryv1::EndpointSlice>),
    Node(Box<corev1::Node>),
}

/// Where a document sits: file, document index (0-based), and List item index.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Location {
    pub file: String,
    pub document: usize,
    pub item: Option<usize>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: document {}", self.file, self.document)?;
        if let Some(i) = self.item {
            write!(f, ", items[{i}]")?;
        }
        Ok(())
    }
}

/// A document or object that could not be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize)]
#[error("{location}: {what}: {field}: {reason}")]
pub struct ManifestError {
    pub location: Location,
    /// `Kind namespace/name` when known, else `document`.
    pub what: String,
    /// Field path (`.spec.ports[0].port`), or `.` for the whole document.
    pub field: String,
    pub reason: String,
}

/// An object with where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Located {
    pub location: Location,
    pub object: Object,
}

/// Everything read from one file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Parsed {
    pub objects: Vec<Located>,
    pub errors: Vec<ManifestError>,
}

/// Upper bound on documents and list items per file: hostile input must not make the
/// proxy allocate without bound.
pub const MAX_OBJECTS_PER_FILE: usize = 1_000_000;

/// Parses one file's text into the objects kproxy consumes.
pub fn parse(file: &str, text: &str) -> Parsed {
    let (values, errors) = documents(file, text);
    let mut out = Parsed {
        objects: Vec::new(),
        errors,
    };
    for (location, v) in values {
        read_object(v, location, &mut out);
    }
    out
}

/// Splits one file's text into raw objects (documents, and the items of `kind: List`
/// documents), each with its location; unreadable documents become errors. `.json`
/// files go through serde_json (a stream of values); everything else through the YAML
/// parser (which also reads JSON). Other readers of manifests (`kproxy lint`) start here.
pub fn documents(file: &str, text: &str) -> (Vec<(Location, Value)>, Vec<ManifestError>) {
    let mut values = Vec::new();
    let mut errors = Vec::new();
    let docs: Vec<Result<Value, String>> = if file.ends_with(".json") {
        let mut docs = Vec::new();
        for v in serde_json::Deserializer::from_str(text).into_iter::<Value>() {
            match v {
                Ok(v) => docs.push(Ok(v)),
                Err(e) => {
                    docs.push(Err(e.to_string()));
                    break;
                }
            }
        }
        docs
    } else {
        // One parse per document: linear in the file (the whole-stream parse grows faster
        // than the file at thousands of documents), and a broken document stays alone.
        let split: Vec<Result<Value, String>> = split_yaml_documents(text)
            .into_iter()
            .map(|d| serde_saphyr::from_str::<Value>(d).map_err(|e| first_line(&e.to_string())))
            .collect();
        if split.iter().any(Result::is_err)
            && let Ok(v) = serde_saphyr::from_multiple::<Value>(text)
        {
            // Valid YAML the line splitter misreads (directives, `...` markers).
            v.into_iter().map(Ok).collect()
        } else {
            split
        }
    };
    for (document, doc) in docs.into_iter().enumerate() {
        let location = Location {
            file: file.to_string(),
            document,
            item: None,
        };
        match doc {
            Ok(Value::Null) => {}
            Ok(v) => flatten_lists(v, location, &mut values, &mut errors),
            Err(reason) => errors.push(ManifestError {
                location,
                what: "document".into(),
                field: ".".into(),
                reason,
            }),
        }
        if values.len() + errors.len() >= MAX_OBJECTS_PER_FILE {
            break;
        }
    }
    (values, errors)
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// Splits YAML text at `---` document markers, so that one unparsable document does not
/// hide the others.
fn split_yaml_documents(text: &str) -> Vec<&str> {
    let mut docs = Vec::new();
    let mut start = 0;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        // A marker is `---` at the start of a line, alone or followed by whitespace; what
        // follows it on the line (`--- {a: 1}`, `--- # comment`) opens the next document.
        if line.starts_with("---") && line[3..].chars().next().is_none_or(char::is_whitespace) {
            docs.push(&text[start..offset]);
            start = offset + 3;
        }
        offset += line.len();
    }
    docs.push(&text[start..]);
    docs.into_iter().filter(|d| !d.trim().is_empty()).collect()
}

fn flatten_lists(
    v: Value,
    location: Location,
    values: &mut Vec<(Location, Value)>,
    errors: &mut Vec<ManifestError>,
) {
    let kind = v
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if !(kind.ends_with("List") && v.get("items").is_some()) {
        values.push((location, v));
        return;
    }
    let Value::Object(mut map) = v else { return };
    let items = match map.remove("items") {
        Some(Value::Array(items)) => items,
        Some(Value::Null) | None => Vec::new(),
        Some(_) => {
            errors.push(ManifestError {
                location,
                what: kind,
                field: ".items".into(),
                reason: "not a list".into(),
            });
            return;
        }
    };
    // Items of a typed list (ServiceList) may omit kind.
    let item_kind = kind
        .strip_suffix("List")
        .filter(|k| !k.is_empty())
        .map(str::to_string);
    for (i, mut item) in items.into_iter().enumerate() {
        if let (Some(k), Value::Object(m)) = (&item_kind, &mut item) {
            m.entry("kind").or_insert_with(|| Value::String(k.clone()));
        }
        values.push((
            Location {
                item: Some(i),
                ..location.clone()
            },
            item,
        ));
    }
}

fn read_object(v: Value, location: Location, out: &mut Parsed) {
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
    let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let what = describe(&v);
    let result = match (kind, api_version) {
        ("Service", "v1" | "") => typed::<corev1::Service>(v).map(|o| Object::Service(Box::new(o))),
        ("Node", "v1" | "") => typed::<corev1::Node>(v).map(|o| Object::Node(Box::new(o))),
        ("EndpointSlice", "discovery.k8s.io/v1" | "") => {
            typed::<discoveryv1::EndpointSlice>(v).map(|o| Object::EndpointSlice(Box::new(o)))
        }
        ("", _) if !v.is_object() => Err((".".to_string(), "not an object".to_string())),
        _ => return, // unknown kinds (Deployments, Pods, …) are skipped quietly
    };
    match result {
        Ok(object) => out.objects.push(Located { location, object }),
        Err((field, reason)) => out.errors.push(ManifestError {
            location,
            what,
            field,
            reason,
        }),
    }
}

fn typed<T: DeserializeOwned>(v: Value) -> Result<T, (String, String)> {
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        let path = e.path().to_string();
        let field = if path == "." {
            ".".to_string()
        } else {
            format!(".{path}")
        };
        (field, e.into_inner().to_string())
    })
}

/// `Kind namespace/name` from raw JSON, for reports on objects that failed to parse.
fn describe(v: &Value) -> String {
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("document");
    let meta = v.get("metadata");
    let s = |k: &str| {
        meta.and_then(|m| m.get(k))
            .and_then(Value::as_str)
            .map(|s| s.escape_debug().to_string())
    };
    match (s("namespace"), s("name")) {
        (Some(ns), Some(n)) => format!("{kind} {ns}/{n}"),
        (None, Some(n)) => format!("{kind} {n}"),
        _ => kind.escape_debug().to_string(),
    }
}

#[cfg(test)]
mod tests {
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
}
