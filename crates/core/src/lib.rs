//! kproxy-core: the cluster model and the pure per-node planner.
//!
//! No I/O, no async, no clock. Start at [`planner::plan`]: it turns a [`ClusterState`]
//! (validated Services, EndpointSlices and this node's Node) and a [`PlanConfig`] into a
//! [`NodePlan`], the complete desired state of one node that every edge consumes.
//!
//! - [`model`]: validated objects; [`ingest`] builds them from Kubernetes objects and
//!   is the only place that rejects bad input.
//! - [`manifest`]: multi-document YAML / JSON / `kind: List` text into objects, with
//!   per-document errors.
//! - [`state`]: the one store, keyed like the API, tracking which Services changed.
//! - [`categorize`]: upstream's CategorizeEndpoints (ready first, terminating fallback,
//!   topology), per service port.
//! - [`planner`]: the plan, full and incremental; [`update`]: what a re-plan changed and
//!   how each consumer follows it; [`no_local`]: which of its ports upstream
//!   counts in `sync_proxy_rules_no_local_endpoints_total`.
//! - [`trace`]: the fate of one packet under a plan; [`explain`]: why, for people.
//! - [`takeover`]: what of kube-proxy's is on a node and the plan that removes it.
//! - [`warmup`]: the hold of an endpoint that has just become ready, until its server
//!   had time to listen.
//! - [`input_guard`]: whether a state from broken or empty input may replace the rules in
//!   place.

#![forbid(unsafe_code)]

pub mod categorize;
pub mod config;
pub mod conflicts;
pub mod explain;
pub mod frontend;
pub mod hold;
pub mod ingest;
pub mod input_guard;
pub mod manifest;
pub mod model;
pub mod no_local;
pub mod plan;
pub mod planner;
pub mod state;
pub mod synthetic;
pub mod takeover;
pub mod trace;
pub mod update;
pub mod warmup;

pub use config::PlanConfig;
pub use plan::NodePlan;
pub use planner::{Planner, plan};
pub use state::ClusterState;
