//! The netlink floor, below both the writer (`netlink`) and the readers (`dump`,
//! `monitor`, `conntrack`): the opening of a netfilter netlink socket ([`open`],
//! [`bound`]) in the calling thread's network namespace (its identity,
//! [`current_netns`]); the registry of kproxy's own netlink port ids, noted by the
//! writer and read by the monitor to tell kproxy's transactions from another process's
//! (its module doc says how); every kernel constant kproxy speaks (declared here once,
//! one type each: netlink's flags and message types, nf_tables' messages, attributes,
//! set and element flags, verdict codes, object types and expression keys, and
//! libnftnl's user data types); and the reading of a message's attributes ([`Attrs`],
//! [`be32`], [`c_str`]). It imports nothing of the crate but its error.

use std::collections::VecDeque;
use std::os::unix::fs::MetadataExt;
use std::sync::Mutex;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use crate::error::NftError;

/// A netfilter netlink socket bound in the calling thread's network namespace, talking
/// to the kernel: the writer's, each reading's, ctnetlink's. Its reads wait at most
/// [`ANSWER_TIMEOUT`] for each message (the writer sets its own, shorter bound).
pub(crate) fn open() -> std::io::Result<Socket> {
    let sock = bound()?;
    sock.connect(&SocketAddr::new(0, 0))?;
    let secs = ANSWER_TIMEOUT.as_secs() as nix::sys::time::time_t;
    nix::sys::socket::setsockopt(
        &sock,
        nix::sys::socket::sockopt::ReceiveTimeout,
        &nix::sys::time::TimeVal::new(secs, 0),
    )?;
    Ok(sock)
}

/// The longest a request socket waits for the kernel's next message. The kernel writes
/// each answer, or the next ≈ 32 KiB round of a dump, while the reader waits in `recv`,
/// so no healthy kernel comes near it; a reading that would otherwise hang a sync (or
/// `kproxy top`, `explain`) for ever ends with an error that says so.
pub(crate) const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `recv`'s error on a request socket, with the receive timeout's `EAGAIN` said as what
/// it is.
pub(crate) fn answer_error(e: std::io::Error) -> std::io::Error {
    if e.kind() == std::io::ErrorKind::WouldBlock {
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the kernel sent nothing for {} s", ANSWER_TIMEOUT.as_secs()),
        )
    } else {
        e
    }
}

/// A netfilter netlink socket bound in the calling thread's network namespace and not
/// connected: the notification socket's (the kernel delivers a group to bound sockets
/// only).
pub(crate) fn bound() -> std::io::Result<Socket> {
    let mut sock = Socket::new(NETLINK_NETFILTER)?;
    sock.bind_auto()?;
    Ok(sock)
}

// The netfilter netlink vocabulary kproxy speaks, declared once (linux/netlink.h,
// linux/netfilter.h, linux/netfilter/nfnetlink.h, linux/netfilter/nf_tables.h): the
// writer (`netlink`), the readers (`dump`, `monitor`), the rule's encoder and decoder,
// and their tests name these.
/// `struct nlmsghdr`'s types and flags.
pub(crate) const NLMSG_ERROR: u16 = 2;
pub(crate) const NLMSG_DONE: u16 = 3;
pub(crate) const NLM_F_REQUEST: u16 = 0x1;
pub(crate) const NLM_F_ACK: u16 = 0x4;
pub(crate) const NLM_F_DUMP_INTR: u16 = 0x10;
pub(crate) const NLM_F_DUMP: u16 = 0x300;
pub(crate) const NLM_F_CREATE: u16 = 0x400;
pub(crate) const NLM_F_APPEND: u16 = 0x800;
/// `NFPROTO_*`: nfgenmsg's family byte of an `ip` / `ip6` table.
pub(crate) const NFPROTO_IPV4: u8 = 2;
pub(crate) const NFPROTO_IPV6: u8 = 10;
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
pub(crate) const NFT_MSG_NEWFLOWTABLE: u16 = 22;
pub(crate) const NFT_MSG_DELFLOWTABLE: u16 = 24;
/// `NFT_MSG_DESTROY*` (announced as deletions): table, chain, rule, set, element,
/// object, flowtable.
pub(crate) const NFT_MSG_DESTROYTABLE: u16 = 26;
pub(crate) const NFT_MSG_DESTROYCHAIN: u16 = 27;
pub(crate) const NFT_MSG_DESTROYRULE: u16 = 28;
pub(crate) const NFT_MSG_DESTROYSET: u16 = 29;
pub(crate) const NFT_MSG_DESTROYSETELEM: u16 = 30;
pub(crate) const NFT_MSG_DESTROYOBJ: u16 = 31;
pub(crate) const NFT_MSG_DESTROYFLOWTABLE: u16 = 32;
/// `enum nft_*_attributes`: the attributes of each object's messages.
/// The table's name is attribute 1 of every object message (`NFTA_TABLE_NAME`,
/// `NFTA_CHAIN_TABLE`, `NFTA_RULE_TABLE`, `NFTA_SET_TABLE`, `NFTA_SET_ELEM_LIST_TABLE`,
/// `NFTA_OBJ_TABLE`, `NFTA_FLOWTABLE_TABLE`).
pub(crate) const NFTA_ANY_TABLE: u16 = 1;
pub(crate) const NFTA_TABLE_NAME: u16 = 1;
pub(crate) const NFTA_TABLE_FLAGS: u16 = 2;
/// The table's use count: its chains, sets (anonymous ones too), objects and flowtables.
pub(crate) const NFTA_TABLE_USE: u16 = 3;
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
/// `enum nft_set_flags`: anonymous, constant, interval, map, timeout, eval (updated
/// from the packet path), object (maps keys to named objects).
pub(crate) const NFT_SET_ANONYMOUS: u32 = 0x1;
pub(crate) const NFT_SET_CONSTANT: u32 = 0x2;
pub(crate) const NFT_SET_INTERVAL: u32 = 0x4;
pub(crate) const NFT_SET_MAP: u32 = 0x8;
pub(crate) const NFT_SET_TIMEOUT: u32 = 0x10;
pub(crate) const NFT_SET_EVAL: u32 = 0x20;
pub(crate) const NFT_SET_OBJECT: u32 = 0x40;
/// `NFT_SET_ELEM_INTERVAL_END`: the element ends an interval.
pub(crate) const NFT_SET_ELEM_INTERVAL_END: u32 = 0x1;
/// `NFT_TABLE_F_DORMANT`: the table's base chains are not hooked.
pub(crate) const NFT_TABLE_F_DORMANT: u32 = 0x1;
/// `NFT_DATA_VERDICT`: a map's data type when it maps to verdicts.
pub(crate) const NFT_DATA_VERDICT: u32 = 0xffff_ff00;
/// Verdict codes (`NF_DROP`, `NF_ACCEPT`, `enum nft_verdicts`), as the kernel's `u32`;
/// `crate::atom::Verdict` encodes and decodes them. `NF_ACCEPT` is also a base chain's
/// policy.
pub(crate) const NF_DROP: u32 = 0;
pub(crate) const NF_ACCEPT: u32 = 1;
pub(crate) const NFT_CONTINUE: u32 = -1i32 as u32;
pub(crate) const NFT_JUMP: u32 = -3i32 as u32;
pub(crate) const NFT_GOTO: u32 = -4i32 as u32;
pub(crate) const NFT_RETURN: u32 = -5i32 as u32;
/// `NFT_OBJECT_COUNTER`: the one type of named object kproxy declares (the others are
/// named by `crate::model::object_kind`).
pub(crate) const NFT_OBJECT_COUNTER: u32 = 1;
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

// The keys and values of the expressions kproxy's rules hold (linux/netfilter/
// nf_tables.h, linux/netfilter/nf_nat.h, linux/netfilter/nf_conntrack_common.h,
// linux/rtnetlink.h), written by `rule::encode` and read by `dump::rule`.
/// `enum nft_payload_bases`.
pub(crate) const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
pub(crate) const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
/// `enum nft_meta_keys`.
pub(crate) const NFT_META_MARK: u32 = 3;
pub(crate) const NFT_META_IIFNAME: u32 = 6;
pub(crate) const NFT_META_L4PROTO: u32 = 16;
/// `enum nft_ct_keys`: `ct status`, and the keys of a `ct original` load (the traffic
/// counters' lookup after DNAT).
pub(crate) const NFT_CT_STATUS: u32 = 2;
pub(crate) const NFT_CT_PROTO_DST: u32 = 12;
pub(crate) const NFT_CT_DST_IP: u32 = 20;
pub(crate) const NFT_CT_DST_IP6: u32 = 22;
/// `IPS_DST_NAT`: the `dnat` bit of `ct status`.
pub(crate) const IPS_DST_NAT: u32 = 0x20;
/// `enum nft_fib_flags` (which address is looked up) and `NFT_FIB_RESULT_ADDRTYPE`.
pub(crate) const NFTA_FIB_F_SADDR: u32 = 1;
pub(crate) const NFTA_FIB_F_DADDR: u32 = 2;
pub(crate) const NFT_FIB_RESULT_ADDRTYPE: u32 = 3;
/// `RTN_LOCAL`: the address type `fib … type local` compares with.
pub(crate) const RTN_LOCAL: u32 = 2;
/// `NFT_NG_RANDOM`: `numgen random`.
pub(crate) const NFT_NG_RANDOM: u32 = 1;
/// `enum nft_cmp_ops`: `==`, `!=`.
pub(crate) const NFT_CMP_EQ: u32 = 0;
pub(crate) const NFT_CMP_NEQ: u32 = 1;
/// `NFT_LOOKUP_F_INV`: a lookup that matches when the key is absent.
pub(crate) const NFT_LOOKUP_F_INV: u32 = 1;
/// `NFT_NAT_DNAT`.
pub(crate) const NFT_NAT_DNAT: u32 = 1;
/// `NF_NAT_RANGE_PROTO_SPECIFIED`, `NF_NAT_RANGE_MAP_IPS` (what the kernel sets itself
/// for a DNAT to an address and a port) and `NF_NAT_RANGE_PROTO_RANDOM_FULLY`.
pub(crate) const NF_NAT_RANGE_MAP_IPS: u32 = 0x1;
pub(crate) const NF_NAT_RANGE_PROTO_SPECIFIED: u32 = 0x2;
pub(crate) const NF_NAT_RANGE_PROTO_RANDOM_FULLY: u32 = 0x10;
/// `enum nft_reject_types`, and the ICMP / ICMPv6 port-unreachable codes kproxy
/// rejects with.
pub(crate) const NFT_REJECT_ICMP_UNREACH: u32 = 0;
pub(crate) const NFT_REJECT_TCP_RST: u32 = 1;
pub(crate) const ICMP_PORT_UNREACH: u8 = 3;
pub(crate) const ICMPV6_PORT_UNREACH: u8 = 4;
/// `NFT_DYNSET_OP_UPDATE`.
pub(crate) const NFT_DYNSET_OP_UPDATE: u32 = 1;

// libnftnl's user data (`enum nftnl_udata_*_types`): TLVs a table, chain, rule, set or
// object carries for nft to print; the kernel stores them unread.
/// A table's, rule's or object's comment.
pub(crate) const UDATA_COMMENT: u8 = 0;
/// A set's: key and data byte order, auto-merge, `typeof` key and data, data interval,
/// comment.
pub(crate) const UDATA_SET_KEYBYTEORDER: u8 = 0;
pub(crate) const UDATA_SET_DATABYTEORDER: u8 = 1;
pub(crate) const UDATA_SET_MERGE_ELEMENTS: u8 = 2;
pub(crate) const UDATA_SET_KEY_TYPEOF: u8 = 3;
pub(crate) const UDATA_SET_DATA_TYPEOF: u8 = 4;
pub(crate) const UDATA_SET_DATA_INTERVAL: u8 = 6;
pub(crate) const UDATA_SET_COMMENT: u8 = 7;

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

#[cfg(test)]
mod answer_tests {
    use super::*;

    #[test]
    fn a_request_socket_waits_for_the_kernel_at_most_the_answer_timeout() {
        let sock = open().expect("a netfilter netlink socket");
        let t = nix::sys::socket::getsockopt(&sock, nix::sys::socket::sockopt::ReceiveTimeout)
            .expect("SO_RCVTIMEO");
        assert_eq!(t.tv_sec() as u64, ANSWER_TIMEOUT.as_secs());
    }

    #[test]
    fn the_receive_timeout_is_said_as_a_timeout_and_other_errors_pass() {
        let e = answer_error(std::io::Error::from(std::io::ErrorKind::WouldBlock));
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert!(e.to_string().contains("30 s"), "{e}");
        let e = answer_error(std::io::Error::from_raw_os_error(libc::ENOBUFS));
        assert_eq!(e.raw_os_error(), Some(libc::ENOBUFS));
    }
}
