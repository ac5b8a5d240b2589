//! Shared test helpers: plans through the real manifest → ingest → plan path, and
//! network namespaces (created with `ip netns`, removed by a Drop guard even on panic).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use kproxy_core::ingest::Ownership;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::{ClusterState, NodePlan, PlanConfig, Planner, manifest};
use serde_json::Value;

pub mod cases;
pub mod fabric;

/// Whether a root-only test can run (the policy of `kproxy_test_support::root`).
pub fn root() -> bool {
    kproxy_test_support::root("network namespaces, nftables")
}

/// The dataplane settings of the tests that program tables of their own: the defaults,
/// without the stale-UDP conntrack cleanup after each sync.
pub fn no_conntrack_cleanup() -> kproxy_nft::DataplaneConfig {
    kproxy_nft::DataplaneConfig {
        conntrack_cleanup: false,
        ..kproxy_nft::DataplaneConfig::default()
    }
}

/// Cluster-CIDR local traffic detection with two CIDRs a family, not adjacent (nft's
/// auto-merge would join adjacent ones): the `local-pods` interval set.
pub fn two_cluster_cidrs_a_family() -> kproxy_core::config::LocalDetectorConfig {
    kproxy_core::config::LocalDetectorConfig::ClusterCidr(
        [
            "10.244.0.0/16",
            "10.250.0.0/16",
            "fd00:244::/48",
            "fd00:250::/48",
        ]
        .iter()
        .map(|c| c.parse().unwrap())
        .collect(),
    )
}

/// Verifies `dp` and asserts that it found drift naming each of `named` (`map
/// service-ips`, `chain services`); answers the report for further checks.
pub fn assert_drift(dp: &mut kproxy_nft::Dataplane, named: &[&str]) -> kproxy_nft::VerifyReport {
    let v = dp.verify().unwrap();
    assert!(v.drift, "{v:?}");
    for name in named {
        assert!(
            v.differences.iter().any(|d| d == name),
            "{name} not in {:?}",
            v.differences
        );
    }
    v
}

pub fn state_from_yaml(text: &str, node: &str) -> ClusterState {
    let parsed = manifest::parse("test.yaml", text);
    assert!(parsed.errors.is_empty(), "{:?}", parsed.errors);
    let mut st = ClusterState::new();
    for o in &parsed.objects {
        let warnings = st
            .apply(&o.object, &Ownership::default(), node)
            .expect("valid object");
        assert!(warnings.is_empty(), "{warnings:?}");
    }
    st
}

pub fn plan_from_yaml(text: &str, node: &str, cfg: &PlanConfig) -> NodePlan {
    kproxy_core::plan(&state_from_yaml(text, node), node, cfg)
}

/// A cluster moving from manifest to manifest as `kproxy run` sees it: one
/// `ClusterState` relisted with each step's objects, and the planner's update of each
/// step (what the sync loop hands the dataplane).
pub struct Moving {
    node: String,
    state: ClusterState,
    planner: Planner,
}

impl Moving {
    pub fn new(node: &str, cfg: &PlanConfig) -> Moving {
        Moving {
            node: node.to_string(),
            state: ClusterState::new(),
            planner: Planner::new(node, cfg.clone()),
        }
    }

    /// The cluster is now `text`'s objects: the plan and what changed.
    pub fn step(&mut self, text: &str) -> (&NodePlan, PlanUpdate) {
        self.state.replace(state_from_yaml(text, &self.node));
        let update = self.planner.update(&mut self.state);
        (self.planner.plan(), update)
    }
}

pub fn example_cluster() -> String {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/cluster");
    let mut text = String::new();
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .expect("examples/cluster")
        .map(|e| e.expect("entry").path())
        .collect();
    names.sort();
    for p in names {
        if p.extension().is_some_and(|e| e == "yaml" || e == "json") {
            text += &std::fs::read_to_string(&p).expect("read example");
            text += "\n---\n";
        }
    }
    text
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A network namespace named `kpnft-<pid>-<n>-<tag>`, deleted on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let name = format!("kpn{}-{n}{tag}", std::process::id());
        sh(&format!("ip netns add {name}"));
        let ns = Netns { name };
        // No duplicate address detection: fresh IPv6 addresses (link-local ones too)
        // would stay tentative for a second and make the first probes time out.
        ns.exec("sysctl -qw net.ipv6.conf.all.accept_dad=0 && sysctl -qw net.ipv6.conf.default.accept_dad=0 && ip link set lo up");
        ns
    }

    /// Runs a shell command inside the namespace; panics on failure.
    pub fn exec(&self, cmd: &str) -> String {
        sh(&format!("ip netns exec {} sh -c '{}'", self.name, cmd))
    }

    /// Runs `f` on a fresh thread that has entered this namespace. Sockets created there
    /// stay in this namespace.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let name = self.name.clone();
        std::thread::spawn(move || {
            kproxy_test_support::netns::enter(&name);
            f()
        })
        .join()
        .expect("netns thread panicked")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        kproxy_test_support::netns::del(&self.name);
    }
}

pub fn sh(cmd: &str) -> String {
    kproxy_test_support::run(Command::new("sh").arg("-c").arg(cmd))
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

/// A table read back from the kernel, reduced to what kproxy decides: per object
/// (`chain NAME` / `set NAME` / `map NAME`) its content without handles, table names or
/// hook parameters, with set elements sorted and the contents of dynamic sets left out
/// (the kernel fills those from traffic).
pub fn normalize(json: &Value) -> BTreeMap<String, Value> {
    let mut out: BTreeMap<String, Value> = BTreeMap::new();
    let Some(items) = json.get("nftables").and_then(|v| v.as_array()) else {
        return out;
    };
    for item in items {
        let Some(obj) = item.as_object() else {
            continue;
        };
        for (kind, body) in obj {
            match kind.as_str() {
                "chain" => {
                    let name = body["name"].as_str().unwrap_or_default().to_string();
                    out.entry(format!("chain {name}"))
                        .or_insert_with(|| Value::Array(Vec::new()));
                }
                "rule" => {
                    let name = body["chain"].as_str().unwrap_or_default().to_string();
                    let entry = out
                        .entry(format!("chain {name}"))
                        .or_insert_with(|| Value::Array(Vec::new()));
                    if let Value::Array(rules) = entry {
                        rules.push(body["expr"].clone());
                    }
                }
                "set" | "map" => {
                    let name = body["name"].as_str().unwrap_or_default().to_string();
                    let mut b = body.clone();
                    if let Some(m) = b.as_object_mut() {
                        m.remove("handle");
                        m.remove("table");
                        m.remove("family");
                        // nft 1.0.6 lists `flags dynamic,timeout` as just `timeout`.
                        let dynamic = m.get("flags").and_then(|f| f.as_array()).is_some_and(|f| {
                            f.iter()
                                .any(|x| matches!(x.as_str(), Some("dynamic" | "timeout")))
                        });
                        if dynamic {
                            m.remove("elem");
                        } else if let Some(Value::Array(e)) = m.get_mut("elem") {
                            e.sort_by_key(|v| v.to_string());
                        }
                    }
                    out.insert(format!("{kind} {name}"), b);
                }
                _ => {}
            }
        }
    }
    out
}

/// `ip netns exec NS nft ARGS` (with `input` as the file `-f` reads when given): its
/// stdout, after checking it succeeded and wrote nothing to stderr.
pub fn nft_in(ns: &Netns, args: &[&str], input: Option<&str>) -> String {
    let mut cmd = std::process::Command::new("ip");
    cmd.args(["netns", "exec", &ns.name, "nft"]).args(args);
    cmd.env("LC_ALL", "C");
    let out = match input {
        Some(text) => {
            use std::io::Write;
            let mut child = cmd
                .arg("-f")
                .arg("-")
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("run nft");
            child
                .stdin
                .take()
                .expect("piped")
                .write_all(text.as_bytes())
                .expect("write to nft");
            child.wait_with_output().expect("nft")
        }
        None => cmd.output().expect("run nft"),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.is_empty(),
        "nft {args:?}: {}: {stderr}",
        out.status
    );
    String::from_utf8(out.stdout).expect("nft writes UTF-8")
}
