//! The KubeProxyConfiguration file: its schema (every field optional, so "absent" and
//! "set" are told apart), the check of apiVersion/kind/mode, and the walk that warns
//! about fields kproxy does not apply. YAML and JSON go through serde-saphyr into a
//! JSON value, then through serde_path_to_error, so a bad value is reported with the
//! path of its field.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;

use crate::{API_VERSION, ConfigError, ConfigWarning, KIND};

/// `kubeproxy.config.k8s.io/v1alpha1` KubeProxyConfiguration, the fields kproxy reads.
/// Unknown fields are accepted here; [`parse`] reports them as warnings.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct KubeProxyConfiguration {
    pub api_version: Option<String>,
    pub kind: Option<String>,
    pub feature_gates: Option<BTreeMap<String, bool>>,
    pub client_connection: Option<ClientConnection>,
    pub hostname_override: Option<String>,
    pub bind_address: Option<String>,
    pub healthz_bind_address: Option<String>,
    pub metrics_bind_address: Option<String>,
    pub mode: Option<String>,
    pub nftables: Option<Nftables>,
    pub detect_local_mode: Option<String>,
    pub detect_local: Option<DetectLocal>,
    #[serde(rename = "clusterCIDR")]
    pub cluster_cidr: Option<String>,
    pub node_port_addresses: Option<Vec<String>>,
    pub conntrack: Option<Conntrack>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClientConnection {
    pub kubeconfig: Option<String>,
    pub content_type: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Nftables {
    pub masquerade_bit: Option<i64>,
    pub masquerade_all: Option<bool>,
    pub sync_period: Option<String>,
    pub min_sync_period: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetectLocal {
    pub bridge_interface: Option<String>,
    pub interface_name_prefix: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Conntrack {
    pub max_per_core: Option<i64>,
    pub min: Option<i64>,
    pub tcp_established_timeout: Option<String>,
    pub tcp_close_wait_timeout: Option<String>,
    pub tcp_be_liberal: Option<bool>,
    pub udp_timeout: Option<String>,
    pub udp_stream_timeout: Option<String>,
}

/// How kproxy treats one field of the file.
enum Field {
    /// Read and applied (a section: its own table).
    Honoured,
    Section(&'static [(&'static str, Field)]),
    /// Read but without effect: warned about when set to a non-zero value.
    Inapplicable(&'static str),
}

use Field::{Honoured, Inapplicable, Section};

const NOT_NFTABLES: &str = "does not apply to kproxy (nftables)";
const NOT_SUPPORTED: &str = "not supported by kproxy; ignored";

const TOP: &[(&str, Field)] = &[
    ("apiVersion", Honoured),
    ("kind", Honoured),
    ("featureGates", Honoured),
    (
        "clientConnection",
        Section(&[
            ("kubeconfig", Honoured),
            ("acceptContentTypes", Inapplicable(NOT_SUPPORTED)),
            ("contentType", Honoured),
            ("qps", Inapplicable(NOT_SUPPORTED)),
            ("burst", Inapplicable(NOT_SUPPORTED)),
        ]),
    ),
    (
        "logging",
        Inapplicable("kproxy logs through tracing (RUST_LOG); ignored"),
    ),
    ("hostnameOverride", Honoured),
    ("bindAddress", Honoured),
    ("healthzBindAddress", Honoured),
    ("metricsBindAddress", Honoured),
    (
        "bindAddressHardFail",
        Inapplicable("kproxy always exits when it cannot bind its ports"),
    ),
    ("enableProfiling", Inapplicable(NOT_SUPPORTED)),
    ("showHiddenMetricsForVersion", Inapplicable(NOT_SUPPORTED)),
    ("mode", Honoured),
    ("iptables", Inapplicable(NOT_NFTABLES)),
    ("ipvs", Inapplicable(NOT_NFTABLES)),
    (
        "nftables",
        Section(&[
            ("masqueradeBit", Honoured),
            ("masqueradeAll", Honoured),
            ("syncPeriod", Honoured),
            ("minSyncPeriod", Honoured),
        ]),
    ),
    ("winkernel", Inapplicable(NOT_NFTABLES)),
    ("detectLocalMode", Honoured),
    (
        "detectLocal",
        Section(&[
            ("bridgeInterface", Honoured),
            ("interfaceNamePrefix", Honoured),
        ]),
    ),
    ("clusterCIDR", Honoured),
    ("nodePortAddresses", Honoured),
    (
        "oomScoreAdj",
        Inapplicable("kproxy does not change its OOM score; set it in the Pod spec"),
    ),
    (
        "conntrack",
        Section(&[
            ("maxPerCore", Honoured),
            ("min", Honoured),
            ("tcpEstablishedTimeout", Honoured),
            ("tcpCloseWaitTimeout", Honoured),
            ("tcpBeLiberal", Honoured),
            ("udpTimeout", Honoured),
            ("udpStreamTimeout", Honoured),
        ]),
    ),
    (
        "configSyncPeriod",
        Inapplicable(
            "kproxy's watches do not resync periodically; the sync loop resyncs every nftables.syncPeriod",
        ),
    ),
    ("portRange", Inapplicable(NOT_SUPPORTED)),
    ("udpIdleTimeout", Inapplicable(NOT_SUPPORTED)),
    ("windowsRunAsService", Inapplicable(NOT_NFTABLES)),
];

/// Null, false, 0, "", "0s", and objects/lists of only those: a field left at its zero
/// value changes nothing, so it is not worth a warning.
fn is_zero(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => matches!(s.as_str(), "" | "0" | "0s"),
        Value::Array(a) => a.iter().all(is_zero),
        Value::Object(m) => m.values().all(is_zero),
    }
}

/// Non-zero leaves under `v`, with their paths.
fn non_zero_leaves(prefix: &str, v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, child) in m {
                non_zero_leaves(&format!("{prefix}.{k}"), child, out);
            }
        }
        _ if is_zero(v) => {}
        _ => out.push(prefix.to_string()),
    }
}

/// Why the inapplicable field `leaf` has no effect, pointing at the nftables field that
/// does what an iptables one did.
fn inapplicable_message(leaf: &str, why: &str) -> String {
    match leaf.strip_prefix("iptables.") {
        Some(rest @ ("masqueradeBit" | "masqueradeAll" | "syncPeriod" | "minSyncPeriod")) => {
            format!("{why}; use nftables.{rest}")
        }
        _ => why.to_string(),
    }
}

/// How kproxy treats one field of the file, by its dotted path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FieldUse {
    /// Read and applied.
    Honoured,
    /// Read but without effect in kproxy: why.
    Inapplicable(String),
    /// Not a KubeProxyConfiguration field kproxy knows.
    Unknown,
}

/// How kproxy treats the field at `path` (`conntrack.maxPerCore`, `featureGates.Name`),
/// from the same table [`parse`] warns from: what `kproxy install` carries over from
/// kube-proxy's configuration and what it drops.
pub fn field_use(path: &str) -> FieldUse {
    let mut table = TOP;
    for key in path.split('.') {
        match table.iter().find(|(k, _)| *k == key).map(|(_, f)| f) {
            Some(Honoured) => return FieldUse::Honoured,
            Some(Inapplicable(why)) => {
                return FieldUse::Inapplicable(inapplicable_message(path, why));
            }
            Some(Section(inner)) => table = inner,
            None => return FieldUse::Unknown,
        }
    }
    // A section itself, not one of its fields.
    FieldUse::Honoured
}

fn walk(
    prefix: &str,
    obj: &serde_json::Map<String, Value>,
    table: &[(&str, Field)],
    warnings: &mut Vec<ConfigWarning>,
) {
    for (key, value) in obj {
        let path = if prefix.is_empty() {
            key.escape_debug().to_string()
        } else {
            format!("{prefix}.{}", key.escape_debug())
        };
        match table.iter().find(|(k, _)| k == key).map(|(_, f)| f) {
            Some(Honoured) => {}
            Some(Section(inner)) => {
                if let Value::Object(m) = value {
                    walk(&path, m, inner, warnings);
                }
            }
            Some(Inapplicable(why)) => {
                let mut leaves = Vec::new();
                non_zero_leaves(&path, value, &mut leaves);
                for leaf in leaves {
                    let message = inapplicable_message(&leaf, why);
                    warnings.push(ConfigWarning {
                        path: leaf,
                        message,
                    });
                }
            }
            None => warnings.push(ConfigWarning {
                path,
                message: "unknown field; ignored".into(),
            }),
        }
    }
}

/// Parses the text of a KubeProxyConfiguration file. Errors name `file` and the field.
pub fn parse(
    file: &str,
    text: &str,
) -> Result<(KubeProxyConfiguration, Vec<ConfigWarning>), ConfigError> {
    let err = |path: &str, message: String| ConfigError::Field {
        file: file.to_string(),
        path: path.to_string(),
        message,
    };
    let value: Value = serde_saphyr::from_str(text).map_err(|e| {
        let msg = e.to_string();
        err(
            ".",
            format!(
                "not valid YAML or JSON: {}",
                msg.lines().next().unwrap_or("").escape_debug()
            ),
        )
    })?;
    let Value::Object(obj) = &value else {
        return Err(err(".", "expected a KubeProxyConfiguration object".into()));
    };
    let s = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or("");
    if s("apiVersion") != API_VERSION {
        return Err(err(
            "apiVersion",
            format!(
                "{:?}: expected {API_VERSION}",
                s("apiVersion").escape_debug().to_string()
            ),
        ));
    }
    if s("kind") != KIND {
        return Err(err(
            "kind",
            format!(
                "{:?}: expected {KIND}",
                s("kind").escape_debug().to_string()
            ),
        ));
    }
    let mut warnings = Vec::new();
    walk("", obj, TOP, &mut warnings);
    let parsed: KubeProxyConfiguration = serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        err(&path, e.into_inner().to_string().escape_debug().to_string())
    })?;
    Ok((parsed, warnings))
}
