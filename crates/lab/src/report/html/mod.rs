//! The self-contained HTML report: per run, a timeline with one lane per
//! node and per pod (pod lifecycles as coloured bars, health answers, LB pool
//! membership, kproxy restarts) and a request lane with every failure marked where it
//! happened; the failure bursts with their causes; the run's anomalies; and, for a
//! matrix, the cells as a coloured table with lint's findings beside the packets. Every
//! table is followed by what its columns mean, and the time scale is stated where times
//! are read. Inline CSS and SVG only: no script, no external resource. Pure functions
//! over finished runs.

use std::fmt::Write as _;

use crate::report::matrix::CellResult;
use crate::report::{self, RunResult, Summary};
use timeline::{legend, timeline_svg};

mod timeline;

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
        s.push_str(&kernel_counters(r));
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
            esc(&c.cell.setting.to_string()),
            esc(crate::scenario::matrix::profile_str(c.cell.profile)),
            esc(crate::scenario::matrix::preset_str(c.cell.preset)),
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
/// kproxy's kernel counters per node beside the load generator's failures
/// (`report::kernel`), when the run read them.
fn kernel_counters(r: &RunResult) -> String {
    if r.kernel.is_empty() {
        return String::new();
    }
    let c = report::kernel::check(r.kernel.clone(), &r.records);
    let mut s = String::from(
        "<h3>Kernel counters beside the load generator</h3>\n<p>New connections during the load, per node, as kproxy's nftables counters counted them; the load generator cannot tell which node a failed connection went through, so it is compared with the sum.</p>\n<table><tr><th>node</th><th>DNATed</th><th>rejected</th><th>dropped</th><th>fallback</th></tr>\n",
    );
    for n in &c.nodes {
        match &n.error {
            Some(e) => {
                let _ = writeln!(
                    s,
                    "<tr><td>{}</td><td colspan=\"4\">not read: {}</td></tr>",
                    esc(&n.node),
                    esc(e)
                );
            }
            None => {
                let _ = writeln!(
                    s,
                    "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                    esc(&n.node),
                    n.new,
                    n.rejected,
                    n.dropped,
                    n.fallback
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "<tr><td><b>all nodes</b></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr></table>\n<p>Load generator: {} connections opened, {} refused, {} timed out.</p>\n<ul>",
        c.kernel_new,
        c.kernel_rejected,
        c.kernel_dropped,
        c.kernel_fallback,
        c.loadgen_connections,
        c.loadgen_refused,
        c.loadgen_timed_out
    );
    for n in &c.notes {
        let _ = writeln!(s, "<li>{}</li>", esc(n));
    }
    s.push_str("</ul>\n");
    s
}

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

#[cfg(test)]
mod tests {
    use super::timeline::{ALL_NODES, LEGEND, OUT_OF_POOL, nice_step};
    use super::*;
    use crate::world::timeline::EventKind;

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
            ev(
                40.0,
                EventKind::HealthAnswer,
                "node-1",
                None,
                "health check fails",
            ),
            ev(
                45.0,
                EventKind::HealthAnswer,
                "node-1",
                None,
                "health check passes",
            ),
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
            control_plane: crate::scenario::run::ControlPlaneKind::Emulated,
            behaviour: crate::scenario::run::Behaviour::Kproxy,
            run: 0,
            time_scale: 0.1,
            nodes: vec!["node-1".into(), "node-2".into()],
            health_check: crate::scenario::balancer::LbPreset::Gke
                .health_check()
                .unwrap(),
            records: vec![failed],
            events,
            load_start_ms: 0.0,
            rollout_start_ms: 0.0,
            rollout_end_ms: 2000.0,
            load_end_ms: 2000.0,
            drain: None,
            kernel: Vec::new(),
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

    /// The main run of issue 50 as its timeline recorded it: three nodes failing their
    /// health check from the first probe (no pod ready yet), all three passing from
    /// 27.0 s, node-1 failing from 33.0 s (its pod terminating). Replayed through the
    /// LB's own bookkeeping (`HealthBook`, gke: a round every 3 s, in after one pass,
    /// out after two failures), the pool events it logs draw the fallback band ("no
    /// node passes, send to every node") up to 27.0 s only; logged by the set of nodes
    /// alone, "all pass" looked like "none passes" and the band ran to 36.0 s.
    #[test]
    fn the_fallback_band_ends_when_every_node_passes() {
        use crate::world::lb::HealthBook;
        use crate::world::timeline::Event;
        let mut r = a_run(vec![]);
        r.nodes = vec!["node-1".into(), "node-2".into(), "node-3".into()];
        r.rollout_start_ms = 3000.0;
        r.rollout_end_ms = 4000.0;
        r.load_end_ms = 4500.0;
        let scale = r.time_scale;
        // (nominal s, node, passes): the answers as recorded.
        let recorded = [
            (0.0, 0, false),
            (0.0, 1, false),
            (0.0, 2, false),
            (27.0, 0, true),
            (27.0, 1, true),
            (27.0, 2, true),
            (33.0, 0, false),
        ];
        let mut book = HealthBook::new(3, &r.health_check);
        let mut events = Vec::new();
        let mut t = 0.0;
        while t <= 45.0 {
            let answers: Vec<bool> = (0..3)
                .map(|n| {
                    recorded
                        .iter()
                        .rfind(|(at, node, _)| *node == n && *at <= t)
                        .is_some_and(|(_, _, passes)| *passes)
                })
                .collect();
            let round = book.round(&answers);
            let at_ms = t * 1000.0 * scale;
            for (i, ok) in round.answers {
                let detail = if ok {
                    "health check passes"
                } else {
                    "health check fails"
                };
                events.push(Event {
                    t_ms: at_ms,
                    kind: EventKind::HealthAnswer,
                    node: Some(r.nodes[i].clone()),
                    pod: None,
                    detail: detail.into(),
                });
            }
            if let Some(pool) = round.pool {
                events.push(Event {
                    t_ms: at_ms,
                    kind: EventKind::LbPool,
                    node: None,
                    pod: None,
                    detail: pool.detail(&r.nodes),
                });
            }
            t += r.health_check.interval_seconds;
        }
        r.events = events;
        let svg = timeline_svg(&r);
        for node in &r.nodes {
            let bands: Vec<&str> = svg
                .lines()
                .filter(|l| l.contains(&format!("<title>{node} ")) && l.contains(ALL_NODES))
                .collect();
            assert_eq!(bands.len(), 1, "{node}: {bands:?}");
            assert!(bands[0].contains("0.0–27.0 s"), "{node}: {}", bands[0]);
        }
        assert!(
            svg.contains("<title>node-1 out of the LB pool, 36.0–"),
            "{svg}"
        );
        assert!(svg.contains("<title>node-2 in the LB pool (passes the health check), 27.0–"));
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
