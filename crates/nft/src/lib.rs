//! kproxy's nftables dataplane: renders a NodePlan into kproxy's own tables
//! (`ip kproxy`, `ip6 kproxy`), applies it atomically (a full table replacement first,
//! then deltas: the in-memory record of what is programmed moved by the Services the
//! planner's `PlanUpdate` names, [`delta`]), verifies the kernel against that record, and
//! deletes stale UDP conntrack entries.
//!
//! Functional core: [`ruleset`] (plan → desired typed [`model::Table`]s), [`model`]
//! (the typed nftables model, `diff(old, new) → Transaction`, the transaction's nft
//! text), [`record`] (the record that moves by the changed Services and yields each
//! sync's transaction, a full sync's straight from the record) and
//! [`conntrack::UdpFrontends`] (the cleanup's decision, moved with the record).
//! Imperative shell:
//! [`Dataplane`], which sends each sync's one transaction as `nft -f` text or, when it
//! only changes elements, as an nfnetlink batch ([`netlink`], the transaction's second
//! renderer), and talks ctnetlink, always in the calling thread's network namespace.

#![forbid(unsafe_code)]

pub mod conntrack;
pub mod dump;
pub mod limits;
pub mod model;
pub mod monitor;
pub mod netlink;
pub mod nft;
pub mod record;
pub mod ruleset;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use kproxy_core::NodePlan;
use kproxy_core::model::{IpFamily, ServiceName};
use kproxy_core::plan::LocalPods;
use kproxy_core::planner::PlanUpdate;

pub use model::{Table, Transaction};
pub use ruleset::DeltaCounts;

/// How the plan reaches the kernel (settings that do not change decisions).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataplaneConfig {
    /// Table name: `kproxy` → tables `ip kproxy` and `ip6 kproxy`.
    pub table: String,
    /// kube-proxy's masqueradeBit (default 14 → mark 0x4000).
    pub masquerade_bit: u8,
    /// Delete stale UDP conntrack entries after each sync (default true).
    pub conntrack_cleanup: bool,
}

impl Default for DataplaneConfig {
    fn default() -> Self {
        DataplaneConfig {
            table: "kproxy".into(),
            masquerade_bit: 14,
            conntrack_cleanup: true,
        }
    }
}

impl DataplaneConfig {
    /// The masquerade mark value.
    pub fn mark(&self) -> u32 {
        1u32 << (self.masquerade_bit & 31)
    }

    /// Rejects values that could not be rendered safely.
    pub fn validate(&self) -> Result<(), NftError> {
        let t = &self.table;
        let ok = !t.is_empty()
            && t.len() <= 32
            && t.starts_with(|c: char| c.is_ascii_alphabetic())
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !ok {
            return Err(NftError::Invalid(format!(
                "table name {t:?}: want [A-Za-z][A-Za-z0-9_-]{{0,31}}"
            )));
        }
        if self.masquerade_bit > 31 {
            return Err(NftError::Invalid(format!(
                "masquerade bit {} is not in 0..=31",
                self.masquerade_bit
            )));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    #[error("invalid input: {0}")]
    Invalid(String),
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    #[error("nft failed ({status}): {stderr}")]
    Nft { status: String, stderr: String },
    #[error("reading the kernel ruleset: {0}")]
    Parse(String),
    #[error("conntrack: {0}")]
    Conntrack(String),
    #[error("nfnetlink: {0}")]
    Netlink(String),
}

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// A full table replacement (first sync, after a failure, or a declaration change).
    pub full: bool,
    /// Wall time of the whole sync (render, transaction, conntrack).
    pub elapsed: Duration,
    /// Wall time of the transactions alone (zero when nothing changed).
    pub transaction: Duration,
    /// Bytes of nft script sent (zero when nothing changed or the delta went over
    /// netlink).
    pub script_bytes: usize,
    /// Bytes of nfnetlink batches sent: a delta of element changes only, or the
    /// elements of a first sync into absent tables (zero otherwise).
    pub netlink_bytes: usize,
    pub changes: DeltaCounts,
    pub conntrack_deleted: usize,
    /// The first sync of this process found kproxy's tables in the kernel, read them
    /// back and sent only the difference (`changes`); see [`dump`].
    pub adopted: bool,
    /// Conntrack cleanup failed (the rules were applied; the next sync retries).
    pub conntrack_error: Option<String>,
}

/// What a verification found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct VerifyReport {
    /// The kernel differed from the record (and a repair restored it).
    pub drift: bool,
    /// Objects (`chain NAME`, `set NAME`, `table FAMILY`) that differed.
    pub differences: Vec<String>,
}

/// The dataplane: the record of what is programmed, and the operations on it.
pub struct Dataplane {
    cfg: DataplaneConfig,
    /// What the kernel holds, per family (IPv4, IPv6); `None` until a full sync
    /// succeeded, and again after any failure (forces the next sync to be full).
    programmed: Option<[record::FamilyRecord; 2]>,
    /// The netlink socket for element-only deltas, opened at the first one.
    writer: Option<netlink::Writer>,
    /// The next full sync may adopt the tables in the kernel: only the first one of a
    /// process (later full syncs repair failures and drift, and replace).
    replace_forced: bool,
    /// The UDP frontends of what is programmed, for the conntrack cleanup; moved with
    /// the record by the changed Services (empty when the cleanup is off).
    udp: conntrack::UdpFrontends,
}

impl Dataplane {
    /// Validates the config; no kernel change yet.
    pub fn new(cfg: DataplaneConfig) -> Result<Dataplane, NftError> {
        cfg.validate()?;
        Ok(Dataplane {
            cfg,
            programmed: None,
            writer: None,
            replace_forced: false,
            udp: conntrack::UdpFrontends::default(),
        })
    }

    pub fn config(&self) -> &DataplaneConfig {
        &self.cfg
    }

    /// Forgets the record, so the next sync is a full one (a replacement, never an
    /// adoption of the tables in the kernel).
    pub fn force_full_sync(&mut self) {
        self.programmed = None;
        self.replace_forced = true;
    }

    /// What is programmed, as whole tables (IPv4, IPv6); `None` before the first
    /// successful sync. Assembles a copy: for tests and tools, not the sync path.
    pub fn programmed(&self) -> Option<[Table; 2]> {
        self.programmed
            .as_ref()
            .map(|[a, b]| [a.assemble(), b.assemble()])
    }

    /// Programs `plan`. `update` is what changed since the last successful sync: the
    /// planner's [`PlanUpdate`], the one owner of change. A delta moves the record by
    /// the Services it names (their parts, and the dispatch groups they touch) and sends
    /// one transaction; no other Service is looked at. A node-level change
    /// (`update.node`, or [`PlanUpdate::WHOLE`] from a caller without a delta) moves it
    /// by every Service, since a Service's rules also depend on node facts (the local-pod
    /// detector). The first call, and any call after a failure, is a full sync: when
    /// kproxy's tables are there (left by a previous run, or by the failed sync) they
    /// are read back and only the difference is sent (adoption); when they are absent
    /// they are built dormant and woken; else (forced, or tables adoption cannot
    /// repair) one atomic transaction replaces them. Then the UDP conntrack
    /// cleanup of §e.6. Blocking; acts on the calling thread's network namespace.
    pub fn sync(&mut self, plan: &NodePlan, update: &PlanUpdate) -> Result<SyncReport, NftError> {
        let start = Instant::now();
        validate_plan(plan)?;
        let mut report = SyncReport::default();
        // Taken: until the kernel took the transaction there is no record, so any
        // failure makes the next sync a full one; and a record that cannot move (a
        // declaration changed) is gone before a full sync builds the next one.
        let moved = self.programmed.take().and_then(|mut recs| {
            let changed = changed_services(&recs, plan, update);
            let tx = delta_by(&mut recs, plan, &changed, &self.cfg)?;
            Some((recs, tx, changed))
        });
        let mut changed = None;
        let (recs, steps) = match moved {
            Some((recs, tx, names)) => {
                report.changes = tx.counts;
                changed = Some(names);
                (recs, vec![Step::of(tx)])
            }
            None => {
                report.full = true;
                match self.full(plan, &mut report) {
                    Ok(done) => done,
                    Err(e) => {
                        self.writer = None;
                        return Err(e);
                    }
                }
            }
        };
        for step in steps {
            if let Err(e) = self.send(step, &recs, &mut report) {
                self.writer = None;
                return Err(e);
            }
        }
        self.programmed = Some(recs);
        if self.cfg.conntrack_cleanup {
            match &changed {
                Some(names) => self.udp.advance(plan, names),
                None => self.udp = conntrack::UdpFrontends::of(plan),
            }
            match conntrack::cleanup(&self.udp) {
                Ok(n) => report.conntrack_deleted = n,
                Err(e) => {
                    tracing::warn!(error = %e, "UDP conntrack cleanup failed; retried after the next sync");
                    report.conntrack_error = Some(e.to_string());
                }
            }
        }
        report.elapsed = start.elapsed();
        Ok(report)
    }

    /// Sends one step of a sync or repair, adding what it sent to `report`.
    fn send(
        &mut self,
        step: Step,
        recs: &[record::FamilyRecord; 2],
        report: &mut SyncReport,
    ) -> Result<(), NftError> {
        let t = Instant::now();
        match step {
            Step::Nft(tx) if !tx.is_empty() => {
                report.script_bytes += nft::run_transaction(&tx)?;
            }
            Step::Netlink(batch) if !batch.is_empty() => {
                report.netlink_bytes += batch.len();
                self.writer()?.send(batch)?;
            }
            Step::Replace => {
                let mut counts = model::Counts::default();
                report.script_bytes += nft::run(|w| {
                    let (n, c) = write_full_replacement(recs, w)?;
                    counts = c;
                    Ok(n)
                })?;
                report.changes = counts;
            }
            _ => {}
        }
        report.transaction += t.elapsed();
        Ok(())
    }

    /// Restores kproxy's tables after another process changed them ([`monitor`]), from
    /// the record, the way a first sync would: when both tables are gone, the first sync
    /// into absent tables (dormant, filled, woken); when they are there, the tables are
    /// read back and only the difference is sent, as an adoption at start does
    /// ([`dump::adopt`]; `report.adopted`); when that cannot repair them in place, one
    /// transaction replacing them (`report.full`). Without a record (a failed sync or
    /// repair before), a full sync of `plan`, which must be the plan last programmed.
    /// `report.changes` says what was restored (nothing: the kernel already matched).
    pub fn repair(&mut self, plan: &NodePlan) -> Result<SyncReport, NftError> {
        let Some(recs) = self.programmed.take() else {
            return self.sync(plan, &PlanUpdate::WHOLE);
        };
        self.restore(recs)
    }

    /// [`Dataplane::repair`] with the record taken: the kernel's tables moved back to it.
    fn restore(&mut self, recs: [record::FamilyRecord; 2]) -> Result<SyncReport, NftError> {
        let start = Instant::now();
        let mut report = SyncReport::default();
        let table = self.cfg.table.as_str();
        let raw = [
            dump::read_table("ip", table),
            dump::read_table("ip6", table),
        ];
        let restored = if raw.iter().all(|r| matches!(r, Ok(None))) {
            match self.first_sync_phased(&recs, &mut report) {
                Ok(true) => Ok(()),
                Ok(false) => {
                    report.full = true;
                    self.send(Step::Replace, &recs, &mut report)
                }
                Err(e) => Err(e),
            }
        } else {
            match adopt(&recs, raw) {
                Some(tx) => {
                    report.adopted = true;
                    report.changes = tx.counts;
                    self.send(Step::of(tx), &recs, &mut report)
                }
                None => {
                    report.full = true;
                    self.send(Step::Replace, &recs, &mut report)
                }
            }
        };
        if let Err(e) = restored {
            // No record: the next repair or sync is a full one.
            self.writer = None;
            return Err(e);
        }
        self.programmed = Some(recs);
        report.elapsed = start.elapsed();
        Ok(report)
    }

    /// A full sync's records and the steps still to send (a first sync into absent
    /// tables sends its own).
    fn full(
        &mut self,
        plan: &NodePlan,
        report: &mut SyncReport,
    ) -> Result<([record::FamilyRecord; 2], Vec<Step>), NftError> {
        // Not only at start: after a failed sync the tables are there too, and a
        // delta against what they hold is a small transaction where a replacement is
        // one of every element, during which the kernel lets about one new connection
        // in 5,000 through the node go unanswered (crates/nft/benches/forwarding.rs).
        let (recs, adopted) = if std::mem::take(&mut self.replace_forced) {
            (records(plan, &self.cfg), None)
        } else {
            records_and_adoption(plan, &self.cfg)
        };
        if let Some(tx) = adopted {
            report.full = false;
            report.adopted = true;
            report.changes = tx.counts;
            return Ok((recs, vec![Step::of(tx)]));
        }
        if self.tables_absent(&recs) && self.first_sync_phased(&recs, report)? {
            return Ok((recs, Vec::new()));
        }
        Ok((recs, vec![Step::Replace]))
    }

    /// The kept netlink socket, (re)opened in the calling thread's network namespace
    /// when needed.
    fn writer(&mut self) -> Result<&mut netlink::Writer, NftError> {
        let reuse = match &self.writer {
            Some(w) => w.in_current_netns()?,
            None => false,
        };
        if !reuse {
            self.writer = Some(netlink::Writer::open()?);
        }
        Ok(self.writer.as_mut().expect("opened above"))
    }

    /// Whether neither of kproxy's tables exists (a node's first start, or after
    /// `kproxy cleanup`); false when that cannot be told.
    fn tables_absent(&mut self, recs: &[record::FamilyRecord; 2]) -> bool {
        let absent = self.writer().and_then(|w| {
            for rec in recs {
                let (family, name) = rec.table();
                if w.table_exists(family, name)? {
                    return Ok(false);
                }
            }
            Ok(true)
        });
        absent.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot check for kproxy's tables over netlink; full sync by nft -f");
            false
        })
    }

    /// The first sync into absent tables ([`first_sync_into_absent_tables`]) with `nft
    /// -f` and this dataplane's netlink socket. `Ok(false)` when an element does not
    /// encode: the tables then exist, dormant, and a one-transaction replacement must
    /// follow.
    fn first_sync_phased(
        &mut self,
        recs: &[record::FamilyRecord; 2],
        report: &mut SyncReport,
    ) -> Result<bool, NftError> {
        let t = Instant::now();
        let writer = self.writer()?;
        let done =
            first_sync_into_absent_tables(recs, &nft::run_transaction, &mut |b| writer.send(b))?;
        let Some(done) = done else {
            return Ok(false);
        };
        report.script_bytes += done.script_bytes;
        report.netlink_bytes += done.netlink_bytes;
        report.transaction += t.elapsed();
        report.changes = done.counts;
        Ok(true)
    }

    /// Reads the kernel, compares with the record, repairs drift (as
    /// [`Dataplane::repair`]: a delta when the tables are there); never on the normal path. Without a record (nothing synced yet) there is
    /// nothing to compare and no drift.
    ///
    /// The kernel is first read back over netlink, as adoption reads it (0.2–0.4 s at
    /// 10k Services × 10 endpoints); only when that finds a difference (or cannot tell)
    /// is `nft -j` asked to name it, which takes ~10 s at that scale. The sync loop
    /// waits for a verification: a 10 s one every verifyPeriod held a change back that
    /// long (issue 27).
    pub fn verify(&mut self) -> Result<VerifyReport, NftError> {
        if let Some(recs) = self.programmed.as_ref() {
            let table = self.cfg.table.as_str();
            let raw = [
                dump::read_table("ip", table),
                dump::read_table("ip6", table),
            ];
            if read_back(recs, raw).is_some_and(|r| r.tx.counts.is_empty()) {
                return Ok(VerifyReport::default());
            }
        }
        let Some(programmed) = self.programmed() else {
            return Ok(VerifyReport::default());
        };
        let mut differences = Vec::new();
        for rs in &programmed {
            differences.extend(nft::compare_with_kernel(rs)?);
        }
        let drift = !differences.is_empty();
        if drift {
            tracing::warn!(?differences, "nftables drift: repairing from the record");
            // The record is what the kernel should hold; repaired as the kernel watch
            // repairs (a delta when the tables are there), not by one transaction of
            // every element.
            if let Some(recs) = self.programmed.take() {
                self.restore(recs)?;
            }
        }
        Ok(VerifyReport { drift, differences })
    }
}

/// Elements per nfnetlink transaction of a first sync into absent tables (≈ 180 KB
/// encoded, ≈ 330 KB typed): small against the ≈ 106k elements at 10k × 10, large
/// enough that a transaction's own cost (a `sendmsg`, the commit) stays a few percent.
const ELEMENTS_PER_PIECE: usize = 4096;

/// Encoded pieces waiting for the socket: the encoder runs ahead of the kernel by this
/// many (and no more, so memory stays bounded) while the structure loads.
const PIECES_AHEAD: usize = 2;

/// What a first sync into absent tables sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PhasedSync {
    /// What the one transaction creating both tables would count.
    pub counts: model::Counts,
    pub script_bytes: usize,
    pub netlink_bytes: usize,
}

/// The first sync into absent tables, in the steps of the transaction that creates
/// them ([`Transaction::dormant_for_absent_tables`]): `load` takes the tables (created
/// dormant), sets, chains and rules (`nft -f`; from the tables without the Services'
/// elements, [`record::FamilyRecord::assemble_structure`]), `send` the elements as
/// nfnetlink transactions of [`ELEMENTS_PER_PIECE`] elements each, typed and encoded
/// piece by piece from the records ([`record::FamilyRecord::element_pieces`]) by a
/// thread that runs at most [`PIECES_AHEAD`] pieces ahead, and last the transaction
/// that wakes both tables ([`netlink::Batch::wake_tables`]), hooking their base chains.
///
/// Why several transactions are safe here: a dormant table's base chains are not
/// hooked, so no packet meets the tables while they fill, whatever order or grouping
/// the elements arrive in; a failure at any step leaves dormant tables, which the next
/// (full, replacing, one-transaction) sync replaces (adoption refuses a table with
/// flags, [`dump::adopt`]). A batch must reach the kernel in one `sendmsg` (nfnetlink
/// runs it from one skb), so one transaction of all elements had to be held whole (4.6
/// MB at 10k × 10, on top of their 8 MiB typed); in pieces neither is. It also lets the
/// kernel grow each set's hash table between pieces: a set starts with 4 buckets and
/// its resize runs in a worker that cannot run during one long `sendmsg` on a
/// non-preemptible kernel, so one batch of 80k elements into one map spent a third of
/// its time in `rhashtable_insert_slow` (`perf`; crates/nft/BENCHMARKS.md).
///
/// `Ok(None)` when an element does not encode (the tables then exist, dormant).
/// Public so a bench can run it with sinks for `load` and `send`.
pub fn first_sync_into_absent_tables(
    recs: &[record::FamilyRecord; 2],
    load: &(dyn Fn(&Transaction) -> Result<usize, NftError> + Sync),
    send: &mut dyn FnMut(netlink::Batch) -> Result<(), NftError>,
) -> Result<Option<PhasedSync>, NftError> {
    let mut bare = Transaction::default();
    for rec in recs {
        bare.extend(Transaction::create(rec.assemble_structure()));
    }
    // The structure's own elements (a NodePort address set's) go with the Services'.
    let (structure, own_elements) = bare.dormant_for_absent_tables();
    let tables: Vec<(model::Family, &str)> = structure
        .ops
        .iter()
        .filter_map(|op| match op {
            model::Op::AddTable { family, table, .. } => Some((*family, table.as_str())),
            _ => None,
        })
        .collect();
    let mut done = PhasedSync {
        counts: structure.counts,
        ..PhasedSync::default()
    };
    let Some(own_elements) = netlink::Batch::transaction(&own_elements) else {
        return Ok(None);
    };
    let elements = std::thread::scope(|s| {
        // A thread starts in its creator's network namespace, so nft acts on ours.
        let loading = s.spawn(|| load(&structure));
        let (pieces, encoded) = std::sync::mpsc::sync_channel(PIECES_AHEAD);
        let encoder = s.spawn(move || {
            let mut n = 0;
            for rec in recs {
                n += rec.element_pieces(ELEMENTS_PER_PIECE, &mut |tx| {
                    // `None` (an element that does not encode) ends the pieces; a
                    // closed channel (the sender failed) stops the encoder.
                    let batch = netlink::Batch::transaction(&tx);
                    let last = batch.is_none();
                    pieces.send(batch).map_err(|_| ())?;
                    if last { Err(()) } else { Ok(()) }
                })?;
            }
            Ok::<usize, ()>(n)
        });
        done.script_bytes += loading
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))?;
        done.netlink_bytes += own_elements.len();
        send(own_elements)?;
        for batch in encoded {
            let Some(batch) = batch else {
                return Ok(None);
            };
            done.netlink_bytes += batch.len();
            send(batch)?;
        }
        let n = encoder
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        Ok(n.ok())
    });
    let Some(n) = elements? else {
        return Ok(None);
    };
    done.counts.elements_added += n;
    let wake = netlink::Batch::wake_tables(&tables);
    done.netlink_bytes += wake.len();
    send(wake)?;
    Ok(Some(done))
}

/// Both families' records of a full sync of `plan`.
fn records(plan: &NodePlan, cfg: &DataplaneConfig) -> [record::FamilyRecord; 2] {
    IpFamily::ALL.map(|f| record::FamilyRecord::full(plan, cfg, f))
}

/// A first sync's records and, when kproxy's tables exist and can be brought to them in
/// place, the adoption delta `diff(kernel, desired)`. The kernel's tables are read
/// (mostly kernel time) while the records are built; a thread starts in its creator's
/// network namespace, so it reads ours.
fn records_and_adoption(
    plan: &NodePlan,
    cfg: &DataplaneConfig,
) -> ([record::FamilyRecord; 2], Option<Transaction>) {
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
fn adopt(
    recs: &[record::FamilyRecord; 2],
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
struct ReadBack {
    tx: Transaction,
    rules: usize,
    elements: usize,
}

/// [`adopt`]'s reading and diffing, without its log: also what `verify` asks first.
/// `None`: a table is absent, or unreadable, or holds what a delta cannot repair (the
/// last two logged as warnings).
fn read_back(
    recs: &[record::FamilyRecord; 2],
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

/// A delta sync's transaction: moves both families' records to `plan` by the Services
/// `update` names (every Service the plan or the records hold when `update.node`), by
/// [`record::FamilyRecord::advance`]. `None` when only a full sync can apply the change
/// (a declaration changed); the records are then unusable. Pure; public so a test can
/// hold it equal to `model::diff` of the whole tables before and after.
pub fn delta(
    recs: &mut [record::FamilyRecord; 2],
    plan: &NodePlan,
    update: &PlanUpdate,
    cfg: &DataplaneConfig,
) -> Option<Transaction> {
    let changed = changed_services(recs, plan, update);
    delta_by(recs, plan, &changed, cfg)
}

/// The Services a delta moves the records by: `update`'s, sorted and deduplicated, or,
/// for a node-level change, every Service the plan or the records hold.
fn changed_services(
    recs: &[record::FamilyRecord; 2],
    plan: &NodePlan,
    update: &PlanUpdate,
) -> Vec<ServiceName> {
    if update.node {
        let mut all: BTreeSet<&ServiceName> = plan.services.keys().collect();
        for rec in recs.iter() {
            all.extend(rec.services());
        }
        all.into_iter().cloned().collect()
    } else {
        let mut names = update.services.clone();
        names.sort_unstable();
        names.dedup();
        names
    }
}

/// [`delta`] by the Services already named.
fn delta_by(
    recs: &mut [record::FamilyRecord; 2],
    plan: &NodePlan,
    changed: &[ServiceName],
    cfg: &DataplaneConfig,
) -> Option<Transaction> {
    let mut tx = Transaction::default();
    for rec in recs.iter_mut() {
        tx.extend(rec.advance(plan, changed, cfg)?);
    }
    tx.order();
    Some(tx)
}

/// One transaction of a sync, in the order sent.
enum Step {
    Nft(Transaction),
    Netlink(netlink::Batch),
    /// The records' tables replacing whatever the kernel holds ([`write_full_replacement`]).
    Replace,
}

impl Step {
    /// A delta as one step: only element changes go over netlink when every element
    /// encodes; anything else is one `nft -f`.
    fn of(tx: Transaction) -> Step {
        let batch = tx
            .elements_only()
            .then(|| netlink::Batch::transaction(&tx))
            .flatten();
        match batch {
            Some(b) => Step::Netlink(b),
            None => Step::Nft(tx),
        }
    }
}

/// Removes everything kproxy made (both tables, and the `-verify` scratch tables a
/// verification interrupted by a crash leaves behind); succeeds when they are absent.
pub fn cleanup(cfg: &DataplaneConfig) -> Result<(), NftError> {
    cfg.validate()?;
    // `add` then `delete` in one transaction: deletes whether or not the table exists.
    let mut tx = Transaction::default();
    for table in [cfg.table.clone(), format!("{}-verify", cfg.table)] {
        for family in [model::Family::Ip, model::Family::Ip6] {
            tx.ops.push(model::Op::AddTable {
                family,
                table: table.clone(),
                comment: None,
                dormant: false,
            });
            tx.ops.push(model::Op::DeleteTable {
                family,
                table: table.clone(),
            });
        }
    }
    nft::run_script(&tx.nft_text())
}

/// The desired state of kproxy's tables for a plan (IPv4, IPv6). Pure.
pub fn desired(plan: &NodePlan, cfg: &DataplaneConfig) -> [Table; 2] {
    IpFamily::ALL.map(|f| ruleset::build(plan, cfg, f))
}

/// The one transaction a full sync sends when the tables may exist: each family's
/// table replaced (created, deleted, created again with everything), no gap.
pub fn full_transaction(tables: [Table; 2]) -> Transaction {
    let mut tx = Transaction::default();
    for t in tables {
        tx.extend(Transaction::replace(t));
    }
    tx
}

/// [`full_transaction`] of the records' tables, built from the records without the
/// tables' element maps ([`record::FamilyRecord::create`]): what a replacing full sync
/// sends (which writes its text from the records, [`write_full_replacement`]), as a
/// transaction, for `sync --dry-run` and tests.
pub fn full_transaction_of(recs: &[record::FamilyRecord; 2]) -> Transaction {
    let mut tx = recs[0].replace();
    tx.extend(recs[1].replace());
    tx
}

/// The nft text of [`full_transaction_of`], written to `w` as it is made, the
/// Services' elements straight from the records' text
/// ([`record::FamilyRecord::write_replacement`]; within a set in record order, not key
/// order): what a full sync sends when the tables exist and cannot be adopted. Returns
/// the bytes written and what the transaction counts.
pub fn write_full_replacement(
    recs: &[record::FamilyRecord; 2],
    w: &mut dyn std::io::Write,
) -> std::io::Result<(usize, model::Counts)> {
    let mut out = model::TextStream::new(w);
    let mut counts = model::Counts::default();
    for rec in recs {
        counts.add(&rec.write_replacement(&mut out)?);
    }
    Ok((out.finish()?, counts))
}

/// The full sync's transaction for a plan, as nft text (what `sync` sends when the
/// tables exist and cannot be adopted; into absent tables it sends the same objects in
/// steps). For golden tests and benches; operators see [`first_sync_transaction`]
/// (`kproxy sync --dry-run`).
pub fn render(plan: &NodePlan, cfg: &DataplaneConfig) -> String {
    full_transaction(desired(plan, cfg)).nft_text()
}

/// Checks the plan's only free-form strings (interface names from the local-traffic
/// detector config) before they reach a script.
pub fn validate_plan(plan: &NodePlan) -> Result<(), NftError> {
    for f in &plan.families {
        match &f.local_pods {
            LocalPods::InterfacePrefix(s) | LocalPods::Bridge(s) => validate_interface(s)?,
            LocalPods::None | LocalPods::Cidrs(_) => {}
        }
    }
    Ok(())
}

/// Linux interface names: 1..=15 bytes; kproxy also limits the alphabet so the name can
/// sit in an nft string without escaping.
pub fn validate_interface(s: &str) -> Result<(), NftError> {
    kproxy_core::config::check_interface_name(s).map_err(NftError::Invalid)
}
