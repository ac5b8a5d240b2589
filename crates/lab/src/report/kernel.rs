//! The lab cross-checking itself (issue 47 item 4): per node, the new connections
//! kproxy's kernel counters rejected and dropped during the load, beside the load
//! generator's refused and timed-out new connections, and where the two differ, why.
//! The load generator cannot say which node a failed connection went through (the LB
//! chooses, and a failure names no pod), so the kernel's counts are per node and the
//! comparison is of their sum with the run's. Pure: the counts come in, words go out.

use std::fmt::Write as _;

use serde::Serialize;

use crate::world::loadgen::{Outcome, RequestRecord};

/// One node's kernel counters over the load (the reading at its end minus the one at
/// its start), summed over the node's Service ports; `kproxy top -o json`'s totals.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeCounts {
    pub node: String,
    /// New connections DNATed to an endpoint.
    pub new: u64,
    /// New connections rejected: the Service port had no endpoint.
    pub rejected: u64,
    /// New connections dropped: no local endpoint (eTP/iTP Local) or source ranges.
    pub dropped: u64,
    /// New connections sent to a terminating endpoint by the fallback.
    pub fallback: u64,
    /// Why the node could not be read (then its counts are 0 and left out of the sums).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The comparison of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelCheck {
    pub nodes: Vec<NodeCounts>,
    /// The nodes' sums (nodes read without error).
    pub kernel_new: u64,
    pub kernel_rejected: u64,
    pub kernel_dropped: u64,
    pub kernel_fallback: u64,
    /// Requests of the load generator that opened a connection (a new connection, or a
    /// keep-alive connection's first request), and how many of those were refused and
    /// timed out.
    pub loadgen_connections: usize,
    pub loadgen_refused: usize,
    pub loadgen_timed_out: usize,
    /// Failures on a reused keep-alive connection: no new connection, so no counter.
    pub loadgen_failed_on_reused: usize,
    /// Where the two agree, where they differ and why, in plain words.
    pub notes: Vec<String>,
}

/// Compares the nodes' counts with the load generator's records.
pub fn check(nodes: Vec<NodeCounts>, records: &[RequestRecord]) -> KernelCheck {
    let read: Vec<&NodeCounts> = nodes.iter().filter(|n| n.error.is_none()).collect();
    let sum = |f: fn(&NodeCounts) -> u64| read.iter().map(|n| f(n)).sum::<u64>();
    let opened: Vec<&RequestRecord> = records.iter().filter(|r| !r.reused).collect();
    let count = |o: Outcome| opened.iter().filter(|r| r.outcome == o).count();
    let mut c = KernelCheck {
        kernel_new: sum(|n| n.new),
        kernel_rejected: sum(|n| n.rejected),
        kernel_dropped: sum(|n| n.dropped),
        kernel_fallback: sum(|n| n.fallback),
        loadgen_connections: opened.len(),
        loadgen_refused: count(Outcome::Refused),
        loadgen_timed_out: count(Outcome::Timeout),
        loadgen_failed_on_reused: records
            .iter()
            .filter(|r| r.reused && !r.outcome.is_ok())
            .count(),
        notes: Vec::new(),
        nodes,
    };
    c.notes = notes(&c);
    c
}

fn notes(c: &KernelCheck) -> Vec<String> {
    let mut out = Vec::new();
    let unread: Vec<&str> = c
        .nodes
        .iter()
        .filter(|n| n.error.is_some())
        .map(|n| n.node.as_str())
        .collect();
    if !unread.is_empty() {
        out.push(format!(
            "the counters of {} could not be read: the sums leave them out",
            unread.join(", ")
        ));
    }
    let (rej, refused) = (c.kernel_rejected, c.loadgen_refused as u64);
    out.push(if rej == 0 && refused == 0 {
        "nothing refused, nothing rejected".to_string()
    } else if rej == refused {
        format!("refused: {refused}, and the kernel rejected {rej}: every refusal was kproxy's reject of a Service port without endpoints")
    } else if refused > rej {
        format!(
            "refused: {refused}, the kernel rejected {rej}: {} refusal(s) were not kproxy's: a pod (or its node) answered the SYN with a reset, the pod's process not listening (exited, or not yet started) while it was still an endpoint; the kernel counted those as new connections DNATed, not as rejects",
            refused - rej
        )
    } else {
        format!(
            "refused: {refused}, the kernel rejected {rej}: {} reject(s) reached no load-generator request as a refusal: another client's connections to the Service (the counters count every client on the node), or a reject the client retried (each attempt counts)",
            rej - refused
        )
    });
    let (drop, timed_out) = (c.kernel_dropped, c.loadgen_timed_out as u64);
    out.push(if drop == 0 && timed_out == 0 {
        "nothing timed out, nothing dropped".to_string()
    } else if drop == timed_out {
        format!("timed out: {timed_out}, and the kernel dropped {drop}")
    } else if drop > timed_out {
        format!(
            "timed out: {timed_out}, the kernel dropped {drop}: a dropped SYN is sent again by the client's TCP (retransmissions within the request timeout), and each attempt is a new connection to the kernel; a connection whose retransmission reached a node that forwards it counted a drop and succeeded"
        )
    } else {
        format!(
            "timed out: {timed_out}, the kernel dropped {drop}: {} time-out(s) were not kproxy's drops: lost elsewhere (the LB sent them to a node that could not answer, a pod accepted and never answered, the answer came after the request timeout)",
            timed_out - drop
        )
    });
    // Connections that reached an endpoint: opened, less the refused and the timed
    // out (a refusal by a pod still reached it through a DNAT).
    let reached = (c.loadgen_connections as u64)
        .saturating_sub(timed_out)
        .saturating_sub(refused.min(rej));
    out.push(if reached == c.kernel_new {
        format!(
            "DNATed: {}, the connections the load generator opened less those timed out and rejected: every one counted",
            c.kernel_new
        )
    } else if c.kernel_new > reached {
        format!(
            "DNATed: {}, the load generator's connections that reached an endpoint: {reached}: {} more DNATs than it saw: connections of other clients, or a connection DNATed that then timed out (a pod that accepted and never answered)",
            c.kernel_new,
            c.kernel_new - reached
        )
    } else {
        format!(
            "DNATed: {}, the load generator's connections that reached an endpoint: {reached}: {} not counted: not DNATed by kproxy on these nodes (the counters leave out a DNAT to an endpoint on the node itself from outside, and ClientIP-affinity endpoints), counts lost to a flush of the ruleset (kproxy restores its last reading, not what the kernel counted after it), or a node's counters not read",
            c.kernel_new,
            reached - c.kernel_new
        )
    });
    if c.loadgen_failed_on_reused > 0 {
        out.push(format!(
            "{} request(s) failed on a reused keep-alive connection: no new connection, so no counter saw them",
            c.loadgen_failed_on_reused
        ));
    }
    if c.kernel_fallback > 0 {
        out.push(format!(
            "the terminating fallback sent {} new connection(s) to terminating endpoints (no ready endpoint qualified on that node)",
            c.kernel_fallback
        ));
    }
    out
}

/// The comparison as text lines (the text report's section).
pub fn text(c: &KernelCheck) -> String {
    let mut s = String::from(
        "  kernel counters beside the load generator (new connections during the load):\n",
    );
    let _ = writeln!(
        s,
        "    {:<10} {:>8} {:>9} {:>8} {:>9}",
        "node", "DNATed", "rejected", "dropped", "fallback"
    );
    for n in &c.nodes {
        match &n.error {
            Some(e) => {
                let _ = writeln!(s, "    {:<10} not read: {e}", n.node);
            }
            None => {
                let _ = writeln!(
                    s,
                    "    {:<10} {:>8} {:>9} {:>8} {:>9}",
                    n.node, n.new, n.rejected, n.dropped, n.fallback
                );
            }
        }
    }
    let _ = writeln!(
        s,
        "    {:<10} {:>8} {:>9} {:>8} {:>9}",
        "all nodes", c.kernel_new, c.kernel_rejected, c.kernel_dropped, c.kernel_fallback
    );
    let _ = writeln!(
        s,
        "    load generator: {} connections opened, {} refused, {} timed out",
        c.loadgen_connections, c.loadgen_refused, c.loadgen_timed_out
    );
    for n in &c.notes {
        let _ = writeln!(s, "    - {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::world::loadgen::ConnKind;

    fn rec(outcome: Outcome, reused: bool) -> RequestRecord {
        RequestRecord {
            start_ms: 0.0,
            end_ms: 1.0,
            outcome,
            conn: if reused {
                ConnKind::KeepAlive
            } else {
                ConnKind::New
            },
            pod: None,
            reused,
            conn_pod: None,
        }
    }

    fn node(name: &str, new: u64, rejected: u64, dropped: u64) -> NodeCounts {
        NodeCounts {
            node: name.into(),
            new,
            rejected,
            dropped,
            ..NodeCounts::default()
        }
    }

    fn records(
        ok: usize,
        refused: usize,
        timeout: usize,
        reused_failed: usize,
    ) -> Vec<RequestRecord> {
        let mut v = Vec::new();
        v.extend((0..ok).map(|_| rec(Outcome::Ok, false)));
        v.extend((0..refused).map(|_| rec(Outcome::Refused, false)));
        v.extend((0..timeout).map(|_| rec(Outcome::Timeout, false)));
        v.extend((0..reused_failed).map(|_| rec(Outcome::Reset, true)));
        v
    }

    #[test]
    fn sums_the_nodes_and_counts_only_requests_that_opened_a_connection() {
        let c = check(
            vec![node("node-1", 50, 2, 0), node("node-2", 40, 1, 3)],
            &records(88, 3, 2, 4),
        );
        assert_eq!(
            (c.kernel_new, c.kernel_rejected, c.kernel_dropped),
            (90, 3, 3)
        );
        assert_eq!(
            (
                c.loadgen_connections,
                c.loadgen_refused,
                c.loadgen_timed_out,
                c.loadgen_failed_on_reused
            ),
            (93, 3, 2, 4)
        );
        assert!(
            c.notes[0].contains("every refusal was kproxy's reject"),
            "{:?}",
            c.notes
        );
        assert!(c.notes[1].contains("retransmissions"), "{:?}", c.notes);
        // 93 opened, 2 timed out, 3 rejected: 88 reached an endpoint; 90 DNATed.
        assert!(c.notes[2].contains("2 more DNATs"), "{:?}", c.notes);
        assert!(
            c.notes[3].starts_with("4 request(s) failed on a reused"),
            "{:?}",
            c.notes
        );
    }

    /// The counts of a real run (`kproxy lab rollout --compare --time-scale 0.15`, the
    /// pre-1.26 behaviour, 2026-11-28): 75 time-outs were 150 drops (each SYN sent
    /// twice within the request timeout), and the kernel's DNATs are exactly the
    /// connections that did not time out.
    #[test]
    fn a_recorded_pre_126_run_agrees_to_the_unit() {
        let c = check(
            vec![
                node("node-1", 468, 0, 34),
                node("node-2", 412, 0, 70),
                node("node-3", 451, 0, 46),
            ],
            &records(1331, 0, 75, 0),
        );
        assert_eq!((c.kernel_new, c.kernel_dropped), (1331, 150));
        assert_eq!(c.notes[0], "nothing refused, nothing rejected");
        assert!(
            c.notes[1]
                .starts_with("timed out: 75, the kernel dropped 150: a dropped SYN is sent again"),
            "{:?}",
            c.notes
        );
        assert!(c.notes[2].ends_with("every one counted"), "{:?}", c.notes);
    }

    /// Each way the two counts differ gets its cause.
    #[test]
    fn each_difference_is_named() {
        let table: [(u64, u64, usize, usize, &str, &str); 5] = [
            // (kernel rejected, dropped, refused, timed out, note on refusals, on time-outs)
            (
                0,
                0,
                0,
                0,
                "nothing refused, nothing rejected",
                "nothing timed out",
            ),
            (
                3,
                3,
                3,
                3,
                "every refusal was kproxy's",
                "and the kernel dropped 3",
            ),
            (
                1,
                0,
                5,
                0,
                "4 refusal(s) were not kproxy's: a pod",
                "nothing timed out",
            ),
            (
                6,
                0,
                2,
                0,
                "4 reject(s) reached no load-generator",
                "nothing timed out",
            ),
            (
                0,
                1,
                0,
                3,
                "nothing refused",
                "2 time-out(s) were not kproxy's drops",
            ),
        ];
        for (rej, drop, refused, timeout, on_refused, on_timeout) in table {
            let c = check(
                vec![node("node-1", 10, rej, drop)],
                &records(10, refused, timeout, 0),
            );
            assert!(
                c.notes[0].contains(on_refused),
                "{rej}/{refused}: {:?}",
                c.notes
            );
            assert!(
                c.notes[1].contains(on_timeout),
                "{drop}/{timeout}: {:?}",
                c.notes
            );
        }
    }

    #[test]
    fn an_unread_node_is_named_and_left_out_of_the_sums() {
        let mut bad = node("node-3", 99, 99, 99);
        bad.error = Some("kproxy top: no such table".into());
        let c = check(vec![node("node-1", 5, 1, 0), bad], &records(5, 1, 0, 0));
        assert_eq!((c.kernel_new, c.kernel_rejected), (5, 1));
        assert!(
            c.notes[0].contains("node-3 could not be read"),
            "{:?}",
            c.notes
        );
        let t = text(&c);
        assert!(t.contains("node-3     not read: kproxy top"), "{t}");
        assert!(t.contains("all nodes"), "{t}");
    }
}
