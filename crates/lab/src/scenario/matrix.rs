//! The scenario matrix's cells: pod profiles × the settings of the rolling-update
//! guide (seed 2, summed up in docs/lint-rules.md) ×
//! load-balancer presets × both proxy behaviours, plus a kproxy restart in the middle
//! of a rollout and a node drain by the cluster autoscaler; which cells a selection
//! holds, and each cell's `RolloutConfig`. Running them is `runs::matrix`, judging them
//! against lint `report::matrix`.

use serde::Serialize;

use crate::LabError;
use crate::scenario::balancer::{HealthCheck, LbPreset};
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::run::{Behaviour, Chaos, DrainBy, NodeDrain};
use crate::scenario::workload::PodProfile;

/// Seed 2's settings, each a deviation from the recommended one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Setting {
    /// preStop outlasts the LB's detection window, grace = preStop + the LB's 20 s
    /// drain, readiness
    /// period 10 × failureThreshold 3 (the inequality holds), initialDelay ≥ 20 s and
    /// past the LB's registration.
    Recommended,
    /// preStop 1 s: far shorter than the LB's detection window.
    ShortPrestop,
    /// Readiness fails at SIGTERM and preStop + period × (failureThreshold − 1) <
    /// terminationGracePeriodSeconds (period 5, failureThreshold 2); only with the
    /// `fail-readiness-on-term` profile, the only one it concerns.
    ReadinessInequalityViolated,
    /// terminationGracePeriodSeconds = preStop + 2 while the LB drains a removed node's
    /// established flows for 30 s.
    GraceShorterThanDrain,
    /// initialDelaySeconds 0: new pods are Ready before the LB sends their node traffic.
    EarlyReady,
    /// The recommended settings, and every node's kproxy restarted when the rollout's
    /// second old pod turns terminating.
    KproxyRestart,
    /// The recommended settings, and node 1's whole nftables ruleset flushed by another
    /// process (`nft flush ruleset`) when the rollout's second old pod turns
    /// terminating: kproxy must notice and restore its rules.
    NftFlush,
    /// The recommended settings, and node 1's kproxy SIGKILLed (and started again) when
    /// node 1's last old pod turns terminating.
    KproxyKill,
    /// The recommended settings, and the API server (k8s-lab) killed for 30 s when the
    /// rollout's second old pod turns terminating: the rollout pauses, nothing is lost.
    ApiOutage,
    /// The recommended settings, and every API connection of node 1's kproxy reset
    /// (its EndpointSlice watch cut) at that moment.
    WatchCut,
    /// Pods without a readiness probe whose server listens 400 ms after it starts
    /// (Ready before it listens, issue 49), behind an `externalTrafficPolicy: Cluster`
    /// Service as in upstream's rolling-update spec: every proxy programs the new pod
    /// before it can answer; kproxy's endpoint warm-up holds it while the other pods
    /// serve.
    ReadyBeforeListen,
    /// No rollout: the cluster autoscaler drains a node of an `externalTrafficPolicy:
    /// Cluster` Service whose load balancer probes kproxy's `/healthz` (KEP-3836):
    /// taint `ToBeDeletedByClusterAutoscaler`, evict its pods, delete the node
    /// ([`NodeDrain`]).
    NodeDrain,
    /// The node drain with the Node condition `DrainInProgress` (KEP-5683) in place of
    /// the taint ([`DrainBy::Condition`]).
    NodeDrainCondition,
    /// A graceful node shutdown: the condition `GracefulNodeShutdownInProgress`, the
    /// node's pods and kproxy stopped at once while the load balancer still sends it
    /// new connections, the node gone once kproxy has exited ([`DrainBy::Shutdown`]).
    NodeShutdown,
}

impl Setting {
    pub fn as_str(self) -> &'static str {
        match self {
            Setting::Recommended => "recommended",
            Setting::ShortPrestop => "short-prestop",
            Setting::ReadinessInequalityViolated => "readiness-inequality-violated",
            Setting::GraceShorterThanDrain => "grace-shorter-than-drain",
            Setting::EarlyReady => "early-ready",
            Setting::KproxyRestart => "kproxy-restart",
            Setting::NftFlush => "nft-flush",
            Setting::KproxyKill => "kproxy-kill",
            Setting::ApiOutage => "api-outage",
            Setting::WatchCut => "watch-cut",
            Setting::NodeDrain => "node-drain",
            Setting::ReadyBeforeListen => "ready-before-listen",
            Setting::NodeDrainCondition => "node-drain-condition",
            Setting::NodeShutdown => "node-shutdown",
        }
    }

    /// The lint rule the setting is about (None: a setting lint should find clean).
    pub fn rule(self) -> Option<&'static str> {
        use kproxy_lint::rules as r;
        match self {
            Setting::Recommended
            | Setting::KproxyRestart
            | Setting::NftFlush
            | Setting::KproxyKill
            | Setting::ApiOutage
            | Setting::WatchCut
            | Setting::NodeDrain
            | Setting::NodeDrainCondition
            | Setting::NodeShutdown => None,
            Setting::ShortPrestop => Some(r::PRESTOP_SHORTER_THAN_LB_DETECTION),
            Setting::ReadinessInequalityViolated => Some(r::READINESS_FAILS_BEFORE_KILL),
            Setting::GraceShorterThanDrain => Some(r::TERMINATION_GRACE_VS_LB_DRAIN),
            Setting::EarlyReady => Some(r::READY_BEFORE_LB_REGISTRATION),
            Setting::ReadyBeforeListen => Some(r::READINESS_PROBE_MISSING),
        }
    }

    /// Rows about the proxy rather than the pod: run with graceful pods only (when
    /// the selection has them).
    fn graceful_only(self) -> bool {
        self.chaos().is_some()
            || self.drain_by().is_some()
            || matches!(self, Setting::ReadyBeforeListen)
    }

    /// How the setting drains a node instead of rolling the Deployment.
    pub fn drain_by(self) -> Option<DrainBy> {
        match self {
            Setting::NodeDrain => Some(DrainBy::AutoscalerTaint),
            Setting::NodeDrainCondition => Some(DrainBy::Condition),
            Setting::NodeShutdown => Some(DrainBy::Shutdown),
            _ => None,
        }
    }

    /// The chaos of the setting's rollout.
    pub fn chaos(self) -> Option<Chaos> {
        match self {
            Setting::KproxyRestart => Some(Chaos::RestartKproxy),
            Setting::NftFlush => Some(Chaos::FlushRuleset),
            Setting::KproxyKill => Some(Chaos::KillKproxy),
            Setting::ApiOutage => Some(Chaos::ApiOutage),
            Setting::WatchCut => Some(Chaos::WatchCut),
            _ => None,
        }
    }

    /// The lab's Service for this setting: eTP Local, except for the node drains and
    /// the pods Ready before they listen.
    pub fn etp_local(self) -> bool {
        self.drain_by().is_none() && self != Setting::ReadyBeforeListen
    }

    fn applies_to(self, profile: PodProfile) -> bool {
        match self {
            Setting::ReadinessInequalityViolated => profile == PodProfile::FailReadinessOnTerm,
            _ => true,
        }
    }
}

pub const ALL_SETTINGS: [Setting; 14] = [
    Setting::Recommended,
    Setting::ShortPrestop,
    Setting::ReadinessInequalityViolated,
    Setting::GraceShorterThanDrain,
    Setting::EarlyReady,
    Setting::KproxyRestart,
    Setting::NftFlush,
    Setting::KproxyKill,
    Setting::ApiOutage,
    Setting::WatchCut,
    Setting::NodeDrain,
    Setting::ReadyBeforeListen,
    Setting::NodeDrainCondition,
    Setting::NodeShutdown,
];
pub const ALL_PROFILES: [PodProfile; 3] = [
    PodProfile::Graceful,
    PodProfile::FailReadinessOnTerm,
    PodProfile::ExitOnTerm,
];
pub const ALL_PRESETS: [LbPreset; 3] = [LbPreset::Gke, LbPreset::AwsNlb, LbPreset::Azure];

/// One cell of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Cell {
    pub profile: PodProfile,
    pub setting: Setting,
    pub preset: LbPreset,
    pub behaviour: Behaviour,
}

impl Cell {
    pub fn id(&self) -> String {
        format!(
            "{}/{}/{}/{}",
            profile_str(self.profile),
            self.setting.as_str(),
            preset_str(self.preset),
            self.behaviour.as_str()
        )
    }
}

pub fn profile_str(p: PodProfile) -> &'static str {
    match p {
        PodProfile::Graceful => "graceful",
        PodProfile::FailReadinessOnTerm => "fail-readiness-on-term",
        PodProfile::ExitOnTerm => "exit-on-term",
    }
}

pub fn preset_str(p: LbPreset) -> &'static str {
    match p {
        LbPreset::Gke => "gke",
        LbPreset::AwsNlb => "aws-nlb",
        LbPreset::Azure => "azure",
        LbPreset::Custom => "custom",
    }
}

/// Which cells to run.
#[derive(Clone, Debug, PartialEq)]
pub struct Selection {
    pub profiles: Vec<PodProfile>,
    pub settings: Vec<Setting>,
    pub presets: Vec<LbPreset>,
    pub behaviours: Vec<Behaviour>,
}

impl Selection {
    pub fn full() -> Selection {
        Selection {
            profiles: ALL_PROFILES.to_vec(),
            settings: ALL_SETTINGS.to_vec(),
            presets: ALL_PRESETS.to_vec(),
            behaviours: vec![Behaviour::Pre126, Behaviour::Kproxy],
        }
    }

    /// The matrix CI runs: graceful pods behind `gke`, the recommended settings, the
    /// short preStop, the kproxy restart and the node drains (taint, condition,
    /// shutdown), under both behaviours.
    pub fn reduced() -> Selection {
        Selection {
            profiles: vec![PodProfile::Graceful],
            settings: vec![
                Setting::Recommended,
                Setting::ShortPrestop,
                Setting::KproxyRestart,
                Setting::NodeDrain,
                Setting::ReadyBeforeListen,
                Setting::NodeDrainCondition,
                Setting::NodeShutdown,
            ],
            presets: vec![LbPreset::Gke],
            behaviours: vec![Behaviour::Pre126, Behaviour::Kproxy],
        }
    }

    /// The cells, setting by setting (the table's row order). The kproxy restart and
    /// the node drain run with graceful pods only: they test the proxy, not the pod.
    pub fn cells(&self) -> Vec<Cell> {
        let mut out = Vec::new();
        for &setting in &self.settings {
            for &profile in &self.profiles {
                if !setting.applies_to(profile)
                    || (setting.graceful_only()
                        && profile != PodProfile::Graceful
                        && self.profiles.contains(&PodProfile::Graceful))
                {
                    continue;
                }
                for &preset in &self.presets {
                    for &behaviour in &self.behaviours {
                        out.push(Cell {
                            profile,
                            setting,
                            preset,
                            behaviour,
                        });
                    }
                }
            }
        }
        out
    }
}

/// Nominal seconds until the emulated LB sends traffic to a node that turned
/// healthy: its first probe after the registration delay plus `healthy_threshold`
/// intervals.
pub fn lb_registration_s(hc: &HealthCheck) -> f64 {
    hc.registration_delay_seconds + hc.interval_seconds * f64::from(hc.healthy_threshold)
}

/// Real milliseconds from a pod's start to its server listening in the
/// `ready-before-listen` cells: inside the 68-463 ms measured on loaded real nodes
/// (issue 49), and longer than kproxy takes to program a new endpoint.
pub const READY_BEFORE_LISTEN_MS: u64 = 400;

/// The LB's connection draining in every cell (nominal s): a removed node's
/// established flows are cut this long after it left the pool. The lab LB and lint
/// are given the same number; the recommended grace period covers it.
pub const DRAIN_SECONDS: f64 = 20.0;
/// The drain in the grace-shorter-than-drain cells.
pub const LONG_DRAIN_SECONDS: f64 = 30.0;

/// The rollout configuration of a cell, derived from `base` (load, time scale, seed)
/// and the preset's health check, so that "recommended" is right for every preset.
pub fn config_for(cell: &Cell, base: &RolloutConfig) -> Result<RolloutConfig, LabError> {
    let mut c = base.clone();
    c.load_balancer.preset = cell.preset;
    c.load_balancer.health_check = None;
    let mut hc = c.load_balancer.effective_health_check()?;
    hc.drain_timeout_seconds = DRAIN_SECONDS;
    // The time until the LB stops sending new connections, plus a second for kproxy.
    let window = hc.detection_window_s() + 1.0;
    let pre_stop = (window.ceil() + 2.0).max(10.0);
    c.pod.profile = cell.profile;
    c.pod.pre_stop_sleep_seconds = pre_stop;
    c.pod.termination_grace_period_seconds = pre_stop + DRAIN_SECONDS;
    let p = &mut c.pod.readiness_probe;
    p.period_seconds = 10.0;
    p.failure_threshold = 3;
    p.success_threshold = 1;
    p.initial_delay_seconds = (lb_registration_s(&hc).ceil() + 2.0).max(20.0);
    match cell.setting {
        Setting::Recommended
        | Setting::KproxyRestart
        | Setting::NftFlush
        | Setting::KproxyKill
        | Setting::ApiOutage
        | Setting::WatchCut => {}
        // Replacement pods must fit on the remaining nodes.
        Setting::NodeDrain | Setting::NodeDrainCondition | Setting::NodeShutdown => {
            c.deployment.one_pod_per_node = false
        }
        Setting::ShortPrestop => c.pod.pre_stop_sleep_seconds = 1.0,
        Setting::ReadinessInequalityViolated => {
            p.period_seconds = 5.0;
            p.failure_threshold = 2;
        }
        Setting::GraceShorterThanDrain => {
            c.pod.termination_grace_period_seconds = pre_stop + 2.0;
            hc.drain_timeout_seconds = LONG_DRAIN_SECONDS;
        }
        Setting::EarlyReady => {
            p.initial_delay_seconds = 0.0;
            p.period_seconds = 1.0;
        }
        // No readiness probe: Ready as soon as the container runs, which is
        // READY_BEFORE_LISTEN_MS before its server binds.
        Setting::ReadyBeforeListen => {
            p.initial_delay_seconds = 0.0;
            p.period_seconds = 1.0;
            c.pod.listen_delay_ms = READY_BEFORE_LISTEN_MS;
        }
    }
    c.load_balancer.health_check = Some(hc);
    c.validate()?;
    Ok(c)
}

/// The node drain of the node-drain row: node 2 (of 3), deleted one LB interval after
/// its last pod is gone. From the taint to the deletion then passes the pods'
/// preStop (longer than the LB's detection window in every cell) plus an interval:
/// the autoscaler waits for the evicted pods (`--max-graceful-termination-sec`)
/// before it deletes the node.
pub fn node_drain(cfg: &RolloutConfig, by: DrainBy) -> NodeDrain {
    let interval = cfg
        .load_balancer
        .effective_health_check()
        .map_or(3.0, |hc| hc.interval_seconds);
    NodeDrain {
        node: 2.min(cfg.nodes),
        delete_after_s: interval,
        by,
    }
}
