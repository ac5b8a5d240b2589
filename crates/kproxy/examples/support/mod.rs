//! What the benches share: finding the kproxy binary built beside them, and numbering
//! addresses.

use std::path::{Path, PathBuf};

/// The kproxy binary of the bench's own profile: target/PROFILE/examples/BENCH →
/// target/PROFILE/kproxy.
pub fn kproxy_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join("kproxy");
    assert!(
        bin.exists(),
        "{} missing: run `cargo build --release -p kproxy` (the bench's profile) first",
        bin.display()
    );
    bin
}

/// The `n`-th IPv4 address after `base`.
pub fn ip4(base: u32, n: usize) -> String {
    std::net::Ipv4Addr::from(base + n as u32).to_string()
}
