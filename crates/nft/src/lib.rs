//! kproxy's nftables dataplane: renders a NodePlan into kproxy's own tables
//! (`ip kproxy`, `ip6 kproxy`), applies it atomically (a full table replacement first,
//! then deltas: the in-memory record of what is programmed moved by the Services the
//! planner's `PlanUpdate` names), verifies the kernel against that record, and deletes
//! stale UDP conntrack entries.
//!
//! This file is the facade: every module is private, and what the node agent and the
//! tools use is re-exported here (crates/nft/README.md, "The Rust facade", says why each
//! item); benches and tests reach below it through `internals` (the `internals`
//! feature). The modules stand in layers (README, "Layers"; `tests/layers.rs` holds the
//! imports to them), bottom first. The floor: `error`, and `nfnl` (the netlink floor:
//! the socket, the namespace, kproxy's own port ids, every kernel constant). The
//! vocabulary: `atom` (the values rules and elements share, each with its kernel
//! encoding), `rule` (the typed rule: its one renderer of nft text and its encoder into
//! the kernel's expressions) and `model` (the typed nftables model, `diff(old, new) →
//! Transaction`, the transaction's nft text). The functional core: `config`,
//! `counters` (their names and values), `ruleset` (plan → desired typed [`Table`]s),
//! `record` (the record that moves by the changed Services and yields each sync's
//! transaction) and `evaluate` (a packet's fate under a table, for `kproxy trace
//! --kernel`). The kernel, written and read, always in the calling thread's network
//! namespace: `conntrack` (ctnetlink's cleanup, its decision moved with the record),
//! `limits`, `netlink` (each sync's transaction as nfnetlink batches; no `nft` process:
//! the nft text is for `sync --dry-run`, docs and tests), `dump` (kproxy's tables read
//! back, and the decoder of the kernel's rule expressions into the typed rule, so rules
//! read back compare by what they do) and `monitor` (the watch). The syncs: `adopt`,
//! `first_sync`, `readback` and [`Dataplane`] (`dataplane`).

#![forbid(unsafe_code)]

mod adopt;
mod atom;
mod config;
mod conntrack;
mod counters;
mod dataplane;
mod dump;
mod error;
mod evaluate;
mod first_sync;
mod limits;
mod model;
mod monitor;
mod netlink;
mod nfnl;
mod readback;
mod record;
mod rule;
mod ruleset;

// The node agent's dataplane: build, sync, verify, repair; remove.
pub use config::{DataplaneConfig, validate_plan};
pub use dataplane::{CounterReader, Dataplane, SyncReport, VerifyReport, cleanup, delete_tables};
pub use error::{EncodeError, EncodeFailure, NftError};
// The traffic counters: their names, and one reading of them (`kproxy top`, metrics).
pub use counters::{
    CounterKind, KernelCounter, ServiceCounter, UNALLOCATED_CLUSTER_IPS, parse_counter_name,
};
pub use dump::read_counters;
pub use ruleset::DeltaCounts;
// The desired tables, and what the first sync would send (`sync --dry-run`).
pub use model::{Family, Table, Transaction};
pub use readback::first_sync_transaction;
pub use record::desired;
// The kernel's tables, read: kproxy's own (`trace --kernel`, the input guard), and the
// names of a family's tables (the takeover's inventory).
pub use adopt::AdoptError;
pub use dump::table_names;
pub use readback::KernelTable;
// The kernel watch.
pub use monitor::{Backoff, ChangeKind, Changes, Event, Interference, Monitor};
// A packet's fate under a table (`kproxy trace`).
pub use evaluate::{Evaluation, Fate, Outcome, Share, Touched, divergence, evaluate};
// The kernel's conntrack limits (`kproxy_conntrack_*` metrics; the stale-UDP cleanup
// runs inside each sync).
pub use limits::{ConntrackTable, conntrack_table, read_sysctl};

/// What benches and tests reach below the facade (the `internals` feature, which the
/// crate's own dev-dependency turns on): the record and its transactions, the typed
/// model, the kernel's raw tables, the nfnetlink writer, the typed rule, adoption, the
/// ctnetlink listing. Not for other crates: nothing here is the node agent's contract.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod internals {
    pub use crate::config::validate_interface;
    pub use crate::dataplane::replacement;
    pub use crate::first_sync::{PhasedSync, first_sync_into_absent_tables};
    pub use crate::record::{FamilyRecord, delta, full_transaction_of, render};
    pub use crate::ruleset::Shards;
    pub mod model {
        pub use crate::model::*;
    }
    pub mod dump {
        pub use crate::dump::*;
    }
    pub mod netlink {
        pub use crate::netlink::*;
    }
    pub mod rule {
        pub use crate::rule::*;
    }
    pub mod adopt {
        pub use crate::adopt::*;
    }
    pub mod conntrack {
        pub use crate::conntrack::*;
    }
}
