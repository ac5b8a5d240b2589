//! What `kproxy install` prints, decided from what the cluster said (pure): the API
//! server address a node reaches without kproxy, the pod CIDR(s) for `clusterCIDR`,
//! the kube-proxy settings carried into kproxy's config.yaml (and those dropped, with
//! why), the image; then deploy/'s files with those values substituted line by line
//! (deploy/'s comments kept), under a header of YAML comments naming each value and
//! where it came from. deploy/ is the one template: the files are included here, and
//! `--defaults` prints them unchanged.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use kproxy_config::{ConfigError, ConfigFlags, FieldUse};
use serde_json::Value;

/// deploy/'s files, in the order they are applied: the ServiceAccount before the pods
/// that use it.
pub const DEPLOY: [(&str, &str); 3] = [
    (
        "deploy/rbac.yaml",
        include_str!("../../../../deploy/rbac.yaml"),
    ),
    (
        "deploy/configmap.yaml",
        include_str!("../../../../deploy/configmap.yaml"),
    ),
    (
        "deploy/daemonset.yaml",
        include_str!("../../../../deploy/daemonset.yaml"),
    ),
];

/// Where kubeadm keeps kube-proxy's configuration, and its keys.
pub const KUBE_PROXY_CONFIG_MAP: (&str, &str) = ("kube-system", "kube-proxy");
const KUBE_PROXY_CONFIG_KEY: &str = "config.conf";
const KUBE_PROXY_KUBECONFIG_KEY: &str = "kubeconfig.conf";

/// Fields of kube-proxy's configuration not carried over although kproxy honours
/// them: `clusterCIDR` is inferred on its own, and `clientConnection.kubeconfig` is a
/// path in kube-proxy's pod (kproxy's is deploy/'s mount).
const NOT_CARRIED: [&str; 4] = [
    "apiVersion",
    "kind",
    "clusterCIDR",
    "clientConnection.kubeconfig",
];

/// A node's pod CIDRs are summarised into the block of at most this many leading bits
/// per family that holds them all: kubeadm's pod network is a /16 of IPv4; IPv6 pod
/// networks are /48 to /64.
const SUMMARY_PREFIX_V4: u8 = 16;
const SUMMARY_PREFIX_V6: u8 = 48;

/// What the cluster said (read at the edge, `cmd_install`).
#[derive(Clone, Debug, Default)]
pub struct Found {
    /// ConfigMap kube-system/kube-proxy's `data`, when it exists.
    pub kube_proxy: Option<BTreeMap<String, String>>,
    /// The `default/kubernetes` Service's cluster IPs: never the server's address.
    pub kubernetes_cluster_ips: Vec<IpAddr>,
    /// The `default/kubernetes` Service's EndpointSlices, as the API serves them.
    pub api_server_slices: Vec<Value>,
    /// Every Node's name and `spec.podCIDRs`.
    pub node_pod_cidrs: Vec<(String, Vec<String>)>,
}

/// What the operator gave instead of inferring.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub api_server: Option<String>,
    pub cluster_cidr: Option<String>,
    pub image: Option<String>,
}

/// One value and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chosen {
    pub value: String,
    pub from: String,
}

/// Everything `kproxy install` substitutes into deploy/.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inferred {
    pub api_server: Chosen,
    pub cluster_cidr: Chosen,
    pub image: Chosen,
    /// kube-proxy's fields carried into config.yaml: dotted path, value as JSON (one
    /// line, and valid YAML).
    pub carried: Vec<(String, String)>,
    /// kube-proxy's fields not carried: dotted path (with the value), why.
    pub dropped: Vec<(String, String)>,
    /// What else the reader should know (a source passed over, and why).
    pub notes: Vec<String>,
}

/// deploy/ byte for byte: the files in [`DEPLOY`]'s order, `---` between them.
pub fn defaults() -> String {
    DEPLOY.map(|(_, text)| text).join("---\n")
}

/// The image deploy/'s DaemonSet runs (its first `image:`).
pub fn default_image() -> &'static str {
    DEPLOY[2]
        .1
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("image: "))
        .unwrap_or("")
        .trim()
}

/// Decides every value from `found` and `overrides`; `Err`: each value that could not
/// be inferred, with what to give instead.
pub fn infer(found: &Found, overrides: &Overrides) -> Result<Inferred, Vec<String>> {
    let mut notes = Vec::new();
    let mut refusals = Vec::new();
    let map = found.kube_proxy.as_ref();
    let map_name = format!(
        "ConfigMap {}/{}",
        KUBE_PROXY_CONFIG_MAP.0, KUBE_PROXY_CONFIG_MAP.1
    );
    let config_text = map.and_then(|m| m.get(KUBE_PROXY_CONFIG_KEY));
    let config: Option<Value> = match config_text.map(|t| serde_saphyr::from_str::<Value>(t)) {
        Some(Ok(v @ Value::Object(_))) => Some(v),
        Some(Ok(_)) => {
            notes.push(format!(
                "{map_name} key {KUBE_PROXY_CONFIG_KEY} is not a KubeProxyConfiguration object: nothing read from it"
            ));
            None
        }
        Some(Err(e)) => {
            notes.push(format!(
                "{map_name} key {KUBE_PROXY_CONFIG_KEY} is not YAML ({}): nothing read from it",
                e.to_string().lines().next().unwrap_or("")
            ));
            None
        }
        None => None,
    };

    let api_server = match &overrides.api_server {
        Some(url) => check_server(url, &found.kubernetes_cluster_ips)
            .map(|value| Chosen {
                value,
                from: "--api-server".into(),
            })
            .map_err(|why| format!("--api-server {url}: {why}")),
        None => infer_server(found, &map_name, &mut notes),
    };
    let api_server = api_server.map_err(|e| refusals.push(e)).ok();

    let config_cidr = config
        .as_ref()
        .and_then(|c| c["clusterCIDR"].as_str())
        .filter(|s| !s.trim().is_empty());
    let cluster_cidr = match (&overrides.cluster_cidr, config_cidr) {
        (Some(c), _) => check_cidrs(c)
            .map(|value| Chosen {
                value,
                from: "--cluster-cidr".into(),
            })
            .map_err(|why| format!("--cluster-cidr {c}: {why}")),
        (None, Some(c)) => check_cidrs(c)
            .map(|value| Chosen {
                value,
                from: format!("{map_name} key {KUBE_PROXY_CONFIG_KEY}, clusterCIDR"),
            })
            .map_err(|why| {
                format!("{map_name} key {KUBE_PROXY_CONFIG_KEY}: clusterCIDR {c:?}: {why}; give --cluster-cidr")
            }),
        (None, None) => summarise_pod_cidrs(&found.node_pod_cidrs),
    };
    let cluster_cidr = cluster_cidr.map_err(|e| refusals.push(e)).ok();

    let image = match &overrides.image {
        Some(i) if i.is_empty() || i.chars().any(|c| c.is_whitespace() || c == '#') => {
            refusals.push(format!("--image {i:?}: not an image reference"));
            None
        }
        Some(i) => Some(Chosen {
            value: i.clone(),
            from: "--image".into(),
        }),
        None => Some(Chosen {
            value: default_image().to_string(),
            from: "deploy/daemonset.yaml (give --image for yours)".into(),
        }),
    };

    let (Some(api_server), Some(cluster_cidr), Some(image)) = (api_server, cluster_cidr, image)
    else {
        return Err(refusals);
    };
    let origin = format!("{map_name} key {KUBE_PROXY_CONFIG_KEY}");
    if let Some(note) = config.as_ref().and_then(node_port_change) {
        notes.push(note);
    }
    let (carried, dropped) = match &config {
        Some(c) => carry(c, &origin, &cluster_cidr.value)?,
        None => (Vec::new(), Vec::new()),
    };
    Ok(Inferred {
        api_server,
        cluster_cidr,
        image,
        carried,
        dropped,
        notes,
    })
}

/// kube-proxy in iptables or IPVS mode (the default on Linux) with nodePortAddresses
/// unset accepted NodePorts on every local address; kproxy, as nftables mode, on the
/// node's primary addresses: said, with the setting that keeps the old reach.
fn node_port_change(config: &Value) -> Option<String> {
    let mode = config["mode"].as_str().unwrap_or("");
    let unset = match &config["nodePortAddresses"] {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        _ => false,
    };
    (mode != "nftables" && unset).then(|| {
        format!(
            "kube-proxy ({} mode, nodePortAddresses unset) accepted NodePorts on every local address; kproxy, as nftables mode, accepts them on the node's primary addresses (deploy/'s nodePortAddresses: [primary]); set nodePortAddresses: [0.0.0.0/0, ::/0] to keep every address",
            if mode.is_empty() { "iptables" } else { mode }
        )
    })
}

/// The API server address from kube-proxy's kubeconfig, else the API servers' own
/// addresses in the `default/kubernetes` EndpointSlices.
fn infer_server(found: &Found, map_name: &str, notes: &mut Vec<String>) -> Result<Chosen, String> {
    let kubeconfig = found
        .kube_proxy
        .as_ref()
        .and_then(|m| m.get(KUBE_PROXY_KUBECONFIG_KEY));
    match kubeconfig.map(|k| kubeconfig_server(k)) {
        Some(Ok(url)) => match check_server(&url, &found.kubernetes_cluster_ips) {
            Ok(value) => {
                return Ok(Chosen {
                    value,
                    from: format!(
                        "{map_name} key {KUBE_PROXY_KUBECONFIG_KEY}, server (what kube-proxy uses)"
                    ),
                });
            }
            Err(why) => notes.push(format!(
                "{map_name} key {KUBE_PROXY_KUBECONFIG_KEY}: server {url} passed over: {why}"
            )),
        },
        Some(Err(why)) => notes.push(format!(
            "{map_name} key {KUBE_PROXY_KUBECONFIG_KEY} passed over: {why}"
        )),
        None => {}
    }
    let mut addresses: Vec<(IpAddr, u16, String)> = Vec::new();
    for slice in &found.api_server_slices {
        let name = slice["metadata"]["name"].as_str().unwrap_or("").to_string();
        let ports = slice["ports"].as_array().cloned().unwrap_or_default();
        let port = ports
            .iter()
            .find(|p| p["name"] == "https")
            .or(ports.first())
            .and_then(|p| p["port"].as_u64())
            .and_then(|p| u16::try_from(p).ok());
        let Some(port) = port else { continue };
        for endpoint in slice["endpoints"].as_array().into_iter().flatten() {
            if endpoint["conditions"]["ready"] == Value::Bool(false) {
                continue;
            }
            for address in endpoint["addresses"].as_array().into_iter().flatten() {
                if let Some(ip) = address.as_str().and_then(|a| a.parse::<IpAddr>().ok()) {
                    addresses.push((ip, port, name.clone()));
                }
            }
        }
    }
    addresses.sort();
    addresses.dedup_by(|a, b| a.0 == b.0 && a.1 == b.1);
    let Some((ip, port, slice)) = addresses.first() else {
        return Err(format!(
            "the API server address: no kube-proxy kubeconfig ({map_name} key {KUBE_PROXY_KUBECONFIG_KEY}) and no ready address in the default/kubernetes EndpointSlices; give --api-server https://HOST:PORT (an address nodes reach without kproxy: the control-plane endpoint or its load balancer, never the kubernetes Service's cluster IP)"
        ));
    };
    let value = match ip {
        IpAddr::V4(v4) => format!("https://{v4}:{port}"),
        IpAddr::V6(v6) => format!("https://[{v6}]:{port}"),
    };
    let of = if addresses.len() == 1 {
        "the one API server".to_string()
    } else {
        format!(
            "the first of {} API servers; a node reaches only this one, so give --api-server with your load balancer if there is one",
            addresses.len()
        )
    };
    Ok(Chosen {
        value,
        from: format!("EndpointSlice default/{slice}, the API servers' own addresses ({of})"),
    })
}

/// The `server:` of a kubeconfig's current context's cluster (or of its only cluster).
fn kubeconfig_server(text: &str) -> Result<String, String> {
    let doc: Value = serde_saphyr::from_str(text)
        .map_err(|e| format!("not YAML: {}", e.to_string().lines().next().unwrap_or("")))?;
    let clusters = doc["clusters"].as_array().cloned().unwrap_or_default();
    let current = doc["current-context"].as_str().unwrap_or("");
    let context_cluster = doc["contexts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == current)
        .and_then(|c| c["context"]["cluster"].as_str());
    let cluster = match context_cluster {
        Some(name) => clusters.iter().find(|c| c["name"] == name),
        None if clusters.len() == 1 => clusters.first(),
        None => None,
    };
    cluster
        .and_then(|c| c["cluster"]["server"].as_str())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .ok_or_else(|| "no server for its current context".into())
}

/// `url` as an API server address a node reaches without kproxy: http(s), a host, and
/// not the `kubernetes` Service's cluster IP (which kproxy itself programs).
fn check_server(url: &str, cluster_ips: &[IpAddr]) -> Result<String, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(uri.scheme_str(), Some("https" | "http")) {
        return Err("not an https:// URL".into());
    }
    let host = uri.host().ok_or("no host")?;
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = bare.parse::<IpAddr>()
        && cluster_ips.contains(&ip)
    {
        return Err(format!(
            "{ip} is the kubernetes Service's cluster IP, which kproxy itself programs: a node without kproxy's rules cannot reach it"
        ));
    }
    if url.chars().any(|c| c.is_whitespace() || c == '#') {
        return Err("has a space or a '#'".into());
    }
    Ok(url.to_string())
}

/// Comma-separated CIDRs, each a network address (one per family at most, as
/// kube-proxy's clusterCIDR).
fn check_cidrs(text: &str) -> Result<String, String> {
    let mut nets = Vec::new();
    for part in text.split(',').map(str::trim) {
        let net: IpNet = part
            .parse()
            .map_err(|_| format!("{part:?} is not a CIDR"))?;
        if net.trunc() != net {
            return Err(format!("{part} is not a network address ({})", net.trunc()));
        }
        nets.push(net.to_string());
    }
    Ok(nets.join(","))
}

/// The Nodes' `spec.podCIDRs` summarised, per family, into the one block of
/// [`SUMMARY_PREFIX_V4`] (IPv4) or [`SUMMARY_PREFIX_V6`] (IPv6) bits that holds them all.
fn summarise_pod_cidrs(nodes: &[(String, Vec<String>)]) -> Result<Chosen, String> {
    let mut families: BTreeMap<bool, Vec<(IpNet, &str)>> = BTreeMap::new();
    let mut bad = Vec::new();
    for (node, cidrs) in nodes {
        for c in cidrs {
            match c.parse::<IpNet>() {
                Ok(net) => families
                    .entry(net.addr().is_ipv6())
                    .or_default()
                    .push((net, node)),
                Err(_) => bad.push(format!("{c:?} on {node}")),
            }
        }
    }
    let with = nodes.iter().filter(|(_, c)| !c.is_empty()).count();
    if families.is_empty() {
        return Err(format!(
            "clusterCIDR: no kube-proxy clusterCIDR ({}/{} key {KUBE_PROXY_CONFIG_KEY}) and no Node has spec.podCIDRs{}; give --cluster-cidr CIDR[,CIDR] (your pod network)",
            KUBE_PROXY_CONFIG_MAP.0,
            KUBE_PROXY_CONFIG_MAP.1,
            if bad.is_empty() {
                String::new()
            } else {
                format!(" that parse ({})", bad.join(", "))
            }
        ));
    }
    let mut chosen = Vec::new();
    for (v6, nets) in &families {
        let bits = if *v6 {
            SUMMARY_PREFIX_V6
        } else {
            SUMMARY_PREFIX_V4
        };
        let widest = nets
            .iter()
            .map(|(n, _)| n.prefix_len())
            .min()
            .unwrap_or(bits);
        let (first, first_node) = nets[0];
        let block = IpNet::new(first.addr(), bits.min(widest))
            .map(|n| n.trunc())
            .map_err(|e| e.to_string())?;
        if let Some((out, node)) = nets.iter().find(|(n, _)| !block.contains(n)) {
            return Err(format!(
                "clusterCIDR: the Nodes' pod CIDRs are not in one /{bits} ({first} on {first_node}, {out} on {node}); give --cluster-cidr CIDR[,CIDR] (your pod network)"
            ));
        }
        chosen.push(block);
    }
    let value = chosen
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",");
    Ok(Chosen {
        value,
        from: format!(
            "the pod CIDRs of {with} of {} Nodes (spec.podCIDRs), summarised as the one /{SUMMARY_PREFIX_V4} (IPv4) or /{SUMMARY_PREFIX_V6} (IPv6) that holds them all: a guess that must cover every future node's, so check it or give --cluster-cidr",
            nodes.len()
        ),
    })
}

/// kube-proxy's fields kproxy honours, as (path, JSON value), checked by kproxy's
/// parser on the config.yaml they make (a value it rejects is dropped with its
/// error), and the fields it does not apply, each with the parser's warning.
#[expect(clippy::type_complexity, reason = "two lists of (path, text)")]
fn carry(
    config: &Value,
    origin: &str,
    cluster_cidr: &str,
) -> Result<(Vec<(String, String)>, Vec<(String, String)>), Vec<String>> {
    let mut leaves = Vec::new();
    flatten("", config, &mut leaves);
    let mut carried = Vec::new();
    let mut dropped = Vec::new();
    for (path, value) in leaves {
        // Unset: upstream defaults null and "" alike.
        if value.is_null() || value == "" || NOT_CARRIED.contains(&path.as_str()) {
            continue;
        }
        match kproxy_config::field_use(&path) {
            // Honoured, unless the parser warns of it (a feature gate kproxy does not
            // act on); a value it rejects is found below, on the whole.
            FieldUse::Honoured if path.split('.').count() <= 2 => match alone(&path, &value) {
                Some(Ok(w)) => dropped.push((format!("{path}: {value}"), w)),
                _ => carried.push((path, value.to_string())),
            },
            // Said by the parser only when set to something that would matter.
            _ => {
                if let Some(w) = alone(&path, &value) {
                    dropped.push((format!("{path}: {value}"), w.unwrap_or_else(|e| e)));
                }
            }
        }
    }
    // Each value the parser rejects is dropped with its error, then the rest again.
    for _ in 0..=carried.len() {
        let text = config_text(&set_fields(DEPLOY[1].1, cluster_cidr, &carried));
        match kproxy_config::load_str(origin, &text, &ConfigFlags::default()) {
            Ok(_) => return Ok((carried, dropped)),
            Err(ConfigError::Field { path, message, .. }) => {
                match carried.iter().position(|(p, _)| *p == path) {
                    Some(i) => {
                        let (p, v) = carried.remove(i);
                        dropped.push((format!("{p}: {v}"), message));
                    }
                    None => return Err(vec![format!("{origin}: {path}: {message}")]),
                }
            }
            Err(e) => return Err(vec![format!("{origin}: {e}")]),
        }
    }
    Err(vec![format!(
        "{origin}: its fields do not make a configuration kproxy loads"
    )])
}

/// What kproxy's parser says of field `path` set to `value` alone: its warning
/// (`Ok`) or its error (`Err`: the field may need another to be valid), if any.
fn alone(path: &str, value: &Value) -> Option<Result<String, String>> {
    let mut doc = serde_json::json!({
        "apiVersion": kproxy_config::API_VERSION, "kind": kproxy_config::KIND});
    let mut at = &mut doc;
    for key in path.split('.') {
        at = &mut at[key];
    }
    *at = value.clone();
    match kproxy_config::load_str("", &doc.to_string(), &ConfigFlags::default()) {
        Ok((_, warnings)) => warnings.first().map(|w| Ok(w.message.clone())),
        Err(e) => Some(Err(e.to_string())),
    }
}

/// The leaves of `v` (objects walked, anything else a leaf), with dotted paths.
fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(m) => {
            for (k, child) in m {
                let path = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&path, child, out);
            }
        }
        leaf => out.push((prefix.to_string(), leaf.clone())),
    }
}

/// The line range of deploy/configmap.yaml's `config.yaml: |` block (its lines after
/// the key, up to the next key of `data`).
fn config_block(lines: &[String]) -> (usize, usize) {
    let start = lines
        .iter()
        .position(|l| l.trim_end() == "  config.yaml: |")
        .map_or(lines.len(), |i| i + 1);
    let end = (start..lines.len())
        .find(|&i| !lines[i].trim().is_empty() && indent(&lines[i]) <= 2)
        .unwrap_or(lines.len());
    (start, end)
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// Whether `line` is key `key` at `depth` spaces.
fn is_key(line: &str, depth: usize, key: &str) -> bool {
    indent(line) == depth
        && line[depth..]
            .strip_prefix(key)
            .is_some_and(|r| r.starts_with(':'))
}

/// The end of the block of the key at `at` (its lines indented deeper).
fn block_end(lines: &[String], at: usize, end: usize) -> usize {
    let depth = indent(&lines[at]);
    (at + 1..end)
        .find(|&i| lines[i].trim().is_empty() || indent(&lines[i]) <= depth)
        .unwrap_or(end)
}

/// Sets `path` (one or two keys) to `value` in the config.yaml block (4 spaces deep),
/// in place of its line (and that line's block), else after its section's last line,
/// else at the block's end.
fn set_field(lines: &mut Vec<String>, path: &str, value: &str) {
    const TOP: usize = 4;
    let (start, end) = config_block(lines);
    let end = (start..end)
        .rev()
        .find(|&i| !lines[i].trim().is_empty())
        .map_or(end, |i| i + 1);
    let keys: Vec<&str> = path.split('.').collect();
    match keys[..] {
        [key] => match (start..end).find(|&i| is_key(&lines[i], TOP, key)) {
            Some(at) => {
                let stop = block_end(lines, at, end);
                lines.splice(at..stop, [format!("{}{key}: {value}", " ".repeat(TOP))]);
            }
            None => lines.insert(end, format!("{}{key}: {value}", " ".repeat(TOP))),
        },
        [section, key] => {
            let line = format!("{}{key}: {value}", " ".repeat(TOP + 2));
            match (start..end).find(|&i| is_key(&lines[i], TOP, section)) {
                Some(at) => {
                    let stop = block_end(lines, at, end);
                    match (at + 1..stop).find(|&i| is_key(&lines[i], TOP + 2, key)) {
                        Some(k) => {
                            let k_end = block_end(lines, k, stop);
                            lines.splice(k..k_end, [line]);
                        }
                        None => lines.insert(stop, line),
                    }
                }
                None => {
                    lines.splice(end..end, [format!("{}{section}:", " ".repeat(TOP)), line]);
                }
            }
        }
        _ => {}
    }
}

/// deploy/configmap.yaml with clusterCIDR and the carried fields set.
fn set_fields(template: &str, cluster_cidr: &str, carried: &[(String, String)]) -> String {
    let mut lines: Vec<String> = template.lines().map(str::to_string).collect();
    set_field(&mut lines, "clusterCIDR", cluster_cidr);
    for (path, value) in carried {
        set_field(&mut lines, path, value);
    }
    let mut out = lines.join("\n");
    out.push('\n');
    out
}

/// The text of the config.yaml block of a ConfigMap as deploy/ writes it.
fn config_text(config_map: &str) -> String {
    let lines: Vec<String> = config_map.lines().map(str::to_string).collect();
    let (start, end) = config_block(&lines);
    lines[start..end]
        .iter()
        .map(|l| format!("{}\n", l.get(4..).unwrap_or("")))
        .collect()
}

/// Each line `KEY: value` (after its indentation) of `text` with `value` replaced.
fn replace_values(text: &str, key: &str, value: &str) -> String {
    let prefix = format!("{key}: ");
    text.lines()
        .map(|l| match l.trim_start().strip_prefix(&prefix) {
            Some(_) => format!("{}{prefix}{value}\n", &l[..indent(l)]),
            None => format!("{l}\n"),
        })
        .collect()
}

/// The manifests for `inferred`, under a header of YAML comments: each value, where
/// it came from; `cluster` names the API server read.
pub fn render(inferred: &Inferred, cluster: &str) -> String {
    let mut h = vec![
        format!("Made by `kproxy install`, {cluster}: deploy/ with these values."),
        format!(
            "API server (kubeconfig.conf server): {}",
            inferred.api_server.value
        ),
        format!("  from {}", inferred.api_server.from),
        format!("clusterCIDR: {}", inferred.cluster_cidr.value),
        format!("  from {}", inferred.cluster_cidr.from),
        format!("image: {}", inferred.image.value),
        format!("  from {}", inferred.image.from),
    ];
    if !inferred.carried.is_empty() {
        h.push(format!(
            "Carried into config.yaml from {}/{} key {KUBE_PROXY_CONFIG_KEY} (kproxy reads them as kube-proxy does):",
            KUBE_PROXY_CONFIG_MAP.0, KUBE_PROXY_CONFIG_MAP.1
        ));
        h.extend(inferred.carried.iter().map(|(p, v)| format!("  {p}: {v}")));
    }
    if !inferred.dropped.is_empty() {
        h.push("Not carried (kproxy's configuration parser says why):".into());
        h.extend(
            inferred
                .dropped
                .iter()
                .map(|(p, why)| format!("  {p}: {why}")),
        );
    }
    h.extend(inferred.notes.iter().map(|n| format!("Note: {n}")));
    // A header line may carry the ConfigMap's own words (a key, the parser's error
    // about a value): one comment line each whatever they hold, so nothing they say
    // becomes YAML.
    let mut out: String = h
        .iter()
        .map(|l| format!("# {}\n", l.replace(|c: char| c.is_control(), " ")))
        .collect();
    let config_map = replace_values(
        &set_fields(DEPLOY[1].1, &inferred.cluster_cidr.value, &inferred.carried),
        "server",
        &inferred.api_server.value,
    );
    let daemon_set = replace_values(DEPLOY[2].1, "image", &inferred.image.value);
    out.push_str(&[DEPLOY[0].1, &config_map, &daemon_set].join("---\n"));
    out
}

#[cfg(test)]
mod tests;
