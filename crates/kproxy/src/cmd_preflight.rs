//! `kproxy preflight`: run on a node (as root, in the node's network namespace, as
//! `kproxy run` would be) before kproxy is installed there; checks what kproxy needs
//! and says what is missing, one line per check, exit 0 when no check fails, 1
//! otherwise.
//!
//! The nftables checks program real tables: each feature kproxy's rules use is a small
//! plan (a Service of one kind) synced by kproxy's own dataplane (`kproxy_nft`, over
//! nfnetlink, no `nft` binary) into a table of its own in a scratch network namespace
//! made for the check, so the node's rules are never touched and a refusal names the
//! feature. The verdicts are pure functions below ([`kernel_check`], [`nofile_check`],
//! [`sysctl_check`], [`kube_proxy_check`], [`feature_check`], [`rbac_check`],
//! [`protobuf_check`]); the rest reads the node and the API server.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use kproxy_config::{ConfigFlags, ConntrackSysctl, ProxyConfig};
use kproxy_core::planner::PlanUpdate;
use kproxy_core::takeover::{self, Decision, Liveness, RemovalPlan, TakeoverMode};
use kproxy_nft::{Dataplane, DataplaneConfig, Family, KernelTable, NftError};

use crate::cluster::CallFlags;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The node agent's configuration (`--config FILE` and kube-proxy's flags), as
    /// `kproxy run` will get it: the sysctls, ports and API server it names are the
    /// ones checked. With `--kubeconfig`, the API server is checked too.
    #[command(flatten)]
    pub config: ConfigFlags,
    /// The kubeconfig context to use instead of its current context.
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
    /// `--kube-proxy-takeover` as `kproxy run` will get it: what the takeover line
    /// says kproxy will do with kube-proxy's rules.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = crate::cmd_run::takeover_parser())]
    pub kube_proxy_takeover: TakeoverMode,
    #[command(flatten)]
    pub calls: CallFlags,
}

/// A check's verdict. Only `Fail` makes the exit status 1: a warning is something an
/// operator should know that does not stop kproxy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

/// One line of the report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    pub name: String,
    pub status: Status,
    pub detail: String,
}

impl Check {
    fn new(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Check {
        Check {
            name: name.into(),
            status,
            detail: detail.into(),
        }
    }

    /// `ok   name: detail`, `WARN …`, `FAIL …`.
    pub fn line(&self) -> String {
        let word = match self.status {
            Status::Ok => "ok  ",
            Status::Warn => "WARN",
            Status::Fail => "FAIL",
        };
        format!("{word} {}: {}", self.name, self.detail)
    }
}

/// The kernel release below which the takeover line warns: upstream kube-proxy's
/// nftables mode needs 5.13. kproxy's own floor is what the feature checks find, so
/// an older kernel warns rather than fails.
pub const KERNEL_WARN_BELOW: (u32, u32) = (5, 13);

/// `uname -r` (`6.18.44-foo`) against [`KERNEL_WARN_BELOW`].
pub fn kernel_check(release: &str) -> Check {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next(), parts.next());
    match (major, minor) {
        (Some(a), Some(b)) if (a, b) >= KERNEL_WARN_BELOW => {
            Check::new("kernel", Status::Ok, format!("Linux {release}"))
        }
        (Some(_), Some(_)) => Check::new(
            "kernel",
            Status::Warn,
            format!(
                "Linux {release}: older than {}.{} (upstream kube-proxy's nftables mode needs it); the nf_tables checks below say whether kproxy's rules load",
                KERNEL_WARN_BELOW.0, KERNEL_WARN_BELOW.1
            ),
        ),
        _ => Check::new(
            "kernel",
            Status::Warn,
            format!("cannot read a version from the release {release:?}"),
        ),
    }
}

/// RLIMIT_NOFILE (soft, hard) against what `kproxy run` wants: it raises the soft
/// limit to the hard one at start, so the hard limit is what counts.
pub fn nofile_check(soft: u64, hard: u64, wanted: u64) -> Check {
    let name = "RLIMIT_NOFILE";
    if hard >= wanted {
        Check::new(
            name,
            Status::Ok,
            format!(
                "soft {soft}, hard {hard}: kproxy run raises the soft limit to the hard one, {wanted} wanted"
            ),
        )
    } else {
        Check::new(
            name,
            Status::Warn,
            format!(
                "hard limit {hard} is below the {wanted} descriptors kproxy run wants for its servers under a flood (it starts, and warns; raise LimitNOFILE or the container runtime's limit)"
            ),
        )
    }
}

/// What preflight found of one sysctl kproxy will set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysctlState {
    pub sysctl: ConntrackSysctl,
    /// The value now (None: unreadable, e.g. the conntrack module not loaded yet).
    pub current: Option<u64>,
    /// This process is in the host's network namespace (machine-wide settings are
    /// written only from there).
    pub host_netns: bool,
    /// `access(W_OK)`: None when writable, else why not.
    pub not_writable: Option<String>,
}

/// One sysctl: already as wanted, or writable by kproxy (`kproxy run` or deploy/'s
/// init container `kproxy sysctl`), or neither.
pub fn sysctl_check(s: &SysctlState) -> Check {
    let name = format!("sysctl {}", s.sysctl.path.trim_start_matches("/proc/sys/"));
    let want = s.sysctl.value;
    if s.current.is_some_and(|v| s.sysctl.satisfied_by(v)) {
        return Check::new(
            name,
            Status::Ok,
            format!(
                "{} already (kproxy wants {want})",
                s.current.unwrap_or(want)
            ),
        );
    }
    let now = s
        .current
        .map_or_else(|| "unreadable".to_string(), |v| v.to_string());
    if !s.sysctl.writable_from(s.host_netns) {
        return Check::new(
            name,
            Status::Warn,
            format!(
                "{now}, kproxy wants {want}: machine-wide, written only from the host's network namespace, and this is not it (kproxy leaves it)"
            ),
        );
    }
    match &s.not_writable {
        None => Check::new(
            name,
            Status::Ok,
            format!("{now}, kproxy will set {want} (writable here)"),
        ),
        Some(why) => Check::new(
            name,
            Status::Fail,
            format!(
                "{now}, kproxy wants {want} and may not write it ({why}): run `kproxy sysctl` in a privileged init container (deploy/), or set it on the node"
            ),
        ),
    }
}

/// The kube-proxy line: what of kube-proxy's is on the node (its modes, from its tables
/// and chains), whether one runs, and what the takeover will do under `mode`.
pub fn kube_proxy_check(plan: &RemovalPlan, live: &Liveness, mode: TakeoverMode) -> Check {
    let name = "kube-proxy";
    if plan.is_empty() {
        let detail = if live.live() {
            format!(
                "no rules of kube-proxy on the node, but {}: it will program them; kproxy then takes over as below",
                live.reason()
            )
        } else {
            "none on the node (no kube-proxy tables, chains or IPVS objects; none running)"
                .to_string()
        };
        return Check::new(name, Status::Ok, detail);
    }
    let steps: Vec<String> = plan.steps.iter().map(|s| s.describe()).collect();
    let found = format!(
        "{} mode rules on the node ({})",
        plan.found.modes().join(" and "),
        steps.join("; ")
    );
    let (status, what) = match takeover::decide(mode, plan, live) {
        Decision::Nothing => (Status::Ok, "nothing to do".to_string()),
        Decision::Remove => (
            Status::Ok,
            format!(
                "no kube-proxy runs: kproxy run will program its own tables first, then remove exactly these ({} steps, what `kube-proxy --cleanup` removes)",
                plan.steps.len()
            ),
        ),
        Decision::WaitForKubeProxy { why } => (
            Status::Warn,
            format!(
                "{why}: kproxy run will program its own tables (they decide first) and leave these until kube-proxy stops, then remove them; stop kube-proxy on this node (docs/migrate.md)"
            ),
        ),
        Decision::LeaveToOperator => (
            Status::Warn,
            "--kube-proxy-takeover=off: kproxy will leave them; remove them with `kube-proxy --cleanup`".to_string(),
        ),
    };
    Check::new(name, status, format!("{found}; {what}"))
}

/// One nftables feature kproxy's rules use, as a plan kproxy's dataplane programs: the
/// scratch node and, but for the first (the empty table), one Service of the kind that
/// needs the feature.
pub struct Feature {
    pub name: &'static str,
    /// What kproxy needs it for, and the kernel pieces it loads.
    pub what: &'static str,
    /// The Service's spec fields besides its cluster IP and port (YAML flow mapping
    /// entries); None: no Service.
    pub spec: Option<&'static str>,
    /// Its port's protocol, and its node port (0: none).
    pub protocol: &'static str,
    pub node_port: u16,
    /// Its `status` (YAML), and how many ready endpoints on the scratch node it has.
    pub status: &'static str,
    pub endpoints: usize,
}

/// The scratch node every feature's plan is made for.
const NODE: &str = "preflight";
const NODE_YAML: &str = "apiVersion: v1
kind: Node
metadata: {name: preflight}
spec: {podCIDR: 10.244.0.0/24, podCIDRs: [10.244.0.0/24]}
status: {addresses: [{type: InternalIP, address: 10.0.0.1}]}
";

/// A feature with a Service of `spec`, TCP, no node port, no status, two endpoints.
const fn service(name: &'static str, what: &'static str, spec: &'static str) -> Feature {
    Feature {
        name,
        what,
        spec: Some(spec),
        protocol: "TCP",
        node_port: 0,
        status: "{}",
        endpoints: 2,
    }
}

/// The features, in the order a table needs them.
pub const FEATURES: [Feature; 7] = [
    Feature {
        spec: None,
        ..service(
            "nf_tables",
            "tables in both families, nat chains at kproxy's hooks, masquerade (nf_tables, nft_chain_nat, nft_masq)",
            "",
        )
    },
    service(
        "nftables maps",
        "a ClusterIP Service: concatenated verdict maps, numgen dispatch, DNAT (nft_numgen, nft_nat)",
        "",
    ),
    Feature {
        node_port: 30001,
        ..service(
            "nftables fib",
            "a NodePort Service: `fib daddr type local` for the node's addresses (nft_fib)",
            "type: NodePort, externalTrafficPolicy: Cluster",
        )
    },
    Feature {
        node_port: 30002,
        status: "{loadBalancer: {ingress: [{ip: 203.0.113.10}]}}",
        ..service(
            "nftables interval sets",
            "loadBalancerSourceRanges: interval sets of prefixes",
            "type: LoadBalancer, externalTrafficPolicy: Cluster, loadBalancerSourceRanges: [198.51.100.0/24, 192.0.2.0/25]",
        )
    },
    service(
        "nftables dynamic sets",
        "sessionAffinity ClientIP: sets with timeouts updated from the packet path (nft_dynset)",
        "sessionAffinity: ClientIP, sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}",
    ),
    Feature {
        endpoints: 0,
        ..service(
            "nftables reject",
            "a Service without endpoints: reject (nft_reject_inet)",
            "",
        )
    },
    Feature {
        protocol: "UDP",
        endpoints: 1,
        ..service(
            "conntrack netlink",
            "a UDP Service: the stale-flow cleanup dumps and deletes conntrack entries over ctnetlink (nf_conntrack_netlink)",
            "",
        )
    },
];

impl Feature {
    /// The scratch node and this feature's Service (the `i`-th feature's cluster IP
    /// 10.96.0.i) with its EndpointSlice, as manifests.
    pub fn manifests(&self, i: usize) -> String {
        let Some(spec) = self.spec else {
            return NODE_YAML.to_string();
        };
        let (proto, ip) = (self.protocol, format!("10.96.0.{}", i + 1));
        let node_port = match self.node_port {
            0 => String::new(),
            p => format!(", nodePort: {p}"),
        };
        let extra = if spec.is_empty() {
            String::new()
        } else {
            format!(", {spec}")
        };
        let mut y = format!(
            "{NODE_YAML}---
apiVersion: v1
kind: Service
metadata: {{name: f{i}, namespace: preflight}}
spec: {{clusterIP: {ip}, clusterIPs: [{ip}], ipFamilies: [IPv4], ports: [{{name: p, protocol: {proto}, port: 80, targetPort: 8080{node_port}}}]{extra}}}
status: {}
",
            self.status
        );
        if self.endpoints > 0 {
            y += &format!(
                "---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: f{i}-1, namespace: preflight, labels: {{kubernetes.io/service-name: f{i}}}}}
addressType: IPv4
ports: [{{name: p, protocol: {proto}, port: 8080}}]
endpoints:
"
            );
            for e in 0..self.endpoints {
                y += &format!(
                    "- {{addresses: [10.244.0.{}], conditions: {{ready: true, serving: true, terminating: false}}, nodeName: preflight}}\n",
                    e + 5
                );
            }
        }
        y
    }
}

/// A feature's line from what its sync answered (`Ok`: the rules the kernel holds
/// afterwards, per family).
pub fn feature_check(f: &Feature, result: &Result<usize, String>) -> Check {
    match result {
        Ok(rules) => Check::new(
            f.name,
            Status::Ok,
            format!("{} ({rules} rules programmed and read back)", f.what),
        ),
        Err(e) => Check::new(f.name, Status::Fail, format!("{}: {e}", f.what)),
    }
}

/// One access kproxy needs: (API group, resource, verb).
pub type Access = (&'static str, &'static str, &'static str);

/// The API access kproxy needs (deploy/rbac.yaml's ClusterRole).
pub const ACCESS: [Access; 10] = [
    ("", "services", "list"),
    ("", "services", "watch"),
    ("", "nodes", "list"),
    ("", "nodes", "watch"),
    ("discovery.k8s.io", "endpointslices", "list"),
    ("discovery.k8s.io", "endpointslices", "watch"),
    ("networking.k8s.io", "servicecidrs", "list"),
    ("networking.k8s.io", "servicecidrs", "watch"),
    ("", "events", "create"),
    ("events.k8s.io", "events", "create"),
];

/// The RBAC line from the SelfSubjectAccessReviews' answers (`Ok(allowed)` per
/// [`ACCESS`] entry, or why the review failed).
pub fn rbac_check(answers: &[(Access, Result<bool, String>)]) -> Check {
    let name = "RBAC";
    let word = |(g, r, v): &Access| {
        if g.is_empty() {
            format!("{v} {r}")
        } else {
            format!("{v} {r}.{g}")
        }
    };
    let denied: Vec<String> = answers
        .iter()
        .filter(|(_, a)| matches!(a, Ok(false)))
        .map(|(k, _)| word(k))
        .collect();
    let failed: Vec<String> = answers
        .iter()
        .filter_map(|(k, a)| a.as_ref().err().map(|e| format!("{}: {e}", word(k))))
        .collect();
    if !failed.is_empty() {
        return Check::new(
            name,
            Status::Fail,
            format!(
                "cannot ask the API server (SelfSubjectAccessReview): {}",
                failed.join("; ")
            ),
        );
    }
    if denied.is_empty() {
        Check::new(
            name,
            Status::Ok,
            format!(
                "these credentials may {} (SelfSubjectAccessReview)",
                answers
                    .iter()
                    .map(|(k, _)| word(k))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    } else {
        Check::new(
            name,
            Status::Fail,
            format!(
                "these credentials may not {}: deploy/rbac.yaml's ClusterRole grants what kproxy needs",
                denied.join(", ")
            ),
        )
    }
}

/// The protobuf line from the Content-Type of a list asked for as protobuf first.
pub fn protobuf_check(content_type: Option<&str>) -> Check {
    let name = "API protobuf";
    match content_type {
        Some(t) if t.starts_with(kproxy_source::kube::proto::MEDIA_TYPE) => Check::new(
            name,
            Status::Ok,
            format!("the API server answers lists in protobuf ({t}): kproxy's watches use it"),
        ),
        Some(t) => Check::new(
            name,
            Status::Warn,
            format!(
                "the API server answered a protobuf request with {t}: kproxy falls back to JSON (more bytes and CPU per change, docs/scale.md)"
            ),
        ),
        None => Check::new(name, Status::Warn, "the answer had no Content-Type"),
    }
}

/// Writes each Feature's manifests beside the scratch node and plans them: the plans
/// the dataplane is asked to program. `dir` is a fresh scratch directory.
fn feature_plans(dir: &Path) -> Result<Vec<kproxy_core::NodePlan>> {
    FEATURES
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let file = dir.join(format!("feature-{i}.yaml"));
            std::fs::write(&file, f.manifests(i))
                .with_context(|| format!("writing {}", file.display()))?;
            let loaded = kproxy_source::manifests::load(&file, NODE, &Default::default());
            if let Some(p) = loaded.problems.first() {
                anyhow::bail!("preflight's own manifest for {}: {p}", f.name);
            }
            Ok(kproxy_core::plan(
                &loaded.state,
                NODE,
                &kproxy_core::PlanConfig::default(),
            ))
        })
        .collect()
}

/// Programs one plan into a table of its own in the calling thread's network
/// namespace, reads it back and answers how many rules the kernel holds.
fn program(i: usize, plan: &kproxy_core::NodePlan) -> Result<usize, NftError> {
    let cfg = DataplaneConfig {
        table: format!("kproxy-preflight-{i}"),
        ..Default::default()
    };
    let mut dp = Dataplane::new(cfg.clone())?;
    dp.sync(plan, &PlanUpdate::WHOLE)?;
    let mut rules = 0;
    for family in [Family::Ip, Family::Ip6] {
        match KernelTable::read(family, &cfg.table)? {
            Some(t) => rules += t.rule_count(),
            None => {
                return Err(NftError::Read(format!(
                    "the table {} was accepted but is not in the kernel",
                    cfg.table
                )));
            }
        }
    }
    kproxy_nft::cleanup(&cfg)?;
    Ok(rules)
}

/// Every feature, programmed in a scratch network namespace made on a thread of its
/// own (it ends with the thread: nothing of it stays on the node).
fn feature_checks(dir: &Path) -> Vec<Check> {
    let plans = match feature_plans(dir) {
        Ok(p) => p,
        Err(e) => return vec![Check::new("nf_tables", Status::Fail, format!("{e:#}"))],
    };
    let outcome = std::thread::spawn(move || {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| format!("cannot make a scratch network namespace to try nftables in ({e}): run preflight as root on the node (or in a privileged pod)"))?;
        let mut results = Vec::new();
        for (i, plan) in plans.iter().enumerate() {
            results.push(program(i, plan).map_err(|e| e.to_string()));
        }
        Ok::<_, String>(results)
    })
    .join();
    match outcome {
        Ok(Ok(results)) => FEATURES
            .iter()
            .zip(&results)
            .map(|(f, r)| feature_check(f, r))
            .collect(),
        Ok(Err(e)) => vec![Check::new("nf_tables", Status::Fail, e)],
        Err(_) => vec![Check::new(
            "nf_tables",
            Status::Fail,
            "the check's thread panicked",
        )],
    }
}

fn sysctl_checks(cfg: &ProxyConfig) -> Vec<Check> {
    let host = crate::cmd_sysctl::in_host_netns();
    let ncpu = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let wanted = kproxy_config::conntrack_sysctls(&cfg.conntrack, ncpu);
    if wanted.is_empty() {
        return vec![Check::new(
            "sysctls",
            Status::Ok,
            "the configuration sets no conntrack sysctl",
        )];
    }
    wanted
        .into_iter()
        .map(|sysctl| {
            let current = std::fs::read_to_string(&sysctl.path)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok());
            let not_writable =
                nix::unistd::access(Path::new(&sysctl.path), nix::unistd::AccessFlags::W_OK)
                    .err()
                    .map(|e| e.desc().to_string());
            sysctl_check(&SysctlState {
                sysctl,
                current,
                host_netns: host,
                not_writable,
            })
        })
        .collect()
}

fn kube_proxy_line(mode: TakeoverMode, healthz: Option<std::net::SocketAddr>) -> Check {
    let inventory = crate::takeover::inventory();
    let plan = takeover::removal_plan(&inventory);
    // kube-proxy's healthz port held by another process is the other sign that one
    // runs (a kube-proxy in a pod without hostPID shows no process here).
    let healthz_port_held = healthz.is_some_and(|a| {
        std::net::TcpListener::bind(a)
            .err()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::AddrInUse)
    });
    let live = Liveness {
        processes: crate::takeover::kube_proxy_processes(),
        healthz_port_held,
    };
    kube_proxy_check(&plan, &live, mode)
}

async fn api_checks(args: &Args, cfg: &ProxyConfig, kubeconfig: &Path) -> Vec<Check> {
    let client = match crate::cluster::connect(
        Some(kubeconfig),
        args.context.as_deref(),
        cfg.kubeconfig.as_deref(),
        &args.calls,
    )
    .await
    {
        Ok((client, _, _)) => client,
        Err(e) => return vec![Check::new("API server", Status::Fail, format!("{e:#}"))],
    };
    let mut out = Vec::new();
    match client.apiserver_version().await {
        Ok(v) => out.push(Check::new(
            "API server",
            Status::Ok,
            format!("{} ({} {})", v.git_version, v.platform, v.go_version),
        )),
        Err(e) => {
            out.push(Check::new(
                "API server",
                Status::Fail,
                format!("GET /version: {e}"),
            ));
            return out;
        }
    }
    let mut answers = Vec::new();
    for (group, resource, verb) in ACCESS {
        answers.push((
            (group, resource, verb),
            access(&client, group, resource, verb).await,
        ));
    }
    out.push(rbac_check(&answers));
    out.push(match protobuf_content_type(&client).await {
        Ok(t) => protobuf_check(t.as_deref()),
        Err(e) => Check::new(
            "API protobuf",
            Status::Warn,
            format!("a protobuf list failed: {e}"),
        ),
    });
    out
}

/// One SelfSubjectAccessReview: may these credentials `verb` `resource` cluster-wide?
async fn access(
    client: &kube::Client,
    group: &str,
    resource: &str,
    verb: &str,
) -> Result<bool, String> {
    let body = serde_json::json!({
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": {"group": group, "resource": resource, "verb": verb}},
    });
    let req = http::Request::post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(serde_json::to_vec(&body).map_err(|e| e.to_string())?)
        .map_err(|e| e.to_string())?;
    let answer: serde_json::Value = client.request(req).await.map_err(|e| e.to_string())?;
    Ok(answer["status"]["allowed"].as_bool().unwrap_or(false))
}

/// The Content-Type of a one-item list of Services asked for as protobuf first (as
/// kproxy's reflectors ask).
async fn protobuf_content_type(client: &kube::Client) -> Result<Option<String>, String> {
    let req = http::Request::get("/api/v1/services?limit=1")
        .header(
            http::header::ACCEPT,
            format!(
                "{}, application/json",
                kproxy_source::kube::proto::MEDIA_TYPE
            ),
        )
        .body(Vec::new())
        .map_err(|e| e.to_string())?;
    let res = client
        .send(req.map(Into::into))
        .await
        .map_err(|e| e.to_string())?;
    if !res.status().is_success() {
        return Err(format!("HTTP {}", res.status()));
    }
    Ok(res
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string))
}

/// A scratch directory for the features' manifests, removed on drop.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new() -> Result<ScratchDir> {
        let dir = std::env::temp_dir().join(format!("kproxy-preflight-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let (cfg, warnings) = kproxy_config::load(&args.config).context("loading the configuration")?;
    for w in &warnings {
        eprintln!("kproxy: warning: {}: {}", w.path, w.message);
    }
    let mut checks = Vec::new();
    // The kernel's release, as `uname -r` prints it.
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let release = release.trim();
    checks.push(kernel_check(release));
    let dir = ScratchDir::new()?;
    checks.extend(feature_checks(&dir.0));
    let (soft, hard) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .context("reading RLIMIT_NOFILE")?;
    checks.push(nofile_check(soft, hard, crate::fdlimit::wanted_for(&cfg)));
    checks.extend(sysctl_checks(&cfg));
    checks.push(kube_proxy_line(
        args.kube_proxy_takeover,
        cfg.healthz_bind_address,
    ));
    if let Some(kubeconfig) = &args.config.kubeconfig {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?;
        checks.extend(runtime.block_on(api_checks(&args, &cfg, kubeconfig)));
    }
    let mut out = std::io::stdout().lock();
    for c in &checks {
        writeln!(out, "{}", c.line()).context("writing to stdout")?;
    }
    let failed = checks.iter().filter(|c| c.status == Status::Fail).count();
    let warned = checks.iter().filter(|c| c.status == Status::Warn).count();
    writeln!(
        out,
        "preflight: {} checks, {failed} failed, {warned} warnings{}",
        checks.len(),
        if args.config.kubeconfig.is_none() {
            " (no --kubeconfig: the API server was not checked)"
        } else {
            ""
        }
    )
    .context("writing to stdout")?;
    Ok(if failed > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_core::takeover::{Inventory, NftTableName};

    #[test]
    fn kernel_versions() {
        assert_eq!(kernel_check("6.18.44-cloud-amd64").status, Status::Ok);
        assert_eq!(kernel_check("5.13.0").status, Status::Ok);
        let old = kernel_check("5.10.0-28-amd64");
        assert_eq!(old.status, Status::Warn);
        assert!(old.detail.contains("older than 5.13"), "{}", old.detail);
        assert_eq!(kernel_check("").status, Status::Warn);
    }

    #[test]
    fn the_hard_limit_decides_nofile() {
        assert_eq!(nofile_check(1024, 524288, 5000).status, Status::Ok);
        let low = nofile_check(1024, 4096, 5000);
        assert_eq!(low.status, Status::Warn);
        assert!(
            low.detail.contains("hard limit 4096 is below the 5000"),
            "{}",
            low.detail
        );
    }

    fn sysctl(path: &str, value: u64) -> ConntrackSysctl {
        let ncpu = 1;
        let cfg = kproxy_config::ConntrackConfig::default();
        let mut s = kproxy_config::conntrack_sysctls(&cfg, ncpu)
            .into_iter()
            .find(|s| s.path.ends_with(path))
            .expect("upstream's defaults set it");
        s.value = value;
        s
    }

    /// Set already, or writable: ok; not writable: fail, naming the init container;
    /// machine-wide outside the host's namespace: a warning (kproxy leaves it).
    #[test]
    fn a_sysctl_kproxy_may_not_write_fails() {
        let s = sysctl("nf_conntrack_tcp_timeout_established", 86400);
        let state = |current, host_netns, not_writable: Option<&str>| SysctlState {
            sysctl: s.clone(),
            current,
            host_netns,
            not_writable: not_writable.map(str::to_string),
        };
        assert_eq!(
            sysctl_check(&state(Some(86400), true, Some("ro"))).status,
            Status::Ok
        );
        assert_eq!(
            sysctl_check(&state(Some(432000), true, None)).status,
            Status::Ok
        );
        let refused = sysctl_check(&state(Some(432000), true, Some("Read-only file system")));
        assert_eq!(refused.status, Status::Fail);
        assert!(
            refused.line().starts_with(
                "FAIL sysctl net/netfilter/nf_conntrack_tcp_timeout_established: 432000, kproxy wants 86400 and may not write it (Read-only file system)"
            ),
            "{}",
            refused.line()
        );
        let max = sysctl("nf_conntrack_max", 1 << 20);
        let outside = sysctl_check(&SysctlState {
            sysctl: max,
            current: Some(65536),
            host_netns: false,
            not_writable: None,
        });
        assert_eq!(outside.status, Status::Warn, "{}", outside.line());
    }

    /// kube-proxy's nftables table on the node: what the takeover does, by mode and
    /// whether one runs.
    #[test]
    fn the_kube_proxy_line_says_what_the_takeover_will_do() {
        let inv = Inventory {
            nft_tables: vec![NftTableName {
                family: "ip".into(),
                name: "kube-proxy".into(),
            }],
            ..Default::default()
        };
        let plan = takeover::removal_plan(&inv);
        let idle = Liveness::default();
        let c = kube_proxy_check(&plan, &idle, TakeoverMode::Auto);
        assert_eq!(c.status, Status::Ok);
        assert!(
            c.detail.starts_with("nftables mode rules on the node (nft table ip kube-proxy); no kube-proxy runs: kproxy run will program its own tables first, then remove exactly these"),
            "{}",
            c.detail
        );
        let running = Liveness {
            processes: vec![42],
            healthz_port_held: false,
        };
        let c = kube_proxy_check(&plan, &running, TakeoverMode::Auto);
        assert_eq!(c.status, Status::Warn);
        assert!(
            c.detail.contains("kube-proxy process(es) [42]"),
            "{}",
            c.detail
        );
        let c = kube_proxy_check(&plan, &idle, TakeoverMode::Off);
        assert!(
            c.detail.contains("--kube-proxy-takeover=off"),
            "{}",
            c.detail
        );
        let none = kube_proxy_check(&RemovalPlan::default(), &idle, TakeoverMode::Auto);
        assert!(
            none.detail.starts_with("none on the node"),
            "{}",
            none.detail
        );
    }

    #[test]
    fn a_refused_feature_fails_its_line() {
        let f = &FEATURES[4];
        let c = feature_check(
            f,
            &Err("the kernel refused the transaction: add rule …: Operation not supported".into()),
        );
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.line()
                .starts_with("FAIL nftables dynamic sets: sessionAffinity ClientIP"),
            "{}",
            c.line()
        );
        assert_eq!(feature_check(f, &Ok(12)).status, Status::Ok);
    }

    #[test]
    fn rbac_names_what_is_denied() {
        let ok = [
            (("", "services", "list"), Ok(true)),
            (("discovery.k8s.io", "endpointslices", "watch"), Ok(true)),
        ];
        assert_eq!(rbac_check(&ok).status, Status::Ok);
        let denied = [
            (("", "services", "list"), Ok(true)),
            (("discovery.k8s.io", "endpointslices", "watch"), Ok(false)),
        ];
        let c = rbac_check(&denied);
        assert_eq!(c.status, Status::Fail);
        assert!(
            c.detail
                .starts_with("these credentials may not watch endpointslices.discovery.k8s.io"),
            "{}",
            c.detail
        );
        let failed = [(("", "services", "list"), Err("HTTP 403".to_string()))];
        assert_eq!(rbac_check(&failed).status, Status::Fail);
    }

    #[test]
    fn protobuf_or_json() {
        assert_eq!(
            protobuf_check(Some("application/vnd.kubernetes.protobuf")).status,
            Status::Ok
        );
        assert_eq!(
            protobuf_check(Some("application/json")).status,
            Status::Warn
        );
    }

    /// Every feature's manifests are valid input: each plans without a problem, and
    /// each (but the first, the empty table) holds a Service.
    #[test]
    fn every_feature_plans() {
        let dir = ScratchDir::new().unwrap();
        let plans = feature_plans(&dir.0).unwrap();
        assert_eq!(plans.len(), FEATURES.len());
        assert!(plans[0].services.is_empty());
        for (f, p) in FEATURES.iter().zip(&plans).skip(1) {
            assert_eq!(p.services.len(), 1, "{}", f.name);
            let ports: Vec<_> = p.service_ports().collect();
            assert_eq!(ports.len(), 1, "{}", f.name);
        }
    }
}
