//! The objects of a table: declarations of sets and maps, their elements and values,
//! hooks, chains and the table itself.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::atom::{Atom, Family, Field, MAX_FIELDS, Verdict};
use crate::rule::Rule;

use super::tuple::*;

/// What a map's elements point to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum SetData {
    Verdict,
    Fields(Vec<Field>),
    /// `: counter`: each element names a counter object of the table (an objref map,
    /// looked up by `counter name SEL map @m`).
    Counter,
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
            Some(SetData::Counter) => out.push_str(" : counter"),
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
            Some(SetData::Counter) => Some(Value::Counter(value.trim().trim_matches('"').into())),
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
            Some(SetData::Counter) => Some(Value::Counter(value.trim().trim_matches('"').into())),
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

/// A map element's value.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Value {
    Verdict(Verdict),
    Data(Tuple),
    /// The name of a counter object (an element of a [`SetData::Counter`] map).
    Counter(Box<str>),
}

impl Value {
    pub fn write(&self, out: &mut String) {
        match self {
            Value::Verdict(v) => v.write(out),
            Value::Data(t) => t.write(out),
            Value::Counter(name) => {
                out.push('"');
                out.push_str(name);
                out.push('"');
            }
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
///
/// Its fields are the crate's: other crates see a table's family, name and counts
/// ([`Table::family`], [`Table::name`], [`Table::rule_count`], [`Table::element_count`]),
/// never its chains and sets, whose types the facade does not export. Benches and tests
/// reach them through the `internals` feature ([`Table::chains`], [`Table::sets`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    pub(crate) family: Family,
    pub(crate) name: String,
    /// `None` when the table does not exist (the `old` of a first sync).
    pub(crate) comment: Option<String>,
    pub(crate) exists: bool,
    pub(crate) sets: BTreeMap<String, Set>,
    pub(crate) chains: BTreeMap<String, Chain>,
    /// Named counter objects (`NFT_OBJECT_COUNTER`), by name. Only their existence is
    /// state: their values are the kernel's, never compared, never rewritten
    /// (crates/nft/README.md, "Counters").
    pub(crate) counters: std::collections::BTreeSet<String>,
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
            counters: std::collections::BTreeSet::new(),
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

    pub fn family(&self) -> Family {
        self.family
    }

    /// The table's name (`--nft-table`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of rules of all chains.
    pub fn rule_count(&self) -> usize {
        self.chains.values().map(|c| c.rules.len()).sum()
    }

    /// Number of elements of all sets.
    pub fn element_count(&self) -> usize {
        self.sets.values().map(|s| s.elements.len()).sum()
    }
}

/// The fields, for benches and tests (the `internals` feature): not for other crates.
#[cfg(feature = "internals")]
#[doc(hidden)]
impl Table {
    pub fn chains(&self) -> &BTreeMap<String, Chain> {
        &self.chains
    }

    pub fn chains_mut(&mut self) -> &mut BTreeMap<String, Chain> {
        &mut self.chains
    }

    pub fn sets(&self) -> &BTreeMap<String, Set> {
        &self.sets
    }

    pub fn sets_mut(&mut self) -> &mut BTreeMap<String, Set> {
        &mut self.sets
    }

    pub fn counters(&self) -> &std::collections::BTreeSet<String> {
        &self.counters
    }

    pub fn exists(&self) -> bool {
        self.exists
    }
}
