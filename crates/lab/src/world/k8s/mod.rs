//! The real control plane (`--control-plane k8s-lab`): kube-apiserver and
//! kube-controller-manager of a k8s-lab instance (found through `K8S_LAB`, see
//! ../shared/tools/k8s-lab/README.md). kcm's Deployment controller performs the
//! rolling update and its EndpointSlice controller derives the endpoint conditions;
//! the lab plays only scheduler and kubelet:
//! - [`Agent`] watches the Pods, binds new ones to a lab node (the Node objects exist,
//!   see [`prepare`]) through the `binding` subresource and starts them
//!   ([`Cluster::start_pod`]); a deletionTimestamp starts the kubelet's termination
//!   ([`Cluster::kubelet_delete`]);
//! - [`PodStatusWriter`] writes what the kubelet observes through the status
//!   subresource (IP, Ready and ContainersReady, container state, terminal phase) and
//!   removes the Pod object (grace period 0) once its container ended, in order;
//! - [`heartbeat`] keeps the Nodes Ready (status conditions and node Lease) as a
//!   kubelet does, or kcm's node lifecycle controller would mark them NotReady after
//!   its grace period and set every pod on them not ready;
//! - [`ApiBridge`] lets each node's kproxy (`kproxy run --kubeconfig`, inside the node
//!   namespace) reach the API server on the host's loopback: a listener made inside
//!   the node namespace, connections made from the host namespace.
//!
//! What the real controllers publish (EndpointSlices) is watched into the run's
//! timeline ([`watch_slices`]) so the report can put both control planes side by side.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::LabError;
use crate::spec::service::{SERVICE_NAME, SERVICE_NAMESPACE};
use crate::spec::workload::{DeploymentSpec, PodTemplate};
use crate::world::cluster::{Cluster, PodApi, PodRuntime};
use crate::world::fabric;
use crate::world::timeline::{Clock, EventKind, Recorder};

/// The pod template annotation naming the lab revision (copied onto every pod).
pub const REVISION_ANNOTATION: &str = "kproxy-lab/revision";
const FIELD_MANAGER: &str = "kproxy-lab";

/// A k8s-lab instance: its directory and the API server port its kubeconfigs name.
#[derive(Clone, Debug)]
pub struct K8sLab {
    pub dir: PathBuf,
    /// admin (system:masters): the lab's own client.
    pub admin_kubeconfig: PathBuf,
    /// system:kube-proxy: what every node's kproxy uses, as a real kube-proxy.
    pub proxy_kubeconfig: PathBuf,
    pub api_port: u16,
}

impl K8sLab {
    /// The instance named by `K8S_LAB`; a clear error when unset or incomplete.
    pub fn from_env() -> Result<K8sLab, LabError> {
        let dir = std::env::var_os("K8S_LAB").ok_or_else(|| {
            LabError::Invalid(
                "--control-plane k8s-lab needs K8S_LAB naming a running k8s-lab instance \
                 (kube-apiserver and kube-controller-manager; see ../shared/tools/k8s-lab/README.md)"
                    .into(),
            )
        })?;
        K8sLab::at(Path::new(&dir))
    }

    pub fn at(dir: &Path) -> Result<K8sLab, LabError> {
        let admin = dir.join("kubeconfig");
        let proxy = dir.join("kubeconfig-proxy");
        let text = std::fs::read_to_string(&admin).map_err(|e| LabError::Io {
            what: format!("read {} (K8S_LAB)", admin.display()),
            source: e,
        })?;
        if !proxy.exists() {
            return Err(LabError::Invalid(format!(
                "{}: missing (start the instance with start.sh start)",
                proxy.display()
            )));
        }
        let api_port = server_port(&text).ok_or_else(|| {
            LabError::Invalid(format!(
                "{}: clusters[0].cluster.server is not https://127.0.0.1:PORT",
                admin.display()
            ))
        })?;
        Ok(K8sLab {
            dir: dir.to_path_buf(),
            admin_kubeconfig: admin,
            proxy_kubeconfig: proxy,
            api_port,
        })
    }
}

/// The port of `server: https://127.0.0.1:PORT` in a kubeconfig.
fn server_port(kubeconfig: &str) -> Option<u16> {
    kubeconfig.lines().find_map(|l| {
        l.trim()
            .strip_prefix("server: https://127.0.0.1:")
            .and_then(|p| p.trim().parse().ok())
    })
}

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> LabError {
    let what = what.into();
    move |e| LabError::Invalid(format!("API server: {what}: {e}"))
}

fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// The lab's client (admin kubeconfig).
pub async fn client(lab: &K8sLab) -> Result<kube::Client, LabError> {
    kproxy_source::kube::client(Some(&lab.admin_kubeconfig))
        .await
        .map_err(|e| LabError::Invalid(format!("k8s-lab client: {e}")))
}

/// Remove what an earlier run left in the lab namespace: the Deployment, its
/// ReplicaSets and Pods (force: no kubelet of that run is left to finish them), the
/// Service; wait until the API and the EndpointSlice controller have caught up.
pub async fn clean(client: &kube::Client, limit: Duration) -> Result<(), LabError> {
    let ns = SERVICE_NAMESPACE;
    let nsapi: Api<Namespace> = Api::all(client.clone());
    nsapi
        .patch(
            ns,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
            ),
        )
        .await
        .map_err(api_err(format!("apply namespace {ns}")))?;
    let deps: Api<Deployment> = Api::namespaced(client.clone(), ns);
    match deps.delete(SERVICE_NAME, &DeleteParams::background()).await {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => {}
        Err(e) => return Err(api_err("delete deployment")(e)),
    }
    let rs: Api<k8s_openapi::api::apps::v1::ReplicaSet> = Api::namespaced(client.clone(), ns);
    let by_app = ListParams::default().labels(&format!("app={SERVICE_NAME}"));
    rs.delete_collection(&DeleteParams::background(), &by_app)
        .await
        .map_err(api_err("delete replicasets"))?;
    let svc: Api<Service> = Api::namespaced(client.clone(), ns);
    match svc.delete(SERVICE_NAME, &DeleteParams::default()).await {
        Ok(_) => {}
        Err(e) if is_not_found(&e) => {}
        Err(e) => return Err(api_err("delete service")(e)),
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let by_svc =
        ListParams::default().labels(&format!("kubernetes.io/service-name={SERVICE_NAME}"));
    let start = Instant::now();
    loop {
        pods.delete_collection(
            &DeleteParams::default().grace_period(0),
            &ListParams::default(),
        )
        .await
        .map_err(api_err("delete pods"))?;
        let left_pods = pods
            .list(&ListParams::default())
            .await
            .map_err(api_err("list pods"))?;
        let left_rs = rs
            .list(&by_app)
            .await
            .map_err(api_err("list replicasets"))?;
        let left_slices = slices
            .list(&by_svc)
            .await
            .map_err(api_err("list endpointslices"))?;
        let left_dep = deps
            .get_opt(SERVICE_NAME)
            .await
            .map_err(api_err("get deployment"))?;
        if left_pods.items.is_empty()
            && left_rs.items.is_empty()
            && left_slices.items.is_empty()
            && left_dep.is_none()
        {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(LabError::Invalid(format!(
                "k8s-lab: namespace {ns} not clean after {limit:?} ({} pods, {} replicasets, {} endpointslices left; is kube-controller-manager running?)",
                left_pods.items.len(),
                left_rs.items.len(),
                left_slices.items.len()
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the lab changed about its Nodes (a node drain): the lab owns these fields.
#[derive(Clone, Debug, Default)]
pub struct NodeChanges {
    /// Node (1-based) → the `ToBeDeletedByClusterAutoscaler` taint's value (Unix s).
    pub tainted: BTreeMap<usize, i64>,
    /// Nodes whose object the lab deleted (no heartbeat recreates them).
    pub deleted: std::collections::BTreeSet<usize>,
}

fn node_object(i: usize, changes: &NodeChanges) -> Value {
    let name = fabric::node_name(i);
    let mut spec =
        json!({"podCIDR": format!("10.244.{i}.0/24"), "podCIDRs": [format!("10.244.{i}.0/24")]});
    if let Some(t) = changes.tainted.get(&i) {
        spec["taints"] = json!([{"key": crate::spec::service::TAINT_TO_BE_DELETED,
            "value": t.to_string(), "effect": "NoSchedule"}]);
    }
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}},
        "spec": spec
    })
}

fn node_status(i: usize, since: &str) -> Value {
    let name = fabric::node_name(i);
    let now = now_rfc3339();
    json!({"status": {
        "addresses": [
            {"type": "InternalIP", "address": fabric::node_ip(i).to_string()},
            {"type": "Hostname", "address": name}
        ],
        "conditions": [{
            "type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "kproxy lab kubelet is posting ready status",
            "lastHeartbeatTime": now, "lastTransitionTime": since
        }]
    }})
}

fn lease_object(i: usize) -> Value {
    let name = fabric::node_name(i);
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S.%6fZ")
        .to_string();
    json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": name, "namespace": "kube-node-lease"},
        "spec": {"holderIdentity": name, "leaseDurationSeconds": 40, "renewTime": now}
    })
}

async fn beat(
    client: &kube::Client,
    nodes: usize,
    since: &str,
    changes: &Mutex<NodeChanges>,
) -> Result<(), LabError> {
    let napi: Api<Node> = Api::all(client.clone());
    let lapi: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "kube-node-lease");
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    for i in 1..=nodes {
        let name = fabric::node_name(i);
        let object = {
            let c = changes.lock().expect("node changes lock");
            if c.deleted.contains(&i) {
                continue;
            }
            node_object(i, &c)
        };
        napi.patch(&name, &pp, &Patch::Apply(object))
            .await
            .map_err(api_err(format!("apply node {name}")))?;
        napi.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(node_status(i, since)),
        )
        .await
        .map_err(api_err(format!("node {name} status")))?;
        lapi.patch(&name, &pp, &Patch::Apply(lease_object(i)))
            .await
            .map_err(api_err(format!("lease {name}")))?;
    }
    Ok(())
}

/// Create the lab's Nodes (Ready) and the Service (with the load balancer's
/// address in its status), as `controlplane::render_manifests` describes them.
pub async fn prepare(
    client: &kube::Client,
    nodes: usize,
    publish_not_ready_addresses: bool,
    etp_local: bool,
) -> Result<String, LabError> {
    let since = now_rfc3339();
    beat(client, nodes, &since, &Mutex::default()).await?;
    let svc: Api<Service> = Api::namespaced(client.clone(), SERVICE_NAMESPACE);
    let spec = crate::spec::service::lab_service(publish_not_ready_addresses, etp_local);
    svc.patch(
        SERVICE_NAME,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(spec),
    )
    .await
    .map_err(api_err("apply service"))?;
    svc.patch_status(
        SERVICE_NAME,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": crate::spec::service::lab_service_status()})),
    )
    .await
    .map_err(api_err("service status"))?;
    Ok(since)
}

/// Keep every lab Node Ready: status heartbeat and Lease renewal every 5 s (the
/// kubelet's defaults are 10 s, kcm's grace period 40-50 s).
pub async fn heartbeat(
    client: kube::Client,
    nodes: usize,
    since: String,
    changes: Arc<Mutex<NodeChanges>>,
    rec: Recorder,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(5));
    tick.tick().await;
    loop {
        tick.tick().await;
        if let Err(e) = beat(&client, nodes, &since, &changes).await {
            rec.record(EventKind::Note, None, None, format!("node heartbeat: {e}"));
        }
    }
}

/// The Deployment as the lab's configuration describes it. Only the rollout fields
/// drive anything (kcm's Deployment controller); the container, probe and preStop
/// are what the lab kubelet runs, in nominal seconds (the lab runs them on its
/// time scale). minReadySeconds is real: the controller reads it.
pub fn deployment_object(
    d: &DeploymentSpec,
    t: &PodTemplate,
    revision: u32,
    time_scale: f64,
) -> Value {
    let secs = |v: f64| v.ceil().max(0.0) as i64;
    let at_least_one = |v: f64| secs(v).max(1);
    let p = &t.readiness_probe;
    let mut container = json!({
        "name": "web", "image": format!("kproxy-lab/web:{revision}"),
        "ports": [{"containerPort": crate::spec::service::POD_PORT}],
        "readinessProbe": {
            "httpGet": {"path": "/", "port": crate::spec::service::POD_PORT},
            "initialDelaySeconds": secs(p.initial_delay_seconds),
            "periodSeconds": at_least_one(p.period_seconds),
            "timeoutSeconds": at_least_one(p.timeout_seconds),
            "successThreshold": p.success_threshold.max(1),
            "failureThreshold": p.failure_threshold.max(1)
        }
    });
    if t.pre_stop_sleep_seconds > 0.0 {
        container["lifecycle"] =
            json!({"preStop": {"sleep": {"seconds": at_least_one(t.pre_stop_sleep_seconds)}}});
    }
    let mut pod_spec = json!({
        "terminationGracePeriodSeconds": secs(t.termination_grace_period_seconds),
        "containers": [container]
    });
    if d.one_pod_per_node {
        pod_spec["affinity"] = json!({"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": SERVICE_NAME}}, "topologyKey": "kubernetes.io/hostname"}]}});
    }
    let min_ready = if d.min_ready_seconds > 0.0 {
        (d.min_ready_seconds * time_scale).ceil() as i64
    } else {
        0
    };
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": SERVICE_NAME, "namespace": SERVICE_NAMESPACE},
        "spec": {
            "replicas": d.replicas,
            "minReadySeconds": min_ready,
            "revisionHistoryLimit": 2,
            "selector": {"matchLabels": {"app": SERVICE_NAME}},
            "strategy": {"type": "RollingUpdate",
                         "rollingUpdate": {"maxSurge": d.max_surge, "maxUnavailable": d.max_unavailable}},
            "template": {
                "metadata": {"labels": {"app": SERVICE_NAME},
                             "annotations": {REVISION_ANNOTATION: revision.to_string()}},
                "spec": pod_spec
            }
        }
    })
}

/// Create the Deployment (revision 1) or roll it to `revision`.
pub async fn apply_deployment(
    client: &kube::Client,
    d: &DeploymentSpec,
    t: &PodTemplate,
    revision: u32,
    time_scale: f64,
) -> Result<(), LabError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), SERVICE_NAMESPACE);
    api.patch(
        SERVICE_NAME,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(deployment_object(d, t, revision, time_scale)),
    )
    .await
    .map_err(api_err(format!("apply deployment revision {revision}")))?;
    Ok(())
}

/// Whether kcm reports the rollout complete: the controller saw the latest spec,
/// every replica is updated and available, and no other replica is left.
pub fn deployment_complete(dep: &Deployment, replicas: u32) -> bool {
    let (Some(status), Some(generation)) = (dep.status.as_ref(), dep.metadata.generation) else {
        return false;
    };
    let r = replicas as i32;
    status.observed_generation.unwrap_or(0) >= generation
        && status.updated_replicas.unwrap_or(0) == r
        && status.available_replicas.unwrap_or(0) == r
        && status.replicas.unwrap_or(0) == r
}

pub async fn get_deployment(client: &kube::Client) -> Result<Option<Deployment>, LabError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), SERVICE_NAMESPACE);
    api.get_opt(SERVICE_NAME)
        .await
        .map_err(api_err("get deployment"))
}

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

/// The retry of the lab's own watches (its kubelet's Pods, its record of the
/// EndpointSlices) while the API server is away: steady and short, so the lab sees the
/// API's return at once (it observes; it is not the system under test), and not at
/// once, which spun thousands of failed requests and timeline notes a second through an
/// API outage.
struct Steady;

impl Iterator for Steady {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(Duration::from_millis(100))
    }
}

impl kube::runtime::utils::Backoff for Steady {
    fn reset(&mut self) {}
}

/// Record every change of the Service's endpoints as the real EndpointSlice
/// controller publishes them (same summary as the emulation's publisher).
pub async fn watch_slices(client: kube::Client, rec: Recorder) {
    let api: Api<EndpointSlice> = Api::namespaced(client, SERVICE_NAMESPACE);
    let cfg =
        watcher::Config::default().labels(&format!("kubernetes.io/service-name={SERVICE_NAME}"));
    let mut events = watcher::watcher(api, cfg).backoff(Steady).boxed();
    let mut slices: BTreeMap<String, Value> = BTreeMap::new();
    let mut last = None::<String>;
    while let Some(ev) = events.next().await {
        match ev {
            Ok(watcher::Event::Apply(s)) | Ok(watcher::Event::InitApply(s)) => {
                let name = s.metadata.name.clone().unwrap_or_default();
                slices.insert(name, serde_json::to_value(&s).unwrap_or_default());
            }
            Ok(watcher::Event::Delete(s)) => {
                slices.remove(&s.metadata.name.clone().unwrap_or_default());
            }
            Ok(_) => continue,
            Err(e) => {
                rec.record(
                    EventKind::Note,
                    None,
                    None,
                    format!("endpointslice watch: {e}"),
                );
                continue;
            }
        }
        let doc = json!({"items": slices.values().collect::<Vec<_>>()});
        let summary = crate::world::controlplane::summarize(&doc.to_string());
        if last.as_deref() != Some(summary.as_str()) {
            rec.record(EventKind::SlicePublished, None, None, summary.clone());
            last = Some(summary);
        }
    }
}

/// The API server, reachable as 127.0.0.1:`port` inside one node namespace: the
/// listener is made in that namespace, each accepted connection is forwarded to the
/// host's 127.0.0.1:`port` from the host namespace (the lab's runtime threads).
pub struct ApiBridge {
    task: tokio::task::JoinHandle<()>,
    /// Bumped to reset every open connection (the watch-cut chaos).
    cut: tokio::sync::watch::Sender<u64>,
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl ApiBridge {
    pub fn start(ns: &str, port: u16) -> Result<ApiBridge, LabError> {
        let ns_name = ns.to_string();
        let listener = std::thread::scope(|s| {
            s.spawn(|| -> Result<std::net::TcpListener, LabError> {
                crate::world::netns::enter_netns_by_name(&ns_name)?;
                let l =
                    std::net::TcpListener::bind(("127.0.0.1", port)).map_err(|e| LabError::Io {
                        what: format!("listen on 127.0.0.1:{port} in {ns_name} (API bridge)"),
                        source: e,
                    })?;
                l.set_nonblocking(true).map_err(|e| LabError::Io {
                    what: "API bridge nonblocking".into(),
                    source: e,
                })?;
                Ok(l)
            })
            .join()
            .map_err(|_| LabError::Invalid("API bridge thread panicked".into()))?
        })?;
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| LabError::Io {
            what: "API bridge listener".into(),
            source: e,
        })?;
        let (cut, cuts) = tokio::sync::watch::channel(0u64);
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = open.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut cuts = cuts.clone();
                cuts.mark_unchanged();
                let open = counter.clone();
                tokio::spawn(async move {
                    if let Ok(mut out) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
                        open.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => {}
                            _ = cuts.changed() => {
                                // A reset, not a close: what a broken path or a
                                // restarted load balancer in front of the API does.
                                let _ = inbound.set_zero_linger();
                                let _ = out.set_zero_linger();
                            }
                        }
                        open.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                    }
                });
            }
        });
        Ok(ApiBridge { task, cut, open })
    }

    /// Resets every connection open through the bridge; how many there were.
    pub fn cut(&self) -> usize {
        let n = self.open.load(std::sync::atomic::Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
        n
    }
}

impl Drop for ApiBridge {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A running control-plane process of the k8s-lab (kube-apiserver,
/// kube-controller-manager), found by the pid file `start.sh` writes: what the
/// API-outage chaos kills and starts again with the same command line.
pub struct LabProcess {
    name: &'static str,
    pid_file: PathBuf,
    log: PathBuf,
    argv: Vec<String>,
    pid: i32,
}

impl LabProcess {
    /// `name` is both `start.sh`'s name for it and its binary's.
    pub fn find(lab: &K8sLab, name: &'static str) -> Result<LabProcess, LabError> {
        let pid_file = lab.dir.join(format!("run/{name}.pid"));
        let io = |what: String| move |e| LabError::Io { what, source: e };
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .map_err(io(format!("read {}", pid_file.display())))?
            .trim()
            .parse()
            .map_err(|_| LabError::Invalid(format!("{}: not a pid", pid_file.display())))?;
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).map_err(io(format!(
            "read the command line of {name} (pid {pid}); is it running?"
        )))?;
        let argv: Vec<String> = cmdline
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !argv.first().is_some_and(|a| a.ends_with(name)) {
            return Err(LabError::Invalid(format!(
                "pid {pid} of {} is not {name}",
                pid_file.display()
            )));
        }
        Ok(LabProcess {
            name,
            pid_file,
            log: lab.dir.join(format!("logs/{name}.log")),
            argv,
            pid,
        })
    }

    /// SIGKILL, and wait until it is gone.
    pub fn kill(&self) -> Result<(), LabError> {
        let pid = nix::unistd::Pid::from_raw(self.pid);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL)
            .map_err(|e| LabError::Invalid(format!("kill {} (pid {pid}): {e}", self.name)))?;
        while std::path::Path::new(&format!("/proc/{}", self.pid)).exists() {
            // A process an earlier run of this process started again is its child: reap
            // it, or it stays a zombie and this waits forever. Another parent's (start.sh's,
            // then init's) is reaped there: ECHILD here.
            let _ = nix::sys::wait::waitpid(pid, Some(nix::sys::wait::WaitPidFlag::WNOHANG));
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// The same command line again, in a session of its own, appending to its log as
    /// `start.sh` does, and its pid where `start.sh` looks for it. The child is
    /// returned so that a caller can tell when it exits (and reap it).
    pub fn start_again(&self) -> Result<std::process::Child, LabError> {
        let log = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&self.log)
            .map_err(|e| LabError::Io {
                what: format!("open {}", self.log.display()),
                source: e,
            })?;
        let err = log.try_clone().map_err(|e| LabError::Io {
            what: "clone the log file".into(),
            source: e,
        })?;
        let child = std::process::Command::new("setsid")
            .args(&self.argv)
            .stdin(std::process::Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| LabError::Io {
                what: format!("start {} again", self.name),
                source: e,
            })?;
        std::fs::write(&self.pid_file, format!("{}\n", child.id())).map_err(|e| LabError::Io {
            what: format!("write {}", self.pid_file.display()),
            source: e,
        })?;
        Ok(child)
    }
}

/// Everything a run against the real control plane holds; dropping it stops the
/// lab's controllers (agent, heartbeat, watches, bridges).
pub struct RealControlPlane {
    pub lab: K8sLab,
    pub client: kube::Client,
    pub writer: Arc<PodStatusWriter>,
    tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    bridges: Vec<ApiBridge>,
    nodes: usize,
    since: String,
    node_changes: Arc<Mutex<NodeChanges>>,
}

impl RealControlPlane {
    /// Clean the lab namespace, create Nodes and Service, start heartbeat, slice
    /// watch and one API bridge per node namespace.
    pub async fn start(
        lab: K8sLab,
        fabric: &fabric::Fabric,
        publish_not_ready_addresses: bool,
        etp_local: bool,
        rec: Recorder,
    ) -> Result<RealControlPlane, LabError> {
        let client = client(&lab).await?;
        clean(&client, Duration::from_secs(60)).await?;
        let since = prepare(
            &client,
            fabric.nodes.len(),
            publish_not_ready_addresses,
            etp_local,
        )
        .await?;
        let node_changes = Arc::new(Mutex::new(NodeChanges::default()));
        let mut bridges = Vec::new();
        for n in &fabric.nodes {
            bridges.push(ApiBridge::start(n.ns.name(), lab.api_port)?);
        }
        let tasks = vec![
            tokio::spawn(heartbeat(
                client.clone(),
                fabric.nodes.len(),
                since.clone(),
                node_changes.clone(),
                rec.clone(),
            )),
            tokio::spawn(watch_slices(client.clone(), rec.clone())),
        ];
        let writer = PodStatusWriter::start(client.clone(), rec);
        Ok(RealControlPlane {
            lab,
            client,
            writer,
            tasks: Mutex::new(tasks),
            bridges,
            nodes: fabric.nodes.len(),
            since,
            node_changes,
        })
    }

    /// Resets every open connection of node `index`'s kproxy to the API server (through
    /// its bridge); how many were open.
    pub fn cut_api_connections(&self, index: usize) -> usize {
        self.bridges.get(index).map_or(0, ApiBridge::cut)
    }

    /// The cluster autoscaler's scale-down taint on node `index`, written to the Node
    /// object at once (the heartbeat keeps it there).
    pub async fn taint_node(&self, index: usize) -> Result<(), LabError> {
        self.node_changes
            .lock()
            .expect("node changes lock")
            .tainted
            .insert(index, jiff::Timestamp::now().as_second());
        beat(&self.client, self.nodes, &self.since, &self.node_changes).await
    }

    /// Evict every pod bound to node `index` through the Eviction API, as the
    /// autoscaler's drain does; returns their names.
    pub async fn evict_node_pods(&self, index: usize) -> Result<Vec<String>, LabError> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), SERVICE_NAMESPACE);
        let node = fabric::node_name(index);
        let pods = api
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(api_err(format!("list pods on {node}")))?;
        let mut evicted = Vec::new();
        for p in pods.items {
            let Some(name) = p.metadata.name else {
                continue;
            };
            api.evict(&name, &kube::api::EvictParams::default())
                .await
                .map_err(api_err(format!("evict pod {name}")))?;
            evicted.push(name);
        }
        Ok(evicted)
    }

    /// Delete node `index`'s Node object (and stop its heartbeat).
    pub async fn delete_node(&self, index: usize) -> Result<(), LabError> {
        self.node_changes
            .lock()
            .expect("node changes lock")
            .deleted
            .insert(index);
        let name = fabric::node_name(index);
        let napi: Api<Node> = Api::all(self.client.clone());
        napi.delete(&name, &DeleteParams::default())
            .await
            .map_err(api_err(format!("delete node {name}")))?;
        Ok(())
    }

    /// Wait until kcm's Deployment controller has replaced evicted pods: the
    /// Deployment complete and the lab running `replicas` ready pods.
    pub async fn wait_replaced(
        &self,
        cluster: &Arc<Cluster>,
        limit: Duration,
    ) -> Result<(), LabError> {
        self.wait_done(cluster, 1, limit, "replacing the evicted pods")
            .await
    }

    /// Wait until kcm reports the Deployment complete and the lab runs only pods of
    /// `revision`, all ready.
    async fn wait_done(
        &self,
        cluster: &Arc<Cluster>,
        revision: u32,
        limit: Duration,
        what: &str,
    ) -> Result<(), LabError> {
        let d = cluster.deployment;
        let start = Instant::now();
        let mut last_error = None;
        loop {
            // An API server that is down (the API-outage chaos) pauses the wait; only
            // the limit ends it, naming the last error.
            let dep = match get_deployment(&self.client).await {
                Ok(dep) => dep,
                Err(e) => {
                    last_error = Some(e);
                    None
                }
            };
            let pods = cluster.pods();
            let lab_done = pods.len() == d.replicas as usize
                && pods.iter().all(|p| p.revision == revision && p.is_ready());
            if lab_done && dep.is_some_and(|dep| deployment_complete(&dep, d.replicas)) {
                return Ok(());
            }
            if start.elapsed() > limit {
                let cause = last_error.map(|e| format!(" (last API error: {e})"));
                return Err(LabError::Invalid(format!(
                    "k8s-lab: {what} did not finish within {limit:?}{}",
                    cause.unwrap_or_default()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Start the scheduler/kubelet agent for `cluster`.
    pub fn start_agent(&self, cluster: Arc<Cluster>, rec: Recorder) {
        self.tasks
            .lock()
            .expect("tasks lock")
            .push(tokio::spawn(Agent::run(self.client.clone(), cluster, rec)));
    }

    /// Roll the Deployment to `revision` (creating it for revision 1) and wait until
    /// kcm reports it complete and the lab runs only pods of `revision`, all ready.
    pub async fn rollout(
        &self,
        cluster: &Arc<Cluster>,
        clock: &Clock,
        revision: u32,
        limit: Duration,
    ) -> Result<(), LabError> {
        let d = cluster.deployment;
        apply_deployment(&self.client, &d, &cluster.template, revision, clock.scale()).await?;
        self.wait_done(
            cluster,
            revision,
            limit,
            &format!("rollout to revision {revision}"),
        )
        .await
    }

    /// Stop the lab's controllers and remove the run's objects (best effort: a
    /// failure is returned for the caller to report, the next run cleans again).
    pub async fn stop(&self) -> Result<(), LabError> {
        self.abort_tasks();
        clean(&self.client, Duration::from_secs(30)).await
    }
}

impl RealControlPlane {
    fn abort_tasks(&self) {
        for t in self.tasks.lock().expect("tasks lock").drain(..) {
            t.abort();
        }
    }
}

impl Drop for RealControlPlane {
    fn drop(&mut self) {
        self.abort_tasks();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_port_from_kubeconfig() {
        let kc = "clusters:\n- name: k8s-lab\n  cluster:\n    server: https://127.0.0.1:6453\n";
        assert_eq!(server_port(kc), Some(6453));
        assert_eq!(server_port("server: https://10.0.0.1:6443"), None);
    }

    #[test]
    fn deployment_carries_the_rollout_parameters() {
        let d = DeploymentSpec {
            replicas: 3,
            max_surge: 1,
            max_unavailable: 0,
            min_ready_seconds: 5.0,
            one_pod_per_node: true,
        };
        let t = crate::spec::rollout::RolloutConfig::default().pod;
        let v = deployment_object(&d, &t, 2, 0.1);
        assert_eq!(v["spec"]["strategy"]["rollingUpdate"]["maxSurge"], 1);
        assert_eq!(v["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"], 0);
        assert_eq!(
            v["spec"]["minReadySeconds"], 1,
            "5 nominal s at scale 0.1, rounded up"
        );
        assert_eq!(
            v["spec"]["template"]["metadata"]["annotations"][REVISION_ANNOTATION],
            "2"
        );
        assert!(v["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"].is_object());
        let dep: Deployment = serde_json::from_value(v).expect("a valid apps/v1 Deployment");
        assert_eq!(dep.spec.map(|s| s.replicas), Some(Some(3)));
    }
}
