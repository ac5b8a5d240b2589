//! The scenario matrix: pod profiles × the settings of the rolling-update guide
//! (`../shared/seeds/zero-downtime-etp-local-rolling-updates.txt`) × load-balancer
//! presets × both proxy behaviours, plus a kproxy restart in the middle of a rollout
//! and a node drain by the cluster autoscaler.
//! Each cell is one real rollout; next to its packets stands what `kproxy lint` says
//! about the manifests of the same settings, so the table proves or refutes each lint
//! rule cell by cell.
//!
//! Pure here: the cell list, each cell's `RolloutConfig`, its manifests, the lint call
//! (a library call on in-memory YAML) and the verdict. Running the cells is
//! `run_matrix`, which only calls `scenario::run_with`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::LabError;
use crate::config::RolloutConfig;
use crate::lb::{HealthCheck, LbPreset};
use crate::pod::PodProfile;
use crate::report::{self, Summary};
use crate::scenario::{self, Behaviour, Chaos, Progress, RunOptions, RunResult};

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
    /// No rollout: the cluster autoscaler drains a node of an `externalTrafficPolicy:
    /// Cluster` Service whose load balancer probes kproxy's `/healthz` (KEP-3836):
    /// taint `ToBeDeletedByClusterAutoscaler`, evict its pods, delete the node
    /// ([`scenario::NodeDrain`]).
    NodeDrain,
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
            | Setting::NodeDrain => None,
            Setting::ShortPrestop => Some(r::PRESTOP_SHORTER_THAN_LB_DETECTION),
            Setting::ReadinessInequalityViolated => Some(r::READINESS_FAILS_BEFORE_KILL),
            Setting::GraceShorterThanDrain => Some(r::TERMINATION_GRACE_VS_LB_DRAIN),
            Setting::EarlyReady => Some(r::READY_BEFORE_LB_REGISTRATION),
        }
    }

    /// Rows about the proxy rather than the pod: run with graceful pods only (when
    /// the selection has them).
    fn graceful_only(self) -> bool {
        self.chaos().is_some() || self == Setting::NodeDrain
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

    /// The lab's Service for this setting: eTP Local, except for the node drain.
    pub fn etp_local(self) -> bool {
        self != Setting::NodeDrain
    }

    fn applies_to(self, profile: PodProfile) -> bool {
        match self {
            Setting::ReadinessInequalityViolated => profile == PodProfile::FailReadinessOnTerm,
            _ => true,
        }
    }
}

pub const ALL_SETTINGS: [Setting; 11] = [
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
    /// short preStop, the kproxy restart and the node drain, under both behaviours.
    pub fn reduced() -> Selection {
        Selection {
            profiles: vec![PodProfile::Graceful],
            settings: vec![
                Setting::Recommended,
                Setting::ShortPrestop,
                Setting::KproxyRestart,
                Setting::NodeDrain,
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
        Setting::NodeDrain => c.deployment.one_pod_per_node = false,
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
pub fn node_drain(cfg: &RolloutConfig) -> scenario::NodeDrain {
    let interval = cfg
        .load_balancer
        .effective_health_check()
        .map_or(3.0, |hc| hc.interval_seconds);
    scenario::NodeDrain {
        node: 2.min(cfg.nodes),
        delete_after_s: interval,
    }
}

/// The Deployment, Service and PodDisruptionBudget a user would apply for `cfg`
/// (one YAML stream); what `kproxy lint` reads for the cell. `etp_local`: the
/// Service's externalTrafficPolicy is Local (else Cluster).
pub fn manifests_for(cfg: &RolloutConfig, etp_local: bool) -> String {
    let p = &cfg.pod;
    let r = &p.readiness_probe;
    let d = &cfg.deployment;
    let fails_on_term = p.profile == PodProfile::FailReadinessOnTerm;
    let secs = |v: f64| v.round() as i64;
    format!(
        r#"apiVersion: apps/v1
kind: Deployment
metadata:
  name: web
  namespace: lab
spec:
  replicas: {replicas}
  minReadySeconds: {min_ready}
  strategy:
    type: RollingUpdate
    rollingUpdate: {{maxSurge: {surge}, maxUnavailable: {unavail}}}
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata:
      labels: {{app: web}}
      annotations:
        lint.kproxy.io/readiness-fails-on-sigterm: "{fails_on_term}"
    spec:
      terminationGracePeriodSeconds: {grace}
      containers:
      - name: web
        image: lab/web:{profile}
        ports: [{{name: http, containerPort: 8080}}]
        readinessProbe:
          httpGet: {{path: /ready, port: 8080}}
          initialDelaySeconds: {initial}
          periodSeconds: {period}
          timeoutSeconds: {timeout}
          successThreshold: {success}
          failureThreshold: {failure}
        lifecycle:
          preStop:
            sleep: {{seconds: {pre_stop}}}
---
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: lab
spec:
  type: LoadBalancer
  externalTrafficPolicy: {etp}
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: http}}]
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: web
  namespace: lab
spec:
  maxUnavailable: 1
  selector: {{matchLabels: {{app: web}}}}
"#,
        replicas = d.replicas,
        min_ready = secs(d.min_ready_seconds),
        surge = d.max_surge,
        unavail = d.max_unavailable,
        grace = secs(p.termination_grace_period_seconds),
        profile = profile_str(p.profile),
        initial = secs(r.initial_delay_seconds),
        period = secs(r.period_seconds).max(1),
        timeout = secs(r.timeout_seconds).max(1),
        success = r.success_threshold,
        failure = r.failure_threshold,
        pre_stop = secs(p.pre_stop_sleep_seconds),
        etp = if etp_local { "Local" } else { "Cluster" },
    )
}

/// One lint finding, as the matrix shows it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LintFinding {
    pub rule: String,
    pub severity: String,
    pub message: String,
}

/// `kproxy lint` on the cell's manifests, told the numbers of the load balancer the
/// lab emulates (as `--lb <preset> --lb-interval … --lb-drain … --lb-registration …`
/// would).
pub fn lint_cell(cfg: &RolloutConfig, etp_local: bool) -> Result<Vec<LintFinding>, LabError> {
    use kproxy_lint::{input::Inventory, lb, rules};
    let hc = cfg.load_balancer.effective_health_check()?;
    let name = preset_str(cfg.load_balancer.preset);
    let mut profile = lb::LbProfile::preset(name).unwrap_or_else(lb::LbProfile::gke);
    let overrides = lb::LbOverrides {
        interval_seconds: Some(hc.interval_seconds),
        unhealthy_threshold: Some(hc.unhealthy_threshold),
        timeout_seconds: Some(hc.timeout_seconds.min(hc.interval_seconds)),
        drain_seconds: Some(hc.drain_timeout_seconds),
        registration_seconds: Some(lb_registration_s(&hc)),
    };
    overrides.apply(&mut profile);
    let mut inv = Inventory::default();
    inv.add_file("cell.yaml", &manifests_for(cfg, etp_local));
    let opts = rules::Options {
        lb: profile,
        lb_flags: overrides,
        proxy_programming_seconds: 1.0,
        nodes: Some(cfg.nodes),
    };
    let findings = rules::lint(&inv, &opts);
    if let Some(bad) = findings.iter().find(|f| f.rule == rules::MANIFEST_INVALID) {
        return Err(LabError::Invalid(format!(
            "the matrix's own manifests do not lint: {}",
            bad.message
        )));
    }
    Ok(findings
        .into_iter()
        .map(|f| LintFinding {
            rule: f.rule.to_string(),
            severity: f.severity.as_str().to_string(),
            message: f.message,
        })
        .collect())
}

/// What a kproxy cell's packets say about its setting's lint rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Lint flags the rule and requests were lost.
    Confirmed,
    /// Lint is clean on the rule and nothing was lost.
    CleanConfirmed,
    /// Lint flags the rule, and no request was lost beyond what the recommended
    /// cell of the same profile, LB and behaviour lost (the harm is elsewhere, e.g.
    /// capacity, or on dataplanes the lab does not emulate).
    NoLossObserved,
    /// Lint is clean on the setting's rules but requests were lost.
    MissedByLint,
    /// Pre-1.26 cells: lint assumes a proxy with terminating-endpoint failover.
    Baseline,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Confirmed => "confirmed",
            Verdict::CleanConfirmed => "clean, confirmed",
            Verdict::NoLossObserved => "flagged, no extra loss",
            Verdict::MissedByLint => "missed by lint",
            Verdict::Baseline => "baseline",
        }
    }
}

/// The rolling-update guide's rules the matrix is about (others, e.g. no surge, are shown but judge
/// no cell).
const SEED2_RULES: [&str; 4] = [
    kproxy_lint::rules::PRESTOP_SHORTER_THAN_LB_DETECTION,
    kproxy_lint::rules::READINESS_FAILS_BEFORE_KILL,
    kproxy_lint::rules::TERMINATION_GRACE_VS_LB_DRAIN,
    kproxy_lint::rules::READY_BEFORE_LB_REGISTRATION,
];

pub fn verdict(cell: &Cell, lost: usize, findings: &[LintFinding]) -> Verdict {
    if cell.behaviour == Behaviour::Pre126 {
        return Verdict::Baseline;
    }
    let flagged = match cell.setting.rule() {
        Some(rule) => findings.iter().any(|f| f.rule == rule),
        None => findings
            .iter()
            .any(|f| SEED2_RULES.contains(&f.rule.as_str())),
    };
    match (flagged, lost > 0) {
        (true, true) => Verdict::Confirmed,
        (false, false) => Verdict::CleanConfirmed,
        (true, false) => Verdict::NoLossObserved,
        (false, true) => Verdict::MissedByLint,
    }
}

/// A flagged cell counts as confirmed only when it lost clearly more than the
/// recommended cell of the same profile, preset and behaviour: an `exit-on-term`
/// pod resets its keep-alive connections in every setting, and that loss is not the
/// flagged rule's. "Clearly": more than twice the recommended loss plus 5.
pub fn judge_against_recommended(cells: &mut [CellResult]) {
    let base: Vec<(PodProfile, LbPreset, Behaviour, usize)> = cells
        .iter()
        .filter(|c| c.cell.setting == Setting::Recommended)
        .map(|c| (c.cell.profile, c.cell.preset, c.cell.behaviour, c.lost))
        .collect();
    for c in cells.iter_mut() {
        if c.verdict != Verdict::Confirmed {
            continue;
        }
        let rec = base
            .iter()
            .find(|b| (b.0, b.1, b.2) == (c.cell.profile, c.cell.preset, c.cell.behaviour))
            .map(|b| b.3);
        if let Some(rec) = rec
            && c.lost <= 2 * rec + 5
            && rec > 0
        {
            c.verdict = Verdict::NoLossObserved;
        }
    }
}

/// The result of one cell.
#[derive(Clone, Debug, Serialize)]
pub struct CellResult {
    pub id: String,
    pub cell: Cell,
    pub settings: CellSettings,
    pub sent: usize,
    pub lost: usize,
    pub lost_by_kind: BTreeMap<String, usize>,
    /// Fewest nodes the LB sent new connections to while the rollout ran.
    pub min_lb_pool: Option<usize>,
    pub rollout_s: f64,
    /// Every burst with its cause.
    pub bursts: Vec<report::Burst>,
    pub lint: Vec<LintFinding>,
    pub verdict: Verdict,
}

/// The numbers of a cell, for the table.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct CellSettings {
    pub pre_stop_s: f64,
    pub grace_s: f64,
    pub readiness_period_s: f64,
    pub readiness_failure_threshold: u32,
    pub initial_delay_s: f64,
    pub lb_detection_window_s: f64,
    pub lb_registration_s: f64,
    pub lb_drain_s: f64,
}

fn settings_of(cfg: &RolloutConfig) -> CellSettings {
    let hc = cfg
        .load_balancer
        .effective_health_check()
        .unwrap_or_else(|_| LbPreset::Gke.health_check().expect("gke preset"));
    CellSettings {
        pre_stop_s: cfg.pod.pre_stop_sleep_seconds,
        grace_s: cfg.pod.termination_grace_period_seconds,
        readiness_period_s: cfg.pod.readiness_probe.period_seconds,
        readiness_failure_threshold: cfg.pod.readiness_probe.failure_threshold,
        initial_delay_s: cfg.pod.readiness_probe.initial_delay_seconds,
        lb_detection_window_s: hc.detection_window_s(),
        lb_registration_s: lb_registration_s(&hc),
        lb_drain_s: hc.drain_timeout_seconds,
    }
}

/// Combine a finished run with its cell's lint findings.
pub fn cell_result(
    cell: &Cell,
    cfg: &RolloutConfig,
    run: &RunResult,
    lint: Vec<LintFinding>,
) -> CellResult {
    let s: Summary = report::summarize(run);
    CellResult {
        id: cell.id(),
        cell: *cell,
        settings: settings_of(cfg),
        sent: s.sent,
        lost: s.failed,
        lost_by_kind: s.failed_by_kind.clone(),
        min_lb_pool: report::min_pool_during_rollout(run),
        rollout_s: (run.rollout_end_ms - run.rollout_start_ms) / 1000.0 / run.time_scale,
        bursts: s.bursts,
        verdict: verdict(cell, s.failed, &lint),
        lint,
    }
}

/// The matrix as a text table, then the causes of every burst per cell.
pub fn render_text(cells: &[CellResult]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<30} {:<23} {:<8} {:<9} {:>6} {:>5} {:>4}  {:<18} lint (the guide's rules; others)",
        "setting", "profile", "lb", "behaviour", "sent", "lost", "pool", "verdict"
    );
    for c in cells {
        let (seed2, other): (Vec<&LintFinding>, Vec<&LintFinding>) = c
            .lint
            .iter()
            .partition(|f| SEED2_RULES.contains(&f.rule.as_str()));
        let names = |v: &[&LintFinding]| {
            v.iter()
                .map(|f| format!("{} {}", f.severity, f.rule))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            s,
            "{:<30} {:<23} {:<8} {:<9} {:>6} {:>5} {:>4}  {:<18} {}; {}",
            c.cell.setting.as_str(),
            profile_str(c.cell.profile),
            preset_str(c.cell.preset),
            c.cell.behaviour.as_str(),
            c.sent,
            c.lost,
            c.min_lb_pool.map_or("?".into(), |n| n.to_string()),
            c.verdict.as_str(),
            if seed2.is_empty() {
                "clean".into()
            } else {
                names(&seed2)
            },
            if other.is_empty() {
                "-".into()
            } else {
                names(&other)
            },
        );
    }
    for c in cells.iter().filter(|c| !c.bursts.is_empty()) {
        let _ = writeln!(s, "\n{}:", c.id);
        for b in &c.bursts {
            let _ = writeln!(
                s,
                "  {:>7.2}s..{:>7.2}s  {} failed: {}",
                b.start_s, b.end_s, b.failed, b.cause
            );
        }
    }
    s
}

/// Run every selected cell, one after the other. `on_cell` sees each result as it
/// comes (progress lines, partial reports); the runs are returned for plots.
pub fn run_matrix(
    sel: &Selection,
    base: &RolloutConfig,
    kproxy: &Path,
    control_plane: scenario::ControlPlaneKind,
    progress: Progress,
    on_cell: &mut dyn FnMut(&CellResult, &RunResult),
) -> Result<Vec<CellResult>, LabError> {
    let cells = sel.cells();
    let mut out = Vec::new();
    for (i, cell) in cells.iter().enumerate() {
        if cell.setting.chaos().is_some_and(Chaos::needs_real_api)
            && control_plane == scenario::ControlPlaneKind::Emulated
        {
            progress(&format!(
                "[matrix {}/{}] {}: skipped, needs --control-plane k8s-lab",
                i + 1,
                cells.len(),
                cell.id()
            ));
            continue;
        }
        let cfg = config_for(cell, base)?;
        let lint = lint_cell(&cfg, cell.setting.etp_local())?;
        progress(&format!("[matrix {}/{}] {}", i + 1, cells.len(), cell.id()));
        let opts = RunOptions {
            chaos: cell.setting.chaos(),
            drain: (cell.setting == Setting::NodeDrain).then(|| node_drain(&cfg)),
            control_plane,
        };
        let run = scenario::run_with(&cfg, cell.behaviour, 0, kproxy, opts, progress)
            .map_err(|e| LabError::Invalid(format!("matrix cell {}: {e}", cell.id())))?;
        let r = cell_result(cell, &cfg, &run, lint);
        on_cell(&r, &run);
        out.push(r);
    }
    judge_against_recommended(&mut out);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(profile: PodProfile, setting: Setting, preset: LbPreset) -> Cell {
        Cell {
            profile,
            setting,
            preset,
            behaviour: Behaviour::Kproxy,
        }
    }

    fn rules_of(c: &Cell) -> Vec<String> {
        let cfg = config_for(c, &RolloutConfig::default()).unwrap();
        lint_cell(&cfg, c.setting.etp_local())
            .unwrap()
            .into_iter()
            .filter(|f| SEED2_RULES.contains(&f.rule.as_str()))
            .map(|f| f.rule)
            .collect()
    }

    #[test]
    fn recommended_is_lint_clean_on_seed_2_rules_for_every_preset_and_profile() {
        for preset in ALL_PRESETS {
            for profile in ALL_PROFILES {
                let c = cell(profile, Setting::Recommended, preset);
                assert_eq!(rules_of(&c), Vec::<String>::new(), "{}", c.id());
            }
        }
        // The gke cell is the rolling-update guide's configuration.
        let cfg = config_for(
            &cell(PodProfile::Graceful, Setting::Recommended, LbPreset::Gke),
            &RolloutConfig::default(),
        )
        .unwrap();
        assert_eq!(cfg.pod.pre_stop_sleep_seconds, 10.0);
        assert_eq!(cfg.pod.termination_grace_period_seconds, 30.0);
        assert_eq!(cfg.pod.readiness_probe.initial_delay_seconds, 20.0);
    }

    #[test]
    fn each_bad_setting_trips_exactly_its_rule() {
        for preset in ALL_PRESETS {
            for (profile, setting) in [
                (PodProfile::Graceful, Setting::ShortPrestop),
                (
                    PodProfile::FailReadinessOnTerm,
                    Setting::ReadinessInequalityViolated,
                ),
                (PodProfile::Graceful, Setting::GraceShorterThanDrain),
                (PodProfile::Graceful, Setting::EarlyReady),
            ] {
                let c = cell(profile, setting, preset);
                let rules = rules_of(&c);
                let want = setting.rule().unwrap();
                assert!(rules.iter().any(|r| r == want), "{}: {rules:?}", c.id());
                assert!(
                    rules.iter().all(|r| r == want),
                    "{} trips only {want}: {rules:?}",
                    c.id()
                );
            }
        }
    }

    #[test]
    fn node_drain_cell_is_a_lint_clean_cluster_policy_service_on_room_for_replacements() {
        for preset in ALL_PRESETS {
            let c = cell(PodProfile::Graceful, Setting::NodeDrain, preset);
            assert_eq!(rules_of(&c), Vec::<String>::new(), "{}", c.id());
            let cfg = config_for(&c, &RolloutConfig::default()).unwrap();
            assert!(!cfg.deployment.one_pod_per_node, "replacements need room");
            let m = manifests_for(&cfg, c.setting.etp_local());
            assert!(m.contains("externalTrafficPolicy: Cluster"), "{m}");
            let d = node_drain(&cfg);
            assert_eq!(d.node, 2);
            let hc = cfg.load_balancer.effective_health_check().unwrap();
            // The evicted pods' preStop alone outlasts the LB's detection window.
            assert!(cfg.pod.pre_stop_sleep_seconds > hc.detection_window_s());
        }
        let rec = cell(PodProfile::Graceful, Setting::Recommended, LbPreset::Gke);
        let cfg = config_for(&rec, &RolloutConfig::default()).unwrap();
        assert!(manifests_for(&cfg, true).contains("externalTrafficPolicy: Local"));
    }

    #[test]
    fn cell_selection() {
        let full = Selection::full().cells();
        // 4 settings × 3 profiles + readiness × 1 + restart, flush, kill, API outage,
        // watch cut and drain × 1 (graceful), × 3 presets × 2.
        assert_eq!(full.len(), (4 * 3 + 1 + 6) * 3 * 2);
        for setting in [Setting::NodeDrain, Setting::NftFlush, Setting::KproxyKill] {
            assert!(
                full.iter()
                    .filter(|c| c.setting == setting)
                    .all(|c| c.profile == PodProfile::Graceful)
            );
        }
        assert!(
            !full
                .iter()
                .any(|c| c.setting == Setting::ReadinessInequalityViolated
                    && c.profile != PodProfile::FailReadinessOnTerm)
        );
        let reduced = Selection::reduced().cells();
        assert_eq!(reduced.len(), 8);
        let ids: Vec<String> = reduced.iter().map(Cell::id).collect();
        assert!(ids.contains(&"graceful/kproxy-restart/gke/kproxy".to_string()));
        assert!(ids.contains(&"graceful/node-drain/gke/pre-1.26".to_string()));
    }

    #[test]
    fn flagged_loss_no_larger_than_the_recommended_cells_is_not_the_rules() {
        let mk = |setting: Setting, lost: usize, verdict: Verdict| {
            let c = cell(PodProfile::ExitOnTerm, setting, LbPreset::Gke);
            let cfg = config_for(&c, &RolloutConfig::default()).unwrap();
            CellResult {
                id: c.id(),
                cell: c,
                settings: settings_of(&cfg),
                sent: 1000,
                lost,
                lost_by_kind: BTreeMap::new(),
                min_lb_pool: None,
                rollout_s: 0.0,
                bursts: vec![],
                lint: vec![],
                verdict,
            }
        };
        let mut v = vec![
            mk(Setting::Recommended, 5, Verdict::MissedByLint),
            mk(Setting::GraceShorterThanDrain, 8, Verdict::Confirmed),
            mk(Setting::ShortPrestop, 54, Verdict::Confirmed),
        ];
        judge_against_recommended(&mut v);
        assert_eq!(v[0].verdict, Verdict::MissedByLint);
        assert_eq!(v[1].verdict, Verdict::NoLossObserved);
        assert_eq!(v[2].verdict, Verdict::Confirmed);
    }

    #[test]
    fn verdicts() {
        let f = |rule: &str| LintFinding {
            rule: rule.into(),
            severity: "error".into(),
            message: String::new(),
        };
        let short = cell(PodProfile::Graceful, Setting::ShortPrestop, LbPreset::Gke);
        let flagged = [f(kproxy_lint::rules::PRESTOP_SHORTER_THAN_LB_DETECTION)];
        assert_eq!(verdict(&short, 3, &flagged), Verdict::Confirmed);
        assert_eq!(verdict(&short, 0, &flagged), Verdict::NoLossObserved);
        assert_eq!(verdict(&short, 3, &[]), Verdict::MissedByLint);
        let rec = cell(PodProfile::Graceful, Setting::Recommended, LbPreset::Gke);
        let other = [f(kproxy_lint::rules::ETP_LOCAL_NO_SURGE)];
        assert_eq!(verdict(&rec, 0, &other), Verdict::CleanConfirmed);
        assert_eq!(verdict(&rec, 1, &other), Verdict::MissedByLint);
        let pre = Cell {
            behaviour: Behaviour::Pre126,
            ..rec
        };
        assert_eq!(verdict(&pre, 40, &[]), Verdict::Baseline);
    }
}
