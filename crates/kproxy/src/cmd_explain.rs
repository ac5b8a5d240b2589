//! `kproxy explain`: for one Service, per port and per kind of traffic, which endpoints
//! are used and why every other endpoint is not. The plan is computed from manifests or
//! from one read of the API server (`crate::cluster`); with `--server`, the runtime state of the Service's health-check node port
//! (where it listens, where it cannot bind and why) is read from a running daemon's
//! metrics server (`/health-check-node-ports`, JSON).

use std::process::ExitCode;

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kproxy_core::model::ServiceName;
use serde_json::Value;

use crate::cluster::ClusterArgs;
use crate::common::{Output, print_structured};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub source: ClusterArgs,
    /// The Service, as `namespace/name`, or `name` with `-n namespace`.
    pub service: String,
    /// The Service's namespace. Default: the kubeconfig context's namespace, as
    /// kubectl's; `default` with manifests or in a pod.
    #[arg(short = 'n', long = "namespace", value_name = "NAMESPACE")]
    pub namespace: Option<String>,
    /// `table`: the explanation in sentences; `json`/`yaml`: the Service's entry of the
    /// plan (docs/plan-json.md).
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: Output,
    /// A running `kproxy run`'s metrics address (`HOST:PORT` or `http://HOST:PORT`):
    /// also show where the Service's health-check node port listens and where it cannot
    /// bind, and why, and which of its endpoints the daemon holds for warm-up and until
    /// when.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    #[command(flatten)]
    pub nft: crate::common::NftTableFlag,
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.server.is_some() && args.output != Output::Table {
        bail!("--server adds to the explanation: it needs -o table");
    }
    if ServiceName::parse(&args.service).is_none() && args.service.contains('/') {
        bail!(
            "SERVICE must be namespace/name or name, got {:?}",
            args.service
        );
    }
    let cluster = args.source.read()?;
    let name = ServiceName::parse(&args.service).unwrap_or_else(|| {
        let namespace = args
            .namespace
            .as_deref()
            .or(cluster.namespace.as_deref())
            .unwrap_or("default");
        ServiceName::new(namespace, args.service.as_str())
    });
    let plan = cluster.plan_with(&cluster.config.plan);
    let strict_failed = cluster.report.strict_failed;
    let Some(svc) = plan.services.get(&name) else {
        bail!(
            "Service {name} is not proxied on node {} (unknown, headless, ExternalName, or another proxy's){}",
            plan.node,
            elsewhere_hint(&name, &cluster.state)
        );
    };
    if print_structured(svc, args.output)? {
        return Ok(if strict_failed {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        });
    }
    print!("{}", kproxy_core::explain::explain_service(&plan, svc));
    if let Some(server) = &args.server {
        let state = fetch_json(server, crate::metrics::HEALTH_CHECK_PORTS_PATH)?;
        print!("{}", health_check_runtime(&state, &name, server)?);
        let held = fetch_json(server, crate::warmup::ENDPOINT_WARMUP_PATH)?;
        print!("{}", crate::warmup::held_lines(&held, Some(&name), server));
        let metrics = fetch(server, "/metrics")?;
        print!("{}", kernel_runtime(&metrics, server));
        let samples = crate::traffic::samples_from_metrics(&metrics);
        print!("{}", traffic_section(&samples, &name, server));
    } else if let Ok(counters) = kproxy_nft::read_counters(&args.nft.nft_table) {
        // On a node running kproxy (else there is nothing to show, and nothing is said).
        let samples = crate::traffic::samples(&counters);
        if !samples.is_empty() {
            let from = format!("this kernel's {} tables", args.nft.nft_table);
            print!("{}", traffic_section(&samples, &name, &from));
        }
    }
    crate::common::print_conflicts(&plan, Some(&name), &cluster.report.files);
    Ok(if strict_failed {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

/// The other namespaces that hold a Service named as `name`, said as what to type;
/// empty when there is none.
fn elsewhere_hint(name: &ServiceName, state: &kproxy_core::ClusterState) -> String {
    let mut namespaces: Vec<&str> = state
        .services()
        .filter(|s| s.name.name == name.name && s.name.namespace != name.namespace)
        .map(|s| &*s.name.namespace)
        .collect();
    namespaces.sort_unstable();
    namespaces.dedup();
    match namespaces.as_slice() {
        [] => String::new(),
        [one] => format!(
            "; a Service {} exists in namespace {one}: give -n {one}",
            name.name
        ),
        many => format!(
            "; a Service {} exists in namespaces {}: give -n NAMESPACE",
            name.name,
            many.join(", ")
        ),
    }
}

/// `GET path` from a daemon's metrics server; the body as JSON.
pub(crate) fn fetch_json(server: &str, path: &str) -> Result<Value> {
    let body = fetch(server, path)?;
    serde_json::from_str(&body).with_context(|| format!("{server}{path}: the body is not JSON"))
}

/// `GET path` from a daemon's metrics server; the body.
fn fetch(server: &str, path: &str) -> Result<String> {
    let authority = server
        .strip_prefix("http://")
        .unwrap_or(server)
        .trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        bail!("--server must be HOST:PORT or http://HOST:PORT, got {server:?}");
    }
    let addr = authority
        .to_socket_addrs()
        .with_context(|| format!("resolving --server {server:?}"))?
        .next()
        .with_context(|| format!("--server {server:?} resolves to no address"))?;
    let timeout = Duration::from_secs(5);
    let mut conn = TcpStream::connect_timeout(&addr, timeout)
        .with_context(|| format!("connecting to {addr} (--server)"))?;
    conn.set_read_timeout(Some(timeout))
        .and_then(|()| conn.set_write_timeout(Some(timeout)))
        .context("setting socket timeouts")?;
    // HTTP/1.0: the server answers with the whole body and closes (no chunking).
    write!(conn, "GET {path} HTTP/1.0\r\nHost: {authority}\r\n\r\n")
        .with_context(|| format!("sending the request to {addr}"))?;
    let mut raw = Vec::new();
    conn.take(8 << 20)
        .read_to_end(&mut raw)
        .with_context(|| format!("reading the answer of {addr}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{addr}{path}: not an HTTP answer"))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        bail!("{addr}{path} answered {status:?} (is this a kproxy metrics address?)");
    }
    Ok(body.to_string())
}

/// The kernel section, from the daemon's `/metrics`: what drops Service traffic without
/// a rule changing (the conntrack table, sysctls changed by others) and other
/// processes' changes to kproxy's tables (docs/health.md). A series the daemon does not
/// export (yet) reads as "unknown".
fn kernel_runtime(metrics: &str, server: &str) -> String {
    use crate::exposition::{label, samples};
    use std::fmt::Write as _;
    let value = |series: &str| crate::exposition::value(metrics, series);
    let show = |v: Option<f64>| v.map_or_else(|| "unknown".to_string(), |v| format!("{v}"));
    let mut out = format!("kernel at runtime ({server}):\n");
    let (entries, max) = (
        value("kproxy_conntrack_entries"),
        value("kproxy_conntrack_max"),
    );
    let full = matches!((entries, max), (Some(e), Some(m)) if m > 0.0 && e >= m);
    let _ = writeln!(
        out,
        "  conntrack: {} of {} entries{}; since boot {} insertion failures, {} drops, {} early drops",
        show(entries),
        show(max),
        if full {
            " (FULL: new connections are dropped)"
        } else {
            ""
        },
        show(value("kproxy_conntrack_insert_failed_total")),
        show(value("kproxy_conntrack_drop_total")),
        show(value("kproxy_conntrack_early_drop_total")),
    );
    let changed: Vec<&str> = samples(metrics)
        .filter(|(n, _, v)| *n == "kproxy_sysctl_changed" && *v == 1.0)
        .filter_map(|(_, labels, _)| label(labels, "sysctl"))
        .collect();
    if changed.is_empty() {
        out.push_str("  sysctls kproxy set: unchanged\n");
    }
    for name in changed {
        let _ = writeln!(
            out,
            "  sysctl {name}: CHANGED by someone else since kproxy set it"
        );
    }
    let kinds: Vec<String> = samples(metrics)
        .filter(|(n, _, _)| *n == "kproxy_kernel_interference_total")
        .filter_map(|(_, labels, v)| Some(format!("{} {v}", label(labels, "what")?)))
        .collect();
    let _ = writeln!(
        out,
        "  kproxy's tables changed by other processes: {}; repaired {} times; repair backoff now {} s",
        if kinds.is_empty() {
            "never".to_string()
        } else {
            kinds.join(", ")
        },
        show(value("kproxy_kernel_interference_repairs_total")),
        show(value("kproxy_kernel_interference_backoff_seconds")),
    );
    out
}

/// The Service's traffic counters on this node, beside the plan (`from`: where they
/// were read).
fn traffic_section(samples: &[crate::traffic::Sample], name: &ServiceName, from: &str) -> String {
    let lines = crate::traffic::explain_lines(samples, &name.namespace, &name.name);
    let mut out = format!("traffic on this node (kernel counters, new connections; {from}):\n");
    if lines.is_empty() {
        out.push_str("  none for this Service (not programmed here, or --traffic-metrics=off)\n");
    }
    out + &lines
}

/// The runtime section for one Service, from the daemon's `/health-check-node-ports`.
fn health_check_runtime(state: &Value, service: &ServiceName, server: &str) -> Result<String> {
    use std::fmt::Write as _;
    let ports = state
        .get("healthCheckNodePorts")
        .and_then(Value::as_array)
        .with_context(|| format!("{server}: the answer has no healthCheckNodePorts list"))?;
    let wanted = service.to_string();
    let mut out = format!("health-check node port at runtime ({server}):\n");
    let Some(entry) = ports
        .iter()
        .find(|p| p.get("service").and_then(Value::as_str) == Some(wanted.as_str()))
    else {
        out.push_str(
            "  not served: the daemon's applied plan has no health check for this Service\n",
        );
        return Ok(out);
    };
    let field = |name: &str| {
        entry
            .get(name)
            .with_context(|| format!("{server}: health-check port of {wanted}: no field {name:?}"))
    };
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|x| x.as_str().map(str::to_string))
            .collect()
    };
    let _ = writeln!(
        out,
        "  port {}, answering with localEndpoints {}",
        field("port")?,
        field("localEndpoints")?
    );
    let listening = strings(field("listening")?);
    if listening.is_empty() {
        out.push_str("  listening nowhere\n");
    }
    for a in listening {
        let _ = writeln!(out, "  listening on {a}");
    }
    for u in field("unbound")?.as_array().into_iter().flatten() {
        let text = |k: &str| u.get(k).and_then(Value::as_str).unwrap_or("?");
        let _ = writeln!(
            out,
            "  NOT listening on {}: {} ({})",
            text("address"),
            text("message"),
            text("reason")
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_section_reads_the_daemons_metrics() {
        let metrics = "# HELP x\nkproxy_conntrack_entries 100\nkproxy_conntrack_max 100\nkproxy_conntrack_insert_failed_total 3\nkproxy_conntrack_drop_total 1\nkproxy_conntrack_early_drop_total 0\nkproxy_sysctl_changed{sysctl=\"/proc/sys/net/netfilter/nf_conntrack_max\"} 1\nkproxy_sysctl_changed{sysctl=\"/proc/sys/net/netfilter/nf_conntrack_udp_timeout\"} 0\nkproxy_kernel_interference_total{what=\"table\"} 2\nkproxy_kernel_interference_total{what=\"rule\"} 1\nkproxy_kernel_interference_repairs_total 2\nkproxy_kernel_interference_backoff_seconds 0.1\n";
        assert_eq!(
            kernel_runtime(metrics, "s"),
            "kernel at runtime (s):\n  conntrack: 100 of 100 entries (FULL: new connections are dropped); since boot 3 insertion failures, 1 drops, 0 early drops\n  sysctl /proc/sys/net/netfilter/nf_conntrack_max: CHANGED by someone else since kproxy set it\n  kproxy's tables changed by other processes: table 2, rule 1; repaired 2 times; repair backoff now 0.1 s\n"
        );
        assert_eq!(
            kernel_runtime("", "s"),
            "kernel at runtime (s):\n  conntrack: unknown of unknown entries; since boot unknown insertion failures, unknown drops, unknown early drops\n  sysctls kproxy set: unchanged\n  kproxy's tables changed by other processes: never; repaired unknown times; repair backoff now unknown s\n"
        );
    }

    #[test]
    fn the_runtime_section_shows_where_the_port_cannot_bind_and_why() {
        let state = serde_json::json!({"healthCheckNodePorts": [{
            "service": "a/b", "port": 31500, "localEndpoints": 2,
            "listening": ["[::]:31500"],
            "unbound": [
                {"address": "10.0.0.9:31500", "reason": "address_absent", "message": "the node address is not on this host"},
                {"address": "0.0.0.0:31500", "reason": "port_in_use", "message": "the port is in use by another socket"},
            ],
        }]});
        let got =
            health_check_runtime(&state, &ServiceName::new("a", "b"), "127.0.0.1:10249").unwrap();
        assert_eq!(
            got,
            "health-check node port at runtime (127.0.0.1:10249):\n  port 31500, answering with localEndpoints 2\n  listening on [::]:31500\n  NOT listening on 10.0.0.9:31500: the node address is not on this host (address_absent)\n  NOT listening on 0.0.0.0:31500: the port is in use by another socket (port_in_use)\n"
        );
        let other = health_check_runtime(&state, &ServiceName::new("a", "c"), "s").unwrap();
        assert!(other.contains("not served"), "{other}");
        let err = health_check_runtime(&serde_json::json!({}), &ServiceName::new("a", "b"), "s")
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "s: the answer has no healthCheckNodePorts list"
        );
    }
}
