//! Operations ([`Op`]) and the transaction that orders them, with what it counts.

use std::collections::BTreeMap;

use crate::atom::{Atom, Family};
use crate::rule::Rule;

use super::objects::*;
use super::tuple::*;

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
    /// Adds a named counter object holding `packets` and `bytes` (0 for a new one; the
    /// last values kproxy read when it restores one the kernel lost), counting since
    /// `since` (Unix seconds, kept in the object's comment; 0: not yet stamped, the
    /// dataplane stamps it when it sends, `crate::counters::CounterMemory::fill`).
    AddCounter {
        family: Family,
        table: String,
        name: String,
        packets: u64,
        bytes: u64,
        since: u64,
    },
    /// Deletes a named stateful object (`NFT_OBJECT_*` type `kind`): a counter kproxy no
    /// longer wants, or any other object (kproxy declares none but counters, so one in
    /// its table is another program's).
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
            Op::AddSet { .. } | Op::AddChain { .. } | Op::AddCounter { .. } => 1,
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
            Op::AddCounter { name, .. } => ("add", "counter", Some(name)),
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
            | Op::AddCounter { family, table, .. }
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
    /// Named objects (another program's, or counters kproxy no longer wants) deleted.
    pub objects_deleted: usize,
    /// Counter objects added.
    pub counters_added: usize,
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
        self.counters_added += o.counters_added;
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
        for name in new.counters {
            t.counts.counters_added += 1;
            t.ops.push(Op::AddCounter {
                family,
                table: table.clone(),
                name,
                packets: 0,
                bytes: 0,
                since: 0,
            });
        }
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

impl Table {
    /// What creating this table counts as.
    pub fn counts(&self) -> Counts {
        Counts {
            chains_added: self.chains.len(),
            sets_added: self.sets.len(),
            elements_added: self.element_count(),
            ..Counts::default()
        }
    }
}
