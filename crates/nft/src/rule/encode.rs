//! A typed [`Rule`] encoded as the kernel's expressions (`NFTA_RULE_EXPRESSIONS`), as
//! `nft` encodes the same rule: the same expressions, registers and data, so that
//! the readers' decoder (`crate::dump::rule`) reads either back into the same value. The one encoder of rules;
//! its inverse is the decoder, and a test holds both to the kernel's own dump of what
//! `nft -f` wrote.
//!
//! An anonymous set (`ip daddr { a, b }`) is not an expression: the rule looks it up by
//! name, and the set with its elements must be created in the same batch before the
//! rule. [`encode`] returns them ([`AnonymousSet`]) beside the expressions.

use std::net::IpAddr;

use crate::atom::{Atom, Family, Field, datatype};
// The kernel's vocabulary: every constant, and the reading of attributes, is the floor's.
use crate::nfnl::*;

use super::{Dir, Expr, Lit, Rhs, Rule, Sel, addr_len, addr_offset};

/// An anonymous set a rule looks up: created (constant) in the rule's batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AnonymousSet {
    /// `__set%d`: the kernel names it when it is added.
    pub name: String,
    /// The id the rule's lookup refers to within the batch.
    pub id: u32,
    /// Bytes of a key.
    pub key_len: u32,
    /// nft's datatype of the key (`ipv4_addr` 7, `ipv6_addr` 8, …).
    pub key_type: u32,
    /// Prefixes or ranges: the elements are interval starts and ends.
    pub interval: bool,
    /// Each element's key, with its `NFT_SET_ELEM_INTERVAL_END` flag.
    pub elements: Vec<(Vec<u8>, bool)>,
}

/// Expressions being written, with the anonymous sets they need.
struct Enc<'a> {
    family: Family,
    buf: Vec<u8>,
    sets: Vec<AnonymousSet>,
    /// The next anonymous set's id.
    next_id: &'a mut u32,
}

/// `rule` of a table of `family` as expressions; the anonymous sets it looks up are
/// numbered from `*next_id` on (each batch counts its own). `None` for a rule holding
/// an [`Expr::Unknown`] (read back, never written).
pub fn encode(
    rule: &Rule,
    family: Family,
    next_id: &mut u32,
) -> Option<(Vec<u8>, Vec<AnonymousSet>)> {
    let mut e = Enc {
        family,
        buf: Vec::new(),
        sets: Vec::new(),
        next_id,
    };
    let tcp = Expr::Match {
        sel: vec![Sel::L4proto],
        neg: false,
        rhs: Rhs::Lit(Lit::Atom(Atom::Proto(6))),
    };
    for (i, x) in rule.exprs.iter().enumerate() {
        // nft's dependency of a TCP reset, unless the rule matches TCP before it.
        if *x == (Expr::Reject { tcp_reset: true }) && !rule.exprs[..i].contains(&tcp) {
            e.expr(&tcp)?;
        }
        e.expr(x)?;
    }
    Some((e.buf, e.sets))
}

/// The netlink register that holds 4-byte slot `slot` (as the kernel reports it:
/// `NFT_REG_1..4` for a slot on a 16-byte boundary, else `NFT_REG32_00 + slot`).
fn reg(slot: usize) -> u32 {
    if slot.is_multiple_of(4) {
        (slot / 4 + 1) as u32
    } else {
        (8 + slot) as u32
    }
}

fn put_attr(buf: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    buf.extend_from_slice(&(len as u16).to_ne_bytes());
    buf.extend_from_slice(&kind.to_ne_bytes());
    buf.extend_from_slice(data);
    buf.resize(buf.len().next_multiple_of(4), 0);
}

fn begin(buf: &mut Vec<u8>, kind: u16) -> usize {
    let at = buf.len();
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(&(kind | NLA_F_NESTED).to_ne_bytes());
    at
}

fn end(buf: &mut [u8], at: usize) {
    let len = (buf.len() - at) as u16;
    buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
}

/// One expression's attributes.
#[derive(Default)]
struct Attrs(Vec<u8>);

impl Attrs {
    fn u32(mut self, kind: u16, v: u32) -> Attrs {
        put_attr(&mut self.0, kind, &v.to_be_bytes());
        self
    }
    fn str(mut self, kind: u16, s: &str) -> Attrs {
        let mut b = s.as_bytes().to_vec();
        b.push(0);
        put_attr(&mut self.0, kind, &b);
        self
    }
    fn data(mut self, kind: u16, v: &[u8]) -> Attrs {
        let at = begin(&mut self.0, kind);
        put_attr(&mut self.0, NFTA_DATA_VALUE, v);
        end(&mut self.0, at);
        self
    }
    fn verdict(mut self, kind: u16, v: &crate::atom::Verdict) -> Attrs {
        let (code, chain) = v.netlink();
        let at = begin(&mut self.0, kind);
        let inner = begin(&mut self.0, NFTA_DATA_VERDICT);
        put_attr(&mut self.0, NFTA_VERDICT_CODE, &code.to_be_bytes());
        if let Some(c) = chain {
            let mut b = c.as_bytes().to_vec();
            b.push(0);
            put_attr(&mut self.0, NFTA_VERDICT_CHAIN, &b);
        }
        end(&mut self.0, inner);
        end(&mut self.0, at);
        self
    }
}

impl Enc<'_> {
    fn push(&mut self, name: &str, attrs: Attrs) {
        let elem = begin(&mut self.buf, NFTA_LIST_ELEM);
        let mut n = name.as_bytes().to_vec();
        n.push(0);
        put_attr(&mut self.buf, NFTA_EXPR_NAME, &n);
        let data = begin(&mut self.buf, NFTA_EXPR_DATA);
        self.buf.extend_from_slice(&attrs.0);
        end(&mut self.buf, data);
        end(&mut self.buf, elem);
    }

    fn addr_len(&self) -> usize {
        addr_len(self.family)
    }

    fn addr_offset(&self, dir: Dir) -> u32 {
        addr_offset(self.family, dir)
    }

    /// Bytes a selector loads.
    fn sel_len(&self, s: &Sel) -> usize {
        match s {
            Sel::Addr(..) => self.addr_len(),
            Sel::L4proto => 1,
            Sel::Dport => 2,
            Sel::Iifname => 16,
            Sel::FibType(_) | Sel::CtStatus | Sel::Numgen(_) | Sel::MarkAnd(_) => 4,
            Sel::CtOrigDaddr(f) => addr_len(*f),
            Sel::CtOrigDport => 2,
        }
    }

    /// Loads `s` (`len` bytes of it, for an address prefix) into slot `slot`.
    fn load(&mut self, s: &Sel, slot: usize, len: usize) -> Option<()> {
        let r = reg(slot);
        match s {
            Sel::Addr(f, d) => {
                (*f == self.family).then_some(())?;
                let a = Attrs::default()
                    .u32(1, r)
                    .u32(2, NFT_PAYLOAD_NETWORK_HEADER)
                    .u32(3, self.addr_offset(*d))
                    .u32(4, len as u32);
                self.push("payload", a);
            }
            Sel::Dport => {
                // The destination port: 2 bytes at offset 2 of the transport header.
                let a = Attrs::default()
                    .u32(1, r)
                    .u32(2, NFT_PAYLOAD_TRANSPORT_HEADER)
                    .u32(3, 2)
                    .u32(4, 2);
                self.push("payload", a);
            }
            Sel::L4proto => {
                let a = Attrs::default().u32(1, r).u32(2, NFT_META_L4PROTO);
                self.push("meta", a);
            }
            Sel::Iifname => {
                let a = Attrs::default().u32(1, r).u32(2, NFT_META_IIFNAME);
                self.push("meta", a);
            }
            Sel::FibType(d) => {
                let flags = match d {
                    Dir::Src => NFTA_FIB_F_SADDR,
                    Dir::Dst => NFTA_FIB_F_DADDR,
                };
                let a = Attrs::default()
                    .u32(1, r)
                    .u32(2, NFT_FIB_RESULT_ADDRTYPE)
                    .u32(3, flags);
                self.push("fib", a);
            }
            Sel::CtStatus => {
                self.push("ct", Attrs::default().u32(1, r).u32(2, NFT_CT_STATUS));
                self.bitwise(r, &IPS_DST_NAT.to_ne_bytes(), &[0; 4]);
            }
            Sel::Numgen(n) => {
                let a = Attrs::default()
                    .u32(1, r)
                    .u32(2, *n)
                    .u32(3, NFT_NG_RANDOM)
                    .u32(4, 0);
                self.push("numgen", a);
            }
            Sel::MarkAnd(m) => {
                self.push("meta", Attrs::default().u32(1, r).u32(2, NFT_META_MARK));
                self.bitwise(r, &m.to_ne_bytes(), &[0; 4]);
            }
            Sel::CtOrigDaddr(f) => {
                (*f == self.family).then_some(())?;
                let key = match f {
                    Family::Ip => NFT_CT_DST_IP,
                    Family::Ip6 => NFT_CT_DST_IP6,
                };
                self.ct_original(r, key);
            }
            Sel::CtOrigDport => self.ct_original(r, NFT_CT_PROTO_DST),
        }
        Some(())
    }

    /// `ct original KEY` into `r`: the direction is one byte (`IP_CT_DIR_ORIGINAL`).
    fn ct_original(&mut self, r: u32, key: u32) {
        let mut a = Attrs::default().u32(1, r).u32(2, key);
        put_attr(&mut a.0, 3, &[0]);
        self.push("ct", a);
    }

    fn bitwise(&mut self, r: u32, mask: &[u8], xor: &[u8]) {
        let a = Attrs::default()
            .u32(1, r)
            .u32(2, r)
            .u32(3, mask.len() as u32)
            .data(4, mask)
            .data(5, xor);
        self.push("bitwise", a);
    }

    /// Loads a concatenation from slot 0 on; the key's length in bytes.
    fn load_concat(&mut self, sel: &[Sel]) -> Option<usize> {
        let mut slot = 0;
        let mut total = 0;
        for s in sel {
            let len = self.sel_len(s);
            self.load(s, slot, len)?;
            slot += len.div_ceil(4);
            total = if sel.len() == 1 {
                len
            } else {
                total + len.next_multiple_of(4)
            };
        }
        Some(total)
    }

    fn cmp(&mut self, neg: bool, data: &[u8]) {
        let op = if neg { NFT_CMP_NEQ } else { NFT_CMP_EQ };
        let a = Attrs::default().u32(1, reg(0)).u32(2, op).data(3, data);
        self.push("cmp", a);
    }

    fn expr(&mut self, x: &Expr) -> Option<()> {
        match x {
            Expr::Match { sel, neg, rhs } => self.matches(sel, *neg, rhs)?,
            Expr::Vmap { sel, map } => {
                self.load_concat(sel)?;
                let a = Attrs::default().str(1, map).u32(2, reg(0)).u32(3, 0);
                self.push("lookup", a);
            }
            Expr::CounterMap { sel, map } => {
                self.load_concat(sel)?;
                // NFTA_OBJREF_SET_SREG, NFTA_OBJREF_SET_NAME.
                let a = Attrs::default().u32(3, reg(0)).str(4, map);
                self.push("objref", a);
            }
            Expr::CounterRef(name) => {
                // NFTA_OBJREF_IMM_TYPE (a counter), NFTA_OBJREF_IMM_NAME.
                let a = Attrs::default().u32(1, NFT_OBJECT_COUNTER).str(2, name);
                self.push("objref", a);
            }
            Expr::MarkOr(m) | Expr::MarkXor(m) => {
                let mask = if matches!(x, Expr::MarkOr(_)) {
                    !m
                } else {
                    u32::MAX
                };
                let load = Attrs::default().u32(1, reg(0)).u32(2, NFT_META_MARK);
                self.push("meta", load);
                self.bitwise(reg(0), &mask.to_ne_bytes(), &m.to_ne_bytes());
                let set = Attrs::default().u32(2, NFT_META_MARK).u32(3, reg(0));
                self.push("meta", set);
            }
            Expr::Update { set, key } => {
                let len = self.sel_len(key);
                self.load(key, 0, len)?;
                let a = Attrs::default()
                    .str(1, set)
                    .u32(3, NFT_DYNSET_OP_UPDATE)
                    .u32(4, reg(0));
                self.push("dynset", a);
            }
            Expr::DnatMap { family, sel, map } => {
                (*family == self.family).then_some(())?;
                self.load_concat(sel)?;
                let a = Attrs::default().str(1, map).u32(2, reg(0)).u32(3, reg(0));
                self.push("lookup", a);
                let port = reg(self.addr_len() / 4);
                self.nat(reg(0), port, None);
            }
            Expr::DnatTo(ep) => {
                let ip = match ep.ip {
                    IpAddr::V4(v4) if self.family == Family::Ip => v4.octets().to_vec(),
                    IpAddr::V6(v6) if self.family == Family::Ip6 => v6.octets().to_vec(),
                    _ => return None,
                };
                self.push("immediate", Attrs::default().u32(1, reg(0)).data(2, &ip));
                self.push(
                    "immediate",
                    Attrs::default()
                        .u32(1, reg(4))
                        .data(2, &ep.port.to_be_bytes()),
                );
                self.nat(reg(0), reg(4), Some(NF_NAT_RANGE_PROTO_SPECIFIED));
            }
            Expr::Masquerade { fully_random } => {
                let a = if *fully_random {
                    Attrs::default().u32(1, NF_NAT_RANGE_PROTO_RANDOM_FULLY)
                } else {
                    Attrs::default()
                };
                self.push("masq", a);
            }
            Expr::Reject { tcp_reset } => {
                let (ty, code) = match (tcp_reset, self.family) {
                    (true, _) => (NFT_REJECT_TCP_RST, 0),
                    (false, Family::Ip) => (NFT_REJECT_ICMP_UNREACH, ICMP_PORT_UNREACH),
                    (false, Family::Ip6) => (NFT_REJECT_ICMP_UNREACH, ICMPV6_PORT_UNREACH),
                };
                let mut a = Attrs::default().u32(1, ty);
                put_attr(&mut a.0, 2, &[code]);
                self.push("reject", a);
            }
            Expr::Verdict(v) => {
                let a = Attrs::default().u32(1, 0).verdict(2, v);
                self.push("immediate", a);
            }
            Expr::Unknown(_) => return None,
        }
        Some(())
    }

    fn nat(&mut self, addr: u32, port: u32, flags: Option<u32>) {
        let family = u32::from(self.family.nfproto());
        let mut a = Attrs::default()
            .u32(1, NFT_NAT_DNAT)
            .u32(2, family)
            .u32(3, addr)
            .u32(5, port);
        if let Some(f) = flags {
            a = a.u32(7, f);
        }
        self.push("nat", a);
    }

    fn matches(&mut self, sel: &[Sel], neg: bool, rhs: &Rhs) -> Option<()> {
        let lits: &[Lit] = match rhs {
            Rhs::Set(set) => {
                self.load_concat(sel)?;
                let mut a = Attrs::default().str(1, set).u32(2, reg(0));
                if neg {
                    a = a.u32(5, NFT_LOOKUP_F_INV);
                }
                self.push("lookup", a);
                return Some(());
            }
            Rhs::Lit(l) => std::slice::from_ref(l),
            Rhs::AnonSet(ls) => ls,
        };
        let [s] = sel else { return None };
        // One element is compared, as nft does with a one-element set.
        if let [l] = lits {
            return self.compare(s, neg, l);
        }
        self.anonymous(s, neg, lits)
    }

    /// `SEL [!=] LIT` as a load and a `cmp` (a prefix loads only its bytes, or masks).
    fn compare(&mut self, s: &Sel, neg: bool, l: &Lit) -> Option<()> {
        match (s, l) {
            (Sel::Addr(..), Lit::Atom(Atom::Addr(ip))) => {
                self.load(s, 0, self.addr_len())?;
                self.cmp(neg, &ip_bytes(ip));
            }
            (Sel::Addr(..), Lit::Atom(Atom::Prefix(ip, len))) => {
                let len = usize::from(*len);
                let full = self.addr_len();
                let bytes = ip_bytes(ip);
                (bytes.len() == full && len <= full * 8).then_some(())?;
                if len == full * 8 {
                    self.load(s, 0, full)?;
                    self.cmp(neg, &bytes);
                } else if len.is_multiple_of(8) {
                    self.load(s, 0, len / 8)?;
                    self.cmp(neg, &bytes[..len / 8]);
                } else {
                    // As nft does: the whole address loaded and masked (not the bytes
                    // the prefix covers), so nft lists it as a prefix.
                    let n = full;
                    let mut mask = vec![0u8; n];
                    for (i, m) in mask.iter_mut().enumerate() {
                        let bits = len.saturating_sub(i * 8).min(8);
                        *m = (0xff00u16 >> bits) as u8;
                    }
                    let value: Vec<u8> = bytes[..n].iter().zip(&mask).map(|(b, m)| b & m).collect();
                    self.load(s, 0, n)?;
                    self.bitwise(reg(0), &mask, &vec![0; n]);
                    self.cmp(neg, &value);
                }
            }
            (Sel::Dport, Lit::Atom(Atom::Port(p))) => {
                self.load(s, 0, 2)?;
                self.cmp(neg, &p.to_be_bytes());
            }
            (Sel::L4proto, Lit::Atom(Atom::Proto(p))) => {
                self.load(s, 0, 1)?;
                self.cmp(neg, &[*p]);
            }
            (Sel::Iifname, Lit::Iface(name)) => {
                self.load(s, 0, 16)?;
                match name.strip_suffix('*') {
                    Some(prefix) => self.cmp(neg, prefix.as_bytes()),
                    None => {
                        let mut b = name.as_bytes().to_vec();
                        (b.len() < 16).then_some(())?;
                        b.resize(16, 0);
                        self.cmp(neg, &b);
                    }
                }
            }
            (Sel::FibType(_), Lit::Local) => {
                self.load(s, 0, 4)?;
                self.cmp(neg, &RTN_LOCAL.to_ne_bytes());
            }
            (Sel::CtStatus, Lit::Dnat) => {
                self.load(s, 0, 4)?;
                // `ct status dnat` is `(status & dnat) != 0`.
                self.cmp(!neg, &[0; 4]);
            }
            (Sel::MarkAnd(_) | Sel::Numgen(_), Lit::Num(n)) => {
                self.load(s, 0, 4)?;
                self.cmp(neg, &n.to_ne_bytes());
            }
            _ => return None,
        }
        Some(())
    }

    /// `SEL [!=] { LITS }`: a lookup in a new anonymous set.
    fn anonymous(&mut self, s: &Sel, neg: bool, lits: &[Lit]) -> Option<()> {
        let id = *self.next_id;
        *self.next_id += 1;
        let name = format!("__set{id}");
        let key_len = self.sel_len(s);
        let (key_type, interval, elements) = match s {
            Sel::Addr(f, _) => {
                let v6 = *f == Family::Ip6;
                let interval = lits
                    .iter()
                    .any(|l| matches!(l, Lit::Atom(Atom::Prefix(..))));
                let mut els = Vec::new();
                if interval {
                    let mut ranges = Vec::new();
                    for l in lits {
                        ranges.push(super::range(l, v6)?);
                    }
                    ranges.sort_unstable();
                    // nft's marker below the first interval, when it does not start at 0.
                    if ranges.first().is_some_and(|r| r.0 != 0) {
                        els.push((vec![0; key_len], true));
                    }
                    for (a, b) in ranges {
                        els.push((num_bytes(a, v6), false));
                        if let Some(next) = b
                            .checked_add(1)
                            .filter(|n| v6 || *n <= u128::from(u32::MAX))
                        {
                            els.push((num_bytes(next, v6), true));
                        }
                    }
                } else {
                    for l in lits {
                        let Lit::Atom(Atom::Addr(ip)) = l else {
                            return None;
                        };
                        els.push((ip_bytes(ip), false));
                    }
                }
                let field = if v6 { Field::Ipv6Addr } else { Field::Ipv4Addr };
                (datatype(field), interval, els)
            }
            _ => return None,
        };
        self.sets.push(AnonymousSet {
            name: name.clone(),
            id,
            key_len: key_len as u32,
            key_type,
            interval,
            elements,
        });
        self.load(s, 0, key_len)?;
        let mut a = Attrs::default().str(1, &name).u32(2, reg(0)).u32(4, id);
        if neg {
            a = a.u32(5, NFT_LOOKUP_F_INV);
        }
        self.push("lookup", a);
        Some(())
    }
}

fn ip_bytes(ip: &IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    }
}

fn num_bytes(n: u128, v6: bool) -> Vec<u8> {
    if v6 {
        n.to_be_bytes().to_vec()
    } else {
        (n as u32).to_be_bytes().to_vec()
    }
}
