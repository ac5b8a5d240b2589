//! The rollout's JSON document (`-o json`), its field names stable (docs/lab.md).

use serde_json::{Value, json};

use super::{RunResult, nominal, summarize};
use crate::report::{compare, kernel};
use crate::scenario::rollout::RolloutConfig;

/// The JSON document: `{"runs": [{"behaviour", "sent", "ok", "failed", ...}], "html"}`;
/// a run that read kproxy's kernel counters also has `kernel_counters`
/// ([`kernel::KernelCheck`]).
/// Times (`*_s`) are nominal seconds since the run started, as in the text report.
pub fn render(runs: &[RunResult], config: &RolloutConfig, html: Option<&std::path::Path>) -> Value {
    let rs: Vec<Value> = runs
        .iter()
        .map(|r| {
            let m = summarize(r);
            let mut v = serde_json::to_value(&m).unwrap_or(Value::Null);
            if let Some(o) = v.as_object_mut() {
                o.insert("time_scale".into(), json!(r.time_scale));
                o.insert("load_start_s".into(), json!(nominal(r, r.load_start_ms)));
                o.insert(
                    "rollout_start_s".into(),
                    json!(nominal(r, r.rollout_start_ms)),
                );
                o.insert("rollout_end_s".into(), json!(nominal(r, r.rollout_end_ms)));
                o.insert(
                    "events".into(),
                    Value::Array(
                        r.events
                            .iter()
                            .map(|e| {
                                let mut ev = serde_json::to_value(e).unwrap_or(Value::Null);
                                if let Some(eo) = ev.as_object_mut() {
                                    eo.insert("t_s".into(), json!(nominal(r, e.t_ms)));
                                }
                                ev
                            })
                            .collect(),
                    ),
                );
                if !r.kernel.is_empty() {
                    o.insert(
                        "kernel_counters".into(),
                        serde_json::to_value(kernel::check(r.kernel.clone(), &r.records))
                            .unwrap_or(Value::Null),
                    );
                }
                o.insert(
                    "records".into(),
                    serde_json::to_value(&r.records).unwrap_or(Value::Null),
                );
            }
            v
        })
        .collect();
    let comparison: Vec<Value> = compare::pairs(runs)
        .into_iter()
        .map(|(e, k)| {
            json!({
                "behaviour": e.behaviour.as_str(),
                "run": e.run + 1,
                "rows": compare::align(&compare::milestones(e), &compare::milestones(k)),
            })
        })
        .collect();
    let html = html.map(|p| p.display().to_string());
    json!({"runs": rs, "config": config, "html": html, "comparison": comparison})
}
