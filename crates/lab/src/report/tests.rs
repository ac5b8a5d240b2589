//! The report's tables: bursts, outages, causes, anomalies and pool sizes from
//! made-up runs.

use super::causes::{explain_burst, pool_contains};
use super::text::render as render_text;
use super::*;
use crate::world::loadgen::ConnKind;

fn rec(start: f64, outcome: Outcome) -> RequestRecord {
    RequestRecord {
        start_ms: start,
        end_ms: start + 1.0,
        outcome,
        conn: ConnKind::New,
        pod: None,
        reused: false,
        conn_pod: None,
    }
}

#[test]
fn bursts_split_on_gaps() {
    let rs = vec![
        rec(0.0, Outcome::Ok),
        rec(10.0, Outcome::Timeout),
        rec(20.0, Outcome::Timeout),
        rec(500.0, Outcome::Refused),
    ];
    // scale 0.1, gap 1 s nominal = 100 ms real
    let b = bursts_of(&rs, 0.1, 1.0);
    assert_eq!(b.len(), 2);
    assert_eq!(b[0].2.len(), 2);
    assert_eq!(b[1].2.len(), 1);
}

/// A three-node run at time scale 0.1 with the gke health check (3 s interval:
/// 300 ms real) and `events`.
fn three_nodes(events: Vec<Event>, records: Vec<RequestRecord>) -> RunResult {
    RunResult {
        control_plane: crate::scenario::run::ControlPlaneKind::Emulated,
        behaviour: crate::scenario::run::Behaviour::Kproxy,
        run: 0,
        time_scale: 0.1,
        nodes: vec!["node-1".into(), "node-2".into(), "node-3".into()],
        health_check: crate::scenario::balancer::LbPreset::Gke
            .health_check()
            .unwrap(),
        records,
        events,
        load_start_ms: 0.0,
        rollout_start_ms: 0.0,
        rollout_end_ms: 6000.0,
        load_end_ms: 6000.0,
        drain: None,
        kernel: Vec::new(),
    }
}

fn answer(t_ms: f64, node: &str, passes: bool) -> Event {
    Event {
        t_ms,
        kind: EventKind::HealthAnswer,
        node: Some(node.into()),
        pod: None,
        detail: if passes {
            "health check passes"
        } else {
            "health check fails"
        }
        .into(),
    }
}

/// Every node failing in one probe round after passing is an anomaly; every node
/// failing its first probes (nothing ready yet), or one node failing, is not.
#[test]
fn all_nodes_failing_one_round_after_passing_is_an_anomaly() {
    let nodes = ["node-1", "node-2", "node-3"];
    let mut events: Vec<Event> = nodes.iter().map(|n| answer(10.0, n, false)).collect();
    events.extend(nodes.iter().map(|n| answer(400.0, n, true)));
    // One node fails alone: a node's own story, not an anomaly.
    events.push(answer(1000.0, "node-2", false));
    events.push(answer(1300.0, "node-2", true));
    // All three fail in the same round (answers recorded a few ms apart).
    events.extend(
        nodes
            .iter()
            .enumerate()
            .map(|(i, n)| answer(2000.0 + i as f64 * 20.0, n, false)),
    );
    let got = anomalies(&three_nodes(events, vec![]));
    assert_eq!(got.len(), 1, "{got:?}");
    assert!((got[0].at_s - 20.0).abs() < 1e-9, "{got:?}");
    assert!(got[0].what.contains("all 3 nodes"), "{got:?}");
    assert!(got[0].what.contains("150 ms real"), "{got:?}");
}

/// The lab's own lateness (a preStop longer than configured) is an anomaly, and a
/// burst beside it names it in its cause.
#[test]
fn a_late_lab_is_an_anomaly_named_in_the_burst_beside_it() {
    let late = Event {
        t_ms: 3000.0,
        kind: EventKind::LabLate,
        node: Some("node-1".into()),
        pod: Some("web-r1-1".into()),
        detail: "preStop lasted 21.0 s, 10.0 s configured: the lab's timer fired 11.0 s late"
            .into(),
    };
    let r = three_nodes(
        vec![late],
        vec![rec(0.0, Outcome::Ok), rec(3100.0, Outcome::Timeout)],
    );
    let m = summarize(&r);
    assert_eq!(m.anomalies.len(), 1, "{:?}", m.anomalies);
    assert!(
        m.anomalies[0]
            .what
            .starts_with("web-r1-1 on node-1: preStop lasted 21.0 s"),
        "{:?}",
        m.anomalies
    );
    assert_eq!(m.bursts.len(), 1);
    assert!(
        m.bursts[0]
            .cause
            .contains("anomaly then: at 30.00 s web-r1-1"),
        "{}",
        m.bursts[0].cause
    );
    let text = render_text(std::slice::from_ref(&r), false);
    assert!(text.contains("anomaly at   30.00s: web-r1-1"), "{text}");
}

#[test]
fn longest_outage_ends_at_a_success() {
    let rs = vec![
        rec(0.0, Outcome::Timeout),
        rec(100.0, Outcome::Timeout),
        rec(150.0, Outcome::Ok),
        rec(200.0, Outcome::Reset),
    ];
    assert_eq!(longest_outage_ms(&rs), 100.0);
}

#[test]
fn keep_alive_failures_after_a_pod_exit_are_explained() {
    use crate::report::RunResult;
    use crate::scenario::run::Behaviour;
    let mut failed = rec(1000.0, Outcome::Reset);
    failed.conn = ConnKind::KeepAlive;
    failed.conn_pod = Some("web-r1-1".into());
    let r = RunResult {
        control_plane: crate::scenario::run::ControlPlaneKind::Emulated,
        behaviour: Behaviour::Kproxy,
        run: 0,
        time_scale: 0.1,
        nodes: vec!["node-1".into()],
        health_check: crate::scenario::balancer::LbPreset::Gke
            .health_check()
            .unwrap(),
        records: vec![rec(0.0, Outcome::Ok), failed.clone()],
        events: vec![
            Event {
                t_ms: 1.0,
                kind: EventKind::PodCreated,
                node: Some("node-1".into()),
                pod: Some("web-r2-1".into()),
                detail: String::new(),
            },
            Event {
                t_ms: 2.0,
                kind: EventKind::PodReady,
                node: Some("node-1".into()),
                pod: Some("web-r2-1".into()),
                detail: String::new(),
            },
            Event {
                t_ms: 1001.0,
                kind: EventKind::PodExited,
                node: Some("node-1".into()),
                pod: Some("web-r1-1".into()),
                detail: "process exited".into(),
            },
        ],
        load_start_ms: 0.0,
        rollout_start_ms: 0.0,
        rollout_end_ms: 2000.0,
        load_end_ms: 2000.0,
        drain: None,
        kernel: Vec::new(),
    };
    let cause = explain_burst(&r, 1000.0, 1000.0, &[&failed]);
    assert!(
        cause.contains("keep-alive connections to web-r1-1"),
        "{cause}"
    );
}

/// The node-drain row's causes: new connections to a deleted node the LB still had
/// in its pool (and whether /healthz had failed since the taint), and requests on
/// keep-alive connections established through it.
#[test]
fn drain_bursts_name_the_deleted_node_and_the_health_story() {
    use crate::report::RunResult;
    use crate::scenario::run::{Behaviour, DrainBy, NodeDrain};
    let ev = |t_ms: f64, kind: EventKind, node: Option<&str>, detail: &str| Event {
        t_ms,
        kind,
        node: node.map(Into::into),
        pod: None,
        detail: detail.into(),
    };
    let mut kept = rec(4010.0, Outcome::Timeout);
    kept.conn = ConnKind::KeepAlive;
    kept.reused = true;
    let new = rec(4050.0, Outcome::Timeout);
    let all = "new connections to node-1, node-2, node-3";
    let without = "new connections to node-1, node-3";
    let run = |events: Vec<Event>| RunResult {
        control_plane: crate::scenario::run::ControlPlaneKind::Emulated,
        behaviour: Behaviour::Pre126,
        run: 0,
        time_scale: 0.1,
        nodes: vec!["node-1".into(), "node-2".into(), "node-3".into()],
        health_check: crate::scenario::balancer::LbPreset::Gke
            .health_check()
            .unwrap(),
        records: vec![kept.clone(), new.clone()],
        events,
        load_start_ms: 0.0,
        rollout_start_ms: 1000.0,
        rollout_end_ms: 5000.0,
        load_end_ms: 6000.0,
        drain: Some(NodeDrain {
            node: 2,
            delete_after_s: 3.0,
            by: DrainBy::AutoscalerTaint,
        }),
        kernel: Vec::new(),
    };
    // pre-1.26 (no KEP-3836): /healthz kept passing until the node vanished; one probe
    // that got no answer in time (a loaded machine) is no 503.
    let r = run(vec![
        ev(10.0, EventKind::LbPool, None, all),
        ev(1000.0, EventKind::NodeTainted, Some("node-2"), ""),
        ev(
            2000.0,
            EventKind::HealthAnswer,
            Some("node-2"),
            "health check fails (no answer)",
        ),
        ev(
            2300.0,
            EventKind::HealthAnswer,
            Some("node-2"),
            "health check passes",
        ),
        ev(4000.0, EventKind::NodeDeleted, Some("node-2"), ""),
        ev(
            4300.0,
            EventKind::HealthAnswer,
            Some("node-2"),
            "health check fails",
        ),
        ev(4600.0, EventKind::LbPool, None, without),
    ]);
    let cause = explain_burst(&r, 4010.0, 4050.0, &[&kept, &new]);
    assert!(cause.contains("node-2 was deleted at 40.0 s"), "{cause}");
    assert!(
        cause.contains("until it took node-2 out at 46.0 s"),
        "{cause}"
    );
    assert!(
        cause.contains("kept answering 200 for the 30.0 s"),
        "{cause}"
    );
    assert!(
        cause.contains("1 request(s) on keep-alive connections"),
        "{cause}"
    );
    assert!(!cause.contains("had no pod"), "no eTP-Local cause: {cause}");
    // KEP-3836 and a node deleted within the LB's detection window.
    let r = run(vec![
        ev(10.0, EventKind::LbPool, None, all),
        ev(1000.0, EventKind::NodeTainted, Some("node-2"), ""),
        ev(
            1300.0,
            EventKind::HealthAnswer,
            Some("node-2"),
            "health check fails (answered 503)",
        ),
        ev(1500.0, EventKind::NodeDeleted, Some("node-2"), ""),
        ev(1900.0, EventKind::LbPool, None, without),
    ]);
    let cause = explain_burst(&r, 1510.0, 1550.0, &[&new]);
    assert!(
        cause.contains("answered 503 (the ToBeDeletedByClusterAutoscaler taint) from 13.0 s"),
        "{cause}"
    );
    assert!(cause.contains("deleted 5.0 s after it"), "{cause}");
    // A burst well before the deletion is not the deletion's.
    let cause = explain_burst(&r, 100.0, 120.0, &[&new]);
    assert!(!cause.contains("was deleted"), "{cause}");
}

/// A burst on a node whose last pod's termination the EndpointSlice controller never
/// published is the controller's; one in a flush's window is the flush's.
#[test]
fn unpublished_terminations_and_flushes_are_named() {
    use crate::report::RunResult;
    use crate::scenario::run::Behaviour;
    let ev =
        |t_ms: f64, kind: EventKind, node: Option<&str>, pod: Option<&str>, detail: &str| Event {
            t_ms,
            kind,
            node: node.map(Into::into),
            pod: pod.map(Into::into),
            detail: detail.into(),
        };
    let new = rec(1500.0, Outcome::Timeout);
    let run = |events: Vec<Event>| RunResult {
        control_plane: crate::scenario::run::ControlPlaneKind::K8sLab,
        behaviour: Behaviour::Kproxy,
        run: 0,
        time_scale: 0.1,
        nodes: vec!["node-1".into(), "node-2".into()],
        health_check: crate::scenario::balancer::LbPreset::Gke
            .health_check()
            .unwrap(),
        records: vec![new.clone()],
        events,
        load_start_ms: 0.0,
        rollout_start_ms: 100.0,
        rollout_end_ms: 3000.0,
        load_end_ms: 3000.0,
        drain: None,
        kernel: Vec::new(),
    };
    let pod = |t: f64, kind: EventKind| ev(t, kind, Some("node-2"), Some("web-1"), "");
    let pods = vec![
        pod(10.0, EventKind::PodCreated),
        pod(20.0, EventKind::PodReady),
        ev(
            30.0,
            EventKind::SlicePublished,
            None,
            None,
            "web-1@node-2:RS-",
        ),
        pod(1000.0, EventKind::PodTerminating),
        pod(1400.0, EventKind::PodSigterm),
    ];
    let cause = explain_burst(&run(pods.clone()), 1500.0, 1500.0, &[&new]);
    assert!(
        cause.contains("no EndpointSlice change had shown web-1 terminating"),
        "{cause}"
    );
    let mut published = pods.clone();
    published.push(ev(
        1010.0,
        EventKind::SlicePublished,
        None,
        None,
        "web-1@node-2:-ST",
    ));
    let cause = explain_burst(&run(published), 1500.0, 1500.0, &[&new]);
    assert!(!cause.contains("no EndpointSlice change"), "{cause}");
    assert!(cause.contains("preStop ended"), "{cause}");

    let mut flushed = pods;
    flushed.extend([
        ev(
            1010.0,
            EventKind::SlicePublished,
            None,
            None,
            "web-1@node-2:-ST",
        ),
        ev(
            1490.0,
            EventKind::RulesetFlushed,
            Some("node-2"),
            None,
            "nft flush ruleset",
        ),
        ev(
            1520.0,
            EventKind::Note,
            Some("node-2"),
            None,
            "kproxy kernel_repaired {}",
        ),
    ]);
    let cause = explain_burst(&run(flushed.clone()), 1500.0, 1500.0, &[&new]);
    assert!(
        cause.contains(
            "flushed node-2's nftables ruleset at 14.90 s and kproxy restored them 30 ms after"
        ),
        "{cause}"
    );
    assert!(
        !cause.contains("preStop"),
        "the flush's node is explained by it: {cause}"
    );
    // Long after the repair, the flush is no cause.
    let cause = explain_burst(&run(flushed), 2500.0, 2500.0, &[&new]);
    assert!(!cause.contains("flushed"), "{cause}");
}

#[test]
fn pool_sizes_from_events() {
    assert_eq!(
        healthy_in_pool("new connections to node-1, node-3"),
        Some(2)
    );
    assert_eq!(
        healthy_in_pool("no healthy node: new connections to all (node-1, node-2)"),
        Some(0)
    );
    assert_eq!(healthy_in_pool("pool update failed: x"), None);
}

#[test]
fn pool_detail_parsing() {
    assert!(pool_contains("new connections to node-1, node-3", "node-3"));
    assert!(!pool_contains(
        "new connections to node-1, node-3",
        "node-2"
    ));
    assert!(!pool_contains("new connections to node-10", "node-1"));
}

/// Two bursts in the same state of the cluster get the same words; the second says it
/// is the first's cause again, and how many requests succeeded between them.
#[test]
fn bursts_with_one_cause_are_told_apart() {
    let r = three_nodes(
        vec![],
        vec![
            rec(1000.0, Outcome::Timeout),
            rec(1200.0, Outcome::Ok),
            rec(1300.0, Outcome::Ok),
            rec(2000.0, Outcome::Timeout),
        ],
    );
    let m = summarize(&r);
    assert_eq!(m.bursts.len(), 2, "{:?}", m.bursts);
    assert!(
        !m.bursts[0].cause.contains("the same cause as"),
        "{}",
        m.bursts[0].cause
    );
    assert_ne!(m.bursts[0].cause, m.bursts[1].cause);
    assert!(
        m.bursts[1].cause.ends_with(
            " (the same cause as the burst at 10.00–10.00 s, still holding: 2 request(s) succeeded between the two)"
        ),
        "{}",
        m.bursts[1].cause
    );
}

/// The rollout's JSON keeps its keys and adds `kernel_counters` when the run read the
/// nodes' counters; the text and HTML reports show the same section.
#[test]
fn the_kernel_counters_are_in_every_report_only_when_read() {
    let records = vec![rec(0.0, Outcome::Ok), rec(10.0, Outcome::Timeout)];
    let mut r = three_nodes(vec![], records);
    let cfg = crate::scenario::rollout::RolloutConfig::default();
    let without = json::render(std::slice::from_ref(&r), &cfg, None);
    assert!(without["runs"][0].get("kernel_counters").is_none());
    assert!(!render_text(std::slice::from_ref(&r), false).contains("kernel counters"));
    r.kernel = vec![kernel::NodeCounts {
        node: "node-1".into(),
        new: 1,
        dropped: 2,
        ..kernel::NodeCounts::default()
    }];
    let with = json::render(std::slice::from_ref(&r), &cfg, None);
    let run = &with["runs"][0];
    for key in [
        "sent",
        "failed_by_kind",
        "bursts",
        "records",
        "rollout_end_s",
    ] {
        assert!(run.get(key).is_some(), "{key} kept: {run}");
    }
    let k = &run["kernel_counters"];
    assert_eq!(k["nodes"][0]["dropped"], 2, "{k}");
    assert_eq!(k["loadgen_timed_out"], 1, "{k}");
    assert!(
        k["notes"][1].as_str().unwrap().contains("retransmissions"),
        "{k}"
    );
    let text = render_text(std::slice::from_ref(&r), false);
    assert!(
        text.contains("kernel counters beside the load generator"),
        "{text}"
    );
    let page = html::render("t", "i", std::slice::from_ref(&r), &[]);
    assert!(page.contains("Kernel counters beside the load generator"));
}
