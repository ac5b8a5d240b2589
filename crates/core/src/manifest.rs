//! Manifest text into Kubernetes objects: multi-document YAML, JSON, and `kind: List`
//! exactly as `kubectl get … -o yaml|json` prints. Pure: the caller reads the file and
//! passes its name for reports. A broken document, or a broken item of a List, is
//! reported and skipped; the rest of the file still loads. Unknown kinds are skipped
//! quietly.

use std::fmt;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use k8s_openapi::api::networking::v1 as networkingv1;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

/// An object kproxy consumes.
#[derive(Clone, Debug, PartialEq)]
pub enum Object {
    Service(Box<corev1::Service>),
    EndpointSlice(Box<discoveryv1::EndpointSlice>),
    Node(Box<corev1::Node>),
    ServiceCidr(Box<networkingv1::ServiceCIDR>),
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
    let mut out = Parsed::default();
    for_each_object(file, text.as_bytes(), &mut |r| match r {
        Ok(o) => out.objects.push(o),
        Err(e) => out.errors.push(e),
    });
    out
}

/// Calls `f` with each object (or error) of one file, in file order, without holding
/// more than one document (or one item of a `kind: List`) parsed at a time: a
/// 50,000-Service `kubectl get -o yaml` dump costs its text plus one item. Invalid UTF-8
/// costs only the document (YAML) or the rest of the stream (JSON) it is in.
pub fn for_each_object(
    file: &str,
    bytes: &[u8],
    f: &mut dyn FnMut(Result<Located, ManifestError>),
) {
    for_each_value(file, bytes, &mut |r| match r {
        Ok((location, v)) => {
            if let Some(r) = read_object(v, location) {
                f(r)
            }
        }
        Err(e) => f(Err(e)),
    });
}

/// Splits one file's text into raw objects (documents, and the items of `kind: List`
/// documents), each with its location; unreadable documents become errors. `.json`
/// files go through serde_json (a stream of values); everything else through the YAML
/// parser (which also reads JSON). Other readers of manifests (`kproxy lint`) start here.
pub fn documents(file: &str, text: &str) -> (Vec<(Location, Value)>, Vec<ManifestError>) {
    let mut values = Vec::new();
    let mut errors = Vec::new();
    for_each_value(file, text.as_bytes(), &mut |r| match r {
        Ok(v) => values.push(v),
        Err(e) => errors.push(e),
    });
    (values, errors)
}

/// The streaming form of [`documents`]: `f` gets each raw object or error in order. At
/// most [`MAX_OBJECTS_PER_FILE`] are delivered.
pub fn for_each_value(
    file: &str,
    bytes: &[u8],
    f: &mut dyn FnMut(Result<(Location, Value), ManifestError>),
) {
    let mut delivered = 0usize;
    let mut capped = |r: Result<(Location, Value), ManifestError>| {
        if delivered < MAX_OBJECTS_PER_FILE {
            delivered += 1;
            f(r);
        }
    };
    if file.ends_with(".json") {
        json::stream(file, bytes, &mut capped);
    } else {
        yaml_stream(file, bytes, &mut capped);
    }
}

fn doc_error(
    location: Location,
    what: impl Into<String>,
    field: &str,
    reason: String,
) -> ManifestError {
    ManifestError {
        location,
        what: what.into(),
        field: field.into(),
        reason,
    }
}

fn yaml_stream(
    file: &str,
    bytes: &[u8],
    f: &mut dyn FnMut(Result<(Location, Value), ManifestError>),
) {
    for (document, doc) in split_yaml_documents(bytes).into_iter().enumerate() {
        let location = Location {
            file: file.to_string(),
            document,
            item: None,
        };
        let text = match std::str::from_utf8(doc) {
            Ok(t) => t,
            Err(e) => {
                f(Err(doc_error(
                    location,
                    "document",
                    ".",
                    format!("invalid UTF-8 at byte {} of the document", e.valid_up_to()),
                )));
                continue;
            }
        };
        if let Some(list) = yaml_list::split(text)
            && let Ok(skeleton) = serde_saphyr::from_str::<Value>(&list.skeleton)
            && let Some(kind) = list_kind(&skeleton)
        {
            let item_kind = item_kind(&kind);
            for (i, range) in list.items.iter().enumerate() {
                let location = Location {
                    item: Some(i),
                    ..location.clone()
                };
                let item = yaml_list::dedent(&text[range.clone()], list.indent);
                match serde_saphyr::from_str::<Value>(&item) {
                    Ok(v) => f(Ok((location, with_kind(v, item_kind.as_deref())))),
                    Err(e) => f(Err(doc_error(
                        location,
                        "item",
                        ".",
                        first_line(&e.to_string()),
                    ))),
                }
            }
            continue;
        }
        match serde_saphyr::from_str::<Value>(text) {
            Ok(Value::Null) => {}
            Ok(v) => flatten_lists(v, location, f),
            Err(e) => f(Err(doc_error(
                location,
                "document",
                ".",
                first_line(&e.to_string()),
            ))),
        }
    }
}

/// The kind of a `kind: …List` document, if it is one.
fn list_kind(v: &Value) -> Option<String> {
    v.get("kind")
        .and_then(Value::as_str)
        .filter(|k| k.ends_with("List"))
        .map(str::to_string)
}

/// Items of a typed list (ServiceList) may omit kind.
fn item_kind(list_kind: &str) -> Option<String> {
    list_kind
        .strip_suffix("List")
        .filter(|k| !k.is_empty())
        .map(str::to_string)
}

fn with_kind(mut item: Value, kind: Option<&str>) -> Value {
    if let (Some(k), Value::Object(m)) = (kind, &mut item) {
        m.entry("kind")
            .or_insert_with(|| Value::String(k.to_string()));
    }
    item
}

fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// Splits YAML text at `---` document markers (and after `...` end markers), so that
/// one unparsable document does not hide the others and each document is parsed alone
/// (one parse of a whole stream grows faster than the stream, and its node budget would
/// cap the file). Directives (`%YAML`) before a document are dropped.
fn split_yaml_documents(text: &[u8]) -> Vec<&[u8]> {
    let mut docs = Vec::new();
    let mut start = 0;
    let mut offset = 0;
    let mut content = false;
    for line in text.split_inclusive(|b| *b == b'\n') {
        // A marker is `---` at the start of a line, alone or followed by whitespace; what
        // follows it on the line (`--- {a: 1}`, `--- # comment`) opens the next document.
        let rest = line.get(3..).unwrap_or(b"");
        let marker =
            |m: &[u8]| line.starts_with(m) && rest.first().is_none_or(|b| b.is_ascii_whitespace());
        if marker(b"---") {
            docs.push(&text[start..offset]);
            start = offset + 3;
            content = true;
        } else if marker(b"...") {
            docs.push(&text[start..offset]);
            start = offset + line.len();
            content = false;
        } else if !content && line.starts_with(b"%") {
            start = offset + line.len();
        } else if !content {
            let t = line.trim_ascii();
            content = !(t.is_empty() || t.starts_with(b"#"));
        }
        offset += line.len();
    }
    docs.push(&text[start..]);
    docs.into_iter()
        .filter(|d| !d.trim_ascii().is_empty())
        .collect()
}

/// A block-style `kind: List` document cut into its items by indentation, the shape
/// `kubectl get -o yaml` prints:
///
/// ```yaml
/// apiVersion: v1
/// items:
/// - apiVersion: v1
///   kind: Service
///   …
/// kind: List
/// ```
///
/// Each item is then parsed alone, so the parser's per-document node budget applies per
/// object and memory holds one item at a time. Anything else (flow style, an indented
/// root) is not cut and goes to the parser whole.
mod yaml_list {
    use std::ops::Range;

    pub struct Split {
        /// The document with its items replaced by `items: []`.
        pub skeleton: String,
        /// Byte ranges of the items, first line starting at the `-`.
        pub items: Vec<Range<usize>>,
        /// Column of the `-` of every item.
        pub indent: usize,
    }

    fn indent_of(line: &str) -> usize {
        line.len() - line.trim_start_matches(' ').len()
    }

    fn is_item_start(line: &str, indent: usize) -> bool {
        indent_of(line) == indent && {
            let rest = &line[indent..];
            rest.starts_with('-') && rest[1..].chars().next().is_none_or(char::is_whitespace)
        }
    }

    fn blank_or_comment(line: &str) -> bool {
        let t = line.trim();
        t.is_empty() || t.starts_with('#')
    }

    pub fn split(text: &str) -> Option<Split> {
        let mut skeleton = String::new();
        let mut items: Vec<Range<usize>> = Vec::new();
        let mut indent = None;
        let mut offset = 0;
        // 0: before `items:`, 1: inside items, 2: after
        let mut phase = 0;
        for line in text.split_inclusive('\n') {
            let here = offset;
            offset += line.len();
            match phase {
                0 => {
                    let body = line.split('#').next().unwrap_or("").trim_end();
                    if body == "items:" {
                        skeleton.push_str("items: []\n");
                        phase = 1;
                    } else {
                        skeleton.push_str(line);
                    }
                }
                1 => {
                    if blank_or_comment(line) {
                        if let Some(last) = items.last_mut() {
                            last.end = offset;
                        }
                        continue;
                    }
                    let ind = *indent.get_or_insert(indent_of(line));
                    if is_item_start(line, ind) {
                        items.push(here..offset);
                    } else if indent_of(line) > ind && !items.is_empty() {
                        if let Some(last) = items.last_mut() {
                            last.end = offset;
                        }
                    } else if indent_of(line) == 0 {
                        phase = 2;
                        skeleton.push_str(line);
                    } else {
                        return None;
                    }
                }
                _ => {
                    if indent_of(line) == 0 && !blank_or_comment(line) && line.starts_with('-') {
                        return None;
                    }
                    skeleton.push_str(line);
                }
            }
        }
        (phase > 0 && !items.is_empty()).then(|| Split {
            skeleton,
            items,
            indent: indent.unwrap_or(0),
        })
    }

    /// One item's text as a document of its own: the `- ` becomes nothing and every line
    /// loses the item's indentation.
    pub fn dedent(item: &str, indent: usize) -> String {
        let cut = indent + 2;
        let mut out = String::with_capacity(item.len());
        for (i, line) in item.split_inclusive('\n').enumerate() {
            if i == 0 {
                let rest = &line[indent + 1..];
                out.push_str(rest.strip_prefix(' ').unwrap_or(rest));
            } else {
                let n = line.len() - line.trim_start_matches(' ').len();
                out.push_str(&line[n.min(cut)..]);
            }
        }
        out
    }
}

fn flatten_lists(
    v: Value,
    location: Location,
    f: &mut dyn FnMut(Result<(Location, Value), ManifestError>),
) {
    let kind = v
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if !(kind.ends_with("List") && v.get("items").is_some()) {
        f(Ok((location, v)));
        return;
    }
    let Value::Object(mut map) = v else { return };
    let items = match map.remove("items") {
        Some(Value::Array(items)) => items,
        Some(Value::Null) | None => Vec::new(),
        Some(_) => {
            f(Err(doc_error(
                location,
                kind,
                ".items",
                "not a list".into(),
            )));
            return;
        }
    };
    let item_kind = item_kind(&kind);
    for (i, item) in items.into_iter().enumerate() {
        f(Ok((
            Location {
                item: Some(i),
                ..location.clone()
            },
            with_kind(item, item_kind.as_deref()),
        )));
    }
}

/// The object kproxy consumes in `v`, the error that makes it unreadable, or `None` for
/// kinds kproxy does not read (Deployments, Pods, …: skipped quietly).
fn read_object(v: Value, location: Location) -> Option<Result<Located, ManifestError>> {
    let kind = v.get("kind").and_then(Value::as_str).unwrap_or("");
    let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let what = describe(&v);
    let result = match (kind, api_version) {
        ("Service", "v1" | "") => typed::<corev1::Service>(v).map(|o| Object::Service(Box::new(o))),
        ("Node", "v1" | "") => typed::<corev1::Node>(v).map(|o| Object::Node(Box::new(o))),
        ("EndpointSlice", "discovery.k8s.io/v1" | "") => {
            typed::<discoveryv1::EndpointSlice>(v).map(|o| Object::EndpointSlice(Box::new(o)))
        }
        ("ServiceCIDR", "networking.k8s.io/v1" | "") => {
            typed::<networkingv1::ServiceCIDR>(v).map(|o| Object::ServiceCidr(Box::new(o)))
        }
        ("", _) if !v.is_object() => Err((".".to_string(), "not an object".to_string())),
        _ => return None,
    };
    Some(match result {
        Ok(object) => Ok(Located { location, object }),
        Err((field, reason)) => Err(ManifestError {
            location,
            what,
            field,
            reason,
        }),
    })
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

/// JSON manifests as a stream of documents, each read by a serde visitor that hands the
/// elements of a top-level `items` array to the caller one by one instead of building
/// the array: `kubectl get -o json` prints `items` before `kind`, so a List is known
/// only by its shape. Duplicate keys in an object are an error, as the YAML reader
/// treats them.
mod json {
    use std::fmt;

    use serde::de::{
        self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
    };
    use serde_json::{Map, Value};

    use super::{
        Location, ManifestError, doc_error, first_line, flatten_lists, item_kind, with_kind,
    };

    type Sink<'a> = dyn FnMut(Result<(Location, Value), ManifestError>) + 'a;

    pub fn stream(file: &str, bytes: &[u8], f: &mut Sink<'_>) {
        let mut de = serde_json::Deserializer::from_slice(bytes);
        for document in 0.. {
            if de.end().is_ok() {
                return;
            }
            let location = Location {
                file: file.to_string(),
                document,
                item: None,
            };
            let seed = Document {
                location: location.clone(),
                f: &mut *f,
            };
            match seed.deserialize(&mut de) {
                Ok(Some(v)) => flatten_lists(v, location, f),
                Ok(None) => {}
                Err(e) => {
                    // The stream has no known position after a syntax error: stop.
                    f(Err(doc_error(
                        location,
                        "document",
                        ".",
                        first_line(&e.to_string()),
                    )));
                    return;
                }
            }
        }
    }

    /// One top-level document: `Some(value)` for a document to read whole, `None` when
    /// its items were streamed to `f`.
    struct Document<'a, 'f> {
        location: Location,
        f: &'a mut Sink<'f>,
    }

    impl<'de> DeserializeSeed<'de> for Document<'_, '_> {
        type Value = Option<Value>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Document<'_, '_> {
        type Value = Option<Value>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = Map::new();
            let mut streamed = false;
            // Kind-less items wait for the list's kind (a typed list names it once).
            let mut waiting: Vec<(usize, Value)> = Vec::new();
            while let Some(key) = map.next_key::<String>()? {
                if out.contains_key(&key) || (streamed && key == "items") {
                    return Err(de::Error::custom(format!("duplicate key {key:?}")));
                }
                let kind_known = out.get("kind").and_then(Value::as_str);
                let stream_items = key == "items" && kind_known.is_none_or(|k| k.ends_with("List"));
                if stream_items {
                    let item_kind = kind_known.and_then(item_kind);
                    streamed = map.next_value_seed(Items {
                        location: &self.location,
                        item_kind: item_kind.as_deref(),
                        waiting: &mut waiting,
                        f: &mut *self.f,
                    })?;
                    if !streamed {
                        out.insert(key, Value::Null);
                    }
                } else {
                    let v = map.next_value::<Strict>()?.0;
                    out.insert(key, v);
                }
            }
            if !streamed {
                return Ok(Some(Value::Object(out)));
            }
            let kind = out.get("kind").and_then(Value::as_str).and_then(item_kind);
            for (i, item) in waiting {
                let location = Location {
                    item: Some(i),
                    ..self.location.clone()
                };
                (self.f)(Ok((location, with_kind(item, kind.as_deref()))));
            }
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(Some(Value::Array(Vec::new())))
        }
        fn visit_bool<E>(self, v: bool) -> Result<Self::Value, E> {
            Ok(Some(Value::Bool(v)))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.into()))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.into()))
        }
        fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
            Ok(Some(v.into()))
        }
        fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.into()))
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }

    /// A `items` value: an array is streamed (true); `null` is no items (false).
    struct Items<'a, 'f> {
        location: &'a Location,
        item_kind: Option<&'a str>,
        waiting: &'a mut Vec<(usize, Value)>,
        f: &'a mut Sink<'f>,
    }

    impl<'de> DeserializeSeed<'de> for Items<'_, '_> {
        type Value = bool;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Items<'_, '_> {
        type Value = bool;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of items")
        }
        fn visit_unit<E>(self) -> Result<bool, E> {
            Ok(false)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
            let mut i = 0;
            while let Some(Strict(item)) = seq.next_element::<Strict>()? {
                let has_kind = item.get("kind").is_some() || !item.is_object();
                if self.item_kind.is_none() && !has_kind {
                    self.waiting.push((i, item));
                } else {
                    let location = Location {
                        item: Some(i),
                        ..self.location.clone()
                    };
                    (self.f)(Ok((location, with_kind(item, self.item_kind))));
                }
                i += 1;
            }
            Ok(true)
        }
    }

    /// A JSON value whose objects have no duplicate keys.
    pub struct Strict(pub Value);

    impl<'de> de::Deserialize<'de> for Strict {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(StrictVisitor).map(Strict)
        }
    }

    struct StrictVisitor;

    impl<'de> Visitor<'de> for StrictVisitor {
        type Value = Value;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(Value::Bool(v))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(v.into())
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(Value::Null)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let mut out = Vec::new();
            while let Some(Strict(v)) = seq.next_element()? {
                out.push(v);
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let mut out = Map::new();
            while let Some(key) = map.next_key::<String>()? {
                if out.contains_key(&key) {
                    return Err(de::Error::custom(format!("duplicate key {key:?}")));
                }
                let Strict(v) = map.next_value()?;
                out.insert(key, v);
            }
            Ok(Value::Object(out))
        }
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

    /// Issue 17: 3,000 Services in one `kind: List` exceeded the YAML parser's node
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
}
