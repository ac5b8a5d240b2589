//! Who is who on netfilter netlink, below both its writer (`netlink`) and its readers
//! (`dump`, `monitor`): the calling thread's network namespace, the registry of
//! kproxy's own netlink port ids, noted by the writer and read by the monitor to tell
//! kproxy's transactions from another process's (its module doc says how), the
//! netfilter netlink constants (declared here once, one type each), and the reading of
//! a message's attributes ([`Attrs`], [`be32`], [`c_str`]).

use std::collections::VecDeque;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

use crate::error::NftError;

// The netfilter netlink vocabulary kproxy speaks, declared once (linux/netlink.h,
// linux/netfilter/nfnetlink.h, linux/netfilter/nf_tables.h): the writer (`netlink`), the
// readers (`dump`, `monitor`) and their tests name these.
/// `enum nfnetlink_groups`: nf_tables' notifications.
pub(crate) const NFNLGRP_NFTABLES: u32 = 7;
/// The nf_tables subsystem (a message type's high byte; a batch header's resource id).
pub(crate) const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// The batch delimiters (`enum nfnl_batch_attributes` messages).
pub(crate) const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
pub(crate) const NFNL_MSG_BATCH_END: u16 = 0x11;
/// An attribute that nests attributes.
pub(crate) const NLA_F_NESTED: u16 = 0x8000;
/// `enum nf_tables_msg_types` (a message type's low byte).
pub(crate) const NFT_MSG_NEWTABLE: u16 = 0;
pub(crate) const NFT_MSG_GETTABLE: u16 = 1;
pub(crate) const NFT_MSG_DELTABLE: u16 = 2;
pub(crate) const NFT_MSG_NEWCHAIN: u16 = 3;
pub(crate) const NFT_MSG_GETCHAIN: u16 = 4;
pub(crate) const NFT_MSG_DELCHAIN: u16 = 5;
pub(crate) const NFT_MSG_NEWRULE: u16 = 6;
pub(crate) const NFT_MSG_GETRULE: u16 = 7;
pub(crate) const NFT_MSG_DELRULE: u16 = 8;
pub(crate) const NFT_MSG_NEWSET: u16 = 9;
pub(crate) const NFT_MSG_GETSET: u16 = 10;
pub(crate) const NFT_MSG_DELSET: u16 = 11;
pub(crate) const NFT_MSG_NEWSETELEM: u16 = 12;
pub(crate) const NFT_MSG_GETSETELEM: u16 = 13;
pub(crate) const NFT_MSG_DELSETELEM: u16 = 14;
pub(crate) const NFT_MSG_NEWGEN: u16 = 15;
pub(crate) const NFT_MSG_GETGEN: u16 = 16;
pub(crate) const NFT_MSG_NEWOBJ: u16 = 18;
pub(crate) const NFT_MSG_GETOBJ: u16 = 19;
pub(crate) const NFT_MSG_DELOBJ: u16 = 20;
/// `enum nft_*_attributes`: the attributes of each object's messages.
pub(crate) const NFTA_TABLE_NAME: u16 = 1;
pub(crate) const NFTA_TABLE_FLAGS: u16 = 2;
pub(crate) const NFTA_TABLE_USERDATA: u16 = 6;
pub(crate) const NFTA_CHAIN_TABLE: u16 = 1;
pub(crate) const NFTA_CHAIN_NAME: u16 = 3;
pub(crate) const NFTA_CHAIN_HOOK: u16 = 4;
pub(crate) const NFTA_CHAIN_POLICY: u16 = 5;
pub(crate) const NFTA_CHAIN_TYPE: u16 = 7;
pub(crate) const NFTA_HOOK_HOOKNUM: u16 = 1;
pub(crate) const NFTA_HOOK_PRIORITY: u16 = 2;
pub(crate) const NFTA_RULE_TABLE: u16 = 1;
pub(crate) const NFTA_RULE_CHAIN: u16 = 2;
pub(crate) const NFTA_RULE_HANDLE: u16 = 3;
pub(crate) const NFTA_RULE_EXPRESSIONS: u16 = 4;
pub(crate) const NFTA_RULE_USERDATA: u16 = 7;
pub(crate) const NFTA_SET_TABLE: u16 = 1;
pub(crate) const NFTA_SET_NAME: u16 = 2;
pub(crate) const NFTA_SET_FLAGS: u16 = 3;
pub(crate) const NFTA_SET_KEY_TYPE: u16 = 4;
pub(crate) const NFTA_SET_KEY_LEN: u16 = 5;
pub(crate) const NFTA_SET_DATA_TYPE: u16 = 6;
pub(crate) const NFTA_SET_DATA_LEN: u16 = 7;
pub(crate) const NFTA_SET_ID: u16 = 10;
pub(crate) const NFTA_SET_TIMEOUT: u16 = 11;
pub(crate) const NFTA_SET_USERDATA: u16 = 13;
pub(crate) const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
pub(crate) const NFTA_SET_ELEM_LIST_SET: u16 = 2;
pub(crate) const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
pub(crate) const NFTA_SET_ELEM_LIST_SET_ID: u16 = 4;
pub(crate) const NFTA_LIST_ELEM: u16 = 1;
pub(crate) const NFTA_SET_ELEM_KEY: u16 = 1;
pub(crate) const NFTA_SET_ELEM_DATA: u16 = 2;
pub(crate) const NFTA_SET_ELEM_FLAGS: u16 = 3;
pub(crate) const NFTA_DATA_VALUE: u16 = 1;
pub(crate) const NFTA_DATA_VERDICT: u16 = 2;
pub(crate) const NFTA_VERDICT_CODE: u16 = 1;
pub(crate) const NFTA_VERDICT_CHAIN: u16 = 2;
pub(crate) const NFTA_OBJ_TABLE: u16 = 1;
pub(crate) const NFTA_OBJ_NAME: u16 = 2;
pub(crate) const NFTA_OBJ_TYPE: u16 = 3;
pub(crate) const NFTA_OBJ_DATA: u16 = 4;
pub(crate) const NFTA_OBJ_USERDATA: u16 = 8;
pub(crate) const NFTA_COUNTER_BYTES: u16 = 1;
pub(crate) const NFTA_COUNTER_PACKETS: u16 = 2;
/// A set's object type (`NFT_OBJECT_*`) when it is an object map (`NFT_SET_OBJECT`).
pub(crate) const NFTA_SET_OBJ_TYPE: u16 = 15;
/// An object map element's object name.
pub(crate) const NFTA_SET_ELEM_OBJREF: u16 = 9;
/// `NFT_SET_OBJECT`: the set maps keys to named objects.
pub(crate) const SET_OBJECT: u32 = 0x40;
pub(crate) const NFTA_EXPR_NAME: u16 = 1;
pub(crate) const NFTA_EXPR_DATA: u16 = 2;
pub(crate) const NFTA_GEN_ID: u16 = 1;
pub(crate) const NFTA_GEN_PROC_PID: u16 = 2;
pub(crate) const NFTA_GEN_PROC_NAME: u16 = 3;

/// A big-endian `u32` attribute.
pub(crate) fn be32(b: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?))
}

/// A NUL-terminated string attribute, borrowed.
pub(crate) fn c_str(b: &[u8]) -> Option<&str> {
    let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..end]).ok()
}

/// Own port ids and pids remembered (the newest; a transaction is announced within
/// milliseconds of the commit).
const OWN_REMEMBERED: usize = 256;

static OWN: Mutex<VecDeque<u32>> = Mutex::new(VecDeque::new());

/// Notes a netlink port id or a child's pid as kproxy's own.
pub fn note_own(id: u32) {
    let mut own = OWN.lock().unwrap_or_else(|e| e.into_inner());
    if own.len() >= OWN_REMEMBERED {
        own.pop_front();
    }
    own.push_back(id);
}

/// Whether `id` was noted by [`note_own`] (among the newest it remembers).
pub(crate) fn noted_own(id: u32) -> bool {
    OWN.lock().unwrap_or_else(|e| e.into_inner()).contains(&id)
}

/// The identity (inode) of the calling thread's network namespace.
pub(crate) fn current_netns() -> Result<u64, NftError> {
    std::fs::metadata("/proc/thread-self/ns/net")
        .map(|m| m.ino())
        .map_err(|e| NftError::Io {
            context: "reading /proc/thread-self/ns/net".into(),
            source: e,
        })
}

/// Attributes of a netlink attribute stream: (type without flag bits, payload).
#[derive(Clone)]
pub(crate) struct Attrs<'a>(pub(crate) &'a [u8]);

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

/// `NFT_CT_*` keys of a `ct original` load (the traffic counters' lookup after DNAT),
/// written by `rule::encode` and read by `rule::decode`.
pub(crate) const CT_PROTO_DST: u32 = 12;
pub(crate) const CT_DST_IP: u32 = 20;
pub(crate) const CT_DST_IP6: u32 = 22;

/// A traffic counter object's comment: since when it counts (Unix seconds). Here, on the
/// floor, because the writer (`netlink`) writes it and the reader (`dump`) reads it back
/// for `crate::counters`.
pub(crate) fn since_comment(since: u64) -> String {
    format!("kproxy counts since {since}")
}

/// The Unix seconds of a comment [`since_comment`] wrote.
pub(crate) fn parse_since(comment: &str) -> Option<u64> {
    comment.strip_prefix("kproxy counts since ")?.parse().ok()
}
