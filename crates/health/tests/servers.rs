//! The health servers through real sockets and HTTP, each test in its own network
//! namespace: servers follow the plans, truthful and upstream differ exactly where they
//! should, `/healthz`/`/livez` timelines with an injected clock, busy ports, selected
//! node addresses on a veth pair, metrics, shutdown.

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use common::{closed_soon, eventually, get, in_netns, ip, metric, refused, request, t0};
use kproxy_core::config::NodePortAddressesConfig;
use kproxy_core::model::ServiceName;
use kproxy_health::fixtures::{plan, plan_with, svc};
use kproxy_health::{Health, HealthConfig, ManualClock, Semantics};
use prometheus_client::registry::Registry;

const SYNC: Duration = Duration::from_secs(30);
const STALE: Duration = Duration::from_secs(60);

fn lo(port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port)
}

async fn start(semantics: Semantics, healthz: bool) -> (Health, Arc<ManualClock>, Registry) {
    let clock = ManualClock::new(t0());
    let mut registry = Registry::default();
    let cfg = HealthConfig {
        healthz_bind_address: healthz
            .then(|| SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10256)),
        semantics,
        sync_period: SYNC,
        connection_budget: None,
    };
    let h = Health::start_with_clock(cfg, &mut registry, clock.clone())
        .await
        .expect("start");
    (h, clock, registry)
}

async fn status(port: u16) -> (u16, u64) {
    let r = get(lo(port), "/").await;
    (
        r.status,
        r.json()["localEndpoints"].as_u64().unwrap_or(u64::MAX),
    )
}

#[test]
fn servers_open_and_close_with_the_applied_plan() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    for semantics in [Semantics::Upstream, Semantics::Truthful] {
        in_netns(move || async move {
            let (h, _clock, _reg) = start(semantics, false).await;
            let one = plan(&[svc("a", "b", 31001, &["10.244.0.5"])]);
            // Computed but not applied: nothing is served yet.
            h.plan_computed(&one);
            h.reconciled().await;
            assert!(
                refused(lo(31001)).await,
                "{semantics:?}: served before any plan was applied"
            );
            h.plan_applied(&one);
            h.reconciled().await;
            assert_eq!(status(31001).await, (200, 1));
            let l = &h.listening()[&ServiceName::new("a", "b")];
            assert_eq!(
                l.addrs,
                vec![
                    "0.0.0.0:31001".parse().unwrap(),
                    "[::]:31001".parse().unwrap()
                ]
            );

            // Port changed: old closes, new opens.
            let moved = plan(&[svc("a", "b", 31002, &["10.244.0.5"])]);
            h.plan_computed(&moved);
            h.plan_applied(&moved);
            h.reconciled().await;
            assert!(closed_soon(lo(31001)).await);
            assert_eq!(status(31002).await, (200, 1));

            // Another Service takes the freed port in the same sync.
            let swapped = plan(&[
                svc("a", "b", 31003, &["10.244.0.5"]),
                svc("c", "d", 31002, &[]),
            ]);
            h.plan_computed(&swapped);
            h.plan_applied(&swapped);
            assert!(
                eventually(&h, || h
                    .listening()
                    .get(&ServiceName::new("c", "d"))
                    .is_some_and(|l| l.failing.is_empty()))
                .await
            );
            let r = get(lo(31002), "/").await;
            assert_eq!(r.status, 503);
            assert_eq!(r.json()["service"]["name"], "d");

            // Service removed.
            let none = plan(&[]);
            h.plan_computed(&none);
            h.plan_applied(&none);
            h.reconciled().await;
            assert!(h.listening().is_empty());
            assert!(closed_soon(lo(31002)).await && closed_soon(lo(31003)).await);
            h.shutdown().await;
        });
    }
}

/// The one place the node-port answers differ: the cluster took endpoints away but the
/// dataplane has not (or cannot) apply it. And both turn 503 when the proxy is stale.
#[test]
fn truthful_and_upstream_differ_exactly_on_unapplied_removals() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    // (step, upstream (status, count), truthful (status, count))
    in_netns(|| async {
        let (up, up_clock, _r1) = start(Semantics::Upstream, false).await;
        let (tr, tr_clock, _r2) = start(Semantics::Truthful, false).await;
        // Two servers on different ports for the same Service shape.
        let p = |port: u16, ips: &[&str]| plan(&[svc("a", "b", port, ips)]);
        let both = |f: &dyn Fn(&Health, u16)| {
            f(&up, 32001);
            f(&tr, 32002);
        };
        both(&|h, port| {
            let x = p(port, &["10.244.0.5"]);
            h.plan_computed(&x);
            h.plan_applied(&x);
        });
        check(&up, &tr, (200, 1), (200, 1), "steady, one local endpoint").await;

        // A second pod becomes ready; its rules are not programmed yet: neither counts it.
        both(&|h, port| h.plan_computed(&p(port, &["10.244.0.5", "10.244.0.6"])));
        check(
            &up,
            &tr,
            (200, 1),
            (200, 1),
            "new endpoint computed, not applied",
        )
        .await;
        both(&|h, _| h.sync_failed());
        check(&up, &tr, (200, 1), (200, 1), "new endpoint, sync failed").await;

        // The pod is replaced (old one gone, new one not programmed) and the sync fails:
        // upstream keeps advertising the gone pod; truthful drains at once.
        both(&|h, port| h.plan_computed(&p(port, &["10.244.0.6"])));
        both(&|h, _| h.sync_failed());
        check(&up, &tr, (200, 1), (503, 0), "pod replaced, sync failing").await;

        // The pod terminates (still serving): same.
        both(&|h, port| h.plan_computed(&p(port, &[])));
        check(
            &up,
            &tr,
            (200, 1),
            (503, 0),
            "only a terminating pod, not applied",
        )
        .await;

        // The failing sync makes the proxy stale: both 503, serviceProxyHealthy false.
        up_clock.advance(STALE);
        tr_clock.advance(STALE);
        check(&up, &tr, (503, 1), (503, 0), "stale").await;
        let r = get(lo(32001), "/").await;
        assert_eq!(r.json()["serviceProxyHealthy"], false);
        assert!(!up.proxy_healthy() && !tr.proxy_healthy());

        // The dataplane recovers and applies the latest plan.
        both(&|h, port| {
            let x = p(port, &["10.244.0.6"]);
            h.plan_computed(&x);
            h.plan_applied(&x);
        });
        check(&up, &tr, (200, 1), (200, 1), "recovered").await;
        up.shutdown().await;
        tr.shutdown().await;
    });
}

async fn check(up: &Health, tr: &Health, want_up: (u16, u64), want_tr: (u16, u64), step: &str) {
    up.reconciled().await;
    tr.reconciled().await;
    assert_eq!(status(32001).await, want_up, "upstream: {step}");
    assert_eq!(status(32002).await, want_tr, "truthful: {step}");
}

#[test]
fn healthz_and_livez_timeline_through_http() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    for semantics in [Semantics::Upstream, Semantics::Truthful] {
        in_netns(move || async move {
            let (h, clock, reg) = start(semantics, true).await;
            let addr = h.healthz_addrs()[0];
            let hz = || async move { get(addr, "/healthz").await };
            let lz = || async move { get(addr, "/livez").await };

            // Start-up, nothing applied: upstream says healthy, truthful keeps eTP-Cluster
            // load balancers away from a node without rules. Both are alive.
            let want_start = if semantics == Semantics::Upstream {
                200
            } else {
                503
            };
            let r = hz().await;
            assert_eq!(r.status, want_start, "{semantics:?} start");
            assert_eq!(r.headers["content-type"], "application/json");
            assert_eq!(r.headers["x-content-type-options"], "nosniff");
            assert_eq!(r.json()["nodeEligible"], true);
            assert_eq!(lz().await.status, 200);

            let p = plan(&[]);
            h.plan_computed(&p);
            clock.advance(Duration::from_secs(59));
            assert_eq!(hz().await.status, want_start, "young pending change");
            clock.advance(Duration::from_secs(1));
            assert_eq!(
                hz().await.status,
                503,
                "first change pending 2 × syncPeriod"
            );
            assert_eq!(lz().await.status, 503);
            assert_eq!(lz().await.json()["healthy"], false);

            h.plan_applied(&p);
            let r = hz().await;
            assert_eq!(r.status, 200);
            let v = r.json();
            assert_eq!(v["healthy"], true);
            assert!(v["status"]["IPv4"]["lastUpdated"].is_string());
            if semantics == Semantics::Upstream {
                assert_eq!(
                    v["lastUpdated"], v["currentTime"],
                    "upstream reports lastUpdated = now on 200"
                );
            } else {
                assert_eq!(v["syncedOnce"], true);
            }

            // Queued, failing, then stale; a later queued change does not reset the clock.
            clock.advance(Duration::from_secs(100));
            h.plan_computed(&p);
            h.sync_failed();
            clock.advance(Duration::from_secs(40));
            h.plan_computed(&p);
            assert_eq!(hz().await.status, 200);
            clock.advance(Duration::from_secs(20));
            assert_eq!(hz().await.status, 503);
            h.plan_applied(&p);
            assert_eq!(hz().await.status, 200);

            // The Node is being deleted / tainted for scale-down: /healthz 503, /livez 200.
            let leaving = plan_with(&[], false, NodePortAddressesConfig::Primary, &[]);
            h.plan_computed(&leaving);
            let r = hz().await;
            assert_eq!(r.status, 503);
            assert_eq!(r.json()["nodeEligible"], false);
            assert_eq!(r.json()["healthy"], true);
            assert_eq!(lz().await.status, 200);
            assert!(lz().await.json().get("nodeEligible").is_none());
            h.plan_applied(&leaving);
            assert_eq!(hz().await.status, 503);

            // Other paths are not found.
            assert_eq!(get(addr, "/metrics").await.status, 404);

            let ok = metric(&reg, r#"kubeproxy_proxy_healthz_total{code="200"}"#).unwrap_or(0.0);
            let bad = metric(&reg, r#"kubeproxy_proxy_healthz_total{code="503"}"#).unwrap_or(0.0);
            let live_bad =
                metric(&reg, r#"kubeproxy_proxy_livez_total{code="503"}"#).unwrap_or(0.0);
            let want_ok = if semantics == Semantics::Upstream {
                5.0
            } else {
                3.0
            };
            // Nine /healthz probes above; upstream answered 200 twice more (start-up).
            assert_eq!(
                (ok, bad, live_bad),
                (want_ok, 9.0 - want_ok, 2.0),
                "{semantics:?} metrics"
            );
            h.shutdown().await;
            assert!(closed_soon(addr).await, "healthz closed on shutdown");
        });
    }
}

#[test]
fn busy_ports_are_retried_and_recover() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        // Someone else holds the health-check port and the healthz port.
        let blocker = std::net::TcpListener::bind("0.0.0.0:31500").unwrap();
        let healthz_blocker = std::net::TcpListener::bind("127.0.0.1:10256").unwrap();
        let (h, _clock, reg) = start(Semantics::Truthful, true).await;
        assert!(h.healthz_addrs().is_empty());
        let p = plan(&[svc("a", "b", 31500, &["10.244.0.5"])]);
        h.plan_computed(&p);
        h.plan_applied(&p);
        h.reconciled().await;
        let name = ServiceName::new("a", "b");
        let l = &h.listening()[&name];
        assert_eq!(l.failing, vec!["0.0.0.0:31500".parse().unwrap()], "{l:?}");
        assert_eq!(
            l.unbound,
            vec![(
                "0.0.0.0:31500".parse().unwrap(),
                kproxy_health::BindFailure::PortInUse
            )]
        );
        assert_eq!(
            l.addrs,
            vec!["[::]:31500".parse().unwrap()],
            "the free address is served meanwhile"
        );
        let labels = r#"{namespace="a",name="b",port="31500"}"#;
        assert!(
            eventually(&h, || metric(
                &reg,
                r#"kproxy_health_check_node_port_bind_failures_total{namespace="a",name="b",port="31500",reason="port_in_use"}"#
            )
            .unwrap_or(0.0)
                >= 2.0)
            .await,
            "retried"
        );
        assert_eq!(
            metric(
                &reg,
                &format!("kproxy_health_check_node_port_listening{labels}")
            ),
            Some(0.0)
        );
        assert!(metric(&reg, "kproxy_proxy_healthz_bind_failures_total").unwrap_or(0.0) >= 1.0);

        drop(blocker);
        drop(healthz_blocker);
        assert!(
            eventually(&h, || h.listening()[&name].failing.is_empty()).await,
            "recovered"
        );
        assert!(
            eventually(&h, || !h.healthz_addrs().is_empty()).await,
            "healthz recovered"
        );
        assert_eq!(status(31500).await, (200, 1));
        assert_eq!(
            metric(
                &reg,
                &format!("kproxy_health_check_node_port_listening{labels}")
            ),
            Some(1.0)
        );
        assert_eq!(get(h.healthz_addrs()[0], "/livez").await.status, 200);
        h.shutdown().await;
    });
}

#[test]
fn node_port_addresses_select_listen_addresses_on_a_veth_pair() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        ip(&["link", "add", "hc0", "type", "veth", "peer", "name", "hc1"]);
        ip(&["addr", "add", "10.200.0.2/24", "dev", "hc0"]);
        ip(&["addr", "add", "10.200.0.3/24", "dev", "hc1"]);
        ip(&["addr", "add", "fd00:200::2/64", "dev", "hc0", "nodad"]);
        ip(&["link", "set", "hc0", "up"]);
        ip(&["link", "set", "hc1", "up"]);
        let (h, _clock, _reg) = start(Semantics::Truthful, false).await;
        let node4 = "10.200.0.2".parse().unwrap();
        let other4: IpAddr = "10.200.0.3".parse().unwrap();
        let node6: IpAddr = "fd00:200::2".parse().unwrap();
        // nodePortAddresses (default: the primary address of each family) selects
        // 10.200.0.2 and fd00:200::2; 10.200.0.3 is a node address too, not selected.
        let p = plan_with(
            &[svc("a", "b", 31600, &["10.244.0.5"])],
            true,
            NodePortAddressesConfig::Primary,
            &[node4, other4, node6],
        );
        h.plan_computed(&p);
        h.plan_applied(&p);
        h.reconciled().await;
        let l = &h.listening()[&ServiceName::new("a", "b")];
        assert_eq!(
            l.addrs,
            vec![SocketAddr::new(node4, 31600), SocketAddr::new(node6, 31600)]
        );
        assert!(l.failing.is_empty() && l.unbound.is_empty(), "{l:?}");
        assert_eq!(get(SocketAddr::new(node4, 31600), "/").await.status, 200);
        assert_eq!(get(SocketAddr::new(node6, 31600), "/").await.status, 200);
        assert!(
            refused(SocketAddr::new(other4, 31600)).await,
            "unselected node address"
        );
        assert!(refused(lo(31600)).await, "loopback not selected");

        // The Node's primary IPv4 address is not on this host: reported with the
        // reason, not retried forever; the IPv6 one is still served.
        let absent: IpAddr = "192.0.2.9".parse().unwrap();
        let moved = plan_with(
            &[svc("a", "b", 31600, &["10.244.0.5"])],
            true,
            NodePortAddressesConfig::Primary,
            &[absent, node6],
        );
        h.plan_computed(&moved);
        h.plan_applied(&moved);
        h.reconciled().await;
        let l = &h.listening()[&ServiceName::new("a", "b")];
        assert_eq!(l.addrs, vec![SocketAddr::new(node6, 31600)], "{l:?}");
        assert_eq!(
            l.unbound,
            vec![(
                SocketAddr::new(absent, 31600),
                kproxy_health::BindFailure::AddressAbsent
            )],
            "the absent node address is reported with its reason"
        );

        // The selection changes to match-all: wildcard listeners replace the addresses.
        let all = plan_with(
            &[svc("a", "b", 31600, &["10.244.0.5"])],
            true,
            NodePortAddressesConfig::Cidrs(vec![
                "0.0.0.0/0".parse().unwrap(),
                "::/0".parse().unwrap(),
            ]),
            &[node4, other4, node6],
        );
        h.plan_computed(&all);
        h.plan_applied(&all);
        assert!(
            eventually(&h, || h.listening()[&ServiceName::new("a", "b")].addrs
                == vec![
                    "0.0.0.0:31600".parse().unwrap(),
                    "[::]:31600".parse().unwrap()
                ])
            .await,
            "{:?}",
            h.listening()
        );
        assert_eq!(get(SocketAddr::new(other4, 31600), "/").await.status, 200);
        h.shutdown().await;
    });
}

#[test]
fn any_path_and_method_same_answer_and_transition_metrics() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        let (h, clock, reg) = start(Semantics::Upstream, false).await;
        let on = plan(&[svc("ns1", "svc1", 31700, &["10.244.0.5", "10.244.0.6"])]);
        h.plan_computed(&on);
        h.plan_applied(&on);
        h.reconciled().await;
        for (m, path) in [
            ("GET", "/"),
            ("POST", "/healthz"),
            ("PUT", "/x/y?z=1"),
            ("DELETE", "/"),
        ] {
            let r = request(lo(31700), m, path).await.unwrap();
            assert_eq!(r.status, 200, "{m} {path}");
            assert_eq!(r.headers["x-load-balancing-endpoint-weight"], "2");
            assert_eq!(r.json()["localEndpoints"], 2);
        }
        let head = request(lo(31700), "HEAD", "/").await.unwrap();
        assert_eq!((head.status, head.body.as_str()), (200, ""));

        let labels = r#"{namespace="ns1",name="svc1"}"#;
        let port_labels = r#"{namespace="ns1",name="svc1",port="31700"}"#;
        assert_eq!(
            metric(
                &reg,
                &format!("kproxy_health_check_node_port_healthy{port_labels}")
            ),
            Some(1.0)
        );
        // 200 → 503 (stale) → 200 (applied) → 503 (no endpoints): three transitions,
        // seen by the reconciler even without a probe in between.
        h.plan_computed(&on);
        clock.advance(STALE);
        h.sync_failed();
        h.reconciled().await;
        assert_eq!(
            metric(
                &reg,
                &format!("kproxy_health_check_node_port_healthy{port_labels}")
            ),
            Some(0.0)
        );
        h.plan_applied(&on);
        h.reconciled().await;
        let off = plan(&[svc("ns1", "svc1", 31700, &[])]);
        h.plan_computed(&off);
        h.plan_applied(&off);
        h.reconciled().await;
        assert_eq!(status(31700).await, (503, 0));
        assert_eq!(
            metric(
                &reg,
                &format!("kproxy_health_check_node_port_transitions_total{labels}")
            ),
            Some(3.0)
        );
        h.shutdown().await;
        assert!(closed_soon(lo(31700)).await, "closed on shutdown");
    });
}

#[test]
fn zero_sync_period_is_rejected() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        let mut reg = Registry::default();
        let cfg = HealthConfig {
            healthz_bind_address: None,
            semantics: Semantics::Truthful,
            sync_period: Duration::ZERO,
            connection_budget: None,
        };
        assert!(Health::start(cfg, &mut reg).await.is_err());
    });
}

/// Nothing leaks across a restart: the new process-equivalent binds the same port at
/// once although the old server's closed connections sit in TIME_WAIT.
#[test]
fn a_restarted_health_server_rebinds_at_once() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    in_netns(|| async {
        let p = plan(&[svc("a", "b", 31950, &["10.244.0.5"])]);
        let (h1, _c1, _r1) = start(Semantics::Truthful, true).await;
        h1.plan_computed(&p);
        h1.plan_applied(&p);
        h1.reconciled().await;
        // Keep-alive connections the server will close itself (server-side TIME_WAIT).
        let mut kept = Vec::new();
        for target in [lo(31950), h1.healthz_addrs()[0]] {
            let mut s = tokio::net::TcpStream::connect(target).await.unwrap();
            s.write_all(b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n")
                .await
                .unwrap();
            let mut buf = [0u8; 1024];
            assert!(s.read(&mut buf).await.unwrap() > 0);
            kept.push(s);
        }
        h1.shutdown().await;
        for mut s in kept {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await; // closed by the server
        }
        let (h2, _c2, _reg2) = start(Semantics::Truthful, true).await;
        h2.plan_computed(&p);
        h2.plan_applied(&p);
        // Without SO_REUSEADDR the binds would fail for the whole TIME_WAIT (60 s);
        // a moment's grace covers a child forked by a concurrent test holding the old
        // listener until it execs.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            h2.reconciled().await;
            let l = h2
                .listening()
                .get(&ServiceName::new("a", "b"))
                .cloned()
                .unwrap_or_default();
            if l.failing.is_empty() && l.addrs.len() == 2 && h2.healthz_addrs().len() == 1 {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "not rebound: {l:?} healthz {:?}",
                h2.healthz_addrs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(status(31950).await, (200, 1));
        h2.shutdown().await;
    });
}

/// `healthzBindAddress: 0.0.0.0:P` serves IPv6 too, as upstream's Go wildcard listener.
#[test]
fn healthz_wildcard_serves_both_families() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        let mut registry = Registry::default();
        let cfg = HealthConfig {
            semantics: Semantics::Upstream,
            ..HealthConfig::default()
        };
        let h = Health::start_with_clock(cfg, &mut registry, ManualClock::new(t0()))
            .await
            .unwrap();
        assert_eq!(
            h.healthz_addrs(),
            vec![
                "0.0.0.0:10256".parse().unwrap(),
                "[::]:10256".parse().unwrap()
            ]
        );
        assert_eq!(
            get("127.0.0.1:10256".parse().unwrap(), "/livez")
                .await
                .status,
            200
        );
        assert_eq!(
            get("[::1]:10256".parse().unwrap(), "/healthz").await.status,
            200
        );
        h.shutdown().await;
    });
}

/// Another process holding only `0.0.0.0:10256` (a kube-proxy) left kproxy serving
/// `[::]:10256` alone, and the takeover, which asks whether the port is held, saw none.
#[test]
fn a_healthz_address_held_by_another_process_is_reported_even_when_the_companion_binds() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        let blocker = std::net::TcpListener::bind("0.0.0.0:10256").unwrap();
        let mut registry = Registry::default();
        let cfg = HealthConfig {
            semantics: Semantics::Upstream,
            ..HealthConfig::default()
        };
        let h = Health::start_with_clock(cfg, &mut registry, ManualClock::new(t0()))
            .await
            .unwrap();
        assert_eq!(h.healthz_addrs(), vec!["[::]:10256".parse().unwrap()]);
        assert!(h.healthz_in_use());
        drop(blocker);
        h.shutdown().await;
    });
}

/// A change that reaches the cluster state but is never planned (a sync loop that
/// stopped taking changes) turns the proxy unhealthy 2 × syncPeriod after it arrived,
/// as upstream's `QueuedUpdate` from the informer handlers does; a later change does
/// not restart the clock, and a successful sync clears it.
#[test]
fn a_change_never_taken_by_the_sync_loop_turns_the_proxy_stale() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    for semantics in [Semantics::Upstream, Semantics::Truthful] {
        in_netns(move || async move {
            let (h, clock, _reg) = start(semantics, false).await;
            let one = plan(&[svc("a", "b", 31101, &["10.244.0.5"])]);
            h.plan_computed(&one);
            h.plan_applied(&one);
            assert!(h.proxy_healthy(), "{semantics:?}: fresh after a sync");
            h.change_queued();
            clock.advance(STALE - Duration::from_secs(1));
            h.change_queued();
            assert!(h.proxy_healthy(), "{semantics:?}: change still young");
            clock.advance(Duration::from_secs(2));
            assert!(
                !h.proxy_healthy(),
                "{semantics:?}: the oldest change waited 2 x syncPeriod"
            );
            h.plan_computed(&one);
            h.plan_applied(&one);
            assert!(h.proxy_healthy(), "{semantics:?}: synced again");
        });
    }
}

/// The sync loop reports each sync's change (`PlanUpdate`), and a reconciler pass then
/// visits only the Services it names: a Service losing its endpoints, one removed and
/// one added in the same delta end where a whole pass would put them, and the one not
/// named keeps serving.
#[test]
fn delta_updates_move_the_named_servers() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    use kproxy_core::planner::PlanUpdate;
    in_netns(|| async {
        let (h, _clock, _reg) = start(Semantics::Upstream, false).await;
        let before = plan(&[
            svc("a", "b", 31001, &["10.244.0.5"]),
            svc("a", "c", 31002, &["10.244.0.6"]),
            svc("a", "e", 31004, &["10.244.0.9"]),
        ]);
        h.plan_computed(&before);
        h.plan_applied(&before);
        h.reconciled().await;
        assert_eq!(status(31001).await, (200, 1));
        assert_eq!(status(31002).await, (200, 1));
        let after = plan(&[
            svc("a", "b", 31001, &[]),
            svc("a", "d", 31003, &["10.244.0.7", "10.244.0.8"]),
            svc("a", "e", 31004, &["10.244.0.9"]),
        ]);
        let up = PlanUpdate {
            services: ["b", "c", "d"].map(|n| ServiceName::new("a", n)).into(),
            node: false,
        };
        h.computed(&after, &up);
        h.applied(&after, &up);
        h.reconciled().await;
        assert_eq!(status(31001).await, (503, 0));
        assert!(refused(lo(31002)).await, "a removed Service still served");
        assert_eq!(status(31003).await, (200, 2));
        assert_eq!(status(31004).await, (200, 1));
        let names: Vec<String> = h.listening().keys().map(|n| n.to_string()).collect();
        assert_eq!(names, ["a/b", "a/d", "a/e"]);
        h.shutdown().await;
    });
}
