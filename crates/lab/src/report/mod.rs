//! Turning what a run recorded into what a person reads. A run hands over a
//! [`RunResult`] (its request records and its event timeline); this room reduces it to
//! the summary (counts by kind, longest outage, failures per phase), failure bursts
//! with their cause in plain words (`causes`), the run's anomalies (the lab running
//! late, every node failing a health check at once), and renders it as text (`text`),
//! JSON (`json`) and a self-contained HTML page (`html`). `compare` lines up one
//! scenario on both control planes; `matrix` judges the matrix's cells against lint;
//! `held` counts the held runs' phases; `kernel` sets kproxy's kernel counters beside
//! the load generator's failures. Pure functions; all times shown are nominal
//! (real time divided by the time scale).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::scenario::balancer::HealthCheck;
use crate::scenario::run::{Behaviour, ControlPlaneKind, NodeDrain};
use crate::world::loadgen::{Outcome, RequestRecord};
use crate::world::timeline::{Event, EventKind};
use causes::explain_burst;

mod causes;
pub mod compare;
pub mod held;
pub mod html;
pub mod json;
pub mod kernel;
pub mod matrix;
#[cfg(test)]
mod tests;
pub mod text;

/// Everything one run produced. Times are real ms since the run's clock started.
#[derive(Clone, Debug)]
pub struct RunResult {
    pub behaviour: Behaviour,
    pub control_plane: ControlPlaneKind,
    pub run: usize,
    pub time_scale: f64,
    pub nodes: Vec<String>,
    pub health_check: HealthCheck,
    pub records: Vec<RequestRecord>,
    pub events: Vec<Event>,
    pub load_start_ms: f64,
    pub rollout_start_ms: f64,
    pub rollout_end_ms: f64,
    pub load_end_ms: f64,
    /// The node drain the run performed instead of a rolling update (the Service was
    /// `externalTrafficPolicy: Cluster`); None: a rolling update of an eTP-Local Service.
    pub drain: Option<NodeDrain>,
    /// Each node's kernel traffic counters over the load (`kernel`): empty when the
    /// run did not read them.
    pub kernel: Vec<kernel::NodeCounts>,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Burst {
    pub start_s: f64,
    pub end_s: f64,
    pub failed: usize,
    pub kinds: BTreeMap<String, usize>,
    pub cause: String,
}

/// Something a run shows that no setting explains: the lab itself ran late (a preStop
/// longer than configured, a stalled runtime), or every node failed a health check in
/// the same probe round after passing.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Anomaly {
    /// Nominal seconds since the run started.
    pub at_s: f64,
    pub what: String,
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Summary {
    pub behaviour: String,
    /// `emulated` or `k8s-lab`.
    pub control_plane: String,
    pub run: usize,
    pub sent: usize,
    pub ok: usize,
    pub failed: usize,
    pub failed_by_kind: BTreeMap<String, usize>,
    /// Longest span (nominal s) from the first to the last failure of a burst with
    /// no success in between.
    pub longest_outage_s: f64,
    pub failed_before_rollout: usize,
    pub failed_during_rollout: usize,
    pub failed_after_rollout: usize,
    pub bursts: Vec<Burst>,
    pub anomalies: Vec<Anomaly>,
}

/// The behaviour, with the control plane when it is not the embedded emulation.
fn label(m: &Summary) -> String {
    label_of(&m.behaviour, &m.control_plane)
}

fn label_of(behaviour: &str, control_plane: &str) -> String {
    if control_plane == "emulated" {
        behaviour.to_string()
    } else {
        format!("{behaviour}/{control_plane}")
    }
}

fn nominal(r: &RunResult, ms: f64) -> f64 {
    ms / 1000.0 / r.time_scale
}

/// Group failures into bursts: failures closer than `gap_s` nominal seconds.
pub fn bursts_of(
    records: &[RequestRecord],
    scale: f64,
    gap_s: f64,
) -> Vec<(f64, f64, Vec<&RequestRecord>)> {
    let mut fails: Vec<&RequestRecord> = records.iter().filter(|r| !r.outcome.is_ok()).collect();
    fails.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    let gap_ms = gap_s * 1000.0 * scale;
    let mut out: Vec<(f64, f64, Vec<&RequestRecord>)> = Vec::new();
    for f in fails {
        match out.last_mut() {
            // Bursts span the start times of their failed requests (a timed-out
            // request ends long after the cause is gone).
            Some((_, end, v)) if f.start_ms - *end <= gap_ms => {
                *end = end.max(f.start_ms);
                v.push(f);
            }
            _ => out.push((f.start_ms, f.start_ms, vec![f])),
        }
    }
    out
}

/// Longest stretch (real ms) where every request that started failed.
fn longest_outage_ms(records: &[RequestRecord]) -> f64 {
    let mut v: Vec<&RequestRecord> = records.iter().collect();
    v.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
    let (mut best, mut cur_start) = (0.0f64, None::<f64>);
    let mut cur_end = 0.0;
    for r in v {
        if r.outcome.is_ok() {
            if let Some(s) = cur_start.take() {
                best = best.max(cur_end - s);
            }
        } else {
            if cur_start.is_none() {
                cur_start = Some(r.start_ms);
            }
            cur_end = r.start_ms;
        }
    }
    if let Some(s) = cur_start {
        best = best.max(cur_end - s);
    }
    best
}

/// The run's anomalies, in time order: every `LabLate` event, and every probe round in
/// which all nodes (two or more) turned from passing to failing their health check.
/// Probes of one round are sent together and answered within the probe timeout, so
/// answers within one interval of each other belong to one round.
pub fn anomalies(r: &RunResult) -> Vec<Anomaly> {
    let mut out: Vec<Anomaly> = r
        .events
        .iter()
        .filter(|e| e.kind == EventKind::LabLate)
        .map(|e| Anomaly {
            at_s: nominal(r, e.t_ms),
            what: match (&e.node, &e.pod) {
                (Some(n), Some(p)) => format!("{p} on {n}: {}", e.detail),
                _ => e.detail.clone(),
            },
        })
        .collect();
    let round_ms = r.health_check.interval_seconds * 1000.0 * r.time_scale;
    let mut passing: BTreeMap<&str, bool> = BTreeMap::new();
    // (time, node) of each passes → fails turn.
    let mut turns: Vec<(f64, &str)> = Vec::new();
    for e in r
        .events
        .iter()
        .filter(|e| e.kind == EventKind::HealthAnswer)
    {
        let Some(node) = e.node.as_deref() else {
            continue;
        };
        let passes = e.detail.contains("passes");
        if !passes && passing.get(node) == Some(&true) {
            turns.push((e.t_ms, node));
        }
        passing.insert(node, passes);
    }
    let mut i = 0;
    while i < turns.len() {
        let start = turns[i].0;
        let round: Vec<&(f64, &str)> = turns[i..]
            .iter()
            .take_while(|(t, _)| *t - start < round_ms)
            .collect();
        let mut nodes: Vec<&str> = round.iter().map(|(_, n)| *n).collect();
        nodes.sort();
        nodes.dedup();
        if r.nodes.len() >= 2 && nodes.len() == r.nodes.len() {
            let hc = &r.health_check;
            out.push(Anomaly {
                at_s: nominal(r, start),
                what: format!(
                    "all {} nodes failed the LB's health check in the same probe round, each after passing: a cause on one node does not hit every node at once; the probes timed out together (after {} ms real), so the lab machine (the LB's runtime or the CPU) was too busy to answer in time",
                    nodes.len(),
                    hc.real_probe_timeout(r.time_scale).as_millis()
                ),
            });
        }
        i += round.len();
    }
    out.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    out
}

/// Nodes in an `LbPool` event's pool that are healthy (0 when the LB fell back to
/// all nodes because none was).
fn healthy_in_pool(detail: &str) -> Option<usize> {
    if detail.starts_with("no healthy node") {
        return Some(0);
    }
    let list = detail.strip_prefix("new connections to ")?;
    Some(list.split(", ").filter(|s| !s.is_empty()).count())
}

/// The fewest healthy nodes the LB had in its pool between rollout start and end.
pub fn min_pool_during_rollout(r: &RunResult) -> Option<usize> {
    let mut current = None;
    let mut min: Option<usize> = None;
    for e in r.events.iter().filter(|e| e.kind == EventKind::LbPool) {
        let Some(n) = healthy_in_pool(&e.detail) else {
            continue;
        };
        if e.t_ms <= r.rollout_start_ms {
            current = Some(n);
            continue;
        }
        if e.t_ms > r.rollout_end_ms {
            break;
        }
        if min.is_none() {
            min = current;
        }
        min = Some(min.map_or(n, |m| m.min(n)));
    }
    min.or(current)
}

/// Bursts whose causes read alike, told apart: a burst whose cause is word for word
/// an earlier burst's says so, and how many requests succeeded between the two (the
/// same state of the cluster, failing again after a pause, is not a second cause).
fn tell_apart(r: &RunResult, mut bursts: Vec<Burst>) -> Vec<Burst> {
    for i in 1..bursts.len() {
        let Some(j) = (0..i).rev().find(|&j| bursts[j].cause == bursts[i].cause) else {
            continue;
        };
        let (from_ms, to_ms) = (
            bursts[j].end_s * 1000.0 * r.time_scale,
            bursts[i].start_s * 1000.0 * r.time_scale,
        );
        let ok_between = r
            .records
            .iter()
            .filter(|x| x.outcome.is_ok() && x.start_ms > from_ms && x.start_ms < to_ms)
            .count();
        let earlier = format!("{:.2}–{:.2} s", bursts[j].start_s, bursts[j].end_s);
        let _ = write!(
            bursts[i].cause,
            " (the same cause as the burst at {earlier}, still holding: {ok_between} request(s) succeeded between the two)"
        );
    }
    bursts
}

pub fn summarize(r: &RunResult) -> Summary {
    let sent = r.records.len();
    let ok = r
        .records
        .iter()
        .filter(|x| x.outcome == Outcome::Ok)
        .count();
    let mut by_kind = BTreeMap::new();
    let (mut before, mut during, mut after) = (0, 0, 0);
    for x in r.records.iter().filter(|x| !x.outcome.is_ok()) {
        *by_kind.entry(x.outcome.as_str().to_string()).or_insert(0) += 1;
        if x.start_ms < r.rollout_start_ms {
            before += 1;
        } else if x.start_ms <= r.rollout_end_ms {
            during += 1;
        } else {
            after += 1;
        }
    }
    let anomalies = anomalies(r);
    let bursts = bursts_of(&r.records, r.time_scale, 1.0)
        .into_iter()
        .map(|(s, e, v)| {
            let mut kinds = BTreeMap::new();
            for x in &v {
                *kinds.entry(x.outcome.as_str().to_string()).or_insert(0) += 1;
            }
            let (start_s, end_s) = (nominal(r, s), nominal(r, e));
            let mut cause = explain_burst(r, s, e, &v);
            // An anomaly up to one probe interval before the burst, or inside it, is
            // named with it: a late lab stretches every timing the cause depends on.
            let near: Vec<String> = anomalies
                .iter()
                .filter(|a| {
                    a.at_s >= start_s - r.health_check.interval_seconds.max(1.0) && a.at_s <= end_s
                })
                .map(|a| format!("at {:.2} s {}", a.at_s, a.what))
                .collect();
            if !near.is_empty() {
                let _ = write!(
                    cause,
                    "; the run shows an anomaly then: {}",
                    near.join("; ")
                );
            }
            Burst {
                start_s,
                end_s,
                failed: v.len(),
                kinds,
                cause,
            }
        })
        .collect();
    let bursts = tell_apart(r, bursts);
    Summary {
        behaviour: r.behaviour.as_str().to_string(),
        control_plane: r.control_plane.as_str().to_string(),
        run: r.run + 1,
        sent,
        ok,
        failed: sent - ok,
        failed_by_kind: by_kind,
        longest_outage_s: nominal(r, longest_outage_ms(&r.records)),
        failed_before_rollout: before,
        failed_during_rollout: during,
        failed_after_rollout: after,
        bursts,
        anomalies,
    }
}
