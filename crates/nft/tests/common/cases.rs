//! Random cluster states for the differential tests (`tests/differential.rs` in this
//! crate: trace vs the kernel kproxy programs; `crates/kproxy/tests/upstream_differential.rs`:
//! trace vs the kernel upstream kube-proxy programs from the real API): the generator,
//! the case as manifests and as config, the probes of every frontend from every traffic
//! source, and the judge of one fate against `kproxy_core::trace`.
#![allow(dead_code)]

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use kproxy_core::config::{LocalDetectorConfig, NodePortAddressesConfig};
use kproxy_core::ingest::Ownership;
use kproxy_core::model::Protocol;
use kproxy_core::trace::{Packet, Trace, TraceVerdict, trace};
use kproxy_core::{ClusterState, PlanConfig, manifest};
use proptest::prelude::*;

use super::fabric::{Fabric, From, NODE_ADDRS, NODE_ADDRS6, Outcome};
use super::ip;

/// (ready, serving, terminating); `None` leaves the condition unset.
pub type Cond = (Option<bool>, Option<bool>, Option<bool>);

#[derive(Clone, Debug)]
pub struct Svc {
    /// 0 ClusterIP, 1 NodePort, 2 LoadBalancer
    pub kind: u8,
    pub v4: bool,
    pub v6: bool,
    pub http: bool,
    pub dns: bool,
    pub external_ip: bool,
    pub lb_ip: bool,
    /// indices into `RANGES`
    pub source_ranges: Vec<usize>,
    pub etp_local: bool,
    pub itp_local: bool,
    pub affinity: bool,
    /// (pod index into `fabric::PODS`, conditions)
    pub endpoints: Vec<(usize, Cond)>,
}

#[derive(Clone, Debug)]
pub struct Case {
    pub masquerade_all: bool,
    /// 0 none, 1 cluster CIDR, 2 node CIDR, 3 interface prefix, 4 bridge
    pub detector: u8,
    /// `None`: primary; else indices into `NP_CIDRS`
    pub node_port_cidrs: Option<Vec<usize>>,
    /// The Node lists its secondary (ExternalIP) addresses too.
    pub node_lists_secondary: bool,
    /// The service CIDRs (10.96.0.0/16, fd00:96::/108) are configured.
    pub service_cidrs: bool,
    /// A single-stack (IPv4) cluster: the only service CIDR is 10.96.0.0/16 and no
    /// IPv6 address is probed (the k8s-lab API server, see the upstream harness).
    pub ipv4_only: bool,
    pub services: Vec<Svc>,
}

pub const RANGES: [&str; 6] = [
    "198.51.100.0/24",
    "192.0.2.0/24",
    "10.200.0.0/24",
    "10.244.1.0/24",
    "fd00:198::/64",
    "fd00:200::/64",
];
pub const NP_CIDRS: [&str; 7] = [
    "10.200.0.0/24",
    "198.51.100.0/24",
    "10.244.0.0/16",
    "0.0.0.0/0",
    "fd00:200::/64",
    "fd00:198::/64",
    "::/0",
];

pub fn cond() -> impl Strategy<Value = Cond> {
    let b = || proptest::option::weighted(0.8, any::<bool>());
    (b(), b(), b())
}

pub fn svc() -> impl Strategy<Value = Svc> {
    (
        (0u8..3, 0u8..3, any::<bool>(), any::<bool>()),
        (any::<bool>(), any::<bool>()),
        proptest::collection::vec(0..RANGES.len(), 0..3),
        (any::<bool>(), any::<bool>(), proptest::bool::weighted(0.15)),
        proptest::collection::vec((0usize..3, cond()), 0..4),
    )
        .prop_map(
            |((kind, fams, http, dns), (external_ip, lb_ip), ranges, policies, endpoints)| {
                let mut source_ranges = ranges;
                source_ranges.sort();
                source_ranges.dedup();
                Svc {
                    kind,
                    v4: fams != 1,
                    v6: fams != 0,
                    http: http || !dns,
                    dns,
                    external_ip,
                    lb_ip: lb_ip && kind == 2,
                    source_ranges,
                    etp_local: policies.0 && kind != 0,
                    itp_local: policies.1,
                    affinity: policies.2,
                    endpoints,
                }
            },
        )
}

pub fn case() -> impl Strategy<Value = Case> {
    (
        any::<bool>(),
        0u8..5,
        proptest::option::of(proptest::collection::vec(0..NP_CIDRS.len(), 1..4)),
        (any::<bool>(), any::<bool>()),
        proptest::collection::vec(svc(), 1..3),
    )
        .prop_map(
            |(masquerade_all, detector, cidrs, (node_lists_secondary, service_cidrs), services)| {
                Case {
                    service_cidrs,
                    ipv4_only: false,
                    masquerade_all,
                    detector,
                    node_port_cidrs: cidrs.map(|mut c| {
                        c.sort();
                        c.dedup();
                        c
                    }),
                    node_lists_secondary,
                    services,
                }
            },
        )
}

pub fn v4_cluster_ip(i: usize) -> String {
    format!("10.96.0.{}", 10 + i)
}
pub fn v6_cluster_ip(i: usize) -> String {
    format!("fd00:96::{}", 10 + i)
}
pub fn node_port(i: usize, port: u16) -> u16 {
    30000 + 1000 * i as u16 + port
}

/// The case as manifests (what `kproxy sync --manifests` would read).
pub fn manifests(c: &Case) -> String {
    let mut addrs = vec![
        "{type: InternalIP, address: 10.200.0.1}".to_string(),
        "{type: InternalIP, address: \"fd00:200::1\"}".to_string(),
    ];
    if c.node_lists_secondary {
        addrs.push("{type: ExternalIP, address: 198.51.100.1}".into());
        addrs.push("{type: ExternalIP, address: \"fd00:198::1\"}".into());
    }
    let mut m = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nspec: {{podCIDRs: [10.244.1.0/24, \"fd00:244:1::/64\"]}}\nstatus: {{addresses: [{}]}}\n",
        addrs.join(", ")
    );
    for (i, s) in c.services.iter().enumerate() {
        let kind = ["ClusterIP", "NodePort", "LoadBalancer"][s.kind as usize];
        let mut ips = Vec::new();
        let mut fams = Vec::new();
        if s.v4 {
            ips.push(format!("\"{}\"", v4_cluster_ip(i)));
            fams.push("IPv4");
        }
        if s.v6 {
            ips.push(format!("\"{}\"", v6_cluster_ip(i)));
            fams.push("IPv6");
        }
        m += &format!(
            "---\napiVersion: v1\nkind: Service\nmetadata: {{name: s{i}, namespace: ns}}\nspec:\n  type: {kind}\n  clusterIP: {}\n  clusterIPs: [{}]\n  ipFamilies: [{}]\n  ipFamilyPolicy: {}\n  internalTrafficPolicy: {}\n",
            ips[0],
            ips.join(", "),
            fams.join(", "),
            if ips.len() == 2 {
                "RequireDualStack"
            } else {
                "SingleStack"
            },
            if s.itp_local { "Local" } else { "Cluster" },
        );
        if s.kind != 0 {
            m += &format!(
                "  externalTrafficPolicy: {}\n",
                if s.etp_local { "Local" } else { "Cluster" }
            );
        }
        if s.external_ip {
            m += &format!(
                "  externalIPs: [203.0.113.{}, \"fd00:203::{}\"]\n",
                50 + i,
                50 + i
            );
        }
        if !s.source_ranges.is_empty() {
            let r: Vec<String> = s
                .source_ranges
                .iter()
                .map(|&r| format!("\"{}\"", RANGES[r]))
                .collect();
            m += &format!("  loadBalancerSourceRanges: [{}]\n", r.join(", "));
        }
        if s.affinity {
            m += "  sessionAffinity: ClientIP\n  sessionAffinityConfig: {clientIP: {timeoutSeconds: 300}}\n";
        }
        m += "  ports:\n";
        for (on, name, port, proto) in [(s.http, "http", 80, "TCP"), (s.dns, "dns", 53, "UDP")] {
            if !on {
                continue;
            }
            m += &format!("  - {{name: {name}, port: {port}, protocol: {proto}");
            if s.kind != 0 {
                m += &format!(", nodePort: {}", node_port(i, port));
            }
            m += "}\n";
        }
        if s.lb_ip {
            m += &format!(
                "status: {{loadBalancer: {{ingress: [{{ip: 203.0.113.{}}}, {{ip: \"fd00:203::{}\"}}]}}}}\n",
                10 + i,
                10 + i
            );
        }
        for (v6, on) in [(false, s.v4), (true, s.v6)] {
            if !on {
                continue;
            }
            let (fam, port) = if v6 { ("IPv6", 8081) } else { ("IPv4", 8080) };
            m += &format!(
                "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: s{i}-{}, namespace: ns, labels: {{kubernetes.io/service-name: s{i}}}}}\naddressType: {fam}\nports: [{{name: http, port: {port}, protocol: TCP}}, {{name: dns, port: {port}, protocol: UDP}}]\nendpoints:\n",
                fam.to_lowercase()
            );
            let mut seen = Vec::new();
            for (pod, (r, sv, t)) in &s.endpoints {
                if seen.contains(pod) {
                    continue;
                }
                seen.push(*pod);
                let (name, a4) = super::fabric::PODS[*pod];
                let addr = if v6 {
                    format!("\"{}\"", super::fabric::PODS6[*pod].1)
                } else {
                    a4.to_string()
                };
                let node = if name == "r" { "node-b" } else { "node-a" };
                let mut conds = Vec::new();
                for (k, v) in [("ready", r), ("serving", sv), ("terminating", t)] {
                    if let Some(v) = v {
                        conds.push(format!("{k}: {v}"));
                    }
                }
                m += &format!(
                    "- {{addresses: [{addr}], nodeName: {node}, conditions: {{{}}}}}\n",
                    conds.join(", ")
                );
            }
            if seen.is_empty() {
                m += "  []\n";
                m = m.replace("endpoints:\n  []\n", "endpoints: []\n");
            }
        }
    }
    m
}

pub fn config(c: &Case) -> PlanConfig {
    let nets = |l: &[&str]| -> Vec<IpNet> { l.iter().map(|n| n.parse().expect("net")).collect() };
    PlanConfig {
        masquerade_all: c.masquerade_all,
        local_detector: match c.detector {
            0 => LocalDetectorConfig::None,
            1 => LocalDetectorConfig::ClusterCidr(nets(&["10.244.0.0/16", "fd00:244::/32"])),
            2 => LocalDetectorConfig::NodeCidr,
            3 => LocalDetectorConfig::InterfaceNamePrefix("kpv".into()),
            _ => LocalDetectorConfig::BridgeInterface("kpva".into()),
        },
        node_port_addresses: match &c.node_port_cidrs {
            None => NodePortAddressesConfig::Primary,
            Some(ix) => NodePortAddressesConfig::Cidrs(
                ix.iter()
                    .map(|&i| NP_CIDRS[i].parse().expect("net"))
                    .collect(),
            ),
        },
        service_cidrs: if c.service_cidrs && c.ipv4_only {
            nets(&["10.96.0.0/16"])
        } else if c.service_cidrs {
            nets(&["10.96.0.0/16", "fd00:96::/108"])
        } else {
            Vec::new()
        },
        ..PlanConfig::default()
    }
}

pub fn state(text: &str) -> Result<ClusterState, String> {
    let parsed = manifest::parse("case.yaml", text);
    if !parsed.errors.is_empty() {
        return Err(format!("{:?}", parsed.errors));
    }
    let mut st = ClusterState::new();
    for o in &parsed.objects {
        st.apply(&o.object, &Ownership::default(), "node-a")
            .map_err(|e| format!("{e:?}"))?;
    }
    Ok(st)
}

pub fn host_addresses() -> Vec<IpAddr> {
    NODE_ADDRS
        .iter()
        .chain(&NODE_ADDRS6[..4])
        .map(|a| ip(a))
        .collect()
}

/// One packet to send: source, destination, port, protocol.
pub type Probe = (From, IpAddr, u16, Protocol);

/// Every frontend of every service port, from every traffic source, plus an undefined
/// port of each cluster IP and an unallocated address in each service range.
pub fn probes(c: &Case) -> Vec<Probe> {
    let mut dsts: Vec<(IpAddr, u16, Protocol)> = Vec::new();
    for (i, s) in c.services.iter().enumerate() {
        for v6 in [false, true] {
            if !(if v6 { s.v6 } else { s.v4 }) {
                continue;
            }
            let cip = ip(&if v6 {
                v6_cluster_ip(i)
            } else {
                v4_cluster_ip(i)
            });
            dsts.push((cip, 81, Protocol::TCP));
            for (on, port, proto) in [(s.http, 80, Protocol::TCP), (s.dns, 53, Protocol::UDP)] {
                if !on {
                    continue;
                }
                dsts.push((cip, port, proto));
                // External IPs are host 50 + i, LB IPs 10 + i (as `manifests` writes them).
                for (on, host) in [(s.external_ip, 50 + i), (s.lb_ip, 10 + i)] {
                    if on {
                        let a = if v6 {
                            format!("fd00:203::{host}")
                        } else {
                            format!("203.0.113.{host}")
                        };
                        dsts.push((ip(&a), port, proto));
                    }
                }
                if s.kind != 0 {
                    let addrs: &[&str] = if v6 {
                        &NODE_ADDRS6[..3]
                    } else {
                        &NODE_ADDRS[..3]
                    };
                    for a in addrs {
                        dsts.push((ip(a), node_port(i, port), proto));
                    }
                }
            }
        }
    }
    dsts.push((ip("10.96.0.99"), 80, Protocol::TCP));
    if !c.ipv4_only {
        dsts.push((ip("fd00:96::99"), 80, Protocol::TCP));
    }
    let sources = [
        From::Pod(0),
        From::Pod(1),
        From::Pod(2),
        From::Node,
        From::Client,
    ];
    let mut out = Vec::new();
    for d in dsts {
        for from in sources {
            out.push((from, d.0, d.1, d.2));
        }
    }
    out
}

/// `None` when the kernel did what the trace says; else why not.
pub fn judge(f: &Fabric, t: &Trace, src: IpAddr, dst: IpAddr, got: &Outcome) -> Option<String> {
    let ok = match t.verdict {
        TraceVerdict::Dnat => match got {
            Outcome::Answer { pod, seen } => {
                let allowed: Vec<&str> = t
                    .endpoints
                    .iter()
                    .filter_map(|e| f.pod_name(e.ip))
                    .collect();
                // Hairpin: the kernel masquerades whenever the chosen endpoint is the
                // source and a pod of this node (not `r`); trace says so only when every
                // candidate is.
                let hairpin = f.pod_name(src) == Some(pod.as_str()) && pod != "r";
                allowed.contains(&pod.as_str()) && (*seen != src) == (t.masquerade || hairpin)
            }
            // A pod of another node DNATed back to itself without masquerade receives
            // a packet from its own address, which its stack drops.
            Outcome::Timeout => {
                !t.masquerade
                    && f.pod_name(src) == Some("r")
                    && t.endpoints.iter().any(|e| e.ip == src)
            }
            _ => false,
        },
        TraceVerdict::Drop => *got == Outcome::Timeout,
        TraceVerdict::Reject => *got == Outcome::Refused,
        TraceVerdict::None => {
            let untouched = if host_addresses().contains(&dst) {
                "host"
            } else {
                "sink"
            };
            matches!(got, Outcome::Answer { pod, .. } if pod == untouched)
        }
    };
    (!ok).then(|| format!("kernel gave {got:?}"))
}

/// Sends every probe of the case through whatever programmed the fabric's node
/// namespace and judges each fate against `kproxy trace`; returns (probes, mismatches).
pub fn probe_and_judge(f: &Arc<Fabric>, c: &Case) -> Result<(usize, Vec<String>), String> {
    let st = state(&manifests(c))?;
    let cfg = config(c);
    // `kproxy trace --node-addresses <host addresses>`.
    let locals = host_addresses();
    let trace_plan = kproxy_core::plan(
        &st,
        "node-a",
        &PlanConfig {
            node_ips: locals.clone(),
            ..cfg.clone()
        },
    );
    f.node.exec("conntrack -F 2>/dev/null || true");
    let probes = probes(c);
    let traces: Vec<(Probe, IpAddr, Trace)> = probes
        .iter()
        .map(|&(from, dst, port, proto)| {
            let (src, iface) = if dst.is_ipv6() {
                f.source6(from)
            } else {
                f.source(from)
            };
            let pkt = Packet {
                src,
                dst,
                dport: port,
                proto,
                in_interface: iface,
            };
            (
                (from, dst, port, proto),
                src,
                trace(&trace_plan, &pkt, &locals),
            )
        })
        .collect();
    // Probes in parallel batches (each one a new connection from an ephemeral port).
    let mut outcomes = Vec::with_capacity(traces.len());
    for chunk in traces.chunks(64) {
        let handles: Vec<_> = chunk
            .iter()
            .map(|&((from, dst, port, proto), _, _)| {
                let f = f.clone();
                std::thread::spawn(move || f.probe(from, dst, port, proto))
            })
            .collect();
        for h in handles {
            outcomes.push(h.join().expect("probe thread"));
        }
    }
    let mut fails = Vec::new();
    for (((from, dst, port, proto), src, t), got) in traces.iter().zip(outcomes) {
        if judge(f, t, *src, *dst, &got).is_none() {
            continue;
        }
        // A mismatch must repeat (one at a time) to count: a loaded machine can delay an
        // answer past the probe's wait.
        let again = f.probe(*from, *dst, *port, *proto);
        if let Some(why) = judge(f, t, *src, *dst, &again) {
            fails.push(format!(
                "{from:?} {src} -> {dst}:{port}/{proto}: trace {:?} {:?} masq={} ({}); {why}",
                t.verdict,
                t.endpoints
                    .iter()
                    .map(|e| e.to_string())
                    .collect::<Vec<_>>(),
                t.masquerade,
                t.reason
            ));
        }
    }
    Ok((traces.len(), fails))
}

/// A number from the environment variable `var` (the number of states to try), else
/// `default`.
pub fn env_count(var: &str, default: u32) -> u32 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The generator's random source, seeded from `var` (a number, or `random` for a
/// fresh seed), else `default` so a run is reproducible; says which seed it used.
pub fn seeded_rng(var: &str, default: u64) -> proptest::test_runner::TestRng {
    use proptest::test_runner::{RngAlgorithm, TestRng};
    let seed: u64 = match std::env::var(var).ok().as_deref() {
        Some("random") => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1),
        Some(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("{var}: a number or `random`")),
        None => default,
    };
    eprintln!("{var}: seed {seed}");
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    TestRng::from_seed(RngAlgorithm::ChaCha, &bytes)
}

/// A state of one Service `s`, every other setting off.
pub fn one_service(s: Svc) -> Case {
    Case {
        masquerade_all: false,
        detector: 0,
        node_port_cidrs: None,
        node_lists_secondary: false,
        service_cidrs: false,
        ipv4_only: false,
        services: vec![s],
    }
}

/// An IPv4 Service of `kind` with port 80 (TCP) and no endpoints.
pub fn plain(kind: u8) -> Svc {
    Svc {
        kind,
        v4: true,
        v6: false,
        http: true,
        dns: false,
        external_ip: false,
        lb_ip: false,
        source_ranges: Vec::new(),
        etp_local: false,
        itp_local: false,
        affinity: false,
        endpoints: Vec::new(),
    }
}

/// A failed run of random states, for a panic message: why, and the minimal state as
/// manifests plus config.
pub fn failure(e: &proptest::test_runner::TestError<Case>) -> String {
    match e {
        proptest::test_runner::TestError::Fail(why, c) => format!(
            "{why}\nminimal state:\n{}\nconfig: {:?}",
            manifests(c),
            config(c)
        ),
        other => other.to_string(),
    }
}
