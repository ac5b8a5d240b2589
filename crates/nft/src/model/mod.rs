//! The typed nftables model: what kproxy wants in (or reads back from) the kernel, as
//! values, and the one way to get from one state to another.
//!
//! - [`Table`] holds [`Chain`]s (an optional base-chain [`Hook`] and typed rules,
//!   [`crate::rule::Rule`], each identified by [`rule_id`] of its text) and [`Set`]s (a typed [`SetDecl`]
//!   and typed [`Elem`]ents).
//! - [`diff`]`(old, new)` returns a [`Transaction`], an ordered list of [`Op`]s that,
//!   applied to `old`, gives `new`. It decides what changed between the kernel's tables
//!   as read back and the record (adoption, repair, verification: `crate::readback`,
//!   which diffs the structure and runs diff's element step, [`ElementDiff`], over the
//!   kernel's elements packed as read and the record's offered in pieces), and, in a
//!   delta, for the base objects, a changed Service's own chains and sets and
//!   the dispatch groups that appear or go (`crate::record::FamilyRecord::advance`).
//!   A delta's element changes are diff's element step too, over the touched part of
//!   each set (the frontends and shared elements the changed Services touch, before
//!   and after); a full sync's transaction is built from the record's one walk over its
//!   elements (`FamilyRecord::walk_elements`: `create`, `element_pieces`). Tests hold deltas equal to `diff` of whole tables
//!   (crates/nft/tests/incremental.rs) and the full transactions to `diff` from an
//!   absent table (the tests of `record.rs`).
//! - A transaction is rendered as `nft -f` input by [`Transaction::nft_text`] /
//!   [`Transaction::write_nft_to`] (`sync --dry-run`, golden tests, the sameness
//!   test) and as nfnetlink bytes by
//!   `crate::netlink::Batch::transaction` (what is sent: every operation, elements
//!   encoded from the typed elements).
//!
//! Element keys and values are typed ([`Atom`]: addresses, prefixes, protocols, ports,
//! `numgen` indexes; [`Verdict`]), so the netlink writer never parses text, and two
//! elements compare by value (how an adopted kernel table is compared with the desired
//! one).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;

use crate::error::NftError;
use crate::rule::Rule;

pub(crate) use crate::atom::write_u32;
pub use crate::atom::{Atom, Family, Field, MAX_FIELDS, RULE_ID_PREFIX, Verdict, rule_id};

/// What a map's elements point to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SetData {
    Verdict,
    Fields(Vec<Field>),
}

/// A set's or map's declaration.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SetDecl {
    pub key: Vec<Field>,
    /// `Some` for a map.
    pub data: Option<SetData>,
    /// Declared with `typeof` expressions rather than `type` names (needed for `numgen`
    /// keys; the kernel keeps the expressions in the set's userdata).
    pub by_expr: bool,
    /// `flags interval` (elements may be prefixes).
    pub interval: bool,
    /// `auto-merge` (interval sets).
    pub auto_merge: bool,
    /// `flags dynamic` (filled by rules from traffic; its elements are not kproxy's).
    pub dynamic: bool,
    /// `timeout Ns` (with `flags timeout`).
    pub timeout_secs: Option<u32>,
    pub comment: Option<String>,
}

impl SetDecl {
    /// A plain `type` set of `key` (no flags, no comment).
    pub fn set(key: Vec<Field>) -> SetDecl {
        SetDecl {
            key,
            data: None,
            by_expr: false,
            interval: false,
            auto_merge: false,
            dynamic: false,
            timeout_secs: None,
            comment: None,
        }
    }

    /// A `type` map of `key` to `data`.
    pub fn map(key: Vec<Field>, data: SetData) -> SetDecl {
        SetDecl {
            data: Some(data),
            ..SetDecl::set(key)
        }
    }

    pub fn with_comment(mut self, c: &str) -> SetDecl {
        self.comment = Some(c.to_string());
        self
    }

    pub fn is_map(&self) -> bool {
        self.data.is_some()
    }

    /// `set` or `map`, as nft's commands name the object.
    pub fn kind(&self) -> &'static str {
        if self.is_map() { "map" } else { "set" }
    }

    /// The body of the declaration, as between `{ }` of `add set`.
    pub fn write(&self, out: &mut String) {
        out.push_str(if self.by_expr { "typeof " } else { "type " });
        self.write_fields(&self.key, out);
        match &self.data {
            None => {}
            Some(SetData::Verdict) => out.push_str(" : verdict"),
            Some(SetData::Fields(f)) => {
                out.push_str(" : ");
                self.write_fields(f, out);
            }
        }
        out.push(';');
        let flags: Vec<&str> = [
            (self.interval, "interval"),
            (self.dynamic, "dynamic"),
            (self.timeout_secs.is_some(), "timeout"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, f)| *f)
        .collect();
        if !flags.is_empty() {
            let _ = write!(out, " flags {};", flags.join(","));
        }
        if let Some(t) = self.timeout_secs {
            let _ = write!(out, " timeout {t}s;");
        }
        if self.auto_merge {
            out.push_str(" auto-merge;");
        }
        if let Some(c) = &self.comment {
            let _ = write!(out, " comment \"{c}\";");
        }
    }

    fn write_fields(&self, fields: &[Field], out: &mut String) {
        for (i, f) in fields.iter().enumerate() {
            if i > 0 {
                out.push_str(" . ");
            }
            match f.type_name() {
                Some(n) if !self.by_expr => out.push_str(n),
                _ => f.write_typeof(out),
            }
        }
    }

    /// Parses an element from nft text (`a . b . c`, value as nft writes it). The one
    /// place element text becomes typed; `None` when it does not fit the declaration.
    pub fn parse_elem(&self, key: &str, value: &str) -> Option<Elem> {
        let key = parse_tuple(&self.key, key, self.interval)?;
        let value = match &self.data {
            None => None,
            Some(SetData::Verdict) => Some(Value::Verdict(Verdict::parse(value)?)),
            Some(SetData::Fields(f)) => Some(Value::Data(parse_tuple(f, value, false)?)),
        };
        Some(Elem { key, value })
    }
}

impl SetDecl {
    /// Parses a key's leading fields: all of them, or all but the last when `row` (a
    /// dispatch map's key is a frontend's key and a `numgen` index).
    pub fn parse_key_prefix(&self, s: &str, row: bool) -> Option<Tuple> {
        let n = self.key.len().checked_sub(usize::from(row))?;
        parse_tuple(&self.key[..n], s, self.interval)
    }

    /// The element of key `prefix` (followed by the index `row`, when given) and the
    /// value text `value`.
    pub fn finish_elem(&self, prefix: Tuple, row: Option<u32>, value: &str) -> Option<Elem> {
        let key = match row {
            None => prefix,
            Some(i) => {
                let Some(Field::Numgen(n)) = self.key.last() else {
                    return None;
                };
                if i >= *n || prefix.atoms().len() >= MAX_FIELDS {
                    return None;
                }
                let mut atoms = [FILLER; MAX_FIELDS];
                let len = prefix.atoms().len();
                atoms[..len].copy_from_slice(&prefix.atoms());
                atoms[len] = Atom::Index(i);
                Tuple::new(&atoms[..=len])
            }
        };
        let value = match &self.data {
            None => None,
            Some(SetData::Verdict) => Some(Value::Verdict(Verdict::parse(value)?)),
            Some(SetData::Fields(f)) => Some(Value::Data(parse_tuple(f, value, false)?)),
        };
        Some(Elem { key, value })
    }
}

fn parse_tuple(fields: &[Field], s: &str, interval: bool) -> Option<Tuple> {
    if fields.len() > MAX_FIELDS {
        return None;
    }
    let mut parts = s.split(" . ");
    let mut out = [FILLER; MAX_FIELDS];
    for (f, o) in fields.iter().zip(&mut out) {
        *o = f.parse(parts.next()?, interval)?;
    }
    parts
        .next()
        .is_none()
        .then(|| Tuple::new(&out[..fields.len()]))
}

/// A concatenation of atoms (one atom for a single-field key).
///
/// A full sync at 10k Services × 10 endpoints holds ≈ 106k elements, most with a tuple
/// as key and another as value, so their size is most of its transient memory; a heap
/// allocation each cost a quarter of its time. Tuples
/// without an IPv6 address (the common case) are held inline as one 8-byte `Slot` per
/// atom; the others (a 16-byte address does not fit a slot) as a boxed slice of atoms.
/// The representation is canonical (chosen by the atoms alone), so the derived
/// equality and hash are those of the atoms; the order is that of `(padded atoms,
/// len)` (see [`Ord for Tuple`](#impl-Ord-for-Tuple)).
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Tuple(Repr);

#[derive(Clone, PartialEq, Eq, Hash)]
enum Repr {
    /// The first `len` slots are the tuple's; the rest are [`FILLER`]'s.
    Inline { slots: [Slot; MAX_FIELDS], len: u8 },
    /// A tuple with an IPv6 address.
    Boxed(Box<[Atom]>),
}

/// One atom other than an IPv6 address or prefix, as `[high, low]` halves of a `u64`
/// whose order is that of the atoms: the top byte is the variant (an IPv6 variant
/// keeps its place in [`Atom`]'s order but never occurs here), the rest the datum.
/// Two `u32`s rather than a `u64` so that a [`Tuple`] is 4-byte aligned inside.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Slot([u32; 2]);

const ADDR4: u64 = 0;
const PREFIX4: u64 = 2;
const PROTO: u64 = 4;
const PORT: u64 = 5;
const INDEX: u64 = 6;

impl Slot {
    fn of(a: Atom) -> Option<Slot> {
        let v = match a {
            Atom::Addr(IpAddr::V4(ip)) => ADDR4 << 56 | u64::from(u32::from(ip)),
            Atom::Prefix(IpAddr::V4(ip), len) => {
                PREFIX4 << 56 | u64::from(u32::from(ip)) << 8 | u64::from(len)
            }
            Atom::Addr(IpAddr::V6(_)) | Atom::Prefix(IpAddr::V6(_), _) => return None,
            Atom::Proto(p) => PROTO << 56 | u64::from(p),
            Atom::Port(p) => PORT << 56 | u64::from(p),
            Atom::Index(i) => INDEX << 56 | u64::from(i),
        };
        Some(Slot([(v >> 32) as u32, v as u32]))
    }

    fn atom(self) -> Atom {
        let v = u64::from(self.0[0]) << 32 | u64::from(self.0[1]);
        let datum = v & ((1 << 56) - 1);
        match v >> 56 {
            ADDR4 => Atom::Addr(IpAddr::V4((datum as u32).into())),
            PREFIX4 => Atom::Prefix(IpAddr::V4(((datum >> 8) as u32).into()), datum as u8),
            PROTO => Atom::Proto(datum as u8),
            PORT => Atom::Port(datum as u16),
            INDEX => Atom::Index(datum as u32),
            _ => unreachable!("a slot is only made by Slot::of"),
        }
    }
}

/// What pads a tuple to [`MAX_FIELDS`] atoms.
const FILLER: Atom = Atom::Index(0);
const FILLER_SLOT: Slot = Slot([(INDEX << 24) as u32, 0]);

/// A tuple's atoms, by value (an inline tuple has no [`Atom`]s to lend).
#[derive(Clone, Copy)]
pub struct Atoms {
    atoms: [Atom; MAX_FIELDS],
    len: u8,
}

impl std::ops::Deref for Atoms {
    type Target = [Atom];
    fn deref(&self) -> &[Atom] {
        &self.atoms[..usize::from(self.len)]
    }
}

impl Tuple {
    /// Panics on more than [`MAX_FIELDS`] atoms: a kproxy declaration never has more
    /// (parsing refuses them).
    pub fn new(atoms: &[Atom]) -> Tuple {
        assert!(
            atoms.len() <= MAX_FIELDS,
            "a tuple of {} atoms",
            atoms.len()
        );
        let mut slots = [FILLER_SLOT; MAX_FIELDS];
        for (s, a) in slots.iter_mut().zip(atoms) {
            match Slot::of(*a) {
                Some(x) => *s = x,
                None => return Tuple(Repr::Boxed(atoms.into())),
            }
        }
        Tuple(Repr::Inline {
            slots,
            len: atoms.len() as u8,
        })
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Inline { len, .. } => usize::from(*len),
            Repr::Boxed(a) => a.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn atoms(&self) -> Atoms {
        let mut atoms = [FILLER; MAX_FIELDS];
        match &self.0 {
            Repr::Inline { slots, len } => {
                for (a, s) in atoms.iter_mut().zip(&slots[..usize::from(*len)]) {
                    *a = s.atom();
                }
            }
            Repr::Boxed(b) => atoms[..b.len()].copy_from_slice(b),
        }
        Atoms {
            atoms,
            len: self.len() as u8,
        }
    }

    pub fn write(&self, out: &mut String) {
        for (i, a) in self.atoms().iter().enumerate() {
            if i > 0 {
                out.push_str(" . ");
            }
            a.write(out);
        }
    }
}

/// The order of `(atoms padded with FILLER to MAX_FIELDS, len)`: that of the former
/// inline `[Atom; MAX_FIELDS]` representation, which decides the order elements are
/// listed in (rendered text, netlink batches). Slots order like their atoms, so two
/// inline tuples compare without decoding.
impl Ord for Tuple {
    fn cmp(&self, other: &Tuple) -> std::cmp::Ordering {
        match (&self.0, &other.0) {
            (Repr::Inline { slots: a, len: m }, Repr::Inline { slots: b, len: n }) => {
                (a, m).cmp(&(b, n))
            }
            _ => {
                let (a, b) = (self.atoms(), other.atoms());
                (a.atoms, a.len).cmp(&(b.atoms, b.len))
            }
        }
    }
}

impl PartialOrd for Tuple {
    fn partial_cmp(&self, other: &Tuple) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl std::fmt::Debug for Tuple {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.atoms().iter()).finish()
    }
}

impl std::fmt::Display for Tuple {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut s = String::new();
        self.write(&mut s);
        f.write_str(&s)
    }
}

/// A map element's value.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Value {
    Verdict(Verdict),
    Data(Tuple),
}

impl Value {
    pub fn write(&self, out: &mut String) {
        match self {
            Value::Verdict(v) => v.write(out),
            Value::Data(t) => t.write(out),
        }
    }
}

/// One element: its key, and its value for a map.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Elem {
    pub key: Tuple,
    pub value: Option<Value>,
}

impl Elem {
    pub fn write(&self, out: &mut String) {
        self.key.write(out);
        if let Some(v) = &self.value {
            out.push_str(" : ");
            v.write(out);
        }
    }
}

/// A set or map: its declaration and its elements, by key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Set {
    pub decl: SetDecl,
    pub elements: BTreeMap<Tuple, Option<Value>>,
}

impl Set {
    pub fn new(decl: SetDecl) -> Set {
        Set {
            decl,
            elements: BTreeMap::new(),
        }
    }
}

/// A base chain's netfilter hook.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HookPoint {
    Prerouting,
    Input,
    Forward,
    Output,
    Postrouting,
}

impl HookPoint {
    pub fn nft(self) -> &'static str {
        match self {
            HookPoint::Prerouting => "prerouting",
            HookPoint::Input => "input",
            HookPoint::Forward => "forward",
            HookPoint::Output => "output",
            HookPoint::Postrouting => "postrouting",
        }
    }

    /// The kernel's hook number (`NF_INET_*`), as the netlink attribute carries it.
    pub(crate) fn number(self) -> u32 {
        match self {
            HookPoint::Prerouting => 0,
            HookPoint::Input => 1,
            HookPoint::Forward => 2,
            HookPoint::Output => 3,
            HookPoint::Postrouting => 4,
        }
    }
}

/// A base chain's type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChainType {
    Filter,
    Nat,
}

/// What makes a chain a base chain: type, hook, priority (policy accept).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Hook {
    pub ty: ChainType,
    pub hook: HookPoint,
    /// The numeric priority (dstnat = -100, srcnat = 100).
    pub priority: i32,
}

impl Hook {
    pub fn nat(hook: HookPoint, priority: i32) -> Hook {
        Hook {
            ty: ChainType::Nat,
            hook,
            priority,
        }
    }

    /// The body of the declaration, as between `{ }` of `add chain`.
    pub fn write(&self, out: &mut String) {
        let ty = match self.ty {
            ChainType::Filter => "filter",
            ChainType::Nat => "nat",
        };
        // nft's names for the standard nat priorities, as kube-proxy writes them.
        let prio = match (self.hook, self.priority) {
            (HookPoint::Prerouting, -100) => "dstnat".to_string(),
            (HookPoint::Postrouting, 100) => "srcnat".to_string(),
            (_, p) => p.to_string(),
        };
        let _ = write!(
            out,
            "type {ty} hook {} priority {prio}; policy accept;",
            self.hook.nft()
        );
    }
}

/// A chain: `None` hook for a regular chain; rules in order, typed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Chain {
    pub hook: Option<Hook>,
    pub rules: Vec<Rule>,
}

/// One family's table: what kproxy programs into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub family: Family,
    pub name: String,
    /// `None` when the table does not exist (the `old` of a first sync).
    pub comment: Option<String>,
    pub exists: bool,
    pub sets: BTreeMap<String, Set>,
    pub chains: BTreeMap<String, Chain>,
}

impl Table {
    /// The comment kproxy's tables carry.
    pub const COMMENT: &'static str = "rules for kproxy";

    /// An empty kproxy table (exists, no chains or sets).
    pub fn new(family: Family, name: &str) -> Table {
        Table {
            family,
            name: name.to_string(),
            comment: Some(Table::COMMENT.to_string()),
            exists: true,
            sets: BTreeMap::new(),
            chains: BTreeMap::new(),
        }
    }

    /// A table that does not exist (diffing against it creates everything).
    pub fn absent(family: Family, name: &str) -> Table {
        Table {
            exists: false,
            comment: None,
            ..Table::new(family, name)
        }
    }

    /// What creating this table counts as.
    pub fn counts(&self) -> Counts {
        Counts {
            chains_added: self.chains.len(),
            sets_added: self.sets.len(),
            elements_added: self.element_count(),
            ..Counts::default()
        }
    }

    /// Number of elements of all sets.
    pub fn element_count(&self) -> usize {
        self.sets.values().map(|s| s.elements.len()).sum()
    }
}

/// One operation of a transaction. Every operation names its table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    AddTable {
        family: Family,
        table: String,
        comment: Option<String>,
        /// Created dormant: its base chains are not hooked until the table is woken
        /// (a first sync into absent tables, [`Transaction::dormant_for_absent_tables`]).
        dormant: bool,
    },
    DeleteTable {
        family: Family,
        table: String,
    },
    AddSet {
        family: Family,
        table: String,
        name: String,
        decl: SetDecl,
    },
    DeleteSet {
        family: Family,
        table: String,
        name: String,
        map: bool,
    },
    AddChain {
        family: Family,
        table: String,
        name: String,
        hook: Option<Hook>,
    },
    FlushChain {
        family: Family,
        table: String,
        name: String,
    },
    DeleteChain {
        family: Family,
        table: String,
        name: String,
    },
    AddRule {
        family: Family,
        table: String,
        chain: String,
        rule: Rule,
    },
    AddElements {
        family: Family,
        table: String,
        set: String,
        elems: Vec<Elem>,
    },
    DeleteElements {
        family: Family,
        table: String,
        set: String,
        keys: Vec<Tuple>,
    },
    /// Deletes a named stateful object (`NFT_OBJECT_*` type `kind`): kproxy declares
    /// none, so one in its table is another program's.
    DeleteObject {
        family: Family,
        table: String,
        kind: u32,
        name: String,
    },
}

/// The nft keyword of a named object's type (`NFT_OBJECT_*`, linux/netfilter/nf_tables.h),
/// as `nft delete KIND …` and the reports name it.
pub fn object_kind(kind: u32) -> &'static str {
    match kind {
        1 => "counter",
        2 => "quota",
        3 => "ct helper",
        4 => "limit",
        5 => "connlimit",
        6 => "tunnel",
        7 => "ct timeout",
        8 => "secmark",
        9 => "ct expectation",
        10 => "synproxy",
        _ => "object",
    }
}

impl Op {
    /// Where the operation goes in a transaction that merges several diffs: every
    /// object is declared before anything refers to it, and deleted after nothing does.
    pub fn phase(&self) -> u8 {
        match self {
            Op::AddTable { .. } | Op::DeleteTable { .. } => 0,
            Op::AddSet { .. } | Op::AddChain { .. } => 1,
            Op::FlushChain { .. } => 2,
            Op::AddRule { .. } => 3,
            Op::DeleteElements { .. } => 4,
            Op::AddElements { .. } => 5,
            Op::DeleteChain { .. } => 6,
            Op::DeleteSet { .. } => 7,
            // After the rules that may refer to it (a foreign `counter name …`) are gone.
            Op::DeleteObject { .. } => 8,
        }
    }

    /// What the operation does to which kind of object, and the object's name (a set's
    /// for element operations, a chain's for a rule; none for a table).
    pub fn object(&self) -> (&'static str, &'static str, Option<&str>) {
        match self {
            Op::AddTable { .. } => ("add", "table", None),
            Op::DeleteTable { .. } => ("delete", "table", None),
            Op::AddSet { name, decl, .. } => ("add", decl.kind(), Some(name)),
            Op::DeleteSet { name, map, .. } => {
                ("delete", if *map { "map" } else { "set" }, Some(name))
            }
            Op::AddChain { name, .. } => ("add", "chain", Some(name)),
            Op::FlushChain { name, .. } => ("flush", "chain", Some(name)),
            Op::DeleteChain { name, .. } => ("delete", "chain", Some(name)),
            Op::AddRule { chain, .. } => ("add", "rule", Some(chain)),
            Op::AddElements { set, .. } => ("add", "element", Some(set)),
            Op::DeleteElements { set, .. } => ("delete", "element", Some(set)),
            Op::DeleteObject { kind, name, .. } => ("delete", object_kind(*kind), Some(name)),
        }
    }

    /// The table the operation acts in.
    pub fn table(&self) -> (Family, &str) {
        match self {
            Op::AddTable { family, table, .. }
            | Op::DeleteTable { family, table }
            | Op::AddSet { family, table, .. }
            | Op::DeleteSet { family, table, .. }
            | Op::AddChain { family, table, .. }
            | Op::FlushChain { family, table, .. }
            | Op::DeleteChain { family, table, .. }
            | Op::AddRule { family, table, .. }
            | Op::AddElements { family, table, .. }
            | Op::DeleteElements { family, table, .. }
            | Op::DeleteObject { family, table, .. } => (*family, table),
        }
    }

    /// The operation in a few words (`add chain ip kproxy services`), for messages.
    pub fn describe(&self) -> String {
        let (verb, kind, name) = self.object();
        let (family, table) = self.table();
        let mut s = format!("{verb} {kind} {} {table}", family.nft());
        if let Some(name) = name {
            s.push(' ');
            s.push_str(name);
        }
        s
    }

    /// Whether it changes elements only (what netlink sends without nft).
    pub fn is_element_op(&self) -> bool {
        matches!(self, Op::AddElements { .. } | Op::DeleteElements { .. })
    }

    /// Whether it adds or deletes an element holding a prefix (an interval set's).
    pub fn has_prefix(&self) -> bool {
        let prefix = |t: &Tuple| t.atoms().iter().any(|a| matches!(a, Atom::Prefix(..)));
        match self {
            Op::AddElements { elems, .. } => elems.iter().any(|e| prefix(&e.key)),
            Op::DeleteElements { keys, .. } => keys.iter().any(prefix),
            _ => false,
        }
    }
}

/// Counts of what a transaction changes, for the sync report and metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub chains_added: usize,
    pub chains_changed: usize,
    pub chains_deleted: usize,
    pub elements_added: usize,
    pub elements_deleted: usize,
    pub sets_added: usize,
    pub sets_deleted: usize,
    /// Named objects (another program's) deleted.
    pub objects_deleted: usize,
}

impl Counts {
    pub fn is_empty(&self) -> bool {
        *self == Counts::default()
    }

    pub fn add(&mut self, o: &Counts) {
        self.chains_added += o.chains_added;
        self.chains_changed += o.chains_changed;
        self.chains_deleted += o.chains_deleted;
        self.elements_added += o.elements_added;
        self.elements_deleted += o.elements_deleted;
        self.sets_added += o.sets_added;
        self.sets_deleted += o.sets_deleted;
        self.objects_deleted += o.objects_deleted;
    }
}

/// An ordered list of operations, applied as one transaction (all or nothing).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transaction {
    pub ops: Vec<Op>,
    /// What the operations change (chains whose rules are replaced count as changed).
    pub counts: Counts,
    /// It replaces a whole table (a declaration changed), rather than changing it.
    pub replaces: bool,
}

/// Elements per `add element`/`delete element` command of the nft text, so no line
/// grows without bound.
pub(crate) const TEXT_ELEMENTS_PER_COMMAND: usize = 1000;

impl Transaction {
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Whether every operation changes elements only.
    pub fn elements_only(&self) -> bool {
        self.ops.iter().all(Op::is_element_op)
    }

    /// Appends `other`'s operations and counts.
    pub fn extend(&mut self, other: Transaction) {
        self.ops.extend(other.ops);
        self.counts.add(&other.counts);
        self.replaces |= other.replaces;
    }

    /// Orders the operations by [`Op::phase`] (stable), so a transaction assembled from
    /// several diffs declares before it refers and deletes after nothing refers.
    pub fn order(&mut self) {
        self.ops.sort_by_key(Op::phase);
    }

    /// The transaction that makes the kernel's `new.family new.name` equal to `new`
    /// whatever it holds now: create-then-delete the table (so `delete` succeeds whether
    /// or not it exists), then [`Transaction::create`]. One transaction: no gap.
    pub fn replace(new: Table) -> Transaction {
        let mut t = Transaction::clearing(new.family, &new.name);
        t.extend(Transaction::create(new));
        t
    }

    /// The header of [`Transaction::replace`]: the table `family name` created, then
    /// deleted, whether or not it existed.
    pub fn clearing(family: Family, table: &str) -> Transaction {
        let mut t = Transaction::default();
        t.ops.push(Op::AddTable {
            family,
            table: table.to_string(),
            comment: None,
            dormant: false,
        });
        t.ops.push(Op::DeleteTable {
            family,
            table: table.to_string(),
        });
        t
    }

    /// `diff(&Table::absent(..), &new)`, moving `new`'s rules and elements into the
    /// operations instead of copying them: a full sync's table holds ≈ 106k elements,
    /// and holding them twice doubled its peak memory. (A test holds it equal to the
    /// diff.)
    pub fn create(new: Table) -> Transaction {
        Transaction::create_with(new, BTreeMap::new())
    }

    /// [`Transaction::create`] of `new` with `more` elements in its sets: per set name,
    /// sorted by key, one per key (a key `new`'s set holds keeps `new`'s value; a set
    /// `new` does not declare takes none). They are moved into the operations, so a
    /// caller holding a table's elements as sorted vectors never builds its maps (the
    /// record's full sync, `crate::record::FamilyRecord::create`).
    pub fn create_with(new: Table, mut more: BTreeMap<String, Vec<Elem>>) -> Transaction {
        let (family, table) = (new.family, new.name);
        let mut t = Transaction::default();
        if !new.exists {
            return t;
        }
        t.ops.push(Op::AddTable {
            family,
            table: table.clone(),
            comment: new.comment,
            dormant: false,
        });
        let mut elements = Vec::new();
        for (name, s) in new.sets {
            t.counts.sets_added += 1;
            t.ops.push(Op::AddSet {
                family,
                table: table.clone(),
                name: name.clone(),
                decl: s.decl.clone(),
            });
            let extra = more.remove(&name).unwrap_or_default();
            if s.decl.dynamic {
                continue;
            }
            let elems = merge_sorted(s.elements, extra);
            if !elems.is_empty() {
                t.counts.elements_added += elems.len();
                elements.push(Op::AddElements {
                    family,
                    table: table.clone(),
                    set: name,
                    elems,
                });
            }
        }
        let mut rules = Vec::new();
        for (name, c) in new.chains {
            t.counts.chains_added += 1;
            t.ops.push(Op::AddChain {
                family,
                table: table.clone(),
                name: name.clone(),
                hook: c.hook,
            });
            for rule in c.rules {
                rules.push(Op::AddRule {
                    family,
                    table: table.clone(),
                    chain: name.clone(),
                    rule,
                });
            }
        }
        t.ops.extend(rules);
        t.ops.extend(elements);
        t
    }

    /// Splits a transaction that creates tables into (everything but the elements
    /// without prefixes, its tables created dormant), (those elements: what netlink
    /// encodes). A dormant table's base chains are not hooked, so no packet meets the
    /// tables while the parts load, each as its own transaction; waking the tables
    /// (one transaction, [`crate::netlink::Batch::wake_tables`]) hooks them all at
    /// once. For a first sync into absent tables.
    pub fn dormant_for_absent_tables(self) -> (Transaction, Transaction) {
        let (mut a, mut b) = (Transaction::default(), Transaction::default());
        for mut op in self.ops {
            if let Op::AddTable { dormant, .. } = &mut op {
                *dormant = true;
            }
            if op.is_element_op() && !op.has_prefix() {
                b.ops.push(op);
            } else {
                a.ops.push(op);
            }
        }
        a.counts = self.counts;
        (a, b)
    }

    /// The `nft -f` input of this transaction.
    pub fn nft_text(&self) -> String {
        let mut out = String::new();
        self.write_nft_text(&mut out);
        out
    }

    /// Appends the `nft -f` input of this transaction to `out`.
    pub fn write_nft_text(&self, out: &mut String) {
        let mut text = Text {
            buf: std::mem::take(out),
            sink: None,
            sent: 0,
        };
        let written = self.write_text(&mut text);
        debug_assert!(written.is_ok(), "a String sink cannot fail");
        *out = text.buf;
    }

    /// Writes the `nft -f` input of this transaction to `w` as it is rendered, in
    /// pieces of about 64 KiB (a full sync's script is ≈ 6 MB: it is never
    /// held whole). Returns the bytes written.
    pub fn write_nft_to(&self, w: &mut dyn std::io::Write) -> std::io::Result<usize> {
        let mut text = TextStream::new(w);
        text.transaction(self)?;
        text.finish()
    }

    /// The one renderer of nft text, command by command into `out`.
    fn write_text(&self, text: &mut Text<'_>) -> std::io::Result<()> {
        for op in &self.ops {
            let out = &mut text.buf;
            match op {
                Op::AddTable {
                    family,
                    table,
                    comment,
                    dormant,
                } => {
                    let _ = write!(out, "add table {} {table}", family.nft());
                    if comment.is_some() || *dormant {
                        out.push_str(" { ");
                        if let Some(c) = comment {
                            let _ = write!(out, "comment \"{c}\"; ");
                        }
                        if *dormant {
                            out.push_str("flags dormant; ");
                        }
                        out.push('}');
                    }
                    out.push('\n');
                }
                Op::DeleteTable { family, table } => {
                    let _ = writeln!(out, "delete table {} {table}", family.nft());
                }
                Op::AddSet {
                    family,
                    table,
                    name,
                    decl,
                } => {
                    let _ = write!(
                        out,
                        "add {} {} {table} {name} {{ ",
                        decl.kind(),
                        family.nft()
                    );
                    decl.write(out);
                    out.push_str(" }\n");
                }
                Op::DeleteSet {
                    family,
                    table,
                    name,
                    map,
                } => {
                    let kind = if *map { "map" } else { "set" };
                    let _ = writeln!(out, "delete {kind} {} {table} {name}", family.nft());
                }
                Op::AddChain {
                    family,
                    table,
                    name,
                    hook,
                } => {
                    let _ = write!(out, "add chain {} {table} {name}", family.nft());
                    if let Some(h) = hook {
                        out.push_str(" { ");
                        h.write(out);
                        out.push_str(" }");
                    }
                    out.push('\n');
                }
                Op::FlushChain {
                    family,
                    table,
                    name,
                } => {
                    let _ = writeln!(out, "flush chain {} {table} {name}", family.nft());
                }
                Op::DeleteChain {
                    family,
                    table,
                    name,
                } => {
                    let _ = writeln!(out, "delete chain {} {table} {name}", family.nft());
                }
                Op::AddRule {
                    family,
                    table,
                    chain,
                    rule,
                } => {
                    let _ = write!(out, "add rule {} {table} {chain} ", family.nft());
                    let body = out.len();
                    rule.write(out);
                    let id = rule_id(&out[body..]);
                    let _ = writeln!(out, " comment \"{RULE_ID_PREFIX}{id}\"");
                }
                Op::AddElements {
                    family,
                    table,
                    set,
                    elems,
                } => {
                    for chunk in elems.chunks(TEXT_ELEMENTS_PER_COMMAND) {
                        let out = &mut text.buf;
                        let _ = write!(out, "add element {} {table} {set} {{ ", family.nft());
                        for (i, e) in chunk.iter().enumerate() {
                            if i > 0 {
                                out.push_str(", ");
                            }
                            e.write(out);
                        }
                        out.push_str(" }\n");
                        text.line_done()?;
                    }
                    continue;
                }
                Op::DeleteElements {
                    family,
                    table,
                    set,
                    keys,
                } => {
                    for chunk in keys.chunks(TEXT_ELEMENTS_PER_COMMAND) {
                        let out = &mut text.buf;
                        let _ = write!(out, "delete element {} {table} {set} {{ ", family.nft());
                        for (i, k) in chunk.iter().enumerate() {
                            if i > 0 {
                                out.push_str(", ");
                            }
                            k.write(out);
                        }
                        out.push_str(" }\n");
                        text.line_done()?;
                    }
                    continue;
                }
                Op::DeleteObject {
                    family,
                    table,
                    kind,
                    name,
                } => {
                    let kind = object_kind(*kind);
                    let _ = writeln!(out, "delete {kind} {} {table} {name}", family.nft());
                }
            }
            text.line_done()?;
        }
        Ok(())
    }
}

/// About how many bytes of nft text [`Transaction::write_nft_to`] writes at a time.
const TEXT_PIECE: usize = 64 * 1024;

/// nft text being rendered: into `buf` alone, or through `buf` into a sink.
struct Text<'a> {
    buf: String,
    sink: Option<&'a mut dyn std::io::Write>,
    sent: usize,
}

impl Text<'_> {
    /// After each command: hands a full piece to the sink.
    fn line_done(&mut self) -> std::io::Result<()> {
        if self.sink.is_some() && self.buf.len() >= TEXT_PIECE {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if let Some(w) = &mut self.sink {
            w.write_all(self.buf.as_bytes())?;
            self.sent += self.buf.len();
            self.buf.clear();
        }
        Ok(())
    }
}

/// nft text written into a sink as it is rendered, in pieces of about 64 KiB
/// ([`Transaction::write_nft_to`]).
pub struct TextStream<'a>(Text<'a>);

impl<'a> TextStream<'a> {
    pub fn new(w: &'a mut dyn std::io::Write) -> TextStream<'a> {
        TextStream(Text {
            buf: String::with_capacity(TEXT_PIECE + 4096),
            sink: Some(w),
            sent: 0,
        })
    }

    /// Appends the transaction's commands.
    pub fn transaction(&mut self, tx: &Transaction) -> std::io::Result<()> {
        tx.write_text(&mut self.0)
    }

    /// Writes what is left; the bytes written in all.
    pub fn finish(mut self) -> std::io::Result<usize> {
        self.0.flush()?;
        Ok(self.0.sent)
    }
}

/// The elements of a set's map followed by `more` (sorted by key, one per key), in key
/// order; the map's value wins on a key both hold.
fn merge_sorted(map: BTreeMap<Tuple, Option<Value>>, more: Vec<Elem>) -> Vec<Elem> {
    if map.is_empty() {
        return more;
    }
    let mut out = Vec::with_capacity(map.len() + more.len());
    let mut more = more.into_iter().peekable();
    for (key, value) in map {
        while let Some(e) = more.next_if(|e| e.key < key) {
            out.push(e);
        }
        more.next_if(|e| e.key == key);
        out.push(Elem { key, value });
    }
    out.extend(more);
    out
}

/// The transaction that turns `old` into `new` (the same table; a different family or
/// name is an error). The one function that decides what changed:
///
/// 1. the table, if `old` does not exist;
/// 2. new sets and chains (a set or chain whose declaration changed cannot change in
///    place: then the whole table is replaced, [`Transaction::replace`], and the
///    transaction says so in `replaces`);
/// 3. chains whose rules changed are flushed, and chains that go are flushed (dropping
///    their references first);
/// 4. rules of new and changed chains;
/// 5. elements: removed or re-valued keys out, new or re-valued keys in;
/// 6. removed chains, then removed sets (now unreferenced).
///
/// Dynamic sets' elements are the kernel's, never diffed.
pub fn diff(old: &Table, new: &Table) -> Result<Transaction, NftError> {
    if old.family != new.family || old.name != new.name {
        return Err(NftError::Invalid(format!(
            "diff between tables {} {} and {} {}",
            old.family.nft(),
            old.name,
            new.family.nft(),
            new.name
        )));
    }
    Ok(diff_tables(old, new))
}

/// [`diff`] of two states of the same table.
fn diff_tables(old: &Table, new: &Table) -> Transaction {
    let (family, table) = (new.family, &new.name);
    let mut t = Transaction::default();
    let n = &mut t.counts;
    let mut ops = Vec::new();
    if !old.exists && new.exists {
        ops.push(Op::AddTable {
            family,
            table: table.clone(),
            comment: new.comment.clone(),
            dormant: false,
        });
    }
    if !new.exists {
        if old.exists {
            ops.push(Op::DeleteTable {
                family,
                table: table.clone(),
            });
        }
        t.ops = ops;
        return t;
    }
    // A changed declaration cannot be applied in place (a set's type, a chain's hook):
    // the table is replaced, in one transaction as always.
    let redeclared = new
        .sets
        .iter()
        .any(|(name, s)| old.sets.get(name).is_some_and(|o| o.decl != s.decl))
        || new
            .chains
            .iter()
            .any(|(name, c)| old.chains.get(name).is_some_and(|o| o.hook != c.hook));
    if old.exists && redeclared {
        let mut t = Transaction::replace(new.clone());
        t.replaces = true;
        return t;
    }
    let mut deletes = Vec::new();
    // 1. New sets and chains.
    for (name, s) in &new.sets {
        if !old.sets.contains_key(name) {
            n.sets_added += 1;
            ops.push(Op::AddSet {
                family,
                table: table.clone(),
                name: name.clone(),
                decl: s.decl.clone(),
            });
        }
    }
    for (name, c) in &new.chains {
        if !old.chains.contains_key(name) {
            n.chains_added += 1;
            ops.push(Op::AddChain {
                family,
                table: table.clone(),
                name: name.clone(),
                hook: c.hook,
            });
        }
    }
    // 2. Flush changed and removed chains.
    for (name, c) in &old.chains {
        match new.chains.get(name) {
            Some(nc) if nc.rules == c.rules => {}
            Some(_) => {
                n.chains_changed += 1;
                ops.push(Op::FlushChain {
                    family,
                    table: table.clone(),
                    name: name.clone(),
                });
            }
            None => {
                ops.push(Op::FlushChain {
                    family,
                    table: table.clone(),
                    name: name.clone(),
                });
                n.chains_deleted += 1;
                deletes.push(Op::DeleteChain {
                    family,
                    table: table.clone(),
                    name: name.clone(),
                });
            }
        }
    }
    // 3. Rules of new and changed chains.
    for (name, c) in &new.chains {
        if old.chains.get(name).is_some_and(|o| o.rules == c.rules) {
            continue;
        }
        for r in &c.rules {
            ops.push(Op::AddRule {
                family,
                table: table.clone(),
                chain: name.clone(),
                rule: r.clone(),
            });
        }
    }
    // 4. Elements.
    let empty = BTreeMap::new();
    let mut adds = Vec::new();
    for (name, s) in &new.sets {
        if s.decl.dynamic {
            continue;
        }
        let olde = old.sets.get(name).map(|o| &o.elements).unwrap_or(&empty);
        let mut d = ElementDiff::new(TypedElements::new(olde));
        for (key, value) in &s.elements {
            d.offer_ref(key, value.as_ref());
        }
        let Ok((del, add)) = d.finish() else {
            unreachable!("typed elements need no decoding")
        };
        n.elements_deleted += del.len();
        n.elements_added += add.len();
        if !del.is_empty() {
            ops.push(Op::DeleteElements {
                family,
                table: table.clone(),
                set: name.clone(),
                keys: del,
            });
        }
        if !add.is_empty() {
            adds.push(Op::AddElements {
                family,
                table: table.clone(),
                set: name.clone(),
                elems: add,
            });
        }
    }
    ops.extend(adds);
    // 5. Removed chains, then removed sets.
    ops.extend(deletes);
    for (name, s) in &old.sets {
        if !new.sets.contains_key(name) {
            n.sets_deleted += 1;
            ops.push(Op::DeleteSet {
                family,
                table: table.clone(),
                name: name.clone(),
                map: s.decl.is_map(),
            });
        }
    }
    t.ops = ops;
    t
}

// ---- The element step of a diff: one comparison over two kinds of old state.

/// How the old state of a set answers for one key of the new state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// The old state does not hold the key.
    No,
    /// It holds the key with the same value.
    Same,
    /// It holds the key with another value.
    Differs,
    /// The key was offered before (its first offer counts).
    Again,
}

/// A set's old elements as [`ElementDiff`] consults them: typed ([`TypedElements`],
/// the model's tables) or packed as the kernel returned them (`crate::readback`).
pub(crate) trait OldElements {
    /// Whether the old state holds `key` with `value`; marks the key as offered.
    fn take(&mut self, key: &Tuple, value: Option<&Value>) -> Held;
    /// The old keys never offered, typed, in any order; an error names an old element
    /// that has no typed form.
    fn rest(self, out: &mut Vec<Tuple>) -> Result<(), String>;
    /// Checks, for a key held with another value, that the old value has a typed form.
    fn check_differing(&self, _key: &Tuple) -> Result<(), String> {
        Ok(())
    }
}

/// The element step of [`diff`] for one set, and of adoption's comparison of the
/// kernel's set with the record's (`crate::readback`): the new state's elements are
/// offered one at a time, in any order; a key the old state does not hold with the same
/// value goes in (and, if held with another value, out first); old keys never offered
/// go out. Both lists come sorted by key, one entry per key.
pub(crate) struct ElementDiff<O> {
    old: O,
    adds: Vec<Elem>,
    dels: Vec<Tuple>,
    /// An old element held with another value that has no typed form.
    broken: Option<String>,
}

impl<O: OldElements> ElementDiff<O> {
    pub(crate) fn new(old: O) -> ElementDiff<O> {
        ElementDiff {
            old,
            adds: Vec::new(),
            dels: Vec::new(),
            broken: None,
        }
    }

    /// One element of the new state.
    pub(crate) fn offer(&mut self, e: Elem) {
        let held = self.old.take(&e.key, e.value.as_ref());
        self.settle(held, e);
    }

    /// [`ElementDiff::offer`] of a borrowed element: cloned only when it goes in.
    pub(crate) fn offer_ref(&mut self, key: &Tuple, value: Option<&Value>) {
        let held = self.old.take(key, value);
        if matches!(held, Held::No | Held::Differs) {
            let e = Elem {
                key: key.clone(),
                value: value.cloned(),
            };
            self.settle(held, e);
        }
    }

    fn settle(&mut self, held: Held, e: Elem) {
        match held {
            Held::Same | Held::Again => {}
            Held::No => self.adds.push(e),
            Held::Differs => {
                if let Err(what) = self.old.check_differing(&e.key) {
                    self.broken.get_or_insert(what);
                }
                self.dels.push(e.key.clone());
                self.adds.push(e);
            }
        }
    }

    /// The keys that go out and the elements that go in, each sorted by key.
    pub(crate) fn finish(self) -> Result<(Vec<Tuple>, Vec<Elem>), String> {
        if let Some(what) = self.broken {
            return Err(what);
        }
        let (mut dels, mut adds) = (self.dels, self.adds);
        self.old.rest(&mut dels)?;
        // Stable: of a key offered twice, the first offer stays.
        adds.sort_by(|a, b| a.key.cmp(&b.key));
        adds.dedup_by(|later, first| later.key == first.key);
        dels.sort_unstable();
        dels.dedup();
        Ok((dels, adds))
    }
}

/// A set's old elements as a typed map (borrowed from a table, or owned).
pub(crate) struct TypedElements<'a> {
    map: std::borrow::Cow<'a, BTreeMap<Tuple, Option<Value>>>,
    offered: std::collections::BTreeSet<Tuple>,
}

impl<'a> TypedElements<'a> {
    pub(crate) fn new(map: &'a BTreeMap<Tuple, Option<Value>>) -> TypedElements<'a> {
        TypedElements {
            map: std::borrow::Cow::Borrowed(map),
            offered: std::collections::BTreeSet::new(),
        }
    }

    pub(crate) fn owned(map: BTreeMap<Tuple, Option<Value>>) -> TypedElements<'static> {
        TypedElements {
            map: std::borrow::Cow::Owned(map),
            offered: std::collections::BTreeSet::new(),
        }
    }
}

impl OldElements for TypedElements<'_> {
    fn take(&mut self, key: &Tuple, value: Option<&Value>) -> Held {
        let Some(held) = self.map.get(key) else {
            return Held::No;
        };
        if !self.offered.insert(key.clone()) {
            return Held::Again;
        }
        if held.as_ref() == value {
            Held::Same
        } else {
            Held::Differs
        }
    }

    fn rest(self, out: &mut Vec<Tuple>) -> Result<(), String> {
        let offered = self.offered;
        out.extend(self.map.keys().filter(|k| !offered.contains(*k)).cloned());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rule::{Dir, Expr, Sel};

    /// What applying `tx` to `t` gives (a model of the kernel's transaction, for
    /// checking that `diff` says everything and only what changed).
    fn apply(t: &Table, tx: &Transaction) -> Table {
        let mut t = t.clone();
        for op in &tx.ops {
            match op {
                Op::AddTable { comment, .. } => {
                    if !t.exists {
                        t.exists = true;
                        t.comment = comment.clone();
                    }
                }
                Op::DeleteTable { .. } => {
                    t = Table::absent(t.family, &t.name);
                }
                Op::AddSet { name, decl, .. } => {
                    t.sets.entry(name.clone()).or_insert(Set::new(decl.clone()));
                }
                Op::DeleteSet { name, .. } => {
                    t.sets.remove(name).expect("deleted set exists");
                }
                Op::AddChain { name, hook, .. } => {
                    t.chains.entry(name.clone()).or_insert(Chain {
                        hook: *hook,
                        rules: Vec::new(),
                    });
                }
                Op::FlushChain { name, .. } => t.chains.get_mut(name).unwrap().rules.clear(),
                Op::DeleteChain { name, .. } => {
                    let c = t.chains.remove(name).expect("deleted chain exists");
                    assert!(c.rules.is_empty(), "chain {name} deleted while not empty");
                }
                Op::AddRule { chain, rule, .. } => {
                    t.chains.get_mut(chain).unwrap().rules.push(rule.clone())
                }
                Op::AddElements { set, elems, .. } => {
                    let s = t.sets.get_mut(set).unwrap();
                    for e in elems {
                        assert!(s.elements.insert(e.key.clone(), e.value.clone()).is_none());
                    }
                }
                Op::DeleteElements { set, keys, .. } => {
                    let s = t.sets.get_mut(set).unwrap();
                    for k in keys {
                        assert!(s.elements.remove(k).is_some(), "deleted element exists");
                    }
                }
                // The model holds no named objects.
                Op::DeleteObject { .. } => {}
            }
        }
        t
    }

    /// A full sync holds ≈ 106k elements (key in a `Set`'s map, and again in an `Elem`
    /// of the transaction): their size is most of its transient memory. An upper bound,
    /// so that a change that grows them fails here.
    #[test]
    fn element_sizes() {
        use std::mem::size_of;
        let sizes = [
            ("Atom", size_of::<Atom>()),
            ("Tuple", size_of::<Tuple>()),
            ("Value", size_of::<Value>()),
            ("Option<Value>", size_of::<Option<Value>>()),
            ("Elem", size_of::<Elem>()),
        ];
        println!("{sizes:?}");
        assert!(size_of::<Elem>() <= 80, "{sizes:?}");
    }

    /// A tuple gives back its atoms, and tuples (inline, boxed, or one of each) order
    /// and compare as `(atoms padded with FILLER, len)` do: the order elements are
    /// listed in must not depend on the representation.
    #[test]
    fn tuple_atoms_and_order() {
        let atoms: Vec<Atom> = [
            "0.0.0.0",
            "10.96.0.1",
            "10.96.0.2",
            "255.255.255.255",
            "::",
            "fd00::1",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ]
        .iter()
        .flat_map(|s| {
            let ip: IpAddr = s.parse().unwrap();
            [Atom::Addr(ip), Atom::Prefix(ip, 0), Atom::Prefix(ip, 24)]
        })
        .chain([0, 6, 17, 255].map(Atom::Proto))
        .chain([0, 80, 65535].map(Atom::Port))
        .chain([0, 1, u32::MAX].map(Atom::Index))
        .collect();
        let mut lists: Vec<Vec<Atom>> = vec![vec![]];
        for a in &atoms {
            lists.push(vec![*a]);
            for b in &atoms {
                lists.push(vec![*a, *b]);
            }
            lists.push(vec![*a, Atom::Proto(6), Atom::Port(80), Atom::Index(3)]);
            lists.push(vec![Atom::Port(80), *a, FILLER]);
        }
        let old = |l: &[Atom]| {
            let mut p = [FILLER; MAX_FIELDS];
            p[..l.len()].copy_from_slice(l);
            (p, l.len())
        };
        let tuples: Vec<Tuple> = lists.iter().map(|l| Tuple::new(l)).collect();
        for (l, t) in lists.iter().zip(&tuples) {
            assert_eq!(&*t.atoms(), &l[..]);
            assert_eq!(t.len(), l.len());
        }
        for (l, t) in lists.iter().zip(&tuples) {
            for (m, u) in lists.iter().zip(&tuples) {
                assert_eq!(t.cmp(u), old(l).cmp(&old(m)), "{l:?} vs {m:?}");
                assert_eq!(t == u, l == m, "{l:?} vs {m:?}");
            }
        }
    }

    fn ip(s: &str) -> Atom {
        Atom::Addr(s.parse().unwrap())
    }

    fn vmap() -> SetDecl {
        SetDecl::map(
            vec![Field::Ipv4Addr, Field::InetProto, Field::InetService],
            SetData::Verdict,
        )
        .with_comment("cluster IPs")
    }

    fn sample() -> Table {
        let mut t = Table::new(Family::Ip, "kproxy");
        t.chains.insert(
            "nat-prerouting".into(),
            Chain {
                hook: Some(Hook::nat(HookPoint::Prerouting, -100)),
                rules: vec![Rule::verdict(Verdict::Jump("services".into()))],
            },
        );
        t.chains.insert(
            "services".into(),
            Chain {
                hook: None,
                rules: vec![Rule::new(vec![Expr::Vmap {
                    sel: vec![Sel::Addr(Family::Ip, Dir::Dst), Sel::L4proto, Sel::Dport],
                    map: "service-ips".into(),
                }])],
            },
        );
        t.chains.insert(
            "svc-a".into(),
            Chain {
                hook: None,
                rules: vec![Rule::verdict(Verdict::Drop)],
            },
        );
        let mut s = Set::new(vmap());
        let key = |a: &str| Tuple::new(&[ip(a), Atom::Proto(6), Atom::Port(80)]);
        s.elements.insert(
            key("10.96.0.1"),
            Some(Value::Verdict(Verdict::Goto("svc-a".into()))),
        );
        s.elements
            .insert(key("10.96.0.2"), Some(Value::Verdict(Verdict::Drop)));
        t.sets.insert("service-ips".into(), s);
        let mut h = Set::new(SetDecl::set(vec![Field::Ipv4Addr]));
        h.elements.insert(Tuple::new(&[ip("10.96.0.1")]), None);
        t.sets.insert("cluster-ips".into(), h);
        t
    }

    /// Variants of `sample`, each one kind of change.
    fn variants() -> Vec<(&'static str, Table)> {
        let key = |a: &str| Tuple::new(&[ip(a), Atom::Proto(6), Atom::Port(80)]);
        let mut v = Vec::new();
        let mut t = sample();
        t.chains.get_mut("svc-a").unwrap().rules =
            vec![Rule::verdict(Verdict::Accept), Rule::verdict(Verdict::Drop)];
        v.push(("rules changed", t));
        let mut t = sample();
        t.chains.remove("svc-a");
        t.sets
            .get_mut("service-ips")
            .unwrap()
            .elements
            .remove(&key("10.96.0.1"));
        v.push(("chain and its element removed", t));
        let mut t = sample();
        t.sets.get_mut("service-ips").unwrap().elements.insert(
            key("10.96.0.2"),
            Some(Value::Verdict(Verdict::Goto("svc-a".into()))),
        );
        v.push(("element re-valued", t));
        let mut t = sample();
        t.sets.remove("cluster-ips");
        t.sets.insert(
            "dnat-c-2".into(),
            Set::new(SetDecl {
                by_expr: true,
                ..SetDecl::map(
                    vec![
                        Field::Ipv4Addr,
                        Field::InetProto,
                        Field::InetService,
                        Field::Numgen(2),
                    ],
                    SetData::Fields(vec![Field::Ipv4Addr, Field::InetService]),
                )
            }),
        );
        t.chains.insert(
            "disp-c-2".into(),
            Chain {
                hook: None,
                rules: vec![Rule::new(vec![Expr::DnatMap {
                    family: Family::Ip,
                    sel: vec![
                        Sel::Addr(Family::Ip, Dir::Dst),
                        Sel::L4proto,
                        Sel::Dport,
                        Sel::Numgen(2),
                    ],
                    map: "dnat-c-2".into(),
                }])],
            },
        );
        v.push(("set removed, map and chain added", t));
        v.push(("same", sample()));
        v.push(("empty table", Table::new(Family::Ip, "kproxy")));
        v
    }

    /// Applying diff(old, new) to old gives new, for every pair of variants, and the
    /// counts say what changed.
    #[test]
    fn diff_applied_to_old_gives_new() {
        let mut all = variants();
        all.push(("absent", Table::absent(Family::Ip, "kproxy")));
        for (a, old) in &all {
            for (b, new) in &all {
                let tx = diff(old, new).unwrap();
                assert!(!tx.replaces, "{a} -> {b}");
                assert_eq!(&apply(old, &tx), new, "{a} -> {b}:\n{}", tx.nft_text());
                if old == new {
                    assert!(tx.is_empty(), "{a} -> {b}: {tx:?}");
                    assert!(tx.counts.is_empty());
                } else {
                    assert!(!tx.is_empty(), "{a} -> {b}");
                }
                // Ordered by phase already: `order` changes nothing.
                let mut o = tx.clone();
                o.order();
                assert_eq!(o, tx, "{a} -> {b}");
            }
        }
    }

    /// `create` is the diff from an absent table.
    #[test]
    fn create_is_the_diff_from_absent() {
        for (name, t) in variants() {
            let absent = Table::absent(t.family, &t.name);
            assert_eq!(
                Transaction::create(t.clone()),
                diff(&absent, &t).unwrap(),
                "{name}"
            );
        }
    }

    /// `create_with` is `create` of the table holding the extra elements too: merged
    /// in key order, the table's value kept on a key both hold, none for an undeclared
    /// set.
    #[test]
    fn create_with_merges_in_key_order() {
        let key = |a: &str| Tuple::new(&[ip(a), Atom::Proto(6), Atom::Port(80)]);
        let goto = |c: &str| Some(Value::Verdict(Verdict::Goto(c.into())));
        let extra = |a: &str, c: &str| Elem {
            key: key(a),
            value: goto(c),
        };
        let more: BTreeMap<String, Vec<Elem>> = [
            (
                "service-ips".to_string(),
                vec![
                    extra("10.96.0.0", "x"),
                    extra("10.96.0.1", "y"),
                    extra("10.96.0.3", "z"),
                ],
            ),
            ("undeclared".to_string(), vec![extra("10.96.0.9", "w")]),
        ]
        .into();
        let mut whole = sample();
        let s = whole.sets.get_mut("service-ips").unwrap();
        s.elements.insert(key("10.96.0.0"), goto("x"));
        s.elements.insert(key("10.96.0.3"), goto("z"));
        assert_eq!(
            Transaction::create_with(sample(), more),
            Transaction::create(whole)
        );
    }

    #[test]
    fn diff_counts_and_text() {
        let old = sample();
        let mut new = sample();
        new.chains.get_mut("svc-a").unwrap().rules = vec![Rule::verdict(Verdict::Accept)];
        let key = Tuple::new(&[ip("10.96.0.2"), Atom::Proto(6), Atom::Port(80)]);
        new.sets
            .get_mut("service-ips")
            .unwrap()
            .elements
            .insert(key, Some(Value::Verdict(Verdict::Goto("svc-a".into()))));
        let tx = diff(&old, &new).unwrap();
        assert_eq!(
            tx.counts,
            Counts {
                chains_changed: 1,
                elements_added: 1,
                elements_deleted: 1,
                ..Counts::default()
            }
        );
        assert_eq!(
            tx.nft_text(),
            format!(
                "flush chain ip kproxy svc-a\n\
                 add rule ip kproxy svc-a accept comment \"kp:{}\"\n\
                 delete element ip kproxy service-ips {{ 10.96.0.2 . tcp . 80 }}\n\
                 add element ip kproxy service-ips {{ 10.96.0.2 . tcp . 80 : goto svc-a }}\n",
                rule_id("accept")
            )
        );
        assert!(!tx.elements_only());
    }

    /// A declaration that cannot change in place replaces the table.
    #[test]
    fn changed_declarations_replace_the_table() {
        let old = sample();
        let mut new = sample();
        new.sets.get_mut("cluster-ips").unwrap().decl.comment = Some("x".into());
        let tx = diff(&old, &new).unwrap();
        assert!(tx.replaces);
        assert_eq!(apply(&old, &tx), new);
        let mut new = sample();
        new.chains.get_mut("nat-prerouting").unwrap().hook =
            Some(Hook::nat(HookPoint::Prerouting, -99));
        let tx = diff(&old, &new).unwrap();
        assert!(tx.replaces);
        assert_eq!(apply(&old, &tx), new);
        assert!(diff(&old, &Table::new(Family::Ip6, "kproxy")).is_err());
        assert!(diff(&old, &Table::new(Family::Ip, "other")).is_err());
    }

    /// Declarations render as kproxy has always written them.
    #[test]
    fn declarations_render_as_nft_text() {
        let text = |d: &SetDecl| {
            let mut s = String::new();
            d.write(&mut s);
            s
        };
        assert_eq!(
            text(&vmap()),
            "type ipv4_addr . inet_proto . inet_service : verdict; comment \"cluster IPs\";"
        );
        let dnat = SetDecl {
            by_expr: true,
            ..SetDecl::map(
                vec![
                    Field::Ipv6Addr,
                    Field::InetProto,
                    Field::InetService,
                    Field::Numgen(3),
                ],
                SetData::Fields(vec![Field::Ipv6Addr, Field::InetService]),
            )
        };
        assert_eq!(
            text(&dnat),
            "typeof ip6 daddr . meta l4proto . th dport . numgen random mod 3 : ip6 daddr . th dport;"
        );
        let aff = SetDecl {
            dynamic: true,
            timeout_secs: Some(10800),
            ..SetDecl::set(vec![Field::Ipv4Addr])
        };
        assert_eq!(
            text(&aff),
            "type ipv4_addr; flags dynamic,timeout; timeout 10800s;"
        );
        let pods = SetDecl {
            interval: true,
            auto_merge: true,
            ..SetDecl::set(vec![Field::Ipv4Addr]).with_comment("local pod CIDRs")
        };
        assert_eq!(
            text(&pods),
            "type ipv4_addr; flags interval; auto-merge; comment \"local pod CIDRs\";"
        );
        let mut h = String::new();
        Hook::nat(HookPoint::Postrouting, 100).write(&mut h);
        assert_eq!(
            h,
            "type nat hook postrouting priority srcnat; policy accept;"
        );
    }

    #[test]
    fn elements_parse_typed_and_write_back() {
        let d = vmap();
        let e = d.parse_elem("10.96.0.1 . udp . 53", "goto svc-x").unwrap();
        assert_eq!(
            e.key,
            Tuple::new(&[ip("10.96.0.1"), Atom::Proto(17), Atom::Port(53)])
        );
        let mut s = String::new();
        e.write(&mut s);
        assert_eq!(s, "10.96.0.1 . udp . 53 : goto svc-x");
        assert!(d.parse_elem("10.96.0.1 . udp", "drop").is_none());
        assert!(d.parse_elem("10.96.0.1 . udp . 53", "reject").is_none());
        assert!(d.parse_elem("fd00::1 . udp . 53", "drop").is_none());
    }

    /// FNV-1a 64 test vectors: the ids a reader of the kernel recomputes.
    #[test]
    fn rule_ids_are_fnv1a_64() {
        assert_eq!(rule_id(""), "cbf29ce484222325");
        assert_eq!(rule_id("a"), "af63dc4c8601ec8c");
        assert_eq!(rule_id("foobar"), "85944171f73967e8");
    }
}
