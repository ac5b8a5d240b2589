//! The scenario matrix's cells: pod profiles × the settings of the rolling-update
//! guide (seed 2, summed up in docs/lint-rules.md) ×
//! load-balancer presets × both proxy behaviours, plus a kproxy restart in the middle
//! of a rollout and a node drain by the cluster autoscaler; which cells a selection
//! holds, and each cell's `RolloutConfig`. Running them is `runs::matrix`, judging them
//! against lint `report::matrix`.

use std::sync::LazyLock;

use clap::ValueEnum;
use clap::builder::PossibleValue;
use serde::Serialize;

use crate::LabError;
use crate::scenario::balancer::{HealthCheck, LbPreset};
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::run::{Behaviour, Chaos, DrainBy, NodeDrain};
use crate::scenario::workload::PodProfile;

/// One row of the matrix: a rollout under one of seed 2's settings (or a node drain in
/// its place), or the recommended rollout with a [`Chaos`]. Every chaos is a row of
/// the full matrix by itself. A row's one name (command line, cell id, JSON) is its
/// inner enum's `ValueEnum` name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Setting {
    Plain(Plain),
    Chaos(Chaos),
}

/// The rows without chaos: seed 2's settings, each a deviation from the recommended
/// one, the pods Ready before they listen, and the node drains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Plain {
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
    /// No rollout: the cluster autoscaler drains a node of an `externalTrafficPolicy:
    /// Cluster` Service whose load balancer probes kproxy's `/healthz` (KEP-3836):
    /// taint `ToBeDeletedByClusterAutoscaler`, evict its pods, delete the node
    /// ([`NodeDrain`]).
    NodeDrain,
    /// Pods without a readiness probe whose server listens 400 ms after it starts
    /// (Ready before it listens, issue 49), behind an `externalTrafficPolicy: Cluster`
    /// Service as in upstream's rolling-update spec: every proxy programs the new pod
    /// before it can answer; kproxy's endpoint warm-up holds it while the other pods
    /// serve.
    ReadyBeforeListen,
    /// The node drain with the Node condition `DrainInProgress` (KEP-5683) in place of
    /// the taint ([`DrainBy::Condition`]).
    NodeDrainCondition,
    /// A graceful node shutdown: the condition `GracefulNodeShutdownInProgress`, the
    /// node's pods and kproxy stopped at once while the load balancer still sends it
    /// new connections, the node gone once kproxy has exited ([`DrainBy::Shutdown`]).
    NodeShutdown,
}

/// Every row, in the table's order: seed 2's settings, each chaos (running the
/// recommended settings), then the rest as they were added.
static ALL_SETTINGS: LazyLock<Vec<Setting>> = LazyLock::new(|| {
    let (guide, rest) = Plain::value_variants().split_at(Plain::EarlyReady as usize + 1);
    let plain = |rows: &[Plain]| rows.iter().copied().map(Setting::Plain).collect::<Vec<_>>();
    let chaos = Chaos::value_variants().iter().copied().map(Setting::Chaos);
    plain(guide)
        .into_iter()
        .chain(chaos)
        .chain(plain(rest))
        .collect()
});

impl ValueEnum for Setting {
    fn value_variants<'a>() -> &'a [Self] {
        &ALL_SETTINGS
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        match self {
            Setting::Plain(p) => p.to_possible_value(),
            Setting::Chaos(c) => c.to_possible_value().map(|v| {
                // The chaos's own words, as a sentence on from "The recommended settings, and".
                let help = v.get_help().map(ToString::to_string).unwrap_or_default();
                let mut words = help.chars();
                let first = words.next().map(|c| c.to_lowercase().to_string());
                let help = first.unwrap_or_default() + words.as_str();
                v.help(format!("The recommended settings, and {help}"))
            }),
        }
    }
}

crate::scenario::named_by_value_enum!(Setting);

impl From<Plain> for Setting {
    fn from(p: Plain) -> Setting {
        Setting::Plain(p)
    }
}

impl From<Chaos> for Setting {
    fn from(c: Chaos) -> Setting {
        Setting::Chaos(c)
    }
}

/// What kproxy claims in a row, so which losses of its kproxy cells fail the matrix
/// (`kproxy lab matrix` exits 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// kproxy loses nothing: every lost request fails the matrix.
    NoLoss,
    /// No new connection is lost; keep-alive connections through a node that vanishes
    /// break whatever the proxy does.
    NoNewConnectionLost,
    /// None: the setting is one lint flags, its losses are judged against lint.
    Nothing,
}

impl Claim {
    /// Whether `lost` requests, `lost_kept_alive` of them on kept-alive connections,
    /// break the claim.
    pub fn broken_by(self, lost: usize, lost_kept_alive: usize) -> bool {
        match self {
            Claim::NoLoss => lost > 0,
            Claim::NoNewConnectionLost => lost > lost_kept_alive,
            Claim::Nothing => false,
        }
    }
}

// Every property of a row is an exhaustive match: a new `Plain` or `Chaos` variant is
// not judged, run or shown until the compiler has had an arm for it here. A chaos row
// runs the recommended settings with graceful pods behind an eTP-Local Service, so
// only its claim is asked of each chaos.
impl Setting {
    /// The lint rule the setting is about (None: a setting lint should find clean).
    pub fn rule(self) -> Option<&'static str> {
        use kproxy_lint::rules as r;
        match self {
            Setting::Plain(
                Plain::Recommended
                | Plain::NodeDrain
                | Plain::NodeDrainCondition
                | Plain::NodeShutdown,
            )
            | Setting::Chaos(_) => None,
            Setting::Plain(Plain::ShortPrestop) => Some(r::PRESTOP_SHORTER_THAN_LB_DETECTION),
            Setting::Plain(Plain::ReadinessInequalityViolated) => {
                Some(r::READINESS_FAILS_BEFORE_KILL)
            }
            Setting::Plain(Plain::GraceShorterThanDrain) => Some(r::TERMINATION_GRACE_VS_LB_DRAIN),
            Setting::Plain(Plain::EarlyReady) => Some(r::READY_BEFORE_LB_REGISTRATION),
            Setting::Plain(Plain::ReadyBeforeListen) => Some(r::READINESS_PROBE_MISSING),
        }
    }

    /// What kproxy claims in the row: the claims under test are that kproxy loses
    /// nothing with the recommended settings, across every chaos, and with pods Ready
    /// before they listen (its endpoint warm-up); and no new connection when a node
    /// drains (taint or condition) or shuts down.
    pub fn claim(self) -> Claim {
        match self {
            Setting::Plain(Plain::Recommended | Plain::ReadyBeforeListen)
            | Setting::Chaos(
                Chaos::KproxyRestart
                | Chaos::NftFlush
                | Chaos::KproxyKill
                | Chaos::ApiOutage
                | Chaos::WatchCut,
            ) => Claim::NoLoss,
            Setting::Plain(Plain::NodeDrain | Plain::NodeDrainCondition | Plain::NodeShutdown) => {
                Claim::NoNewConnectionLost
            }
            Setting::Plain(
                Plain::ShortPrestop
                | Plain::ReadinessInequalityViolated
                | Plain::GraceShorterThanDrain
                | Plain::EarlyReady,
            ) => Claim::Nothing,
        }
    }

    /// Rows about the proxy rather than the pod: run with graceful pods only (when
    /// the selection has them).
    fn graceful_only(self) -> bool {
        match self {
            Setting::Plain(
                Plain::Recommended
                | Plain::ShortPrestop
                | Plain::ReadinessInequalityViolated
                | Plain::GraceShorterThanDrain
                | Plain::EarlyReady,
            ) => false,
            Setting::Plain(
                Plain::NodeDrain
                | Plain::ReadyBeforeListen
                | Plain::NodeDrainCondition
                | Plain::NodeShutdown,
            )
            | Setting::Chaos(_) => true,
        }
    }

    /// How the setting drains a node instead of rolling the Deployment.
    pub fn drain_by(self) -> Option<DrainBy> {
        match self {
            Setting::Plain(Plain::NodeDrain) => Some(DrainBy::AutoscalerTaint),
            Setting::Plain(Plain::NodeDrainCondition) => Some(DrainBy::Condition),
            Setting::Plain(Plain::NodeShutdown) => Some(DrainBy::Shutdown),
            Setting::Plain(
                Plain::Recommended
                | Plain::ShortPrestop
                | Plain::ReadinessInequalityViolated
                | Plain::GraceShorterThanDrain
                | Plain::EarlyReady
                | Plain::ReadyBeforeListen,
            )
            | Setting::Chaos(_) => None,
        }
    }

    /// The chaos of the setting's rollout.
    pub fn chaos(self) -> Option<Chaos> {
        match self {
            Setting::Chaos(c) => Some(c),
            Setting::Plain(_) => None,
        }
    }

    /// The lab's Service for this setting: eTP Local, except for the node drains and
    /// the pods Ready before they listen.
    pub fn etp_local(self) -> bool {
        match self {
            Setting::Plain(
                Plain::Recommended
                | Plain::ShortPrestop
                | Plain::ReadinessInequalityViolated
                | Plain::GraceShorterThanDrain
                | Plain::EarlyReady,
            )
            | Setting::Chaos(_) => true,
            Setting::Plain(
                Plain::NodeDrain
                | Plain::ReadyBeforeListen
                | Plain::NodeDrainCondition
                | Plain::NodeShutdown,
            ) => false,
        }
    }

    /// Whether the setting concerns pods of `profile` at all.
    fn applies_to(self, profile: PodProfile) -> bool {
        match self {
            Setting::Plain(Plain::ReadinessInequalityViolated) => {
                profile == PodProfile::FailReadinessOnTerm
            }
            Setting::Plain(
                Plain::Recommended
                | Plain::ShortPrestop
                | Plain::GraceShorterThanDrain
                | Plain::EarlyReady
                | Plain::NodeDrain
                | Plain::ReadyBeforeListen
                | Plain::NodeDrainCondition
                | Plain::NodeShutdown,
            )
            | Setting::Chaos(_) => true,
        }
    }
}

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
            self.setting,
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
            settings: Setting::value_variants().to_vec(),
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
                Setting::Plain(Plain::Recommended),
                Setting::Plain(Plain::ShortPrestop),
                Setting::Chaos(Chaos::KproxyRestart),
                Setting::Plain(Plain::NodeDrain),
                Setting::Plain(Plain::ReadyBeforeListen),
                Setting::Plain(Plain::NodeDrainCondition),
                Setting::Plain(Plain::NodeShutdown),
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
        Setting::Plain(Plain::Recommended) | Setting::Chaos(_) => {}
        // Replacement pods must fit on the remaining nodes.
        Setting::Plain(Plain::NodeDrain | Plain::NodeDrainCondition | Plain::NodeShutdown) => {
            c.deployment.one_pod_per_node = false
        }
        Setting::Plain(Plain::ShortPrestop) => c.pod.pre_stop_sleep_seconds = 1.0,
        Setting::Plain(Plain::ReadinessInequalityViolated) => {
            p.period_seconds = 5.0;
            p.failure_threshold = 2;
        }
        Setting::Plain(Plain::GraceShorterThanDrain) => {
            c.pod.termination_grace_period_seconds = pre_stop + 2.0;
            hc.drain_timeout_seconds = LONG_DRAIN_SECONDS;
        }
        Setting::Plain(Plain::EarlyReady) => {
            p.initial_delay_seconds = 0.0;
            p.period_seconds = 1.0;
        }
        // No readiness probe: Ready as soon as the container runs, which is
        // READY_BEFORE_LISTEN_MS before its server binds.
        Setting::Plain(Plain::ReadyBeforeListen) => {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows' names and order are the command line's, the cell ids' and the JSON's:
    /// one name each, from the derive, parsed back to the same row.
    #[test]
    fn every_row_has_one_name_in_the_table_order() {
        let names: Vec<String> = Setting::value_variants()
            .iter()
            .map(Setting::to_string)
            .collect();
        assert_eq!(
            names,
            [
                "recommended",
                "short-prestop",
                "readiness-inequality-violated",
                "grace-shorter-than-drain",
                "early-ready",
                "kproxy-restart",
                "nft-flush",
                "kproxy-kill",
                "api-outage",
                "watch-cut",
                "node-drain",
                "ready-before-listen",
                "node-drain-condition",
                "node-shutdown",
            ]
        );
        for &s in Setting::value_variants() {
            let name = s.to_string();
            assert_eq!(Setting::from_str(&name, false), Ok(s), "{name}");
            assert_eq!(serde_json::to_value(s).unwrap(), name.as_str());
            if let Setting::Chaos(c) = s {
                // `lab rollout --chaos` knows the chaos by the matrix row's name.
                assert_eq!(Chaos::from_str(&name, false), Ok(c), "{name}");
                assert_eq!(c.to_string(), name);
            }
        }
    }

    /// docs/lab.md's counts: the full matrix, its gke third, and the reduced one CI runs.
    #[test]
    fn matrix_sizes() {
        let full = Selection::full();
        assert_eq!(full.cells().len(), 132);
        let gke = Selection {
            presets: vec![LbPreset::Gke],
            ..full
        };
        assert_eq!(gke.cells().len(), 44);
        assert_eq!(Selection::reduced().cells().len(), 14);
    }

    /// A row lint finds clean has nothing to be judged by but its packets: kproxy must
    /// claim something there, or a loss in it would pass unnoticed.
    #[test]
    fn every_row_lint_finds_clean_is_judged_by_its_losses() {
        for &s in Setting::value_variants() {
            if s.rule().is_none() {
                assert_ne!(s.claim(), Claim::Nothing, "{s}");
            }
        }
        assert!(Claim::NoLoss.broken_by(1, 1));
        assert!(!Claim::NoNewConnectionLost.broken_by(3, 3));
        assert!(Claim::NoNewConnectionLost.broken_by(4, 3));
        assert!(!Claim::Nothing.broken_by(50, 0));
    }
}
