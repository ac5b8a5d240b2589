//! The rollout's text report: per run, the summary, the failures by phase, the bursts
//! with their causes and the anomalies, kproxy's kernel counters beside the load
//! generator's failures; with `--timeline`, every event.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use super::{RunResult, Summary, label, label_of, nominal, summarize};
use crate::world::timeline::{Event, EventKind};

fn event_line(r: &RunResult, e: &Event) -> String {
    let who = match (&e.node, &e.pod) {
        (Some(n), Some(p)) => format!("{n} {p}"),
        (Some(n), None) => n.clone(),
        (None, Some(p)) => p.clone(),
        (None, None) => String::new(),
    };
    let kind = serde_json::to_value(&e.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    format!(
        "{:>8.2}s  {:<18} {:<20} {}",
        nominal(r, e.t_ms),
        kind,
        who,
        e.detail
    )
}

/// Events worth a line in the text timeline (kproxy syncs are many: only failures).
fn shown_in_timeline(e: &Event) -> bool {
    !matches!(
        e.kind,
        EventKind::KproxySynced | EventKind::Note | EventKind::SlicePublished
    )
}

/// The text report for a set of runs.
pub fn render(runs: &[RunResult], timeline: bool) -> String {
    let mut s = String::new();
    let sums: Vec<Summary> = runs.iter().map(summarize).collect();
    let w = sums
        .iter()
        .map(|m| label(m).len())
        .max()
        .unwrap_or(0)
        .max(9);
    let _ = writeln!(
        s,
        "\nSummary (times are nominal: real time / time scale {}; they count from the start of each run, the cluster's set-up, as the HTML report's axis does)",
        runs.first().map(|r| r.time_scale).unwrap_or(1.0)
    );
    let _ = writeln!(
        s,
        "{:<w$} {:>3} {:>7} {:>7} {:>7} {:>8} {:>6} {:>8} {:>6} {:>12}  {:>8} {:>8} {:>8}",
        "behaviour",
        "run",
        "sent",
        "ok",
        "failed",
        "refused",
        "reset",
        "timeout",
        "other",
        "longest out",
        "before",
        "rollout",
        "after"
    );
    for m in &sums {
        let k = |n: &str| m.failed_by_kind.get(n).copied().unwrap_or(0);
        let other = m.failed - k("refused") - k("reset") - k("timeout");
        let _ = writeln!(
            s,
            "{:<w$} {:>3} {:>7} {:>7} {:>7} {:>8} {:>6} {:>8} {:>6} {:>11.1}s  {:>8} {:>8} {:>8}",
            label(m),
            m.run,
            m.sent,
            m.ok,
            m.failed,
            k("refused"),
            k("reset"),
            k("timeout"),
            other,
            m.longest_outage_s,
            m.failed_before_rollout,
            m.failed_during_rollout,
            m.failed_after_rollout
        );
    }
    // Distribution per behaviour when there are several runs.
    let mut per: BTreeMap<String, Vec<&Summary>> = BTreeMap::new();
    for m in &sums {
        per.entry(label(m)).or_default().push(m);
    }
    if runs.len() > per.len() {
        let _ = writeln!(s);
        for (b, v) in &per {
            let total: usize = v.iter().map(|m| m.failed).sum();
            let sent: usize = v.iter().map(|m| m.sent).sum();
            let worst = v
                .iter()
                .max_by_key(|m| m.failed)
                .map(|m| (m.run, m.failed))
                .unwrap_or((0, 0));
            let with_loss = v.iter().filter(|m| m.failed > 0).count();
            let slowest = runs
                .iter()
                .filter(|r| label_of(r.behaviour.as_str(), r.control_plane.as_str()) == *b)
                .map(|r| {
                    (
                        r.run + 1,
                        (r.rollout_end_ms - r.rollout_start_ms) / 1000.0 / r.time_scale,
                    )
                })
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .unwrap_or((0, 0.0));
            let _ = writeln!(
                s,
                "{b}: {} runs, {total} of {sent} requests failed in total; runs with loss: {with_loss}; worst run: #{} with {} failed; slowest rollout: #{} in {:.1} s",
                v.len(),
                worst.0,
                worst.1,
                slowest.0,
                slowest.1
            );
        }
    }
    for (r, m) in runs.iter().zip(&sums) {
        let _ = writeln!(
            s,
            "\n== {} run {}: {} failure burst(s); load from {:.2}s, {} {:.2}s..{:.2}s",
            label(m),
            m.run,
            m.bursts.len(),
            nominal(r, r.load_start_ms),
            if r.drain.is_some() {
                "node drain"
            } else {
                "rollout"
            },
            nominal(r, r.rollout_start_ms),
            nominal(r, r.rollout_end_ms)
        );
        for b in &m.bursts {
            let kinds: Vec<String> = b.kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
            let _ = writeln!(
                s,
                "  {:>7.2}s..{:>7.2}s  {} failed ({}): {}",
                b.start_s,
                b.end_s,
                b.failed,
                kinds.join(", "),
                b.cause
            );
        }
        for a in &m.anomalies {
            let _ = writeln!(s, "  anomaly at {:>7.2}s: {}", a.at_s, a.what);
        }
        if !r.kernel.is_empty() {
            s.push_str(&super::kernel::text(&super::kernel::check(
                r.kernel.clone(),
                &r.records,
            )));
        }
        if timeline {
            let _ = writeln!(s, "  timeline:");
            for e in r.events.iter().filter(|e| shown_in_timeline(e)) {
                let _ = writeln!(s, "  {}", event_line(r, e));
            }
            let syncs = r
                .events
                .iter()
                .filter(|e| e.kind == EventKind::KproxySynced)
                .count();
            let _ = writeln!(
                s,
                "  ({syncs} kproxy syncs across nodes, in the JSON output)"
            );
        }
    }
    s
}
