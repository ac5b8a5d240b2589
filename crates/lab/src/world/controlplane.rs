//! Control plane emulation: a store of the Pods behind one Service, the
//! EndpointSlice controller's derivation of endpoint conditions from pod state, and
//! publication to every node's kproxy through the manifest source (files in a
//! per-node directory, written atomically) after a propagation delay.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::LabError;
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::service::{
    SERVICE_NAME, SERVICE_NAMESPACE, TAINT_TO_BE_DELETED, lab_service, lab_service_status,
};
use crate::world::fabric;
use crate::world::timeline::{EventKind, Recorder};

/// A pod as the API server knows it (only what the EndpointSlice controller reads).
#[derive(Clone, Debug, PartialEq)]
pub struct PodRecord {
    pub name: String,
    pub node: String,
    pub ip: Option<Ipv4Addr>,
    /// The pod's Ready condition.
    pub ready: bool,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
    /// status.phase is Failed or Succeeded.
    pub finished: bool,
}

/// The conditions of one endpoint, as the EndpointSlice controller sets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conditions {
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
}

/// Whether a pod gets an endpoint at all, and with which conditions. Mirrors
/// kubernetes/pkg/controller/endpointslice (podToEndpoint, ShouldPodBeInEndpoints
/// with includeTerminating=true):
/// - no pod IP, or phase Failed/Succeeded: no endpoint;
/// - serving = publishNotReadyAddresses || pod Ready;
/// - terminating = deletionTimestamp set;
/// - ready = publishNotReadyAddresses || (serving && !terminating).
pub fn endpoint_conditions(
    pod: &PodRecord,
    publish_not_ready_addresses: bool,
) -> Option<Conditions> {
    if pod.ip.is_none() || pod.finished {
        return None;
    }
    let serving = publish_not_ready_addresses || pod.ready;
    let terminating = pod.deleting;
    let ready = publish_not_ready_addresses || (serving && !terminating);
    Some(Conditions {
        ready,
        serving,
        terminating,
    })
}

/// What the emulated API server holds besides the Pods: the Nodes (some tainted for
/// scale-down, some deleted) and the shape of the lab's Service.
#[derive(Clone, Debug, PartialEq)]
pub struct Objects {
    pub nodes: usize,
    /// Nodes (1-based) carrying the `ToBeDeletedByClusterAutoscaler` taint, with the
    /// taint's value (the time it was set, Unix seconds, as the autoscaler writes it).
    pub tainted: BTreeMap<usize, i64>,
    /// Nodes (1-based) whose Node object is gone.
    pub deleted: BTreeSet<usize>,
    /// Nodes (1-based) with a drain condition of KEP-5683 (its type) set "True".
    pub conditions: BTreeMap<usize, &'static str>,
    pub publish_not_ready_addresses: bool,
    /// `externalTrafficPolicy: Local` (with a healthCheckNodePort); else `Cluster`.
    pub etp_local: bool,
}

impl Objects {
    pub fn new(nodes: usize, publish_not_ready_addresses: bool, etp_local: bool) -> Objects {
        Objects {
            nodes,
            tainted: BTreeMap::new(),
            deleted: BTreeSet::new(),
            conditions: BTreeMap::new(),
            publish_not_ready_addresses,
            etp_local,
        }
    }
}

/// The node objects, the Service and its EndpointSlice as one `kind: List`.
pub fn render_manifests(
    objects: &Objects,
    pods: &BTreeMap<String, PodRecord>,
    trigger_time: Option<jiff::Timestamp>,
) -> Value {
    let publish_not_ready_addresses = objects.publish_not_ready_addresses;
    let mut items = Vec::new();
    for i in (1..=objects.nodes).filter(|i| !objects.deleted.contains(i)) {
        let name = fabric::node_name(i);
        let mut spec = json!({"podCIDR": format!("10.244.{i}.0/24"), "podCIDRs": [format!("10.244.{i}.0/24")]});
        if let Some(t) = objects.tainted.get(&i) {
            spec["taints"] = json!([{"key": TAINT_TO_BE_DELETED, "value": t.to_string(), "effect": "NoSchedule"}]);
        }
        let mut node = json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "spec": spec,
            "status": {"addresses": [
                {"type": "InternalIP", "address": fabric::node_ip(i).to_string()},
                {"type": "Hostname", "address": name}
            ]}
        });
        if let Some(kind) = objects.conditions.get(&i) {
            node["status"]["conditions"] = json!([{"type": kind, "status": "True"}]);
        }
        items.push(node);
    }
    let mut service = lab_service(publish_not_ready_addresses, objects.etp_local);
    service["status"] = lab_service_status();
    items.push(service);
    let endpoints: Vec<Value> = pods
        .values()
        .filter_map(|p| {
            let c = endpoint_conditions(p, publish_not_ready_addresses)?;
            Some(json!({
                "addresses": [p.ip?.to_string()],
                "conditions": {"ready": c.ready, "serving": c.serving, "terminating": c.terminating},
                "nodeName": p.node,
                "targetRef": {"kind": "Pod", "namespace": SERVICE_NAMESPACE, "name": p.name}
            }))
        })
        .collect();
    let mut annotations = serde_json::Map::new();
    if let Some(t) = trigger_time {
        annotations.insert(
            "endpoints.kubernetes.io/last-change-trigger-time".into(),
            Value::String(t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()),
        );
    }
    items.push(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{SERVICE_NAME}-lab01"), "namespace": SERVICE_NAMESPACE,
            "labels": {"kubernetes.io/service-name": SERVICE_NAME,
                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"},
            "annotations": annotations
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "protocol": "TCP", "port": crate::scenario::service::POD_PORT}],
        "endpoints": endpoints
    }));
    json!({"apiVersion": "v1", "kind": "List", "items": items})
}

/// Write `content` as `dir/lab.json` atomically (temp file whose name the manifest
/// source ignores, then rename).
pub fn write_atomically(dir: &Path, content: &[u8]) -> Result<(), LabError> {
    let tmp = dir.join(".lab.json.tmp");
    let dst = dir.join("lab.json");
    std::fs::write(&tmp, content).map_err(|e| LabError::Io {
        what: format!("write {}", tmp.display()),
        source: e,
    })?;
    std::fs::rename(&tmp, &dst).map_err(|e| LabError::Io {
        what: format!("rename to {}", dst.display()),
        source: e,
    })
}

struct Store {
    objects: Objects,
    pods: BTreeMap<String, PodRecord>,
    last_published: Option<String>,
}

/// The control plane: pod store + EndpointSlice controller + publisher.
#[derive(Clone)]
pub struct ControlPlane {
    store: Arc<Mutex<Store>>,
    tx: mpsc::UnboundedSender<(Instant, String)>,
    recorder: Recorder,
}

impl ControlPlane {
    /// [`ControlPlane::start`] for a run whose nodes' kproxies read manifests: the lab
    /// Service (eTP=Local, or Cluster for a node drain) over `fabric`'s nodes, published
    /// after `cfg`'s propagation delay into one directory per node,
    /// `workdir/<node name>`, returned in node order.
    pub fn start_for_nodes(
        fabric: &fabric::Fabric,
        workdir: &Path,
        cfg: &RolloutConfig,
        etp_local: bool,
        recorder: Recorder,
    ) -> Result<(ControlPlane, Vec<PathBuf>), LabError> {
        let dirs: Vec<PathBuf> = fabric.nodes.iter().map(|n| workdir.join(&n.name)).collect();
        let cp = ControlPlane::start(
            Objects::new(
                fabric.nodes.len(),
                cfg.publish_not_ready_addresses,
                etp_local,
            ),
            dirs.clone(),
            recorder.clock().real(cfg.propagation_delay_seconds),
            recorder,
        )?;
        Ok((cp, dirs))
    }

    /// Start the publisher task (on the current tokio runtime) writing to `dirs`
    /// after `propagation` (real time).
    pub fn start(
        objects: Objects,
        dirs: Vec<PathBuf>,
        propagation: Duration,
        recorder: Recorder,
    ) -> Result<ControlPlane, LabError> {
        let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, String)>();
        let rec = recorder.clone();
        let initial =
            serde_json::to_string_pretty(&render_manifests(&objects, &BTreeMap::new(), None))
                .map_err(|e| LabError::Invalid(e.to_string()))?;
        for d in &dirs {
            std::fs::create_dir_all(d).map_err(|e| LabError::Io {
                what: format!("mkdir {}", d.display()),
                source: e,
            })?;
            write_atomically(d, initial.as_bytes())?;
        }
        tokio::spawn(async move {
            // One writer, in order: every change reaches every node after the same delay.
            while let Some((changed_at, content)) = rx.recv().await {
                tokio::time::sleep_until((changed_at + propagation).into()).await;
                for d in &dirs {
                    if let Err(e) = write_atomically(d, content.as_bytes()) {
                        rec.record(EventKind::Note, None, None, format!("publish failed: {e}"));
                    }
                }

                rec.record(EventKind::SlicePublished, None, None, summarize(&content));
            }
        });
        Ok(ControlPlane {
            store: Arc::new(Mutex::new(Store {
                objects,
                pods: BTreeMap::new(),
                last_published: None,
            })),
            tx,
            recorder,
        })
    }

    /// Apply a change to one pod (insert/replace) and publish if the slice changed.
    pub fn upsert_pod(&self, pod: PodRecord) {
        let mut s = self.store.lock().expect("store lock");
        s.pods.insert(pod.name.clone(), pod);
        self.publish_locked(&mut s);
    }

    pub fn update_pod(&self, name: &str, f: impl FnOnce(&mut PodRecord)) {
        let mut s = self.store.lock().expect("store lock");
        if let Some(p) = s.pods.get_mut(name) {
            f(p);
        }
        self.publish_locked(&mut s);
    }

    pub fn remove_pod(&self, name: &str) {
        let mut s = self.store.lock().expect("store lock");
        s.pods.remove(name);
        self.publish_locked(&mut s);
    }

    /// The cluster autoscaler taints node `index` `ToBeDeletedByClusterAutoscaler`.
    pub fn taint_node(&self, index: usize) {
        let mut s = self.store.lock().expect("store lock");
        s.objects
            .tainted
            .insert(index, jiff::Timestamp::now().as_second());
        self.publish_locked(&mut s);
    }

    /// A drain condition of KEP-5683 (`kind`) turns "True" on node `index`.
    pub fn set_node_condition(&self, index: usize, kind: &'static str) {
        let mut s = self.store.lock().expect("store lock");
        s.objects.conditions.insert(index, kind);
        self.publish_locked(&mut s);
    }

    /// Node `index`'s Node object is deleted.
    pub fn delete_node(&self, index: usize) {
        let mut s = self.store.lock().expect("store lock");
        s.objects.deleted.insert(index);
        self.publish_locked(&mut s);
    }

    pub fn pods(&self) -> BTreeMap<String, PodRecord> {
        self.store.lock().expect("store lock").pods.clone()
    }

    fn publish_locked(&self, s: &mut Store) {
        let now = jiff::Timestamp::now();
        let doc = render_manifests(&s.objects, &s.pods, Some(now));
        // Compare without the trigger-time annotation: only real changes publish.
        let key =
            serde_json::to_string(&render_manifests(&s.objects, &s.pods, None)).unwrap_or_default();
        if s.last_published.as_deref() == Some(key.as_str()) {
            return;
        }
        s.last_published = Some(key);
        let content = serde_json::to_string_pretty(&doc).unwrap_or_default();
        if self.tx.send((Instant::now(), content)).is_err() {
            self.recorder.record(
                EventKind::Note,
                None,
                None,
                "control plane publisher stopped",
            );
        }
    }
}

/// One line per endpoint for the timeline: `pod@node r/s/t`.
pub(crate) fn summarize(content: &str) -> String {
    let Ok(v) = serde_json::from_str::<Value>(content) else {
        return String::new();
    };
    let mut parts = Vec::new();
    for item in v["items"].as_array().into_iter().flatten() {
        if item["kind"] == "EndpointSlice" {
            for ep in item["endpoints"].as_array().into_iter().flatten() {
                let c = &ep["conditions"];
                let flag = |k: &str, ch: char| if c[k] == true { ch } else { '-' };
                parts.push(format!(
                    "{}@{}:{}{}{}",
                    ep["targetRef"]["name"].as_str().unwrap_or("?"),
                    ep["nodeName"].as_str().unwrap_or("?"),
                    flag("ready", 'R'),
                    flag("serving", 'S'),
                    flag("terminating", 'T')
                ));
            }
        }
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ip: bool, ready: bool, deleting: bool, finished: bool) -> PodRecord {
        PodRecord {
            name: "p".into(),
            node: "node-1".into(),
            ip: ip.then_some(Ipv4Addr::new(10, 244, 1, 2)),
            ready,
            deleting,
            finished,
        }
    }

    fn c(ready: bool, serving: bool, terminating: bool) -> Option<Conditions> {
        Some(Conditions {
            ready,
            serving,
            terminating,
        })
    }

    /// The documented rules (KEP-1672, EndpointSlice API reference, v1.26 blog):
    /// ready is false for every terminating pod unless publishNotReadyAddresses;
    /// serving follows the Ready condition regardless of termination.
    #[test]
    fn conditions_follow_the_endpointslice_controller() {
        let table = [
            // (has ip, pod Ready, deletionTimestamp, finished, publishNotReady) -> conditions
            ((true, true, false, false, false), c(true, true, false)),
            ((true, false, false, false, false), c(false, false, false)),
            ((true, true, true, false, false), c(false, true, true)),
            ((true, false, true, false, false), c(false, false, true)),
            ((false, true, false, false, false), None),
            ((true, true, false, true, false), None),
            ((true, false, false, false, true), c(true, true, false)),
            ((true, false, true, false, true), c(true, true, true)),
            ((true, true, true, false, true), c(true, true, true)),
        ];
        for ((ip, ready, deleting, finished, pnr), want) in table {
            assert_eq!(
                endpoint_conditions(&pod(ip, ready, deleting, finished), pnr),
                want,
                "ip={ip} ready={ready} deleting={deleting} finished={finished} publishNotReady={pnr}"
            );
        }
    }

    #[test]
    fn manifests_parse_with_kproxy_core() {
        let mut pods = BTreeMap::new();
        pods.insert("p".to_string(), pod(true, true, true, false));
        let doc = render_manifests(
            &Objects::new(2, false, true),
            &pods,
            Some(jiff::Timestamp::UNIX_EPOCH),
        );
        let text = serde_json::to_string(&doc).unwrap();
        assert!(text.contains("last-change-trigger-time"));
        assert!(text.contains("\"terminating\":true"));
        let s = summarize(&text);
        assert_eq!(s, "p@node-1:-ST");
        let parsed = kproxy_core::manifest::parse("lab.json", &text);
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        assert_eq!(
            parsed.objects.len(),
            4,
            "2 nodes, the Service, the EndpointSlice"
        );
    }

    /// The drain row's objects: a tainted Node carries the autoscaler's taint as kproxy
    /// reads it, a deleted Node is gone, and an eTP-Cluster Service has no health
    /// check node port.
    #[test]
    fn drained_nodes_and_cluster_policy_render_as_kproxy_reads_them() {
        let mut objects = Objects::new(3, false, false);
        objects.tainted.insert(2, 1_732_270_000);
        objects.deleted.insert(3);
        let doc = render_manifests(&objects, &BTreeMap::new(), None);
        let text = serde_json::to_string(&doc).unwrap();
        let parsed = kproxy_core::manifest::parse("lab.json", &text);
        assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
        assert_eq!(
            parsed.objects.len(),
            4,
            "2 nodes, the Service, the EndpointSlice"
        );
        let mut st = kproxy_core::ClusterState::new();
        for o in &parsed.objects {
            st.apply(&o.object, &Default::default(), "node-2")
                .expect("valid object");
        }
        let node = st.node().expect("node-2 is known");
        assert!(node.to_be_deleted_by_autoscaler && !node.eligible());
        assert!(!text.contains("node-3"), "a deleted node is not listed");
        assert!(text.contains("\"externalTrafficPolicy\":\"Cluster\""));
        assert!(!text.contains("healthCheckNodePort"));
        let local = serde_json::to_string(&lab_service(false, true)).unwrap();
        assert!(local.contains("\"healthCheckNodePort\":32000"));
    }
}
