//! What `kproxy connectivity-test` checks and what it expects (pure): from the facts the
//! API server gave about the test's Services and nodes ([`Setup`]), the probes each
//! client runs ([`probes`]: per node and [`Source`], each with its [`Expect`]) and the
//! checks that are skipped, with why ([`skips`]). The expectations are upstream
//! kube-proxy's semantics (docs/upstream-semantics.md), not kproxy's planner: the test
//! holds any Service proxy to them.

use std::net::IpAddr;

use serde::Serialize;

/// Where a probe starts: the node itself (a hostNetwork pod: the node's view) or a
/// pod on the node's pod network (a pod's view).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    Node,
    Pod,
}

impl Source {
    pub const ALL: [Source; 2] = [Source::Node, Source::Pod];

    pub fn word(self) -> &'static str {
        match self {
            Source::Node => "node",
            Source::Pod => "pod",
        }
    }
}

/// One path through the Service proxy, a column of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Check {
    /// TCP to the cluster IP: any server answers.
    #[serde(rename = "clusterip-tcp")]
    ClusterIpTcp,
    /// UDP to the cluster IP: any server answers.
    #[serde(rename = "clusterip-udp")]
    ClusterIpUdp,
    /// TCP to every node's InternalIP at the NodePort (externalTrafficPolicy Cluster).
    #[serde(rename = "nodeport")]
    NodePort,
    /// TCP to the load balancer's ingress IP.
    #[serde(rename = "loadbalancer")]
    LoadBalancer,
    /// TCP to the externalIP given with `--external-ip`.
    #[serde(rename = "external-ip")]
    ExternalIp,
    /// sessionAffinity ClientIP: every one of several connections lands on one server.
    #[serde(rename = "affinity")]
    Affinity,
    /// externalTrafficPolicy Local's healthCheckNodePort on this node: 200 where the
    /// Service has a local ready endpoint, 503 where none.
    #[serde(rename = "etp-local-hc")]
    EtpLocalHc,
    /// internalTrafficPolicy Local: the server on this node answers; a node without
    /// one drops the connection (a timeout).
    #[serde(rename = "itp-local")]
    InternalLocal,
    /// A Service without endpoints: the connection is refused (rejected), not dropped.
    #[serde(rename = "no-endpoints")]
    NoEndpoints,
    /// A Service whose one endpoint is terminating but still serving (a long preStop):
    /// connections fall back to it.
    #[serde(rename = "terminating")]
    Terminating,
    /// That Service's healthCheckNodePort (externalTrafficPolicy Local) on this node:
    /// 503, a terminating endpoint does not count, even on its own node.
    #[serde(rename = "terminating-hc")]
    TerminatingHc,
}

impl Check {
    pub const ALL: [Check; 11] = [
        Check::ClusterIpTcp,
        Check::ClusterIpUdp,
        Check::NodePort,
        Check::LoadBalancer,
        Check::ExternalIp,
        Check::Affinity,
        Check::EtpLocalHc,
        Check::InternalLocal,
        Check::NoEndpoints,
        Check::Terminating,
        Check::TerminatingHc,
    ];

    /// The column's name.
    pub fn name(self) -> &'static str {
        match self {
            Check::ClusterIpTcp => "clusterip-tcp",
            Check::ClusterIpUdp => "clusterip-udp",
            Check::NodePort => "nodeport",
            Check::LoadBalancer => "loadbalancer",
            Check::ExternalIp => "external-ip",
            Check::Affinity => "affinity",
            Check::EtpLocalHc => "etp-local-hc",
            Check::InternalLocal => "itp-local",
            Check::NoEndpoints => "no-endpoints",
            Check::Terminating => "terminating",
            Check::TerminatingHc => "terminating-hc",
        }
    }
}

/// What a probe must see to pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "value", rename_all = "kebab-case")]
pub enum Expect {
    /// An answer from any server.
    Answer,
    /// An answer from this server (a pod name: netexec answers its hostname).
    AnswerFrom(String),
    /// Every try answered, all by one server.
    OneServer,
    /// This HTTP status.
    Status(u16),
    /// Connection refused (the proxy rejects).
    Refused,
    /// No answer within the probe timeout (the proxy drops).
    Timeout,
}

impl Expect {
    /// In words, for a failing cell: "expected …".
    pub fn words(&self) -> String {
        match self {
            Expect::Answer => "an answer".into(),
            Expect::AnswerFrom(s) => format!("an answer from {s}"),
            Expect::OneServer => "every answer from one server".into(),
            Expect::Status(c) => format!("HTTP {c}"),
            Expect::Refused => "connection refused".into(),
            Expect::Timeout => "a timeout (dropped)".into(),
        }
    }
}

/// What a client does for one probe.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Action {
    /// `GET http://ADDR:PORT/hostname`: the answering server's name.
    Hostname { ip: IpAddr, port: u16 },
    /// `GET http://ADDR:PORT/hostname` this many times: the servers' names.
    Hostnames { ip: IpAddr, port: u16, tries: u32 },
    /// `GET http://ADDR:PORT/healthz`: the status code.
    Healthz { ip: IpAddr, port: u16 },
    /// A UDP datagram `hostname` to ADDR:PORT: answered or not.
    Udp { ip: IpAddr, port: u16 },
    /// A TCP connection to ADDR:PORT: made, refused or timed out.
    Connect { ip: IpAddr, port: u16 },
}

/// One probe a client runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Probe {
    pub check: Check,
    /// The node whose address is probed (NodePort, health check), else `None`.
    pub target: Option<String>,
    pub action: Action,
    pub expect: Expect,
}

/// A node under test.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TestNode {
    pub name: String,
    /// Its InternalIP (NodePorts and health checks are probed there).
    pub address: IpAddr,
    /// The name of the server pod pinned to it (netexec answers with it).
    pub server: String,
}

/// The test's Services as the API server allocated them, and the nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Setup {
    pub nodes: Vec<TestNode>,
    /// The node (index into `nodes`) holding the one endpoint of the Local-policy
    /// Services.
    pub local: usize,
    /// The main Service: cluster IP, TCP port, UDP port, TCP NodePort.
    pub cluster_ip: IpAddr,
    pub tcp_port: u16,
    pub udp_port: u16,
    pub node_port: u16,
    /// Its load balancer's ingress IP, or why there is none to probe.
    pub load_balancer: Result<IpAddr, String>,
    /// `--external-ip`, set on the main Service.
    pub external_ip: Option<IpAddr>,
    /// The ClientIP-affinity Service's cluster IP (port `tcp_port`).
    pub affinity_ip: IpAddr,
    /// The externalTrafficPolicy Local Service's healthCheckNodePort.
    pub health_check_node_port: u16,
    /// The internalTrafficPolicy Local Service's cluster IP (port `tcp_port`).
    pub internal_local_ip: IpAddr,
    /// The Service without endpoints (port `tcp_port`).
    pub no_endpoints_ip: IpAddr,
    /// The Service whose one endpoint is terminating, or why that could not be set up.
    pub terminating: Result<TerminatingService, String>,
}

/// The Service (LoadBalancer, externalTrafficPolicy Local) whose one endpoint, on the
/// first node, was deleted and is terminating while its preStop hook runs, still
/// serving.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TerminatingService {
    pub cluster_ip: IpAddr,
    pub health_check_node_port: u16,
    /// The terminating pod's name.
    pub server: String,
}

/// How many connections the affinity check makes (with two servers, a proxy ignoring
/// affinity lands them all on one with probability 2^-9).
pub const AFFINITY_TRIES: u32 = 10;

/// The pods whose names the expectations hold.
#[derive(Clone, Copy, Debug)]
pub struct Servers<'a> {
    /// The Local-policy Services' one endpoint.
    pub local: &'a str,
    /// The terminating endpoint.
    pub terminating: &'a str,
}

/// What a client on a node sees for `check` in upstream kube-proxy's semantics, for a
/// target on `target_is_local` (the node with the Local Services' endpoint, for
/// [`Check::EtpLocalHc`] the probed node, otherwise the client's own node). The same
/// from a node and from a pod: both are "internal" traffic, and traffic from the node
/// or a local pod to a NodePort or load balancer IP is sent to every endpoint whatever
/// its externalTrafficPolicy.
pub fn expectation(check: Check, target_is_local: bool, servers: Servers<'_>) -> Expect {
    match check {
        Check::ClusterIpTcp
        | Check::ClusterIpUdp
        | Check::NodePort
        | Check::LoadBalancer
        | Check::ExternalIp => Expect::Answer,
        Check::Affinity => Expect::OneServer,
        // health.md: 200 with a local ready endpoint, 503 without.
        Check::EtpLocalHc if target_is_local => Expect::Status(200),
        Check::EtpLocalHc => Expect::Status(503),
        // upstream-semantics.md: internalTrafficPolicy Local without a local endpoint
        // drops; the endpoint on this node answers.
        Check::InternalLocal if target_is_local => Expect::AnswerFrom(servers.local.to_string()),
        Check::InternalLocal => Expect::Timeout,
        // No endpoints at all: rejected (ICMP port unreachable, connection refused).
        Check::NoEndpoints => Expect::Refused,
        // upstream-semantics.md: no ready endpoint, so the serving terminating ones
        // are used; the health check counts ready endpoints only.
        Check::Terminating => Expect::AnswerFrom(servers.terminating.to_string()),
        Check::TerminatingHc => Expect::Status(503),
    }
}

/// The checks not run, each with why (the same for every node).
pub fn skips(setup: &Setup) -> Vec<(Check, String)> {
    let mut out = Vec::new();
    if let Err(why) = &setup.load_balancer {
        out.push((Check::LoadBalancer, why.clone()));
    }
    if let Err(why) = &setup.terminating {
        out.push((Check::Terminating, why.clone()));
        out.push((Check::TerminatingHc, why.clone()));
    }
    if setup.external_ip.is_none() {
        out.push((
            Check::ExternalIp,
            "no --external-ip given (an address routed to the nodes)".to_string(),
        ));
    }
    out
}

/// The probes both clients on node `node` (index into `setup.nodes`) run, the node's
/// and the pod's (the same from both views, see [`expectation`]), in order: the checks
/// that expect an answer first (their retries also wait for the node's proxy to program
/// the new Services), then those expecting a drop or a reject.
pub fn probes(setup: &Setup, node: usize) -> Vec<Probe> {
    let servers = Servers {
        local: &setup.nodes[setup.local].server,
        terminating: setup.terminating.as_ref().map_or("", |t| t.server.as_str()),
    };
    let expect = |check, is_local| expectation(check, is_local, servers);
    let on_local = node == setup.local;
    let port = setup.tcp_port;
    let probe = |check, target: Option<&TestNode>, action, expect| Probe {
        check,
        target: target.map(|n| n.name.clone()),
        action,
        expect,
    };
    let mut out = vec![
        probe(
            Check::ClusterIpTcp,
            None,
            Action::Hostname {
                ip: setup.cluster_ip,
                port,
            },
            expect(Check::ClusterIpTcp, on_local),
        ),
        probe(
            Check::ClusterIpUdp,
            None,
            Action::Udp {
                ip: setup.cluster_ip,
                port: setup.udp_port,
            },
            expect(Check::ClusterIpUdp, on_local),
        ),
    ];
    for target in &setup.nodes {
        out.push(probe(
            Check::NodePort,
            Some(target),
            Action::Hostname {
                ip: target.address,
                port: setup.node_port,
            },
            expect(Check::NodePort, false),
        ));
    }
    if let Ok(ip) = setup.load_balancer {
        out.push(probe(
            Check::LoadBalancer,
            None,
            Action::Hostname { ip, port },
            expect(Check::LoadBalancer, false),
        ));
    }
    if let Some(ip) = setup.external_ip {
        out.push(probe(
            Check::ExternalIp,
            None,
            Action::Hostname { ip, port },
            expect(Check::ExternalIp, false),
        ));
    }
    out.push(probe(
        Check::Affinity,
        None,
        Action::Hostnames {
            ip: setup.affinity_ip,
            port,
            tries: AFFINITY_TRIES,
        },
        expect(Check::Affinity, false),
    ));
    let me = &setup.nodes[node];
    out.push(probe(
        Check::EtpLocalHc,
        Some(me),
        Action::Healthz {
            ip: me.address,
            port: setup.health_check_node_port,
        },
        expect(Check::EtpLocalHc, on_local),
    ));
    if let Ok(t) = &setup.terminating {
        out.push(probe(
            Check::Terminating,
            None,
            Action::Hostname {
                ip: t.cluster_ip,
                port,
            },
            expect(Check::Terminating, on_local),
        ));
        out.push(probe(
            Check::TerminatingHc,
            Some(me),
            Action::Healthz {
                ip: me.address,
                port: t.health_check_node_port,
            },
            expect(Check::TerminatingHc, on_local),
        ));
    }
    out.push(probe(
        Check::InternalLocal,
        None,
        Action::Hostname {
            ip: setup.internal_local_ip,
            port,
        },
        expect(Check::InternalLocal, on_local),
    ));
    out.push(probe(
        Check::NoEndpoints,
        None,
        Action::Connect {
            ip: setup.no_endpoints_ip,
            port,
        },
        expect(Check::NoEndpoints, on_local),
    ));
    // Answers first: a drop expected before the rules exist would pass for nothing.
    out.sort_by_key(|p| matches!(p.expect, Expect::Timeout | Expect::Refused));
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub fn setup(nodes: usize, local: usize) -> Setup {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        Setup {
            nodes: (0..nodes)
                .map(|i| TestNode {
                    name: format!("node-{i}"),
                    address: ip(&format!("192.168.0.{}", i + 10)),
                    server: format!("server-{i}"),
                })
                .collect(),
            local,
            cluster_ip: ip("10.96.0.10"),
            tcp_port: 80,
            udp_port: 81,
            node_port: 30080,
            load_balancer: Ok(ip("172.31.229.10")),
            external_ip: None,
            affinity_ip: ip("10.96.0.11"),
            health_check_node_port: 30999,
            internal_local_ip: ip("10.96.0.12"),
            no_endpoints_ip: ip("10.96.0.13"),
            terminating: Ok(TerminatingService {
                cluster_ip: ip("10.96.0.14"),
                health_check_node_port: 30998,
                server: "terminating-0".into(),
            }),
        }
    }

    /// Upstream's semantics per check, on and off the node with the Local Services'
    /// endpoint.
    #[test]
    fn expectations_per_check() {
        use Expect::*;
        let table: [(Check, Expect, Expect); 11] = [
            (Check::ClusterIpTcp, Answer, Answer),
            (Check::ClusterIpUdp, Answer, Answer),
            (Check::NodePort, Answer, Answer),
            (Check::LoadBalancer, Answer, Answer),
            (Check::ExternalIp, Answer, Answer),
            (Check::Affinity, OneServer, OneServer),
            (Check::EtpLocalHc, Status(200), Status(503)),
            (Check::InternalLocal, AnswerFrom("server-0".into()), Timeout),
            (Check::NoEndpoints, Refused, Refused),
            (
                Check::Terminating,
                AnswerFrom("terminating-0".into()),
                AnswerFrom("terminating-0".into()),
            ),
            (Check::TerminatingHc, Status(503), Status(503)),
        ];
        let servers = Servers {
            local: "server-0",
            terminating: "terminating-0",
        };
        for (check, on_local, elsewhere) in table {
            assert_eq!(expectation(check, true, servers), on_local, "{check:?}");
            assert_eq!(expectation(check, false, servers), elsewhere, "{check:?}");
        }
    }

    /// Every node gets one NodePort probe per node, its own health check and the
    /// Local checks by where the endpoint is; drops and rejects come last.
    #[test]
    fn probes_per_node() {
        let s = setup(3, 1);
        for node in 0..3 {
            let p = probes(&s, node);
            let of = |c: Check| p.iter().filter(|x| x.check == c).collect::<Vec<_>>();
            let targets: Vec<_> = of(Check::NodePort)
                .iter()
                .map(|x| x.target.clone().unwrap())
                .collect();
            assert_eq!(targets, ["node-0", "node-1", "node-2"]);
            let hc = of(Check::EtpLocalHc);
            assert_eq!(hc.len(), 1);
            assert_eq!(hc[0].target.as_deref(), Some(s.nodes[node].name.as_str()));
            assert_eq!(
                hc[0].action,
                Action::Healthz {
                    ip: s.nodes[node].address,
                    port: 30999
                }
            );
            let want = if node == 1 { 200 } else { 503 };
            assert_eq!(hc[0].expect, Expect::Status(want));
            let itp = of(Check::InternalLocal);
            let want = if node == 1 {
                Expect::AnswerFrom("server-1".into())
            } else {
                Expect::Timeout
            };
            assert_eq!(itp[0].expect, want);
            assert_eq!(of(Check::LoadBalancer).len(), 1);
            let term = of(Check::Terminating);
            assert_eq!(term[0].expect, Expect::AnswerFrom("terminating-0".into()));
            let term_hc = of(Check::TerminatingHc);
            assert_eq!(
                term_hc[0].action,
                Action::Healthz {
                    ip: s.nodes[node].address,
                    port: 30998
                }
            );
            assert_eq!(term_hc[0].expect, Expect::Status(503));
            assert!(of(Check::ExternalIp).is_empty());
            let first_drop = p
                .iter()
                .position(|x| matches!(x.expect, Expect::Timeout | Expect::Refused))
                .unwrap();
            assert!(
                p[first_drop..]
                    .iter()
                    .all(|x| matches!(x.expect, Expect::Timeout | Expect::Refused)),
                "{p:?}"
            );
        }
    }

    #[test]
    fn skipped_checks_say_why() {
        let mut s = setup(2, 0);
        s.load_balancer = Err("no ingress IP within 30s".into());
        s.terminating = Err("not serving while terminating".into());
        let skipped = skips(&s);
        assert_eq!(
            skipped.iter().map(|(c, _)| *c).collect::<Vec<_>>(),
            [
                Check::LoadBalancer,
                Check::Terminating,
                Check::TerminatingHc,
                Check::ExternalIp
            ]
        );
        assert!(
            probes(&s, 0)
                .iter()
                .all(|p| !matches!(p.check, Check::Terminating | Check::TerminatingHc))
        );
        assert!(probes(&s, 0).iter().all(|p| p.check != Check::LoadBalancer));
        s.external_ip = Some("198.51.100.7".parse().unwrap());
        s.load_balancer = Ok("172.31.229.10".parse().unwrap());
        s.terminating = setup(2, 0).terminating;
        assert!(skips(&s).is_empty());
        assert!(probes(&s, 0).iter().any(|p| p.check == Check::ExternalIp));
    }
}
