//! The cost of one structural transaction through `nft -f` (a dispatch group's map,
//! chain and rule created, then deleted, as a Service's endpoint count moves), in a
//! throwaway network namespace: wall time from handing `nft` its script to the caller
//! going on, p50 and max of `ROUNDS` each way, for a one-off call (until `nft` exits)
//! and for the dataplane's `nft::Runner` (until the kernel's commit). It is what a
//! structural delta, and a repair's structure, wait for.
//!
//! Run: `cargo bench -p kproxy-nft --bench nft_commit` (root).

mod common;

use std::time::{Duration, Instant};

const ROUNDS: usize = 40;

fn main() {
    common::in_throwaway_netns("kpnftc", || {
        kproxy_nft::nft::run_script(
            "add table ip kpbench\n\
             add chain ip kpbench pre { type nat hook prerouting priority -101; }\n",
        )
        .expect("the table");
        let add = "add map ip kpbench dnat-c-2 { typeof ip daddr . meta l4proto . th dport . numgen random mod 2 : ip daddr . th dport; }\n\
                   add chain ip kpbench disp-c-2\n\
                   add rule ip kpbench disp-c-2 dnat ip to ip daddr . meta l4proto . th dport . numgen random mod 2 map @dnat-c-2\n\
                   add element ip kpbench dnat-c-2 { 10.96.0.10 . tcp . 80 . 0 : 10.244.1.2 . 8080, 10.96.0.10 . tcp . 80 . 1 : 10.244.2.3 . 8080 }\n";
        let delete = "flush chain ip kpbench disp-c-2\n\
                      delete chain ip kpbench disp-c-2\n\
                      delete map ip kpbench dnat-c-2\n";
        // One-off calls wait for nft's exit; the dataplane's runner goes on at the commit.
        let mut runner = kproxy_nft::nft::Runner::default();
        let mut samples: [Vec<Duration>; 4] = Default::default();
        for _ in 0..ROUNDS {
            for (i, script) in [add, delete].into_iter().enumerate() {
                let t = Instant::now();
                kproxy_nft::nft::run_script(script).expect("the transaction");
                samples[i].push(t.elapsed());
            }
            for (i, script) in [add, delete].into_iter().enumerate() {
                let t = Instant::now();
                runner.run_script(script).expect("the transaction");
                samples[2 + i].push(t.elapsed());
            }
        }
        kproxy_nft::nft::run_script("delete table ip kpbench\n").expect("cleanup");
        let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        let what = [
            "create a group, until nft exits",
            "delete a group, until nft exits",
            "create a group, until the commit (Runner)",
            "delete a group, until the commit (Runner)",
        ];
        for (what, mut v) in what.into_iter().zip(samples) {
            v.sort();
            println!(
                "nft -f, {what}: p50 {} ms, max {} ms ({ROUNDS} rounds)",
                ms(v[v.len() / 2]),
                ms(v[v.len() - 1])
            );
        }
    });
}
