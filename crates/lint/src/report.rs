//! Findings into text (for people, grouped by workload), JSON (for scripts) and SARIF
//! 2.1.0 (for code scanning). Pure: each function returns the whole document.

use std::fmt::Write as _;

use serde_json::{Value, json};

use crate::rules::{Finding, Options, RULES, Severity, num};

/// Counts per severity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Summary {
    pub errors: usize,
    pub warnings: usize,
    pub notes: usize,
}

impl Summary {
    pub fn of(findings: &[Finding]) -> Self {
        let mut s = Summary::default();
        for f in findings {
            match f.severity {
                Severity::Error => s.errors += 1,
                Severity::Warning => s.warnings += 1,
                Severity::Note => s.notes += 1,
            }
        }
        s
    }
}

/// Human output: one block per workload (or unreadable object), findings under it.
pub fn text(findings: &[Finding], opts: &Options, workloads_checked: usize) -> String {
    let lb = &opts.lb;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "load balancer {}: detection window {} × {} + {} = {} s, connection draining {} s, new-node registration {} s; proxy programming {} s",
        lb.name,
        num(lb.interval_seconds),
        lb.unhealthy_threshold,
        num(lb.timeout_seconds),
        num(lb.detection_window()),
        num(lb.drain_seconds),
        num(lb.registration_seconds),
        num(opts.proxy_programming_seconds)
    );
    // Group by object, keeping first-appearance order.
    let mut groups: Vec<(String, String, Vec<&Finding>)> = Vec::new();
    for f in findings {
        let key = match f.line {
            Some(line) => format!("{}, line {line}", f.location),
            None => format!("{}", f.location),
        };
        match groups
            .iter_mut()
            .find(|(o, k, _)| *o == f.object && *k == key)
        {
            Some(g) => g.2.push(f),
            None => groups.push((f.object.clone(), key, vec![f])),
        }
    }
    for (object, location, fs) in &groups {
        let _ = writeln!(out, "\n{} ({})", sanitize(object), sanitize(location));
        // Errors first; otherwise input order.
        let mut fs = fs.clone();
        fs.sort_by_key(|f| f.severity);
        for f in fs {
            let mut about = Vec::new();
            if let Some(s) = &f.service {
                about.push(format!(
                    "Service {} ({})",
                    sanitize(s),
                    f.external_traffic_policy.unwrap_or("?")
                ));
            }
            if let Some(c) = &f.container {
                about.push(format!("container {}", sanitize(c)));
            }
            let about = if about.is_empty() {
                String::new()
            } else {
                format!("  [{}]", about.join(", "))
            };
            let _ = writeln!(out, "  {:<7} {}{about}", f.severity.as_str(), f.rule);
            let _ = writeln!(out, "          {}", sanitize(&f.message));
            if !f.numbers.is_empty() {
                let n: Vec<String> = f
                    .numbers
                    .iter()
                    .map(|(k, v)| format!("{k}={}", num(*v)))
                    .collect();
                let _ = writeln!(out, "          numbers: {}", n.join(" "));
            }
            let _ = writeln!(out, "          fix: {}", sanitize(&f.fix));
        }
    }
    let s = Summary::of(findings);
    let _ = writeln!(
        out,
        "\n{} workload(s) behind a LoadBalancer Service checked: {} error(s), {} warning(s), {} note(s)",
        workloads_checked, s.errors, s.warnings, s.notes
    );
    out
}

/// Machine output: the options, a summary and every finding.
pub fn json(findings: &[Finding], opts: &Options, workloads_checked: usize) -> Value {
    json!({
        "options": opts,
        "lbDetectionWindowSeconds": opts.lb.detection_window(),
        "workloadsChecked": workloads_checked,
        "summary": Summary::of(findings),
        "findings": findings,
    })
}

/// SARIF 2.1.0 (OASIS): one run, the rule catalogue as `tool.driver.rules`, one result
/// per finding located at its manifest file, with the object as a logical location.
pub fn sarif(findings: &[Finding]) -> Value {
    let rules: Vec<Value> = RULES
        .iter()
        .map(|r| {
            json!({
                "id": r.id,
                "shortDescription": {"text": r.summary},
                "fullDescription": {"text": r.summary},
                "help": {"text": format!("See docs/lint-rules.md#{} in the kproxy repository.", r.id)},
                "defaultConfiguration": {"level": r.severity.as_str()},
            })
        })
        .collect();
    let results: Vec<Value> = findings
        .iter()
        .map(|f| {
            let rule_index = RULES.iter().position(|r| r.id == f.rule);
            let mut logical = json!({"fullyQualifiedName": f.object, "kind": "object"});
            if let Some(w) = &f.workload {
                logical = json!({
                    "name": w.name,
                    "fullyQualifiedName": format!("{}/{}/{}", w.kind, w.namespace, w.name),
                    "kind": "object",
                });
            }
            let mut result = json!({
                "ruleId": f.rule,
                "level": f.severity.as_str(),
                "message": {"text": format!("{}. Fix: {}", f.message, f.fix)},
                "locations": [{
                    "physicalLocation": physical_location(f),
                    "logicalLocations": [logical],
                }],
                "properties": {
                    "document": f.location.document,
                    "item": f.location.item,
                    "service": f.service,
                    "externalTrafficPolicy": f.external_traffic_policy,
                    "container": f.container,
                    "numbers": f.numbers,
                },
            });
            if let (Some(i), Value::Object(m)) = (rule_index, &mut result) {
                m.insert("ruleIndex".into(), json!(i));
            }
            result
        })
        .collect();
    json!({
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "kproxy lint",
                "version": env!("CARGO_PKG_VERSION"),
                "rules": rules,
            }},
            "results": results,
        }],
    })
}

/// The manifest file, and the line its document starts on when known.
fn physical_location(f: &Finding) -> Value {
    let mut p = json!({"artifactLocation": {"uri": uri_reference(&f.location.file)}});
    if let (Some(line), Value::Object(m)) = (f.line, &mut p) {
        m.insert("region".into(), json!({"startLine": line}));
    }
    p
}

/// Control characters (newlines, ESC, …) escaped, everything else as is: text output
/// must not let a value from a manifest (a name, a map key in a field path) forge lines
/// or drive the terminal. Values already escaped pass through unchanged.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A file path as a relative URI reference: everything but unreserved characters and `/`
/// is percent-encoded (SARIF `artifactLocation.uri` must be a URI).
fn uri_reference(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_nothing_else() {
        assert_eq!(
            sanitize("a\nb\u{1b}[2J ≥ \"q\" \\n"),
            "a\\nb\\u{1b}[2J ≥ \"q\" \\n"
        );
    }

    #[test]
    fn uris_are_percent_encoded() {
        assert_eq!(
            uri_reference("dir/my file#1.yaml"),
            "dir/my%20file%231.yaml"
        );
        assert_eq!(uri_reference("ü.yaml"), "%C3%BC.yaml");
    }
}
