//! What one re-plan changed ([`PlanUpdate`], made by [`crate::Planner::update`]) and how
//! every consumer follows it: updates add up with [`PlanUpdate::merge`] (the sync
//! loop's changes owed to the dataplane across failed syncs, health's changes not yet
//! reconciled), and [`PlanUpdate::revisit`] says which Services a consumer that keeps
//! something per Service of the plan (the nft record, health's views, the
//! no-local-endpoints counts) must look at again. The one place that says "follow the
//! `PlanUpdate`"; consumers only say what they do per Service.

use std::borrow::Cow;
use std::collections::BTreeSet;

use crate::model::ServiceName;
use crate::plan::NodePlan;

/// What one [`crate::Planner::update`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanUpdate {
    /// Services whose plan differs (added, changed or removed). The planner and
    /// [`PlanUpdate::merge`] keep them sorted, each once.
    pub services: Vec<ServiceName>,
    /// Node-level facts (families, zone, eligibility) changed: consumers should treat
    /// this as a full re-plan.
    pub node: bool,
}

/// What a consumer revisits to follow a [`PlanUpdate`] ([`PlanUpdate::revisit`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Revisit<'a> {
    /// Everything: node-level facts changed, or the consumer did not follow the plan
    /// before this update. It rebuilds from the plan: node facts, every Service the
    /// plan holds, and none it holds that the plan lacks.
    Whole,
    /// These Services only, sorted, each once: one the plan holds was added or
    /// changed, one it lacks was removed. Nothing else differs.
    Services(Cow<'a, [ServiceName]>),
}

impl PlanUpdate {
    /// "Everything may have changed": for callers that hold a whole plan and no delta
    /// (tools, tests, a consumer rebuilding its view).
    pub const WHOLE: PlanUpdate = PlanUpdate {
        services: Vec::new(),
        node: true,
    };

    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.node
    }

    /// Adds `later`, an update made after this one: together they say what changed
    /// from the plan before `self` to the plan after `later`: the Services of either
    /// (sorted, each once) and a node-level change if either had one. Linear in both.
    pub fn merge(&mut self, later: PlanUpdate) {
        let PlanUpdate {
            services: mut b,
            node,
        } = later;
        self.node |= node;
        normalise(&mut b);
        if self.services.is_empty() {
            self.services = b;
            return;
        }
        normalise(&mut self.services);
        if b.is_empty() {
            return;
        }
        let a = std::mem::take(&mut self.services);
        let mut out = Vec::with_capacity(a.len() + b.len());
        let (mut a, mut b) = (a.into_iter().peekable(), b.into_iter().peekable());
        while let (Some(x), Some(y)) = (a.peek(), b.peek()) {
            match x.cmp(y) {
                std::cmp::Ordering::Less => out.extend(a.next()),
                std::cmp::Ordering::Greater => out.extend(b.next()),
                std::cmp::Ordering::Equal => {
                    b.next();
                    out.extend(a.next());
                }
            }
        }
        out.extend(a);
        out.extend(b);
        self.services = out;
    }

    /// What a consumer that keeps something per Service of the plan revisits to follow
    /// this update. `following`: the consumer followed the plan this update starts
    /// from (false before its first plan, or after it lost track).
    pub fn revisit(&self, following: bool) -> Revisit<'_> {
        if self.node || !following {
            Revisit::Whole
        } else {
            Revisit::Services(sorted_ref(&self.services))
        }
    }
}

impl Revisit<'_> {
    /// The Services revisited, by name: for [`Revisit::Whole`] every one `plan` holds
    /// or `held` names (what the consumer holds), sorted, each once. For a consumer that
    /// moves Service by Service even when it rebuilds (the nft record).
    pub fn names<'h>(
        self,
        plan: &'h NodePlan,
        held: impl IntoIterator<Item = &'h ServiceName>,
    ) -> Vec<ServiceName> {
        match self {
            Revisit::Whole => {
                let mut all: BTreeSet<&ServiceName> = plan.services.keys().collect();
                all.extend(held);
                all.into_iter().cloned().collect()
            }
            Revisit::Services(names) => names.into_owned(),
        }
    }
}

/// Sorts `names` and keeps each once, unless they are already (as the planner makes
/// them).
fn normalise(names: &mut Vec<ServiceName>) {
    if !names.is_sorted_by(|a, b| a < b) {
        names.sort_unstable();
        names.dedup();
    }
}

fn sorted_ref(names: &[ServiceName]) -> Cow<'_, [ServiceName]> {
    if names.is_sorted_by(|a, b| a < b) {
        Cow::Borrowed(names)
    } else {
        let mut owned = names.to_vec();
        normalise(&mut owned);
        Cow::Owned(owned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synthetic::{self, Spec};

    fn n(s: &str) -> ServiceName {
        let (ns, name) = s.split_once('/').unwrap();
        ServiceName::new(ns, name)
    }

    fn up(services: &[&str], node: bool) -> PlanUpdate {
        PlanUpdate {
            services: services.iter().map(|s| n(s)).collect(),
            node,
        }
    }

    #[test]
    fn merge() {
        // (name, earlier, later, together)
        #[rustfmt::skip]
        let rows: &[(&str, PlanUpdate, PlanUpdate, PlanUpdate)] = &[
            ("nothing and nothing is nothing",
             up(&[], false), up(&[], false), up(&[], false)),
            ("nothing, then a change, is that change",
             up(&[], false), up(&["a/x"], false), up(&["a/x"], false)),
            ("a change, then nothing, is that change",
             up(&["a/x"], false), up(&[], false), up(&["a/x"], false)),
            ("the Services of both, sorted, each once",
             up(&["a/x", "c/z"], false), up(&["a/x", "b/y"], false), up(&["a/x", "b/y", "c/z"], false)),
            ("a node-level change in either stays",
             up(&["a/x"], true), up(&["b/y"], false), up(&["a/x", "b/y"], true)),
            ("a node-level change later too",
             up(&["a/x"], false), PlanUpdate::WHOLE, up(&["a/x"], true)),
            ("a hand-made update out of order is sorted",
             up(&["c/z"], false), up(&["b/y", "a/x", "b/y"], false), up(&["a/x", "b/y", "c/z"], false)),
            ("out of order into nothing is sorted too",
             up(&[], false), up(&["b/y", "a/x"], false), up(&["a/x", "b/y"], false)),
        ];
        for (name, earlier, later, together) in rows {
            let mut acc = earlier.clone();
            acc.merge(later.clone());
            assert_eq!(&acc, together, "{name}");
        }
    }

    #[test]
    fn revisit() {
        // (name, update, following, revisit)
        #[rustfmt::skip]
        let rows: &[(&str, PlanUpdate, bool, Revisit)] = &[
            ("a consumer following the plan revisits the changed Services",
             up(&["a/x", "b/y"], false), true, Revisit::Services(vec![n("a/x"), n("b/y")].into())),
            ("nothing changed: nothing to revisit",
             up(&[], false), true, Revisit::Services(Vec::new().into())),
            ("a node-level change: everything",
             up(&["a/x"], true), true, Revisit::Whole),
            ("a consumer that did not follow the plan before: everything",
             up(&["a/x"], false), false, Revisit::Whole),
            ("even for an empty update",
             up(&[], false), false, Revisit::Whole),
            ("a hand-made update: sorted, each once",
             up(&["b/y", "a/x", "b/y"], false), true, Revisit::Services(vec![n("a/x"), n("b/y")].into())),
        ];
        for (name, update, following, want) in rows {
            assert_eq!(&update.revisit(*following), want, "{name}");
        }
    }

    #[test]
    fn whole_names_every_service_of_the_plan_and_every_one_held() {
        let spec = Spec::new(3, 1);
        let plan = crate::plan(
            &synthetic::cluster(&spec),
            &synthetic::node_name(0),
            &crate::PlanConfig::default(),
        );
        let in_plan: Vec<ServiceName> = plan.services.keys().cloned().collect();
        let gone = n("zz/gone");
        let names = PlanUpdate::WHOLE
            .revisit(true)
            .names(&plan, [&gone, &in_plan[0]]);
        let mut want = in_plan.clone();
        want.push(gone.clone());
        assert_eq!(names, want);
        let names = up(&["zz/gone"], false).revisit(true).names(&plan, &in_plan);
        assert_eq!(names, [gone]);
    }
}
