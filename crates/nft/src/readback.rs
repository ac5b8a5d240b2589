//! Reading kproxy's tables back from the kernel and comparing them with the record:
//! the one way kproxy reads the kernel, used by adoption at start, by repair after
//! interference, and by verification.
//!
//! The tables are read over nfnetlink ([`crate::dump::read_table`]; a table that does
//! not exist is the kernel's `ENOENT`, never a tool's message), turned into the desired
//! state's vocabulary ([`crate::dump::adopt`]) and diffed against the record
//! ([`crate::model::diff`]): the transaction that diff returns is what adoption and
//! repair send, and what it touches is what verification names as differing. `nft` is
//! not asked to list anything: `nft -j` of a 10k-Service table took ~10 s, and the
//! netlink reading 0.2–0.4 s.

use std::time::Instant;

use kproxy_core::NodePlan;

use crate::config::DataplaneConfig;
use crate::dump::{self, AdoptError, RawTable};
use crate::error::NftError;
use crate::model::{self, Transaction};
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
        let reader = s.spawn(|| {
            [
                dump::read_table("ip", table),
                dump::read_table("ip6", table),
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
/// [`dump::adopt`] turns the kernel's table into the model, and [`model::diff`] says
/// what moves it to the record. Fails only when the diff does (a bug).
pub(crate) fn compare(rec: &FamilyRecord, raw: Option<&RawTable>) -> Result<Compared, NftError> {
    Ok(compare_named(rec, raw)?.0)
}

/// [`compare`] and the objects that differ, as verification names them (`table ip
/// kproxy`, `chain services`, `map service-ips`, or what adoption could not account
/// for), in the order the transaction touches them, each once.
pub(crate) fn compare_named(
    rec: &FamilyRecord,
    raw: Option<&RawTable>,
) -> Result<(Compared, Vec<String>), NftError> {
    let (family, table) = rec.table();
    let Some(raw) = raw else {
        let named = vec![format!("table {} {table}", family.nft())];
        return Ok((Compared::Absent, named));
    };
    let desired = rec.assemble();
    let kernel = match dump::adopt(raw, &desired) {
        Ok(k) => k,
        Err(e) => {
            let named = vec![e.what.clone()];
            return Ok((Compared::Unadoptable(e), named));
        }
    };
    let tx = model::diff(&kernel, &desired)?;
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

/// One family's kproxy table as the kernel holds it, in the terms of `desired` (the
/// plan's table of that family): read and adopted exactly as adoption does
/// (`kproxy trace --kernel`). `Ok(None)` when the table does not exist; the inner
/// error when the kernel holds what adoption cannot account for.
pub fn kernel_table(
    desired: &model::Table,
) -> Result<Option<Result<model::Table, AdoptError>>, NftError> {
    let raw = dump::read_table(desired.family.nft(), &desired.name)?;
    Ok(raw.map(|raw| dump::adopt(&raw, desired)))
}
