//! `kproxy status` (also `kubectl kproxy status`): one screen for the whole cluster, from
//! the API server only. Reads kproxy's DaemonSet (the rollout), the Nodes and kproxy's
//! Pods, then asks every pod its `/healthz` and `/metrics` through the API server's
//! pods proxy subresource (`pods/NAME:PORT/proxy/PATH`), `--concurrency` pods at a
//! time, each pod bounded by `--pod-timeout` so one hung pod costs only its own row.
//! What the answers mean is `crate::status` (pure); this module does the calls and
//! prints. Why the proxy and not a status object each kproxy writes: docs/status.md.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use kproxy_source::kube as api;
use serde_json::Value;

use crate::cluster::ApiArgs;
use crate::status::{self, DaemonSetState, Fetched, NodeState, PodState, Report};

/// deploy/daemonset.yaml's labels, used to find kproxy's Pods when the DaemonSet
/// itself is missing.
const DEFAULT_POD_LABELS: [(&str, &str); 1] = [("app.kubernetes.io/name", "kproxy")];

/// Objects per page of the Node and Pod lists (kubectl's chunk size).
const PAGE: u32 = 500;
/// The most bytes of one list page, and of a DaemonSet or a `/healthz` answer.
const MAX_PAGE_BYTES: usize = 64 << 20;
const MAX_OBJECT_BYTES: usize = 1 << 20;
const MAX_HEALTHZ_BYTES: usize = 64 << 10;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub api: ApiArgs,
    /// The namespace of kproxy's DaemonSet (deploy/'s).
    #[arg(
        short = 'n',
        long,
        value_name = "NAMESPACE",
        default_value = "kube-system"
    )]
    pub namespace: String,
    /// kproxy's DaemonSet (deploy/'s); its selector finds the Pods.
    #[arg(long, value_name = "NAME", default_value = "kproxy")]
    pub daemonset: String,
    /// The Pods' container that runs kproxy (its image is the version shown).
    #[arg(long, value_name = "NAME", default_value = "kproxy")]
    pub container: String,
    /// The port of kproxy's `/healthz` (healthzBindAddress; deploy/'s 10256).
    #[arg(long, value_name = "PORT", default_value_t = 10256)]
    pub healthz_port: u16,
    /// The port of kproxy's `/metrics` (metricsBindAddress); 0: do not read it. The
    /// API server reaches it only when kproxy binds it beyond 127.0.0.1.
    #[arg(long, value_name = "PORT", default_value_t = 10249)]
    pub metrics_port: u16,
    /// Pods asked at the same time (each pod: one or two calls through the API server).
    #[arg(long, value_name = "N", default_value_t = 16)]
    pub concurrency: usize,
    /// All the calls for one pod; a pod that takes longer is "unreachable".
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = kproxy_config::parse_go_duration)]
    pub pod_timeout: Duration,
    /// The most bytes read of one pod's `/metrics` (the traffic counters make it large).
    #[arg(long, value_name = "BYTES", default_value_t = 16 << 20)]
    pub max_metrics_bytes: usize,
    /// `table` (human) or `json` (docs/status.md names the fields).
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
}

pub fn run(args: Args) -> Result<ExitCode> {
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = runtime.block_on(gather(&args))?;
    match args.output {
        Output::Table => print!("{}", status::table(&report)),
        Output::Json => println!("{}", serde_json::to_string_pretty(&report)?),
    }
    Ok(if report.summary.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// `GET path`: the answer's JSON when 200, `None` on 404, else an error naming what
/// was read.
pub(crate) async fn get_json(
    client: &kube::Client,
    path: &str,
    max: usize,
    what: &str,
) -> Result<Option<Value>> {
    let (code, body) = api::get(client, path, max)
        .await
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("reading {what}"))?;
    if code == http::StatusCode::NOT_FOUND {
        return Ok(None);
    }
    if !code.is_success() {
        let message = serde_json::from_slice::<Value>(&body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).trim().to_string());
        bail!("reading {what}: {code}: {message}");
    }
    serde_json::from_slice(&body)
        .map(Some)
        .with_context(|| format!("reading {what}: the answer is not JSON"))
}

/// Every item of a collection, page by page.
pub(crate) async fn list_all(
    client: &kube::Client,
    collection: &str,
    labels: Option<&str>,
) -> Result<Vec<Value>> {
    let mut items = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut params = kube::api::ListParams::default().limit(PAGE);
        if let Some(l) = labels {
            params = params.labels(l);
        }
        if let Some(t) = &token {
            params = params.continue_token(t);
        }
        let req = kube::core::Request::new(collection)
            .list(&params)
            .with_context(|| format!("listing {collection}"))?;
        let path = req.uri().to_string();
        let page = get_json(client, &path, MAX_PAGE_BYTES, collection)
            .await?
            .with_context(|| format!("listing {collection}: 404 Not Found"))?;
        if let Some(list) = page["items"].as_array() {
            items.extend(list.iter().cloned());
        }
        token = page["metadata"]["continue"]
            .as_str()
            .filter(|t| !t.is_empty())
            .map(str::to_string);
        if token.is_none() {
            return Ok(items);
        }
    }
}

/// One GET through the pods proxy, as [`Fetched`].
async fn proxied(client: &kube::Client, path: &str, max: usize) -> Fetched {
    match api::get(client, path, max).await {
        Ok((code, body)) => Fetched::Answer {
            code: code.as_u16(),
            body: String::from_utf8_lossy(&body).into_owned(),
        },
        Err(e) => Fetched::Failed(e),
    }
}

/// A pod's `/healthz`, then (when that was answered and a metrics port is given) its
/// `/metrics`, within `timeout` together.
async fn ask_pod(
    client: kube::Client,
    namespace: String,
    pod: String,
    args: Arc<PodCalls>,
) -> (Fetched, Option<Fetched>) {
    let base = format!("/api/v1/namespaces/{namespace}/pods/{pod}");
    let healthz_path = format!("{base}:{}/proxy/healthz", args.healthz_port);
    let late = || {
        Fetched::Failed(format!(
            "no answer within {:?} (--pod-timeout)",
            args.timeout
        ))
    };
    let deadline = tokio::time::Instant::now() + args.timeout;
    let healthz =
        tokio::time::timeout_at(deadline, proxied(&client, &healthz_path, MAX_HEALTHZ_BYTES))
            .await
            .unwrap_or_else(|_| late());
    if args.metrics_port == 0 || !status::reached(&healthz) {
        return (healthz, None);
    }
    let metrics_path = format!("{base}:{}/proxy/metrics", args.metrics_port);
    let metrics = tokio::time::timeout_at(
        deadline,
        proxied(&client, &metrics_path, args.max_metrics_bytes),
    )
    .await
    .unwrap_or_else(|_| late());
    (healthz, Some(metrics))
}

/// What each pod's calls need.
struct PodCalls {
    healthz_port: u16,
    metrics_port: u16,
    timeout: Duration,
    max_metrics_bytes: usize,
}

/// Reads the cluster and asks every pod: the report.
async fn gather(args: &Args) -> Result<Report> {
    let (client, _) = args.api.reach().await?;
    let (ns, name) = (&args.namespace, &args.daemonset);
    let ds = get_json(
        &client,
        &format!("/apis/apps/v1/namespaces/{ns}/daemonsets/{name}"),
        MAX_OBJECT_BYTES,
        &format!("DaemonSet {ns}/{name}"),
    )
    .await?
    .map(|v| DaemonSetState::from_json(&v));
    let labels: BTreeMap<String, String> = match &ds {
        Some(d) if !d.selector.is_empty() => d.selector.clone(),
        _ => DEFAULT_POD_LABELS
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    };
    let selector = labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let nodes: Vec<NodeState> = list_all(&client, "/api/v1/nodes", None)
        .await?
        .iter()
        .map(NodeState::from_json)
        .collect();
    let pods: Vec<PodState> = list_all(
        &client,
        &format!("/api/v1/namespaces/{ns}/pods"),
        Some(&selector),
    )
    .await?
    .iter()
    .map(|p| PodState::from_json(p, &args.container))
    .collect();

    // One row per Node, and per Node a pod runs on that the list no longer holds.
    let mut on_node: BTreeMap<String, Vec<&PodState>> = BTreeMap::new();
    for p in &pods {
        if let Some(n) = &p.node {
            on_node.entry(n.clone()).or_default().push(p);
        }
    }
    let mut all_nodes: BTreeMap<String, NodeState> =
        nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
    for n in on_node.keys() {
        all_nodes.entry(n.clone()).or_insert_with(|| NodeState {
            name: n.clone(),
            labels: BTreeMap::new(),
        });
    }
    let picked: Vec<(&NodeState, Option<&PodState>)> = all_nodes
        .values()
        .map(|n| {
            (
                n,
                status::pick_pod(on_node.get(&n.name).map_or(&[][..], Vec::as_slice)),
            )
        })
        .collect();

    // Ask the running pods, --concurrency at a time.
    let calls = Arc::new(PodCalls {
        healthz_port: args.healthz_port,
        metrics_port: args.metrics_port,
        timeout: args.pod_timeout,
        max_metrics_bytes: args.max_metrics_bytes,
    });
    let permits = Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    let mut tasks = tokio::task::JoinSet::new();
    for (i, (_, pod)) in picked.iter().enumerate() {
        let Some(pod) = pod.filter(|p| p.phase == "Running" && p.pod_ip.is_some()) else {
            continue;
        };
        let permit = permits.clone().acquire_owned().await?;
        let (client, ns, pod, calls) =
            (client.clone(), ns.clone(), pod.name.clone(), calls.clone());
        tasks.spawn(async move {
            let answers = ask_pod(client, ns, pod, calls).await;
            drop(permit);
            (i, answers)
        });
    }
    let mut answers: BTreeMap<usize, (Fetched, Option<Fetched>)> = BTreeMap::new();
    while let Some(done) = tasks.join_next().await {
        let (i, a) = done.context("a pod's calls")?;
        answers.insert(i, a);
    }

    let now = jiff::Timestamp::now();
    let rows: Vec<status::Row> = picked
        .iter()
        .enumerate()
        .map(|(i, (node, pod))| {
            let a = answers.get(&i);
            status::row(
                node,
                status::selected(node, ds.as_ref()),
                *pod,
                a.map(|a| &a.0),
                a.and_then(|a| a.1.as_ref()),
                now,
            )
        })
        .collect();
    let mut running: BTreeMap<String, usize> = BTreeMap::new();
    for p in &pods {
        if let Some(i) = &p.image {
            *running.entry(i.clone()).or_default() += 1;
        }
    }
    let daemon_set = status::rollout(ns, name, ds.as_ref(), running);
    let summary = status::summary(&rows, &daemon_set);
    Ok(Report {
        daemon_set,
        nodes: rows,
        summary,
    })
}
