//! The typed rule: what one rule of kproxy's tables does, as a value. `crate::ruleset`
//! builds these values; [`Rule::write`] is the one renderer of their nft text (the
//! `kp:` id of a rule is [`crate::atom::rule_id`] of that text, kept as the rule's
//! user data); [`encode`] writes them as the kernel's expressions, and the readers'
//! decoder (`crate::dump::rule`) turns those back into the same values, so that a rule
//! read back is compared by what it does ([`Rule::same`]), not by its comment;
//! `crate::evaluate` interprets them.
//!
//! Below the table model (`crate::model`, whose chains hold these rules) and above the
//! values it shares with it (`crate::atom`) and the netlink floor (`crate::nfnl`) only;
//! the decoder reads the readers' raw tables, so it stands with them, not here.
//!
//! The vocabulary is exactly what kproxy writes: matches of selectors (addresses,
//! `meta l4proto`, `th dport`, `iifname`, `fib … type`, `ct status`, `numgen`, the
//! mark) against literals, anonymous sets or named sets; statements (mark, `update
//! @set`, `counter name … map @m`, keyed also by `ct original` destinations); verdict
//! maps, dispatch maps, DNAT, masquerade, reject and verdicts. A kernel
//! rule holding anything else decodes to a rule with an [`Expr::Unknown`]: it is never
//! the same as a rule kproxy wants, and the evaluator says it cannot tell.

pub mod encode;

use std::fmt::Write as _;
use std::net::IpAddr;

use kproxy_core::model::EndpointAddr;

use crate::atom::{Atom, Family, Verdict, rule_id, write_u32};

/// Bytes of an address of `family`.
pub(crate) fn addr_len(family: Family) -> usize {
    match family {
        Family::Ip => 4,
        Family::Ip6 => 16,
    }
}

/// The network-header offset of the source or destination address of `family`.
pub(crate) fn addr_offset(family: Family, dir: Dir) -> u32 {
    match (family, dir) {
        (Family::Ip, Dir::Src) => 12,
        (Family::Ip, Dir::Dst) => 16,
        (Family::Ip6, Dir::Src) => 8,
        (Family::Ip6, Dir::Dst) => 24,
    }
}

/// Which address of the network header, or which side of a `fib` lookup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dir {
    Src,
    Dst,
}

impl Dir {
    fn word(self) -> &'static str {
        match self {
            Dir::Src => "saddr",
            Dir::Dst => "daddr",
        }
    }
}

/// A selector: what a match, a lookup key or a map key reads from the packet or its
/// state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Sel {
    /// `ip saddr`, `ip6 daddr`, …: an address of the network header.
    Addr(Family, Dir),
    /// `meta l4proto`.
    L4proto,
    /// `th dport`.
    Dport,
    /// `iifname`.
    Iifname,
    /// `fib saddr type` / `fib daddr type`.
    FibType(Dir),
    /// `ct status`.
    CtStatus,
    /// `numgen random mod N`.
    Numgen(u32),
    /// `meta mark & M`.
    MarkAnd(u32),
    /// `ct original ip daddr` / `ct original ip6 daddr`: a connection's destination
    /// before DNAT (the Service frontend), read after it (postrouting).
    CtOrigDaddr(Family),
    /// `ct original proto-dst`: the connection's destination port before DNAT.
    CtOrigDport,
}

impl Sel {
    pub fn write(&self, out: &mut String) {
        match self {
            Sel::Addr(f, d) => {
                out.push_str(f.nft());
                out.push(' ');
                out.push_str(d.word());
            }
            Sel::L4proto => out.push_str("meta l4proto"),
            Sel::Dport => out.push_str("th dport"),
            Sel::Iifname => out.push_str("iifname"),
            Sel::FibType(d) => {
                out.push_str("fib ");
                out.push_str(d.word());
                out.push_str(" type");
            }
            Sel::CtStatus => out.push_str("ct status"),
            Sel::Numgen(n) => {
                out.push_str("numgen random mod ");
                write_u32(out, *n);
            }
            Sel::MarkAnd(m) => {
                let _ = write!(out, "meta mark & {m:#x}");
            }
            Sel::CtOrigDaddr(f) => {
                out.push_str("ct original ");
                out.push_str(f.nft());
                out.push_str(" daddr");
            }
            Sel::CtOrigDport => out.push_str("ct original proto-dst"),
        }
    }
}

fn write_sels(sel: &[Sel], out: &mut String) {
    for (i, s) in sel.iter().enumerate() {
        if i > 0 {
            out.push_str(" . ");
        }
        s.write(out);
    }
}

/// A literal on the right of a match.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Lit {
    /// An address, a prefix, a protocol or a port.
    Atom(Atom),
    /// A number: a masked mark, a `numgen` index.
    Num(u32),
    /// An `iifname` pattern (`"veth*"` matches by prefix).
    Iface(String),
    /// `fib … type local`.
    Local,
    /// `ct status dnat`.
    Dnat,
}

impl Lit {
    pub fn write(&self, out: &mut String) {
        match self {
            Lit::Atom(a) => a.write(out),
            Lit::Num(n) => write_u32(out, *n),
            Lit::Iface(s) => {
                out.push('"');
                out.push_str(s);
                out.push('"');
            }
            Lit::Local => out.push_str("local"),
            Lit::Dnat => out.push_str("dnat"),
        }
    }
}

/// What a match compares its selectors with.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Rhs {
    /// One literal.
    Lit(Lit),
    /// An anonymous set `{ a, b }`: any of them.
    AnonSet(Vec<Lit>),
    /// A named set `@name`.
    Set(String),
}

/// One expression of a rule, in the order nft writes them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// `SEL [. SEL…] [!=|==] RHS`: the rule goes on when it holds.
    Match {
        sel: Vec<Sel>,
        neg: bool,
        rhs: Rhs,
    },
    /// `SEL… vmap @map`.
    Vmap {
        sel: Vec<Sel>,
        map: String,
    },
    /// `meta mark set meta mark | M`.
    MarkOr(u32),
    /// `meta mark set meta mark ^ M`.
    MarkXor(u32),
    /// `update @set { SEL }`: fills a dynamic set (ClientIP affinity).
    Update {
        set: String,
        key: Sel,
    },
    /// `counter name SEL… map @map`: counts the packet in the counter object the map
    /// names for its key (no element: nothing counted, the rule ends there).
    CounterMap {
        sel: Vec<Sel>,
        map: String,
    },
    /// `counter name NAME`: counts the packet in the named counter object.
    CounterRef(String),
    /// `dnat FAMILY to SEL… map @map`.
    DnatMap {
        family: Family,
        sel: Vec<Sel>,
        map: String,
    },
    /// `dnat to ADDR:PORT`.
    DnatTo(EndpointAddr),
    Masquerade {
        fully_random: bool,
    },
    /// `reject` (ICMP port unreachable) or `reject with tcp reset`.
    Reject {
        tcp_reset: bool,
    },
    Verdict(Verdict),
    /// Read back only: what the kernel holds that kproxy never writes (why, in words).
    Unknown(String),
}

impl Expr {
    pub fn write(&self, out: &mut String) {
        match self {
            Expr::Match { sel, neg, rhs } => {
                write_sels(sel, out);
                if *neg {
                    out.push_str(" != ");
                } else if matches!(sel.as_slice(), [Sel::MarkAnd(_)]) {
                    out.push_str(" == ");
                } else {
                    out.push(' ');
                }
                match rhs {
                    Rhs::Lit(l) => l.write(out),
                    Rhs::AnonSet(lits) => {
                        out.push_str("{ ");
                        for (i, l) in lits.iter().enumerate() {
                            if i > 0 {
                                out.push_str(", ");
                            }
                            l.write(out);
                        }
                        out.push_str(" }");
                    }
                    Rhs::Set(s) => {
                        out.push('@');
                        out.push_str(s);
                    }
                }
            }
            Expr::Vmap { sel, map } => {
                write_sels(sel, out);
                out.push_str(" vmap @");
                out.push_str(map);
            }
            Expr::CounterMap { sel, map } => {
                out.push_str("counter name ");
                write_sels(sel, out);
                out.push_str(" map @");
                out.push_str(map);
            }
            Expr::CounterRef(name) => {
                out.push_str("counter name ");
                out.push_str(name);
            }
            Expr::MarkOr(m) => {
                let _ = write!(out, "meta mark set meta mark | {m:#x}");
            }
            Expr::MarkXor(m) => {
                let _ = write!(out, "meta mark set meta mark ^ {m:#x}");
            }
            Expr::Update { set, key } => {
                out.push_str("update @");
                out.push_str(set);
                out.push_str(" { ");
                key.write(out);
                out.push_str(" }");
            }
            Expr::DnatMap { family, sel, map } => {
                out.push_str("dnat ");
                out.push_str(family.nft());
                out.push_str(" to ");
                write_sels(sel, out);
                out.push_str(" map @");
                out.push_str(map);
            }
            Expr::DnatTo(ep) => {
                // EndpointAddr's Display is `ip:port` / `[ip]:port`, nft's syntax too.
                let _ = write!(out, "dnat to {ep}");
            }
            Expr::Masquerade { fully_random } => {
                out.push_str("masquerade");
                if *fully_random {
                    out.push_str(" fully-random");
                }
            }
            Expr::Reject { tcp_reset } => {
                out.push_str("reject");
                if *tcp_reset {
                    out.push_str(" with tcp reset");
                }
            }
            Expr::Verdict(v) => v.write(out),
            Expr::Unknown(why) => {
                out.push_str("# ");
                out.push_str(why);
            }
        }
    }
}

/// One rule: its expressions in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Rule {
    pub exprs: Vec<Expr>,
}

impl Rule {
    pub fn new(exprs: Vec<Expr>) -> Rule {
        Rule { exprs }
    }

    /// A rule of one verdict (`jump services`, `drop`).
    pub fn verdict(v: Verdict) -> Rule {
        Rule::new(vec![Expr::Verdict(v)])
    }

    /// A rule standing for what the kernel holds and kproxy cannot read (`why`).
    pub fn unknown(why: impl Into<String>) -> Rule {
        Rule::new(vec![Expr::Unknown(why.into())])
    }

    /// Whether a part of it could not be read back.
    pub fn is_unknown(&self) -> bool {
        self.exprs.iter().any(|e| matches!(e, Expr::Unknown(_)))
    }

    /// Appends the rule as nft writes it (the body of `add rule … CHAIN`, no comment).
    pub fn write(&self, out: &mut String) {
        for (i, e) in self.exprs.iter().enumerate() {
            if i > 0 {
                out.push(' ');
            }
            e.write(out);
        }
    }

    /// The rule's `kp:` id: [`rule_id`] of its text.
    pub fn id(&self) -> String {
        rule_id(&self.to_string())
    }

    /// Whether two rules do the same: equal once both are in the kernel's terms (a
    /// one-element anonymous set is the literal, a set of addresses is the addresses it
    /// covers, `reject with tcp reset`'s `meta l4proto tcp` is implied).
    pub fn same(&self, other: &Rule) -> bool {
        !self.is_unknown() && !other.is_unknown() && self.canonical() == other.canonical()
    }

    fn canonical(&self) -> Vec<Expr> {
        let mut out: Vec<Expr> = Vec::with_capacity(self.exprs.len());
        for e in &self.exprs {
            match e {
                Expr::Match { sel, neg, rhs } => {
                    let rhs = match rhs {
                        Rhs::Lit(l) => Rhs::AnonSet(canonical_lits(std::slice::from_ref(l))),
                        Rhs::AnonSet(ls) => Rhs::AnonSet(canonical_lits(ls)),
                        Rhs::Set(s) => Rhs::Set(s.clone()),
                    };
                    out.push(Expr::Match {
                        sel: sel.clone(),
                        neg: *neg,
                        rhs,
                    });
                }
                Expr::Reject { tcp_reset: true } => {
                    // nft puts `meta l4proto tcp` before a TCP reset unless the rule
                    // already has it.
                    let tcp = Expr::Match {
                        sel: vec![Sel::L4proto],
                        neg: false,
                        rhs: Rhs::AnonSet(vec![Lit::Atom(Atom::Proto(6))]),
                    };
                    if out.last() == Some(&tcp) {
                        out.pop();
                    }
                    out.push(e.clone());
                }
                _ => out.push(e.clone()),
            }
        }
        out
    }
}

impl std::fmt::Display for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        self.write(&mut s);
        f.write_str(&s)
    }
}

/// Literals in the kernel's terms: addresses and prefixes as the fewest prefixes that
/// cover the same addresses (a full-length prefix is the address), then everything
/// sorted and each once.
fn canonical_lits(lits: &[Lit]) -> Vec<Lit> {
    let mut ranges: [Vec<(u128, u128)>; 2] = [Vec::new(), Vec::new()];
    let mut out = Vec::new();
    for l in lits {
        match l {
            Lit::Atom(Atom::Addr(ip) | Atom::Prefix(ip, _)) => {
                let v6 = ip.is_ipv6();
                match range(l, v6) {
                    Some(r) => ranges[usize::from(v6)].push(r),
                    None => out.push(l.clone()),
                }
            }
            l => out.push(l.clone()),
        }
    }
    for (v6, mut rs) in ranges.into_iter().enumerate() {
        rs.sort_unstable();
        let mut merged: Vec<(u128, u128)> = Vec::new();
        for (a, b) in rs {
            match merged.last_mut() {
                Some(last) if a <= last.1.saturating_add(1) => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        for (a, b) in merged {
            prefixes(v6 == 1, a, b, &mut out);
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The first and last address an address or prefix literal of family `v6` covers.
pub(crate) fn range(l: &Lit, v6: bool) -> Option<(u128, u128)> {
    let (ip, len) = match l {
        Lit::Atom(Atom::Addr(ip)) => (ip, None),
        Lit::Atom(Atom::Prefix(ip, len)) => (ip, Some(*len)),
        _ => return None,
    };
    let (is_v6, n) = bits(ip);
    (is_v6 == v6).then_some(())?;
    let width = if v6 { 128 } else { 32 };
    let len = len.map_or(width, |l| u32::from(l).min(width));
    let host = if len == width {
        0
    } else if width - len == 128 {
        u128::MAX
    } else {
        (1u128 << (width - len)) - 1
    };
    Some((n & !host, (n & !host) | host))
}

fn bits(ip: &IpAddr) -> (bool, u128) {
    match ip {
        IpAddr::V4(v4) => (false, u128::from(u32::from(*v4))),
        IpAddr::V6(v6) => (true, u128::from(*v6)),
    }
}

fn addr(v6: bool, n: u128) -> IpAddr {
    if v6 {
        IpAddr::V6(n.into())
    } else {
        IpAddr::V4((n as u32).into())
    }
}

/// The fewest prefixes covering `a..=b`, each as an address when it is one.
pub(crate) fn prefixes(v6: bool, mut a: u128, b: u128, out: &mut Vec<Lit>) {
    let width: u32 = if v6 { 128 } else { 32 };
    let last_of = |a: u128, host: u32| {
        if host >= 128 {
            u128::MAX
        } else {
            a | ((1u128 << host) - 1)
        }
    };
    loop {
        // The largest aligned block at `a` that ends at or before `b`.
        let mut host = if a == 0 {
            width
        } else {
            a.trailing_zeros().min(width)
        };
        while host > 0 && last_of(a, host) > b {
            host -= 1;
        }
        let last = last_of(a, host);
        out.push(ip_lit(addr(v6, a), (width - host) as u8));
        if last >= b {
            return;
        }
        a = last + 1;
    }
}

/// The literal of the prefix `ip/len`: the address itself when `len` is its length.
pub(crate) fn ip_lit(ip: IpAddr, len: u8) -> Lit {
    let full = if ip.is_ipv6() { 128 } else { 32 };
    Lit::Atom(if len >= full {
        Atom::Addr(ip)
    } else {
        Atom::Prefix(ip, len)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Lit {
        let n: ipnet::IpNet = s.parse().unwrap();
        ip_lit(n.addr(), n.prefix_len())
    }

    #[test]
    fn address_literals_compare_by_what_they_cover() {
        let a = canonical_lits(&[p("10.0.0.0/25"), p("10.0.0.128/25")]);
        assert_eq!(a, vec![p("10.0.0.0/24")]);
        let b = canonical_lits(&[p("10.0.0.5/32")]);
        assert_eq!(b, vec![Lit::Atom(Atom::Addr("10.0.0.5".parse().unwrap()))]);
        let c = canonical_lits(&[p("10.96.0.5/16")]);
        assert_eq!(c, vec![p("10.96.0.0/16")]);
        let d = canonical_lits(&[p("0.0.0.0/0")]);
        assert_eq!(d, vec![p("0.0.0.0/0")]);
        let e = canonical_lits(&[p("::/0")]);
        assert_eq!(e, vec![p("::/0")]);
        let f = canonical_lits(&[p("10.0.0.1/32"), p("10.0.0.2/32")]);
        assert_eq!(f, vec![p("10.0.0.1/32"), p("10.0.0.2/32")]);
        let g = canonical_lits(&[p("255.255.255.255/32")]);
        assert_eq!(g, vec![p("255.255.255.255/32")]);
    }

    #[test]
    fn a_tcp_reset_implies_its_protocol_match() {
        let tcp = Expr::Match {
            sel: vec![Sel::L4proto],
            neg: false,
            rhs: Rhs::Lit(Lit::Atom(Atom::Proto(6))),
        };
        let reset = Expr::Reject { tcp_reset: true };
        let a = Rule::new(vec![tcp.clone(), reset.clone()]);
        let b = Rule::new(vec![reset]);
        assert!(a.same(&b));
        assert!(!a.same(&Rule::new(vec![tcp, Expr::Reject { tcp_reset: false }])));
        assert!(!Rule::unknown("x").same(&Rule::unknown("x")));
    }
}
