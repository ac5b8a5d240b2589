//! kube-proxy on the lab's nodes, and what of it a node holds: upstream kube-proxy
//! as a process in a node's namespace or as its recording, where it comes from (the
//! real control plane or the emulated one), and the node's rules read back (kube-proxy's
//! left after a takeover, kproxy's after the way back).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::recorded;
use crate::LabError;
use crate::scenario::service::{CLUSTER_IP, PROXY_HEALTHZ_PORT, SERVICE_PORT};
use crate::world::fabric::NodeNet;
use crate::world::k8s::{K8sLab, RealControlPlane};
use crate::world::kproxyd::KproxySource;

/// Upstream kube-proxy in one node's namespace.
pub(super) struct KubeProxy {
    child: Child,
}

impl KubeProxy {
    pub(super) fn start(
        lab: &K8sLab,
        node: &NodeNet,
        mode: &str,
        workdir: &Path,
        n: usize,
    ) -> Result<KubeProxy, LabError> {
        let io = |what: String| move |e| LabError::Io { what, source: e };
        let cfg = workdir.join(format!("{}-kube-proxy-{n}.yaml", node.name));
        let healthz = format!("{}:{PROXY_HEALTHZ_PORT}", node.ip);
        std::fs::write(&cfg, lab.kube_proxy_config(mode, &node.name, &healthz))
            .map_err(io(format!("write {}", cfg.display())))?;
        let log_path = workdir.join(format!("{}-kube-proxy-{n}.log", node.name));
        let log = std::fs::File::create(&log_path)
            .map_err(io(format!("create {}", log_path.display())))?;
        let err = log.try_clone().map_err(io("log".into()))?;
        let child = Command::new("ip")
            .args(["netns", "exec", node.ns.name()])
            .arg(lab.dir.join("bin/kube-proxy"))
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(io("start kube-proxy".into()))?;
        Ok(KubeProxy { child })
    }

    pub(super) fn stop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn in_ns(node: &NodeNet, args: &[&str]) -> String {
    Command::new("ip")
        .args(["netns", "exec", node.ns.name()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// kube-proxy has programmed the lab Service on this node.
pub(super) fn kube_proxy_programmed(node: &NodeNet, mode: &str) -> bool {
    let needle = CLUSTER_IP;
    match mode {
        "nftables" => in_ns(node, &["nft", "list", "table", "ip", "kube-proxy"])
            .contains(&format!("{needle} . tcp . {}", SERVICE_PORT)),
        _ => in_ns(node, &["iptables-save", "-t", "nat"])
            .contains(&format!("-A KUBE-SERVICES -d {needle}/32")),
    }
}

/// What of kube-proxy's is on this node: its nftables tables (`ip`/`ip6 kube-proxy`)
/// and the iptables chains upstream's cleanup removes (IPv4 and IPv6, iptables-nft,
/// the lab's iptables), named `FAMILY TABLE/CHAIN`. An error when a listing fails: an
/// unreadable node is not a clean one.
pub(super) fn kube_proxy_objects(node: &NodeNet) -> Result<Vec<String>, LabError> {
    use kproxy_core::takeover::{XtBackend, is_kube_proxy_chain, parse_iptables_save};
    let mut left: Vec<String> = nft_tables(node)?
        .into_iter()
        .filter(|t| t == "ip kube-proxy" || t == "ip6 kube-proxy")
        .collect();
    for (family, cmd) in [
        (kproxy_core::model::IpFamily::IPv4, "iptables-save"),
        (kproxy_core::model::IpFamily::IPv6, "ip6tables-save"),
    ] {
        let text = node.ns.exec(cmd, &[])?;
        let tables = parse_iptables_save(XtBackend::Nft, family, &text)
            .map_err(|e| LabError::Invalid(format!("{cmd} in {}: {e}", node.name)))?;
        for t in tables {
            left.extend(
                t.chains
                    .iter()
                    .filter(|c| is_kube_proxy_chain(&t.name, c))
                    .map(|c| format!("{} {}/{c}", family.as_str(), t.name)),
            );
        }
    }
    Ok(left)
}

/// What a phase reports as left on its node: the objects, or why they are unknown.
pub(super) fn left_or_error(listed: Result<Vec<String>, LabError>) -> Vec<String> {
    listed.unwrap_or_else(|e| vec![format!("(could not list: {e})")])
}

/// kproxy's nftables tables on this node (`FAMILY NAME`).
pub(super) fn kproxy_tables(node: &NodeNet) -> Result<Vec<String>, LabError> {
    Ok(nft_tables(node)?
        .into_iter()
        .filter(|t| {
            t.split_once(' ')
                .is_some_and(|(_, n)| n.starts_with("kproxy"))
        })
        .collect())
}

fn nft_tables(node: &NodeNet) -> Result<Vec<String>, LabError> {
    Ok(
        kproxy_core::takeover::parse_nft_tables(&node.ns.exec("nft", &["list", "tables"])?)
            .into_iter()
            .map(|t| format!("{} {}", t.family, t.name))
            .collect(),
    )
}

/// Where the cluster and kube-proxy come from.
pub(super) enum Source {
    /// k8s-lab's API server and kcm, upstream kube-proxy.
    Real {
        lab: K8sLab,
        cp: Box<RealControlPlane>,
    },
    /// The lab's emulated control plane (each node's manifest directory) and kube-proxy
    /// as recorded.
    Recorded { dirs: Vec<PathBuf> },
}

/// kube-proxy on one node: the process, or its recorded health servers (its recorded
/// rules are in the kernel, where they stay when it stops, as real kube-proxy's do).
pub(super) enum OnNode {
    Real(KubeProxy),
    Recorded(recorded::HealthStandIn),
}

impl OnNode {
    /// SIGTERM, as a DaemonSet's pod deletion does.
    pub(super) fn stop(&mut self) {
        match self {
            OnNode::Real(k) => k.stop(),
            OnNode::Recorded(h) => h.stop(),
        }
    }
}

impl Source {
    /// kube-proxy starts on `node` (the `n`th time there).
    pub(super) fn start_kube_proxy(
        &self,
        node: &NodeNet,
        mode: &str,
        workdir: &Path,
        n: usize,
    ) -> Result<OnNode, LabError> {
        match self {
            Source::Real { lab, .. } => {
                Ok(OnNode::Real(KubeProxy::start(lab, node, mode, workdir, n)?))
            }
            // Its sync writes its rules; its health servers then answer.
            Source::Recorded { .. } => {
                recorded::load(node, mode)?;
                Ok(OnNode::Recorded(recorded::HealthStandIn::start(
                    node,
                    recorded::health_answers(node, mode)?,
                )?))
            }
        }
    }

    pub(super) fn kproxy_source<'a>(&'a self, i: usize) -> KproxySource<'a> {
        match self {
            Source::Real { lab, .. } => KproxySource::Kubeconfig(&lab.proxy_kubeconfig),
            Source::Recorded { dirs } => KproxySource::Manifests(&dirs[i]),
        }
    }
}
