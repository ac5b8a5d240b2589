//! The declarative nftables model of one family's table (`Ruleset`), built from a
//! `NodePlan` by pure code, and the two ways it reaches nft text: a full
//! table-replacing script and the delta between two rulesets. The in-memory record of
//! what is programmed (`crate::record`) keeps per-Service fragments, so an incremental
//! sync costs work proportional to what changed.
//!
//! Layout (chosen for kernel and nft cost, see BENCHMARKS.md: nft spends ~45 µs per
//! rule but ~6–14 µs per set element, and every nft call dumps all rules into its
//! cache, so the table holds few rules and many elements):
//! - `service-ips` (addr . proto . port → verdict) and `service-nodeports` (proto . port
//!   → verdict) dispatch new connections from the `services` chain;
//! - the endpoint is chosen by *dispatch groups*: map `dnat-c-N` (`dnat-l-N` for the
//!   Local endpoint set) keyed `daddr . l4proto . dport . numgen random mod N` holds,
//!   for every address frontend whose endpoint set has N endpoints, the rows
//!   `frontend . i : endpoint ip . port`; its chain `disp-c-N` has the one rule
//!   `dnat to daddr . l4proto . dport . numgen random mod N map @dnat-c-N`. NodePorts
//!   use `npdnat-…`/`npdisp-…`, keyed `l4proto . dport . numgen …` (daddr is any node
//!   address). Each map is referenced by exactly one rule: the kernel walks every
//!   binding of a map on each element insert, and names each anonymous set by scanning
//!   every set of the table, both of which made per-Service maps quadratic;
//! - a frontend whose rules are *regular* (one rule for every source, or "local pods
//!   as they are, everyone else masqueraded", both to one endpoint set) maps straight
//!   to `goto disp-…` from the verdict map: no chain or rule of its own. Its masquerade
//!   is an element of `masq-ips` / `masq-ips-nonlocal` / `masq-nodeports`, which one
//!   rule each in `services` turns into the masquerade mark before the dispatch;
//! - an irregular frontend (eTP Local with its local-source short-circuit, LB source
//!   ranges) gets a chain `svc-…` (cluster IP), `ext-…` (external/LB IPs, source-range
//!   drop first) or `np-…` (NodePort) whose rules are `<source match> [mark] goto
//!   disp-…`, `drop` or `goto no-endpoints`; ClientIP-affinity ports keep per-endpoint
//!   chains with dynamic sets and a `numgen random mod n-i 0` rule per endpoint (rare);
//! - frontends with nothing to forward to map to `drop`, or to `goto no-endpoints`
//!   (`reject`; IPv6 TCP: `no-endpoints-tcp`, a TCP reset);
//! - hairpin masquerade is one set `hairpin` of `ip . ip` pairs matched in postrouting
//!   (source == DNATed destination), instead of a rule in every endpoint chain;
//! - REJECT/DROP verdicts run in the same nat chains (kernel ≥ 5.9 allows `reject`
//!   in prerouting); nat chains only see the first packet of a connection, so every
//!   verdict applies to new connections only, as upstream's do.
//!
//! So a one-endpoint change is a few element deletes and adds (a frontend moving to
//! another N: its old rows out, new rows in, its verdict-map element re-pointed).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;

use kproxy_core::NodePlan;
use kproxy_core::model::{EndpointAddr, IpFamily};
use kproxy_core::plan::{
    EndpointSet, LocalPods, NodePortAddresses, ServicePortPlan, SourceClass, TrafficRule, Verdict,
};
use sha2::{Digest, Sha256};

use crate::DataplaneConfig;

/// One chain: its declaration (base-chain hook spec, or empty) and its rules in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chain {
    pub decl: String,
    pub rules: Vec<String>,
}

/// One named set or map: its declaration and its elements (key → value; value empty
/// for sets).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Set {
    pub decl: String,
    pub elements: BTreeMap<String, String>,
}

/// Everything kproxy programs into one family's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ruleset {
    /// `ip` or `ip6`.
    pub family: &'static str,
    pub table: String,
    pub sets: BTreeMap<String, Set>,
    pub chains: BTreeMap<String, Chain>,
}

/// Counts of what a delta changes, for the sync report and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaCounts {
    pub chains_added: usize,
    pub chains_changed: usize,
    pub chains_deleted: usize,
    pub elements_added: usize,
    pub elements_deleted: usize,
    pub sets_added: usize,
    pub sets_deleted: usize,
}

impl DeltaCounts {
    pub fn is_empty(&self) -> bool {
        *self == DeltaCounts::default()
    }

    pub fn add(&mut self, o: &DeltaCounts) {
        self.chains_added += o.chains_added;
        self.chains_changed += o.chains_changed;
        self.chains_deleted += o.chains_deleted;
        self.elements_added += o.elements_added;
        self.elements_deleted += o.elements_deleted;
        self.sets_added += o.sets_added;
        self.sets_deleted += o.sets_deleted;
    }
}

pub fn nft_family(f: IpFamily) -> &'static str {
    match f {
        IpFamily::IPv4 => "ip",
        IpFamily::IPv6 => "ip6",
    }
}

/// Family-specific vocabulary.
struct Fam {
    /// `ip` / `ip6` as a payload protocol.
    p: &'static str,
    addr: &'static str,
    loopback: &'static str,
    family: IpFamily,
}

impl Fam {
    fn of(family: IpFamily) -> Fam {
        match family {
            IpFamily::IPv4 => Fam {
                p: "ip",
                addr: "ipv4_addr",
                loopback: "127.0.0.0/8",
                family,
            },
            IpFamily::IPv6 => Fam {
                p: "ip6",
                addr: "ipv6_addr",
                loopback: "::1",
                family,
            },
        }
    }
}

/// Builds the ruleset of one family. Pure.
pub fn build(plan: &NodePlan, cfg: &DataplaneConfig, family: IpFamily) -> Ruleset {
    let mut rs = build_base(plan, cfg, family);
    let mut claimed = BTreeSet::new();
    for svc in plan.services.values() {
        rs.merge(&build_service(svc, plan, cfg, family), &mut claimed);
    }
    rs
}

/// One element of a named set or map: (set, key, value; value empty for sets).
pub type Element = (String, String, String);

/// What one Service contributes to one family's table: its own chains and sets (a
/// `Ruleset` holding only those), its elements of the shared sets (`cluster-ips`,
/// `hairpin`: present while any Service has them), its frontends (every element a
/// frontend key brings: the `service-ips`/`service-nodeports` verdict, the masquerade
/// set entry and the dispatch-map rows; a frontend claimed by several Services takes
/// all of them from the first in plan order, which is what `trace` predicts), and the
/// dispatch groups it uses (created while any Service uses them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fragment {
    pub own: Ruleset,
    pub shared: Vec<(&'static str, String, String)>,
    pub frontends: Vec<(String, Arc<[Element]>)>,
    pub dispatch: BTreeSet<Dispatch>,
}

/// A dispatch group: the map `dnat-{c,l}-N` (address frontends) or `npdnat-{c,l}-N`
/// (NodePorts) holding, for every frontend whose endpoint set (Cluster or Local) has N
/// endpoints, the rows `frontend . i : endpoint` (i in 0..N), and the chain
/// `disp-…`/`npdisp-…` whose one rule DNATs through it with `numgen random mod N`.
/// Each map is referenced by exactly one rule (every binding of a map is walked on
/// every element insert), and no anonymous sets are involved.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Dispatch {
    pub nodeport: bool,
    pub local: bool,
    pub n: usize,
}

impl Dispatch {
    fn prefix(&self) -> &'static str {
        if self.nodeport { "np" } else { "" }
    }
    fn tag(&self) -> String {
        format!("{}-{}", if self.local { "l" } else { "c" }, self.n)
    }
    pub fn chain(&self) -> String {
        format!("{}disp-{}", self.prefix(), self.tag())
    }
    pub fn map(&self) -> String {
        format!("{}dnat-{}", self.prefix(), self.tag())
    }
    /// The map and the chain of this group.
    pub fn objects(&self, family: IpFamily) -> (Set, Chain) {
        let f = Fam::of(family);
        let key = if self.nodeport {
            "meta l4proto . th dport".to_string()
        } else {
            format!("{} daddr . meta l4proto . th dport", f.p)
        };
        let pick = format!("numgen random mod {}", self.n);
        (
            Set {
                decl: format!("typeof {key} . {pick} : {} daddr . th dport;", f.p),
                elements: BTreeMap::new(),
            },
            Chain {
                decl: String::new(),
                rules: vec![format!(
                    "dnat {} to {key} . {pick} map @{}",
                    f.p,
                    self.map()
                )],
            },
        )
    }
}

impl Ruleset {
    /// Adds a Service's fragment. A shared key already present keeps its first value; a
    /// frontend already in `claimed` keeps the elements of its first Service (plan
    /// order), which is what `trace` predicts for colliding frontends.
    pub fn merge(&mut self, frag: &Fragment, claimed: &mut BTreeSet<String>) {
        self.chains
            .extend(frag.own.chains.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.sets
            .extend(frag.own.sets.iter().map(|(k, v)| (k.clone(), v.clone())));
        for d in &frag.dispatch {
            self.add_dispatch(d);
        }
        for (set, key, value) in &frag.shared {
            if let Some(s) = self.sets.get_mut(*set) {
                s.elements
                    .entry(key.clone())
                    .or_insert_with(|| value.clone());
            }
        }
        for (fe, elems) in &frag.frontends {
            if claimed.insert(fe.clone()) {
                self.add_elements(elems);
            }
        }
    }

    /// Declares a dispatch group's map and chain (no-op when present).
    pub fn add_dispatch(&mut self, d: &Dispatch) {
        let family = if self.family == "ip6" {
            IpFamily::IPv6
        } else {
            IpFamily::IPv4
        };
        if let std::collections::btree_map::Entry::Vacant(e) = self.sets.entry(d.map()) {
            let (set, chain) = d.objects(family);
            e.insert(set);
            self.chains.insert(d.chain(), chain);
        }
    }

    /// Inserts elements into sets that exist (first value of a key wins).
    pub fn add_elements(&mut self, elems: &[Element]) {
        for (set, key, value) in elems {
            if let Some(s) = self.sets.get_mut(set) {
                s.elements
                    .entry(key.clone())
                    .or_insert_with(|| value.clone());
            }
        }
    }
}

/// The Service's fragment for one family. Pure.
pub fn build_service(
    svc: &kproxy_core::plan::ServicePlan,
    plan: &NodePlan,
    cfg: &DataplaneConfig,
    family: IpFamily,
) -> Fragment {
    let f = Fam::of(family);
    let mut frag = Fragment {
        own: Ruleset {
            family: nft_family(family),
            table: cfg.table.clone(),
            sets: BTreeMap::new(),
            chains: BTreeMap::new(),
        },
        shared: Vec::new(),
        frontends: Vec::new(),
        dispatch: BTreeSet::new(),
    };
    let local_pods = &plan.family(family).local_pods;
    for sp in svc.ports.iter().filter(|sp| sp.family == family) {
        add_service_port(&mut frag, &f, sp, local_pods, cfg.mark());
    }
    frag
}

/// The table without any Service: base chains, the shared sets (empty of Service
/// elements) and the node-level sets. Pure and cheap (no per-Service work).
pub fn build_base(plan: &NodePlan, cfg: &DataplaneConfig, family: IpFamily) -> Ruleset {
    let f = Fam::of(family);
    let mark = cfg.mark();
    let mut rs = Ruleset {
        family: nft_family(family),
        table: cfg.table.clone(),
        sets: BTreeMap::new(),
        chains: BTreeMap::new(),
    };
    let fp = plan.family(family);

    // Sets and maps.
    let set = |decl: String| Set {
        decl,
        elements: BTreeMap::new(),
    };
    rs.sets.insert(
        "service-ips".into(),
        set(format!("type {} . inet_proto . inet_service : verdict; comment \"cluster IPs, external IPs and LB IPs\";", f.addr)),
    );
    rs.sets.insert(
        "service-nodeports".into(),
        set("type inet_proto . inet_service : verdict; comment \"NodePorts\";".into()),
    );
    rs.sets.insert(
        "cluster-ips".into(),
        set(format!("type {}; comment \"active cluster IPs\";", f.addr)),
    );
    rs.sets.insert(
        "nodeport-ips".into(),
        set(format!(
            "type {}; comment \"addresses that accept NodePorts\";",
            f.addr
        )),
    );
    rs.sets.insert(
        "masq-ips".into(),
        set(format!(
            "type {} . inet_proto . inet_service; comment \"frontends that masquerade\";",
            f.addr
        )),
    );
    rs.sets.insert(
        "masq-nodeports".into(),
        set("type inet_proto . inet_service; comment \"NodePorts that masquerade\";".into()),
    );
    let nonlocal = nonlocal_match(&f, &fp.local_pods);
    if nonlocal.is_some() {
        rs.sets.insert(
            "masq-ips-nonlocal".into(),
            set(format!(
                "type {} . inet_proto . inet_service; comment \"frontends that masquerade unless from a local pod\";",
                f.addr
            )),
        );
    }
    rs.sets.insert(
        "hairpin".into(),
        set(format!(
            "type {} . {}; comment \"endpoint IP . endpoint IP\";",
            f.addr, f.addr
        )),
    );

    // Base chains, hooks and priorities as upstream's nat chains.
    let base = |decl: &str, rules: Vec<String>| Chain {
        decl: decl.to_string(),
        rules,
    };
    rs.chains.insert(
        "nat-prerouting".into(),
        base(
            "type nat hook prerouting priority dstnat; policy accept;",
            vec!["jump services".into()],
        ),
    );
    rs.chains.insert(
        "nat-output".into(),
        base(
            "type nat hook output priority -100; policy accept;",
            vec!["jump services".into()],
        ),
    );
    rs.chains.insert(
        "nat-postrouting".into(),
        base(
            "type nat hook postrouting priority srcnat; policy accept;",
            vec!["jump masquerading".into()],
        ),
    );
    rs.chains.insert(
        "masquerading".into(),
        base(
            "",
            vec![
                // Hairpin: a pod reaching itself through a Service (source == chosen endpoint).
                format!(
                    "ct status dnat {p} saddr . {p} daddr @hairpin masquerade fully-random",
                    p = f.p
                ),
                format!("meta mark & {mark:#x} == 0 return"),
                format!("meta mark set meta mark ^ {mark:#x}"),
                "masquerade fully-random".into(),
            ],
        ),
    );
    // Masquerade marks of the frontends whose plan is regular (see `classify`), then
    // the dispatch; irregular frontends set the mark in their own chain.
    let masq = format!("meta mark set meta mark | {mark:#x}");
    let key = format!("{} daddr . meta l4proto . th dport", f.p);
    let mut services = vec![format!("{key} @masq-ips {masq}")];
    if let Some(m) = &nonlocal {
        services.push(format!("{m}{key} @masq-ips-nonlocal {masq}"));
    }
    services.push(format!("{key} vmap @service-ips"));
    let np_match = match &fp.node_port_addresses {
        NodePortAddresses::AllLocal => Some(format!(
            "fib daddr type local {} daddr != {} ",
            f.p, f.loopback
        )),
        NodePortAddresses::Only(list) => {
            let ips: Vec<&IpAddr> = list.iter().filter(|ip| family.contains(ip)).collect();
            if ips.is_empty() {
                None
            } else {
                let s = rs.sets.get_mut("nodeport-ips").expect("declared above");
                for ip in ips {
                    s.elements.insert(ip.to_string(), String::new());
                }
                Some(format!("{} daddr @nodeport-ips ", f.p))
            }
        }
    };
    if let Some(m) = np_match {
        services.push(format!("{m}meta l4proto . th dport @masq-nodeports {masq}"));
        services.push(format!(
            "{m}meta l4proto . th dport vmap @service-nodeports"
        ));
    }
    // A live cluster IP on a port/protocol no Service defines is rejected (v1.30+).
    services.push(format!("{} daddr @cluster-ips reject", f.p));
    rs.chains.insert("services".into(), base("", services));
    // REJECT targets of frontends without endpoints (verdict maps cannot reject).
    rs.chains
        .insert("no-endpoints".into(), base("", vec!["reject".into()]));
    if family == IpFamily::IPv6 {
        rs.chains.insert(
            "no-endpoints-tcp".into(),
            base("", vec!["reject with tcp reset".into()]),
        );
    }

    if let LocalPods::Cidrs(cidrs) = &fp.local_pods {
        let c: Vec<String> = cidrs
            .iter()
            .filter(|n| family.contains(&n.addr()))
            .map(|n| n.trunc().to_string())
            .collect();
        if c.len() > 1 {
            let mut s = set(format!(
                "type {}; flags interval; auto-merge; comment \"local pod CIDRs\";",
                f.addr
            ));
            s.elements = c.into_iter().map(|k| (k, String::new())).collect();
            rs.sets.insert("local-pods".into(), s);
        }
    }
    rs
}

fn add_service_port(
    frag: &mut Fragment,
    f: &Fam,
    sp: &ServicePortPlan,
    local_pods: &LocalPods,
    mark: u32,
) {
    let id = port_id(sp);
    let proto = sp.protocol.nft_name();
    for ep in &sp.all_reachable_endpoints {
        frag.shared
            .push(("hairpin", format!("{ip} . {ip}", ip = ep.ip), String::new()));
    }
    frag.shared
        .push(("cluster-ips", sp.cluster_ip.to_string(), String::new()));
    if sp.session_affinity_timeout.is_some() {
        add_affinity_port(frag, f, sp, &id, local_pods, mark);
        return;
    }
    let addr_key = |ip: &IpAddr| format!("{ip} . {proto} . {}", sp.port);

    // Internal traffic: the cluster IP.
    let ctx = PortCtx {
        f,
        sp,
        local_pods,
        mark,
    };
    ctx.frontends(
        frag,
        &sp.internal,
        vec![addr_key(&sp.cluster_ip)],
        false,
        format!("svc-{id}"),
        None,
    );
    if sp.external.is_empty() {
        return;
    }
    // External traffic: external IPs and LB IPs (LB source ranges first), NodePort.
    let firewall = firewall_rule(f, sp);
    let addrs: Vec<String> = sp
        .external_ips
        .iter()
        .chain(&sp.load_balancer_ips)
        .map(addr_key)
        .collect();
    if !addrs.is_empty() {
        ctx.frontends(
            frag,
            &sp.external,
            addrs,
            false,
            format!("ext-{id}"),
            firewall,
        );
    }
    if let Some(np) = sp.node_port {
        ctx.frontends(
            frag,
            &sp.external,
            vec![format!("{proto} . {np}")],
            true,
            format!("np-{id}"),
            None,
        );
    }
}

/// The LB source-range rule of a port's external chain, if it has one.
fn firewall_rule(f: &Fam, sp: &ServicePortPlan) -> Option<String> {
    let fw = sp.firewall.as_ref()?;
    let lbs: Vec<String> = sp
        .load_balancer_ips
        .iter()
        .map(|ip| ip.to_string())
        .collect();
    if lbs.is_empty() {
        return None;
    }
    let allowed: Vec<String> = fw
        .allowed_sources
        .iter()
        .filter(|n| f.family.contains(&n.addr()))
        .map(|n| n.trunc().to_string())
        .collect();
    let lb = format!(
        "{} daddr {{ {} }} th dport {}",
        f.p,
        lbs.join(", "),
        sp.port
    );
    Some(if allowed.is_empty() {
        format!("{lb} drop")
    } else {
        format!("{lb} {} saddr != {{ {} }} drop", f.p, allowed.join(", "))
    })
}

/// How a frontend whose rules need no chain of its own is dispatched.
enum Direct {
    Drop,
    Reject,
    Forward(EndpointSet, Masq),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Masq {
    Never,
    Always,
    /// Unless the source is a local pod (the `masq-ips-nonlocal` set).
    NonLocal,
}

struct PortCtx<'a> {
    f: &'a Fam,
    sp: &'a ServicePortPlan,
    local_pods: &'a LocalPods,
    mark: u32,
}

impl PortCtx<'_> {
    /// The rules that can match (a `LocalPod` rule without a detector never does).
    fn live<'r>(&self, rules: &'r [TrafficRule]) -> Vec<(String, &'r TrafficRule)> {
        rules
            .iter()
            .filter_map(|r| source_match(r.from, self.f, self.local_pods).map(|m| (m, r)))
            .collect()
    }

    /// The regular shapes the planner produces for most frontends, which need no
    /// per-Service chain: one rule for every source, or "local pods as they are,
    /// everyone else masqueraded" to one endpoint set. `None`: a chain of its own.
    fn classify(&self, rules: &[TrafficRule], nodeport: bool) -> Option<Direct> {
        let live = self.live(rules);
        let nonempty = |s: EndpointSet| !self.sp.endpoints_for(s).is_empty();
        match live.as_slice() {
            [(_, r)] if r.from == SourceClass::Any => match r.verdict {
                Verdict::Drop => Some(Direct::Drop),
                Verdict::Reject => Some(Direct::Reject),
                Verdict::Forward {
                    endpoints,
                    masquerade,
                } if nonempty(endpoints) => Some(Direct::Forward(
                    endpoints,
                    if masquerade {
                        Masq::Always
                    } else {
                        Masq::Never
                    },
                )),
                Verdict::Forward { .. } => None,
            },
            [(_, a), (_, b)]
                if !nodeport && a.from == SourceClass::LocalPod && b.from == SourceClass::Any =>
            {
                match (a.verdict, b.verdict) {
                    (
                        Verdict::Forward {
                            endpoints: x,
                            masquerade: false,
                        },
                        Verdict::Forward {
                            endpoints: y,
                            masquerade: true,
                        },
                    ) if x == y && nonempty(x) => Some(Direct::Forward(x, Masq::NonLocal)),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    fn dispatch(&self, set: EndpointSet, nodeport: bool) -> Dispatch {
        Dispatch {
            nodeport,
            local: set == EndpointSet::Local,
            n: self.sp.endpoints_for(set).len(),
        }
    }

    fn reject_target(&self) -> &'static str {
        // IPv6: a TCP connect() ignored the ICMPv6 port-unreachable that plain `reject`
        // sends from the nat hooks (measured: it timed out), so TCP gets a reset, which
        // refuses at once as REJECT must.
        if self.f.family == IpFamily::IPv6 && self.sp.protocol == kproxy_core::model::Protocol::TCP
        {
            "no-endpoints-tcp"
        } else {
            "no-endpoints"
        }
    }

    /// Renders the frontends `keys` (address keys `ip . proto . port`, or NodePort keys
    /// `proto . port`) that share the rule list `rules`: straight from the verdict map
    /// to a dispatch chain when the rules are regular, else through the chain `chain`.
    fn frontends(
        &self,
        frag: &mut Fragment,
        rules: &[TrafficRule],
        keys: Vec<String>,
        nodeport: bool,
        chain: String,
        firewall: Option<String>,
    ) {
        let direct = if firewall.is_none() {
            self.classify(rules, nodeport)
        } else {
            None
        };
        let mut sets: Vec<EndpointSet> = Vec::new();
        let mut masq = Masq::Never;
        let value = match direct {
            Some(Direct::Drop) => "drop".to_string(),
            Some(Direct::Reject) => format!("goto {}", self.reject_target()),
            Some(Direct::Forward(set, m)) => {
                sets.push(set);
                masq = m;
                format!("goto {}", self.dispatch(set, nodeport).chain())
            }
            None => {
                let mut out: Vec<String> = firewall.into_iter().collect();
                for (m, r) in self.live(rules) {
                    match r.verdict {
                        Verdict::Drop => out.push(format!("{m}drop")),
                        Verdict::Reject => out.push(format!("{m}goto {}", self.reject_target())),
                        Verdict::Forward {
                            endpoints,
                            masquerade,
                        } => {
                            if self.sp.endpoints_for(endpoints).is_empty() {
                                // Invariant of the planner (a Forward set is never
                                // empty); be safe anyway.
                                out.push(format!("{m}drop"));
                                continue;
                            }
                            let mk = if masquerade {
                                format!("meta mark set meta mark | {:#x} ", self.mark)
                            } else {
                                String::new()
                            };
                            out.push(format!(
                                "{m}{mk}goto {}",
                                self.dispatch(endpoints, nodeport).chain()
                            ));
                            if !sets.contains(&endpoints) {
                                sets.push(endpoints);
                            }
                        }
                    }
                }
                frag.own.chains.insert(
                    chain.clone(),
                    Chain {
                        decl: String::new(),
                        rules: out,
                    },
                );
                format!("goto {chain}")
            }
        };
        for d in sets.iter().map(|s| self.dispatch(*s, nodeport)) {
            frag.dispatch.insert(d);
        }
        let (vmap, masq_set) = match (nodeport, masq) {
            (_, Masq::Never) => (
                if nodeport {
                    "service-nodeports"
                } else {
                    "service-ips"
                },
                None,
            ),
            (true, _) => ("service-nodeports", Some("masq-nodeports")),
            (false, Masq::Always) => ("service-ips", Some("masq-ips")),
            (false, Masq::NonLocal) => ("service-ips", Some("masq-ips-nonlocal")),
        };
        for key in keys {
            let fe = format!("{}{key}", if nodeport { "np " } else { "ip " });
            if frag.frontends.iter().any(|(k, _)| *k == fe) {
                continue; // the same frontend twice in one Service: the first counts
            }
            let mut elems = vec![(vmap.to_string(), key.clone(), value.clone())];
            if let Some(ms) = masq_set {
                elems.push((ms.to_string(), key.clone(), String::new()));
            }
            for set in &sets {
                let d = self.dispatch(*set, nodeport);
                let map = d.map();
                for (i, ep) in self.sp.endpoints_for(*set).iter().enumerate() {
                    elems.push((
                        map.clone(),
                        format!("{key} . {i}"),
                        format!("{} . {}", ep.ip, ep.port),
                    ));
                }
            }
            frag.frontends.push((fe, elems.into()));
        }
    }
}

/// A ClientIP-affinity port: per-endpoint chains and dynamic sets as before the
/// dispatch maps (rare; the per-endpoint rules are what remembers the client).
fn add_affinity_port(
    frag: &mut Fragment,
    f: &Fam,
    sp: &ServicePortPlan,
    id: &str,
    local_pods: &LocalPods,
    mark: u32,
) {
    let Fragment {
        own: rs, frontends, ..
    } = frag;
    let proto = sp.protocol.nft_name();
    let svc_chain = format!("svc-{id}");
    let ext_chain = format!("ext-{id}");
    let timeout = sp.session_affinity_timeout.unwrap_or_default();
    for ep in &sp.all_reachable_endpoints {
        let (set, chain) = affinity_names(id, ep);
        rs.sets.insert(
            set.clone(),
            Set {
                decl: format!(
                    "type {}; flags dynamic,timeout; timeout {timeout}s;",
                    f.addr
                ),
                elements: BTreeMap::new(),
            },
        );
        rs.chains.insert(
            chain,
            Chain {
                decl: String::new(),
                rules: vec![format!(
                    "update @{set} {{ {} saddr }} meta l4proto {proto} dnat to {}",
                    f.p,
                    dnat_target(ep)
                )],
            },
        );
    }

    let ctx = PortCtx {
        f,
        sp,
        local_pods,
        mark,
    };
    let rules = |list: &[TrafficRule]| -> Vec<String> {
        let mut out = Vec::new();
        for (m, r) in ctx.live(list) {
            match r.verdict {
                Verdict::Drop => out.push(format!("{m}drop")),
                Verdict::Reject => out.push(format!("{m}goto {}", ctx.reject_target())),
                Verdict::Forward {
                    endpoints,
                    masquerade,
                } => {
                    let eps = sp.endpoints_for(endpoints);
                    forward_rules(&mut out, &m, f, sp, id, eps, masquerade, mark);
                }
            }
        }
        out
    };
    let mut push = |fe: String, vmap: &str, key: String, value: String| {
        if !frontends.iter().any(|(k, _)| *k == fe) {
            frontends.push((fe, vec![(vmap.to_string(), key, value)].into()));
        }
    };

    rs.chains.insert(
        svc_chain.clone(),
        Chain {
            decl: String::new(),
            rules: rules(&sp.internal),
        },
    );
    let key = format!("{} . {proto} . {}", sp.cluster_ip, sp.port);
    push(
        format!("ip {key}"),
        "service-ips",
        key,
        format!("goto {svc_chain}"),
    );

    if !sp.external.is_empty() {
        let mut ext: Vec<String> = firewall_rule(f, sp).into_iter().collect();
        ext.extend(rules(&sp.external));
        rs.chains.insert(
            ext_chain.clone(),
            Chain {
                decl: String::new(),
                rules: ext,
            },
        );
        for ip in sp.external_ips.iter().chain(&sp.load_balancer_ips) {
            let key = format!("{ip} . {proto} . {}", sp.port);
            push(
                format!("ip {key}"),
                "service-ips",
                key,
                format!("goto {ext_chain}"),
            );
        }
        if let Some(np) = sp.node_port {
            let key = format!("{proto} . {np}");
            push(
                format!("np {key}"),
                "service-nodeports",
                key,
                format!("goto {ext_chain}"),
            );
        }
    }
}

/// The Forward rules of an affinity port: known clients go back to the endpoint they
/// used (in endpoint order), new ones pick uniformly.
#[allow(clippy::too_many_arguments)]
fn forward_rules(
    out: &mut Vec<String>,
    m: &str,
    f: &Fam,
    sp: &ServicePortPlan,
    id: &str,
    eps: &[EndpointAddr],
    masquerade: bool,
    mark: u32,
) {
    let proto = sp.protocol.nft_name();
    if eps.is_empty() {
        // Invariant of the planner (a Forward set is never empty); be safe anyway.
        out.push(format!("{m}drop"));
        return;
    }
    let masq = if masquerade {
        format!("meta mark set meta mark | {mark:#x} ")
    } else {
        String::new()
    };
    for ep in eps {
        let (set, _) = affinity_names(id, ep);
        out.push(format!(
            "{m}{p} saddr @{set} {masq}update @{set} {{ {p} saddr }} meta l4proto {proto} dnat to {}",
            dnat_target(ep),
            p = f.p
        ));
    }
    for (i, ep) in eps.iter().enumerate() {
        let pick = pick(i, eps.len());
        out.push(format!("{m}{masq}{pick}goto {}", affinity_names(id, ep).1));
    }
}

/// The uniform random choice of an affinity port without a set: rule `i` of `n` takes
/// the packet with probability 1/(n-i) (each `numgen` evaluation draws afresh), so every
/// endpoint gets 1/n. (Affinity ports are rare; all others use the dispatch maps.)
fn pick(i: usize, n: usize) -> String {
    if i + 1 == n {
        String::new()
    } else {
        format!("numgen random mod {} 0 ", n - i)
    }
}

fn dnat_target(ep: &EndpointAddr) -> String {
    // EndpointAddr's Display is `ip:port` / `[ip]:port`, which is nft's syntax too.
    ep.to_string()
}

/// The match prefix (with a trailing space) of a source class; `None` when the class
/// can never match (LocalPod without a detector), so the rule is left out.
fn source_match(class: SourceClass, f: &Fam, local_pods: &LocalPods) -> Option<String> {
    match class {
        SourceClass::Any => Some(String::new()),
        SourceClass::ThisNode => Some("fib saddr type local ".into()),
        SourceClass::LocalPod => match local_pods {
            LocalPods::None => None,
            LocalPods::Cidrs(cidrs) => {
                let c: Vec<String> = cidrs
                    .iter()
                    .filter(|n| f.family.contains(&n.addr()))
                    .map(|n| n.trunc().to_string())
                    .collect();
                match c.len() {
                    0 => None,
                    1 => Some(format!("{} saddr {} ", f.p, c[0])),
                    // A named set, filled in `build`: no anonymous set per rule.
                    _ => Some(format!("{} saddr @local-pods ", f.p)),
                }
            }
            // Interface names are validated by `crate::ident::interface_name`; an invalid
            // one was rejected before rendering (see `validate_plan`).
            LocalPods::InterfacePrefix(p) => Some(format!("iifname \"{p}*\" ")),
            LocalPods::Bridge(b) => Some(format!("iifname \"{b}\" ")),
        },
    }
}

/// The negation of the `LocalPod` match (with a trailing space); `None` when there is
/// no `LocalPod` match for this family.
fn nonlocal_match(f: &Fam, local_pods: &LocalPods) -> Option<String> {
    let m = source_match(SourceClass::LocalPod, f, local_pods)?;
    // `ip saddr X `, `ip saddr @local-pods `, `iifname "…" ` → the same with `!=`.
    let (lhs, rhs) = if let Some(rest) = m.strip_prefix("iifname ") {
        ("iifname".to_string(), rest.to_string())
    } else {
        let rest = m.strip_prefix(&format!("{} saddr ", f.p))?;
        (format!("{} saddr", f.p), rest.to_string())
    };
    Some(format!("{lhs} != {rhs}"))
}

/// A short stable identifier of a service port: hash (uniqueness) + readable name.
/// Every part is a validated Kubernetes name; `sanitize` keeps it an nft identifier
/// even if that ever changes.
pub fn port_id(sp: &ServicePortPlan) -> String {
    let spn = &sp.service_port;
    let key = spn.to_string();
    let h = Sha256::digest(key.as_bytes());
    let hash: String = h.iter().take(4).map(|b| format!("{b:02x}")).collect();
    let readable = format!(
        "{}/{}/{}/{}",
        spn.service.namespace,
        spn.service.name,
        sp.protocol.nft_name(),
        spn.port_name
    );
    let mut id = format!("{hash}-{}", sanitize(&readable));
    id.truncate(180);
    id
}

fn affinity_names(id: &str, ep: &EndpointAddr) -> (String, String) {
    let e = sanitize(&format!("{}/{}", ep.ip, ep.port).replace(':', "."));
    (format!("aff-{id}__{e}"), format!("aep-{id}__{e}"))
}

/// Keeps only characters nft accepts in an unquoted identifier.
fn sanitize(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

impl Ruleset {
    /// The full script that replaces this family's table atomically: creating then
    /// deleting the table first makes `delete` succeed whether or not it exists, and
    /// the whole script is one transaction, so there is no gap.
    pub fn full_script(&self, out: &mut String) {
        let (fam, t) = (self.family, &self.table);
        full_header(out, fam, t);
        for (name, s) in &self.sets {
            let _ = writeln!(out, "add {} {fam} {t} {name} {{ {} }}", kind(s), s.decl);
        }
        for (name, c) in &self.chains {
            decl_chain(out, fam, t, name, c);
        }
        for (name, c) in &self.chains {
            for r in &c.rules {
                let _ = writeln!(out, "add rule {fam} {t} {name} {r}");
            }
        }
        for (name, s) in &self.sets {
            elements(out, "add", fam, t, name, str_pairs(s.elements.iter()), true);
        }
    }

    /// The delta from `old` (what is programmed) to `self`, as one script; `None` when
    /// a declaration changed and only a full sync can apply it.
    pub fn delta_script(&self, old: &Ruleset, out: &mut String) -> Option<DeltaCounts> {
        let mut n = DeltaCounts::default();
        if !self.delta_pre(old, out, &mut n) {
            return None;
        }
        self.delta_post(old, out, &mut n);
        Some(n)
    }

    /// First half of the delta (new sets and chains, flushes, rules, own elements);
    /// `false` when a declaration changed and only a full sync can apply it. Shared
    /// elements that reference chains go between this and [`Ruleset::delta_post`].
    pub fn delta_pre(&self, old: &Ruleset, out: &mut String, n: &mut DeltaCounts) -> bool {
        if old.family != self.family || old.table != self.table {
            return false;
        }
        let (fam, t) = (self.family, &self.table);
        for (name, s) in &self.sets {
            if let Some(o) = old.sets.get(name)
                && o.decl != s.decl
            {
                return false;
            }
        }
        for (name, c) in &self.chains {
            if let Some(o) = old.chains.get(name)
                && o.decl != c.decl
            {
                return false;
            }
        }
        // 1. New sets and chains.
        for (name, s) in &self.sets {
            if !old.sets.contains_key(name) {
                n.sets_added += 1;
                let _ = writeln!(out, "add {} {fam} {t} {name} {{ {} }}", kind(s), s.decl);
            }
        }
        for (name, c) in &self.chains {
            if !old.chains.contains_key(name) {
                n.chains_added += 1;
                decl_chain(out, fam, t, name, c);
            }
        }
        // 2. Flush changed and removed chains (drops their references first).
        for (name, c) in &old.chains {
            match self.chains.get(name) {
                Some(new) if new.rules == c.rules => {}
                Some(_) => {
                    n.chains_changed += 1;
                    let _ = writeln!(out, "flush chain {fam} {t} {name}");
                }
                None => {
                    let _ = writeln!(out, "flush chain {fam} {t} {name}");
                }
            }
        }
        // 3. Rules of new and changed chains.
        for (name, c) in &self.chains {
            if old.chains.get(name).is_some_and(|o| o.rules == c.rules) {
                continue;
            }
            for r in &c.rules {
                let _ = writeln!(out, "add rule {fam} {t} {name} {r}");
            }
        }
        // 4. Elements: removed or re-valued keys out, new or re-valued keys in.
        for (name, s) in &self.sets {
            let empty = BTreeMap::new();
            let olde = old.sets.get(name).map(|o| &o.elements).unwrap_or(&empty);
            let del: Vec<_> = olde
                .iter()
                .filter(|(k, v)| s.elements.get(*k) != Some(*v))
                .collect();
            let add: Vec<_> = s
                .elements
                .iter()
                .filter(|(k, v)| olde.get(*k) != Some(*v))
                .collect();
            n.elements_deleted += del.len();
            n.elements_added += add.len();
            elements(
                out,
                "delete",
                fam,
                t,
                name,
                str_pairs(del.into_iter()),
                false,
            );
            elements(out, "add", fam, t, name, str_pairs(add.into_iter()), true);
        }
        true
    }

    /// Second half of the delta: removed chains and sets, now unreferenced.
    pub fn delta_post(&self, old: &Ruleset, out: &mut String, n: &mut DeltaCounts) {
        let (fam, t) = (self.family, &self.table);
        for name in old.chains.keys() {
            if !self.chains.contains_key(name) {
                n.chains_deleted += 1;
                let _ = writeln!(out, "delete chain {fam} {t} {name}");
            }
        }
        for name in old.sets.keys() {
            if !self.sets.contains_key(name) {
                n.sets_deleted += 1;
                let _ = writeln!(out, "delete {} {fam} {t} {name}", kind(&old.sets[name]));
            }
        }
    }

    /// Counts for a full sync.
    pub fn counts(&self) -> DeltaCounts {
        DeltaCounts {
            chains_added: self.chains.len(),
            sets_added: self.sets.len(),
            elements_added: self.sets.values().map(|s| s.elements.len()).sum(),
            ..DeltaCounts::default()
        }
    }

    /// Names of all chains and sets (for verification).
    pub fn names(&self) -> (BTreeSet<&str>, BTreeSet<&str>) {
        (
            self.chains.keys().map(|s| s.as_str()).collect(),
            self.sets.keys().map(|s| s.as_str()).collect(),
        )
    }
}

pub(crate) fn kind(s: &Set) -> &'static str {
    if s.decl.contains(" : ") { "map" } else { "set" }
}

pub(crate) fn decl_chain(out: &mut String, fam: &str, t: &str, name: &str, c: &Chain) {
    if c.decl.is_empty() {
        let _ = writeln!(out, "add chain {fam} {t} {name}");
    } else {
        let _ = writeln!(out, "add chain {fam} {t} {name} {{ {} }}", c.decl);
    }
}

pub(crate) fn str_pairs<'a>(
    it: impl Iterator<Item = (&'a String, &'a String)>,
) -> impl Iterator<Item = (&'a str, &'a str)> {
    it.map(|(k, v)| (k.as_str(), v.as_str()))
}

/// Writes the header of a full script: creating then deleting the table first makes
/// `delete` succeed whether or not it exists, and the whole script is one transaction,
/// so there is no gap.
pub(crate) fn full_header(out: &mut String, fam: &str, t: &str) {
    let _ = writeln!(out, "add table {fam} {t}");
    let _ = writeln!(out, "delete table {fam} {t}");
    let _ = writeln!(
        out,
        "add table {fam} {t} {{ comment \"rules for kproxy\"; }}"
    );
}

/// Writes elements in batches so no single line grows without bound.
pub(crate) fn elements<'a>(
    out: &mut String,
    verb: &str,
    fam: &str,
    t: &str,
    name: &str,
    it: impl Iterator<Item = (&'a str, &'a str)>,
    with_value: bool,
) {
    let mut n = 0;
    for (k, v) in it {
        if n % 1000 == 0 {
            if n > 0 {
                out.push_str(" }\n");
            }
            let _ = write!(out, "{verb} element {fam} {t} {name} {{ ");
        } else {
            out.push_str(", ");
        }
        out.push_str(k);
        if with_value && !v.is_empty() {
            out.push_str(" : ");
            out.push_str(v);
        }
        n += 1;
    }
    if n > 0 {
        out.push_str(" }\n");
    }
}
