//! What the memory benches measure, in one place for every crate's memory bench
//! (included by path: a bench support file has no crate of its own, and `kproxy-core`
//! itself stays free of I/O such as reading /proc). Two measures: live heap bytes,
//! through a counting global allocator (what the structures hold, and the peak while
//! building them), and VmRSS from /proc/self/status (Linux), which also counts the
//! allocator slack a daemon keeps.
//!
//! One of the workspace's two reviewed exceptions to `unsafe_code` (Cargo.toml): a
//! global allocator is an `unsafe impl`. It forwards every call to `System` unchanged
//! (a crate such as peak_alloc would turn every realloc into alloc+copy+free, and so
//! change the peak it reports).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

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

/// Heap bytes allocated now.
pub fn live() -> usize {
    LIVE.load(Relaxed)
}

/// Starts a new high-water mark from the bytes allocated now.
pub fn reset_peak() {
    PEAK.store(live(), Relaxed);
}

/// The most heap bytes allocated at once since [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Relaxed)
}

/// VmRSS in KiB (0 when /proc/self/status cannot be read).
pub fn rss_kib() -> u64 {
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

pub fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}
