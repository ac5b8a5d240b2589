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

/// The set of nodes (1-based indexes) new flows may go to.
pub fn pool_for(healthy: &[bool]) -> Vec<usize> {
    let h: Vec<usize> = healthy
        .iter()
        .enumerate()
        .filter(|(_, h)| **h)
        .map(|(i, _)| i + 1)
        .collect();
    if h.is_empty() {
        (1..=healthy.len()).collect()
    } else {
        h
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
pub async fn probe(addr: SocketAddr, timeout: Duration) -> bool {
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
        let head = std::str::from_utf8(&buf[..got]).ok()?;
        Some(head.starts_with("HTTP/1.1 200") || head.starts_with("HTTP/1.0 200"))
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(true)))
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
    let mut healthy = vec![false; n];
    let mut last_answer: Vec<Option<bool>> = vec![None; n];
    let mut ok_run = vec![0u32; n];
    let mut fail_run = vec![0u32; n];
    let interval = hc.real_interval(clock.scale());
    let timeout = hc.real_probe_timeout(clock.scale());
    let reg = clock.real(hc.registration_delay_seconds);
    let mut next = tokio::time::Instant::now() + reg;
    let mut current_pool = (1..=n).collect::<Vec<_>>();
    let drain = (hc.drain_timeout_seconds > 0.0).then(|| clock.real(hc.drain_timeout_seconds));
    // When each node left the pool (None: in the pool, or already drained).
    let mut left_at: Vec<Option<tokio::time::Instant>> = vec![None; n];
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
        let results = futures::future::join_all(probes).await;
        for (i, ok) in results.into_iter().enumerate() {
            if last_answer[i] != Some(ok) {
                last_answer[i] = Some(ok);
                recorder.record(
                    EventKind::HealthAnswer,
                    Some(&names[i]),
                    None,
                    if ok {
                        "health check passes"
                    } else {
                        "health check fails"
                    },
                );
            }
            if ok {
                ok_run[i] += 1;
                fail_run[i] = 0;
                if !healthy[i] && ok_run[i] >= hc.healthy_threshold {
                    healthy[i] = true;
                }
            } else {
                fail_run[i] += 1;
                ok_run[i] = 0;
                if healthy[i] && fail_run[i] >= hc.unhealthy_threshold {
                    healthy[i] = false;
                }
            }
        }
        *healthy_out.lock().expect("healthy lock") = healthy.clone();
        let new_pool = pool_for(&healthy);
        if new_pool != current_pool {
            let script = render_nft(mode, &new_pool, node_port, service_port);
            let res =
                netns::run_cmd_input("ip", &["netns", "exec", &ns, "nft", "-f", "-"], &script);
            let names_in: Vec<&str> = new_pool.iter().map(|i| names[i - 1].as_str()).collect();
            let all_down = healthy.iter().all(|h| !h);
            recorder.record(
                EventKind::LbPool,
                None,
                None,
                match res {
                    Ok(_) if all_down => format!(
                        "no healthy node: new connections to all ({})",
                        names_in.join(", ")
                    ),
                    Ok(_) => format!("new connections to {}", names_in.join(", ")),
                    Err(e) => format!("pool update failed: {e}"),
                },
            );
            for i in 1..=n {
                let was_in = current_pool.contains(&i);
                let now_in = new_pool.contains(&i);
                if was_in && !now_in {
                    left_at[i - 1] = Some(tokio::time::Instant::now());
                } else if now_in {
                    left_at[i - 1] = None;
                }
            }
            current_pool = new_pool.clone();
            *pool.lock().expect("pool lock") = new_pool;
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
        assert_eq!(pool_for(&[true, false, true]), vec![1, 3]);
        assert_eq!(pool_for(&[false, false, false]), vec![1, 2, 3]);
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
