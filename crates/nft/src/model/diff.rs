//! `diff(old, new)`: the transaction from one state of a table to another, and its
//! element step over two kinds of old state.

use std::collections::BTreeMap;

use crate::error::NftError;

use super::objects::*;
use super::transaction::*;
use super::tuple::*;

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
    // Counters: only whether one exists is state (its values are the kernel's).
    for name in new.counters.difference(&old.counters) {
        n.counters_added += 1;
        ops.push(Op::AddCounter {
            family,
            table: table.clone(),
            name: name.clone(),
            packets: 0,
            bytes: 0,
            since: 0,
        });
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
    // After the sets whose elements named them.
    for name in old.counters.difference(&new.counters) {
        n.objects_deleted += 1;
        ops.push(Op::DeleteObject {
            family,
            table: table.clone(),
            kind: crate::nfnl::NFT_OBJECT_COUNTER,
            name: name.clone(),
        });
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
