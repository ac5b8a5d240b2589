//! Memory of the dataplane's record (what is programmed, per family) at 10k Services ×
//! 10 endpoints: the part of `kproxy run`'s heap that the nftables dataplane keeps
//! between syncs. Run: `cargo bench -p kproxy-nft --bench record_memory`. No kernel
//! access.
//!
//! Two measures: live heap bytes (a counting global allocator: what the records hold
//! once built, and the peak while building them, which includes the fragments built on
//! every core and the sort vectors), and the VmRSS growth from /proc/self/status
//! (Linux), which also counts allocator slack that a daemon keeps.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use kproxy_core::PlanConfig;
use kproxy_core::model::IpFamily;
use kproxy_core::synthetic::{self, Spec};
use kproxy_nft::DataplaneConfig;
use kproxy_nft::record::FamilyRecord;

/// `System`, counting the bytes currently allocated and their high-water mark.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Relaxed) + n;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every call is forwarded to `System` with the same arguments; the counters
// only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System`'s.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is `System`'s.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            grew(l.size());
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract is `System`'s.
        unsafe { System.dealloc(p, l) };
        LIVE.fetch_sub(l.size(), Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        // SAFETY: the caller's contract is `System`'s.
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            LIVE.fetch_sub(l.size(), Relaxed);
            grew(new);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

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

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn main() {
    let state = synthetic::cluster(&Spec::new(10_000, 10));
    let plan = kproxy_core::plan(&state, "node-0", &PlanConfig::default());
    let cfg = DataplaneConfig::default();
    let before = rss_kib();
    let live_before = LIVE.load(Relaxed);
    PEAK.store(live_before, Relaxed);
    let recs = [
        FamilyRecord::full(&plan, &cfg, IpFamily::IPv4),
        FamilyRecord::full(&plan, &cfg, IpFamily::IPv6),
    ];
    let after = rss_kib();
    let live = LIVE.load(Relaxed) - live_before;
    let peak = PEAK.load(Relaxed) - live_before;
    let mut script = String::new();
    for r in &recs {
        r.full_script(&mut script);
    }
    println!(
        "record_memory 10000x10: FamilyRecord (both families) live {:.1} MiB (peak while \
         building {:.1} MiB), RSS +{:.1} MiB; full script {:.1} MB",
        mib(live),
        mib(peak),
        after.saturating_sub(before) as f64 / 1024.0,
        script.len() as f64 / 1e6
    );
}
