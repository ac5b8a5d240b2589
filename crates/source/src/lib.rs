//! kproxy-source: where cluster objects come from. Every source (manifest files,
//! the Kubernetes API) writes into one store ([`store()`]): the source holds its
//! [`Writer`], the sync loop its [`Reader`] and the [`Status`] it waits on. One code path
//! after the source.
//!
//! - [`store`]: the one `ClusterState`, its writer, reader and status.
//! - [`manifests`]: read a file or directory of manifests into a `ClusterState`.
//! - [`watch`]: keep the store in step with a manifest file or directory.
//! - [`kube`]: the Kubernetes API watchers.

#![forbid(unsafe_code)]

#[cfg(feature = "fake-api")]
pub mod fake_api;
pub mod kube;
pub mod manifests;
pub mod store;
pub mod watch;

pub use store::{Pending, Reader, Status, Writer, store};
