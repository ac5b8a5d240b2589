//! The skeleton of a held run (`lab restart`, `lab takeover`): the network and the
//! run's scratch directory, its clock and timeline, the emulated control plane with
//! one manifest directory per node, the Deployment of one pod per node, the load
//! balancer in front of the lab Service, and the two loads — new and keep-alive
//! connections through the load balancer from the client, and through the cluster IP
//! from node 1 — whose records are counted into the run's phases when they stop.
//!
//! A held run builds a [`HeldLab`], brings its cluster up, starts the [`Loads`], then
//! changes the lab phase by phase; what differs between the runs (which process is
//! disturbed, what a phase waits for) stays in the run's own module.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::LabError;
use crate::report::held::{Phase, Via, tally};
use crate::runs::Workdir;
use crate::scenario::balancer::HealthCheck;
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::service::{CLUSTER_IP, SERVICE_PORT, VIP};
use crate::world::cluster::{Cluster, PodApi};
use crate::world::controlplane::ControlPlane;
use crate::world::fabric::{self, Fabric};
use crate::world::lb::LoadBalancer;
use crate::world::loadgen::LoadGenerator;
use crate::world::timeline::{Clock, Recorder};

/// What a held run holds from its start to its end.
pub(crate) struct HeldLab {
    pub clock: Clock,
    pub rec: Recorder,
    pub hc: HealthCheck,
    pub fabric: Arc<Fabric>,
    pub workdir: Workdir,
    /// The longest the initial pods and the load balancer's view of them may take.
    pub limit: Duration,
}

impl HeldLab {
    /// The network and the scratch directory. `slack` is real time added to the
    /// limit of the bring-up (processes that start on a busy machine).
    pub fn build(cfg: &RolloutConfig, slack: Duration) -> Result<HeldLab, LabError> {
        let clock = Clock::new(cfg.time_scale);
        let rec = Recorder::new(clock.clone());
        let hc = cfg.load_balancer.effective_health_check()?;
        let fabric = Arc::new(Fabric::build(cfg.nodes)?);
        let workdir = Workdir::create(&fabric.prefix)?;
        let limit = clock.real(
            cfg.pod.readiness_probe.initial_delay_seconds
                + cfg.pod.readiness_probe.period_seconds * 4.0
                + hc.interval_seconds * (hc.healthy_threshold as f64 + 2.0)
                + 30.0,
        ) + slack;
        Ok(HeldLab {
            clock,
            rec,
            hc,
            fabric,
            workdir,
            limit,
        })
    }

    /// The emulated control plane, publishing to one manifest directory per node (the
    /// directories, in node order, are what each node's kproxy reads).
    pub fn emulated_control_plane(
        &self,
        cfg: &RolloutConfig,
    ) -> Result<(ControlPlane, Vec<PathBuf>), LabError> {
        ControlPlane::start_for_nodes(
            &self.fabric,
            &self.workdir.path,
            cfg,
            true,
            self.rec.clone(),
        )
    }

    /// The Deployment's controller and kubelets, reporting through `api`.
    pub fn cluster(&self, cfg: &RolloutConfig, api: Arc<dyn PodApi>) -> Arc<Cluster> {
        Cluster::new(
            self.fabric.clone(),
            api,
            self.rec.clone(),
            cfg.pod,
            cfg.deployment,
        )
    }

    /// The emulated cloud load balancer in front of the lab Service.
    pub fn load_balancer(&self, cfg: &RolloutConfig) -> Result<LoadBalancer, LabError> {
        LoadBalancer::for_lab_service(
            &self.fabric,
            cfg.load_balancer.mode,
            self.hc,
            self.rec.clone(),
        )
    }

    /// Both loads, started, after a warm-up that opens the keep-alive connections and
    /// puts their conntrack entries in place.
    pub async fn start_loads(&self, cfg: &RolloutConfig) -> Result<Loads, LabError> {
        let fabric = &self.fabric;
        // A node reaches the Service range by its default route on a real cluster; the
        // lab's nodes have none, so node 1 gets one for the range (DNAT in the output
        // hook then re-routes to the chosen pod).
        fabric.nodes[0].ns.ip(&[
            "route",
            "add",
            "10.96.0.0/16",
            "via",
            &fabric::LB_FABRIC_IP.to_string(),
        ])?;
        let cip: std::net::IpAddr = CLUSTER_IP
            .parse()
            .map_err(|e| LabError::Invalid(format!("cluster IP: {e}")))?;
        let loads = Loads([
            (
                Via::Lb,
                LoadGenerator::start(
                    fabric.client.name(),
                    SocketAddr::from((VIP, SERVICE_PORT)),
                    cfg.load.clone(),
                    self.clock.start(),
                )?,
            ),
            (
                Via::ClusterIp,
                LoadGenerator::start(
                    fabric.nodes[0].ns.name(),
                    SocketAddr::new(cip, SERVICE_PORT),
                    cfg.load.clone(),
                    self.clock.start(),
                )?,
            ),
        ]);
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(loads)
    }
}

/// The two loads of a held run, by the path they enter.
pub(crate) struct Loads([(Via, LoadGenerator); 2]);

impl Loads {
    /// Requests sent and failed so far, both paths.
    pub fn counts(&self) -> (usize, usize) {
        self.0.iter().fold((0, 0), |(s, f), (_, l)| {
            let (a, b) = l.counts();
            (s + a, f + b)
        })
    }

    /// Stops both loads (their requests in flight finish) and counts every record into
    /// the phase it started in.
    pub fn stop_into(self, phases: &mut [Phase]) {
        for (path, load) in self.0 {
            let records = load.stop();
            tally(phases, path, &records);
        }
    }
}
