//! The same scenario on both control planes, side by side: the
//! emulated run and the k8s-lab run of one behaviour are reduced to the milestones of
//! their rolling update (a node's old pod terminating, its endpoint conditions
//! changing, its new pod ready, its health check answer, the rollout done), named by
//! rollout step and occurrence so that the two runs line up although their pods are
//! named differently and kcm's ReplicaSet controller may pick another node first
//! (`step2` = the node whose old pod was deleted second), with times relative to the
//! rollout start (nominal seconds). Pure functions over `RunResult`s.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::report::RunResult;
use crate::scenario::run::ControlPlaneKind;
use crate::world::timeline::EventKind;

/// One moment of a rollout, named so that both control planes produce the same
/// name for the same step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Milestone {
    /// e.g. `step1 endpoints old:-ST #1`, `step2 new pod ready #1`.
    pub what: String,
    /// Nominal seconds after the rollout started.
    pub t_s: f64,
}

/// Revision per pod name, from the kubelet's `pod_created` events.
fn revisions(r: &RunResult) -> BTreeMap<String, u32> {
    r.events
        .iter()
        .filter(|e| e.kind == EventKind::PodCreated)
        .filter_map(|e| {
            let rev = e
                .detail
                .strip_prefix("revision ")?
                .split(',')
                .next()?
                .trim()
                .parse()
                .ok()?;
            Some((e.pod.clone()?, rev))
        })
        .collect()
}

/// Per node, the endpoints of a slice summary (`pod@node:RST ...`) as
/// `old:RST`/`new:RST`, sorted.
fn endpoints_by_node(summary: &str, revs: &BTreeMap<String, u32>) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for part in summary.split_whitespace() {
        let Some((pod, rest)) = part.split_once('@') else {
            continue;
        };
        let Some((node, flags)) = rest.split_once(':') else {
            continue;
        };
        let age = match revs.get(pod) {
            Some(1) => "old",
            Some(_) => "new",
            None => "?",
        };
        out.entry(node.to_string())
            .or_default()
            .push(format!("{age}:{flags}"));
    }
    for v in out.values_mut() {
        v.sort();
    }
    out
}

/// The milestones of `r`'s rolling update, in time order.
pub fn milestones(r: &RunResult) -> Vec<Milestone> {
    let revs = revisions(r);
    let t0 = r.rollout_start_ms;
    let nominal = |ms: f64| (ms - t0) / 1000.0 / r.time_scale;
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = Vec::new();
    let mut push = |what: String, t_ms: f64| {
        let n = seen.entry(what.clone()).or_insert(0);
        *n += 1;
        out.push(Milestone {
            what: format!("{what} #{n}"),
            t_s: nominal(t_ms),
        });
    };
    let in_rollout =
        |e: &&crate::world::timeline::Event| e.t_ms >= t0 && e.t_ms <= r.rollout_end_ms;
    // Node -> step name, in the order the old pods began terminating.
    let mut step: BTreeMap<String, String> = BTreeMap::new();
    for e in r
        .events
        .iter()
        .filter(in_rollout)
        .filter(|e| e.kind == EventKind::PodTerminating)
    {
        if let Some(n) = &e.node {
            let k = step.len() + 1;
            step.entry(n.clone()).or_insert_with(|| format!("step{k}"));
        }
    }
    let name = |node: &str| step.get(node).cloned().unwrap_or_else(|| node.to_string());
    let mut last_eps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in r.events.iter().filter(in_rollout) {
        let node = name(e.node.as_deref().unwrap_or_default());
        let age = |pod: &Option<String>| match pod.as_ref().and_then(|p| revs.get(p)) {
            Some(1) => "old",
            _ => "new",
        };
        match e.kind {
            EventKind::PodTerminating => push(format!("{node} old pod terminating"), e.t_ms),
            EventKind::PodSigterm => push(format!("{node} old pod SIGTERM"), e.t_ms),
            EventKind::PodExited | EventKind::PodKilled => {
                push(format!("{node} old pod ended"), e.t_ms)
            }
            EventKind::PodCreated => push(format!("{node} new pod started"), e.t_ms),
            EventKind::PodReady => push(format!("{node} {} pod ready", age(&e.pod)), e.t_ms),
            EventKind::HealthAnswer => push(format!("{node} {}", e.detail), e.t_ms),
            EventKind::SlicePublished => {
                let eps = endpoints_by_node(&e.detail, &revs);
                let nodes: std::collections::BTreeSet<&String> =
                    eps.keys().chain(last_eps.keys()).collect();
                for n in nodes {
                    let now = eps.get(n).cloned().unwrap_or_default();
                    if last_eps.get(n).cloned().unwrap_or_default() != now {
                        let shown = if now.is_empty() {
                            "none".to_string()
                        } else {
                            now.join(",")
                        };
                        push(format!("{} endpoints {shown}", name(n)), e.t_ms);
                    }
                }
                last_eps = eps;
            }
            _ => {}
        }
    }
    push("rollout done".into(), r.rollout_end_ms);
    out
}

/// One line of the comparison: a milestone and when it happened on each plane.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub what: String,
    pub emulated_s: Option<f64>,
    pub k8s_lab_s: Option<f64>,
}

/// Line up two runs' milestones by name (emulated order first, then what only the
/// real run has).
pub fn align(emulated: &[Milestone], real: &[Milestone]) -> Vec<Row> {
    let real_t: BTreeMap<&str, f64> = real.iter().map(|m| (m.what.as_str(), m.t_s)).collect();
    let emu_names: std::collections::HashSet<&str> =
        emulated.iter().map(|m| m.what.as_str()).collect();
    let mut rows: Vec<Row> = emulated
        .iter()
        .map(|m| Row {
            what: m.what.clone(),
            emulated_s: Some(m.t_s),
            k8s_lab_s: real_t.get(m.what.as_str()).copied(),
        })
        .collect();
    rows.extend(
        real.iter()
            .filter(|m| !emu_names.contains(m.what.as_str()))
            .map(|m| Row {
                what: m.what.clone(),
                emulated_s: None,
                k8s_lab_s: Some(m.t_s),
            }),
    );
    rows
}

/// Pairs (emulated, k8s-lab) of runs with the same behaviour and run number.
pub fn pairs(runs: &[RunResult]) -> Vec<(&RunResult, &RunResult)> {
    runs.iter()
        .filter(|r| r.control_plane == ControlPlaneKind::Emulated)
        .filter_map(|e| {
            runs.iter()
                .find(|r| {
                    r.control_plane == ControlPlaneKind::K8sLab
                        && r.behaviour == e.behaviour
                        && r.run == e.run
                })
                .map(|k| (e, k))
        })
        .collect()
}

fn failed(r: &RunResult) -> usize {
    r.records.iter().filter(|x| !x.outcome.is_ok()).count()
}

/// The text section comparing every pair; empty when there is no pair.
pub fn render_text(runs: &[RunResult]) -> String {
    let mut s = String::new();
    for (e, k) in pairs(runs) {
        let dur = |r: &RunResult| (r.rollout_end_ms - r.rollout_start_ms) / 1000.0 / r.time_scale;
        let _ = writeln!(
            s,
            "\n== {} run {}: emulated vs k8s-lab control plane (nominal s after the rollout started)",
            e.behaviour.as_str(),
            e.run + 1
        );
        let _ = writeln!(
            s,
            "  failed: {} of {} vs {} of {}; rollout took {:.1} s vs {:.1} s",
            failed(e),
            e.records.len(),
            failed(k),
            k.records.len(),
            dur(e),
            dur(k)
        );
        let _ = writeln!(
            s,
            "  {:<44} {:>9} {:>9} {:>8}",
            "milestone", "emulated", "k8s-lab", "delta"
        );
        for row in align(&milestones(e), &milestones(k)) {
            let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
            let d = match (row.emulated_s, row.k8s_lab_s) {
                (Some(a), Some(b)) => format!("{:+.2}", b - a),
                _ => "-".into(),
            };
            let _ = writeln!(
                s,
                "  {:<44} {:>9} {:>9} {:>8}",
                row.what,
                f(row.emulated_s),
                f(row.k8s_lab_s),
                d
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_grouped_by_node_and_age() {
        let mut revs = BTreeMap::new();
        revs.insert("a".to_string(), 1);
        revs.insert("b".to_string(), 2);
        let m = endpoints_by_node("a@node-1:-ST b@node-1:R-- c@node-2:RS-", &revs);
        assert_eq!(m["node-1"], vec!["new:R--", "old:-ST"]);
        assert_eq!(m["node-2"], vec!["?:RS-"]);
    }

    fn run(plane: ControlPlaneKind, events: Vec<(f64, EventKind, &str, &str, &str)>) -> RunResult {
        RunResult {
            control_plane: plane,
            behaviour: crate::scenario::run::Behaviour::Kproxy,
            run: 0,
            time_scale: 0.1,
            nodes: vec!["node-1".into(), "node-2".into()],
            health_check: crate::scenario::balancer::LbPreset::Gke
                .health_check()
                .expect("gke"),
            records: vec![],
            events: events
                .into_iter()
                .map(
                    |(t_ms, kind, node, pod, detail)| crate::world::timeline::Event {
                        t_ms,
                        kind,
                        node: (!node.is_empty()).then(|| node.to_string()),
                        pod: (!pod.is_empty()).then(|| pod.to_string()),
                        detail: detail.into(),
                    },
                )
                .collect(),
            load_start_ms: 0.0,
            rollout_start_ms: 1000.0,
            rollout_end_ms: 2100.0,
            load_end_ms: 3000.0,
            drain: None,
            kernel: Vec::new(),
        }
    }

    /// The same steps on different nodes and with different pod names line up: the
    /// first node whose old pod terminates is step1 on both planes.
    #[test]
    fn milestones_are_named_by_rollout_step() {
        use EventKind as K;
        let emulated = run(
            ControlPlaneKind::Emulated,
            vec![
                (
                    10.0,
                    K::PodCreated,
                    "node-1",
                    "web-r1-1",
                    "revision 1, 10.244.1.2",
                ),
                (1001.0, K::PodTerminating, "node-1", "web-r1-1", ""),
                (1050.0, K::SlicePublished, "", "", "web-r1-1@node-1:-ST"),
                (
                    1500.0,
                    K::PodCreated,
                    "node-1",
                    "web-r2-2",
                    "revision 2, 10.244.1.3",
                ),
                (2000.0, K::PodReady, "node-1", "web-r2-2", ""),
            ],
        );
        let real = run(
            ControlPlaneKind::K8sLab,
            vec![
                (
                    10.0,
                    K::PodCreated,
                    "node-2",
                    "web-aa-x",
                    "revision 1, 10.244.2.2",
                ),
                (1100.0, K::PodTerminating, "node-2", "web-aa-x", ""),
                (1150.0, K::SlicePublished, "", "", "web-aa-x@node-2:-ST"),
                (
                    1600.0,
                    K::PodCreated,
                    "node-2",
                    "web-bb-y",
                    "revision 2, 10.244.2.3",
                ),
                (2050.0, K::PodReady, "node-2", "web-bb-y", ""),
            ],
        );
        let names =
            |r: &RunResult| -> Vec<String> { milestones(r).into_iter().map(|m| m.what).collect() };
        let want = [
            "step1 old pod terminating #1",
            "step1 endpoints old:-ST #1",
            "step1 new pod started #1",
            "step1 new pod ready #1",
            "rollout done #1",
        ];
        assert_eq!(names(&emulated), want);
        assert_eq!(names(&real), want);
        let rows = align(&milestones(&emulated), &milestones(&real));
        assert_eq!(rows.len(), 5);
        assert_eq!(rows[0].emulated_s, Some(0.01));
        assert_eq!(rows[0].k8s_lab_s, Some(1.0));
        let runs = [emulated, real];
        assert_eq!(pairs(&runs).len(), 1);
        assert!(render_text(&runs).contains("step1 new pod ready #1"));
    }

    #[test]
    fn align_keeps_both_sides() {
        let m = |w: &str, t: f64| Milestone {
            what: w.into(),
            t_s: t,
        };
        let rows = align(
            &[m("x #1", 1.0), m("y #1", 2.0)],
            &[m("y #1", 2.5), m("z #1", 3.0)],
        );
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].k8s_lab_s, None);
        assert_eq!(rows[1].k8s_lab_s, Some(2.5));
        assert_eq!(rows[2].emulated_s, None);
    }
}
