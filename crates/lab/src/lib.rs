//! The lab: a Kubernetes-like cluster built from network namespaces, an emulated
//! cloud load balancer, pods with lifecycles and a load generator, running the
//! real kproxy daemon on every node.
//!
//! Functional core: `controlplane::endpoint_conditions`, `lb::pool_for`, `lb::render_nft`,
//! `config`, `matrix` (cells, their settings and lint verdicts), `compare` (one scenario on
//! both control planes), `report` (pure functions over records and events). Imperative shell:
//! `netns`, `fabric`, `pod`, `cluster`, `lb`, `loadgen`, `kproxyd`, `scenario`, `cli`, `k8s`
//! (the real control plane: k8s-lab's kube-apiserver and kube-controller-manager, the lab as
//! scheduler and kubelet).

#![forbid(unsafe_code)]

pub mod cli;
pub mod cluster;
pub mod compare;
pub mod config;
pub mod controlplane;
pub mod fabric;
pub mod html;
pub mod k8s;
pub mod kproxyd;
pub mod lb;
pub mod loadgen;
pub mod matrix;
pub mod netns;
pub mod pod;
pub mod report;
pub mod restart;
pub mod scenario;
pub mod takeover;
pub mod timeline;

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
