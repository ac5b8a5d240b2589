//! Upstream's `sync_proxy_rules_no_local_endpoints_total` decision: which service ports
//! of a plan count as "Local policy, endpoints exist, none on this node".
//!
//! Upstream (pkg/proxy/nftables/proxier.go, syncProxyRules) counts per service port and
//! per family proxier, and only in the branch where the service port *has* usable
//! endpoints somewhere (`hasEndpoints`): a Service with no endpoints at all is rejected,
//! not counted. The internal count needs internalTrafficPolicy Local; the external count
//! needs an effective externalTrafficPolicy Local, which upstream only sets for
//! externally accessible ports (NodePort, external IP or load-balancer IP).

use crate::model::{IpFamily, TrafficPolicy};
use crate::plan::{NodePlan, ServicePlan, ServicePortPlan};

/// The gauge values of one family.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoLocalEndpoints {
    /// `traffic_policy="internal"`.
    pub internal: u32,
    /// `traffic_policy="external"`.
    pub external: u32,
}

fn no_local(p: &ServicePortPlan) -> bool {
    p.has_any_endpoints && p.local_endpoints.as_ref().is_none_or(|l| l.is_empty())
}

/// The counts for `family` (upstream runs one proxier, hence one gauge pair, per family).
pub fn no_local_endpoints(plan: &NodePlan, family: IpFamily) -> NoLocalEndpoints {
    let mut out = NoLocalEndpoints::default();
    for svc in plan.services.values() {
        out += service_no_local_endpoints(svc, family);
    }
    out
}

/// One Service's share of [`no_local_endpoints`]. The counts are sums over Services, so a
/// caller following a plan's changes keeps them by the changed Services alone.
pub fn service_no_local_endpoints(svc: &ServicePlan, family: IpFamily) -> NoLocalEndpoints {
    let mut out = NoLocalEndpoints::default();
    for p in svc.ports.iter().filter(|p| p.family == family) {
        if !no_local(p) {
            continue;
        }
        if p.internal_traffic_policy == TrafficPolicy::Local {
            out.internal += 1;
        }
        if p.external_traffic_policy == TrafficPolicy::Local && p.externally_accessible() {
            out.external += 1;
        }
    }
    out
}

impl std::ops::AddAssign for NoLocalEndpoints {
    fn add_assign(&mut self, o: NoLocalEndpoints) {
        self.internal += o.internal;
        self.external += o.external;
    }
}

impl std::ops::SubAssign for NoLocalEndpoints {
    fn sub_assign(&mut self, o: NoLocalEndpoints) {
        self.internal = self.internal.saturating_sub(o.internal);
        self.external = self.external.saturating_sub(o.external);
    }
}
