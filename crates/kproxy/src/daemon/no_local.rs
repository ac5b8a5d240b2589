//! The no-local-endpoints gauges (`sync_proxy_rules_no_local_endpoints_total`) of the
//! applied plan, kept per Service and moved by each sync's changes ([`NoLocalCounts`]):
//! the loop's observer of what it programmed.

use std::collections::HashMap;

use kproxy_core::NodePlan;
use kproxy_core::model::IpFamily;
use kproxy_core::no_local::NoLocalEndpoints;
use kproxy_core::planner::PlanUpdate;
use kproxy_core::update::Revisit;

use crate::metrics::{Metrics, NoLocalLabels};

/// Upstream's `sync_proxy_rules_no_local_endpoints_total{traffic_policy, ip_family}`
/// of the applied plan: the decision is `kproxy_core::no_local`; the counts are kept per
/// Service and moved by each sync's changed Services, so a sync does not walk the
/// cluster. Only Services that count are held.
#[derive(Debug, Default)]
pub(super) struct NoLocalCounts {
    /// IPv4, IPv6.
    total: [NoLocalEndpoints; 2],
    by_service: HashMap<kproxy_core::model::ServiceName, [NoLocalEndpoints; 2]>,
    primed: bool,
}

impl NoLocalCounts {
    fn of_service(svc: &kproxy_core::plan::ServicePlan) -> [NoLocalEndpoints; 2] {
        IpFamily::ALL.map(|f| kproxy_core::no_local::service_no_local_endpoints(svc, f))
    }

    /// Moves the counts to `plan` by `update` (every change since the plan they
    /// counted), as [`PlanUpdate::revisit`] says.
    pub(super) fn follow(&mut self, plan: &NodePlan, update: &PlanUpdate) {
        let zero = [NoLocalEndpoints::default(); 2];
        let Revisit::Services(names) = update.revisit(self.primed) else {
            *self = NoLocalCounts {
                primed: true,
                ..NoLocalCounts::default()
            };
            for (name, svc) in &plan.services {
                let n = Self::of_service(svc);
                if n != zero {
                    self.add(name.clone(), n);
                }
            }
            return;
        };
        for name in names.iter() {
            if let Some(old) = self.by_service.remove(name) {
                for (t, o) in self.total.iter_mut().zip(old) {
                    *t -= o;
                }
            }
            if let Some(svc) = plan.services.get(name) {
                let n = Self::of_service(svc);
                if n != zero {
                    self.add(name.clone(), n);
                }
            }
        }
    }

    fn add(&mut self, name: kproxy_core::model::ServiceName, n: [NoLocalEndpoints; 2]) {
        for (t, x) in self.total.iter_mut().zip(n) {
            *t += x;
        }
        self.by_service.insert(name, n);
    }

    fn get(&self, family: IpFamily) -> NoLocalEndpoints {
        self.total[family.index()]
    }

    /// One gauge pair per family of the plan.
    pub(super) fn set(&self, metrics: &Metrics, plan: &NodePlan) {
        for f in &plan.families {
            let n = self.get(f.family);
            for (traffic_policy, v) in [("internal", n.internal), ("external", n.external)] {
                metrics
                    .no_local_endpoints
                    .get_or_create(&NoLocalLabels {
                        traffic_policy,
                        ip_family: f.family.as_str(),
                    })
                    .set(i64::from(v));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kproxy_core::synthetic::{self, Spec};
    use kproxy_core::{PlanConfig, Planner};

    /// The no-local-endpoints gauges, moved by each sync's changed Services, equal a
    /// count of the whole plan.
    #[test]
    fn no_local_counts_follow_changes_as_a_recount_would() {
        let spec = Spec {
            etp_local_every: 2,
            ..Spec::new(40, 2)
        };
        let mut state = synthetic::cluster(&spec);
        let mut planner = Planner::new(synthetic::node_name(0), PlanConfig::default());
        let mut counts = NoLocalCounts::default();
        let recount = |plan: &NodePlan| {
            IpFamily::ALL.map(|f| kproxy_core::no_local::no_local_endpoints(plan, f))
        };
        let up = planner.update(&mut state);
        counts.follow(planner.plan(), &up);
        assert!(counts.total[0].external > 0, "{counts:?}");
        assert_eq!(counts.total, recount(planner.plan()));
        for step in 1..=30usize {
            let i = (step * 7) % spec.services;
            let svc = synthetic::service(&spec, i);
            match step % 3 {
                0 => {
                    if state.service(&svc.name).is_some() {
                        state.delete_service(&svc.name);
                    } else {
                        state.upsert_service(svc);
                    }
                }
                1 => {
                    state.delete_slice(&svc.name.namespace, &format!("svc-{i}-abcde"));
                }
                _ => {
                    state.upsert_slice(synthetic::slice(&spec, i, step));
                }
            }
            let up = planner.update(&mut state);
            counts.follow(planner.plan(), &up);
            assert_eq!(counts.total, recount(planner.plan()), "step {step}");
        }
    }
}
