//! The fate of one new connection under a kproxy table, computed from the table's
//! chains, rules, sets and maps: an interpreter of the rules kproxy writes
//! (`crate::ruleset`) over the typed [`Table`]. `kproxy trace --kernel` runs it on the
//! tables read back from the kernel (`crate::readback::KernelTable`) and sets the
//! result beside `kproxy_core::trace`'s answer from the plan; run on the desired tables
//! it gives `trace`'s answer (crates/nft/tests/kernel_trace.rs holds both). Pure.
//!
//! What it models: the `nat-prerouting` (or, for a packet from this node,
//! `nat-output`) chain and what it jumps and goes to, then `nat-postrouting` for the
//! masquerade; verdict maps, sets (interval sets by prefix), dispatch maps with
//! `numgen` (every index is one branch, its share of new connections kept exactly),
//! the masquerade mark, `fib … type local` against the addresses it is given, and
//! `iifname` patterns. Dynamic sets (ClientIP affinity) are taken as empty: the fate
//! of a client without affinity yet, as `trace` answers. A rule it does not know — in
//! the kernel, one kproxy did not write or not the plan's (`crate::adopt::adopt` marks
//! such chains) — ends the branch as [`Fate::Unknown`], never as a guess.
//!
//! [`divergence`] names what of the table a packet touched differs from the plan's:
//! [`crate::model::diff`] of the two tables, restricted to the chains the packet
//! entered and the set and map elements it looked up. The rules are the typed values
//! of [`crate::rule`]: those `crate::ruleset` builds, or those decoded from the kernel.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use kproxy_core::model::EndpointAddr;
use kproxy_core::trace::{Packet, Trace, TraceVerdict};
use serde::Serialize;

use crate::error::NftError;

use crate::model::{self, Atom, Op, Table, Tuple, Value};
use crate::rule::{Dir, Expr, Lit, Rhs, Rule, Sel};

/// A selector's value for one packet.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Val {
    Atom(Atom),
    Str(String),
    /// `fib … type local`, `ct status dnat`: whether it holds.
    Holds(bool),
}

/// Whether literal `l` matches value `v` (a prefix contains an address, an `iifname`
/// pattern ending in `*` matches by prefix).
fn matches(l: &Lit, v: &Val) -> bool {
    match (l, v) {
        (Lit::Atom(Atom::Prefix(net, len)), Val::Atom(Atom::Addr(ip))) => {
            ipnet::IpNet::new(*net, *len).is_ok_and(|n| n.contains(ip))
        }
        (Lit::Atom(a), Val::Atom(b)) => a == b,
        (Lit::Num(n), Val::Atom(Atom::Index(i))) => n == i,
        (Lit::Iface(pat), Val::Str(s)) => match pat.strip_suffix('*') {
            Some(prefix) => s.starts_with(prefix),
            None => s == pat,
        },
        (Lit::Local | Lit::Dnat, Val::Holds(h)) => *h,
        _ => false,
    }
}

/// What kproxy's rules do to a new connection on one branch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Fate {
    /// Translated to the outcome's endpoint.
    Dnat,
    Drop,
    Reject,
    /// kproxy does not touch the packet.
    None,
    /// The branch reached a rule the evaluator cannot evaluate (see the note).
    Unknown,
}

/// A fraction of new connections, exact (a dispatch map's index is `numgen random mod
/// N`: each of N rows takes 1/N).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Share {
    pub num: u128,
    pub den: u128,
}

impl Share {
    pub const ALL: Share = Share { num: 1, den: 1 };

    fn new(num: u128, den: u128) -> Share {
        let g = gcd(num, den).max(1);
        Share {
            num: num / g,
            den: den / g,
        }
    }

    fn times(self, o: Share) -> Share {
        Share::new(self.num * o.num, self.den * o.den)
    }

    fn plus(self, o: Share) -> Share {
        Share::new(self.num * o.den + o.num * self.den, self.den * o.den)
    }
}

fn gcd(a: u128, b: u128) -> u128 {
    if b == 0 { a } else { gcd(b, a % b) }
}

impl std::fmt::Display for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.num, self.den)
    }
}

impl Serialize for Share {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One branch of the evaluation: its share of new connections, its fate, and the
/// chains it went through.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Outcome {
    pub share: Share,
    pub fate: Fate,
    /// The endpoint of a DNAT.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<EndpointAddr>,
    /// Masqueraded in `nat-postrouting` (the mark, or a hairpin).
    pub masquerade: bool,
    /// The chains entered, in order (postrouting's after prerouting's or output's).
    pub chains: Vec<String>,
    /// Why a branch is [`Fate::Unknown`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// What the packet touched: the chains it entered, and per set or map the keys it
/// looked up (`None`: the set was searched as a whole, an interval set).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Touched {
    pub chains: BTreeSet<String>,
    pub lookups: BTreeMap<String, BTreeSet<Option<Tuple>>>,
}

impl Touched {
    pub fn extend(&mut self, o: Touched) {
        self.chains.extend(o.chains);
        for (set, keys) in o.lookups {
            self.lookups.entry(set).or_default().extend(keys);
        }
    }

    fn touched(&self, set: &str, key: &Tuple) -> bool {
        self.lookups
            .get(set)
            .is_some_and(|k| k.contains(&None) || k.contains(&Some(key.clone())))
    }
}

/// The evaluation of one packet against one table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evaluation {
    /// Branches with the same fate, endpoint, masquerade and chains are merged; sorted.
    pub outcomes: Vec<Outcome>,
    pub touched: Touched,
}

impl Evaluation {
    /// Whether the table does what `t` (trace's answer from the plan) says: every
    /// branch has trace's verdict and masquerade, and a DNAT picks each of trace's
    /// endpoints with an equal share.
    pub fn agrees_with(&self, t: &Trace) -> bool {
        let fate = match t.verdict {
            TraceVerdict::Dnat => Fate::Dnat,
            TraceVerdict::Drop => Fate::Drop,
            TraceVerdict::Reject => Fate::Reject,
            TraceVerdict::None => Fate::None,
        };
        if self.outcomes.iter().any(|o| o.fate != fate) {
            return false;
        }
        if fate != Fate::Dnat {
            return self.outcomes.iter().all(|o| !o.masquerade);
        }
        // trace's masquerade is certain: the mark, or every candidate a hairpin.
        if self.outcomes.iter().all(|o| o.masquerade) != t.masquerade {
            return false;
        }
        let mut kernel: BTreeMap<EndpointAddr, Share> = BTreeMap::new();
        for o in &self.outcomes {
            let Some(e) = o.endpoint else { return false };
            let s = kernel.entry(e).or_insert(Share { num: 0, den: 1 });
            *s = s.plus(o.share);
        }
        let mut plan: BTreeMap<EndpointAddr, Share> = BTreeMap::new();
        let n = t.endpoints.len() as u128;
        for e in &t.endpoints {
            let s = plan.entry(*e).or_insert(Share { num: 0, den: 1 });
            *s = s.plus(Share::new(1, n));
        }
        kernel == plan
    }
}

/// Evaluates a new connection `pkt` against `table` (of `pkt`'s family).
/// `local_addresses` are this node's addresses (`fib … type local`); a packet from one
/// of them with no input interface is this node's own and takes `nat-output`.
pub fn evaluate(table: &Table, pkt: &Packet, local_addresses: &[IpAddr]) -> Evaluation {
    let mut ev = Eval {
        table,
        pkt,
        locals: local_addresses,
        touched: Touched::default(),
    };
    let start = St {
        mark: 0,
        dnat: None,
        share: Share::ALL,
        chains: Vec::new(),
    };
    let own = pkt.in_interface.is_none() && local_addresses.contains(&pkt.src);
    let first = if own { "nat-output" } else { "nat-prerouting" };
    let mut outcomes: Vec<Outcome> = Vec::new();
    for (st, end) in ev.chain(first, start, 0) {
        let fate = match end {
            End::Fall | End::Accept => Fate::None,
            End::Dnat(_) => Fate::Dnat,
            End::Drop => Fate::Drop,
            End::Reject => Fate::Reject,
            End::Masquerade => Fate::None,
            End::Unknown(why) => {
                outcomes.push(outcome(st, Fate::Unknown, false, Some(why)));
                continue;
            }
        };
        let mut st = st;
        if let End::Dnat(e) = end {
            st.dnat = Some(e);
        }
        if matches!(fate, Fate::Drop | Fate::Reject) {
            outcomes.push(outcome(st, fate, false, None));
            continue;
        }
        // The connection leaves: postrouting decides the masquerade.
        for (st, end) in ev.chain("nat-postrouting", st, 0) {
            let (f, masq, note) = match end {
                End::Masquerade => (fate, true, None),
                End::Fall | End::Accept | End::Dnat(_) => (fate, false, None),
                End::Drop => (Fate::Drop, false, None),
                End::Reject => (Fate::Reject, false, None),
                End::Unknown(why) => (Fate::Unknown, false, Some(why)),
            };
            outcomes.push(outcome(st, f, masq, note));
        }
    }
    // Merge equal branches (a dispatch map's rows to one endpoint, say).
    let mut merged: BTreeMap<Branch, Share> = BTreeMap::new();
    for o in outcomes {
        let s = merged
            .entry((o.fate, o.endpoint, o.masquerade, o.chains, o.note))
            .or_insert(Share { num: 0, den: 1 });
        *s = s.plus(o.share);
    }
    Evaluation {
        outcomes: merged
            .into_iter()
            .map(
                |((fate, endpoint, masquerade, chains, note), share)| Outcome {
                    share,
                    fate,
                    endpoint,
                    masquerade,
                    chains,
                    note,
                },
            )
            .collect(),
        touched: ev.touched,
    }
}

/// What makes two branches one outcome: fate, endpoint, masquerade, chains, note.
type Branch = (
    Fate,
    Option<EndpointAddr>,
    bool,
    Vec<String>,
    Option<String>,
);

fn outcome(st: St, fate: Fate, masquerade: bool, note: Option<String>) -> Outcome {
    Outcome {
        share: st.share,
        fate,
        endpoint: if fate == Fate::Dnat { st.dnat } else { None },
        masquerade,
        chains: st.chains,
        note,
    }
}

/// What of `kernel` (as `crate::adopt::adopt` gives it) differs from `desired`, among
/// the objects `touched` names: one line per chain, set or element, in the order of
/// `model::diff`'s transaction. Empty when what the packet touched is the plan's.
pub fn divergence(
    kernel: &Table,
    desired: &Table,
    touched: &Touched,
) -> Result<Vec<String>, NftError> {
    let tx = model::diff(kernel, desired)?;
    let mut out: Vec<String> = Vec::new();
    let mut push = |s: String| {
        if !out.contains(&s) {
            out.push(s);
        }
    };
    let kind = |set: &str| {
        let map = desired
            .sets
            .get(set)
            .or_else(|| kernel.sets.get(set))
            .is_some_and(|s| s.decl.is_map());
        if map { "map" } else { "set" }
    };
    let text = |v: &Option<Value>| {
        let mut s = String::new();
        if let Some(v) = v {
            s.push_str(" : ");
            v.write(&mut s);
        }
        s
    };
    // Keys deleted and added again: re-valued elements.
    let readded: BTreeSet<(&str, &Tuple)> = tx
        .ops
        .iter()
        .filter_map(|op| match op {
            Op::AddElements { set, elems, .. } => {
                Some(elems.iter().map(move |e| (set.as_str(), &e.key)))
            }
            _ => None,
        })
        .flatten()
        .collect();
    if tx.replaces {
        push(format!(
            "table {} {}: a declaration differs from the plan's (the next sync replaces the table)",
            desired.family.nft(),
            desired.name
        ));
    }
    for op in &tx.ops {
        match op {
            Op::AddTable { .. } | Op::DeleteTable { .. } => push(format!(
                "table {} {}: differs from the plan's",
                desired.family.nft(),
                desired.name
            )),
            Op::AddChain { name, .. } if touched.chains.contains(name) => {
                push(format!("chain {name}: in the plan, not in the kernel"))
            }
            Op::DeleteChain { name, .. } if touched.chains.contains(name) => {
                push(format!("chain {name}: in the kernel, not in the plan"))
            }
            Op::FlushChain { name, .. } | Op::AddRule { chain: name, .. }
                if touched.chains.contains(name) =>
            {
                push(format!(
                    "chain {name}: its rules in the kernel are not the plan's"
                ))
            }
            Op::AddSet { name, decl, .. } if touched.lookups.contains_key(name) => push(format!(
                "{} {name}: in the plan, not in the kernel",
                decl.kind()
            )),
            Op::DeleteSet { name, map, .. } if touched.lookups.contains_key(name) => push(format!(
                "{} {name}: in the kernel, not in the plan",
                if *map { "map" } else { "set" }
            )),
            Op::AddElements { set, elems, .. } => {
                for e in elems.iter().filter(|e| touched.touched(set, &e.key)) {
                    let old = kernel.sets.get(set).and_then(|s| s.elements.get(&e.key));
                    push(match old {
                        Some(old) => format!(
                            "{} {set}: element {}{} in the kernel, {}{} in the plan",
                            kind(set),
                            e.key,
                            text(old),
                            e.key,
                            text(&e.value)
                        ),
                        None => format!(
                            "{} {set}: element {}{} is in the plan, not in the kernel",
                            kind(set),
                            e.key,
                            text(&e.value)
                        ),
                    });
                }
            }
            Op::DeleteElements { set, keys, .. } => {
                for k in keys
                    .iter()
                    .filter(|k| touched.touched(set, k) && !readded.contains(&(set.as_str(), *k)))
                {
                    let v = kernel.sets.get(set).and_then(|s| s.elements.get(k));
                    push(format!(
                        "{} {set}: element {k}{} is in the kernel, not in the plan",
                        kind(set),
                        v.map(text).unwrap_or_default()
                    ));
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

// ---- The interpreter.

/// The state of one branch.
#[derive(Clone, Debug)]
struct St {
    mark: u32,
    dnat: Option<EndpointAddr>,
    share: Share,
    chains: Vec<String>,
}

/// How a chain (or a branch through it) ends.
#[derive(Clone, Debug, PartialEq, Eq)]
enum End {
    /// Its rules ran out, or `return`: back to the caller.
    Fall,
    Accept,
    Drop,
    Reject,
    Dnat(EndpointAddr),
    Masquerade,
    Unknown(String),
}

/// How one rule ends on a branch.
enum RuleEnd {
    /// Did not match, or matched without a verdict: the next rule.
    Next,
    End(End),
    Jump(String),
    Goto(String),
}

/// Chains nest this deep at most in what kproxy writes (base → services → frontend →
/// dispatch); deeper is a loop in a foreign table.
const MAX_DEPTH: u32 = 16;

struct Eval<'a> {
    table: &'a Table,
    pkt: &'a Packet,
    locals: &'a [IpAddr],
    touched: Touched,
}

impl Eval<'_> {
    fn chain(&mut self, name: &str, mut st: St, depth: u32) -> Vec<(St, End)> {
        let Some(chain) = self.table.chains.get(name) else {
            let why = format!("chain {name} does not exist");
            return vec![(st, End::Unknown(why))];
        };
        if depth > MAX_DEPTH {
            return vec![(
                st,
                End::Unknown(format!("chain {name}: chains nest too deep")),
            )];
        }
        self.touched.chains.insert(name.to_string());
        st.chains.push(name.to_string());
        let rules: Vec<Rule> = chain.rules.clone();
        self.rules(name, &rules, 0, st, depth)
    }

    fn rules(
        &mut self,
        name: &str,
        rules: &[Rule],
        i: usize,
        st: St,
        depth: u32,
    ) -> Vec<(St, End)> {
        let Some(rule) = rules.get(i) else {
            return vec![(st, End::Fall)];
        };
        let mut out = Vec::new();
        for (st, end) in self.exprs(name, &rule.exprs, 0, st) {
            match end {
                RuleEnd::Next => out.extend(self.rules(name, rules, i + 1, st, depth)),
                RuleEnd::End(e) => out.push((st, e)),
                RuleEnd::Jump(to) => {
                    for (st, e) in self.chain(&to, st, depth + 1) {
                        match e {
                            End::Fall => out.extend(self.rules(name, rules, i + 1, st, depth)),
                            e => out.push((st, e)),
                        }
                    }
                }
                RuleEnd::Goto(to) => out.extend(self.chain(&to, st, depth + 1)),
            }
        }
        out
    }

    /// Runs the rule's expressions from `i` on: each branch and how the rule ends on it.
    fn exprs(&mut self, chain: &str, rule: &[Expr], i: usize, mut st: St) -> Vec<(St, RuleEnd)> {
        let Some(e) = rule.get(i) else {
            return vec![(st, RuleEnd::Next)];
        };
        match e {
            Expr::Match { sel, neg, rhs } => {
                let lits = match rhs {
                    Rhs::Lit(l) => std::slice::from_ref(l),
                    Rhs::AnonSet(ls) => ls.as_slice(),
                    Rhs::Set(_) => &[],
                };
                if let ([Sel::Numgen(n)], false) = (sel.as_slice(), matches!(rhs, Rhs::Set(_))) {
                    return self.numgen_match(chain, rule, i, st, *n, lits, *neg);
                }
                let mut out = Vec::new();
                for (st, key) in self.keys(sel, st) {
                    let hit = match rhs {
                        Rhs::Set(name) => self.lookup(name, &key),
                        Rhs::Lit(_) | Rhs::AnonSet(_) => {
                            key.len() == 1 && lits.iter().any(|l| matches(l, &key[0]))
                        }
                    };
                    if hit != *neg {
                        out.extend(self.exprs(chain, rule, i + 1, st));
                    } else {
                        out.push((st, RuleEnd::Next));
                    }
                }
                out
            }
            Expr::MarkOr(m) => {
                st.mark |= m;
                self.exprs(chain, rule, i + 1, st)
            }
            Expr::MarkXor(m) => {
                st.mark ^= m;
                self.exprs(chain, rule, i + 1, st)
            }
            // Fills a dynamic set: no effect on this connection's fate.
            Expr::Update { .. } => self.exprs(chain, rule, i + 1, st),
            // Counts: no effect on the connection's fate (a key the map lacks ends the
            // rule, and kproxy's counting rules end their chain either way).
            Expr::CounterMap { .. } | Expr::CounterRef(_) => self.exprs(chain, rule, i + 1, st),
            Expr::Vmap { sel, map: set } => {
                let mut out = Vec::new();
                for (st, key) in self.keys(sel, st) {
                    let end = match self.value(set, &key) {
                        Some(Value::Verdict(v)) => verdict(&v),
                        Some(Value::Data(_) | Value::Counter(_)) => RuleEnd::End(End::Unknown(
                            format!("map {set} holds data where a verdict is looked up"),
                        )),
                        None => RuleEnd::Next,
                    };
                    out.push((st, end));
                }
                out
            }
            Expr::DnatMap { sel, map: set, .. } => {
                let mut out = Vec::new();
                for (st, key) in self.keys(sel, st) {
                    let end = match self.value(set, &key) {
                        Some(Value::Data(t)) => match &*t.atoms() {
                            [Atom::Addr(ip), Atom::Port(p)] => {
                                RuleEnd::End(End::Dnat(EndpointAddr::new(*ip, *p)))
                            }
                            _ => RuleEnd::End(End::Unknown(format!(
                                "map {set}: value {t} is not an address and port"
                            ))),
                        },
                        Some(Value::Verdict(_) | Value::Counter(_)) => RuleEnd::End(End::Unknown(
                            format!("map {set} holds no endpoint where one is looked up"),
                        )),
                        // No element: the expression breaks, the rule does not apply.
                        None => RuleEnd::Next,
                    };
                    out.push((st, end));
                }
                out
            }
            Expr::DnatTo(e) => vec![(st, RuleEnd::End(End::Dnat(*e)))],
            Expr::Verdict(v) => vec![(st, verdict(v))],
            Expr::Reject { .. } => vec![(st, RuleEnd::End(End::Reject))],
            Expr::Masquerade { .. } => vec![(st, RuleEnd::End(End::Masquerade))],
            // `crate::adopt::adopt` decodes what kproxy does not write into these.
            Expr::Unknown(why) => vec![(
                st,
                RuleEnd::End(End::Unknown(format!(
                    "chain {chain} holds a rule the evaluator cannot read: {why}"
                ))),
            )],
        }
    }

    /// `numgen random mod n` compared with literals: two branches, the indices that
    /// match and those that do not, rather than one per index (an affinity port's
    /// `numgen random mod n-i 0` rules follow one another: per-index branches would
    /// multiply to n!).
    #[allow(clippy::too_many_arguments)]
    fn numgen_match(
        &mut self,
        chain: &str,
        rule: &[Expr],
        i: usize,
        st: St,
        n: u32,
        lits: &[Lit],
        neg: bool,
    ) -> Vec<(St, RuleEnd)> {
        let hits = (0..n)
            .filter(|k| lits.iter().any(|l| matches(l, &Val::Atom(Atom::Index(*k)))) != neg)
            .count() as u128;
        let n = u128::from(n);
        let mut out = Vec::new();
        if hits > 0 {
            let mut hit = st.clone();
            hit.share = hit.share.times(Share::new(hits, n));
            out.extend(self.exprs(chain, rule, i + 1, hit));
        }
        if hits < n {
            let mut miss = st;
            miss.share = miss.share.times(Share::new(n - hits, n));
            out.push((miss, RuleEnd::Next));
        }
        out
    }

    /// The values of a concatenation of selectors: one per branch (`numgen` branches).
    fn keys(&self, sel: &[Sel], st: St) -> Vec<(St, Vec<Val>)> {
        let mut out = vec![(st, Vec::new())];
        for s in sel {
            let mut next = Vec::new();
            for (st, key) in out {
                if let Sel::Numgen(n) = s {
                    for i in 0..*n {
                        let mut st = st.clone();
                        st.share = st.share.times(Share::new(1, u128::from(*n)));
                        let mut key = key.clone();
                        key.push(Val::Atom(Atom::Index(i)));
                        next.push((st, key));
                    }
                } else {
                    let v = self.select(*s, &st);
                    let mut key = key;
                    key.push(v);
                    next.push((st, key));
                }
            }
            out = next;
        }
        out
    }

    fn select(&self, s: Sel, st: &St) -> Val {
        let pkt = self.pkt;
        let daddr = st.dnat.map_or(pkt.dst, |e| e.ip);
        match s {
            Sel::Addr(_, Dir::Src) => Val::Atom(Atom::Addr(pkt.src)),
            Sel::Addr(_, Dir::Dst) => Val::Atom(Atom::Addr(daddr)),
            Sel::L4proto => Val::Atom(Atom::proto(pkt.proto)),
            Sel::Dport => Val::Atom(Atom::Port(st.dnat.map_or(pkt.dport, |e| e.port))),
            Sel::Iifname => Val::Str(pkt.in_interface.clone().unwrap_or_default()),
            Sel::FibType(Dir::Src) => Val::Holds(self.locals.contains(&pkt.src)),
            Sel::FibType(Dir::Dst) => Val::Holds(self.locals.contains(&daddr)),
            Sel::CtStatus => Val::Holds(st.dnat.is_some()),
            Sel::MarkAnd(m) => Val::Atom(Atom::Index(st.mark & m)),
            // Branched on in `keys`.
            Sel::Numgen(_) => Val::Atom(Atom::Index(0)),
            Sel::CtOrigDaddr(_) => Val::Atom(Atom::Addr(pkt.dst)),
            Sel::CtOrigDport => Val::Atom(Atom::Port(pkt.dport)),
        }
    }

    fn note(&mut self, set: &str, key: Option<Tuple>) {
        self.touched
            .lookups
            .entry(set.to_string())
            .or_default()
            .insert(key);
    }

    /// Whether `key` is in set `set` (an interval set by prefix).
    fn lookup(&mut self, set: &str, key: &[Val]) -> bool {
        let Some(s) = self.table.sets.get(set) else {
            self.note(set, None);
            return false;
        };
        if s.decl.interval {
            self.note(set, None);
            return match key {
                [Val::Atom(a)] => s.elements.keys().any(|k| {
                    k.atoms()
                        .first()
                        .is_some_and(|p| matches(&Lit::Atom(*p), &Val::Atom(*a)))
                }),
                _ => false,
            };
        }
        match tuple(key) {
            Some(t) => {
                let hit = s.elements.contains_key(&t);
                self.note(set, Some(t));
                hit
            }
            None => false,
        }
    }

    /// The value of `key` in map `set`.
    fn value(&mut self, set: &str, key: &[Val]) -> Option<Value> {
        let t = tuple(key)?;
        self.note(set, Some(t.clone()));
        self.table
            .sets
            .get(set)?
            .elements
            .get(&t)
            .cloned()
            .flatten()
    }
}

fn tuple(key: &[Val]) -> Option<Tuple> {
    let atoms: Option<Vec<Atom>> = key
        .iter()
        .map(|v| match v {
            Val::Atom(a) => Some(*a),
            _ => None,
        })
        .collect();
    let atoms = atoms?;
    (atoms.len() <= model::MAX_FIELDS).then(|| Tuple::new(&atoms))
}

fn verdict(v: &model::Verdict) -> RuleEnd {
    match v {
        model::Verdict::Accept => RuleEnd::End(End::Accept),
        model::Verdict::Drop => RuleEnd::End(End::Drop),
        model::Verdict::Return => RuleEnd::End(End::Fall),
        model::Verdict::Continue => RuleEnd::Next,
        model::Verdict::Jump(c) => RuleEnd::Jump(c.to_string()),
        model::Verdict::Goto(c) => RuleEnd::Goto(c.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Chain, Family, Field, Hook, HookPoint, Set, SetData, SetDecl};

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn chain(hook: Option<Hook>, rules: Vec<Rule>) -> Chain {
        Chain { hook, rules }
    }

    // Typed rules, as `crate::ruleset` builds them.
    const SADDR: Sel = Sel::Addr(Family::Ip, Dir::Src);
    const DADDR: Sel = Sel::Addr(Family::Ip, Dir::Dst);

    fn r(exprs: Vec<Expr>) -> Rule {
        Rule::new(exprs)
    }

    fn v(x: model::Verdict) -> Expr {
        Expr::Verdict(x)
    }

    fn to(c: &str) -> Expr {
        v(model::Verdict::Goto(c.into()))
    }

    fn m(sel: Vec<Sel>, neg: bool, rhs: Rhs) -> Expr {
        Expr::Match { sel, neg, rhs }
    }

    fn set(name: &str) -> Rhs {
        Rhs::Set(name.into())
    }

    fn net(s: &str) -> Lit {
        let n: ipnet::IpNet = s.parse().unwrap();
        Lit::Atom(Atom::Prefix(n.addr(), n.prefix_len()))
    }

    fn frontend_key() -> Vec<Sel> {
        vec![DADDR, Sel::L4proto, Sel::Dport]
    }

    /// `update @aff-I { ip saddr } meta l4proto tcp dnat to EP`.
    fn affinity_dnat(i: u32, ep: &str) -> Vec<Expr> {
        vec![
            Expr::Update {
                set: format!("aff-{i}"),
                key: SADDR,
            },
            m(
                vec![Sel::L4proto],
                false,
                Rhs::Lit(Lit::Atom(Atom::Proto(6))),
            ),
            dnat(ep),
        ]
    }

    fn dnat(ep: &str) -> Expr {
        let sa: std::net::SocketAddr = ep.parse().unwrap();
        Expr::DnatTo(EndpointAddr::new(sa.ip(), sa.port()))
    }

    /// `numgen random mod N 0 goto C`.
    fn pick(n: u32, c: &str) -> Rule {
        r(vec![
            m(vec![Sel::Numgen(n)], false, Rhs::Lit(Lit::Num(0))),
            to(c),
        ])
    }

    fn key(atoms: &[Atom]) -> Tuple {
        Tuple::new(atoms)
    }

    fn frontend(a: &str, port: u16) -> Vec<Atom> {
        vec![Atom::Addr(ip(a)), Atom::Proto(6), Atom::Port(port)]
    }

    /// A table in kproxy's layout (crate::ruleset): 10.96.0.1:80 dispatches to two
    /// endpoints, masqueraded from everywhere but local pods (10.244.1.0/24);
    /// 10.96.0.2:80 has its own chain (this node's traffic to one endpoint, the rest
    /// dropped); 10.96.0.3:80 has no endpoints (reject); 10.96.0.4 is allocated, with no
    /// port 81.
    fn table() -> Table {
        let mut t = Table::new(Family::Ip, "kproxy");
        let nat = |h, p| Some(Hook::nat(h, p));
        let jump = |c: &str| vec![r(vec![v(model::Verdict::Jump(c.into()))])];
        t.chains.insert(
            "nat-prerouting".into(),
            chain(nat(HookPoint::Prerouting, -101), jump("services")),
        );
        t.chains.insert(
            "nat-output".into(),
            chain(nat(HookPoint::Output, -101), jump("services")),
        );
        t.chains.insert(
            "nat-postrouting".into(),
            chain(nat(HookPoint::Postrouting, 99), jump("masquerading")),
        );
        let masquerade = Expr::Masquerade { fully_random: true };
        let reject = Expr::Reject { tcp_reset: false };
        t.chains.insert(
            "masquerading".into(),
            chain(
                None,
                vec![
                    r(vec![
                        m(vec![Sel::CtStatus], false, Rhs::Lit(Lit::Dnat)),
                        m(vec![SADDR, DADDR], false, set("hairpin")),
                        masquerade.clone(),
                    ]),
                    r(vec![
                        m(vec![Sel::MarkAnd(0x4000)], false, Rhs::Lit(Lit::Num(0))),
                        v(model::Verdict::Return),
                    ]),
                    r(vec![Expr::MarkXor(0x4000)]),
                    r(vec![masquerade]),
                ],
            ),
        );
        t.chains.insert(
            "services".into(),
            chain(
                None,
                vec![
                    r(vec![
                        m(vec![SADDR], true, Rhs::Lit(net("10.244.1.0/24"))),
                        m(frontend_key(), false, set("masq-ips-nonlocal")),
                        Expr::MarkOr(0x4000),
                    ]),
                    r(vec![Expr::Vmap {
                        sel: frontend_key(),
                        map: "service-ips".into(),
                    }]),
                    r(vec![
                        m(vec![DADDR], false, set("cluster-ips")),
                        reject.clone(),
                    ]),
                    r(vec![
                        m(vec![DADDR], false, Rhs::AnonSet(vec![net("10.96.0.0/16")])),
                        v(model::Verdict::Drop),
                    ]),
                ],
            ),
        );
        t.chains
            .insert("no-endpoints".into(), chain(None, vec![r(vec![reject])]));
        t.chains.insert(
            "svc-b".into(),
            chain(
                None,
                vec![
                    r(vec![
                        m(vec![Sel::FibType(Dir::Src)], false, Rhs::Lit(Lit::Local)),
                        to("disp-c-2"),
                    ]),
                    r(vec![v(model::Verdict::Drop)]),
                ],
            ),
        );
        let mut dispatch = frontend_key();
        dispatch.push(Sel::Numgen(2));
        t.chains.insert(
            "disp-c-2".into(),
            chain(
                None,
                vec![r(vec![Expr::DnatMap {
                    family: Family::Ip,
                    sel: dispatch,
                    map: "dnat-c-2".into(),
                }])],
            ),
        );
        let a = Field::Ipv4Addr;
        let mut vmap = Set::new(SetDecl::map(
            vec![a, Field::InetProto, Field::InetService],
            SetData::Verdict,
        ));
        let goto = |c: &str| Some(Value::Verdict(model::Verdict::Goto(c.into())));
        vmap.elements
            .insert(key(&frontend("10.96.0.1", 80)), goto("disp-c-2"));
        vmap.elements
            .insert(key(&frontend("10.96.0.2", 80)), goto("svc-b"));
        vmap.elements
            .insert(key(&frontend("10.96.0.3", 80)), goto("no-endpoints"));
        t.sets.insert("service-ips".into(), vmap);
        let mut masq = Set::new(SetDecl::set(vec![a, Field::InetProto, Field::InetService]));
        masq.elements.insert(key(&frontend("10.96.0.1", 80)), None);
        t.sets.insert("masq-ips-nonlocal".into(), masq);
        let mut cips = Set::new(SetDecl::set(vec![a]));
        for c in ["10.96.0.1", "10.96.0.2", "10.96.0.3", "10.96.0.4"] {
            cips.elements.insert(key(&[Atom::Addr(ip(c))]), None);
        }
        t.sets.insert("cluster-ips".into(), cips);
        let mut hairpin = Set::new(SetDecl::set(vec![a, a]));
        hairpin.elements.insert(
            key(&[Atom::Addr(ip("10.244.1.2")), Atom::Addr(ip("10.244.1.2"))]),
            None,
        );
        t.sets.insert("hairpin".into(), hairpin);
        let mut dnat = Set::new(SetDecl {
            by_expr: true,
            ..SetDecl::map(
                vec![a, Field::InetProto, Field::InetService, Field::Numgen(2)],
                SetData::Fields(vec![a, Field::InetService]),
            )
        });
        for (fe, eps) in [
            ("10.96.0.1", ["10.244.1.2", "10.244.2.2"]),
            ("10.96.0.2", ["10.244.1.3", "10.244.2.3"]),
        ] {
            for (i, ep) in eps.iter().enumerate() {
                let mut k = frontend(fe, 80);
                k.push(Atom::Index(i as u32));
                dnat.elements.insert(
                    key(&k),
                    Some(Value::Data(key(&[Atom::Addr(ip(ep)), Atom::Port(8080)]))),
                );
            }
        }
        t.sets.insert("dnat-c-2".into(), dnat);
        t
    }

    fn pkt(src: &str, dst: &str, dport: u16) -> Packet {
        Packet {
            src: ip(src),
            dst: ip(dst),
            dport,
            proto: kproxy_core::model::Protocol::TCP,
            in_interface: None,
        }
    }

    const NODE: &str = "10.200.0.1";

    /// Outcomes as `share FATE [endpoint] [masq]`.
    fn fates(t: &Table, p: &Packet) -> Vec<String> {
        evaluate(t, p, &[ip(NODE)])
            .outcomes
            .iter()
            .map(|o| {
                let mut s = format!("{} {:?}", o.share, o.fate).to_uppercase();
                if let Some(e) = o.endpoint {
                    s += &format!(" {e}");
                }
                if o.masquerade {
                    s += " masq";
                }
                s
            })
            .collect()
    }

    #[test]
    fn packets_take_the_table_s_branches() {
        let t = table();
        let cases: &[(&str, Packet, &[&str])] = &[
            (
                "outside client: both endpoints, masqueraded",
                pkt("198.51.100.2", "10.96.0.1", 80),
                &[
                    "1/2 DNAT 10.244.1.2:8080 masq",
                    "1/2 DNAT 10.244.2.2:8080 masq",
                ],
            ),
            (
                "a local pod: client address kept, but its own connection is a hairpin",
                pkt("10.244.1.2", "10.96.0.1", 80),
                &["1/2 DNAT 10.244.1.2:8080 masq", "1/2 DNAT 10.244.2.2:8080"],
            ),
            (
                "this node: through its own chain's first rule",
                pkt(NODE, "10.96.0.2", 80),
                &["1/2 DNAT 10.244.1.3:8080", "1/2 DNAT 10.244.2.3:8080"],
            ),
            (
                "anyone else: dropped by its chain",
                pkt("198.51.100.2", "10.96.0.2", 80),
                &["1/1 DROP"],
            ),
            (
                "no endpoints",
                pkt("198.51.100.2", "10.96.0.3", 80),
                &["1/1 REJECT"],
            ),
            (
                "undefined port",
                pkt("198.51.100.2", "10.96.0.4", 81),
                &["1/1 REJECT"],
            ),
            (
                "unallocated cluster IP",
                pkt("198.51.100.2", "10.96.9.9", 80),
                &["1/1 DROP"],
            ),
            (
                "not a service",
                pkt("198.51.100.2", "10.1.2.3", 80),
                &["1/1 NONE"],
            ),
        ];
        for (name, p, want) in cases {
            assert_eq!(fates(&t, p), *want, "{name}");
        }
    }

    #[test]
    fn a_missing_dispatch_row_leaves_its_share_untouched_and_is_named() {
        let desired = table();
        let mut kernel = table();
        let mut row = frontend("10.96.0.1", 80);
        row.push(Atom::Index(1));
        kernel
            .sets
            .get_mut("dnat-c-2")
            .unwrap()
            .elements
            .remove(&key(&row));
        let p = pkt("198.51.100.2", "10.96.0.1", 80);
        // The mark is set before the dispatch: the untouched half is masqueraded too.
        assert_eq!(
            fates(&kernel, &p),
            ["1/2 DNAT 10.244.1.2:8080 masq", "1/2 NONE masq"]
        );
        let (k, d) = (
            evaluate(&kernel, &p, &[ip(NODE)]),
            evaluate(&desired, &p, &[ip(NODE)]),
        );
        let mut touched = k.touched;
        touched.extend(d.touched);
        assert_eq!(
            divergence(&kernel, &desired, &touched).unwrap(),
            [
                "map dnat-c-2: element 10.96.0.1 . tcp . 80 . 1 : 10.244.2.2 . 8080 is in the plan, not in the kernel"
            ]
        );
        // Another frontend's packet does not touch it.
        let other = evaluate(&kernel, &pkt(NODE, "10.96.0.2", 80), &[ip(NODE)]);
        assert_eq!(
            divergence(&kernel, &desired, &other.touched).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn re_valued_and_extra_elements_and_foreign_rules_are_named() {
        let desired = table();
        let mut kernel = table();
        let vmap = kernel.sets.get_mut("service-ips").unwrap();
        vmap.elements.insert(
            key(&frontend("10.96.0.1", 80)),
            Some(Value::Verdict(model::Verdict::Drop)),
        );
        vmap.elements.insert(
            key(&frontend("10.96.0.9", 80)),
            Some(Value::Verdict(model::Verdict::Drop)),
        );
        kernel.chains.get_mut("svc-b").unwrap().rules = vec![Rule::unknown(
            "a `counter` expression kproxy does not write",
        )];
        let ev = |p: &Packet| {
            let (k, d) = (
                evaluate(&kernel, p, &[ip(NODE)]),
                evaluate(&desired, p, &[ip(NODE)]),
            );
            let mut touched = k.touched.clone();
            touched.extend(d.touched);
            (k, divergence(&kernel, &desired, &touched).unwrap())
        };
        let (k, named) = ev(&pkt("198.51.100.2", "10.96.0.1", 80));
        assert_eq!(
            fates(&kernel, &pkt("198.51.100.2", "10.96.0.1", 80)),
            ["1/1 DROP"]
        );
        assert!(!k.agrees_with(&kproxy_core::trace::Trace {
            verdict: TraceVerdict::Dnat,
            endpoints: vec![],
            masquerade: true,
            reason: String::new(),
        }));
        assert_eq!(
            named,
            [
                "map service-ips: element 10.96.0.1 . tcp . 80 : drop in the kernel, 10.96.0.1 . tcp . 80 : goto disp-c-2 in the plan"
            ]
        );
        let (_, named) = ev(&pkt("198.51.100.2", "10.96.0.9", 80));
        assert_eq!(
            named,
            [
                "map service-ips: element 10.96.0.9 . tcp . 80 : drop is in the kernel, not in the plan"
            ]
        );
        let (k, named) = ev(&pkt(NODE, "10.96.0.2", 80));
        assert_eq!(k.outcomes.len(), 1);
        assert_eq!(k.outcomes[0].fate, Fate::Unknown);
        assert!(
            k.outcomes[0]
                .note
                .as_deref()
                .unwrap()
                .contains("chain svc-b")
        );
        assert_eq!(
            named,
            ["chain svc-b: its rules in the kernel are not the plan's"]
        );
    }

    #[test]
    fn agreement_is_trace_s_verdict_endpoints_shares_and_masquerade() {
        let t = table();
        let ev = evaluate(&t, &pkt("198.51.100.2", "10.96.0.1", 80), &[ip(NODE)]);
        let ep = |s: &str| EndpointAddr::new(ip(s), 8080);
        let trace = |endpoints: Vec<EndpointAddr>, masquerade| Trace {
            verdict: TraceVerdict::Dnat,
            endpoints,
            masquerade,
            reason: String::new(),
        };
        assert!(ev.agrees_with(&trace(vec![ep("10.244.1.2"), ep("10.244.2.2")], true)));
        assert!(!ev.agrees_with(&trace(vec![ep("10.244.1.2"), ep("10.244.2.2")], false)));
        assert!(!ev.agrees_with(&trace(vec![ep("10.244.1.2")], true)));
        assert!(!ev.agrees_with(&trace(
            vec![ep("10.244.1.2"), ep("10.244.2.2"), ep("10.244.2.2")],
            true
        )));
        let none = evaluate(&t, &pkt("198.51.100.2", "10.1.2.3", 80), &[ip(NODE)]);
        assert!(none.agrees_with(&Trace {
            verdict: TraceVerdict::None,
            endpoints: vec![],
            masquerade: false,
            reason: String::new(),
        }));
    }

    #[test]
    fn affinity_rules_pick_each_endpoint_with_an_equal_share() {
        let mut t = table();
        t.chains.insert(
            "svc-b".into(),
            chain(
                None,
                vec![
                    r([m(vec![SADDR], false, set("aff-1"))]
                        .into_iter()
                        .chain(affinity_dnat(1, "10.244.1.3:8080"))
                        .collect()),
                    pick(3, "aep-1"),
                    pick(2, "aep-2"),
                    r(vec![to("aep-3")]),
                ],
            ),
        );
        for i in 1..=3 {
            t.chains.insert(
                format!("aep-{i}"),
                chain(
                    None,
                    vec![r(affinity_dnat(i, &format!("10.244.1.{i}:8080")))],
                ),
            );
            t.sets.insert(
                format!("aff-{i}"),
                Set::new(SetDecl {
                    dynamic: true,
                    timeout_secs: Some(10800),
                    ..SetDecl::set(vec![Field::Ipv4Addr])
                }),
            );
        }
        let got = fates(&t, &pkt("198.51.100.2", "10.96.0.2", 80));
        assert_eq!(
            got,
            [
                "1/3 DNAT 10.244.1.1:8080",
                "1/3 DNAT 10.244.1.2:8080",
                "1/3 DNAT 10.244.1.3:8080"
            ]
        );
        // Forty endpoints: each rule is one choice of two, not one per index.
        let n = 40;
        let mut rules: Vec<Rule> = (1..n)
            .map(|i| pick(n - i + 1, &format!("aep-{i}")))
            .collect();
        rules.push(r(vec![to(&format!("aep-{n}"))]));
        t.chains.insert("svc-b".into(), Chain { hook: None, rules });
        for i in 1..=n {
            t.chains.insert(
                format!("aep-{i}"),
                chain(None, vec![r(vec![dnat(&format!("10.244.3.{i}:8080"))])]),
            );
        }
        let got = fates(&t, &pkt("198.51.100.2", "10.96.0.2", 80));
        assert_eq!(got.len(), n as usize);
        assert!(got.iter().all(|f| f.starts_with("1/40 DNAT")), "{got:?}");
    }
}
