//! Reading kproxy's tables back from the kernel and comparing them with the record:
//! the one way kproxy reads the kernel, used by adoption at start, by repair after
//! interference, and by verification.
//!
//! The tables are read over nfnetlink ([`crate::dump::read_table`]; a table that does
//! not exist is the kernel's `ENOENT`, never a tool's message); their structure is
//! turned into the desired state's vocabulary ([`crate::adopt::adopt_structure`]) and
//! diffed against the record's ([`crate::model::diff`]), and their elements, packed as
//! read, are compared set by set with the record's, offered in pieces as a first sync
//! sends them ([`compare_named`]). The transaction that gives is what adoption and
//! repair send, and what it touches is what verification names as differing. `nft` is
//! not asked to list anything: `nft -j` of a 10k-Service table took ~10 s, and the
//! netlink reading 0.2–0.4 s.

use std::time::Instant;

use kproxy_core::NodePlan;

use crate::config::DataplaneConfig;
use std::collections::BTreeMap;

use crate::adopt::{self, AdoptError};
use crate::dump::{self, RawData, RawElements, RawSet, RawTable};
use crate::error::NftError;
use crate::first_sync::ELEMENTS_PER_PIECE;
use crate::model::{
    self, Elem, ElementDiff, Family, Held, OldElements, Op, SetDecl, Table, Transaction, Tuple,
    TypedElements, Value,
};
use crate::netlink::encode_tuple;
use crate::record::{FamilyRecord, full_transaction_of, records};

/// A first sync's records and, when kproxy's tables exist and can be brought to them in
/// place, the adoption delta `diff(kernel, desired)`. The kernel's tables are read
/// (mostly kernel time) while the records are built; a thread starts in its creator's
/// network namespace, so it reads ours.
pub(crate) fn records_and_adoption(
    plan: &NodePlan,
    cfg: &DataplaneConfig,
) -> ([FamilyRecord; 2], Option<Transaction>) {
    let table = cfg.table.as_str();
    let (recs, raw) = std::thread::scope(|s| {
        // The counters' names are the plan's (`ruleset::counters`), known before the
        // records are built.
        let known = |family| {
            let rec_family = match family {
                Family::Ip => kproxy_core::model::IpFamily::IPv4,
                Family::Ip6 => kproxy_core::model::IpFamily::IPv6,
            };
            plan.services
                .values()
                .flat_map(|svc| crate::ruleset::counters(svc, rec_family, cfg.counters))
                .collect::<std::collections::BTreeSet<String>>()
        };
        let reader = s.spawn(move || {
            [
                dump::read_table_knowing(Family::Ip, table, &known(Family::Ip)),
                dump::read_table_knowing(Family::Ip6, table, &known(Family::Ip6)),
            ]
        });
        let recs = records(plan, cfg);
        let raw = reader
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        (recs, raw)
    });
    let adopted = adopt(&recs, raw);
    (recs, adopted)
}

/// What a new `Dataplane`'s first sync of `plan` would send here and now, without
/// sending it: the adoption delta when kproxy's tables exist and can be adopted
/// (`true`), else the full replacement (`false`; into absent tables a sync sends the
/// same objects in steps). Reading the kernel needs CAP_NET_ADMIN; without it the
/// answer is the full replacement (logged). `kproxy sync --dry-run`.
pub fn first_sync_transaction(plan: &NodePlan, cfg: &DataplaneConfig) -> (Transaction, bool) {
    match records_and_adoption(plan, cfg) {
        (_, Some(tx)) => (tx, true),
        (recs, None) => (full_transaction_of(&recs), false),
    }
}

/// Adoption at start: from both tables as read back (netlink dumps), the transaction
/// `diff(kernel, desired)`; `None` (a full replacement follows) when a table is absent
/// (a first start: the cold path), or when the kernel holds anything the diff cannot
/// repair in place (logged).
pub(crate) fn adopt(
    recs: &[FamilyRecord; 2],
    raw: [Result<Option<RawTable>, NftError>; 2],
) -> Option<Transaction> {
    let t = Instant::now();
    let (mut tx, mut rules, mut elements) = (Transaction::default(), 0, 0);
    for (rec, raw) in recs.iter().zip(raw) {
        let raw = match raw {
            Ok(Some(raw)) => raw,
            Ok(None) => return None,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read kproxy's tables back; replacing them");
                return None;
            }
        };
        rules += raw.rule_count();
        elements += raw.element_count();
        match compare(rec, Some(&raw)) {
            Ok(Compared::Delta(d)) => tx.extend(d),
            Ok(Compared::Absent) => return None,
            Ok(Compared::Unadoptable(e)) => {
                tracing::warn!(error = %e, "kproxy's tables hold what a delta cannot repair; replacing them");
                return None;
            }
            Ok(Compared::Replaces) => {
                tracing::warn!(
                    family = rec.table().0.nft(),
                    "a declaration in the kernel differs; replacing the tables"
                );
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot diff the kernel's tables; replacing them");
                return None;
            }
        }
    }
    tx.order();
    tracing::info!(
        rules,
        elements,
        diff_ms = t.elapsed().as_secs_f64() * 1e3,
        changes = ?tx.counts,
        "adopted kproxy's tables from the kernel"
    );
    Some(tx)
}

/// One family's table in the kernel against the record.
#[derive(Debug)]
pub(crate) enum Compared {
    /// The table does not exist.
    Absent,
    /// The kernel holds what a delta cannot repair (a foreign comment or flags, a hook
    /// or set type that differs, elements that do not decode): the object and why.
    Unadoptable(AdoptError),
    /// A declaration differs: `diff` replaces the table.
    Replaces,
    /// The delta that moves the kernel to the record; empty when they are equal.
    Delta(Transaction),
}

/// Compares one family's table as read back (`None`: absent) with the record:
/// [`adopt::adopt_structure`] turns the kernel's structure into the model and
/// [`model::diff`] says what moves it to the record's structure; the elements are then
/// compared set by set ([`elements_delta`]). Fails only when the diff does (a bug).
pub(crate) fn compare(rec: &FamilyRecord, raw: Option<&RawTable>) -> Result<Compared, NftError> {
    Ok(compare_named(rec, raw)?.0)
}

/// [`compare`] and the objects that differ, as verification names them (`table ip
/// kproxy`, `chain services`, `map service-ips`, or what adoption could not account
/// for), in the order the transaction touches them, each once.
///
/// The transaction equals `diff(adopt(raw, desired), desired)` with `desired` the
/// record's whole table (a test holds them equal), without ever holding the desired
/// or the kernel's elements typed: the kernel's stay packed as read, the record's come
/// in pieces as a first sync sends them. Both typed tables were most of a restart's
/// peak memory (30 MiB above a cold start's at 10k Services × 10 endpoints).
pub(crate) fn compare_named(
    rec: &FamilyRecord,
    raw: Option<&RawTable>,
) -> Result<(Compared, Vec<String>), NftError> {
    let (family, table) = rec.table();
    let Some(raw) = raw else {
        let named = vec![format!("table {} {table}", family.nft())];
        return Ok((Compared::Absent, named));
    };
    let mut desired = rec.assemble_structure();
    // The structure's own elements are compared with the Services' below.
    let own: BTreeMap<String, Vec<Elem>> = desired
        .sets
        .iter_mut()
        .map(|(name, s)| {
            let elems = std::mem::take(&mut s.elements)
                .into_iter()
                .map(|(key, value)| Elem { key, value });
            (name.clone(), elems.collect())
        })
        .collect();
    let unadoptable = |e: AdoptError| {
        let named = vec![e.what.clone()];
        Ok((Compared::Unadoptable(e), named))
    };
    let kernel = match adopt::adopt_structure(raw, &desired) {
        Ok(k) => k,
        Err(e) => return unadoptable(e),
    };
    let mut tx = model::diff(&kernel, &desired)?;
    if !tx.replaces {
        match elements_delta(rec, raw, &desired, own) {
            Ok(elements) => {
                tx.counts.add(&elements.counts);
                tx.ops.extend(elements.ops);
            }
            Err(e) => return unadoptable(e),
        }
        match foreign_objects(raw, family, table) {
            Ok(objects) => {
                tx.counts.objects_deleted += objects.len();
                tx.ops.extend(objects);
            }
            Err(e) => return unadoptable(e),
        }
        tx.order();
    }
    let mut named: Vec<String> = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for op in &tx.ops {
        // A rule is its chain's difference, an element its set's or map's.
        let name = match op.object() {
            (_, _, None) => format!("table {} {table}", family.nft()),
            (_, "rule", Some(chain)) => format!("chain {chain}"),
            (_, "element", Some(set)) => {
                let map = desired.sets.get(set).is_some_and(|s| s.decl.is_map());
                format!("{} {set}", if map { "map" } else { "set" })
            }
            (_, kind, Some(name)) => format!("{kind} {name}"),
        };
        if seen.insert(name.clone()) {
            named.push(name);
        }
    }
    let compared = if tx.replaces {
        Compared::Replaces
    } else {
        Compared::Delta(tx)
    };
    Ok((compared, named))
}

/// The deletions of the named objects in kproxy's table (it declares none: each is
/// another program's counter, quota, limit…). A name nft could not be given back (not
/// `[A-Za-z0-9_.-]`) is an [`AdoptError`]: the table is replaced instead, which needs
/// no name.
fn foreign_objects(raw: &RawTable, family: Family, table: &str) -> Result<Vec<Op>, AdoptError> {
    raw.objects
        .iter()
        // Counters are the model's: the diff keeps kproxy's and deletes the others.
        .filter(|(kind, _)| *kind != crate::nfnl::NFT_OBJECT_COUNTER)
        .map(|(kind, name)| {
            let plain = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !plain {
                return Err(AdoptError {
                    family,
                    table: table.to_string(),
                    what: format!(
                        "a {} named {:?}, another program's",
                        model::object_kind(*kind),
                        name.escape_debug().to_string()
                    ),
                });
            }
            Ok(Op::DeleteObject {
                family,
                table: table.to_string(),
                kind: *kind,
                name: name.clone(),
            })
        })
        .collect()
}

/// One of kproxy's tables as the kernel holds it, read over nfnetlink: the one read of
/// the kernel's tables other crates get (`kproxy trace --kernel`, the input guard).
pub struct KernelTable(RawTable);

impl KernelTable {
    /// Reads table `name` of `family`; `Ok(None)` when it does not exist.
    pub fn read(family: Family, name: &str) -> Result<Option<KernelTable>, NftError> {
        Ok(dump::read_table(family, name)?.map(KernelTable))
    }

    /// The rules of all its chains.
    pub fn rule_count(&self) -> usize {
        self.0.rule_count()
    }

    /// The elements of all its sets and maps.
    pub fn element_count(&self) -> usize {
        self.0.element_count()
    }

    /// The table in the terms of `desired` (the plan's table of its family), adopted
    /// exactly as adoption does; the error when it holds what adoption cannot account
    /// for.
    pub fn adopt(&self, desired: &model::Table) -> Result<model::Table, AdoptError> {
        adopt::adopt(&self.0, desired)
    }
}

// ---- Elements, set by set.

/// The element operations that move the kernel's sets (`raw`) to the record's: per set
/// of `desired` (the record's structure, its elements taken out into `own`),
/// [`model::diff`]'s element step ([`ElementDiff`]) over the kernel's elements as read,
/// the record's offered in the pieces a first sync sends.
fn elements_delta(
    rec: &FamilyRecord,
    raw: &RawTable,
    desired: &Table,
    own: BTreeMap<String, Vec<Elem>>,
) -> Result<Transaction, AdoptError> {
    let err = |what: String| AdoptError {
        family: desired.family,
        table: desired.name.clone(),
        what,
    };
    let v6 = desired.family == Family::Ip6;
    let mut sets: BTreeMap<&str, ElementDiff<KernelElements<'_>>> = BTreeMap::new();
    for (name, s) in &desired.sets {
        if s.decl.dynamic {
            continue;
        }
        let kernel = KernelElements::new(&s.decl, raw.sets.get(name), v6)
            .map_err(|e| err(format!("set {name}: {e}")))?;
        sets.insert(name, ElementDiff::new(kernel));
    }
    for (name, elems) in own {
        if let Some(d) = sets.get_mut(name.as_str()) {
            elems.into_iter().for_each(|e| d.offer(e));
        }
    }
    // Pieces never fail; the closure's error type only satisfies the signature.
    let _ = rec.element_pieces::<std::convert::Infallible>(ELEMENTS_PER_PIECE, &mut |piece| {
        for op in piece.ops {
            if let Op::AddElements { set, elems, .. } = op
                && let Some(d) = sets.get_mut(set.as_str())
            {
                elems.into_iter().for_each(|e| d.offer(e));
            }
        }
        Ok(())
    });
    let mut tx = Transaction::default();
    let mut adds = Vec::new();
    for (name, d) in sets {
        let (dels, add) = d.finish().map_err(|e| err(format!("set {name}: {e}")))?;
        tx.counts.elements_deleted += dels.len();
        tx.counts.elements_added += add.len();
        let (family, table) = (desired.family, desired.name.clone());
        if !dels.is_empty() {
            tx.ops.push(Op::DeleteElements {
                family,
                table: table.clone(),
                set: name.to_string(),
                keys: dels,
            });
        }
        if !add.is_empty() {
            adds.push(Op::AddElements {
                family,
                table,
                set: name.to_string(),
                elems: add,
            });
        }
    }
    tx.ops.extend(adds);
    Ok(tx)
}

/// A set's elements in the kernel, as [`ElementDiff`] consults them: packed as read,
/// sorted by key bytes, each marked once offered; an interval set (a handful of
/// prefixes, each held by the kernel as two bounds) typed.
enum KernelElements<'a> {
    /// The set is not in the kernel: every element is added.
    Absent,
    Packed {
        decl: &'a SetDecl,
        raw: &'a RawElements,
        /// Indices into `raw`, sorted by key bytes.
        order: Vec<u32>,
        offered: Vec<bool>,
        /// Scratch for a key's encoding.
        key: Vec<u8>,
    },
    Typed(TypedElements<'static>),
}

impl<'a> KernelElements<'a> {
    fn new(
        decl: &'a SetDecl,
        raw: Option<&'a RawSet>,
        v6: bool,
    ) -> Result<KernelElements<'a>, String> {
        let Some(rs) = raw else {
            return Ok(KernelElements::Absent);
        };
        if decl.interval {
            return Ok(KernelElements::Typed(TypedElements::owned(
                adopt::decode_elements(rs, decl, v6)?,
            )));
        }
        if rs.elements.misfits() > 0 {
            return Err(format!(
                "{} elements that do not fit the set's own declaration",
                rs.elements.misfits()
            ));
        }
        let raw = &rs.elements;
        let mut order: Vec<u32> = (0..raw.len() as u32).collect();
        order.sort_unstable_by(|&a, &b| raw.get(a as usize).key.cmp(raw.get(b as usize).key));
        Ok(KernelElements::Packed {
            decl,
            raw,
            offered: vec![false; order.len()],
            order,
            key: Vec::new(),
        })
    }

    /// The position in `order` of the element whose key encodes as `key`.
    fn find(raw: &RawElements, order: &[u32], scratch: &mut Vec<u8>, key: &Tuple) -> Option<usize> {
        scratch.clear();
        // A key that does not encode (a prefix) has no packed form to match.
        encode_tuple(key, scratch).ok()?;
        order
            .binary_search_by(|&i| raw.get(i as usize).key.cmp(scratch.as_slice()))
            .ok()
    }
}

impl OldElements for KernelElements<'_> {
    fn take(&mut self, key: &Tuple, value: Option<&Value>) -> Held {
        match self {
            KernelElements::Absent => Held::No,
            KernelElements::Typed(t) => t.take(key, value),
            KernelElements::Packed {
                raw,
                order,
                offered,
                key: scratch,
                ..
            } => {
                let Some(at) = Self::find(raw, order, scratch, key) else {
                    return Held::No;
                };
                if std::mem::replace(&mut offered[at], true) {
                    return Held::Again;
                }
                if same_data(raw.get(order[at] as usize).data, value) {
                    Held::Same
                } else {
                    Held::Differs
                }
            }
        }
    }

    fn check_differing(&self, key: &Tuple) -> Result<(), String> {
        let KernelElements::Packed {
            decl, raw, order, ..
        } = self
        else {
            return Ok(());
        };
        let mut scratch = Vec::new();
        match Self::find(raw, order, &mut scratch, key) {
            Some(at) => adopt::decode_element(raw.get(order[at] as usize), decl).map(|_| ()),
            None => Ok(()),
        }
    }

    fn rest(self, out: &mut Vec<Tuple>) -> Result<(), String> {
        match self {
            KernelElements::Absent => Ok(()),
            KernelElements::Typed(t) => t.rest(out),
            // Every kernel element must decode, as adoption of the typed table requires;
            // those offered with the same value hold the record's bytes.
            KernelElements::Packed {
                decl,
                raw,
                order,
                offered,
                ..
            } => {
                for (i, offered) in order.into_iter().zip(offered) {
                    if !offered {
                        out.push(adopt::decode_element(raw.get(i as usize), decl)?.0);
                    }
                }
                Ok(())
            }
        }
    }
}

/// Whether the kernel's data of an element is the record's value.
fn same_data(kernel: Option<RawData<'_>>, value: Option<&Value>) -> bool {
    match (kernel, value) {
        (None, None) => true,
        (Some(RawData::Verdict { code, chain }), Some(Value::Verdict(v))) => {
            v.netlink() == (code, chain)
        }
        (Some(RawData::Value(bytes)), Some(Value::Data(t))) => {
            let mut b = Vec::with_capacity(bytes.len());
            encode_tuple(t, &mut b).is_ok() && b == bytes
        }
        (Some(RawData::Object(name)), Some(Value::Counter(want))) => name == &**want,
        _ => false,
    }
}
