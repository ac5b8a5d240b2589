//! Explanations for people: the plan as a table, and for one Service why each endpoint
//! is or is not used by each kind of traffic.

use std::fmt::Write;

use crate::plan::{NodePlan, ServicePlan};

/// One line per service port and family.
pub fn plan_table(plan: &NodePlan) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "node {}", plan.node);
    for p in plan.service_ports() {
        let _ = writeln!(out, "{} {} {}:{}", p.service_port, p.family, p.cluster_ip, p.port);
    }
    out
}

pub fn explain_service(_plan: &NodePlan, svc: &ServicePlan) -> String {
    format!("{}\n", svc.service)
}
