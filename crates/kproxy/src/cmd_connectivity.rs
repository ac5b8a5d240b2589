//! `kproxy connectivity-test` (also `kubectl kproxy connectivity-test`): creates a
//! scratch namespace on the cluster, deploys a server pinned to every node and two
//! clients per node (the node's view, hostNetwork, and a pod's view) that probe every
//! Service path themselves and print one line per probe, reads the lines back through
//! the pods' `log` subresource, prints the table (node × check), and deletes the
//! namespace — also on Ctrl-C, SIGTERM and `--timeout`. A next run deletes the
//! leftovers (namespaces carrying the test's label) older than `--leftover-age`.
//!
//! Why clients that probe by themselves: reading a pod's log is one plain GET, where
//! exec needs a SPDY or websocket stream through the API server to the kubelet; and a
//! client's probes run on its node with no round trip to the API per probe.
//!
//! Every API call is bounded (`CallFlags`), every wait ends at the run's deadline, and
//! every probe at `--probe-timeout`. The decisions are pure, in `connectivity/`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;
use tokio::time::Instant;

use crate::cluster::ApiArgs;
use crate::connectivity::checks::{self, Setup, Source, TestNode};
use crate::connectivity::objects::{self, MANAGED_BY};
use crate::connectivity::report::{self, Observed, Report};
use crate::connectivity::script;

/// agnhost as upstream's e2e images name it: netexec for the servers; sh, curl and
/// `agnhost connect` for the clients.
pub const DEFAULT_IMAGE: &str = "registry.k8s.io/e2e-test-images/agnhost:2.63.0";

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub api: ApiArgs,
    /// The image of the servers and clients: agnhost (netexec; /bin/sh, curl and
    /// /agnhost for the clients), present on the nodes or pullable there.
    #[arg(long, value_name = "IMAGE", default_value = DEFAULT_IMAGE)]
    pub image: String,
    /// Test only these nodes (repeat or comma-separate; the first holds the Local
    /// Services' endpoint). Default: every Ready, schedulable Linux node.
    #[arg(long = "node", value_name = "NAME", value_delimiter = ',')]
    pub nodes: Vec<String>,
    /// An address routed to the nodes, set as the main Service's externalIP and
    /// probed from every node (without it the external-ip check is skipped).
    #[arg(long, value_name = "IP")]
    pub external_ip: Option<IpAddr>,
    /// Label the test's Services `service.kubernetes.io/service-proxy-name=NAME`: for a
    /// proxy run with `--service-proxy-name NAME` (beside another one); any other
    /// proxy leaves them alone.
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,
    /// The whole run, from the first call to the last result; the namespace is
    /// deleted after it.
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = kproxy_config::parse_go_duration)]
    pub timeout: Duration,
    /// One probe's try (connect and answer); whole seconds.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = kproxy_config::parse_go_duration)]
    pub probe_timeout: Duration,
    /// How long to wait for the load balancer's ingress IP (the loadbalancer check is
    /// skipped without one).
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = kproxy_config::parse_go_duration)]
    pub load_balancer_timeout: Duration,
    /// Delete the test's namespaces left by earlier runs (killed before their cleanup)
    /// that are older than this.
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = kproxy_config::parse_go_duration)]
    pub leftover_age: Duration,
    /// Keep the namespace after the run (to look at its pods); a next run deletes it
    /// once older than --leftover-age.
    #[arg(long)]
    pub keep: bool,
    /// Output: the table, or the report as JSON.
    #[arg(short = 'o', long, value_name = "FORMAT", default_value = "table", value_parser = ["table", "json"])]
    pub output: String,
}

/// How long the deletion of the namespace may take to be accepted.
const CLEANUP_BOUND: Duration = Duration::from_secs(30);
/// How often pods and Services are polled.
const POLL: Duration = Duration::from_secs(1);
/// Kept from the deadline for reading the clients' logs.
const LOG_RESERVE: Duration = Duration::from_secs(15);

/// The API calls the test makes, as raw JSON requests on a bounded client.
struct Api {
    client: kube::Client,
}

fn request(
    method: http::Method,
    path: &str,
    body: Option<&Value>,
) -> Result<http::Request<Vec<u8>>> {
    let mut r = http::Request::builder().method(method).uri(path);
    let bytes = match body {
        Some(b) => {
            r = r.header(http::header::CONTENT_TYPE, "application/json");
            serde_json::to_vec(b)?
        }
        None => Vec::new(),
    };
    Ok(r.body(bytes)?)
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

fn call_error(what: &str, e: &kube::Error) -> anyhow::Error {
    anyhow!("{what}: {}", kproxy_source::kube::call_error_text(e))
}

impl Api {
    async fn json(&self, method: http::Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let what = format!("{method} {path}");
        self.client
            .request::<Value>(request(method, path, body)?)
            .await
            .map_err(|e| call_error(&what, &e))
    }

    async fn get(&self, path: &str) -> Result<Value> {
        self.json(http::Method::GET, path, None).await
    }

    async fn create(&self, path: &str, object: &Value) -> Result<Value> {
        self.json(http::Method::POST, path, Some(object)).await
    }

    /// The items of a list (`labelSelector` when given).
    async fn list(&self, path: &str, selector: Option<&str>) -> Result<Vec<Value>> {
        let path = match selector {
            Some(s) => format!("{path}?labelSelector={}", s.replace('/', "%2F")),
            None => path.to_string(),
        };
        let list = self.get(&path).await?;
        Ok(list["items"].as_array().cloned().unwrap_or_default())
    }

    /// Deletes namespace `name` (its objects go with it); Ok(false): it was gone.
    async fn delete_namespace(&self, name: &str) -> Result<bool> {
        let body = serde_json::json!({"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"});
        self.delete(&format!("/api/v1/namespaces/{name}"), &body)
            .await
    }

    /// Deletes the object at `path` with these DeleteOptions; Ok(false): it was gone.
    async fn delete(&self, path: &str, body: &Value) -> Result<bool> {
        match self
            .client
            .request::<Value>(request(http::Method::DELETE, path, Some(body))?)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if is_not_found(&e) => Ok(false),
            Err(e) => Err(call_error(&format!("DELETE {path}"), &e)),
        }
    }

    async fn log(&self, namespace: &str, pod: &str) -> Result<String> {
        let path = format!("/api/v1/namespaces/{namespace}/pods/{pod}/log");
        self.client
            .request_text(request(http::Method::GET, &path, None)?)
            .await
            .map_err(|e| call_error(&format!("GET {path}"), &e))
    }
}

/// The leftovers among the test's namespaces: older than `age` at `now`, not already
/// being deleted. (name, age in seconds).
pub fn leftovers(namespaces: &[Value], now: jiff::Timestamp, age: Duration) -> Vec<(String, i64)> {
    namespaces
        .iter()
        .filter(|ns| ns["metadata"]["deletionTimestamp"].is_null())
        .filter_map(|ns| {
            let name = ns["metadata"]["name"].as_str()?;
            let created: jiff::Timestamp =
                ns["metadata"]["creationTimestamp"].as_str()?.parse().ok()?;
            let seconds = now.as_second() - created.as_second();
            (seconds >= i64::try_from(age.as_secs()).unwrap_or(i64::MAX))
                .then(|| (name.to_string(), seconds))
        })
        .collect()
}

/// The nodes to test: those named (in that order), else every Ready, schedulable
/// Linux node by name; each with its InternalIP (IPv4 first).
pub fn test_nodes(nodes: &[Value], named: &[String]) -> Result<Vec<(String, IpAddr)>> {
    let address = |n: &Value| -> Option<IpAddr> {
        let internal: Vec<IpAddr> = n["status"]["addresses"]
            .as_array()?
            .iter()
            .filter(|a| a["type"] == "InternalIP")
            .filter_map(|a| a["address"].as_str()?.parse().ok())
            .collect();
        internal
            .iter()
            .find(|a| a.is_ipv4())
            .or(internal.first())
            .copied()
    };
    let name_of = |n: &Value| n["metadata"]["name"].as_str().unwrap_or("").to_string();
    let ready = |n: &Value| {
        n["status"]["conditions"].as_array().is_some_and(|c| {
            c.iter()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
    };
    if !named.is_empty() {
        return named
            .iter()
            .map(|want| {
                let n = nodes
                    .iter()
                    .find(|n| &name_of(n) == want)
                    .with_context(|| format!("--node {want}: no such Node"))?;
                let ip = address(n)
                    .with_context(|| format!("--node {want}: the Node has no InternalIP"))?;
                Ok((want.clone(), ip))
            })
            .collect();
    }
    let mut out: Vec<(String, IpAddr)> = nodes
        .iter()
        .filter(|n| ready(n) && n["spec"]["unschedulable"] != true)
        .filter(|n| {
            let os = &n["metadata"]["labels"]["kubernetes.io/os"];
            os.is_null() || os == "linux"
        })
        .filter_map(|n| Some((name_of(n), address(n)?)))
        .collect();
    out.sort();
    if out.is_empty() {
        bail!(
            "no Ready, schedulable Linux node with an InternalIP to test (name some with --node)"
        );
    }
    Ok(out)
}

/// Why a pod is not ready or not done: its phase and its container's waiting or
/// terminated reason, or the scheduling condition's message.
pub fn pod_state(pod: &Value) -> String {
    let phase = pod["status"]["phase"].as_str().unwrap_or("no status yet");
    let mut why = Vec::new();
    for c in pod["status"]["containerStatuses"]
        .as_array()
        .into_iter()
        .flatten()
    {
        for state in ["waiting", "terminated"] {
            let s = &c["state"][state];
            if let Some(reason) = s["reason"].as_str() {
                let msg = s["message"].as_str().unwrap_or("");
                why.push(format!(
                    "{reason}{}",
                    if msg.is_empty() {
                        String::new()
                    } else {
                        format!(": {msg}")
                    }
                ));
            }
        }
    }
    for c in pod["status"]["conditions"].as_array().into_iter().flatten() {
        if c["status"] == "False"
            && let Some(msg) = c["message"].as_str()
        {
            why.push(msg.to_string());
        }
    }
    if why.is_empty() {
        phase.to_string()
    } else {
        format!("{phase}: {}", why.join("; "))
    }
}

/// Whether the EndpointSlices hold `pod` as an endpoint that is terminating and still
/// serving (what the terminating checks need).
pub fn terminating_and_serving(slices: &[Value], pod: &str) -> bool {
    slices
        .iter()
        .flat_map(|s| s["endpoints"].as_array().into_iter().flatten())
        .any(|e| {
            e["targetRef"]["name"] == pod
                && e["conditions"]["terminating"] == true
                && e["conditions"]["serving"] == true
        })
}

fn is_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

fn is_done(pod: &Value) -> bool {
    matches!(
        pod["status"]["phase"].as_str(),
        Some("Succeeded" | "Failed")
    )
}

fn ip_of(v: &Value, what: &str) -> Result<IpAddr> {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("the API server gave {what} no address ({v})"))
}

fn port_of(v: &Value, what: &str) -> Result<u16> {
    v.as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p > 0)
        .with_context(|| format!("the API server allocated {what} no port ({v})"))
}

/// The client pod of `source` on node `i`.
fn client_name(source: Source, i: usize) -> String {
    format!("client-{}-{i}", source.word())
}

/// The run inside the namespace: Services, servers, clients, results. The namespace's
/// name goes into `slot` as soon as it exists, for the cleanup.
async fn test(
    api: &Api,
    args: &Args,
    nodes: &[(String, IpAddr)],
    slot: Arc<Mutex<Option<String>>>,
    deadline: Instant,
) -> Result<Report> {
    let ns = api
        .create("/api/v1/namespaces", &objects::namespace())
        .await
        .context("creating the test's namespace")?;
    let namespace = ns["metadata"]["name"]
        .as_str()
        .context("the created namespace has no name")?
        .to_string();
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(namespace.clone());
    eprintln!(
        "kproxy: connectivity-test in namespace {namespace} on {} nodes",
        nodes.len()
    );
    let base = format!("/api/v1/namespaces/{namespace}");
    let (services, servers) = create_workloads(api, args, &base, nodes, deadline).await?;
    let mut waited: Vec<(String, &str)> = servers
        .iter()
        .zip(nodes)
        .map(|(s, (n, _))| (s.clone(), n.as_str()))
        .collect();
    waited.push((objects::TERMINATING_POD.to_string(), nodes[0].0.as_str()));
    let load_balancer = wait_for_servers(api, args, &base, &waited, deadline).await?;
    let terminating = terminate(api, &base, deadline).await?;
    let setup = setup_of(
        nodes,
        &servers,
        &services,
        load_balancer,
        terminating,
        args.external_ip,
    )?;
    // The clients.
    let left = deadline.saturating_duration_since(Instant::now());
    let mut clients = Vec::new();
    for (i, (node, _)) in nodes.iter().enumerate() {
        for source in Source::ALL {
            let probes = checks::probes(&setup, i);
            let text = script::render(&probes, args.probe_timeout);
            let name = client_name(source, i);
            let pod = objects::client(
                &name,
                node,
                &args.image,
                source == Source::Node,
                &text,
                left.as_secs(),
            );
            api.create(&format!("{base}/pods"), &pod)
                .await
                .with_context(|| format!("creating the client pod {name} on {node}"))?;
            clients.push((i, source, name, probes));
        }
    }
    let probe_deadline = deadline.checked_sub(LOG_RESERVE).unwrap_or(deadline);
    let pods = loop {
        let pods = api
            .list(
                &format!("{base}/pods"),
                Some(&objects::role_selector("client")),
            )
            .await?;
        let done = clients.iter().all(|(_, _, name, _)| {
            pods.iter()
                .any(|p| p["metadata"]["name"] == name.as_str() && is_done(p))
        });
        if done || Instant::now() + POLL >= probe_deadline {
            break pods;
        }
        tokio::time::sleep(POLL).await;
    };
    let skipped = checks::skips(&setup);
    let mut cells = Vec::new();
    for (i, source, name, probes) in &clients {
        let pod = pods.iter().find(|p| p["metadata"]["name"] == name.as_str());
        let seen = observations(api, &namespace, name, pod, probes.len()).await;
        cells.extend(report::cells(&nodes[*i].0, *source, probes, seen, &skipped));
    }
    Ok(Report {
        namespace,
        nodes: nodes.iter().map(|(n, _)| n.clone()).collect(),
        cells,
        cleanup: String::new(),
    })
}

/// The Services (by name, as created: their allocations), a server pinned to every
/// node (named in the order of `nodes`) and the terminating server on the first.
async fn create_workloads(
    api: &Api,
    args: &Args,
    base: &str,
    nodes: &[(String, IpAddr)],
    deadline: Instant,
) -> Result<(BTreeMap<String, Value>, Vec<String>)> {
    let external = args.external_ip.map(|ip| ip.to_string());
    let mut services = BTreeMap::new();
    for s in objects::services(external.as_deref(), args.service_proxy_name.as_deref()) {
        let name = s["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let created = api
            .create(&format!("{base}/services"), &s)
            .await
            .with_context(|| format!("creating Service {name} in {base}"))?;
        services.insert(name, created);
    }
    let servers: Vec<String> = (0..nodes.len()).map(|i| format!("server-{i}")).collect();
    for (i, (node, _)) in nodes.iter().enumerate() {
        let pod = objects::server(&servers[i], node, &args.image, i == 0);
        api.create(&format!("{base}/pods"), &pod)
            .await
            .with_context(|| format!("creating the server pod on {node}"))?;
    }
    // Its preStop hook lasts the rest of the run.
    let grace = deadline.saturating_duration_since(Instant::now()).as_secs();
    let pod = objects::terminating_server(&nodes[0].0, &args.image, grace);
    api.create(&format!("{base}/pods"), &pod)
        .await
        .with_context(|| format!("creating the terminating server on {}", nodes[0].0))?;
    Ok((services, servers))
}

/// Waits until every pod of `waited` (name, node) is ready and the main Service's load
/// balancer has its address or `--load-balancer-timeout` is over; that address, or why
/// there is none. `Err`: a pod not ready by the deadline (each named, with why).
async fn wait_for_servers(
    api: &Api,
    args: &Args,
    base: &str,
    waited: &[(String, &str)],
    deadline: Instant,
) -> Result<Result<IpAddr, String>> {
    let lb_deadline = Instant::now() + args.load_balancer_timeout;
    let mut load_balancer: Option<Result<IpAddr, String>> = None;
    loop {
        if load_balancer.is_none() {
            let main = api
                .get(&format!("{base}/services/{}", objects::MAIN))
                .await?;
            let ingress = &main["status"]["loadBalancer"]["ingress"][0];
            if let Some(ip) = ingress["ip"].as_str().and_then(|s| s.parse().ok()) {
                load_balancer = Some(Ok(ip));
            } else if let Some(host) = ingress["hostname"].as_str() {
                load_balancer = Some(Err(format!(
                    "the load balancer's ingress is a host name ({host}), not probed"
                )));
            } else if Instant::now() >= lb_deadline {
                load_balancer = Some(Err(format!(
                    "no ingress IP within --load-balancer-timeout {:?} (no load-balancer controller?)",
                    args.load_balancer_timeout
                )));
            }
        }
        let pods = api.list(&format!("{base}/pods"), None).await?;
        let not_ready: Vec<String> = waited
            .iter()
            .filter_map(|(name, node)| {
                let pod = pods.iter().find(|p| p["metadata"]["name"] == name.as_str());
                match pod {
                    Some(p) if is_ready(p) => None,
                    Some(p) => Some(format!("{name} on {node}: {}", pod_state(p))),
                    None => Some(format!("{name} on {node}: not found")),
                }
            })
            .collect();
        if let (true, Some(lb)) = (not_ready.is_empty(), &load_balancer) {
            return Ok(lb.clone());
        }
        if Instant::now() + POLL >= deadline {
            bail!(
                "the servers were not ready within --timeout: {}",
                not_ready.join("; ")
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The test's facts from the Services as the API server allocated them.
fn setup_of(
    nodes: &[(String, IpAddr)],
    servers: &[String],
    services: &BTreeMap<String, Value>,
    load_balancer: Result<IpAddr, String>,
    terminating: Result<(), String>,
    external_ip: Option<IpAddr>,
) -> Result<Setup> {
    let spec = |name: &str| &services[name]["spec"];
    let cluster_ip = |name: &str| ip_of(&spec(name)["clusterIP"], &format!("Service {name}"));
    let health_port = |name: &str| {
        port_of(
            &spec(name)["healthCheckNodePort"],
            &format!("Service {name}'s healthCheckNodePort"),
        )
    };
    Ok(Setup {
        nodes: nodes
            .iter()
            .zip(servers)
            .map(|((name, address), server)| TestNode {
                name: name.clone(),
                address: *address,
                server: server.clone(),
            })
            .collect(),
        local: 0,
        cluster_ip: cluster_ip(objects::MAIN)?,
        tcp_port: objects::TCP_PORT,
        udp_port: objects::UDP_PORT,
        node_port: port_of(
            &spec(objects::MAIN)["ports"][0]["nodePort"],
            "Service main's NodePort",
        )?,
        load_balancer,
        external_ip,
        affinity_ip: cluster_ip(objects::AFFINITY)?,
        health_check_node_port: health_port(objects::LOCAL)?,
        internal_local_ip: cluster_ip(objects::INTERNAL_LOCAL)?,
        no_endpoints_ip: cluster_ip(objects::NO_ENDPOINTS)?,
        terminating: match terminating {
            Ok(()) => Ok(checks::TerminatingService {
                cluster_ip: cluster_ip(objects::TERMINATING)?,
                health_check_node_port: health_port(objects::TERMINATING)?,
                server: objects::TERMINATING_POD.to_string(),
            }),
            Err(why) => Err(why),
        },
    })
}

/// What the client `name` saw, one per probe: its log read back, or why there is no
/// result (not finished, log unreadable, gone).
async fn observations(
    api: &Api,
    namespace: &str,
    name: &str,
    pod: Option<&Value>,
    count: usize,
) -> Vec<Observed> {
    let missing = |why: String| vec![Observed::Missing(why); count];
    let Some(pod) = pod else {
        return missing(format!("the client {name} is gone"));
    };
    let state = pod_state(pod);
    if !is_done(pod) {
        return missing(format!("the client {name} did not finish in time: {state}"));
    }
    match api.log(namespace, name).await {
        Ok(log) => {
            let (seen, finished) = script::parse(&log, count);
            let why = if finished {
                "the client printed no result for it".to_string()
            } else {
                format!("the client {name} stopped before it ({state})")
            };
            seen.into_iter()
                .map(|o| o.unwrap_or_else(|| Observed::Missing(why.clone())))
                .collect()
        }
        Err(e) => missing(format!("the client {name}'s log could not be read: {e:#}")),
    }
}

/// How long the terminating pod's endpoint may take to show as terminating and
/// serving before the terminating checks are skipped.
const TERMINATING_BOUND: Duration = Duration::from_secs(30);

/// Deletes the terminating server (its preStop hook keeps it serving) and waits until
/// its Service's EndpointSlice shows it terminating and serving. `Err`: why the
/// terminating checks are skipped.
async fn terminate(api: &Api, base: &str, deadline: Instant) -> Result<Result<(), String>> {
    let pod = format!("{base}/pods/{}", objects::TERMINATING_POD);
    api.delete(
        &pod,
        &serde_json::json!({"kind": "DeleteOptions", "apiVersion": "v1"}),
    )
    .await?;
    let until = deadline.min(Instant::now() + TERMINATING_BOUND);
    let selector = format!("kubernetes.io/service-name={}", objects::TERMINATING);
    let slices = format!(
        "/apis/discovery.k8s.io/v1/{}/endpointslices",
        base.trim_start_matches("/api/v1/")
    );
    loop {
        if terminating_and_serving(
            &api.list(&slices, Some(&selector)).await?,
            objects::TERMINATING_POD,
        ) {
            return Ok(Ok(()));
        }
        if Instant::now() + POLL >= until {
            return Ok(Err(format!(
                "the deleted pod {} did not show as terminating and serving in its EndpointSlice within {TERMINATING_BOUND:?}",
                objects::TERMINATING_POD
            )));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The first of SIGINT and SIGTERM, by name (never, if they cannot be caught).
async fn signalled() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

enum Outcome {
    Done(Result<Report>),
    TimedOut,
    Signalled(&'static str),
}

async fn run_async(args: Args) -> Result<ExitCode> {
    let start = Instant::now();
    let (client, server) = args.api.reach().await?;
    let api = Api { client };
    let selector = objects::selector(MANAGED_BY);
    let ours = api
        .list("/api/v1/namespaces", Some(&selector))
        .await
        .with_context(|| format!("listing the test's namespaces; {server}"))?;
    for (name, age) in leftovers(&ours, jiff::Timestamp::now(), args.leftover_age) {
        match api.delete_namespace(&name).await {
            Ok(_) => eprintln!(
                "kproxy: deleted namespace {name}, left by an earlier run {} min ago",
                age / 60
            ),
            Err(e) => eprintln!("kproxy: warning: a leftover namespace {name}: {e:#}"),
        }
    }
    let nodes = test_nodes(
        &api.list("/api/v1/nodes", None)
            .await
            .context("listing Nodes")?,
        &args.nodes,
    )?;
    let slot = Arc::new(Mutex::new(None));
    let deadline = start + args.timeout;
    let outcome = tokio::select! {
        r = tokio::time::timeout_at(deadline, test(&api, &args, &nodes, slot.clone(), deadline)) => match r {
            Ok(r) => Outcome::Done(r),
            Err(_) => Outcome::TimedOut,
        },
        s = signalled() => Outcome::Signalled(s),
    };
    let namespace = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
    let cleanup = match namespace {
        None => "no namespace was created".to_string(),
        Some(ns) if args.keep => format!("namespace {ns} kept (--keep)"),
        Some(ns) => match tokio::time::timeout(CLEANUP_BOUND, async {
            // The terminating pod would sleep out its preStop hook: ended at once.
            let pod = format!("/api/v1/namespaces/{ns}/pods/{}", objects::TERMINATING_POD);
            let now = serde_json::json!({"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0});
            if let Err(e) = api.delete(&pod, &now).await {
                eprintln!("kproxy: warning: {e:#}");
            }
            api.delete_namespace(&ns).await
        })
        .await
        {
            Ok(Ok(_)) => format!("namespace {ns} deleted"),
            Ok(Err(e)) => format!(
                "the namespace {ns} could not be deleted ({e:#}): kubectl delete namespace {ns}"
            ),
            Err(_) => format!(
                "deleting the namespace {ns} took over {CLEANUP_BOUND:?}: kubectl delete namespace {ns}"
            ),
        },
    };
    match outcome {
        Outcome::Done(Ok(mut report)) => {
            report.cleanup = cleanup;
            if args.output == "json" {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.text());
            }
            Ok(if report.failed() > 0 {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            })
        }
        Outcome::Done(Err(e)) => Err(e.context(cleanup)),
        Outcome::TimedOut => bail!("the run took over --timeout {:?}; {cleanup}", args.timeout),
        Outcome::Signalled(name) => {
            eprintln!("kproxy: {name}: connectivity-test stopped; {cleanup}");
            Ok(ExitCode::from(if name == "SIGINT" { 130 } else { 143 }))
        }
    }
}

pub fn run(args: Args) -> Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_async(args))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn leftovers_are_the_old_ones_not_being_deleted() {
        let ns = |name: &str, created: &str, deleting: bool| {
            let mut v = json!({"metadata": {"name": name, "creationTimestamp": created}});
            if deleting {
                v["metadata"]["deletionTimestamp"] = json!(created);
            }
            v
        };
        let now: jiff::Timestamp = "2026-11-29T05:00:00Z".parse().unwrap();
        let list = [
            ns("old", "2026-11-29T04:00:00Z", false),
            ns("fresh", "2026-11-29T04:55:00Z", false),
            ns("going", "2026-11-29T03:00:00Z", true),
            json!({"metadata": {"name": "no-time"}}),
        ];
        assert_eq!(
            leftovers(&list, now, Duration::from_secs(30 * 60)),
            [("old".to_string(), 3600)]
        );
        assert_eq!(leftovers(&list, now, Duration::ZERO).len(), 2);
    }

    #[test]
    fn nodes_under_test() {
        let node = |name: &str, ready: bool, extra: Value| {
            let mut v = json!({
                "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux"}},
                "spec": {},
                "status": {
                    "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}],
                    "addresses": [{"type": "Hostname", "address": name},
                                  {"type": "InternalIP", "address": "fd00::5"},
                                  {"type": "InternalIP", "address": "192.168.0.5"}],
                },
            });
            if let Some(o) = extra.as_object() {
                for (k, x) in o {
                    v["spec"][k] = x.clone();
                }
            }
            v
        };
        let mut windows = node("win", true, json!({}));
        windows["metadata"]["labels"]["kubernetes.io/os"] = json!("windows");
        let list = [
            node("b", true, json!({})),
            node("a", true, json!({})),
            node("down", false, json!({})),
            node("cordoned", true, json!({"unschedulable": true})),
            windows,
        ];
        let got = test_nodes(&list, &[]).unwrap();
        let v4: IpAddr = "192.168.0.5".parse().unwrap();
        assert_eq!(got, [("a".to_string(), v4), ("b".to_string(), v4)]);
        let named = test_nodes(&list, &["down".into(), "a".into()]).unwrap();
        assert_eq!(named[0].0, "down", "named: in that order, Ready or not");
        let err = test_nodes(&list, &["zz".into()]).unwrap_err();
        assert_eq!(err.to_string(), "--node zz: no such Node");
        assert!(test_nodes(&[], &[]).is_err());
    }

    #[test]
    fn the_terminating_endpoint_must_serve() {
        let slice = |terminating: bool, serving: bool| {
            json!({"endpoints": [
                {"targetRef": {"name": "server-0"}, "conditions": {"terminating": true, "serving": true}},
                {"targetRef": {"name": "terminating-0"},
                 "conditions": {"ready": false, "terminating": terminating, "serving": serving}}]})
        };
        assert!(terminating_and_serving(
            &[slice(true, true)],
            "terminating-0"
        ));
        assert!(!terminating_and_serving(
            &[slice(false, true)],
            "terminating-0"
        ));
        assert!(!terminating_and_serving(
            &[slice(true, false)],
            "terminating-0"
        ));
        assert!(!terminating_and_serving(&[json!({})], "terminating-0"));
    }

    #[test]
    fn a_pod_says_why_it_is_not_ready() {
        let pod = json!({"status": {"phase": "Pending",
            "containerStatuses": [{"state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}],
            "conditions": [{"type": "Ready", "status": "False"}]}});
        assert_eq!(pod_state(&pod), "Pending: ErrImagePull: not found");
        assert_eq!(pod_state(&json!({})), "no status yet");
    }
}
