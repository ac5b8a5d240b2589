//! Manifest text into Kubernetes objects: multi-document YAML, JSON, and `kind: List`
//! exactly as `kubectl get … -o yaml|json` prints. Pure: the caller reads the file and
//! passes its name for reports. A broken document, or a broken item of a List, is
//! reported and skipped; the rest of the file still loads. So is a document without a
//! kind, or with a kind that is none of the Kubernetes kinds of the groups kproxy reads;
//! other kinds (Deployments, CRDs) are skipped quietly.

use std::fmt;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use k8s_openapi::api::networking::v1 as networkingv1;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

mod json;
mod yaml_list;

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

/// Upper bound on the values (mappings, sequences and scalars) of one JSON document or
/// List item: the YAML parser's default budget of nodes per document, which applies to
/// each YAML document and List item.
pub const MAX_NODES_PER_OBJECT: usize = 250_000;

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
    let mut cap = ErrorCap::new();
    for_each_value(file, bytes, &mut |r| {
        let r = match r {
            Ok((location, v)) => read_object(v, location),
            Err(e) => Some(Err(e)),
        };
        match r {
            Some(Ok(o)) => f(Ok(o)),
            Some(Err(e)) => {
                if let Some(e) = cap.pass(e) {
                    f(Err(e))
                }
            }
            None => {}
        }
    });
    if let Some(e) = cap.finish() {
        f(Err(e));
    }
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
/// most [`MAX_OBJECTS_PER_FILE`] are delivered; what is beyond is reported once.
pub fn for_each_value(
    file: &str,
    bytes: &[u8],
    f: &mut dyn FnMut(Result<(Location, Value), ManifestError>),
) {
    let mut delivered = 0usize;
    let mut over: Option<(Location, usize)> = None;
    let mut capped = |r: Result<(Location, Value), ManifestError>| {
        if delivered < MAX_OBJECTS_PER_FILE {
            delivered += 1;
            f(r);
        } else {
            let location = match &r {
                Ok((l, _)) => l,
                Err(e) => &e.location,
            };
            over.get_or_insert_with(|| (location.clone(), 0)).1 += 1;
        }
    };
    if file.ends_with(".json") {
        json::stream(file, bytes, &mut capped);
    } else {
        yaml_stream(file, bytes, &mut capped);
    }
    if let Some((location, n)) = over {
        f(Err(doc_error(
            location,
            "document",
            ".",
            format!(
                "more than {MAX_OBJECTS_PER_FILE} documents and List items in one file: the last {n} are not read"
            ),
        )));
    }
}

/// Upper bound on the errors of one file that are reported one by one; the rest are
/// counted in one last error. A file of a million kind-less `{}` items is a million
/// errors, and their reports must not cost more memory than the file.
pub const MAX_ERRORS_PER_FILE: usize = 1_000;

/// [`for_each_object`]'s errors after the first [`MAX_ERRORS_PER_FILE`], counted.
struct ErrorCap {
    reported: usize,
    more: Option<(Location, usize)>,
}

impl ErrorCap {
    fn new() -> Self {
        ErrorCap {
            reported: 0,
            more: None,
        }
    }

    /// The error to report now, if any.
    fn pass(&mut self, e: ManifestError) -> Option<ManifestError> {
        if self.reported < MAX_ERRORS_PER_FILE {
            self.reported += 1;
            return Some(e);
        }
        self.more.get_or_insert((e.location, 0)).1 += 1;
        None
    }

    /// The count of the errors not reported, as one error.
    fn finish(self) -> Option<ManifestError> {
        self.more.map(|(location, n)| {
            doc_error(
                location,
                "document",
                ".",
                format!("{n} more documents or List items not read (only the first {MAX_ERRORS_PER_FILE} problems of a file are listed)"),
            )
        })
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
        // Invalid UTF-8 costs the document, or in a List only the items it is in: the
        // text is cut into items with the bad bytes replaced, and an item holding a
        // replacement character is reported instead of read.
        let lossy;
        let (text, bad_utf8) = match std::str::from_utf8(doc) {
            Ok(t) => (t, None),
            Err(e) => {
                lossy = String::from_utf8_lossy(doc);
                (&*lossy, Some(e.valid_up_to()))
            }
        };
        let invalid_utf8 = |location, what: &str, at: usize| {
            doc_error(
                location,
                what,
                ".",
                format!("invalid UTF-8 at byte {at} of the {what}"),
            )
        };
        if let Some(list) = yaml_list::split(text)
            && !(bad_utf8.is_some() && list.skeleton.contains(char::REPLACEMENT_CHARACTER))
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
                if bad_utf8.is_some()
                    && let Some(at) = item.find(char::REPLACEMENT_CHARACTER)
                {
                    f(Err(invalid_utf8(location, "item", at)));
                    continue;
                }
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
        if let Some(at) = bad_utf8 {
            f(Err(invalid_utf8(location, "document", at)));
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
/// kinds kproxy does not read (Deployments, Pods, …: skipped quietly). A document with
/// content but no kind, or with a kind that is no Kubernetes kind of the groups kproxy
/// reads, is an error: a `kubectl get -o yaml` dump cut short ends before its
/// `kind: List` line, and a typo (`kind: Servic`) must not read as "no Services".
fn read_object(v: Value, location: Location) -> Option<Result<Located, ManifestError>> {
    let Some(kind) = v.get("kind").and_then(Value::as_str) else {
        return Some(Err(no_kind(&v, location)));
    };
    let api_version = v.get("apiVersion").and_then(Value::as_str).unwrap_or("");
    let what = describe(&v, None);
    if let Some(reason) = unknown_kind(kind, api_version) {
        return Some(Err(ManifestError {
            location,
            what,
            field: ".kind".into(),
            reason,
        }));
    }
    let result = match (kind, api_version) {
        ("Service", "v1" | "") => typed::<corev1::Service>(v).map(|o| Object::Service(Box::new(o))),
        ("Node", "v1" | "") => typed::<corev1::Node>(v).map(|o| Object::Node(Box::new(o))),
        ("EndpointSlice", "discovery.k8s.io/v1" | "") => {
            typed::<discoveryv1::EndpointSlice>(v).map(|o| Object::EndpointSlice(Box::new(o)))
        }
        ("ServiceCIDR", "networking.k8s.io/v1" | "") => {
            typed::<networkingv1::ServiceCIDR>(v).map(|o| Object::ServiceCidr(Box::new(o)))
        }
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

/// The error for a document without a (string) `kind`, naming what it holds instead.
fn no_kind(v: &Value, location: Location) -> ManifestError {
    let reason = match v {
        Value::Object(m) if m.is_empty() => "an empty object, no kind; not read".to_string(),
        Value::Object(m) => {
            const SHOWN: usize = 6;
            let mut keys: Vec<&str> = m.keys().take(SHOWN).map(String::as_str).collect();
            if m.len() > SHOWN {
                keys.push("…");
            }
            let found = match m.get("kind") {
                Some(k) => format!("kind is not a string ({k}); keys"),
                None => "no kind; found keys".to_string(),
            };
            let hint = if m.contains_key("items") {
                " (a `kind: List` cut short before its `kind` line?)"
            } else {
                ""
            };
            format!("{found}: {}{hint}; not read", keys.join(", "))
        }
        Value::Array(_) => "a sequence, not an object; not read".to_string(),
        other => format!(
            "a scalar ({}), not an object; not read",
            scalar_preview(other)
        ),
    };
    ManifestError {
        location,
        what: describe(v, None),
        field: if v.is_object() { ".kind" } else { "." }.into(),
        reason,
    }
}

fn scalar_preview(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(40) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// The kinds kproxy reads, and their API groups.
const READ_KINDS: [(&str, &str); 4] = [
    ("Service", "v1"),
    ("Node", "v1"),
    ("EndpointSlice", "discovery.k8s.io/v1"),
    ("ServiceCIDR", "networking.k8s.io/v1"),
];

/// Every kind of the API groups kproxy reads from (Kubernetes 1.33): a kind of these
/// groups outside this list is a typo, not an object kproxy may ignore.
const GROUP_KINDS: [(&str, &[&str]); 3] = [
    (
        "",
        &[
            "Binding",
            "ComponentStatus",
            "ConfigMap",
            "Endpoints",
            "Event",
            "LimitRange",
            "Namespace",
            "Node",
            "PersistentVolume",
            "PersistentVolumeClaim",
            "Pod",
            "PodTemplate",
            "ReplicationController",
            "ResourceQuota",
            "Secret",
            "Service",
            "ServiceAccount",
        ],
    ),
    ("discovery.k8s.io", &["EndpointSlice"]),
    (
        "networking.k8s.io",
        &[
            "Ingress",
            "IngressClass",
            "IPAddress",
            "NetworkPolicy",
            "ServiceCIDR",
        ],
    ),
];

/// Why `kind` at `api_version` is neither an object kproxy reads nor one it may skip
/// quietly: a kind of kproxy's API groups that the group does not have, a kind kproxy
/// reads at another version, or a near miss of one (`Servic`, `service`,
/// `EndpointSlices`) in any group. `None`: read it, or skip it quietly.
fn unknown_kind(kind: &str, api_version: &str) -> Option<String> {
    let read = READ_KINDS.iter().find(|(k, _)| *k == kind);
    if kind.ends_with("List") || (read.is_some() && api_version.is_empty()) {
        return None;
    }
    if let Some((k, want)) = read {
        return (*want != api_version).then(|| {
            format!("{k} of apiVersion {api_version:?} is not read (kproxy reads {want}); not read")
        });
    }
    let (group, _version) = match api_version.rsplit_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    };
    let in_group = GROUP_KINDS
        .iter()
        .find(|(g, _)| *g == group)
        .map(|(_, kinds)| kinds.contains(&kind));
    if in_group != Some(true)
        && let Some((near, _)) = READ_KINDS.iter().find(|(k, _)| near_miss(kind, k))
    {
        return Some(format!(
            "unknown kind {kind:?} (did you mean {near}?); not read"
        ));
    }
    (in_group == Some(false))
        .then(|| format!("unknown kind {kind:?} for apiVersion {api_version:?}; not read"))
}

/// `a` differs from `b` only in case, or by at most two single-character edits (one
/// for kinds of four letters or fewer: `Role` is not a misspelt `Node`).
fn near_miss(a: &str, b: &str) -> bool {
    let (a, b): (Vec<char>, Vec<char>) = (
        a.to_lowercase().chars().collect(),
        b.to_lowercase().chars().collect(),
    );
    let most = if b.len() <= 4 { 1 } else { 2 };
    if a.len().abs_diff(b.len()) > most {
        return false;
    }
    // Levenshtein distance, one row at a time.
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()] <= most
}

/// `v` as the Kubernetes type `T`, or the field (`.spec.ports[0].port`) and the reason it
/// does not fit. Shared with the lint's reader.
pub fn typed<T: DeserializeOwned>(v: Value) -> Result<T, (String, String)> {
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

/// `Kind namespace/name` from raw JSON, for reports on objects that failed to parse;
/// `default_namespace` stands in for a missing namespace (the lint's `default`, as
/// `kubectl apply` would place the object; kproxy's reader names none, since it refuses
/// a namespaced object without one). Shared with the lint's reader.
pub fn describe(v: &Value, default_namespace: Option<&str>) -> String {
    let kind = v
        .get("kind")
        .and_then(Value::as_str)
        .unwrap_or("document")
        .escape_debug()
        .to_string();
    let meta = v.get("metadata");
    let s = |k: &str| {
        meta.and_then(|m| m.get(k))
            .and_then(Value::as_str)
            .map(|s| s.escape_debug().to_string())
    };
    match (
        s("namespace").or(default_namespace.map(str::to_string)),
        s("name"),
    ) {
        (Some(ns), Some(n)) => format!("{kind} {ns}/{n}"),
        (None, Some(n)) => format!("{kind} {n}"),
        _ => kind,
    }
}

#[cfg(test)]
mod tests;
