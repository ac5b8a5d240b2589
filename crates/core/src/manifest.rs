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

/// JSON manifests as a stream of documents, each read by a serde visitor that hands the
/// elements of the `items` array of a `kind: …List` document to the caller one by one
/// instead of building the array. `kubectl get -o json` prints `items` before `kind`, so
/// a first pass over the stream reads each document's `kind` (allocating nothing else)
/// and the second knows a List before its items: memory holds the text plus one item,
/// whatever the items contain (kind-less items used to wait for the List's
/// kind, all of them). Each item, and each document read whole, has the YAML reader's
/// per-document budget of nodes; duplicate keys and a budget overrun cost that item or
/// document only, as in YAML.
mod json {
    use std::fmt;

    use serde::de::{
        self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor,
    };
    use serde_json::{Map, Value};

    use super::{
        Location, MAX_NODES_PER_OBJECT, ManifestError, describe, doc_error, first_line, item_kind,
        with_kind,
    };

    type Sink<'a> = dyn FnMut(Result<(Location, Value), ManifestError>) + 'a;

    pub fn stream(file: &str, bytes: &[u8], f: &mut Sink<'_>) {
        let kinds = document_kinds(bytes);
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
            let list_kind = kinds
                .get(document)
                .cloned()
                .flatten()
                .filter(|k| k.ends_with("List"));
            let mut judge = Judge::default();
            let seed = Document {
                location: location.clone(),
                list_kind,
                judge: &mut judge,
                f: &mut *f,
            };
            match seed.deserialize(&mut de) {
                Ok(Some(v)) => f(judge.verdict(v, location)),
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

    /// The `kind` of each top-level document (`None`: none, or not a string), up to the
    /// first syntax error.
    fn document_kinds(bytes: &[u8]) -> Vec<Option<String>> {
        serde_json::Deserializer::from_slice(bytes)
            .into_iter::<KindOnly>()
            .map_while(Result::ok)
            .map(|k| k.0)
            .collect()
    }

    /// A document's `kind`, everything else skipped unbuilt.
    struct KindOnly(Option<String>);

    impl<'de> de::Deserialize<'de> for KindOnly {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(KindOnlyVisitor)
        }
    }

    struct KindOnlyVisitor;

    impl<'de> Visitor<'de> for KindOnlyVisitor {
        type Value = KindOnly;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KindOnly, A::Error> {
            let mut kind = None;
            while let Some(key) = map.next_key::<KeyIsKind>()? {
                if key.0 && kind.is_none() {
                    kind = map.next_value::<Value>()?.as_str().map(str::to_string);
                } else {
                    map.next_value::<IgnoredAny>()?;
                }
            }
            Ok(KindOnly(kind))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<KindOnly, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(KindOnly(None))
        }
        fn visit_bool<E>(self, _: bool) -> Result<KindOnly, E> {
            Ok(KindOnly(None))
        }
        fn visit_i64<E>(self, _: i64) -> Result<KindOnly, E> {
            Ok(KindOnly(None))
        }
        fn visit_u64<E>(self, _: u64) -> Result<KindOnly, E> {
            Ok(KindOnly(None))
        }
        fn visit_f64<E>(self, _: f64) -> Result<KindOnly, E> {
            Ok(KindOnly(None))
        }
        fn visit_str<E>(self, _: &str) -> Result<KindOnly, E> {
            Ok(KindOnly(None))
        }
        fn visit_unit<E>(self) -> Result<KindOnly, E> {
            Ok(KindOnly(None))
        }
    }

    /// Whether a key is `kind`, without allocating it.
    struct KeyIsKind(bool);

    impl<'de> de::Deserialize<'de> for KeyIsKind {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> Visitor<'de> for V {
                type Value = KeyIsKind;
                fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                    f.write_str("a key")
                }
                fn visit_str<E>(self, v: &str) -> Result<KeyIsKind, E> {
                    Ok(KeyIsKind(v == "kind"))
                }
            }
            d.deserialize_str(V)
        }
    }

    /// What reading one object (a List item, or a document read whole) found: its nodes,
    /// counted against [`MAX_NODES_PER_OBJECT`], where the reader is, and the first
    /// problem. After a problem the rest of the object is read (the stream goes on) but
    /// not kept.
    #[derive(Default)]
    struct Judge {
        nodes: usize,
        path: Vec<Segment>,
        problem: Option<(String, String)>,
    }

    enum Segment {
        Key(String),
        Index(usize),
    }

    impl Judge {
        fn field(&self) -> String {
            if self.path.is_empty() {
                return ".".into();
            }
            let mut out = String::new();
            for s in &self.path {
                match s {
                    Segment::Key(k) => {
                        out.push('.');
                        out.push_str(k);
                    }
                    Segment::Index(i) => out.push_str(&format!("[{i}]")),
                }
            }
            out
        }

        fn fail(&mut self, reason: String) {
            if self.problem.is_none() {
                self.problem = Some((self.field(), reason));
            }
        }

        /// Counts one node; false once the object is over budget or has a problem (its
        /// values are no longer kept).
        fn count(&mut self) -> bool {
            self.nodes += 1;
            if self.nodes > MAX_NODES_PER_OBJECT {
                self.fail(format!(
                    "more than {MAX_NODES_PER_OBJECT} values in one object; not read"
                ));
            }
            self.problem.is_none()
        }

        /// The object, or the error that costs it.
        fn verdict(self, v: Value, location: Location) -> Result<(Location, Value), ManifestError> {
            match self.problem {
                None => Ok((location, v)),
                Some((field, reason)) => Err(ManifestError {
                    location,
                    what: describe(&v, None),
                    field,
                    reason,
                }),
            }
        }
    }

    /// One top-level document: `Some(value)` for a document to read whole, `None` when
    /// its items were streamed to `f`.
    struct Document<'a, 'f> {
        location: Location,
        /// The document's kind when it is a `…List`.
        list_kind: Option<String>,
        judge: &'a mut Judge,
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
            while let Some(key) = map.next_key::<String>()? {
                if out.contains_key(&key) || (streamed && key == "items") {
                    self.judge.path.push(Segment::Key(key));
                    self.judge.fail("duplicate key".into());
                    map.next_value::<IgnoredAny>()?;
                    self.judge.path.pop();
                } else if key == "items"
                    && let Some(list_kind) = &self.list_kind
                {
                    let item_kind = item_kind(list_kind);
                    map.next_value_seed(Items {
                        location: &self.location,
                        item_kind: item_kind.as_deref(),
                        f: &mut *self.f,
                    })?;
                    streamed = true;
                } else {
                    self.judge.path.push(Segment::Key(key));
                    let v = map.next_value_seed(Strict(&mut *self.judge))?;
                    let Some(Segment::Key(key)) = self.judge.path.pop() else {
                        unreachable!("the key pushed above")
                    };
                    out.insert(key, v);
                }
            }
            if !streamed || self.judge.problem.is_some() {
                // A duplicate key or an overrun beside the items is reported with the
                // document; its items were judged one by one.
                return Ok(Some(Value::Object(out)));
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

    /// The `items` of a List: each element read alone, with its own budget, and handed
    /// to the caller.
    struct Items<'a, 'f> {
        location: &'a Location,
        item_kind: Option<&'a str>,
        f: &'a mut Sink<'f>,
    }

    impl<'de> DeserializeSeed<'de> for Items<'_, '_> {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Items<'_, '_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a list of items")
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            for i in 0.. {
                let mut judge = Judge::default();
                let Some(item) = seq.next_element_seed(Strict(&mut judge))? else {
                    break;
                };
                let location = Location {
                    item: Some(i),
                    ..self.location.clone()
                };
                (self.f)(judge.verdict(with_kind(item, self.item_kind), location));
            }
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            self.not_a_list()
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            self.not_a_list()
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            self.not_a_list()
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            self.not_a_list()
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            self.not_a_list()
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            self.not_a_list()
        }
    }

    impl Items<'_, '_> {
        fn not_a_list<E>(self) -> Result<(), E> {
            (self.f)(Err(doc_error(
                self.location.clone(),
                "List",
                ".items",
                "not a list".into(),
            )));
            Ok(())
        }
    }

    /// A JSON value read under a [`Judge`]: duplicate keys and a budget overrun are
    /// recorded there, and what follows them is consumed but not kept.
    struct Strict<'a>(&'a mut Judge);

    impl<'de> DeserializeSeed<'de> for Strict<'_> {
        type Value = Value;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Strict<'_> {
        type Value = Value;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
            Ok(self.scalar(Value::Bool(v)))
        }
        fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
            Ok(self.scalar(v.into()))
        }
        fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
            Ok(self.scalar(v.into()))
        }
        fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
            Ok(self.scalar(v.into()))
        }
        fn visit_str<E>(self, v: &str) -> Result<Value, E> {
            Ok(if self.0.count() {
                v.into()
            } else {
                Value::Null
            })
        }
        fn visit_string<E>(self, v: String) -> Result<Value, E> {
            Ok(self.scalar(v.into()))
        }
        fn visit_unit<E>(self) -> Result<Value, E> {
            Ok(self.scalar(Value::Null))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let judge = self.0;
            let mut out = Vec::new();
            let mut keep = Keep::new(judge.count());
            for i in 0.. {
                judge.path.push(Segment::Index(i));
                let v = seq.next_element_seed(Strict(&mut *judge))?;
                judge.path.pop();
                match v {
                    Some(v) if keep.this(judge) => out.push(v),
                    Some(_) => {}
                    None => break,
                }
            }
            Ok(Value::Array(out))
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let judge = self.0;
            let mut out = Map::new();
            let mut keep = Keep::new(judge.count());
            while let Some(key) = map.next_key::<String>()? {
                let duplicate = out.contains_key(&key);
                judge.path.push(Segment::Key(key));
                if duplicate {
                    judge.fail("duplicate key".into());
                }
                let v = map.next_value_seed(Strict(&mut *judge))?;
                let Some(Segment::Key(key)) = judge.path.pop() else {
                    unreachable!("the key pushed above")
                };
                // A duplicate's value does not replace the first (that names the object).
                if !duplicate && keep.this(judge) {
                    out.insert(key, v);
                }
            }
            Ok(Value::Object(out))
        }
    }

    /// Which values a mapping or sequence keeps: all until a problem, then the one
    /// that held it (so that the report can name the object), then none.
    struct Keep {
        open: bool,
        after_problem: bool,
    }

    impl Keep {
        fn new(open: bool) -> Keep {
            Keep {
                open,
                after_problem: false,
            }
        }

        fn this(&mut self, judge: &Judge) -> bool {
            if !self.open || self.after_problem {
                return false;
            }
            self.after_problem = judge.problem.is_some();
            true
        }
    }

    impl Strict<'_> {
        fn scalar(self, v: Value) -> Value {
            if self.0.count() { v } else { Value::Null }
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
}
