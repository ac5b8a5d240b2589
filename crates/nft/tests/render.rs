//! Golden tests of rendered scripts (insta) for representative plans built through the
//! real manifest → plan path, and a check that every rendered script loads into a real
//! kernel (in a namespace of its own).

mod common;

use common::*;
use kproxy_core::PlanConfig;
use kproxy_core::config::{LocalDetectorConfig, NodePortAddressesConfig};
use kproxy_nft::DataplaneConfig;
use kproxy_nft::internals::render;

/// Affinity, source ranges, UDP, iTP Local, externalIPs, a Service without endpoints.
pub const MIXED: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-a}
spec: {podCIDRs: [10.244.1.0/24]}
status: {addresses: [{type: InternalIP, address: 10.200.0.1}]}
---
apiVersion: v1
kind: Service
metadata: {name: sticky, namespace: ns}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.20
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  sessionAffinity: ClientIP
  sessionAffinityConfig: {clientIP: {timeoutSeconds: 600}}
  loadBalancerSourceRanges: [198.51.100.0/24]
  ports: [{name: dns, port: 53, protocol: UDP, nodePort: 30053}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.20}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: sticky-1, namespace: ns, labels: {kubernetes.io/service-name: sticky}}
addressType: IPv4
ports: [{name: dns, port: 5353, protocol: UDP}]
endpoints:
- {addresses: [10.244.1.2], nodeName: node-a, conditions: {ready: true}}
- {addresses: [10.244.2.2], nodeName: node-b, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: internal, namespace: ns}
spec:
  clusterIP: 10.96.0.21
  internalTrafficPolicy: Local
  externalIPs: [203.0.113.21]
  ports: [{name: http, port: 80, protocol: TCP}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: internal-1, namespace: ns, labels: {kubernetes.io/service-name: internal}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.2.3], nodeName: node-b, conditions: {ready: true}}
- {addresses: [10.244.2.4], nodeName: node-b, conditions: {ready: true}}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: ns}
spec:
  type: NodePort
  clusterIP: 10.96.0.22
  ports: [{name: http, port: 80, protocol: TCP, nodePort: 30022}]
"#;

fn mixed_config() -> PlanConfig {
    PlanConfig {
        local_detector: LocalDetectorConfig::InterfaceNamePrefix("kpv".into()),
        node_port_addresses: NodePortAddressesConfig::Cidrs(vec!["10.200.0.0/24".parse().unwrap()]),
        ..PlanConfig::default()
    }
}

fn example_config() -> PlanConfig {
    PlanConfig {
        local_detector: LocalDetectorConfig::ClusterCidr(vec![
            "10.244.0.0/16".parse().unwrap(),
            "fd00:10:244::/48".parse().unwrap(),
        ]),
        ..PlanConfig::default()
    }
}

/// Every connection masqueraded, with `local_detector`.
fn masquerade_all(local_detector: LocalDetectorConfig) -> PlanConfig {
    PlanConfig {
        masquerade_all: true,
        local_detector,
        ..PlanConfig::default()
    }
}

#[test]
fn golden_example_cluster() {
    let plan = plan_from_yaml(&example_cluster(), "node-a", &example_config());
    insta::assert_snapshot!(render(&plan, &DataplaneConfig::default()));
}

#[test]
fn golden_mixed() {
    let plan = plan_from_yaml(MIXED, "node-a", &mixed_config());
    insta::assert_snapshot!(render(&plan, &DataplaneConfig::default()));
}

/// Which eTP=Local frontends take the shared dispatch (`goto etp-local`, NodePorts `goto
/// etp-local-np`, with their elements in the `etp-local…` maps) and which keep a chain
/// of their own: LB source ranges keep the LB IP's `ext-…` chain (its drop rule names
/// the Service's own LB IPs and sources; its NodePort takes the shared chain),
/// ClientIP affinity keeps per-endpoint chains. No detector: the shared chain has no
/// local-pod rule, and the frontends take it still. No local endpoint: the Local map
/// says `drop`; no endpoint at all: `goto no-endpoints`, as any Service.
#[test]
fn which_etp_local_frontends_take_the_shared_dispatch() {
    let service = |extra: &str, endpoints: &str| {
        format!(
            "apiVersion: v1\nkind: Node\nmetadata: {{name: node-a}}\nspec: {{podCIDRs: [10.244.1.0/24]}}\nstatus: {{addresses: [{{type: InternalIP, address: 10.200.0.1}}]}}\n---\napiVersion: v1\nkind: Service\nmetadata: {{name: web, namespace: ns}}\nspec:\n  type: LoadBalancer\n  clusterIP: 10.96.0.10\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 32000\n{extra}  ports: [{{name: http, port: 80, protocol: TCP, nodePort: 30080}}]\nstatus: {{loadBalancer: {{ingress: [{{ip: 203.0.113.10}}]}}}}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {{name: web-1, namespace: ns, labels: {{kubernetes.io/service-name: web}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints: [{endpoints}]\n"
        )
    };
    let (here, there) = (
        "{addresses: [10.244.1.5], nodeName: node-a}",
        "{addresses: [10.244.2.5], nodeName: node-b}",
    );
    let both = format!("{here}, {there}");
    let ranges = "  loadBalancerSourceRanges: [198.51.100.0/24]\n";
    let affinity = "  sessionAffinity: ClientIP\n";
    let none = LocalDetectorConfig::None;
    let cidr = LocalDetectorConfig::ClusterCidr(vec!["10.244.0.0/16".parse().unwrap()]);
    /// (case, Service, detector, the LB IP's and the NodePort's verdicts, elements of
    /// the shared maps)
    type Case<'a> = (
        &'a str,
        String,
        &'a LocalDetectorConfig,
        [&'a str; 2],
        &'a [&'a str],
    );
    let cases: [Case; 6] = [
        (
            "regular",
            service("", &both),
            &cidr,
            ["goto etp-local", "goto etp-local-np"],
            &[
                "etp-local-cluster { 203.0.113.10 . tcp . 80 : goto disp-c-2 }",
                "etp-local-local { 203.0.113.10 . tcp . 80 : goto disp-l-1 }",
                "etp-local-np-cluster { tcp . 30080 : goto npdisp-c-2 }",
                "etp-local-np-local { tcp . 30080 : goto npdisp-l-1 }",
            ],
        ),
        (
            "no detector",
            service("", &both),
            &none,
            ["goto etp-local", "goto etp-local-np"],
            &["etp-local-local { 203.0.113.10 . tcp . 80 : goto disp-l-1 }"],
        ),
        (
            "no local endpoint",
            service("", there),
            &cidr,
            ["goto etp-local", "goto etp-local-np"],
            &[
                "etp-local-cluster { 203.0.113.10 . tcp . 80 : goto disp-c-1 }",
                "etp-local-local { 203.0.113.10 . tcp . 80 : drop }",
            ],
        ),
        (
            "no endpoint",
            service("", ""),
            &cidr,
            ["goto no-endpoints", "goto no-endpoints"],
            &[],
        ),
        (
            "source ranges",
            service(ranges, &both),
            &cidr,
            ["goto ext-", "goto etp-local-np"],
            &["etp-local-np-local { tcp . 30080 : goto npdisp-l-1 }"],
        ),
        (
            "affinity",
            service(affinity, &both),
            &cidr,
            ["goto ext-", "goto ext-"],
            &[],
        ),
    ];
    for (case, text, detector, [lb, np], elements) in cases {
        let cfg = PlanConfig {
            local_detector: detector.clone(),
            ..PlanConfig::default()
        };
        let plan = plan_from_yaml(&text, "node-a", &cfg);
        let script = render(&plan, &DataplaneConfig::default());
        let v4 = script
            .split("add table ip6")
            .next()
            .expect("the ip table first");
        let element = |set: &str| -> String {
            let at = v4
                .find(&format!("add element ip kproxy {set} {{"))
                .unwrap_or_else(|| panic!("{case}: no {set} elements:\n{v4}"));
            v4[at..].lines().next().expect("a line").to_string()
        };
        let lb_line = element("service-ips");
        assert!(
            lb_line.contains(&format!("203.0.113.10 . tcp . 80 : {lb}")),
            "{case}: {lb_line}"
        );
        let np_line = element("service-nodeports");
        assert!(
            np_line.contains(&format!("tcp . 30080 : {np}")),
            "{case}: {np_line}"
        );
        for e in elements {
            assert!(
                v4.contains(&format!("add element ip kproxy {e}")),
                "{case}: {e}:\n{v4}"
            );
        }
        let shared = v4.contains("add element ip kproxy etp-local");
        assert_eq!(shared, !elements.is_empty(), "{case}:\n{v4}");
        let own = v4.contains("add chain ip kproxy ext-") || v4.contains("add chain ip kproxy np-");
        assert_eq!(own, lb == "goto ext-", "{case}:\n{v4}");
    }
}

#[test]
fn rendered_scripts_load_into_the_kernel() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let ns = Netns::new("load");
    let plans = [
        plan_from_yaml(&example_cluster(), "node-a", &example_config()),
        plan_from_yaml(&example_cluster(), "node-b", &PlanConfig::default()),
        plan_from_yaml(MIXED, "node-a", &mixed_config()),
        plan_from_yaml(MIXED, "node-b", &masquerade_all(LocalDetectorConfig::None)),
    ];
    ns.run(move || {
        for plan in &plans {
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            // A replacement, not an adoption of the previous plan's tables.
            dp.force_full_sync();
            let r = dp
                .sync(plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("full sync loads");
            assert!(r.full);
            assert!(dp.verify().expect("verify").differences.is_empty());
        }
        kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup");
        kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup when absent");
    });
}

/// The kernel's expressions of every rule kproxy writes, read back over netlink, decode
/// into the typed rule it was rendered from (`kproxy_nft::internals::dump::rule`): no rule of
/// kproxy's is "cannot tell", and none is taken for another. Both families, every
/// local-traffic detector, node-port addresses by CIDR and by list, affinity, source
/// ranges, service CIDRs.
#[test]
fn the_kernel_s_expressions_decode_into_the_rules_kproxy_wrote() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let plans = [
        plan_from_yaml(&example_cluster(), "node-a", &example_config()),
        plan_from_yaml(&example_cluster(), "node-b", &PlanConfig::default()),
        plan_from_yaml(MIXED, "node-a", &mixed_config()),
        plan_from_yaml(MIXED, "node-b", &masquerade_all(LocalDetectorConfig::None)),
        plan_from_yaml(
            MIXED,
            "node-a",
            &masquerade_all(LocalDetectorConfig::InterfaceNamePrefix("kpv".into())),
        ),
        plan_from_yaml(
            MIXED,
            "node-a",
            &masquerade_all(LocalDetectorConfig::BridgeInterface("cbr0".into())),
        ),
        // Two CIDRs a family (the `local-pods` set), node ports on every address.
        plan_from_yaml(
            MIXED,
            "node-a",
            &PlanConfig {
                node_port_addresses: NodePortAddressesConfig::Cidrs(vec![
                    "0.0.0.0/0".parse().unwrap(),
                    "::/0".parse().unwrap(),
                ]),
                ..masquerade_all(two_cluster_cidrs_a_family())
            },
        ),
    ];
    let mut bad = Vec::new();
    let mut rules = 0;
    for plan in plans {
        let ns = Netns::new("decode");
        let want = kproxy_nft::desired(&plan, &DataplaneConfig::default());
        let raw = ns.run(move || {
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            dp.sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("sync");
            [kproxy_nft::Family::Ip, kproxy_nft::Family::Ip6].map(|f| {
                kproxy_nft::internals::dump::read_table(f, "kproxy")
                    .expect("dump")
                    .expect("table")
            })
        });
        for (table, raw) in want.iter().zip(&raw) {
            for (name, chain) in table.chains() {
                let got = &raw.chains[name].rules;
                assert_eq!(got.len(), chain.rules.len(), "chain {name}");
                for (r, k) in chain.rules.iter().zip(got) {
                    rules += 1;
                    let d =
                        kproxy_nft::internals::dump::rule::decode(&k.exprs, table.family(), raw);
                    if !d.same(r) {
                        bad.push(format!(
                            "{} {name}: wrote `{r}`, read `{d}`",
                            table.family()
                        ));
                    }
                }
            }
        }
    }
    assert!(rules > 100, "{rules} rules");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Every rule kproxy writes, encoded by kproxy (`kproxy_nft::internals::rule::encode`) and sent
/// over nfnetlink in place of the rules `nft -f` wrote, lists exactly as `nft -f`'s
/// (`nft list ruleset`, comments included) and reads back as the same rules.
#[test]
fn rules_written_over_nfnetlink_list_as_nft_wrote_them() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let plans = [
        plan_from_yaml(&example_cluster(), "node-a", &example_config()),
        plan_from_yaml(MIXED, "node-a", &mixed_config()),
        plan_from_yaml(
            MIXED,
            "node-b",
            &masquerade_all(LocalDetectorConfig::BridgeInterface("cbr0".into())),
        ),
    ];
    for plan in plans {
        let ns = Netns::new("encode");
        let want = kproxy_nft::desired(&plan, &DataplaneConfig::default());
        nft_in(&ns, &[], Some(&render(&plan, &DataplaneConfig::default())));
        let by_nft = ns.exec("nft list ruleset");
        // Every chain flushed and refilled over netlink, in one batch.
        let mut tx = kproxy_nft::Transaction::default();
        for table in &want {
            for (name, chain) in table.chains() {
                tx.ops.push(kproxy_nft::internals::model::Op::FlushChain {
                    family: table.family(),
                    table: table.name().to_string(),
                    name: name.clone(),
                });
                for rule in &chain.rules {
                    tx.ops.push(kproxy_nft::internals::model::Op::AddRule {
                        family: table.family(),
                        table: table.name().to_string(),
                        chain: name.clone(),
                        rule: rule.clone(),
                    });
                }
            }
        }
        let batch =
            kproxy_nft::internals::netlink::Batch::transaction(&tx).expect("every rule encodes");
        ns.run(move || {
            kproxy_nft::internals::netlink::Writer::open()
                .expect("socket")
                .send(batch)
                .expect("the kernel takes the batch")
        });
        let by_netlink = ns.exec("nft list ruleset");
        assert_eq!(by_netlink, by_nft);
        let p = plan.clone();
        let report = ns.run(move || {
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            dp.sync(&p, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("adoption")
        });
        assert!(report.adopted && report.changes.is_empty(), "{report:?}");
    }
}

/// Every object kproxy writes — both tables (comment; created dormant and woken), base
/// and regular chains, `type` sets and verdict maps of concatenations, `typeof`
/// dispatch maps with a `numgen` field, dynamic sets with a timeout, an interval set
/// with auto-merge and its prefixes, every element and rule — written over nfnetlink by
/// the dataplane lists in `nft list ruleset` exactly as `nft -f` of the rendered text
/// writes it: the first sync into absent tables (its pieces and wake) and the
/// one-transaction replacement. And the other way round: the tables `nft -f` wrote read
/// back over nfnetlink as the record (an adoption that changes nothing).
#[test]
fn every_object_written_over_nfnetlink_lists_as_nft_wrote_it() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    let two_cidrs = LocalDetectorConfig::ClusterCidr(
        [
            "10.244.0.0/16",
            "10.250.0.0/16",
            "fd00:244::/32",
            "fd00:250::/32",
        ]
        .iter()
        .map(|n| n.parse().unwrap())
        .collect(),
    );
    let plans = [
        plan_from_yaml(&example_cluster(), "node-a", &example_config()),
        plan_from_yaml(MIXED, "node-a", &mixed_config()),
        plan_from_yaml(MIXED, "node-b", &masquerade_all(two_cidrs)),
        plan_from_yaml(
            MIXED,
            "node-b",
            &masquerade_all(LocalDetectorConfig::BridgeInterface("cbr0".into())),
        ),
    ];
    let mut kinds = std::collections::BTreeSet::new();
    for plan in plans {
        let cfg = DataplaneConfig::default();
        let script = render(&plan, &cfg);
        for kind in [
            "typeof",
            "numgen",
            ": verdict",
            "flags dynamic,timeout",
            "auto-merge",
            "flags interval",
            "comment",
        ] {
            if script.contains(kind) {
                kinds.insert(kind);
            }
        }
        let ns = Netns::new("objects");
        nft_in(&ns, &[], Some(&script));
        let by_nft = nft_in(&ns, &["list", "ruleset"], None);
        let p = plan.clone();
        let adopted = ns.run(move || {
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            dp.sync(&p, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("adoption")
        });
        assert!(
            adopted.adopted && adopted.changes.is_empty(),
            "nft's tables read back as the record: {adopted:?}"
        );

        let p = plan.clone();
        let first = ns.run(move || {
            kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup");
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            dp.sync(&p, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("first sync")
        });
        assert!(
            first.full && !first.adopted && first.netlink_bytes > 0,
            "{first:?}"
        );
        assert_eq!(
            nft_in(&ns, &["list", "ruleset"], None),
            by_nft,
            "first sync over nfnetlink"
        );

        let p = plan.clone();
        let replaced = ns.run(move || {
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            dp.force_full_sync();
            dp.sync(&p, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("replacement")
        });
        assert!(replaced.full && !replaced.adopted, "{replaced:?}");
        assert_eq!(
            nft_in(&ns, &["list", "ruleset"], None),
            by_nft,
            "one-transaction replacement over nfnetlink"
        );
        ns.run(|| kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup"));
        assert_eq!(nft_in(&ns, &["list", "ruleset"], None), "");
    }
    assert_eq!(
        kinds.len(),
        7,
        "every kind of declaration covered: {kinds:?}"
    );
}

#[test]
fn hostile_names_are_rejected() {
    for bad in [
        "",
        "kproxy\"; flush ruleset",
        "1abc",
        "a b",
        &"x".repeat(40),
        // nft keywords: the flag's rule is the dataplane's too.
        "inet",
        "Table",
    ] {
        let cfg = DataplaneConfig {
            table: bad.to_string(),
            ..DataplaneConfig::default()
        };
        assert!(kproxy_nft::Dataplane::new(cfg).is_err(), "{bad:?}");
    }
    for bad in ["eth0\" accept", "veth*", "", "abcdefghijklmnop", "a\nb"] {
        assert!(
            kproxy_nft::internals::validate_interface(bad).is_err(),
            "{bad:?}"
        );
    }
    assert!(kproxy_nft::internals::validate_interface("cbr0").is_ok());
}

/// A first sync into absent tables large enough to send its elements in several
/// nfnetlink transactions (≈ 15k elements, 4,096 a piece; the kernel's set hashes grow
/// between them) leaves exactly the record's tables in the kernel, woken: hooked, no
/// table flag left.
#[test]
fn a_first_sync_in_pieces_loads_the_whole_tables() {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return;
    }
    use kproxy_core::synthetic::{Spec, cluster};
    let state = cluster(&Spec::new(1500, 10));
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let ns = Netns::new("pieces");
    ns.run(move || {
        let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
        let r = dp
            .sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
            .expect("first sync loads");
        assert!(r.full && !r.adopted, "{r:?}");
        assert!(r.changes.elements_added > 3 * 4096, "{r:?}");
        assert!(r.netlink_bytes > 0, "{r:?}");
        assert!(dp.verify().expect("verify").differences.is_empty());
        let listed = sh("nft list table ip kproxy");
        assert!(listed.contains(" hook prerouting "));
        assert!(!listed.contains("dormant"));
        kproxy_nft::cleanup(&DataplaneConfig::default()).expect("cleanup");
    });
}

/// The host's own `nft` (Debian's 1.0.6 on the CI machine) decodes everything kproxy
/// puts in its tables: `nft list ruleset` and `nft -j list ruleset` succeed without a
/// word on stderr and without anything they could not decode, every rule kproxy wrote
/// is listed with its `kp:` id, and the listing, loaded into an empty namespace, lists
/// the same again (so each construct kproxy uses parses as nft prints it). Plans with
/// affinity (dynamic sets), source ranges (anonymous sets), reject and drop verdicts,
/// iTP/eTP Local, NodePorts, both families and each local-traffic detector (an interval
/// set of CIDRs, an interface prefix).
#[test]
fn the_hosts_nft_lists_kproxys_tables_and_reads_the_listing_back() {
    let version = sh("nft --version");
    let plans = [
        plan_from_yaml(&example_cluster(), "node-a", &example_config()),
        plan_from_yaml(MIXED, "node-a", &mixed_config()),
        plan_from_yaml(
            MIXED,
            "node-b",
            &masquerade_all(LocalDetectorConfig::InterfaceNamePrefix("veth".into())),
        ),
    ];
    for (n, plan) in plans.into_iter().enumerate() {
        let ns = Netns::new("list");
        let programmed = ns.run(move || {
            let mut dp = kproxy_nft::Dataplane::new(DataplaneConfig::default()).unwrap();
            dp.sync(&plan, &kproxy_core::planner::PlanUpdate::WHOLE)
                .expect("sync");
            dp.programmed().expect("synced")
        });
        let rules: usize = programmed.iter().map(|t| t.rule_count()).sum();
        let listed = nft_in(&ns, &["list", "ruleset"], None);
        let json = nft_in(&ns, &["-j", "list", "ruleset"], None);
        serde_json::from_str::<serde_json::Value>(&json).expect("nft -j lists JSON");
        for (what, text) in [("text", &listed), ("json", &json)] {
            for bad in ["unknown", "invalid", "??", "#0x"] {
                assert!(
                    !text.contains(bad),
                    "plan {n}: {version}: the {what} listing holds {bad:?}:\n{text}"
                );
            }
        }
        assert!(rules > 10, "plan {n}: {rules} rules");
        assert_eq!(
            listed.matches("comment \"kp:").count(),
            rules,
            "plan {n}: {version}: every rule listed with its id:\n{listed}"
        );
        // What nft printed, loaded into an empty namespace, is listed the same again.
        let empty = Netns::new("relist");
        nft_in(&empty, &[], Some(&listed));
        assert_eq!(
            nft_in(&empty, &["list", "ruleset"], None),
            listed,
            "plan {n}: {version}"
        );
    }
}
