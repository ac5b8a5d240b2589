//! Reads kproxy's own tables back from the kernel over nfnetlink (NFT_MSG_GETTABLE,
//! GETCHAIN, GETSET, GETSETELEM, GETRULE, GETOBJ dumps; no `nft list`), as they are:
//! [`read_table`] decodes the dumps by hand into a [`RawTable`] (attribute walking over
//! the received bytes; netlink-packet-netfilter's types cost microseconds per element,
//! and a 10k-Service table has ≈ 106k of them), each set's elements packed as the
//! kernel holds them ([`RawElements`], ≈ 25 bytes each). A reading of one table is taken
//! only when the table stayed as it was while it was read: the ruleset generation did
//! not move, or every transaction that moved it (announced on a subscription opened
//! first, `crate::monitor::ReadWatch`) left the table alone; else it is read again, and
//! after three tries it is an error (the caller falls back to a full replacement).
//! Another program's writes to its own tables neither fail a reading nor repeat it.
//! Also the names of a family's tables ([`table_names`]) and the traffic counters alone
//! ([`read_counters`]).
//!
//! The readers' decoding of the kernel's bytes into the typed vocabulary sits here too:
//! a key or value into a tuple ([`decode_tuple`]), an interval set's elements into
//! prefixes ([`decode_intervals`]), and a rule's expressions into the typed rule
//! ([`rule`], which looks up the raw tables' sets). Turning a raw table into the desired
//! model's terms ("adoption", see `Dataplane::sync`) is `crate::adopt`'s, above.
//! The socket comes from the netlink floor (`crate::nfnl::open`), as the writer's does.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use netlink_sys::Socket;

use crate::atom::{Atom, Family, Field, MAX_FIELDS};
use crate::counters::RawCounter;
use crate::counters::{KernelCounter, kernel_counters};
use crate::error::NftError;
use crate::model::Tuple;
use crate::monitor::ReadWatch;
// The kernel's vocabulary: every constant, and the reading of attributes, is the floor's.
use crate::nfnl::*;

pub mod objects;
pub mod rule;

pub use objects::ObjectRead;

const ELEM_INTERVAL_END: u8 = NFT_SET_ELEM_INTERVAL_END as u8;
/// The most bytes of one block of [`RawElements`].
const BLOCK_BYTES: usize = 64 * 1024;

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

/// One rule: its handle, its comment (kproxy's tag), if any, and its expressions as the
/// kernel sent them (`NFTA_RULE_EXPRESSIONS`, decoded by [`rule::decode`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawRule {
    pub handle: u64,
    pub comment: Option<String>,
    pub exprs: Vec<u8>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawChain {
    pub hook: Option<RawHook>,
    pub rules: Vec<RawRule>,
}

/// What a map element points to, as read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RawData<'a> {
    Value(&'a [u8]),
    Verdict {
        code: u32,
        chain: Option<&'a str>,
    },
    /// An object map's element: the object's name.
    Object(&'a str),
}

/// One element as read: its key, what it maps to, and whether it ends an interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawElement<'a> {
    pub key: &'a [u8],
    pub data: Option<RawData<'a>>,
    pub interval_end: bool,
}

/// What a set's elements carry besides their key, by the set's own declaration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum DataKind {
    #[default]
    None,
    /// Value bytes of this length.
    Value(usize),
    /// A verdict: its code and the index of its chain (`u32::MAX`: none), 4 bytes each.
    Verdict,
    /// An object's name: its index among the names (4 bytes).
    Object,
}

impl DataKind {
    fn len(self) -> usize {
        match self {
            DataKind::None => 0,
            DataKind::Value(n) => n,
            DataKind::Verdict => 8,
            DataKind::Object => 4,
        }
    }
}

/// A set's elements packed as the kernel holds them: each is `stride` bytes, its key
/// (the set's key length), its data (a map's value, or a verdict's code and chain
/// index), and a flags byte. About 25 bytes an element at 10k Services × 10 endpoints,
/// where a vector per key and per value took ≈ 100 and a restart held all of a
/// table's ≈ 106k at once (its peak was 30 MiB above a cold start's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawElements {
    key_len: usize,
    data: DataKind,
    /// Elements in blocks of [`BLOCK_BYTES`] at most, each block allocated at its full
    /// size once: a vector grown by doubling held up to twice the elements' bytes, and
    /// both copies while it moved.
    blocks: Vec<Vec<u8>>,
    len: usize,
    /// The chains verdicts name, each once.
    chains: Vec<String>,
    /// Elements whose key or data did not have the set's declared shape (a kernel
    /// keeps its own declaration; counted rather than trusted).
    misfits: usize,
}

impl RawElements {
    fn for_set(set: &RawSet) -> RawElements {
        let data = match (set.flags & NFT_SET_MAP != 0, set.data_type, set.data_len) {
            _ if set.flags & NFT_SET_OBJECT != 0 => DataKind::Object,
            (false, ..) => DataKind::None,
            (true, Some(NFT_DATA_VERDICT), _) => DataKind::Verdict,
            (true, _, Some(n)) => DataKind::Value(n as usize),
            (true, _, None) => DataKind::Value(0),
        };
        RawElements {
            key_len: set.key_len as usize,
            data,
            ..RawElements::default()
        }
    }

    fn stride(&self) -> usize {
        self.key_len + self.data.len() + 1
    }

    fn per_block(&self) -> usize {
        (BLOCK_BYTES / self.stride()).max(1)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// How many elements read did not fit the set's declared key or data.
    pub fn misfits(&self) -> usize {
        self.misfits
    }

    /// The `i`th element as read (dump order).
    pub fn get(&self, i: usize) -> RawElement<'_> {
        let (stride, per) = (self.stride(), self.per_block());
        let at = (i % per) * stride;
        let b = &self.blocks[i / per][at..at + stride];
        let (key, rest) = b.split_at(self.key_len);
        let (data, flags) = rest.split_at(self.data.len());
        let data = match self.data {
            DataKind::None => None,
            DataKind::Value(_) => Some(RawData::Value(data)),
            DataKind::Verdict => {
                let code = u32::from_ne_bytes(data[..4].try_into().expect("4 bytes"));
                let idx = u32::from_ne_bytes(data[4..8].try_into().expect("4 bytes"));
                let chain = self.chains.get(idx as usize).map(String::as_str);
                Some(RawData::Verdict { code, chain })
            }
            DataKind::Object => {
                let idx = u32::from_ne_bytes(data[..4].try_into().expect("4 bytes"));
                let name = self.chains.get(idx as usize).map_or("", String::as_str);
                Some(RawData::Object(name))
            }
        };
        RawElement {
            key,
            data,
            interval_end: flags[0] & ELEM_INTERVAL_END != 0,
        }
    }

    pub fn iter(&self) -> impl Iterator<Item = RawElement<'_>> {
        (0..self.len()).map(|i| self.get(i))
    }

    /// Appends one element; one of another shape is counted in [`RawElements::misfits`].
    pub fn push(&mut self, e: RawElement<'_>, chain_index: &mut BTreeMap<String, u32>) {
        let fits = e.key.len() == self.key_len
            && match (self.data, e.data) {
                (DataKind::None, None) => true,
                (DataKind::Value(n), Some(RawData::Value(v))) => v.len() == n,
                (DataKind::Verdict, Some(RawData::Verdict { .. })) => true,
                (DataKind::Object, Some(RawData::Object(_))) => true,
                _ => false,
            };
        if !fits {
            self.misfits += 1;
            return;
        }
        let (stride, per) = (self.stride(), self.per_block());
        if self.len.is_multiple_of(per) {
            self.blocks.push(Vec::with_capacity(per * stride));
        }
        self.len += 1;
        let bytes = self.blocks.last_mut().expect("a block was pushed above");
        bytes.extend_from_slice(e.key);
        match e.data {
            Some(RawData::Value(v)) => bytes.extend_from_slice(v),
            Some(RawData::Verdict { code, chain }) => {
                let idx = chain.map_or(u32::MAX, |c| self.name_index(c, chain_index));
                let bytes = self.blocks.last_mut().expect("a block was pushed above");
                bytes.extend_from_slice(&code.to_ne_bytes());
                bytes.extend_from_slice(&idx.to_ne_bytes());
            }
            // Object names share the chain names' table (an index each).
            Some(RawData::Object(name)) => {
                let idx = self.name_index(name, chain_index);
                let bytes = self.blocks.last_mut().expect("a block was pushed above");
                bytes.extend_from_slice(&idx.to_ne_bytes());
            }
            None => {}
        }
        let bytes = self.blocks.last_mut().expect("a block was pushed above");
        bytes.push(u8::from(e.interval_end) * ELEM_INTERVAL_END);
    }

    /// The index of chain or object name `name` in this set's names, added when new.
    fn name_index(&mut self, name: &str, index: &mut BTreeMap<String, u32>) -> u32 {
        if let Some(&i) = index.get(name) {
            return i;
        }
        let i = self.chains.len() as u32;
        self.chains.push(name.to_string());
        index.insert(name.to_string(), i);
        i
    }
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
    pub elements: RawElements,
    /// The element dump's cost in the kernel: its messages (≈ 32 KiB each, the most a
    /// netlink dump sends per round), and the elements its walk visited. Each round
    /// walks the set from its start and skips what earlier rounds sent
    /// (`nf_tables_dump_set`), so the visits are Σ (elements before a message + in it):
    /// quadratic in one set's size, which is why no dispatch map grows past
    /// [`crate::ruleset::Shards::ROWS`] rows.
    pub dump_messages: usize,
    pub dump_visits: u64,
}

/// One table as the kernel holds it; the anonymous sets, which belong to rules (`ip
/// daddr { … }`), apart from the named ones.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RawTable {
    pub flags: u32,
    pub comment: Option<String>,
    pub chains: BTreeMap<String, RawChain>,
    pub sets: BTreeMap<String, RawSet>,
    pub anonymous: BTreeMap<String, RawSet>,
    /// Named stateful objects (counters, quotas, limits, ct helpers…: `NFT_OBJECT_*`
    /// type, name; `model::object_kind` names the type). kproxy declares none: each is
    /// another program's.
    pub objects: std::collections::BTreeSet<(u32, String)>,
    /// The counter objects among them, by name.
    pub counters: BTreeMap<String, RawCounter>,
    /// How the objects were read and what it cost the kernel ([`objects`]).
    pub object_read: ObjectRead,
    /// The table's use count (`NFTA_TABLE_USE`): chains, sets, objects, flowtables.
    pub use_count: Option<u32>,
}

impl RawTable {
    /// Notes one named object as read (a counter's values too).
    fn add_object(&mut self, (kind, name, counter): objects::Object) {
        if let (NFT_OBJECT_COUNTER, Some(c)) = (kind, counter) {
            self.counters.insert(name.clone(), c);
        }
        self.objects.insert((kind, name));
    }

    pub fn rule_count(&self) -> usize {
        self.chains.values().map(|c| c.rules.len()).sum()
    }

    pub fn element_count(&self) -> usize {
        self.sets.values().map(|s| s.elements.len()).sum()
    }
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

/// One netlink message of an answer.
struct Message<'a> {
    kind: u16,
    flags: u16,
    seq: u32,
    /// After the 16-byte header.
    payload: &'a [u8],
}

/// The messages of one datagram received (`b`), in order; a malformed one is an error
/// about `what`.
fn messages<'a>(mut b: &'a [u8], what: &str) -> Result<Vec<Message<'a>>, NftError> {
    let mut out = Vec::new();
    while b.len() >= 16 {
        let len = u32::from_ne_bytes(b[..4].try_into().expect("4 bytes")) as usize;
        if len < 16 || len > b.len() {
            return Err(NftError::Read(format!(
                "{what}: a malformed answer ({len}-byte message in {} bytes)",
                b.len()
            )));
        }
        out.push(Message {
            kind: u16::from_ne_bytes([b[4], b[5]]),
            flags: u16::from_ne_bytes([b[6], b[7]]),
            seq: u32::from_ne_bytes(b[8..12].try_into().expect("4 bytes")),
            payload: &b[16..len],
        });
        b = b.get(len.next_multiple_of(4)..).unwrap_or_default();
    }
    Ok(out)
}

/// An `NLMSG_ERROR` answer's code (0: an acknowledgement; else minus an errno).
fn error_code(payload: &[u8]) -> i32 {
    payload
        .get(..4)
        .map_or(0, |c| i32::from_ne_bytes(c.try_into().expect("4 bytes")))
}

/// A netfilter socket for one reading, with a sequence counter, and, for a reading of
/// one table ([`read_consistent`]), the watch that says whether the table changed while
/// it was read.
struct Reader {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
    watch: Option<ReadWatch>,
}

impl Reader {
    fn open() -> Result<Reader, NftError> {
        let sock = crate::nfnl::open().map_err(|e| NftError::Io {
            context: "opening a netfilter netlink socket to read kproxy's tables".into(),
            source: e,
        })?;
        Ok(Reader {
            sock,
            seq: 0,
            buf: vec![0; 1 << 20],
            watch: None,
        })
    }

    /// Sends one request and hands every answer's nfgenmsg payload (after the 4-byte
    /// nfgenmsg header) to `each`, until the dump ends or the request is acknowledged.
    /// `Ok(false)` when the kernel answered ENOENT. With a watch, a dump the kernel
    /// marks interrupted (`NLM_F_DUMP_INTR`: the generation moved, in any table) is
    /// read to its end, and the watch judges the reading; without one it is an error.
    /// The watch's queue is read after each request.
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
        let values: Vec<Vec<u8>> = attrs
            .iter()
            .map(|(_, s)| [s.as_bytes(), b"\0"].concat())
            .collect();
        let attrs: Vec<(u16, &[u8])> = attrs
            .iter()
            .zip(&values)
            .map(|((k, _), v)| (*k, &v[..]))
            .collect();
        let mut req = Vec::with_capacity(64);
        append_request(&mut req, msg, flags, seq, family, &attrs);
        self.sock.send(&req, 0).map_err(|e| NftError::Io {
            context: format!("asking the kernel for {what}"),
            source: e,
        })?;
        let answered = 'answer: loop {
            let n = self
                .sock
                .recv(&mut &mut self.buf[..], 0)
                .map_err(|e| NftError::Io {
                    context: format!("reading the kernel's answer about {what}"),
                    source: crate::nfnl::answer_error(e),
                })?;
            for m in messages(&self.buf[..n], what)? {
                let Message {
                    kind,
                    flags: mflags,
                    seq: mseq,
                    payload,
                } = m;
                if mseq != seq {
                    continue; // a late answer to an earlier request
                }
                if mflags & NLM_F_DUMP_INTR != 0 && self.watch.is_none() {
                    return Err(NftError::Read(format!(
                        "{what}: the ruleset changed during the dump"
                    )));
                }
                match kind {
                    NLMSG_DONE => break 'answer Ok(true),
                    NLMSG_ERROR => {
                        break 'answer match error_code(payload) {
                            0 => Ok(true),
                            c if c == -libc::ENOENT => Ok(false),
                            c => Err(NftError::Read(format!(
                                "{what}: {}",
                                std::io::Error::from_raw_os_error(-c)
                            ))),
                        };
                    }
                    _ => each(payload.get(4..).unwrap_or_default())?,
                }
            }
        };
        if let Some(w) = &mut self.watch {
            w.drain()?;
        }
        answered
    }

    /// [`Reader::request`] handing `each` the value of attribute `want` of every answer.
    fn request_attr(
        &mut self,
        what: &str,
        (msg, flags, family): (u16, u16, u8),
        want: u16,
        mut each: impl FnMut(&[u8]),
    ) -> Result<bool, NftError> {
        self.request(what, msg, flags, family, &[], |p| {
            Attrs(p)
                .filter(|(k, _)| *k == want)
                .for_each(|(_, v)| each(v));
            Ok(())
        })
    }

    /// The ruleset generation (bumped by every committed transaction).
    fn generation(&mut self) -> Result<u32, NftError> {
        let mut id = None;
        let ask = (NFT_MSG_GETGEN, NLM_F_ACK, 0);
        self.request_attr("the ruleset generation", ask, NFTA_GEN_ID, |v| id = be32(v))?;
        id.ok_or_else(|| NftError::Read("the kernel sent no ruleset generation".into()))
    }
}

/// Appends one nf_tables request to `req`: the netlink and nfgenmsg headers, then
/// `attrs` as given (a string's value carries its own NUL). Every read request, the
/// dumps' and the by-name lookups', is written here.
pub(super) fn append_request(
    req: &mut Vec<u8>,
    msg: u16,
    flags: u16,
    seq: u32,
    family: u8,
    attrs: &[(u16, &[u8])],
) {
    let start = req.len();
    req.extend_from_slice(&[0; 4]);
    req.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | msg).to_ne_bytes());
    req.extend_from_slice(&(NLM_F_REQUEST | flags).to_ne_bytes());
    req.extend_from_slice(&seq.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&[family, 0, 0, 0]);
    for (kind, v) in attrs {
        req.extend_from_slice(&((4 + v.len()) as u16).to_ne_bytes());
        req.extend_from_slice(&kind.to_ne_bytes());
        req.extend_from_slice(v);
        req.resize(req.len().next_multiple_of(4), 0);
    }
    let total = (req.len() - start) as u32;
    req[start..start + 4].copy_from_slice(&total.to_ne_bytes());
}

/// Whether table `family table` exists: one GETTABLE request, absent when the kernel
/// answers `ENOENT`.
pub fn table_exists(family: Family, table: &str) -> Result<bool, NftError> {
    let fam = family.nfproto();
    Reader::open()?.request(
        &format!("table {family} {table}"),
        NFT_MSG_GETTABLE,
        NLM_F_ACK,
        fam,
        &[(NFTA_TABLE_NAME, table)],
        |_| Ok(()),
    )
}

/// The names of the tables of family `family` (`ip`, `ip6`) in the calling thread's
/// network namespace: one GETTABLE dump (what `nft list tables` prints, for one
/// family). The takeover reads kube-proxy's and kproxy's tables with it.
pub fn table_names(family: Family) -> Result<Vec<String>, NftError> {
    let mut names = Vec::new();
    let ask = (NFT_MSG_GETTABLE, NLM_F_DUMP, family.nfproto());
    Reader::open()?.request_attr(&format!("the {family} tables"), ask, NFTA_TABLE_NAME, |v| {
        names.push(string(v))
    })?;
    Ok(names)
}

/// Reads table `family table` (e.g. `ip kproxy`) with its chains, rules, named sets
/// and their elements from the calling thread's network namespace; `None` when the
/// table does not exist. Consistent: the reading is repeated (up to three times) when a
/// transaction that named the table committed meanwhile (or the notifications that
/// would say so were lost), then an error; other tables' transactions do not count.
pub fn read_table(family: Family, table: &str) -> Result<Option<RawTable>, NftError> {
    read_consistent(family, table, Elements::All, &Default::default())
}

/// [`read_table`] with the names of objects the caller knows the table may hold (its
/// record's counters): asked for by name with those the table's elements and rules
/// name ([`objects`]), so that a counter nothing names (an endpoint's that is not
/// ready) is not what sends the reading to the object dump.
pub(crate) fn read_table_knowing(
    family: Family,
    table: &str,
    known: &std::collections::BTreeSet<String>,
) -> Result<Option<RawTable>, NftError> {
    read_consistent(family, table, Elements::All, known)
}

/// Which sets' elements a reading takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Elements {
    All,
    /// The object maps' alone: what names the table's objects (a counters' reading).
    ObjectMaps,
}

/// [`read_table`], the elements of `which` sets read.
fn read_consistent(
    family: Family,
    table: &str,
    which: Elements,
    known: &std::collections::BTreeSet<String>,
) -> Result<Option<RawTable>, NftError> {
    let mut r = Reader::open()?;
    r.watch = Some(ReadWatch::open(family, table)?);
    for _ in 0..3 {
        let watch = r.watch.as_mut().expect("opened above");
        watch.start()?;
        let before = r.generation()?;
        let got = read_once(&mut r, family, table, which, known);
        let after = r.generation()?;
        // Transactions in other tables move the generation too (a neighbour adding
        // rules to its own): what counts is whether one named this table.
        let settled = r
            .watch
            .as_mut()
            .expect("opened above")
            .settled(before, after)?;
        match got {
            Ok(t) if settled => return Ok(t),
            Err(e) if settled => return Err(e),
            _ => continue,
        }
    }
    Err(NftError::Read(format!(
        "table {family} {table}: the ruleset kept changing while it was read"
    )))
}

/// The counter objects of kproxy's tables `ip TABLE` and `ip6 TABLE` (absent tables
/// have none), in this thread's network namespace ([`read_counter_objects`] of each).
/// Needs CAP_NET_ADMIN.
pub fn read_counters(table: &str) -> Result<Vec<KernelCounter>, NftError> {
    let mut out = Vec::new();
    for family in [Family::Ip, Family::Ip6] {
        out.extend(kernel_counters(
            family,
            read_counter_objects(family, table)?,
        ));
    }
    Ok(out)
}

/// The counter objects of table `family table` (e.g. `ip kproxy`) with their values
/// (packets, bytes), by name. An absent table has none. The table's structure and its
/// object maps' elements are read (what names its objects), then each object by name
/// ([`objects`]): linear in the objects, where their dump was quadratic. Consistent as
/// [`read_table`] is.
pub fn read_counter_objects(
    family: Family,
    table: &str,
) -> Result<BTreeMap<String, RawCounter>, NftError> {
    read_counter_objects_knowing(family, table, &Default::default())
}

/// [`read_counter_objects`] with the counters the caller knows the table may hold
/// ([`read_table_knowing`]).
pub(crate) fn read_counter_objects_knowing(
    family: Family,
    table: &str,
    known: &std::collections::BTreeSet<String>,
) -> Result<BTreeMap<String, RawCounter>, NftError> {
    Ok(read_consistent(family, table, Elements::ObjectMaps, known)?
        .map(|t| t.counters)
        .unwrap_or_default())
}

fn read_once(
    r: &mut Reader,
    family: Family,
    table: &str,
    which: Elements,
    known: &std::collections::BTreeSet<String>,
) -> Result<Option<RawTable>, NftError> {
    let fam = family.nfproto();
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
                    NFTA_TABLE_USE => t.use_count = be32(v),
                    NFTA_TABLE_USERDATA => t.comment = udata_string(v, UDATA_COMMENT),
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
                exprs: Vec::new(),
            };
            for (k, v) in Attrs(p) {
                match k {
                    NFTA_RULE_TABLE => tbl = string(v),
                    NFTA_RULE_CHAIN => chain = string(v),
                    NFTA_RULE_HANDLE => rule.handle = be64(v).unwrap_or(0),
                    NFTA_RULE_USERDATA => rule.comment = udata_string(v, UDATA_COMMENT),
                    NFTA_RULE_EXPRESSIONS => rule.exprs = v.to_vec(),
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
        return Err(NftError::Read(format!(
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
            if tbl == table && set.flags & NFT_SET_ANONYMOUS == 0 {
                t.sets.insert(name, set);
            } else if tbl == table {
                t.anonymous.insert(name, set);
            }
            Ok(())
        },
    )?;
    // How many objects the table holds: its use count less its chains and named sets
    // ([`objects`]; an anonymous set, bound to its rule, is not in the count: measured
    // on Linux 6.18, a table of 18 chains, 16 named sets and one anonymous set counts
    // 34, and 35 with one counter); and those its rules name.
    let structure = t.chains.len() + t.sets.len();
    let expected = t
        .use_count
        .and_then(|u| (u as usize).checked_sub(structure));
    let mut referenced = std::collections::BTreeSet::new();
    for rule in t.chains.values().flat_map(|c| &c.rules) {
        rule_object_names(&rule.exprs, &mut referenced);
    }
    if which == Elements::ObjectMaps && !known.is_empty() {
        // The counters alone, their names known (the daemon's reading): when those and
        // the rules' account for every object, the object maps need not be read.
        let names = known.union(&referenced).cloned().collect();
        if let Some((found, messages)) =
            objects::complete_by_name(r, family, table, &names, expected)?
        {
            t.object_read = ObjectRead {
                by_name: true,
                messages,
                visits: messages as u64,
            };
            found.into_iter().for_each(|o| t.add_object(o));
            return Ok(Some(t));
        }
    }
    for (name, set) in t.sets.iter_mut().chain(t.anonymous.iter_mut()) {
        if which == Elements::ObjectMaps && set.flags & NFT_SET_OBJECT == 0 {
            continue;
        }
        let mut elements = RawElements::for_set(set);
        let mut chain_index = BTreeMap::new();
        let (mut messages, mut visits) = (0usize, 0u64);
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
                        match element(e) {
                            Some(e) => elements.push(e, &mut chain_index),
                            None => elements.misfits += 1,
                        }
                    }
                }
                // This round walked what earlier rounds sent, then this message's.
                messages += 1;
                visits += (elements.len() + elements.misfits) as u64;
                Ok(())
            },
        )?;
        // The last round walks the whole set to find nothing left to send.
        set.dump_messages = messages;
        set.dump_visits = visits + (elements.len() + elements.misfits) as u64;
        set.elements = elements;
    }
    // The objects the table's elements name.
    for set in t.sets.values().chain(t.anonymous.values()) {
        for e in set.elements.iter() {
            if let Some(RawData::Object(name)) = e.data {
                referenced.insert(name.to_string());
            }
        }
    }
    // A port's fallback counter is named by an element only while it has a fallback
    // set; its name is its new-connection counter's, another prefix.
    let fallbacks: Vec<String> = referenced
        .iter()
        .filter_map(|n| Some(format!("fallback-{}", n.strip_prefix("new-")?)))
        .collect();
    referenced.extend(fallbacks);
    referenced.extend(known.iter().cloned());
    let mut read = RawTable::default();
    let how = objects::read_objects(r, family, table, &referenced, expected, |o| {
        read.add_object(o)
    })?;
    (t.objects, t.counters, t.object_read) = (read.objects, read.counters, how);
    Ok(Some(t))
}

/// Adds the object names a rule's expressions name (`objref`'s `NFTA_OBJREF_IMM_NAME`:
/// `counter name "x"`) to `out`.
fn rule_object_names(exprs: &[u8], out: &mut std::collections::BTreeSet<String>) {
    for (k, e) in Attrs(exprs) {
        if k != NFTA_LIST_ELEM {
            continue;
        }
        let mut objref = false;
        for (ek, ev) in Attrs(e) {
            match ek {
                NFTA_EXPR_NAME => objref = str_ref(ev) == Some("objref"),
                NFTA_EXPR_DATA if objref => {
                    // NFTA_OBJREF_IMM_NAME.
                    if let Some((_, name)) = Attrs(ev).find(|(a, _)| *a == 2) {
                        out.insert(string(name));
                    }
                }
                _ => {}
            }
        }
    }
}

/// A NUL-terminated string attribute, borrowed; `None` when it is not UTF-8.
fn str_ref(b: &[u8]) -> Option<&str> {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    std::str::from_utf8(&b[..end]).ok()
}

/// One object of a GETOBJ answer: its table, name, type, and for a counter its values
/// and since when it counts.
fn object(p: &[u8]) -> (String, String, u32, Option<RawCounter>) {
    let (mut tbl, mut name, mut kind) = (String::new(), String::new(), 0);
    let (mut values, mut since) = (None, None);
    for (k, v) in Attrs(p) {
        match k {
            NFTA_OBJ_TABLE => tbl = string(v),
            NFTA_OBJ_NAME => name = string(v),
            NFTA_OBJ_TYPE => kind = be32(v).unwrap_or(0),
            NFTA_OBJ_DATA => {
                let (mut packets, mut bytes) = (0, 0);
                for (k, v) in Attrs(v) {
                    match k {
                        NFTA_COUNTER_PACKETS => packets = be64(v).unwrap_or(0),
                        NFTA_COUNTER_BYTES => bytes = be64(v).unwrap_or(0),
                        _ => {}
                    }
                }
                values = Some((packets, bytes));
            }
            NFTA_OBJ_USERDATA => {
                since = udata_string(v, UDATA_COMMENT).and_then(|c| crate::nfnl::parse_since(&c));
            }
            _ => {}
        }
    }
    let counter = values.map(|(packets, bytes)| RawCounter {
        packets,
        bytes,
        since,
    });
    (tbl, name, kind, counter)
}

/// One element's attributes; `None` when a verdict's chain is not UTF-8.
fn element(e: &[u8]) -> Option<RawElement<'_>> {
    let mut el = RawElement {
        key: &[],
        data: None,
        interval_end: false,
    };
    for (k, v) in Attrs(e) {
        match k {
            NFTA_SET_ELEM_KEY => {
                if let Some((_, b)) = Attrs(v).find(|(t, _)| *t == NFTA_DATA_VALUE) {
                    el.key = b;
                }
            }
            NFTA_SET_ELEM_DATA => {
                for (dk, dv) in Attrs(v) {
                    match dk {
                        NFTA_DATA_VALUE => el.data = Some(RawData::Value(dv)),
                        NFTA_DATA_VERDICT => {
                            let (mut code, mut chain) = (0, None);
                            for (vk, vv) in Attrs(dv) {
                                match vk {
                                    NFTA_VERDICT_CODE => code = be32(vv).unwrap_or(0),
                                    NFTA_VERDICT_CHAIN => chain = Some(str_ref(vv)?),
                                    _ => {}
                                }
                            }
                            el.data = Some(RawData::Verdict { code, chain });
                        }
                        _ => {}
                    }
                }
            }
            NFTA_SET_ELEM_FLAGS => {
                el.interval_end = be32(v).unwrap_or(0) & NFT_SET_ELEM_INTERVAL_END != 0;
            }
            NFTA_SET_ELEM_OBJREF => el.data = Some(RawData::Object(str_ref(v)?)),
            _ => {}
        }
    }
    Some(el)
}

// ---- Decoding elements back into the typed model (the inverse of netlink.rs's
// encoding).

/// One datum of `f` from `b` (exactly its bytes).
fn decode_atom(f: Field, b: &[u8]) -> Option<Atom> {
    Some(match f {
        Field::Ipv4Addr => Atom::Addr(IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(b).ok()?))),
        Field::Ipv6Addr => Atom::Addr(IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(b).ok()?))),
        Field::InetProto => Atom::Proto(*b.first()?),
        Field::InetService => Atom::Port(u16::from_be_bytes(b.try_into().ok()?)),
        Field::Numgen(_) => Atom::Index(u32::from_ne_bytes(b.try_into().ok()?)),
    })
}

/// Bytes → a tuple of `fields` (a single field unpadded, each field of a concatenation
/// padded to 4 bytes); `None` when the bytes do not fit.
pub fn decode_tuple(fields: &[Field], mut b: &[u8]) -> Option<Tuple> {
    if fields.is_empty() || fields.len() > MAX_FIELDS {
        return None;
    }
    let mut atoms = [Atom::Index(0); MAX_FIELDS];
    for (i, &f) in fields.iter().enumerate() {
        let n = f.datum_len();
        atoms[i] = decode_atom(f, b.get(..n)?)?;
        let step = if fields.len() > 1 {
            n.next_multiple_of(4)
        } else {
            n
        };
        b = b.get(step..)?;
    }
    b.is_empty().then(|| Tuple::new(&atoms[..fields.len()]))
}

/// The elements of an interval set of addresses as prefixes.
pub(crate) fn decode_intervals<'a>(
    v6: bool,
    elements: impl IntoIterator<Item = RawElement<'a>>,
) -> Option<Vec<Tuple>> {
    let bits: u32 = if v6 { 128 } else { 32 };
    let mut out = Vec::new();
    for (start, last) in interval_ranges(v6, elements)? {
        let size = (last - start).wrapping_add(1);
        // `size` is 0 only for ::/0 (2^128 addresses).
        if size != 0 && (!size.is_power_of_two() || !start.is_multiple_of(size)) {
            return None; // not a prefix: kproxy never writes ranges in named sets
        }
        let len = if size == 0 {
            0
        } else {
            bits - size.trailing_zeros()
        };
        let addr = if v6 {
            IpAddr::V6(Ipv6Addr::from(start))
        } else {
            IpAddr::V4(Ipv4Addr::from(start as u32))
        };
        out.push(Tuple::new(&[Atom::Prefix(addr, len as u8)]));
    }
    Some(out)
}

/// The intervals of an interval set of addresses, each as its first and last address.
/// The kernel holds each interval as its start and an end element (flagged) one past
/// its last address.
pub(crate) fn interval_ranges<'a>(
    v6: bool,
    elements: impl IntoIterator<Item = RawElement<'a>>,
) -> Option<Vec<(u128, u128)>> {
    let num = |b: &[u8]| -> Option<u128> {
        Some(if v6 {
            u128::from_be_bytes(b.try_into().ok()?)
        } else {
            u128::from(u32::from_be_bytes(b.try_into().ok()?))
        })
    };
    let mut points: Vec<(u128, bool)> = elements
        .into_iter()
        .map(|e| Some((num(e.key)?, e.interval_end)))
        .collect::<Option<_>>()?;
    points.sort();
    let mut out = Vec::new();
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
                Some(e)
            }
            _ => {
                i += 1;
                None
            }
        };
        let last = match end {
            Some(e) => e.checked_sub(1)?,
            None if v6 => u128::MAX,
            None => u128::from(u32::MAX),
        };
        if last < start {
            return None;
        }
        out.push((start, last));
    }
    Some(out)
}

#[cfg(test)]
mod tests;
