//! The lab's network: one namespace per node, per pod, for the outside client and
//! for the cloud load balancer, wired like a simple cluster.
//!
//! ```text
//!  client ns 198.51.100.2 ── veth ── 198.51.100.1  LB ns  (bridge br0 10.200.0.254/24)
//!                                                    │ veth per node
//!        node-N ns: eth0 10.200.0.N/24, bridge cni0 10.244.N.1/24, ip_forward
//!                                                    │ veth per pod
//!        pod ns: eth0 10.244.N.K/24, default via 10.244.N.1
//! ```
//! Nodes route other nodes' pod CIDRs over br0 (like a host-gw CNI) and the client
//! network through the LB namespace. Nothing routes to the host's own network, and
//! no interface is ever created in the host namespace (every `ip link add` runs
//! inside a lab namespace and puts the peer directly into another one).

use std::net::Ipv4Addr;
use std::sync::Mutex;

use crate::LabError;
use crate::scenario::rollout::MAX_NODES;
use crate::world::netns::{self, Netns};

pub const LB_FABRIC_IP: Ipv4Addr = Ipv4Addr::new(10, 200, 0, 254);
pub const LB_CLIENT_SIDE_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);

/// The address of node `index` (1-based) on the node network.
pub fn node_ip(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 200, 0, index as u8)
}

/// The pod CIDR base of node `index`: 10.244.index.0/24.
pub fn pod_gateway(index: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 244, index as u8, 1)
}

pub fn node_name(index: usize) -> String {
    format!("node-{index}")
}

#[derive(Debug)]
pub struct NodeNet {
    pub index: usize,
    pub name: String,
    pub ip: Ipv4Addr,
    pub ns: Netns,
}

/// A pod's network: its namespace and address. Dropping it removes the namespace.
#[derive(Debug)]
pub struct PodNet {
    pub ip: Ipv4Addr,
    pub ns: Netns,
}

#[derive(Debug)]
pub struct Fabric {
    pub prefix: String,
    // Field order matters for Drop: pods' and nodes' namespaces go before the LB's.
    pub client: Netns,
    pub nodes: Vec<NodeNet>,
    pub lb: Netns,
    next_pod: Mutex<Vec<u8>>,
}

impl Fabric {
    /// Build the network for `nodes` nodes. On error, whatever was created is
    /// removed by the guards already held.
    pub fn build(nodes: usize) -> Result<Fabric, LabError> {
        if nodes == 0 || nodes > MAX_NODES {
            return Err(LabError::Invalid(format!(
                "nodes must be 1..={MAX_NODES}, got {nodes}"
            )));
        }
        netns::sweep_dead_runs();
        let prefix = netns::run_prefix();
        let lb = Netns::create(&format!("{prefix}-lb"))?;
        lb.ip(&["link", "add", "br0", "type", "bridge"])?;
        lb.ip(&["addr", "add", &format!("{LB_FABRIC_IP}/24"), "dev", "br0"])?;
        lb.ip(&["link", "set", "br0", "up"])?;
        lb.sysctl("net.ipv4.ip_forward", "1")?;

        let client = Netns::create(&format!("{prefix}-client"))?;
        client.ip(&[
            "link",
            "add",
            "eth0",
            "type",
            "veth",
            "peer",
            "name",
            "client0",
            "netns",
            lb.name(),
        ])?;
        client.ip(&["addr", "add", &format!("{CLIENT_IP}/24"), "dev", "eth0"])?;
        client.ip(&["link", "set", "eth0", "up"])?;
        client.ip(&[
            "route",
            "add",
            "default",
            "via",
            &LB_CLIENT_SIDE_IP.to_string(),
        ])?;
        lb.ip(&[
            "addr",
            "add",
            &format!("{LB_CLIENT_SIDE_IP}/24"),
            "dev",
            "client0",
        ])?;
        lb.ip(&["link", "set", "client0", "up"])?;

        let mut node_nets = Vec::new();
        for i in 1..=nodes {
            let ns = Netns::create(&format!("{prefix}-node{i}"))?;
            plug_into_bridge(
                &ns,
                &lb,
                &format!("n{i}"),
                "br0",
                &format!("{}/24", node_ip(i)),
            )?;
            ns.ip(&["link", "add", "cni0", "type", "bridge"])?;
            ns.ip(&[
                "addr",
                "add",
                &format!("{}/24", pod_gateway(i)),
                "dev",
                "cni0",
            ])?;
            ns.ip(&["link", "set", "cni0", "up"])?;
            ns.ip(&[
                "route",
                "add",
                "198.51.100.0/24",
                "via",
                &LB_FABRIC_IP.to_string(),
            ])?;
            ns.sysctl("net.ipv4.ip_forward", "1")?;
            node_nets.push(NodeNet {
                index: i,
                name: node_name(i),
                ip: node_ip(i),
                ns,
            });
        }
        for n in &node_nets {
            for m in &node_nets {
                if m.index != n.index {
                    n.ns.ip(&[
                        "route",
                        "add",
                        &format!("10.244.{}.0/24", m.index),
                        "via",
                        &m.ip.to_string(),
                    ])?;
                }
            }
        }
        Ok(Fabric {
            prefix,
            client,
            nodes: node_nets,
            lb,
            next_pod: Mutex::new(vec![2; nodes + 1]),
        })
    }

    pub fn node(&self, index: usize) -> Option<&NodeNet> {
        self.nodes.iter().find(|n| n.index == index)
    }

    /// Create a pod namespace on node `index`, wired to the node's cni0 bridge.
    pub fn add_pod(&self, node_index: usize, pod_name: &str) -> Result<PodNet, LabError> {
        let node = self
            .node(node_index)
            .ok_or_else(|| LabError::Invalid(format!("no node {node_index}")))?;
        let host = {
            let mut next = self.next_pod.lock().expect("pod counter lock");
            let h = next[node_index];
            if h == 254 {
                return Err(LabError::Invalid(format!(
                    "node {node_index} ran out of pod addresses"
                )));
            }
            next[node_index] += 1;
            h
        };
        let ip = Ipv4Addr::new(10, 244, node_index as u8, host);
        let _ = pod_name;
        let ns = Netns::create(&format!("{}-n{node_index}p{host}", self.prefix))?;
        plug_into_bridge(
            &ns,
            &node.ns,
            &format!("p{host}"),
            "cni0",
            &format!("{ip}/24"),
        )?;
        ns.ip(&[
            "route",
            "add",
            "default",
            "via",
            &pod_gateway(node_index).to_string(),
        ])?;
        Ok(PodNet { ip, ns })
    }
}

/// Gives `ns` an `eth0` with address `cidr`, whose veth peer `peer` lives in `host` as
/// a port of `bridge` there: how a node hangs off the LB's fabric and a pod off its node.
fn plug_into_bridge(
    ns: &Netns,
    host: &Netns,
    peer: &str,
    bridge: &str,
    cidr: &str,
) -> Result<(), LabError> {
    ns.ip(&[
        "link",
        "add",
        "eth0",
        "type",
        "veth",
        "peer",
        "name",
        peer,
        "netns",
        host.name(),
    ])?;
    host.ip(&["link", "set", peer, "master", bridge, "up"])?;
    ns.ip(&["addr", "add", cidr, "dev", "eth0"])?;
    ns.ip(&["link", "set", "eth0", "up"])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_plan() {
        assert_eq!(node_ip(3), Ipv4Addr::new(10, 200, 0, 3));
        assert_eq!(pod_gateway(2), Ipv4Addr::new(10, 244, 2, 1));
        assert_eq!(node_name(1), "node-1");
    }
}
