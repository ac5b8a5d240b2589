//! Memory of the dataplane's record (what is programmed, per family) at 10k Services ×
//! 10 endpoints: the part of `kproxy run`'s heap that the nftables dataplane keeps
//! between syncs. Run: `cargo bench -p kproxy-nft --bench record_memory`. Reads VmRSS
//! from /proc/self/status (Linux), so it measures real allocations. No kernel access.

use kproxy_core::PlanConfig;
use kproxy_core::model::IpFamily;
use kproxy_core::synthetic::{self, Spec};
use kproxy_nft::DataplaneConfig;
use kproxy_nft::record::FamilyRecord;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(str::to_string)
        })
        .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}

fn main() {
    let state = synthetic::cluster(&Spec::new(10_000, 10));
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let cfg = DataplaneConfig::default();
    let before = rss_kib();
    let recs = [
        FamilyRecord::full(&plan, &cfg, IpFamily::IPv4),
        FamilyRecord::full(&plan, &cfg, IpFamily::IPv6),
    ];
    let after = rss_kib();
    let mut script = String::new();
    for r in &recs {
        r.full_script(&mut script);
    }
    println!(
        "record_memory 10000x10: FamilyRecord (both families) {:.1} MiB; full script {:.1} MB",
        (after - before) as f64 / 1024.0,
        script.len() as f64 / 1e6
    );
}
