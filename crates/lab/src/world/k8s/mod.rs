//! The real control plane (`--control-plane k8s-lab`): kube-apiserver and
//! kube-controller-manager of a k8s-lab instance (found through `K8S_LAB`; how to
//! start one: docs/lab.md, "The real control plane"). kcm's Deployment controller performs the
//! rolling update and its EndpointSlice controller derives the endpoint conditions;
//! the lab plays only scheduler and kubelet:
//! - `kubelet`: [`Agent`](kubelet::Agent) watches the Pods, binds new ones to a lab node
//!   (the Node objects exist, see `nodes`) through the `binding` subresource and starts
//!   them ([`Cluster::start_pod`]); a deletionTimestamp starts the kubelet's termination
//!   ([`Cluster::kubelet_delete`]). [`PodStatusWriter`](kubelet::PodStatusWriter) writes
//!   what the kubelet observes through the status subresource (IP, Ready and
//!   ContainersReady, container state, terminal phase) and removes the Pod object
//!   (grace period 0) once its container ended, in order;
//! - `nodes`: the Nodes kept Ready (status conditions and node Lease) as a kubelet
//!   does, or kcm's node lifecycle controller would mark them NotReady after its grace
//!   period and set every pod on them not ready;
//! - `deployment`: the Deployment object per revision, and kcm's word on a rollout;
//! - `bridge`: each node's kproxy (`kproxy run --kubeconfig`, inside the node
//!   namespace) reaches the API server on the host's loopback: a listener made inside
//!   the node namespace, connections made from the host namespace;
//! - `process`: the instance's kube-apiserver and kube-controller-manager, which the
//!   API-outage chaos kills and starts again.
//!
//! What the real controllers publish (EndpointSlices) is watched into the run's
//! timeline ([`watch_slices`]) so the report can put both control planes side by side.
//! [`RealControlPlane`] holds all of it for one run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher;
use serde_json::{Value, json};

use crate::LabError;
use crate::scenario::service::{SERVICE_NAME, SERVICE_NAMESPACE};
use crate::world::cluster::Cluster;
use crate::world::fabric;
use crate::world::timeline::{Clock, EventKind, Recorder};
use bridge::ApiBridge;
use deployment::{apply_deployment, deployment_complete, get_deployment};
use kubelet::{Agent, PodStatusWriter};
use nodes::{NodeChanges, beat, heartbeat, prepare};

pub mod bridge;
pub mod deployment;
pub mod kubelet;
pub mod nodes;
pub mod process;

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
    /// The KubeProxyConfiguration of an upstream kube-proxy on a lab node: `mode`
    /// (`nftables`, `iptables`), as node `node` through the proxy kubeconfig, the lab's
    /// cluster CIDR for local traffic, `/healthz` on `healthz`, and the conntrack
    /// settings as the kernel has them (0: kube-proxy sets none).
    pub fn kube_proxy_config(&self, mode: &str, node: &str, healthz: &str) -> String {
        format!(
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: {mode}
hostnameOverride: {node}
clientConnection: {{kubeconfig: {}}}
clusterCIDR: 10.244.0.0/16
detectLocalMode: ClusterCIDR
healthzBindAddress: {healthz}
metricsBindAddress: 127.0.0.1:10249
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
",
            self.proxy_kubeconfig.display()
        )
    }

    /// The instance named by `K8S_LAB`; a clear error when unset or incomplete.
    pub fn from_env() -> Result<K8sLab, LabError> {
        let dir = std::env::var_os("K8S_LAB").ok_or_else(|| {
            LabError::Invalid(
                "--control-plane k8s-lab needs K8S_LAB naming a running k8s-lab instance \
                 (kube-apiserver and kube-controller-manager; docs/lab.md says how to start one)"
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

    /// A drain condition of KEP-5683 (`kind`) set "True" on node `index`'s status at
    /// once (the heartbeat keeps it there).
    pub async fn set_node_condition(
        &self,
        index: usize,
        kind: &'static str,
    ) -> Result<(), LabError> {
        self.node_changes
            .lock()
            .expect("node changes lock")
            .conditions
            .insert(index, kind);
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
}
