//! Table tests: every honoured field changes the resolved config; flags override the
//! file; inapplicable and unknown fields warn with their path; bad values fail with the
//! file and the field's path.

use super::*;
use std::net::Ipv6Addr;

const HEAD: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

fn file(body: &str) -> Result<(ProxyConfig, Vec<ConfigWarning>), ConfigError> {
    load_str("kp.yaml", &format!("{HEAD}{body}"), &ConfigFlags::default())
}

fn cidrs(v: &[&str]) -> Vec<IpNet> {
    v.iter().map(|c| c.parse().unwrap()).collect()
}

type Check = fn(&ProxyConfig) -> bool;

#[test]
fn every_honoured_field_changes_the_config() {
    let table: &[(&str, Check)] = &[
        ("hostnameOverride: node-7", |c| {
            c.hostname_override.as_deref() == Some("node-7")
        }),
        ("clientConnection: {kubeconfig: /etc/kp/kubeconfig}", |c| {
            c.kubeconfig == Some(PathBuf::from("/etc/kp/kubeconfig"))
        }),
        ("clientConnection: {contentType: application/json}", |c| {
            c.content_type == ContentType::Json
        }),
        ("bindAddress: '::'", |c| {
            c.bind_address == IpAddr::V6(Ipv6Addr::UNSPECIFIED)
                && c.healthz_bind_address == Some("[::]:10256".parse().unwrap())
                && c.metrics_bind_address == Some("[::1]:10249".parse().unwrap())
        }),
        ("healthzBindAddress: 10.200.0.1:9000", |c| {
            c.healthz_bind_address == Some("10.200.0.1:9000".parse().unwrap())
        }),
        ("healthzBindAddress: 10.200.0.1", |c| {
            c.healthz_bind_address == Some("10.200.0.1:10256".parse().unwrap())
        }),
        ("metricsBindAddress: 0.0.0.0:10249", |c| {
            c.metrics_bind_address == Some("0.0.0.0:10249".parse().unwrap())
        }),
        ("metricsBindAddress: '[::]:9100'", |c| {
            c.metrics_bind_address == Some("[::]:9100".parse().unwrap())
        }),
        ("mode: nftables", |c| *c == ProxyConfig::default()),
        ("nftables: {masqueradeBit: 3}", |c| c.masquerade_bit == 3),
        ("nftables: {masqueradeAll: true}", |c| c.plan.masquerade_all),
        ("nftables: {syncPeriod: 1m30s}", |c| {
            c.sync_period == Duration::from_secs(90)
        }),
        ("nftables: {minSyncPeriod: 250ms}", |c| {
            c.min_sync_period == Some(Duration::from_millis(250))
        }),
        ("clusterCIDR: 10.244.0.0/16", |c| {
            c.plan.local_detector == LocalDetectorConfig::ClusterCidr(cidrs(&["10.244.0.0/16"]))
        }),
        ("clusterCIDR: 10.244.0.0/16,fd00:10:244::/56", |c| {
            c.plan.local_detector
                == LocalDetectorConfig::ClusterCidr(cidrs(&["10.244.0.0/16", "fd00:10:244::/56"]))
        }),
        ("detectLocalMode: NodeCIDR", |c| {
            c.plan.local_detector == LocalDetectorConfig::NodeCidr
        }),
        ("detectLocalMode: None\nclusterCIDR: 10.244.0.0/16", |c| {
            c.plan.local_detector == LocalDetectorConfig::None
        }),
        (
            "detectLocalMode: InterfaceNamePrefix\ndetectLocal: {interfaceNamePrefix: veth}",
            |c| c.plan.local_detector == LocalDetectorConfig::InterfaceNamePrefix("veth".into()),
        ),
        (
            "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: cbr0}",
            |c| c.plan.local_detector == LocalDetectorConfig::BridgeInterface("cbr0".into()),
        ),
        ("nodePortAddresses: [10.200.0.0/24]", |c| {
            c.plan.node_port_addresses == NodePortAddressesConfig::Cidrs(cidrs(&["10.200.0.0/24"]))
        }),
        ("nodePortAddresses: [all]", |c| {
            c.plan.node_port_addresses
                == NodePortAddressesConfig::Cidrs(cidrs(&["0.0.0.0/0", "::/0"]))
        }),
        ("conntrack: {maxPerCore: 0}", |c| {
            c.conntrack.max_per_core == 0
        }),
        ("conntrack: {min: 1000}", |c| c.conntrack.min == 1000),
        ("conntrack: {tcpEstablishedTimeout: 2h}", |c| {
            c.conntrack.tcp_established_timeout == Duration::from_secs(7200)
        }),
        ("conntrack: {tcpCloseWaitTimeout: 60s}", |c| {
            c.conntrack.tcp_close_wait_timeout == Duration::from_secs(60)
        }),
        ("conntrack: {tcpBeLiberal: true}", |c| {
            c.conntrack.tcp_be_liberal
        }),
        ("conntrack: {udpTimeout: 30s}", |c| {
            c.conntrack.udp_timeout == Duration::from_secs(30)
        }),
        ("conntrack: {udpStreamTimeout: 300s}", |c| {
            c.conntrack.udp_stream_timeout == Duration::from_secs(300)
        }),
        (
            "featureGates: {PreferSameTrafficDistribution: false}",
            |c| {
                !c.plan.prefer_same_node_hints
                    && c.feature_gates.get("PreferSameTrafficDistribution") == Some(&false)
            },
        ),
        ("featureGates: {ProxyTerminatingEndpoints: false}", |c| {
            !c.plan.proxy_terminating_endpoints
        }),
        (
            "featureGates: {KubeProxyDrainingTerminatingNodes: false}",
            |c| !c.plan.drain_terminating_nodes && c.plan.proxy_terminating_endpoints,
        ),
    ];
    let default = ProxyConfig::default();
    for (body, check) in table {
        let (cfg, warnings) = file(body).unwrap_or_else(|e| panic!("{body}: {e}"));
        assert!(check(&cfg), "{body}: {cfg:#?}");
        // `mode: nftables` is the default; `detectLocalMode: None` is checked against the
        // ClusterCIDR detector the same clusterCIDR alone gives (row above).
        if !body.starts_with("mode:") && !body.starts_with("detectLocalMode: None") {
            assert_ne!(cfg, default, "{body} changed nothing");
        }
        assert!(warnings.is_empty(), "{body}: {warnings:?}");
    }
}

#[test]
fn defaults_are_kube_proxys() {
    let (cfg, warnings) = file("").unwrap();
    assert!(warnings.is_empty());
    assert_eq!(cfg, ProxyConfig::default());
    assert_eq!(
        cfg.healthz_bind_address,
        Some("0.0.0.0:10256".parse().unwrap())
    );
    assert_eq!(
        cfg.metrics_bind_address,
        Some("127.0.0.1:10249".parse().unwrap())
    );
    assert_eq!(
        (cfg.min_sync_period, cfg.sync_period, cfg.masquerade_bit),
        (None, Duration::from_secs(30), 14),
        "minSyncPeriod unset: kproxy paces its syncs itself"
    );
    assert_eq!(
        (cfg.conntrack.max_per_core, cfg.conntrack.min),
        (32768, 131072)
    );
    assert_eq!(
        cfg.conntrack.tcp_established_timeout,
        Duration::from_secs(86400)
    );
    assert_eq!(
        cfg.conntrack.tcp_close_wait_timeout,
        Duration::from_secs(3600)
    );
    assert_eq!(cfg.plan, PlanConfig::default());
    // No file at all: the same.
    assert_eq!(load(&ConfigFlags::default()).unwrap().0, cfg);
}

/// A kubeadm-generated ConfigMap (every field present, zero values): no warnings.
#[test]
fn a_kubeadm_style_file_with_zero_values_is_quiet() {
    let body = r#"
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection: {acceptContentTypes: "", burst: 0, contentType: "", kubeconfig: /var/lib/kube-proxy/kubeconfig.conf, qps: 0}
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack: {maxPerCore: null, min: null, tcpBeLiberal: false, tcpCloseWaitTimeout: null, tcpEstablishedTimeout: null, udpStreamTimeout: 0s, udpTimeout: 0s}
detectLocal: {bridgeInterface: "", interfaceNamePrefix: ""}
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables: {localhostNodePorts: null, masqueradeAll: false, masqueradeBit: null, minSyncPeriod: 0s, syncPeriod: 0s}
ipvs: {excludeCIDRs: null, minSyncPeriod: 0s, scheduler: "", strictARP: false, syncPeriod: 0s, tcpFinTimeout: 0s, tcpTimeout: 0s, udpTimeout: 0s}
logging: {flushFrequency: 0, options: {json: {infoBufferSize: "0"}, text: {infoBufferSize: "0"}}, verbosity: 0}
metricsBindAddress: ""
mode: nftables
nftables: {masqueradeAll: false, masqueradeBit: null, minSyncPeriod: 0s, syncPeriod: 0s}
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel: {enableDSR: false, forwardHealthCheckVip: false, networkName: "", rootHnsEndpointName: "", sourceVip: ""}
"#;
    let (cfg, warnings) = file(body).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(
        cfg.kubeconfig,
        Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
    );
    assert_eq!(
        cfg.plan.local_detector,
        LocalDetectorConfig::ClusterCidr(cidrs(&["10.244.0.0/16"]))
    );
    assert_eq!(
        (cfg.sync_period, cfg.min_sync_period),
        (Duration::from_secs(30), None),
        "the file's 0s means the default, as upstream's defaulting"
    );
}

#[test]
fn inapplicable_and_unknown_fields_warn_with_their_path() {
    let body = "iptables: {syncPeriod: 10s, masqueradeBit: 14}\nipvs: {scheduler: rr}\noomScoreAdj: -999\nlogging: {verbosity: 4}\nnoSuchField: 1\nconntrack: {typo: 1}\nfeatureGates: {SomeAlphaGate: true}\n";
    let (_, warnings) = file(body).unwrap();
    let paths: Vec<&str> = warnings.iter().map(|w| w.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "conntrack.typo",
            "iptables.masqueradeBit",
            "iptables.syncPeriod",
            "ipvs.scheduler",
            "logging.verbosity",
            "noSuchField",
            "oomScoreAdj",
            "featureGates"
        ],
        "{warnings:#?}"
    );
    let w = |p: &str| {
        warnings
            .iter()
            .find(|w| w.path == p)
            .unwrap()
            .message
            .clone()
    };
    assert_eq!(
        w("iptables.syncPeriod"),
        "does not apply to kproxy (nftables); use nftables.syncPeriod"
    );
    assert_eq!(w("noSuchField"), "unknown field; ignored");
    assert!(w("featureGates").contains("SomeAlphaGate"));
}

#[test]
fn other_modes_are_refused_clearly() {
    for mode in ["iptables", "ipvs", "kernelspace"] {
        let e = file(&format!("mode: {mode}")).unwrap_err().to_string();
        assert!(e.starts_with("kp.yaml: mode: proxy mode"), "{e}");
        assert!(e.contains("kproxy is an nftables proxy"), "{e}");
    }
    assert!(file("mode: \"\"").is_ok());
}

#[test]
fn bad_values_fail_with_the_file_and_the_field_path() {
    for (body, path) in [
        ("nftables: {masqueradeBit: 32}", "nftables.masqueradeBit"),
        (
            "nftables: {masqueradeBit: fourteen}",
            "nftables.masqueradeBit",
        ),
        ("nftables: {syncPeriod: 30}", "nftables.syncPeriod"),
        ("nftables: {minSyncPeriod: soon}", "nftables.minSyncPeriod"),
        (
            "conntrack: {tcpEstablishedTimeout: -1h}",
            "conntrack.tcpEstablishedTimeout",
        ),
        ("conntrack: {maxPerCore: -1}", "conntrack.maxPerCore"),
        ("conntrack: {tcpBeLiberal: maybe}", "conntrack.tcpBeLiberal"),
        ("clusterCIDR: 10.244.0.0/33", "clusterCIDR"),
        ("clusterCIDR: 10.0.0.0/8,10.1.0.0/16", "clusterCIDR"),
        ("bindAddress: not-an-ip", "bindAddress"),
        ("healthzBindAddress: 'x:y'", "healthzBindAddress"),
        ("metricsBindAddress: 1.2.3.4:99999", "metricsBindAddress"),
        ("detectLocalMode: Magic", "detectLocalMode"),
        ("detectLocalMode: InterfaceNamePrefix", "detectLocalMode"),
        (
            "detectLocalMode: BridgeInterface\ndetectLocal: {bridgeInterface: 'br0; flush ruleset'}",
            "detectLocal.bridgeInterface",
        ),
        (
            "nodePortAddresses: [primary, 10.0.0.0/8]",
            "nodePortAddresses",
        ),
        ("nodePortAddresses: [nope]", "nodePortAddresses"),
        ("featureGates: {A: yes please}", "featureGates.A"),
        ("nodePortAddresses: 10.0.0.0/8", "nodePortAddresses"),
        (
            "clientConnection: {contentType: application/yaml}",
            "clientConnection.contentType",
        ),
    ] {
        let e = file(body).expect_err(body);
        match &e {
            ConfigError::Field { file, path: p, .. } => {
                assert_eq!(
                    (file.as_str(), p.as_str()),
                    ("kp.yaml", path),
                    "{body}: {e}"
                );
            }
            other => panic!("{body}: {other}"),
        }
        assert!(
            e.to_string().starts_with(&format!("kp.yaml: {path}: ")),
            "{e}"
        );
    }
}

#[test]
fn wrong_documents_are_refused() {
    let flags = ConfigFlags::default();
    for (text, path) in [
        ("apiVersion: v1\nkind: ConfigMap\n", "apiVersion"),
        (
            "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeletConfiguration\n",
            "kind",
        ),
        ("[1, 2]", "."),
        ("key: [unclosed", "."),
        ("", "."),
    ] {
        match load_str("kp.yaml", text, &flags) {
            Err(ConfigError::Field { path: p, .. }) => assert_eq!(p, path, "{text}"),
            other => panic!("{text}: {other:?}"),
        }
    }
}

#[test]
fn json_files_are_read_too() {
    let text = r#"{"apiVersion":"kubeproxy.config.k8s.io/v1alpha1","kind":"KubeProxyConfiguration","nftables":{"masqueradeBit":5}}"#;
    assert_eq!(
        load_str("kp.json", text, &ConfigFlags::default())
            .unwrap()
            .0
            .masquerade_bit,
        5
    );
}

#[test]
fn flags_override_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(
        &path,
        format!(
            "{HEAD}hostnameOverride: from-file\nclientConnection: {{kubeconfig: /file/kubeconfig}}\nhealthzBindAddress: 1.1.1.1:1\n\
             metricsBindAddress: 1.1.1.1:2\nclusterCIDR: 10.0.0.0/8\nnodePortAddresses: [10.0.0.0/8]\n\
             nftables: {{masqueradeBit: 3, masqueradeAll: true, syncPeriod: 10s, minSyncPeriod: 2s}}\n\
             featureGates: {{PreferSameTrafficDistribution: false}}\n"
        ),
    )
    .unwrap();
    let only_file = ConfigFlags {
        config: Some(path.clone()),
        ..Default::default()
    };
    let (f, _) = load(&only_file).unwrap();
    assert_eq!(f.hostname_override.as_deref(), Some("from-file"));
    assert_eq!(f.masquerade_bit, 3);

    let flags = ConfigFlags {
        config: Some(path.clone()),
        kubeconfig: Some("/flag/kubeconfig".into()),
        hostname_override: Some("from-flag".into()),
        bind_address: None,
        healthz_bind_address: Some("".into()),
        metrics_bind_address: Some("127.0.0.1:9999".into()),
        cluster_cidr: Some("10.244.0.0/16".into()),
        detect_local_mode: None,
        pod_interface_name_prefix: None,
        pod_bridge_interface: None,
        nodeport_addresses: Some("primary".into()),
        masquerade_all: Some(false),
        masquerade_bit: Some(7),
        min_sync_period: Some("0s".into()),
        sync_period: Some("1m".into()),
        feature_gates: Some("PreferSameTrafficDistribution=true".into()),
        proxy_terminating_endpoints: Some(false),
    };
    let (c, warnings) = load(&flags).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(c.kubeconfig, Some(PathBuf::from("/flag/kubeconfig")));
    assert_eq!(c.hostname_override.as_deref(), Some("from-flag"));
    assert_eq!(
        c.healthz_bind_address, None,
        "an empty flag disables the server"
    );
    assert_eq!(
        c.metrics_bind_address,
        Some("127.0.0.1:9999".parse().unwrap())
    );
    assert_eq!(
        c.plan.local_detector,
        LocalDetectorConfig::ClusterCidr(cidrs(&["10.244.0.0/16"]))
    );
    assert_eq!(c.plan.node_port_addresses, NodePortAddressesConfig::Primary);
    assert!(!c.plan.masquerade_all);
    assert_eq!(c.masquerade_bit, 7);
    assert_eq!(
        c.min_sync_period,
        Some(Duration::ZERO),
        "a flag's 0 is taken as given"
    );
    assert_eq!(c.sync_period, Duration::from_secs(60));
    assert!(c.plan.prefer_same_node_hints);
    assert!(!c.plan.proxy_terminating_endpoints);
}

#[test]
fn flags_alone_and_bad_flags() {
    let f = |flags: ConfigFlags| load(&flags);
    let c = f(ConfigFlags {
        detect_local_mode: Some("InterfaceNamePrefix".into()),
        pod_interface_name_prefix: Some("cali".into()),
        masquerade_all: Some(true),
        ..Default::default()
    })
    .unwrap()
    .0;
    assert_eq!(
        c.plan.local_detector,
        LocalDetectorConfig::InterfaceNamePrefix("cali".into())
    );
    assert!(c.plan.masquerade_all);
    let c = f(ConfigFlags {
        detect_local_mode: Some("BridgeInterface".into()),
        pod_bridge_interface: Some("cbr0".into()),
        ..Default::default()
    })
    .unwrap()
    .0;
    assert_eq!(
        c.plan.local_detector,
        LocalDetectorConfig::BridgeInterface("cbr0".into())
    );
    let c = f(ConfigFlags {
        nodeport_addresses: Some("10.200.0.0/24, fd00::/64".into()),
        ..Default::default()
    })
    .unwrap()
    .0;
    assert_eq!(
        c.plan.node_port_addresses,
        NodePortAddressesConfig::Cidrs(cidrs(&["10.200.0.0/24", "fd00::/64"]))
    );
    let c = f(ConfigFlags {
        bind_address: Some("fd00::1".into()),
        ..Default::default()
    })
    .unwrap()
    .0;
    assert_eq!(c.metrics_bind_address, Some("[::1]:10249".parse().unwrap()));

    for (flags, flag) in [
        (
            ConfigFlags {
                masquerade_bit: Some(40),
                ..Default::default()
            },
            "--masquerade-bit",
        ),
        (
            ConfigFlags {
                sync_period: Some("0s".into()),
                ..Default::default()
            },
            "--sync-period",
        ),
        (
            ConfigFlags {
                min_sync_period: Some("1 second".into()),
                ..Default::default()
            },
            "--min-sync-period",
        ),
        (
            ConfigFlags {
                feature_gates: Some("A".into()),
                ..Default::default()
            },
            "--feature-gates",
        ),
        (
            ConfigFlags {
                feature_gates: Some("A=maybe".into()),
                ..Default::default()
            },
            "--feature-gates",
        ),
        (
            ConfigFlags {
                detect_local_mode: Some("Nope".into()),
                ..Default::default()
            },
            "--detect-local-mode",
        ),
        (
            ConfigFlags {
                healthz_bind_address: Some("nope".into()),
                ..Default::default()
            },
            "--healthz-bind-address",
        ),
        (
            ConfigFlags {
                cluster_cidr: Some("10.0.0.0".into()),
                ..Default::default()
            },
            "--cluster-cidr",
        ),
        (
            ConfigFlags {
                detect_local_mode: Some("InterfaceNamePrefix".into()),
                pod_interface_name_prefix: Some("ve\"th".into()),
                ..Default::default()
            },
            "--pod-interface-name-prefix",
        ),
    ] {
        match f(flags) {
            Err(ConfigError::Flag { flag: got, .. }) => assert_eq!(got, flag),
            other => panic!("{flag}: {other:?}"),
        }
    }
    match f(ConfigFlags {
        config: Some("/nonexistent/kp.yaml".into()),
        ..Default::default()
    }) {
        Err(e @ ConfigError::Read { .. }) => {
            assert!(e.to_string().contains("/nonexistent/kp.yaml"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn cluster_cidr_mode_without_a_cidr_warns_only_when_asked_for() {
    let (c, w) = file("detectLocalMode: ClusterCIDR").unwrap();
    assert_eq!(c.plan.local_detector, LocalDetectorConfig::None);
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].path, "detectLocalMode");
    let (_, w) = file("").unwrap();
    assert!(w.is_empty());
}

#[test]
fn clap_parses_kube_proxy_style_flags() {
    use clap::Parser;
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        flags: ConfigFlags,
    }
    let cli = Cli::try_parse_from([
        "kproxy",
        "--config",
        "/c.yaml",
        "--masquerade-all",
        "--proxy-terminating-endpoints=false",
        "--masquerade-bit",
        "9",
        "--healthz-bind-address=",
        "--min-sync-period=100ms",
    ])
    .unwrap();
    assert_eq!(cli.flags.config, Some(PathBuf::from("/c.yaml")));
    assert_eq!(cli.flags.masquerade_all, Some(true));
    assert_eq!(cli.flags.proxy_terminating_endpoints, Some(false));
    assert_eq!(cli.flags.masquerade_bit, Some(9));
    assert_eq!(cli.flags.healthz_bind_address.as_deref(), Some(""));
    assert_eq!(cli.flags.min_sync_period.as_deref(), Some("100ms"));
}

#[test]
fn conntrack_sysctls_follow_upstream() {
    let d = ConntrackConfig::default();
    let nf = |n: &str| format!("/proc/sys/net/netfilter/{n}");
    let brief = |v: Vec<ConntrackSysctl>| -> Vec<(String, u64, SysctlScope, bool)> {
        v.into_iter()
            .map(|s| (s.path, s.value, s.scope, s.raise_only))
            .collect()
    };
    use SysctlScope::{Machine, NetworkNamespace};
    assert_eq!(
        brief(conntrack_sysctls(&d, 2)),
        vec![
            (nf("nf_conntrack_max"), 131072, Machine, false), // 2 × 32768 < min
            (CONNTRACK_HASHSIZE.to_string(), 32768, Machine, true),
            (
                nf("nf_conntrack_tcp_timeout_established"),
                86400,
                NetworkNamespace,
                false
            ),
            (
                nf("nf_conntrack_tcp_timeout_close_wait"),
                3600,
                NetworkNamespace,
                false
            ),
        ]
    );
    assert_eq!(
        brief(conntrack_sysctls(&d, 8))[..2],
        [
            (nf("nf_conntrack_max"), 262144, Machine, false),
            (CONNTRACK_HASHSIZE.to_string(), 65536, Machine, true)
        ]
    );
    let c = ConntrackConfig {
        max_per_core: 0,
        min: 5,
        tcp_established_timeout: Duration::ZERO,
        tcp_close_wait_timeout: Duration::from_millis(500),
        tcp_be_liberal: true,
        udp_timeout: Duration::from_secs(30),
        udp_stream_timeout: Duration::from_secs(120),
    };
    assert_eq!(
        brief(conntrack_sysctls(&c, 4)),
        vec![
            (nf("nf_conntrack_udp_timeout"), 30, NetworkNamespace, false),
            (
                nf("nf_conntrack_udp_timeout_stream"),
                120,
                NetworkNamespace,
                false
            ),
            (
                nf("nf_conntrack_tcp_be_liberal"),
                1,
                NetworkNamespace,
                false
            )
        ]
    );
}

#[test]
fn who_may_write_a_conntrack_sysctl_and_when_it_is_satisfied() {
    let all = conntrack_sysctls(&ConntrackConfig::default(), 2);
    let from = |host: bool| -> Vec<&str> {
        all.iter()
            .filter(|s| s.writable_from(host))
            .map(|s| s.path.rsplit('/').next().unwrap())
            .collect()
    };
    // A proxy in the node's own network namespace (a lab, a node in a namespace) sets
    // the timeouts there; the machine-wide table size only from the host's namespace.
    assert_eq!(
        from(false),
        [
            "nf_conntrack_tcp_timeout_established",
            "nf_conntrack_tcp_timeout_close_wait"
        ]
    );
    assert_eq!(from(true).len(), 4);
    // (setting, kernel's value, satisfied)
    for (i, current, want) in [
        (0, 131072, true),
        (0, 262144, false), // exactly: a larger max is lowered, as upstream does
        (1, 32768, true),
        (1, 65536, true), // the hash table is only raised
        (1, 16384, false),
        (3, 60, false),
        (3, 3600, true),
    ] {
        assert_eq!(
            all[i].satisfied_by(current),
            want,
            "{:?} at {current}",
            all[i]
        );
    }
}

/// `--config` had no bounds: a FIFO hung the loader, `/dev/zero` grew it to 1 GB
/// before "out of memory", a 2 GB sparse file to 2.1 GB. Now anything but a regular
/// file, and a file over `MAX_CONFIG_BYTES`, is refused with an error naming it; a
/// regular file (through a symlink, as a ConfigMap volume mounts it) still loads.
#[test]
fn the_config_file_must_be_a_regular_file_of_bounded_size() {
    let dir = tempfile::tempdir().unwrap();
    let load_path = |path: &std::path::Path| {
        load(&ConfigFlags {
            config: Some(path.to_path_buf()),
            ..ConfigFlags::default()
        })
    };
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let sparse = dir.path().join("sparse.yaml");
    std::fs::File::create(&sparse)
        .unwrap()
        .set_len(2 << 30)
        .unwrap();
    for (path, why) in [
        (fifo.as_path(), "a FIFO"),
        (std::path::Path::new("/dev/zero"), "a character device"),
        (dir.path(), "a directory"),
        (sparse.as_path(), "more than a configuration holds"),
    ] {
        let e = load_path(path).expect_err("refused").to_string();
        assert!(
            e.contains(&path.display().to_string()) && e.contains(why),
            "{e}"
        );
    }
    let real = dir.path().join("kp.yaml");
    std::fs::write(&real, format!("{HEAD}mode: nftables\n")).unwrap();
    let link = dir.path().join("config.yaml");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    load_path(&link).expect("a regular file through a symlink");
}

/// A sub-second conntrack timeout was skipped silently (the kernel takes whole
/// seconds): now it warns, naming the field, as does one that is truncated.
#[test]
fn conntrack_timeouts_the_kernel_cannot_take_as_given_warn() {
    let (c, warnings) = file("conntrack: {udpTimeout: 500ms, udpStreamTimeout: 90500ms}").unwrap();
    let said: Vec<String> = warnings.iter().map(ToString::to_string).collect();
    assert!(
        said.iter()
            .any(|w| w.starts_with("conntrack.udpTimeout") && w.contains("under a second")),
        "{said:?}"
    );
    assert!(
        said.iter()
            .any(|w| w.starts_with("conntrack.udpStreamTimeout") && w.contains("90 s")),
        "{said:?}"
    );
    // Not written, as upstream: no sysctl for the sub-second one.
    let sysctls = conntrack_sysctls(&c.conntrack, 1);
    assert!(
        !sysctls
            .iter()
            .any(|s| s.path.ends_with("nf_conntrack_udp_timeout"))
    );
    let (_, quiet) = file("conntrack: {udpTimeout: 30s}").unwrap();
    assert!(quiet.is_empty(), "{quiet:?}");
}

#[test]
fn field_use_is_the_table_the_parser_warns_from() {
    for (path, want) in [
        ("clusterCIDR", FieldUse::Honoured),
        ("conntrack.maxPerCore", FieldUse::Honoured),
        ("featureGates.AnyGate", FieldUse::Honoured),
        ("nftables", FieldUse::Honoured),
        (
            "iptables.masqueradeAll",
            FieldUse::Inapplicable(
                "does not apply to kproxy (nftables); use nftables.masqueradeAll".into(),
            ),
        ),
        (
            "ipvs.scheduler",
            FieldUse::Inapplicable("does not apply to kproxy (nftables)".into()),
        ),
        ("conntrack.noSuchField", FieldUse::Unknown),
        ("noSuchField", FieldUse::Unknown),
    ] {
        assert_eq!(field_use(path), want, "{path}");
    }
    // The same words as the parser's warning for the same field.
    let text = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\niptables:\n  masqueradeAll: true\n";
    let (_, warnings) = load_str("f", text, &ConfigFlags::default()).unwrap();
    assert_eq!(
        FieldUse::Inapplicable(warnings[0].message.clone()),
        field_use(&warnings[0].path)
    );
}
