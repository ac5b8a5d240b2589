//! Memory of the dataplane's record (what is programmed, per family) at 10k Services ×
//! 10 endpoints: the part of `kproxy run`'s heap that the nftables dataplane keeps
//! between syncs, and the transient of a full sync built from it. Run: `cargo bench -p
//! kproxy-nft --bench record_memory`. No kernel access.
//!
//! Two measures (`crates/core/benches/support/memory.rs`): live heap bytes, what the
//! records hold once built and the peak while building them (which includes the
//! fragments built on every core and the sort vectors), and VmRSS growth, which also
//! counts allocator slack that a daemon keeps.
//!
//! A full sync's transient (peak heap above the records) is measured for what `sync`
//! does, and, in the same binary, as it was done before:
//! - replacing existing tables: `kproxy_nft::internals::replacement`, the one
//!   nfnetlink batch `sync` sends (held whole: a batch goes in one `sendmsg`), its
//!   elements typed and encoded piece by piece; for comparison the nft text of the
//!   typed transaction (`full_transaction_of`, written into a sink in 64 KiB pieces, how
//!   it was sent through `nft -f` before);
//! - into absent tables: `kproxy_nft::internals::first_sync_into_absent_tables` with a sink (the
//!   structure as one nfnetlink transaction, the elements as transactions of a few
//!   thousand elements each, typed and encoded piece by piece), and for comparison the
//!   creating transaction split and its elements encoded as one batch (how it was done
//!   before).

#[path = "../../core/benches/support/memory.rs"]
mod memory;

use kproxy_core::PlanConfig;
use kproxy_core::model::IpFamily;
use kproxy_core::synthetic::{self, Spec};
use kproxy_nft::internals::FamilyRecord;
use kproxy_nft::{DataplaneConfig, Transaction};

use memory::{live, mib, peak, reset_peak, rss_kib};

/// Peak heap above the current live bytes while `f` runs, and what `f` returned.
fn transient<T>(f: impl FnOnce() -> T) -> (f64, T) {
    let base = live();
    reset_peak();
    let out = f();
    (mib(peak().saturating_sub(base)), out)
}

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

    // Replacing existing tables: what `sync` sends, one nfnetlink batch.
    let (replace_nl, batch_nl) = transient(|| {
        let (batch, _) = kproxy_nft::internals::replacement(&recs).expect("every object encodes");
        batch.len()
    });
    // The same through the record's typed transaction as nft text (how it was done
    // before).
    let (replace_tx, sent) = transient(|| {
        let tx = kproxy_nft::internals::full_transaction_of(&recs);
        tx.write_nft_to(&mut std::io::sink()).expect("a sink")
    });

    // Into absent tables: what `sync` does (structure text, the elements in pieces,
    // the hooks), with sinks for nft and the socket.
    let (cold, (batch, pieces)) = transient(|| {
        let mut sent = (0, 0);
        let mut send = |b: kproxy_nft::internals::netlink::Batch| {
            sent.0 += b.len();
            sent.1 += 1;
            Ok(())
        };
        let done = kproxy_nft::internals::first_sync_into_absent_tables(&recs, &mut send)
            .expect("sinks do not fail, and every element encodes");
        assert_eq!(done.netlink_bytes, sent.0);
        sent
    });
    // The same elements as one nfnetlink batch (how it was done before), through the
    // record's transaction and through typed tables.
    let cold_batch = |create: &dyn Fn(&FamilyRecord) -> Transaction| {
        let mut tx = create(&recs[0]);
        tx.extend(create(&recs[1]));
        let (_, elements) = tx.dormant_for_absent_tables();
        kproxy_nft::internals::netlink::Batch::transaction(&elements).map_or(0, |b| b.len())
    };
    let (cold_one, batch_one) = transient(|| cold_batch(&|r| r.create()));
    let (cold_old, batch_old) = transient(|| cold_batch(&|r| Transaction::create(r.assemble())));
    assert_eq!(batch_one, batch_old, "both paths encode the same batch");

    println!(
        "record_memory 10000x10: FamilyRecord (both families) live {:.1} MiB (peak while \
         building {:.1} MiB), RSS +{:.1} MiB; full sync transient peak: replacing \
         {replace_nl:.1} MiB (one nfnetlink batch, {:.1} MB; as nft text through the \
         typed transaction: {replace_tx:.1} MiB, script {:.1} MB), into absent tables {cold:.1} MiB ({pieces} nfnetlink \
         transactions, {:.1} MB; as one batch: {cold_one:.1} MiB, through tables: \
         {cold_old:.1} MiB; batch {:.1} MB)",
        mib(live),
        mib(peak),
        after.saturating_sub(before) as f64 / 1024.0,
        batch_nl as f64 / 1e6,
        sent as f64 / 1e6,
        batch as f64 / 1e6,
        batch_one as f64 / 1e6,
    );
}
