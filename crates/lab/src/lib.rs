//! The lab: a Kubernetes-like cluster built from network namespaces, an emulated
//! cloud load balancer, pods with lifecycles and a load generator, running the
//! real kproxy daemon on every node.
//!
//! Four rooms, imported in one direction only (a room imports the rooms above it in
//! this list, never one below):
//! - `scenario`: the scenario's vocabulary (the lab Service, the Deployment, the load
//!   balancer, the load, a rollout's configuration, the matrix's cells). Data and
//!   pure functions.
//! - `world`: what a run builds and drives (network, nodes, pods, control planes,
//!   kproxy per node, load balancer, load, the timeline).
//! - `report`: what a run recorded, turned into text, JSON and HTML. Pure functions.
//! - `runs`: each scenario end to end (rollout, matrix, restart, takeover), driving the
//!   world and handing its record to the report.
//!
//! `cli` is the command line over the runs. Start at `runs::rollout`; the README says
//! how a new scenario is added.

#![forbid(unsafe_code)]

pub mod cli;
pub mod report;
pub mod runs;
pub mod scenario;
pub mod world;

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("command `{cmd}` failed: {detail}")]
    Command { cmd: String, detail: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
    #[error("kproxy on {node}: {detail}")]
    Daemon { node: String, detail: String },
}

/// The lab needs root (namespaces, nftables).
pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}
