//! What the test suites of every crate share: the one policy for root-only tests,
//! [`run`], a command a test needs to succeed, [`netns`], named network namespaces,
//! and [`conformance`], upstream's test tables.
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
