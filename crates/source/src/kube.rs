//! The Kubernetes API source: three kube-rs watchers (Services, EndpointSlices, this
//! Node) folded into the one [`StateHandle`], the same ClusterState the manifest source
//! fills. Owns: which objects are watched (upstream's label selectors, spec §a.1/§f),
//! when the first sync may happen (all three kinds listed), and how relists are applied
//! (atomically per kind, see [`fold`]).
//!
//! Failure model: kube-rs' watcher resumes a dropped watch from the last
//! resourceVersion, relists on 410 Gone, and retries errors with its default backoff
//! (client-go's: 0.8 s doubling to 30 s, jittered). Meanwhile the last state stays in
//! place, so the rules already programmed keep serving.

pub mod fold;
pub mod raw;

use std::path::{Path, PathBuf};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::discovery::v1 as discoveryv1;
use kproxy_core::ingest::{self, Kind, Ownership};
use kproxy_core::manifest::Object;
use kube::api::Api;
use kube::runtime::{WatchStreamExt, watcher};

use crate::StateHandle;
use fold::{Folder, Input, Key};
use raw::Raw;

/// What the Kubernetes source needs to know.
#[derive(Clone, Debug, Default)]
pub struct KubeSourceConfig {
    /// This node's name (`--hostname-override`, else the host name): selects the Node
    /// watched and which endpoints are local.
    pub node_name: String,
    pub ownership: Ownership,
}

#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(
        "node name {0:?} is not a valid Kubernetes node name (DNS subdomain: lower-case letters, digits, '-', '.'; at most 253)"
    )]
    InvalidNodeName(String),
    #[error(
        "service proxy name {0:?} is not a valid label value (1-63 letters, digits, '-', '_', '.', starting and ending alphanumeric)"
    )]
    InvalidServiceProxyName(String),
    #[error("cannot load kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        source: kube::config::KubeconfigError,
    },
    #[error("no --kubeconfig given and not running in a cluster: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    #[error("the Kubernetes watches ended")]
    WatchEnded,
}

/// A client from a kubeconfig file, or the in-cluster configuration (service account
/// token and `KUBERNETES_SERVICE_HOST`) when `kubeconfig` is `None`, as kube-proxy.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, SourceError> {
    let config = match kubeconfig {
        Some(path) => {
            let err = |source| SourceError::Kubeconfig {
                path: path.to_path_buf(),
                source,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(err)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(err)?
        }
        None => kube::Config::incluster().map_err(SourceError::InCluster)?,
    };
    kube::Client::try_from(config).map_err(SourceError::Client)
}

/// Upstream's label selector for Services and EndpointSlices (spec §a.1): skip headless
/// and other proxies' objects; with a service proxy name, take exactly that proxy's.
pub fn label_selector(ownership: &Ownership) -> String {
    match &ownership.service_proxy_name {
        None => format!(
            "!{},!{}",
            ingest::LABEL_HEADLESS,
            ingest::LABEL_SERVICE_PROXY_NAME
        ),
        Some(name) => format!(
            "!{},{}={name}",
            ingest::LABEL_HEADLESS,
            ingest::LABEL_SERVICE_PROXY_NAME
        ),
    }
}

/// The Node's field selector.
pub fn node_field_selector(node_name: &str) -> String {
    format!("metadata.name={node_name}")
}

/// DNS-1123 subdomain, as the API server requires of Node names.
fn valid_node_name(s: &str) -> bool {
    let alnum = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|label| {
            let b = label.as_bytes();
            !b.is_empty()
                && alnum(b[0])
                && alnum(b[b.len() - 1])
                && b.iter().all(|&c| alnum(c) || c == b'-')
        })
}

/// A label value, as the API server requires (non-empty here: an empty name would be
/// ambiguous with "no service proxy name").
fn valid_label_value(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

impl KubeSourceConfig {
    /// Both strings reach a URL query and log lines: refuse what the API server would.
    pub fn validate(&self) -> Result<(), SourceError> {
        if !valid_node_name(&self.node_name) {
            return Err(SourceError::InvalidNodeName(self.node_name.clone()));
        }
        if let Some(name) = &self.ownership.service_proxy_name
            && !valid_label_value(name)
        {
            return Err(SourceError::InvalidServiceProxyName(name.clone()));
        }
        Ok(())
    }
}

/// A kind kproxy watches.
trait Watched:
    kube::Resource<DynamicType = (), Scope = Self::S> + serde::de::DeserializeOwned + 'static
{
    type S;
    const KIND: Kind;
    fn object(self) -> Object;
}

impl Watched for corev1::Service {
    type S = k8s_openapi::NamespaceResourceScope;
    const KIND: Kind = Kind::Service;
    fn object(self) -> Object {
        Object::Service(Box::new(self))
    }
}

impl Watched for discoveryv1::EndpointSlice {
    type S = k8s_openapi::NamespaceResourceScope;
    const KIND: Kind = Kind::EndpointSlice;
    fn object(self) -> Object {
        Object::EndpointSlice(Box::new(self))
    }
}

impl Watched for corev1::Node {
    type S = k8s_openapi::ClusterResourceScope;
    const KIND: Kind = Kind::Node;
    fn object(self) -> Object {
        Object::Node(Box::new(self))
    }
}

fn key<K>(raw: &Raw<K>) -> Key {
    (
        raw.namespace().unwrap_or_default().to_string(),
        raw.name().unwrap_or_default().to_string(),
    )
}

fn decode<K: Watched>(raw: Raw<K>) -> (Key, Result<Object, ingest::IngestError>) {
    let key = key(&raw);
    let decoded = raw
        .typed()
        .map(K::object)
        .map_err(|e| fold::decode_warning(K::KIND, &key, &e.field, &e.reason));
    (key, decoded)
}

fn input<K: Watched>(event: watcher::Event<Raw<K>>) -> Input {
    match event {
        watcher::Event::Init => Input::Init,
        watcher::Event::InitApply(raw) => {
            let (k, d) = decode(raw);
            Input::Listed(k, d)
        }
        watcher::Event::InitDone => Input::InitDone,
        watcher::Event::Apply(raw) => {
            let (k, d) = decode(raw);
            Input::Apply(k, d)
        }
        watcher::Event::Delete(raw) => Input::Delete(key(&raw)),
    }
}

type Tagged = (Kind, Result<Input, watcher::Error>);

/// One kind's watcher, with backoff, its events decoded and tagged with the kind.
fn watch<K: Watched>(
    client: kube::Client,
    config: watcher::Config,
) -> impl Stream<Item = Tagged> + Send
where
    Raw<K>: kube::Resource<DynamicType = ()>,
{
    let api: Api<Raw<K>> = Api::all(client);
    watcher(api, config)
        .default_backoff()
        .map(|r| (K::KIND, r.map(input::<K>)))
}

/// Runs until cancelled (drop the future): watchers for Services and EndpointSlices
/// (label selector as upstream, §f; with a service proxy name, the Services carrying
/// it) and this Node (field selector `metadata.name`). Marks `handle` ready once all
/// three have been listed. Relists with backoff on errors, 410 Gone and dropped
/// connections; the last state stays in place meanwhile.
pub async fn run(
    client: kube::Client,
    cfg: KubeSourceConfig,
    handle: StateHandle,
) -> Result<(), SourceError> {
    cfg.validate()?;
    let labels = label_selector(&cfg.ownership);
    // Lists with resourceVersion=0 are served from the API server's watch cache, as
    // client-go's reflectors do: thousands of nodes relisting must not all reach etcd.
    // kube-rs drops resourceVersion=0 from paginated lists, and the watch cache answers
    // in one response anyway, so no page size.
    let base = || {
        let mut c = watcher::Config::default().any_semantic();
        c.page_size = None;
        c
    };
    let streams = vec![
        watch::<corev1::Service>(client.clone(), base().labels(&labels)).boxed(),
        watch::<discoveryv1::EndpointSlice>(client.clone(), base().labels(&labels)).boxed(),
        watch::<corev1::Node>(client, base().fields(&node_field_selector(&cfg.node_name))).boxed(),
    ];
    let mut events = futures::stream::select_all(streams);
    let mut folder = Folder::new();
    let mut ready = false;
    tracing::info!(node = %cfg.node_name, label_selector = %labels, "watching the Kubernetes API");
    while let Some((kind, item)) = events.next().await {
        let event = match item {
            Ok(event) => event,
            Err(e) => {
                // The watcher recovers on its own (resume, or relist on 410) after the
                // backoff; the state, and so the programmed rules, stay as they are.
                let error = e.to_string();
                tracing::warn!(%kind, error = %error.escape_debug(), "watch error; keeping the last state and retrying");
                continue;
            }
        };
        let relist = matches!(event, Input::InitDone);
        let (change, skipped) = folder.step(kind, event);
        for w in &skipped {
            tracing::warn!("skipped {w}");
        }
        if let Some(change) = change {
            let warnings = handle
                .update(|state| fold::apply_change(state, change, &cfg.ownership, &cfg.node_name));
            for w in &warnings {
                tracing::warn!("{w}");
            }
        }
        if relist {
            tracing::info!(%kind, "listed");
        }
        if !ready && folder.all_listed() {
            ready = true;
            tracing::info!("Services, EndpointSlices and the Node listed: first sync allowed");
            handle.mark_ready();
        }
    }
    // select_all ends only when every watcher ended, which kube's watcher never does.
    Err(SourceError::WatchEnded)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_are_upstreams() {
        assert_eq!(
            label_selector(&Ownership::default()),
            "!service.kubernetes.io/headless,!service.kubernetes.io/service-proxy-name"
        );
        assert_eq!(
            label_selector(&Ownership {
                service_proxy_name: Some("kproxy".into())
            }),
            "!service.kubernetes.io/headless,service.kubernetes.io/service-proxy-name=kproxy"
        );
        assert_eq!(node_field_selector("node-a"), "metadata.name=node-a");
    }

    #[test]
    fn names_that_reach_selectors_are_validated() {
        let cfg = |node: &str, spn: Option<&str>| KubeSourceConfig {
            node_name: node.into(),
            ownership: Ownership {
                service_proxy_name: spn.map(str::to_string),
            },
        };
        for (node, spn, ok) in [
            ("node-a", None, true),
            ("ip-10-0-0-1.ec2.internal", None, true),
            ("Node-A", None, false),
            ("", None, false),
            ("a,metadata.name=b", None, false),
            ("node-", None, false),
            ("node-a", Some("kproxy"), true),
            ("node-a", Some("my_proxy.v1"), true),
            ("node-a", Some(""), false),
            ("node-a", Some("x,!y"), false),
            ("node-a", Some("-x"), false),
        ] {
            assert_eq!(cfg(node, spn).validate().is_ok(), ok, "{node:?} {spn:?}");
        }
        assert!(!valid_node_name(&"a".repeat(254)));
        assert!(!valid_label_value(&"a".repeat(64)));
    }
}
