//! kproxy's nftables dataplane: renders a NodePlan into kproxy's own tables
//! (`ip kproxy`, `ip6 kproxy`), applies it atomically (a full table replacement first,
//! then deltas: the in-memory record of what is programmed moved by the Services the
//! planner's `PlanUpdate` names), verifies the kernel against that record, and deletes
//! stale UDP conntrack entries.
//!
//! This file is the facade: it declares the modules and re-exports what callers use.
//! Functional core: [`ruleset`] (plan → desired typed [`model::Table`]s), `atom` (the
//! values rules and elements share: family, field, atom, verdict, rule id), [`rule`] (the
//! typed rule: its one renderer of nft text, and the decoder of the kernel's
//! expressions back into it, so rules read back compare by what they do), [`model`]
//! (the typed nftables model, `diff(old, new) → Transaction`, the transaction's nft
//! text), [`record`] (the record that moves by the changed Services and yields each
//! sync's transaction), [`conntrack::UdpFrontends`] (the cleanup's decision, moved
//! with the record) and [`evaluate`] (a packet's fate under a table, for `kproxy trace
//! --kernel`). Imperative shell: [`Dataplane`] ([`dataplane`]), which sends each
//! sync's transaction as nfnetlink batches ([`netlink`]; no `nft` process: the nft
//! text is for `sync --dry-run`, docs and tests); reads kproxy's tables back over
//! nfnetlink ([`dump`], [`readback`]); and talks ctnetlink ([`conntrack`]), always in
//! the calling thread's network namespace.

#![forbid(unsafe_code)]

pub mod adopt;
mod atom;
pub mod config;
pub mod conntrack;
pub mod dataplane;
pub mod dump;
pub mod error;
pub mod evaluate;
pub mod first_sync;
pub mod limits;
pub mod model;
pub mod monitor;
pub mod netlink;
mod nfnl;
pub mod readback;
pub mod record;
pub mod rule;
pub mod ruleset;

pub use config::{DataplaneConfig, validate_interface, validate_plan};
pub use dataplane::{Dataplane, SyncReport, VerifyReport, cleanup, delete_tables};
pub use error::{EncodeError, EncodeFailure, NftError};
pub use first_sync::{PhasedSync, first_sync_into_absent_tables};
pub use model::{Table, Transaction};
pub use readback::first_sync_transaction;
pub use record::{
    delta, desired, full_transaction, full_transaction_of, render, write_full_replacement,
};
pub use ruleset::DeltaCounts;
