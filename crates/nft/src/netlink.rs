//! Every write kproxy makes to the kernel's nftables, over nfnetlink, without the `nft`
//! tool: one [`Batch`] is one transaction (all or nothing, like `nft -f`), sent on a
//! socket kept open between syncs ([`Writer`]). Tables (comment, dormant flag), sets and
//! maps (their declarations' user data as nft writes it, so `nft list` prints them as
//! declared), chains (hook, priority, policy), rules (their expressions encoded by
//! [`crate::rule::encode`], the anonymous sets a rule looks up created in its batch) and
//! elements (interval sets' prefixes as start and end elements); deletes and flushes.
//! A delta, an adoption's difference, the first sync into absent tables (in pieces, then
//! the transaction that wakes them; see [`crate::first_sync`]), the one-transaction
//! replacement, `kproxy cleanup` and the takeover's removal of kube-proxy's tables.
//!
//! Why not `nft`: at 10k Services one `nft -f` costs ≈ 5 ms to start, a few ms to fetch
//! its cache and parse (16–20 ms a structural delta, crates/nft/BENCHMARKS.md), and
//! 10–20 ms *closing its netlink socket* after a transaction that deleted elements (the
//! close waits for the kernel to release them; `strace -T`: `close(3)` 18.6 ms). A
//! socket that stays open does not wait. And the `nft` userspace is a moving
//! dependency (version skew, crashes: issue 39).
//!
//! Operations reach this module as a typed [`crate::model::Transaction`]
//! ([`Batch::transaction`], the rendering beside its nft text) and are encoded as nft
//! encodes them: each field of a concatenation padded to 4 bytes, addresses and ports
//! in network order, the `numgen` index in host order. What kproxy never writes (a rule
//! outside its vocabulary, an interval concatenation) is refused, never guessed.

use std::net::IpAddr;
use std::os::fd::AsRawFd;

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::NetfilterMessage;
use netlink_sys::{Socket, SocketAddr};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeVal;

use crate::atom::{concat_type, fields_len};
use crate::error::{EncodeError, EncodeFailure, NftError};
use crate::model::{Atom, Family, Field, Op, SetData, SetDecl, Transaction, Tuple, Value};
// The kernel's vocabulary: every constant, and the reading of attributes, is the floor's.
use crate::nfnl::*;

/// Elements per message are capped so the nested element list stays under the 64 KiB
/// an attribute length can say.
const MAX_ELEMENTS_BYTES: usize = 48 * 1024;
/// A batch's chunk is sealed once it holds this many bytes (at a message's start).
const CHUNK_BYTES: usize = 256 << 10;
/// The send buffer a new socket starts with; raised to the size of a larger batch (a
/// batch must reach the kernel in one `sendmsg`, as `nft` sends it too).
const INITIAL_SNDBUF: usize = 1 << 20;

/// Appends a key or value: a single field as is, each field of a concatenation padded
/// to 4 bytes (nft's register layout); addresses and ports in network order, the
/// `numgen` index in host order. A prefix does not encode as one key: an interval set's
/// prefixes are sent as start and end elements (`interval_elements`).
pub(crate) fn encode_tuple(t: &Tuple, out: &mut Vec<u8>) -> Result<(), EncodeFailure> {
    let concat = t.atoms().len() > 1;
    for a in t.atoms().iter() {
        match a {
            Atom::Addr(IpAddr::V4(v4)) => out.extend_from_slice(&v4.octets()),
            Atom::Addr(IpAddr::V6(v6)) => out.extend_from_slice(&v6.octets()),
            Atom::Prefix(..) => return Err(EncodeFailure::Prefix),
            Atom::Proto(p) => out.push(*p),
            Atom::Port(p) => out.extend_from_slice(&p.to_be_bytes()),
            Atom::Index(i) => out.extend_from_slice(&i.to_ne_bytes()),
        }
        if concat {
            out.resize(out.len().next_multiple_of(4), 0);
        }
    }
    Ok(())
}

/// One transaction of element changes, encoded and ready to send.
///
/// Written as bytes directly rather than through netlink-packet-netfilter's message
/// types: building a `Vec` of attribute objects per element and emitting them cost
/// ≈ 3.5 µs per element (0.6 s of a 10k-Service first sync, 176k elements); writing
/// the bytes costs a tenth of that. A test checks the bytes against the crate's
/// encoding of the same elements.
#[derive(Debug, Default)]
pub struct Batch {
    /// The chunk being written; earlier ones are `sealed`. A message never spans two
    /// chunks, and the batch goes in one `sendmsg` of all of them (an iovec): a
    /// replacement's ≈ 6 MB is never copied into one growing buffer (whose doubling
    /// held twice its size at once).
    bytes: Vec<u8>,
    sealed: Vec<Vec<u8>>,
    sealed_len: usize,
    /// Per message: (sequence number, offset in the whole batch). What a message does
    /// is read back from its bytes when the kernel refuses it ([`Batch::describe`]):
    /// a full sync holds ≈ 60k messages, whose descriptions written up front cost
    /// megabytes and a rendering of every rule.
    messages: Vec<(u32, usize)>,
    /// Messages so far, batch header included (the next sequence number).
    count: u32,
    /// The next anonymous set's id in this batch.
    set_ids: u32,
}

/// Starts an attribute; returns its offset for [`nla_end`].
fn nla_begin(buf: &mut Vec<u8>, kind: u16) -> usize {
    let at = buf.len();
    buf.extend_from_slice(&[0, 0]);
    buf.extend_from_slice(&kind.to_ne_bytes());
    at
}

/// Closes the attribute started at `at`: its length, then padding to 4 bytes.
/// Fails when it does not fit the 16-bit length.
fn nla_end(buf: &mut Vec<u8>, at: usize) -> Result<(), EncodeFailure> {
    let len = u16::try_from(buf.len() - at).map_err(|_| EncodeFailure::TooLong)?;
    buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    buf.resize(buf.len().next_multiple_of(4), 0);
    Ok(())
}

fn nla_u32(buf: &mut Vec<u8>, kind: u16, v: u32) -> Result<(), EncodeFailure> {
    let at = nla_begin(buf, kind);
    buf.extend_from_slice(&v.to_be_bytes());
    nla_end(buf, at)
}

fn nla_str(buf: &mut Vec<u8>, kind: u16, s: &str) -> Result<(), EncodeFailure> {
    let at = nla_begin(buf, kind);
    buf.extend_from_slice(s.as_bytes());
    buf.push(0);
    nla_end(buf, at)
}

fn nla_bytes(buf: &mut Vec<u8>, kind: u16, v: &[u8]) -> Result<(), EncodeFailure> {
    let at = nla_begin(buf, kind);
    buf.extend_from_slice(v);
    nla_end(buf, at)
}

/// The message type and flags that add (`add`) or delete elements.
fn element_message(add: bool) -> (u16, u16) {
    if add {
        (NFT_MSG_NEWSETELEM, NLM_F_CREATE)
    } else {
        (NFT_MSG_DELSETELEM, 0)
    }
}

/// A set's element list of keys only (raw bytes), each flagged when it ends an
/// interval: an interval set's prefixes, an anonymous set's literals.
fn key_list(b: &mut Vec<u8>, elements: &[(Vec<u8>, bool)]) -> Result<(), EncodeFailure> {
    let list = nla_begin(b, NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
    for (key, end) in elements {
        let elem = nla_begin(b, NFTA_LIST_ELEM | NLA_F_NESTED);
        if *end {
            nla_u32(b, NFTA_SET_ELEM_FLAGS, NFT_SET_ELEM_INTERVAL_END)?;
        }
        let k = nla_begin(b, NFTA_SET_ELEM_KEY | NLA_F_NESTED);
        let v = nla_begin(b, NFTA_DATA_VALUE);
        b.extend_from_slice(key);
        nla_end(b, v)?;
        nla_end(b, k)?;
        nla_end(b, elem)?;
    }
    nla_end(b, list)
}

/// libnftnl's user data: TLVs of a one-byte type, a one-byte length, the value.
fn udata(out: &mut Vec<u8>, kind: u8, value: &[u8]) -> Result<(), EncodeFailure> {
    out.push(kind);
    out.push(u8::try_from(value.len()).map_err(|_| EncodeFailure::TooLong)?);
    out.extend_from_slice(value);
    Ok(())
}

/// A user data `u32`, in host order (libnftnl copies it as is).
fn udata_u32(out: &mut Vec<u8>, kind: u8, v: u32) -> Result<(), EncodeFailure> {
    udata(out, kind, &v.to_ne_bytes())
}

/// A user data string, NUL-terminated.
fn udata_str(out: &mut Vec<u8>, kind: u8, s: &str) -> Result<(), EncodeFailure> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    udata(out, kind, &v)
}

/// nft's byte order of a key or data (its `enum byteorder`): a concatenation's is
/// unset (0), an address's or port's big endian (2), an integer's (`numgen`) host (1).
fn byteorder(fields: &[Field]) -> u32 {
    match fields {
        [Field::Numgen(_)] => 1,
        [_] => 2,
        _ => 0,
    }
}

// nft's ids of the expressions and protocol fields a `typeof` declaration names (nft's
// own, in its user data; libnftnl's user data types are `nfnl`'s).
const EXPR_PAYLOAD: u32 = 7;
const EXPR_META: u32 = 9;
const EXPR_CONCAT: u32 = 13;
const EXPR_NUMGEN: u32 = 23;

/// A set's user data as nft 1.0.6 writes it (each verified byte for byte against nft's
/// own batch, `nft --debug=mnl`; a test compares the kernel's listing of both):
/// key byte order; a map's data byte order; auto-merge; the key's (and a map's data)
/// `typeof` expressions, or for a `type` concatenation an empty concatenation; a map's
/// data-interval flag; the comment.
fn set_udata(decl: &SetDecl) -> Result<Vec<u8>, EncodeFailure> {
    let mut u = Vec::new();
    udata_u32(&mut u, UDATA_SET_KEYBYTEORDER, byteorder(&decl.key))?;
    match &decl.data {
        Some(SetData::Verdict) => udata_u32(&mut u, UDATA_SET_DATABYTEORDER, 0)?,
        Some(SetData::Fields(f)) => udata_u32(&mut u, UDATA_SET_DATABYTEORDER, byteorder(f))?,
        // An object map holds no data, only the object's name.
        Some(SetData::Counter) | None => {}
    }
    if decl.auto_merge {
        udata_u32(&mut u, UDATA_SET_MERGE_ELEMENTS, 1)?;
    }
    let typeof_of = |fields: &[Field]| -> Result<Option<Vec<u8>>, EncodeFailure> {
        if decl.by_expr {
            return typeof_udata(fields).map(Some);
        }
        if fields.len() < 2 {
            return Ok(None);
        }
        // A `type` concatenation: the concatenation with no expressions.
        let mut v = Vec::new();
        udata_u32(&mut v, 0, EXPR_CONCAT)?;
        udata(&mut v, 1, &[])?;
        Ok(Some(v))
    };
    if let Some(k) = typeof_of(&decl.key)? {
        udata(&mut u, UDATA_SET_KEY_TYPEOF, &k)?;
    }
    if let Some(SetData::Fields(f)) = &decl.data
        && let Some(d) = typeof_of(f)?
    {
        udata(&mut u, UDATA_SET_DATA_TYPEOF, &d)?;
    }
    if decl.is_map() && decl.data != Some(SetData::Counter) {
        udata_u32(&mut u, UDATA_SET_DATA_INTERVAL, 0)?;
    }
    if let Some(c) = &decl.comment {
        udata_str(&mut u, UDATA_SET_COMMENT, c)?;
    }
    Ok(u)
}

/// A `typeof` declaration's expressions as nft stores them: the expression's id, then
/// its own data; a concatenation's data is each field's, numbered from 0.
fn typeof_udata(fields: &[Field]) -> Result<Vec<u8>, EncodeFailure> {
    let expr = |f: Field| -> Result<Vec<u8>, EncodeFailure> {
        let mut data = Vec::new();
        let ty = match f {
            // payload: protocol description (ip 12, ip6 13, th 11), field (daddr,
            // dport)
            Field::Ipv4Addr => {
                udata_u32(&mut data, 0, 12)?;
                udata_u32(&mut data, 1, 12)?;
                EXPR_PAYLOAD
            }
            Field::Ipv6Addr => {
                udata_u32(&mut data, 0, 13)?;
                udata_u32(&mut data, 1, 9)?;
                EXPR_PAYLOAD
            }
            Field::InetService => {
                udata_u32(&mut data, 0, 11)?;
                udata_u32(&mut data, 1, 2)?;
                EXPR_PAYLOAD
            }
            // meta: its key (NFT_META_L4PROTO)
            Field::InetProto => {
                udata_u32(&mut data, 0, 16)?;
                EXPR_META
            }
            // numgen: type (random), modulus, offset
            Field::Numgen(n) => {
                udata_u32(&mut data, 0, 1)?;
                udata_u32(&mut data, 1, n)?;
                udata_u32(&mut data, 2, 0)?;
                EXPR_NUMGEN
            }
        };
        let mut v = Vec::new();
        udata_u32(&mut v, 0, ty)?;
        udata(&mut v, 1, &data)?;
        Ok(v)
    };
    if let [f] = fields {
        return expr(*f);
    }
    let mut members = Vec::new();
    for (i, f) in fields.iter().enumerate() {
        udata(&mut members, i as u8, &expr(*f)?)?;
    }
    let mut v = Vec::new();
    udata_u32(&mut v, 0, EXPR_CONCAT)?;
    udata(&mut v, 1, &members)?;
    Ok(v)
}

impl Batch {
    pub fn len(&self) -> usize {
        self.sealed_len + self.bytes.len()
    }

    /// Notes the message `seq` begun at `at` in the chunk being written.
    fn note(&mut self, seq: u32, at: usize) {
        self.messages.push((seq, self.sealed_len + at));
    }

    /// What the message at `at` (in the whole batch) does, read from its bytes, in
    /// nft's words: `add rule ip kproxy services`, `delete element ip kproxy hairpin`,
    /// `flush chain ip6 kproxy nat-output` (a rule's comment, kproxy's id, follows).
    fn describe(&self, at: usize) -> String {
        let mut base = 0;
        let mut msg: &[u8] = &[];
        for chunk in self.sealed.iter().chain(std::iter::once(&self.bytes)) {
            if at < base + chunk.len() {
                let start = at - base;
                let len = chunk.get(start..start + 4).map_or(0, |b| {
                    u32::from_ne_bytes(b.try_into().expect("4 bytes")) as usize
                });
                msg = chunk.get(start..start + len).unwrap_or_default();
                break;
            }
            base += chunk.len();
        }
        let Some(header) = msg.get(..20) else {
            return "a message of the batch".into();
        };
        let kind = u16::from_ne_bytes([header[4], header[5]]) & 0xff;
        let family = Family::of_nfproto(header[16]).map_or("", Family::nft);
        let attrs = Attrs(&msg[20..]);
        let text = |want: u16| {
            attrs.clone().find(|(k, _)| *k == want).map(|(_, v)| {
                let end = v.iter().position(|&c| c == 0).unwrap_or(v.len());
                String::from_utf8_lossy(&v[..end]).into_owned()
            })
        };
        let table = text(NFTA_ANY_TABLE).unwrap_or_default();
        let (what, name) = match kind {
            NFT_MSG_NEWTABLE => ("add table", None),
            NFT_MSG_DELTABLE => ("delete table", None),
            NFT_MSG_NEWCHAIN => ("add chain", text(NFTA_CHAIN_NAME)),
            NFT_MSG_DELCHAIN => ("delete chain", text(NFTA_CHAIN_NAME)),
            NFT_MSG_NEWRULE => ("add rule", text(NFTA_RULE_CHAIN)),
            NFT_MSG_DELRULE => ("flush chain", text(NFTA_RULE_CHAIN)),
            NFT_MSG_NEWSET => ("add set", text(NFTA_SET_NAME)),
            NFT_MSG_DELSET => ("delete set", text(NFTA_SET_NAME)),
            NFT_MSG_NEWSETELEM => ("add element", text(NFTA_SET_ELEM_LIST_SET)),
            NFT_MSG_DELSETELEM => ("delete element", text(NFTA_SET_ELEM_LIST_SET)),
            NFT_MSG_DELOBJ => ("delete object", text(NFTA_OBJ_NAME)),
            _ => ("a message", None),
        };
        let mut out = format!("{what} {family} {table}");
        if let Some(n) = name {
            out.push(' ');
            out.push_str(&n);
        }
        if kind == NFT_MSG_NEWRULE
            && let Some((_, u)) = attrs.clone().find(|(k, _)| *k == NFTA_RULE_USERDATA)
            && let Some(c) = u.get(2..)
        {
            let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
            out.push_str(" comment ");
            out.push_str(&String::from_utf8_lossy(&c[..end]));
        }
        out
    }

    /// The batch's bytes, chunk by chunk, for one `sendmsg`.
    fn slices(&self) -> Vec<std::io::IoSlice<'_>> {
        self.sealed
            .iter()
            .chain(std::iter::once(&self.bytes))
            .map(|c| std::io::IoSlice::new(c))
            .collect()
    }

    /// What each message of the batch does, in order ([`Batch::describe`]; tests).
    #[cfg(test)]
    pub(crate) fn descriptions(&self) -> Vec<String> {
        self.messages
            .iter()
            .map(|&(_, at)| self.describe(at))
            .collect()
    }

    /// The batch's bytes in one buffer (tests).
    #[cfg(test)]
    fn to_vec(&self) -> Vec<u8> {
        self.sealed
            .concat()
            .into_iter()
            .chain(self.bytes.iter().copied())
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Starts a message: netlink header (length filled by [`Batch::end_message`]) and
    /// nfgenmsg. Returns its offset.
    fn begin_message(&mut self, kind: u16, flags: u16, family: u8, res_id: u16) -> usize {
        if self.bytes.len() >= CHUNK_BYTES {
            self.sealed_len += self.bytes.len();
            // Room for a chunk and its last message (under 64 KiB), so a chunk is not
            // grown by doubling past it.
            let next = Vec::with_capacity(CHUNK_BYTES + (64 << 10));
            self.sealed.push(std::mem::replace(&mut self.bytes, next));
        }
        self.count += 1;
        let at = self.bytes.len();
        let b = &mut self.bytes;
        b.extend_from_slice(&[0; 4]);
        b.extend_from_slice(&kind.to_ne_bytes());
        b.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
        b.extend_from_slice(&self.count.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&[family, 0]);
        b.extend_from_slice(&res_id.to_be_bytes());
        at
    }

    fn end_message(&mut self, at: usize) {
        let len = (self.bytes.len() - at) as u32;
        self.bytes[at..at + 4].copy_from_slice(&len.to_ne_bytes());
    }

    /// The nfnetlink rendering of a transaction (one batch, one transaction): every
    /// operation kproxy's transactions hold. Fails only on what kproxy never writes (a
    /// rule outside its vocabulary, read back from the kernel; an interval
    /// concatenation), or an attribute too long for netlink: the error names the
    /// operation.
    pub fn transaction(tx: &Transaction) -> Result<Batch, EncodeError> {
        let mut b = Batch::default();
        b.extend(tx)?;
        Ok(b)
    }

    /// Appends `tx`'s operations to this batch (still one transaction): a full sync
    /// encodes its elements piece by piece into the batch, never holding them all typed.
    pub fn extend(&mut self, tx: &Transaction) -> Result<(), EncodeError> {
        for op in &tx.ops {
            self.op(op).map_err(|why| EncodeError {
                what: op.describe(),
                why,
            })?;
        }
        Ok(())
    }

    fn op(&mut self, op: &Op) -> Result<(), EncodeFailure> {
        match op {
            Op::AddTable {
                family,
                table,
                comment,
                dormant,
            } => self.add_table(*family, table, comment.as_deref(), *dormant),
            Op::DeleteTable { family, table } => {
                self.object(*family, NFT_MSG_DELTABLE, table, None)
            }
            Op::AddSet {
                family,
                table,
                name,
                decl,
            } => self.add_set(*family, table, name, decl),
            Op::AddElements {
                family,
                table,
                set,
                elems,
            } if op.has_prefix() => {
                self.interval_elements(true, *family, table, set, elems.iter().map(|e| &e.key))
            }
            Op::DeleteElements {
                family,
                table,
                set,
                keys,
            } if op.has_prefix() => self.interval_elements(false, *family, table, set, keys.iter()),
            Op::AddElements {
                family,
                table,
                set,
                elems,
            } => self.encode_elements(
                true,
                *family,
                table,
                set,
                elems.iter().map(|e| (&e.key, e.value.as_ref())),
            ),
            Op::DeleteElements {
                family,
                table,
                set,
                keys,
            } => self.encode_elements(false, *family, table, set, keys.iter().map(|k| (k, None))),
            Op::AddChain {
                family,
                table,
                name,
                hook,
            } => self.add_chain(*family, table, name, hook.as_ref()),
            Op::FlushChain {
                family,
                table,
                name,
            } => self.object(
                *family,
                NFT_MSG_DELRULE,
                table,
                Some((NFTA_RULE_CHAIN, name)),
            ),
            Op::DeleteChain {
                family,
                table,
                name,
            } => self.object(
                *family,
                NFT_MSG_DELCHAIN,
                table,
                Some((NFTA_CHAIN_NAME, name)),
            ),
            Op::DeleteSet {
                family,
                table,
                name,
                ..
            } => self.object(*family, NFT_MSG_DELSET, table, Some((NFTA_SET_NAME, name))),
            Op::AddRule {
                family,
                table,
                chain,
                rule,
            } => self.add_rule(*family, table, chain, rule),
            Op::AddCounter {
                family,
                table,
                name,
                packets,
                bytes,
                since,
            } => self.add_counter(*family, table, name, [*packets, *bytes, *since]),
            Op::DeleteObject {
                family,
                table,
                kind,
                name,
            } => self.delete_object(*family, table, *kind, name),
        }
    }

    /// `add counter`: a named counter object starting at `packets` and `bytes`, its
    /// comment (libnftnl's object comment, user data type 0) saying since when it
    /// counts (`since_comment`).
    fn add_counter(
        &mut self,
        family: Family,
        table: &str,
        name: &str,
        [packets, bytes, since]: [u64; 3],
    ) -> Result<(), EncodeFailure> {
        self.message(NFT_MSG_NEWOBJ, NLM_F_CREATE, family.nfproto(), |b| {
            nla_str(b, NFTA_OBJ_TABLE, table)?;
            nla_str(b, NFTA_OBJ_NAME, name)?;
            nla_u32(b, NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER)?;
            let data = nla_begin(b, NFTA_OBJ_DATA | NLA_F_NESTED);
            nla_bytes(b, NFTA_COUNTER_BYTES, &bytes.to_be_bytes())?;
            nla_bytes(b, NFTA_COUNTER_PACKETS, &packets.to_be_bytes())?;
            nla_end(b, data)?;
            let mut u = Vec::new();
            udata_str(&mut u, UDATA_COMMENT, &since_comment(since))?;
            nla_bytes(b, NFTA_OBJ_USERDATA, &u)?;
            Ok(())
        })
    }

    /// `add table`, with its comment as nft stores it (libnftnl's table user data: the
    /// comment TLV, type 0) and created dormant when asked (its base chains unhooked
    /// until [`Batch::wake_tables`]).
    fn add_table(
        &mut self,
        family: Family,
        table: &str,
        comment: Option<&str>,
        dormant: bool,
    ) -> Result<(), EncodeFailure> {
        self.message(NFT_MSG_NEWTABLE, NLM_F_CREATE, family.nfproto(), |b| {
            nla_str(b, NFTA_TABLE_NAME, table)?;
            let flags = if dormant { NFT_TABLE_F_DORMANT } else { 0 };
            nla_u32(b, NFTA_TABLE_FLAGS, flags)?;
            if let Some(c) = comment {
                let mut u = Vec::new();
                udata_str(&mut u, UDATA_COMMENT, c)?;
                nla_bytes(b, NFTA_TABLE_USERDATA, &u)?;
            }
            Ok(())
        })
    }

    /// `add set` / `add map` as nft 1.0.6 sends its declaration: the kernel's key and
    /// data types (a concatenation's datatypes 6 bits each), flags, timeout, and the
    /// user data nft reads back to print it (byte orders, auto-merge, a `typeof`
    /// declaration's expressions, the comment: [`set_udata`]).
    fn add_set(
        &mut self,
        family: Family,
        table: &str,
        name: &str,
        decl: &SetDecl,
    ) -> Result<(), EncodeFailure> {
        if decl.interval && decl.key.len() > 1 {
            // nft adds a field-length description kproxy never needs; not guessed.
            return Err(EncodeFailure::Declaration);
        }
        self.set_ids += 1;
        let id = self.set_ids;
        self.message(NFT_MSG_NEWSET, NLM_F_CREATE, family.nfproto(), |b| {
            nla_str(b, NFTA_SET_TABLE, table)?;
            nla_str(b, NFTA_SET_NAME, name)?;
            let mut flags = 0;
            for (on, f) in [
                (decl.interval, NFT_SET_INTERVAL),
                (
                    decl.is_map() && decl.data != Some(SetData::Counter),
                    NFT_SET_MAP,
                ),
                (decl.timeout_secs.is_some(), NFT_SET_TIMEOUT),
                (decl.dynamic, NFT_SET_EVAL),
                (decl.data == Some(SetData::Counter), NFT_SET_OBJECT),
            ] {
                if on {
                    flags |= f;
                }
            }
            nla_u32(b, NFTA_SET_FLAGS, flags)?;
            nla_u32(b, NFTA_SET_KEY_TYPE, concat_type(&decl.key))?;
            nla_u32(b, NFTA_SET_KEY_LEN, fields_len(&decl.key))?;
            match &decl.data {
                None => {}
                Some(SetData::Verdict) => {
                    nla_u32(b, NFTA_SET_DATA_TYPE, NFT_DATA_VERDICT)?;
                    nla_u32(b, NFTA_SET_DATA_LEN, 0)?;
                }
                Some(SetData::Fields(f)) => {
                    nla_u32(b, NFTA_SET_DATA_TYPE, concat_type(f))?;
                    nla_u32(b, NFTA_SET_DATA_LEN, fields_len(f))?;
                }
                Some(SetData::Counter) => {
                    nla_u32(b, NFTA_SET_OBJ_TYPE, NFT_OBJECT_COUNTER)?;
                }
            }
            nla_u32(b, NFTA_SET_ID, id)?;
            if let Some(secs) = decl.timeout_secs {
                let at = nla_begin(b, NFTA_SET_TIMEOUT);
                b.extend_from_slice(&(u64::from(secs) * 1000).to_be_bytes());
                nla_end(b, at)?;
            }
            nla_bytes(b, NFTA_SET_USERDATA, &set_udata(decl)?)?;
            Ok(())
        })
    }

    /// Adds or deletes prefixes of an interval set of addresses as the kernel holds
    /// them: each its start and an end element (flagged) one past its last address (none
    /// when it runs to the top of the space), and on add nft's end marker at 0 below
    /// the first interval when that does not start at 0 (added again, it is the same
    /// element: no error). A prefix inside another of the same operation is dropped (its
    /// interval is the other's: nft's auto-merge does the same); adjacent prefixes stay
    /// two intervals, so the kernel reads back as the record wrote them.
    fn interval_elements<'a>(
        &mut self,
        add: bool,
        family: Family,
        table: &str,
        set: &str,
        keys: impl Iterator<Item = &'a Tuple>,
    ) -> Result<(), EncodeFailure> {
        let v6 = family == Family::Ip6;
        let mut ranges = Vec::new();
        for k in keys {
            let atoms = k.atoms();
            let [atom] = atoms[..] else {
                return Err(EncodeFailure::Prefix);
            };
            let lit = crate::rule::Lit::Atom(atom);
            ranges.push(crate::rule::range(&lit, v6).ok_or(EncodeFailure::Prefix)?);
        }
        ranges.sort_unstable();
        let mut kept: Vec<(u128, u128)> = Vec::new();
        for r in ranges {
            match kept.last() {
                Some(&(_, last)) if r.1 <= last => {}
                _ => kept.push(r),
            }
        }
        let width = if v6 { 16 } else { 4 };
        let bytes = |n: u128| n.to_be_bytes()[16 - width..].to_vec();
        let top = if v6 { u128::MAX } else { u128::from(u32::MAX) };
        let mut elements = Vec::new();
        if add && kept.first().is_some_and(|r| r.0 != 0) {
            elements.push((bytes(0), true));
        }
        for (start, last) in kept {
            elements.push((bytes(start), false));
            if last != top {
                elements.push((bytes(last + 1), true));
            }
        }
        let (kind, flags) = element_message(add);
        self.message(kind, flags, family.nfproto(), |b| {
            nla_str(b, NFTA_SET_ELEM_LIST_TABLE, table)?;
            nla_str(b, NFTA_SET_ELEM_LIST_SET, set)?;
            key_list(b, &elements)
        })
    }

    /// Adds (`add`) or deletes the elements `items` (key, value) of `set` in `table`
    /// of `family`. Fails when an element does not encode.
    fn encode_elements<'a>(
        &mut self,
        add: bool,
        family: Family,
        table: &str,
        set: &str,
        items: impl Iterator<Item = (&'a Tuple, Option<&'a Value>)>,
    ) -> Result<(), EncodeFailure> {
        self.batch_begin();
        let fam = family.nfproto();
        let (kind, flags) = element_message(add);
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | kind;
        // (message offset, element list offset) of the open message.
        let mut open: Option<(usize, usize)> = None;
        for (k, v) in items {
            let (msg, list) = match open {
                Some(o) => o,
                None => {
                    let seq = self.count + 1;
                    let msg = self.begin_message(kind, flags, fam, 0);
                    nla_str(&mut self.bytes, NFTA_SET_ELEM_LIST_TABLE, table)?;
                    nla_str(&mut self.bytes, NFTA_SET_ELEM_LIST_SET, set)?;
                    let list =
                        nla_begin(&mut self.bytes, NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
                    self.note(seq, msg);
                    *open.insert((msg, list))
                }
            };
            let b = &mut self.bytes;
            let elem = nla_begin(b, NFTA_LIST_ELEM | NLA_F_NESTED);
            let key = nla_begin(b, NFTA_SET_ELEM_KEY | NLA_F_NESTED);
            let value = nla_begin(b, NFTA_DATA_VALUE);
            encode_tuple(k, b)?;
            nla_end(b, value)?;
            nla_end(b, key)?;
            match (v, add) {
                (Some(Value::Verdict(v)), true) => {
                    let (code, chain) = v.netlink();
                    let data = nla_begin(b, NFTA_SET_ELEM_DATA | NLA_F_NESTED);
                    let vd = nla_begin(b, NFTA_DATA_VERDICT | NLA_F_NESTED);
                    let c = nla_begin(b, NFTA_VERDICT_CODE);
                    b.extend_from_slice(&code.to_be_bytes());
                    nla_end(b, c)?;
                    if let Some(chain) = chain {
                        nla_str(b, NFTA_VERDICT_CHAIN, chain)?;
                    }
                    nla_end(b, vd)?;
                    nla_end(b, data)?;
                }
                (Some(Value::Data(t)), true) => {
                    let data = nla_begin(b, NFTA_SET_ELEM_DATA | NLA_F_NESTED);
                    let value = nla_begin(b, NFTA_DATA_VALUE);
                    encode_tuple(t, b)?;
                    nla_end(b, value)?;
                    nla_end(b, data)?;
                }
                (Some(Value::Counter(name)), true) => {
                    nla_str(b, NFTA_SET_ELEM_OBJREF, name)?;
                }
                _ => {}
            }
            nla_end(b, elem)?;
            if b.len() - list >= MAX_ELEMENTS_BYTES {
                nla_end(b, list)?;
                self.end_message(msg);
                open = None;
            }
        }
        if let Some((msg, list)) = open {
            nla_end(&mut self.bytes, list)?;
            self.end_message(msg);
        }
        Ok(())
    }

    /// One nf_tables message `msg` of the batch (begun first when it is the first):
    /// header and nfgenmsg, then the attributes `body` writes; noted for
    /// [`Batch::describe`].
    fn message(
        &mut self,
        msg: u16,
        flags: u16,
        family: u8,
        body: impl FnOnce(&mut Vec<u8>) -> Result<(), EncodeFailure>,
    ) -> Result<(), EncodeFailure> {
        self.batch_begin();
        let seq = self.count + 1;
        let at = self.begin_message((NFNL_SUBSYS_NFTABLES << 8) | msg, flags, family, 0);
        body(&mut self.bytes)?;
        self.end_message(at);
        self.note(seq, at);
        Ok(())
    }

    fn batch_begin(&mut self) {
        if self.count == 0 {
            let at = self.begin_message(NFNL_MSG_BATCH_BEGIN, 0, 0, NFNL_SUBSYS_NFTABLES);
            self.end_message(at);
        }
    }

    /// A message naming one object (`table`, and `named` = (attribute, name) unless
    /// the object is the table): a table's, chain's or set's delete, a chain's flush
    /// (`DELRULE` without a handle).
    fn object(
        &mut self,
        family: Family,
        msg: u16,
        table: &str,
        named: Option<(u16, &str)>,
    ) -> Result<(), EncodeFailure> {
        self.message(msg, 0, family.nfproto(), |b| {
            nla_str(b, NFTA_ANY_TABLE, table)?;
            if let Some((attr, name)) = named {
                nla_str(b, attr, name)?;
            }
            Ok(())
        })
    }

    /// `delete KIND`: a named object of `NFT_OBJECT_*` type `kind` (the kernel finds it
    /// by table, name and type).
    fn delete_object(
        &mut self,
        family: Family,
        table: &str,
        kind: u32,
        name: &str,
    ) -> Result<(), EncodeFailure> {
        self.message(NFT_MSG_DELOBJ, 0, family.nfproto(), |b| {
            nla_str(b, NFTA_OBJ_TABLE, table)?;
            nla_str(b, NFTA_OBJ_NAME, name)?;
            nla_u32(b, NFTA_OBJ_TYPE, kind)?;
            Ok(())
        })
    }

    /// `add chain`: a regular chain, or a base chain with its hook (policy accept).
    fn add_chain(
        &mut self,
        family: Family,
        table: &str,
        name: &str,
        hook: Option<&crate::model::Hook>,
    ) -> Result<(), EncodeFailure> {
        self.message(NFT_MSG_NEWCHAIN, NLM_F_CREATE, family.nfproto(), |b| {
            nla_str(b, NFTA_CHAIN_TABLE, table)?;
            nla_str(b, NFTA_CHAIN_NAME, name)?;
            if let Some(h) = hook {
                let nest = nla_begin(b, NFTA_CHAIN_HOOK | NLA_F_NESTED);
                nla_u32(b, NFTA_HOOK_HOOKNUM, h.hook.number())?;
                nla_u32(b, NFTA_HOOK_PRIORITY, h.priority as u32)?;
                nla_end(b, nest)?;
                nla_u32(b, NFTA_CHAIN_POLICY, NF_ACCEPT)?;
                let ty = match h.ty {
                    crate::model::ChainType::Filter => "filter",
                    crate::model::ChainType::Nat => "nat",
                };
                nla_str(b, NFTA_CHAIN_TYPE, ty)?;
            }
            Ok(())
        })
    }

    /// `add rule` with its `kp:` id as the comment: the anonymous sets it looks up
    /// (created constant, with their elements), then the rule's expressions, encoded by
    /// the one encoder of rules ([`crate::rule::encode`]).
    fn add_rule(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
        rule: &crate::rule::Rule,
    ) -> Result<(), EncodeFailure> {
        let tag = format!("{}{}", crate::model::RULE_ID_PREFIX, rule.id());
        self.add_rule_tagged(family, table, chain, rule, &tag)
    }

    /// Appends `rule` to `chain` with the comment `tag` (kproxy's own rules carry
    /// their `kp:` id; a test forges one under another rule's id).
    pub fn add_rule_tagged(
        &mut self,
        family: Family,
        table: &str,
        chain: &str,
        rule: &crate::rule::Rule,
        tag: &str,
    ) -> Result<(), EncodeFailure> {
        let (exprs, sets) = crate::rule::encode::encode(rule, family, &mut self.set_ids)
            .ok_or(EncodeFailure::Rule)?;
        let fam = family.nfproto();
        for set in &sets {
            self.anonymous_set(fam, table, set)?;
        }
        self.message(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, fam, |b| {
            nla_str(b, NFTA_RULE_TABLE, table)?;
            nla_str(b, NFTA_RULE_CHAIN, chain)?;
            let e = nla_begin(b, NFTA_RULE_EXPRESSIONS | NLA_F_NESTED);
            b.extend_from_slice(&exprs);
            nla_end(b, e)?;
            // libnftnl's user data: the comment TLV, NUL-terminated.
            let mut u = Vec::new();
            udata_str(&mut u, UDATA_COMMENT, tag)?;
            nla_bytes(b, NFTA_RULE_USERDATA, &u)
        })
    }

    /// A rule's anonymous set and its elements, in the rule's batch.
    fn anonymous_set(
        &mut self,
        fam: u8,
        table: &str,
        set: &crate::rule::encode::AnonymousSet,
    ) -> Result<(), EncodeFailure> {
        self.message(NFT_MSG_NEWSET, NLM_F_CREATE, fam, |b| {
            nla_str(b, NFTA_SET_TABLE, table)?;
            nla_str(b, NFTA_SET_NAME, &set.name)?;
            let mut flags = NFT_SET_ANONYMOUS | NFT_SET_CONSTANT;
            if set.interval {
                flags |= NFT_SET_INTERVAL;
            }
            nla_u32(b, NFTA_SET_FLAGS, flags)?;
            nla_u32(b, NFTA_SET_KEY_TYPE, set.key_type)?;
            nla_u32(b, NFTA_SET_KEY_LEN, set.key_len)?;
            nla_u32(b, NFTA_SET_ID, set.id)?;
            Ok(())
        })?;
        self.message(NFT_MSG_NEWSETELEM, NLM_F_CREATE, fam, |b| {
            nla_str(b, NFTA_SET_ELEM_LIST_TABLE, table)?;
            nla_str(b, NFTA_SET_ELEM_LIST_SET, &set.name)?;
            nla_u32(b, NFTA_SET_ELEM_LIST_SET_ID, set.id)?;
            key_list(b, &set.elements)?;
            Ok(())
        })
    }

    /// One transaction of `first`'s operations (a first sync's base chains' rules)
    /// that then wakes the dormant `tables` (`NEWTABLE` with no flags): each table's
    /// base chains are hooked as it commits, all tables at once. The last step of a
    /// first sync into absent tables
    /// ([`crate::model::Transaction::dormant_for_absent_tables`]); without `nft`, whose
    /// start and cache dump (every chain of the tables) cost more than the rest of the
    /// step.
    pub fn wake_tables(
        tables: &[(Family, &str)],
        first: &Transaction,
    ) -> Result<Batch, EncodeError> {
        let mut b = Batch::transaction(first)?;
        b.batch_begin();
        let kind = (u16::from(NFNL_SUBSYS_NFTABLES as u8) << 8) | NFT_MSG_NEWTABLE;
        for (family, table) in tables {
            let seq = b.count + 1;
            let msg = b.begin_message(kind, 0, family.nfproto(), 0);
            // A name longer than an attribute can say is refused by `DataplaneConfig`.
            let named = nla_str(&mut b.bytes, NFTA_TABLE_NAME, table);
            debug_assert!(named.is_ok());
            let flags = nla_begin(&mut b.bytes, NFTA_TABLE_FLAGS);
            b.bytes.extend_from_slice(&0u32.to_be_bytes());
            let _ = nla_end(&mut b.bytes, flags);
            b.end_message(msg);
            b.note(seq, msg);
        }
        Ok(b)
    }

    /// Closes the batch (nothing can be added after). Only its last message asks for
    /// an acknowledgement: the kernel runs the whole batch inside `sendmsg`, so that
    /// answer arrives after any error of an earlier message (a few hundred answers
    /// would overflow the socket's receive buffer on a full sync).
    fn finish(mut self) -> Batch {
        if let Some((_, offset)) = self.messages.last() {
            // The last message is in the chunk being written.
            let at = offset - self.sealed_len + 6;
            let flags = u16::from_ne_bytes([self.bytes[at], self.bytes[at + 1]]) | NLM_F_ACK;
            self.bytes[at..at + 2].copy_from_slice(&flags.to_ne_bytes());
        }
        if self.count > 0 {
            let at = self.begin_message(NFNL_MSG_BATCH_END, 0, 0, NFNL_SUBSYS_NFTABLES);
            self.end_message(at);
        }
        self
    }
}

/// A netfilter netlink socket kept between syncs, in the network namespace of the
/// thread that opened it; reopened if a later call comes from another namespace.
pub struct Writer {
    sock: Socket,
    netns: u64,
    sndbuf: usize,
}

fn set_sndbuf(sock: &Socket, size: usize) -> std::io::Result<()> {
    // SO_SNDBUFFORCE needs CAP_NET_ADMIN, which kproxy has; fall back to the capped one.
    setsockopt(sock, sockopt::SndBufForce, &size)
        .or_else(|_| setsockopt(sock, sockopt::SndBuf, &size))
        .map_err(std::io::Error::from)
}

/// The netlink messages in one datagram, decoded (undecodable ones skipped).
fn messages(buf: &[u8]) -> impl Iterator<Item = NetlinkPayload<NetfilterMessage>> + '_ {
    let mut offset = 0;
    std::iter::from_fn(move || {
        while offset + 16 <= buf.len() {
            let len =
                u32::from_ne_bytes(buf[offset..offset + 4].try_into().expect("4 bytes")) as usize;
            if len < 16 || offset + len > buf.len() {
                return None;
            }
            let m = <NetlinkMessage<NetfilterMessage>>::deserialize(&buf[offset..offset + len]);
            offset += len.next_multiple_of(4);
            if let Ok(m) = m {
                return Some(m.payload);
            }
        }
        None
    })
}

impl Writer {
    /// Opens the socket in the calling thread's network namespace.
    pub fn open() -> Result<Writer, NftError> {
        let io = |context: &str| {
            let context = context.to_string();
            move |source| NftError::Io { context, source }
        };
        let sock = open().map_err(io("opening a netfilter netlink socket"))?;
        // What this socket commits is kproxy's own, not interference.
        let mut addr = SocketAddr::new(0, 0);
        sock.get_address(&mut addr)
            .map_err(io("reading the netlink socket's port id"))?;
        note_own(addr.port_number());
        // Errors carry only the failing message's header, not the whole batch back.
        sock.set_cap_ack(true)
            .map_err(io("setting NETLINK_CAP_ACK"))?;
        set_sndbuf(&sock, INITIAL_SNDBUF).map_err(io("raising the netlink send buffer"))?;
        let rcvbuf: usize = 1 << 20;
        setsockopt(&sock, sockopt::RcvBufForce, &rcvbuf)
            .or_else(|_| setsockopt(&sock, sockopt::RcvBuf, &rcvbuf))
            .map_err(std::io::Error::from)
            .map_err(io("raising the netlink receive buffer"))?;
        // The kernel answers while processing the batch inside sendmsg, so replies are
        // queued before we read; the timeout only guards against a kernel that does not.
        setsockopt(&sock, sockopt::ReceiveTimeout, &TimeVal::new(5, 0))
            .map_err(std::io::Error::from)
            .map_err(io("setting the netlink receive timeout"))?;
        Ok(Writer {
            sock,
            netns: current_netns()?,
            sndbuf: INITIAL_SNDBUF,
        })
    }

    /// Drops replies left from an aborted batch, so they are not read as answers to the
    /// next one.
    fn drain(&self) {
        let mut buf = vec![0u8; 1 << 16];
        while self
            .sock
            .recv(&mut &mut buf[..], libc::MSG_DONTWAIT)
            .is_ok_and(|n| n > 0)
        {}
    }

    /// True when the calling thread is in the namespace the socket was opened in.
    pub fn in_current_netns(&self) -> Result<bool, NftError> {
        Ok(current_netns()? == self.netns)
    }

    /// Sends the batch as one transaction and waits for the kernel's answer to every
    /// message; the first error names the message it failed on.
    pub fn send(&mut self, batch: Batch) -> Result<(), NftError> {
        let batch = batch.finish();
        if batch.is_empty() {
            return Ok(());
        }
        self.drain();
        if batch.len() + (64 << 10) > self.sndbuf {
            let size = batch.len() + (64 << 10);
            set_sndbuf(&self.sock, size).map_err(|e| NftError::Io {
                context: format!("raising the netlink send buffer to {size} bytes"),
                source: e,
            })?;
            self.sndbuf = size;
        }
        // One `sendmsg`: the kernel copies the iovec into one skb and runs the batch.
        let sent = nix::sys::socket::sendmsg::<nix::sys::socket::NetlinkAddr>(
            self.sock.as_raw_fd(),
            &batch.slices(),
            &[],
            nix::sys::socket::MsgFlags::empty(),
            None,
        )
        .map_err(|e| NftError::Io {
            context: format!("sending a {}-byte nfnetlink batch", batch.len()),
            source: e.into(),
        })?;
        if sent != batch.len() {
            return Err(NftError::Io {
                context: format!("sending a {}-byte nfnetlink batch", batch.len()),
                source: std::io::Error::other(format!("sent {sent} bytes")),
            });
        }
        let last = batch.messages.last().map_or(0, |(seq, _)| *seq);
        let (mut acked, mut first_error) = (false, None::<(u32, i32)>);
        let mut buf = vec![0u8; 1 << 16];
        // Everything the kernel says about the batch is queued before `send` returns:
        // read it all, blocking (up to the receive timeout) only until the last message's
        // acknowledgement or an error has come.
        loop {
            let flags = if acked || first_error.is_some() {
                libc::MSG_DONTWAIT
            } else {
                0
            };
            let size = match self.sock.recv(&mut &mut buf[..], flags) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && flags != 0 => break,
                Err(e) => {
                    return Err(NftError::Io {
                        context: format!(
                            "reading the kernel's answer to a {}-message nfnetlink batch",
                            batch.messages.len()
                        ),
                        source: e,
                    });
                }
            };
            for m in messages(&buf[..size]) {
                if let NetlinkPayload::Error(e) = m {
                    let seq = e
                        .header
                        .get(8..12)
                        .map_or(0, |b| u32::from_ne_bytes(b.try_into().expect("4 bytes")));
                    match e.code.map_or(0, |c| c.get()) {
                        0 => acked |= seq == last,
                        code => {
                            first_error.get_or_insert((seq, code));
                        }
                    }
                }
            }
        }
        match first_error {
            None => Ok(()),
            Some((seq, code)) => {
                let what = batch
                    .messages
                    .iter()
                    .find(|(s, _)| *s == seq)
                    .map_or_else(|| "the batch".to_string(), |(_, at)| batch.describe(*at));
                Err(NftError::Refused {
                    message: format!("{what}: {}", std::io::Error::from_raw_os_error(-code)),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Elem;
    use netlink_packet_netfilter::nftables::{NfTablesMessage, TableMessage};
    use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessageInner, NetfilterProtoFamily};

    use crate::model::{Field, SetData, SetDecl};

    /// `fields` as a set declaration (`typeof` when a `numgen` field needs it).
    fn decl(fields: &[Field]) -> SetDecl {
        SetDecl {
            by_expr: fields.iter().any(|f| matches!(f, Field::Numgen(_))),
            ..SetDecl::set(fields.to_vec())
        }
    }

    fn tuple(fields: &[Field], s: &str) -> Option<Tuple> {
        decl(fields).parse_elem(s, "").map(|e| e.key)
    }

    /// Byte layouts as `nft --debug=netlink` prints them for the same elements (words
    /// shown little-endian there): e.g. `0100000a 00000006 00005000 00000001 :
    /// 0201f40a 0000901f` for `10.0.0.1 . tcp . 80 . 1 : 10.244.1.2 . 8080`.
    #[test]
    fn encodings_match_nft() {
        use Field::*;
        let n = 1u32.to_ne_bytes();
        let cases: &[(&[Field], &str, Vec<u8>)] = &[
            (
                &[Ipv4Addr, InetProto, InetService, Numgen(2)],
                "10.0.0.1 . tcp . 80 . 1",
                [&[10, 0, 0, 1, 6, 0, 0, 0, 0, 80, 0, 0][..], &n].concat(),
            ),
            (
                &[Ipv4Addr, InetService],
                "10.244.1.2 . 8080",
                vec![10, 244, 1, 2, 0x1f, 0x90, 0, 0],
            ),
            (
                &[InetProto, InetService],
                "udp . 30053",
                vec![17, 0, 0, 0, 0x75, 0x65, 0, 0],
            ),
            (&[Ipv4Addr], "10.96.0.1", vec![10, 96, 0, 1]),
            (&[InetService], "443", vec![1, 0xbb]),
            (
                &[Ipv6Addr],
                "fd00::1",
                vec![0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1],
            ),
        ];
        for (fields, s, want) in cases {
            let mut out = Vec::new();
            encode_tuple(&tuple(fields, s).unwrap(), &mut out).unwrap();
            assert_eq!(&out, want, "{s}");
        }
        // Wrong arity or unparsable fields are refused, not guessed.
        assert_eq!(tuple(&[Ipv4Addr, InetService], "10.0.0.1"), None);
        assert_eq!(tuple(&[Ipv4Addr], "10.0.0.1 . 80"), None);
        assert_eq!(tuple(&[Ipv4Addr], "fd00::1"), None);
        assert_eq!(tuple(&[InetProto], "icmp"), None);
        assert_eq!(tuple(&[Numgen(2)], "2"), None);
        // A prefix is an interval: start and end elements, not one tuple.
        let mut iv = decl(&[Ipv4Addr]);
        iv.interval = true;
        let p = iv.parse_elem("10.0.0.0/8", "").unwrap().key;
        assert_eq!(
            encode_tuple(&p, &mut Vec::new()),
            Err(EncodeFailure::Prefix)
        );
        let mut v6 = decl(&[Ipv6Addr]);
        v6.interval = true;
        // The batch says which operation did not encode, and why.
        let add = |key: Tuple| Op::AddElements {
            family: Family::Ip,
            table: "kproxy".into(),
            set: "local-pods".into(),
            elems: vec![crate::model::Elem { key, value: None }],
        };
        let tx = |ops| Transaction {
            ops,
            ..Transaction::default()
        };
        assert!(Batch::transaction(&tx(vec![add(p)])).is_ok());
        // An address of the other family in an ip table's interval set is refused.
        let wrong = v6.parse_elem("fd00::/64", "").unwrap().key;
        assert_eq!(
            Batch::transaction(&tx(vec![add(wrong)])).err(),
            Some(EncodeError {
                what: "add element ip kproxy local-pods".into(),
                why: EncodeFailure::Prefix,
            })
        );
        let table = Op::DeleteTable {
            family: Family::Ip6,
            table: "kproxy".into(),
        };
        assert!(Batch::transaction(&tx(vec![table])).is_ok());
        let flush = Op::FlushChain {
            family: Family::Ip6,
            table: "kproxy".into(),
            name: "services".into(),
        };
        assert!(Batch::transaction(&tx(vec![flush])).is_ok());
    }

    /// The hand-written bytes equal netlink-packet-netfilter's encoding of the same
    /// messages (its types are the reference; kproxy only skips their per-element cost).
    #[test]
    fn batch_bytes_equal_the_crates_encoding() {
        use netlink_packet_core::NetlinkHeader;
        use netlink_packet_netfilter::nftables::{
            DataAttribute, ListAttribute, SetElementAttribute, SetElementList, SetElementMessage,
            Verdict, VerdictAttribute,
        };
        use netlink_packet_netfilter::none::ControlMessage;

        fn serialize(
            seq: u32,
            flags: u16,
            family: NetfilterProtoFamily,
            res: u16,
            inner: NetfilterMessageInner,
        ) -> Vec<u8> {
            let mut hdr = NetlinkHeader::default();
            hdr.flags = NLM_F_REQUEST | flags;
            hdr.sequence_number = seq;
            let mut m = NetfilterMessage::new(
                NetfilterHeader::new(family, 0, res),
                NfTablesMessage::GetTable(TableMessage { attributes: vec![] }),
            );
            m.inner = inner;
            let mut packet = NetlinkMessage::new(hdr, NetlinkPayload::from(m));
            packet.finalize();
            let mut buf = vec![0; packet.buffer_len()];
            packet.serialize(&mut buf);
            buf
        }
        let key = |f: &[Field], s: &str| {
            let mut v = Vec::new();
            encode_tuple(&tuple(f, s).unwrap(), &mut v).unwrap();
            SetElementAttribute::Key(DataAttribute::Value(v))
        };
        let elems_msg = |set: &str, elems: Vec<Vec<SetElementAttribute>>, add: bool| {
            let m = SetElementMessage {
                attributes: vec![
                    SetElementList::Table("kproxy".into()),
                    SetElementList::Set(set.into()),
                    SetElementList::Elements(
                        elems.into_iter().map(ListAttribute::Element).collect(),
                    ),
                ],
            };
            NetfilterMessageInner::NfTables(if add {
                NfTablesMessage::NewSetElement(m)
            } else {
                NfTablesMessage::DeleteSetElement(m)
            })
        };
        use Field::*;
        let vmap = SetDecl::map(vec![Ipv4Addr, InetProto, InetService], SetData::Verdict);
        let dnat = SetDecl {
            by_expr: true,
            ..SetDecl::map(
                vec![Ipv4Addr, InetProto, InetService, Numgen(2)],
                SetData::Fields(vec![Ipv4Addr, InetService]),
            )
        };
        let set = SetDecl::set(vec![Ipv4Addr]);
        let op = |decl: &SetDecl, set: &str, add: bool, items: &[(&str, &str)]| {
            let elems: Vec<_> = items
                .iter()
                .map(|(k, v)| decl.parse_elem(k, v).unwrap())
                .collect();
            let (family, table, set) = (Family::Ip, "kproxy".to_string(), set.to_string());
            if add {
                Op::AddElements {
                    family,
                    table,
                    set,
                    elems,
                }
            } else {
                Op::DeleteElements {
                    family,
                    table,
                    set,
                    keys: elems.into_iter().map(|e| e.key).collect(),
                }
            }
        };
        let tx = Transaction {
            ops: vec![
                op(
                    &vmap,
                    "service-ips",
                    true,
                    &[
                        ("10.96.0.1 . tcp . 80", "goto svc-a"),
                        ("10.96.0.2 . udp . 53", "drop"),
                    ],
                ),
                op(
                    &dnat,
                    "dnat-c-2",
                    true,
                    &[("10.96.0.1 . tcp . 80 . 1", "10.244.1.2 . 8080")],
                ),
                op(&set, "cluster-ips", false, &[("10.96.0.3", "")]),
            ],
            ..Transaction::default()
        };
        let b = Batch::transaction(&tx).unwrap();
        let got = b.finish().to_vec();

        let v4 = NetfilterProtoFamily::IPv4;
        let mut want = serialize(
            1,
            0,
            NetfilterProtoFamily::Unspec,
            NFNL_SUBSYS_NFTABLES,
            NetfilterMessageInner::None(ControlMessage::BatchBegin),
        );
        want.extend(serialize(
            2,
            NLM_F_CREATE,
            v4,
            0,
            elems_msg(
                "service-ips",
                vec![
                    vec![
                        key(&vmap.key[..], "10.96.0.1 . tcp . 80"),
                        SetElementAttribute::Data(DataAttribute::Verdict(vec![
                            VerdictAttribute::Code(Verdict::Goto),
                            VerdictAttribute::Chain("svc-a".into()),
                        ])),
                    ],
                    vec![
                        key(&vmap.key[..], "10.96.0.2 . udp . 53"),
                        SetElementAttribute::Data(DataAttribute::Verdict(vec![
                            VerdictAttribute::Code(Verdict::Other(0)),
                        ])),
                    ],
                ],
                true,
            ),
        ));
        let mut data = Vec::new();
        encode_tuple(
            &tuple(&[Ipv4Addr, InetService], "10.244.1.2 . 8080").unwrap(),
            &mut data,
        )
        .unwrap();
        want.extend(serialize(
            3,
            NLM_F_CREATE,
            v4,
            0,
            elems_msg(
                "dnat-c-2",
                vec![vec![
                    key(&dnat.key[..], "10.96.0.1 . tcp . 80 . 1"),
                    SetElementAttribute::Data(DataAttribute::Value(data)),
                ]],
                true,
            ),
        ));
        want.extend(serialize(
            4,
            NLM_F_ACK,
            v4,
            0,
            elems_msg(
                "cluster-ips",
                vec![vec![key(&set.key[..], "10.96.0.3")]],
                false,
            ),
        ));
        want.extend(serialize(
            5,
            0,
            NetfilterProtoFamily::Unspec,
            NFNL_SUBSYS_NFTABLES,
            NetfilterMessageInner::None(ControlMessage::BatchEnd),
        ));
        assert_eq!(got, want);
    }

    /// Many elements are split into messages whose element list fits a 16-bit length.
    #[test]
    fn large_batches_split_into_messages() {
        let elems: Vec<Elem> = (0..20_000u32)
            .map(|i| {
                let ip = IpAddr::V4(std::net::Ipv4Addr::from(0x0af4_0000 + i));
                Elem {
                    key: Tuple::new(&[Atom::Addr(ip), Atom::Addr(ip)]),
                    value: None,
                }
            })
            .collect();
        let tx = Transaction {
            ops: vec![Op::AddElements {
                family: Family::Ip,
                table: "kproxy".into(),
                set: "hairpin".into(),
                elems,
            }],
            ..Transaction::default()
        };
        let b = Batch::transaction(&tx).unwrap();
        let b = b.finish();
        assert!(b.messages.len() > 5, "{}", b.messages.len());
        // In chunks, each starting at a message (the walk below crosses them).
        assert!(!b.sealed.is_empty(), "{}", b.sealed.len());
        assert_eq!(b.len(), b.to_vec().len());
        // A refused message is named from its bytes, in whichever chunk it is.
        for (_, at) in [b.messages[0], b.messages[b.messages.len() - 1]] {
            assert_eq!(b.describe(at), "add element ip kproxy hairpin");
        }
        let ops = vec![
            Op::FlushChain {
                family: Family::Ip6,
                table: "kproxy".into(),
                name: "nat-output".into(),
            },
            Op::AddRule {
                family: Family::Ip6,
                table: "kproxy".into(),
                chain: "nat-output".into(),
                rule: crate::rule::Rule::verdict(crate::model::Verdict::Jump("services".into())),
            },
            Op::DeleteTable {
                family: Family::Ip,
                table: "kproxy".into(),
            },
        ];
        let small = Batch::transaction(&Transaction {
            ops,
            ..Transaction::default()
        })
        .unwrap();
        let said: Vec<String> = small
            .messages
            .iter()
            .map(|(_, at)| small.describe(*at))
            .collect();
        assert_eq!(said[0], "flush chain ip6 kproxy nat-output");
        assert!(
            said[1].starts_with("add rule ip6 kproxy nat-output comment kp:"),
            "{}",
            said[1]
        );
        assert_eq!(said[2], "delete table ip kproxy");
        let mut offset = 0;
        let mut n = 0;
        let bytes = b.to_vec();
        while offset < bytes.len() {
            let len = u32::from_ne_bytes(bytes[offset..offset + 4].try_into().unwrap()) as usize;
            assert!((20..65536).contains(&len));
            offset += len;
            n += 1;
        }
        assert_eq!(offset, bytes.len());
        assert_eq!(n, b.messages.len() + 2);
    }

    /// Set declarations carry the kernel types and user data nft 1.0.6 sends for the
    /// same declaration (the bytes of its batch, `nft --debug=mnl -f`, on this
    /// little-endian machine: libnftnl writes the user data's numbers in host order).
    #[cfg(target_endian = "little")]
    #[test]
    fn set_declarations_encode_as_nft_encodes_them() {
        use Field::*;
        let hex = |s: &str| -> Vec<u8> {
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect()
        };
        let typeof_map = |key: Vec<Field>, data: Vec<Field>| SetDecl {
            by_expr: true,
            ..SetDecl::map(key, SetData::Fields(data))
        };
        let cases: Vec<(SetDecl, u32, Option<u32>, &str)> = vec![
            (
                typeof_map(
                    vec![Ipv4Addr, InetProto, InetService, Numgen(2)],
                    vec![Ipv4Addr, InetService],
                ),
                0x001c_c344,
                Some(0x1cd),
                "000400000000010400000000036000040d00000001580014000407000000010c00040c00000001040c000000010e00040900000001060004100000000214000407000000010c00040b000000010402000000031a0004170000000112000401000000010402000000020400000000043400040d000000012c0014000407000000010c00040c00000001040c0000000114000407000000010c00040b000000010402000000060400000000",
            ),
            (
                typeof_map(
                    vec![InetProto, InetService, Numgen(1)],
                    vec![Ipv4Addr, InetService],
                ),
                0xc344,
                Some(0x1cd),
                "000400000000010400000000034a00040d0000000142000e00040900000001060004100000000114000407000000010c00040b000000010402000000021a0004170000000112000401000000010401000000020400000000043400040d000000012c0014000407000000010c00040c00000001040c0000000114000407000000010c00040b000000010402000000060400000000",
            ),
            (
                typeof_map(
                    vec![Ipv6Addr, InetProto, InetService, Numgen(2)],
                    vec![Ipv6Addr, InetService],
                ),
                0x0020_c344,
                Some(0x20d),
                "000400000000010400000000036000040d00000001580014000407000000010c00040d000000010409000000010e00040900000001060004100000000214000407000000010c00040b000000010402000000031a0004170000000112000401000000010402000000020400000000043400040d000000012c0014000407000000010c00040d0000000104090000000114000407000000010c00040b000000010402000000060400000000",
            ),
            (
                SetDecl::map(vec![Ipv4Addr, InetProto, InetService], SetData::Verdict)
                    .with_comment("cluster IPs"),
                0x730d,
                Some(NFT_DATA_VERDICT),
                "000400000000010400000000030800040d0000000100060400000000070c636c75737465722049507300",
            ),
            (
                SetDecl {
                    dynamic: true,
                    timeout_secs: Some(600),
                    ..SetDecl::set(vec![Ipv4Addr])
                },
                7,
                None,
                "000402000000",
            ),
            (
                SetDecl {
                    interval: true,
                    auto_merge: true,
                    ..SetDecl::set(vec![Ipv4Addr]).with_comment("local pod CIDRs")
                },
                7,
                None,
                "00040200000002040100000007106c6f63616c20706f6420434944527300",
            ),
            (
                SetDecl::set(vec![Ipv6Addr]).with_comment("x"),
                8,
                None,
                "00040200000007027800",
            ),
            (
                SetDecl::set(vec![Ipv6Addr, Ipv6Addr]),
                0x208,
                None,
                "000400000000030800040d0000000100",
            ),
        ];
        for (decl, key_type, data_type, udata) in cases {
            let mut body = String::new();
            decl.write(&mut body);
            assert_eq!(concat_type(&decl.key), key_type, "{body}");
            let data = match &decl.data {
                Some(SetData::Fields(f)) => Some(concat_type(f)),
                Some(SetData::Verdict) => Some(NFT_DATA_VERDICT),
                Some(SetData::Counter) | None => None,
            };
            assert_eq!(data, data_type, "{body}");
            assert_eq!(set_udata(&decl).unwrap(), hex(udata), "{body}");
        }
        // An interval concatenation is not guessed.
        let concat = SetDecl {
            interval: true,
            ..SetDecl::set(vec![Ipv4Addr, InetService])
        };
        let op = Op::AddSet {
            family: Family::Ip,
            table: "kproxy".into(),
            name: "x".into(),
            decl: concat,
        };
        let tx = Transaction {
            ops: vec![op],
            ..Transaction::default()
        };
        assert_eq!(
            Batch::transaction(&tx).err().map(|e| e.why),
            Some(EncodeFailure::Declaration)
        );
    }
}
