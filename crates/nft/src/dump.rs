//! Reads kproxy's own tables back from the kernel over nfnetlink (NFT_MSG_GETTABLE,
//! GETCHAIN, GETSET, GETSETELEM, GETRULE dumps; no `nft list`), and turns what it read
//! into the desired state's vocabulary so that a restart can apply only the difference
//! ("adoption", see `Dataplane::sync`).
//!
//! Two halves:
//! - [`read_table`] (imperative): the dumps, decoded by hand into [`RawTable`] (attribute
//!   walking over the received bytes; netlink-packet-netfilter's types cost microseconds
//!   per element, and a 10k-Service table has ≈ 176k of them). A dump the kernel marks
//!   interrupted (`NLM_F_DUMP_INTR`) or a ruleset generation that moved while reading is
//!   an error: the caller falls back to a full replacement.
//! - [`adopt`] (pure): a [`RawTable`] and the desired [`Ruleset`] → the kernel as a
//!   `Ruleset` in kproxy's text form, to which the existing delta (`delta_pre` /
//!   `delta_post`) applies. Rules cannot be turned back into text, so a chain is taken
//!   as "holding the desired rules" when its rules' comments are the desired rules' tags
//!   ([`crate::ruleset::rule_tag`]) in order; any other chain is marked so that the delta
//!   flushes and refills it. Sets and maps compare by declaration (key/data types,
//!   flags, timeout, comment, checked against the dump) and by elements decoded with the
//!   desired set's type. Anything it cannot account for — a foreign table comment, a
//!   base chain whose hook differs, a set whose type differs or whose elements do not
//!   decode — is an [`AdoptError`], and the caller replaces the table as a whole.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{Ipv4Addr, Ipv6Addr};

use netlink_sys::Socket;

use crate::NftError;
use crate::netlink::{Data, Field, SetType};
use crate::record::ElementDelta;
use crate::ruleset::{Chain, Ruleset, Set, rule_tag};

// linux/netlink.h, linux/netfilter/nfnetlink.h, linux/netfilter/nf_tables.h.
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP_INTR: u16 = 0x10;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_GETSET: u16 = 10;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFTA_TABLE_USERDATA: u16 = 6;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_HANDLE: u16 = 3;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DATA_TYPE: u16 = 6;
const NFTA_SET_DATA_LEN: u16 = 7;
const NFTA_SET_TIMEOUT: u16 = 11;
const NFTA_SET_USERDATA: u16 = 13;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
/// libnftnl's udata TLV types: a rule's comment, a set's comment.
const UDATA_RULE_COMMENT: u8 = 0;
const UDATA_SET_COMMENT: u8 = 7;

pub const SET_ANONYMOUS: u32 = 0x1;
pub const SET_INTERVAL: u32 = 0x4;
pub const SET_MAP: u32 = 0x8;
pub const SET_TIMEOUT: u32 = 0x10;
pub const SET_EVAL: u32 = 0x20;
pub const SET_CONCAT: u32 = 0x80;
const ELEM_INTERVAL_END: u32 = 0x1;

/// A base chain's hook as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawHook {
    /// `NF_INET_*`: 0 prerouting, 1 input, 2 forward, 3 output, 4 postrouting.
    pub hooknum: u32,
    pub priority: i32,
    /// `nat`, `filter`, `route`.
    pub kind: String,
    /// `NF_DROP` 0 / `NF_ACCEPT` 1.
    pub policy: u32,
}

/// One rule: its handle and its comment (kproxy's tag), if any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRule {
    pub handle: u64,
    pub comment: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawChain {
    pub hook: Option<RawHook>,
    pub rules: Vec<RawRule>,
}

/// What a map element points to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RawData {
    Value(Vec<u8>),
    Verdict { code: u32, chain: Option<String> },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawElement {
    pub key: Vec<u8>,
    pub data: Option<RawData>,
    /// `NFT_SET_ELEM_*` (bit 0: the end of an interval).
    pub flags: u32,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawSet {
    pub flags: u32,
    pub key_type: u32,
    pub key_len: u32,
    pub data_type: Option<u32>,
    pub data_len: Option<u32>,
    /// Milliseconds.
    pub timeout: Option<u64>,
    pub comment: Option<String>,
    pub elements: Vec<RawElement>,
}

/// One table as the kernel holds it (anonymous sets, which belong to rules, left out).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawTable {
    pub flags: u32,
    pub comment: Option<String>,
    pub chains: BTreeMap<String, RawChain>,
    pub sets: BTreeMap<String, RawSet>,
}

impl RawTable {
    pub fn rule_count(&self) -> usize {
        self.chains.values().map(|c| c.rules.len()).sum()
    }

    pub fn element_count(&self) -> usize {
        self.sets.values().map(|s| s.elements.len()).sum()
    }
}

/// `ip` / `ip6` → NFPROTO_IPV4 / NFPROTO_IPV6.
fn family_code(family: &str) -> Result<u8, NftError> {
    match family {
        "ip" => Ok(2),
        "ip6" => Ok(10),
        f => Err(NftError::Invalid(format!(
            "table family {f:?}: want ip or ip6"
        ))),
    }
}

/// Attributes of a netlink attribute stream: (type without flag bits, payload).
struct Attrs<'a>(&'a [u8]);

impl<'a> Iterator for Attrs<'a> {
    type Item = (u16, &'a [u8]);
    fn next(&mut self) -> Option<Self::Item> {
        if self.0.len() < 4 {
            return None;
        }
        let len = usize::from(u16::from_ne_bytes([self.0[0], self.0[1]]));
        let kind = u16::from_ne_bytes([self.0[2], self.0[3]]) & 0x3fff;
        if len < 4 || len > self.0.len() {
            self.0 = &[];
            return None;
        }
        let payload = &self.0[4..len];
        self.0 = &self.0[len.next_multiple_of(4).min(self.0.len())..];
        Some((kind, payload))
    }
}

fn be32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

fn be64(b: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(b.get(..8)?.try_into().ok()?))
}

fn string(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

/// The string of TLV `kind` in libnftnl user data (type u8, length u8, value).
fn udata_string(mut b: &[u8], kind: u8) -> Option<String> {
    while b.len() >= 2 {
        let (t, len) = (b[0], usize::from(b[1]));
        let v = b.get(2..2 + len)?;
        if t == kind {
            return Some(string(v));
        }
        b = &b[2 + len..];
    }
    None
}

/// A netfilter socket for one reading, with a sequence counter.
struct Reader {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Reader {
    fn open() -> Result<Reader, NftError> {
        let sock = crate::netlink::open().map_err(|e| NftError::Io {
            context: "opening a netfilter netlink socket to read kproxy's tables".into(),
            source: e,
        })?;
        Ok(Reader {
            sock,
            seq: 0,
            buf: vec![0; 1 << 20],
        })
    }

    /// Sends one request and hands every answer's nfgenmsg payload (after the 4-byte
    /// nfgenmsg header) to `each`, until the dump ends or the request is acknowledged.
    /// `Ok(false)` when the kernel answered ENOENT.
    fn request(
        &mut self,
        what: &str,
        msg: u16,
        flags: u16,
        family: u8,
        attrs: &[(u16, &str)],
        mut each: impl FnMut(&[u8]) -> Result<(), NftError>,
    ) -> Result<bool, NftError> {
        self.seq += 1;
        let seq = self.seq;
        let mut req = Vec::with_capacity(64);
        req.extend_from_slice(&[0; 4]);
        req.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
        req.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        req.extend_from_slice(&seq.to_ne_bytes());
        req.extend_from_slice(&0u32.to_ne_bytes());
        req.extend_from_slice(&[family, 0, 0, 0]);
        for (kind, s) in attrs {
            let len = 4 + s.len() + 1;
            req.extend_from_slice(&(len as u16).to_ne_bytes());
            req.extend_from_slice(&kind.to_ne_bytes());
            req.extend_from_slice(s.as_bytes());
            req.push(0);
            req.resize(req.len().next_multiple_of(4), 0);
        }
        let total = req.len() as u32;
        req[..4].copy_from_slice(&total.to_ne_bytes());
        self.sock.send(&req, 0).map_err(|e| NftError::Io {
            context: format!("asking the kernel for {what}"),
            source: e,
        })?;
        loop {
            let n = self
                .sock
                .recv(&mut &mut self.buf[..], 0)
                .map_err(|e| NftError::Io {
                    context: format!("reading the kernel's answer about {what}"),
                    source: e,
                })?;
            let mut at = 0;
            while at + 16 <= n {
                let b = &self.buf[at..n];
                let len = u32::from_ne_bytes(b[..4].try_into().expect("4 bytes")) as usize;
                if len < 16 || len > b.len() {
                    return Err(NftError::Netlink(format!(
                        "{what}: a malformed answer ({len}-byte message in {} bytes)",
                        b.len()
                    )));
                }
                let kind = u16::from_ne_bytes([b[4], b[5]]);
                let mflags = u16::from_ne_bytes([b[6], b[7]]);
                let mseq = u32::from_ne_bytes(b[8..12].try_into().expect("4 bytes"));
                let payload = &b[16..len];
                at += len.next_multiple_of(4);
                if mseq != seq {
                    continue; // a late answer to an earlier request
                }
                if mflags & NLM_F_DUMP_INTR != 0 {
                    return Err(NftError::Netlink(format!(
                        "{what}: the ruleset changed during the dump"
                    )));
                }
                match kind {
                    NLMSG_DONE => return Ok(true),
                    NLMSG_ERROR => {
                        let code = payload
                            .get(..4)
                            .map_or(0, |c| i32::from_ne_bytes(c.try_into().expect("4 bytes")));
                        return match code {
                            0 => Ok(true),
                            c if c == -libc::ENOENT => Ok(false),
                            c => Err(NftError::Netlink(format!(
                                "{what}: {}",
                                std::io::Error::from_raw_os_error(-c)
                            ))),
                        };
                    }
                    _ => each(payload.get(4..).unwrap_or_default())?,
                }
            }
        }
    }

    /// The ruleset generation (bumped by every committed transaction).
    fn generation(&mut self) -> Result<u32, NftError> {
        let mut id = None;
        self.request(
            "the ruleset generation",
            NFT_MSG_GETGEN,
            NLM_F_ACK,
            0,
            &[],
            |p| {
                for (k, v) in Attrs(p) {
                    if k == NFTA_GEN_ID {
                        id = be32(v);
                    }
                }
                Ok(())
            },
        )?;
        id.ok_or_else(|| NftError::Netlink("the kernel sent no ruleset generation".into()))
    }
}

/// Reads table `family table` (e.g. `ip kproxy`) with its chains, rules, named sets
/// and their elements from the calling thread's network namespace; `None` when the
/// table does not exist. Consistent: the reading is repeated (up to three times) when a
/// transaction committed meanwhile, then an error.
pub fn read_table(family: &str, table: &str) -> Result<Option<RawTable>, NftError> {
    let fam = family_code(family)?;
    let mut r = Reader::open()?;
    for _ in 0..3 {
        let before = r.generation()?;
        let got = read_once(&mut r, family, fam, table);
        let after = r.generation()?;
        match got {
            Ok(t) if before == after => return Ok(t),
            Err(e) if before == after => return Err(e),
            _ => continue,
        }
    }
    Err(NftError::Netlink(format!(
        "table {family} {table}: the ruleset kept changing while it was read"
    )))
}

fn read_once(
    r: &mut Reader,
    family: &str,
    fam: u8,
    table: &str,
) -> Result<Option<RawTable>, NftError> {
    let mut t = RawTable::default();
    let found = r.request(
        &format!("table {family} {table}"),
        NFT_MSG_GETTABLE,
        NLM_F_ACK,
        fam,
        &[(NFTA_TABLE_NAME, table)],
        |p| {
            for (k, v) in Attrs(p) {
                match k {
                    NFTA_TABLE_FLAGS => t.flags = be32(v).unwrap_or(0),
                    NFTA_TABLE_USERDATA => t.comment = udata_string(v, 0),
                    _ => {}
                }
            }
            Ok(())
        },
    )?;
    if !found {
        return Ok(None);
    }
    r.request(
        &format!("the chains of table {family} {table}"),
        NFT_MSG_GETCHAIN,
        NLM_F_DUMP,
        fam,
        &[(NFTA_CHAIN_TABLE, table)],
        |p| {
            let (mut tbl, mut name, mut chain) =
                (String::new(), String::new(), RawChain::default());
            let (mut hooknum, mut prio, mut kind, mut policy) = (None, 0i32, String::new(), 1u32);
            for (k, v) in Attrs(p) {
                match k {
                    NFTA_CHAIN_TABLE => tbl = string(v),
                    NFTA_CHAIN_NAME => name = string(v),
                    NFTA_CHAIN_HOOK => {
                        for (hk, hv) in Attrs(v) {
                            match hk {
                                NFTA_HOOK_HOOKNUM => hooknum = be32(hv),
                                NFTA_HOOK_PRIORITY => prio = be32(hv).unwrap_or(0) as i32,
                                _ => {}
                            }
                        }
                    }
                    NFTA_CHAIN_TYPE => kind = string(v),
                    NFTA_CHAIN_POLICY => policy = be32(v).unwrap_or(1),
                    _ => {}
                }
            }
            if tbl == table {
                chain.hook = hooknum.map(|hooknum| RawHook {
                    hooknum,
                    priority: prio,
                    kind,
                    policy,
                });
                t.chains.insert(name, chain);
            }
            Ok(())
        },
    )?;
    let mut orphans = Vec::new();
    r.request(
        &format!("the rules of table {family} {table}"),
        NFT_MSG_GETRULE,
        NLM_F_DUMP,
        fam,
        &[(NFTA_RULE_TABLE, table)],
        |p| {
            let (mut tbl, mut chain) = (String::new(), String::new());
            let mut rule = RawRule {
                handle: 0,
                comment: None,
            };
            for (k, v) in Attrs(p) {
                match k {
                    NFTA_RULE_TABLE => tbl = string(v),
                    NFTA_RULE_CHAIN => chain = string(v),
                    NFTA_RULE_HANDLE => rule.handle = be64(v).unwrap_or(0),
                    NFTA_RULE_USERDATA => rule.comment = udata_string(v, UDATA_RULE_COMMENT),
                    _ => {}
                }
            }
            if tbl == table {
                match t.chains.get_mut(&chain) {
                    Some(c) => c.rules.push(rule),
                    None => orphans.push(chain),
                }
            }
            Ok(())
        },
    )?;
    if let Some(c) = orphans.first() {
        // A chain created between the two dumps; the generation check repeats the read.
        return Err(NftError::Netlink(format!(
            "table {family} {table}: a rule of chain {c} that the chain dump did not list"
        )));
    }
    r.request(
        &format!("the sets of table {family} {table}"),
        NFT_MSG_GETSET,
        NLM_F_DUMP,
        fam,
        &[(NFTA_SET_TABLE, table)],
        |p| {
            let (mut tbl, mut name, mut set) = (String::new(), String::new(), RawSet::default());
            for (k, v) in Attrs(p) {
                match k {
                    NFTA_SET_TABLE => tbl = string(v),
                    NFTA_SET_NAME => name = string(v),
                    NFTA_SET_FLAGS => set.flags = be32(v).unwrap_or(0),
                    NFTA_SET_KEY_TYPE => set.key_type = be32(v).unwrap_or(0),
                    NFTA_SET_KEY_LEN => set.key_len = be32(v).unwrap_or(0),
                    NFTA_SET_DATA_TYPE => set.data_type = be32(v),
                    NFTA_SET_DATA_LEN => set.data_len = be32(v),
                    NFTA_SET_TIMEOUT => set.timeout = be64(v),
                    NFTA_SET_USERDATA => set.comment = udata_string(v, UDATA_SET_COMMENT),
                    _ => {}
                }
            }
            if tbl == table && set.flags & SET_ANONYMOUS == 0 {
                t.sets.insert(name, set);
            }
            Ok(())
        },
    )?;
    for (name, set) in t.sets.iter_mut() {
        r.request(
            &format!("the elements of set {name} in table {family} {table}"),
            NFT_MSG_GETSETELEM,
            NLM_F_DUMP,
            fam,
            &[
                (NFTA_SET_ELEM_LIST_TABLE, table),
                (NFTA_SET_ELEM_LIST_SET, name),
            ],
            |p| {
                for (k, v) in Attrs(p) {
                    if k != NFTA_SET_ELEM_LIST_ELEMENTS {
                        continue;
                    }
                    for (_, e) in Attrs(v) {
                        set.elements.push(element(e));
                    }
                }
                Ok(())
            },
        )?;
    }
    Ok(Some(t))
}

fn element(e: &[u8]) -> RawElement {
    let mut el = RawElement {
        key: Vec::new(),
        data: None,
        flags: 0,
    };
    for (k, v) in Attrs(e) {
        match k {
            NFTA_SET_ELEM_KEY => {
                if let Some((_, b)) = Attrs(v).find(|(t, _)| *t == NFTA_DATA_VALUE) {
                    el.key = b.to_vec();
                }
            }
            NFTA_SET_ELEM_DATA => {
                for (dk, dv) in Attrs(v) {
                    match dk {
                        NFTA_DATA_VALUE => el.data = Some(RawData::Value(dv.to_vec())),
                        NFTA_DATA_VERDICT => {
                            let (mut code, mut chain) = (0, None);
                            for (vk, vv) in Attrs(dv) {
                                match vk {
                                    NFTA_VERDICT_CODE => code = be32(vv).unwrap_or(0),
                                    NFTA_VERDICT_CHAIN => chain = Some(string(vv)),
                                    _ => {}
                                }
                            }
                            el.data = Some(RawData::Verdict { code, chain });
                        }
                        _ => {}
                    }
                }
            }
            NFTA_SET_ELEM_FLAGS => el.flags = be32(v).unwrap_or(0),
            _ => {}
        }
    }
    el
}

// ---- Decoding elements back into kproxy's text (the inverse of netlink.rs's encoding).

fn field_len(f: Field) -> usize {
    match f {
        Field::Ipv4 | Field::Numgen => 4,
        Field::Ipv6 => 16,
        Field::Proto => 1,
        Field::Service => 2,
    }
}

/// Bytes → `a . b . c` as kproxy writes them; `None` when the bytes do not fit.
pub fn decode_fields(fields: &[Field], mut b: &[u8], out: &mut String) -> Option<()> {
    for (i, &f) in fields.iter().enumerate() {
        if i > 0 {
            out.push_str(" . ");
        }
        let n = field_len(f);
        let v = b.get(..n)?;
        match f {
            Field::Ipv4 => write!(out, "{}", Ipv4Addr::from(<[u8; 4]>::try_from(v).ok()?)).ok()?,
            Field::Ipv6 => write!(out, "{}", Ipv6Addr::from(<[u8; 16]>::try_from(v).ok()?)).ok()?,
            Field::Proto => match v[0] {
                6 => out.push_str("tcp"),
                17 => out.push_str("udp"),
                132 => out.push_str("sctp"),
                p => write!(out, "{p}").ok()?,
            },
            Field::Service => write!(out, "{}", u16::from_be_bytes([v[0], v[1]])).ok()?,
            Field::Numgen => write!(out, "{}", u32::from_ne_bytes(v.try_into().ok()?)).ok()?,
        }
        let step = if fields.len() > 1 {
            n.next_multiple_of(4)
        } else {
            n
        };
        b = b.get(step..)?;
    }
    b.is_empty().then_some(())
}

/// A verdict as kproxy writes it in a verdict map.
pub fn decode_verdict(code: u32, chain: Option<&str>) -> Option<String> {
    Some(match (code as i32, chain) {
        (0, None) => "drop".into(),
        (1, None) => "accept".into(),
        (-1, None) => "continue".into(),
        (-5, None) => "return".into(),
        (-3, Some(c)) => format!("jump {c}"),
        (-4, Some(c)) => format!("goto {c}"),
        _ => return None,
    })
}

/// The elements of an interval set of addresses as kproxy writes them: `a/len` (also
/// for a single address). The kernel holds each interval as its start and an end
/// element (flagged) one past its last address.
fn decode_intervals(v6: bool, elements: &[RawElement]) -> Option<BTreeMap<String, String>> {
    let num = |b: &[u8]| -> Option<u128> {
        Some(if v6 {
            u128::from_be_bytes(b.try_into().ok()?)
        } else {
            u128::from(u32::from_be_bytes(b.try_into().ok()?))
        })
    };
    let bits: u32 = if v6 { 128 } else { 32 };
    let mut points: Vec<(u128, bool)> = elements
        .iter()
        .map(|e| Some((num(&e.key)?, e.flags & ELEM_INTERVAL_END != 0)))
        .collect::<Option<_>>()?;
    points.sort();
    let mut out = BTreeMap::new();
    let mut i = 0;
    while i < points.len() {
        let (start, end_flag) = points[i];
        if end_flag && start == 0 && i == 0 {
            i += 1; // nft's marker below the first interval
            continue;
        }
        if end_flag {
            return None;
        }
        // The end element is absent when the interval runs to the top of the space.
        let end = match points.get(i + 1) {
            Some(&(e, true)) => {
                i += 2;
                e
            }
            _ => {
                i += 1;
                if bits == 128 { 0 } else { 1u128 << 32 }
            }
        };
        let size = end.wrapping_sub(start) & if v6 { u128::MAX } else { (1u128 << 32) - 1 };
        let size = if size == 0 && bits == 32 {
            1u128 << 32
        } else {
            size
        };
        if size == 0 || !size.is_power_of_two() || start % size != 0 {
            return None; // not a prefix: kproxy never writes ranges
        }
        let len = bits - size.trailing_zeros();
        let addr = if v6 {
            Ipv6Addr::from(start).to_string()
        } else {
            Ipv4Addr::from(start as u32).to_string()
        };
        let text = format!("{addr}/{len}");
        out.insert(text, String::new());
    }
    Some(out)
}

// ---- Adoption: the kernel in the desired state's vocabulary.

/// Why a table cannot be adopted (the caller replaces it as a whole).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("table {family} {table}: {what}")]
pub struct AdoptError {
    pub family: &'static str,
    pub table: String,
    pub what: String,
}

/// Stands for rules that are not the desired ones: a chain holding it differs from
/// every desired chain, so the delta flushes it and adds the desired rules.
const UNKNOWN_RULES: &str = "# rules read from the kernel that kproxy did not write";

/// `NF_INET_*` hook numbers by name.
fn hook_number(name: &str) -> Option<u32> {
    Some(match name {
        "prerouting" => 0,
        "input" => 1,
        "forward" => 2,
        "output" => 3,
        "postrouting" => 4,
        _ => return None,
    })
}

/// A base chain declaration (`type nat hook output priority -100; policy accept;`)
/// as the kernel reports it.
fn parse_hook(decl: &str) -> Option<RawHook> {
    let mut h = RawHook {
        hooknum: u32::MAX,
        priority: 0,
        kind: String::new(),
        policy: 1,
    };
    for part in decl.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let words: Vec<&str> = part.split_whitespace().collect();
        match words.as_slice() {
            ["type", kind, "hook", hook, "priority", prio] => {
                h.kind = (*kind).into();
                h.hooknum = hook_number(hook)?;
                h.priority = match *prio {
                    "raw" => -300,
                    "mangle" => -150,
                    "dstnat" => -100,
                    "filter" => 0,
                    "security" => 50,
                    "srcnat" => 100,
                    n => n.parse().ok()?,
                };
            }
            ["policy", "accept"] => h.policy = 1,
            ["policy", "drop"] => h.policy = 0,
            _ => return None,
        }
    }
    (h.hooknum != u32::MAX).then_some(h)
}

/// The comment of a set declaration, if it has one.
fn decl_comment(decl: &str) -> Option<&str> {
    let (_, rest) = decl.split_once("comment \"")?;
    rest.split_once('"').map(|(c, _)| c)
}

/// nft's datatype ids, and the key type it stores for a concatenation.
fn datatype(f: Field) -> u32 {
    match f {
        Field::Ipv4 => 7,
        Field::Ipv6 => 8,
        Field::Proto => 12,
        Field::Service => 13,
        Field::Numgen => 0, // `integer` from `typeof numgen …`
    }
}

fn concat_type(fields: &[Field]) -> u32 {
    fields.iter().fold(0u32, |acc, &f| (acc << 6) | datatype(f))
}

fn fields_len(fields: &[Field]) -> u32 {
    if fields.len() == 1 {
        field_len(fields[0]) as u32
    } else {
        fields
            .iter()
            .map(|&f| field_len(f).next_multiple_of(4) as u32)
            .sum()
    }
}

/// Does the kernel's set have the declaration `decl`? Checks what the dump shows: key
/// and data types and lengths, interval/timeout flags, timeout, comment.
fn set_matches(raw: &RawSet, decl: &str, ty: Option<&SetType>) -> Result<(), String> {
    let flag = |f: u32| raw.flags & f != 0;
    if flag(SET_INTERVAL) != decl.contains("interval") {
        return Err("interval flag differs".into());
    }
    if flag(SET_TIMEOUT) != decl.contains("timeout") {
        return Err("timeout flag differs".into());
    }
    if decl_comment(decl) != raw.comment.as_deref() {
        return Err(format!(
            "comment {:?} instead of {:?}",
            raw.comment,
            decl_comment(decl)
        ));
    }
    if let Some(t) = decl
        .split(';')
        .map(str::trim)
        .find_map(|p| p.strip_prefix("timeout "))
    {
        let want = t
            .strip_suffix('s')
            .and_then(|s| s.parse::<u64>().ok())
            .map(|s| s * 1000);
        if want.is_none() || want != raw.timeout {
            return Err(format!("timeout {:?} ms instead of {t}", raw.timeout));
        }
    }
    let key: Vec<Field> = match ty {
        Some(ty) => ty.key.clone(),
        None => {
            // Interval and dynamic sets: a single address key.
            let spec = decl.split(';').next().unwrap_or("").trim();
            match spec.strip_prefix("type ") {
                Some("ipv4_addr") => vec![Field::Ipv4],
                Some("ipv6_addr") => vec![Field::Ipv6],
                _ => return Err(format!("declaration {decl:?} is not one adoption reads")),
            }
        }
    };
    if raw.key_len != fields_len(&key) {
        return Err(format!("key length {} bytes", raw.key_len));
    }
    // `typeof` keys may be stored with other type ids; lengths cover them.
    if decl.trim_start().starts_with("type ") && raw.key_type != concat_type(&key) {
        return Err(format!("key type {:#x}", raw.key_type));
    }
    match ty.and_then(|t| t.data.as_ref()) {
        None if flag(SET_MAP) => Err("a map where a set is declared".into()),
        None => Ok(()),
        Some(_) if !flag(SET_MAP) => Err("a set where a map is declared".into()),
        Some(Data::Verdict) => match raw.data_type {
            Some(0xffff_ff00) => Ok(()),
            t => Err(format!("data type {t:?} instead of verdict")),
        },
        Some(Data::Value(fields)) => match raw.data_len {
            Some(n) if n == fields_len(fields) => Ok(()),
            n => Err(format!("data length {n:?}")),
        },
    }
}

/// One kernel element as kproxy's text: key into `k`, value into `v` (both cleared
/// first), decoded by the desired type.
fn decode_element(
    ty: &SetType,
    e: &RawElement,
    k: &mut String,
    v: &mut String,
) -> Result<(), String> {
    k.clear();
    v.clear();
    decode_fields(&ty.key, &e.key, k)
        .ok_or_else(|| format!("element key {:02x?} does not fit the type", e.key))?;
    match (&ty.data, &e.data) {
        (None, None) => {}
        (Some(Data::Verdict), Some(RawData::Verdict { code, chain })) => v.push_str(
            &decode_verdict(*code, chain.as_deref())
                .ok_or_else(|| format!("element {k}: verdict {code:#x} {chain:?}"))?,
        ),
        (Some(Data::Value(f)), Some(RawData::Value(b))) => decode_fields(f, b, v)
            .ok_or_else(|| format!("element {k}: value {b:02x?} does not fit"))?,
        _ => return Err(format!("element {k}: data does not fit the declaration")),
    }
    Ok(())
}

/// The element changes that bring the kernel's set `name` to `want`: one pass over
/// the kernel's elements, each looked up in `want`; the desired elements the kernel
/// lacks are looked for only when some are missing.
fn element_delta(
    name: &str,
    raw: &RawSet,
    decl: &str,
    want: &BTreeMap<String, String>,
    v6: bool,
    out: &mut ElementDelta,
) -> Result<(), String> {
    let ty = SetType::parse(decl);
    let interval;
    let kernel: Box<dyn Iterator<Item = Result<(String, String), String>>> =
        if raw.flags & SET_INTERVAL != 0 {
            interval = decode_intervals(v6, &raw.elements)
                .ok_or_else(|| "interval elements that are not prefixes".to_string())?;
            Box::new(interval.iter().map(|(k, v)| Ok((k.clone(), v.clone()))))
        } else {
            let Some(ty) = ty else {
                return Err(format!("elements of {decl:?} are not ones adoption reads"));
            };
            Box::new(raw.elements.iter().map(move |e| {
                let (mut k, mut v) = (String::with_capacity(48), String::new());
                decode_element(&ty, e, &mut k, &mut v).map(|_| (k, v))
            }))
        };
    let mut matched = 0;
    let mut seen = std::collections::HashSet::new();
    for kv in kernel {
        let (k, v) = kv?;
        match want.get(&k) {
            Some(w) if *w == v => matched += 1,
            _ => {
                out.dels
                    .entry(name.to_string())
                    .or_default()
                    .insert(k.clone());
            }
        }
        seen.insert(k);
    }
    if matched != want.len() {
        for (k, v) in want {
            let present = seen.contains(k) && !out.dels.get(name).is_some_and(|d| d.contains(k));
            if !present {
                out.adds
                    .entry(name.to_string())
                    .or_default()
                    .insert(k.clone(), v.clone());
            }
        }
    }
    Ok(())
}

/// The kernel's table as a [`Ruleset`] to diff the desired one against, and the element
/// changes. The elements of `desired`'s sets are taken out (compared here, one lookup
/// per kernel element), so that the structural delta from the returned ruleset
/// (`desired.delta_pre(&kernel, …)` and `delta_post`, both now without elements) plus
/// the element changes, in that order, bring the kernel to the desired state. Objects
/// kproxy's delta cannot repair in place are an error.
pub fn adopt(raw: &RawTable, desired: &mut Ruleset) -> Result<(Ruleset, ElementDelta), AdoptError> {
    let err = |what: String| AdoptError {
        family: desired.family,
        table: desired.table.clone(),
        what,
    };
    let want_comment = "rules for kproxy";
    if raw.comment.as_deref() != Some(want_comment) || raw.flags != 0 {
        return Err(err(format!(
            "comment {:?} and flags {:#x}: not a table kproxy made",
            raw.comment, raw.flags
        )));
    }
    let v6 = desired.family == "ip6";
    let mut kernel = Ruleset {
        family: desired.family,
        table: desired.table.clone(),
        sets: BTreeMap::new(),
        chains: BTreeMap::new(),
    };
    for (name, rc) in &raw.chains {
        let want = desired.chains.get(name);
        let decl = match (&rc.hook, want) {
            (None, Some(w)) if w.decl.is_empty() => String::new(),
            (None, None) => String::new(),
            (Some(h), Some(w)) if parse_hook(&w.decl).as_ref() == Some(h) => w.decl.clone(),
            (h, _) => {
                return Err(err(format!(
                    "chain {name}: hook {h:?} is not the declared {:?}",
                    want.map(|w| w.decl.as_str())
                )));
            }
        };
        let same = want.is_some_and(|w| {
            w.rules.len() == rc.rules.len()
                && w.rules
                    .iter()
                    .zip(&rc.rules)
                    .all(|(r, k)| k.comment.as_deref() == Some(rule_tag(r).as_str()))
        });
        let rules = match want {
            Some(w) if same => w.rules.clone(),
            _ if rc.rules.is_empty() => Vec::new(),
            _ => vec![UNKNOWN_RULES.to_string()],
        };
        kernel.chains.insert(name.clone(), Chain { decl, rules });
    }
    let mut delta = ElementDelta::default();
    for (name, rs) in &raw.sets {
        let set = match desired.sets.get_mut(name) {
            Some(w) => {
                let ty = SetType::parse(&w.decl);
                set_matches(rs, &w.decl, ty.as_ref())
                    .map_err(|e| err(format!("set {name}: {e}")))?;
                let want = std::mem::take(&mut w.elements);
                // A dynamic set is filled by the datapath (affinity), never by kproxy.
                if !w.decl.contains("dynamic") {
                    element_delta(name, rs, &w.decl, &want, v6, &mut delta)
                        .map_err(|e| err(format!("set {name}: {e}")))?;
                }
                Set {
                    decl: w.decl.clone(),
                    elements: BTreeMap::new(),
                }
            }
            // Deleted whole by the delta: its type and elements do not matter, only
            // whether it is a map (the delete command says which).
            None => Set {
                decl: if rs.flags & SET_MAP != 0 {
                    "type ipv4_addr : verdict;".into()
                } else {
                    "type ipv4_addr;".into()
                },
                elements: BTreeMap::new(),
            },
        };
        kernel.sets.insert(name.clone(), set);
    }
    // Sets the kernel lacks: created by the structural delta, filled here.
    for (name, w) in desired.sets.iter_mut() {
        if !raw.sets.contains_key(name) {
            let want = std::mem::take(&mut w.elements);
            if !want.is_empty() {
                delta.adds.insert(name.clone(), want);
            }
        }
    }
    Ok((kernel, delta))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The byte layouts of netlink.rs's `encodings_match_nft` test, decoded back.
    #[test]
    fn fields_decode_as_they_encode() {
        use Field::*;
        let n = 1u32.to_ne_bytes();
        let cases: &[(&[Field], Vec<u8>, &str)] = &[
            (
                &[Ipv4, Proto, Service, Numgen],
                [&[10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0][..], &n].concat(),
                "10.0.0.1 . tcp . 80 . 1",
            ),
            (
                &[Ipv4, Service],
                vec![10, 244, 1, 2, 0x1f, 0x90, 0, 0],
                "10.244.1.2 . 8080",
            ),
            (
                &[Proto, Service],
                vec![17, 0, 0, 0, 0x75, 0x65, 0, 0],
                "udp . 30053",
            ),
            (&[Ipv4], vec![10, 96, 0, 1], "10.96.0.1"),
            (&[Service], vec![1, 0xbb], "443"),
            (
                &[Ipv6],
                vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
                "fd00::1",
            ),
        ];
        for (fields, bytes, want) in cases {
            let mut s = String::new();
            assert_eq!(decode_fields(fields, bytes, &mut s), Some(()), "{want}");
            assert_eq!(&s, want);
            assert_eq!(bytes.len() as u32, fields_len(fields), "{want}");
        }
        let mut s = String::new();
        decode_fields(
            &[Ipv4, Proto, Service, Numgen],
            &[
                [10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0].as_slice(),
                &1u32.to_ne_bytes(),
            ]
            .concat(),
            &mut s,
        )
        .unwrap();
        assert_eq!(s, "10.0.0.1 . tcp . 80 . 1");
        let mut s = String::new();
        decode_fields(&[Service], &[1, 0xbb], &mut s).unwrap();
        assert_eq!(s, "443");
        // Wrong lengths are refused, never guessed.
        assert_eq!(decode_fields(&[Ipv4], &[1, 2, 3], &mut String::new()), None);
        assert_eq!(
            decode_fields(&[Ipv4], &[1, 2, 3, 4, 5], &mut String::new()),
            None
        );
        assert_eq!(
            decode_fields(&[Ipv4, Service], &[1, 2, 3, 4, 0, 80], &mut String::new()),
            None
        );
    }

    #[test]
    fn verdicts_decode() {
        assert_eq!(
            decode_verdict(-4i32 as u32, Some("svc-a")).as_deref(),
            Some("goto svc-a")
        );
        assert_eq!(
            decode_verdict(-3i32 as u32, Some("x")).as_deref(),
            Some("jump x")
        );
        assert_eq!(decode_verdict(0, None).as_deref(), Some("drop"));
        assert_eq!(decode_verdict(-4i32 as u32, None), None);
        assert_eq!(decode_verdict(7, None), None);
    }

    #[test]
    fn hooks_parse() {
        let h = |d| parse_hook(d).map(|h| (h.kind, h.hooknum, h.priority, h.policy));
        assert_eq!(
            h("type nat hook output priority -100; policy accept;"),
            Some(("nat".into(), 3, -100, 1))
        );
        assert_eq!(
            h("type nat hook postrouting priority srcnat; policy accept;"),
            Some(("nat".into(), 4, 100, 1))
        );
        assert_eq!(
            h("type nat hook prerouting priority dstnat;"),
            Some(("nat".into(), 0, -100, 1))
        );
        assert_eq!(h("type nat hook ingress priority 0;"), None);
        assert_eq!(h(""), None);
        assert_eq!(h("policy accept;"), None);
    }

    fn el(key: &[u8], end: bool) -> RawElement {
        RawElement {
            key: key.to_vec(),
            data: None,
            flags: u32::from(end),
        }
    }

    #[test]
    fn intervals_decode_to_prefixes() {
        // An end element with no start is not an interval kproxy wrote (but one at the
        // bottom of the space is nft's marker).
        assert_eq!(decode_intervals(false, &[el(&[10, 0, 0, 0], true)]), None);
        let got = decode_intervals(
            false,
            &[
                el(&[0, 0, 0, 0], true),
                el(&[10, 0, 0, 0], false),
                el(&[11, 0, 0, 0], true),
            ],
        );
        assert_eq!(
            got.unwrap().keys().next().map(String::as_str),
            Some("10.0.0.0/8")
        );
        let got = decode_intervals(
            false,
            &[
                el(&[10, 245, 0, 0], true),
                el(&[10, 244, 0, 0], false),
                el(&[192, 168, 1, 8], true),
                el(&[192, 168, 1, 7], false),
            ],
        )
        .unwrap();
        let keys: Vec<&str> = got.keys().map(String::as_str).collect();
        assert_eq!(keys, ["10.244.0.0/16", "192.168.1.7/32"]);
        // A range that is not a prefix.
        assert_eq!(
            decode_intervals(
                false,
                &[el(&[10, 0, 0, 1], false), el(&[10, 0, 0, 4], true)]
            ),
            None
        );
        // Up to the end of the space: no end element.
        let got = decode_intervals(false, &[el(&[128, 0, 0, 0], false)]).unwrap();
        assert_eq!(got.keys().next().map(String::as_str), Some("128.0.0.0/1"));
    }
}
