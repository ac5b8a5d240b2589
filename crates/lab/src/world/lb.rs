//! The emulated cloud load balancer, living in the LB namespace.
//!
//! Data path (nftables + policy routing in the LB namespace only):
//! - `passthrough` (a GCP network LB): packets keep the VIP as destination. A new
//!   flow gets a conntrack mark naming one node of the pool (`numgen random`);
//!   every packet of the flow copies the mark to the packet, and `ip rule fwmark N`
//!   routes it to node N. Conntrack keeps a flow on its node, so existing flows keep
//!   going when the pool changes; only new flows follow the pool.
//! - `node-port` (an AWS NLB in instance mode): a new flow is DNATed to
//!   nodeIP:nodePort of one node of the pool; conntrack keeps existing flows.
//!   The client address is preserved in both modes (no SNAT).
//!
//! Control path: a health checker on its own thread inside the LB namespace probes
//! each node's health-check node port over HTTP every interval with a timeout, and
//! applies healthy/unhealthy thresholds. New flows go only to healthy nodes, and to
//! all nodes when none is healthy (as GCP does). A node starts unhealthy and joins
//! after `healthy_threshold` successes, after an optional registration delay.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::LabError;
use crate::scenario::balancer::{HealthCheck, LbMode};
use crate::scenario::service::VIP;
use crate::world::fabric::{self, Fabric};
use crate::world::netns;
use crate::world::timeline::{EventKind, Recorder};

/// Where the LB sends new flows. Two states can hold the same set of nodes — every
/// node passing, and none passing (then the LB sends to every node, as GCP does) — so
/// the pool is this state, not only its set: the timeline must tell them apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pool {
    /// The nodes (1-based indexes) that pass the health check.
    Healthy(Vec<usize>),
    /// No node passes: new flows go to all of these many nodes.
    AllNodes(usize),
}

impl Pool {
    /// The pool for the LB's per-node verdicts (index − 1: is node healthy?).
    pub fn for_health(healthy: &[bool]) -> Pool {
        let h: Vec<usize> = healthy
            .iter()
            .enumerate()
            .filter(|(_, h)| **h)
            .map(|(i, _)| i + 1)
            .collect();
        if h.is_empty() {
            Pool::AllNodes(healthy.len())
        } else {
            Pool::Healthy(h)
        }
    }

    /// The nodes (1-based indexes) new flows may go to.
    pub fn nodes(&self) -> Vec<usize> {
        match self {
            Pool::Healthy(h) => h.clone(),
            Pool::AllNodes(n) => (1..=*n).collect(),
        }
    }

    /// The `LbPool` event's detail for this pool (`names[i − 1]` names node i); the
    /// reports read it back (`report::healthy_in_pool`, the timeline's node lanes).
    pub fn detail(&self, names: &[String]) -> String {
        let names_in: Vec<&str> = self
            .nodes()
            .iter()
            .filter_map(|i| names.get(i - 1).map(String::as_str))
            .collect();
        match self {
            Pool::AllNodes(_) => format!(
                "no healthy node: new connections to all ({})",
                names_in.join(", ")
            ),
            Pool::Healthy(_) => format!("new connections to {}", names_in.join(", ")),
        }
    }
}

/// What one probe round changed.
#[derive(Debug, Default, PartialEq)]
pub struct Round {
    /// Nodes (index − 1) whose answer differs from their last one, with the new answer.
    pub answers: Vec<(usize, bool)>,
    /// The new pool, when the round changed it (its set or its state).
    pub pool: Option<Pool>,
}

/// The health checker's bookkeeping, without the network: each node's last answer,
/// its runs of passes and failures against the thresholds, its verdict, and the pool.
/// A node starts unhealthy; the pool starts as every node (no node passes yet).
#[derive(Clone, Debug)]
pub struct HealthBook {
    healthy_threshold: u32,
    unhealthy_threshold: u32,
    last_answer: Vec<Option<bool>>,
    ok_run: Vec<u32>,
    fail_run: Vec<u32>,
    healthy: Vec<bool>,
    pool: Pool,
}

impl HealthBook {
    pub fn new(nodes: usize, hc: &HealthCheck) -> HealthBook {
        HealthBook {
            healthy_threshold: hc.healthy_threshold,
            unhealthy_threshold: hc.unhealthy_threshold,
            last_answer: vec![None; nodes],
            ok_run: vec![0; nodes],
            fail_run: vec![0; nodes],
            healthy: vec![false; nodes],
            pool: Pool::AllNodes(nodes),
        }
    }

    /// One probe round's answers (index − 1: did node pass?).
    pub fn round(&mut self, results: &[bool]) -> Round {
        let mut out = Round::default();
        for (i, &ok) in results.iter().enumerate().take(self.healthy.len()) {
            if self.last_answer[i] != Some(ok) {
                self.last_answer[i] = Some(ok);
                out.answers.push((i, ok));
            }
            if ok {
                self.ok_run[i] += 1;
                self.fail_run[i] = 0;
                if !self.healthy[i] && self.ok_run[i] >= self.healthy_threshold {
                    self.healthy[i] = true;
                }
            } else {
                self.fail_run[i] += 1;
                self.ok_run[i] = 0;
                if self.healthy[i] && self.fail_run[i] >= self.unhealthy_threshold {
                    self.healthy[i] = false;
                }
            }
        }
        let pool = Pool::for_health(&self.healthy);
        if pool != self.pool {
            self.pool = pool.clone();
            out.pool = Some(pool);
        }
        out
    }

    pub fn healthy(&self) -> &[bool] {
        &self.healthy
    }
}

/// The nft script that sends new flows to `pool`.
pub fn render_nft(mode: LbMode, pool: &[usize], node_port: u16, service_port: u16) -> String {
    let vip = VIP;
    let mut s = String::from("table ip kplab\ndelete table ip kplab\ntable ip kplab {\n");
    match mode {
        LbMode::Passthrough => {
            let map: Vec<String> = pool
                .iter()
                .enumerate()
                .map(|(i, n)| format!("{i} : {n}"))
                .collect();
            s += "  chain pre {\n    type filter hook prerouting priority mangle; policy accept;\n";
            s += &format!(
                // `ct mark 0`, not `ct state new`: a retransmitted SYN is still "new" to
                // conntrack, and a real LB's connection table keeps it on the node it
                // chose first (so a dropped SYN stays dropped, as in the cloud).
                "    ip daddr {vip} ct mark 0 ct mark set numgen random mod {} map {{ {} }}\n",
                pool.len(),
                map.join(", ")
            );
            s += &format!("    ip daddr {vip} meta mark set ct mark\n  }}\n");
        }
        LbMode::NodePort => {
            let map: Vec<String> = pool
                .iter()
                .enumerate()
                .map(|(i, n)| format!("{i} : {}", fabric::node_ip(*n)))
                .collect();
            s += "  chain pre {\n    type nat hook prerouting priority dstnat; policy accept;\n";
            s += &format!(
                "    ip daddr {vip} tcp dport {service_port} dnat to numgen random mod {} map {{ {} }} : {node_port}\n  }}\n",
                pool.len(),
                map.join(", ")
            );
        }
    }
    s += "}\n";
    s
}

pub struct LoadBalancer {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub pool: Arc<Mutex<Vec<usize>>>,
    /// Per node (index − 1): does the LB consider it healthy?
    pub healthy: Arc<Mutex<Vec<bool>>>,
}

impl LoadBalancer {
    /// [`LoadBalancer::start`] in front of the lab's one Service (its health-check node
    /// port, NodePort and port, `crate::world::controlplane`), as the held runs (`lab restart`,
    /// `lab takeover`) put it.
    pub fn for_lab_service(
        fabric: &Fabric,
        mode: LbMode,
        hc: HealthCheck,
        recorder: Recorder,
    ) -> Result<LoadBalancer, LabError> {
        use crate::scenario::service::{HEALTH_CHECK_NODE_PORT, NODE_PORT, SERVICE_PORT};
        LoadBalancer::start(
            fabric,
            mode,
            hc,
            HEALTH_CHECK_NODE_PORT,
            NODE_PORT,
            SERVICE_PORT,
            recorder,
        )
    }

    /// Program the data path (all nodes in the pool until the first health checks)
    /// and start the health checker.
    pub fn start(
        fabric: &Fabric,
        mode: LbMode,
        hc: HealthCheck,
        health_port: u16,
        node_port: u16,
        service_port: u16,
        recorder: Recorder,
    ) -> Result<LoadBalancer, LabError> {
        let n = fabric.nodes.len();
        for node in &fabric.nodes {
            let table = (100 + node.index).to_string();
            fabric.lb.ip(&[
                "rule",
                "add",
                "fwmark",
                &node.index.to_string(),
                "lookup",
                &table,
            ])?;
            fabric.lb.ip(&[
                "route",
                "add",
                "default",
                "via",
                &node.ip.to_string(),
                "table",
                &table,
            ])?;
        }
        let all: Vec<usize> = (1..=n).collect();
        fabric
            .lb
            .nft(&render_nft(mode, &all, node_port, service_port))?;
        let stop = Arc::new(AtomicBool::new(false));
        let pool = Arc::new(Mutex::new(all));
        let healthy = Arc::new(Mutex::new(vec![false; n]));
        let hl = healthy.clone();
        let (st, pl, ns) = (stop.clone(), pool.clone(), fabric.lb.name().to_string());
        let names: Vec<String> = fabric.nodes.iter().map(|n| n.name.clone()).collect();
        let ips: Vec<Ipv4Addr> = fabric.nodes.iter().map(|n| n.ip).collect();
        let thread = netns::spawn_runtime_in_netns("lab-lb", ns.clone(), move || {
            health_loop(
                ns,
                mode,
                hc,
                health_port,
                node_port,
                service_port,
                names,
                ips,
                st,
                pl,
                hl,
                recorder,
            )
        })?;
        let lb = LoadBalancer {
            stop,
            thread: Some(thread),
            pool,
            healthy,
        };
        Ok(lb)
    }

    pub fn healthy(&self) -> Vec<bool> {
        self.healthy.lock().expect("healthy lock").clone()
    }

    pub fn pool(&self) -> Vec<usize> {
        self.pool.lock().expect("pool lock").clone()
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for LoadBalancer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One HTTP health probe: 200 within `timeout` is a success.
/// What one health probe saw. The load balancer acts only on pass or fail; the timeline
/// keeps why a probe failed, because an answer of 503 is the node's proxy draining and
/// a probe with no answer in time is the node (or the machine's load) not answering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeAnswer {
    Passes,
    /// An HTTP answer other than 200 (the status, 0 when it was not HTTP).
    Answered(u16),
    /// Refused, reset or closed before an answer, or nothing within the timeout.
    NoAnswer,
}

impl ProbeAnswer {
    pub fn passes(self) -> bool {
        self == ProbeAnswer::Passes
    }

    /// The timeline's words: "passes" and "fails" are what every reader matches.
    pub fn detail(self) -> String {
        match self {
            ProbeAnswer::Passes => "health check passes".into(),
            ProbeAnswer::Answered(status) => format!("health check fails (answered {status})"),
            ProbeAnswer::NoAnswer => "health check fails (no answer)".into(),
        }
    }
}

pub async fn probe(addr: SocketAddr, timeout: Duration) -> ProbeAnswer {
    let attempt = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: lb\r\nUser-Agent: kproxy-lab-lb\r\nConnection: close\r\n\r\n")
            .await
            .ok()?;
        let mut buf = [0u8; 64];
        let mut got = 0;
        while got < 12 {
            let n = s.read(&mut buf[got..]).await.ok()?;
            if n == 0 {
                break;
            }
            got += n;
        }
        // "HTTP/1.1 503": the status is the second word.
        let head = std::str::from_utf8(&buf[..got]).ok()?;
        let status = head
            .strip_prefix("HTTP/1.")
            .and_then(|rest| rest.get(2..5))
            .and_then(|code| code.parse::<u16>().ok());
        Some(match status {
            Some(200) => ProbeAnswer::Passes,
            Some(code) => ProbeAnswer::Answered(code),
            None if got == 0 => ProbeAnswer::NoAnswer,
            None => ProbeAnswer::Answered(0),
        })
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(Some(answer)) => answer,
        Ok(None) | Err(_) => ProbeAnswer::NoAnswer,
    }
}

#[allow(clippy::too_many_arguments)]
async fn health_loop(
    ns: String,
    mode: LbMode,
    hc: HealthCheck,
    health_port: u16,
    node_port: u16,
    service_port: u16,
    names: Vec<String>,
    ips: Vec<Ipv4Addr>,
    stop: Arc<AtomicBool>,
    pool: Arc<Mutex<Vec<usize>>>,
    healthy_out: Arc<Mutex<Vec<bool>>>,
    recorder: Recorder,
) {
    let clock = recorder.clock().clone();
    let n = ips.len();
    let mut book = HealthBook::new(n, &hc);
    let interval = hc.real_interval(clock.scale());
    let timeout = hc.real_probe_timeout(clock.scale());
    let reg = clock.real(hc.registration_delay_seconds);
    let mut next = tokio::time::Instant::now() + reg;
    // The nodes the data path sends new flows to (all, until the first verdicts).
    let mut current_nodes = (1..=n).collect::<Vec<_>>();
    let drain = (hc.drain_timeout_seconds > 0.0).then(|| clock.real(hc.drain_timeout_seconds));
    // When each node left the pool (None: in the pool, or already drained).
    let mut left_at: Vec<Option<tokio::time::Instant>> = vec![None; n];
    let mut last_answer: Vec<Option<ProbeAnswer>> = vec![None; n];
    while !stop.load(Ordering::SeqCst) {
        let now = tokio::time::Instant::now();
        if now < next {
            tokio::time::sleep(Duration::from_millis(10).min(next - now)).await;
            continue;
        }
        next += interval;
        let probes = ips
            .iter()
            .map(|ip| probe(SocketAddr::from((*ip, health_port)), timeout));
        let answers = futures::future::join_all(probes).await;
        let round = book.round(&answers.iter().map(|a| a.passes()).collect::<Vec<_>>());
        // Every change of answer, also from one kind of failure to another.
        for (i, answer) in answers.iter().enumerate() {
            if last_answer[i] != Some(*answer) {
                last_answer[i] = Some(*answer);
                recorder.record(
                    EventKind::HealthAnswer,
                    Some(&names[i]),
                    None,
                    answer.detail(),
                );
            }
        }
        *healthy_out.lock().expect("healthy lock") = book.healthy().to_vec();
        if let Some(new_pool) = round.pool {
            let new_nodes = new_pool.nodes();
            // Every node passing and none passing hold the same set: the data path
            // stays, the timeline still learns which state the pool is in.
            let res = if new_nodes == current_nodes {
                Ok(())
            } else {
                let script = render_nft(mode, &new_nodes, node_port, service_port);
                netns::run_cmd_input("ip", &["netns", "exec", &ns, "nft", "-f", "-"], &script)
                    .map(|_| ())
            };
            recorder.record(
                EventKind::LbPool,
                None,
                None,
                match res {
                    Ok(()) => new_pool.detail(&names),
                    Err(e) => format!("pool update failed: {e}"),
                },
            );
            for i in 1..=n {
                let was_in = current_nodes.contains(&i);
                let now_in = new_nodes.contains(&i);
                if was_in && !now_in {
                    left_at[i - 1] = Some(tokio::time::Instant::now());
                } else if now_in {
                    left_at[i - 1] = None;
                }
            }
            current_nodes = new_nodes.clone();
            *pool.lock().expect("pool lock") = new_nodes;
        }
        if let Some(d) = drain {
            for i in 0..n {
                if left_at[i].is_some_and(|t| t.elapsed() >= d) {
                    left_at[i] = None;
                    let mark = (i + 1).to_string();
                    // conntrack exits non-zero when nothing matched; that is fine.
                    let _ = netns::run_cmd(
                        "ip",
                        &["netns", "exec", &ns, "conntrack", "-D", "--mark", &mark],
                    );
                    recorder.record(
                        EventKind::LbDrained,
                        Some(&names[i]),
                        None,
                        "drain timeout: established flows cut",
                    );
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_is_healthy_nodes_or_all() {
        assert_eq!(Pool::for_health(&[true, false, true]).nodes(), vec![1, 3]);
        assert_eq!(Pool::for_health(&[false, false, false]), Pool::AllNodes(3));
        assert_eq!(
            Pool::for_health(&[false, false, false]).nodes(),
            vec![1, 2, 3]
        );
        assert_eq!(
            Pool::for_health(&[true, true, true]),
            Pool::Healthy(vec![1, 2, 3])
        );
    }

    /// Every node starting to pass in the same round leaves the set of nodes as it was
    /// (all of them), and still changes the pool: from "none passes, send to all" to
    /// "all pass". The LB must log it, or the timeline keeps drawing the fallback.
    #[test]
    fn all_nodes_passing_together_is_a_pool_change() {
        let hc = crate::scenario::balancer::LbPreset::Gke
            .health_check()
            .unwrap();
        let mut book = HealthBook::new(3, &hc);
        let first = book.round(&[false, false, false]);
        assert_eq!(first.answers, vec![(0, false), (1, false), (2, false)]);
        assert_eq!(
            first.pool, None,
            "the pool starts as every node, none passing"
        );
        let joined = book.round(&[true, true, true]);
        assert_eq!(joined.pool, Some(Pool::Healthy(vec![1, 2, 3])));
        let names: Vec<String> = (1..=3).map(|i| format!("node-{i}")).collect();
        assert_eq!(
            joined.pool.unwrap().detail(&names),
            "new connections to node-1, node-2, node-3"
        );
        assert_eq!(book.round(&[true, true, true]), Round::default());
        // Unhealthy threshold 2: one failure keeps node-2, the second takes it out.
        assert_eq!(book.round(&[true, false, true]).pool, None);
        assert_eq!(
            book.round(&[true, false, true]).pool,
            Some(Pool::Healthy(vec![1, 3]))
        );
        // Every node failing: back to all, now as the fallback.
        book.round(&[false, false, false]);
        let down = book.round(&[false, false, false]);
        assert_eq!(down.pool, Some(Pool::AllNodes(3)));
        assert_eq!(
            down.pool.unwrap().detail(&names),
            "no healthy node: new connections to all (node-1, node-2, node-3)"
        );
    }

    #[test]
    fn nft_script_maps_pool() {
        let s = render_nft(LbMode::Passthrough, &[1, 3], 30080, 80);
        assert!(
            s.contains("numgen random mod 2 map { 0 : 1, 1 : 3 }"),
            "{s}"
        );
        let s = render_nft(LbMode::NodePort, &[2], 30080, 80);
        assert!(s.contains("map { 0 : 10.200.0.2 } : 30080"), "{s}");
    }
}
