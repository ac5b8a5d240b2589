//! The desired state of one family's table for a `NodePlan`, by pure code: the base
//! objects ([`build_base`]) and one fragment per Service ([`build_service`]), from
//! which the in-memory record of what is programmed (`crate::record`) assembles the
//! whole table and moves by the changed Services only. What changed and how it reaches the kernel is `crate::model`'s business
//! (`diff`, `Transaction`).
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
//!   every set of the table, both of which made per-Service maps quadratic. A group
//!   of more rows than [`Shards::ROWS`] is split into a power of two of maps
//!   (`dnat-c-N-sK`, `disp-c-N-sK` for K ≥ 1; the first keeps the group's name), each
//!   port's frontends in the one its name's hash picks: reading a set back costs the
//!   kernel the square of its size ([`Shards`]);
//! - a frontend whose rules are *regular* (one rule for every source, or "local pods
//!   as they are, everyone else masqueraded", both to one endpoint set) maps straight
//!   to `goto disp-…` from the verdict map: no chain or rule of its own. Its masquerade
//!   is an element of `masq-ips` / `masq-ips-nonlocal` / `masq-nodeports`, which one
//!   rule each in `services` turns into the masquerade mark before the dispatch;
//! - a frontend whose rules are the eTP=Local shape (local pods as they are and this
//!   node masqueraded to the Cluster set, everyone else to the Local set, a side `drop`
//!   while its set is empty) maps to `goto etp-local` (`etp-local-np` for NodePorts):
//!   one shared chain per family and kind that tells the sources apart and looks the
//!   frontend up in two verdict maps, `etp-local[-np]-cluster` (→ `goto disp-c-N` |
//!   `drop`, bound by the one rule of `etp-local[-np]-short`) and
//!   `etp-local[-np]-local` (→ `goto disp-l-M` | `drop`), each bound by one rule
//!   ([`EtpLocal`]). So a change of its local endpoint count re-points elements, as a
//!   regular frontend's does. (iTP=Local shapes are regular already: one endpoint
//!   set, the Local one, for every source.);
//! - an irregular frontend (LB source ranges: a drop rule naming the Service's LB IPs
//!   and allowed sources; a local-pod rule the family's detector cannot express; any
//!   other shape) gets a chain `svc-…` (cluster IP), `ext-…` (external/LB IPs,
//!   source-range drop first) or `np-…` (NodePort) whose rules are `<source match>
//!   [mark] goto disp-…`, `drop` or `goto no-endpoints`, so its endpoint count changes
//!   its rules; ClientIP-affinity ports keep per-endpoint chains with dynamic sets and a
//!   `numgen random mod n-i 0` rule per endpoint (rare; the per-endpoint rules are what
//!   remembers the client);
//! - frontends with nothing to forward to map to `drop`, or to `goto no-endpoints`
//!   (`reject`; IPv6 TCP: `no-endpoints-tcp`, a TCP reset);
//! - hairpin masquerade is one set `hairpin` of `ip . ip` pairs of local endpoints, matched in postrouting
//!   (source == DNATed destination), instead of a rule in every endpoint chain;
//! - REJECT/DROP verdicts run in the same nat chains (kernel ≥ 5.9 allows `reject`
//!   in prerouting); nat chains only see the first packet of a connection, so every
//!   verdict applies to new connections only, as upstream's do.
//!
//! So a one-endpoint change is a few element deletes and adds (a frontend moving to
//! another N: its old rows out, new rows in, its verdict-map element re-pointed), and
//! a structural change only when the group of N does not exist (the record keeps idle
//! groups a while, so a rollout's N → N−1 → N creates each once).

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use kproxy_core::NodePlan;
use kproxy_core::model::{EndpointAddr, IpFamily};
use kproxy_core::plan::{
    EndpointSet, LocalPods, NodePortAddresses, ServicePortPlan, SourceClass, TrafficRule, Verdict,
};
use sha2::{Digest, Sha256};

use crate::config::DataplaneConfig;
use crate::counters::{CounterKind, UNALLOCATED_CLUSTER_IPS, counter_name};

use crate::model::{Atom, Family, Field, Hook, HookPoint, SetData, SetDecl, Tuple, Value};
pub use crate::model::{Chain, Set, Table};
use crate::rule::{Dir, Expr, Lit, Rhs, Rule, Sel};

/// Priority of kproxy's `nat-prerouting` and `nat-output` chains: `dstnat - 1`, one step
/// before upstream kube-proxy's nat chains (`dstnat`, also iptables' nat table). The
/// kernel runs every nat base chain of a hook inside one nat hook, in priority order,
/// and stops at the first that binds a NAT mapping or drops: so while kube-proxy's rules
/// are still on a node (a takeover), kproxy's DNAT, reject or drop decides every
/// connection to a frontend kproxy knows, and kube-proxy's nat rules never see it.
/// The contract and its reasons: crates/nft/README.md, docs/migrate.md.
pub const DSTNAT_PRIORITY: i32 = -101;
/// Priority of kproxy's `nat-postrouting` chain: `srcnat - 1`, so kproxy's masquerade
/// binds before kube-proxy's (`srcnat`) for the same reason.
pub const SRCNAT_PRIORITY: i32 = 99;

/// kproxy's base chains: (name, hook, priority, the chain its one rule jumps to). The
/// neighbour contract (crates/nft/README.md) promises these hooks and priorities.
pub const BASE_CHAINS: [(&str, HookPoint, i32, &str); 3] = [
    (
        "nat-prerouting",
        HookPoint::Prerouting,
        DSTNAT_PRIORITY,
        "services",
    ),
    ("nat-output", HookPoint::Output, DSTNAT_PRIORITY, "services"),
    (
        "nat-postrouting",
        HookPoint::Postrouting,
        SRCNAT_PRIORITY,
        "masquerading",
    ),
];

/// The chain of new connections dropped because endpoints exist but none this traffic
/// may use is here (Local policy), when the traffic counters are on: it counts them per
/// Service port (`count-no-local[-np]`), then drops. Without counters such frontends
/// map to `drop` directly.
pub const NO_LOCAL: &str = "no-local";

/// The chain, jumped to from `masquerading` for DNATed connections when the traffic
/// counters are on, that counts a new connection per Service port and endpoint
/// (`count-endpoints[-np]`) and per fallback (`count-fallback[-np]`).
pub const COUNT_ENDPOINTS: &str = "count-endpoints";

/// Counts of what a delta changes, for the sync report and metrics.
pub type DeltaCounts = crate::model::Counts;

/// Family-specific vocabulary.
struct Fam {
    /// `ip` / `ip6`: the table's family, and the payload protocol of its addresses.
    p: Family,
    addr: Field,
    loopback: Lit,
    family: IpFamily,
}

impl Fam {
    fn of(family: IpFamily) -> Fam {
        match family {
            IpFamily::IPv4 => Fam {
                p: Family::Ip,
                addr: Field::Ipv4Addr,
                loopback: Lit::Atom(Atom::Prefix(IpAddr::V4([127, 0, 0, 0].into()), 8)),
                family,
            },
            IpFamily::IPv6 => Fam {
                p: Family::Ip6,
                addr: Field::Ipv6Addr,
                loopback: Lit::Atom(Atom::Addr(IpAddr::V6(std::net::Ipv6Addr::LOCALHOST))),
                family,
            },
        }
    }

    fn saddr(&self) -> Sel {
        Sel::Addr(self.p, Dir::Src)
    }

    fn daddr(&self) -> Sel {
        Sel::Addr(self.p, Dir::Dst)
    }

    /// `daddr . meta l4proto . th dport`: an address frontend's key.
    fn frontend_key(&self) -> Vec<Sel> {
        vec![self.daddr(), Sel::L4proto, Sel::Dport]
    }
}

/// `SEL… @set`.
fn in_set(sel: Vec<Sel>, set: &str) -> Expr {
    Expr::Match {
        sel,
        neg: false,
        rhs: Rhs::Set(set.into()),
    }
}

/// `SEL LIT` (`!=` when `neg`).
fn is(sel: Sel, neg: bool, lit: Lit) -> Expr {
    Expr::Match {
        sel: vec![sel],
        neg,
        rhs: Rhs::Lit(lit),
    }
}

/// `SEL { LITS }` (`!=` when `neg`).
fn in_anon(sel: Sel, neg: bool, lits: Vec<Lit>) -> Expr {
    Expr::Match {
        sel: vec![sel],
        neg,
        rhs: Rhs::AnonSet(lits),
    }
}

fn goto(chain: &str) -> Expr {
    Expr::Verdict(crate::model::Verdict::Goto(chain.into()))
}

/// A rule of `prefix`'s expressions followed by `more`.
fn rule(prefix: &[Expr], more: impl IntoIterator<Item = Expr>) -> Rule {
    let mut exprs = prefix.to_vec();
    exprs.extend(more);
    Rule::new(exprs)
}

/// A network as a literal: `ADDR/LEN` as ipnet prints it.
fn net_lit(n: &ipnet::IpNet) -> Lit {
    Lit::Atom(Atom::Prefix(n.addr(), n.prefix_len()))
}

/// What one Service contributes to one family's table: its own chains and sets (a
/// `Ruleset` holding only those; `None` for the many Services that need none), its
/// frontends
/// (every element a frontend key brings; a frontend claimed by several Services takes
/// all of them from the first in plan order, which is what `trace` predicts), and the
/// dispatch groups it uses (sorted; created while any Service uses them, and kept a
/// while idle after: `crate::record::IDLE_DISPATCH_GROUPS`).
///
/// Its elements of the shared sets (present while any Service has them) are not part
/// of it: [`shared`] derives them from the Service's plan, which the record keeps
/// anyway, rather than holding ≈ 100k addresses twice.
///
/// Fragments are kept for every Service between syncs, so they are built once and then
/// held in boxed slices, without spare capacity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Fragment {
    pub own: Option<Box<Own>>,
    pub frontends: Box<[Arc<Frontend>]>,
    pub dispatch: Box<[Dispatch]>,
}

/// A fragment while it is built.
struct Draft {
    own: Table,
    frontends: Vec<Arc<Frontend>>,
    dispatch: BTreeSet<Dispatch>,
}

/// A Service's own chains and sets, each sorted by name: boxed slices rather than a
/// `Ruleset`'s maps, as a map node costs several hundred bytes for the one or two
/// chains most such Services (those with LB source ranges) have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Own {
    pub sets: Box<[(String, Set)]>,
    pub chains: Box<[(String, Chain)]>,
}

impl Own {
    /// As a table of `family`'s `table` (to diff a changed Service's own objects).
    pub fn to_table(&self, family: Family, table: &str) -> Table {
        Table {
            sets: self.sets.iter().cloned().collect(),
            chains: self.chains.iter().cloned().collect(),
            ..Table::new(family, table)
        }
    }
}

impl Draft {
    fn finish(self) -> Fragment {
        let own = !(self.own.sets.is_empty() && self.own.chains.is_empty());
        Fragment {
            // The maps iterate in name order, so the slices come sorted.
            own: own.then(|| {
                Box::new(Own {
                    sets: self.own.sets.into_iter().collect(),
                    chains: self.own.chains.into_iter().collect(),
                })
            }),
            frontends: self.frontends.into_boxed_slice(),
            dispatch: self.dispatch.into_iter().collect(),
        }
    }
}

/// The elements a Service brings to the shared sets of `family`, in fragment order:
/// per port of the family, the hairpin pair of each local reachable endpoint, then its
/// cluster IP (also for affinity ports). A pure function of the plan, so the record
/// derives them instead of storing them.
pub fn shared(
    svc: &kproxy_core::plan::ServicePlan,
    family: IpFamily,
) -> impl Iterator<Item = Shared> + '_ {
    svc.ports
        .iter()
        .filter(move |sp| sp.family == family)
        .flat_map(|sp| {
            let hairpins = sp.hairpin_endpoints().map(|ep| Shared::Hairpin(ep.ip));
            hairpins.chain(std::iter::once(Shared::ClusterIp(sp.cluster_ip)))
        })
}

/// The traffic counters a Service holds in `family`'s table (none unless `on`): per
/// port, its new-connection, rejected, no-local and fallback counters, its source-range counter when it
/// has the rule, and one per endpoint the port knows, whatever its state (so a rollout's
/// endpoint keeps its count while it goes from ready to terminating and back to the
/// fallback). A pure function of the plan, like [`shared`]: the record derives them.
pub fn counters(
    svc: &kproxy_core::plan::ServicePlan,
    family: IpFamily,
    on: bool,
) -> impl Iterator<Item = String> + '_ {
    svc.ports
        .iter()
        .filter(move |sp| on && sp.family == family)
        .flat_map(|sp| {
            let id = port_id(port_hash(sp), sp);
            let mut kinds = vec![
                CounterKind::New,
                CounterKind::Rejected,
                CounterKind::NoLocal,
                CounterKind::Fallback,
            ];
            if sp.firewall.is_some() && !sp.load_balancer_ips.is_empty() {
                kinds.push(CounterKind::SourceRange);
            }
            let mut eps: Vec<EndpointAddr> = sp.endpoints.iter().map(|e| e.addr).collect();
            eps.extend(sp.all_reachable_endpoints.iter().copied());
            eps.sort();
            eps.dedup();
            kinds.extend(eps.into_iter().map(CounterKind::Endpoint));
            kinds
                .into_iter()
                .map(move |k| counter_name(&id, &k))
                .collect::<Vec<_>>()
        })
}

/// Whether `svc` has a port of `family`: without one its fragment and its shared
/// elements there are empty.
pub fn has_family(svc: &kproxy_core::plan::ServicePlan, family: IpFamily) -> bool {
    svc.ports.iter().any(|sp| sp.family == family)
}

/// An element of a set that several Services may hold at once: present while any
/// does. Both shared sets are plain sets (no value to choose between owners), and both
/// keys are one address, so the element is kept as that address rather than as text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Shared {
    /// `hairpin`: an endpoint's `ip . ip` pair (source == DNATed destination).
    Hairpin(IpAddr),
    /// `cluster-ips`: a live cluster IP.
    ClusterIp(IpAddr),
}

impl Shared {
    /// The element, typed.
    pub fn tuple(&self) -> Tuple {
        match self {
            Shared::Hairpin(ip) => Tuple::new(&[Atom::Addr(*ip), Atom::Addr(*ip)]),
            Shared::ClusterIp(ip) => Tuple::new(&[Atom::Addr(*ip)]),
        }
    }

    pub fn set(&self) -> &'static str {
        match self {
            Shared::Hairpin(_) => "hairpin",
            Shared::ClusterIp(_) => "cluster-ips",
        }
    }
}

/// A set or map that holds frontend elements, named without a `String` per element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetRef {
    ServiceIps,
    ServiceNodeports,
    MasqIps,
    MasqIpsNonlocal,
    MasqNodeports,
    /// A map of the shared eTP=Local dispatch ([`EtpLocal`]): `nodeport` for the
    /// NodePort kind's, `local` for the Local endpoint set's (else the Cluster set's).
    EtpLocal {
        nodeport: bool,
        local: bool,
    },
    /// A counter map of frontends ([`CountMap`]); `shard` > 0 only for
    /// `count-endpoints`, split as the dispatch maps are ([`Shards::count_endpoints`]).
    Count {
        map: CountMap,
        nodeport: bool,
        shard: u32,
    },
    /// A dispatch group's map.
    Map(Dispatch),
}

/// The counter maps (`SetData::Counter`) keyed by frontends (the traffic counters,
/// [`crate::counters`]): `count-rejected` and `count-no-local` (frontend → its Service
/// port's counter, looked up where a new connection is rejected or dropped),
/// `count-endpoints` and `count-fallback` (frontend . endpoint address → the endpoint's
/// counter, or the port's fallback counter for an endpoint of a fallback set, looked
/// up after DNAT, in postrouting, by `ct original` destination). Each has a NodePort
/// twin (`-np`) keyed `l4proto . port` instead of `addr . l4proto . port`. A frontend's
/// elements there depend on its endpoints only (not on how they are dispatched), so a
/// dispatch change never touches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CountMap {
    Rejected,
    NoLocal,
    /// New connections DNATed to the frontend's Service port (any endpoint), looked up
    /// after DNAT as the endpoints' are.
    New,
    Endpoints,
    Fallback,
}

impl CountMap {
    pub const ALL: [CountMap; 5] = [
        CountMap::Rejected,
        CountMap::NoLocal,
        CountMap::New,
        CountMap::Endpoints,
        CountMap::Fallback,
    ];

    pub fn name(self, nodeport: bool) -> &'static str {
        match (self, nodeport) {
            (CountMap::Rejected, false) => "count-rejected",
            (CountMap::Rejected, true) => "count-rejected-np",
            (CountMap::NoLocal, false) => "count-no-local",
            (CountMap::NoLocal, true) => "count-no-local-np",
            (CountMap::New, false) => "count-new",
            (CountMap::New, true) => "count-new-np",
            (CountMap::Endpoints, false) => "count-endpoints",
            (CountMap::Endpoints, true) => "count-endpoints-np",
            (CountMap::Fallback, false) => "count-fallback",
            (CountMap::Fallback, true) => "count-fallback-np",
        }
    }

    /// The name of its map `shard` (0: [`CountMap::name`]; `NAME-sK` for K > 0).
    pub fn shard_name(self, nodeport: bool, shard: u32) -> Cow<'static, str> {
        match shard {
            0 => Cow::Borrowed(self.name(nodeport)),
            k => Cow::Owned(format!("{}-s{k}", self.name(nodeport))),
        }
    }

    /// How many maps it is split into in a table of `shards`: `count-endpoints` holds a
    /// frontend's every endpoint (a row per endpoint, as the dispatch maps do), so it is
    /// split like them; the others hold one element per frontend, as `service-ips` does.
    pub fn shards(self, shards: &Shards) -> u32 {
        match self {
            CountMap::Endpoints => shards.count_endpoints(),
            _ => 1,
        }
    }

    /// Keyed by frontend and endpoint address (else by frontend).
    fn per_endpoint(self) -> bool {
        matches!(self, CountMap::Endpoints | CountMap::Fallback)
    }

    /// Looked up after DNAT (postrouting), by `ct original` destination.
    fn post_dnat(self) -> bool {
        matches!(
            self,
            CountMap::New | CountMap::Endpoints | CountMap::Fallback
        )
    }

    /// The map's key: the frontend's (pre-DNAT `daddr . l4proto . dport`, or after DNAT
    /// its `ct original` twin) and, per endpoint, the DNATed address.
    fn key(self, f: &Fam, nodeport: bool) -> (Vec<Sel>, Vec<Field>) {
        let (mut sel, mut fields) = match (nodeport, self.post_dnat()) {
            (false, false) => (f.frontend_key(), vec![f.addr]),
            (true, false) => (vec![Sel::L4proto, Sel::Dport], vec![]),
            (false, true) => (
                vec![Sel::CtOrigDaddr(f.p), Sel::L4proto, Sel::CtOrigDport],
                vec![f.addr],
            ),
            (true, true) => (vec![Sel::L4proto, Sel::CtOrigDport], vec![]),
        };
        fields.extend([Field::InetProto, Field::InetService]);
        if self.per_endpoint() {
            sel.push(f.daddr());
            fields.push(f.addr);
        }
        (sel, fields)
    }
}

impl SetRef {
    pub fn name(&self) -> Cow<'static, str> {
        Cow::Borrowed(match self {
            SetRef::ServiceIps => "service-ips",
            SetRef::ServiceNodeports => "service-nodeports",
            SetRef::MasqIps => "masq-ips",
            SetRef::MasqIpsNonlocal => "masq-ips-nonlocal",
            SetRef::MasqNodeports => "masq-nodeports",
            SetRef::EtpLocal { nodeport, local } => EtpLocal {
                nodeport: *nodeport,
            }
            .map(*local),
            SetRef::Count {
                map,
                nodeport,
                shard,
            } => return map.shard_name(*nodeport, *shard),
            SetRef::Map(d) => return Cow::Owned(d.map()),
        })
    }
}

/// The elements one frontend brings, typed from the plan to the encoder: its
/// `service-ips`/`service-nodeports` verdict, its masquerade-set entry and its
/// dispatch-map rows. They are the largest part of the record, so each is held once:
/// every key is the frontend's own key (a dispatch row's followed by its index), kept
/// once, and a row is its endpoint's address and port (20 bytes; as text with offsets
/// it took ≈ 29). Nothing is parsed to type them; their text is written through the
/// model's one formatting of keys and values.
#[derive(Clone, PartialEq, Eq)]
pub struct Frontend {
    /// `ip KEY` (address frontends) or `np KEY` (NodePorts), KEY as nft writes it: the
    /// frontend's identity among a table's frontends.
    name: Box<str>,
    key: Tuple,
    vmap: SetRef,
    verdict: crate::model::Verdict,
    /// A frontend of the shared eTP=Local dispatch ([`EtpLocal`]): its elements of the
    /// Cluster set's map and of the Local set's, in that order.
    etp_local: Option<Box<[crate::model::Verdict; 2]>>,
    masq: Option<SetRef>,
    /// Each dispatch map and where its rows end in `rows`.
    maps: Box<[(SetRef, u32)]>,
    rows: Box<[(IpAddr, u16)]>,
    /// The Service port's id ([`port_id`]) when the traffic counters are on: the
    /// frontend's elements of the counter maps ([`CountMap`]) name its counters.
    counters: Option<Arc<str>>,
    /// Which `count-endpoints` map its endpoints' elements are in
    /// ([`Shards::count_endpoints`]).
    count_shard: u32,
    /// Bit `i`: `maps[i]`'s endpoint set is the serving+terminating fallback.
    fallback: u8,
}

/// The key of a frontend element: the frontend's key, and for a dispatch-map row its
/// index (` . i`), for a per-endpoint counter map's element the endpoint's address.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Key<'a> {
    pub base: &'a Tuple,
    pub row: Option<u32>,
    pub endpoint: Option<IpAddr>,
}

impl Key<'_> {
    /// Appends the key as nft writes it.
    pub fn write(&self, out: &mut String) {
        self.base.write(out);
        if let Some(i) = self.row {
            out.push_str(" . ");
            crate::model::write_u32(out, i);
        }
        if let Some(ip) = self.endpoint {
            out.push_str(" . ");
            Atom::Addr(ip).write(out);
        }
    }

    /// The key as a typed tuple.
    pub fn tuple(&self) -> Tuple {
        let last = match (self.row, self.endpoint) {
            (None, None) => return self.base.clone(),
            (Some(i), _) => Atom::Index(i),
            (None, Some(ip)) => Atom::Addr(ip),
        };
        let base = self.base.atoms();
        let mut atoms = [last; crate::model::MAX_FIELDS];
        atoms[..base.len()].copy_from_slice(&base);
        Tuple::new(&atoms[..=base.len()])
    }
}

impl std::fmt::Debug for Key<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        self.write(&mut s);
        write!(f, "{s:?}")
    }
}

/// What a frontend element maps to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrontendValue<'a> {
    /// A set element (the masquerade sets).
    None,
    Verdict(&'a crate::model::Verdict),
    /// A dispatch row's endpoint.
    Endpoint(IpAddr, u16),
    /// A counter map's element: the counter of `kind` of the Service port `id`.
    Counter(&'a str, crate::counters::CounterKind),
}

impl FrontendValue<'_> {
    /// The typed value (`None` for a set element).
    pub fn typed(&self) -> Option<Value> {
        match *self {
            FrontendValue::None => None,
            FrontendValue::Verdict(v) => Some(Value::Verdict(v.clone())),
            FrontendValue::Endpoint(ip, port) => {
                Some(Value::Data(Tuple::new(&[Atom::Addr(ip), Atom::Port(port)])))
            }
            FrontendValue::Counter(id, kind) => Some(Value::Counter(
                crate::counters::counter_name(id, &kind).into_boxed_str(),
            )),
        }
    }
}

impl Frontend {
    /// A frontend keyed `key` (`nodeport`: a NodePort's `proto . port`, else an
    /// address's `addr . proto . port`) whose verdict-map element `vmap` says
    /// `verdict`, with the elements of the shared eTP=Local maps `etp_local`, a
    /// masquerade-set entry in `masq` and, per dispatch map, the endpoints of its rows
    /// in order.
    /// `counters`: the Service port's id when the traffic counters are on; a map
    /// flagged in `maps` is a fallback set's.
    #[allow(clippy::too_many_arguments)]
    fn new(
        nodeport: bool,
        key: Tuple,
        vmap: SetRef,
        verdict: crate::model::Verdict,
        etp_local: Option<[crate::model::Verdict; 2]>,
        masq: Option<SetRef>,
        maps: Vec<(SetRef, &[EndpointAddr], bool)>,
        (counters, count_shard): (Option<Arc<str>>, u32),
    ) -> Arc<Frontend> {
        let mut name = String::from(if nodeport { "np " } else { "ip " });
        key.write(&mut name);
        let total: usize = maps.iter().map(|(_, eps, _)| eps.len()).sum();
        let mut rows = Vec::with_capacity(total);
        let mut ends = Vec::with_capacity(maps.len());
        let mut fallback = 0u8;
        for (i, (map, eps, terminating)) in maps.into_iter().enumerate() {
            rows.extend(eps.iter().map(|ep| (ep.ip, ep.port)));
            ends.push((map, row_index(rows.len())));
            if terminating && i < 8 {
                fallback |= 1 << i;
            }
        }
        Arc::new(Frontend {
            name: name.into_boxed_str(),
            key,
            vmap,
            verdict,
            etp_local: etp_local.map(Box::new),
            masq,
            maps: ends.into_boxed_slice(),
            rows: rows.into_boxed_slice(),
            counters,
            count_shard,
            fallback,
        })
    }

    /// Its elements of the counter maps: per Service port verdict, and per endpoint
    /// address of its rows (the first row of an address counts: one element per key).
    fn count_elements(&self) -> Vec<(SetRef, Key<'_>, FrontendValue<'_>)> {
        use crate::counters::CounterKind;
        let Some(id) = self.counters.as_deref() else {
            return Vec::new();
        };
        let nodeport = self.vmap == SetRef::ServiceNodeports;
        let base = &self.key;
        let set = |map| SetRef::Count {
            map,
            nodeport,
            shard: 0,
        };
        let mut out = vec![
            (
                set(CountMap::Rejected),
                Key {
                    base,
                    row: None,
                    endpoint: None,
                },
                FrontendValue::Counter(id, CounterKind::Rejected),
            ),
            (
                set(CountMap::NoLocal),
                Key {
                    base,
                    row: None,
                    endpoint: None,
                },
                FrontendValue::Counter(id, CounterKind::NoLocal),
            ),
            (
                set(CountMap::New),
                Key {
                    base,
                    row: None,
                    endpoint: None,
                },
                FrontendValue::Counter(id, CounterKind::New),
            ),
        ];
        // (address, port, in a fallback set), sorted by address, the first of each.
        let mut eps: Vec<(IpAddr, u16, bool)> = Vec::with_capacity(self.rows.len());
        let mut start = 0usize;
        for (i, &(_, end)) in self.maps.iter().enumerate() {
            let fb = i < 8 && self.fallback & (1 << i) != 0;
            eps.extend(
                self.rows[start..end as usize]
                    .iter()
                    .map(|&(ip, port)| (ip, port, fb)),
            );
            start = end as usize;
        }
        eps.sort_by_key(|e| e.0);
        eps.dedup_by_key(|e| e.0);
        for (ip, port, fb) in eps {
            let key = Key {
                base,
                row: None,
                endpoint: Some(ip),
            };
            let ep = kproxy_core::model::EndpointAddr::new(ip, port);
            let shard = self.count_shard;
            out.push((
                SetRef::Count {
                    map: CountMap::Endpoints,
                    nodeport,
                    shard,
                },
                key,
                FrontendValue::Counter(id, CounterKind::Endpoint(ep)),
            ));
            if fb {
                out.push((
                    set(CountMap::Fallback),
                    key,
                    FrontendValue::Counter(id, CounterKind::Fallback),
                ));
            }
        }
        out
    }

    /// `ip KEY` (address frontends) or `np KEY` (NodePorts).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The frontend's key.
    pub fn key(&self) -> &Tuple {
        &self.key
    }

    /// `(set, key, value)` of each element: the verdict, the eTP=Local maps' (Cluster,
    /// Local), the masquerade entry, the rows.
    pub fn elements(&self) -> impl Iterator<Item = (SetRef, Key<'_>, FrontendValue<'_>)> {
        let base = &self.key;
        let key = move |row| Key {
            base,
            row,
            endpoint: None,
        };
        let verdict =
            std::iter::once((self.vmap, key(None), FrontendValue::Verdict(&self.verdict)));
        let nodeport = self.vmap == SetRef::ServiceNodeports;
        let etp_local = self.etp_local.iter().flat_map(move |vs| {
            vs.iter().zip([false, true]).map(move |(v, local)| {
                let set = SetRef::EtpLocal { nodeport, local };
                (set, key(None), FrontendValue::Verdict(v))
            })
        });
        let masq = self.masq.map(|m| (m, key(None), FrontendValue::None));
        let mut start = 0usize;
        let rows = self.maps.iter().flat_map(move |&(map, end)| {
            let run = &self.rows[start..end as usize];
            start = end as usize;
            run.iter()
                .zip(0u32..)
                .map(move |(&(ip, port), i)| (map, key(Some(i)), FrontendValue::Endpoint(ip, port)))
        });
        verdict
            .chain(etp_local)
            .chain(masq)
            .chain(rows)
            .chain(self.count_elements())
    }

    /// The frontend's elements of the sets that exist (`decl` says which; `None` leaves
    /// a set's elements out), typed.
    pub fn typed_elements<'d>(
        &self,
        decl: impl Fn(SetRef) -> Option<&'d SetDecl>,
    ) -> Vec<(SetRef, crate::model::Elem)> {
        let mut out = Vec::with_capacity(self.rows.len() + 4);
        let mut run: Option<(SetRef, bool)> = None;
        for (set, key, value) in self.elements() {
            let exists = match run {
                Some((s, e)) if s == set => e,
                _ => {
                    let e = decl(set).is_some();
                    run = Some((set, e));
                    e
                }
            };
            if exists {
                let e = crate::model::Elem {
                    key: key.tuple(),
                    value: value.typed(),
                };
                out.push((set, e));
            }
        }
        out
    }
}

impl std::fmt::Debug for Frontend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frontend")
            .field("name", &self.name())
            .field("elements", &self.elements().collect::<Vec<_>>())
            .finish()
    }
}

/// A row count as an offset into a frontend's rows.
fn row_index(n: usize) -> u32 {
    // One frontend's rows: 4 billion would take that many endpoints behind one
    // Service port, far past what the plan could hold.
    u32::try_from(n).expect("a frontend's rows fit in u32")
}

/// How many maps each dispatch group is split into, so that no map holds more than
/// about [`Shards::ROWS`] rows: a power of two per (endpoint set, N), 1 when absent. A
/// Service port's frontends go to the shard its port id's hash picks
/// ([`port_hash`]), so a shard is a pure function of the port and the count.
///
/// Why: reading a set back (a restart's adoption, a repair, a verification) costs the
/// kernel the square of the set's size. Its element dump sends one ≈ 32 KiB message
/// per round (the most a netlink dump round holds) and each round walks the set from
/// its start, skipping what earlier rounds sent (`nf_tables_dump_set`), so a map of n
/// rows costs ≈ n² / 1,400 element visits: at 100k Services × 10 endpoints the one map
/// `dnat-c-10` (1M rows) took 87–105 s to read, against a cold sync of 16–19 s
/// (BENCHMARKS.md, "One node, one million endpoints"). Maps of at most ≈ `ROWS` rows
/// make a read linear in the table's elements.
///
/// The counts are computed from the plan at each full sync ([`Shards::of`]) and kept by
/// the record while it moves by deltas (a group new since then has one map), so a
/// delta never moves a Service between shards; a restart computes them afresh, and its
/// adoption moves what a changed count moves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shards {
    groups: std::collections::BTreeMap<(bool, u32), u32>,
    /// How many maps `count-endpoints` (and `count-endpoints-np`) is split into (0 as
    /// 1): the traffic counters' per-endpoint elements are as many as the dispatch
    /// rows, and reading a map back costs the same square.
    endpoints: u32,
}

impl Shards {
    /// The rows a dispatch map is sized for: a read of one costs the kernel about
    /// `ROWS / 1,400` element visits per row (≈ 6 here), while each map also costs a
    /// chain and a rule.
    pub const ROWS: usize = 8192;

    /// The shard counts of `plan`'s dispatch groups in `family`: the rows each (endpoint
    /// set, N) would hold (an upper bound: both endpoint sets of a port, all its
    /// frontends), divided by [`Shards::ROWS`], to the next power of two.
    pub fn of(plan: &NodePlan, family: IpFamily) -> Shards {
        let mut rows: std::collections::BTreeMap<(bool, u32), usize> = Default::default();
        let mut counted = [0usize; 2];
        for svc in plan.services.values() {
            for sp in svc.ports.iter().filter(|sp| sp.family == family) {
                let addresses = 1 + sp.external_ips.len() + sp.load_balancer_ips.len();
                let frontends = addresses + usize::from(sp.node_port.is_some());
                // Its elements of count-endpoints and count-endpoints-np (at most).
                counted[0] += addresses * sp.endpoints.len();
                counted[1] += usize::from(sp.node_port.is_some()) * sp.endpoints.len();
                for set in [EndpointSet::Cluster, EndpointSet::Local] {
                    let n = sp.endpoints_for(set).len();
                    if n > 0 {
                        let group = (
                            set == EndpointSet::Local,
                            u32::try_from(n).unwrap_or(u32::MAX),
                        );
                        *rows.entry(group).or_default() += n * frontends;
                    }
                }
            }
        }
        let count = |rows: usize| {
            let count = rows.div_ceil(Shards::ROWS).next_power_of_two();
            u32::try_from(count).unwrap_or(1 << 31)
        };
        Shards {
            groups: rows
                .into_iter()
                .filter_map(|(group, rows)| {
                    let count = count(rows);
                    (count > 1).then_some((group, count))
                })
                .collect(),
            endpoints: count(counted[0].max(counted[1])),
        }
    }

    /// How many maps the group (endpoint set, `n`) has.
    pub fn count(&self, local: bool, n: u32) -> u32 {
        self.groups.get(&(local, n)).copied().unwrap_or(1)
    }

    /// How many maps `count-endpoints` (and its NodePort twin) is split into.
    pub fn count_endpoints(&self) -> u32 {
        self.endpoints.max(1)
    }
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
    /// `numgen random mod N`: nft's modulus is 32 bits.
    pub n: u32,
    /// Which of the group's maps ([`Shards`]): 0 is `dnat-c-N` as in a table whose group
    /// fits one map, `k` > 0 is `dnat-c-N-sK` (and `disp-c-N-sK`).
    pub shard: u32,
}

impl Dispatch {
    fn prefix(&self) -> &'static str {
        if self.nodeport { "np" } else { "" }
    }
    fn tag(&self) -> String {
        let set = if self.local { "l" } else { "c" };
        match self.shard {
            0 => format!("{set}-{}", self.n),
            k => format!("{set}-{}-s{k}", self.n),
        }
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
        let mut sel = if self.nodeport {
            vec![Sel::L4proto, Sel::Dport]
        } else {
            f.frontend_key()
        };
        sel.push(Sel::Numgen(self.n));
        (
            Set::new(SetDecl {
                by_expr: true,
                ..SetDecl::map(
                    vec![
                        f.addr,
                        Field::InetProto,
                        Field::InetService,
                        Field::Numgen(self.n),
                    ]
                    .into_iter()
                    .skip(if self.nodeport { 1 } else { 0 })
                    .collect(),
                    SetData::Fields(vec![f.addr, Field::InetService]),
                )
            }),
            Chain {
                hook: None,
                rules: vec![Rule::new(vec![Expr::DnatMap {
                    family: f.p,
                    sel,
                    map: self.map(),
                }])],
            },
        )
    }
}

/// The shared dispatch of the regular eTP=Local shape (docs/upstream-semantics.md §c.2):
/// local pods (as they are) and this node (masqueraded) go to the Cluster endpoint set,
/// everyone else to the Local set, each side `drop` while its set is empty. One per
/// family and kind (`nodeport`: NodePorts, keyed `l4proto . dport`; else external and
/// LB IPs, keyed `daddr . l4proto . dport`), in the base table: the chain
/// `etp-local[-np]` tells the sources apart, and looks the frontend up in two verdict
/// maps, `etp-local[-np]-cluster` (frontend → `goto disp-c-N` | `drop`) and
/// `etp-local[-np]-local` (frontend → `goto disp-l-M` | `drop`). The Cluster map is
/// bound by the one rule of the chain `etp-local[-np]-short` (both the local-pod and
/// the node rule go there), so each map has exactly one binding, as a dispatch map has.
/// A frontend of this shape is its `service-ips`/`service-nodeports` element (`goto
/// etp-local[-np]`) and one element in each map: a change of its local endpoint count
/// re-points elements and moves dispatch rows, with no chain or rule of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EtpLocal {
    pub nodeport: bool,
}

impl EtpLocal {
    /// Both kinds.
    pub const KINDS: [EtpLocal; 2] = [EtpLocal { nodeport: false }, EtpLocal { nodeport: true }];

    /// The chain a frontend's verdict-map element goes to.
    pub fn chain(self) -> &'static str {
        if self.nodeport {
            "etp-local-np"
        } else {
            "etp-local"
        }
    }

    /// The chain of local pods' and this node's traffic: its one rule binds the
    /// Cluster map.
    pub fn short_circuit(self) -> &'static str {
        if self.nodeport {
            "etp-local-np-short"
        } else {
            "etp-local-short"
        }
    }

    /// The verdict map of the Local endpoint set (`local`) or of the Cluster set.
    pub fn map(self, local: bool) -> &'static str {
        match (self.nodeport, local) {
            (false, false) => "etp-local-cluster",
            (false, true) => "etp-local-local",
            (true, false) => "etp-local-np-cluster",
            (true, true) => "etp-local-np-local",
        }
    }

    /// Declares both maps and both chains in `rs`. The local-pod rule is there when
    /// the family has a detector (a frontend takes this dispatch only when its rules
    /// have the local-pod rule exactly then: `PortCtx::etp_local`).
    fn declare(self, rs: &mut Table, f: &Fam, local_pods: &LocalPods, mark: u32) {
        let (key, fields) = if self.nodeport {
            (
                vec![Sel::L4proto, Sel::Dport],
                vec![Field::InetProto, Field::InetService],
            )
        } else {
            (
                f.frontend_key(),
                vec![f.addr, Field::InetProto, Field::InetService],
            )
        };
        for (local, comment) in [
            (
                false,
                "eTP=Local frontends: local pods and this node to the Cluster set",
            ),
            (true, "eTP=Local frontends: everyone else to the Local set"),
        ] {
            let decl = SetDecl::map(fields.clone(), SetData::Verdict).with_comment(comment);
            rs.sets.insert(self.map(local).into(), Set::new(decl));
        }
        let vmap = |local: bool| Expr::Vmap {
            sel: key.clone(),
            map: self.map(local).into(),
        };
        let short = goto(self.short_circuit());
        let mut rules: Vec<Rule> = source_match(SourceClass::LocalPod, f, local_pods)
            .map(|m| rule(&m, [short.clone()]))
            .into_iter()
            .collect();
        let this_node = source_match(SourceClass::ThisNode, f, local_pods).unwrap_or_default();
        rules.push(rule(&this_node, [Expr::MarkOr(mark), short]));
        rules.push(Rule::new(vec![vmap(true)]));
        let chain = |rules| Chain { hook: None, rules };
        rs.chains.insert(self.chain().into(), chain(rules));
        rs.chains.insert(
            self.short_circuit().into(),
            chain(vec![Rule::new(vec![vmap(false)])]),
        );
    }
}

impl Table {
    /// Adds a fragment's own chains and sets.
    pub fn add_own(&mut self, own: &Own) {
        self.chains
            .extend(own.chains.iter().map(|(k, v)| (k.clone(), v.clone())));
        self.sets
            .extend(own.sets.iter().map(|(k, v)| (k.clone(), v.clone())));
    }

    /// Declares a dispatch group's map and chain (no-op when present).
    pub fn add_dispatch(&mut self, d: &Dispatch) {
        if let std::collections::btree_map::Entry::Vacant(e) = self.sets.entry(d.map()) {
            let (set, chain) = d.objects(self.family.ip_family());
            e.insert(set);
            self.chains.insert(d.chain(), chain);
        }
    }
}

/// The Service's fragment for one family. Pure.
pub fn build_service(
    svc: &kproxy_core::plan::ServicePlan,
    plan: &NodePlan,
    cfg: &DataplaneConfig,
    family: IpFamily,
    shards: &Shards,
) -> Fragment {
    let f = Fam::of(family);
    let mut frag = Draft {
        own: Table::new(Family::of(family), &cfg.table),
        frontends: Vec::new(),
        dispatch: BTreeSet::new(),
    };
    let local_pods = &plan.family(family).local_pods;
    for sp in svc.ports.iter().filter(|sp| sp.family == family) {
        add_service_port(
            &mut frag,
            &f,
            sp,
            local_pods,
            cfg.mark(),
            cfg.counters,
            shards,
        );
    }
    frag.finish()
}

/// The table without any Service: base chains, the shared sets (empty of Service
/// elements) and the node-level sets. Pure and cheap (no per-Service work).
pub fn build_base(
    plan: &NodePlan,
    cfg: &DataplaneConfig,
    family: IpFamily,
    shards: &Shards,
) -> Table {
    let f = Fam::of(family);
    let mark = cfg.mark();
    let mut rs = Table::new(Family::of(family), &cfg.table);
    let fp = plan.family(family);

    // Sets and maps.
    let (a, proto, port) = (f.addr, Field::InetProto, Field::InetService);
    let set = |key: Vec<Field>, comment: &str| Set::new(SetDecl::set(key).with_comment(comment));
    let vmap = |key: Vec<Field>, comment: &str| {
        Set::new(SetDecl::map(key, SetData::Verdict).with_comment(comment))
    };
    rs.sets.insert(
        "service-ips".into(),
        vmap(vec![a, proto, port], "cluster IPs, external IPs and LB IPs"),
    );
    rs.sets.insert(
        "service-nodeports".into(),
        vmap(vec![proto, port], "NodePorts"),
    );
    rs.sets
        .insert("cluster-ips".into(), set(vec![a], "active cluster IPs"));
    rs.sets.insert(
        "nodeport-ips".into(),
        set(vec![a], "addresses that accept NodePorts"),
    );
    rs.sets.insert(
        "masq-ips".into(),
        set(vec![a, proto, port], "frontends that masquerade"),
    );
    rs.sets.insert(
        "masq-nodeports".into(),
        set(vec![proto, port], "NodePorts that masquerade"),
    );
    let nonlocal = nonlocal_match(&f, &fp.local_pods);
    if nonlocal.is_some() {
        rs.sets.insert(
            "masq-ips-nonlocal".into(),
            set(
                vec![a, proto, port],
                "frontends that masquerade unless from a local pod",
            ),
        );
    }
    rs.sets.insert(
        "hairpin".into(),
        set(vec![a, a], "endpoint IP . endpoint IP"),
    );

    if cfg.counters {
        for map in CountMap::ALL {
            for nodeport in [false, true] {
                for shard in 0..map.shards(shards) {
                    let (_, key) = map.key(&f, nodeport);
                    let decl = SetDecl::map(key, SetData::Counter)
                        .with_comment("traffic counters (crates/nft/src/counters.rs)");
                    let name = map.shard_name(nodeport, shard).into_owned();
                    rs.sets.insert(name, Set::new(decl));
                }
            }
        }
    }
    // `counter name SEL… map @m` of a counter map, then `more`.
    // The same in map `shard` of the counter map.
    let count_shard = |map: CountMap, nodeport: bool, shard: u32, more: Vec<Expr>| {
        let (sel, _) = map.key(&f, nodeport);
        let mut exprs = vec![Expr::CounterMap {
            sel,
            map: map.shard_name(nodeport, shard).into_owned(),
        }];
        exprs.extend(more);
        Rule::new(exprs)
    };
    let count =
        |map: CountMap, nodeport: bool, more: Vec<Expr>| count_shard(map, nodeport, 0, more);
    let base = |hook: Option<Hook>, rules: Vec<Rule>| Chain { hook, rules };
    for (name, hook, priority, to) in BASE_CHAINS {
        let chain = Chain {
            hook: Some(Hook::nat(hook, priority)),
            rules: vec![Rule::verdict(crate::model::Verdict::Jump(to.into()))],
        };
        rs.chains.insert(name.into(), chain);
    }
    let masquerade = Expr::Masquerade { fully_random: true };
    let mut masquerading = Vec::new();
    if cfg.counters {
        masquerading.push(Rule::new(vec![
            is(Sel::CtStatus, false, Lit::Dnat),
            Expr::Verdict(crate::model::Verdict::Jump(COUNT_ENDPOINTS.into())),
        ]));
        // The fallback and the port first (they do not end the chain), then the
        // endpoint: an address frontend's element ends it, so a NodePort's never
        // counts it twice. Per protocol: nft types `ct original proto-dst` (in a
        // concatenation) only after a `meta l4proto` match, so each rule has one.
        let ret = Expr::Verdict(crate::model::Verdict::Return);
        let mut rules = Vec::new();
        for (map, nodeport, end) in [
            (CountMap::Fallback, false, None),
            (CountMap::Fallback, true, None),
            (CountMap::New, false, None),
            (CountMap::New, true, None),
            (CountMap::Endpoints, false, Some(ret)),
            (CountMap::Endpoints, true, None),
        ] {
            // A split map is looked up map by map: a miss ends that rule only.
            for proto in [6, 17, 132] {
                for shard in 0..map.shards(shards) {
                    let more = end.clone().into_iter().collect();
                    let mut r = count_shard(map, nodeport, shard, more);
                    let l4 = is(Sel::L4proto, false, Lit::Atom(Atom::Proto(proto)));
                    r.exprs.insert(0, l4);
                    rules.push(r);
                }
            }
        }
        rs.chains.insert(COUNT_ENDPOINTS.into(), base(None, rules));
    }
    masquerading.extend([
        // Hairpin: a pod reaching itself through a Service (source == chosen endpoint).
        Rule::new(vec![
            is(Sel::CtStatus, false, Lit::Dnat),
            in_set(vec![f.saddr(), f.daddr()], "hairpin"),
            masquerade.clone(),
        ]),
        Rule::new(vec![
            is(Sel::MarkAnd(mark), false, Lit::Num(0)),
            Expr::Verdict(crate::model::Verdict::Return),
        ]),
        Rule::new(vec![Expr::MarkXor(mark)]),
        Rule::new(vec![masquerade]),
    ]);
    rs.chains
        .insert("masquerading".into(), base(None, masquerading));
    // Masquerade marks of the frontends whose plan is regular (see `classify`), then
    // the dispatch; irregular frontends set the mark in their own chain.
    let masq = Expr::MarkOr(mark);
    let key = f.frontend_key();
    let mut services = vec![Rule::new(vec![
        in_set(key.clone(), "masq-ips"),
        masq.clone(),
    ])];
    if let Some(m) = &nonlocal {
        services.push(Rule::new(vec![
            m.clone(),
            in_set(key.clone(), "masq-ips-nonlocal"),
            masq.clone(),
        ]));
    }
    services.push(Rule::new(vec![Expr::Vmap {
        sel: key,
        map: "service-ips".into(),
    }]));
    let fib_local = is(Sel::FibType(Dir::Dst), false, Lit::Local);
    let not_loopback = is(f.daddr(), true, f.loopback.clone());
    let np_match: Option<Vec<Expr>> = match &fp.node_port_addresses {
        NodePortAddresses::AllLocal => Some(vec![fib_local, not_loopback]),
        // Local addresses inside the CIDRs, decided per packet as `trace` decides it, so
        // a secondary address the Node object does not list still takes NodePorts.
        NodePortAddresses::Cidrs(cidrs) => {
            let c: Vec<Lit> = cidrs
                .iter()
                .filter(|n| family.contains(&n.addr()))
                .map(|n| net_lit(&n.trunc()))
                .collect();
            (!c.is_empty()).then(|| vec![fib_local, not_loopback, in_anon(f.daddr(), false, c)])
        }
        NodePortAddresses::Only(list) => {
            let ips: Vec<&IpAddr> = list.iter().filter(|ip| family.contains(ip)).collect();
            if ips.is_empty() {
                None
            } else {
                let s = rs.sets.get_mut("nodeport-ips").expect("declared above");
                for ip in ips {
                    s.elements.insert(Tuple::new(&[Atom::Addr(*ip)]), None);
                }
                Some(vec![in_set(vec![f.daddr()], "nodeport-ips")])
            }
        }
    };
    if let Some(m) = np_match {
        let np_key = vec![Sel::L4proto, Sel::Dport];
        services.push(rule(
            &m,
            [in_set(np_key.clone(), "masq-nodeports"), masq.clone()],
        ));
        services.push(rule(
            &m,
            [Expr::Vmap {
                sel: np_key,
                map: "service-nodeports".into(),
            }],
        ));
    }
    // A live cluster IP on a port/protocol no Service defines is rejected (v1.30+).
    // IPv6 TCP gets a reset: the ICMPv6 error of a `reject` in these nat hooks never
    // reaches the client (as for `no-endpoints-tcp`).
    let live_cluster_ip = in_set(vec![f.daddr()], "cluster-ips");
    if family == IpFamily::IPv6 {
        services.push(Rule::new(vec![
            live_cluster_ip.clone(),
            is(Sel::L4proto, false, Lit::Atom(Atom::Proto(6))),
            Expr::Reject { tcp_reset: true },
        ]));
    }
    services.push(Rule::new(vec![
        live_cluster_ip,
        Expr::Reject { tcp_reset: false },
    ]));
    // An unallocated address inside a service CIDR is dropped (upstream
    // `cluster-ips-check`, needs the service CIDRs).
    if !fp.service_cidrs.is_empty() {
        let c: Vec<Lit> = fp.service_cidrs.iter().map(net_lit).collect();
        let mut exprs = vec![in_anon(f.daddr(), false, c)];
        if cfg.counters {
            rs.counters.insert(UNALLOCATED_CLUSTER_IPS.into());
            exprs.push(Expr::CounterRef(UNALLOCATED_CLUSTER_IPS.into()));
        }
        exprs.push(Expr::Verdict(crate::model::Verdict::Drop));
        services.push(Rule::new(exprs));
    }
    rs.chains.insert("services".into(), base(None, services));
    // REJECT targets of frontends without endpoints (verdict maps cannot reject),
    // counted per Service port first when the counters are on (an address frontend's
    // element, else a NodePort's; a packet to neither is rejected uncounted).
    let counted = |map: CountMap, last: Expr| {
        let mut rules = Vec::new();
        if cfg.counters {
            for nodeport in [false, true] {
                let mut r = count(map, nodeport, vec![last.clone()]);
                if last == (Expr::Reject { tcp_reset: true }) {
                    // The reset's `meta l4proto tcp` first, where nft puts it.
                    let tcp = is(Sel::L4proto, false, Lit::Atom(Atom::Proto(6)));
                    r.exprs.insert(0, tcp);
                }
                rules.push(r);
            }
        }
        rules.push(Rule::new(vec![last]));
        rules
    };
    rs.chains.insert(
        "no-endpoints".into(),
        base(
            None,
            counted(CountMap::Rejected, Expr::Reject { tcp_reset: false }),
        ),
    );
    if family == IpFamily::IPv6 {
        rs.chains.insert(
            "no-endpoints-tcp".into(),
            base(
                None,
                counted(CountMap::Rejected, Expr::Reject { tcp_reset: true }),
            ),
        );
    }
    if cfg.counters {
        let drop = Expr::Verdict(crate::model::Verdict::Drop);
        rs.chains.insert(
            NO_LOCAL.into(),
            base(None, counted(CountMap::NoLocal, drop)),
        );
    }

    for kind in EtpLocal::KINDS {
        kind.declare(&mut rs, &f, &fp.local_pods, mark);
    }

    if let LocalPods::Cidrs(cidrs) = &fp.local_pods {
        let c: Vec<Atom> = cidrs
            .iter()
            .filter(|n| family.contains(&n.addr()))
            .map(|n| Atom::Prefix(n.trunc().addr(), n.prefix_len()))
            .collect();
        if c.len() > 1 {
            let mut s = set(vec![f.addr], "local pod CIDRs");
            s.decl.interval = true;
            s.decl.auto_merge = true;
            s.elements = c.into_iter().map(|k| (Tuple::new(&[k]), None)).collect();
            rs.sets.insert("local-pods".into(), s);
        }
    }
    rs
}

/// An address frontend's key: `addr . proto . port`.
fn address_key(ip: IpAddr, sp: &ServicePortPlan) -> Tuple {
    Tuple::new(&[
        Atom::Addr(ip),
        Atom::proto(sp.protocol),
        Atom::Port(sp.port),
    ])
}

/// A NodePort frontend's key: `proto . port`.
fn node_port_key(sp: &ServicePortPlan, node_port: u16) -> Tuple {
    Tuple::new(&[Atom::proto(sp.protocol), Atom::Port(node_port)])
}

fn add_service_port(
    frag: &mut Draft,
    f: &Fam,
    sp: &ServicePortPlan,
    local_pods: &LocalPods,
    mark: u32,
    counters: bool,
    shards: &Shards,
) {
    let hash = port_hash(sp);
    let id = port_id(hash, sp);
    // An affinity port's rules go to its own per-endpoint chains, never to a dispatch
    // group: no shards for it.
    let affinity = sp.session_affinity_timeout.is_some();
    let no_groups = Shards::default();
    let ctx = PortCtx {
        f,
        sp,
        local_pods,
        mark,
        counters: counters.then(|| Arc::from(id.as_str())),
        shards: if affinity { &no_groups } else { shards },
        hash: if affinity { 0 } else { hash },
    };
    // Its shared elements are derived by `shared`.
    if affinity {
        add_affinity_port(frag, &ctx, &id);
        return;
    }
    let addr_key = |ip: &IpAddr| address_key(*ip, sp);

    // Internal traffic: the cluster IP.
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
    let firewall = firewall_rule(f, sp, counters);
    let addrs: Vec<Tuple> = sp
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
            vec![node_port_key(sp, np)],
            true,
            format!("np-{id}"),
            None,
        );
    }
}

/// The LB source-range rule of a port's external chain, if it has one (counting its
/// drops in the port's `source-range-…` counter when `counters`).
fn firewall_rule(f: &Fam, sp: &ServicePortPlan, counters: bool) -> Option<Rule> {
    let fw = sp.firewall.as_ref()?;
    let lbs: Vec<Lit> = sp
        .load_balancer_ips
        .iter()
        .map(|ip| Lit::Atom(Atom::Addr(*ip)))
        .collect();
    if lbs.is_empty() {
        return None;
    }
    let allowed: Vec<Lit> = fw
        .allowed_sources
        .iter()
        .filter(|n| f.family.contains(&n.addr()))
        .map(|n| net_lit(&n.trunc()))
        .collect();
    let mut exprs = vec![
        in_anon(f.daddr(), false, lbs),
        is(Sel::Dport, false, Lit::Atom(Atom::Port(sp.port))),
    ];
    if !allowed.is_empty() {
        exprs.push(in_anon(f.saddr(), true, allowed));
    }
    if counters {
        let name = counter_name(&port_id(port_hash(sp), sp), &CounterKind::SourceRange);
        exprs.push(Expr::CounterRef(name));
    }
    exprs.push(Expr::Verdict(crate::model::Verdict::Drop));
    Some(Rule::new(exprs))
}

/// How a frontend whose rules need no chain of its own is dispatched.
enum Direct {
    Drop,
    Reject,
    Forward(EndpointSet, Masq),
    /// Through the shared eTP=Local dispatch ([`EtpLocal`]): whether local pods and
    /// the node go to the Cluster set (else `drop`), whether everyone else goes to the
    /// Local set (else `drop`).
    EtpLocal {
        cluster: bool,
        local: bool,
    },
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
    /// The port's id when the traffic counters are on.
    counters: Option<Arc<str>>,
    shards: &'a Shards,
    /// [`port_hash`] of the port: which shard of a group its frontends take.
    hash: u32,
}

impl PortCtx<'_> {
    /// The verdict of traffic dropped because no endpoint this traffic may use is here:
    /// through `no-local`, which counts it, when the counters are on.
    fn drop_verdict(&self) -> crate::model::Verdict {
        if self.counters.is_some() {
            crate::model::Verdict::Goto(NO_LOCAL.into())
        } else {
            crate::model::Verdict::Drop
        }
    }

    /// The rules that can match (a `LocalPod` rule without a detector never does).
    fn live<'r>(&self, rules: &'r [TrafficRule]) -> Vec<(Vec<Expr>, &'r TrafficRule)> {
        rules
            .iter()
            .filter_map(|r| source_match(r.from, self.f, self.local_pods).map(|m| (m, r)))
            .collect()
    }

    /// The regular shapes the planner produces for most frontends, which need no
    /// per-Service chain: one rule for every source, "local pods as they are,
    /// everyone else masqueraded" to one endpoint set, or the eTP=Local shape
    /// ([`PortCtx::etp_local`]). `None`: a chain of its own.
    fn classify(&self, rules: &[TrafficRule], nodeport: bool) -> Option<Direct> {
        if let Some(d) = self.etp_local(rules) {
            return Some(d);
        }
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

    /// The eTP=Local shape of the shared dispatch ([`EtpLocal`]): `[local pods →
    /// Cluster set as they are,] this node → Cluster set masqueraded, everyone else →
    /// Local set as they are`, a side whose set is empty `drop` (the planner's
    /// none-verdict while endpoints exist elsewhere). The local-pod rule must be there
    /// exactly when the family's shared chain has one (a detector of this family);
    /// anything else keeps a chain of its own.
    fn etp_local(&self, rules: &[TrafficRule]) -> Option<Direct> {
        let detector = source_match(SourceClass::LocalPod, self.f, self.local_pods).is_some();
        let (pod, node, any) = match rules {
            [p, n, a] if detector && p.from == SourceClass::LocalPod => (Some(p), n, a),
            [n, a] if !detector => (None, n, a),
            _ => return None,
        };
        if node.from != SourceClass::ThisNode || any.from != SourceClass::Any {
            return None;
        }
        // Whether a rule forwards to `set` with `masquerade` (`Some(false)`: drops).
        let forwards = |r: &TrafficRule, set: EndpointSet, masquerade: bool| match r.verdict {
            Verdict::Drop => Some(false),
            Verdict::Forward {
                endpoints,
                masquerade: m,
            } if endpoints == set && m == masquerade && !self.sp.endpoints_for(set).is_empty() => {
                Some(true)
            }
            _ => None,
        };
        let cluster = forwards(node, EndpointSet::Cluster, true)?;
        if let Some(p) = pod
            && forwards(p, EndpointSet::Cluster, false)? != cluster
        {
            return None;
        }
        let local = forwards(any, EndpointSet::Local, false)?;
        Some(Direct::EtpLocal { cluster, local })
    }

    /// Its frontends' counters: the port's id (when on) and their `count-endpoints`
    /// map, picked by the port's hash as a dispatch group's shard is.
    fn counted(&self) -> (Option<Arc<str>>, u32) {
        let shard = self.hash & (self.shards.count_endpoints() - 1);
        (self.counters.clone(), shard)
    }

    fn dispatch(&self, set: EndpointSet, nodeport: bool) -> Dispatch {
        let n = self.sp.endpoints_for(set).len();
        let local = set == EndpointSet::Local;
        // Beyond nft's 32-bit modulus there is no map to write either.
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        Dispatch {
            nodeport,
            local,
            n,
            // A power of two: the hash's low bits.
            shard: self.hash & (self.shards.count(local, n) - 1),
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
        frag: &mut Draft,
        rules: &[TrafficRule],
        keys: Vec<Tuple>,
        nodeport: bool,
        chain: String,
        firewall: Option<Rule>,
    ) {
        let direct = if firewall.is_none() {
            self.classify(rules, nodeport)
        } else {
            None
        };
        let mut sets: Vec<EndpointSet> = Vec::new();
        let mut masq = Masq::Never;
        let mut etp_local = None;
        let value = match direct {
            Some(Direct::EtpLocal { cluster, local }) => {
                let mut to = |forward: bool, set: EndpointSet| {
                    if forward {
                        sets.push(set);
                        crate::model::Verdict::Goto(self.dispatch(set, nodeport).chain().into())
                    } else {
                        self.drop_verdict()
                    }
                };
                etp_local = Some([
                    to(cluster, EndpointSet::Cluster),
                    to(local, EndpointSet::Local),
                ]);
                crate::model::Verdict::Goto(EtpLocal { nodeport }.chain().into())
            }
            Some(Direct::Drop) => self.drop_verdict(),
            Some(Direct::Reject) => crate::model::Verdict::Goto(self.reject_target().into()),
            Some(Direct::Forward(set, m)) => {
                sets.push(set);
                masq = m;
                crate::model::Verdict::Goto(self.dispatch(set, nodeport).chain().into())
            }
            None => {
                let mut out: Vec<Rule> = firewall.into_iter().collect();
                let drop = Expr::Verdict(crate::model::Verdict::Drop);
                for (m, r) in self.live(rules) {
                    match r.verdict {
                        Verdict::Drop => out.push(rule(&m, [Expr::Verdict(self.drop_verdict())])),
                        Verdict::Reject => out.push(rule(&m, [goto(self.reject_target())])),
                        Verdict::Forward {
                            endpoints,
                            masquerade,
                        } => {
                            if self.sp.endpoints_for(endpoints).is_empty() {
                                // Invariant of the planner (a Forward set is never
                                // empty); be safe anyway.
                                out.push(rule(&m, [drop.clone()]));
                                continue;
                            }
                            let mk = masquerade.then_some(Expr::MarkOr(self.mark));
                            let to = goto(&self.dispatch(endpoints, nodeport).chain());
                            out.push(rule(&m, mk.into_iter().chain([to])));
                            if !sets.contains(&endpoints) {
                                sets.push(endpoints);
                            }
                        }
                    }
                }
                frag.own.chains.insert(
                    chain.clone(),
                    Chain {
                        hook: None,
                        rules: out,
                    },
                );
                crate::model::Verdict::Goto(chain.as_str().into())
            }
        };
        for d in sets.iter().map(|s| self.dispatch(*s, nodeport)) {
            frag.dispatch.insert(d);
        }
        let (vmap, masq_set) = match (nodeport, masq) {
            (_, Masq::Never) => (
                if nodeport {
                    SetRef::ServiceNodeports
                } else {
                    SetRef::ServiceIps
                },
                None,
            ),
            (true, _) => (SetRef::ServiceNodeports, Some(SetRef::MasqNodeports)),
            (false, Masq::Always) => (SetRef::ServiceIps, Some(SetRef::MasqIps)),
            (false, Masq::NonLocal) => (SetRef::ServiceIps, Some(SetRef::MasqIpsNonlocal)),
        };
        for key in keys {
            // The same frontend twice in one Service: the first counts.
            if frag.frontends.iter().any(|fe| *fe.key() == key) {
                continue;
            }
            let maps = sets
                .iter()
                .map(|set| {
                    let map = SetRef::Map(self.dispatch(*set, nodeport));
                    let terminating = self.sp.uses_terminating(*set);
                    (map, self.sp.endpoints_for(*set), terminating)
                })
                .collect();
            let fe = Frontend::new(
                nodeport,
                key,
                vmap,
                value.clone(),
                etp_local.clone(),
                masq_set,
                maps,
                self.counted(),
            );
            frag.frontends.push(fe);
        }
    }
}

/// A ClientIP-affinity port: per-endpoint chains and dynamic sets as before the
/// dispatch maps (rare; the per-endpoint rules are what remembers the client).
fn add_affinity_port(frag: &mut Draft, ctx: &PortCtx<'_>, id: &str) {
    let (f, sp, mark) = (ctx.f, ctx.sp, ctx.mark);
    let Draft {
        own: rs, frontends, ..
    } = frag;
    let svc_chain = format!("svc-{id}");
    let ext_chain = format!("ext-{id}");
    let timeout = sp.session_affinity_timeout.unwrap_or_default();
    for ep in &sp.all_reachable_endpoints {
        let (set, chain) = affinity_names(id, ep);
        rs.sets.insert(
            set.clone(),
            Set::new(SetDecl {
                dynamic: true,
                timeout_secs: Some(timeout),
                ..SetDecl::set(vec![f.addr])
            }),
        );
        rs.chains.insert(
            chain,
            Chain {
                hook: None,
                rules: vec![Rule::new(dnat_to(f, sp, &set, ep))],
            },
        );
    }

    let rules = |list: &[TrafficRule]| -> Vec<Rule> {
        let mut out = Vec::new();
        for (m, r) in ctx.live(list) {
            match r.verdict {
                Verdict::Drop => out.push(rule(&m, [Expr::Verdict(ctx.drop_verdict())])),
                Verdict::Reject => out.push(rule(&m, [goto(ctx.reject_target())])),
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
    let mut push = |nodeport: bool, vmap: SetRef, key: Tuple, chain: &str| {
        if !frontends.iter().any(|f| *f.key() == key) {
            let verdict = crate::model::Verdict::Goto(chain.into());
            frontends.push(Frontend::new(
                nodeport,
                key,
                vmap,
                verdict,
                None,
                None,
                Vec::new(),
                ctx.counted(),
            ));
        }
    };

    rs.chains.insert(
        svc_chain.clone(),
        Chain {
            hook: None,
            rules: rules(&sp.internal),
        },
    );
    push(
        false,
        SetRef::ServiceIps,
        address_key(sp.cluster_ip, sp),
        &svc_chain,
    );

    if !sp.external.is_empty() {
        let mut ext: Vec<Rule> = firewall_rule(f, sp, ctx.counters.is_some())
            .into_iter()
            .collect();
        ext.extend(rules(&sp.external));
        rs.chains.insert(
            ext_chain.clone(),
            Chain {
                hook: None,
                rules: ext,
            },
        );
        for ip in sp.external_ips.iter().chain(&sp.load_balancer_ips) {
            push(false, SetRef::ServiceIps, address_key(*ip, sp), &ext_chain);
        }
        if let Some(np) = sp.node_port {
            push(
                true,
                SetRef::ServiceNodeports,
                node_port_key(sp, np),
                &ext_chain,
            );
        }
    }
}

/// The Forward rules of an affinity port: known clients go back to the endpoint they
/// used (in endpoint order), new ones pick uniformly.
#[allow(clippy::too_many_arguments)]
fn forward_rules(
    out: &mut Vec<Rule>,
    m: &[Expr],
    f: &Fam,
    sp: &ServicePortPlan,
    id: &str,
    eps: &[EndpointAddr],
    masquerade: bool,
    mark: u32,
) {
    if eps.is_empty() {
        // Invariant of the planner (a Forward set is never empty); be safe anyway.
        out.push(rule(m, [Expr::Verdict(crate::model::Verdict::Drop)]));
        return;
    }
    let masq = masquerade.then_some(Expr::MarkOr(mark));
    for ep in eps {
        let (set, _) = affinity_names(id, ep);
        let known = in_set(vec![f.saddr()], &set);
        let then = masq.iter().cloned().chain(dnat_to(f, sp, &set, ep));
        out.push(rule(m, std::iter::once(known).chain(then)));
    }
    for (i, ep) in eps.iter().enumerate() {
        let pick = pick(i, eps.len());
        let to = goto(&affinity_names(id, ep).1);
        out.push(rule(m, masq.iter().cloned().chain(pick).chain([to])));
    }
}

/// `update @set { saddr } meta l4proto P dnat to EP`: an affinity endpoint's DNAT,
/// remembering the client.
fn dnat_to(f: &Fam, sp: &ServicePortPlan, set: &str, ep: &EndpointAddr) -> Vec<Expr> {
    vec![
        Expr::Update {
            set: set.into(),
            key: f.saddr(),
        },
        is(Sel::L4proto, false, Lit::Atom(Atom::proto(sp.protocol))),
        Expr::DnatTo(*ep),
    ]
}

/// The uniform random choice of an affinity port without a set: rule `i` of `n` takes
/// the packet with probability 1/(n-i) (each `numgen` evaluation draws afresh), so every
/// endpoint gets 1/n. (Affinity ports are rare; all others use the dispatch maps.)
fn pick(i: usize, n: usize) -> Option<Expr> {
    (i + 1 != n).then(|| {
        let n = u32::try_from(n - i).unwrap_or(u32::MAX);
        is(Sel::Numgen(n), false, Lit::Num(0))
    })
}

/// The matches of a source class (none for any source); `None` when the class can
/// never match (LocalPod without a detector), so the rule is left out.
fn source_match(class: SourceClass, f: &Fam, local_pods: &LocalPods) -> Option<Vec<Expr>> {
    match class {
        SourceClass::Any => Some(Vec::new()),
        SourceClass::ThisNode => Some(vec![is(Sel::FibType(Dir::Src), false, Lit::Local)]),
        SourceClass::LocalPod => local_pod_match(f, local_pods, false).map(|m| vec![m]),
    }
}

/// The match of a local pod's traffic (`neg`: of everything else); `None` when there
/// is no detector for this family.
fn local_pod_match(f: &Fam, local_pods: &LocalPods, neg: bool) -> Option<Expr> {
    match local_pods {
        LocalPods::None => None,
        LocalPods::Cidrs(cidrs) => {
            let c: Vec<Lit> = cidrs
                .iter()
                .filter(|n| f.family.contains(&n.addr()))
                .map(|n| net_lit(&n.trunc()))
                .collect();
            match c.as_slice() {
                [] => None,
                [one] => Some(is(f.saddr(), neg, one.clone())),
                // A named set, filled in `build`: no anonymous set per rule.
                _ => Some(Expr::Match {
                    sel: vec![f.saddr()],
                    neg,
                    rhs: Rhs::Set("local-pods".into()),
                }),
            }
        }
        // Interface names are validated by `crate::config::validate_interface`; an invalid
        // one was rejected before rendering (see `validate_plan`).
        LocalPods::InterfacePrefix(p) => Some(is(Sel::Iifname, neg, Lit::Iface(format!("{p}*")))),
        LocalPods::Bridge(b) => Some(is(Sel::Iifname, neg, Lit::Iface(b.clone()))),
    }
}

/// The negation of the `LocalPod` match; `None` when there is no `LocalPod` match for
/// this family.
fn nonlocal_match(f: &Fam, local_pods: &LocalPods) -> Option<Expr> {
    local_pod_match(f, local_pods, true)
}

/// The first 32 bits of the SHA-256 of the port's name (`namespace/name:port`): the
/// head of its [`port_id`], and the shard of a dispatch group it takes ([`Shards`]).
fn port_hash(sp: &ServicePortPlan) -> u32 {
    let h = Sha256::digest(sp.service_port.to_string().as_bytes());
    u32::from_be_bytes([h[0], h[1], h[2], h[3]])
}

/// A short stable identifier of a service port: its [`port_hash`] `hash` (uniqueness)
/// and a readable name. Every part is a validated Kubernetes name; `sanitize` keeps it
/// an nft identifier even if that ever changes.
fn port_id(hash: u32, sp: &ServicePortPlan) -> String {
    let spn = &sp.service_port;
    let hash = format!("{hash:08x}");
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
