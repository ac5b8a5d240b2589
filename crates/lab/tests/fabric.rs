//! Kernel tests of the lab machinery (root needed: they create network namespaces;
//! nothing touches the host's own network). A stand-in DNAT rule in the node
//! namespace plays kproxy's part here; the real daemon is exercised by
//! crates/kproxy/tests/lab_rollout.rs.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kproxy_lab::scenario::balancer::{HealthCheck, LbMode};
use kproxy_lab::scenario::load::LoadSpec;
use kproxy_lab::scenario::service::VIP;
use kproxy_lab::scenario::workload::PodProfile;
use kproxy_lab::world::fabric::{self, Fabric};
use kproxy_lab::world::lb::LoadBalancer;
use kproxy_lab::world::loadgen::{LoadGenerator, Outcome};
use kproxy_lab::world::netns;
use kproxy_lab::world::pod::{PodServer, PodSignal};
use kproxy_lab::world::timeline::{Clock, Recorder};

/// Tests here count namespaces and fds of this process: run them one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn root() -> bool {
    kproxy_test_support::root("network namespaces")
}

fn my_namespaces() -> usize {
    let me = std::process::id();
    netns::list_lab_namespaces()
        .iter()
        .filter(|n| netns::owner_pid(n) == Some(me))
        .count()
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn host_links() -> String {
    netns::run_cmd("ip", &["-o", "link", "show"]).unwrap_or_default()
}

#[test]
fn fabric_comes_up_and_down_twenty_times_without_leaks() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !root() {
        return;
    }
    let links_before: Vec<String> = host_links()
        .lines()
        .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        .collect();
    let ns_before = my_namespaces();
    let fds_before = fd_count();
    for i in 0..20 {
        let f = Fabric::build(2).expect("fabric");
        let pod = f.add_pod(1, "leak-test").expect("pod");
        let mut server = PodServer::start(
            "leak-test",
            pod.ns.name(),
            PodProfile::Graceful,
            Duration::from_secs(1),
        )
        .expect("server");
        // Node 2 reaches the pod on node 1 through the pod CIDR routes.
        let out = f.nodes[1]
            .ns
            .exec("ip", &["route", "get", &pod.ip.to_string()])
            .expect("route");
        assert!(out.contains("via 10.200.0.1"), "run {i}: {out}");
        server.join();
        assert_eq!(
            my_namespaces(),
            ns_before + 5,
            "run {i}: lb, client, 2 nodes, 1 pod"
        );
        drop(pod);
        drop(f);
    }
    assert_eq!(my_namespaces(), ns_before, "namespaces leaked");
    assert!(
        fd_count() <= fds_before + 2,
        "fds leaked: {} -> {}",
        fds_before,
        fd_count()
    );
    let links_after: Vec<String> = host_links()
        .lines()
        .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        .collect();
    let new: Vec<&String> = links_after
        .iter()
        .filter(|l| !links_before.contains(l) && l.starts_with('n'))
        .collect();
    assert!(
        new.is_empty(),
        "interfaces appeared in the host namespace: {new:?}"
    );
}

/// A blocking GET from inside `ns`; returns the response head.
fn get_from(ns: &str, target: SocketAddr) -> String {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        netns::enter_netns_by_name(&ns).expect("setns");
        let mut s = TcpStream::connect_timeout(&target, Duration::from_secs(2)).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(2))).ok();
        s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).expect("read");
        out
    })
    .join()
    .expect("client thread")
}

fn lb_reaches_pod(mode: LbMode) {
    let f = Fabric::build(1).expect("fabric");
    let pod = f.add_pod(1, "web-a").expect("pod");
    let _server = PodServer::start(
        "web-a",
        pod.ns.name(),
        PodProfile::Graceful,
        Duration::from_secs(1),
    )
    .expect("server");
    // Stand-in for kproxy on the node: DNAT the VIP (passthrough) or the node port.
    let rule = match mode {
        LbMode::Passthrough => format!("ip daddr {} tcp dport 80 dnat to {}:8080", VIP, pod.ip),
        LbMode::NodePort => format!("tcp dport 30080 dnat to {}:8080", pod.ip),
    };
    f.nodes[0]
        .ns
        .nft(&format!("table ip standin {{\n chain pre {{\n  type nat hook prerouting priority dstnat;\n  {rule}\n }}\n}}\n"))
        .expect("stand-in rules");
    let rec = Recorder::new(Clock::new(0.05));
    let hc = HealthCheck {
        interval_seconds: 1.0,
        timeout_seconds: 1.0,
        healthy_threshold: 1,
        unhealthy_threshold: 2,
        registration_delay_seconds: 0.0,
        drain_timeout_seconds: 0.0,
    };
    let _lb = LoadBalancer::start(&f, mode, hc, 32000, 30080, 80, rec).expect("lb");
    let head = get_from(f.client.name(), SocketAddr::from((VIP, 80)));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("x-pod: web-a"), "{head}");
    assert!(
        head.contains(&format!("x-client: {}", fabric::CLIENT_IP)),
        "client address not preserved: {head}"
    );
}

#[test]
fn a_request_through_the_vip_reaches_a_pod_in_passthrough_mode() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if root() {
        lb_reaches_pod(LbMode::Passthrough);
    }
}

#[test]
fn a_request_through_the_vip_reaches_a_pod_in_node_port_mode() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if root() {
        lb_reaches_pod(LbMode::NodePort);
    }
}

#[test]
fn load_generator_accounts_for_every_request_when_a_pod_is_killed() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !root() {
        return;
    }
    let f = Fabric::build(1).expect("fabric");
    let pod = f.add_pod(1, "victim").expect("pod");
    let server = PodServer::start(
        "victim",
        pod.ns.name(),
        PodProfile::Graceful,
        Duration::from_secs(1),
    )
    .expect("server");
    // The client talks to the pod directly through the node (routing only).
    let spec = LoadSpec {
        new_connection_rate: 200.0,
        keepalive_connections: 3,
        keepalive_rate: 50.0,
        request_timeout_ms: 500,
    };
    let target = SocketAddr::from((pod.ip, 8080));
    // The client namespace routes 10.244.0.0/16 only via the LB: add it for this test.
    f.lb.ip(&["route", "add", "10.244.1.0/24", "via", "10.200.0.1"])
        .expect("route");
    let epoch = Instant::now();
    let load = LoadGenerator::start(f.client.name(), target, spec, epoch).expect("load");
    std::thread::sleep(Duration::from_millis(400));
    server.signal(PodSignal::Kill);
    std::thread::sleep(Duration::from_millis(400));
    let (started, records) = load.stop_counted();
    let ok = records.iter().filter(|r| r.outcome == Outcome::Ok).count();
    let failed = records.iter().filter(|r| !r.outcome.is_ok()).count();
    assert_eq!(
        records.len() as u64,
        started,
        "every started request has exactly one record"
    );
    assert_eq!(ok + failed, records.len());
    assert!(ok > 0, "requests before the kill succeed");
    assert!(failed > 0, "requests after the kill fail");
    assert!(
        records
            .iter()
            .all(|r| r.outcome != Outcome::Ok || r.pod.as_deref() == Some("victim"))
    );
    let kinds: std::collections::BTreeSet<_> = records
        .iter()
        .filter(|r| !r.outcome.is_ok())
        .map(|r| r.outcome)
        .collect();
    assert!(
        kinds.contains(&Outcome::Refused),
        "new connections to a dead pod are refused: {kinds:?}"
    );
    drop(server);
}

#[test]
fn sweep_removes_namespaces_of_dead_runs_only() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !root() {
        return;
    }
    // A pid above the kernel's default pid_max range in use here: no such process.
    let dead = 4_194_303u32;
    assert!(
        !std::path::Path::new(&format!("/proc/{dead}")).exists(),
        "pid {dead} unexpectedly alive"
    );
    let leftover =
        netns::Netns::create(&format!("{}{dead}x0-sweeptest", netns::PREFIX)).expect("ns");
    let name = leftover.name().to_string();
    // Simulate a run killed with SIGKILL: its guard never runs.
    std::mem::forget(leftover);
    let mine = Fabric::build(1).expect("fabric (sweeps on start)");
    assert!(
        !netns::list_lab_namespaces().contains(&name),
        "leftover of a dead run was swept"
    );
    let live: Vec<String> = netns::list_lab_namespaces();
    assert!(
        live.iter().any(|n| n.starts_with(&mine.prefix)),
        "this run's namespaces are kept"
    );
    drop(mine);
}
