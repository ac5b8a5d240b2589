//! Workloads on the lab cluster: the kubelet emulation (readiness probes, preStop,
//! SIGTERM, SIGKILL after the grace period) and the Deployment controller emulation
//! (rolling update with replicas, maxSurge, maxUnavailable, minReadySeconds and an
//! optional one-pod-per-node anti-affinity).
//!
//! All periods are nominal seconds, turned into real time by the run's clock.
//!
//! What the kubelet reports goes through [`PodApi`]: the embedded control plane
//! ([`ControlPlane`]) or the real API server (`k8s::kubelet::PodStatusWriter`). With the real
//! control plane the Deployment controller is kube-controller-manager's and this
//! module only schedules and runs the pods it creates (`k8s::kubelet::Agent` drives
//! [`Cluster::start_pod`] and [`Cluster::kubelet_delete`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::LabError;
use crate::scenario::workload::{DeploymentSpec, PodTemplate};
use crate::world::controlplane::{ControlPlane, PodRecord};
use crate::world::fabric::{Fabric, PodNet};
use crate::world::pod::{PodServer, PodSignal};
use crate::world::timeline::{EventKind, Recorder};

/// Where the kubelet writes what it observes about its pods.
pub trait PodApi: Send + Sync {
    /// The pod runs (it has its IP), not yet ready.
    fn started(&self, pod: &PodRuntime);
    /// The Ready condition changed.
    fn ready_changed(&self, pod: &PodRuntime, ready: bool);
    /// The lab's Deployment controller deleted the pod (deletionTimestamp set).
    fn deleting(&self, pod: &PodRuntime);
    /// The container ended (`killed`: by SIGKILL at the grace period) and the pod
    /// object goes away.
    fn gone(&self, pod: &PodRuntime, killed: bool);
}

impl PodApi for ControlPlane {
    fn started(&self, pod: &PodRuntime) {
        self.upsert_pod(PodRecord {
            name: pod.name.clone(),
            node: crate::world::fabric::node_name(pod.node_index),
            ip: Some(pod.ip),
            ready: false,
            deleting: false,
            finished: false,
        });
    }
    fn ready_changed(&self, pod: &PodRuntime, ready: bool) {
        self.update_pod(&pod.name, |r| r.ready = ready);
    }
    fn deleting(&self, pod: &PodRuntime) {
        self.update_pod(&pod.name, |r| r.deleting = true);
    }
    fn gone(&self, pod: &PodRuntime, _killed: bool) {
        self.remove_pod(&pod.name);
    }
}

pub struct PodRuntime {
    pub name: String,
    pub node_index: usize,
    pub revision: u32,
    pub ip: std::net::Ipv4Addr,
    ready: AtomicBool,
    ready_since: Mutex<Option<Instant>>,
    deleting: AtomicBool,
    gone: AtomicBool,
    delete: Notify,
    server: Mutex<Option<PodServer>>,
    net: Mutex<Option<PodNet>>,
}

impl PodRuntime {
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }
    pub fn is_deleting(&self) -> bool {
        self.deleting.load(Ordering::SeqCst)
    }
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::SeqCst)
    }
    /// The pod's server has bound its port (`PodTemplate::listen_delay_ms` after its
    /// start).
    pub fn is_listening(&self) -> bool {
        let g = self.server.lock().expect("server lock");
        g.as_ref()
            .is_some_and(|s| s.shared.listening.load(Ordering::SeqCst))
    }
    /// When the pod last became ready (None while not ready).
    pub fn ready_since(&self) -> Option<Instant> {
        *self.ready_since.lock().expect("lock")
    }
    fn available(&self, min_ready: Duration) -> bool {
        self.is_ready()
            && !self.is_deleting()
            && self
                .ready_since
                .lock()
                .expect("lock")
                .is_some_and(|t| t.elapsed() >= min_ready)
    }
}

pub struct Cluster {
    pub fabric: Arc<Fabric>,
    pub api: Arc<dyn PodApi>,
    pub recorder: Recorder,
    pub template: PodTemplate,
    pub deployment: DeploymentSpec,
    pods: Mutex<Vec<Arc<PodRuntime>>>,
    next_id: Mutex<u32>,
    idle_close: Duration,
    /// Nodes (1-based) the scheduler no longer uses (tainted `NoSchedule`).
    cordoned: Mutex<Vec<usize>>,
}

impl Cluster {
    pub fn new(
        fabric: Arc<Fabric>,
        api: Arc<dyn PodApi>,
        recorder: Recorder,
        template: PodTemplate,
        deployment: DeploymentSpec,
    ) -> Arc<Cluster> {
        let idle_close = recorder.clock().real(2.0).max(Duration::from_millis(500));
        Arc::new(Cluster {
            fabric,
            api,
            recorder,
            template,
            deployment,
            pods: Mutex::new(Vec::new()),
            next_id: Mutex::new(0),
            idle_close,
            cordoned: Mutex::new(Vec::new()),
        })
    }

    pub fn pods(&self) -> Vec<Arc<PodRuntime>> {
        self.pods
            .lock()
            .expect("pods lock")
            .iter()
            .filter(|p| !p.is_gone())
            .cloned()
            .collect()
    }

    /// Pick a node for a new pod: the one with fewest pods of the Deployment;
    /// with anti-affinity only nodes with none (terminating ones count).
    pub fn schedule(&self) -> Option<usize> {
        let pods = self.pods();
        let count = |i: usize| pods.iter().filter(|p| p.node_index == i).count();
        let cordoned = self.cordoned.lock().expect("cordoned lock").clone();
        let mut best: Option<(usize, usize)> = None;
        for n in self
            .fabric
            .nodes
            .iter()
            .filter(|n| !cordoned.contains(&n.index))
        {
            let c = count(n.index);
            if self.deployment.one_pod_per_node && c > 0 {
                continue;
            }
            if best.is_none_or(|(_, bc)| c < bc) {
                best = Some((n.index, c));
            }
        }
        best.map(|(i, _)| i)
    }

    fn create_pod(
        self: &Arc<Self>,
        revision: u32,
        node_index: usize,
    ) -> Result<Arc<PodRuntime>, LabError> {
        let id = {
            let mut n = self.next_id.lock().expect("id lock");
            *n += 1;
            *n
        };
        let name = format!("web-r{revision}-{id}");
        self.start_pod(&name, revision, node_index)
    }

    /// The kubelet starts pod `name` on node `node_index`: its namespace, its
    /// server, its prober and its termination handler.
    pub fn start_pod(
        self: &Arc<Self>,
        name: &str,
        revision: u32,
        node_index: usize,
    ) -> Result<Arc<PodRuntime>, LabError> {
        let name = name.to_string();
        let net = self.fabric.add_pod(node_index, &name)?;
        let server = PodServer::start_listening_after(
            &name,
            net.ns.name(),
            self.template.profile,
            self.idle_close,
            Duration::from_millis(self.template.listen_delay_ms),
        )?;
        let node = crate::world::fabric::node_name(node_index);
        let pod = Arc::new(PodRuntime {
            name: name.clone(),
            node_index,
            revision,
            ip: net.ip,
            ready: AtomicBool::new(false),
            ready_since: Mutex::new(None),
            deleting: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            delete: Notify::new(),
            server: Mutex::new(Some(server)),
            net: Mutex::new(Some(net)),
        });
        self.api.started(&pod);
        self.recorder.record(
            EventKind::PodCreated,
            Some(&node),
            Some(&name),
            format!("revision {revision}, {}", pod.ip),
        );
        self.pods.lock().expect("pods lock").push(pod.clone());
        let (c, p) = (self.clone(), pod.clone());
        tokio::spawn(async move { c.probe_loop(p).await });
        let (c, p) = (self.clone(), pod.clone());
        tokio::spawn(async move { c.termination(p).await });
        Ok(pod)
    }

    fn server_probe_ok(pod: &PodRuntime) -> bool {
        let g = pod.server.lock().expect("server lock");
        match g.as_ref() {
            Some(s) => !s.exited() && s.shared.probe_ok.load(Ordering::SeqCst),
            None => false,
        }
    }

    fn server_exited(pod: &PodRuntime) -> bool {
        let g = pod.server.lock().expect("server lock");
        g.as_ref().is_none_or(|s| s.exited())
    }

    fn set_ready(&self, pod: &PodRuntime, ready: bool, why: &str) {
        pod.ready.store(ready, Ordering::SeqCst);
        *pod.ready_since.lock().expect("lock") = ready.then(Instant::now);
        self.api.ready_changed(pod, ready);
        let node = crate::world::fabric::node_name(pod.node_index);
        self.recorder.record(
            if ready {
                EventKind::PodReady
            } else {
                EventKind::PodNotReady
            },
            Some(&node),
            Some(&pod.name),
            why,
        );
    }

    /// The kubelet's readiness prober.
    async fn probe_loop(self: Arc<Self>, pod: Arc<PodRuntime>) {
        let clock = self.recorder.clock().clone();
        let p = self.template.readiness_probe;
        tokio::time::sleep(clock.real(p.initial_delay_seconds)).await;
        let period = clock.real(p.period_seconds).max(Duration::from_millis(5));
        let (mut succ, mut fail) = (0u32, 0u32);
        while !pod.is_gone() {
            if Self::server_exited(&pod) {
                if pod.is_ready() {
                    self.set_ready(&pod, false, "container exited");
                }
                return;
            }
            if Self::server_probe_ok(&pod) {
                succ += 1;
                fail = 0;
                if !pod.is_ready() && succ >= p.success_threshold.max(1) {
                    self.set_ready(&pod, true, "readiness probe succeeded");
                }
            } else {
                fail += 1;
                succ = 0;
                if pod.is_ready() && fail >= p.failure_threshold.max(1) {
                    self.set_ready(&pod, false, &format!("readiness probe failed {fail} times"));
                }
            }
            // Sleep one period, but notice an exit at once (the kubelet sees the
            // container stop without waiting for a probe).
            let until = Instant::now() + period;
            while Instant::now() < until && !pod.is_gone() && !Self::server_exited(&pod) {
                tokio::time::sleep(
                    Duration::from_millis(5).min(until.saturating_duration_since(Instant::now())),
                )
                .await;
            }
        }
    }

    /// The kubelet's termination: preStop, SIGTERM, SIGKILL after the grace period.
    async fn termination(self: Arc<Self>, pod: Arc<PodRuntime>) {
        pod.delete.notified().await;
        let clock = self.recorder.clock().clone();
        let node = crate::world::fabric::node_name(pod.node_index);
        let t0 = Instant::now();
        let grace_end = t0 + clock.real(self.template.termination_grace_period_seconds);
        let pre_stop = clock.real(self.template.pre_stop_sleep_seconds);
        tokio::time::sleep(pre_stop).await;
        let lasted = t0.elapsed();
        if lasted >= pre_stop + crate::world::timeline::LATE {
            let nominal = |d: Duration| clock.nominal_s(d.as_secs_f64() * 1000.0);
            self.recorder.record(
                EventKind::LabLate,
                Some(&node),
                Some(&pod.name),
                format!(
                    "preStop lasted {:.1} s, {:.1} s configured: the lab's timer fired {:.1} s late",
                    nominal(lasted),
                    self.template.pre_stop_sleep_seconds,
                    nominal(lasted - pre_stop)
                ),
            );
        }
        if let Some(s) = pod.server.lock().expect("server lock").as_ref() {
            s.signal(PodSignal::Term);
        }
        self.recorder.record(
            EventKind::PodSigterm,
            Some(&node),
            Some(&pod.name),
            "SIGTERM after preStop",
        );
        let mut killed = false;
        loop {
            if Self::server_exited(&pod) {
                self.recorder.record(
                    EventKind::PodExited,
                    Some(&node),
                    Some(&pod.name),
                    "process exited",
                );
                break;
            }
            if Instant::now() >= grace_end {
                if let Some(s) = pod.server.lock().expect("server lock").as_ref() {
                    s.signal(PodSignal::Kill);
                }
                killed = true;
                self.recorder.record(
                    EventKind::PodKilled,
                    Some(&node),
                    Some(&pod.name),
                    "SIGKILL at end of grace period",
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let server = pod.server.lock().expect("server lock").take();
        if let Some(mut s) = server {
            tokio::task::spawn_blocking(move || s.join()).await.ok();
        }
        pod.gone.store(true, Ordering::SeqCst);
        self.api.gone(&pod, killed);
        let net = pod.net.lock().expect("net lock").take();
        drop(net);
    }

    /// The scheduler stops using node `node_index` (its `NoSchedule` taint).
    pub fn cordon(&self, node_index: usize) {
        self.cordoned
            .lock()
            .expect("cordoned lock")
            .push(node_index);
    }

    /// Node drain: the node's `NoSchedule` taint keeps new pods off it, and every pod
    /// on it is evicted (deleted with its grace period, as the Eviction API does). The
    /// Deployment controller replaces them elsewhere. Returns the evicted pods' names.
    pub fn drain_node(&self, node_index: usize) -> Vec<String> {
        self.cordon(node_index);
        let mut evicted = Vec::new();
        for p in self.pods() {
            if p.node_index == node_index && !p.is_deleting() {
                self.delete_pod(&p);
                evicted.push(p.name.clone());
            }
        }
        evicted
    }

    pub fn delete_pod(&self, pod: &PodRuntime) {
        if pod.deleting.swap(true, Ordering::SeqCst) {
            return;
        }
        self.api.deleting(pod);
        self.begin_termination(pod);
    }

    /// The API server set the pod's deletionTimestamp (real control plane): the
    /// kubelet starts its termination. False when the lab does not run that pod.
    pub fn kubelet_delete(&self, name: &str) -> bool {
        let Some(pod) = self.pods().into_iter().find(|p| p.name == name) else {
            return false;
        };
        if !pod.deleting.swap(true, Ordering::SeqCst) {
            self.begin_termination(&pod);
        }
        true
    }

    fn begin_termination(&self, pod: &PodRuntime) {
        let node = crate::world::fabric::node_name(pod.node_index);
        self.recorder.record(
            EventKind::PodTerminating,
            Some(&node),
            Some(&pod.name),
            "deletionTimestamp set; preStop starts",
        );
        pod.delete.notify_one();
    }

    /// One pass of the Deployment controller towards `revision`. Returns true when
    /// the rollout is complete (all replicas of `revision` available, no old pod left).
    pub fn reconcile(self: &Arc<Self>, revision: u32) -> Result<bool, LabError> {
        let d = self.deployment;
        let min_ready = self.recorder.clock().real(d.min_ready_seconds);
        let pods = self.pods();
        let active: Vec<&Arc<PodRuntime>> = pods.iter().filter(|p| !p.is_deleting()).collect();
        let old: Vec<&Arc<PodRuntime>> = active
            .iter()
            .copied()
            .filter(|p| p.revision != revision)
            .collect();
        let new: Vec<&Arc<PodRuntime>> = active
            .iter()
            .copied()
            .filter(|p| p.revision == revision)
            .collect();
        let new_avail = new.iter().filter(|p| p.available(min_ready)).count() as i64;
        let old_avail = old.iter().filter(|p| p.available(min_ready)).count() as i64;
        let replicas = d.replicas as i64;
        // Scale up the new ReplicaSet within maxSurge.
        let mut total = (old.len() + new.len()) as i64;
        let mut new_count = new.len() as i64;
        while new_count < replicas && total < replicas + d.max_surge as i64 {
            let Some(node) = self.schedule() else { break };
            self.create_pod(revision, node)?;
            new_count += 1;
            total += 1;
        }
        // Scale down the old one within maxUnavailable: unavailable old pods first.
        let min_available = replicas - d.max_unavailable as i64;
        let mut can_remove = old_avail + new_avail - min_available;
        let mut excess = total - replicas; // pods above the desired count may go
        let mut victims: Vec<&Arc<PodRuntime>> = old.clone();
        victims.sort_by_key(|p| p.available(min_ready));
        for v in victims {
            if v.available(min_ready) {
                if can_remove <= 0 && excess <= 0 {
                    break;
                }
                if can_remove <= 0 {
                    continue;
                }
                can_remove -= 1;
            }
            excess -= 1;
            self.delete_pod(v);
        }
        let old_left = pods.iter().any(|p| p.revision != revision);
        Ok(!old_left && new_avail == replicas)
    }

    /// Run the controller until the rollout to `revision` completes or `limit` passes.
    pub async fn rollout(self: &Arc<Self>, revision: u32, limit: Duration) -> Result<(), LabError> {
        let start = Instant::now();
        loop {
            if self.reconcile(revision)? {
                return Ok(());
            }
            if start.elapsed() > limit {
                return Err(LabError::Invalid(format!(
                    "rollout to revision {revision} did not finish within {limit:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Kill every pod at once (end of run).
    pub async fn shutdown(&self) {
        let pods: Vec<Arc<PodRuntime>> = self.pods.lock().expect("pods lock").drain(..).collect();
        for p in pods {
            p.gone.store(true, Ordering::SeqCst);
            let server = p.server.lock().expect("server lock").take();
            if let Some(mut s) = server {
                tokio::task::spawn_blocking(move || s.join()).await.ok();
            }
            drop(p.net.lock().expect("net lock").take());
        }
    }
}
