//! Memory of the dataplane's record (what is programmed, per family) at 10k Services ×
//! 10 endpoints: the part of `kproxy run`'s heap that the nftables dataplane keeps
//! between syncs. Run: `cargo bench -p kproxy-nft --bench record_memory`. No kernel
//! access.
//!
//! Two measures (`crates/core/benches/support/memory.rs`): live heap bytes, what the
//! records hold once built and the peak while building them (which includes the
//! fragments built on every core and the sort vectors), and VmRSS growth, which also
//! counts allocator slack that a daemon keeps.

#[path = "../../core/benches/support/memory.rs"]
mod memory;

use kproxy_core::PlanConfig;
use kproxy_core::model::IpFamily;
use kproxy_core::synthetic::{self, Spec};
use kproxy_nft::DataplaneConfig;
use kproxy_nft::record::FamilyRecord;

use memory::{live, mib, peak, reset_peak, rss_kib};

fn main() {
    let state = synthetic::cluster(&Spec::new(10_000, 10));
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let cfg = DataplaneConfig::default();
    let before = rss_kib();
    let live_before = live();
    reset_peak();
    let recs = [
        FamilyRecord::full(&plan, &cfg, IpFamily::IPv4),
        FamilyRecord::full(&plan, &cfg, IpFamily::IPv6),
    ];
    let after = rss_kib();
    let (live, peak) = (live() - live_before, peak() - live_before);
    // A full sync's transient: the typed tables, their transaction and its text.
    let live_tx = memory::live();
    reset_peak();
    let tables = [recs[0].assemble(), recs[1].assemble()];
    let tx = kproxy_nft::full_transaction(tables);
    let script = tx.nft_text();
    let tx_peak = memory::peak().saturating_sub(live_tx);
    println!(
        "record_memory 10000x10: FamilyRecord (both families) live {:.1} MiB (peak while \
         building {:.1} MiB), RSS +{:.1} MiB; full sync transaction (tables, ops, text) \
         peak {:.1} MiB; full script {:.1} MB",
        mib(live),
        mib(peak),
        after.saturating_sub(before) as f64 / 1024.0,
        mib(tx_peak),
        script.len() as f64 / 1e6
    );
}
