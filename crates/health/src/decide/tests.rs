use super::*;

#[test]
fn bind_failures_are_classified_by_the_kernel_error() {
    use std::io::{Error, ErrorKind};
    for (e, want, label) in [
        (
            Error::from(ErrorKind::AddrInUse),
            BindFailure::PortInUse,
            "port_in_use",
        ),
        (
            Error::from(ErrorKind::AddrNotAvailable),
            BindFailure::AddressAbsent,
            "address_absent",
        ),
        (
            Error::from_raw_os_error(libc::EACCES),
            BindFailure::Other(Error::from_raw_os_error(libc::EACCES).to_string()),
            "other",
        ),
    ] {
        let got = BindFailure::of(&e);
        assert_eq!(got, want);
        assert_eq!(got.label(), label);
    }
}

#[test]
fn a_view_moved_by_plan_updates_equals_one_built_from_the_whole_plan() {
    use kproxy_core::synthetic::{self, Spec};
    let spec = Spec {
        nodes: 2,
        etp_local_every: 3,
        ..Spec::new(60, 4)
    };
    let mut state = synthetic::cluster(&spec);
    let mut planner = kproxy_core::Planner::new(synthetic::node_name(0), Default::default());
    let mut view = None;
    let update = planner.update(&mut state);
    follow(&mut view, planner.plan(), &update);
    let rebuilt = |plan: &NodePlan| {
        let mut v = None;
        follow(&mut v, plan, &PlanUpdate::WHOLE);
        v
    };
    assert_eq!(view, rebuilt(planner.plan()));
    assert_eq!(view.as_ref().map(|v| v.services.len()), Some(20));
    // Endpoints change, a health-checked Service goes, another loses its eTP Local,
    // a new one comes.
    for i in (0..30).step_by(2) {
        state.upsert_slice(synthetic::slice(&spec, i, 1));
    }
    state.delete_service(&synthetic::service(&spec, 3).name);
    let mut cluster_policy = synthetic::service(&spec, 6);
    cluster_policy.external_traffic_policy = kproxy_core::model::TrafficPolicy::Cluster;
    state.upsert_service(cluster_policy);
    state.upsert_service(synthetic::service(&spec, 60));
    let update = planner.update(&mut state);
    assert!(!update.node && !update.services.is_empty());
    follow(&mut view, planner.plan(), &update);
    assert_eq!(view, rebuilt(planner.plan()));
}

const T: Duration = Duration::from_secs(60);

fn at(s: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000 + s)
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Queued,
    Updated,
    Failed,
}

/// A timeline: events at times, then probes at a time with the expected statuses
/// (healthz upstream, healthz truthful, livez upstream, livez truthful).
struct Case {
    name: &'static str,
    events: &'static [(u64, Ev)],
    eligible: bool,
    probe_at: u64,
    want: [u16; 4],
}

#[test]
fn proxy_health_timelines() {
    use Ev::*;
    let cases = [
        Case {
            name: "fresh start, nothing queued",
            events: &[],
            eligible: true,
            probe_at: 1000,
            want: [200, 503, 200, 200],
        },
        Case {
            name: "start, first plan queued, young",
            events: &[(10, Queued)],
            eligible: true,
            probe_at: 69,
            want: [200, 503, 200, 200],
        },
        Case {
            name: "start, first plan never applied, just stale",
            events: &[(10, Queued)],
            eligible: true,
            probe_at: 70,
            want: [503, 503, 503, 503],
        },
        Case {
            name: "applied",
            events: &[(10, Queued), (11, Updated)],
            eligible: true,
            probe_at: 5000,
            want: [200, 200, 200, 200],
        },
        Case {
            name: "applied, new change pending 59s",
            events: &[(10, Queued), (11, Updated), (100, Queued)],
            eligible: true,
            probe_at: 159,
            want: [200, 200, 200, 200],
        },
        Case {
            name: "applied, new change pending 60s",
            events: &[(10, Queued), (11, Updated), (100, Queued)],
            eligible: true,
            probe_at: 160,
            want: [503, 503, 503, 503],
        },
        Case {
            name: "later queued does not reset the oldest",
            events: &[(0, Updated), (100, Queued), (150, Queued)],
            eligible: true,
            probe_at: 165,
            want: [503, 503, 503, 503],
        },
        Case {
            name: "update clears pending",
            events: &[(0, Updated), (100, Queued), (150, Queued), (170, Updated)],
            eligible: true,
            probe_at: 171,
            want: [200, 200, 200, 200],
        },
        Case {
            name: "node not eligible: healthz 503, livez 200",
            events: &[(0, Updated)],
            eligible: false,
            probe_at: 10,
            want: [503, 503, 200, 200],
        },
        Case {
            name: "failing syncs while queued: stale after timeout",
            events: &[(0, Updated), (10, Queued), (11, Failed), (40, Failed)],
            eligible: true,
            probe_at: 70,
            want: [503, 503, 503, 503],
        },
        Case {
            name: "failing syncs while queued: young",
            events: &[(0, Updated), (10, Queued), (11, Failed)],
            eligible: true,
            probe_at: 69,
            want: [200, 200, 200, 200],
        },
        // A failure reported without a queued change (e.g. re-verification):
        // upstream ignores it; truthful starts the staleness clock.
        Case {
            name: "failure without queued change",
            events: &[(0, Updated), (10, Failed)],
            eligible: true,
            probe_at: 80,
            want: [200, 503, 200, 503],
        },
        Case {
            name: "clock went backwards",
            events: &[(0, Updated), (100, Queued)],
            eligible: true,
            probe_at: 50,
            want: [200, 200, 200, 200],
        },
    ];
    for c in cases {
        let mut got = [0u16; 4];
        for (i, (probe, sem)) in [
            (Probe::Healthz, Semantics::Upstream),
            (Probe::Healthz, Semantics::Truthful),
            (Probe::Livez, Semantics::Upstream),
            (Probe::Livez, Semantics::Truthful),
        ]
        .into_iter()
        .enumerate()
        {
            let mut h = ProxyHealth::new(at(0));
            for (t, ev) in c.events {
                match ev {
                    Ev::Queued => h.queued(at(*t)),
                    Ev::Updated => h.updated(at(*t)),
                    Ev::Failed => h.failed(at(*t), sem),
                }
            }
            got[i] = proxy_answer(
                sem,
                probe,
                &h,
                if c.eligible {
                    &[]
                } else {
                    &[DrainSignal::DeletionTimestamp]
                },
                &IpFamily::ALL,
                at(c.probe_at),
                T,
            )
            .status;
        }
        assert_eq!(got, c.want, "{}", c.name);
    }
}

#[test]
fn proxy_body_fields() {
    let mut h = ProxyHealth::new(at(0));
    h.updated(at(5));
    let now = at(10);
    let a = proxy_answer(
        Semantics::Upstream,
        Probe::Healthz,
        &h,
        &[],
        &[IpFamily::IPv4],
        now,
        T,
    );
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(
        v["lastUpdated"],
        rfc3339(now),
        "200 reports lastUpdated = currentTime"
    );
    assert_eq!(v["currentTime"], rfc3339(now));
    assert_eq!(v["nodeEligible"], true);
    assert_eq!(v["healthy"], true);
    assert_eq!(v["status"]["IPv4"]["lastUpdated"], rfc3339(at(5)));
    assert!(v["status"].get("IPv6").is_none());
    assert!(v.get("syncedOnce").is_none());

    let l = proxy_answer(
        Semantics::Upstream,
        Probe::Livez,
        &h,
        &[],
        &IpFamily::ALL,
        now,
        T,
    );
    let v: serde_json::Value = serde_json::from_str(&l.body).unwrap();
    assert!(v.get("nodeEligible").is_none(), "livez has no nodeEligible");
    assert_eq!(v["status"]["IPv6"]["healthy"], true);

    // 503: the real last update.
    h.queued(at(20));
    let a = proxy_answer(
        Semantics::Upstream,
        Probe::Healthz,
        &h,
        &[],
        &[IpFamily::IPv4],
        at(100),
        T,
    );
    assert_eq!(a.status, 503);
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!(v["lastUpdated"], rfc3339(at(5)));
    assert_eq!(v["healthy"], false);

    // Truthful never rewrites lastUpdated and says what is pending.
    let mut h = ProxyHealth::new(at(0));
    h.updated(at(5));
    h.queued(at(8));
    let t = proxy_answer(
        Semantics::Truthful,
        Probe::Healthz,
        &h,
        &[],
        &[IpFamily::IPv4],
        now,
        T,
    );
    assert_eq!(t.status, 200);
    let v: serde_json::Value = serde_json::from_str(&t.body).unwrap();
    assert_eq!(v["lastUpdated"], rfc3339(at(5)));
    assert_eq!(v["oldestPendingChange"], rfc3339(at(8)));
    assert_eq!(v["syncedOnce"], true);
}

/// Every drain signal and its opt-out, from the Node object through the planner to
/// the answer: `/healthz` under both semantics, `/livez`, and truthful's
/// `drainSignals`. Fails if a signal is not read, not planned, or not answered.
#[test]
fn drain_signals_table() {
    use DrainSignal::*;
    use kproxy_core::config::PlanConfig;
    use kproxy_core::model::Node;
    use kproxy_core::state::ClusterState;
    struct Case {
        name: &'static str,
        node: fn(&mut Node),
        /// `--ignore-drain-signal`.
        ignore: &'static [DrainSignal],
        /// The `KubeProxyDrainingTerminatingNodes` gate.
        gate: bool,
        /// SIGTERM with a drain period.
        shutdown: bool,
        want: &'static [DrainSignal],
    }
    let none: fn(&mut Node) = |_| {};
    let taint: fn(&mut Node) = |n| n.to_be_deleted_by_autoscaler = true;
    let deleting: fn(&mut Node) = |n| n.deleting = true;
    let deleted: fn(&mut Node) = |n| n.deleted = true;
    let draining: fn(&mut Node) = |n| n.drain_in_progress = true;
    let stopping: fn(&mut Node) = |n| n.graceful_node_shutdown_in_progress = true;
    let c = |name, node, ignore, gate, shutdown, want| Case {
        name,
        node,
        ignore,
        gate,
        shutdown,
        want,
    };
    let cases = [
        c("no signal", none, &[], true, false, &[]),
        c(
            "autoscaler taint",
            taint,
            &[],
            true,
            false,
            &[AutoscalerTaint],
        ),
        c("taint ignored", taint, &[AutoscalerTaint], true, false, &[]),
        c("taint, gate off", taint, &[], false, false, &[]),
        c(
            "deletionTimestamp",
            deleting,
            &[],
            true,
            false,
            &[DeletionTimestamp],
        ),
        c(
            "deletionTimestamp ignored",
            deleting,
            &[DeletionTimestamp],
            true,
            false,
            &[],
        ),
        c(
            "deletionTimestamp, gate off",
            deleting,
            &[],
            false,
            false,
            &[],
        ),
        c("Node deleted", deleted, &[], true, false, &[NodeDeleted]),
        c(
            "Node deleted ignored",
            deleted,
            &[NodeDeleted],
            true,
            false,
            &[],
        ),
        c("Node deleted, gate off", deleted, &[], false, false, &[]),
        c(
            "DrainInProgress",
            draining,
            &[],
            true,
            false,
            &[DrainInProgress],
        ),
        c(
            "DrainInProgress ignored",
            draining,
            &[DrainInProgress],
            true,
            false,
            &[],
        ),
        // The gate is KEP-3836's: KEP-5683's conditions have their own opt-outs.
        c(
            "DrainInProgress, gate off",
            draining,
            &[],
            false,
            false,
            &[DrainInProgress],
        ),
        c(
            "GracefulNodeShutdownInProgress",
            stopping,
            &[],
            true,
            false,
            &[GracefulNodeShutdownInProgress],
        ),
        c(
            "GracefulNodeShutdownInProgress ignored",
            stopping,
            &[GracefulNodeShutdownInProgress],
            true,
            false,
            &[],
        ),
        c(
            "GracefulNodeShutdownInProgress, gate off",
            stopping,
            &[],
            false,
            false,
            &[GracefulNodeShutdownInProgress],
        ),
        c("shutdown drain", none, &[], true, true, &[Shutdown]),
        // An ignored Node signal does not hide the shutdown drain, nor another signal.
        c(
            "shutdown, taint ignored",
            taint,
            &[AutoscalerTaint],
            true,
            true,
            &[Shutdown],
        ),
        c(
            "two signals, one ignored",
            |n| {
                n.to_be_deleted_by_autoscaler = true;
                n.drain_in_progress = true;
            },
            &[AutoscalerTaint],
            true,
            false,
            &[DrainInProgress],
        ),
        c(
            "every signal",
            |n| {
                n.to_be_deleted_by_autoscaler = true;
                n.deleting = true;
                n.deleted = true;
                n.drain_in_progress = true;
                n.graceful_node_shutdown_in_progress = true;
            },
            &[],
            true,
            true,
            &[
                AutoscalerTaint,
                DeletionTimestamp,
                NodeDeleted,
                DrainInProgress,
                GracefulNodeShutdownInProgress,
                Shutdown,
            ],
        ),
    ];
    for c in cases {
        let mut node = Node {
            name: "node-a".into(),
            ..Node::default()
        };
        (c.node)(&mut node);
        let mut state = ClusterState::new();
        state.set_node(Some(node));
        let config = PlanConfig {
            ignored_drain_signals: c.ignore.iter().copied().collect(),
            drain_terminating_nodes: c.gate,
            ..PlanConfig::default()
        };
        let plan = kproxy_core::plan(&state, "node-a", &config);
        let mut h = ProxyHealth::new(at(0));
        h.updated(at(1));
        if c.shutdown {
            h.shut_down(at(2));
        }
        let drain = drain_signals(Some(&plan), &h);
        assert_eq!(drain, c.want, "{}", c.name);
        let healthz = if c.want.is_empty() { 200 } else { 503 };
        for sem in [Semantics::Truthful, Semantics::Upstream] {
            let a = proxy_answer(sem, Probe::Healthz, &h, &drain, &[], at(3), T);
            assert_eq!(a.status, healthz, "{} {sem:?}", c.name);
            let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
            assert_eq!(v["nodeEligible"], c.want.is_empty(), "{}", c.name);
            let l = proxy_answer(sem, Probe::Livez, &h, &drain, &[], at(3), T);
            assert_eq!(l.status, 200, "{}: /livez ignores drains", c.name);
        }
        let a = proxy_answer(
            Semantics::Truthful,
            Probe::Healthz,
            &h,
            &drain,
            &[],
            at(3),
            T,
        );
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        let names: Vec<&str> = c.want.iter().map(|d| d.as_str()).collect();
        assert_eq!(v["drainSignals"], serde_json::json!(names), "{}", c.name);
    }
}

/// The shutdown drain: when SIGTERM drains and for how long, counted from the start
/// of the drain.
#[test]
fn shutdown_drain_table() {
    use ShutdownDrain::*;
    let p = Duration::from_secs(26);
    let s = Duration::from_secs;
    #[rustfmt::skip]
        /// (case, mode, period, draining since, now, drain for)
        type Row = (&'static str, ShutdownDrain, Duration, Option<u64>, u64, Option<Duration>);
    let cases: [Row; 10] = [
        (
            "signalled, no signal: kproxy's own restart",
            Signalled,
            p,
            None,
            100,
            None,
        ),
        (
            "signalled, signal just seen",
            Signalled,
            p,
            Some(100),
            100,
            Some(p),
        ),
        (
            "signalled, signal 20 s ago",
            Signalled,
            p,
            Some(80),
            100,
            Some(s(6)),
        ),
        (
            "signalled, drained longer than the period",
            Signalled,
            p,
            Some(10),
            100,
            None,
        ),
        (
            "signalled, drained exactly the period",
            Signalled,
            p,
            Some(74),
            100,
            None,
        ),
        ("always, no signal", Always, p, None, 100, Some(p)),
        (
            "always, signal 20 s ago",
            Always,
            p,
            Some(80),
            100,
            Some(s(6)),
        ),
        ("never, signal just seen", Never, p, Some(100), 100, None),
        ("period 0", Always, Duration::ZERO, None, 100, None),
        (
            "clock went backwards",
            Signalled,
            p,
            Some(200),
            100,
            Some(p),
        ),
    ];
    for (name, mode, period, since, now, want) in cases {
        assert_eq!(
            shutdown_drain(mode, period, since.map(at), at(now)),
            want,
            "{name}"
        );
    }
}

/// The drain's start: the first Node signal (or SIGTERM), kept while signals
/// change, cleared when none is left, never cleared once shutting down.
#[test]
fn draining_since_follows_the_signals() {
    let mut h = ProxyHealth::new(at(0));
    h.node_drain(&[], at(1));
    assert_eq!(h.draining_since, None);
    h.node_drain(&[DrainSignal::DrainInProgress], at(2));
    h.node_drain(
        &[DrainSignal::DrainInProgress, DrainSignal::NodeDeleted],
        at(3),
    );
    assert_eq!(h.draining_since, Some(at(2)));
    h.node_drain(&[], at(4));
    assert_eq!(h.draining_since, None, "an uncordoned node is not draining");
    h.node_drain(&[DrainSignal::AutoscalerTaint], at(5));
    h.shut_down(at(6));
    assert_eq!(
        h.draining_since,
        Some(at(5)),
        "SIGTERM keeps the drain's start"
    );
    h.node_drain(&[], at(7));
    assert_eq!(
        h.draining_since,
        Some(at(5)),
        "shutting down drains to the end"
    );
    let mut h = ProxyHealth::new(at(0));
    h.shut_down(at(8));
    assert_eq!(h.draining_since, Some(at(8)));
}

/// Truthful: from another process's change to kproxy's tables until the repair, the
/// node ports say unhealthy, and `/healthz` too while a table is missing; `/livez`
/// and upstream semantics do not look at the kernel.
#[test]
fn kernel_interference_until_repair() {
    use KernelRules::*;
    let now = at(10);
    let mut h = ProxyHealth::new(at(0));
    h.updated(at(5));
    let answers = |h: &ProxyHealth| {
        [Semantics::Truthful, Semantics::Upstream].map(|sem| {
            (
                proxy_answer(sem, Probe::Healthz, h, &[], &[IpFamily::IPv4], now, T).status,
                proxy_answer(sem, Probe::Livez, h, &[], &[IpFamily::IPv4], now, T).status,
                h.service_proxy_healthy(sem, now, T),
            )
        })
    };
    let all_well = [(200, 200, true), (200, 200, true)];
    assert_eq!(answers(&h), all_well);
    h.kernel_changed(false);
    assert_eq!(h.kernel, Altered);
    assert_eq!(answers(&h), [(200, 200, false), (200, 200, true)]);
    h.kernel_changed(true);
    assert_eq!(answers(&h), [(503, 200, false), (200, 200, true)]);
    // A later partial change does not hide the missing table.
    h.kernel_changed(false);
    assert_eq!(h.kernel, TablesMissing);
    let v: serde_json::Value = serde_json::from_str(
        &proxy_answer(Semantics::Truthful, Probe::Healthz, &h, &[], &[], now, T).body,
    )
    .unwrap();
    assert_eq!(v["kernelRules"], "tablesMissing");
    h.kernel_repaired();
    assert_eq!(answers(&h), all_well);
    // A full conntrack table: no new Service connection can be accepted.
    h.conntrack_full = true;
    assert_eq!(answers(&h), [(503, 200, false), (200, 200, true)]);
}

#[test]
fn service_answer_table() {
    let svc = ServiceName::new("a", "b");
    for (n, healthy, status) in [
        (0, true, 503),
        (1, true, 200),
        (18, true, 200),
        (7, false, 503),
        (0, false, 503),
    ] {
        let a = service_answer(&svc, n, healthy);
        assert_eq!(a.status, status, "{n} {healthy}");
        assert_eq!(a.endpoint_weight, Some(n));
        let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"service": {"namespace": "a", "name": "b"}, "localEndpoints": n, "serviceProxyHealthy": healthy})
        );
    }
    // Upstream's exact bytes.
    assert_eq!(
        service_answer(&svc, 3, true).body,
        "{\n\t\"service\": {\n\t\t\"namespace\": \"a\",\n\t\t\"name\": \"b\"\n\t},\n\t\"localEndpoints\": 3,\n\t\"serviceProxyHealthy\": true\n}"
    );
}

fn fam(family: IpFamily, ips: &[&str], npa: NodePortAddresses) -> FamilyPlan {
    FamilyPlan {
        family,
        node_ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
        node_port_addresses: npa,
        local_pods: kproxy_core::plan::LocalPods::None,
        service_cidrs: Vec::new(),
    }
}

#[test]
fn a_selected_node_address_absent_from_the_host_is_reported_missing() {
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let local = [LocalAddr {
        ip: ip("10.200.0.2"),
        scope_id: 0,
    }];
    let only = |ips: &[&str]| NodePortAddresses::Only(ips.iter().map(|s| ip(s)).collect());
    let families = [
        fam(
            IpFamily::IPv4,
            &["10.200.0.9"],
            only(&["10.200.0.9", "10.200.0.2"]),
        ),
        fam(IpFamily::IPv6, &[], NodePortAddresses::AllLocal),
    ];
    assert_eq!(
        missing_node_addrs(&families, &local),
        vec![ip("10.200.0.9")]
    );
    // Every selected address present: nothing missing; nothing known: nothing said.
    let present = [fam(IpFamily::IPv4, &["10.200.0.2"], only(&["10.200.0.2"]))];
    assert!(missing_node_addrs(&present, &local).is_empty());
    assert!(missing_node_addrs(&families, &[]).is_empty());
    // Match-all and CIDR selections name no address that could be missing.
    let cidrs = [fam(
        IpFamily::IPv4,
        &["10.200.0.9"],
        NodePortAddresses::Cidrs(vec!["10.0.0.0/8".parse().unwrap()]),
    )];
    assert!(missing_node_addrs(&cidrs, &local).is_empty());
}

#[test]
fn listen_addrs_table() {
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    let local = [
        LocalAddr {
            ip: ip("127.0.0.1"),
            scope_id: 0,
        },
        LocalAddr {
            ip: ip("10.200.0.2"),
            scope_id: 0,
        },
        LocalAddr {
            ip: ip("10.200.0.3"),
            scope_id: 0,
        },
        LocalAddr {
            ip: ip("fd00::2"),
            scope_id: 0,
        },
        LocalAddr {
            ip: ip("fe80::1"),
            scope_id: 7,
        },
    ];
    use NodePortAddresses::*;
    let cases: Vec<(&str, Vec<FamilyPlan>, Vec<&str>)> = vec![
        (
            "nothing known: wildcard both",
            vec![
                fam(IpFamily::IPv4, &[], AllLocal),
                fam(IpFamily::IPv6, &[], AllLocal),
            ],
            vec!["0.0.0.0:9", "[::]:9"],
        ),
        (
            "v4-only node: no v6 wildcard",
            vec![
                fam(IpFamily::IPv4, &["10.200.0.2"], AllLocal),
                fam(IpFamily::IPv6, &[], AllLocal),
            ],
            vec!["0.0.0.0:9"],
        ),
        (
            "dual-stack all",
            vec![
                fam(IpFamily::IPv4, &["10.200.0.2"], AllLocal),
                fam(IpFamily::IPv6, &["fd00::2"], AllLocal),
            ],
            vec!["0.0.0.0:9", "[::]:9"],
        ),
        (
            "primary only",
            vec![
                fam(
                    IpFamily::IPv4,
                    &["10.200.0.2"],
                    Only(vec![ip("10.200.0.2")]),
                ),
                fam(IpFamily::IPv6, &[], AllLocal),
            ],
            vec!["10.200.0.2:9"],
        ),
        (
            "non-local address skipped",
            vec![
                fam(
                    IpFamily::IPv4,
                    &["10.200.0.2", "192.0.2.1"],
                    Only(vec![ip("10.200.0.2"), ip("192.0.2.1")]),
                ),
                fam(IpFamily::IPv6, &[], Only(vec![])),
            ],
            vec!["10.200.0.2:9"],
        ),
        (
            "empty selection: nothing",
            vec![
                fam(IpFamily::IPv4, &["10.200.0.2"], Only(vec![])),
                fam(IpFamily::IPv6, &[], Only(vec![])),
            ],
            vec![],
        ),
        (
            "v6 with scope",
            vec![
                fam(IpFamily::IPv4, &[], Only(vec![])),
                fam(
                    IpFamily::IPv6,
                    &["fe80::1"],
                    Only(vec![ip("fe80::1"), ip("fd00::2")]),
                ),
            ],
            vec!["[fd00::2]:9", "[fe80::1%7]:9"],
        ),
    ];
    for (name, fams, want) in cases {
        let got: Vec<String> = listen_addrs(&fams, &local, 9)
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(got, want, "{name}");
    }
}

#[test]
fn health_check_targets_table() {
    use crate::fixtures::{plan, svc};
    let ab = |ips: &[&str]| plan(&[svc("a", "b", 9376, ips)]);
    let p_a = ab(&["10.244.0.5"]);
    let p_a2 = ab(&["10.244.0.5"]);
    let p_none = ab(&[]);
    let p_ac = ab(&["10.244.0.5", "10.244.0.6"]);
    let p_c = ab(&["10.244.0.6"]);
    let p_term = plan(&[svc("a", "b", 9376, &[]).terminating("10.244.0.5")]);
    let p_moved = plan(&[svc("a", "b", 9377, &["10.244.0.5"])]);
    let empty = plan(&[]);
    // (name, computed, applied, upstream count, truthful count); None = no server.
    type P<'a> = Option<&'a std::sync::Arc<NodePlan>>;
    type Case<'a> = (&'a str, P<'a>, P<'a>, Option<u32>, Option<u32>);
    let cases: Vec<Case> = vec![
        (
            "nothing applied yet: no server",
            Some(&p_a),
            None,
            None,
            None,
        ),
        ("steady state", Some(&p_a), Some(&p_a), Some(1), Some(1)),
        (
            "steady state, equal but not the same Arc",
            Some(&p_a2),
            Some(&p_a),
            Some(1),
            Some(1),
        ),
        (
            "new endpoint computed, not applied",
            Some(&p_ac),
            Some(&p_a),
            Some(1),
            Some(1),
        ),
        (
            "first endpoint computed, not applied",
            Some(&p_a),
            Some(&p_none),
            Some(0),
            Some(0),
        ),
        (
            "endpoint gone, not applied yet",
            Some(&p_none),
            Some(&p_a),
            Some(1),
            Some(0),
        ),
        (
            "endpoint terminating, not applied yet",
            Some(&p_term),
            Some(&p_a),
            Some(1),
            Some(0),
        ),
        (
            "pod replaced on the node, not applied yet",
            Some(&p_c),
            Some(&p_a),
            Some(1),
            Some(0),
        ),
        (
            "one of two gone, not applied yet",
            Some(&p_c),
            Some(&p_ac),
            Some(2),
            Some(1),
        ),
        (
            "service deleted, not applied yet",
            Some(&empty),
            Some(&p_a),
            Some(1),
            Some(0),
        ),
        (
            "port moved, not applied yet: old port stays",
            Some(&p_moved),
            Some(&p_a),
            Some(1),
            Some(1),
        ),
        (
            "service deleted and applied: no server",
            Some(&empty),
            Some(&empty),
            None,
            None,
        ),
    ];
    let name = ServiceName::new("a", "b");
    for (what, computed, applied, up, tr) in cases {
        for (sem, want) in [(Semantics::Upstream, up), (Semantics::Truthful, tr)] {
            let got = health_check_targets(sem, computed.map(|p| &**p), applied.map(|p| &**p));
            let got_n = got.get(&name).map(|t| t.local_endpoints);
            assert_eq!(got_n, want, "{what} ({sem:?})");
            // One Service's target, as the reconciler visits changed Services.
            let one =
                health_check_target(sem, computed.map(|p| &**p), applied.map(|p| &**p), &name);
            assert_eq!(one.as_ref(), got.get(&name), "{what} ({sem:?}): one by one");
            if let (Some(t), Some(a)) = (got.get(&name), applied) {
                assert_eq!(
                    t.port,
                    a.health_checks().next().unwrap().health_check_node_port,
                    "{what}: port follows the applied plan"
                );
            }
        }
    }
}
