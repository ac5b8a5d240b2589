//! The matrix's cells judged: what `kproxy lint` says about the manifests of a cell's
//! settings (a library call on in-memory YAML), each cell's packets beside it, the
//! verdict (does the loss confirm the lint rule?), and the matrix as a text table.
//! Pure functions over the cells and their finished runs.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{RunResult, Summary};
use crate::LabError;
use crate::scenario::balancer::LbPreset;
use crate::scenario::matrix::{Cell, Plain, lb_registration_s, preset_str, profile_str};
use crate::scenario::rollout::RolloutConfig;
use crate::scenario::run::Behaviour;
use crate::scenario::workload::PodProfile;

/// The Deployment, Service and PodDisruptionBudget a user would apply for `cfg`
/// (one YAML stream); what `kproxy lint` reads for the cell. `etp_local`: the
/// Service's externalTrafficPolicy is Local (else Cluster).
pub fn manifests_for(cfg: &RolloutConfig, etp_local: bool) -> String {
    let p = &cfg.pod;
    let r = &p.readiness_probe;
    let d = &cfg.deployment;
    let fails_on_term = p.profile == PodProfile::FailReadinessOnTerm;
    let secs = |v: f64| v.round() as i64;
    // A pod that listens late is the lab's model of a pod without a readiness probe
    // (its probe never looks at the port): lint reads it as one.
    let probe = if p.listen_delay_ms > 0 {
        String::new()
    } else {
        format!(
            "        readinessProbe:\n          httpGet: {{path: /ready, port: 8080}}\n          initialDelaySeconds: {}\n          periodSeconds: {}\n          timeoutSeconds: {}\n          successThreshold: {}\n          failureThreshold: {}\n",
            secs(r.initial_delay_seconds),
            secs(r.period_seconds).max(1),
            secs(r.timeout_seconds).max(1),
            r.success_threshold,
            r.failure_threshold,
        )
    };
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
{probe}        lifecycle:
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
        probe = probe,
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
        .filter(|c| c.cell.setting == Plain::Recommended.into())
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
    /// Of `lost`, requests on keep-alive connections established before (a drained
    /// node that vanishes breaks them, whatever the proxy does); the rest were new
    /// connections.
    pub lost_kept_alive: usize,
    pub lost_by_kind: BTreeMap<String, usize>,
    /// Fewest nodes the LB sent new connections to while the rollout ran.
    pub min_lb_pool: Option<usize>,
    pub rollout_s: f64,
    /// Every burst with its cause.
    pub bursts: Vec<super::Burst>,
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
    let s: Summary = super::summarize(run);
    CellResult {
        id: cell.id(),
        cell: *cell,
        settings: settings_of(cfg),
        sent: s.sent,
        lost: s.failed,
        lost_kept_alive: run
            .records
            .iter()
            .filter(|x| x.reused && !x.outcome.is_ok())
            .count(),
        lost_by_kind: s.failed_by_kind.clone(),
        min_lb_pool: super::min_pool_during_rollout(run),
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
            c.cell.setting,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::matrix::{
        ALL_PRESETS, ALL_PROFILES, Selection, Setting, config_for, node_drain,
    };
    use crate::scenario::run::Chaos;

    fn cell(profile: PodProfile, setting: impl Into<Setting>, preset: LbPreset) -> Cell {
        Cell {
            profile,
            setting: setting.into(),
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
                let c = cell(profile, Plain::Recommended, preset);
                assert_eq!(rules_of(&c), Vec::<String>::new(), "{}", c.id());
            }
        }
        // The gke cell is the rolling-update guide's configuration.
        let cfg = config_for(
            &cell(PodProfile::Graceful, Plain::Recommended, LbPreset::Gke),
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
                (PodProfile::Graceful, Plain::ShortPrestop),
                (
                    PodProfile::FailReadinessOnTerm,
                    Plain::ReadinessInequalityViolated,
                ),
                (PodProfile::Graceful, Plain::GraceShorterThanDrain),
                (PodProfile::Graceful, Plain::EarlyReady),
            ] {
                let c = cell(profile, setting, preset);
                let rules = rules_of(&c);
                let want = Setting::from(setting).rule().unwrap();
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
        let drains = [
            Plain::NodeDrain,
            Plain::NodeDrainCondition,
            Plain::NodeShutdown,
        ];
        for (preset, setting) in ALL_PRESETS.into_iter().flat_map(|p| drains.map(|s| (p, s))) {
            let c = cell(PodProfile::Graceful, setting, preset);
            assert_eq!(rules_of(&c), Vec::<String>::new(), "{}", c.id());
            let cfg = config_for(&c, &RolloutConfig::default()).unwrap();
            assert!(!cfg.deployment.one_pod_per_node, "replacements need room");
            let m = manifests_for(&cfg, c.setting.etp_local());
            assert!(m.contains("externalTrafficPolicy: Cluster"), "{m}");
            let by = c.setting.drain_by().expect("a drain setting");
            let d = node_drain(&cfg, by);
            assert_eq!((d.node, d.by), (2, by));
            let hc = cfg.load_balancer.effective_health_check().unwrap();
            // The evicted pods' preStop alone outlasts the LB's detection window.
            assert!(cfg.pod.pre_stop_sleep_seconds > hc.detection_window_s());
        }
        let rec = cell(PodProfile::Graceful, Plain::Recommended, LbPreset::Gke);
        let cfg = config_for(&rec, &RolloutConfig::default()).unwrap();
        assert!(manifests_for(&cfg, true).contains("externalTrafficPolicy: Local"));
    }

    #[test]
    fn cell_selection() {
        let full = Selection::full().cells();
        // 4 settings × 3 profiles + readiness × 1 + restart, flush, kill, API outage,
        // watch cut, the three drains and ready-before-listen × 1 (graceful), × 3 presets × 2.
        assert_eq!(full.len(), (4 * 3 + 1 + 9) * 3 * 2);
        for setting in [
            Plain::NodeDrain.into(),
            Plain::NodeDrainCondition.into(),
            Plain::NodeShutdown.into(),
            Chaos::NftFlush.into(),
            Chaos::KproxyKill.into(),
        ] {
            assert!(
                full.iter()
                    .filter(|c| c.setting == setting)
                    .all(|c| c.profile == PodProfile::Graceful)
            );
        }
        assert!(
            !full
                .iter()
                .any(|c| c.setting == Plain::ReadinessInequalityViolated.into()
                    && c.profile != PodProfile::FailReadinessOnTerm)
        );
        let reduced = Selection::reduced().cells();
        assert_eq!(reduced.len(), 14);
        let ids: Vec<String> = reduced.iter().map(Cell::id).collect();
        assert!(ids.contains(&"graceful/kproxy-restart/gke/kproxy".to_string()));
        assert!(ids.contains(&"graceful/node-drain/gke/pre-1.26".to_string()));
        assert!(ids.contains(&"graceful/ready-before-listen/gke/kproxy".to_string()));
        assert!(ids.contains(&"graceful/node-drain-condition/gke/kproxy".to_string()));
        assert!(ids.contains(&"graceful/node-shutdown/gke/kproxy".to_string()));
    }

    /// Pods Ready before they listen: no readiness probe in the manifests lint reads
    /// (lint names the missing probe), a server 400 ms late, eTP Cluster.
    #[test]
    fn ready_before_listen_cell_is_a_pod_without_a_probe_that_listens_late() {
        for preset in ALL_PRESETS {
            let c = cell(PodProfile::Graceful, Plain::ReadyBeforeListen, preset);
            let cfg = config_for(&c, &RolloutConfig::default()).unwrap();
            assert_eq!(cfg.pod.listen_delay_ms, 400);
            assert_eq!(cfg.pod.readiness_probe.initial_delay_seconds, 0.0);
            let m = manifests_for(&cfg, c.setting.etp_local());
            assert!(!m.contains("readinessProbe"), "{m}");
            assert!(m.contains("externalTrafficPolicy: Cluster"), "{m}");
            let findings = lint_cell(&cfg, c.setting.etp_local()).unwrap();
            assert!(
                findings
                    .iter()
                    .any(|f| f.rule == kproxy_lint::rules::READINESS_PROBE_MISSING),
                "{findings:?}"
            );
            assert_eq!(verdict(&c, 0, &findings), Verdict::NoLossObserved);
            assert_eq!(verdict(&c, 3, &findings), Verdict::Confirmed);
        }
    }

    #[test]
    fn flagged_loss_no_larger_than_the_recommended_cells_is_not_the_rules() {
        let mk = |setting: Plain, lost: usize, verdict: Verdict| {
            let c = cell(PodProfile::ExitOnTerm, setting, LbPreset::Gke);
            let cfg = config_for(&c, &RolloutConfig::default()).unwrap();
            CellResult {
                id: c.id(),
                cell: c,
                settings: settings_of(&cfg),
                sent: 1000,
                lost,
                lost_kept_alive: 0,
                lost_by_kind: BTreeMap::new(),
                min_lb_pool: None,
                rollout_s: 0.0,
                bursts: vec![],
                lint: vec![],
                verdict,
            }
        };
        let mut v = vec![
            mk(Plain::Recommended, 5, Verdict::MissedByLint),
            mk(Plain::GraceShorterThanDrain, 8, Verdict::Confirmed),
            mk(Plain::ShortPrestop, 54, Verdict::Confirmed),
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
        let short = cell(PodProfile::Graceful, Plain::ShortPrestop, LbPreset::Gke);
        let flagged = [f(kproxy_lint::rules::PRESTOP_SHORTER_THAN_LB_DETECTION)];
        assert_eq!(verdict(&short, 3, &flagged), Verdict::Confirmed);
        assert_eq!(verdict(&short, 0, &flagged), Verdict::NoLossObserved);
        assert_eq!(verdict(&short, 3, &[]), Verdict::MissedByLint);
        let rec = cell(PodProfile::Graceful, Plain::Recommended, LbPreset::Gke);
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
