//! The values that rules and set elements share: the table family, a set field, one
//! datum (an atom), a verdict, and a rule's `kp:` id, with the nft text of each.
//!
//! A floor below both the table model (`crate::model`, whose chains hold rules and whose
//! sets hold atoms) and the typed rule (`crate::rule`), so that neither reaches into the
//! other for them; `crate::model` re-exports them under their old paths. Above the
//! netlink floor (`crate::nfnl`) only: each value's kernel encoding is here beside it
//! (a family's `NFPROTO`, a verdict's code both ways, a field's datatype and length).

use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;

use kproxy_core::model::IpFamily;

use crate::nfnl::{
    NF_ACCEPT, NF_DROP, NFPROTO_IPV4, NFPROTO_IPV6, NFT_CONTINUE, NFT_GOTO, NFT_JUMP, NFT_RETURN,
};

/// An nftables table family kproxy uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    Ip,
    Ip6,
}

impl Family {
    pub fn of(f: IpFamily) -> Family {
        match f {
            IpFamily::IPv4 => Family::Ip,
            IpFamily::IPv6 => Family::Ip6,
        }
    }

    pub fn ip_family(self) -> IpFamily {
        match self {
            Family::Ip => IpFamily::IPv4,
            Family::Ip6 => IpFamily::IPv6,
        }
    }

    /// As nft writes it: `ip` / `ip6` (the word is the IP family's).
    pub fn nft(self) -> &'static str {
        self.ip_family().nft_family()
    }

    /// `NFPROTO_IPV4` / `NFPROTO_IPV6` (nfgenmsg's family byte).
    pub fn nfproto(self) -> u8 {
        match self {
            Family::Ip => NFPROTO_IPV4,
            Family::Ip6 => NFPROTO_IPV6,
        }
    }

    /// The family of nfgenmsg's family byte; `None` for any but `ip` and `ip6`.
    pub(crate) fn of_nfproto(code: u8) -> Option<Family> {
        match code {
            NFPROTO_IPV4 => Some(Family::Ip),
            NFPROTO_IPV6 => Some(Family::Ip6),
            _ => None,
        }
    }
}

/// As nft writes it (`ip`, `ip6`): in messages and errors that name a table.
impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.nft())
    }
}

/// One field of a set's key or a map's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    Ipv4Addr,
    Ipv6Addr,
    /// `inet_proto` / `meta l4proto`: one byte.
    InetProto,
    /// `inet_service` / `th dport`: two bytes, network order.
    InetService,
    /// `numgen random mod N` (only in `typeof` declarations): a 32-bit host-order index.
    Numgen(u32),
}

impl Field {
    /// The datatype name of a `type` declaration (`None` for `numgen`, which only
    /// `typeof` can declare).
    pub(crate) fn type_name(self) -> Option<&'static str> {
        Some(match self {
            Field::Ipv4Addr => "ipv4_addr",
            Field::Ipv6Addr => "ipv6_addr",
            Field::InetProto => "inet_proto",
            Field::InetService => "inet_service",
            Field::Numgen(_) => return None,
        })
    }

    /// The expression of a `typeof` declaration (addresses are destination addresses:
    /// kproxy's `typeof` maps are keyed and valued by them).
    pub(crate) fn write_typeof(self, out: &mut String) {
        match self {
            Field::Ipv4Addr => out.push_str("ip daddr"),
            Field::Ipv6Addr => out.push_str("ip6 daddr"),
            Field::InetProto => out.push_str("meta l4proto"),
            Field::InetService => out.push_str("th dport"),
            Field::Numgen(n) => {
                let _ = write!(out, "numgen random mod {n}");
            }
        }
    }

    /// Bytes of one datum of this field.
    pub fn datum_len(self) -> usize {
        match self {
            Field::Ipv4Addr | Field::Numgen(_) => 4,
            Field::Ipv6Addr => 16,
            Field::InetProto => 1,
            Field::InetService => 2,
        }
    }

    /// Parses one datum of this field from nft text.
    pub(crate) fn parse(self, s: &str, interval: bool) -> Option<Atom> {
        let s = s.trim();
        Some(match self {
            Field::Ipv4Addr | Field::Ipv6Addr => {
                let v6 = self == Field::Ipv6Addr;
                match s.split_once('/') {
                    Some((ip, len)) if interval => {
                        let ip: IpAddr = ip.parse().ok()?;
                        let len: u8 = len.parse().ok()?;
                        if ip.is_ipv6() != v6 || len > if v6 { 128 } else { 32 } {
                            return None;
                        }
                        Atom::Prefix(ip, len)
                    }
                    Some(_) => return None,
                    None => {
                        let ip: IpAddr = s.parse().ok()?;
                        if ip.is_ipv6() != v6 {
                            return None;
                        }
                        Atom::Addr(ip)
                    }
                }
            }
            Field::InetProto => Atom::Proto(match s {
                "tcp" => 6,
                "udp" => 17,
                "sctp" => 132,
                n => n.parse().ok()?,
            }),
            Field::InetService => Atom::Port(s.parse().ok()?),
            Field::Numgen(n) => {
                let i: u32 = s.parse().ok()?;
                if i >= n {
                    return None;
                }
                Atom::Index(i)
            }
        })
    }
}

/// One datum of an element.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Atom {
    Addr(IpAddr),
    /// An address prefix (elements of interval sets).
    Prefix(IpAddr, u8),
    /// An IP protocol number.
    Proto(u8),
    Port(u16),
    /// A `numgen` index.
    Index(u32),
}

impl Atom {
    pub fn write(&self, out: &mut String) {
        match self {
            Atom::Addr(ip) => write_ip(out, ip),
            Atom::Prefix(ip, len) => {
                write_ip(out, ip);
                let _ = write!(out, "/{len}");
            }
            Atom::Proto(6) => out.push_str("tcp"),
            Atom::Proto(17) => out.push_str("udp"),
            Atom::Proto(132) => out.push_str("sctp"),
            // Without the formatting machinery: a full sync writes ≈ 300k numbers.
            Atom::Proto(p) => write_u32(out, u32::from(*p)),
            Atom::Port(p) => write_u32(out, u32::from(*p)),
            Atom::Index(i) => write_u32(out, *i),
        }
    }
}

/// The most fields a key or value of kproxy's sets has (a dispatch map's key:
/// address, protocol, port, index).
pub const MAX_FIELDS: usize = 4;

impl Atom {
    /// The IP protocol number of a Service port's protocol.
    pub fn proto(p: kproxy_core::model::Protocol) -> Atom {
        use kproxy_core::model::Protocol;
        Atom::Proto(match p {
            Protocol::TCP => 6,
            Protocol::UDP => 17,
            Protocol::SCTP => 132,
        })
    }
}

/// A verdict map's value.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Accept,
    Drop,
    Return,
    Continue,
    Jump(Arc<str>),
    Goto(Arc<str>),
}

impl Verdict {
    pub fn parse(s: &str) -> Option<Verdict> {
        let s = s.trim();
        Some(match s.split_once(' ') {
            None => match s {
                "drop" => Verdict::Drop,
                "accept" => Verdict::Accept,
                "return" => Verdict::Return,
                "continue" => Verdict::Continue,
                _ => return None,
            },
            Some(("goto", c)) => Verdict::Goto(c.trim().into()),
            Some(("jump", c)) => Verdict::Jump(c.trim().into()),
            Some(_) => return None,
        })
    }

    pub fn write(&self, out: &mut String) {
        match self {
            Verdict::Accept => out.push_str("accept"),
            Verdict::Drop => out.push_str("drop"),
            Verdict::Return => out.push_str("return"),
            Verdict::Continue => out.push_str("continue"),
            Verdict::Jump(c) => {
                out.push_str("jump ");
                out.push_str(c);
            }
            Verdict::Goto(c) => {
                out.push_str("goto ");
                out.push_str(c);
            }
        }
    }
}

// The kernel's encoding of a verdict, both ways (the writer encodes, the readers and
// the rule's decoder decode).
impl Verdict {
    /// The verdict code (as the kernel's u32) and chain of a verdict.
    pub(crate) fn netlink(&self) -> (u32, Option<&str>) {
        match self {
            Verdict::Drop => (NF_DROP, None),
            Verdict::Accept => (NF_ACCEPT, None),
            Verdict::Return => (NFT_RETURN, None),
            Verdict::Continue => (NFT_CONTINUE, None),
            Verdict::Goto(c) => (NFT_GOTO, Some(c)),
            Verdict::Jump(c) => (NFT_JUMP, Some(c)),
        }
    }

    /// The verdict of a code and chain as the kernel reports them: the inverse of
    /// [`Verdict::netlink`]; `None` for a code kproxy never writes, or a chain where
    /// the code takes none (or none where it takes one).
    pub fn from_netlink(code: u32, chain: Option<&str>) -> Option<Verdict> {
        Some(match (code, chain) {
            (NF_DROP, None) => Verdict::Drop,
            (NF_ACCEPT, None) => Verdict::Accept,
            (NFT_CONTINUE, None) => Verdict::Continue,
            (NFT_RETURN, None) => Verdict::Return,
            (NFT_JUMP, Some(c)) => Verdict::Jump(c.into()),
            (NFT_GOTO, Some(c)) => Verdict::Goto(c.into()),
            _ => return None,
        })
    }
}

/// What the comment of every rule kproxy writes starts with; the rest is its
/// [`rule_id`].
pub const RULE_ID_PREFIX: &str = "kp:";

/// The identity of a rule's content: the FNV-1a 64 hash of its text body (without
/// `add rule FAMILY TABLE CHAIN` and without the comment), 16 hex digits. Every rule is
/// written with the comment `kp:<id>` (the kernel keeps it as the rule's userdata), so
/// a reader of the kernel's tables finds which rule of the record a rule claims to be
/// (whether it does what that rule does is decided on its expressions,
/// [`crate::rule::Rule::same`]; agreed with the adoption reader, `crate::dump`).
pub fn rule_id(rule: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in rule.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

// Numbers and addresses as nft text: the one place they are formatted (element keys
// of the model and of the record's frontends alike).

/// The ASCII digits of `o` into `buf`; returns how many.
fn u8_digits(o: u8, buf: &mut [u8; 3]) -> usize {
    if o >= 100 {
        *buf = [b'0' + o / 100, b'0' + o / 10 % 10, b'0' + o % 10];
        3
    } else if o >= 10 {
        buf[..2].copy_from_slice(&[b'0' + o / 10, b'0' + o % 10]);
        2
    } else {
        buf[0] = b'0' + o;
        1
    }
}

/// `ip` as its `Display` writes it; IPv4 without the formatting machinery, as a full
/// script writes some 100k of them.
pub(crate) fn write_ip(out: &mut String, ip: &IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            let mut buf = [0; 15];
            let mut n = 0;
            for (i, o) in v4.octets().iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                let mut digits = [0; 3];
                let d = u8_digits(*o, &mut digits);
                buf[n..n + d].copy_from_slice(&digits[..d]);
                n += d;
            }
            out.push_str(std::str::from_utf8(&buf[..n]).unwrap_or_default());
        }
        IpAddr::V6(_) => {
            let _ = write!(out, "{ip}");
        }
    }
}

/// `n` in decimal, without the formatting machinery (a full script writes ≈ 100k row
/// keys).
pub(crate) fn write_u32(out: &mut String, mut n: u32) {
    let mut buf = [0u8; 10];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.push_str(std::str::from_utf8(&buf[i..]).unwrap_or_default());
}

/// nft's datatype ids (a `numgen` field is an integer).
pub(crate) fn datatype(f: Field) -> u32 {
    match f {
        Field::Ipv4Addr => 7,
        Field::Ipv6Addr => 8,
        Field::InetProto => 12,
        Field::InetService => 13,
        Field::Numgen(_) => 4,
    }
}

/// The type the kernel holds for a set's key or a map's data: nft's datatype ids,
/// 6 bits each for a concatenation.
pub(crate) fn concat_type(fields: &[Field]) -> u32 {
    fields.iter().fold(0u32, |acc, &f| (acc << 6) | datatype(f))
}

/// The bytes of a key or data: a concatenation's fields padded to 4 bytes each.
pub(crate) fn fields_len(fields: &[Field]) -> u32 {
    if fields.len() == 1 {
        fields[0].datum_len() as u32
    } else {
        fields
            .iter()
            .map(|&f| f.datum_len().next_multiple_of(4) as u32)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A verdict decodes from the kernel's code and chain as it encodes, and a code or
    /// chain kproxy never writes is refused.
    #[test]
    fn verdicts_decode_as_they_encode() {
        for s in [
            "drop",
            "accept",
            "return",
            "continue",
            "goto svc-a",
            "jump x",
        ] {
            let v = Verdict::parse(s).unwrap();
            let (code, chain) = v.netlink();
            assert_eq!(Verdict::from_netlink(code, chain), Some(v.clone()), "{s}");
        }
        assert_eq!(
            Verdict::parse("goto svc-1").map(|v| (v.netlink().0, v.netlink().1.map(String::from))),
            Some((-4i32 as u32, Some("svc-1".into())))
        );
        assert_eq!(Verdict::parse("jump x").unwrap().netlink().0, -3i32 as u32);
        assert_eq!(Verdict::parse("drop").unwrap().netlink(), (0, None));
        assert_eq!(Verdict::parse("reject"), None);
        assert_eq!(Verdict::parse("dnat to 1.2.3.4"), None);
        assert_eq!(
            Verdict::from_netlink(-4i32 as u32, Some("svc-a")),
            Some(Verdict::Goto("svc-a".into()))
        );
        assert_eq!(Verdict::from_netlink(0, None), Some(Verdict::Drop));
        assert_eq!(Verdict::from_netlink(-4i32 as u32, None), None);
        assert_eq!(Verdict::from_netlink(0, Some("x")), None);
        assert_eq!(Verdict::from_netlink(7, None), None);
    }
}
