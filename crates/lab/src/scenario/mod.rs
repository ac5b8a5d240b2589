//! The scenario's vocabulary: what a run is asked to do, in the words a scenario file
//! and the command line use. The lab Service and its numbers (`service`), the
//! Deployment and its pods (`workload`), the cloud load balancer (`balancer`), the
//! load (`load`), a rollout's whole configuration with its defaults and validation
//! (`rollout`), what else a run is asked for — behaviour, control plane, chaos, a node
//! drain, `lab restart`'s disturbances (`run`) — and the matrix's cells (`matrix`); the
//! one name a value has on the command line, in cell ids and in JSON (`value_name`).
//!
//! Data and pure functions only. The world, the runs and the reports import from
//! here; nothing here imports from them.

pub mod balancer;
pub mod load;
pub mod matrix;
pub mod rollout;
pub mod run;
pub mod service;
mod value_name;
pub mod workload;

pub(crate) use value_name::named_by_value_enum;
