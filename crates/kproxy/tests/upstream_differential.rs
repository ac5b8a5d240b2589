//! kproxy against upstream kube-proxy v1.36, packet for packet.
//!
//! Random cluster states (the generator of `crates/nft/tests/differential.rs`, IPv4: the
//! k8s-lab API server is single-stack) go through a real kube-apiserver; upstream
//! kube-proxy (nftables mode) and `kproxy run --kubeconfig` each watch it from the node
//! namespace of their own packet fabric, with the same KubeProxyConfiguration and the
//! same Node. When both have settled, the same probes (every frontend from every traffic
//! source) go through both kernels, and every fate is judged against `kproxy trace` of
//! the same state. `trace` equals kproxy's kernel by construction and by the CI
//! differential test, so a probe where upstream's fate is not trace's is a difference
//! between kproxy and kube-proxy; each is reported with the state that produced it.
//!
//! Opt-in: needs root, and a running k8s-lab instance (`start.sh start`; kcm is not
//! needed) named by K8S_LAB, with upstream kube-proxy at `$K8S_LAB/bin/kube-proxy`.
//! CI cannot build the lab, so the test is `#[ignore]`d with that reason: `cargo test`
//! lists it as ignored, visibly, instead of passing without running (a skip printed
//! from inside a test is swallowed by the test runner's capture). Run it with
//! `--ignored`; then anything missing fails.
//!
//! K8S_LAB=../k8s-lab KPROXY_UPSTREAM_CASES=200 \
//!   cargo test -p kproxy --test upstream_differential -- --ignored --nocapture
//!
//! Cases `KPROXY_UPSTREAM_CASES` (default 10), seed `KPROXY_UPSTREAM_SEED` (default 36;
//! `random` for a fresh one); `KPROXY_UPSTREAM_REPORT=FILE` writes every difference.

#![expect(clippy::disallowed_types, reason = "waits on real clusters: wall time")]

#[path = "../../nft/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cases::{Case, case, env_count, manifests, probe_and_judge, seeded_rng};
use common::fabric::Fabric;
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kproxy_core::manifest::{self, Object};
use kproxy_lab::world::k8s::K8sLab;
use kproxy_lab::world::k8s::bridge::ApiBridge;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, TestRunner};
use serde_json::json;

const NAMESPACE: &str = "ns";
const NODE: &str = "node-a";

/// Asked for with `--ignored`: the lab must be there.
fn require_lab() -> K8sLab {
    assert!(
        std::env::var_os("K8S_LAB").is_some(),
        "set K8S_LAB to a running k8s-lab instance (start.sh start) to compare kproxy with upstream kube-proxy"
    );
    assert!(
        kproxy_lab::is_root(),
        "K8S_LAB is set but the test is not root (network namespaces, nftables)"
    );
    let lab = K8sLab::from_env().expect("K8S_LAB names a k8s-lab instance");
    assert!(
        lab.dir.join("bin/kube-proxy").exists(),
        "{}: no bin/kube-proxy (setup.sh builds it)",
        lab.dir.display()
    );
    lab
}

/// What the lab's API server can hold: both families only when its service CIDRs
/// have an IPv6 range (k8s-lab's start.sh configures IPv4 only), the service CIDRs it
/// publishes as ServiceCIDRs (kube-proxy always learns them, so kproxy's trace must
/// too), source ranges only where the API allows them (type LoadBalancer).
fn for_api(mut c: Case, dual_stack: bool) -> Case {
    c.service_cidrs = true;
    c.ipv4_only = !dual_stack;
    for s in &mut c.services {
        if !dual_stack {
            s.v4 = true;
            s.v6 = false;
        }
        if s.kind != 2 {
            s.source_ranges.clear();
        }
    }
    c
}

/// The KubeProxyConfiguration both proxies read.
fn proxy_config(c: &Case, kubeconfig: &Path) -> String {
    let (mode, extra) = match c.detector {
        0 => ("ClusterCIDR", String::new()),
        1 => (
            "ClusterCIDR",
            "clusterCIDR: 10.244.0.0/16,fd00:244::/32\n".to_string(),
        ),
        2 => ("NodeCIDR", String::new()),
        3 => (
            "InterfaceNamePrefix",
            "detectLocal: {interfaceNamePrefix: kpv}\n".to_string(),
        ),
        _ => (
            "BridgeInterface",
            "detectLocal: {bridgeInterface: kpva}\n".to_string(),
        ),
    };
    let npa = match &c.node_port_cidrs {
        None => String::new(),
        Some(ix) => format!(
            "nodePortAddresses: [{}]\n",
            ix.iter()
                .map(|&i| format!("\"{}\"", common::cases::NP_CIDRS[i]))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    format!(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
hostnameOverride: {NODE}
clientConnection: {{kubeconfig: {}}}
nftables: {{masqueradeAll: {}, syncPeriod: 30s, minSyncPeriod: 0s}}
conntrack: {{maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}}
detectLocalMode: {mode}
{extra}{npa}",
        kubeconfig.display(),
        c.masquerade_all
    )
}

/// A proxy process in a fabric's node namespace; killed (and its tables removed) on drop.
struct Proxy {
    child: Child,
    ns: String,
    tables: &'static str,
}

impl Proxy {
    fn start(ns: &str, argv: &[&str], log: &Path, tables: &'static str) -> Proxy {
        let log = std::fs::File::create(log).expect("proxy log");
        let child = Command::new("ip")
            .args(["netns", "exec", ns])
            .args(argv)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn proxy");
        Proxy {
            child,
            ns: ns.to_string(),
            tables,
        }
    }

    /// Both families' tables, without counters or timeouts: what "settled" compares.
    fn ruleset(&self) -> String {
        let mut out = String::new();
        for fam in ["ip", "ip6"] {
            let o = Command::new("ip")
                .args(["netns", "exec", &self.ns, "nft", "-s", "list", "table", fam])
                .arg(self.tables)
                .output()
                .expect("nft list");
            out += &String::from_utf8_lossy(&o.stdout);
        }
        out
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for fam in ["ip", "ip6"] {
            let _ = Command::new("ip")
                .args(["netns", "exec", &self.ns, "nft", "delete", "table", fam])
                .arg(self.tables)
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Waits until every proxy's ruleset is non-empty and unchanged for `quiet`.
fn settle(proxies: &mut [&mut Proxy], quiet: Duration, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    let mut last: Vec<(String, Instant)> = proxies
        .iter()
        .map(|p| (p.ruleset(), Instant::now()))
        .collect();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let mut all = true;
        for (p, (seen, since)) in proxies.iter_mut().zip(last.iter_mut()) {
            if let Some(st) = p.exited() {
                return Err(format!("{} exited: {st}", p.tables));
            }
            let now = p.ruleset();
            if now != *seen || now.is_empty() {
                *seen = now;
                *since = Instant::now();
            }
            all &= !seen.is_empty() && since.elapsed() >= quiet;
        }
        if all {
            return Ok(());
        }
        if start.elapsed() > limit {
            return Err(format!("rules not settled within {limit:?}"));
        }
    }
}

/// Retries `f` while the API says an address or port is still held by the previous
/// case's objects (the allocators release them shortly after deletion).
async fn retry<T>(
    what: &str,
    mut f: impl AsyncFnMut() -> Result<T, kube::Error>,
) -> Result<T, String> {
    let start = Instant::now();
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(kube::Error::Api(s))
                if (s.code == 422 || s.code == 409)
                    && start.elapsed() < Duration::from_secs(20) =>
            {
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => return Err(format!("{what}: {e}")),
        }
    }
}

/// Replaces the namespace's Services and EndpointSlices and node-a's addresses with
/// the case's.
async fn apply(client: &kube::Client, c: &Case) -> Result<(), String> {
    let svcs: Api<Service> = Api::namespaced(client.clone(), NAMESPACE);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NAMESPACE);
    let nodes: Api<Node> = Api::all(client.clone());
    let lp = ListParams::default();
    let dp = DeleteParams::default();
    svcs.delete_collection(&dp, &lp)
        .await
        .map_err(|e| format!("delete Services: {e}"))?;
    slices
        .delete_collection(&dp, &lp)
        .await
        .map_err(|e| format!("delete EndpointSlices: {e}"))?;
    let start = Instant::now();
    while !svcs
        .list(&lp)
        .await
        .map_err(|e| format!("list Services: {e}"))?
        .items
        .is_empty()
    {
        if start.elapsed() > Duration::from_secs(20) {
            return Err("Services not gone after 20 s".into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let parsed = manifest::parse("case.yaml", &manifests(c));
    if !parsed.errors.is_empty() {
        return Err(format!("{:?}", parsed.errors));
    }
    let pp = PostParams::default();
    for o in parsed.objects {
        match o.object {
            Object::Node(n) => {
                let status = json!({"status": {"addresses": n.status.as_ref().and_then(|s| s.addresses.clone())}});
                nodes
                    .patch_status(NODE, &PatchParams::default(), &Patch::Merge(&status))
                    .await
                    .map_err(|e| format!("Node status: {e}"))?;
            }
            Object::Service(s) => {
                let name = s.metadata.name.clone().unwrap_or_default();
                let lb = s
                    .status
                    .as_ref()
                    .and_then(|st| st.load_balancer.clone())
                    .filter(|lb| lb.ingress.as_ref().is_some_and(|i| !i.is_empty()));
                let mut s = *s;
                s.status = None;
                retry(&format!("create Service {name}"), async || {
                    svcs.create(&pp, &s).await
                })
                .await?;
                if let Some(lb) = lb {
                    let p = json!({"status": {"loadBalancer": lb}});
                    svcs.patch_status(&name, &PatchParams::default(), &Patch::Merge(&p))
                        .await
                        .map_err(|e| format!("Service {name} status: {e}"))?;
                }
            }
            Object::EndpointSlice(e) => {
                let name = e.metadata.name.clone().unwrap_or_default();
                slices
                    .create(&pp, &e)
                    .await
                    .map_err(|e| format!("create EndpointSlice {name}: {e}"))?;
            }
            Object::ServiceCidr(_) => {}
        }
    }
    Ok(())
}

/// The namespace and node-a (its podCIDRs are set once; addresses change per case);
/// whether the API server serves both families (its default ServiceCIDR has an IPv6
/// range).
async fn prepare(client: &kube::Client) -> Result<bool, String> {
    let cidrs: Api<ServiceCIDR> = Api::all(client.clone());
    let default = cidrs
        .get("kubernetes")
        .await
        .map_err(|e| format!("get ServiceCIDR kubernetes: {e}"))?;
    let dual_stack = default
        .spec
        .and_then(|s| s.cidrs)
        .unwrap_or_default()
        .iter()
        .any(|c| c.contains(':'));
    let nsapi: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let ns = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).expect("ns");
    match nsapi.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => return Err(format!("create namespace {NAMESPACE}: {e}")),
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let node = serde_json::from_value(json!({
        "metadata": {"name": NODE},
        "spec": {"podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24", "fd00:244:1::/64"]}
    }))
    .expect("node");
    match nodes.create(&PostParams::default(), &node).await {
        Ok(_) => Ok(dual_stack),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(dual_stack),
        Err(e) => Err(format!("create Node {NODE}: {e}")),
    }
}

fn cases() -> u32 {
    env_count("KPROXY_UPSTREAM_CASES", 10)
}

fn runner() -> TestRunner {
    TestRunner::new_with_rng(Config::default(), seeded_rng("KPROXY_UPSTREAM_SEED", 36))
}

/// Where the case's config and both proxies' logs go (kept when a case differs).
fn work_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("kproxy-upstream-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("work dir");
    d
}

#[test]
#[ignore = "needs K8S_LAB (a k8s-lab instance: start.sh start) with bin/kube-proxy, and root; run with --ignored"]
fn upstream_kube_proxy_meets_the_fate_kproxy_trace_predicts() {
    let lab = require_lab();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let client = rt
        .block_on(kproxy_lab::world::k8s::client(&lab))
        .expect("lab client");
    let dual_stack = rt.block_on(prepare(&client)).expect("prepare");
    eprintln!(
        "upstream differential: {}",
        if dual_stack {
            "dual-stack API server: IPv4, IPv6 and dual-stack Services"
        } else {
            "IPv4 API server: IPv4 Services only"
        }
    );
    let upstream = Arc::new(Fabric::new());
    let ours = Arc::new(Fabric::new());
    let _bridges = {
        let _g = rt.enter();
        [
            ApiBridge::start(&upstream.node.name, lab.api_port).expect("bridge"),
            ApiBridge::start(&ours.node.name, lab.api_port).expect("bridge"),
        ]
    };
    let dir = work_dir();
    let kube_proxy = lab.dir.join("bin/kube-proxy");
    let kproxy = env!("CARGO_BIN_EXE_kproxy");
    let mut runner = runner();
    let strategy = case();
    let mut probes = 0usize;
    let mut differences: Vec<String> = Vec::new();
    let mut kproxy_mismatches: Vec<String> = Vec::new();
    let started = Instant::now();
    // KPROXY_UPSTREAM_ONLY=3,8: run only these cases of the seed's sequence.
    let only: Option<Vec<u32>> = std::env::var("KPROXY_UPSTREAM_ONLY")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect());
    for n in 0..cases() {
        let c = for_api(
            strategy.new_tree(&mut runner).expect("case").current(),
            dual_stack,
        );
        if only.as_ref().is_some_and(|o| !o.contains(&n)) {
            continue;
        }
        rt.block_on(apply(&client, &c))
            .unwrap_or_else(|e| panic!("case {n}: {e}\nstate:\n{}", manifests(&c)));
        let cfg = dir.join("config.yaml");
        std::fs::write(&cfg, proxy_config(&c, &lab.proxy_kubeconfig)).expect("config");
        let cfg = cfg.to_str().expect("utf-8 path");
        let mut up = Proxy::start(
            &upstream.node.name,
            &[kube_proxy.to_str().expect("path"), "--config", cfg, "--v=2"],
            &dir.join(format!("kube-proxy-{n}.log")),
            "kube-proxy",
        );
        let mut kp = Proxy::start(
            &ours.node.name,
            &[kproxy, "run", "--config", cfg],
            &dir.join(format!("kproxy-{n}.log")),
            "kproxy",
        );
        if let Err(e) = settle(
            &mut [&mut up, &mut kp],
            Duration::from_millis(1500),
            Duration::from_secs(60),
        ) {
            panic!(
                "case {n}: {e}; logs in {}\nstate:\n{}",
                dir.display(),
                manifests(&c)
            );
        }
        let (np, up_fails) = probe_and_judge(&upstream, &c).expect("valid state");
        let (_, kp_fails) = probe_and_judge(&ours, &c).expect("valid state");
        probes += np;
        if !up_fails.is_empty() || !kp_fails.is_empty() {
            let cfg_text = std::fs::read_to_string(cfg).unwrap_or_default();
            let rules = up.ruleset();
            differences.extend(up_fails.iter().map(|f| {
                format!(
                    "case {n}: upstream: {f}\n--- state ---\n{}--- config ---\n{cfg_text}--- kube-proxy's rules ---\n{rules}",
                    manifests(&c)
                )
            }));
            kproxy_mismatches.extend(kp_fails.iter().map(|f| {
                format!(
                    "case {n}: kproxy: {f}\n--- state ---\n{}--- config ---\n{cfg_text}",
                    manifests(&c)
                )
            }));
        }
        eprintln!(
            "case {n}: {np} probes, upstream differs {}, kproxy differs {} ({:.0} s)",
            up_fails.len(),
            kp_fails.len(),
            started.elapsed().as_secs_f64()
        );
        // KPROXY_UPSTREAM_HOLD=SECONDS: keep both proxies and fabrics up after a
        // differing case, to look inside (`ip netns exec NODE nft list ruleset`).
        if (!up_fails.is_empty() || !kp_fails.is_empty())
            && let Some(hold) = std::env::var("KPROXY_UPSTREAM_HOLD")
                .ok()
                .and_then(|v| v.parse().ok())
        {
            eprintln!(
                "holding {hold} s: upstream node {}, kproxy node {}, pods {:?}, client {}",
                upstream.node.name,
                ours.node.name,
                upstream.pods.iter().map(|p| &p.2.name).collect::<Vec<_>>(),
                upstream.client.name
            );
            std::thread::sleep(Duration::from_secs(hold));
        }
        drop(up);
        drop(kp);
    }
    let summary = format!(
        "upstream differential: {} states, {probes} probes per proxy; upstream ≠ trace: {}; kproxy ≠ trace: {}",
        cases(),
        differences.len(),
        kproxy_mismatches.len()
    );
    eprintln!("{summary}");
    if let Ok(path) = std::env::var("KPROXY_UPSTREAM_REPORT") {
        let body = format!(
            "{summary}\n\n{}\n\n{}",
            differences.join("\n\n"),
            kproxy_mismatches.join("\n\n")
        );
        std::fs::write(&path, body).expect("write report");
    }
    if differences.is_empty() && kproxy_mismatches.is_empty() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    assert!(
        differences.is_empty() && kproxy_mismatches.is_empty(),
        "{summary}\n{}\n{}",
        differences.join("\n\n"),
        kproxy_mismatches.join("\n\n")
    );
}
