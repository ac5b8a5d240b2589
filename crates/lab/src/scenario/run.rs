//! What a run is asked to be, besides its cluster: which proxy behaviour, which
//! control plane, which chaos or node drain, and the disturbances of `lab restart`.

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Behaviour {
    /// kproxy as it ships: failover to serving-terminating endpoints.
    #[serde(rename = "kproxy")]
    Kproxy,
    /// kube-proxy before 1.26: `--proxy-terminating-endpoints=false`, and `/healthz`
    /// ignores the Node's scale-down taint (`kproxyd::PRE_126_FLAGS`).
    #[serde(rename = "pre-1.26")]
    Pre126,
}

impl Behaviour {
    pub fn as_str(self) -> &'static str {
        match self {
            Behaviour::Kproxy => "kproxy",
            Behaviour::Pre126 => "pre-1.26",
        }
    }
}

/// Which control plane runs the Deployment and EndpointSlice controllers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ControlPlaneKind {
    /// The lab's own emulation (`controlplane`, `cluster`); kproxy reads manifests.
    #[default]
    Emulated,
    /// kube-apiserver and kube-controller-manager of the k8s-lab instance named by
    /// `K8S_LAB`; kproxy watches the API (`k8s`).
    K8sLab,
}

impl ControlPlaneKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ControlPlaneKind::Emulated => "emulated",
            ControlPlaneKind::K8sLab => "k8s-lab",
        }
    }
}

/// A node drain (the matrix's node-drain rows), run instead of the rolling update,
/// with an `externalTrafficPolicy: Cluster` Service whose load balancer probes every
/// node's kproxy `/healthz`: the node is told it is going ([`DrainBy`]), its pods are
/// evicted (the Deployment replaces them on other nodes), and once they are gone and
/// `delete_after_s` more has passed, the node is deleted: its kproxy stops, its link is
/// cut, its Node object goes. A shutdown does not wait for the pods: see
/// [`DrainBy::Shutdown`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct NodeDrain {
    /// The drained node (1-based).
    pub node: usize,
    /// Nominal seconds from the drained node's last pod being gone to its deletion.
    pub delete_after_s: f64,
    /// What tells the node's kproxy.
    pub by: DrainBy,
}

/// What tells a drained node's kproxy that the node is going (docs/health.md, "Drain
/// signals").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DrainBy {
    /// The cluster autoscaler's taint `ToBeDeletedByClusterAutoscaler` (KEP-3836).
    #[default]
    AutoscalerTaint,
    /// The Node condition `DrainInProgress` (KEP-5683), as a drain writes it.
    Condition,
    /// A graceful node shutdown (KEP-2000) on a cluster with KEP-5683: the condition
    /// `GracefulNodeShutdownInProgress` and the node's pods stopped, then, `delete_after_s`
    /// later (one LB interval: less than its detection window), its kproxy (SIGTERM)
    /// while the load balancer still sends it new connections; the node goes (link cut,
    /// Node deleted) as soon as kproxy has exited.
    Shutdown,
}

impl DrainBy {
    /// The Node condition the drain sets (status "True"), if any.
    pub fn condition(self) -> Option<&'static str> {
        match self {
            DrainBy::AutoscalerTaint => None,
            DrainBy::Condition => Some("DrainInProgress"),
            DrainBy::Shutdown => Some("GracefulNodeShutdownInProgress"),
        }
    }

    /// The signal, in the words of the reports.
    pub fn words(self) -> &'static str {
        match self {
            DrainBy::AutoscalerTaint => "the ToBeDeletedByClusterAutoscaler taint",
            DrainBy::Condition => "the DrainInProgress condition",
            DrainBy::Shutdown => "the GracefulNodeShutdownInProgress condition and SIGTERM",
        }
    }
}

/// Chaos during the rolling update (`lab rollout --chaos`, and one row of the matrix
/// each: `matrix::Setting::Chaos`). Each happens once, at its [`ChaosMoment`], so a pod
/// is serving-terminating while it happens. A variant's one name (command line, cell
/// id, JSON) is clap's kebab-case of it (`ValueEnum`); `Display` and `Serialize` write
/// that name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Chaos {
    /// Every node's kproxy stopped (SIGTERM) and started again: the new processes must
    /// pick up where the old ones left.
    KproxyRestart,
    /// Node 1's whole nftables ruleset flushed (`nft flush ruleset`, another process than
    /// kproxy): kproxy must restore its rules before traffic notices.
    NftFlush,
    /// Node 1's kproxy SIGKILLed (no shutdown path runs) and started again.
    KproxyKill,
    /// The API server (k8s-lab) killed for 30 s nominal (`API_OUTAGE_S`), then started
    /// again with the same command line, once the terminating pod's EndpointSlice change
    /// is out (a change the API never published no proxy can act on): the rollout
    /// pauses, nodes keep their rules. kube-controller-manager goes down and comes back
    /// with it, as a production kcm (leader election on) does in an outage longer than
    /// its lease's renew deadline.
    ApiOutage,
    /// Every connection of node 1's kproxy to the API server reset (its API bridge):
    /// its watches must resume without losing a change.
    WatchCut,
}

crate::scenario::named_by_value_enum!(Chaos);

/// Nominal seconds the API server stays down in [`Chaos::ApiOutage`] before it is
/// started again (its own start then adds real seconds: the timeline shows when it
/// answered again).
pub const API_OUTAGE_S: f64 = 30.0;

/// When during the rollout a chaos happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChaosMoment {
    /// The rollout's second old pod becomes terminating.
    SecondOldPodTerminating,
    /// Node 1's last old pod becomes terminating.
    Node1LastOldPodTerminating,
}

impl Chaos {
    /// Only the real control plane has an API server to kill or connections to cut.
    pub fn needs_real_api(self) -> bool {
        match self {
            Chaos::KproxyRestart | Chaos::NftFlush | Chaos::KproxyKill => false,
            Chaos::ApiOutage | Chaos::WatchCut => true,
        }
    }

    /// When it happens.
    pub fn moment(self) -> ChaosMoment {
        match self {
            Chaos::KproxyRestart | Chaos::NftFlush | Chaos::ApiOutage | Chaos::WatchCut => {
                ChaosMoment::SecondOldPodTerminating
            }
            // Node 1's kproxy dies while node 1 still has a pod going away.
            Chaos::KproxyKill => ChaosMoment::Node1LastOldPodTerminating,
        }
    }
}

/// Disturbances a run adds to the rolling update (the scenario matrix's extra rows).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RunOptions {
    /// Chaos during the rolling update.
    pub chaos: Option<Chaos>,
    /// The control plane the run uses.
    pub control_plane: ControlPlaneKind,
    /// Drain a node instead of rolling the Deployment.
    pub drain: Option<NodeDrain>,
    /// The lab Service is externalTrafficPolicy Cluster, its load balancer probing
    /// kproxy's `/healthz` (the `ready-before-listen` row, like upstream's rolling-update
    /// spec); a node drain's always is.
    pub etp_cluster: bool,
}

impl RunOptions {
    /// The lab Service's externalTrafficPolicy is Local (its load balancer probes the
    /// health-check node port), else Cluster.
    pub fn etp_local(&self) -> bool {
        self.drain.is_none() && !self.etp_cluster
    }
}

/// What is done to node 1's kproxy at the start of a phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disturbance {
    /// Nothing: the reference the other phases compare with.
    None,
    Sigterm,
    Sigkill,
    /// SIGTERM, then a different binary (another path, or `--upgrade-to`'s build) with
    /// the same arguments.
    Upgrade,
    /// After an upgrade to `--upgrade-to`'s build: SIGTERM, then the first binary again
    /// (a rollback across versions).
    Rollback,
}

impl Disturbance {
    pub const ALL: [Disturbance; 4] = [
        Disturbance::None,
        Disturbance::Sigterm,
        Disturbance::Sigkill,
        Disturbance::Upgrade,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Disturbance::None => "baseline",
            Disturbance::Sigterm => "sigterm",
            Disturbance::Sigkill => "sigkill",
            Disturbance::Upgrade => "upgrade",
            Disturbance::Rollback => "rollback",
        }
    }
}
