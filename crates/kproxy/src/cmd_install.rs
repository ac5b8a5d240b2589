//! `kproxy install` (also `kubectl kproxy install`): prints deploy/'s manifests for this
//! cluster, for `kubectl apply -f -`. Reads, bounded (`crate::cluster`'s flags), the
//! kube-proxy ConfigMap, the `default/kubernetes` Service and its EndpointSlices, and
//! the Nodes; what they mean, what is chosen and what is refused is `manifests` (pure).
//! Prints nothing on stdout when it refuses (exit 1, the reasons on stderr).

mod manifests;

use std::collections::BTreeMap;
use std::process::ExitCode;

use anyhow::{Context, Result};

use crate::cluster::ApiArgs;
use crate::cmd_status::{get_json, list_all};
use manifests::{Found, KUBE_PROXY_CONFIG_MAP, Overrides};

/// The most bytes of one object read (a ConfigMap is at most 1 MiB).
const MAX_OBJECT_BYTES: usize = 2 << 20;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print deploy/ as it is, without reading the cluster.
    #[arg(long, conflicts_with_all = ["kubeconfig", "context", "api_server", "cluster_cidr", "image"])]
    pub defaults: bool,
    #[command(flatten)]
    pub api: ApiArgs,
    /// The API server address nodes reach without kproxy (the control-plane endpoint
    /// or its load balancer), instead of inferring it.
    #[arg(long, value_name = "URL")]
    pub api_server: Option<String>,
    /// The pod network (one CIDR per family, comma-separated) for clusterCIDR, instead
    /// of inferring it.
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Option<String>,
    /// The image of kproxy's DaemonSet (default: deploy/'s).
    #[arg(long, value_name = "IMAGE")]
    pub image: Option<String>,
}

pub fn run(args: Args) -> Result<ExitCode> {
    if args.defaults {
        print!("{}", manifests::defaults());
        return Ok(ExitCode::SUCCESS);
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let (found, cluster) = runtime.block_on(read(&args))?;
    let overrides = Overrides {
        api_server: args.api_server.clone(),
        cluster_cidr: args.cluster_cidr.clone(),
        image: args.image.clone(),
    };
    match manifests::infer(&found, &overrides) {
        Ok(inferred) => {
            print!("{}", manifests::render(&inferred, &cluster));
            Ok(ExitCode::SUCCESS)
        }
        Err(refusals) => {
            for r in refusals {
                eprintln!("kproxy: cannot infer {r}");
            }
            eprintln!("kproxy: nothing printed");
            Ok(ExitCode::from(1))
        }
    }
}

/// What the cluster says, and the words naming the API server read.
async fn read(args: &Args) -> Result<(Found, String)> {
    let (client, server) = args.api.reach().await?;
    let (ns, name) = KUBE_PROXY_CONFIG_MAP;
    let kube_proxy = get_json(
        &client,
        &format!("/api/v1/namespaces/{ns}/configmaps/{name}"),
        MAX_OBJECT_BYTES,
        &format!("ConfigMap {ns}/{name}"),
    )
    .await?
    .map(|cm| {
        cm["data"]
            .as_object()
            .into_iter()
            .flatten()
            .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
            .collect::<BTreeMap<_, _>>()
    });
    let service = get_json(
        &client,
        "/api/v1/namespaces/default/services/kubernetes",
        MAX_OBJECT_BYTES,
        "Service default/kubernetes",
    )
    .await?;
    let kubernetes_cluster_ips = service
        .iter()
        .flat_map(|s| {
            let ips = s["spec"]["clusterIPs"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            ips.into_iter().chain([s["spec"]["clusterIP"].clone()])
        })
        .filter_map(|ip| ip.as_str()?.parse().ok())
        .collect();
    let api_server_slices = list_all(
        &client,
        "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices",
        Some("kubernetes.io/service-name=kubernetes"),
    )
    .await?;
    let node_pod_cidrs = list_all(&client, "/api/v1/nodes", None)
        .await?
        .iter()
        .map(|n| {
            let name = n["metadata"]["name"].as_str().unwrap_or("").to_string();
            let cidrs = n["spec"]["podCIDRs"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c.as_str().map(str::to_string))
                .collect();
            (name, cidrs)
        })
        .collect();
    Ok((
        Found {
            kube_proxy,
            kubernetes_cluster_ips,
            api_server_slices,
            node_pod_cidrs,
        },
        server,
    ))
}
