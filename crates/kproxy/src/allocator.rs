//! The process's memory allocator: jemalloc, configured to give freed memory back to the
//! kernel as soon as it is freed.
//!
//! Why not the system allocator: a node agent's memory comes in bursts (the first sync
//! parses, plans and renders everything on every core, then idles for hours), and
//! glibc keeps what each thread's arena once held. When this was chosen, `kproxy run`
//! at 10k Services × 10 endpoints held 55 MiB of live heap after its first sync, and
//! glibc left it at
//! 115–128 MiB RSS in five arenas. jemalloc with a background purging thread settles at
//! 81 MiB, and at 74–75 MiB with one arena (BENCHMARKS.md, "kproxy run at scale"), with
//! the same first-sync time: the threads' own caches (tcache) keep allocation off the
//! shared arena's lock. Capping glibc at one arena got to 76 MiB but serialised the
//! parsing threads.
//!
//! Freed pages are returned to the kernel at once (`dirty_decay_ms:0`), not kept for
//! reuse: a full sync's transients (the typed nft tables, their transaction, growing
//! vectors) free pages that later allocations of other sizes cannot reuse, and keeping
//! them added 22–31 MiB to the peak RSS of `kproxy run` at 10k Services × 10 endpoints
//! from the real API (133–143 MiB with a 1 s decay, 111–112 MiB at once; the first
//! sync's nft time within run-to-run noise: BENCHMARKS.md, "kproxy run from the real
//! API"). Returning at once also needs no background purging thread.
//! `_RJEM_MALLOC_CONF` in the environment still overrides this at run time.
//!
//! The one module of the workspace allowed `unsafe` (reviewed): exporting the options
//! symbol needs `#[unsafe(export_name)]`, and the test reads options back with mallctl.
#![allow(unsafe_code)]

#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// Read by jemalloc at its initialisation (the prefixed build's name for
/// `malloc_conf`): a pointer to a NUL-terminated string.
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "_rjem_malloc_conf")]
pub static malloc_conf: &[u8; 44] = b"dirty_decay_ms:0,muzzy_decay_ms:0,narenas:1\0";

#[cfg(test)]
mod tests {
    use tikv_jemalloc_ctl::{epoch, raw};

    #[test]
    fn jemalloc_runs_with_the_configured_purging() {
        epoch::advance().expect("jemalloc answers");
        // SAFETY: both options are `ssize_t` in jemalloc 5.
        let decay = |name: &[u8]| unsafe { raw::read::<isize>(name) }.expect("decay option");
        // jemalloc's default is 10 s: 0 shows the malloc_conf symbol was read.
        assert_eq!(decay(b"opt.dirty_decay_ms\0"), 0);
        assert_eq!(decay(b"opt.muzzy_decay_ms\0"), 0);
        // SAFETY: `opt.narenas` is `unsigned` in jemalloc 5.
        let narenas = unsafe { raw::read::<u32>(b"opt.narenas\0") }.expect("opt.narenas");
        assert_eq!(narenas, 1);
    }
}
