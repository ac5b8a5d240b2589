//! Taking a node over from kube-proxy (docs/migrate.md): what of upstream kube-proxy's is on a
//! node, and the plan that removes exactly what `kube-proxy --cleanup` (v1.36,
//! `cmd/kube-proxy/app/server_linux.go` `platformCleanup`) removes — its nftables tables,
//! its iptables chains and the rules jumping to them, and in IPVS mode its virtual
//! servers, the `kube-ipvs0` interface and its ipsets — and nothing else.
//!
//! Pure: the shell (`crates/kproxy/src/takeover.rs`) reads the node into an
//! [`Inventory`], asks [`removal_plan`] and [`decide`], and runs the steps.
//!
//! The names come from upstream's sources: `pkg/proxy/nftables/cleanup.go` (the tables
//! `ip kube-proxy`, `ip6 kube-proxy`), `pkg/proxy/iptables/cleanup.go` (nat, filter and
//! mangle chains, and the service chain prefixes of `isServiceChainName`),
//! `pkg/proxy/ipvs/cleanup.go` (its chains, `ipsetInfo`, `kube-ipvs0`). A chain or table
//! of another name is left alone, whatever it looks like: an unknown kube-proxy version's
//! extra objects stay for its own `--cleanup`.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use crate::model::IpFamily;

/// The nftables table of kube-proxy's nftables mode, in both families.
pub const NFT_TABLE: &str = "kube-proxy";

/// The dummy interface kube-proxy's IPVS mode puts every Service IP on.
pub const IPVS_DEVICE: &str = "kube-ipvs0";

/// Chains `kube-proxy --cleanup` deletes, by table (iptables and IPVS modes together:
/// it runs both cleanups).
const NAT_CHAINS: [&str; 7] = [
    "KUBE-SERVICES",
    "KUBE-NODEPORTS",
    "KUBE-POSTROUTING",
    "KUBE-MARK-MASQ",
    "KUBE-PROXY-CANARY",
    // IPVS mode
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
];
const FILTER_CHAINS: [&str; 10] = [
    "KUBE-SERVICES",
    "KUBE-EXTERNAL-SERVICES",
    "KUBE-FORWARD",
    "KUBE-NODEPORTS",
    "KUBE-PROXY-FIREWALL",
    "KUBE-PROXY-CANARY",
    // IPVS mode
    "KUBE-NODE-PORT",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];
const MANGLE_CHAINS: [&str; 1] = ["KUBE-PROXY-CANARY"];
/// Per-service chains of the iptables mode (nat only), by prefix.
const SERVICE_CHAIN_PREFIXES: [&str; 5] = [
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-SEP-",
    "KUBE-FW-",
    "KUBE-EXT-",
];
/// The ipsets of the IPVS mode (`ipsetInfo`).
pub const IPVS_IPSETS: [&str; 18] = [
    "KUBE-LOOP-BACK",
    "KUBE-CLUSTER-IP",
    "KUBE-EXTERNAL-IP",
    "KUBE-EXTERNAL-IP-LOCAL",
    "KUBE-LOAD-BALANCER",
    "KUBE-LOAD-BALANCER-FW",
    "KUBE-LOAD-BALANCER-LOCAL",
    "KUBE-LOAD-BALANCER-SOURCE-IP",
    "KUBE-LOAD-BALANCER-SOURCE-CIDR",
    "KUBE-NODE-PORT-TCP",
    "KUBE-NODE-PORT-LOCAL-TCP",
    "KUBE-NODE-PORT-UDP",
    "KUBE-NODE-PORT-LOCAL-UDP",
    "KUBE-NODE-PORT-SCTP-HASH",
    "KUBE-NODE-PORT-LOCAL-SCTP-HASH",
    "KUBE-HEALTH-CHECK-NODE-PORT",
    "KUBE-IPVS-IPS",
    // Not in v1.36's ipsetInfo any more, but created by earlier IPVS proxiers under the
    // same documented prefix and removed by their cleanup.
    "KUBE-6-CLUSTER-IP",
];

/// Which iptables of the node: the nf_tables-based one or the legacy one (kube-proxy
/// uses whichever the node's `iptables` is; a node switched between them can hold both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum XtBackend {
    Nft,
    Legacy,
}

impl XtBackend {
    /// The restore command of this backend and family.
    pub fn restore_command(self, family: IpFamily) -> &'static str {
        match (self, family) {
            (XtBackend::Nft, IpFamily::IPv4) => "iptables-nft-restore",
            (XtBackend::Nft, IpFamily::IPv6) => "ip6tables-nft-restore",
            (XtBackend::Legacy, IpFamily::IPv4) => "iptables-legacy-restore",
            (XtBackend::Legacy, IpFamily::IPv6) => "ip6tables-legacy-restore",
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            XtBackend::Nft => "iptables-nft",
            XtBackend::Legacy => "iptables-legacy",
        }
    }
}

/// One iptables table of one backend and family, as `iptables-save` printed it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XtTable {
    pub backend: XtBackend,
    pub family: IpFamily,
    /// `nat`, `filter`, `mangle`, ...
    pub name: String,
    /// Every chain, built-in or not.
    pub chains: Vec<String>,
    /// `(chain, rule)`, the rule as after `-A CHAIN ` in the save format.
    pub rules: Vec<(String, String)>,
}

/// Parses `iptables-save` output (any number of tables) of one backend and family.
/// Lines it does not know (comments, counters) are skipped; a rule outside a table is
/// an error naming the line.
pub fn parse_iptables_save(
    backend: XtBackend,
    family: IpFamily,
    text: &str,
) -> Result<Vec<XtTable>, String> {
    let mut tables: Vec<XtTable> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end();
        if let Some(name) = line.strip_prefix('*') {
            tables.push(XtTable {
                backend,
                family,
                name: name.to_string(),
                chains: Vec::new(),
                rules: Vec::new(),
            });
        } else if let Some(decl) = line.strip_prefix(':') {
            let t = tables
                .last_mut()
                .ok_or_else(|| format!("line {}: chain before any table", n + 1))?;
            if let Some(name) = decl.split_whitespace().next() {
                t.chains.push(name.to_string());
            }
        } else if let Some(rule) = line.strip_prefix("-A ") {
            let t = tables
                .last_mut()
                .ok_or_else(|| format!("line {}: rule before any table", n + 1))?;
            let (chain, spec) = rule.split_once(' ').unwrap_or((rule, ""));
            t.rules.push((chain.to_string(), spec.to_string()));
        }
    }
    Ok(tables)
}

/// An nftables table: family word (`ip`, `ip6`, `inet`, ...) and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NftTableName {
    pub family: String,
    pub name: String,
}

/// Parses `nft list tables` output (`table FAMILY NAME` lines).
pub fn parse_nft_tables(text: &str) -> Vec<NftTableName> {
    text.lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next()? == "table").then_some(())?;
            Some(NftTableName {
                family: w.next()?.to_string(),
                name: w.next()?.to_string(),
            })
        })
        .collect()
}

/// What the shell read of the node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    pub nft_tables: Vec<NftTableName>,
    pub xt_tables: Vec<XtTable>,
    /// Network interface names.
    pub links: Vec<String>,
    /// ipset names (empty when the node has no `ipset`).
    pub ipsets: Vec<String>,
    /// IPVS virtual servers on the node (0 when the kernel has no IPVS).
    pub ipvs_virtual_servers: usize,
}

/// One removal, in the order of the plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `nft delete table FAMILY kube-proxy`: everything of the nftables mode.
    DeleteNftTable { family: IpFamily },
    /// One `*-restore --noflush` transaction on one table: the chain declarations flush
    /// the chains, `-D` deletes the rules of other chains that jump to them, `-X`
    /// deletes them.
    XtRestore {
        backend: XtBackend,
        family: IpFamily,
        table: String,
        chains: Vec<String>,
        jumps: usize,
        script: String,
    },
    /// `ipvsadm --clear` (upstream's `ipvs.Flush()`).
    IpvsFlush,
    /// `ip link delete kube-ipvs0`.
    DeleteLink { name: String },
    /// `ipset destroy NAME`, after the iptables rules that use it are gone.
    DestroyIpset { name: String },
}

impl Step {
    /// One line for logs and reports.
    pub fn describe(&self) -> String {
        match self {
            Step::DeleteNftTable { family } => {
                format!("nft table {} {NFT_TABLE}", family.nft_family())
            }
            Step::XtRestore {
                backend,
                family,
                table,
                chains,
                jumps,
                ..
            } => format!(
                "{} {} table {table}: {} chains, {jumps} jump rules",
                backend.as_str(),
                family.as_str(),
                chains.len()
            ),
            Step::IpvsFlush => "IPVS virtual servers".to_string(),
            Step::DeleteLink { name } => format!("interface {name}"),
            Step::DestroyIpset { name } => format!("ipset {name}"),
        }
    }
}

/// Which of kube-proxy's modes left something on the node.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Found {
    pub nftables: bool,
    pub iptables: bool,
    pub ipvs: bool,
}

impl Found {
    pub fn any(&self) -> bool {
        self.nftables || self.iptables || self.ipvs
    }

    /// The modes found, as words for logs and the metric's label.
    pub fn modes(&self) -> Vec<&'static str> {
        [
            (self.nftables, "nftables"),
            (self.iptables, "iptables"),
            (self.ipvs, "ipvs"),
        ]
        .into_iter()
        .filter_map(|(f, m)| f.then_some(m))
        .collect()
    }
}

/// The removal plan: empty when nothing of kube-proxy's is on the node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemovalPlan {
    pub found: Found,
    pub steps: Vec<Step>,
}

impl RemovalPlan {
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }
}

/// Is `chain` of table `table` one `kube-proxy --cleanup` deletes?
pub fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    match table {
        "nat" => {
            NAT_CHAINS.contains(&chain)
                || SERVICE_CHAIN_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        "filter" => FILTER_CHAINS.contains(&chain),
        "mangle" => MANGLE_CHAINS.contains(&chain),
        _ => false,
    }
}

/// The chain a rule jumps or goes to (`-j X` / `-g X`), if any.
fn rule_target(spec: &str) -> Option<&str> {
    let mut words = spec.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" || w == "--jump" || w == "--goto" {
            return words.next();
        }
    }
    None
}

/// Is this chain only an IPVS-mode chain (not one the iptables mode also has)?
fn ipvs_only_chain(chain: &str) -> bool {
    matches!(
        chain,
        "KUBE-NODE-PORT"
            | "KUBE-LOAD-BALANCER"
            | "KUBE-SOURCE-RANGES-FIREWALL"
            | "KUBE-IPVS-FILTER"
            | "KUBE-IPVS-OUT-FILTER"
    )
}

/// Exactly what `kube-proxy --cleanup` would remove from this node, in an order that
/// works: nftables tables; per iptables table one transaction (a rule jumping into a
/// chain must go before the chain); then IPVS virtual servers, `kube-ipvs0`, and the
/// ipsets last (an ipset cannot be destroyed while a rule uses it).
///
/// Deliberate differences from upstream, each safer: IPVS virtual servers are flushed
/// only when `kube-ipvs0` or one of kube-proxy's ipsets shows an IPVS kube-proxy was
/// here (upstream flushes every virtual server on any node with `ip_vs`); and every
/// rule jumping into a removed chain goes, whatever its comment (upstream deletes the
/// jumps by their exact text and then fails to delete a chain still referenced).
pub fn removal_plan(inv: &Inventory) -> RemovalPlan {
    let mut plan = RemovalPlan::default();
    for t in &inv.nft_tables {
        if t.name != NFT_TABLE {
            continue;
        }
        if let Some(family) = IpFamily::of_nft_family(&t.family) {
            plan.found.nftables = true;
            plan.steps.push(Step::DeleteNftTable { family });
        }
    }
    for t in &inv.xt_tables {
        let chains: Vec<String> = t
            .chains
            .iter()
            .filter(|c| is_kube_proxy_chain(&t.name, c))
            .cloned()
            .collect();
        if chains.is_empty() {
            continue;
        }
        // The canary alone (kube-proxy's iptables mode creates it in every table, the
        // nftables mode never) is enough to say iptables mode; IPVS-only chains say IPVS.
        for c in &chains {
            if ipvs_only_chain(c) {
                plan.found.ipvs = true;
            } else {
                plan.found.iptables = true;
            }
        }
        let removed: BTreeSet<&str> = chains.iter().map(String::as_str).collect();
        let jumps: Vec<&(String, String)> = t
            .rules
            .iter()
            .filter(|(chain, spec)| {
                !removed.contains(chain.as_str())
                    && rule_target(spec).is_some_and(|to| removed.contains(to))
            })
            .collect();
        let mut script = format!("*{}\n", t.name);
        for c in &chains {
            let _ = writeln!(script, ":{c} - [0:0]");
        }
        for (chain, spec) in &jumps {
            let _ = writeln!(script, "-D {chain} {spec}");
        }
        for c in &chains {
            let _ = writeln!(script, "-X {c}");
        }
        script.push_str("COMMIT\n");
        plan.steps.push(Step::XtRestore {
            backend: t.backend,
            family: t.family,
            table: t.name.clone(),
            jumps: jumps.len(),
            chains,
            script,
        });
    }
    let has_device = inv.links.iter().any(|l| l == IPVS_DEVICE);
    let ipsets: Vec<&String> = inv
        .ipsets
        .iter()
        .filter(|s| IPVS_IPSETS.contains(&s.as_str()))
        .collect();
    if has_device || !ipsets.is_empty() {
        plan.found.ipvs = true;
        if inv.ipvs_virtual_servers > 0 {
            plan.steps.push(Step::IpvsFlush);
        }
        if has_device {
            plan.steps.push(Step::DeleteLink {
                name: IPVS_DEVICE.to_string(),
            });
        }
        for s in ipsets {
            plan.steps.push(Step::DestroyIpset { name: s.clone() });
        }
    }
    plan
}

/// `--kube-proxy-takeover`: what kproxy does with kube-proxy's rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TakeoverMode {
    /// Remove them once no kube-proxy runs on the node (the default).
    #[default]
    Auto,
    /// Never remove them (the operator does, e.g. with `kube-proxy --cleanup`); only
    /// detect, log and count.
    Off,
    /// Remove them even while a kube-proxy runs (it will put them back on its next
    /// sync: only for a kube-proxy that is stuck or being stopped).
    Force,
}

impl TakeoverMode {
    pub const NAMES: [&'static str; 3] = ["auto", "off", "force"];

    pub fn parse(s: &str) -> Option<TakeoverMode> {
        match s {
            "auto" => Some(TakeoverMode::Auto),
            "off" => Some(TakeoverMode::Off),
            "force" => Some(TakeoverMode::Force),
            _ => None,
        }
    }
}

/// Signs of a kube-proxy still running on this node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Liveness {
    /// Pids of `kube-proxy` processes in this network namespace.
    pub processes: Vec<u32>,
    /// kproxy's healthzBindAddress could not be bound: another process holds it
    /// (kube-proxy's default healthz port is the same, 10256).
    pub healthz_port_held: bool,
}

impl Liveness {
    pub fn live(&self) -> bool {
        !self.processes.is_empty() || self.healthz_port_held
    }

    /// Why kproxy thinks a kube-proxy runs, for the log.
    pub fn reason(&self) -> String {
        let mut why = Vec::new();
        if !self.processes.is_empty() {
            why.push(format!(
                "kube-proxy process(es) {:?} in this network namespace",
                self.processes
            ));
        }
        if self.healthz_port_held {
            why.push("another process holds the healthz port".to_string());
        }
        why.join("; ")
    }
}

/// What to do now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nothing of kube-proxy's on the node.
    Nothing,
    /// Run the plan.
    Remove,
    /// A kube-proxy runs: leave its rules, say why, look again later.
    WaitForKubeProxy { why: String },
    /// `--kube-proxy-takeover=off`: leave them to the operator.
    LeaveToOperator,
}

/// The takeover decision. kproxy's own tables are up before this is asked (its verdicts
/// already win), so waiting costs nothing but the stale rules' memory.
pub fn decide(mode: TakeoverMode, plan: &RemovalPlan, live: &Liveness) -> Decision {
    if plan.is_empty() {
        return Decision::Nothing;
    }
    match mode {
        TakeoverMode::Off => Decision::LeaveToOperator,
        TakeoverMode::Force => Decision::Remove,
        TakeoverMode::Auto if live.live() => Decision::WaitForKubeProxy { why: live.reason() },
        TakeoverMode::Auto => Decision::Remove,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const IPTABLES_SAVE: &str = r#"*mangle
:PREROUTING ACCEPT [0:0]
:KUBE-PROXY-CANARY - [0:0]
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FIREWALL - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-NODEPORTS - [0:0]
:KUBE-SERVICES - [0:0]
:MY-FIREWALL - [0:0]
-A INPUT -j KUBE-FIREWALL
-A INPUT -m comment --comment "kubernetes health check service ports" -j KUBE-NODEPORTS
-A INPUT -j MY-FIREWALL
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A OUTPUT -m conntrack --ctstate NEW -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -j DROP
-A KUBE-NODEPORTS -p tcp -m tcp --dport 32000 -j ACCEPT
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-ABC - [0:0]
:KUBE-SEP-DEF - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-NEW-IN-V2 - [0:0]
:DOCKER - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A PREROUTING -j DOCKER
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A KUBE-SERVICES -d 10.96.0.10/32 -j KUBE-SVC-ABC
-A KUBE-NEW-IN-V2 -j KUBE-SVC-ABC
COMMIT
"#;

    fn inv() -> Inventory {
        Inventory {
            xt_tables: parse_iptables_save(XtBackend::Nft, IpFamily::IPv4, IPTABLES_SAVE).unwrap(),
            ..Default::default()
        }
    }

    fn restore<'a>(plan: &'a RemovalPlan, table: &str) -> Option<&'a Step> {
        plan.steps
            .iter()
            .find(|s| matches!(s, Step::XtRestore { table: t, .. } if t == table))
    }

    #[test]
    fn iptables_mode_plan_is_upstream_cleanup() {
        let plan = removal_plan(&inv());
        assert_eq!(
            plan.found,
            Found {
                iptables: true,
                ..Default::default()
            }
        );
        let Some(Step::XtRestore { script, .. }) = restore(&plan, "filter") else {
            panic!("no filter step: {plan:?}")
        };
        // kubelet's KUBE-FIREWALL and the admin's MY-FIREWALL stay, with their jumps.
        assert_eq!(
            script,
            "*filter\n:KUBE-FORWARD - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:KUBE-SERVICES - [0:0]\n\
             -D INPUT -m comment --comment \"kubernetes health check service ports\" -j KUBE-NODEPORTS\n\
             -D FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD\n\
             -D OUTPUT -m conntrack --ctstate NEW -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
             -X KUBE-FORWARD\n-X KUBE-NODEPORTS\n-X KUBE-SERVICES\nCOMMIT\n"
        );
        let Some(Step::XtRestore { script, chains, .. }) = restore(&plan, "nat") else {
            panic!("no nat step")
        };
        assert_eq!(
            chains,
            &[
                "KUBE-SERVICES",
                "KUBE-SVC-ABC",
                "KUBE-SEP-DEF",
                "KUBE-POSTROUTING"
            ]
        );
        // DOCKER and the unknown KUBE-NEW-IN-V2 stay; KUBE-NEW-IN-V2's jump into a
        // removed chain must go, or the chain could not be deleted.
        assert!(
            script.contains("-D KUBE-NEW-IN-V2 -j KUBE-SVC-ABC\n"),
            "{script}"
        );
        assert!(!script.contains("DOCKER"), "{script}");
        assert!(!script.contains(":KUBE-NEW-IN-V2"), "{script}");
        let Some(Step::XtRestore { script, .. }) = restore(&plan, "mangle") else {
            panic!("no mangle step")
        };
        assert_eq!(
            script,
            "*mangle\n:KUBE-PROXY-CANARY - [0:0]\n-X KUBE-PROXY-CANARY\nCOMMIT\n"
        );
    }

    /// The rules real kube-proxy v1.36.2 wrote (crates/kproxy/tests/fixtures/kube-proxy):
    /// every chain it created goes, kubelet's KUBE-FIREWALL stays.
    #[test]
    fn recorded_iptables_mode_rules() {
        let text = include_str!("../../kproxy/tests/fixtures/kube-proxy/iptables.save");
        let inv = Inventory {
            xt_tables: parse_iptables_save(XtBackend::Nft, IpFamily::IPv4, text).unwrap(),
            ..Default::default()
        };
        let plan = removal_plan(&inv);
        let kinds: Vec<String> = plan.steps.iter().map(Step::describe).collect();
        assert_eq!(
            kinds,
            vec![
                "iptables-nft IPv4 table mangle: 1 chains, 0 jump rules",
                "iptables-nft IPv4 table filter: 6 chains, 9 jump rules",
                "iptables-nft IPv4 table nat: 11 chains, 3 jump rules",
            ]
        );
        for t in &inv.xt_tables {
            for c in &t.chains {
                let kept = !plan.steps.iter().any(|s| matches!(s, Step::XtRestore { table, chains, .. } if *table == t.name && chains.contains(c)));
                assert_eq!(
                    kept,
                    !c.starts_with("KUBE-") || c == "KUBE-FIREWALL",
                    "{} {c}",
                    t.name
                );
            }
        }
    }

    #[test]
    fn nftables_mode_plan_deletes_only_its_two_tables() {
        let inv = Inventory {
            nft_tables: parse_nft_tables(
                "table ip kube-proxy\ntable ip6 kube-proxy\ntable inet kube-proxy\n\
                 table ip kproxy\ntable ip kube-proxy-next\ntable ip filter\n",
            ),
            ..Default::default()
        };
        let plan = removal_plan(&inv);
        assert_eq!(
            plan.steps,
            vec![
                Step::DeleteNftTable {
                    family: IpFamily::IPv4
                },
                Step::DeleteNftTable {
                    family: IpFamily::IPv6
                },
            ]
        );
        assert_eq!(plan.found.modes(), vec!["nftables"]);
    }

    /// What kube-proxy's IPVS mode leaves (upstream `pkg/proxy/ipvs`); this kernel has
    /// no `ip_vs`, so the plan is covered here and not by packets.
    #[test]
    fn ipvs_mode_plan() {
        let save = "*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n\
                    :KUBE-SERVICES - [0:0]\n:KUBE-POSTROUTING - [0:0]\n:KUBE-NODE-PORT - [0:0]\n\
                    :KUBE-LOAD-BALANCER - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n\
                    -A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES\n\
                    -A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n\
                    -A KUBE-SERVICES -m set --match-set KUBE-CLUSTER-IP dst,dst -j ACCEPT\n\
                    COMMIT\n*filter\n:INPUT ACCEPT [0:0]\n:KUBE-IPVS-FILTER - [0:0]\n\
                    -A INPUT -m comment --comment \"kubernetes ipvs access filter\" -j KUBE-IPVS-FILTER\n\
                    COMMIT\n";
        let inv = Inventory {
            xt_tables: parse_iptables_save(XtBackend::Legacy, IpFamily::IPv4, save).unwrap(),
            links: vec!["lo".into(), "eth0".into(), IPVS_DEVICE.into()],
            ipsets: vec![
                "KUBE-CLUSTER-IP".into(),
                "KUBE-LOOP-BACK".into(),
                "my-set".into(),
            ],
            ipvs_virtual_servers: 12,
            ..Default::default()
        };
        let plan = removal_plan(&inv);
        assert!(plan.found.ipvs && plan.found.iptables);
        let kinds: Vec<String> = plan.steps.iter().map(Step::describe).collect();
        assert_eq!(
            kinds,
            vec![
                "iptables-legacy IPv4 table nat: 5 chains, 2 jump rules",
                "iptables-legacy IPv4 table filter: 1 chains, 1 jump rules",
                "IPVS virtual servers",
                "interface kube-ipvs0",
                "ipset KUBE-CLUSTER-IP",
                "ipset KUBE-LOOP-BACK",
            ]
        );
        // Another user's IPVS services, with no sign of kube-proxy: left alone.
        let other = Inventory {
            ipvs_virtual_servers: 3,
            ipsets: vec!["my-set".into()],
            ..Default::default()
        };
        assert!(removal_plan(&other).is_empty());
    }

    #[test]
    fn nothing_of_kube_proxys_is_an_empty_plan() {
        let save = "*filter\n:INPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n-A INPUT -j KUBE-FIREWALL\nCOMMIT\n";
        let inv = Inventory {
            xt_tables: parse_iptables_save(XtBackend::Nft, IpFamily::IPv4, save).unwrap(),
            nft_tables: parse_nft_tables("table ip kproxy\ntable ip6 kproxy\n"),
            links: vec!["eth0".into()],
            ..Default::default()
        };
        let plan = removal_plan(&inv);
        assert!(plan.is_empty() && !plan.found.any());
        assert_eq!(
            decide(TakeoverMode::Force, &plan, &Liveness::default()),
            Decision::Nothing
        );
    }

    #[test]
    fn decisions() {
        let plan = removal_plan(&inv());
        let dead = Liveness::default();
        let running = Liveness {
            processes: vec![42],
            healthz_port_held: false,
        };
        let port = Liveness {
            processes: vec![],
            healthz_port_held: true,
        };
        let table = [
            (TakeoverMode::Auto, &dead, "remove"),
            (TakeoverMode::Auto, &running, "wait"),
            (TakeoverMode::Auto, &port, "wait"),
            (TakeoverMode::Force, &running, "remove"),
            (TakeoverMode::Off, &dead, "leave"),
            (TakeoverMode::Off, &running, "leave"),
        ];
        for (mode, live, want) in table {
            let got = match decide(mode, &plan, live) {
                Decision::Remove => "remove",
                Decision::WaitForKubeProxy { .. } => "wait",
                Decision::LeaveToOperator => "leave",
                Decision::Nothing => "nothing",
            };
            assert_eq!(got, want, "{mode:?} {live:?}");
        }
        let Decision::WaitForKubeProxy { why } = decide(TakeoverMode::Auto, &plan, &running) else {
            unreachable!()
        };
        assert!(why.contains("[42]"), "{why}");
    }

    #[test]
    fn bad_save_lines_name_the_line() {
        let err =
            parse_iptables_save(XtBackend::Nft, IpFamily::IPv4, "-A INPUT -j X\n").unwrap_err();
        assert!(err.contains("line 1"), "{err}");
    }
}
