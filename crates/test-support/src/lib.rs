//! What the test suites of every crate share: the one policy for root-only tests,
//! [`run`], a command a test needs to succeed, [`netns`], named network namespaces,
//! [`nft_neighbour`], another program writing nftables beside kproxy, and
//! [`conformance`], upstream's test tables.
//!
//! Tests that build network namespaces or program nftables need root; CI (`.ci/run`)
//! runs as root, so there every such test runs. A test that needs root and finds
//! itself without it must not pass green in silence: it fails, saying why, unless
//! `KPROXY_SKIP_ROOT_TESTS=1` asks to skip them. A skip is then written to the
//! process's standard error directly, which the test harness does not capture (it
//! captures only `print!`/`eprint!`), so every skipped test shows in the output.
#![forbid(unsafe_code)]

use std::io::Write;
use std::process::Command;

/// The variable that turns a root-only test run without root into a visible skip.
pub const SKIP_VAR: &str = "KPROXY_SKIP_ROOT_TESTS";

/// Whether the calling root-only test may run: `true` as root. Without root it panics
/// naming `needs`, or, with `KPROXY_SKIP_ROOT_TESTS=1`, writes a skip line that the
/// harness shows and returns `false` (the test then returns at once).
pub fn root(needs: &str) -> bool {
    // Straight to fd 2: `eprintln!` would be captured and shown only on failure.
    decide(
        nix::unistd::geteuid().is_root(),
        skip_asked(),
        needs,
        &mut std::io::stderr(),
    )
}

/// Runs `cmd` to its end and answers its standard output. Panics, naming the command
/// and showing its exit and standard error, when it cannot start or does not succeed:
/// a test's setup step (`ip`, `nft`, `kubectl`) or a command under test whose failure
/// fails the test.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Named network namespaces (`ip netns`) of a test or a bench: made afresh, used,
/// entered and deleted. The owner's type deletes its namespace on drop ([`del`]).
pub mod netns {
    use std::process::Command;

    /// Creates the namespace `name` afresh (one a killed run left behind is deleted
    /// first), its loopback up.
    pub fn add(name: &str) {
        del(name);
        crate::run(Command::new("ip").args(["netns", "add", name]));
        exec(name, &["ip", "link", "set", "lo", "up"]);
    }

    /// Runs `args` inside the namespace `name` (`ip netns exec`) and answers its
    /// standard output; a failure fails the caller ([`crate::run`]).
    pub fn exec(name: &str, args: &[&str]) -> String {
        crate::run(Command::new("ip").args(["netns", "exec", name]).args(args))
    }

    /// Moves the calling thread into the namespace `name`: the sockets it makes
    /// afterwards stay there, whichever thread uses them.
    pub fn enter(name: &str) {
        use std::os::fd::AsFd;
        let f = std::fs::File::open(format!("/var/run/netns/{name}")).expect("open netns");
        nix::sched::setns(f.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
    }

    /// Deletes the namespace `name` when it exists; never fails (for a `Drop`).
    pub fn del(name: &str) {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
    }
}

/// Another nftables user of a network namespace, as a CNI plugin or a firewall is: a
/// thread adding one rule at a time to a table of its own (`ip NAME`, chain `c`) over
/// nfnetlink, each add its own acknowledged transaction, timed. Benches measure the
/// slowest add (the stall kproxy's transactions impose on others); tests use its
/// transactions to move the ruleset's generation while kproxy reads its tables.
#[expect(
    clippy::disallowed_types,
    reason = "a blocking thread timing the kernel's answers"
)]
pub mod nft_neighbour {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    /// The adding thread; [`Neighbour::stop`] ends it and deletes its table.
    pub struct Neighbour {
        stop: Arc<AtomicBool>,
        thread: std::thread::JoinHandle<Adds>,
    }

    /// The adds a [`Neighbour`] made: when each began and how long it took.
    #[derive(Clone, Debug, Default)]
    pub struct Adds(pub Vec<(Instant, Duration)>);

    impl Adds {
        /// The slowest add.
        pub fn worst(&self) -> Duration {
            self.0.iter().map(|a| a.1).max().unwrap_or_default()
        }

        /// The slowest add that began at or after `from` (a phase of a bench).
        pub fn worst_since(&self, from: Instant) -> Duration {
            let since = self.0.iter().filter(|a| a.0 >= from);
            since.map(|a| a.1).max().unwrap_or_default()
        }

        /// The slowest add that began before `until`.
        pub fn worst_before(&self, until: Instant) -> Duration {
            let before = self.0.iter().filter(|a| a.0 < until);
            before.map(|a| a.1).max().unwrap_or_default()
        }

        pub fn len(&self) -> usize {
            self.0.len()
        }

        pub fn is_empty(&self) -> bool {
            self.0.is_empty()
        }
    }

    impl Neighbour {
        /// Starts adding one rule to `ip TABLE` in namespace `ns` every `period` (zero:
        /// back to back).
        pub fn start(ns: &str, table: &str, period: Duration) -> Neighbour {
            let stop = Arc::new(AtomicBool::new(false));
            let (ns, table, s) = (ns.to_string(), table.to_string(), stop.clone());
            let thread = std::thread::spawn(move || {
                crate::netns::enter(&ns);
                let mut nl = Socket::open(&table);
                nl.setup();
                let mut adds = Adds::default();
                while !s.load(Ordering::Relaxed) {
                    let at = Instant::now();
                    adds.0.push((at, nl.add_rule()));
                    if adds.len() % 10_000 == 0 {
                        // A chain of ever more rules would make each add dearer.
                        nl.teardown();
                        nl.setup();
                    }
                    std::thread::sleep(period);
                }
                nl.teardown();
                adds
            });
            Neighbour { stop, thread }
        }

        /// Stops adding: the adds made.
        pub fn stop(self) -> Adds {
            self.stop.store(true, Ordering::Relaxed);
            self.thread.join().expect("neighbour thread")
        }
    }

    /// The neighbour's nfnetlink: batches of one message, framed by hand (it shares
    /// nothing with kproxy's writer, as another program would not).
    pub struct Socket {
        fd: std::os::fd::OwnedFd,
        seq: u32,
        table: String,
    }

    const CHAIN: &str = "c";
    const NFNL_SUBSYS_NFTABLES: u16 = 10;
    const BEGIN: u16 = 0x10;
    const END: u16 = 0x11;
    const NEWTABLE: u16 = 0;
    const NEWCHAIN: u16 = 3;
    const NEWRULE: u16 = 6;
    const DELTABLE: u16 = 2;
    const F_REQUEST: u16 = 1;
    const F_ACK: u16 = 4;
    const F_CREATE: u16 = 0x400;
    const F_APPEND: u16 = 0x800;

    fn attr(out: &mut Vec<u8>, kind: u16, s: &str) {
        let len = 4 + s.len() + 1;
        out.extend_from_slice(&(len as u16).to_ne_bytes());
        out.extend_from_slice(&kind.to_ne_bytes());
        out.extend_from_slice(s.as_bytes());
        out.push(0);
        out.resize(out.len().next_multiple_of(4), 0);
    }

    impl Socket {
        /// A netfilter netlink socket in the calling thread's namespace, for `ip TABLE`.
        pub fn open(table: &str) -> Socket {
            use nix::sys::socket::{
                AddressFamily, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, socket,
            };
            use std::os::fd::AsRawFd;
            let fd = socket(
                AddressFamily::Netlink,
                SockType::Raw,
                SockFlag::empty(),
                SockProtocol::NetlinkNetFilter,
            )
            .expect("netlink socket");
            bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).expect("bind");
            Socket {
                fd,
                seq: 1,
                table: table.to_string(),
            }
        }

        fn msg(
            &mut self,
            out: &mut Vec<u8>,
            kind: u16,
            flags: u16,
            res: u16,
            attrs: &[(u16, &str)],
        ) {
            let start = out.len();
            out.extend_from_slice(&[0; 4]);
            out.extend_from_slice(&kind.to_ne_bytes());
            out.extend_from_slice(&(F_REQUEST | flags).to_ne_bytes());
            self.seq += 1;
            out.extend_from_slice(&self.seq.to_ne_bytes());
            out.extend_from_slice(&0u32.to_ne_bytes());
            out.extend_from_slice(&[2, 0]); // NFPROTO_IPV4, version
            out.extend_from_slice(&res.to_be_bytes());
            for (k, v) in attrs {
                attr(out, *k, v);
            }
            let len = (out.len() - start) as u32;
            out[start..start + 4].copy_from_slice(&len.to_ne_bytes());
        }

        /// One transaction of one message, acknowledged: how long the kernel took to
        /// answer.
        fn transaction(&mut self, kind: u16, flags: u16, attrs: &[(u16, &str)]) -> Duration {
            use nix::sys::socket::{MsgFlags, recv, send};
            use std::os::fd::AsRawFd;
            let mut b = Vec::new();
            self.msg(&mut b, BEGIN, 0, NFNL_SUBSYS_NFTABLES, &[]);
            self.msg(
                &mut b,
                (NFNL_SUBSYS_NFTABLES << 8) | kind,
                flags | F_ACK,
                0,
                attrs,
            );
            let seq = self.seq;
            self.msg(&mut b, END, 0, NFNL_SUBSYS_NFTABLES, &[]);
            let t = Instant::now();
            send(self.fd.as_raw_fd(), &b, MsgFlags::empty()).expect("send");
            let mut buf = vec![0u8; 8192];
            loop {
                let n = recv(self.fd.as_raw_fd(), &mut buf, MsgFlags::empty()).expect("recv");
                let mut at = 0;
                while at + 20 <= n {
                    let word = |at: usize| buf[at..at + 4].try_into().expect("4 bytes");
                    let len = u32::from_ne_bytes(word(at)) as usize;
                    let kind = u16::from_ne_bytes([buf[at + 4], buf[at + 5]]);
                    let got = u32::from_ne_bytes(word(at + 8));
                    if kind == 2 && got == seq {
                        let err = i32::from_ne_bytes(word(at + 16));
                        assert!(err == 0, "the neighbour's nftables message failed: {err}");
                        return t.elapsed();
                    }
                    at += len.max(20).next_multiple_of(4);
                }
            }
        }

        /// Creates the table and its chain.
        pub fn setup(&mut self) {
            let table = self.table.clone();
            self.transaction(NEWTABLE, F_CREATE, &[(1, &table)]);
            self.transaction(NEWCHAIN, F_CREATE, &[(1, &table), (3, CHAIN)]);
        }

        /// An empty rule (no expressions) appended to the chain: how long it took.
        pub fn add_rule(&mut self) -> Duration {
            let table = self.table.clone();
            self.transaction(NEWRULE, F_CREATE | F_APPEND, &[(1, &table), (2, CHAIN)])
        }

        /// Deletes the table.
        pub fn teardown(&mut self) {
            let table = self.table.clone();
            self.transaction(DELTABLE, 0, &[(1, &table)]);
        }
    }
}

/// Upstream kube-proxy's test tables, re-encoded as JSON in the `conformance` folder of
/// the shared folder beside the repository, or of `KPROXY_SHARED` (docs/conformance.md).
pub mod conformance {
    use std::path::PathBuf;

    use serde_json::Value;

    fn dir() -> PathBuf {
        if let Ok(d) = std::env::var("KPROXY_SHARED") {
            return PathBuf::from(d).join("conformance");
        }
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/conformance")
    }

    /// The array `key` of the table `file` (`service_health.json`, `vectors`); panics
    /// naming the file when it cannot be read or parsed.
    pub fn load(file: &str, key: &str) -> Vec<Value> {
        let path = dir().join(file);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (set KPROXY_SHARED to the shared/ folder)",
                path.display()
            )
        });
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        v[key].as_array().cloned().unwrap_or_default()
    }

    /// A vector's `name` as a test name: lower case, every other character `_`.
    pub fn slug(v: &Value) -> String {
        let name = v["name"].as_str().unwrap_or("unnamed");
        let s: String = name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() {
                    c.to_ascii_lowercase()
                } else {
                    '_'
                }
            })
            .collect();
        s.trim_matches('_').to_string()
    }
}

fn skip_asked() -> bool {
    std::env::var(SKIP_VAR).is_ok_and(|v| v == "1")
}

fn decide(is_root: bool, skip: bool, needs: &str, out: &mut impl Write) -> bool {
    if is_root {
        return true;
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("a root-only test")
        .to_string();
    assert!(
        skip,
        "{test} needs root ({needs}); run as root (.ci/run does), or set {SKIP_VAR}=1 to skip it"
    );
    let _ = writeln!(
        out,
        "SKIPPED (not root, {SKIP_VAR}=1): {test}: needs {needs}"
    );
    false
}

#[cfg(test)]
mod tests {
    use super::{decide, run};
    use std::process::Command;

    #[test]
    fn run_answers_stdout_and_fails_with_stderr() {
        assert_eq!(run(Command::new("sh").args(["-c", "echo out"])), "out\n");
        let failed = std::panic::catch_unwind(|| {
            run(Command::new("sh").args(["-c", "echo why >&2; exit 3"]))
        });
        let msg = failed.expect_err("a failing command fails the test");
        let msg = msg.downcast_ref::<String>().expect("a formatted message");
        assert!(
            msg.contains("exit status: 3") && msg.contains("why"),
            "{msg}"
        );
    }

    #[test]
    fn root_runs_whatever_the_variable_says() {
        let mut out = Vec::new();
        assert!(decide(true, false, "x", &mut out));
        assert!(decide(true, true, "x", &mut out));
        assert!(out.is_empty());
    }

    #[test]
    fn without_root_a_skip_must_be_asked_for() {
        let mut out = Vec::new();
        assert!(!decide(false, true, "nftables", &mut out));
        let said = String::from_utf8(out).unwrap();
        assert!(said.starts_with("SKIPPED (not root"), "{said}");
        assert!(said.contains("needs nftables"), "{said}");
        let failed = std::panic::catch_unwind(|| {
            decide(false, false, "network namespaces", &mut Vec::new())
        });
        let msg = failed.expect_err("not root and no skip asked: the test fails");
        let msg = msg.downcast_ref::<String>().expect("a formatted message");
        assert!(msg.contains("needs root (network namespaces)"), "{msg}");
        assert!(msg.contains("KPROXY_SKIP_ROOT_TESTS=1"), "{msg}");
    }
}
