//! The in-memory record of what is programmed, per family, kept so that a sync costs
//! work proportional to what changed: the base objects (rebuilt every sync; cheap), one
//! fragment per Service with a port of the family, with its `Arc<ServicePlan>` (rebuilt
//! only when the planner's update names the Service; the Service's shared elements are
//! derived from that plan), how many times the fragments hold every shared set element (a
//! hairpin pair or a cluster IP may come from several Services; it is programmed while
//! any does), the claimants of every frontend (a colliding frontend takes all its
//! elements from the first Service in plan order, as in a full render), and how many
//! Services use each dispatch group (its map and chain exist while one does, and stay
//! a while idle after: [`IDLE_DISPATCH_GROUPS`]).
//!
//! It is the dataplane's largest long-lived data (≈ 106k elements at 10k Services ×
//! 10 endpoints), so elements are held once: a frontend's typed and compact (its key
//! once, each dispatch row as its endpoint's address and port) and shared by `Arc`
//! between its fragment and its claim, shared ones as addresses, and the elements
//! themselves (a key with its row index, a value) are made when a transaction is built: for a delta the
//! touched elements by [`FamilyRecord::advance`]; for a whole table by one walk over the
//! Services' elements (`walk_elements`) into one of two sinks — typed, in pieces
//! ([`FamilyRecord::element_pieces`]: the first sync into absent tables, adoption's and
//! verification's comparison with the kernel, [`FamilyRecord::assemble`] and
//! [`FamilyRecord::create`] for tools and tests, [`desired`], and a replacing sync's
//! batch). The structure (base objects, Services' own chains and sets,
//! dispatch groups) is [`FamilyRecord::assemble_structure`] for every one of them.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use kproxy_core::NodePlan;
use kproxy_core::model::{IpFamily, ServiceName};
use kproxy_core::plan::ServicePlan;
use kproxy_core::planner::PlanUpdate;

use crate::config::DataplaneConfig;
use crate::error::NftError;
use crate::model::{
    self, Elem, ElementDiff, Family, Op, SetDecl, Table, Transaction, Tuple, TypedElements, Value,
};
use crate::ruleset::{self, Dispatch, Fragment, Frontend, SetRef, Shared};

/// The Services claiming one frontend, in plan order, each with the frontend's elements
/// from its fragment. Almost every frontend has exactly one claimant, so this is a
/// sorted `Vec` of exact capacity rather than a `BTreeMap` (a 500-byte node each).
#[derive(Clone, Debug, Default)]
struct Claims(Vec<(ServiceName, Arc<Frontend>)>);

impl Claims {
    fn insert(&mut self, name: &ServiceName, fe: &Arc<Frontend>) {
        match self.0.binary_search_by(|(n, _)| n.cmp(name)) {
            Ok(i) => self.0[i].1 = fe.clone(),
            Err(i) => {
                if self.0.capacity() == 0 {
                    self.0.reserve_exact(1);
                }
                self.0.insert(i, (name.clone(), fe.clone()));
            }
        }
    }

    fn remove(&mut self, name: &ServiceName) {
        if let Ok(i) = self.0.binary_search_by(|(n, _)| n.cmp(name)) {
            self.0.remove(i);
        }
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The elements of the first claimant: those programmed.
    fn first(&self) -> Option<&Arc<Frontend>> {
        self.0.first().map(|(_, fe)| fe)
    }
}

#[derive(Clone, Debug)]
pub struct FamilyRecord {
    family: IpFamily,
    base: Table,
    services: BTreeMap<ServiceName, (Arc<ServicePlan>, Fragment)>,
    /// Shared element → how many times the fragments hold it (never 0).
    shared: BTreeMap<Shared, u32>,
    /// Frontend name → the Services claiming it, with its elements from each.
    frontends: BTreeMap<Box<str>, Claims>,
    /// Dispatch group → number of Services using it (0: idle, kept).
    dispatch: BTreeMap<Dispatch, usize>,
    /// The idle dispatch groups, the longest idle first: at most
    /// [`IDLE_DISPATCH_GROUPS`] after each `advance`.
    idle: VecDeque<Dispatch>,
    /// The traffic counters are on (`DataplaneConfig::counters`): each Service's
    /// counters ([`ruleset::counters`], derived from its plan) are in the table.
    counters: bool,
    /// How many maps each dispatch group is split into: the full sync's plan's, kept
    /// while the record moves ([`ruleset::Shards`]).
    shards: ruleset::Shards,
}

/// How many dispatch groups no Service uses any more stay in the tables, per family,
/// for the next Service whose endpoint count takes them again. While a Deployment
/// rolls, its Services' endpoint counts go N → N−1 → N → …: with the group of each
/// count kept, every such step is an element-only delta (one nfnetlink batch, ≈ 1 ms)
/// instead of a structural one (a map, a chain and a rule created or deleted: 12–26
/// ms when it went through `nft`, 0.3–6 ms over nfnetlink, crates/nft/BENCHMARKS.md),
/// which is also the window in which a flush by another process meets a delta in
/// flight. Each idle group costs one empty map, one chain and one rule, which every
/// read-back of the tables reads; past this many, the longest idle goes. A full sync (a start, an adoption, a
/// replacement) builds the record afresh, without idle groups.
pub const IDLE_DISPATCH_GROUPS: usize = 16;

impl FamilyRecord {
    /// The record of a full sync of `plan`.
    pub fn full(plan: &NodePlan, cfg: &DataplaneConfig, family: IpFamily) -> FamilyRecord {
        let shards = ruleset::Shards::of(plan, family);
        let mut r = FamilyRecord {
            family,
            base: ruleset::build_base(plan, cfg, family, &shards),
            services: BTreeMap::new(),
            shared: BTreeMap::new(),
            frontends: BTreeMap::new(),
            dispatch: BTreeMap::new(),
            idle: VecDeque::new(),
            counters: cfg.counters,
            shards,
        };
        // A Service without a port of this family has nothing here (an IPv4-only
        // cluster's IPv6 record would otherwise hold 10k empty fragments); `advance`
        // takes a Service it does not hold as one that had nothing.
        let services: Vec<_> = plan
            .services
            .iter()
            .filter(|(_, svc)| ruleset::has_family(svc, family))
            .collect();
        let frags = build_fragments(&services, plan, cfg, family, &r.shards);
        // The same maps `add_shared` would build Service by Service, built in bulk from
        // sorted vectors (a third of the time at 10k Services).
        let mut shared = Vec::new();
        let mut frontends = Vec::new();
        for ((name, svc), frag) in services.iter().zip(&frags) {
            for fe in &frag.frontends {
                frontends.push((fe.name(), *name, fe));
            }
            for d in &frag.dispatch {
                *r.dispatch.entry(*d).or_default() += 1;
            }
            shared.extend(ruleset::shared(svc, family));
        }
        shared.sort_unstable();
        let mut counted: Vec<(Shared, u32)> = Vec::new();
        for sh in shared {
            match counted.last_mut() {
                Some((last, n)) if *last == sh => *n += 1,
                _ => counted.push((sh, 1)),
            }
        }
        r.shared = counted.into_iter().collect();
        // A stable sort keeps plan (claimant) order within a frontend, as `add_shared`.
        frontends.sort_by(|a, b| a.0.cmp(b.0));
        r.frontends = group(frontends.into_iter().map(|(fe, name, e)| (fe, (name, e))))
            .map(|(fe, claims)| {
                let claims = claims
                    .into_iter()
                    .map(|(name, e)| (name.clone(), e.clone()));
                (fe.into(), Claims(claims.collect()))
            })
            .collect();
        r.services = services
            .into_iter()
            .zip(frags)
            .map(|((name, svc), frag)| (name.clone(), (svc.clone(), frag)))
            .collect();
        r
    }

    /// The whole table, typed: the desired state of a full sync (tools and tests;
    /// verification and adoption compare the kernel with the walk's pieces instead).
    pub fn assemble(&self) -> Table {
        let (mut rs, elements) = self.parts();
        for (name, elems) in elements {
            let Some(s) = rs.sets.get_mut(&name) else {
                continue;
            };
            // A key twice keeps its first value.
            if s.elements.is_empty() {
                s.elements = elems.into_iter().map(|e| (e.key, e.value)).collect();
            } else {
                for e in elems {
                    s.elements.entry(e.key).or_insert(e.value);
                }
            }
        }
        rs
    }

    /// The transaction that creates the whole table: `Transaction::create(self.assemble())`
    /// (a test holds them equal), with each set's Service elements moved from their
    /// sorted vectors into the operations instead of through the table's maps. A full
    /// sync's largest transient is its ≈ 106k elements (10k × 10); this holds them once.
    pub fn create(&self) -> Transaction {
        let (rs, elements) = self.parts();
        Transaction::create_with(rs, elements)
    }

    /// [`FamilyRecord::create`] after the header that deletes the table if it exists
    /// (`Transaction::replace(self.assemble())`).
    pub fn replace(&self) -> Transaction {
        let mut tx = Transaction::clearing(self.base.family, &self.base.name);
        tx.extend(self.create());
        tx
    }

    /// The table's structure ([`FamilyRecord::assemble_structure`]) and, per set name,
    /// the Services' elements of that set, sorted by key, one per key: every piece of
    /// [`FamilyRecord::element_pieces`] collected (the walk a first sync and adoption
    /// take, here into one typed collection).
    fn parts(&self) -> (Table, BTreeMap<String, Vec<Elem>>) {
        let rs = self.assemble_structure();
        let mut out: BTreeMap<String, Vec<Elem>> = BTreeMap::new();
        let collected = self.element_pieces::<std::convert::Infallible>(usize::MAX, &mut |tx| {
            for op in tx.ops {
                if let Op::AddElements { set, elems, .. } = op {
                    match out.get_mut(&set) {
                        Some(v) => v.extend(elems),
                        None => {
                            out.insert(set, elems);
                        }
                    }
                }
            }
            Ok(())
        });
        let Ok(_) = collected;
        for elems in out.values_mut() {
            // Keys are unique (a frontend's own, a shared element once); were one not,
            // ordering by value too keeps the choice deterministic.
            elems.sort_unstable();
            elems.dedup_by(|later, first| later.key == first.key);
        }
        (rs, out)
    }

    /// The Services' elements of the table (the frontends' and the shared sets'; not
    /// the structure's own, [`FamilyRecord::assemble_structure`]), typed, as
    /// transactions of `AddElements` of about `per_piece` elements each, handed to
    /// `piece` in turn until it fails. The elements of a first sync into absent tables,
    /// without ever holding them all: a whole table's typed elements were most of a full
    /// sync's transient memory (≈ 8 MiB at 10k × 10), and their nfnetlink batch as
    /// much again. Every key occurs once (a frontend's keys start with its own key,
    /// frontends are unique by name, shared elements are a map's keys), in no
    /// particular order (the sets are hashes; the pieces of one set go in the order the
    /// frontends are held). Returns the number of elements.
    pub fn element_pieces<E>(
        &self,
        per_piece: usize,
        piece: &mut dyn FnMut(Transaction) -> Result<(), E>,
    ) -> Result<usize, E> {
        let mut sink = PieceSink {
            pending: Pieces {
                family: self.base.family,
                table: &self.base.name,
                sets: BTreeMap::new(),
                len: 0,
                total: 0,
            },
            per_piece,
            piece,
        };
        self.walk_elements(&mut sink)?;
        if sink.pending.len > 0 {
            (sink.piece)(sink.pending.take())?;
        }
        Ok(sink.pending.total)
    }

    /// The one walk over the Services' elements of the table, behind every consumer of
    /// a full table's elements: each programmed frontend (its first claimant's
    /// elements), then each shared element, handed to `sink` — typed in pieces
    /// ([`FamilyRecord::element_pieces`]: a first sync, adoption, [`FamilyRecord::assemble`]).
    fn walk_elements<S: ElementSink>(&self, sink: &mut S) -> Result<(), S::Error> {
        let decls = self.service_decls();
        for fe in self.frontends.values().filter_map(Claims::first) {
            sink.frontend(fe, &decls)?;
        }
        for sh in self.shared.keys() {
            sink.shared(sh)?;
        }
        Ok(())
    }

    /// The declarations of the sets that hold frontends' elements and exist.
    fn service_decls(&self) -> BTreeMap<SetRef, SetDecl> {
        let fixed = [
            SetRef::ServiceIps,
            SetRef::ServiceNodeports,
            SetRef::MasqIps,
            SetRef::MasqIpsNonlocal,
            SetRef::MasqNodeports,
        ];
        let etp_local = ruleset::EtpLocal::KINDS.into_iter().flat_map(|k| {
            [false, true].map(|local| SetRef::EtpLocal {
                nodeport: k.nodeport,
                local,
            })
        });
        let dispatch = self.dispatch.keys().map(|d| SetRef::Map(*d));
        let count = ruleset::CountMap::ALL.into_iter().flat_map(|map| {
            [false, true].into_iter().flat_map(move |nodeport| {
                (0..map.shards(&self.shards)).map(move |shard| SetRef::Count {
                    map,
                    nodeport,
                    shard,
                })
            })
        });
        fixed
            .into_iter()
            .chain(etp_local)
            .chain(count)
            .chain(dispatch)
            .filter_map(|set| Some((set, self.decl(set)?)))
            .collect()
    }

    /// The names of the traffic counters the table holds (none when they are off): what
    /// a reading asks the kernel for by name (`crate::dump::objects`).
    pub fn counter_names(&self) -> std::collections::BTreeSet<String> {
        let mut names: std::collections::BTreeSet<String> =
            self.base.counters.iter().cloned().collect();
        for svc in self.services.values().map(|(svc, _)| svc) {
            names.extend(ruleset::counters(svc, self.family, self.counters));
        }
        names
    }

    /// The whole table without the Services' elements of the shared sets and maps
    /// (the base sets' own elements included): everything a first sync's structure
    /// step needs, cheap.
    pub fn assemble_structure(&self) -> Table {
        let mut rs = self.base.clone();
        for (svc, frag) in self.services.values() {
            if let Some(own) = &frag.own {
                rs.add_own(own);
            }
            rs.counters
                .extend(ruleset::counters(svc, self.family, self.counters));
        }
        for d in self.dispatch.keys() {
            rs.add_dispatch(d);
        }
        rs
    }

    /// The elements of a frontend now: those of its first claimant.
    fn frontend_now(&self, fe: &str) -> Option<Arc<Frontend>> {
        self.frontends.get(fe).and_then(Claims::first).cloned()
    }

    fn add_shared(&mut self, name: &ServiceName, svc: &ServicePlan, frag: &Fragment) {
        for fe in &frag.frontends {
            match self.frontends.get_mut(fe.name()) {
                Some(claims) => claims.insert(name, fe),
                None => {
                    let mut claims = Claims::default();
                    claims.insert(name, fe);
                    self.frontends.insert(fe.name().into(), claims);
                }
            }
        }
        for d in &frag.dispatch {
            let users = self.dispatch.entry(*d).or_default();
            if *users == 0 {
                self.idle.retain(|i| i != d);
            }
            *users += 1;
        }
        for sh in ruleset::shared(svc, self.family) {
            *self.shared.entry(sh).or_default() += 1;
        }
    }

    fn remove_shared(&mut self, name: &ServiceName, svc: &ServicePlan, frag: &Fragment) {
        for fe in &frag.frontends {
            if let Some(claims) = self.frontends.get_mut(fe.name()) {
                claims.remove(name);
                if claims.is_empty() {
                    self.frontends.remove(fe.name());
                }
            }
        }
        for d in &frag.dispatch {
            if let Some(c) = self.dispatch.get_mut(d) {
                *c -= 1;
                if *c == 0 {
                    self.idle.push_back(*d);
                }
            }
        }
        for sh in ruleset::shared(svc, self.family) {
            if let Some(c) = self.shared.get_mut(&sh) {
                *c -= 1;
                if *c == 0 {
                    self.shared.remove(&sh);
                }
            }
        }
    }

    /// Dispatch groups in the tables that no Service uses.
    #[cfg(test)]
    pub fn idle_dispatch_groups(&self) -> usize {
        self.idle.len()
    }

    /// The Services this record holds (those with a port of its family).
    pub fn services(&self) -> impl Iterator<Item = &ServiceName> {
        self.services.keys()
    }

    /// `(family, table)` of this record's table.
    pub fn table(&self) -> (Family, &str) {
        (self.base.family, &self.base.name)
    }

    /// The declaration of a set that holds Service elements (the base sets and the
    /// dispatch maps); `None` when it does not exist.
    fn decl(&self, set: SetRef) -> Option<SetDecl> {
        match set {
            SetRef::Map(d) => Some(d.objects(self.family).0.decl),
            _ => self
                .base
                .sets
                .get(set.name().as_ref())
                .map(|s| s.decl.clone()),
        }
    }

    /// Moves the record to `plan`, in which the Services `changed` (and only those; no
    /// other Service is looked at) differ from the record's, and returns the transaction
    /// that moves the kernel along: [`model::diff`] of the base objects, of each changed Service's own chains
    /// and sets, of the dispatch groups that appear or go, and the element changes of
    /// the shared sets and frontends, ordered by [`Transaction::order`]. `Ok(None)` when
    /// only a full sync can apply the change (a declaration changed); the record is
    /// then unusable (as it is after an error: a diff refused its tables).
    pub fn advance(
        &mut self,
        plan: &NodePlan,
        changed: &[ServiceName],
        cfg: &DataplaneConfig,
    ) -> Result<Option<Transaction>, NftError> {
        let new_base = ruleset::build_base(plan, cfg, self.family, &self.shards);
        let mut tx = model::diff(&self.base, &new_base)?;
        if tx.replaces {
            return Ok(None);
        }
        let empty = Fragment::default();
        let no_own = ruleset::Own::default();
        self.base = new_base;
        let (fam, t) = (self.base.family, self.base.name.clone());

        // Shared elements → present before; frontends → their elements before.
        let mut touched: BTreeMap<Shared, bool> = BTreeMap::new();
        let mut touched_fe: BTreeMap<Box<str>, Option<Arc<Frontend>>> = BTreeMap::new();
        let mut touched_disp: BTreeMap<Dispatch, bool> = BTreeMap::new();
        for name in changed {
            let old = self.services.remove(name);
            let new = plan
                .services
                .get(name)
                .filter(|svc| ruleset::has_family(svc, self.family))
                .map(|svc| {
                    (
                        svc.clone(),
                        ruleset::build_service(svc, plan, cfg, self.family, &self.shards),
                    )
                });
            let old_frag = old.as_ref().map(|(_, f)| f).unwrap_or(&empty);
            let new_frag = new.as_ref().map(|(_, f)| f).unwrap_or(&empty);
            // As tables for the diff (a changed Service's one or two chains).
            let old_own = old_frag.own.as_deref().unwrap_or(&no_own);
            let new_own = new_frag.own.as_deref().unwrap_or(&no_own);
            let own = model::diff(&old_own.to_table(fam, &t), &new_own.to_table(fam, &t))?;
            if own.replaces {
                return Ok(None);
            }
            tx.extend(own);
            // Its counters: created with it, deleted with it, never rewritten between.
            let counters_of = |svc: Option<&Arc<ServicePlan>>| {
                let mut tb = Table::new(fam, &t);
                if let Some(svc) = svc {
                    tb.counters
                        .extend(ruleset::counters(svc, self.family, self.counters));
                }
                tb
            };
            let old_counters = counters_of(old.as_ref().map(|(svc, _)| svc));
            let new_counters = counters_of(new.as_ref().map(|(svc, _)| svc));
            tx.extend(model::diff(&old_counters, &new_counters)?);
            let old_shared = old
                .iter()
                .flat_map(|(svc, _)| ruleset::shared(svc, self.family));
            let new_shared = new
                .iter()
                .flat_map(|(svc, _)| ruleset::shared(svc, self.family));
            for sh in old_shared.chain(new_shared) {
                let before = self.shared.contains_key(&sh);
                touched.entry(sh).or_insert(before);
            }
            for fe in old_frag.frontends.iter().chain(&new_frag.frontends) {
                if !touched_fe.contains_key(fe.name()) {
                    let before = self.frontend_now(fe.name());
                    touched_fe.insert(fe.name().into(), before);
                }
            }
            for d in old_frag.dispatch.iter().chain(&new_frag.dispatch) {
                if !touched_disp.contains_key(d) {
                    touched_disp.insert(*d, self.dispatch.contains_key(d));
                }
            }
            if let Some((svc, f)) = &old {
                self.remove_shared(name, svc, f);
            }
            if let Some((svc, f)) = new {
                self.add_shared(name, &svc, &f);
                self.services.insert(name.clone(), (svc, f));
            }
        }

        // Past the cap once every Service moved (a group one leaves and another takes
        // is not idle), the longest idle groups leave the tables.
        while self.idle.len() > IDLE_DISPATCH_GROUPS {
            let longest = self.idle.pop_front().expect("over the cap");
            self.dispatch.remove(&longest);
            touched_disp.entry(longest).or_insert(true);
        }
        // Dispatch groups that appear or go with these Services: the diff of a table
        // holding the group and one without it.
        for (d, before) in touched_disp {
            let after = self.dispatch.contains_key(&d);
            if before == after {
                continue;
            }
            let with = |present: bool| {
                let mut tb = Table::new(fam, &t);
                if present {
                    tb.add_dispatch(&d);
                }
                tb
            };
            tx.extend(model::diff(&with(before), &with(after))?);
        }

        // Elements whose effective value changed: the touched part of each set before
        // and after, through diff's element step.
        let mut before_sets: BTreeMap<String, BTreeMap<Tuple, Option<Value>>> = BTreeMap::new();
        let mut after_sets: BTreeMap<String, Vec<Elem>> = BTreeMap::new();
        for (sh, before) in touched {
            let after = self.shared.contains_key(&sh);
            if before == after {
                continue;
            }
            let set = sh.set().to_string();
            if before {
                before_sets.entry(set).or_default().insert(sh.tuple(), None);
            } else {
                let e = Elem {
                    key: sh.tuple(),
                    value: None,
                };
                after_sets.entry(set).or_default().push(e);
            }
        }
        let mut decls: BTreeMap<SetRef, Option<SetDecl>> = BTreeMap::new();
        for (fe, before) in touched_fe {
            let after = self.frontend_now(&fe);
            if let (Some(b), Some(a)) = (&before, &after)
                && Arc::ptr_eq(b, a)
            {
                continue;
            }
            let mut typed = |fe: &Option<Arc<Frontend>>| {
                let Some(fe) = fe else { return Vec::new() };
                for (set, ..) in fe.elements() {
                    decls.entry(set).or_insert_with(|| self.decl(set));
                }
                // A set that does not exist takes no elements (as in `assemble`).
                fe.typed_elements(|set| decls.get(&set).and_then(|d| d.as_ref()))
            };
            for (set, e) in typed(&before) {
                let old = before_sets.entry(set.name().into_owned()).or_default();
                old.entry(e.key).or_insert(e.value);
            }
            for (set, e) in typed(&after) {
                after_sets
                    .entry(set.name().into_owned())
                    .or_default()
                    .push(e);
            }
        }
        let mut dels: BTreeMap<String, Vec<Tuple>> = BTreeMap::new();
        let mut adds: BTreeMap<String, Vec<Elem>> = BTreeMap::new();
        let names: BTreeSet<String> = before_sets
            .keys()
            .chain(after_sets.keys())
            .cloned()
            .collect();
        for set in names {
            let old = before_sets.remove(&set).unwrap_or_default();
            let mut d = ElementDiff::new(TypedElements::owned(old));
            after_sets
                .remove(&set)
                .into_iter()
                .flatten()
                .for_each(|e| d.offer(e));
            let (del, add) = d.finish().map_err(NftError::Invalid)?;
            if !del.is_empty() {
                dels.insert(set.clone(), del);
            }
            if !add.is_empty() {
                adds.insert(set, add);
            }
        }
        // A set deleted by this transaction takes its elements with it (as `diff` has it).
        let gone: BTreeSet<String> = tx
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::DeleteSet { name, .. } => Some(name.clone()),
                _ => None,
            })
            .collect();
        dels.retain(|set, _| !gone.contains(set));
        for (set, keys) in dels {
            tx.counts.elements_deleted += keys.len();
            tx.ops.push(Op::DeleteElements {
                family: fam,
                table: t.clone(),
                set,
                keys,
            });
        }
        for (set, elems) in adds {
            tx.counts.elements_added += elems.len();
            tx.ops.push(Op::AddElements {
                family: fam,
                table: t.clone(),
                set,
                elems,
            });
        }
        tx.order();
        Ok(Some(tx))
    }
}

/// The set of an element of [`FamilyRecord::element_pieces`].
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PieceSet {
    Frontend(SetRef),
    Shared(&'static str),
}

/// Where [`FamilyRecord::walk_elements`] hands the Services' elements.
trait ElementSink {
    type Error;
    /// A programmed frontend; its elements of sets that do not exist (not in `decls`)
    /// are nobody's.
    fn frontend(
        &mut self,
        fe: &Frontend,
        decls: &BTreeMap<SetRef, SetDecl>,
    ) -> Result<(), Self::Error>;
    /// An element of a shared set.
    fn shared(&mut self, sh: &Shared) -> Result<(), Self::Error>;
}

/// The elements typed, in transactions of about `per_piece` elements.
struct PieceSink<'a, 'p, E> {
    pending: Pieces<'a>,
    per_piece: usize,
    piece: &'p mut dyn FnMut(Transaction) -> Result<(), E>,
}

impl<E> PieceSink<'_, '_, E> {
    fn hand_out_if_full(&mut self) -> Result<(), E> {
        if self.pending.len >= self.per_piece {
            (self.piece)(self.pending.take())?;
        }
        Ok(())
    }
}

impl<E> ElementSink for PieceSink<'_, '_, E> {
    type Error = E;

    fn frontend(&mut self, fe: &Frontend, decls: &BTreeMap<SetRef, SetDecl>) -> Result<(), E> {
        for (set, e) in fe.typed_elements(|set| decls.get(&set)) {
            self.pending.push(PieceSet::Frontend(set), e);
        }
        self.hand_out_if_full()
    }

    fn shared(&mut self, sh: &Shared) -> Result<(), E> {
        let e = Elem {
            key: sh.tuple(),
            value: None,
        };
        self.pending.push(PieceSet::Shared(sh.set()), e);
        self.hand_out_if_full()
    }
}

/// The elements of the piece being filled, per set.
struct Pieces<'a> {
    family: Family,
    table: &'a str,
    sets: BTreeMap<PieceSet, Vec<Elem>>,
    /// Elements held now, and handed out so far.
    len: usize,
    total: usize,
}

impl Pieces<'_> {
    fn push(&mut self, set: PieceSet, e: Elem) {
        self.sets.entry(set).or_default().push(e);
        self.len += 1;
    }

    /// The piece so far, as one transaction; empties it.
    fn take(&mut self) -> Transaction {
        let mut tx = Transaction::default();
        for (set, elems) in std::mem::take(&mut self.sets) {
            let set = match set {
                PieceSet::Frontend(s) => s.name().into_owned(),
                PieceSet::Shared(s) => s.to_string(),
            };
            tx.counts.elements_added += elems.len();
            tx.ops.push(Op::AddElements {
                family: self.family,
                table: self.table.to_string(),
                set,
                elems,
            });
        }
        self.total += self.len;
        self.len = 0;
        tx
    }
}

/// Runs of equal keys of a sorted iterator, with their values in order.
fn group<K: PartialEq, V>(
    sorted: impl Iterator<Item = (K, V)>,
) -> impl Iterator<Item = (K, Vec<V>)> {
    let mut it = sorted.peekable();
    std::iter::from_fn(move || {
        let (k, v) = it.next()?;
        let mut vs = vec![v];
        while let Some((_, v)) = it.next_if(|(k2, _)| *k2 == k) {
            vs.push(v);
        }
        Some((k, vs))
    })
}

/// The fragments of `services`, in order, built on every core: each is a pure function
/// of its Service, and building them is most of a full sync's own work (0.5 s at 10k
/// Services × 10 endpoints on one core).
fn build_fragments(
    services: &[(&ServiceName, &Arc<ServicePlan>)],
    plan: &NodePlan,
    cfg: &DataplaneConfig,
    family: IpFamily,
    shards: &ruleset::Shards,
) -> Vec<Fragment> {
    let build = |c: &[(&ServiceName, &Arc<ServicePlan>)]| -> Vec<Fragment> {
        c.iter()
            .map(|(_, svc)| ruleset::build_service(svc, plan, cfg, family, shards))
            .collect()
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    if threads == 1 || services.len() < 512 {
        return build(services);
    }
    std::thread::scope(|s| {
        let parts: Vec<_> = services
            .chunks(services.len().div_ceil(threads))
            .map(|c| s.spawn(move || build(c)))
            .collect();
        parts
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Both families' records of a full sync of `plan`.
pub(crate) fn records(plan: &NodePlan, cfg: &DataplaneConfig) -> [FamilyRecord; 2] {
    IpFamily::ALL.map(|f| FamilyRecord::full(plan, cfg, f))
}

/// The desired state of kproxy's tables for a plan (IPv4, IPv6): the records of a full
/// sync, assembled. Pure.
pub fn desired(plan: &NodePlan, cfg: &DataplaneConfig) -> [Table; 2] {
    records(plan, cfg).map(|r| r.assemble())
}

/// The full sync's transaction for a plan, as nft text (what `sync` sends, as one
/// nfnetlink batch, when the tables exist and cannot be adopted; into absent tables it
/// sends the same objects in steps). For golden tests, the sameness test (`nft -f` of
/// it lists as kproxy's own writes) and benches; operators see
/// [`crate::readback::first_sync_transaction`] (`kproxy sync --dry-run`).
#[cfg(feature = "internals")]
pub fn render(plan: &NodePlan, cfg: &DataplaneConfig) -> String {
    full_transaction_of(&records(plan, cfg)).nft_text()
}

/// A delta sync's transaction: moves both families' records to `plan` by the Services
/// `update` names (every Service the plan or the records hold when `update.node`), by
/// [`FamilyRecord::advance`]. `Ok(None)` when only a full sync can apply the change
/// (a declaration changed); the records are then unusable, as after an error. Pure;
/// a test holds it equal to `model::diff` of the whole tables before and after (the
/// dataplane names the Services once, [`delta_by`]).
#[cfg(feature = "internals")]
pub fn delta(
    recs: &mut [FamilyRecord; 2],
    plan: &NodePlan,
    update: &PlanUpdate,
    cfg: &DataplaneConfig,
) -> Result<Option<Transaction>, NftError> {
    let changed = changed_services(recs, plan, update);
    delta_by(recs, plan, &changed, cfg)
}

/// The Services a delta moves the records by: what `update` says to revisit
/// ([`PlanUpdate::revisit`]), every Service the plan or the records hold when that is
/// the whole plan.
pub(crate) fn changed_services(
    recs: &[FamilyRecord; 2],
    plan: &NodePlan,
    update: &PlanUpdate,
) -> Vec<ServiceName> {
    update
        .revisit(true)
        .names(plan, recs.iter().flat_map(|rec| rec.services()))
}

/// [`delta`] by the Services already named.
pub(crate) fn delta_by(
    recs: &mut [FamilyRecord; 2],
    plan: &NodePlan,
    changed: &[ServiceName],
    cfg: &DataplaneConfig,
) -> Result<Option<Transaction>, NftError> {
    let mut tx = Transaction::default();
    for rec in recs.iter_mut() {
        match rec.advance(plan, changed, cfg)? {
            Some(d) => tx.extend(d),
            None => return Ok(None),
        }
    }
    tx.order();
    Ok(Some(tx))
}

/// The one transaction a full sync sends when the tables may exist: each family's
/// table replaced (created, deleted, created again with everything), no gap; built
/// from the records without the tables' element maps ([`FamilyRecord::create`]). What
/// a replacing full sync sends (encoded from the records, `dataplane::replacement`), as
/// a transaction, for `sync --dry-run` and tests.
pub fn full_transaction_of(recs: &[FamilyRecord; 2]) -> Transaction {
    let mut tx = recs[0].replace();
    tx.extend(recs[1].replace());
    tx
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kproxy_core::PlanConfig;
    use kproxy_core::config::LocalDetectorConfig;
    use kproxy_core::synthetic::{self, Spec};

    /// A dispatch group whose last Service left stays, idle, for the next change back
    /// to its endpoint count (then elements only); past [`IDLE_DISPATCH_GROUPS`] the
    /// longest idle goes, deleted by the delta that pushed it out, so the record and
    /// the kernel stay one table.
    #[test]
    fn idle_dispatch_groups_stay_the_most_recent_up_to_their_cap() {
        let cfg = DataplaneConfig::default();
        let plan_with = |endpoints: usize| {
            let spec = Spec {
                etp_local_every: 0,
                terminating_every: 0,
                hinted_every: 0,
                ..Spec::new(1, endpoints)
            };
            kproxy_core::plan(&synthetic::cluster(&spec), "node-0", &PlanConfig::default())
        };
        let first = plan_with(1);
        let mut rec = FamilyRecord::full(&first, &cfg, IpFamily::IPv4);
        let names: Vec<ServiceName> = first.services.keys().cloned().collect();
        let structure = |tx: &Transaction| {
            tx.ops
                .iter()
                .filter(|op| !matches!(op, Op::AddElements { .. } | Op::DeleteElements { .. }))
                .count()
        };
        let mut table = rec.assemble();
        for n in 2..=40 {
            let plan = plan_with(n);
            let tx = rec.advance(&plan, &names, &cfg).unwrap().unwrap();
            assert!(structure(&tx) > 0, "{n}: a new group is created");
            assert!(rec.idle_dispatch_groups() <= IDLE_DISPATCH_GROUPS);
            // The delta moves the kernel's table to the record's, evicted groups too.
            let after = rec.assemble();
            let sorted = |tx: &Transaction| {
                let mut ops: Vec<String> = tx.ops.iter().map(|op| format!("{op:?}")).collect();
                ops.sort();
                ops
            };
            let whole = model::diff(&table, &after).unwrap();
            assert_eq!(sorted(&whole), sorted(&tx), "{n}");
            table = after;
        }
        assert_eq!(rec.idle_dispatch_groups(), IDLE_DISPATCH_GROUPS);
        // The most recent counts' groups are the idle ones: back to one, elements only.
        let tx = rec.advance(&plan_with(38), &names, &cfg).unwrap().unwrap();
        assert_eq!(structure(&tx), 0, "{:?}", tx.ops);
        // The oldest went: back to two endpoints creates its group again.
        let tx = rec.advance(&plan_with(2), &names, &cfg).unwrap().unwrap();
        assert!(structure(&tx) > 0, "{:?}", tx.ops);
    }

    /// A dispatch group of more rows than one map is sized for is split into maps of
    /// about [`ruleset::Shards::ROWS`] rows each (a read of one set back costs the
    /// kernel the square of its size), each frontend's verdict going to the chain of
    /// the map that holds its rows; a delta keeps a Service in its shard; a group that
    /// fits one map keeps its one name.
    #[test]
    fn a_big_dispatch_group_is_split_into_bounded_maps() {
        let cfg = DataplaneConfig::default();
        let spec = Spec {
            etp_local_every: 0,
            terminating_every: 0,
            hinted_every: 0,
            ..Spec::new(3000, 10)
        };
        let mut state = synthetic::cluster(&spec);
        let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
        let mut rec = FamilyRecord::full(&plan, &cfg, IpFamily::IPv4);
        let table = rec.assemble();
        let maps: Vec<(&String, usize)> = table
            .sets
            .iter()
            .filter(|(name, _)| name.starts_with("dnat-c-10"))
            .map(|(name, s)| (name, s.elements.len()))
            .collect();
        // 30,000 rows: four maps of ≈ 7,500.
        assert_eq!(maps.len(), 4, "{maps:?}");
        assert_eq!(maps.iter().map(|(_, n)| n).sum::<usize>(), 30_000);
        assert!(
            maps.iter().all(|(_, n)| *n <= 2 * ruleset::Shards::ROWS),
            "{maps:?}"
        );
        assert!(maps.iter().any(|(name, _)| *name == "dnat-c-10"));
        // Each frontend's verdict is the chain whose one rule reads the map holding its
        // rows.
        let service_ips = &table.sets["service-ips"].elements;
        for (map, _) in &maps {
            let chain = map.replace("dnat-", "disp-");
            let rule = format!("{:?}", table.chains[&chain].rules);
            assert!(rule.contains(&format!("map: \"{map}\"")), "{chain}: {rule}");
            for key in table.sets[*map].elements.keys() {
                let frontend = Tuple::new(&key.atoms()[..3]);
                assert_eq!(
                    service_ips.get(&frontend),
                    Some(&Some(Value::Verdict(model::Verdict::Goto(
                        chain.as_str().into()
                    )))),
                    "{key}"
                );
            }
        }
        // A Service whose endpoints change stays in its map: elements only.
        let names: Vec<ServiceName> = (0..50)
            .map(|i| ServiceName::new(format!("ns-{}", i % 50), format!("svc-{i}")))
            .collect();
        for i in 0..50u8 {
            let mut slice = synthetic::slice(&spec, usize::from(i), 0);
            slice.endpoints[0].ip = std::net::Ipv4Addr::new(10, 250, 0, i).into();
            state.upsert_slice(slice);
        }
        let moved = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
        let tx = rec.advance(&moved, &names, &cfg).unwrap().unwrap();
        assert!(
            tx.ops
                .iter()
                .all(|op| matches!(op, Op::AddElements { .. } | Op::DeleteElements { .. })),
            "{:?}",
            tx.ops
        );
        // A small group keeps its one map, named as before sharding.
        let small = kproxy_core::plan(
            &synthetic::cluster(&Spec::new(100, 10)),
            "node-0",
            &PlanConfig::default(),
        );
        let names: Vec<String> = FamilyRecord::full(&small, &cfg, IpFamily::IPv4)
            .assemble()
            .sets
            .into_keys()
            .filter(|n| n.contains("dnat-"))
            .collect();
        assert!(names.iter().all(|n| !n.contains("-s")), "{names:?}");
    }

    /// The bulk-built maps of `full` are those `add_shared` builds Service by Service.
    #[test]
    fn full_builds_the_maps_add_shared_would() {
        let state = synthetic::cluster(&Spec::new(300, 4));
        let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
        let cfg = DataplaneConfig::default();
        for family in IpFamily::ALL {
            let bulk = FamilyRecord::full(&plan, &cfg, family);
            let shards = ruleset::Shards::of(&plan, family);
            let mut one = FamilyRecord {
                family,
                base: ruleset::build_base(&plan, &cfg, family, &shards),
                services: BTreeMap::new(),
                shared: BTreeMap::new(),
                frontends: BTreeMap::new(),
                dispatch: BTreeMap::new(),
                idle: VecDeque::new(),
                counters: cfg.counters,
                shards,
            };
            for (name, svc) in &plan.services {
                if !ruleset::has_family(svc, family) {
                    continue;
                }
                let frag = ruleset::build_service(svc, &plan, &cfg, family, &one.shards);
                one.add_shared(name, svc, &frag);
                one.services.insert(name.clone(), (svc.clone(), frag));
            }
            assert_eq!(format!("{:?}", bulk.shared), format!("{:?}", one.shared));
            assert_eq!(
                format!("{:?}", bulk.frontends),
                format!("{:?}", one.frontends)
            );
            assert_eq!(bulk.dispatch, one.dispatch);
            assert_eq!(
                format!("{:?}", bulk.services),
                format!("{:?}", one.services)
            );
            assert!(family == IpFamily::IPv6 || !bulk.shared.is_empty());
        }
    }

    /// The pieces of a first sync into absent tables hold, together, exactly the
    /// Services' elements of the creating transaction, each once, in pieces of the
    /// size asked for.
    #[test]
    fn element_pieces_are_the_created_elements() {
        let state = synthetic::cluster(&Spec::new(200, 4));
        let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
        let cfg = DataplaneConfig::default();
        for family in IpFamily::ALL {
            let rec = FamilyRecord::full(&plan, &cfg, family);
            let elements = |tx: Transaction| {
                let mut out: Vec<(String, Elem)> = Vec::new();
                for op in tx.ops {
                    if let Op::AddElements { set, elems, .. } = op {
                        out.extend(elems.into_iter().map(|e| (set.clone(), e)));
                    }
                }
                out
            };
            let mut want = elements(rec.create());
            // Less the structure's own (a first sync sends them with the structure).
            let own = elements(Transaction::create(rec.assemble_structure()));
            want.retain(|e| !own.contains(e));
            let mut got = Vec::new();
            let mut sizes = Vec::new();
            let n = rec
                .element_pieces(37, &mut |tx| {
                    assert!(tx.elements_only());
                    assert_eq!(tx.counts.elements_added, elements(tx.clone()).len());
                    sizes.push(tx.counts.elements_added);
                    got.extend(elements(tx));
                    Ok::<(), ()>(())
                })
                .unwrap();
            assert_eq!(n, got.len());
            // A piece ends at a frontend's end: at least 37, fewer than 37 + a frontend's.
            if let Some((_, full)) = sizes.split_last() {
                assert!(full.iter().all(|n| (37..37 + 64).contains(n)), "{sizes:?}");
            }
            got.sort();
            want.sort();
            assert_eq!(got, want);
            assert!(family == IpFamily::IPv6 || got.len() > 37 * 10);
        }
    }

    /// The nft text written into a pipe piece by piece is the text rendered whole.
    #[test]
    fn streamed_text_is_the_whole_text() {
        let state = synthetic::cluster(&Spec::new(1500, 4));
        let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
        let cfg = DataplaneConfig::default();
        let recs = IpFamily::ALL.map(|f| FamilyRecord::full(&plan, &cfg, f));
        let tx = super::full_transaction_of(&recs);
        let whole = tx.nft_text();
        assert!(
            whole.len() > 4 * 65536,
            "{} bytes: several pieces",
            whole.len()
        );
        let mut piped = Vec::new();
        assert_eq!(tx.write_nft_to(&mut piped).unwrap(), whole.len());
        assert!(piped == whole.as_bytes());
    }

    /// The default config, and one whose local-pod detector makes an interval set.
    pub(crate) fn plan_configs() -> [PlanConfig; 2] {
        let cidr = LocalDetectorConfig::ClusterCidr(vec!["10.0.0.0/8".parse().unwrap()]);
        [
            PlanConfig::default(),
            PlanConfig {
                local_detector: cidr,
                ..PlanConfig::default()
            },
        ]
    }

    /// The transactions a record makes without its table's element maps are those of
    /// the assembled table, and the one that creates it splits into the structure with
    /// its tables dormant and the elements (all encodable but the interval set's).
    #[test]
    fn assembled_table_creates_as_made_and_splits_for_absent_tables() {
        for pc in plan_configs() {
            let state = synthetic::cluster(&Spec::new(60, 4));
            let plan = kproxy_core::plan(&state, "node-0", &pc);
            for family in IpFamily::ALL {
                let cfg = DataplaneConfig::default();
                let rec = FamilyRecord::full(&plan, &cfg, family);
                let table = rec.assemble();
                // A full sync's transaction, made without the table's element maps.
                assert_eq!(rec.create(), Transaction::create(table.clone()));
                assert_eq!(rec.replace(), Transaction::replace(table.clone()));
                let all = Transaction::replace(table.clone()).nft_text();
                assert!(family == IpFamily::IPv6 || all.contains("dnat-c-"), "{all}");

                let absent = Table::absent(table.family, &table.name);
                let create = model::diff(&absent, &table).unwrap();
                assert_eq!(create.counts, table.counts());
                let (structure, elements) = create.clone().dormant_for_absent_tables();
                let st = structure.nft_text();
                // Every table dormant, everything else as created: the hooked base
                // chains with the rest, hooked only when the tables are woken.
                let first = st.lines().next().unwrap();
                assert_eq!(
                    first,
                    format!(
                        "add table {} kproxy {{ comment \"{}\"; flags dormant; }}",
                        table.family.nft(),
                        Table::COMMENT
                    )
                );
                assert_eq!(st.lines().filter(|l| l.starts_with("add table")).count(), 1);
                let hooked = |t: &str| t.lines().filter(|l| l.contains(" hook ")).count();
                assert_eq!(hooked(&st), hooked(&all));
                assert!(hooked(&st) > 0);
                assert!(elements.elements_only());
                // The structure does not depend on the Services' elements (a first
                // sync loads it from the bare tables while it encodes those).
                let bare = model::diff(&absent, &rec.assemble_structure()).unwrap();
                let (bare_structure, _) = bare.dormant_for_absent_tables();
                assert_eq!(bare_structure.ops, structure.ops);
                assert_eq!(structure.ops.len() + elements.ops.len(), create.ops.len());
                // `local-pods` (an interval set) stays with the structure (that the
                // elements encode is `crate::first_sync`'s test, above the writer).
                let interval = table.sets.values().any(|s| s.decl.interval);
                assert_eq!(
                    st.contains("add element ip kproxy local-pods"),
                    interval && family == IpFamily::IPv4
                );
                assert!(family == IpFamily::IPv6 || !elements.is_empty());
            }
        }
    }
}
