//! The process's memory allocator: jemalloc, configured to give freed memory back to the
//! kernel soon after a burst.
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
//! Freed pages are returned after about a second (`dirty_decay_ms`) by jemalloc's own
//! background thread, so an idle daemon shrinks without any allocation to trigger it.
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
pub static malloc_conf: &[u8; 70] =
    b"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0,narenas:1\0";

#[cfg(test)]
mod tests {
    use tikv_jemalloc_ctl::{background_thread, epoch, opt, raw};

    #[test]
    fn jemalloc_runs_with_the_configured_purging() {
        epoch::advance().expect("jemalloc answers");
        assert!(
            opt::background_thread::read().expect("opt.background_thread"),
            "the malloc_conf symbol was not read"
        );
        assert!(background_thread::read().expect("background_thread"));
        // SAFETY: both options are `ssize_t` in jemalloc 5.
        let decay = |name: &[u8]| unsafe { raw::read::<isize>(name) }.expect("decay option");
        assert_eq!(decay(b"opt.dirty_decay_ms\0"), 1000);
        assert_eq!(decay(b"opt.muzzy_decay_ms\0"), 0);
        // SAFETY: `opt.narenas` is `unsigned` in jemalloc 5.
        let narenas = unsafe { raw::read::<u32>(b"opt.narenas\0") }.expect("opt.narenas");
        assert_eq!(narenas, 1);
    }
}
