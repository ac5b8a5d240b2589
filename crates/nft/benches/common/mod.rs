//! What the dataplane benches share: the cluster sizes asked for on the command line, and
//! a throwaway network namespace to run in.

use std::process::Command;

/// The sizes (`SERVICESxENDPOINTS`, e.g. `10000x10`) among the bench's arguments, or
/// `default` when there are none.
#[allow(
    dead_code,
    reason = "each bench includes this module; not every one asks for sizes"
)]
pub fn sizes(default: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let asked: Vec<(usize, usize)> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .filter_map(|a| {
            let (s, e) = a.split_once('x')?;
            Some((s.parse().ok()?, e.parse().ok()?))
        })
        .collect();
    if asked.is_empty() {
        default.to_vec()
    } else {
        asked
    }
}

#[allow(dead_code, reason = "the forwarding bench makes namespaces of its own")]
/// Runs `f` on a thread inside a network namespace of its own (root), deleted after;
/// prints a note and does nothing when one cannot be made.
pub fn in_throwaway_netns(tag: &str, f: impl FnOnce() + Send + 'static) {
    struct Ns(String);
    impl Drop for Ns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let name = format!("{tag}{}", std::process::id());
    let ok = Command::new("ip")
        .args(["netns", "add", &name])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("cannot create a network namespace (needs root); skipping");
        return;
    }
    let ns = Ns(name);
    let path = format!("/run/netns/{}", ns.0);
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).expect("open netns");
        nix::sched::setns(file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f();
    })
    .join()
    .expect("bench thread");
}
