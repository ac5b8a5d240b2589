//! What the benches share: finding the kproxy binary built beside them, numbering
//! addresses, their network namespaces and child processes (removed and killed on
//! drop), running a set-up command, and reading the clock, the load and /proc.

// Each bench uses its own subset of these helpers.
#![allow(dead_code)]

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

/// The endpoints of the `i`-th Service's EndpointSlice at `eps` a Service (JSON, as
/// the API takes them): pod IPs from 10.244.0.1 on, over node-0 … node-99, every
/// seventh terminating.
pub fn slice_endpoints(i: usize, eps: usize) -> Vec<serde_json::Value> {
    (0..eps)
        .map(|e| {
            let n = i * eps + e;
            let terminating = n % 7 == 6;
            serde_json::json!({"addresses": [ip4(0x0af4_0000, n + 1)], "nodeName": format!("node-{}", n % 100),
                   "conditions": {"ready": !terminating, "serving": true, "terminating": terminating}})
        })
        .collect()
}

/// Runs a command, panicking with its stderr when it fails (a bench's set-up step).
pub fn sh(args: &[&str]) {
    kproxy_test_support::run(std::process::Command::new(args[0]).args(&args[1..]));
}

/// A network namespace the bench creates (its loopback up), deleted on drop.
pub struct Netns(pub String);

impl Netns {
    /// `name`, created afresh (one left by a killed run is deleted first).
    pub fn new(name: String) -> Netns {
        kproxy_test_support::netns::add(&name);
        Netns(name)
    }

    /// Runs a command inside the namespace (`ip netns exec`).
    pub fn exec(&self, args: &[&str]) {
        kproxy_test_support::netns::exec(&self.0, args);
    }

    /// The probe's path inside the namespace: a veth pair, `{name}0` with 10.200.0.1/24
    /// and `{name}1` with `probe_ip`/24 (the probe pod's address), both up, and
    /// `cluster_cidr` routed through `{name}0`, as a node routes cluster IPs by its
    /// default route (the routing decision comes before the DNAT in the output hook).
    pub fn probe_veth(&self, name: &str, probe_ip: &str, cluster_cidr: &str) {
        let (a, b) = (format!("{name}0"), format!("{name}1"));
        self.exec(&["ip", "link", "add", &a, "type", "veth", "peer", "name", &b]);
        self.exec(&["ip", "addr", "add", "10.200.0.1/24", "dev", &a]);
        self.exec(&["ip", "addr", "add", &format!("{probe_ip}/24"), "dev", &b]);
        self.exec(&["ip", "link", "set", &a, "up"]);
        self.exec(&["ip", "link", "set", &b, "up"]);
        self.exec(&["ip", "route", "add", cluster_cidr, "dev", &a]);
    }

    /// Moves the calling thread into the namespace named `name` (sockets it makes
    /// afterwards stay there, whichever thread uses them).
    pub fn enter(name: &str) {
        kproxy_test_support::netns::enter(name);
    }

    /// Runs `f` on a thread of its own inside the namespace and waits for it.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let name = self.0.clone();
        std::thread::spawn(move || {
            Netns::enter(&name);
            f()
        })
        .join()
        .expect("netns thread")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        kproxy_test_support::netns::del(&self.0);
    }
}

/// A child process, killed and reaped on drop.
pub struct Proc(pub std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Microseconds since the epoch (the event log's `committed_unix_us` clock).
pub fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// The machine's load averages over 1, 5 and 15 minutes (what `uptime` prints), to
/// stand beside every figure.
pub fn load() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// A `Name: N kB` field of a /proc file (`VmHWM:` of /proc/PID/status, `SUnreclaim:` of
/// /proc/meminfo), in KiB; 0 when absent.
pub fn proc_kib(path: &str, field: &str) -> u64 {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// A field of /proc/PID/status in KiB (`VmHWM:`, the peak RSS).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    proc_kib(&format!("/proc/{pid}/status"), field)
}

/// utime + stime of `pid` in clock ticks (`/proc/PID/stat` fields 14 and 15; USER_HZ is
/// 100 on every Linux the benches run on); 0 when unreadable.
pub fn cpu_ticks(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces: count from the `)` that ends it.
    let rest = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)
}

/// CPU seconds (user + system) of every child waited for so far.
pub fn children_cpu() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    let u = getrusage(UsageWho::RUSAGE_CHILDREN).expect("getrusage");
    let secs = |t: nix::sys::time::TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    secs(u.user_time()) + secs(u.system_time())
}
