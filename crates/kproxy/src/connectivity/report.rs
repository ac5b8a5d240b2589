//! What the connectivity test found (pure): each probe's verdict ([`verdict`]: what was
//! expected against what was seen), the cells of the table (node × source × check, a
//! cell failing when one of its probes does), the table and summary as text, and the
//! JSON of `-o json`.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use super::checks::{Check, Expect, Probe, Source};

/// What one probe saw.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "kebab-case")]
pub enum Observed {
    /// Answered; the servers' names when the probe asks for them (empty: a UDP answer
    /// or a TCP connection made).
    Answer(Vec<String>),
    /// An HTTP status other than an answer's 200 (or the health check's status).
    Status(u16),
    Refused,
    Timeout,
    /// Anything else the client printed (no route, an unreadable line).
    Error(String),
    /// No result: the client did not run it (why).
    Missing(String),
}

impl Observed {
    pub fn words(&self) -> String {
        match self {
            Observed::Answer(names) if names.is_empty() => "an answer".into(),
            Observed::Answer(names) => {
                let mut distinct: Vec<&String> = names.iter().collect();
                distinct.sort();
                distinct.dedup();
                if names.len() > 1 {
                    let list: Vec<&str> = distinct.iter().map(|s| s.as_str()).collect();
                    format!("{} answers from {}", names.len(), list.join(", "))
                } else {
                    format!("an answer from {}", names[0])
                }
            }
            Observed::Status(c) => format!("HTTP {c}"),
            Observed::Refused => "connection refused".into(),
            Observed::Timeout => "a timeout".into(),
            Observed::Error(e) => format!("an error ({e})"),
            Observed::Missing(why) => format!("no result ({why})"),
        }
    }
}

/// Whether `seen` is what `expect` asks for.
pub fn verdict(expect: &Expect, seen: &Observed) -> bool {
    match (expect, seen) {
        (Expect::Answer, Observed::Answer(_)) => true,
        (Expect::AnswerFrom(want), Observed::Answer(names)) => {
            !names.is_empty() && names.iter().all(|n| n == want)
        }
        (Expect::OneServer, Observed::Answer(names)) => names
            .first()
            .is_some_and(|first| names.iter().all(|n| n == first)),
        (Expect::Status(want), Observed::Status(got)) => want == got,
        // A 200 with a body is read as an answer by the hostname probes only; the
        // health check reads the status alone.
        (Expect::Refused, Observed::Refused) | (Expect::Timeout, Observed::Timeout) => true,
        _ => false,
    }
}

/// One probe's outcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ProbeResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    pub expected: Expect,
    pub observed: Observed,
    pub ok: bool,
}

/// A cell's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CellStatus {
    Ok,
    Failed,
    Skipped,
}

/// One cell: a check from one source on one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Cell {
    pub node: String,
    pub source: Source,
    pub check: Check,
    pub status: CellStatus,
    /// Why it was skipped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub probes: Vec<ProbeResult>,
}

/// The whole result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Report {
    pub namespace: String,
    pub nodes: Vec<String>,
    pub cells: Vec<Cell>,
    /// What happened to the namespace at the end.
    pub cleanup: String,
}

/// The cells of one client (node, source): its probes with what it saw, then a
/// skipped cell for each of `skipped`.
pub fn cells(
    node: &str,
    source: Source,
    probes: &[Probe],
    seen: Vec<Observed>,
    skipped: &[(Check, String)],
) -> Vec<Cell> {
    let mut by_check: BTreeMap<Check, Vec<ProbeResult>> = BTreeMap::new();
    for (probe, observed) in probes.iter().zip(seen) {
        by_check.entry(probe.check).or_default().push(ProbeResult {
            target: probe.target.clone(),
            expected: probe.expect.clone(),
            ok: verdict(&probe.expect, &observed),
            observed,
        });
    }
    let mut out: Vec<Cell> = by_check
        .into_iter()
        .map(|(check, probes)| Cell {
            node: node.to_string(),
            source,
            check,
            status: if probes.iter().all(|p| p.ok) {
                CellStatus::Ok
            } else {
                CellStatus::Failed
            },
            reason: None,
            probes,
        })
        .collect();
    for (check, why) in skipped {
        out.push(Cell {
            node: node.to_string(),
            source,
            check: *check,
            status: CellStatus::Skipped,
            reason: Some(why.clone()),
            probes: Vec::new(),
        });
    }
    out.sort_by_key(|c| c.check);
    out
}

impl Report {
    pub fn failed(&self) -> usize {
        self.count(CellStatus::Failed)
    }

    fn count(&self, status: CellStatus) -> usize {
        self.cells.iter().filter(|c| c.status == status).count()
    }

    /// The last line.
    pub fn summary(&self) -> String {
        format!(
            "connectivity-test: {} nodes, {} checks: {} ok, {} failed, {} skipped; {}",
            self.nodes.len(),
            self.cells.len(),
            self.count(CellStatus::Ok),
            self.failed(),
            self.count(CellStatus::Skipped),
            self.cleanup
        )
    }

    /// The table (a row per node and source, a column per check), then one line per
    /// failing probe (node, source, check, target: expected and seen), the skipped
    /// checks with why, and the summary.
    pub fn text(&self) -> String {
        let checks: Vec<Check> = Check::ALL
            .into_iter()
            .filter(|c| self.cells.iter().any(|x| x.check == *c))
            .collect();
        let mut header = vec!["NODE".to_string(), "FROM".to_string()];
        header.extend(checks.iter().map(|c| c.name().to_string()));
        let mut rows = vec![header];
        for node in &self.nodes {
            for source in Source::ALL {
                let mut row = vec![node.clone(), source.word().to_string()];
                for check in &checks {
                    let cell = self
                        .cells
                        .iter()
                        .find(|c| &c.node == node && c.source == source && c.check == *check);
                    row.push(match cell.map(|c| c.status) {
                        Some(CellStatus::Ok) => "ok".into(),
                        Some(CellStatus::Failed) => "FAIL".into(),
                        Some(CellStatus::Skipped) => "skip".into(),
                        None => "-".into(),
                    });
                }
                rows.push(row);
            }
        }
        let widths: Vec<usize> = (0..rows[0].len())
            .map(|i| rows.iter().map(|r| r[i].len()).max().unwrap_or(0))
            .collect();
        let mut s = String::new();
        for row in &rows {
            let line: Vec<String> = row
                .iter()
                .zip(&widths)
                .map(|(v, w)| format!("{v:<w$}"))
                .collect();
            let _ = writeln!(s, "{}", line.join("  ").trim_end());
        }
        for cell in self.cells.iter().filter(|c| c.status == CellStatus::Failed) {
            for p in cell.probes.iter().filter(|p| !p.ok) {
                let target = p
                    .target
                    .as_ref()
                    .map(|t| format!(" to {t}"))
                    .unwrap_or_default();
                let _ = writeln!(
                    s,
                    "FAIL {} {} from the {}{target}: {}, expected {}",
                    cell.node,
                    cell.check.name(),
                    source_words(cell.source),
                    p.observed.words(),
                    p.expected.words()
                );
            }
        }
        let mut skipped: Vec<(Check, &str)> = self
            .cells
            .iter()
            .filter_map(|c| Some((c.check, c.reason.as_deref()?)))
            .collect();
        skipped.sort();
        skipped.dedup();
        for (check, why) in skipped {
            let _ = writeln!(s, "skip {}: {why}", check.name());
        }
        let _ = writeln!(s, "{}", self.summary());
        s
    }
}

fn source_words(source: Source) -> &'static str {
    match source {
        Source::Node => "node (hostNetwork)",
        Source::Pod => "pod",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connectivity::checks::{probes, skips, tests::setup};

    fn answer(names: &[&str]) -> Observed {
        Observed::Answer(names.iter().map(|s| s.to_string()).collect())
    }

    #[test]
    fn verdicts() {
        use Expect as E;
        use Observed as O;
        let table: Vec<(E, O, bool)> = vec![
            (E::Answer, answer(&["server-1"]), true),
            (E::Answer, answer(&[]), true),
            (E::Answer, O::Timeout, false),
            (E::Answer, O::Status(503), false),
            (
                E::AnswerFrom("server-0".into()),
                answer(&["server-0"]),
                true,
            ),
            (
                E::AnswerFrom("server-0".into()),
                answer(&["server-1"]),
                false,
            ),
            (E::AnswerFrom("server-0".into()), answer(&[]), false),
            (E::OneServer, answer(&["server-1", "server-1"]), true),
            (E::OneServer, answer(&["server-1", "server-0"]), false),
            (E::OneServer, answer(&[]), false),
            (E::Status(200), O::Status(200), true),
            (E::Status(503), O::Status(200), false),
            (E::Status(503), O::Refused, false),
            (E::Refused, O::Refused, true),
            (E::Refused, O::Timeout, false),
            (E::Refused, answer(&[]), false),
            (E::Timeout, O::Timeout, true),
            (E::Timeout, answer(&["server-1"]), false),
            (E::Timeout, O::Error("no route".into()), false),
            (E::Answer, O::Missing("pod Pending".into()), false),
        ];
        for (expect, seen, ok) in table {
            assert_eq!(verdict(&expect, &seen), ok, "{expect:?} {seen:?}");
        }
    }

    /// A healthy run but one UDP timeout on node-1's pod: that cell fails, the line
    /// names node, check, source, what was seen and expected; skips say why.
    #[test]
    fn the_table_names_the_failing_cell() {
        let mut s = setup(2, 0);
        s.load_balancer = Err("no ingress IP within 30s".into());
        let mut cells_all = Vec::new();
        for (i, node) in s.nodes.iter().enumerate() {
            for source in Source::ALL {
                let p = probes(&s, i);
                let seen = p
                    .iter()
                    .map(|p| match (&p.expect, p.check) {
                        (_, Check::ClusterIpUdp) if i == 1 && source == Source::Pod => {
                            Observed::Timeout
                        }
                        (Expect::Answer, _) => answer(&["server-1"]),
                        (Expect::AnswerFrom(n), _) => answer(&[n]),
                        (Expect::OneServer, _) => answer(&["server-0"; 10]),
                        (Expect::Status(c), _) => Observed::Status(*c),
                        (Expect::Refused, _) => Observed::Refused,
                        (Expect::Timeout, _) => Observed::Timeout,
                    })
                    .collect();
                cells_all.extend(cells(&node.name, source, &p, seen, &skips(&s)));
            }
        }
        let report = Report {
            namespace: "kproxy-connectivity-x".into(),
            nodes: s.nodes.iter().map(|n| n.name.clone()).collect(),
            cells: cells_all,
            cleanup: "namespace kproxy-connectivity-x deleted".into(),
        };
        assert_eq!(report.failed(), 1);
        let text = report.text();
        let expected = "\
NODE    FROM  clusterip-tcp  clusterip-udp  nodeport  loadbalancer  external-ip  affinity  etp-local-hc  itp-local  no-endpoints  terminating  terminating-hc
node-0  node  ok             ok             ok        skip          skip         ok        ok            ok         ok            ok           ok
node-0  pod   ok             ok             ok        skip          skip         ok        ok            ok         ok            ok           ok
node-1  node  ok             ok             ok        skip          skip         ok        ok            ok         ok            ok           ok
node-1  pod   ok             FAIL           ok        skip          skip         ok        ok            ok         ok            ok           ok
FAIL node-1 clusterip-udp from the pod: a timeout, expected an answer
skip loadbalancer: no ingress IP within 30s
skip external-ip: no --external-ip given (an address routed to the nodes)
connectivity-test: 2 nodes, 44 checks: 35 ok, 1 failed, 8 skipped; namespace kproxy-connectivity-x deleted
";
        assert_eq!(text, expected);
        let json = serde_json::to_value(&report).unwrap();
        let failed: Vec<_> = json["cells"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["status"] == "failed")
            .collect();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0]["node"], "node-1");
        assert_eq!(failed[0]["source"], "pod");
        assert_eq!(failed[0]["check"], "clusterip-udp");
        assert_eq!(failed[0]["probes"][0]["observed"]["kind"], "timeout");
        assert_eq!(failed[0]["probes"][0]["expected"]["kind"], "answer");
    }

    /// A failing NodePort probe names the node whose address was probed.
    #[test]
    fn a_failing_probe_names_its_target() {
        let s = setup(2, 0);
        let p: Vec<Probe> = probes(&s, 0)
            .into_iter()
            .filter(|p| p.check == Check::NodePort)
            .collect();
        let seen = vec![answer(&["server-0"]), Observed::Refused];
        let c = cells("node-0", Source::Node, &p, seen, &[]);
        let report = Report {
            namespace: "ns".into(),
            nodes: vec!["node-0".into()],
            cells: c,
            cleanup: "kept".into(),
        };
        assert!(
            report.text().contains(
                "FAIL node-0 nodeport from the node (hostNetwork) to node-1: connection refused, expected an answer\n"
            ),
            "{}",
            report.text()
        );
    }
}
