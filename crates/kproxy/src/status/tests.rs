//! The status table's decisions, by table: rows, reasons, the summary, the text.

use super::*;
use serde_json::json;

fn node(name: &str) -> NodeState {
    NodeState {
        name: name.into(),
        labels: BTreeMap::from([("kubernetes.io/os".into(), "linux".into())]),
    }
}

fn pod(name: &str, node: &str) -> PodState {
    PodState {
        name: name.into(),
        node: Some(node.into()),
        phase: "Running".into(),
        pod_ip: Some("10.0.0.1".into()),
        ready: true,
        image: Some("registry.example/kproxy:0.1.0".into()),
        deleting: false,
        created: "2026-11-29T04:00:00Z".into(),
    }
}

fn answer(code: u16, body: Value) -> Fetched {
    Fetched::Answer {
        code,
        body: body.to_string(),
    }
}

/// A truthful `/healthz` body as kproxy writes it.
fn healthz(ok: bool) -> Value {
    json!({"lastUpdated": "2026-11-29T04:59:30Z", "currentTime": "2026-11-29T05:00:00Z",
               "nodeEligible": true, "healthy": true, "status": {},
               "syncedOnce": ok, "oldestPendingChange": null, "consecutiveSyncFailures": 0,
               "kernelRules": "intact", "conntrackFull": false, "inputHeld": !ok,
               "drainSignals": [], "sourceStalledSince": null})
}

const METRICS_ON: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds 1795928340\n\
kubeproxy_sync_proxy_rules_nftables_sync_failures_total 2\n\
kproxy_frontend_conflicts 1\nkproxy_skipped_objects 0\nkproxy_dataplane_drift_repairs_total 3\n\
kproxy_kernel_interference_total{what=\"rule\"} 4\nkproxy_kernel_interference_total{what=\"table\"} 1\n\
kproxy_kernel_interference_repairs_total 5\n\
kproxy_kube_proxy_rules_present{mode=\"nftables\"} 0\nkproxy_kube_proxy_rules_present{mode=\"iptables\"} 1\n\
kproxy_kube_proxy_takeover_waiting 1\nkproxy_endpoint_warmup_holds_total 6\n\
kproxy_traffic_counters_read_seconds 0.01\n\
kproxy_service_rejected_total{namespace=\"a\",service=\"b\",port=\"p\",protocol=\"TCP\"} 7\n\
kproxy_service_rejected_total{namespace=\"a\",service=\"c\",port=\"p\",protocol=\"TCP\"} 1\n\
kproxy_service_no_local_endpoint_drops_total{namespace=\"a\",service=\"b\",port=\"p\",protocol=\"TCP\"} 9\n# EOF\n";

const METRICS_OFF: &str = "kubeproxy_sync_proxy_rules_last_timestamp_seconds 0\n\
kproxy_kernel_interference_repairs_total 0\nkproxy_endpoint_warmup_holds_total 0\n# EOF\n";

fn now() -> jiff::Timestamp {
    "2026-11-29T06:00:00Z".parse().unwrap()
}

#[test]
fn rows_table() {
    let unreachable_pod = answer(
        503,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                   "message": "error trying to reach service: dial tcp 10.0.0.1:10256: connect: connection refused"}),
    );
    let held = answer(503, healthz(false));
    let healthy = answer(200, healthz(true));
    let on = answer(200, Value::Null);
    let on = match on {
        Fetched::Answer { code, .. } => Fetched::Answer {
            code,
            body: METRICS_ON.into(),
        },
        f => f,
    };
    let off = Fetched::Answer {
        code: 200,
        body: METRICS_OFF.into(),
    };
    let p = pod("kproxy-a", "a");
    let pending = PodState {
        phase: "Pending".into(),
        pod_ip: None,
        ..pod("kproxy-b", "b")
    };
    struct Case<'a> {
        name: &'a str,
        selected: bool,
        pod: Option<&'a PodState>,
        healthz: Option<&'a Fetched>,
        metrics: Option<&'a Fetched>,
        state: Verdict,
        counted: bool,
        healthy: bool,
        reason: &'a str,
    }
    let cases = [
        Case {
            name: "healthy, counters on",
            selected: true,
            pod: Some(&p),
            healthz: Some(&healthy),
            metrics: Some(&on),
            state: Verdict::Healthy,
            counted: true,
            healthy: true,
            reason: "",
        },
        Case {
            name: "healthy, counters off",
            selected: true,
            pod: Some(&p),
            healthz: Some(&healthy),
            metrics: Some(&off),
            state: Verdict::Healthy,
            counted: true,
            healthy: true,
            reason: "",
        },
        Case {
            name: "healthy, metrics out of reach",
            selected: true,
            pod: Some(&p),
            healthz: Some(&healthy),
            metrics: Some(&unreachable_pod),
            state: Verdict::Healthy,
            counted: true,
            healthy: true,
            reason: "",
        },
        Case {
            name: "503 held",
            selected: true,
            pod: Some(&p),
            healthz: Some(&held),
            metrics: None,
            state: Verdict::Unhealthy,
            counted: true,
            healthy: false,
            reason: "no rules programmed yet (the first sync has not succeeded); start held on empty or broken input (docs/input.md)",
        },
        Case {
            name: "API server cannot reach the pod",
            selected: true,
            pod: Some(&p),
            healthz: Some(&unreachable_pod),
            metrics: None,
            state: Verdict::Unreachable,
            counted: true,
            healthy: false,
            reason: "unreachable: 503 from the API server: error trying to reach service: dial tcp 10.0.0.1:10256: connect: connection refused",
        },
        Case {
            name: "call failed",
            selected: true,
            pod: Some(&p),
            healthz: Some(&Fetched::Failed(
                "no answer within 5s (--pod-timeout)".into(),
            )),
            metrics: None,
            state: Verdict::Unreachable,
            counted: true,
            healthy: false,
            reason: "unreachable: no answer within 5s (--pod-timeout)",
        },
        Case {
            name: "no pod",
            selected: true,
            pod: None,
            healthz: None,
            metrics: None,
            state: Verdict::NoPod,
            counted: true,
            healthy: false,
            reason: "no kproxy pod on this node (its taints, the DaemonSet's tolerations or a failed scheduling)",
        },
        Case {
            name: "not selected",
            selected: false,
            pod: None,
            healthz: None,
            metrics: None,
            state: Verdict::NotSelected,
            counted: false,
            healthy: true,
            reason: "not selected by the DaemonSet's nodeSelector",
        },
        Case {
            name: "pending",
            selected: true,
            pod: Some(&pending),
            healthz: None,
            metrics: None,
            state: Verdict::PodNotRunning,
            counted: true,
            healthy: false,
            reason: "pod kproxy-b is Pending with no IP",
        },
    ];
    for c in cases {
        let r = row(&node("a"), c.selected, c.pod, c.healthz, c.metrics, now());
        assert_eq!(
            (r.state, r.counted, r.healthy, r.reasons.join("; ")),
            (c.state, c.counted, c.healthy, c.reason.to_string()),
            "{}",
            c.name
        );
    }

    // What the rows carry from the answers.
    let r = row(&node("a"), true, Some(&p), Some(&healthy), Some(&on), now());
    let m = r.metrics.clone().unwrap();
    assert_eq!(
        (
            m.sync_failures,
            m.frontend_conflicts,
            m.drift_repairs,
            m.kernel_interference,
            m.kernel_interference_repairs,
            m.endpoint_warmup_holds
        ),
        (Some(2), Some(1), Some(3), Some(5), Some(5), Some(6))
    );
    assert_eq!(m.kube_proxy_rules, Some(vec!["iptables".to_string()]));
    assert_eq!(m.kube_proxy_takeover_waiting, Some(true));
    assert_eq!(
        (m.traffic_counters, m.rejected, m.no_local_endpoint_drops),
        (true, Some(8), Some(9))
    );
    // The metric's time (04:59:00), aged on the node's clock (currentTime 05:00:00),
    // not this machine's (06:00).
    assert_eq!(r.last_sync.as_deref(), Some("2026-11-29T04:59:00Z"));
    assert_eq!(r.last_sync_age_seconds, Some(60.0));
    assert_eq!(
        (r.healthz, r.kernel_rules.as_deref(), r.input_held),
        (Some(200), Some("intact"), Some(false))
    );

    let r = row(
        &node("a"),
        true,
        Some(&p),
        Some(&healthy),
        Some(&off),
        now(),
    );
    let m = r.metrics.clone().unwrap();
    assert_eq!(
        (m.traffic_counters, m.rejected, m.no_local_endpoint_drops),
        (false, None, None)
    );
    assert_eq!(
        m.kernel_interference,
        Some(0),
        "repairs exported, no interference yet"
    );
    assert_eq!(m.kube_proxy_rules, None, "not exported");
    // Metric 0 (never): the last sync from truthful /healthz's lastUpdated.
    assert_eq!(r.last_sync_age_seconds, Some(30.0));

    let r = row(
        &node("a"),
        true,
        Some(&p),
        Some(&healthy),
        Some(&unreachable_pod),
        now(),
    );
    assert!(r.metrics.is_none());
    assert!(r.metrics_error.unwrap().contains("connection refused"));
    assert!(reached(&healthy) && reached(&held));
    assert!(!reached(&unreachable_pod) && !reached(&Fetched::Failed("x".into())));

    let r = row(&node("a"), true, Some(&p), Some(&held), None, now());
    assert_eq!(r.last_sync, None, "never synced");
}

#[test]
fn healthz_reasons_table() {
    let body = |v: Value| serde_json::from_value::<HealthzBody>(v).unwrap();
    for (code, b, want) in [
        (200, json!({"healthy": true, "syncedOnce": true}), vec![]),
        (
            200,
            json!({"healthy": true, "syncedOnce": true, "sourceStalledSince": "T"}),
            vec!["hears nothing from the API server since T"],
        ),
        // kube-proxy's (or kproxy's upstream-semantics) body: said, still healthy.
        (
            200,
            json!({"healthy": true, "nodeEligible": true, "status": {}}),
            vec![
                "an upstream-style /healthz answer (none of kproxy's fields): kproxy with --health-check-semantics upstream, or another process on the port (kube-proxy still running?)",
            ],
        ),
        (
            503,
            json!({"healthy": false, "oldestPendingChange": "T", "consecutiveSyncFailures": 3}),
            vec![
                "stale: a change has waited longer than 2 × syncPeriod (pending since T), 3 failed syncs in a row",
            ],
        ),
        (
            503,
            json!({"healthy": true, "nodeEligible": false, "drainSignals": ["autoscalerTaint"]}),
            vec!["the node is draining (autoscalerTaint)"],
        ),
        (
            503,
            json!({"healthy": true, "nodeEligible": false}),
            vec![
                "the node is draining",
                "an upstream-style /healthz answer (none of kproxy's fields): kproxy with --health-check-semantics upstream, or another process on the port (kube-proxy still running?)",
            ],
        ),
        (
            503,
            json!({"healthy": true, "kernelRules": "tablesMissing"}),
            vec!["kproxy's tables are missing (removed by another process; repair pending)"],
        ),
        (
            503,
            json!({"healthy": true, "conntrackFull": true}),
            vec!["the conntrack table is full"],
        ),
        (
            503,
            json!({}),
            vec![
                "/healthz answered 503",
                "an upstream-style /healthz answer (none of kproxy's fields): kproxy with --health-check-semantics upstream, or another process on the port (kube-proxy still running?)",
            ],
        ),
    ] {
        assert_eq!(healthz_reasons(code, &body(b.clone())), want, "{b}");
    }
}

#[test]
fn rollout_table() {
    let ds = |generation, observed, desired, updated, available| DaemonSetState {
        generation,
        observed_generation: observed,
        desired,
        updated,
        ready: available,
        available,
        update_strategy: "RollingUpdate".into(),
        images: vec!["kproxy:0.2.0".into()],
        ..Default::default()
    };
    for (state, complete, message) in [
        (Some(ds(2, 2, 3, 3, 3)), true, "complete"),
        (
            Some(ds(3, 2, 3, 3, 3)),
            false,
            "in progress: the DaemonSet controller has not yet seen the newest spec",
        ),
        (
            Some(ds(2, 2, 3, 1, 3)),
            false,
            "in progress: 1 of 3 pods updated",
        ),
        (
            Some(ds(2, 2, 3, 3, 2)),
            false,
            "in progress: 2 of 3 updated pods available",
        ),
        (
            Some(DaemonSetState {
                update_strategy: "OnDelete".into(),
                ..ds(1, 1, 1, 1, 1)
            }),
            true,
            "complete (updateStrategy OnDelete: pods are replaced only when deleted)",
        ),
        (
            None,
            false,
            "no DaemonSet kube-system/kproxy (is kproxy installed? --namespace and --daemonset name another)",
        ),
    ] {
        let r = rollout("kube-system", "kproxy", state.as_ref(), BTreeMap::new());
        assert_eq!((r.complete, r.message.as_str()), (complete, message));
        assert_eq!(r.found, state.is_some());
    }
    let from = DaemonSetState::from_json(&json!({
            "metadata": {"generation": 4},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "kproxy"}},
                     "template": {"spec": {"nodeSelector": {"kubernetes.io/os": "linux"},
                                           "containers": [{"name": "kproxy", "image": "kproxy:0.2.0"}]}}},
            "status": {"observedGeneration": 4, "desiredNumberScheduled": 2, "updatedNumberScheduled": 2,
                       "numberReady": 1, "numberAvailable": 1}}));
    assert_eq!(
        (
            from.generation,
            from.desired,
            from.updated,
            from.ready,
            from.available,
            from.update_strategy.as_str()
        ),
        (4, 2, 2, 1, 1, "RollingUpdate")
    );
    assert_eq!(from.images, ["kproxy:0.2.0"]);
    assert!(selected(&node("a"), Some(&from)));
    assert!(!selected(
        &NodeState {
            name: "w".into(),
            labels: BTreeMap::new()
        },
        Some(&from)
    ));
    assert!(selected(&NodeState::default(), None));
}

#[test]
fn summary_table() {
    let done = rollout(
        "kube-system",
        "kproxy",
        Some(&DaemonSetState {
            desired: 2,
            updated: 2,
            available: 2,
            update_strategy: "RollingUpdate".into(),
            ..Default::default()
        }),
        BTreeMap::new(),
    );
    let moving = rollout(
        "kube-system",
        "kproxy",
        Some(&DaemonSetState {
            desired: 2,
            updated: 1,
            available: 2,
            update_strategy: "RollingUpdate".into(),
            ..Default::default()
        }),
        BTreeMap::new(),
    );
    let p = pod("kproxy-a", "a");
    let ok = row(
        &node("a"),
        true,
        Some(&p),
        Some(&answer(200, healthz(true))),
        None,
        now(),
    );
    let bad = row(
        &node("b"),
        true,
        Some(&p),
        Some(&Fetched::Failed("x".into())),
        None,
        now(),
    );
    let none = row(&node("c"), true, None, None, None, now());
    let windows = row(&node("w"), false, None, None, None, now());
    for (rows, r, ok_, line) in [
        (
            vec![ok.clone(), ok.clone()],
            &done,
            true,
            "2/2 nodes healthy, rollout complete",
        ),
        (
            vec![ok.clone(), ok.clone(), windows.clone()],
            &done,
            true,
            "2/2 nodes healthy, rollout complete",
        ),
        (
            vec![ok.clone(), ok.clone()],
            &moving,
            false,
            "2/2 nodes healthy, rollout in progress: 1 of 2 pods updated",
        ),
        (
            vec![ok.clone(), bad.clone(), none.clone()],
            &done,
            false,
            "1/3 nodes healthy (1 unreachable, 1 without a kproxy pod), rollout complete",
        ),
        (vec![], &done, true, "0/0 nodes healthy, rollout complete"),
    ] {
        let s = summary(&rows, r);
        assert_eq!((s.ok, s.line.as_str()), (ok_, line));
    }
    // The table ends with the summary and shows every node, the missing pod too.
    let report = Report {
        daemon_set: done.clone(),
        nodes: vec![ok.clone(), bad, none, windows],
        summary: summary(&[], &done),
    };
    let t = table(&report);
    assert!(t.contains("no kproxy pod"), "{t}");
    assert!(t.contains("unreachable: x"), "{t}");
    assert!(t.ends_with("0/0 nodes healthy, rollout complete\n"), "{t}");
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["nodes"][2]["state"], "noPod");
    assert_eq!(json["nodes"][0]["lastSyncAgeSeconds"], 30.0);
    assert_eq!(json["daemonSet"]["complete"], true);
}

#[test]
fn the_pod_of_a_node_is_the_newest_not_terminating() {
    let old = PodState {
        created: "2026-11-29T01:00:00Z".into(),
        ..pod("old", "a")
    };
    let new = PodState {
        created: "2026-11-29T02:00:00Z".into(),
        ..pod("new", "a")
    };
    let going = PodState {
        deleting: true,
        created: "2026-11-29T03:00:00Z".into(),
        ..pod("going", "a")
    };
    assert_eq!(pick_pod(&[&old, &going, &new]).unwrap().name, "new");
    assert_eq!(pick_pod(&[&going]).unwrap().name, "going");
    assert_eq!(pick_pod(&[]), None);
    assert_eq!(age(59.9), "59s");
    assert_eq!(age(192.0), "3m12s");
    assert_eq!(age(18_120.0), "5h2m");
    assert_eq!(age(356_400.0), "4d3h");
}
