//! The packet-test fabric: a node namespace running the real dataplane, two pods on this
//! node (`a`, `b`, behind veths named `kpv*`), one pod "on another node" (`r`, behind
//! `rem0`), and an outside client (`c`, 198.51.100.2). Every pod runs tiny TCP and UDP
//! servers on port 8080 that answer `<pod> <client address they saw>`.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kproxy_core::NodePlan;
use kproxy_core::model::Protocol;
use kproxy_nft::{Dataplane, DataplaneConfig, SyncReport};

use super::{Netns, ip};

pub const NODE_IP: &str = "10.200.0.1";
/// Every address of the node namespace (what `fib saddr type local` knows).
pub const NODE_ADDRS: [&str; 4] = ["10.200.0.1", "198.51.100.1", "10.244.1.1", "10.244.2.1"];
pub const PODS: [(&str, &str); 3] = [
    ("a", "10.244.1.2"),
    ("b", "10.244.1.3"),
    ("r", "10.244.2.2"),
];
pub const CLIENT_IP: &str = "198.51.100.2";
pub const NODE_IP6: &str = "fd00:200::1";
pub const NODE_ADDRS6: [&str; 5] = [
    "fd00:200::1",
    "fd00:198::1",
    "fd00:244:1::1",
    "fd00:244:2::1",
    "::1",
];
pub const PODS6: [(&str, &str); 3] = [
    ("a", "fd00:244:1::2"),
    ("b", "fd00:244:1::3"),
    ("r", "fd00:244:2::2"),
];
pub const CLIENT_IP6: &str = "fd00:198::2";
/// Address ranges owned by the sink namespace (see `Fabric::new`).
pub const SINK_NETS: [&str; 4] = [
    "10.96.0.0/16",
    "203.0.113.0/24",
    "fd00:96::/64",
    "fd00:203::/64",
];
/// Ports the sink answers on (TCP and UDP, both families).
pub const SINK_PORTS: [u16; 3] = [80, 53, 81];
/// Ports the node's own stack answers on (TCP and UDP, both families).
pub const HOST_PORTS: [u16; 6] = [30080, 30053, 31080, 31053, 32080, 32053];

pub struct Fabric {
    pub node: Netns,
    /// Owns the service ranges; answers what kproxy leaves untouched.
    pub sink: Netns,
    /// name, IPv4 address, namespace, IPv6 address
    pub pods: Vec<(String, IpAddr, Netns, IpAddr)>,
    pub client: Netns,
    pub dp: Arc<Mutex<Dataplane>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Answer { pod: String, seen: IpAddr },
    Refused,
    Timeout,
    Other(String),
}

/// Where a probe starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum From {
    Pod(usize),
    Node,
    Client,
}

impl Fabric {
    pub fn new() -> Fabric {
        Fabric::with_config(DataplaneConfig::default())
    }

    /// A fabric whose dataplane runs with `cfg`.
    pub fn with_config(cfg: DataplaneConfig) -> Fabric {
        let node = Netns::new("n");
        let client = Netns::new("c");
        node.exec("sysctl -qw net.ipv4.ip_forward=1");
        // Many REJECTs to one client in a row: without this the kernel's per-destination
        // ICMP rate limit (burst 6, then 1/s) turns later REJECTs into silence.
        node.exec("sysctl -qw net.ipv4.icmp_ratelimit=0 && sysctl -qw net.ipv4.icmp_msgs_per_sec=100000 && sysctl -qw net.ipv4.icmp_msgs_burst=100000");
        node.exec("sysctl -qw net.ipv6.conf.all.forwarding=1 && sysctl -qw net.ipv6.conf.default.forwarding=1 && sysctl -qw net.ipv6.icmp.ratelimit=0");
        // Outside client and the node's own address.
        node.exec(&format!(
            "ip link add ext0 type veth peer name eth0 netns {}",
            client.name
        ));
        node.exec("ip addr add 198.51.100.1/24 dev ext0 && ip addr add 10.200.0.1/32 dev ext0 && ip link set ext0 up");
        client.exec("ip addr add 198.51.100.2/24 dev eth0 && ip link set eth0 up && ip route add default via 198.51.100.1");
        node.exec("ip addr add fd00:198::1/64 dev ext0 nodad && ip addr add fd00:200::1/128 dev ext0 nodad");
        client.exec(
            "ip addr add fd00:198::2/64 dev eth0 nodad && ip -6 route add default via fd00:198::1",
        );
        // Service ranges (cluster, external and LB IPs) route to the `sink` namespace,
        // which owns every address in them and answers `sink <client>`: a packet kproxy
        // leaves untouched is answered there, so "untouched" is observable and differs
        // from DROP. Node-originated traffic to them leaves from the node IP.
        let sink = Netns::new("u");
        node.exec(&format!(
            "ip link add up0 type veth peer name eth0 netns {}",
            sink.name
        ));
        node.exec("ip addr add 100.64.0.1/30 dev up0 && ip addr add fd00:64::1/64 dev up0 nodad && ip link set up0 up");
        sink.exec("ip addr add 100.64.0.2/30 dev eth0 && ip addr add fd00:64::2/64 dev eth0 nodad && ip link set eth0 up && ip route add default via 100.64.0.1 && ip -6 route add default via fd00:64::1");
        for net in SINK_NETS {
            sink.exec(&format!("ip route add local {net} dev lo"));
        }
        node.exec("ip route add 10.96.0.0/16 via 100.64.0.2 src 10.200.0.1 && ip route add 203.0.113.0/24 via 100.64.0.2 src 10.200.0.1");
        node.exec("ip -6 route add fd00:96::/64 via fd00:64::2 src fd00:200::1 && ip -6 route add fd00:203::/64 via fd00:64::2 src fd00:200::1");
        // UDP answers must leave from the address asked, so UDP sockets are bound per
        // address (the sink's addresses are "local" only by route: non-local bind).
        sink.exec(
            "sysctl -qw net.ipv4.ip_nonlocal_bind=1 && sysctl -qw net.ipv6.ip_nonlocal_bind=1",
        );
        let mut sink_addrs = Vec::new();
        for host in (10..14).chain(50..54).chain([99]) {
            for net in ["10.96.0.", "203.0.113.", "fd00:96::", "fd00:203::"] {
                sink_addrs.push(ip(&format!("{net}{host}")));
            }
        }
        for port in SINK_PORTS {
            serve_any(&sink, "sink", port, &sink_addrs);
        }
        let mut pods = Vec::new();
        for ((name, addr), (_, addr6)) in PODS.into_iter().zip(PODS6) {
            let ns = Netns::new(name);
            if name == "r" {
                node.exec(&format!(
                    "ip link add rem0 type veth peer name eth0 netns {}",
                    ns.name
                ));
                node.exec("ip addr add 10.244.2.1/24 dev rem0 && ip link set rem0 up");
                ns.exec(&format!("ip addr add {addr}/24 dev eth0 && ip link set eth0 up && ip route add default via 10.244.2.1"));
                node.exec("ip addr add fd00:244:2::1/64 dev rem0 nodad");
                ns.exec(&format!("ip addr add {addr6}/64 dev eth0 nodad && ip -6 route add default via fd00:244:2::1"));
            } else {
                let veth = format!("kpv{name}");
                node.exec(&format!(
                    "ip link add {veth} type veth peer name eth0 netns {}",
                    ns.name
                ));
                node.exec(&format!(
                    "ip addr add 10.244.1.1/32 dev {veth} && ip link set {veth} up && ip route add {addr}/32 dev {veth}"
                ));
                ns.exec(&format!(
                    "ip addr add {addr}/32 dev eth0 && ip link set eth0 up && ip route add 10.244.1.1 dev eth0 && ip route add default via 10.244.1.1"
                ));
                node.exec(&format!("ip addr add fd00:244:1::1/128 dev {veth} nodad && ip -6 route add {addr6}/128 dev {veth}"));
                ns.exec(&format!(
                    "ip addr add {addr6}/128 dev eth0 nodad && ip -6 route add fd00:244:1::1 dev eth0 && ip -6 route add default via fd00:244:1::1"
                ));
            }
            serve(&ns, name);
            pods.push((name.to_string(), ip(addr), ns, ip(addr6)));
        }
        // The node's own stack answers `host <client>` on the NodePorts, so a NodePort
        // packet kproxy leaves untouched is observable too.
        let node_addrs: Vec<IpAddr> = NODE_ADDRS
            .iter()
            .chain(&NODE_ADDRS6[..4])
            .map(|a| ip(a))
            .collect();
        for port in HOST_PORTS {
            serve_any(&node, "host", port, &node_addrs);
        }
        let dp = Arc::new(Mutex::new(Dataplane::new(cfg).expect("config")));
        Fabric {
            node,
            sink,
            pods,
            client,
            dp,
        }
    }

    pub fn sync(&self, plan: &NodePlan) -> SyncReport {
        let dp = self.dp.clone();
        let plan = plan.clone();
        self.node.run(move || {
            dp.lock()
                .expect("dp")
                .sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("sync")
        })
    }

    pub fn pod_name(&self, addr: IpAddr) -> Option<&str> {
        self.pods
            .iter()
            .find(|(_, a, _, a6)| *a == addr || *a6 == addr)
            .map(|(n, _, _, _)| n.as_str())
    }

    /// The probe's source address and input interface as `trace` sees them.
    pub fn source(&self, from: From) -> (IpAddr, Option<String>) {
        source(from, false)
    }

    /// As `source`, for IPv6 probes.
    pub fn source6(&self, from: From) -> (IpAddr, Option<String>) {
        source(from, true)
    }

    fn ns(&self, from: From) -> &Netns {
        match from {
            From::Pod(i) => &self.pods[i].2,
            From::Node => &self.node,
            From::Client => &self.client,
        }
    }

    /// One new connection (TCP) or one datagram exchange (UDP).
    ///
    /// A UDP probe is a new flow only if its 5-tuple is: the kernel's ephemeral port can
    /// repeat one an earlier case used, and conntrack then keeps answering from that
    /// case's endpoint (as upstream's cleanup does while the endpoint still serves). So
    /// every UDP probe gets a source port no other probe of this process used.
    pub fn probe(&self, from: From, dst: IpAddr, port: u16, proto: Protocol) -> Outcome {
        let sport = match proto {
            Protocol::UDP => fresh_udp_port(),
            _ => 0,
        };
        self.probe_from_port(from, dst, port, proto, sport)
    }

    pub fn probe_from_port(
        &self,
        from: From,
        dst: IpAddr,
        port: u16,
        proto: Protocol,
        sport: u16,
    ) -> Outcome {
        let to = SocketAddr::new(dst, port);
        self.ns(from).run(move || match proto {
            Protocol::TCP => tcp_probe(to),
            Protocol::UDP => udp_probe(to, sport),
            Protocol::SCTP => Outcome::Other("SCTP probes not implemented".into()),
        })
    }
}

const WAIT: Duration = Duration::from_millis(700);
/// An ICMPv6 error answering a SYN (upstream's IPv6 `reject`) refuses the connection
/// only when it answers the SYN's first retransmission, ~1 s after the first try; a
/// TCP reset (kproxy's IPv6 TCP reject) refuses at once. Waiting less would call
/// upstream's REJECT a DROP.
const WAIT_TCP6: Duration = Duration::from_millis(1600);

fn parse_answer(s: &str) -> Outcome {
    let mut it = s.split_whitespace();
    match (it.next(), it.next().and_then(|a| a.parse().ok())) {
        (Some(pod), Some(seen)) => Outcome::Answer {
            pod: pod.to_string(),
            seen,
        },
        _ => Outcome::Other(format!("bad answer {s:?}")),
    }
}

fn classify(e: std::io::Error) -> Outcome {
    match e.kind() {
        ErrorKind::ConnectionRefused => Outcome::Refused,
        ErrorKind::TimedOut | ErrorKind::WouldBlock => Outcome::Timeout,
        _ => Outcome::Other(e.to_string()),
    }
}

fn tcp_probe(to: SocketAddr) -> Outcome {
    let wait = if to.is_ipv6() { WAIT_TCP6 } else { WAIT };
    let mut s = match TcpStream::connect_timeout(&to, wait) {
        Ok(s) => s,
        Err(e) => return classify(e),
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
    let mut buf = String::new();
    match s.read_to_string(&mut buf) {
        Ok(_) => parse_answer(&buf),
        Err(e) => classify(e),
    }
}

/// Source ports for `probe`'s UDP flows: below the kernel's ephemeral range (32768+) and
/// below the ports tests pick themselves (40000+), so no probe reuses another's flow.
fn fresh_udp_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    const FIRST: u16 = 10_000;
    const SPAN: u16 = 20_000;
    static NEXT: AtomicU16 = AtomicU16::new(0);
    FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN
}

fn udp_probe(to: SocketAddr, sport: u16) -> Outcome {
    let any: IpAddr = if to.is_ipv6() {
        ip("::")
    } else {
        ip("0.0.0.0")
    };
    let s = match UdpSocket::bind((any, sport)) {
        Ok(s) => s,
        Err(e) => return Outcome::Other(e.to_string()),
    };
    if let Err(e) = s.connect(to) {
        return classify(e);
    }
    let _ = s.set_read_timeout(Some(WAIT));
    let mut buf = [0u8; 256];
    // Two tries: the first datagram of a flow can race the ARP of a fresh veth.
    for _ in 0..2 {
        // A locally generated datagram dropped in `output` (DROP or REJECT) fails with
        // EPERM; a REJECT still queues the ICMP error, which `recv` reports.
        if let Err(e) = s.send(b"hi")
            && e.kind() != ErrorKind::PermissionDenied
        {
            return classify(e);
        }
        match s.recv(&mut buf) {
            Ok(n) => return parse_answer(&String::from_utf8_lossy(&buf[..n])),
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::TimedOut => {
                continue;
            }
            Err(e) => return classify(e),
        }
    }
    Outcome::Timeout
}

/// A dual-stack TCP and UDP server on `port` answering `<name> <client>` (the client
/// address without IPv4-mapping).
fn serve_any(ns: &Netns, name: &str, port: u16, udp_addrs: &[IpAddr]) {
    let addrs = udp_addrs.to_vec();
    let (tcp, udps) = ns.run(move || {
        (
            TcpListener::bind(("::", port)).expect("bind tcp"),
            addrs
                .into_iter()
                .map(|a| UdpSocket::bind((a, port)).expect("bind udp"))
                .collect::<Vec<_>>(),
        )
    });
    let n = name.to_string();
    std::thread::spawn(move || {
        for c in tcp.incoming() {
            let Ok(mut c) = c else { continue };
            if let Ok(peer) = c.peer_addr() {
                let _ = c.write_all(format!("{n} {}\n", peer.ip().to_canonical()).as_bytes());
            }
        }
    });
    for udp in udps {
        let n = name.to_string();
        std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            while let Ok((_, peer)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(format!("{n} {}\n", peer.ip()).as_bytes(), peer);
            }
        });
    }
}

/// IPv4 servers on 8080, IPv6 servers on 8081 (so the two never share a port).
fn serve(ns: &Netns, name: &str) {
    serve_on(ns, name, "0.0.0.0:8080");
    serve_on(ns, name, "[::]:8081");
}

fn serve_on(ns: &Netns, name: &str, addr: &'static str) {
    let (tcp, udp) = ns.run(move || {
        (
            TcpListener::bind(addr).expect("bind tcp"),
            UdpSocket::bind(addr).expect("bind udp"),
        )
    });
    let n = name.to_string();
    std::thread::spawn(move || {
        for c in tcp.incoming() {
            let Ok(mut c) = c else { continue };
            if let Ok(peer) = c.peer_addr() {
                let _ = c.write_all(format!("{n} {}\n", peer.ip()).as_bytes());
            }
        }
    });
    let n = name.to_string();
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, peer)) = udp.recv_from(&mut buf) {
            let _ = udp.send_to(format!("{n} {}\n", peer.ip()).as_bytes(), peer);
        }
    });
}

/// A probe's source address (of IPv6 when `v6`) and input interface as `trace` sees
/// them: the fabric's pods, node and client, without a fabric.
pub fn source(from: From, v6: bool) -> (IpAddr, Option<String>) {
    match from {
        From::Pod(i) => {
            let (name, addr) = PODS[i];
            let iface = if name == "r" {
                "rem0".to_string()
            } else {
                format!("kpv{name}")
            };
            (ip(if v6 { PODS6[i].1 } else { addr }), Some(iface))
        }
        From::Node => (ip(if v6 { NODE_IP6 } else { NODE_IP }), None),
        From::Client => (
            ip(if v6 { CLIENT_IP6 } else { CLIENT_IP }),
            Some("ext0".into()),
        ),
    }
}
