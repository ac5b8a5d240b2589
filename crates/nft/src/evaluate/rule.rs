//! The rules kproxy writes (`crate::ruleset`), parsed into the expressions the
//! evaluator runs: matches of selectors (addresses, protocol, port, interface name,
//! `fib … type local`, `ct status`, `numgen`, the mark) against literals, anonymous
//! sets or named sets, and the statements (mark, verdict maps, dispatch maps, DNAT,
//! masquerade, reject, verdicts). Anything else parses to `None`: the evaluator says
//! it cannot tell rather than guess.

use std::net::IpAddr;

use kproxy_core::model::EndpointAddr;

use crate::model::{self, Atom};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dir {
    Src,
    Dst,
}

/// A selector: what a match or a lookup key reads from the packet or its state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sel {
    Saddr,
    Daddr,
    L4proto,
    Dport,
    Iifname,
    /// `fib saddr|daddr type`: `local` or not.
    FibLocal(Dir),
    /// `ct status`: `dnat` or not.
    CtStatusDnat,
    /// `numgen random mod N`.
    Numgen(u32),
    /// `meta mark & M`.
    MarkAnd(u32),
}

/// A selector's value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Val {
    Atom(Atom),
    Str(String),
    /// `local` / `dnat`, or "" when not.
    Word(&'static str),
}

/// A literal on the right of a match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Lit {
    Atom(Atom),
    /// An `iifname` pattern (`"veth*"` matches by prefix).
    Str(String),
    Word(String),
    Num(u32),
}

impl Lit {
    pub(super) fn matches(&self, v: &Val) -> bool {
        match (self, v) {
            (Lit::Atom(Atom::Prefix(net, len)), Val::Atom(Atom::Addr(ip))) => {
                ipnet::IpNet::new(*net, *len).is_ok_and(|n| n.contains(ip))
            }
            (Lit::Atom(a), Val::Atom(b)) => a == b,
            (Lit::Num(n), Val::Atom(Atom::Port(p))) => *n == u32::from(*p),
            (Lit::Num(n), Val::Atom(Atom::Proto(p))) => *n == u32::from(*p),
            (Lit::Num(n), Val::Atom(Atom::Index(i))) => n == i,
            (Lit::Str(pat), Val::Str(s)) => match pat.strip_suffix('*') {
                Some(prefix) => s.starts_with(prefix),
                None => s == pat,
            },
            (Lit::Word(w), Val::Word(v)) => w == v,
            _ => false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Rhs {
    Set(String),
    /// One literal, or an anonymous set `{ a, b }`: any of them.
    Lits(Vec<Lit>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Expr {
    Match {
        sel: Vec<Sel>,
        neg: bool,
        rhs: Rhs,
    },
    MarkOr(u32),
    MarkXor(u32),
    /// `update @set { … }`: fills a dynamic set; no effect on this connection's fate.
    Update,
    Vmap {
        sel: Vec<Sel>,
        set: String,
    },
    DnatMap {
        sel: Vec<Sel>,
        set: String,
    },
    DnatTo(EndpointAddr),
    Verdict(model::Verdict),
    Reject,
    Masquerade,
}

/// Words of a rule; `{ … }` is one token (its inside, commas as spaces).
fn tokens(text: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('{') {
            let end = r.find('}')?;
            out.push(format!("{{{}", r[..end].replace(',', " ")));
            rest = r[end + 1..].trim_start();
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            out.push(rest[..end].to_string());
            rest = rest[end..].trim_start();
        }
    }
    Some(out)
}

fn number(s: &str) -> Option<u32> {
    match s.strip_prefix("0x") {
        Some(h) => u32::from_str_radix(h, 16).ok(),
        None => s.parse().ok(),
    }
}

fn lit(s: &str) -> Option<Lit> {
    if let Some(q) = s.strip_prefix('"') {
        return Some(Lit::Str(q.strip_suffix('"')?.to_string()));
    }
    Some(match s {
        "tcp" => Lit::Atom(Atom::Proto(6)),
        "udp" => Lit::Atom(Atom::Proto(17)),
        "sctp" => Lit::Atom(Atom::Proto(132)),
        "local" | "dnat" => Lit::Word(s.to_string()),
        _ => {
            if let Ok(ip) = s.parse::<IpAddr>() {
                Lit::Atom(Atom::Addr(ip))
            } else if let Ok(n) = s.parse::<ipnet::IpNet>() {
                Lit::Atom(Atom::Prefix(n.addr(), n.prefix_len()))
            } else {
                Lit::Num(number(s)?)
            }
        }
    })
}

/// A rule's words, read left to right.
struct Words<'a> {
    t: Vec<&'a str>,
    i: usize,
}

impl<'a> Words<'a> {
    fn peek(&self, k: usize) -> Option<&'a str> {
        self.t.get(self.i + k).copied()
    }

    fn next(&mut self) -> Option<&'a str> {
        let w = self.peek(0)?;
        self.i += 1;
        Some(w)
    }

    /// Takes the next word if it is `w`.
    fn take(&mut self, w: &str) -> bool {
        let hit = self.peek(0) == Some(w);
        if hit {
            self.i += 1;
        }
        hit
    }

    /// The next word, which must be `w`.
    fn expect(&mut self, w: &str) -> Option<()> {
        self.take(w).then_some(())
    }

    /// `@name`.
    fn set(&mut self) -> Option<String> {
        Some(self.next()?.strip_prefix('@')?.to_string())
    }
}

/// A rule of kproxy's vocabulary as expressions; `None` for anything else.
pub(super) fn parse(text: &str) -> Option<Vec<Expr>> {
    let toks = tokens(text)?;
    let mut w = Words {
        t: toks.iter().map(String::as_str).collect(),
        i: 0,
    };
    let mut out = Vec::new();
    while let Some(word) = w.peek(0) {
        match word {
            "drop" | "accept" | "return" | "continue" => {
                w.next();
                out.push(Expr::Verdict(model::Verdict::parse(word)?));
            }
            "goto" | "jump" => {
                w.next();
                let to = w.next()?;
                out.push(Expr::Verdict(model::Verdict::parse(&format!(
                    "{word} {to}"
                ))?));
            }
            "reject" => {
                w.next();
                if w.take("with") {
                    w.expect("tcp")?;
                    w.expect("reset")?;
                }
                out.push(Expr::Reject);
            }
            "masquerade" => {
                w.next();
                w.take("fully-random");
                out.push(Expr::Masquerade);
            }
            "update" => {
                // `update @set { ip saddr }`
                w.next();
                w.set()?;
                w.next()?.strip_prefix('{')?;
                out.push(Expr::Update);
            }
            "dnat" => {
                w.next();
                if !w.take("ip") {
                    w.take("ip6");
                }
                w.expect("to")?;
                if let Ok(sa) = w.peek(0)?.parse::<std::net::SocketAddr>() {
                    w.next();
                    out.push(Expr::DnatTo(EndpointAddr::new(sa.ip(), sa.port())));
                } else {
                    let sel = selectors(&mut w)?;
                    w.expect("map")?;
                    out.push(Expr::DnatMap { sel, set: w.set()? });
                }
            }
            "meta" if w.peek(1) == Some("mark") && w.peek(2) == Some("set") => {
                // `meta mark set meta mark | M` / `^ M`
                w.i += 3;
                w.expect("meta")?;
                w.expect("mark")?;
                let op = w.next()?;
                let m = number(w.next()?)?;
                out.push(match op {
                    "|" => Expr::MarkOr(m),
                    "^" => Expr::MarkXor(m),
                    _ => return None,
                });
            }
            _ => {
                let sel = selectors(&mut w)?;
                if w.take("vmap") {
                    out.push(Expr::Vmap { sel, set: w.set()? });
                    continue;
                }
                let neg = w.take("!=");
                if !neg {
                    w.take("==");
                }
                let r = w.next()?;
                let rhs = if let Some(set) = r.strip_prefix('@') {
                    Rhs::Set(set.to_string())
                } else if let Some(inner) = r.strip_prefix('{') {
                    Rhs::Lits(inner.split_whitespace().map(lit).collect::<Option<_>>()?)
                } else {
                    Rhs::Lits(vec![lit(r)?])
                };
                out.push(Expr::Match { sel, neg, rhs });
            }
        }
    }
    Some(out)
}

/// A concatenation `s . s . s` of selectors.
fn selectors(w: &mut Words) -> Option<Vec<Sel>> {
    let mut sel = Vec::new();
    loop {
        let s = match w.next()? {
            "ip" | "ip6" => match w.next()? {
                "saddr" => Sel::Saddr,
                "daddr" => Sel::Daddr,
                _ => return None,
            },
            "meta" => match w.next()? {
                "l4proto" => Sel::L4proto,
                "mark" => {
                    w.expect("&")?;
                    Sel::MarkAnd(number(w.next()?)?)
                }
                _ => return None,
            },
            "th" => {
                w.expect("dport")?;
                Sel::Dport
            }
            "iifname" => Sel::Iifname,
            "fib" => {
                let dir = match w.next()? {
                    "saddr" => Dir::Src,
                    "daddr" => Dir::Dst,
                    _ => return None,
                };
                w.expect("type")?;
                Sel::FibLocal(dir)
            }
            "ct" => {
                w.expect("status")?;
                Sel::CtStatusDnat
            }
            "numgen" => {
                w.expect("random")?;
                w.expect("mod")?;
                Sel::Numgen(number(w.next()?)?)
            }
            _ => return None,
        };
        sel.push(s);
        if !w.take(".") {
            return Some(sel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rule kproxy writes parses; anything else does not (and is `Unknown`).
    #[test]
    fn kproxy_s_rule_vocabulary_parses() {
        for r in [
            "jump services",
            "fib daddr type local ip daddr != 127.0.0.0/8 ip daddr { 10.0.0.0/8, 192.168.0.0/16 } meta l4proto . th dport @masq-nodeports meta mark set meta mark | 0x4000",
            "ip6 daddr @cluster-ips meta l4proto tcp reject with tcp reset",
            "ip daddr { 203.0.113.10 } th dport 80 ip saddr != { 10.0.0.0/8 } drop",
            "iifname != \"kpv*\" ip daddr . meta l4proto . th dport @masq-ips-nonlocal meta mark set meta mark | 0x4000",
            "iifname \"cbr0\" goto disp-l-1",
            "dnat ip6 to meta l4proto . th dport . numgen random mod 3 map @npdnat-c-3",
            "ip saddr @aff-x meta mark set meta mark | 0x4000 update @aff-x { ip saddr } meta l4proto tcp dnat to 10.244.1.2:8080",
            "update @aff-y { ip6 saddr } meta l4proto udp dnat to [fd00::1]:53",
            "numgen random mod 2 0 goto aep-x",
            "ip saddr @local-pods goto no-endpoints-tcp",
        ] {
            assert!(parse(r).is_some(), "{r}");
        }
        for r in [
            "# rules read from the kernel that kproxy did not write",
            "counter",
            "ip daddr {",
            "dnat to",
            "meta mark set 1",
        ] {
            assert!(parse(r).is_none(), "{r}");
        }
    }
}
