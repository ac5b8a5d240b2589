//! Set and map elements written to the kernel over nfnetlink, without the `nft` tool,
//! as one nfnetlink batch (one transaction, all or nothing, like `nft -f`) on a socket
//! kept open between syncs: the delta of a sync that only adds and deletes elements (an
//! endpoint became ready, terminating or gone; a Service port gained or lost
//! endpoints), and every element of a first sync into absent tables (after the `nft`
//! step that creates the tables dormant, in pieces, then the transaction that wakes
//! them; see [`crate::first_sync`]).
//!
//! Why not `nft` for these: at 10k Services one `nft -f` costs ≈ 5 ms to start, a few
//! ms to fetch its cache and parse, and 10–20 ms *closing its netlink socket* after a
//! transaction that deleted elements (the close waits for the kernel to release the
//! deleted elements; measured with `strace -T`: `close(3)` 18.6 ms). A socket that
//! stays open does not wait. Chains and rules go this way too, their expressions encoded
//! by [`crate::rule::encode`] (the anonymous sets a rule looks up created in its batch);
//! tables and set declarations (a `typeof` map's user data) stay on `nft -f`.
//!
//! Elements reach this module as the typed element operations of a
//! [`crate::model::Transaction`] ([`Batch::transaction`], the rendering
//! beside its nft text) and are encoded as nft encodes them: each field of a
//! concatenation padded to 4 bytes, addresses and ports in network order, the `numgen`
//! index in host order. An element it does not encode (a prefix of an interval set)
//! makes the caller render the transaction as nft text, never a guess.

use std::net::IpAddr;

use netlink_packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::NetfilterMessage;
use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeVal;

use crate::error::{EncodeError, EncodeFailure, NftError, Via};
use crate::model::{Atom, Family, Op, Transaction, Tuple, Value};

/// `NFNL_SUBSYS_NFTABLES`: the batch header's resource id names the subsystem.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// Elements per message are capped so the nested element list stays under the 64 KiB
/// an attribute length can say.
const MAX_ELEMENTS_BYTES: usize = 48 * 1024;
/// The send buffer a new socket starts with; raised to the size of a larger batch (a
/// batch must reach the kernel in one `sendmsg`, as `nft` sends it too).
const INITIAL_SNDBUF: usize = 1 << 20;

/// Opens a netfilter netlink socket in the calling thread's network namespace.
pub(crate) fn open() -> Result<Socket, std::io::Error> {
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    Ok(sock)
}

/// Appends a key or value: a single field as is, each field of a concatenation padded
/// to 4 bytes (nft's register layout); addresses and ports in network order, the
/// `numgen` index in host order. A prefix does not encode (interval sets need start and
/// end elements; their few elements go by `nft`).
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

// Netlink and nf_tables constants (linux/netlink.h, linux/netfilter/nfnetlink.h,
// linux/netfilter/nf_tables.h).
const NLA_F_NESTED: u16 = 0x8000;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_TABLE_FLAGS: u16 = 2;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_DELCHAIN: u16 = 5;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_DELRULE: u16 = 8;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_DELSET: u16 = 11;
const NFT_MSG_DELOBJ: u16 = 20;
const NFTA_OBJ_TABLE: u16 = 1;
const NFTA_OBJ_NAME: u16 = 2;
const NFTA_OBJ_TYPE: u16 = 3;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;
const NFTA_SET_ELEM_FLAGS: u16 = 3;
const ELEM_INTERVAL_END: u32 = 0x1;
const NLM_F_APPEND: u16 = 0x800;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

/// One transaction of element changes, encoded and ready to send.
///
/// Written as bytes directly rather than through netlink-packet-netfilter's message
/// types: building a `Vec` of attribute objects per element and emitting them cost
/// ≈ 3.5 µs per element (0.6 s of a 10k-Service first sync, 176k elements); writing
/// the bytes costs a tenth of that. A test checks the bytes against the crate's
/// encoding of the same elements.
#[derive(Debug, Default)]
pub struct Batch {
    bytes: Vec<u8>,
    /// Per element message: (sequence number, offset in `bytes`, what it does).
    messages: Vec<(u32, usize, String)>,
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

impl Batch {
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Starts a message: netlink header (length filled by [`Batch::end_message`]) and
    /// nfgenmsg. Returns its offset.
    fn begin_message(&mut self, kind: u16, flags: u16, family: u8, res_id: u16) -> usize {
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

    /// The nfnetlink rendering of a transaction of element operations (one batch, one
    /// transaction). Fails when an operation is not an element one, or an element is
    /// one this writer does not encode (a prefix): the caller renders nft text then.
    pub fn transaction(tx: &Transaction) -> Result<Batch, EncodeError> {
        let mut b = Batch::default();
        for op in &tx.ops {
            let encoded = match op {
                Op::AddElements {
                    family,
                    table,
                    set,
                    elems,
                } => b.encode_elements(
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
                } => b.encode_elements(false, *family, table, set, keys.iter().map(|k| (k, None))),
                Op::AddChain {
                    family,
                    table,
                    name,
                    hook,
                } => b.add_chain(*family, table, name, hook.as_ref()),
                Op::FlushChain {
                    family,
                    table,
                    name,
                } => b.object(*family, NFT_MSG_DELRULE, table, NFTA_RULE_CHAIN, name, op),
                Op::DeleteChain {
                    family,
                    table,
                    name,
                } => b.object(*family, NFT_MSG_DELCHAIN, table, NFTA_CHAIN_NAME, name, op),
                Op::DeleteSet {
                    family,
                    table,
                    name,
                    ..
                } => b.object(*family, NFT_MSG_DELSET, table, NFTA_SET_NAME, name, op),
                Op::AddRule {
                    family,
                    table,
                    chain,
                    rule,
                } => b.add_rule(*family, table, chain, rule),
                Op::DeleteObject {
                    family,
                    table,
                    kind,
                    name,
                } => b.delete_object(*family, table, *kind, name, op),
                _ => Err(EncodeFailure::NotElements),
            };
            encoded.map_err(|why| EncodeError {
                what: op.describe(),
                why,
            })?;
        }
        Ok(b)
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
        if self.bytes.is_empty() {
            let at = self.begin_message(NFNL_MSG_BATCH_BEGIN, 0, 0, NFNL_SUBSYS_NFTABLES);
            self.end_message(at);
        }
        let fam = family.nfproto();
        let (kind, flags, verb) = if add {
            (NFT_MSG_NEWSETELEM, NLM_F_CREATE, "add")
        } else {
            (NFT_MSG_DELSETELEM, 0, "delete")
        };
        let kind = (u16::from(NFNL_SUBSYS_NFTABLES as u8) << 8) | kind;
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
                    let what = format!("{verb} element {} {table} {set}", family.nft());
                    self.messages.push((seq, msg, what));
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

    fn batch_begin(&mut self) {
        if self.bytes.is_empty() {
            let at = self.begin_message(NFNL_MSG_BATCH_BEGIN, 0, 0, NFNL_SUBSYS_NFTABLES);
            self.end_message(at);
        }
    }

    /// A message naming one object (`table`, and `attr` = `name`): a chain's or set's
    /// delete, a chain's flush (`DELRULE` without a handle).
    fn object(
        &mut self,
        family: Family,
        msg: u16,
        table: &str,
        attr: u16,
        name: &str,
        op: &Op,
    ) -> Result<(), EncodeFailure> {
        self.batch_begin();
        let seq = self.count + 1;
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | msg;
        let at = self.begin_message(kind, 0, family.nfproto(), 0);
        nla_str(&mut self.bytes, 1, table)?;
        nla_str(&mut self.bytes, attr, name)?;
        self.end_message(at);
        self.messages.push((seq, at, op.describe()));
        Ok(())
    }

    /// `delete KIND`: a named object of `NFT_OBJECT_*` type `kind` (the kernel finds it
    /// by table, name and type).
    fn delete_object(
        &mut self,
        family: Family,
        table: &str,
        kind: u32,
        name: &str,
        op: &Op,
    ) -> Result<(), EncodeFailure> {
        self.batch_begin();
        let seq = self.count + 1;
        let msg = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_DELOBJ;
        let at = self.begin_message(msg, 0, family.nfproto(), 0);
        nla_str(&mut self.bytes, NFTA_OBJ_TABLE, table)?;
        nla_str(&mut self.bytes, NFTA_OBJ_NAME, name)?;
        nla_u32(&mut self.bytes, NFTA_OBJ_TYPE, kind)?;
        self.end_message(at);
        self.messages.push((seq, at, op.describe()));
        Ok(())
    }

    /// `add chain`: a regular chain, or a base chain with its hook (policy accept).
    fn add_chain(
        &mut self,
        family: Family,
        table: &str,
        name: &str,
        hook: Option<&crate::model::Hook>,
    ) -> Result<(), EncodeFailure> {
        self.batch_begin();
        let seq = self.count + 1;
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWCHAIN;
        let at = self.begin_message(kind, NLM_F_CREATE, family.nfproto(), 0);
        let b = &mut self.bytes;
        nla_str(b, NFTA_CHAIN_TABLE, table)?;
        nla_str(b, NFTA_CHAIN_NAME, name)?;
        if let Some(h) = hook {
            let nest = nla_begin(b, NFTA_CHAIN_HOOK | NLA_F_NESTED);
            nla_u32(b, NFTA_HOOK_HOOKNUM, h.hook.number())?;
            nla_u32(b, NFTA_HOOK_PRIORITY, h.priority as u32)?;
            nla_end(b, nest)?;
            nla_u32(b, NFTA_CHAIN_POLICY, 1)?;
            let ty = match h.ty {
                crate::model::ChainType::Filter => "filter",
                crate::model::ChainType::Nat => "nat",
            };
            nla_str(b, NFTA_CHAIN_TYPE, ty)?;
        }
        self.end_message(at);
        let what = format!("add chain {} {table} {name}", family.nft());
        self.messages.push((seq, at, what));
        Ok(())
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
        self.batch_begin();
        let fam = family.nfproto();
        for set in &sets {
            self.anonymous_set(fam, table, set)?;
        }
        let seq = self.count + 1;
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWRULE;
        let at = self.begin_message(kind, NLM_F_CREATE | NLM_F_APPEND, fam, 0);
        let b = &mut self.bytes;
        nla_str(b, NFTA_RULE_TABLE, table)?;
        nla_str(b, NFTA_RULE_CHAIN, chain)?;
        let e = nla_begin(b, NFTA_RULE_EXPRESSIONS | NLA_F_NESTED);
        b.extend_from_slice(&exprs);
        nla_end(b, e)?;
        // libnftnl's user data: the comment TLV (type 0), NUL-terminated.
        let comment = format!("{tag}\0");
        let u = nla_begin(b, NFTA_RULE_USERDATA);
        b.push(0);
        b.push(u8::try_from(comment.len()).map_err(|_| EncodeFailure::TooLong)?);
        b.extend_from_slice(comment.as_bytes());
        nla_end(b, u)?;
        self.end_message(at);
        let what = format!("add rule {} {table} {chain} {rule}", family.nft());
        self.messages.push((seq, at, what));
        Ok(())
    }

    /// A rule's anonymous set and its elements, in the rule's batch.
    fn anonymous_set(
        &mut self,
        fam: u8,
        table: &str,
        set: &crate::rule::encode::AnonymousSet,
    ) -> Result<(), EncodeFailure> {
        const SET_ANONYMOUS: u32 = 0x1;
        const SET_CONSTANT: u32 = 0x2;
        const SET_INTERVAL: u32 = 0x4;
        let seq = self.count + 1;
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSET;
        let at = self.begin_message(kind, NLM_F_CREATE, fam, 0);
        let b = &mut self.bytes;
        nla_str(b, NFTA_SET_TABLE, table)?;
        nla_str(b, NFTA_SET_NAME, &set.name)?;
        let mut flags = SET_ANONYMOUS | SET_CONSTANT;
        if set.interval {
            flags |= SET_INTERVAL;
        }
        nla_u32(b, NFTA_SET_FLAGS, flags)?;
        nla_u32(b, NFTA_SET_KEY_TYPE, set.key_type)?;
        nla_u32(b, NFTA_SET_KEY_LEN, set.key_len)?;
        nla_u32(b, NFTA_SET_ID, set.id)?;
        self.end_message(at);
        self.messages
            .push((seq, at, format!("add anonymous set {} of a rule", set.name)));
        let seq = self.count + 1;
        let kind = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWSETELEM;
        let at = self.begin_message(kind, NLM_F_CREATE, fam, 0);
        let b = &mut self.bytes;
        nla_str(b, NFTA_SET_ELEM_LIST_TABLE, table)?;
        nla_str(b, NFTA_SET_ELEM_LIST_SET, &set.name)?;
        nla_u32(b, NFTA_SET_ELEM_LIST_SET_ID, set.id)?;
        let list = nla_begin(b, NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED);
        for (key, end) in &set.elements {
            let elem = nla_begin(b, NFTA_LIST_ELEM | NLA_F_NESTED);
            if *end {
                nla_u32(b, NFTA_SET_ELEM_FLAGS, ELEM_INTERVAL_END)?;
            }
            let k = nla_begin(b, NFTA_SET_ELEM_KEY | NLA_F_NESTED);
            let v = nla_begin(b, NFTA_DATA_VALUE);
            b.extend_from_slice(key);
            nla_end(b, v)?;
            nla_end(b, k)?;
            nla_end(b, elem)?;
        }
        nla_end(b, list)?;
        self.end_message(at);
        self.messages.push((
            seq,
            at,
            format!("add the elements of anonymous set {}", set.name),
        ));
        Ok(())
    }

    /// One transaction that wakes the dormant `tables` (`NEWTABLE` with no flags): each
    /// table's base chains are hooked as it commits, all tables at once. The last step
    /// of a first sync into absent tables
    /// ([`crate::model::Transaction::dormant_for_absent_tables`]); without `nft`, whose
    /// start and cache dump (every chain of the tables) cost more than the rest of the
    /// step.
    pub fn wake_tables(tables: &[(Family, &str)]) -> Batch {
        let mut b = Batch::default();
        let at = b.begin_message(NFNL_MSG_BATCH_BEGIN, 0, 0, NFNL_SUBSYS_NFTABLES);
        b.end_message(at);
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
            let what = format!("wake table {} {table}", family.nft());
            b.messages.push((seq, msg, what));
        }
        b
    }

    /// Closes the batch (nothing can be added after). Only its last message asks for
    /// an acknowledgement: the kernel runs the whole batch inside `sendmsg`, so that
    /// answer arrives after any error of an earlier message (a few hundred answers
    /// would overflow the socket's receive buffer on a full sync).
    fn finish(mut self) -> Batch {
        if let Some((_, offset, _)) = self.messages.last() {
            let at = offset + 6;
            let flags = u16::from_ne_bytes([self.bytes[at], self.bytes[at + 1]]) | NLM_F_ACK;
            self.bytes[at..at + 2].copy_from_slice(&flags.to_ne_bytes());
        }
        if !self.bytes.is_empty() {
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
        crate::nfnl::note_own(addr.port_number());
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
            netns: crate::nfnl::current_netns()?,
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
        Ok(crate::nfnl::current_netns()? == self.netns)
    }

    /// Sends the batch as one transaction and waits for the kernel's answer to every
    /// message; the first error names the message it failed on.
    pub fn send(&mut self, batch: Batch) -> Result<(), NftError> {
        let batch = batch.finish();
        if batch.is_empty() {
            return Ok(());
        }
        self.drain();
        if batch.bytes.len() + (64 << 10) > self.sndbuf {
            let size = batch.bytes.len() + (64 << 10);
            set_sndbuf(&self.sock, size).map_err(|e| NftError::Io {
                context: format!("raising the netlink send buffer to {size} bytes"),
                source: e,
            })?;
            self.sndbuf = size;
        }
        let sent = self.sock.send(&batch.bytes, 0).map_err(|e| NftError::Io {
            context: format!("sending a {}-byte nfnetlink batch", batch.bytes.len()),
            source: e,
        })?;
        if sent != batch.bytes.len() {
            return Err(NftError::Io {
                context: format!("sending a {}-byte nfnetlink batch", batch.bytes.len()),
                source: std::io::Error::other(format!("sent {sent} bytes")),
            });
        }
        let last = batch.messages.last().map_or(0, |(seq, _, _)| *seq);
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
                    .find(|(s, _, _)| *s == seq)
                    .map_or("the batch", |(_, _, w)| w.as_str());
                Err(NftError::Refused {
                    via: Via::Netlink,
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
        // A prefix (interval sets) is left to nft.
        let mut iv = decl(&[Ipv4Addr]);
        iv.interval = true;
        let p = iv.parse_elem("10.0.0.0/8", "").unwrap().key;
        assert_eq!(
            encode_tuple(&p, &mut Vec::new()),
            Err(EncodeFailure::Prefix)
        );
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
        assert_eq!(
            Batch::transaction(&tx(vec![add(p)])).err(),
            Some(EncodeError {
                what: "add element ip kproxy local-pods".into(),
                why: EncodeFailure::Prefix,
            })
        );
        let table = Op::DeleteTable {
            family: Family::Ip6,
            table: "kproxy".into(),
        };
        assert_eq!(
            Batch::transaction(&tx(vec![table])).err(),
            Some(EncodeError {
                what: "delete table ip6 kproxy".into(),
                why: EncodeFailure::NotElements,
            })
        );
        let flush = Op::FlushChain {
            family: Family::Ip6,
            table: "kproxy".into(),
            name: "services".into(),
        };
        assert!(Batch::transaction(&tx(vec![flush])).is_ok());
    }

    #[test]
    fn verdicts() {
        let v = |s: &str| {
            crate::model::Verdict::parse(s)
                .map(|v| (v.netlink().0, v.netlink().1.map(String::from)))
        };
        assert_eq!(v("goto svc-1"), Some((-4i32 as u32, Some("svc-1".into()))));
        assert_eq!(v("jump x"), Some((-3i32 as u32, Some("x".into()))));
        assert_eq!(v("drop"), Some((0, None)));
        assert_eq!(v("reject"), None);
        assert_eq!(v("dnat to 1.2.3.4"), None);
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
        let got = b.finish().bytes;

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
        let mut offset = 0;
        let mut n = 0;
        while offset < b.bytes.len() {
            let len = u32::from_ne_bytes(b.bytes[offset..offset + 4].try_into().unwrap()) as usize;
            assert!((20..65536).contains(&len));
            offset += len;
            n += 1;
        }
        assert_eq!(offset, b.bytes.len());
        assert_eq!(n, b.messages.len() + 2);
    }
}
