//! `kproxy status`'s decisions, pure: what the API server's objects (the DaemonSet, the
//! Nodes, kproxy's Pods) and each pod's `/healthz` and `/metrics` answers (read through
//! the pods' proxy subresource by `crate::cmd_status`) say about the cluster — the
//! rollout ([`rollout`], kubectl's `rollout status` rule), one row per Node ([`row`]:
//! healthy or why not), the summary line and the exit code ([`summary`]) — and the
//! table and JSON shown (docs/status.md names every field).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::exposition;

/// What the DaemonSet says (`apps/v1` DaemonSet: its spec and status).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DaemonSetState {
    pub generation: i64,
    pub observed_generation: i64,
    pub desired: i64,
    pub updated: i64,
    pub ready: i64,
    pub available: i64,
    /// `spec.updateStrategy.type` (`RollingUpdate` unless set).
    pub update_strategy: String,
    /// The pod template's container images, in order.
    pub images: Vec<String>,
    /// `spec.template.spec.nodeSelector`: the Nodes it runs on.
    pub node_selector: BTreeMap<String, String>,
    /// `spec.selector.matchLabels`: its Pods.
    pub selector: BTreeMap<String, String>,
}

fn int(v: &Value) -> i64 {
    v.as_i64().unwrap_or(0)
}

fn strings(v: &Value) -> BTreeMap<String, String> {
    v.as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

impl DaemonSetState {
    /// From the DaemonSet as the API serves it (missing fields read as 0 / empty).
    pub fn from_json(ds: &Value) -> DaemonSetState {
        let status = &ds["status"];
        let spec = &ds["spec"];
        DaemonSetState {
            generation: int(&ds["metadata"]["generation"]),
            observed_generation: int(&status["observedGeneration"]),
            desired: int(&status["desiredNumberScheduled"]),
            updated: int(&status["updatedNumberScheduled"]),
            ready: int(&status["numberReady"]),
            available: int(&status["numberAvailable"]),
            update_strategy: spec["updateStrategy"]["type"]
                .as_str()
                .unwrap_or("RollingUpdate")
                .to_string(),
            images: spec["template"]["spec"]["containers"]
                .as_array()
                .map(|cs| {
                    cs.iter()
                        .filter_map(|c| c["image"].as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default(),
            node_selector: strings(&spec["template"]["spec"]["nodeSelector"]),
            selector: strings(&spec["selector"]["matchLabels"]),
        }
    }
}

/// The rollout as shown (`daemonSet` in `-o json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    pub namespace: String,
    pub name: String,
    pub found: bool,
    pub desired: i64,
    pub updated: i64,
    pub ready: i64,
    pub available: i64,
    /// The pod template's images (what the rollout installs).
    pub images: Vec<String>,
    /// The kproxy container's image of each Pod found, and how many Pods run it.
    pub running_images: BTreeMap<String, usize>,
    pub complete: bool,
    pub message: String,
}

/// The rollout of the DaemonSet `namespace/name` (`None`: not found), as `kubectl
/// rollout status` judges a DaemonSet: complete when its controller has seen the
/// newest spec (observedGeneration ≥ generation) and every desired Pod is updated
/// and available.
pub fn rollout(
    namespace: &str,
    name: &str,
    ds: Option<&DaemonSetState>,
    running_images: BTreeMap<String, usize>,
) -> Rollout {
    let mut r = Rollout {
        namespace: namespace.to_string(),
        name: name.to_string(),
        found: ds.is_some(),
        desired: 0,
        updated: 0,
        ready: 0,
        available: 0,
        images: Vec::new(),
        running_images,
        complete: false,
        message: String::new(),
    };
    let Some(ds) = ds else {
        r.message = format!(
            "no DaemonSet {namespace}/{name} (is kproxy installed? --namespace and --daemonset name another)"
        );
        return r;
    };
    (r.desired, r.updated, r.ready, r.available) = (ds.desired, ds.updated, ds.ready, ds.available);
    r.images = ds.images.clone();
    (r.complete, r.message) = if ds.observed_generation < ds.generation {
        (
            false,
            "in progress: the DaemonSet controller has not yet seen the newest spec".into(),
        )
    } else if ds.updated < ds.desired {
        (
            false,
            format!("in progress: {} of {} pods updated", ds.updated, ds.desired),
        )
    } else if ds.available < ds.desired {
        (
            false,
            format!(
                "in progress: {} of {} updated pods available",
                ds.available, ds.desired
            ),
        )
    } else {
        (true, "complete".into())
    };
    if ds.update_strategy != "RollingUpdate" {
        r.message += &format!(
            " (updateStrategy {}: pods are replaced only when deleted)",
            ds.update_strategy
        );
    }
    r
}

/// A Node: its name and labels.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeState {
    pub name: String,
    pub labels: BTreeMap<String, String>,
}

impl NodeState {
    pub fn from_json(node: &Value) -> NodeState {
        NodeState {
            name: node["metadata"]["name"].as_str().unwrap_or("").to_string(),
            labels: strings(&node["metadata"]["labels"]),
        }
    }
}

/// Whether the DaemonSet's nodeSelector takes `node` (every label equal). Without a
/// DaemonSet every Node is expected to run kproxy. Node affinity is not read.
pub fn selected(node: &NodeState, ds: Option<&DaemonSetState>) -> bool {
    ds.is_none_or(|ds| {
        ds.node_selector
            .iter()
            .all(|(k, v)| node.labels.get(k) == Some(v))
    })
}

/// One of kproxy's Pods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodState {
    pub name: String,
    pub node: Option<String>,
    pub phase: String,
    pub pod_ip: Option<String>,
    /// Its `Ready` condition is `True`.
    pub ready: bool,
    /// The image of its container `container` (else its first).
    pub image: Option<String>,
    /// It has a deletionTimestamp (terminating).
    pub deleting: bool,
    pub created: String,
}

impl PodState {
    /// From the Pod as the API serves it; `container`: kproxy's container's name.
    pub fn from_json(pod: &Value, container: &str) -> PodState {
        let containers = pod["spec"]["containers"].as_array();
        let image = containers.and_then(|cs| {
            cs.iter()
                .find(|c| c["name"] == container)
                .or_else(|| cs.first())
                .and_then(|c| c["image"].as_str())
                .map(str::to_string)
        });
        let ready = pod["status"]["conditions"].as_array().is_some_and(|cs| {
            cs.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        });
        let text = |v: &Value| v.as_str().filter(|s| !s.is_empty()).map(str::to_string);
        PodState {
            name: pod["metadata"]["name"].as_str().unwrap_or("").to_string(),
            node: text(&pod["spec"]["nodeName"]),
            phase: pod["status"]["phase"]
                .as_str()
                .unwrap_or("Unknown")
                .to_string(),
            pod_ip: text(&pod["status"]["podIP"]),
            ready,
            image,
            deleting: !pod["metadata"]["deletionTimestamp"].is_null(),
            created: pod["metadata"]["creationTimestamp"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        }
    }
}

/// The Pod that speaks for a Node when several are on it (a rollout replacing one):
/// one not terminating before one that is, then the newest.
pub fn pick_pod<'a>(pods: &[&'a PodState]) -> Option<&'a PodState> {
    pods.iter()
        .copied()
        .max_by(|a, b| (!a.deleting, &a.created).cmp(&(!b.deleting, &b.created)))
}

/// One GET through the API server's pods proxy: the answer passed through (the
/// pod's, or the API server's own when it could not reach the pod), or why the call
/// failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fetched {
    Answer { code: u16, body: String },
    Failed(String),
}

/// The message of an API server's own error (a `Status` object: the pod could not be
/// reached, or the proxy is forbidden), which is not the pod's answer.
fn api_error(code: u16, body: &str) -> Option<String> {
    let v: Value = serde_json::from_str(body).ok()?;
    (v["kind"] == "Status").then(|| {
        let message = v["message"].as_str().unwrap_or("no message");
        format!("{code} from the API server: {message}")
    })
}

/// Whether the pod itself answered (not the API server for it, nor a failed call):
/// only then is its `/metrics` worth asking.
pub fn reached(fetched: &Fetched) -> bool {
    matches!(fetched, Fetched::Answer { code, body } if api_error(*code, body).is_none())
}

/// The fields of kproxy's `/healthz` body status reads (docs/health.md; the
/// `truthful` semantics' fields are absent under `upstream`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct HealthzBody {
    pub healthy: Option<bool>,
    pub node_eligible: Option<bool>,
    pub last_updated: Option<String>,
    pub current_time: Option<String>,
    pub synced_once: Option<bool>,
    pub oldest_pending_change: Option<String>,
    pub consecutive_sync_failures: Option<u64>,
    pub kernel_rules: Option<String>,
    pub conntrack_full: Option<bool>,
    pub input_held: Option<bool>,
    pub source_stalled_since: Option<String>,
    pub drain_signals: Option<Vec<String>>,
}

impl HealthzBody {
    /// Whether the body carries any field only kproxy's truthful semantics writes.
    pub fn is_truthful(&self) -> bool {
        self.synced_once.is_some()
            || self.oldest_pending_change.is_some()
            || self.consecutive_sync_failures.is_some()
            || self.kernel_rules.is_some()
            || self.conntrack_full.is_some()
            || self.input_held.is_some()
            || self.source_stalled_since.is_some()
            || self.drain_signals.is_some()
    }
}

/// Why a `/healthz` answer is what it is, from its body: for a 503 the reasons
/// kproxy's health rules give (docs/health.md), for a 200 what an operator should
/// still know (the API source stalled).
pub fn healthz_reasons(code: u16, body: &HealthzBody) -> Vec<String> {
    let mut out = Vec::new();
    if code != 200 {
        if body.synced_once == Some(false) {
            out.push("no rules programmed yet (the first sync has not succeeded)".to_string());
        }
        if body.input_held == Some(true) {
            out.push("start held on empty or broken input (docs/input.md)".to_string());
        }
        if body.kernel_rules.as_deref() == Some("tablesMissing") {
            out.push(
                "kproxy's tables are missing (removed by another process; repair pending)"
                    .to_string(),
            );
        }
        if body.conntrack_full == Some(true) {
            out.push("the conntrack table is full".to_string());
        }
        if body.node_eligible == Some(false) {
            let signals = body.drain_signals.clone().unwrap_or_default();
            out.push(if signals.is_empty() {
                "the node is draining".to_string()
            } else {
                format!("the node is draining ({})", signals.join(", "))
            });
        }
        if body.healthy == Some(false) {
            let mut why = "stale: a change has waited longer than 2 × syncPeriod".to_string();
            if let Some(since) = &body.oldest_pending_change {
                why += &format!(" (pending since {since})");
            }
            match body.consecutive_sync_failures {
                Some(n) if n > 0 => why += &format!(", {n} failed syncs in a row"),
                _ => {}
            }
            out.push(why);
        }
        if out.is_empty() {
            out.push(format!("/healthz answered {code}"));
        }
    }
    if let Some(since) = &body.source_stalled_since {
        out.push(format!("hears nothing from the API server since {since}"));
    }
    // kproxy's default (truthful) answer always carries its own fields; upstream's body
    // has none. Without them the answer is kproxy under `--health-check-semantics
    // upstream`, or another process on the port: kube-proxy, while it still runs beside
    // kproxy during a migration, holds 10256 and answers for the node.
    if !body.is_truthful() {
        out.push(
            "an upstream-style /healthz answer (none of kproxy's fields): kproxy with \
             --health-check-semantics upstream, or another process on the port (kube-proxy \
             still running?)"
                .to_string(),
        );
    }
    out
}

/// The figures status shows from a pod's `/metrics` (`None`: the family is not
/// exported by that kproxy).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeMetrics {
    /// `kubeproxy_sync_proxy_rules_last_timestamp_seconds` (0: never).
    pub last_sync_unix: Option<f64>,
    pub sync_failures: Option<u64>,
    pub frontend_conflicts: Option<u64>,
    pub skipped_objects: Option<u64>,
    pub drift_repairs: Option<u64>,
    pub kernel_interference: Option<u64>,
    pub kernel_interference_repairs: Option<u64>,
    /// The modes of kube-proxy's rules on the node (empty: none).
    pub kube_proxy_rules: Option<Vec<String>>,
    pub kube_proxy_takeover_waiting: Option<bool>,
    pub endpoint_warmup_holds: Option<u64>,
    /// The kernel traffic counters are on (`--traffic-metrics`).
    pub traffic_counters: bool,
    /// Summed over Service ports, when the counters are on.
    pub rejected: Option<u64>,
    pub no_local_endpoint_drops: Option<u64>,
}

/// Reads [`NodeMetrics`] from a `/metrics` text.
pub fn metrics_of(text: &str) -> NodeMetrics {
    let count = |v: Option<f64>| v.map(|v| v.max(0.0) as u64);
    let value = |series: &str| exposition::value(text, series);
    let sum = |name: &str| exposition::sum(text, name);
    let modes: Vec<(String, f64)> = exposition::samples(text)
        .filter(|(n, _, _)| *n == "kproxy_kube_proxy_rules_present")
        .filter_map(|(_, l, v)| Some((exposition::label(l, "mode")?.to_string(), v)))
        .collect();
    let traffic = value("kproxy_traffic_counters_read_seconds").is_some();
    NodeMetrics {
        last_sync_unix: value("kubeproxy_sync_proxy_rules_last_timestamp_seconds"),
        sync_failures: count(value(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures_total",
        )),
        frontend_conflicts: count(value("kproxy_frontend_conflicts")),
        skipped_objects: count(value("kproxy_skipped_objects")),
        drift_repairs: count(value("kproxy_dataplane_drift_repairs_total")),
        // A family with no series yet (nothing ever changed): 0, once the process
        // exports its sibling.
        kernel_interference: count(
            sum("kproxy_kernel_interference_total")
                .or(value("kproxy_kernel_interference_repairs_total").map(|_| 0.0)),
        ),
        kernel_interference_repairs: count(value("kproxy_kernel_interference_repairs_total")),
        kube_proxy_rules: (!modes.is_empty()).then(|| {
            modes
                .iter()
                .filter(|(_, v)| *v > 0.0)
                .map(|(m, _)| m.clone())
                .collect()
        }),
        kube_proxy_takeover_waiting: value("kproxy_kube_proxy_takeover_waiting").map(|v| v > 0.0),
        endpoint_warmup_holds: count(value("kproxy_endpoint_warmup_holds_total")),
        traffic_counters: traffic,
        rejected: traffic.then(|| count(sum("kproxy_service_rejected_total")).unwrap_or(0)),
        no_local_endpoint_drops: traffic
            .then(|| count(sum("kproxy_service_no_local_endpoint_drops_total")).unwrap_or(0)),
    }
}

/// What a row says of its Node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Verdict {
    /// `/healthz` answered 200.
    Healthy,
    /// `/healthz` answered something else (503): `reason` says why.
    Unhealthy,
    /// The pod could not be asked (the API server could not reach it, the call failed
    /// or timed out).
    Unreachable,
    /// The pod exists but is not running with an IP (Pending, Failed, …).
    PodNotRunning,
    /// No kproxy Pod on a Node the DaemonSet selects.
    NoPod,
    /// The DaemonSet's nodeSelector leaves the Node out: not counted.
    NotSelected,
}

/// One Node's row (an element of `nodes` in `-o json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    pub node: String,
    pub state: Verdict,
    /// Counted in the summary: the Node should run kproxy.
    pub counted: bool,
    pub healthy: bool,
    /// Why not healthy, or what a healthy node's kproxy still reports.
    pub reasons: Vec<String>,
    pub pod: Option<String>,
    pub image: Option<String>,
    pub pod_ready: Option<bool>,
    /// The `/healthz` status code.
    pub healthz: Option<u16>,
    /// The last successful sync (RFC 3339) and its age on the node's clock (the
    /// `/healthz` answer's `currentTime`, else this machine's).
    pub last_sync: Option<String>,
    pub last_sync_age_seconds: Option<f64>,
    pub consecutive_sync_failures: Option<u64>,
    pub input_held: Option<bool>,
    /// `intact`, `altered` or `tablesMissing` (truthful `/healthz`).
    pub kernel_rules: Option<String>,
    pub metrics: Option<NodeMetrics>,
    /// Why `/metrics` could not be read (kproxy's metricsBindAddress is 127.0.0.1 by
    /// default: out of the API server's reach).
    pub metrics_error: Option<String>,
}

/// Parses an RFC 3339 time.
fn time(s: &str) -> Option<jiff::Timestamp> {
    s.parse().ok()
}

/// The row of `node`: its kproxy Pod (`None`: none), that pod's `/healthz` and
/// `/metrics` answers (`None`: not asked), `now` this machine's clock.
pub fn row(
    node: &NodeState,
    selected: bool,
    pod: Option<&PodState>,
    healthz: Option<&Fetched>,
    metrics: Option<&Fetched>,
    now: jiff::Timestamp,
) -> Row {
    let mut r = Row {
        node: node.name.clone(),
        state: Verdict::NoPod,
        counted: true,
        healthy: false,
        reasons: Vec::new(),
        pod: pod.map(|p| p.name.clone()),
        image: pod.and_then(|p| p.image.clone()),
        pod_ready: pod.map(|p| p.ready),
        healthz: None,
        last_sync: None,
        last_sync_age_seconds: None,
        consecutive_sync_failures: None,
        input_held: None,
        kernel_rules: None,
        metrics: None,
        metrics_error: None,
    };
    let Some(pod) = pod else {
        if selected {
            r.reasons.push(
                "no kproxy pod on this node (its taints, the DaemonSet's tolerations or a failed scheduling)".into(),
            );
        } else {
            (r.state, r.counted, r.healthy) = (Verdict::NotSelected, false, true);
            r.reasons
                .push("not selected by the DaemonSet's nodeSelector".into());
        }
        return r;
    };
    if pod.phase != "Running" || pod.pod_ip.is_none() {
        r.state = Verdict::PodNotRunning;
        r.reasons.push(format!(
            "pod {} is {}{}",
            pod.name,
            pod.phase,
            if pod.pod_ip.is_none() {
                " with no IP"
            } else {
                ""
            }
        ));
        return r;
    }
    let mut body = HealthzBody::default();
    match healthz {
        None => {
            r.state = Verdict::Unreachable;
            r.reasons.push("unreachable: not asked".into());
        }
        Some(Fetched::Failed(why)) => {
            r.state = Verdict::Unreachable;
            r.reasons.push(format!("unreachable: {why}"));
        }
        Some(Fetched::Answer { code, body: text }) => match api_error(*code, text) {
            Some(why) => {
                r.state = Verdict::Unreachable;
                r.reasons.push(format!("unreachable: {why}"));
            }
            None => {
                body = serde_json::from_str(text).unwrap_or_default();
                r.healthz = Some(*code);
                r.healthy = *code == 200;
                r.state = if r.healthy {
                    Verdict::Healthy
                } else {
                    Verdict::Unhealthy
                };
                r.reasons = healthz_reasons(*code, &body);
                r.consecutive_sync_failures = body.consecutive_sync_failures;
                r.input_held = body.input_held;
                r.kernel_rules = body.kernel_rules.clone();
            }
        },
    }
    match metrics {
        None => {}
        Some(Fetched::Failed(why)) => r.metrics_error = Some(why.clone()),
        Some(Fetched::Answer { code, body: text }) => match api_error(*code, text) {
            Some(why) => r.metrics_error = Some(why),
            None if *code != 200 => r.metrics_error = Some(format!("/metrics answered {code}")),
            None => r.metrics = Some(metrics_of(text)),
        },
    }
    // The last sync: the metric (both semantics), else truthful /healthz's
    // lastUpdated once a sync succeeded (upstream's 200 rewrites it to the current
    // time); its age on the node's clock.
    let from_metric = r
        .metrics
        .as_ref()
        .and_then(|m| m.last_sync_unix)
        .filter(|t| *t > 0.0)
        .and_then(|t| jiff::Timestamp::from_millisecond((t * 1000.0) as i64).ok());
    let from_healthz = (body.synced_once == Some(true))
        .then(|| body.last_updated.as_deref().and_then(time))
        .flatten();
    if let Some(at) = from_metric.or(from_healthz) {
        let node_now = body.current_time.as_deref().and_then(time).unwrap_or(now);
        let age = node_now.duration_since(at).as_secs_f64().max(0.0);
        r.last_sync = Some(at.to_string());
        r.last_sync_age_seconds = Some((age * 10.0).round() / 10.0);
    }
    r
}

/// The verdict over the cluster (`summary` in `-o json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// Nodes that should run kproxy (selected by the DaemonSet, or holding a Pod).
    pub nodes: usize,
    pub healthy: usize,
    pub rollout_complete: bool,
    /// Every counted node healthy and the rollout complete: exit code 0.
    pub ok: bool,
    pub line: String,
}

/// The summary of `rows` and the rollout.
pub fn summary(rows: &[Row], rollout: &Rollout) -> Summary {
    let counted: Vec<&Row> = rows.iter().filter(|r| r.counted).collect();
    let healthy = counted.iter().filter(|r| r.healthy).count();
    let mut not = BTreeMap::<&str, usize>::new();
    for r in counted.iter().filter(|r| !r.healthy) {
        let what = match r.state {
            Verdict::Unhealthy => "unhealthy",
            Verdict::Unreachable => "unreachable",
            Verdict::PodNotRunning => "pod not running",
            Verdict::NoPod => "without a kproxy pod",
            Verdict::Healthy | Verdict::NotSelected => continue,
        };
        *not.entry(what).or_default() += 1;
    }
    let mut line = format!("{healthy}/{} nodes healthy", counted.len());
    if !not.is_empty() {
        let parts: Vec<String> = not.iter().map(|(w, n)| format!("{n} {w}")).collect();
        line += &format!(" ({})", parts.join(", "));
    }
    line += &format!(", rollout {}", rollout.message);
    let ok = healthy == counted.len() && rollout.complete;
    Summary {
        nodes: counted.len(),
        healthy,
        rollout_complete: rollout.complete,
        ok,
        line,
    }
}

/// Everything `kproxy status` shows (`-o json`).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub daemon_set: Rollout,
    pub nodes: Vec<Row>,
    pub summary: Summary,
}

/// An age as `45s`, `3m12s`, `5h2m`, `4d3h`.
pub fn age(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86400, s % 86400 / 3600),
    }
}

/// The human screen: the rollout, one line per Node, the summary.
pub fn table(report: &Report) -> String {
    let d = &report.daemon_set;
    let mut out = format!("DaemonSet {}/{}: ", d.namespace, d.name);
    if d.found {
        let running: Vec<String> = d
            .running_images
            .iter()
            .map(|(i, n)| format!("{i} ×{n}"))
            .collect();
        let _ = writeln!(
            out,
            "desired {}, updated {}, ready {}, available {}; rollout {}\n  image {}; running {}",
            d.desired,
            d.updated,
            d.ready,
            d.available,
            d.message,
            d.images.join(", "),
            if running.is_empty() {
                "nothing".to_string()
            } else {
                running.join(", ")
            }
        );
    } else {
        let _ = writeln!(out, "{}", d.message);
    }
    out.push('\n');
    let dash = || "-".to_string();
    let n = |v: Option<u64>| v.map_or_else(dash, |v| v.to_string());
    let header = [
        "NODE",
        "POD",
        "IMAGE",
        "HEALTHZ",
        "LAST SYNC",
        "CONFLICTS",
        "REPAIRS",
        "INTERFERENCE",
        "KUBE-PROXY",
        "WARMUP",
        "REJECT/NOLOCAL",
        "STATUS",
    ];
    let mut lines: Vec<[String; 12]> = vec![header.map(str::to_string)];
    for r in &report.nodes {
        let m = r.metrics.as_ref();
        let tag = |i: &String| i.rsplit_once(':').map_or(i.clone(), |(_, t)| t.to_string());
        let status = match r.state {
            Verdict::Healthy if r.reasons.is_empty() => "ok".to_string(),
            Verdict::Healthy => format!("ok; {}", r.reasons.join("; ")),
            _ => r.reasons.join("; "),
        };
        lines.push([
            r.node.clone(),
            r.pod.clone().unwrap_or_else(|| "no kproxy pod".into()),
            r.image.as_ref().map_or_else(dash, tag),
            r.healthz.map_or_else(dash, |c| c.to_string()),
            r.last_sync_age_seconds
                .map_or_else(dash, |a| format!("{} ago", age(a))),
            n(m.and_then(|m| m.frontend_conflicts)),
            n(m.and_then(|m| m.drift_repairs)),
            match (
                r.kernel_rules.as_deref(),
                m.and_then(|m| m.kernel_interference),
            ) {
                (None, None) => dash(),
                (k, i) => format!(
                    "{}{}",
                    i.map_or_else(String::new, |i| i.to_string()),
                    k.filter(|k| *k != "intact")
                        .map_or_else(String::new, |k| format!(" ({k})"))
                )
                .trim()
                .to_string(),
            },
            m.and_then(|m| m.kube_proxy_rules.as_ref())
                .map_or_else(dash, |modes| {
                    if modes.is_empty() {
                        "none".to_string()
                    } else {
                        modes.join(",")
                    }
                }),
            n(m.and_then(|m| m.endpoint_warmup_holds)),
            match m {
                Some(m) if m.traffic_counters => {
                    format!("{}/{}", n(m.rejected), n(m.no_local_endpoint_drops))
                }
                Some(_) => "off".to_string(),
                None => dash(),
            },
            if r.input_held == Some(true) && !status.contains("held") {
                format!("input held; {status}")
            } else {
                status
            },
        ]);
    }
    let widths: Vec<usize> = (0..12)
        .map(|i| {
            lines
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for l in &lines {
        let mut line = String::new();
        for (i, cell) in l.iter().enumerate() {
            if i == 11 {
                line += cell;
            } else {
                let pad = widths[i] - cell.chars().count();
                line += cell;
                line += &" ".repeat(pad + 2);
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
    let unread = report
        .nodes
        .iter()
        .filter(|r| r.healthz.is_some() && r.metrics_error.is_some())
        .count();
    if unread > 0 {
        let _ = writeln!(
            out,
            "\n/metrics not readable through the API server on {unread} pods (first: {}): kproxy serves it on metricsBindAddress, 127.0.0.1:10249 by default, which the API server cannot reach; bind it to 0.0.0.0:10249 to see the columns from it (docs/status.md)",
            report
                .nodes
                .iter()
                .find_map(|r| r.metrics_error.as_deref().filter(|_| r.healthz.is_some()))
                .unwrap_or_default()
        );
    }
    let _ = writeln!(out, "\n{}", report.summary.line);
    out
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod doc_tests {
    use super::*;

    /// The keys of every object in `v`, by path (arrays by their first element).
    fn keys(v: &Value, path: &str, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    let p = format!("{path}.{k}");
                    out.push(p.clone());
                    // runningImages is keyed by image, not by field name.
                    if k != "runningImages" {
                        keys(v, &p, out);
                    }
                }
            }
            Value::Array(a) => {
                if let Some(first) = a.first() {
                    keys(first, &format!("{path}[]"), out);
                }
            }
            _ => {}
        }
    }

    #[test]
    fn the_json_fields_are_the_ones_docs_status_md_names() {
        let doc = include_str!("../../../docs/status.md");
        let block = doc
            .split("```json\n")
            .nth(1)
            .and_then(|b| b.split("```").next())
            .expect("a json block in docs/status.md");
        let documented: Value = serde_json::from_str(block).expect("docs/status.md's JSON");
        let metrics = metrics_of("kproxy_kube_proxy_rules_present{mode=\"nftables\"} 0\n");
        let done = rollout(
            "kube-system",
            "kproxy",
            Some(&DaemonSetState::default()),
            BTreeMap::from([("kproxy:0.1.0".to_string(), 1)]),
        );
        let node = NodeState {
            name: "node-a".into(),
            labels: BTreeMap::new(),
        };
        let mut r = row(&node, true, None, None, None, jiff::Timestamp::UNIX_EPOCH);
        r.metrics = Some(metrics);
        let report = Report {
            summary: summary(std::slice::from_ref(&r), &done),
            daemon_set: done,
            nodes: vec![r],
        };
        let (mut want, mut got) = (Vec::new(), Vec::new());
        keys(&documented, "", &mut want);
        keys(&serde_json::to_value(&report).unwrap(), "", &mut got);
        want.sort();
        got.sort();
        assert_eq!(got, want);
    }
}
