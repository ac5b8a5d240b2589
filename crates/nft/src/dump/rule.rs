//! The kernel's expressions of a rule (`NFTA_RULE_EXPRESSIONS` of a GETRULE dump,
//! [`super::read_table`]) back into a typed [`Rule`]: the inverse of what `nft` (or kproxy's
//! encoder) makes of the rules kproxy writes. It runs the expressions over a model of
//! the registers, so a match reads what its source register really holds: a rule that
//! loads one field and compares another is not mistaken for kproxy's.
//!
//! Anything outside kproxy's vocabulary (another expression, a flag or an operation
//! kproxy never uses, a register that holds nothing known) becomes an
//! [`Expr::Unknown`] naming it; such a rule is never the same as a wanted one.
//!
//! With the readers, not with the typed rule: it reads the dump's raw tables (the sets a
//! lookup names), so it stands above them, and the rule (`crate::rule`) stays below the
//! table model that holds it. Its inverse, the encoder, is `crate::rule::encode`; both
//! name the kernel's constants from `crate::nfnl`.

use crate::atom::{Atom, Family, Field, Verdict};
// The kernel's vocabulary: every constant, and the reading of attributes, is the floor's.
use crate::nfnl::*;
use crate::rule::{Dir, Expr, Lit, Rhs, Rule, Sel, addr_len, addr_offset, ip_lit, prefixes};
use kproxy_core::model::EndpointAddr;

use super::{RawSet, RawTable, decode_tuple, interval_ranges};

/// What the kernel sets itself for a DNAT to an address and a port.
const NAT_PLAIN_FLAGS: u32 = NF_NAT_RANGE_MAP_IPS | NF_NAT_RANGE_PROTO_SPECIFIED;

/// What a loading expression put in a register.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Load {
    Payload {
        base: u32,
        offset: u32,
    },
    Meta(u32),
    Ct(u32),
    /// `ct original KEY`.
    CtOrig(u32),
    Fib {
        flags: u32,
        result: u32,
    },
    Numgen(u32),
}

/// One 4-byte register slot.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Reg {
    /// The start of a loaded value of `len` bytes, masked when a bitwise ran on it.
    Value {
        load: Load,
        len: usize,
        bitwise: Option<(Vec<u8>, Vec<u8>)>,
    },
    /// An immediate's bytes.
    Data(Vec<u8>),
    /// Part `part` of the value a map lookup found (`map`, keyed by `sel`).
    Mapped {
        map: String,
        sel: Vec<Sel>,
        part: usize,
    },
    /// Covered by the value that starts in an earlier slot.
    Rest,
}

/// 16 slots of 4 bytes (`NFT_REG_1..4` are four slots each, `NFT_REG32_00..15` one).
struct Regs([Option<Reg>; 16]);

fn slot(reg: u32) -> Option<usize> {
    match reg {
        1..=4 => Some((reg as usize - 1) * 4),
        8..=23 => Some(reg as usize - 8),
        _ => None,
    }
}

impl Regs {
    fn put(&mut self, reg: u32, value: Reg, len: usize) -> Option<()> {
        let s = slot(reg)?;
        let n = len.div_ceil(4).max(1);
        if s + n > 16 {
            return None;
        }
        self.0[s] = Some(value);
        for r in &mut self.0[s + 1..s + n] {
            *r = Some(Reg::Rest);
        }
        Some(())
    }

    fn get(&self, reg: u32) -> Option<&Reg> {
        self.0.get(slot(reg)?)?.as_ref()
    }

    fn get_mut(&mut self, reg: u32) -> Option<&mut Reg> {
        self.0.get_mut(slot(reg)?)?.as_mut()
    }

    /// The loaded values a key of `key_len` bytes at `reg` is made of (a concatenation
    /// pads each to 4 bytes).
    fn concat(&self, reg: u32, key_len: usize) -> Option<Vec<(&Load, usize)>> {
        let mut at = slot(reg)?;
        let mut covered = 0;
        let mut out = Vec::new();
        while covered < key_len {
            match self.0.get(at)?.as_ref()? {
                Reg::Value {
                    load,
                    len,
                    bitwise: None,
                } => {
                    out.push((load, *len));
                    covered += len.next_multiple_of(4);
                    at += len.div_ceil(4);
                }
                _ => return None,
            }
        }
        let fits = match out.as_slice() {
            [(_, len)] => *len == key_len,
            _ => covered == key_len,
        };
        fits.then_some(out)
    }
}

/// The attributes of an expression's data, by type (the last of each).
struct Data<'a>(Vec<(u16, &'a [u8])>);

impl<'a> Data<'a> {
    fn new(b: &'a [u8]) -> Data<'a> {
        Data(Attrs(b).collect())
    }
    fn raw(&self, t: u16) -> Option<&'a [u8]> {
        self.0.iter().rev().find(|(k, _)| *k == t).map(|(_, v)| *v)
    }
    fn u32(&self, t: u16) -> Option<u32> {
        be32(self.raw(t)?)
    }
    fn has(&self, t: u16) -> bool {
        self.raw(t).is_some()
    }
    fn string(&self, t: u16) -> Option<String> {
        let b = self.raw(t)?;
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8(b[..end].to_vec()).ok()
    }
    /// A nested `NFTA_DATA_VALUE`.
    fn value(&self, t: u16) -> Option<&'a [u8]> {
        Attrs(self.raw(t)?)
            .find(|(k, _)| *k == NFTA_DATA_VALUE)
            .map(|(_, v)| v)
    }
}

/// The rule whose kernel expressions are `exprs`, in table `table` of `family`.
pub fn decode(exprs: &[u8], family: Family, table: &RawTable) -> Rule {
    let mut d = Decoder {
        family,
        table,
        regs: Regs(Default::default()),
        out: Vec::new(),
    };
    for (k, elem) in Attrs(exprs) {
        if k != NFTA_LIST_ELEM {
            continue;
        }
        let e = Data::new(elem);
        let name = e.string(NFTA_EXPR_NAME).unwrap_or_default();
        let data = Data::new(e.raw(NFTA_EXPR_DATA).unwrap_or_default());
        if d.expr(&name, &data).is_none() {
            d.out.push(Expr::Unknown(format!(
                "a `{name}` expression kproxy does not write"
            )));
            break;
        }
    }
    Rule::new(d.out)
}

struct Decoder<'t> {
    family: Family,
    table: &'t RawTable,
    regs: Regs,
    out: Vec<Expr>,
}

impl Decoder<'_> {
    fn addr_len(&self) -> usize {
        addr_len(self.family)
    }

    fn addr_offset(&self, dir: Dir) -> u32 {
        addr_offset(self.family, dir)
    }

    fn addr_dir(&self, offset: u32) -> Option<Dir> {
        [Dir::Src, Dir::Dst]
            .into_iter()
            .find(|d| self.addr_offset(*d) == offset)
    }

    /// One expression into the registers or the rule; `None`: not kproxy's vocabulary.
    fn expr(&mut self, name: &str, a: &Data) -> Option<()> {
        match name {
            "payload" => {
                if a.has(5) {
                    return None; // NFTA_PAYLOAD_SREG: a payload write
                }
                let (base, offset, len) = (a.u32(2)?, a.u32(3)?, a.u32(4)? as usize);
                let load = Load::Payload { base, offset };
                self.regs.put(a.u32(1)?, value(load, len), len)
            }
            "meta" => {
                let key = a.u32(2)?;
                if let Some(sreg) = a.u32(3) {
                    return self.mark_set(key, sreg);
                }
                let len = match key {
                    NFT_META_MARK => 4,
                    NFT_META_IIFNAME => 16,
                    NFT_META_L4PROTO => 1,
                    _ => return None,
                };
                self.regs.put(a.u32(1)?, value(Load::Meta(key), len), len)
            }
            "ct" => {
                if a.has(4) {
                    return None; // a ct write
                }
                let key = a.u32(2)?;
                if let Some(dir) = a.raw(3) {
                    // The original direction's destination address or port.
                    let len = match key {
                        NFT_CT_DST_IP => 4,
                        NFT_CT_DST_IP6 => 16,
                        NFT_CT_PROTO_DST => 2,
                        _ => return None,
                    };
                    (dir.first() == Some(&0)).then_some(())?;
                    return self.regs.put(a.u32(1)?, value(Load::CtOrig(key), len), len);
                }
                (key == NFT_CT_STATUS).then_some(())?;
                self.regs.put(a.u32(1)?, value(Load::Ct(key), 4), 4)
            }
            "fib" => {
                let load = Load::Fib {
                    result: a.u32(2)?,
                    flags: a.u32(3)?,
                };
                self.regs.put(a.u32(1)?, value(load, 4), 4)
            }
            "numgen" => {
                if a.u32(3)? != NFT_NG_RANDOM || a.u32(4).unwrap_or(0) != 0 {
                    return None;
                }
                let load = Load::Numgen(a.u32(2)?);
                self.regs.put(a.u32(1)?, value(load, 4), 4)
            }
            "bitwise" => {
                // Only the boolean form (mask, xor), in place.
                if a.u32(6).unwrap_or(0) != 0 || a.has(7) {
                    return None;
                }
                let (sreg, dreg, len) = (a.u32(1)?, a.u32(2)?, a.u32(3)? as usize);
                let (mask, xor) = (a.value(4)?.to_vec(), a.value(5)?.to_vec());
                if sreg != dreg || mask.len() != len || xor.len() != len {
                    return None;
                }
                match self.regs.get_mut(sreg)? {
                    Reg::Value {
                        len: l,
                        bitwise: b @ None,
                        ..
                    } if *l == len => {
                        *b = Some((mask, xor));
                        Some(())
                    }
                    _ => None,
                }
            }
            "cmp" => {
                let op = a.u32(2)?;
                let neg = match op {
                    NFT_CMP_EQ => false,
                    NFT_CMP_NEQ => true,
                    _ => return None,
                };
                let data = a.value(3)?;
                let reg = self.regs.get(a.u32(1)?)?.clone();
                let (sel, lit, flip) = self.compared(&reg, data)?;
                self.out.push(Expr::Match {
                    sel: vec![sel],
                    neg: neg != flip,
                    rhs: Rhs::Lit(lit),
                });
                Some(())
            }
            "lookup" => self.lookup(a),
            "objref" => {
                // A named counter (NFTA_OBJREF_IMM_TYPE 1, NFTA_OBJREF_IMM_NAME 2), or
                // the map form (NFTA_OBJREF_SET_SREG 3, NFTA_OBJREF_SET_NAME 4).
                if a.has(1) || a.has(2) {
                    (a.u32(1)? == NFT_OBJECT_COUNTER && !a.has(3)).then_some(())?;
                    self.out.push(Expr::CounterRef(a.string(2)?));
                    return Some(());
                }
                let map = a.string(4)?;
                let rs = self.table.sets.get(&map)?;
                let sel: Vec<Sel> = self
                    .regs
                    .concat(a.u32(3)?, rs.key_len as usize)?
                    .iter()
                    .map(|(load, len)| self.selector(load, *len))
                    .collect::<Option<_>>()?;
                self.out.push(Expr::CounterMap { sel, map });
                Some(())
            }
            "immediate" => {
                let dreg = a.u32(1)?;
                let data = a.raw(2)?;
                if dreg == 0 {
                    let v = Attrs(data).find(|(k, _)| *k == NFTA_DATA_VERDICT)?.1;
                    let v = Data::new(v);
                    let chain = v.string(NFTA_VERDICT_CHAIN);
                    let verdict =
                        Verdict::from_netlink(v.u32(NFTA_VERDICT_CODE)?, chain.as_deref())?;
                    self.out.push(Expr::Verdict(verdict));
                    return Some(());
                }
                let bytes = Attrs(data).find(|(k, _)| *k == NFTA_DATA_VALUE)?.1.to_vec();
                let len = bytes.len();
                self.regs.put(dreg, Reg::Data(bytes), len)
            }
            "nat" => self.nat(a),
            "masq" => {
                if a.has(2) || a.has(3) {
                    return None;
                }
                let flags = a.u32(1).unwrap_or(0);
                if flags & !NF_NAT_RANGE_PROTO_RANDOM_FULLY != 0 {
                    return None;
                }
                self.out.push(Expr::Masquerade {
                    fully_random: flags != 0,
                });
                Some(())
            }
            "reject" => {
                let (ty, code) = (a.u32(1)?, a.raw(2).and_then(|c| c.first().copied()));
                let port_unreachable = match self.family {
                    Family::Ip => ICMP_PORT_UNREACH,
                    Family::Ip6 => ICMPV6_PORT_UNREACH,
                };
                let tcp_reset = match (ty, code) {
                    (NFT_REJECT_ICMP_UNREACH, Some(c)) if c == port_unreachable => false,
                    (NFT_REJECT_TCP_RST, _) => true,
                    _ => return None,
                };
                self.out.push(Expr::Reject { tcp_reset });
                Some(())
            }
            "dynset" => {
                // An `update` of the key alone: no data, timeout (the kernel reports
                // a zero one), flags or expressions (NFTA_DYNSET_SREG_DATA 5, TIMEOUT
                // 6, EXPR 7, FLAGS 9, EXPRESSIONS 10).
                let timeout = a.raw(6).map(|t| t.iter().any(|&b| b != 0));
                if a.u32(3)? != NFT_DYNSET_OP_UPDATE
                    || a.has(5)
                    || timeout == Some(true)
                    || a.has(7)
                    || a.has(10)
                    || a.u32(9).unwrap_or(0) != 0
                {
                    return None;
                }
                let set = a.string(1)?;
                let key = match self.regs.concat(a.u32(4)?, self.addr_len())?.as_slice() {
                    [(load, len)] => self.selector(load, *len)?,
                    _ => return None,
                };
                matches!(key, Sel::Addr(..)).then_some(())?;
                self.out.push(Expr::Update { set, key });
                Some(())
            }
            _ => None,
        }
    }

    /// `meta mark set` from a register holding the mark, or'd or xor'd.
    fn mark_set(&mut self, key: u32, sreg: u32) -> Option<()> {
        if key != NFT_META_MARK {
            return None;
        }
        let Reg::Value {
            load: Load::Meta(NFT_META_MARK),
            len: 4,
            bitwise: Some((mask, xor)),
        } = self.regs.get(sreg)?
        else {
            return None;
        };
        let (mask, xor) = (ne32(mask)?, ne32(xor)?);
        let e = if mask == u32::MAX {
            Expr::MarkXor(xor)
        } else if mask == !xor {
            Expr::MarkOr(xor)
        } else {
            return None;
        };
        self.out.push(e);
        Some(())
    }

    /// The selector a register of `len` bytes loaded by `load` holds, unmasked.
    fn selector(&self, load: &Load, len: usize) -> Option<Sel> {
        Some(match (load, len) {
            (Load::Payload { base, offset }, l) if *base == NFT_PAYLOAD_NETWORK_HEADER => {
                (l == self.addr_len()).then_some(())?;
                Sel::Addr(self.family, self.addr_dir(*offset)?)
            }
            (
                Load::Payload {
                    base: NFT_PAYLOAD_TRANSPORT_HEADER,
                    offset: 2,
                },
                2,
            ) => Sel::Dport,
            (Load::Meta(NFT_META_L4PROTO), 1) => Sel::L4proto,
            (Load::Meta(NFT_META_IIFNAME), 16) => Sel::Iifname,
            (Load::Numgen(n), 4) => Sel::Numgen(*n),
            (Load::CtOrig(NFT_CT_DST_IP), 4) if self.family == Family::Ip => {
                Sel::CtOrigDaddr(Family::Ip)
            }
            (Load::CtOrig(NFT_CT_DST_IP6), 16) if self.family == Family::Ip6 => {
                Sel::CtOrigDaddr(Family::Ip6)
            }
            (Load::CtOrig(NFT_CT_PROTO_DST), 2) => Sel::CtOrigDport,
            _ => return None,
        })
    }

    /// What a `cmp` against `data` of register `reg` matches: the selector, the
    /// literal, and whether the comparison is inverted (`ct status dnat` is `!= 0`).
    fn compared(&self, reg: &Reg, data: &[u8]) -> Option<(Sel, Lit, bool)> {
        let Reg::Value { load, len, bitwise } = reg else {
            return None;
        };
        let len = *len;
        let plain = bitwise.is_none();
        Some(match load {
            Load::Payload {
                base: NFT_PAYLOAD_NETWORK_HEADER,
                offset,
            } => {
                let dir = self.addr_dir(*offset)?;
                let full = self.addr_len();
                if data.len() != len || len > full {
                    return None;
                }
                let plen = match bitwise {
                    None => len * 8,
                    Some((mask, xor)) => {
                        if xor.iter().any(|&b| b != 0) {
                            return None;
                        }
                        let ones = leading_ones(mask)?;
                        // Bits outside the mask never match: not a prefix.
                        if data.iter().zip(mask).any(|(d, m)| d & !m != 0) {
                            return None;
                        }
                        ones
                    }
                };
                let mut bytes = data.to_vec();
                bytes.resize(full, 0);
                let ip = match self.family {
                    Family::Ip => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
                    Family::Ip6 => std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?),
                };
                (
                    Sel::Addr(self.family, dir),
                    ip_lit(ip, u8::try_from(plen).ok()?),
                    false,
                )
            }
            Load::Payload {
                base: NFT_PAYLOAD_TRANSPORT_HEADER,
                offset: 2,
            } if plain && len == 2 && data.len() == 2 => (
                Sel::Dport,
                Lit::Atom(Atom::Port(u16::from_be_bytes(data.try_into().ok()?))),
                false,
            ),
            Load::Meta(NFT_META_L4PROTO) if plain && len == 1 && data.len() == 1 => {
                (Sel::L4proto, Lit::Atom(Atom::Proto(data[0])), false)
            }
            Load::Meta(NFT_META_IIFNAME) if plain && data.len() <= len => {
                let name = match data.iter().position(|&c| c == 0) {
                    // Padded with NULs to IFNAMSIZ: the name exactly.
                    Some(end) if data.len() == len && data[end..].iter().all(|&c| c == 0) => {
                        std::str::from_utf8(&data[..end]).ok()?.to_string()
                    }
                    Some(_) => return None,
                    // A prefix: `"name*"`.
                    None => format!("{}*", std::str::from_utf8(data).ok()?),
                };
                (Sel::Iifname, Lit::Iface(name), false)
            }
            Load::Meta(NFT_META_MARK) => {
                let (mask, xor) = bitwise.as_ref()?;
                if ne32(xor)? != 0 {
                    return None;
                }
                (Sel::MarkAnd(ne32(mask)?), Lit::Num(ne32(data)?), false)
            }
            Load::Fib { flags, result } if plain && *result == NFT_FIB_RESULT_ADDRTYPE => {
                let dir = match *flags {
                    NFTA_FIB_F_SADDR => Dir::Src,
                    NFTA_FIB_F_DADDR => Dir::Dst,
                    _ => return None,
                };
                (ne32(data)? == RTN_LOCAL).then_some(())?;
                (Sel::FibType(dir), Lit::Local, false)
            }
            Load::Ct(NFT_CT_STATUS) => {
                let (mask, xor) = bitwise.as_ref()?;
                if ne32(mask)? != IPS_DST_NAT || ne32(xor)? != 0 || ne32(data)? != 0 {
                    return None;
                }
                // `ct status dnat` is `(status & dnat) != 0`.
                (Sel::CtStatus, Lit::Dnat, true)
            }
            Load::Numgen(n) if plain && data.len() == 4 => {
                (Sel::Numgen(*n), Lit::Num(ne32(data)?), false)
            }
            _ => return None,
        })
    }

    fn lookup(&mut self, a: &Data) -> Option<()> {
        let set = a.string(1)?;
        let neg = a.u32(5).unwrap_or(0) & NFT_LOOKUP_F_INV != 0;
        let (anonymous, rs) = match self.table.sets.get(&set) {
            Some(rs) => (false, rs),
            None => (true, self.table.anonymous.get(&set)?),
        };
        let keys = self.regs.concat(a.u32(2)?, rs.key_len as usize)?;
        let sel: Vec<Sel> = keys
            .iter()
            .map(|(load, len)| self.selector(load, *len))
            .collect::<Option<_>>()?;
        match a.u32(3) {
            None => {
                let rhs = if anonymous {
                    Rhs::AnonSet(self.anonymous_elements(rs, &sel)?)
                } else {
                    Rhs::Set(set)
                };
                self.out.push(Expr::Match { sel, neg, rhs });
            }
            Some(0) if !neg && !anonymous => self.out.push(Expr::Vmap { sel, map: set }),
            Some(dreg) if !neg && !anonymous => {
                // A map's value: an address, then a port (4-byte aligned).
                let parts = [0, self.addr_len()];
                for (part, at) in parts.into_iter().enumerate() {
                    let value = Reg::Mapped {
                        map: set.clone(),
                        sel: sel.clone(),
                        part,
                    };
                    let reg = slot(dreg)? + at / 4 + 8;
                    self.regs.put(reg as u32, value, 4)?;
                }
            }
            _ => return None,
        }
        Some(())
    }

    /// The literals of an anonymous set keyed by one selector.
    fn anonymous_elements(&self, rs: &RawSet, sel: &[Sel]) -> Option<Vec<Lit>> {
        let [sel] = sel else { return None };
        if rs.flags & NFT_SET_MAP != 0 || rs.flags & NFT_SET_ANONYMOUS == 0 {
            return None;
        }
        if rs.flags & NFT_SET_INTERVAL != 0 {
            let Sel::Addr(f, _) = sel else { return None };
            let v6 = *f == Family::Ip6;
            let mut out = Vec::new();
            for (a, b) in interval_ranges(v6, rs.elements.iter())? {
                prefixes(v6, a, b, &mut out);
            }
            return Some(out);
        }
        let field = match sel {
            Sel::Addr(Family::Ip, _) => Field::Ipv4Addr,
            Sel::Addr(Family::Ip6, _) => Field::Ipv6Addr,
            Sel::Dport => Field::InetService,
            Sel::L4proto => Field::InetProto,
            _ => return None,
        };
        rs.elements
            .iter()
            .map(|e| {
                let t = decode_tuple(&[field], e.key)?;
                (e.data.is_none() && !e.interval_end).then_some(())?;
                Some(Lit::Atom(t.atoms()[0]))
            })
            .collect()
    }

    fn nat(&mut self, a: &Data) -> Option<()> {
        if a.u32(1)? != NFT_NAT_DNAT || u32::from(self.family.nfproto()) != a.u32(2)? {
            return None;
        }
        let (addr, proto) = (a.u32(3)?, a.u32(5)?);
        if a.u32(4).is_some_and(|m| m != addr) || a.u32(6).is_some_and(|m| m != proto) {
            return None;
        }
        if a.u32(7).unwrap_or(0) & !NAT_PLAIN_FLAGS != 0 {
            return None;
        }
        let e = match (self.regs.get(addr)?, self.regs.get(proto)?) {
            (Reg::Data(ip), Reg::Data(port)) => {
                let ip = match self.family {
                    Family::Ip => std::net::IpAddr::from(<[u8; 4]>::try_from(ip.as_slice()).ok()?),
                    Family::Ip6 => {
                        std::net::IpAddr::from(<[u8; 16]>::try_from(ip.as_slice()).ok()?)
                    }
                };
                let port = u16::from_be_bytes(port.as_slice().try_into().ok()?);
                Expr::DnatTo(EndpointAddr::new(ip, port))
            }
            (
                Reg::Mapped { map, sel, part: 0 },
                Reg::Mapped {
                    map: m2, part: 1, ..
                },
            ) if map == m2 && slot(proto)? == slot(addr)? + self.addr_len() / 4 => Expr::DnatMap {
                family: self.family,
                sel: sel.clone(),
                map: map.clone(),
            },
            _ => return None,
        };
        self.out.push(e);
        Some(())
    }
}

fn value(load: Load, len: usize) -> Reg {
    Reg::Value {
        load,
        len,
        bitwise: None,
    }
}

fn ne32(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.try_into().ok()?))
}

/// The number of leading one bits of a contiguous mask (`None` when not contiguous).
fn leading_ones(mask: &[u8]) -> Option<usize> {
    let mut ones = 0;
    let mut ended = false;
    for b in mask {
        for i in (0..8).rev() {
            let bit = b >> i & 1 == 1;
            match (bit, ended) {
                (true, false) => ones += 1,
                (true, true) => return None,
                (false, _) => ended = true,
            }
        }
    }
    Some(ones)
}
