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
use crate::dump;
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
    raw: [Result<Option<dump::RawTable>, NftError>; 2],
) -> Option<Transaction> {
    let t = Instant::now();
    let r = read_back(recs, raw)?;
    tracing::info!(
        rules = r.rules,
        elements = r.elements,
        diff_ms = t.elapsed().as_secs_f64() * 1e3,
        changes = ?r.tx.counts,
        "adopted kproxy's tables from the kernel"
    );
    Some(r.tx)
}

/// The kernel's tables read back and diffed against the records: the delta that moves
/// them to the records, and what was read.
pub(crate) struct ReadBack {
    pub(crate) tx: Transaction,
    rules: usize,
    elements: usize,
}

/// [`adopt`]'s reading and diffing, without its log: also what `verify` asks first.
/// `None`: a table is absent, or unreadable, or holds what a delta cannot repair (the
/// last two logged as warnings).
pub(crate) fn read_back(
    recs: &[FamilyRecord; 2],
    raw: [Result<Option<dump::RawTable>, NftError>; 2],
) -> Option<ReadBack> {
    let mut tx = Transaction::default();
    let (mut rules, mut elements) = (0, 0);
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
        let desired = rec.assemble();
        let kernel = match dump::adopt(&raw, &desired) {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(error = %e, "kproxy's tables hold what a delta cannot repair; replacing them");
                return None;
            }
        };
        match model::diff(&kernel, &desired) {
            Ok(d) if !d.replaces => tx.extend(d),
            Ok(_) => {
                tracing::warn!(
                    family = desired.family.nft(),
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
    Some(ReadBack {
        tx,
        rules,
        elements,
    })
}
