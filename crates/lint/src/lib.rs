//! `kproxy lint`: checks workloads' rollout settings (preStop, readiness, grace period,
//! surge, PodDisruptionBudgets) against the load balancer in front of them, before the
//! rollout rather than after the outage.
//!
//! Functional core, imperative shell: [`input`] types the manifests, [`rules::lint`] is a
//! pure function from them and an [`lb::LbProfile`] to findings, [`report`] renders them,
//! and [`cli`] is the only module that touches files and streams.

#![forbid(unsafe_code)]

pub mod cli;
pub mod input;
pub mod lb;
pub mod report;
pub mod rules;
