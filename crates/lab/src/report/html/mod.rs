//! The self-contained HTML report: per run, a timeline with one lane per
//! node and per pod (pod lifecycles as coloured bars, health answers, LB pool
//! membership, kproxy restarts) and a request lane with every failure marked where it
//! happened; the failure bursts with their causes; the run's anomalies; and, for a
//! matrix, the cells as a coloured table with lint's findings beside the packets. Every
//! table is followed by what its columns mean, and the time scale is stated where times
//! are read. Inline CSS and SVG only: no script, no external resource. Pure functions
//! over finished runs.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::report::matrix::CellResult;
use crate::report::{self, RunResult, Summary};
use crate::world::timeline::EventKind;

/// Escape text for HTML element content and attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&#39;"),
            c => o.push(c),
        }
    }
    o
}

const STYLE: &str = r#"
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.5em;color:#1d232b;background:#fbfbfc}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;margin:.6em 0}
th,td{border:1px solid #ccd;padding:3px 6px;text-align:left;vertical-align:top}
th{background:#eef0f4}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.v-confirmed{background:#f6c4c0}.v-clean-confirmed{background:#c9ecc9}
.v-flagged-no-loss{background:#fbe9b7}.v-missed-by-lint{background:#e9a1f0}
.v-baseline-loss{background:#f3d6d3}.v-baseline-ok{background:#e3f2e3}
.lost{color:#b3261e;font-weight:600}.ok{color:#1b6e20;font-weight:600}
.cause{font-size:.85em;color:#333}
details{margin:.3em 0}summary{cursor:pointer}
.legend span{display:inline-block;padding:1px 6px;margin-right:6px;border:1px solid #ccd;font-size:.8em}
.legend i{display:inline-block;width:14px;height:10px;margin-right:4px;vertical-align:middle;border:1px solid #999}
svg text{font-family:system-ui,sans-serif}
.defs{font-size:.8em;color:#333;max-width:75em}.defs dt{font-weight:600;display:inline}.defs dd{display:inline;margin:0 0 0 .3em}.defs dd:after{content:"";display:block;margin-bottom:.2em}
"#;

/// What each column of a table means, shown under it.
fn definitions(defs: &[(&str, &str)]) -> String {
    let mut s = String::from("<dl class=\"defs\">");
    for (term, meaning) in defs {
        let _ = write!(s, "<dt>{}</dt><dd>{}</dd>", esc(term), esc(meaning));
    }
    s.push_str("</dl>\n");
    s
}

/// The failure kinds, as the "by kind" and "kinds" columns count them.
const KINDS: &str = "how the requests failed: refused (RST or ICMP port unreachable to the SYN), reset (connection reset mid-request), timeout (no answer within the client's timeout: dropped packets), closed (closed without an answer), unreachable (ICMP host or network unreachable), http_5xx, http_error (another status or no HTTP)";

/// The time scale, where times are read.
fn time_scale_note(scale: f64) -> String {
    format!(
        "Times are nominal seconds since the run started (the cluster's set-up), as in the text report: the lab ran at time scale {scale} (real time = nominal × {scale}), so every nominal second took {:.0} ms.",
        scale * 1000.0
    )
}

/// A whole report: optional matrix table, then every run (summary, bursts, timeline).
pub fn render(title: &str, intro: &str, runs: &[RunResult], matrix: &[CellResult]) -> String {
    let mut s = String::new();
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head><body>\n<h1>{}</h1>\n<p>{}</p>\n",
        esc(title),
        esc(title),
        esc(intro)
    );
    if !matrix.is_empty() {
        s.push_str(&matrix_table(matrix));
    }
    let sums: Vec<Summary> = runs.iter().map(report::summarize).collect();
    if let Some(first) = runs.first() {
        s.push_str(&summary_table(&sums, runs));
        s.push_str(&legend(first.time_scale));
    }
    for (i, (r, m)) in runs.iter().zip(&sums).enumerate() {
        let label = match matrix.get(i) {
            Some(c) if matrix.len() == runs.len() => c.id.clone(),
            _ => format!("{} run {}", m.behaviour, m.run),
        };
        let open = if m.failed > 0 || runs.len() <= 4 {
            " open"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            "<details{open} id=\"run-{i}\"><summary><b>{}</b>: <span class=\"{}\">{} of {} requests failed</span>, {} burst(s), {} anomaly(ies); times in nominal s, time scale {}</summary>",
            esc(&label),
            if m.failed > 0 { "lost" } else { "ok" },
            m.failed,
            m.sent,
            m.bursts.len(),
            m.anomalies.len(),
            r.time_scale
        );
        s.push_str(&bursts(m));
        s.push_str(&anomalies(m));
        s.push_str(&timeline_svg(r));
        s.push_str("</details>\n");
    }
    s.push_str("</body></html>\n");
    s
}

fn summary_table(sums: &[Summary], runs: &[RunResult]) -> String {
    let mut s = String::from(
        "<h2>Runs</h2><table><tr><th>run</th><th>behaviour</th><th>sent</th><th>ok</th><th>failed</th><th>by kind</th><th>longest outage (s)</th><th>rollout (s)</th></tr>\n",
    );
    for (i, (m, r)) in sums.iter().zip(runs).enumerate() {
        let kinds: Vec<String> = m
            .failed_by_kind
            .iter()
            .map(|(k, n)| format!("{n} {k}"))
            .collect();
        let _ = writeln!(
            s,
            "<tr><td><a href=\"#run-{i}\">{}</a></td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num {}\">{}</td><td>{}</td><td class=\"num\">{:.1}</td><td class=\"num\">{:.1}</td></tr>",
            m.run,
            esc(&m.behaviour),
            m.sent,
            m.ok,
            if m.failed > 0 { "lost" } else { "ok" },
            m.failed,
            esc(&kinds.join(", ")),
            m.longest_outage_s,
            (r.rollout_end_ms - r.rollout_start_ms) / 1000.0 / r.time_scale
        );
    }
    s.push_str("</table>\n");
    s.push_str(&definitions(&[
        ("run", "the run's number; it links to the run's bursts and timeline."),
        ("behaviour", "kproxy, or pre-1.26: kube-proxy's behaviour before 1.26, where a terminating pod is no endpoint."),
        ("sent", "requests the load generator started through the load balancer during the run (each on a new connection or a kept-alive one)."),
        ("ok", "requests answered with 200."),
        ("failed", "sent − ok."),
        ("by kind", KINDS),
        ("longest outage (s)", "the longest stretch in which every request that started failed, from the first to the last failed start (nominal s). It stays short when requests through other nodes still succeed: a burst (below) can last seconds with successes in between."),
        ("rollout (s)", "from the rolling update's start (revision 2 applied) to its end (every new pod available, no old pod left), or the node drain's span (nominal s)."),
    ]));
    s
}

fn verdict_class(c: &CellResult) -> &'static str {
    use crate::report::matrix::Verdict::*;
    match c.verdict {
        Confirmed => "v-confirmed",
        CleanConfirmed => "v-clean-confirmed",
        NoLossObserved => "v-flagged-no-loss",
        MissedByLint => "v-missed-by-lint",
        Baseline if c.lost > 0 => "v-baseline-loss",
        Baseline => "v-baseline-ok",
    }
}

/// The matrix as a coloured table: one row per cell.
pub fn matrix_table(cells: &[CellResult]) -> String {
    let mut s = String::from(
        "<h2>Scenario matrix</h2>\n<p class=\"legend\"><span class=\"v-confirmed\">lint flags the setting, packets lost</span><span class=\"v-clean-confirmed\">lint clean, nothing lost</span><span class=\"v-flagged-no-loss\">lint flags, nothing lost</span><span class=\"v-missed-by-lint\">lint clean, packets lost</span><span class=\"v-baseline-loss\">pre-1.26 behaviour, lost</span><span class=\"v-baseline-ok\">pre-1.26 behaviour, nothing lost</span></p>\n<table><tr><th>setting</th><th>pod profile</th><th>LB</th><th>behaviour</th><th>preStop / grace / period×failures / initialDelay (s)</th><th>LB detect / register / drain (s)</th><th>sent</th><th>lost</th><th>min LB pool</th><th>kproxy lint</th><th>verdict</th><th>cause of every burst</th></tr>\n",
    );
    for (i, c) in cells.iter().enumerate() {
        let st = &c.settings;
        let lint: Vec<String> = c
            .lint
            .iter()
            .map(|f| {
                format!(
                    "<span title=\"{}\">{} {}</span>",
                    esc(&f.message),
                    esc(&f.severity),
                    esc(&f.rule)
                )
            })
            .collect();
        let causes: Vec<String> = c
            .bursts
            .iter()
            .map(|b| {
                format!(
                    "{:.1}–{:.1} s, {} failed: {}",
                    b.start_s,
                    b.end_s,
                    b.failed,
                    esc(&b.cause)
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "<tr class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} / {} / {}×{} / {}</td><td>{:.0} / {:.0} / {:.0}</td><td class=\"num\">{}</td><td class=\"num {}\"><a href=\"#run-{i}\">{}</a></td><td class=\"num\">{}</td><td>{}</td><td>{}</td><td class=\"cause\">{}</td></tr>",
            verdict_class(c),
            esc(c.cell.setting.as_str()),
            esc(crate::spec::matrix::profile_str(c.cell.profile)),
            esc(crate::spec::matrix::preset_str(c.cell.preset)),
            esc(c.cell.behaviour.as_str()),
            st.pre_stop_s,
            st.grace_s,
            st.readiness_period_s,
            st.readiness_failure_threshold,
            st.initial_delay_s,
            st.lb_detection_window_s,
            st.lb_registration_s,
            st.lb_drain_s,
            c.sent,
            if c.lost > 0 { "lost" } else { "ok" },
            c.lost,
            c.min_lb_pool.map_or("?".to_string(), |n| n.to_string()),
            lint.join("<br>"),
            esc(c.verdict.as_str()),
            causes.join("<br>")
        );
    }
    s.push_str("</table>\n");
    s.push_str(&definitions(&[
        ("setting", "the pod, rollout or disturbance the cell tries (docs/lab.md)."),
        ("pod profile", "how the pod's process behaves at SIGTERM and after."),
        ("LB", "the load balancer preset: its health check and drain."),
        ("behaviour", "kproxy, or pre-1.26 (a terminating pod is no endpoint)."),
        ("preStop / grace / period×failures / initialDelay (s)", "the pod's preStop sleep, terminationGracePeriodSeconds, readiness periodSeconds × failureThreshold, and initialDelaySeconds (nominal s)."),
        ("LB detect / register / drain (s)", "the load balancer's detection window (interval × unhealthy threshold + timeout), its registration delay, and its drain timeout (nominal s)."),
        ("sent", "requests started through the load balancer."),
        ("lost", "requests that failed; it links to the cell's run."),
        ("min LB pool", "the fewest healthy nodes in the load balancer's pool during the rollout (0: none healthy, the LB sent to all)."),
        ("kproxy lint", "kproxy lint's findings on the cell's manifests (hover for the message)."),
        ("verdict", "lint's findings on the cell's rule against its packets, coloured as the legend above the table says: confirmed (flagged, lost), clean, confirmed (clean, nothing lost), flagged, no extra loss (no more lost than the recommended cell), missed by lint (clean, lost), baseline (pre-1.26 cells: lint assumes terminating-endpoint failover)."),
        ("cause of every burst", "each failure burst: its span (nominal s), its failed requests, and its cause."),
    ]));
    s
}

fn bursts(m: &Summary) -> String {
    if m.bursts.is_empty() {
        return "<p>No failed request.</p>\n".into();
    }
    let mut s = String::from(
        "<table><tr><th>from (s)</th><th>to (s)</th><th>failed</th><th>kinds</th><th>cause</th></tr>\n",
    );
    for b in &m.bursts {
        let kinds: Vec<String> = b.kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
        let _ = writeln!(
            s,
            "<tr><td class=\"num\">{:.2}</td><td class=\"num\">{:.2}</td><td class=\"num lost\">{}</td><td>{}</td><td class=\"cause\">{}</td></tr>",
            b.start_s,
            b.end_s,
            b.failed,
            esc(&kinds.join(", ")),
            esc(&b.cause)
        );
    }
    s.push_str("</table>\n");
    s.push_str(&definitions(&[
        ("from (s), to (s)", "the start times of the burst's first and last failed request, nominal s since the run started; failures less than 1 nominal s apart form one burst."),
        ("failed", "failed requests in the burst."),
        ("kinds", KINDS),
        ("cause", "what the run's timeline shows at that moment (pods, health answers, the LB's pool, EndpointSlice changes, disturbances, anomalies), in plain words."),
    ]));
    s
}

/// The run's anomalies: what no setting explains (the lab running late, every node
/// failing a health check at once).
fn anomalies(m: &Summary) -> String {
    if m.anomalies.is_empty() {
        return "<p>No anomaly: the lab kept time (no preStop longer than configured, no stall) and no probe round failed every node.</p>\n".into();
    }
    let mut s = String::from("<p><b>Anomalies</b> (nominal s):</p><ul>\n");
    for a in &m.anomalies {
        let _ = writeln!(s, "<li>{:.2} s: {}</li>", a.at_s, esc(&a.what));
    }
    s.push_str("</ul>\n");
    s
}

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
const ALL_NODES: &str = "#f3e7a1";
const OUT_OF_POOL: &str = "#d9d9d9";
const LAB_LATE: &str = "#06c";
const HEALTH_ANSWER: &str = "#246";
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
const LEGEND: [(&str, &str); 17] = [
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
    (HEALTH_ANSWER, "a change of the node's health-check answer"),
    (RESTART, "kproxy restarted on the node"),
    (NODE_MARK, "node tainted for deletion, or deleted"),
    (LB_DRAIN, "the LB's drain timeout cut the node's flows"),
    (POD, "pod lane: the pod exists"),
    (READY, "pod ready"),
    (TERMINATING, "pod terminating (thin bar)"),
    (SIGTERM, "SIGTERM sent to the pod"),
    (EXITED, "■ pod exited"),
    (KILLED, "✖ pod killed (SIGKILL)"),
];

/// The legend of every timeline's colours, shown once above the runs.
fn legend(time_scale: f64) -> String {
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

/// The run's timeline as inline SVG.
pub fn timeline_svg(r: &RunResult) -> String {
    let nominal = |ms: f64| ms / 1000.0 / r.time_scale;
    let t0 = 0.0;
    let t1 = nominal(r.load_end_ms.max(1.0)) * 1.02;
    let x = |t: f64| LEFT + (t - t0) / (t1 - t0) * (WIDTH - LEFT - 10.0);
    // Lanes: requests, LB pool per node, then pods by node.
    let mut pods: BTreeMap<String, PodLane> = BTreeMap::new();
    let mut health: BTreeMap<String, Vec<(f64, String)>> = BTreeMap::new();
    let mut pool_changes: Vec<(f64, String)> = Vec::new();
    let mut restarts: Vec<(f64, String)> = Vec::new();
    let mut drained: Vec<(f64, String)> = Vec::new();
    // Node drain: (time, node, what).
    let mut node_marks: Vec<(f64, String, &str)> = Vec::new();
    for e in &r.events {
        let t = nominal(e.t_ms);
        match (&e.kind, &e.pod) {
            (EventKind::PodCreated, Some(p)) => {
                pods.insert(
                    p.clone(),
                    PodLane {
                        node: e.node.clone().unwrap_or_default(),
                        created: t,
                        ..Default::default()
                    },
                );
            }
            (EventKind::PodReady, Some(p)) => {
                if let Some(l) = pods.get_mut(p) {
                    l.ready.push((t, f64::NAN));
                }
            }
            (EventKind::PodNotReady, Some(p)) => {
                if let Some(l) = pods.get_mut(p)
                    && let Some(last) = l.ready.last_mut()
                    && last.1.is_nan()
                {
                    last.1 = t;
                }
            }
            (EventKind::PodTerminating, Some(p)) => {
                if let Some(l) = pods.get_mut(p) {
                    l.terminating = Some(t);
                }
            }
            (EventKind::PodSigterm, Some(p)) => {
                if let Some(l) = pods.get_mut(p) {
                    l.sigterm = Some(t);
                }
            }
            (EventKind::PodExited | EventKind::PodKilled, Some(p)) => {
                if let Some(l) = pods.get_mut(p) {
                    l.end = Some((t, e.kind == EventKind::PodKilled));
                }
            }
            (EventKind::HealthAnswer, _) => {
                if let Some(n) = &e.node {
                    health
                        .entry(n.clone())
                        .or_default()
                        .push((t, e.detail.clone()));
                }
            }
            (EventKind::LbPool, _) => pool_changes.push((t, e.detail.clone())),
            (EventKind::KproxyRestarted, _) => {
                restarts.push((t, e.node.clone().unwrap_or_default()))
            }
            (EventKind::LbDrained, _) => drained.push((t, e.node.clone().unwrap_or_default())),
            (EventKind::RulesetFlushed, _) => node_marks.push((
                t,
                e.node.clone().unwrap_or_default(),
                "nft flush ruleset by another process",
            )),
            (EventKind::KproxyKilled, _) => node_marks.push((
                t,
                e.node.clone().unwrap_or_default(),
                "kproxy SIGKILLed and started again",
            )),
            (EventKind::ApiConnectionsCut, _) => node_marks.push((
                t,
                e.node.clone().unwrap_or_default(),
                "kproxy's API connections reset",
            )),
            (EventKind::ApiServerDown | EventKind::ApiServerUp, _) => {
                let what = if e.kind == EventKind::ApiServerDown {
                    "API server killed"
                } else {
                    "API server started again"
                };
                for n in &r.nodes {
                    node_marks.push((t, n.clone(), what));
                }
            }
            (EventKind::NodeTainted, _) => node_marks.push((
                t,
                e.node.clone().unwrap_or_default(),
                "tainted ToBeDeletedByClusterAutoscaler",
            )),
            (EventKind::NodeDeleted, _) => node_marks.push((
                t,
                e.node.clone().unwrap_or_default(),
                "deleted (kproxy stopped, link cut)",
            )),
            _ => {}
        }
    }
    let n_lanes = 1 + r.nodes.len() + pods.len();
    let top = 22.0;
    let h = top + n_lanes as f64 * (LANE_H + 4.0) + 28.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{h:.0}\" viewBox=\"0 0 {WIDTH} {h:.0}\" role=\"img\" aria-label=\"timeline\">"
    );
    let lane_y = |i: usize| top + i as f64 * (LANE_H + 4.0);
    // Rollout (or node drain) window.
    let (rs, re) = (nominal(r.rollout_start_ms), nominal(r.rollout_end_ms));
    let phase = if r.drain.is_some() {
        "node drain"
    } else {
        "rollout"
    };
    let _ = writeln!(
        s,
        "<rect x=\"{:.1}\" y=\"{}\" width=\"{:.1}\" height=\"{:.0}\" fill=\"{ROLLOUT}\"><title>{phase} {rs:.1}–{re:.1} s</title></rect><text x=\"{:.1}\" y=\"14\" font-size=\"11\" fill=\"#335\">{phase}</text>",
        x(rs),
        top - 4.0,
        (x(re) - x(rs)).max(1.0),
        n_lanes as f64 * (LANE_H + 4.0),
        x(rs) + 2.0
    );
    // Lane 0: requests; failures as red ticks at their start.
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
        let t = nominal(rec.start_ms);
        let _ = writeln!(
            s,
            "<line class=\"fail\" x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{y0:.1}\" y2=\"{:.1}\" stroke=\"{FAILED}\" stroke-width=\"1.5\"><title>{} at {t:.2} s</title></line>",
            x(t),
            x(t),
            y0 + LANE_H,
            rec.outcome.as_str()
        );
    }
    for e in r.events.iter().filter(|e| e.kind == EventKind::LabLate) {
        let t = nominal(e.t_ms);
        let _ = writeln!(
            s,
            "<rect x=\"{:.1}\" y=\"{y0:.1}\" width=\"3\" height=\"{LANE_H}\" fill=\"{LAB_LATE}\"><title>{} at {t:.2} s</title></rect>",
            x(t),
            esc(&e.detail)
        );
    }
    // Node lanes: in the LB pool, with every node, or out; health answers, restarts.
    for (i, node) in r.nodes.iter().enumerate() {
        let y = lane_y(1 + i);
        let _ = writeln!(
            s,
            "<text x=\"4\" y=\"{:.1}\" font-size=\"12\">{} (LB)</text>",
            y + 13.0,
            esc(node)
        );
        // The LB starts with every node (no health data yet) and moves as its pool
        // events say; a failed pool update leaves the pool as it was.
        let mut segs: Vec<(f64, Pool)> = vec![(0.0, Pool::AllNodes)];
        for (t, d) in &pool_changes {
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
            let end = segs.get(k + 1).map_or(t1, |s| s.0);
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
                x(*t),
                (x(end) - x(*t)).max(0.0),
                esc(node)
            );
        }
        for (t, d) in health.get(node).into_iter().flatten() {
            // `d` is the LB's word: "health check passes" or "health check fails".
            let _ = writeln!(
                s,
                "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"{HEALTH_ANSWER}\"><title>{}: {} from {t:.1} s</title></circle>",
                x(*t),
                y + LANE_H / 2.0,
                esc(node),
                esc(d)
            );
        }
        for (t, _) in restarts.iter().filter(|(_, n)| n == node) {
            let _ = writeln!(
                s,
                "<path d=\"M{:.1} {y:.1} l5 9 l-5 9 l-5 -9 z\" fill=\"{RESTART}\"><title>kproxy restarted at {t:.1} s</title></path>",
                x(*t)
            );
        }
        for (t, _, what) in node_marks.iter().filter(|(_, n, _)| n == node) {
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"4\" height=\"{LANE_H}\" fill=\"{NODE_MARK}\"><title>{what} at {t:.1} s</title></rect>",
                x(*t)
            );
        }
        for (t, _) in drained.iter().filter(|(_, n)| n == node) {
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"3\" height=\"{LANE_H}\" fill=\"{LB_DRAIN}\"><title>LB drain timeout cut flows at {t:.1} s</title></rect>",
                x(*t)
            );
        }
    }
    // Pod lanes.
    let mut lanes: Vec<(&String, &PodLane)> = pods.iter().collect();
    lanes.sort_by(|a, b| {
        (&a.1.node, a.1.created)
            .partial_cmp(&(&b.1.node, b.1.created))
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    for (i, (name, l)) in lanes.iter().enumerate() {
        let y = lane_y(1 + r.nodes.len() + i);
        let end = l.end.map_or(t1, |e| e.0);
        let _ = writeln!(
            s,
            "<text x=\"4\" y=\"{:.1}\" font-size=\"11\">{} ({})</text><rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"{LANE_H}\" fill=\"{POD}\"><title>{} created at {:.1} s</title></rect>",
            y + 13.0,
            esc(name),
            esc(&l.node),
            x(l.created),
            (x(end) - x(l.created)).max(0.5),
            esc(name),
            l.created
        );
        for (a, b) in &l.ready {
            let b = if b.is_nan() { end } else { *b };
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.0}\" fill=\"{READY}\"><title>ready {a:.1}–{b:.1} s</title></rect>",
                x(*a),
                y + 3.0,
                (x(b) - x(*a)).max(0.5),
                LANE_H - 6.0
            );
        }
        if let Some(t) = l.terminating {
            let _ = writeln!(
                s,
                "<rect x=\"{:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"4\" fill=\"{TERMINATING}\"><title>terminating from {t:.1} s</title></rect>",
                x(t),
                (x(end) - x(t)).max(0.5)
            );
        }
        if let Some(t) = l.sigterm {
            let _ = writeln!(
                s,
                "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{y:.1}\" y2=\"{:.1}\" stroke=\"{SIGTERM}\" stroke-width=\"2\"><title>SIGTERM at {t:.1} s</title></line>",
                x(t),
                x(t),
                y + LANE_H
            );
        }
        if let Some((t, killed)) = l.end {
            let _ = writeln!(
                s,
                "<text x=\"{:.1}\" y=\"{:.1}\" font-size=\"11\" fill=\"{}\">{}<title>{} at {t:.1} s</title></text>",
                x(t) + 2.0,
                y + 13.0,
                if killed { KILLED } else { EXITED },
                if killed { "✖" } else { "■" },
                if killed { "SIGKILL" } else { "exited" }
            );
        }
    }
    // Time axis, from the same origin as the text report's times.
    let ya = h - 20.0;
    let _ = writeln!(
        s,
        "<text x=\"4\" y=\"{:.1}\" font-size=\"10\">nominal s (real = × {})</text>",
        ya + 15.0,
        r.time_scale
    );
    let step = nice_step(t1 - t0);
    let mut t = 0.0;
    while t <= t1 {
        let _ = writeln!(
            s,
            "<line x1=\"{:.1}\" x2=\"{:.1}\" y1=\"{ya:.1}\" y2=\"{:.1}\" stroke=\"#888\"/><text x=\"{:.1}\" y=\"{:.1}\" font-size=\"10\" text-anchor=\"middle\">{t:.0}s</text>",
            x(t),
            x(t),
            ya + 4.0,
            x(t),
            ya + 15.0
        );
        t += step;
    }
    s.push_str("</svg>\n");
    s
}

fn nice_step(span: f64) -> f64 {
    for s in [1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0] {
        if span / s <= 20.0 {
            return s;
        }
    }
    600.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup() {
        assert_eq!(
            esc("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    /// Every colour a timeline draws has its line in the legend.
    #[test]
    fn the_legend_names_every_colour_of_the_timeline() {
        use crate::world::timeline::Event;
        let ev = |t_ms: f64, kind: EventKind, node: &str, pod: Option<&str>, detail: &str| Event {
            t_ms,
            kind,
            node: Some(node.into()),
            pod: pod.map(Into::into),
            detail: detail.into(),
        };
        let pod = Some("web-1");
        let r = a_run(vec![
            ev(10.0, EventKind::PodCreated, "node-1", pod, ""),
            ev(20.0, EventKind::PodReady, "node-1", pod, ""),
            ev(
                25.0,
                EventKind::LbPool,
                "node-1",
                None,
                "new connections to node-1",
            ),
            ev(30.0, EventKind::LbPool, "node-1", None, "no healthy node"),
            ev(
                35.0,
                EventKind::LbPool,
                "node-1",
                None,
                "new connections to node-2",
            ),
            ev(36.0, EventKind::LabLate, "node-1", None, "late"),
            ev(40.0, EventKind::HealthAnswer, "node-1", None, "503"),
            ev(50.0, EventKind::KproxyRestarted, "node-1", None, ""),
            ev(60.0, EventKind::NodeTainted, "node-1", None, ""),
            ev(70.0, EventKind::LbDrained, "node-1", None, ""),
            ev(80.0, EventKind::PodTerminating, "node-1", pod, ""),
            ev(90.0, EventKind::PodSigterm, "node-1", pod, ""),
            ev(100.0, EventKind::PodKilled, "node-1", pod, ""),
            ev(10.0, EventKind::PodCreated, "node-1", Some("web-2"), ""),
            ev(100.0, EventKind::PodExited, "node-1", Some("web-2"), ""),
        ]);
        let svg = timeline_svg(&r);
        let legend = legend(r.time_scale);
        let mut drawn = 0;
        for attr in ["fill=\"", "stroke=\""] {
            for piece in svg.split(attr).skip(1) {
                let colour = &piece[..piece.find('"').unwrap()];
                if ["#335", "#888"].contains(&colour) {
                    continue; // the rollout's label and the axis: text, not marks
                }
                drawn += 1;
                assert!(
                    legend.contains(&format!("background:{colour}\"")),
                    "{colour} is drawn but not in the legend"
                );
            }
        }
        assert!(
            drawn >= LEGEND.len(),
            "the fixture draws every mark: {drawn}"
        );
        for (colour, _) in LEGEND {
            assert!(
                svg.contains(colour),
                "{colour} in the legend is never drawn"
            );
        }
        let page = render("t", "i", std::slice::from_ref(&r), &[]);
        assert!(page.contains(&legend), "the report shows the legend");
    }

    /// A run over two nodes at time scale 0.1, with one failed request (1.5 s real)
    /// and `events`.
    fn a_run(events: Vec<crate::world::timeline::Event>) -> RunResult {
        let failed = crate::world::loadgen::RequestRecord {
            start_ms: 1500.0,
            end_ms: 1600.0,
            outcome: crate::world::loadgen::Outcome::Timeout,
            conn: crate::world::loadgen::ConnKind::New,
            pod: None,
            reused: false,
            conn_pod: None,
        };
        RunResult {
            control_plane: crate::spec::run::ControlPlaneKind::Emulated,
            behaviour: crate::spec::run::Behaviour::Kproxy,
            run: 0,
            time_scale: 0.1,
            nodes: vec!["node-1".into(), "node-2".into()],
            health_check: crate::spec::balancer::LbPreset::Gke.health_check().unwrap(),
            records: vec![failed],
            events,
            load_start_ms: 0.0,
            rollout_start_ms: 0.0,
            rollout_end_ms: 2000.0,
            load_end_ms: 2000.0,
            drain: None,
        }
    }

    /// The header cells of every table in `page`.
    fn headers(page: &str) -> Vec<String> {
        page.split("<th>")
            .skip(1)
            .map(|p| p[..p.find("</th>").unwrap()].to_string())
            .collect()
    }

    /// Every column of the runs and bursts tables is defined on the page, as is the
    /// time scale.
    #[test]
    fn the_page_defines_every_column_and_states_the_time_scale() {
        let page = render("t", "i", &[a_run(vec![])], &[]);
        let defined: Vec<&str> = page
            .split("<dt>")
            .skip(1)
            .map(|p| &p[..p.find("</dt>").unwrap()])
            .collect();
        let hs = headers(&page);
        assert!(hs.len() >= 13, "{hs:?}");
        for h in hs {
            assert!(
                defined.iter().any(|d| d.split(", ").any(|x| x == h)),
                "column {h:?} is not defined on the page: {defined:?}"
            );
        }
        assert!(
            page.contains("time scale 0.1 (real time = nominal × 0.1)"),
            "{page}"
        );
        assert!(page.contains("nominal s (real = × 0.1)"), "{page}");
    }

    /// Before any pool change, and whenever no node passes, the LB sends to every node:
    /// drawn as its own state, not as "in the pool"; then each node is in or out.
    #[test]
    fn the_lb_sending_to_every_node_is_its_own_state() {
        use crate::world::timeline::Event;
        let pool = |t_ms: f64, detail: &str| Event {
            t_ms,
            kind: EventKind::LbPool,
            node: None,
            pod: None,
            detail: detail.into(),
        };
        let svg = timeline_svg(&a_run(vec![
            pool(500.0, "new connections to node-2"),
            pool(
                900.0,
                "no healthy node: new connections to all (node-1, node-2)",
            ),
        ]));
        let node1: Vec<&str> = svg
            .lines()
            .filter(|l| l.contains("<title>node-1 "))
            .collect();
        assert_eq!(node1.len(), 3, "{svg}");
        assert!(
            node1[0].contains(ALL_NODES) && node1[0].contains("0.0–5.0 s"),
            "{}",
            node1[0]
        );
        assert!(node1[1].contains(OUT_OF_POOL), "{}", node1[1]);
        assert!(node1[2].contains(ALL_NODES), "{}", node1[2]);
        assert!(svg.contains("<title>node-2 in the LB pool"), "{svg}");
    }

    #[test]
    fn a_health_answer_says_it_once() {
        let answer = crate::world::timeline::Event {
            t_ms: 100.0,
            kind: EventKind::HealthAnswer,
            node: Some("node-1".into()),
            pod: None,
            detail: "health check fails".into(),
        };
        let svg = timeline_svg(&a_run(vec![answer]));
        assert!(
            svg.contains("<title>node-1: health check fails from 1.0 s</title>"),
            "{svg}"
        );
        assert!(!svg.contains("health check health check"), "{svg}");
    }

    #[test]
    fn steps_keep_the_axis_readable() {
        assert_eq!(nice_step(15.0), 1.0);
        assert_eq!(nice_step(150.0), 10.0);
    }
}
