//! The in-memory record of what is programmed, per family, kept so that a sync costs
//! work proportional to what changed: the base objects (rebuilt every sync; cheap), one
//! fragment per Service with a port of the family, with its `Arc<ServicePlan>` (rebuilt
//! only when the planner handed a different one; the Service's shared elements are
//! derived from that plan), how many times the fragments hold every shared set element (a
//! hairpin pair or a cluster IP may come from several Services; it is programmed while
//! any does), the claimants of every frontend (a colliding frontend takes all its
//! elements from the first Service in plan order, as in a full render), and how many
//! Services use each dispatch group (its map and chain exist while one does).
//!
//! It is the dataplane's largest long-lived data (≈ 176k elements at 10k Services ×
//! 10 endpoints), so elements are held once: a frontend's as one text shared by `Arc`
//! between its fragment and its claim (its keys made from its name), shared ones as
//! addresses, and nft names and keys are made when a script or batch is written.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::Arc;

use kproxy_core::NodePlan;
use kproxy_core::model::{IpFamily, ServiceName};
use kproxy_core::plan::ServicePlan;

use crate::DataplaneConfig;
use crate::netlink;
use crate::ruleset::{
    self, Chain, DeltaCounts, Dispatch, Fragment, Frontend, Ruleset, Set, SetRef, Shared,
};

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

/// The element changes of one family's delta, per set: keys deleted, then keys added
/// with their values (a changed value is a delete and an add).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ElementDelta {
    pub dels: BTreeMap<String, BTreeSet<String>>,
    pub adds: BTreeMap<String, BTreeMap<String, String>>,
}

impl ElementDelta {
    pub fn is_empty(&self) -> bool {
        self.dels.is_empty() && self.adds.is_empty()
    }

    /// As `nft -f` commands: deletes first, then adds.
    pub fn script(&self, fam: &str, t: &str, out: &mut String) {
        for (set, keys) in &self.dels {
            let keys = keys.iter().map(|k| (k.as_str(), ""));
            ruleset::elements(out, "delete", fam, t, set, keys, false);
        }
        for (set, kv) in &self.adds {
            ruleset::elements(out, "add", fam, t, set, ruleset::str_pairs(kv.iter()), true);
        }
    }

    /// As one part of an nfnetlink batch (deletes first, then adds); `None` when a set's
    /// type or an element is one the netlink writer does not encode.
    pub fn encode(&self, rec: &FamilyRecord, batch: &mut netlink::Batch) -> Option<()> {
        let (fam, t) = (rec.base.family, rec.base.table.as_str());
        for (set, keys) in &self.dels {
            let ty = rec.set_type(set)?;
            batch.elements(
                false,
                fam,
                t,
                set,
                &ty,
                keys.iter().map(|k| (k.as_str(), "")),
            )?;
        }
        for (set, kv) in &self.adds {
            let ty = rec.set_type(set)?;
            batch.elements(true, fam, t, set, &ty, ruleset::str_pairs(kv.iter()))?;
        }
        Some(())
    }
}

/// What [`FamilyRecord::write_full`] writes: the whole table as one script, or one of
/// the steps of a first sync.
enum Part<'a> {
    All(&'a mut String),
    Structure {
        out: &'a mut String,
        hooks: &'a mut String,
    },
    Elements(&'a mut netlink::Batch),
}

#[derive(Clone, Debug)]
pub struct FamilyRecord {
    family: IpFamily,
    base: Ruleset,
    services: BTreeMap<ServiceName, (Arc<ServicePlan>, Fragment)>,
    /// Shared element → how many times the fragments hold it (never 0).
    shared: BTreeMap<Shared, u32>,
    /// Frontend name → the Services claiming it, with its elements from each.
    frontends: BTreeMap<Box<str>, Claims>,
    /// Dispatch group → number of Services using it.
    dispatch: BTreeMap<Dispatch, usize>,
}

impl FamilyRecord {
    /// The record of a full sync of `plan`.
    pub fn full(plan: &NodePlan, cfg: &DataplaneConfig, family: IpFamily) -> FamilyRecord {
        let mut r = FamilyRecord {
            family,
            base: ruleset::build_base(plan, cfg, family),
            services: BTreeMap::new(),
            shared: BTreeMap::new(),
            frontends: BTreeMap::new(),
            dispatch: BTreeMap::new(),
        };
        // A Service without a port of this family has nothing here (an IPv4-only
        // cluster's IPv6 record would otherwise hold 10k empty fragments); `advance`
        // takes a Service it does not hold as one that had nothing.
        let services: Vec<_> = plan
            .services
            .iter()
            .filter(|(_, svc)| ruleset::has_family(svc, family))
            .collect();
        let frags = build_fragments(&services, plan, cfg, family);
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

    /// The whole table as one ruleset (for the full script and verification).
    pub fn assemble(&self) -> Ruleset {
        let mut rs = self.base.clone();
        for (_, frag) in self.services.values() {
            if let Some(own) = &frag.own {
                rs.add_own(own);
            }
        }
        for d in self.dispatch.keys() {
            rs.add_dispatch(d);
        }
        for sh in self.shared.keys() {
            if let Some(s) = rs.sets.get_mut(sh.set()) {
                s.elements.insert(sh.key(), String::new());
            }
        }
        for claims in self.frontends.values() {
            if let Some(fe) = claims.first() {
                rs.add_elements(fe);
            }
        }
        rs
    }

    /// The full table-replacing script of this record, written from references (the
    /// same text as `self.assemble().full_script(out)`, without copying every element
    /// into a `Ruleset` first). Returns the counts of a full sync.
    pub fn full_script(&self, out: &mut String) -> DeltaCounts {
        self.write_full(Part::All(out))
            .expect("a script takes every element")
    }

    /// The same table in steps, for when it does not exist yet: `full_structure` (the
    /// table, its sets, regular chains and rules, and the elements netlink does not
    /// encode into `out`; base chains and their rules into `hooks`), then
    /// `full_elements` (every other element). Sent as `out`, the batch, then `hooks`:
    /// traffic sees the table only once the last step adds the hooks, so each step may
    /// be its own transaction and the table is never seen half-written.
    pub fn full_structure(&self, out: &mut String, hooks: &mut String) -> DeltaCounts {
        self.write_full(Part::Structure { out, hooks })
            .expect("a script takes every element")
    }

    /// See [`FamilyRecord::full_structure`]. `None` when an element does not encode
    /// (the batch is then unusable).
    pub fn full_elements(&self, batch: &mut netlink::Batch) -> Option<DeltaCounts> {
        self.write_full(Part::Elements(batch))
    }

    fn write_full(&self, mut part: Part) -> Option<DeltaCounts> {
        let disp: Vec<(String, String, Set, Chain)> = self
            .dispatch
            .keys()
            .map(|d| {
                let (s, c) = d.objects(self.family);
                (d.map(), d.chain(), s, c)
            })
            .collect();
        // The keys of shared elements, written for this part (they are kept as
        // addresses): declared first, as the entries below borrow from it.
        let mut shared_text = String::new();
        // Likewise the keys of dispatch-map rows (made from their frontend's key).
        let mut row_text = String::new();
        // Per set: its declaration, its netlink type when this part sends its elements
        // by netlink, whether this part handles its elements, and the elements.
        type Elems<'a> = Vec<(&'a str, &'a str)>;
        type Entry<'a> = (&'a Set, Option<netlink::SetType>, bool, Elems<'a>);
        let mut entries: Vec<Entry> = Vec::new();
        // Set name → its entry.
        let mut sets: BTreeMap<&str, usize> = BTreeMap::new();
        let mut chains: BTreeMap<&str, &Chain> = BTreeMap::new();
        let (all, structure) = (
            matches!(part, Part::All(_)),
            matches!(part, Part::Structure { .. }),
        );
        fn add_set<'s>(s: &'s Set, all: bool, structure: bool) -> Entry<'s> {
            let ty = if all {
                None
            } else {
                netlink::SetType::parse(&s.decl)
            };
            // Whole script: every element; steps: by nft if it does not encode.
            let mine = all || (structure == ty.is_none());
            (s, ty, mine, Vec::new())
        }
        let own = self.services.values().filter_map(|(_, f)| f.own.as_deref());
        let own_sets = own.clone().flat_map(|o| o.sets.iter().map(|(n, s)| (n, s)));
        let own_chains = own.flat_map(|o| o.chains.iter().map(|(n, c)| (n, c)));
        for (name, c) in self.base.chains.iter().chain(own_chains) {
            chains.insert(name, c);
        }
        for (name, s) in self.base.sets.iter().chain(own_sets) {
            let mut e = add_set(s, all, structure);
            if e.2 {
                e.3 = ruleset::str_pairs(s.elements.iter()).collect();
            }
            sets.insert(name, entries.len());
            entries.push(e);
        }
        for (map, chain, s, c) in &disp {
            sets.insert(map, entries.len());
            entries.push(add_set(s, all, structure));
            chains.insert(chain, c);
        }
        let mut shared = Vec::with_capacity(self.shared.len());
        let mut last: Option<(&str, Option<usize>)> = None;
        for sh in self.shared.keys() {
            let i = match last {
                Some((s, i)) if s == sh.set() => i,
                _ => {
                    let i = sets.get(sh.set()).copied().filter(|&i| entries[i].2);
                    last = Some((sh.set(), i));
                    i
                }
            };
            if let Some(i) = i {
                shared.push((sh.text_order(), i, sh));
            }
        }
        // In text order where that is cheap (IPv4), so the sort below finds them sorted.
        shared.sort_unstable_by_key(|(order, ..)| *order);
        let mut ends = Vec::with_capacity(shared.len());
        for (_, i, sh) in shared {
            sh.write_key(&mut shared_text);
            ends.push((i, shared_text.len()));
        }
        let mut start = 0;
        for (i, end) in ends {
            entries[i].3.push((&shared_text[start..end], ""));
            start = end;
        }
        // The entry of each set that frontend elements name (found by name once per
        // set; elements come in runs of one set).
        let mut dest: BTreeMap<SetRef, Option<usize>> = BTreeMap::new();
        let mut run: Option<(SetRef, Option<usize>)> = None;
        // Row elements: their entry, where their key ends in `row_text`, their value.
        // Rows are the only elements of the dispatch maps, so adding them to their
        // entries after the others keeps each entry's order.
        let mut rows: Vec<(usize, usize, &str)> = Vec::new();
        for claims in self.frontends.values() {
            let Some(fe) = claims.first() else {
                continue;
            };
            for (set, key, v) in fe.elements() {
                let i = match run {
                    Some((s, i)) if s == set => i,
                    _ => {
                        let i = *dest
                            .entry(set)
                            .or_insert_with(|| sets.get(set.name().as_ref()).copied());
                        run = Some((set, i));
                        i
                    }
                };
                if let Some(i) = i
                    && entries[i].2
                {
                    if key.row.is_none() {
                        entries[i].3.push((key.base, v));
                    } else {
                        key.write(&mut row_text);
                        rows.push((i, row_text.len(), v));
                    }
                }
            }
        }
        let mut start = 0;
        for (i, end, v) in rows {
            entries[i].3.push((&row_text[start..end], v));
            start = end;
        }
        let (fam, t) = (self.base.family, self.base.table.as_str());
        let mut n = DeltaCounts::default();
        for (name, &i) in &sets {
            let (_, ty, mine, e) = &mut entries[i];
            if !*mine {
                continue;
            }
            // Sorted by key as in a `Ruleset`; a key twice keeps its first value.
            e.sort_by(|a, b| a.0.cmp(b.0));
            e.dedup_by(|a, b| a.0 == b.0);
            n.elements_added += e.len();
            if let (Part::Elements(batch), Some(ty)) = (&mut part, ty)
                && !e.is_empty()
            {
                batch.elements(true, fam, t, name, ty, e.iter().copied())?;
            }
        }
        let (out, mut hooks) = match part {
            Part::Elements(_) => return Some(n),
            Part::All(out) => (out, None),
            Part::Structure { out, hooks } => (out, Some(hooks)),
        };
        n.chains_added = chains.len();
        n.sets_added = sets.len();
        ruleset::full_header(out, fam, t);
        for (name, &i) in &sets {
            let s = entries[i].0;
            let _ = writeln!(
                out,
                "add {} {fam} {t} {name} {{ {} }}",
                ruleset::kind(s),
                s.decl
            );
        }
        // In steps, base chains (those with a hook) go to the last one.
        for (name, c) in &chains {
            let o = match &mut hooks {
                Some(h) if !c.decl.is_empty() => &mut **h,
                _ => &mut *out,
            };
            ruleset::decl_chain(o, fam, t, name, c);
        }
        for (name, c) in &chains {
            let o = match &mut hooks {
                Some(h) if !c.decl.is_empty() => &mut **h,
                _ => &mut *out,
            };
            for r in &c.rules {
                ruleset::write_rule(o, fam, t, name, r);
            }
        }
        for (name, &i) in &sets {
            let (_, _, mine, e) = &entries[i];
            if *mine {
                ruleset::elements(out, "add", fam, t, name, e.iter().copied(), true);
            }
        }
        Some(n)
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
            *self.dispatch.entry(*d).or_default() += 1;
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
                    self.dispatch.remove(d);
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

    /// `(family, table)` as nft names them (`ip`, `kproxy`).
    pub fn table(&self) -> (&'static str, &str) {
        (self.base.family, &self.base.table)
    }

    /// The element type of a set that holds Service elements (the base sets and the
    /// dispatch maps); `None` for any other.
    fn set_type(&self, name: &str) -> Option<netlink::SetType> {
        if let Some(s) = self.base.sets.get(name) {
            return netlink::SetType::parse(&s.decl);
        }
        let d = self.dispatch.keys().find(|d| d.map() == name)?;
        netlink::SetType::parse(&d.objects(self.family).0.decl)
    }

    /// Moves the record to `plan`, in which the Services `changed` (and only those)
    /// differ from the record's, writing the delta: declarations, chains and rules into
    /// the scripts `pre` and `post`, element changes into `elems` (`pre`, then
    /// `elems.script`, then `post` form one valid transaction). Returns `None` when only
    /// a full sync can apply the change; the record is then unusable.
    pub fn advance(
        &mut self,
        plan: &NodePlan,
        changed: &[ServiceName],
        cfg: &DataplaneConfig,
        pre: &mut String,
        elems: &mut ElementDelta,
        post: &mut String,
    ) -> Option<DeltaCounts> {
        let mut n = DeltaCounts::default();
        let new_base = ruleset::build_base(plan, cfg, self.family);
        if !new_base.delta_pre(&self.base, pre, &mut n) {
            return None;
        }
        new_base.delta_post(&self.base, post, &mut n);
        let empty = Fragment::default();
        let no_own = ruleset::Own::default();
        self.base = new_base;
        let (fam, t) = (self.base.family, self.base.table.clone());

        // Shared elements → present before; frontends → their elements before.
        let mut touched: BTreeMap<Shared, bool> = BTreeMap::new();
        let mut touched_fe: BTreeMap<Box<str>, Option<Arc<Frontend>>> = BTreeMap::new();
        let mut touched_disp: BTreeMap<Dispatch, bool> = BTreeMap::new();
        // Per-Service chain changes go after new dispatch groups (their rules jump there).
        let mut own_pre = String::new();
        for name in changed {
            let old = self.services.remove(name);
            let new = plan
                .services
                .get(name)
                .filter(|svc| ruleset::has_family(svc, self.family))
                .map(|svc| {
                    (
                        svc.clone(),
                        ruleset::build_service(svc, plan, cfg, self.family),
                    )
                });
            let old_frag = old.as_ref().map(|(_, f)| f).unwrap_or(&empty);
            let new_frag = new.as_ref().map(|(_, f)| f).unwrap_or(&empty);
            // As rulesets for the delta (a changed Service's one or two chains).
            let old_own = old_frag.own.as_deref().unwrap_or(&no_own);
            let old_own = old_own.to_ruleset(fam, &t);
            let new_own = new_frag.own.as_deref().unwrap_or(&no_own);
            let new_own = new_own.to_ruleset(fam, &t);
            if !new_own.delta_pre(&old_own, &mut own_pre, &mut n) {
                return None;
            }
            new_own.delta_post(&old_own, post, &mut n);
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

        // Dispatch groups that appear or disappear with these Services.
        for (d, before) in touched_disp {
            let after = self.dispatch.contains_key(&d);
            if before == after {
                continue;
            }
            if after {
                let (set, chain) = d.objects(self.family);
                n.sets_added += 1;
                n.chains_added += 1;
                let _ = writeln!(pre, "add map {fam} {t} {} {{ {} }}", d.map(), set.decl);
                let _ = writeln!(pre, "add chain {fam} {t} {}", d.chain());
                for r in &chain.rules {
                    ruleset::write_rule(pre, fam, &t, &d.chain(), r);
                }
            } else {
                n.sets_deleted += 1;
                n.chains_deleted += 1;
                let _ = writeln!(pre, "flush chain {fam} {t} {}", d.chain());
                let _ = writeln!(post, "delete chain {fam} {t} {}", d.chain());
                let _ = writeln!(post, "delete map {fam} {t} {}", d.map());
            }
        }
        pre.push_str(&own_pre);

        // Shared elements whose effective value changed: deletes first, then adds.
        let mut dels: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut adds: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for (sh, before) in touched {
            let after = self.shared.contains_key(&sh);
            if before == after {
                continue;
            }
            let set = sh.set().to_string();
            if before {
                dels.entry(set).or_default().insert(sh.key());
            } else {
                adds.entry(set).or_default().insert(sh.key(), String::new());
            }
        }
        for (fe, before) in touched_fe {
            let after = self.frontend_now(&fe);
            if let (Some(b), Some(a)) = (&before, &after)
                && Arc::ptr_eq(b, a)
            {
                continue;
            }
            fn elements(fe: &Option<Arc<Frontend>>) -> BTreeMap<(SetRef, String), &str> {
                fe.iter()
                    .flat_map(|fe| fe.elements())
                    .map(|(s, k, v)| ((s, k.text()), v))
                    .collect()
            }
            let (b, a) = (elements(&before), elements(&after));
            for ((set, k), v) in &b {
                if a.get(&(*set, k.clone())) != Some(v) {
                    let keys = dels.entry(set.name().into_owned()).or_default();
                    keys.insert(k.to_string());
                }
            }
            for ((set, k), v) in &a {
                if b.get(&(*set, k.clone())) != Some(v) {
                    let kv = adds.entry(set.name().into_owned()).or_default();
                    kv.insert(k.to_string(), v.to_string());
                }
            }
        }
        for keys in dels.values() {
            n.elements_deleted += keys.len();
        }
        for kv in adds.values() {
            n.elements_added += kv.len();
        }
        elems.dels = dels;
        elems.adds = adds;
        Some(n)
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
) -> Vec<Fragment> {
    let build = |c: &[(&ServiceName, &Arc<ServicePlan>)]| -> Vec<Fragment> {
        c.iter()
            .map(|(_, svc)| ruleset::build_service(svc, plan, cfg, family))
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

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_core::PlanConfig;
    use kproxy_core::config::LocalDetectorConfig;
    use kproxy_core::synthetic::{self, Spec};

    /// The bulk-built maps of `full` are those `add_shared` builds Service by Service.
    #[test]
    fn full_builds_the_maps_add_shared_would() {
        let state = synthetic::cluster(&Spec::new(300, 4));
        let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
        let cfg = DataplaneConfig::default();
        for family in IpFamily::ALL {
            let bulk = FamilyRecord::full(&plan, &cfg, family);
            let mut one = FamilyRecord {
                family,
                base: ruleset::build_base(&plan, &cfg, family),
                services: BTreeMap::new(),
                shared: BTreeMap::new(),
                frontends: BTreeMap::new(),
                dispatch: BTreeMap::new(),
            };
            for (name, svc) in &plan.services {
                if !ruleset::has_family(svc, family) {
                    continue;
                }
                let frag = ruleset::build_service(svc, &plan, &cfg, family);
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

    /// The full script written from the record is the assembled ruleset's, byte for byte.
    #[test]
    fn full_script_from_references_equals_the_assembled_one() {
        let cfgs = [
            PlanConfig::default(),
            PlanConfig {
                local_detector: LocalDetectorConfig::ClusterCidr(vec![
                    "10.0.0.0/8".parse().unwrap(),
                ]),
                ..PlanConfig::default()
            },
        ];
        for pc in cfgs {
            let state = synthetic::cluster(&Spec::new(60, 4));
            let plan = kproxy_core::plan(&state, "node-0", &pc);
            for family in IpFamily::ALL {
                let rec = FamilyRecord::full(&plan, &DataplaneConfig::default(), family);
                let (mut a, mut b) = (String::new(), String::new());
                let n = rec.full_script(&mut a);
                let rs = rec.assemble();
                rs.full_script(&mut b);
                assert_eq!(a, b);
                assert_eq!(n, rs.counts());
                let mut c = String::new();
                crate::ruleset::build(&plan, &DataplaneConfig::default(), family)
                    .full_script(&mut c);
                assert_eq!(a, c, "record and pure render agree");
                assert!(family == IpFamily::IPv6 || a.contains("dnat-c-"), "{a}");

                // In steps: every hooked chain and only those in the last step, no
                // element left in the first but those netlink does not encode.
                let (mut tables, mut hooks) = (String::new(), String::new());
                let mut batch = crate::netlink::Batch::default();
                let m = rec.full_structure(&mut tables, &mut hooks);
                rec.full_elements(&mut batch).unwrap();
                assert_eq!(m.chains_added, n.chains_added);
                assert_eq!(m.sets_added, n.sets_added);
                assert!(!tables.contains(" hook "), "{tables}");
                let hooked = a.lines().filter(|l| l.contains(" hook ")).count();
                assert_eq!(
                    hooks.lines().filter(|l| l.contains(" hook ")).count(),
                    hooked
                );
                assert!(
                    hooks
                        .lines()
                        .all(|l| l.starts_with("add chain") || l.starts_with("add rule"))
                );
                assert!(
                    tables
                        .lines()
                        .filter(|l| l.starts_with("add element"))
                        .all(|l| l.contains("local-pods")),
                    "{tables}"
                );
                let lines = |s: &str| s.lines().filter(|l| !l.starts_with("add element")).count();
                assert_eq!(lines(&tables) + lines(&hooks), lines(&a));
                assert!(family == IpFamily::IPv6 || !batch.is_empty());
            }
        }
    }
}
