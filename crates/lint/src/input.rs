//! Manifests into the objects `kproxy lint` reasons about: Deployments, StatefulSets,
//! DaemonSets (as one `Workload` shape), LoadBalancer-relevant Services,
//! PodDisruptionBudgets, and a count of Nodes. Pure: the caller reads the files.
//!
//! Splitting (YAML/JSON, multi-document, `kind: List`) is `kproxy_core::manifest::documents`;
//! this module only types each raw document with `serde_path_to_error`, so a broken object
//! is reported with its file, `Kind namespace/name` and field path, and the others still load.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use k8s_openapi::api::apps::v1 as appsv1;
use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::policy::v1 as policyv1;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kproxy_core::manifest::{Location, ManifestError, describe, documents, typed};
use serde::Serialize;
use serde_json::Value;

/// The workload kinds whose pods sit behind Services.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum WorkloadKind {
    Deployment,
    StatefulSet,
    DaemonSet,
}

impl fmt::Display for WorkloadKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorkloadKind::Deployment => "Deployment",
            WorkloadKind::StatefulSet => "StatefulSet",
            WorkloadKind::DaemonSet => "DaemonSet",
        })
    }
}

/// Which workload, and where it was read from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkloadRef {
    pub kind: WorkloadKind,
    pub namespace: String,
    pub name: String,
    pub location: Location,
}

impl fmt::Display for WorkloadRef {
    /// Names come from the user's files: control characters are escaped so a name cannot
    /// rewrite the terminal or forge report lines.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {}/{}",
            self.kind,
            self.namespace.escape_debug(),
            self.name.escape_debug()
        )
    }
}

/// How a workload replaces its pods.
#[derive(Clone, Debug, PartialEq)]
pub enum Strategy {
    /// Deployment `Recreate`: every old pod is gone before any new one starts.
    Recreate,
    /// StatefulSet / DaemonSet `OnDelete`: pods are replaced only when someone deletes them.
    OnDelete,
    /// `RollingUpdate`, with the values as written (defaults are applied by the rules,
    /// which know the kind). StatefulSets have no `maxSurge`.
    RollingUpdate {
        max_surge: Option<IntOrString>,
        max_unavailable: Option<IntOrString>,
    },
}

/// A Deployment, StatefulSet or DaemonSet reduced to what the rules need.
#[derive(Clone, Debug)]
pub struct Workload {
    pub id: WorkloadRef,
    /// `spec.replicas` (default 1); `None` for DaemonSets (one pod per eligible node).
    pub replicas: Option<i32>,
    pub min_ready_seconds: i32,
    pub strategy: Strategy,
    /// The workload's annotations overlaid with the pod template's (template wins).
    pub annotations: BTreeMap<String, String>,
    pub template: corev1::PodTemplateSpec,
}

impl Workload {
    /// The pod template's labels (what Services and PodDisruptionBudgets select on).
    pub fn labels(&self) -> &BTreeMap<String, String> {
        static NONE: BTreeMap<String, String> = BTreeMap::new();
        self.template
            .metadata
            .as_ref()
            .and_then(|m| m.labels.as_ref())
            .unwrap_or(&NONE)
    }
}

/// An object with where it came from.
#[derive(Clone, Debug)]
pub struct At<T> {
    pub location: Location,
    pub object: T,
}

/// Everything read from all inputs.
#[derive(Clone, Debug, Default)]
pub struct Inventory {
    pub workloads: Vec<Workload>,
    pub services: Vec<At<corev1::Service>>,
    pub pdbs: Vec<At<policyv1::PodDisruptionBudget>>,
    /// Nodes present in the input (used as the node count when `--nodes` is not given).
    pub nodes: usize,
    pub errors: Vec<ManifestError>,
    /// (kind, namespace, name) → position in `services` / `pdbs`, for replacing a
    /// redefinition without a scan.
    positions: HashMap<(&'static str, String, String), usize>,
    /// File → the 1-based line each YAML document starts on, when unambiguous.
    document_lines: HashMap<String, Vec<usize>>,
}

impl Inventory {
    /// Adds one file's text (`file` names it in reports; `.json` selects the JSON reader).
    pub fn add_file(&mut self, file: &str, text: &str) {
        if let Some(lines) = document_start_lines(file, text) {
            self.document_lines.insert(file.to_string(), lines);
        }
        let (values, errors) = documents(file, text);
        self.errors.extend(errors);
        for (location, value) in values {
            self.add_value(location, value);
        }
    }

    /// The 1-based line a located object's document starts on (for SARIF regions), when
    /// it can be told for sure.
    pub fn line_of(&self, location: &Location) -> Option<usize> {
        self.document_lines
            .get(&location.file)?
            .get(location.document)
            .copied()
    }

    fn add_value(&mut self, location: Location, v: Value) {
        let kind = v
            .get("kind")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let api_version = v
            .get("apiVersion")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let what = describe(&v, Some("default"));
        let fail = |inv: &mut Self, (field, reason): (String, String)| {
            inv.errors.push(ManifestError {
                location: location.clone(),
                what: what.clone(),
                field,
                reason,
            })
        };
        match (kind.as_str(), api_version.as_str()) {
            ("Deployment", "apps/v1" | "") => match typed::<appsv1::Deployment>(v) {
                Ok(d) => self.workloads.push(from_deployment(d, location.clone())),
                Err(e) => fail(self, e),
            },
            ("StatefulSet", "apps/v1" | "") => match typed::<appsv1::StatefulSet>(v) {
                Ok(s) => self.workloads.push(from_stateful_set(s, location.clone())),
                Err(e) => fail(self, e),
            },
            ("DaemonSet", "apps/v1" | "") => match typed::<appsv1::DaemonSet>(v) {
                Ok(d) => self.workloads.push(from_daemon_set(d, location.clone())),
                Err(e) => fail(self, e),
            },
            ("Service", "v1" | "") => match typed::<corev1::Service>(v) {
                Ok(object) => {
                    let key = key("Service", &object.metadata);
                    let new = At {
                        location: location.clone(),
                        object,
                    };
                    replace_or_push(&mut self.services, &mut self.positions, key, new)
                }
                Err(e) => fail(self, e),
            },
            ("PodDisruptionBudget", "policy/v1" | "") => {
                match typed::<policyv1::PodDisruptionBudget>(v) {
                    Ok(object) => {
                        let key = key("PodDisruptionBudget", &object.metadata);
                        let new = At {
                            location: location.clone(),
                            object,
                        };
                        replace_or_push(&mut self.pdbs, &mut self.positions, key, new)
                    }
                    Err(e) => fail(self, e),
                }
            }
            ("Node", "v1" | "") => self.nodes += 1,
            ("", _) if !v.is_object() => fail(self, (".".into(), "not an object".into())),
            // Everything else (ConfigMaps, Ingresses, older API versions, …) is not ours.
            _ => {}
        }
    }
}

/// Where each YAML document of `text` starts (1-based), counting `---` lines the way
/// `kproxy_core::manifest::documents` numbers documents. Only for the unambiguous shape:
/// YAML (not `.json`), no `---` before the first content line, no `...` end markers, only
/// bare `---` separators (nothing after them on the line), and no document that is empty (the parser may
/// or may not count those). Otherwise `None`: no line beats a wrong line.
fn document_start_lines(file: &str, text: &str) -> Option<Vec<usize>> {
    if file.ends_with(".json") {
        return None;
    }
    let is_content = |l: &str| {
        let t = l.trim();
        !t.is_empty() && !t.starts_with('#')
    };
    let mut starts = Vec::new();
    let mut current: Option<usize> = None; // first content line of the open document
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.starts_with("...") {
            return None;
        }
        if line.starts_with("---") {
            // `--- # comment` or `--- {inline}`: parsers and core's fallback splitter
            // disagree on those; give up rather than guess.
            if line.trim_end() != "---" {
                return None;
            }
            let first = current.take()?; // `---` with no content before it: ambiguous
            starts.push(first);
            continue;
        }
        if current.is_none() && is_content(line) {
            current = Some(n);
        }
    }
    if let Some(first) = current {
        starts.push(first);
    }
    Some(starts)
}

/// A cluster holds one Service (one PodDisruptionBudget) per namespace/name: a later
/// definition of the same object replaces the earlier one, as `kubectl apply` of the files
/// in order would. (Workloads are all kept: each definition is checked and reported.)
fn replace_or_push<T>(
    list: &mut Vec<At<T>>,
    positions: &mut HashMap<(&'static str, String, String), usize>,
    key: (&'static str, String, String),
    new: At<T>,
) {
    match positions.get(&key) {
        Some(&i) => list[i] = new,
        None => {
            positions.insert(key, list.len());
            list.push(new);
        }
    }
}

fn key(
    kind: &'static str,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> (&'static str, String, String) {
    (
        kind,
        namespace_of(meta),
        meta.name.clone().unwrap_or_default(),
    )
}

/// The namespace an object lives in, borrowed (`default` when unset).
pub fn namespace_str(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> &str {
    meta.namespace
        .as_deref()
        .filter(|n| !n.is_empty())
        .unwrap_or("default")
}

/// The namespace an object lives in (`default` when unset, as `kubectl apply` does).
pub fn namespace_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> String {
    meta.namespace
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "default".to_string())
}

fn workload_ref(
    kind: WorkloadKind,
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    location: Location,
) -> WorkloadRef {
    WorkloadRef {
        kind,
        namespace: namespace_of(meta),
        name: meta.name.clone().unwrap_or_default(),
        location,
    }
}

fn annotations(
    meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    template: &corev1::PodTemplateSpec,
) -> BTreeMap<String, String> {
    let mut a = meta.annotations.clone().unwrap_or_default();
    if let Some(t) = template
        .metadata
        .as_ref()
        .and_then(|m| m.annotations.as_ref())
    {
        a.extend(t.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    a
}

fn from_deployment(d: appsv1::Deployment, location: Location) -> Workload {
    let spec = d.spec.unwrap_or_default();
    let strategy = match spec.strategy {
        Some(s) if s.type_.as_deref() == Some("Recreate") => Strategy::Recreate,
        Some(s) => Strategy::RollingUpdate {
            max_surge: s.rolling_update.as_ref().and_then(|r| r.max_surge.clone()),
            max_unavailable: s.rolling_update.and_then(|r| r.max_unavailable),
        },
        None => Strategy::RollingUpdate {
            max_surge: None,
            max_unavailable: None,
        },
    };
    Workload {
        id: workload_ref(WorkloadKind::Deployment, &d.metadata, location),
        replicas: Some(spec.replicas.unwrap_or(1)),
        min_ready_seconds: spec.min_ready_seconds.unwrap_or(0),
        strategy,
        annotations: annotations(&d.metadata, &spec.template),
        template: spec.template,
    }
}

fn from_stateful_set(s: appsv1::StatefulSet, location: Location) -> Workload {
    let spec = s.spec.unwrap_or_default();
    let strategy = match spec.update_strategy {
        Some(u) if u.type_.as_deref() == Some("OnDelete") => Strategy::OnDelete,
        Some(u) => Strategy::RollingUpdate {
            max_surge: None,
            max_unavailable: u.rolling_update.and_then(|r| r.max_unavailable),
        },
        None => Strategy::RollingUpdate {
            max_surge: None,
            max_unavailable: None,
        },
    };
    Workload {
        id: workload_ref(WorkloadKind::StatefulSet, &s.metadata, location),
        replicas: Some(spec.replicas.unwrap_or(1)),
        min_ready_seconds: spec.min_ready_seconds.unwrap_or(0),
        strategy,
        annotations: annotations(&s.metadata, &spec.template),
        template: spec.template,
    }
}

fn from_daemon_set(d: appsv1::DaemonSet, location: Location) -> Workload {
    let spec = d.spec.unwrap_or_default();
    let strategy = match spec.update_strategy {
        Some(u) if u.type_.as_deref() == Some("OnDelete") => Strategy::OnDelete,
        Some(u) => Strategy::RollingUpdate {
            max_surge: u.rolling_update.as_ref().and_then(|r| r.max_surge.clone()),
            max_unavailable: u.rolling_update.and_then(|r| r.max_unavailable),
        },
        None => Strategy::RollingUpdate {
            max_surge: None,
            max_unavailable: None,
        },
    };
    Workload {
        id: workload_ref(WorkloadKind::DaemonSet, &d.metadata, location),
        replicas: None,
        min_ready_seconds: spec.min_ready_seconds.unwrap_or(0),
        strategy,
        annotations: annotations(&d.metadata, &spec.template),
        template: spec.template,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_workload_is_reported_with_its_field_and_does_not_hide_the_others() {
        let text = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: bad, namespace: shop}
spec:
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      terminationGracePeriodSeconds: thirty
      containers: [{name: web, image: web}]
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: good}
spec:
  selector: {matchLabels: {app: ds}}
  template:
    metadata: {labels: {app: ds}}
    spec: {containers: [{name: ds, image: ds}]}
---
apiVersion: v1
kind: Node
metadata: {name: n1}
"#;
        let mut inv = Inventory::default();
        inv.add_file("w.yaml", text);
        assert_eq!(inv.errors.len(), 1, "{:?}", inv.errors);
        let e = &inv.errors[0];
        assert_eq!(e.what, "Deployment shop/bad");
        assert_eq!(e.field, ".spec.template.spec.terminationGracePeriodSeconds");
        assert_eq!(e.location.document, 0);
        assert_eq!(inv.workloads.len(), 1);
        assert_eq!(inv.workloads[0].id.to_string(), "DaemonSet default/good");
        assert_eq!(inv.workloads[0].replicas, None);
        assert_eq!(inv.nodes, 1);
    }

    #[test]
    fn document_start_lines_only_when_unambiguous() {
        let lines = |t: &str| document_start_lines("f.yaml", t);
        assert_eq!(
            lines("# c\na: 1\n---\n\n# d\nb: 2\n---  \nc: 3\n"),
            Some(vec![2, 6, 8])
        );
        assert_eq!(
            lines("a: 1\n--- # x\nb: 2\n"),
            None,
            "comment on the separator"
        );
        assert_eq!(lines("a: 1\n---\n"), Some(vec![1]));
        assert_eq!(lines("---\na: 1\n"), None, "leading separator");
        assert_eq!(lines("a: 1\n---\n---\nb: 2\n"), None, "empty document");
        assert_eq!(lines("a: 1\n...\n"), None, "end marker");
        assert_eq!(
            lines("a: 1\n--- {b: 2}\n"),
            None,
            "content on the separator"
        );
        assert_eq!(document_start_lines("f.json", "{}"), None);
        // The numbering agrees with kproxy_core::manifest::documents.
        let text = "kind: A\n---\n# c\nkind: B\n---\nkind: C\n";
        let (docs, _) = documents("f.yaml", text);
        let starts = lines(text).unwrap();
        for (loc, v) in docs {
            let kind = v["kind"].as_str().unwrap();
            assert_eq!(
                text.lines().nth(starts[loc.document] - 1),
                Some(format!("kind: {kind}").as_str())
            );
        }
    }

    #[test]
    fn list_items_and_json_are_read() {
        let text = r#"{"apiVersion":"v1","kind":"List","items":[
          {"apiVersion":"policy/v1","kind":"PodDisruptionBudget","metadata":{"name":"p","namespace":"d"},"spec":{"minAvailable":1}},
          {"apiVersion":"apps/v1","kind":"StatefulSet","metadata":{"name":"s","namespace":"d"},
           "spec":{"replicas":3,"selector":{},"template":{"spec":{"containers":[]}},"updateStrategy":{"type":"OnDelete"}}}]}"#;
        let mut inv = Inventory::default();
        inv.add_file("l.json", text);
        assert!(inv.errors.is_empty(), "{:?}", inv.errors);
        assert_eq!(inv.pdbs.len(), 1);
        assert_eq!(inv.workloads[0].strategy, Strategy::OnDelete);
        assert_eq!(inv.workloads[0].replicas, Some(3));
        assert_eq!(inv.workloads[0].id.location.item, Some(1));
    }
}
