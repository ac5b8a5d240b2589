//! The lab as kubelet and scheduler for the real control plane: [`Agent`] binds the
//! Pods kcm's ReplicaSet controller creates to a lab node and starts them, and starts a
//! pod's termination at its deletionTimestamp; [`PodStatusWriter`] writes what the
//! kubelet observes through the status subresource, in order, and removes a Pod
//! object once its container ended.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::deployment::REVISION_ANNOTATION;
use super::{Steady, now_rfc3339};
use crate::scenario::service::SERVICE_NAMESPACE;
use crate::world::cluster::{Cluster, PodApi, PodRuntime};
use crate::world::fabric;
use crate::world::timeline::{EventKind, Recorder};

enum Write {
    Status(String, Value),
    Delete(String),
}

/// The kubelet's status manager: writes, in order, through the status subresource.
pub struct PodStatusWriter {
    tx: mpsc::UnboundedSender<Write>,
    started: Mutex<HashMap<String, String>>,
    recorder: Recorder,
}

impl PodStatusWriter {
    /// Start the writer task on the current runtime.
    pub fn start(client: kube::Client, recorder: Recorder) -> Arc<PodStatusWriter> {
        let (tx, mut rx) = mpsc::unbounded_channel::<Write>();
        let rec = recorder.clone();
        tokio::spawn(async move {
            let api: Api<Pod> = Api::namespaced(client, SERVICE_NAMESPACE);
            while let Some(w) = rx.recv().await {
                let (name, res) = match w {
                    Write::Status(name, v) => {
                        let r = api
                            .patch_status(&name, &PatchParams::default(), &Patch::Merge(v))
                            .await
                            .map(|_| ());
                        (name, r)
                    }
                    Write::Delete(name) => {
                        let r = api
                            .delete(&name, &DeleteParams::default().grace_period(0))
                            .await
                            .map(|_| ());
                        (name, r)
                    }
                };
                if let Err(e) = res {
                    rec.record(
                        EventKind::Note,
                        None,
                        Some(&name),
                        format!("kubelet status write failed: {e}"),
                    );
                }
            }
        });
        Arc::new(PodStatusWriter {
            tx,
            started: Mutex::new(HashMap::new()),
            recorder,
        })
    }

    fn send(&self, w: Write) {
        if self.tx.send(w).is_err() {
            self.recorder
                .record(EventKind::Note, None, None, "kubelet status writer stopped");
        }
    }

    fn start_time(&self, pod: &PodRuntime) -> String {
        self.started
            .lock()
            .expect("started lock")
            .entry(pod.name.clone())
            .or_insert_with(now_rfc3339)
            .clone()
    }
}

/// The Pod status a kubelet writes for a running container.
pub fn running_status(pod: &PodRuntime, ready: bool, started_at: &str, changed_at: &str) -> Value {
    let node_ip = fabric::node_ip(pod.node_index).to_string();
    let r = if ready { "True" } else { "False" };
    json!({"status": {
        "phase": "Running",
        "hostIP": node_ip, "hostIPs": [{"ip": node_ip}],
        "podIP": pod.ip.to_string(), "podIPs": [{"ip": pod.ip.to_string()}],
        "startTime": started_at,
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": started_at},
            {"type": "Initialized", "status": "True", "lastTransitionTime": started_at},
            {"type": "ContainersReady", "status": r, "lastTransitionTime": changed_at},
            {"type": "Ready", "status": r, "lastTransitionTime": changed_at}
        ],
        "containerStatuses": [{
            "name": "web", "image": format!("kproxy-lab/web:{}", pod.revision), "imageID": "",
            "ready": ready, "started": true, "restartCount": 0,
            "state": {"running": {"startedAt": started_at}}
        }]
    }})
}

/// The terminal status the kubelet writes for a deleted pod whose container ended:
/// phase Succeeded after a clean exit, Failed after SIGKILL (exit code 137).
pub fn terminated_status(pod: &PodRuntime, killed: bool, started_at: &str) -> Value {
    let now = now_rfc3339();
    let mut v = running_status(pod, false, started_at, &now);
    let (phase, code, reason) = if killed {
        ("Failed", 137, "Error")
    } else {
        ("Succeeded", 0, "Completed")
    };
    v["status"]["phase"] = json!(phase);
    v["status"]["containerStatuses"][0]["started"] = json!(false);
    v["status"]["containerStatuses"][0]["state"] = json!({"terminated": {
        "exitCode": code, "reason": reason, "startedAt": started_at, "finishedAt": now}});
    v
}

impl PodApi for PodStatusWriter {
    fn started(&self, pod: &PodRuntime) {
        let t0 = self.start_time(pod);
        self.send(Write::Status(
            pod.name.clone(),
            running_status(pod, false, &t0, &t0),
        ));
    }
    fn ready_changed(&self, pod: &PodRuntime, ready: bool) {
        let t0 = self.start_time(pod);
        self.send(Write::Status(
            pod.name.clone(),
            running_status(pod, ready, &t0, &now_rfc3339()),
        ));
    }
    fn deleting(&self, _pod: &PodRuntime) {
        // The deletion came from the API server; nothing to write.
    }
    fn gone(&self, pod: &PodRuntime, killed: bool) {
        let t0 = self.start_time(pod);
        self.send(Write::Status(
            pod.name.clone(),
            terminated_status(pod, killed, &t0),
        ));
        self.send(Write::Delete(pod.name.clone()));
        self.started.lock().expect("started lock").remove(&pod.name);
    }
}

/// The lab's scheduler and kubelet front: Pods created by kcm's ReplicaSet
/// controller are bound to a node with room (one-pod-per-node counts terminating
/// pods, as the scheduler does) and started; a deletionTimestamp starts the
/// kubelet's termination.
pub struct Agent;

impl Agent {
    pub async fn run(client: kube::Client, cluster: Arc<Cluster>, rec: Recorder) {
        let api: Api<Pod> = Api::namespaced(client.clone(), SERVICE_NAMESPACE);
        let mut events = watcher::watcher(api.clone(), watcher::Config::default())
            .backoff(Steady)
            .boxed();
        // Pods waiting for a node, by name: their revision.
        let mut pending: BTreeMap<String, u32> = BTreeMap::new();
        let mut bound: HashSet<String> = HashSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        loop {
            tokio::select! {
                ev = events.next() => {
                    let Some(ev) = ev else { return };
                    match ev {
                        Ok(watcher::Event::Apply(p)) | Ok(watcher::Event::InitApply(p)) => {
                            Self::observe(&cluster, &rec, &p, &mut pending, &bound);
                        }
                        Ok(watcher::Event::Delete(p)) => {
                            if let Some(n) = p.metadata.name.as_deref() {
                                pending.remove(n);
                            }
                        }
                        Ok(_) => {}
                        Err(e) => rec.record(EventKind::Note, None, None, format!("pod watch: {e}")),
                    }
                }
                _ = tick.tick() => {}
            }
            Self::schedule(&api, &cluster, &rec, &mut pending, &mut bound).await;
        }
    }

    fn observe(
        cluster: &Arc<Cluster>,
        rec: &Recorder,
        p: &Pod,
        pending: &mut BTreeMap<String, u32>,
        bound: &HashSet<String>,
    ) {
        let Some(name) = p.metadata.name.clone() else {
            return;
        };
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        if p.metadata.deletion_timestamp.is_some() {
            pending.remove(&name);
            if bound.contains(&name) {
                cluster.kubelet_delete(&name);
            }
            return;
        }
        if node.is_none() && !bound.contains(&name) && !pending.contains_key(&name) {
            let revision = p
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(REVISION_ANNOTATION))
                .and_then(|r| r.parse().ok())
                .unwrap_or(0);
            rec.record(
                EventKind::Note,
                None,
                Some(&name),
                format!("ReplicaSet controller created pod (revision {revision})"),
            );
            pending.insert(name, revision);
        }
    }

    async fn schedule(
        api: &Api<Pod>,
        cluster: &Arc<Cluster>,
        rec: &Recorder,
        pending: &mut BTreeMap<String, u32>,
        bound: &mut HashSet<String>,
    ) {
        while let Some((name, revision)) = pending.first_key_value().map(|(n, r)| (n.clone(), *r)) {
            let Some(node_index) = cluster.schedule() else {
                return;
            };
            pending.remove(&name);
            let node = fabric::node_name(node_index);
            let binding = json!({
                "apiVersion": "v1", "kind": "Binding",
                "metadata": {"name": name, "namespace": SERVICE_NAMESPACE},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}
            });
            let res: Result<Value, kube::Error> = api
                .create_subresource("binding", &name, &PostParams::default(), &binding)
                .await;
            if let Err(e) = res {
                rec.record(
                    EventKind::Note,
                    Some(&node),
                    Some(&name),
                    format!("binding failed: {e}"),
                );
                continue;
            }
            bound.insert(name.clone());
            if let Err(e) = cluster.start_pod(&name, revision, node_index) {
                rec.record(
                    EventKind::Note,
                    Some(&node),
                    Some(&name),
                    format!("kubelet could not start the pod: {e}"),
                );
            }
        }
    }
}
