//! The kernel's word on kproxy's tables: a netfilter netlink socket subscribed to the
//! nftables notification group (`NFNLGRP_NFTABLES`, what `nft monitor` reads) in the
//! calling thread's network namespace. Every committed nftables transaction is announced
//! there, object by object (table, chain, rule, set, element added or deleted), and
//! closed by a `NEWGEN` message naming the process that committed it
//! (`NFTA_GEN_PROC_PID`, `NFTA_GEN_PROC_NAME`). [`Monitor::next_event`] reports each
//! transaction of another process that touched kproxy's tables (`ip NAME`, `ip6 NAME`;
//! the neighbour contract in crates/nft/README.md), and the loss of notifications (a
//! receive buffer overrun), when what changed is unknown. It decides nothing about the
//! repair: the caller repairs from the record ([`crate::dataplane::Dataplane::repair`]), paced by
//! [`Backoff`] so a process that keeps fighting cannot make kproxy spin. The same
//! notifications tell a reader of one table whether a transaction touched it while it
//! was read ([`ReadWatch`], used by `dump`'s readings).
//!
//! Which transactions are kproxy's own: the kernel names the committing *thread*
//! (`task_pid_nr`, in the initial pid namespace) and stamps every notification with the
//! netlink port id of the committing socket. kproxy commits only from its own threads
//! (nfnetlink batches), whose sockets note their port ids here ([`crate::nfnl::note_own`]). A
//! transaction is
//! kproxy's when its port id or pid is one of those, or its pid is a thread of this
//! process. The port id holds in a container with its own pid namespace too, where the
//! kernel's pid is not the one kproxy sees.
//!
//! Written on `netlink-sys` (the socket, group membership) and `netlink-packet-core`'s
//! attribute iterator; the messages are read by hand (header, family, the table name
//! attribute, which is attribute 1 in every object message) rather than decoded whole by
//! `netlink-packet-netfilter`: a full sync announces every element (≈ 106k at
//! 10k Services × 10 endpoints) and rules with their expressions, and decoding each whole
//! to read one name would cost the monitor more than the sync.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use netlink_sys::Socket;
use nix::sys::socket::{setsockopt, sockopt};
use nix::sys::time::TimeVal;

use crate::atom::Family;
use crate::error::NftError;
// The kernel's vocabulary: every constant, and the reading of attributes, is the floor's.
use crate::nfnl::*;
const NETLINK_HEADER: usize = 16;
const NFGENMSG: usize = 4;
/// The receive buffer: a full sync at 10k × 10 announces ≈ 10 MB of notifications
/// (coalesced by the kernel into page-sized messages) while the monitor reads them.
const RCVBUF: usize = 64 << 20;
/// How long [`Monitor::next_event`] blocks before answering `None`, so its thread can notice
/// that nobody listens any more.
const POLL: Duration = Duration::from_secs(1);
/// Whether the transaction announced with `port_id` and `pid` was committed by kproxy.
fn own_transaction(port_id: u32, pid: Option<u32>) -> bool {
    if port_id != 0 && noted_own(port_id) {
        return true;
    }
    pid.is_some_and(|pid| {
        pid == std::process::id()
            || noted_own(pid)
            || std::path::Path::new(&format!("/proc/self/task/{pid}")).exists()
    })
}

/// The kind of object a notification is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChangeKind {
    Table,
    Chain,
    Rule,
    Set,
    Element,
    /// Stateful objects, flowtables: kproxy has none, so any is someone else's.
    Other,
}

impl ChangeKind {
    /// The metric label (`kproxy_kernel_interference_total{what}`).
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Table => "table",
            ChangeKind::Chain => "chain",
            ChangeKind::Rule => "rule",
            ChangeKind::Set => "set",
            ChangeKind::Element => "element",
            ChangeKind::Other => "other",
        }
    }

    /// Every label value.
    pub const ALL: [ChangeKind; 6] = [
        ChangeKind::Table,
        ChangeKind::Chain,
        ChangeKind::Rule,
        ChangeKind::Set,
        ChangeKind::Element,
        ChangeKind::Other,
    ];
}

/// The kind and verb (added: true) of an nf_tables message type; `None` for the
/// generation message and anything that is not an object notification.
fn object(msg: u16) -> Option<(ChangeKind, bool)> {
    Some(match msg {
        NFT_MSG_NEWTABLE => (ChangeKind::Table, true),
        NFT_MSG_DELTABLE | NFT_MSG_DESTROYTABLE => (ChangeKind::Table, false),
        NFT_MSG_NEWCHAIN => (ChangeKind::Chain, true),
        NFT_MSG_DELCHAIN | NFT_MSG_DESTROYCHAIN => (ChangeKind::Chain, false),
        NFT_MSG_NEWRULE => (ChangeKind::Rule, true),
        NFT_MSG_DELRULE | NFT_MSG_DESTROYRULE => (ChangeKind::Rule, false),
        NFT_MSG_NEWSET => (ChangeKind::Set, true),
        NFT_MSG_DELSET | NFT_MSG_DESTROYSET => (ChangeKind::Set, false),
        NFT_MSG_NEWSETELEM => (ChangeKind::Element, true),
        NFT_MSG_DELSETELEM | NFT_MSG_DESTROYSETELEM => (ChangeKind::Element, false),
        NFT_MSG_NEWOBJ | NFT_MSG_NEWFLOWTABLE => (ChangeKind::Other, true),
        NFT_MSG_DELOBJ | NFT_MSG_DELFLOWTABLE | NFT_MSG_DESTROYOBJ | NFT_MSG_DESTROYFLOWTABLE => {
            (ChangeKind::Other, false)
        }
        _ => return None,
    })
}

/// What one transaction changed in kproxy's tables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Objects added and deleted per kind: (added, deleted).
    pub counts: BTreeMap<ChangeKind, (usize, usize)>,
    /// kproxy's tables the transaction deleted (a flushed ruleset deletes them all).
    pub tables_deleted: Vec<Family>,
    /// A few of the changed objects by name, for the log (`delete chain ip kproxy svc-x`).
    pub examples: Vec<String>,
}

/// Objects named in [`Changes::examples`].
const EXAMPLES: usize = 3;

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }

    fn note(
        &mut self,
        kind: ChangeKind,
        added: bool,
        family: Family,
        table: &str,
        name: Option<&str>,
    ) {
        let c = self.counts.entry(kind).or_default();
        if added {
            c.0 += 1
        } else {
            c.1 += 1
        }
        if kind == ChangeKind::Table && !added && !self.tables_deleted.contains(&family) {
            self.tables_deleted.push(family);
        }
        if self.examples.len() < EXAMPLES {
            let verb = if added { "add" } else { "delete" };
            let mut e = format!("{verb} {} {} {table}", kind.as_str(), family.nft());
            if let Some(n) = name {
                e.push(' ');
                e.push_str(n);
            }
            self.examples.push(e);
        }
    }

    /// One line for the log: `deleted: 1 table, 12 chains; added: 1 rule`.
    pub fn summary(&self) -> String {
        let part = |pick: fn(&(usize, usize)) -> usize| {
            self.counts
                .iter()
                .filter(|(_, c)| pick(c) > 0)
                .map(|(k, c)| format!("{} {}", pick(c), k.as_str()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let (deleted, added) = (part(|c| c.1), part(|c| c.0));
        match (deleted.is_empty(), added.is_empty()) {
            (false, false) => format!("deleted {deleted}; added {added}"),
            (false, true) => format!("deleted {deleted}"),
            _ => format!("added {added}"),
        }
    }
}

/// A transaction of another process that changed kproxy's tables.
#[derive(Clone, Debug)]
pub struct Interference {
    /// The committing process as the kernel names it (its pid in the initial pid
    /// namespace; 0 when the kernel did not say).
    pub pid: u32,
    /// Its command name (`comm`, e.g. `nft`).
    pub process: String,
    /// The ruleset generation the transaction made.
    pub generation: u32,
    pub changes: Changes,
    /// When the monitor read the transaction's last message.
    pub detected: Instant,
}

impl Interference {
    /// Whether one of kproxy's tables is gone (the first sync's path repairs it).
    pub fn tables_missing(&self) -> bool {
        !self.changes.tables_deleted.is_empty()
    }

    /// Adds a later transaction `i` to this one (reported together).
    pub fn merge(&mut self, i: Interference) {
        for (k, (a, d)) in i.changes.counts {
            let c = self.changes.counts.entry(k).or_default();
            c.0 += a;
            c.1 += d;
        }
        for f in i.changes.tables_deleted {
            if !self.changes.tables_deleted.contains(&f) {
                self.changes.tables_deleted.push(f);
            }
        }
        let room = EXAMPLES.saturating_sub(self.changes.examples.len());
        self.changes
            .examples
            .extend(i.changes.examples.into_iter().take(room));
        self.pid = i.pid;
        self.process = i.process;
        self.generation = i.generation;
    }
}

/// What [`Monitor::next_event`] read.
#[derive(Clone, Debug)]
pub enum Event {
    /// Another process changed kproxy's tables.
    Interference(Interference),
    /// Notifications were lost (the receive buffer overran): whatever happened meanwhile
    /// is unknown; the caller compares the kernel with its record.
    Lost,
}

/// The subscribed socket.
pub struct Monitor {
    sock: Socket,
    table: String,
    /// The open transaction's changes to kproxy's tables, until its `NEWGEN`.
    pending: Changes,
    buf: Vec<u8>,
}

impl Monitor {
    /// Subscribes to nftables notifications in the calling thread's network namespace,
    /// for kproxy's tables named `table`.
    pub fn open(table: &str) -> Result<Monitor, NftError> {
        let sock = notification_socket(RCVBUF, POLL)?;
        Ok(Monitor {
            sock,
            table: table.to_string(),
            pending: Changes::default(),
            buf: vec![0; 1 << 20],
        })
    }

    /// Blocks until another process's transaction changed kproxy's tables, or
    /// notifications were lost; `Ok(None)` after a second without either.
    pub fn next_event(&mut self) -> Result<Option<Event>, NftError> {
        loop {
            let n = match recv(&self.sock, &mut self.buf, 0) {
                Ok(Some(n)) => n,
                Ok(None) => return Ok(None),
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    self.pending = Changes::default();
                    return Ok(Some(Event::Lost));
                }
                Err(e) => {
                    return Err(NftError::Io {
                        context: "reading nftables notifications".into(),
                        source: e,
                    });
                }
            };
            let detected = Instant::now();
            let mut found = None;
            let (table, pending) = (&self.table, &mut self.pending);
            read_datagram(&self.buf[..n], table, pending, &mut |i| found = Some(i));
            if let Some(mut i) = found {
                i.detected = detected;
                return Ok(Some(Event::Interference(i)));
            }
        }
    }
}

/// A bound netfilter netlink socket for notifications (the kernel delivers the group to
/// bound sockets only), with a receive buffer of `rcvbuf` bytes (forced, else as large
/// as allowed) and a receive timeout of `poll`, in the nftables notification group.
fn notification_socket(rcvbuf: usize, poll: Duration) -> Result<Socket, NftError> {
    let io = |context: &str| {
        let context = context.to_string();
        move |source| NftError::Io { context, source }
    };
    let sock = bound().map_err(io("opening a netfilter netlink socket"))?;
    setsockopt(&sock, sockopt::RcvBufForce, &rcvbuf)
        .or_else(|_| setsockopt(&sock, sockopt::RcvBuf, &rcvbuf))
        .map_err(std::io::Error::from)
        .map_err(io("raising a notification socket's receive buffer"))?;
    let poll = TimeVal::new(poll.as_secs() as i64, i64::from(poll.subsec_micros()));
    setsockopt(&sock, sockopt::ReceiveTimeout, &poll)
        .map_err(std::io::Error::from)
        .map_err(io("setting a notification socket's receive timeout"))?;
    sock.add_membership(NFNLGRP_NFTABLES)
        .map_err(io("joining the nftables notification group"))?;
    Ok(sock)
}

/// One datagram into `buf`: its length, `None` when the socket's receive timeout passed
/// (or, with `MSG_DONTWAIT` in `flags`, when none was queued).
fn recv(sock: &Socket, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<Option<usize>> {
    loop {
        match sock.recv(&mut &mut buf[..], flags) {
            Ok(n) => return Ok(Some(n)),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// An nftables message of a datagram: its type, family and attributes, and the port id
/// it is stamped with.
struct Message<'a> {
    msg_type: u16,
    family: u8,
    port_id: u32,
    attrs: &'a [u8],
}

/// The nftables messages of one datagram, in order (others skipped; a truncated one
/// ends it).
fn messages(buf: &[u8]) -> impl Iterator<Item = Message<'_>> {
    let mut offset = 0;
    std::iter::from_fn(move || {
        while offset + NETLINK_HEADER <= buf.len() {
            let word = |at: usize| u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
            let len = word(offset) as usize;
            if len < NETLINK_HEADER || offset + len > buf.len() {
                return None;
            }
            let kind = u16::from_ne_bytes([buf[offset + 4], buf[offset + 5]]);
            let port_id = word(offset + 12);
            let msg = &buf[offset..offset + len];
            offset += len.next_multiple_of(4);
            let (subsys, msg_type) = (kind >> 8, kind & 0xff);
            if subsys != NFNL_SUBSYS_NFTABLES || msg.len() < NETLINK_HEADER + NFGENMSG {
                continue;
            }
            return Some(Message {
                msg_type,
                family: msg[NETLINK_HEADER],
                port_id,
                attrs: &msg[NETLINK_HEADER + NFGENMSG..],
            });
        }
        None
    })
}

/// Reads one datagram's messages into `pending`; at each `NEWGEN` closing a transaction
/// that changed kproxy's tables and is not kproxy's own, hands it to `found` (at most one
/// per datagram can be reported before the caller reads on: the rest of the datagram is
/// still read, and a second one in the same datagram is merged into the first).
fn read_datagram(
    buf: &[u8],
    table: &str,
    pending: &mut Changes,
    found: &mut dyn FnMut(Interference),
) {
    let mut report: Option<Interference> = None;
    for Message {
        msg_type,
        family,
        port_id,
        attrs,
    } in messages(buf)
    {
        if msg_type == NFT_MSG_NEWGEN {
            let changes = std::mem::take(pending);
            let (generation, pid, process) = gen_info(attrs);
            if changes.is_empty() || own_transaction(port_id, pid) {
                continue;
            }
            let i = Interference {
                pid: pid.unwrap_or(0),
                process: process.unwrap_or_default(),
                generation,
                changes,
                detected: Instant::now(),
            };
            match &mut report {
                None => report = Some(i),
                Some(r) => r.merge(i),
            }
            continue;
        }
        let Some((kind, added)) = object(msg_type) else {
            continue;
        };
        let Some(family) = Family::of_nfproto(family) else {
            continue;
        };
        // The object's own name: `NFTA_CHAIN_NAME` (3), `NFTA_RULE_CHAIN` (2, the
        // rule's chain), `NFTA_SET_NAME` and `NFTA_SET_ELEM_LIST_SET` (2).
        let name_attr = match kind {
            ChangeKind::Chain => Some(NFTA_CHAIN_NAME),
            ChangeKind::Rule => Some(NFTA_RULE_CHAIN),
            ChangeKind::Set | ChangeKind::Element => Some(NFTA_SET_NAME),
            ChangeKind::Table | ChangeKind::Other => None,
        };
        let (mut this_table, mut name) = (None, None);
        for (k, value) in Attrs(attrs) {
            if k == NFTA_ANY_TABLE {
                this_table = c_str(value);
            } else if Some(k) == name_attr {
                name = c_str(value);
            }
        }
        if this_table == Some(table) {
            pending.note(kind, added, family, table, name);
        }
    }
    if let Some(r) = report {
        found(r);
    }
}

/// Generation id, committing pid and command name of a `NEWGEN` message.
fn gen_info(attrs: &[u8]) -> (u32, Option<u32>, Option<String>) {
    let (mut generation, mut pid, mut name) = (0, None, None);
    for (kind, value) in Attrs(attrs) {
        match kind {
            NFTA_GEN_ID => generation = be32(value).unwrap_or(0),
            NFTA_GEN_PROC_PID => pid = be32(value),
            NFTA_GEN_PROC_NAME => name = c_str(value).map(str::to_string),
            _ => {}
        }
    }
    (generation, pid, name)
}

/// Whether one table stayed as it was while a reader read it (`dump`'s readings): a
/// subscription to the notifications, opened before the reading asks the kernel for
/// the ruleset's generation, that says afterwards whether any transaction committed
/// meanwhile named the table. The generation alone cannot say it: it is the whole
/// namespace's, so another program adding one rule a second to a table of its own moved
/// it during every reading of a large table, and each adoption at start ended in a
/// replacement of every element (one transaction holding the kernel's nftables lock,
/// and every other writer, for seconds: BENCHMARKS.md, "Another nftables user during
/// kproxy's adoption").
///
/// Why the notifications are the whole truth of what changed: a transaction makes its
/// objects visible at once (the generation cursor's flip, after the generation is
/// bumped), then announces every object it touched, each message naming its table, and
/// ends with `NEWGEN`, all before the next transaction starts; so a transaction that
/// became visible during the reading announced itself after the subscription, and,
/// when the reading saw generation `after`, before `NEWGEN(after)`. Nothing is taken on
/// trust from anyone's writing: any message naming the table (kproxy's own
/// transactions too), a lost notification (receive buffer overrun), or a `NEWGEN`
/// that does not come, and the reading is not taken.
pub(crate) struct ReadWatch {
    sock: Socket,
    buf: Vec<u8>,
    seen: Watched,
}

/// What a [`ReadWatch`] has read since its last [`ReadWatch::start`].
#[derive(Clone, Debug, PartialEq, Eq)]
struct Watched {
    family: Family,
    table: String,
    /// A message named the table.
    touched: bool,
    /// Notifications were lost.
    lost: bool,
    /// The generation of the last `NEWGEN` read.
    last: Option<u32>,
}

impl Watched {
    /// Whether the `NEWGEN` of generation `generation` was read: the last one read is
    /// that or a later one (generations count up by one a transaction, wrapping).
    fn announced(&self, generation: u32) -> bool {
        self.last
            .is_some_and(|last| (last.wrapping_sub(generation) as i32) >= 0)
    }

    /// Reads one datagram of notifications.
    fn read(&mut self, buf: &[u8]) {
        for m in messages(buf) {
            if m.msg_type == NFT_MSG_NEWGEN {
                self.last = Some(gen_info(m.attrs).0);
                continue;
            }
            // Any other message naming the table, whatever its type: an object's, a
            // reset's, one of a kernel newer than this code.
            if Family::of_nfproto(m.family) == Some(self.family)
                && Attrs(m.attrs).any(|(k, v)| k == NFTA_ANY_TABLE && c_str(v) == Some(&self.table))
            {
                self.touched = true;
            }
        }
    }
}

/// How long [`ReadWatch::settled`] waits for the `NEWGEN` of the generation the reading
/// ended at: the transaction that made it was announcing itself as the reading ended.
const NEWGEN_WAIT: Duration = Duration::from_secs(2);
/// The watch's receive timeout, the step of that wait.
const WATCH_POLL: Duration = Duration::from_millis(50);

impl ReadWatch {
    /// Subscribes to the notifications of the calling thread's network namespace, for
    /// table `family table`.
    pub(crate) fn open(family: Family, table: &str) -> Result<ReadWatch, NftError> {
        let sock = notification_socket(RCVBUF, WATCH_POLL)?;
        Ok(ReadWatch {
            sock,
            buf: vec![0; 1 << 20],
            seen: Watched {
                family,
                table: table.to_string(),
                touched: false,
                lost: false,
                last: None,
            },
        })
    }

    /// Forgets what was announced so far: every transaction announced before this call
    /// was visible before it. Called before a reading asks for its first generation.
    pub(crate) fn start(&mut self) -> Result<(), NftError> {
        self.drain()?;
        self.seen.touched = false;
        self.seen.lost = false;
        Ok(())
    }

    /// Reads what is queued, without waiting (the reader calls it between its requests,
    /// so a long reading beside a busy neighbour queues little).
    pub(crate) fn drain(&mut self) -> Result<(), NftError> {
        while self.recv(libc::MSG_DONTWAIT)? {}
        Ok(())
    }

    /// One datagram read into `seen`; false when none came (or, with `flags` 0, none
    /// within the receive timeout).
    fn recv(&mut self, flags: libc::c_int) -> Result<bool, NftError> {
        match recv(&self.sock, &mut self.buf, flags) {
            Ok(Some(n)) => {
                self.seen.read(&self.buf[..n]);
                // A datagram that filled the buffer may have been cut short.
                self.seen.lost |= n >= self.buf.len();
                Ok(true)
            }
            Ok(None) => Ok(false),
            Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                self.seen.lost = true;
                Ok(true)
            }
            Err(source) => Err(NftError::Io {
                context: "reading nftables notifications during a reading".into(),
                source,
            }),
        }
    }

    /// Whether a reading that began at generation `before` (asked after
    /// [`ReadWatch::start`]) and ended at `after` saw the table in one state: no
    /// transaction announced through `after` named it, and none was lost. When the
    /// generation moved, the wait for `NEWGEN(after)` is bounded ([`NEWGEN_WAIT`]);
    /// without it the answer is no.
    pub(crate) fn settled(&mut self, before: u32, after: u32) -> Result<bool, NftError> {
        self.drain()?;
        if before != after {
            let deadline = Instant::now() + NEWGEN_WAIT;
            while !self.seen.announced(after) && !self.seen.lost && !self.seen.touched {
                if Instant::now() >= deadline {
                    return Ok(false);
                }
                self.recv(0)?;
            }
        }
        Ok(!self.seen.touched && !self.seen.lost)
    }
}

/// How long to wait before repairing, so a process that keeps changing kproxy's tables
/// (a firewall manager reapplying its ruleset, a script in a loop) meets repairs further
/// and further apart instead of a kproxy that spins: the first repair of a quiet spell
/// at once, then [`Backoff::FIRST`] doubling to [`Backoff::MAX`] while interference keeps
/// coming back within [`Backoff::QUIET`] of the last repair. Pure (the caller gives the
/// time since the last repair).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backoff {
    /// Repairs since the last quiet spell.
    pub streak: u32,
}

impl Backoff {
    pub const FIRST: Duration = Duration::from_millis(100);
    pub const MAX: Duration = Duration::from_secs(30);
    /// Interference this long after the last repair starts a new spell.
    pub const QUIET: Duration = Duration::from_secs(60);

    /// The wait before repairing interference detected `since_repair` after the last
    /// repair (`None`: never repaired).
    pub fn delay(&mut self, since_repair: Option<Duration>) -> Duration {
        if since_repair.is_none_or(|d| d >= Self::QUIET) {
            self.streak = 0;
        }
        match self.streak {
            0 => Duration::ZERO,
            n => Self::FIRST
                .saturating_mul(1 << (n - 1).min(16))
                .min(Self::MAX),
        }
    }

    /// A repair ran (successful or not).
    pub fn repaired(&mut self) {
        self.streak = self.streak.saturating_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One nf_tables message: header (type, port id), nfgenmsg (family), attributes.
    fn message(msg_type: u16, family: u8, port_id: u32, attrs: &[(u16, Vec<u8>)]) -> Vec<u8> {
        let mut b = vec![0; NETLINK_HEADER];
        b[4..6].copy_from_slice(&(NFNL_SUBSYS_NFTABLES << 8 | msg_type).to_ne_bytes());
        b[12..16].copy_from_slice(&port_id.to_ne_bytes());
        b.extend_from_slice(&[family, 0, 0, 0]);
        for (kind, value) in attrs {
            let len = (4 + value.len()) as u16;
            b.extend_from_slice(&len.to_ne_bytes());
            b.extend_from_slice(&kind.to_ne_bytes());
            b.extend_from_slice(value);
            b.resize(b.len().next_multiple_of(4), 0);
        }
        let len = b.len() as u32;
        b[0..4].copy_from_slice(&len.to_ne_bytes());
        b
    }

    fn s(x: &str) -> Vec<u8> {
        let mut v = x.as_bytes().to_vec();
        v.push(0);
        v
    }

    fn newgen(port_id: u32, pid: u32, name: &str) -> Vec<u8> {
        message(
            NFT_MSG_NEWGEN,
            0,
            port_id,
            &[
                (NFTA_GEN_ID, 7u32.to_be_bytes().to_vec()),
                (NFTA_GEN_PROC_PID, pid.to_be_bytes().to_vec()),
                (NFTA_GEN_PROC_NAME, s(name)),
            ],
        )
    }

    fn read(datagram: &[u8]) -> Option<Interference> {
        let mut pending = Changes::default();
        let mut got = None;
        read_datagram(datagram, "kproxy", &mut pending, &mut |i| got = Some(i));
        got
    }

    /// A pid no thread of this process has (pid_max is at most 2^22).
    const STRANGER: u32 = 4_000_000_001;

    /// A child's commit is its `NEWGEN`, named by its socket's port id or by its pid
    /// (after other messages in the datagram); another process's is not.

    #[test]
    fn a_flush_by_another_process_is_reported_with_its_name() {
        let mut d = Vec::new();
        d.extend(message(
            8,
            NFPROTO_IPV4,
            0,
            &[(1, s("kproxy")), (2, s("services"))],
        ));
        d.extend(message(
            5,
            NFPROTO_IPV4,
            0,
            &[(1, s("kproxy")), (3, s("services"))],
        ));
        d.extend(message(2, NFPROTO_IPV4, 0, &[(1, s("kproxy"))]));
        d.extend(message(2, NFPROTO_IPV6, 0, &[(1, s("kproxy"))]));
        // Someone else's table goes too: not kproxy's business.
        d.extend(message(2, NFPROTO_IPV4, 0, &[(1, s("filter"))]));
        d.extend(newgen(STRANGER, STRANGER, "nft"));
        let i = read(&d).expect("reported");
        assert_eq!(
            (i.pid, i.process.as_str(), i.generation),
            (STRANGER, "nft", 7)
        );
        assert!(i.tables_missing());
        assert_eq!(i.changes.tables_deleted, [Family::Ip, Family::Ip6]);
        assert_eq!(i.changes.summary(), "deleted 2 table, 1 chain, 1 rule");
        assert_eq!(i.changes.examples[0], "delete rule ip kproxy services");
    }

    #[test]
    fn own_transactions_and_other_tables_are_not_reported() {
        let elem = message(14, NFPROTO_IPV4, 0, &[(1, s("kproxy")), (2, s("dnat"))]);
        // Another table only.
        let mut d = message(14, NFPROTO_IPV4, 0, &[(1, s("kproxy2")), (2, s("dnat"))]);
        d.extend(newgen(STRANGER, STRANGER, "nft"));
        assert!(read(&d).is_none());
        // This process's pid, or a noted port id.
        let mut d = elem.clone();
        d.extend(newgen(0, std::process::id(), "kproxy"));
        assert!(read(&d).is_none());
        note_own(STRANGER + 1);
        let mut d = elem.clone();
        d.extend(newgen(STRANGER + 1, STRANGER + 2, "nft"));
        assert!(read(&d).is_none());
        // An element deleted by a stranger is.
        let mut d = elem;
        d.extend(newgen(STRANGER + 3, STRANGER + 3, "iptables-nft"));
        let i = read(&d).expect("reported");
        assert!(!i.tables_missing());
        assert_eq!(i.changes.summary(), "deleted 1 element");
        assert_eq!(i.process, "iptables-nft");
    }

    #[test]
    fn a_transaction_split_over_datagrams_is_reported_at_its_generation() {
        let mut pending = Changes::default();
        let mut got = Vec::new();
        let add = message(
            6,
            NFPROTO_IPV6,
            0,
            &[(1, s("kproxy")), (2, s("nat-prerouting"))],
        );
        read_datagram(&add, "kproxy", &mut pending, &mut |i| got.push(i));
        assert!(got.is_empty());
        read_datagram(
            &newgen(9, STRANGER, "sh"),
            "kproxy",
            &mut pending,
            &mut |i| got.push(i),
        );
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].changes.summary(), "added 1 rule");
        assert!(pending.is_empty());
    }

    /// A reading's watch: only a message naming its own table in its own family
    /// touches it (an object's, or any other type's), and `NEWGEN`s count up to and
    /// past the generation the reading ended at, across the wrap.
    #[test]
    fn a_reading_is_touched_only_by_its_own_table() {
        let mut w = Watched {
            family: Family::Ip,
            table: "kproxy".into(),
            touched: false,
            lost: false,
            last: None,
        };
        let gen_at = |g: u32| {
            message(
                NFT_MSG_NEWGEN,
                0,
                0,
                &[(NFTA_GEN_ID, g.to_be_bytes().to_vec())],
            )
        };
        let mut d = message(6, NFPROTO_IPV4, 0, &[(1, s("neighbour")), (2, s("c"))]);
        d.extend(message(
            6,
            NFPROTO_IPV6,
            0,
            &[(1, s("kproxy")), (2, s("c"))],
        ));
        d.extend(message(
            12,
            NFPROTO_IPV4,
            0,
            &[(1, s("kproxy2")), (2, s("dnat"))],
        ));
        d.extend(gen_at(u32::MAX));
        w.read(&d);
        assert!(!w.touched);
        assert!(w.announced(u32::MAX) && !w.announced(1));
        w.read(&gen_at(2));
        assert!(w.announced(1) && w.announced(2) && !w.announced(3));
        // A reset's notification, or a type this code does not know, counts too.
        w.read(&message(0x3f, NFPROTO_IPV4, 0, &[(1, s("kproxy"))]));
        assert!(w.touched);
    }

    #[test]
    fn backoff_doubles_while_fought_and_resets_after_a_quiet_spell() {
        let ms = |d: Duration| d.as_millis() as u64;
        let mut b = Backoff::default();
        let mut got = Vec::new();
        let mut since = None;
        for _ in 0..12 {
            got.push(ms(b.delay(since)));
            b.repaired();
            since = Some(Duration::from_millis(50));
        }
        assert_eq!(
            got,
            [
                0, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000
            ]
        );
        // A minute without interference: the next repair is immediate again.
        assert_eq!(b.delay(Some(Backoff::QUIET)), Duration::ZERO);
    }
}
