//! The conntrack sysctls where users expect them, as root in network namespaces this
//! test creates: `kproxy sysctl` (deploy/'s init container) and `kproxy run` write the
//! per-namespace TCP timeouts in the namespace they run in (a node that is itself a
//! namespace, as lab/real-nodes' are), leave the machine-wide `nf_conntrack_max` to a
//! process in the host's namespace, and `kproxy sysctl` fails loudly where `/proc/sys`
//! is read-only (an unprivileged container).

#![expect(
    clippy::disallowed_types,
    reason = "waits for a real kproxy process: wall time"
)]

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Daemon, Netns, can_run};

const NF: &str = "/proc/sys/net/netfilter";

/// The value of a `/proc/sys` file as a process in `ns` reads it.
fn read_in(ns: &Netns, name: &str) -> u64 {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.0, "cat", &format!("{NF}/{name}")])
        .output()
        .expect("ip netns exec cat");
    assert!(out.status.success(), "{name}: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn read_host(name: &str) -> u64 {
    std::fs::read_to_string(format!("{NF}/{name}"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A KubeProxyConfiguration with upstream's conntrack defaults written out, and a
/// CLOSE_WAIT timeout no fresh namespace has (the kernel's default is 60 s).
fn config(dir: &std::path::Path) -> std::path::PathBuf {
    let p = dir.join("config.yaml");
    std::fs::write(
        &p,
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n\
         conntrack:\n  maxPerCore: 32768\n  min: 131072\n  tcpEstablishedTimeout: 24h0m0s\n  tcpCloseWaitTimeout: 1h0m1s\n",
    )
    .unwrap();
    p
}

fn kproxy_sysctl_in(ns: &Netns, prefix: &str, cfg: &std::path::Path) -> Output {
    Command::new("ip")
        .args(["netns", "exec", &ns.0, "sh", "-c"])
        .arg(format!(
            "{prefix}exec {} sysctl --config {}",
            env!("CARGO_BIN_EXE_kproxy"),
            cfg.display()
        ))
        .output()
        .expect("run kproxy sysctl")
}

#[test]
fn kproxy_sysctl_sets_the_timeouts_in_its_own_network_namespace() {
    if !can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let ns = Netns::new("sysctl");
    let host = (
        read_host("nf_conntrack_tcp_timeout_close_wait"),
        read_host("nf_conntrack_max"),
    );
    assert_ne!(read_in(&ns, "nf_conntrack_tcp_timeout_close_wait"), 3601);

    let out = kproxy_sysctl_in(&ns, "", &cfg);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(read_in(&ns, "nf_conntrack_tcp_timeout_close_wait"), 3601);
    assert_eq!(read_in(&ns, "nf_conntrack_tcp_timeout_established"), 86400);
    assert!(
        stdout.contains("nf_conntrack_max = ")
            && stdout.contains("left alone: machine-wide, and this is not the host's"),
        "{stdout}"
    );
    // Nothing changed outside the namespace.
    assert_eq!(
        (
            read_host("nf_conntrack_tcp_timeout_close_wait"),
            read_host("nf_conntrack_max")
        ),
        host
    );
    // A second run finds everything set.
    let again = kproxy_sysctl_in(&ns, "", &cfg);
    assert!(again.status.success(), "{again:?}");
    assert!(
        String::from_utf8_lossy(&again.stdout)
            .contains("nf_conntrack_tcp_timeout_close_wait = 3601: already set"),
        "{again:?}"
    );
}

#[test]
fn kproxy_sysctl_fails_where_proc_sys_is_read_only() {
    if !can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let ns = Netns::new("sysctlro");
    // As a container runtime mounts it for an unprivileged container (`ip netns exec`
    // runs the command in a mount namespace of its own: the host's /proc/sys stays).
    let out = kproxy_sysctl_in(&ns, "mount -o bind,ro /proc/sys /proc/sys && ", &cfg);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("not written") && stderr.contains("nf_conntrack_tcp_timeout_close_wait"),
        "{stderr}"
    );
    assert_ne!(read_in(&ns, "nf_conntrack_tcp_timeout_close_wait"), 3601);
}

#[test]
fn kproxy_run_sets_the_timeouts_in_its_own_network_namespace() {
    if !can_run() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let manifests = dir.path().join("manifests");
    std::fs::create_dir(&manifests).unwrap();
    let ns = Netns::new("sysctlrun");
    let table = format!("kpt_sysctl_{}", std::process::id());
    let _daemon = Daemon(
        ns.kproxy("run")
            .args(["--config", cfg.to_str().unwrap()])
            .args(["--manifests", manifests.to_str().unwrap()])
            .args(["--hostname-override", "node-a", "--nft-table", &table])
            .args([
                "--healthz-bind-address",
                "127.0.0.1:10256",
                "--metrics-bind-address",
                "127.0.0.1:10249",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start kproxy run"),
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while read_in(&ns, "nf_conntrack_tcp_timeout_close_wait") != 3601 {
        assert!(
            Instant::now() < deadline,
            "kproxy run did not set the CLOSE_WAIT timeout in its namespace"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(read_in(&ns, "nf_conntrack_tcp_timeout_established"), 86400);
}
