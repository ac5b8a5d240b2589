//! The reports of the held runs (`lab restart`, `lab takeover`): a cluster under two
//! loads, changed phase by phase. Each request counts in the phase it started in, by
//! the path it took ([`tally`]); the text tables say per phase and path what was sent
//! and what failed. Pure functions over the loads' records.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::scenario::run::Disturbance;
use crate::world::loadgen::{ConnKind, RequestRecord};

/// Where a load enters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Via {
    /// Client → LB VIP → a node's NodePort (eTP=Local).
    Lb,
    /// Node 1's own network namespace → the cluster IP.
    ClusterIp,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Via::Lb => "lb",
            Via::ClusterIp => "cluster-ip",
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    pub new_sent: usize,
    pub new_failed: usize,
    pub keepalive_sent: usize,
    /// Failed requests on a connection that had already carried one: an established
    /// connection broken.
    pub established_broken: usize,
    /// Other keep-alive failures (the first request of a connection).
    pub keepalive_other_failed: usize,
}

impl Counts {
    pub fn failures(&self) -> usize {
        self.new_failed + self.established_broken + self.keepalive_other_failed
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Phase {
    pub disturbance: Disturbance,
    pub start_ms: f64,
    pub end_ms: f64,
    /// From the disturbance to the new process's first sync (none for the baseline).
    pub converged_ms: Option<f64>,
    pub by_path: BTreeMap<Via, Counts>,
    /// Failures by outcome, both paths.
    pub failed_by_kind: BTreeMap<String, usize>,
}

impl Phase {
    /// A phase from `start_ms` to `end_ms` (real, the run's clock), nothing counted yet.
    pub fn window(
        disturbance: Disturbance,
        start_ms: f64,
        end_ms: f64,
        converged_ms: Option<f64>,
    ) -> Phase {
        Phase {
            disturbance,
            start_ms,
            end_ms,
            converged_ms,
            by_path: BTreeMap::new(),
            failed_by_kind: BTreeMap::new(),
        }
    }
}

/// The failed requests of every phase, on every path.
pub fn failures<'a>(phases: impl Iterator<Item = &'a BTreeMap<Via, Counts>>) -> usize {
    phases
        .flat_map(BTreeMap::values)
        .map(Counts::failures)
        .sum()
}

#[derive(Clone, Debug, Serialize)]
pub struct RestartReport {
    pub nodes: usize,
    pub hold_seconds: f64,
    pub phases: Vec<Phase>,
    pub failures: usize,
}

/// Counts the records of `path` into the phases whose window holds their start.
/// Pure.
pub fn tally(phases: &mut [Phase], path: Via, records: &[RequestRecord]) {
    for r in records {
        let Some(p) = phases
            .iter_mut()
            .find(|p| r.start_ms >= p.start_ms && r.start_ms < p.end_ms)
        else {
            continue; // before the first phase or after the last
        };
        let c = p.by_path.entry(path).or_default();
        let ok = r.outcome.is_ok();
        match r.conn {
            ConnKind::New => {
                c.new_sent += 1;
                c.new_failed += usize::from(!ok);
            }
            ConnKind::KeepAlive => {
                c.keepalive_sent += 1;
                if !ok && r.reused {
                    c.established_broken += 1;
                } else if !ok {
                    c.keepalive_other_failed += 1;
                }
            }
        }
        if !ok {
            *p.failed_by_kind
                .entry(r.outcome.as_str().to_string())
                .or_default() += 1;
        }
    }
}

pub fn restart_text(r: &RestartReport) -> String {
    let mut s = format!(
        "kproxy restart under load: {} nodes, node 1's kproxy disturbed, {:.1} s held after each new process synced\n",
        r.nodes, r.hold_seconds
    );
    s.push_str("phase     path        new conns (failed)  keep-alive reqs  established broken  other failed  converged\n");
    for p in &r.phases {
        for (path, c) in &p.by_path {
            s.push_str(&format!(
                "{:<9} {:<11} {:>9} ({:>3})      {:>9}        {:>6}              {:>6}        {}\n",
                p.disturbance.as_str(),
                path.as_str(),
                c.new_sent,
                c.new_failed,
                c.keepalive_sent,
                c.established_broken,
                c.keepalive_other_failed,
                p.converged_ms
                    .map_or("-".to_string(), |m| format!("{m:.0} ms")),
            ));
        }
        if !p.failed_by_kind.is_empty() {
            s.push_str(&format!("          failures: {:?}\n", p.failed_by_kind));
        }
    }
    s.push_str(&format!(
        "total failures: {}{}\n",
        r.failures,
        if r.failures == 0 { " (hitless)" } else { "" }
    ));
    s
}

#[derive(Clone, Debug, Serialize)]
pub struct TakeoverPhase {
    pub name: String,
    /// The fewest nodes the load balancer had in its pool during the phase.
    pub min_pool: usize,
    pub by_path: BTreeMap<Via, Counts>,
    pub failed_by_kind: BTreeMap<String, usize>,
    /// At the phase's end, on the phase's node: what of kube-proxy's is left after a
    /// takeover (`ip kube-proxy`, `IPv4 nat/KUBE-SERVICES`, ...), what of kproxy's after
    /// the way back (`ip kproxy`, ...). Empty when the handover is complete.
    pub left: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct TakeoverReport {
    pub from: String,
    /// `real` (the process, on k8s-lab) or `recorded`.
    pub kube_proxy: String,
    pub nodes: usize,
    pub phases: Vec<TakeoverPhase>,
    pub failures: usize,
}

pub fn takeover_text(r: &TakeoverReport) -> String {
    let mut s = format!(
        "takeover from kube-proxy ({} mode, {}), {} nodes\n| phase | path | new conns | failed | keep-alive reqs | established broken | other failed | fewest nodes in LB pool | left on the node |\n|---|---|---|---|---|---|---|---|---|\n",
        r.from, r.kube_proxy, r.nodes
    );
    for p in &r.phases {
        for (path, c) in &p.by_path {
            s.push_str(&format!(
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                p.name,
                path.as_str(),
                c.new_sent,
                c.new_failed,
                c.keepalive_sent,
                c.established_broken,
                c.keepalive_other_failed,
                p.min_pool,
                if p.left.is_empty() {
                    "-".to_string()
                } else {
                    p.left.join(", ")
                }
            ));
        }
    }
    s.push_str(&format!("total failures: {}\n", r.failures));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::loadgen::Outcome;

    fn rec(start_ms: f64, conn: ConnKind, outcome: Outcome, reused: bool) -> RequestRecord {
        RequestRecord {
            start_ms,
            end_ms: start_ms + 1.0,
            outcome,
            conn,
            pod: None,
            reused,
            conn_pod: None,
        }
    }

    fn phase(d: Disturbance, start_ms: f64, end_ms: f64) -> Phase {
        Phase::window(d, start_ms, end_ms, None)
    }

    #[test]
    fn records_count_in_the_phase_they_started_in() {
        let mut phases = vec![
            phase(Disturbance::None, 0.0, 100.0),
            phase(Disturbance::Sigkill, 100.0, 200.0),
        ];
        let records = [
            rec(-5.0, ConnKind::New, Outcome::Refused, false), // warm-up: not counted
            rec(10.0, ConnKind::New, Outcome::Ok, false),
            rec(99.9, ConnKind::KeepAlive, Outcome::Ok, true),
            rec(100.0, ConnKind::New, Outcome::Refused, false),
            rec(150.0, ConnKind::KeepAlive, Outcome::Reset, true),
            rec(160.0, ConnKind::KeepAlive, Outcome::Timeout, false),
            rec(250.0, ConnKind::New, Outcome::Refused, false), // after: not counted
        ];
        tally(&mut phases, Via::Lb, &records);
        let base = phases[0].by_path[&Via::Lb];
        assert_eq!(
            (base.new_sent, base.keepalive_sent, base.failures()),
            (1, 1, 0)
        );
        let k = phases[1].by_path[&Via::Lb];
        assert_eq!(
            (
                k.new_sent,
                k.new_failed,
                k.keepalive_sent,
                k.established_broken,
                k.keepalive_other_failed
            ),
            (1, 1, 2, 1, 1)
        );
        assert_eq!(phases[1].failed_by_kind["refused"], 1);
        assert_eq!(phases[1].failed_by_kind["reset"], 1);
        assert!(
            restart_text(&RestartReport {
                nodes: 3,
                hold_seconds: 1.0,
                phases,
                failures: 3
            })
            .contains("sigkill   lb")
        );
    }
}
