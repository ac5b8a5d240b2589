//! Does forwarding stall while a big transaction commits? New TCP connections are
//! opened every millisecond, through a node namespace where the dataplane runs, from a
//! client namespace to a server namespace — one stream straight to the server's address
//! (routed: it meets kproxy's nat hooks but no Service), one through a probe Service's
//! cluster IP (DNATed by kproxy's rules) — while the dataplane makes the syncs that move
//! the most: the cold first sync, an adopting restart and a full replacing sync.
//! Upstream's nftables mode has stalled nodes for minutes at this scale (kernel soft
//! lockups during 5k × 50 syncs), which is what this looks for.
//!
//! For each sync, the connections whose handshake overlapped the sync are reported
//! (count, failures, p50 / p99 / max handshake time), beside the same for the 500 ms
//! before it; a failure is a handshake that did not complete within 1 s. The cluster-IP
//! stream cannot work before the first sync, so it is not reported for the cold one.
//!
//! Run (root): `cargo bench -p kproxy-nft --bench forwarding` (sizes 44000x1 5000x50) or
//! `cargo bench -p kproxy-nft --bench forwarding -- 10000x10`.
//!
//! `KPROXY_BENCH_ROUNDS=N`: N full replacing syncs (default 1); `KPROXY_BENCH_QUIET_MS`:
//! the pause around each sync (default 500); `KPROXY_BENCH_CMD`: a shell command run in
//! the node namespace as one more window (e.g. an unrelated big `nft -f`, to tell the
//! kernel's part from kproxy's); `KPROXY_BENCH_UNREPLIED=1`: at the end, the node's
//! unanswered conntrack entries and how many entries had the client's port remapped;
//! `KPROXY_BENCH_COUNTERS=1`: with the traffic counters (`DataplaneConfig::counters`,
//! `kproxy run`'s default), so the quiet windows' handshake times compare counters off
//! and on.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kproxy_core::model::{
    ClusterIps, Conditions, EndpointSlice, IpFamily, Placement, Protocol, ServiceName, ServiceType,
    SliceEndpoint, SlicePort, TrafficPolicy,
};
use kproxy_core::planner::PlanUpdate;
use kproxy_core::synthetic::{self, Spec};
use kproxy_core::{PlanConfig, Planner};
use kproxy_nft::{Dataplane, DataplaneConfig};

mod common;

const SERVER: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
const SERVER_PORT: u16 = 8080;
/// Outside every synthetic cluster IP (10.96.0.0/14 from its first address upward).
const PROBE_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
const PERIOD: Duration = Duration::from_millis(1);
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(1);
const QUIET: Duration = Duration::from_millis(500);
/// `KPROXY_BENCH_QUIET_MS` shortens the pause around each sync (for many rounds).
fn quiet() -> Duration {
    std::env::var("KPROXY_BENCH_QUIET_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(QUIET, Duration::from_millis)
}

/// Three namespaces (node, client, server) joined by veth pairs, deleted on drop.
struct Lab {
    node: String,
    /// Opens the routed connections.
    client: String,
    /// Opens the connections through the cluster IP, from an address of its own: both
    /// streams reach the same server address and port, and from one address their
    /// reused source ports would clash in conntrack.
    client2: String,
    server: String,
}

impl Lab {
    fn new() -> Option<Lab> {
        let id = std::process::id();
        let lab = Lab {
            node: format!("kpfwd-node-{id}"),
            client: format!("kpfwd-cli-{id}"),
            client2: format!("kpfwd-cl2-{id}"),
            server: format!("kpfwd-srv-{id}"),
        };
        let n = lab.node.as_str();
        let mut steps: Vec<Vec<String>> = Vec::new();
        for ns in [n, &lab.client, &lab.client2, &lab.server] {
            steps.push(words(&format!("ip netns add {ns}")));
        }
        // Each leaf on a veth pair of its own: `eth0` at 192.168.SUBNET.2, the node's end
        // at .1, which is the leaf's default route.
        for (leaf, node_if, subnet) in [
            (&lab.client, "to-cli", 76),
            (&lab.client2, "to-cl2", 78),
            (&lab.server, "to-srv", 77),
        ] {
            for step in [
                format!("ip -n {n} link add {node_if} type veth peer name eth0 netns {leaf}"),
                format!("ip -n {n} addr add 192.168.{subnet}.1/24 dev {node_if}"),
                format!("ip -n {leaf} addr add 192.168.{subnet}.2/24 dev eth0"),
                format!("ip -n {n} link set {node_if} up"),
                format!("ip -n {leaf} link set eth0 up"),
                format!("ip -n {leaf} link set lo up"),
                format!("ip -n {leaf} route add default via 192.168.{subnet}.1"),
            ] {
                steps.push(words(&step));
            }
        }
        steps.push(words(&format!("ip -n {n} link set lo up")));
        steps.push(words(&format!(
            "ip netns exec {n} sysctl -qw net.ipv4.ip_forward=1"
        )));
        for step in steps {
            let ok = Command::new(&step[0])
                .args(&step[1..])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!(
                    "forwarding bench: `{}` failed (needs root); skipping",
                    step.join(" ")
                );
                return None;
            }
        }
        Some(lab)
    }
}

/// A command line split at spaces (the lab's own names and addresses have none).
fn words(line: &str) -> Vec<String> {
    line.split(' ').map(str::to_string).collect()
}

impl Drop for Lab {
    fn drop(&mut self) {
        for ns in [&self.client, &self.client2, &self.server, &self.node] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

fn enter(ns: &str) {
    let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("open netns");
    nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
}

/// Real-time priority for the calling thread, so that what is measured is the kernel
/// holding packets back, not other processes on a busy machine taking the CPU (on a
/// node, packets are handled in softirq, ahead of every process).
fn realtime() {
    // `chrt` on this thread's id: the same syscall without an unsafe block here.
    let tid = nix::unistd::gettid().to_string();
    let ok = Command::new("chrt")
        .args(["-f", "-p", "10", &tid])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("forwarding bench: SCHED_FIFO refused; figures include CPU contention");
    }
}

/// One handshake: when it started, how long it took, whether it completed.
#[derive(Clone, Copy)]
struct Handshake {
    start: Instant,
    took: Duration,
    ok: bool,
}

/// Opens a connection to `target` every `PERIOD` until `stop`; each is reset at once
/// (SO_LINGER 0) so thousands per second leave no TIME_WAIT behind.
fn probe(ns: String, target: SocketAddr, stop: Arc<AtomicBool>) -> Vec<Handshake> {
    enter(&ns);
    realtime();
    let mut out = Vec::with_capacity(200_000);
    let t0 = Instant::now();
    let mut k: u32 = 0;
    while !stop.load(Ordering::Relaxed) {
        k += 1;
        let next = t0 + PERIOD * k;
        let now = Instant::now();
        if next > now {
            std::thread::sleep(next - now);
        }
        let start = Instant::now();
        let r = TcpStream::connect_timeout(&target, HANDSHAKE_TIMEOUT);
        let took = start.elapsed();
        if let Ok(s) = &r {
            let reset = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            let _ =
                nix::sys::socket::setsockopt(&s.as_fd(), nix::sys::socket::sockopt::Linger, &reset);
        }
        out.push(Handshake {
            start,
            took,
            ok: r.is_ok(),
        });
        // No catching up after a slow handshake: the next one starts on the next tick.
        k = k.max((t0.elapsed().as_nanos() / PERIOD.as_nanos()) as u32);
    }
    out
}

fn serve(ns: String) {
    enter(&ns);
    realtime();
    let listener = TcpListener::bind((Ipv4Addr::UNSPECIFIED, SERVER_PORT)).expect("listen");
    for conn in listener.incoming() {
        drop(conn);
    }
}

struct Window {
    what: String,
    start: Instant,
    end: Instant,
}

/// The handshakes that started at or after `since` and overlapped `from..to`.
fn stats(handshakes: &[Handshake], since: Instant, from: Instant, to: Instant) -> String {
    let overlapping = || {
        handshakes
            .iter()
            .filter(move |h| h.start >= since && h.start <= to && h.start + h.took >= from)
    };
    let mut took: Vec<Duration> = overlapping().map(|h| h.took).collect();
    let failed = overlapping().filter(|h| !h.ok).count();
    if took.is_empty() {
        return "no connection".into();
    }
    took.sort();
    let at = |q: f64| took[((took.len() - 1) as f64 * q).round() as usize];
    let ms = |d: Duration| format!("{:.2}", d.as_secs_f64() * 1000.0);
    format!(
        "{} conns, {failed} failed, p50 {} / p99 {} / max {} ms",
        took.len(),
        ms(at(0.5)),
        ms(at(0.99)),
        ms(*took.last().expect("non-empty"))
    )
}

fn probe_service(spec: &Spec) -> (kproxy_core::model::Service, EndpointSlice) {
    let name = ServiceName::new("bench".to_string(), "probe".to_string());
    let mut svc = synthetic::service(spec, 1);
    svc.name = name.clone();
    svc.service_type = ServiceType::ClusterIP;
    svc.cluster_ips = ClusterIps::from_iter([(IpFamily::IPv4, IpAddr::V4(PROBE_CLUSTER_IP))]);
    svc.ports[0].node_port = None;
    svc.load_balancer_ips.clear();
    svc.external_traffic_policy = TrafficPolicy::Cluster;
    svc.health_check_node_port = None;
    let slice = EndpointSlice {
        name: "probe-abcde".into(),
        service: name,
        family: IpFamily::IPv4,
        ports: vec![SlicePort {
            name: "http".into(),
            protocol: Protocol::TCP,
            port: SERVER_PORT,
        }],
        endpoints: vec![SliceEndpoint {
            ip: IpAddr::V4(SERVER),
            conditions: Conditions {
                ready: true,
                serving: true,
                terminating: false,
            },
            placement: Placement {
                node_name: Some(synthetic::node_name(0).into()),
                zone: None,
                zone_hints: None,
                node_hints: None,
            }
            .shared(),
        }],
        last_change_trigger_time: None,
    };
    (svc, slice)
}

/// `KPROXY_BENCH_ROUNDS`: how many full replacing syncs (default 1).
fn rounds() -> usize {
    std::env::var("KPROXY_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn run(lab: &Lab, services: usize, eps: usize) {
    let spec = Spec::new(services, eps);
    let mut state = synthetic::cluster(&spec);
    let (svc, slice) = probe_service(&spec);
    state.upsert_service(svc);
    state.upsert_slice(slice);
    let mut planner = Planner::new("node-0", PlanConfig::default());
    planner.update(&mut state);
    let plan = planner.plan();
    let cfg = DataplaneConfig {
        conntrack_cleanup: false,
        counters: std::env::var_os("KPROXY_BENCH_COUNTERS").is_some(),
        ..DataplaneConfig::default()
    };
    kproxy_nft::cleanup(&cfg).expect("remove an earlier size's tables");

    let stop = Arc::new(AtomicBool::new(false));
    let direct = {
        let (ns, stop) = (lab.client.clone(), stop.clone());
        std::thread::spawn(move || probe(ns, SocketAddr::from((SERVER, SERVER_PORT)), stop))
    };
    let via_service = {
        let (ns, stop) = (lab.client2.clone(), stop.clone());
        std::thread::spawn(move || probe(ns, SocketAddr::from((PROBE_CLUSTER_IP, 80)), stop))
    };
    let mut windows = Vec::new();
    let mut timed = |what: &str, op: &mut dyn FnMut()| {
        std::thread::sleep(quiet());
        let start = Instant::now();
        op();
        windows.push(Window {
            what: what.to_string(),
            start,
            end: Instant::now(),
        });
    };
    let mut dp = Dataplane::new(cfg.clone()).expect("config");
    timed("cold first sync", &mut || {
        dp.sync(plan, &PlanUpdate::WHOLE).expect("cold sync");
    });
    timed("adopting restart", &mut || {
        dp = Dataplane::new(cfg.clone()).expect("config");
        dp.sync(plan, &PlanUpdate::WHOLE).expect("adopting sync");
    });
    // An experiment of one's own in the node namespace (e.g. an `nft -f` loop).
    if let Some(cmd) = std::env::var_os("KPROXY_BENCH_CMD") {
        timed("KPROXY_BENCH_CMD", &mut || {
            let _ = Command::new("sh").arg("-c").arg(&cmd).status();
        });
    }
    // The same streams with no sync at all: what failures the probe sees on its own.
    timed("idle, no sync", &mut || {
        std::thread::sleep(Duration::from_secs(5))
    });
    for _ in 0..rounds() {
        timed("full replacing sync", &mut || {
            dp.force_full_sync();
            dp.sync(plan, &PlanUpdate::WHOLE).expect("replacing sync");
        });
    }
    std::thread::sleep(quiet());
    stop.store(true, Ordering::Relaxed);
    if std::env::var_os("KPROXY_BENCH_UNREPLIED").is_some() {
        // The node's conntrack entries of handshakes that got no answer, with their NAT.
        let _ = Command::new("conntrack")
            .args(["-L", "-p", "tcp", "--status", "UNREPLIED"])
            .status();
        let all = Command::new("conntrack").args(["-L", "-p", "tcp"]).output();
        if let Ok(all) = all {
            let text = String::from_utf8_lossy(&all.stdout);
            let remapped = text
                .lines()
                .filter(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let get = |k: &str, nth: usize| {
                        f.iter()
                            .filter_map(|x| x.strip_prefix(k))
                            .nth(nth)
                            .map(str::to_string)
                    };
                    get("sport=", 0) != get("dport=", 1)
                })
                .count();
            println!(
                "conntrack: {} tcp entries, {remapped} with the client's port remapped",
                text.lines().count()
            );
        }
    }
    let direct = direct.join().expect("direct probe");
    let via_service = via_service.join().expect("service probe");

    let begin = windows[0].start - QUIET;
    let first_sync_end = windows[0].end;
    for w in &windows {
        let took = w.end - w.start;
        println!(
            "{services}x{eps}: {} ({:.0} ms)\n  routed:     during {} | 500 ms before {}",
            w.what,
            took.as_secs_f64() * 1000.0,
            stats(&direct, begin, w.start, w.end),
            stats(&direct, begin, w.start - QUIET, w.start)
        );
        // The cluster IP answers only once the first sync is in.
        if w.start >= first_sync_end {
            println!(
                "  cluster IP: during {} | 500 ms before {}",
                stats(&via_service, first_sync_end, w.start, w.end),
                stats(&via_service, first_sync_end, w.start - QUIET, w.start)
            );
        }
    }
    kproxy_nft::cleanup(&cfg).expect("remove the tables");
}

fn main() {
    let sizes = common::sizes(&[(44000, 1), (5000, 50)]);
    let Some(lab) = Lab::new() else { return };
    {
        let ns = lab.server.clone();
        std::thread::spawn(move || serve(ns));
    }
    let node = lab.node.clone();
    let lab = Arc::new(lab);
    let inner = lab.clone();
    std::thread::spawn(move || {
        enter(&node);
        for (s, e) in sizes {
            run(&inner, s, e);
        }
    })
    .join()
    .expect("bench thread");
}
