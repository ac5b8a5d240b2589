//! No file-descriptor leak over 1,000 open/close cycles of a health-check port (its own
//! test binary: counting /proc/self/fd needs a process where nothing else runs).

mod common;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use common::{get, health_config, in_netns, t0};
use kproxy_health::fixtures::{plan, svc};
use kproxy_health::{Health, ManualClock, Semantics};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .count()
}

#[test]
fn no_fd_leak_over_1000_open_close_cycles() {
    if !kproxy_test_support::root("network namespaces") {
        return;
    }
    in_netns(|| async {
        let mut registry = prometheus_client::registry::Registry::default();
        let cfg = health_config(
            Some(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 10256)),
            Semantics::Truthful,
        );
        let h = Health::start_with_clock(cfg, &mut registry, ManualClock::new(t0()))
            .await
            .unwrap();
        let on = plan(&[svc("a", "b", 31800, &["10.244.0.5"])]);
        let off = plan(&[]);
        let probe = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 31800);
        let cycle = |i: usize| {
            let (h, on, off) = (h.clone(), on.clone(), off.clone());
            async move {
                h.plan_computed(&on);
                h.plan_applied(&on);
                h.reconciled().await;
                assert!(
                    h.listening().values().all(|l| l.failing.is_empty()),
                    "cycle {i}: {:?}",
                    h.listening()
                );
                if i.is_multiple_of(50) {
                    assert_eq!(get(probe, "/").await.status, 200, "cycle {i}");
                    assert_eq!(get(h.healthz_addrs()[0], "/livez").await.status, 200);
                }
                h.plan_computed(&off);
                h.plan_applied(&off);
                h.reconciled().await;
            }
        };
        cycle(0).await; // warm-up: lazily created runtime resources
        let before = open_fds();
        for i in 1..=1000 {
            cycle(i).await;
        }
        let after = open_fds();
        // Each cycle opens two listeners (0.0.0.0, [::]) and some connections: a leak
        // would show in the thousands.
        assert!(
            after <= before + 2,
            "file descriptors: {before} before, {after} after 1000 cycles"
        );
        h.shutdown().await;
    });
}
