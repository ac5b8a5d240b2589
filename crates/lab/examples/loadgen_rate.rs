//! How many requests per second the lab's load generator sustains, through the
//! LB VIP (passthrough LB + a stand-in DNAT on the node) and directly to a pod.
//! Root needed. Usage: cargo run --release -p kproxy-lab --example loadgen_rate [SECONDS]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kproxy_lab::scenario::balancer::{HealthCheck, LbMode};
use kproxy_lab::scenario::load::LoadSpec;
use kproxy_lab::scenario::service::VIP;
use kproxy_lab::scenario::workload::PodProfile;
use kproxy_lab::world::fabric::Fabric;
use kproxy_lab::world::lb::LoadBalancer;
use kproxy_lab::world::loadgen::LoadGenerator;
use kproxy_lab::world::pod::PodServer;
use kproxy_lab::world::timeline::{Clock, Recorder};

fn measure(f: &Fabric, target: SocketAddr, spec: LoadSpec, secs: f64) -> (f64, usize, usize) {
    let load = LoadGenerator::start(f.client.name(), target, spec, Instant::now()).expect("load");
    std::thread::sleep(Duration::from_secs_f64(secs));
    let recs = load.stop();
    let ok = recs.iter().filter(|r| r.outcome.is_ok()).count();
    (ok as f64 / secs, ok, recs.len() - ok)
}

fn main() {
    let secs: f64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(3.0);
    if !kproxy_lab::is_root() {
        eprintln!("needs root");
        std::process::exit(2);
    }
    let f = Fabric::build(1).expect("fabric");
    let pod = f.add_pod(1, "bench").expect("pod");
    let _server = PodServer::start(
        "bench",
        pod.ns.name(),
        PodProfile::Graceful,
        Duration::from_secs(5),
    )
    .expect("server");
    f.nodes[0]
        .ns
        .nft(&format!(
            "table ip standin {{\n chain pre {{\n  type nat hook prerouting priority dstnat;\n  ip daddr {} tcp dport 80 dnat to {}:8080\n }}\n}}\n",
            VIP,
            pod.ip
        ))
        .expect("stand-in rule");
    f.lb.ip(&["route", "add", "10.244.1.0/24", "via", "10.200.0.1"])
        .expect("route");
    let hc = HealthCheck {
        interval_seconds: 10.0,
        timeout_seconds: 1.0,
        healthy_threshold: 1,
        unhealthy_threshold: 2,
        registration_delay_seconds: 0.0,
        drain_timeout_seconds: 0.0,
    };
    let _lb = LoadBalancer::start(
        &f,
        LbMode::Passthrough,
        hc,
        32000,
        30080,
        80,
        Recorder::new(Clock::new(1.0)),
    )
    .expect("lb");
    let vip = SocketAddr::from((VIP, 80));
    let direct = SocketAddr::from((pod.ip, 8080));
    let new_conns = LoadSpec {
        new_connection_rate: 5000.0,
        keepalive_connections: 0,
        keepalive_rate: 1.0,
        request_timeout_ms: 2000,
    };
    let keepalive = LoadSpec {
        new_connection_rate: 0.0,
        keepalive_connections: 16,
        keepalive_rate: 1000.0,
        request_timeout_ms: 2000,
    };
    for (name, target) in [("VIP", vip), ("pod", direct)] {
        for (mix, spec) in [
            ("new connections (target 5000/s)", &new_conns),
            ("16 keep-alive connections (target 16000/s)", &keepalive),
        ] {
            let (rate, ok, failed) = measure(&f, target, spec.clone(), secs);
            println!(
                "{name:<4} {mix:<45} {rate:>8.0} ok/s  ({ok} ok, {failed} failed in {secs} s)"
            );
        }
    }
}
