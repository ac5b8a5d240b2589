//! The imperative shell of the dataplane: [`Dataplane`] holds the record of what is
//! programmed and runs each sync, repair and verification against the kernel of the
//! calling thread's network namespace — a delta as one transaction, a full sync as an
//! adoption of the tables found ([`crate::readback`]), a first sync into absent tables
//! ([`crate::first_sync`]) or one replacing transaction — then the UDP conntrack
//! cleanup. Every transaction is an nfnetlink batch on one kept socket
//! ([`netlink::Writer`]): no `nft` process. Every decision it sends is made by the pure
//! modules below it.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kproxy_core::NodePlan;
use kproxy_core::planner::PlanUpdate;

use crate::config::{DataplaneConfig, validate_plan};
use crate::counters::{CounterMemory, KernelCounter};
use crate::error::NftError;
use crate::first_sync::first_sync_into_absent_tables_with;
use crate::model::{self, Table, Transaction};
use crate::readback::{adopt, compare_named, records_and_adoption};
use crate::record::{FamilyRecord, changed_services, delta_by, records};
use crate::ruleset::DeltaCounts;
use crate::{conntrack, dump, netlink};

/// What one sync did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// A full table replacement (first sync, after a failure, or a declaration change).
    pub full: bool,
    /// Wall time of the whole sync (render, transaction, conntrack).
    pub elapsed: Duration,
    /// Wall time of the transactions alone (zero when nothing changed).
    pub transaction: Duration,
    /// Bytes of nfnetlink batches sent (zero when nothing changed).
    pub netlink_bytes: usize,
    pub changes: DeltaCounts,
    pub conntrack_deleted: usize,
    /// The first sync of this process found kproxy's tables in the kernel, read them
    /// back and sent only the difference (`changes`); see [`dump`].
    pub adopted: bool,
    /// Conntrack cleanup failed (the rules were applied; the next sync retries).
    pub conntrack_error: Option<String>,
    /// Traffic counters the kernel had lost, created again from the values kproxy last
    /// read (`crate::counters::CounterMemory`), by name.
    pub counters_restored: Vec<String>,
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
    programmed: Option<[FamilyRecord; 2]>,
    /// The netlink socket every transaction goes on, opened by every full sync (so
    /// before the first delta) and again after a failed one.
    writer: Option<netlink::Writer>,
    /// The next full sync replaces the tables instead of adopting them (forced).
    replace_forced: bool,
    /// The UDP frontends of what is programmed, for the conntrack cleanup; moved with
    /// the record by the changed Services (empty when the cleanup is off).
    udp: conntrack::UdpFrontends,
    /// The traffic counters as last read (by the dataplane, or through a
    /// [`CounterReader`]), to restore those the kernel loses.
    counters: Arc<Mutex<CounterMemory>>,
}

/// Reads kproxy's traffic counters from the kernel on any thread of the dataplane's
/// network namespace, and remembers each reading for the dataplane that made it
/// ([`Dataplane::counter_reader`]): what a repair restores is the last reading, whoever
/// made it.
#[derive(Clone, Debug)]
pub struct CounterReader {
    table: String,
    memory: Arc<Mutex<CounterMemory>>,
}

impl CounterReader {
    /// Both families' counters, each asked for by name (`crate::dump::objects`): the
    /// names this dataplane created or read first.
    pub fn read(&self) -> Result<Vec<KernelCounter>, NftError> {
        let mut out = Vec::new();
        for family in [model::Family::Ip, model::Family::Ip6] {
            let known = lock(&self.memory).names(family);
            let read = dump::read_counter_objects_knowing(family, &self.table, &known)?;
            lock(&self.memory).observe(family, &read);
            out.extend(crate::counters::kernel_counters(family, read));
        }
        Ok(out)
    }
}

fn lock(m: &Mutex<CounterMemory>) -> std::sync::MutexGuard<'_, CounterMemory> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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
            counters: Arc::default(),
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
    /// repair) one atomic transaction replaces them. Then the UDP conntrack cleanup
    /// (docs/upstream-semantics.md §e.6). Blocking; acts on the calling thread's network namespace.
    pub fn sync(&mut self, plan: &NodePlan, update: &PlanUpdate) -> Result<SyncReport, NftError> {
        let start = Instant::now();
        validate_plan(plan)?;
        let mut report = SyncReport::default();
        // Taken: until the kernel took the transaction there is no record, so any
        // failure makes the next sync a full one; and a record that cannot move (a
        // declaration changed) is gone before a full sync builds the next one. A diff
        // that fails (a bug: it was given two different tables) fails the sync.
        let moved = match self.programmed.take() {
            Some(mut recs) => {
                let changed = changed_services(&recs, plan, update);
                delta_by(&mut recs, plan, &changed, &self.cfg)?.map(|tx| (recs, tx, changed))
            }
            None => None,
        };
        let mut changed = None;
        let (recs, steps) = match moved {
            Some((recs, tx, names)) => {
                report.changes = tx.counts;
                changed = Some(names);
                (recs, vec![self.step(tx, &mut report)?])
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
            let mut sent = self.send(step, &recs, &mut report);
            if report.adopted
                && let Err(e) = &sent
            {
                sent = self.replace_refused_adoption(e, &recs, &mut report);
            }
            if let Err(e) = sent {
                self.writer = None;
                return Err(e);
            }
        }
        self.programmed = Some(recs);
        if report.full || report.adopted {
            // The socket every delta goes on, open before the caller reports ready
            // (an adoption that had nothing to send never opened it), so the first
            // change after start costs what the rest do (issue 39.4). A socket that
            // cannot be opened now fails the first delta, which says why.
            if let Err(e) = self.writer() {
                tracing::warn!(error = %e, "cannot open the nfnetlink socket for the next delta");
            }
        }
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

    /// A delta read back from the kernel (an adoption, a repair) that the kernel refused:
    /// the tables hold something the diff cannot move (a renamed chain still jumped to
    /// from a rule the diff kept: EBUSY), so one transaction replaces them. Without this
    /// the same delta was refused at every retry and every restart.
    fn replace_refused_adoption(
        &mut self,
        refused: &NftError,
        recs: &[FamilyRecord; 2],
        report: &mut SyncReport,
    ) -> Result<(), NftError> {
        tracing::warn!(
            error = %refused,
            "the kernel refused the delta to kproxy's tables as read back; replacing them"
        );
        report.adopted = false;
        report.full = true;
        self.send(Step::Replace, recs, report)
    }

    /// Sends one step of a sync or repair, adding what it sent to `report`.
    fn send(
        &mut self,
        step: Step,
        recs: &[FamilyRecord; 2],
        report: &mut SyncReport,
    ) -> Result<(), NftError> {
        let t = Instant::now();
        match step {
            Step::Netlink(batch) if !batch.is_empty() => {
                report.netlink_bytes += batch.len();
                self.writer()?.send(batch)?;
            }
            Step::Replace => {
                // The counters go with the tables and come back in the same
                // transaction: from what they hold now.
                self.observe_counters(recs);
                let mut counters = lock(&self.counters);
                let mut restored = Vec::new();
                let (batch, counts) = replacement_with(recs, &mut |tx| {
                    restored.extend(counters.fill(tx, true));
                })?;
                drop(counters);
                note_restored(&restored, report);
                report.netlink_bytes += batch.len();
                self.writer()?.send(batch)?;
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
    /// (`readback::adopt`; `report.adopted`); when that cannot repair them in place, one
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
    fn restore(&mut self, recs: [FamilyRecord; 2]) -> Result<SyncReport, NftError> {
        let start = Instant::now();
        let mut report = SyncReport::default();
        let table = self.cfg.table.as_str();
        let raw = [
            dump::read_table_knowing(model::Family::Ip, table, &recs[0].counter_names()),
            dump::read_table_knowing(model::Family::Ip6, table, &recs[1].counter_names()),
        ];
        for (rec, raw) in recs.iter().zip(&raw) {
            if let Ok(Some(raw)) = raw {
                lock(&self.counters).observe(rec.table().0, &raw.counters);
            }
        }
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
                    let step = self.step(tx, &mut report);
                    match step.and_then(|step| self.send(step, &recs, &mut report)) {
                        Err(e) => self.replace_refused_adoption(&e, &recs, &mut report),
                        ok => ok,
                    }
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
    ) -> Result<([FamilyRecord; 2], Vec<Step>), NftError> {
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
            return Ok((recs, vec![self.step(tx, report)?]));
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
    fn tables_absent(&self, recs: &[FamilyRecord; 2]) -> bool {
        let absent = recs.iter().try_fold(true, |absent, rec| {
            let (family, name) = rec.table();
            Ok::<_, NftError>(absent && !dump::table_exists(family, name)?)
        });
        absent.unwrap_or_else(|e| {
            tracing::warn!(error = %e, "cannot check for kproxy's tables over netlink; full sync by one replacing transaction");
            false
        })
    }

    /// The first sync into absent tables ([`first_sync_into_absent_tables`]) on this
    /// dataplane's netlink socket. `Ok(false)` when something does not encode: the
    /// tables then exist, dormant, and a one-transaction replacement must follow.
    fn first_sync_phased(
        &mut self,
        recs: &[FamilyRecord; 2],
        report: &mut SyncReport,
    ) -> Result<bool, NftError> {
        let t = Instant::now();
        self.writer()?;
        let writer = self.writer.as_mut().expect("opened above");
        let mut counters = lock(&self.counters);
        let mut restored = Vec::new();
        let done = first_sync_into_absent_tables_with(
            recs,
            &mut |tx| restored.extend(counters.fill(tx, false)),
            &mut |b| writer.send(b),
        );
        drop(counters);
        note_restored(&restored, report);
        let done = match done {
            Ok(done) => done,
            Err(NftError::Encode(e)) => {
                tracing::info!(error = %e, "first sync: something does not encode; replacing the dormant tables");
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        report.netlink_bytes += done.netlink_bytes;
        report.transaction += t.elapsed();
        report.changes = done.counts;
        Ok(true)
    }

    /// Reads the kernel, compares with the record, repairs drift (as
    /// [`Dataplane::repair`]: a delta when the tables are there, not one transaction of
    /// every element); never on the normal path. Without a record
    /// (nothing synced yet) there is nothing to compare and no drift.
    ///
    /// The kernel is read back over netlink as adoption reads it ([`readback`]; 0.2–0.4
    /// s at 10k Services × 10 endpoints), and the differences are the objects that
    /// the delta from the kernel to the record touches. `nft` is never run to list
    /// the tables: `nft -j` took ~10 s at that scale, and the sync loop waits for a
    /// verification.
    pub fn verify(&mut self) -> Result<VerifyReport, NftError> {
        let Some(recs) = self.programmed.take() else {
            return Ok(VerifyReport::default());
        };
        let mut differences = Vec::new();
        for rec in &recs {
            let (family, table) = rec.table();
            let raw = match dump::read_table_knowing(family, table, &rec.counter_names()) {
                Ok(raw) => raw,
                Err(e) => {
                    // Unread is not drift: the record stays, the next verification
                    // reads again.
                    self.programmed = Some(recs);
                    return Err(e);
                }
            };
            if let Some(raw) = &raw {
                lock(&self.counters).observe(family, &raw.counters);
            }
            // Nothing named: the kernel holds the record's table.
            match compare_named(rec, raw.as_ref()) {
                Ok((_, named)) => differences.extend(named),
                Err(e) => {
                    self.programmed = Some(recs);
                    return Err(e);
                }
            }
        }
        let drift = !differences.is_empty();
        if drift {
            tracing::warn!(?differences, "nftables drift: repairing from the record");
            // `restore` keeps the record on success and drops it on failure (the next
            // sync is then a full one).
            self.restore(recs)?;
            return Ok(VerifyReport { drift, differences });
        }
        self.programmed = Some(recs);
        Ok(VerifyReport { drift, differences })
    }
}

impl Dataplane {
    /// A transaction as a step, its new counters stamped ([`CounterMemory::fill`]).
    fn step(&mut self, mut tx: Transaction, report: &mut SyncReport) -> Result<Step, NftError> {
        let restored = lock(&self.counters).fill(&mut tx, false);
        note_restored(&restored, report);
        Step::of(tx)
    }

    /// Reads the counters of the records' tables into the memory (best effort: a
    /// replacement proceeds without them, from the last reading).
    fn observe_counters(&mut self, recs: &[FamilyRecord; 2]) {
        if !self.cfg.counters {
            return;
        }
        for rec in recs {
            let (family, table) = rec.table();
            match dump::read_counter_objects_knowing(family, table, &rec.counter_names()) {
                Ok(read) => lock(&self.counters).observe(family, &read),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the traffic counters before replacing the tables; restoring the last values read");
                }
            }
        }
    }

    /// Reads kproxy's traffic counters from the kernel (both families; each asked for
    /// by name) and remembers them, so that a counter the kernel loses is
    /// restored from this reading. The metrics' and `explain --server`'s reading.
    pub fn read_counters(&mut self) -> Result<Vec<KernelCounter>, NftError> {
        self.counter_reader().read()
    }

    /// A reader of the traffic counters for another thread (the metrics), whose
    /// readings this dataplane restores from.
    pub fn counter_reader(&self) -> CounterReader {
        CounterReader {
            table: self.cfg.table.clone(),
            memory: self.counters.clone(),
        }
    }
}

/// Logs and reports the counters a transaction restored from the last reading.
fn note_restored(restored: &[String], report: &mut SyncReport) {
    if restored.is_empty() {
        return;
    }
    tracing::warn!(
        counters = restored.len(),
        "the kernel had lost kproxy's traffic counters: restored from the values last read (what they counted since is lost; their `since` is now)"
    );
    report.counters_restored.extend_from_slice(restored);
}

/// One transaction of a sync, in the order sent.
enum Step {
    Netlink(netlink::Batch),
    /// The records' tables replacing whatever the kernel holds ([`replacement`]).
    Replace,
}

impl Step {
    /// A delta (or an adoption's difference) as one nfnetlink transaction. It fails
    /// only on what kproxy never writes: a transaction holds the record's objects, and
    /// what it deletes is named. (Not `nft -f`: nft 1.0.6 refuses a rule on a `typeof`
    /// map it did not declare in the same batch, "conflicting protocols specified: ip
    /// vs. th", so a repair refilling a dispatch chain failed through it.)
    fn of(tx: Transaction) -> Result<Step, NftError> {
        Ok(Step::Netlink(netlink::Batch::transaction(&tx)?))
    }
}

/// The one transaction that replaces both tables with the records' (each table created
/// then deleted, so the delete succeeds whether or not it existed, then created with
/// everything: [`crate::record::full_transaction_of`]), encoded as one nfnetlink batch,
/// the Services' elements typed and encoded piece by piece
/// ([`FamilyRecord::element_pieces`]) so they are never held typed all at once. What
/// it counts beside it.
#[cfg(any(test, feature = "internals"))]
pub fn replacement(recs: &[FamilyRecord; 2]) -> Result<(netlink::Batch, model::Counts), NftError> {
    replacement_with(recs, &mut |_| {})
}

/// [`replacement`], each table's structure handed to `fill` before it is encoded (the
/// counters stamped).
pub(crate) fn replacement_with(
    recs: &[FamilyRecord; 2],
    fill: &mut dyn FnMut(&mut Transaction),
) -> Result<(netlink::Batch, model::Counts), NftError> {
    let mut batch = netlink::Batch::default();
    let mut counts = model::Counts::default();
    for rec in recs {
        let (family, name) = rec.table();
        let mut tx = Transaction::clearing(family, name);
        tx.extend(Transaction::create(rec.assemble_structure()));
        fill(&mut tx);
        counts.add(&tx.counts);
        batch.extend(&tx)?;
        counts.elements_added += rec
            .element_pieces(crate::first_sync::ELEMENTS_PER_PIECE, &mut |piece| {
                batch.extend(&piece)
            })?;
    }
    Ok((batch, counts))
}

/// Removes everything kproxy made (both tables); succeeds when they are absent. Two
/// nfnetlink transactions ([`delete_tables`]).
pub fn cleanup(cfg: &DataplaneConfig) -> Result<(), NftError> {
    cfg.validate()?;
    delete_tables(&[
        (model::Family::Ip, cfg.table.as_str()),
        (model::Family::Ip6, cfg.table.as_str()),
    ])
}

/// Deletes the tables `tables` (family, name), whether or not they exist (each is
/// added, then deleted, as `nft` would be told `add table`, `delete table`): `kproxy
/// cleanup`, and the takeover's removal of kube-proxy's tables. In the calling thread's
/// network namespace.
///
/// Two transactions: the tables turn dormant (their hooks go), then they are deleted.
/// Deleted in one step, a table is not gone at once for a packet already inside its
/// chains: the kernel can show that packet the chains' rules with the verdict maps'
/// elements already deactivated, so a `service-ips` lookup misses and the cluster-IP
/// reject below it refuses a connection the other proxy, whose rules are in place,
/// would have served (`tests/packets.rs`,
/// `cleanup_with_another_proxy_in_place_refuses_nothing`). A dormant table keeps every
/// rule and element for the packets still in it, and no new packet enters it.
pub fn delete_tables(tables: &[(model::Family, &str)]) -> Result<(), NftError> {
    // `add table` with the dormant flag in both: it creates an absent table, and it
    // does not wake the table in the deleting transaction (an `add table` without the
    // flag would, and packets would enter it again while it is deleted).
    let mut dormant = Transaction::default();
    for (family, table) in tables {
        dormant.ops.push(model::Op::AddTable {
            family: *family,
            table: table.to_string(),
            comment: None,
            dormant: true,
        });
    }
    let mut delete = dormant.clone();
    for (family, table) in tables {
        delete.ops.push(model::Op::DeleteTable {
            family: *family,
            table: table.to_string(),
        });
    }
    let mut w = netlink::Writer::open()?;
    w.send(netlink::Batch::transaction(&dormant)?)?;
    w.send(netlink::Batch::transaction(&delete)?)
}
