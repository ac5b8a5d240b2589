//! The run's timeline as inline SVG: a request lane with every failure where it
//! started, a lane per node (its place in the load balancer's pool, health answers,
//! restarts, chaos and drain marks), a lane per pod (its lifecycle), a time axis in
//! nominal seconds, and the legend of every colour drawn.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{esc, time_scale_note};
use crate::report::RunResult;
use crate::world::timeline::EventKind;

/// A pod's lifecycle on its lane: (state, from, to) in nominal seconds.
#[derive(Debug, Default)]
struct PodLane {
    node: String,
    created: f64,
    ready: Vec<(f64, f64)>,
    terminating: Option<f64>,
    sigterm: Option<f64>,
    end: Option<(f64, bool)>,
}

const LANE_H: f64 = 18.0;
const LEFT: f64 = 150.0;
const WIDTH: f64 = 1100.0;

/// The timeline's colours, named once: the drawing and its legend use these.
const ROLLOUT: &str = "#eef3ff";
const REQUESTS: &str = "#9c9";
const FAILED: &str = "#d22";
const IN_POOL: &str = "#bfe5bf";
pub(super) const ALL_NODES: &str = "#f3e7a1";
pub(super) const OUT_OF_POOL: &str = "#d9d9d9";
const LAB_LATE: &str = "#06c";
const HEALTH_PASSES: &str = "#0a6";
const HEALTH_FAILS: &str = "#803";
const RESTART: &str = "#e80";
const NODE_MARK: &str = "#000";
const LB_DRAIN: &str = "#a0a";
const POD: &str = "#e4e4ee";
const READY: &str = "#5cb85c";
const TERMINATING: &str = "#f0ad4e";
const SIGTERM: &str = "#c60";
const EXITED: &str = "#555";
const KILLED: &str = "#b00";

/// What each colour of the timeline means, in the order a reader meets the lanes.
pub(super) const LEGEND: [(&str, &str); 18] = [
    (ROLLOUT, "the rollout (or node drain) window"),
    (REQUESTS, "requests lane: the load generator's requests"),
    (FAILED, "a failed request, at the time it started"),
    (
        LAB_LATE,
        "the lab itself ran late (an anomaly, listed above the timeline)",
    ),
    (
        IN_POOL,
        "node lane: in the load balancer's pool (it passes the health check)",
    ),
    (
        ALL_NODES,
        "node lane: no node passes the health check (none has yet, at the start), so the LB sends new connections to every node",
    ),
    (OUT_OF_POOL, "node lane: out of the pool"),
    (
        HEALTH_PASSES,
        "the node's health-check answer turns to passing (200)",
    ),
    (
        HEALTH_FAILS,
        "the node's health-check answer turns to failing (not 200, or no answer in time)",
    ),
    (RESTART, "kproxy restarted on the node"),
    (
        NODE_MARK,
        "node tainted or conditioned for deletion, its kproxy stopped, or deleted",
    ),
    (LB_DRAIN, "the LB's drain timeout cut the node's flows"),
    (POD, "pod lane: the pod exists"),
    (READY, "pod ready"),
    (TERMINATING, "pod terminating (thin bar)"),
    (SIGTERM, "SIGTERM sent to the pod"),
    (EXITED, "■ pod exited"),
    (KILLED, "✖ pod killed (SIGKILL)"),
];

/// The legend of every timeline's colours, shown once above the runs.
pub(super) fn legend(time_scale: f64) -> String {
    let mut s = String::from("<p class=\"legend\"><b>Timeline:</b> ");
    for (colour, meaning) in LEGEND {
        let _ = write!(
            s,
            "<span><i style=\"background:{colour}\"></i>{}</span>",
            esc(meaning)
        );
    }
    let _ = writeln!(
        s,
        "<br>{} Hover over a mark for its time and detail.</p>",
        esc(&time_scale_note(time_scale))
    );
    s
}

/// A node's place in the load balancer's pool.
#[derive(Clone, Copy, PartialEq)]
enum Pool {
    In,
    /// No node passes the health check: the LB sends new connections to all of them.
    AllNodes,
    Out,
}

/// What the run's events say, lane by lane (times nominal).
#[derive(Default)]
struct Marks {
    pods: BTreeMap<String, PodLane>,
    health: BTreeMap<String, Vec<(f64, String)>>,
    pool_changes: Vec<(f64, String)>,
    restarts: Vec<(f64, String)>,
    drained: Vec<(f64, String)>,
    /// Chaos and node drain: (time, node, what).
    node_marks: Vec<(f64, String, &'static str)>,
}

impl Marks {
    fn read(r: &RunResult) -> Marks {
        let mut m = Marks::default();
        for e in &r.events {
            let t = r_nominal(r, e.t_ms);
            let node = || e.node.clone().unwrap_or_default();
            match (&e.kind, &e.pod) {
                (EventKind::PodCreated, Some(p)) => {
                    m.pods.insert(
                        p.clone(),
                        PodLane {
                            node: e.node.clone().unwrap_or_default(),
                            created: t,
                            ..Default::default()
                        },
                    );
                }
                (EventKind::PodReady, Some(p)) => {
                    if let Some(l) = m.pods.get_mut(p) {
                        l.ready.push((t, f64::NAN));
                    }
                }
                (EventKind::PodNotReady, Some(p)) => {
                    if let Some(l) = m.pods.get_mut(p)
                        && let Some(last) = l.ready.last_mut()
                        && last.1.is_nan()
                    {
                        last.1 = t;
                    }
                }
                (EventKind::PodTerminating, Some(p)) => {
                    if let Some(l) = m.pods.get_mut(p) {
                        l.terminating = Some(t);
                    }
                }
                (EventKind::PodSigterm, Some(p)) => {
                    if let Some(l) = m.pods.get_mut(p) {
                        l.sigterm = Some(t);
                    }
                }
                (EventKind::PodExited | EventKind::PodKilled, Some(p)) => {
                    if let Some(l) = m.pods.get_mut(p) {
                        l.end = Some((t, e.kind == EventKind::PodKilled));
                    }
                }
                (EventKind::HealthAnswer, _) => {
                    if let Some(n) = &e.node {
                        m.health
                            .entry(n.clone())
                            .or_default()
                            .push((t, e.detail.clone()));
                    }
                }
                (EventKind::LbPool, _) => m.pool_changes.push((t, e.detail.clone())),
                (EventKind::KproxyRestarted, _) => m.restarts.push((t, node())),
                (EventKind::LbDrained, _) => m.drained.push((t, node())),
                (EventKind::ApiServerDown | EventKind::ApiServerUp, _) => {
                    let what = if e.kind == EventKind::ApiServerDown {
                        "API server killed"
                    } else {
                        "API server started again"
                    };
                    for n in &r.nodes {
                        m.node_marks.push((t, n.clone(), what));
                    }
                }
                (kind, _) => {
                    if let Some(what) = node_mark(kind) {
                        m.node_marks.push((t, node(), what));
                    }
                }
            }
        }
        m
    }
}

/// What a mark on a node's lane says, for the events drawn as one.
fn node_mark(kind: &EventKind) -> Option<&'static str> {
    Some(match kind {
        EventKind::RulesetFlushed => "nft flush ruleset by another process",
        EventKind::KproxyKilled => "kproxy SIGKILLed and started again",
        EventKind::ApiConnectionsCut => "kproxy's API connections reset",
        EventKind::NodeTainted => "told it is going (taint or drain condition)",
        EventKind::KproxyStopped => "kproxy SIGTERMed for the node's shutdown, or exited",
        EventKind::NodeDeleted => "deleted (kproxy stopped, link cut)",
        _ => return None,
    })
}

/// A run-relative real time in ms as nominal seconds.
fn r_nominal(r: &RunResult, ms: f64) -> f64 {
    ms / 1000.0 / r.time_scale
}

/// The drawing's horizontal scale: nominal seconds from 0 to `t1` across the lanes.
struct Axis {
    t1: f64,
}

impl Axis {
    fn x(&self, t: f64) -> f64 {
        let t0 = 0.0;
        LEFT + (t - t0) / (self.t1 - t0) * (WIDTH - LEFT - 10.0)
    }
}

const TOP: f64 = 22.0;

fn lane_y(i: usize) -> f64 {
    TOP + i as f64 * (LANE_H + 4.0)
}

/// The run's timeline as inline SVG.
pub fn timeline_svg(r: &RunResult) -> String {
    let ax = Axis {
        t1: r_nominal(r, r.load_end_ms.max(1.0)) * 1.02,
    };
    // Lanes: requests, LB pool per node, then pods by node.
    let marks = Marks::read(r);
    let n_lanes = 1 + r.nodes.len() + marks.pods.len();
    let h = TOP + n_lanes as f64 * (LANE_H + 4.0) + 28.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{h:.0}\" viewBox=\"0 0 {WIDTH} {h:.0}\" role=\"img\" aria-label=\"timeline\">"
    );
    // Rollout (or node drain) window.
    let (rs, re) = (
        r_nominal(r, r.rollout_start_ms),
        r_nominal(r, r.rollout_end_ms),
    );
    let phase = if r.drain.is_some() {
        "node drain"
    } else {
        "rollout"
    };
    let _ = writeln!(
        s,
        "<rect x=\"{:.1}\" y=\"{}\" width=\"{:.1}\" height=\"{:.0}\" fill=\"{ROLLOUT}\"><title>{phase} {rs:.1}–{re:.1} s</title></rect><text x=\"{:.1}\" y=\"14\" font-size=\"11\" fill=\"#335\">{phase}</text>",
        ax.x(rs),
        TOP - 4.0,
        (ax.x(re) - ax.x(rs)).max(1.0),
        n_lanes as f64 * (LANE_H + 4.0),
        ax.x(rs) + 2.0
    );
    request_lane(&mut s, r, &ax);
    for (i, node) in r.nodes.iter().enumerate() {
        node_lane(&mut s, node, lane_y(1 + i), &marks, &ax);
    }
    pod_lanes(&mut s, &marks.pods, r.nodes.len(), &ax);
    time_axis(&mut s, h - 20.0, r.time_scale, &ax);
    s.push_str("</svg>\n");
    s
}

/// Lane 0: requests; failures as red ticks at their start, and the lab running late.
fn request_lane(s: &mut String, r: &RunResult, ax: &Axis) {
    let y0 = lane_y(0);
    let _ = writeln!(
        s,
        "<text x=\"4\" y=\"{:.1}\" font-size=\"12\">requests</text><line x1=\"{LEFT}\" x2=\"{:.0}\" y1=\"{:.1}\" y2=\"{:.1}\" stroke=\"{REQUESTS}\"/>",
        y0 + 13.0,
        WIDTH - 10.0,
        y0 + LANE_H / 2.0,
        y0 + LANE_H / 2.0
    );
    for rec in r.records.iter().filter(|x| !x.outcome.is_ok()) {
        let t = r_nominal(r, rec.start_ms);
        let _ = writeln!(
            s,
            "<line class=\"fail\" x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{y0:.1}\" y2=\"{:.1}\" stroke=\"{FAILED}\" stroke-width=\"1.5\"><title>{} at {t:.2} s</title></line>",
            ax.x(t),
            ax.x(t),
            y0 + LANE_H,
            rec.outcome.as_str()
        );
    }
    for e in r.events.iter().filter(|e| e.kind == EventKind::LabLate) {
        let t = r_nominal(r, e.t_ms);
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{y0:.1}\" width=\"3\" height=\"{LANE_H}\" fill=\"{LAB_LATE}\"><title>{} at {t:.2} s</title></rect>",
            ax.x(t),
            esc(&e.detail)
        );
    }
}

/// A node's lane: in the LB pool, with every node, or out; health answers, restarts,
/// chaos and drain marks.
fn node_lane(s: &mut String, node: &str, y: f64, m: &Marks, ax: &Axis) {
    let _ = writeln!(
        s,
        "<text x=\"4\" y=\"{:.1}\" font-size=\"12\">{} (LB)</text>",
        y + 13.0,
        esc(node)
    );
    // The LB starts with every node (no health data yet) and moves as its pool
    // events say; a failed pool update leaves the pool as it was.
    let mut segs: Vec<(f64, Pool)> = vec![(0.0, Pool::AllNodes)];
    for (t, d) in &m.pool_changes {
        let state = if d.starts_with("no healthy node") {
            Pool::AllNodes
        } else if let Some(list) = d.strip_prefix("new connections to ") {
            if list.split(", ").any(|w| w == node) {
                Pool::In
            } else {
                Pool::Out
            }
        } else {
            continue;
        };
        segs.push((*t, state));
    }
    for (k, (t, state)) in segs.iter().enumerate() {
        let end = segs.get(k + 1).map_or(ax.t1, |s| s.0);
        let (fill, what) = match state {
            Pool::In => (IN_POOL, "in the LB pool (passes the health check)"),
            Pool::AllNodes => (
                ALL_NODES,
                "no node passes the health check: the LB sends new connections to every node",
            ),
            Pool::Out => (OUT_OF_POOL, "out of the LB pool"),
        };
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{LANE_H}\" fill=\"{fill}\"><title>{} {what}, {t:.1}–{end:.1} s</title></rect>",
            ax.x(*t),
            (ax.x(end) - ax.x(*t)).max(0.0),
            esc(node)
        );
    }
    for (t, d) in m.health.get(node).into_iter().flatten() {
        // `d` is the LB's word: "health check passes", or "health check fails" with why.
        let fill = if d.contains("passes") {
            HEALTH_PASSES
        } else {
            HEALTH_FAILS
        };
        let _ = writeln!(
            s,
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{fill}\"><title>{}: {} from {t:.1} s</title></circle>",
            ax.x(*t),
            y + LANE_H / 2.0,
            esc(node),
            esc(d)
        );
    }
    for (t, _) in m.restarts.iter().filter(|(_, n)| n == node) {
        let _ = writeln!(
            s,
            "<path d=\"M{:.1} {y:.1} l5 9 l-5 9 l-5 -9 z\" fill=\"{RESTART}\"><title>kproxy restarted at {t:.1} s</title></path>",
            ax.x(*t)
        );
    }
    for (t, _, what) in m.node_marks.iter().filter(|(_, n, _)| n == node) {
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"4\" height=\"{LANE_H}\" fill=\"{NODE_MARK}\"><title>{what} at {t:.1} s</title></rect>",
            ax.x(*t)
        );
    }
    for (t, _) in m.drained.iter().filter(|(_, n)| n == node) {
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"3\" height=\"{LANE_H}\" fill=\"{LB_DRAIN}\"><title>LB drain timeout cut flows at {t:.1} s</title></rect>",
            ax.x(*t)
        );
    }
}

/// The pods' lanes, by node and creation, below the `nodes` node lanes.
fn pod_lanes(s: &mut String, pods: &BTreeMap<String, PodLane>, nodes: usize, ax: &Axis) {
    let mut lanes: Vec<(&String, &PodLane)> = pods.iter().collect();
    lanes.sort_by(|a, b| {
        (&a.1.node, a.1.created)
            .partial_cmp(&(&b.1.node, b.1.created))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    for (i, (name, l)) in lanes.iter().enumerate() {
        let y = lane_y(1 + nodes + i);
        let end = l.end.map_or(ax.t1, |e| e.0);
        let _ = writeln!(
            s,
            "<text x=\"4\" y=\"{:.1}\" font-size=\"11\">{} ({})</text><rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{LANE_H}\" fill=\"{POD}\"><title>{} created at {:.1} s</title></rect>",
            y + 13.0,
            esc(name),
            esc(&l.node),
            ax.x(l.created),
            (ax.x(end) - ax.x(l.created)).max(0.5),
            esc(name),
            l.created
        );
        for (a, b) in &l.ready {
            let b = if b.is_nan() { end } else { *b };
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.0}\" fill=\"{READY}\"><title>ready {a:.1}–{b:.1} s</title></rect>",
                ax.x(*a),
                y + 3.0,
                (ax.x(b) - ax.x(*a)).max(0.5),
                LANE_H - 6.0
            );
        }
        if let Some(t) = l.terminating {
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"4\" fill=\"{TERMINATING}\"><title>terminating from {t:.1} s</title></rect>",
                ax.x(t),
                (ax.x(end) - ax.x(t)).max(0.5)
            );
        }
        if let Some(t) = l.sigterm {
            let _ = writeln!(
                s,
                "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{:.1}\" stroke=\"{SIGTERM}\" stroke-width=\"2\"><title>SIGTERM at {t:.1} s</title></line>",
                ax.x(t),
                ax.x(t),
                y + LANE_H
            );
        }
        if let Some((t, killed)) = l.end {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"{}\">{}<title>{} at {t:.1} s</title></text>",
                ax.x(t) + 2.0,
                y + 13.0,
                if killed { KILLED } else { EXITED },
                if killed { "✖" } else { "■" },
                if killed { "SIGKILL" } else { "exited" }
            );
        }
    }
}

/// The time axis at `ya`, from the same origin as the text report's times.
fn time_axis(s: &mut String, ya: f64, time_scale: f64, ax: &Axis) {
    let _ = writeln!(
        s,
        "<text x=\"4\" y=\"{:.1}\" font-size=\"10\">nominal s (real = × {})</text>",
        ya + 15.0,
        time_scale
    );
    let step = nice_step(ax.t1);
    let mut t = 0.0;
    while t <= ax.t1 {
        let _ = writeln!(
            s,
            "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{ya:.1}\" y2=\"{:.1}\" stroke=\"#888\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\">{t:.0}s</text>",
            ax.x(t),
            ax.x(t),
            ya + 4.0,
            ax.x(t),
            ya + 15.0
        );
        t += step;
    }
}

pub(super) fn nice_step(span: f64) -> f64 {
    for s in [1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0] {
        if span / s <= 20.0 {
            return s;
        }
    }
    600.0
}
