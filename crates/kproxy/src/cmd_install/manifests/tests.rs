use serde_json::json;

use super::*;

/// kube-proxy's ConfigMap as kubeadm writes it (trimmed), with `config.conf` given.
fn kubeadm_map(config: &str) -> BTreeMap<String, String> {
    let kubeconfig = "apiVersion: v1\nkind: Config\nclusters:\n- cluster:\n    certificate-authority: /var/lib/kube-proxy/ca.crt\n    server: https://cp.example.internal:6443\n  name: default\ncontexts:\n- context:\n    cluster: default\n    namespace: default\n    user: default\n  name: default\ncurrent-context: default\nusers:\n- name: default\n  user:\n    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n";
    BTreeMap::from([
        ("config.conf".to_string(), config.to_string()),
        ("kubeconfig.conf".to_string(), kubeconfig.to_string()),
    ])
}

const KUBEADM_CONFIG: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: \"\"
  burst: 0
  contentType: \"\"
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
detectLocalMode: \"\"
enableProfiling: false
healthzBindAddress: \"\"
hostnameOverride: \"\"
iptables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  scheduler: \"\"
  strictARP: false
metricsBindAddress: \"\"
mode: \"\"
nodePortAddresses: null
oomScoreAdj: null
portRange: \"\"
";

fn slice(name: &str, addresses: &[&str], port: u16) -> Value {
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default",
            "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4",
        "endpoints": addresses.iter().map(|a| json!({"addresses": [a], "conditions": {"ready": true}})).collect::<Vec<_>>(),
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}]})
}

fn nodes(cidrs: &[&[&str]]) -> Vec<(String, Vec<String>)> {
    cidrs
        .iter()
        .enumerate()
        .map(|(i, c)| {
            (
                format!("node-{i}"),
                c.iter().map(|s| s.to_string()).collect(),
            )
        })
        .collect()
}

#[test]
fn defaults_are_deploy_byte_for_byte() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let files: Vec<String> = DEPLOY
        .iter()
        .map(|(path, _)| std::fs::read_to_string(dir.join(path)).unwrap())
        .collect();
    for f in &files {
        assert!(f.ends_with('\n'), "each file ends its last line");
    }
    assert_eq!(defaults(), files.join("---\n"));
    assert_eq!(default_image(), "kproxy:0.1.0");
}

/// One inference case: the cluster, the flags, then what is expected.
struct Case {
    name: &'static str,
    found: Found,
    overrides: Overrides,
    /// (server, its source contains), (clusterCIDR, its source contains).
    expect: Result<[(&'static str, &'static str); 2], &'static [&'static str]>,
    carried: &'static [&'static str],
    dropped: &'static [&'static str],
}

#[test]
fn inference_by_case() {
    let cases = [
        Case {
            name: "kubeadm's kube-proxy ConfigMap",
            found: Found {
                kube_proxy: Some(kubeadm_map(KUBEADM_CONFIG)),
                kubernetes_cluster_ips: vec!["10.96.0.1".parse().unwrap()],
                api_server_slices: vec![slice("kubernetes", &["10.0.0.5"], 6443)],
                node_pod_cidrs: nodes(&[&["10.244.0.0/24"]]),
            },
            overrides: Overrides::default(),
            expect: Ok([
                (
                    "https://cp.example.internal:6443",
                    "ConfigMap kube-system/kube-proxy key kubeconfig.conf",
                ),
                (
                    "10.244.0.0/16",
                    "ConfigMap kube-system/kube-proxy key config.conf, clusterCIDR",
                ),
            ]),
            // Its zero values of inapplicable fields are not worth a word.
            carried: &["bindAddress: \"0.0.0.0\""],
            dropped: &[],
        },
        Case {
            name: "no ConfigMap: the API servers' EndpointSlice, the Nodes' /24s in one /16",
            found: Found {
                kube_proxy: None,
                kubernetes_cluster_ips: vec!["10.96.0.1".parse().unwrap()],
                api_server_slices: vec![slice("kubernetes", &["10.0.0.7", "10.0.0.5"], 6443)],
                node_pod_cidrs: nodes(&[&["10.244.1.0/24"], &["10.244.7.0/24"], &[]]),
            },
            overrides: Overrides::default(),
            expect: Ok([
                ("https://10.0.0.5:6443", "the first of 2 API servers"),
                ("10.244.0.0/16", "2 of 3 Nodes"),
            ]),
            carried: &[],
            dropped: &[],
        },
        Case {
            name: "dual-stack Node pod CIDRs",
            found: Found {
                api_server_slices: vec![slice("kubernetes", &["10.0.0.5"], 6443)],
                node_pod_cidrs: nodes(&[
                    &["10.244.1.0/24", "fd00:10:244:1::/64"],
                    &["10.244.2.0/24", "fd00:10:244:2::/64"],
                ]),
                ..Found::default()
            },
            overrides: Overrides::default(),
            expect: Ok([
                ("https://10.0.0.5:6443", "the one API server"),
                ("10.244.0.0/16,fd00:10:244::/48", "spec.podCIDRs"),
            ]),
            carried: &[],
            dropped: &[],
        },
        Case {
            name: "kube-proxy's server is the kubernetes cluster IP: passed over",
            found: Found {
                kube_proxy: Some(BTreeMap::from([(
                    "kubeconfig.conf".to_string(),
                    "clusters:\n- name: c\n  cluster:\n    server: https://10.96.0.1:443\n"
                        .to_string(),
                )])),
                kubernetes_cluster_ips: vec!["10.96.0.1".parse().unwrap()],
                api_server_slices: vec![slice("kubernetes", &["10.0.0.5"], 6443)],
                node_pod_cidrs: nodes(&[&["10.244.1.0/24"]]),
            },
            overrides: Overrides::default(),
            expect: Ok([
                ("https://10.0.0.5:6443", "EndpointSlice default/kubernetes"),
                ("10.244.0.0/16", "spec.podCIDRs"),
            ]),
            carried: &[],
            dropped: &[],
        },
        Case {
            name: "flags win",
            found: Found {
                kube_proxy: Some(kubeadm_map(KUBEADM_CONFIG)),
                ..Found::default()
            },
            overrides: Overrides {
                api_server: Some("https://lb.example:443".into()),
                cluster_cidr: Some("10.32.0.0/12".into()),
                image: None,
            },
            expect: Ok([
                ("https://lb.example:443", "--api-server"),
                ("10.32.0.0/12", "--cluster-cidr"),
            ]),
            carried: &["bindAddress: \"0.0.0.0\""],
            dropped: &[],
        },
        Case {
            name: "fields kproxy does not apply, or rejects, are dropped with why",
            found: Found {
                kube_proxy: Some(kubeadm_map(
                    "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nclusterCIDR: 10.244.0.0/16\nmode: ipvs\niptables:\n  masqueradeAll: true\nipvs:\n  strictARP: true\noomScoreAdj: -999\nnodePortAddresses: [10.0.0.0/8]\nconntrack:\n  maxPerCore: 0\n  tcpBeLiberal: true\nnftables:\n  masqueradeBit: 40\nfeatureGates:\n  SomeGate: true\n  ProxyTerminatingEndpoints: true\ndetectLocalMode: NodeCIDR\n",
                )),
                ..Found::default()
            },
            overrides: Overrides::default(),
            expect: Ok([
                ("https://cp.example.internal:6443", "kubeconfig.conf"),
                ("10.244.0.0/16", "clusterCIDR"),
            ]),
            carried: &[
                "nodePortAddresses: [\"10.0.0.0/8\"]",
                "conntrack.maxPerCore: 0",
                "conntrack.tcpBeLiberal: true",
                "featureGates.ProxyTerminatingEndpoints: true",
                "detectLocalMode: \"NodeCIDR\"",
            ],
            dropped: &[
                "mode: \"ipvs\": proxy mode \"ipvs\" is not supported",
                "iptables.masqueradeAll: true: does not apply to kproxy (nftables); use nftables.masqueradeAll",
                "ipvs.strictARP: true: does not apply",
                "oomScoreAdj: -999: kproxy does not change its OOM score",
                "nftables.masqueradeBit: 40: ",
                "featureGates.SomeGate: true: feature gate \"SomeGate\" does not change kproxy's behaviour",
            ],
        },
        Case {
            name: "Nodes in two /16s: refused",
            found: Found {
                api_server_slices: vec![slice("kubernetes", &["10.0.0.5"], 6443)],
                node_pod_cidrs: nodes(&[&["10.244.1.0/24"], &["10.245.1.0/24"]]),
                ..Found::default()
            },
            overrides: Overrides::default(),
            expect: Err(&[
                "not in one /16 (10.244.1.0/24 on node-0, 10.245.1.0/24 on node-1); give --cluster-cidr",
            ]),
            carried: &[],
            dropped: &[],
        },
        Case {
            name: "nothing usable: both refused",
            found: Found {
                kubernetes_cluster_ips: vec!["10.96.0.1".parse().unwrap()],
                node_pod_cidrs: nodes(&[&[]]),
                ..Found::default()
            },
            overrides: Overrides::default(),
            expect: Err(&[
                "the API server address: no kube-proxy kubeconfig",
                "give --api-server https://HOST:PORT",
                "no Node has spec.podCIDRs; give --cluster-cidr",
            ]),
            carried: &[],
            dropped: &[],
        },
        Case {
            name: "bad flags: refused",
            found: Found::default(),
            overrides: Overrides {
                api_server: Some("https://10.96.0.1:443".into()),
                cluster_cidr: Some("10.244.1.0/16".into()),
                image: Some("a b".into()),
            },
            expect: Err(&[
                "--api-server https://10.96.0.1:443: 10.96.0.1 is the kubernetes Service's cluster IP",
                "--cluster-cidr 10.244.1.0/16: 10.244.1.0/16 is not a network address (10.244.0.0/16)",
                "--image \"a b\": not an image reference",
            ]),
            carried: &[],
            dropped: &[],
        },
    ];
    // The cluster IP check needs the IP: the last case's Found gives none, so give it.
    for mut case in cases {
        if case.name == "bad flags: refused" {
            case.found.kubernetes_cluster_ips = vec!["10.96.0.1".parse().unwrap()];
        }
        let got = infer(&case.found, &case.overrides);
        match (&case.expect, &got) {
            (Ok([(server, server_from), (cidr, cidr_from)]), Ok(i)) => {
                assert_eq!(i.api_server.value, *server, "{}", case.name);
                assert!(
                    i.api_server.from.contains(server_from),
                    "{}: {:?}",
                    case.name,
                    i.api_server.from
                );
                assert_eq!(i.cluster_cidr.value, *cidr, "{}", case.name);
                assert!(
                    i.cluster_cidr.from.contains(cidr_from),
                    "{}: {:?}",
                    case.name,
                    i.cluster_cidr.from
                );
                let carried: Vec<String> =
                    i.carried.iter().map(|(p, v)| format!("{p}: {v}")).collect();
                let mut want: Vec<&str> = case.carried.to_vec();
                let mut have: Vec<&str> = carried.iter().map(String::as_str).collect();
                want.sort();
                have.sort();
                assert_eq!(have, want, "{}: carried", case.name);
                let dropped: Vec<String> =
                    i.dropped.iter().map(|(p, w)| format!("{p}: {w}")).collect();
                assert_eq!(
                    dropped.len(),
                    case.dropped.len(),
                    "{}: {dropped:#?}",
                    case.name
                );
                for d in case.dropped {
                    assert!(
                        dropped.iter().any(|x| x.starts_with(d)),
                        "{}: {d} in {dropped:#?}",
                        case.name
                    );
                }
                let node_port_note = i
                    .notes
                    .iter()
                    .any(|n| n.contains("accepted NodePorts on every local address"));
                // kubeadm's mode "" is iptables, with nodePortAddresses null: every address.
                let kubeadm = case
                    .found
                    .kube_proxy
                    .as_ref()
                    .and_then(|m| m.get("config.conf"))
                    .is_some_and(|c| c == KUBEADM_CONFIG);
                assert_eq!(node_port_note, kubeadm, "{}: {:?}", case.name, i.notes);
                let text = render(i, "test");
                // What is carried is what kproxy loads from the config.yaml printed.
                let (cfg, warnings) = kproxy_config::load_str(
                    "printed",
                    &config_text(&text),
                    &ConfigFlags::default(),
                )
                .unwrap();
                assert!(warnings.is_empty(), "{}: {warnings:?}", case.name);
                match &cfg.plan.local_detector {
                    kproxy_core::config::LocalDetectorConfig::ClusterCidr(nets) => assert_eq!(
                        nets.iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(","),
                        *cidr,
                        "{}",
                        case.name
                    ),
                    // detectLocalMode: NodeCIDR carried over; clusterCIDR is still set.
                    _ => assert!(
                        text.contains(&format!("    clusterCIDR: {cidr}\n")),
                        "{}",
                        case.name
                    ),
                }
                assert!(
                    text.contains(&format!("          server: {server}\n")),
                    "{}",
                    case.name
                );
            }
            (Err(want), Err(refusals)) => {
                let all = refusals.join("\n");
                for w in *want {
                    assert!(all.contains(w), "{}: {w:?} in\n{all}", case.name);
                }
            }
            (want, got) => panic!("{}: want {want:?}, got {got:#?}", case.name),
        }
    }
}

#[test]
fn fields_are_set_in_place_in_their_section_or_added() {
    let carried = vec![
        ("conntrack.maxPerCore".to_string(), "0".to_string()),
        ("conntrack.tcpBeLiberal".to_string(), "true".to_string()),
        (
            "nodePortAddresses".to_string(),
            "[\"10.0.0.0/8\"]".to_string(),
        ),
        (
            "featureGates.ProxyTerminatingEndpoints".to_string(),
            "false".to_string(),
        ),
    ];
    let text = set_fields(DEPLOY[1].1, "10.1.0.0/16", &carried);
    let config = config_text(&text);
    let (cfg, warnings) = kproxy_config::load_str("set", &config, &ConfigFlags::default()).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(cfg.conntrack.max_per_core, 0);
    assert!(cfg.conntrack.tcp_be_liberal);
    assert_eq!(
        cfg.feature_gates.get("ProxyTerminatingEndpoints"),
        Some(&false)
    );
    // In place: one line each, deploy/'s comments and the other keys kept.
    assert_eq!(config.matches("maxPerCore").count(), 1, "{config}");
    assert!(
        config.contains("conntrack:\n  maxPerCore: 0\n  min: 131072\n"),
        "{config}"
    );
    assert!(
        config.contains("  tcpCloseWaitTimeout: 1h0m0s\n  tcpBeLiberal: true\n"),
        "{config}"
    );
    assert!(config.contains("clusterCIDR: 10.1.0.0/16\n"), "{config}");
    assert!(
        config.contains("nodePortAddresses: [\"10.0.0.0/8\"]\n"),
        "{config}"
    );
    assert!(
        config.ends_with("featureGates:\n  ProxyTerminatingEndpoints: false\n"),
        "{config}"
    );
    assert!(
        text.contains("  # minSyncPeriod unset"),
        "deploy/'s comments kept"
    );
    // The rest of the ConfigMap (its kubeconfig.conf) untouched.
    let tail = |t: &str| t[t.find("  kubeconfig.conf: |").unwrap()..].to_string();
    assert_eq!(tail(&text), tail(DEPLOY[1].1));
}

/// The ConfigMap's own words reach the header (a dropped key, the parser's reason):
/// however they are written, each stays inside one comment line and adds no YAML.
#[test]
fn the_configmaps_words_stay_in_their_comment_lines() {
    let config = format!("{KUBEADM_CONFIG}\"evil\\nkind: Secret\": 1\n");
    let found = Found {
        kube_proxy: Some(kubeadm_map(&config)),
        ..Found::default()
    };
    let inferred = infer(&found, &Overrides::default()).expect("inferred");
    assert!(
        inferred.dropped.iter().any(|(p, _)| p.contains('\n')),
        "the case needs a dropped key with a line break: {:?}",
        inferred.dropped
    );
    let out = render(&inferred, "test");
    let header: Vec<&str> = out.lines().take_while(|l| l.starts_with('#')).collect();
    let first_yaml = out.lines().nth(header.len()).unwrap_or("");
    assert!(
        first_yaml.starts_with("apiVersion:") || first_yaml.starts_with("# "),
        "the header ends in YAML of deploy/'s, not the ConfigMap's: {first_yaml:?}"
    );
    assert!(
        !out.lines().any(|l| l.trim_start() == "kind: Secret"),
        "{out}"
    );
    assert!(
        header.iter().any(|l| l.contains("evil kind: Secret")),
        "{header:?}"
    );
}
