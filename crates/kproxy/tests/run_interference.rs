//! `kproxy run` under interference, as root, in network namespaces this test
//! creates. Another process (`nft`) flushes the ruleset, deletes an element and a rule
//! of kproxy's tables, or keeps deleting a table in a loop: kproxy logs the process,
//! counts it, restores its tables from its record, says 503 on `/healthz` while a table
//! is missing, and backs off against the loop instead of spinning.

#![expect(
    clippy::disallowed_types,
    reason = "times a real kproxy process: wall time"
)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{
    Daemon, Fabric, Netns, can_run, eventually, fabric, http_get, kproxy_run, manifests, metric,
};

const TABLE: &str = "kpi";

fn start_daemon(node: &Netns, dir: &Path, log: &Path) -> Daemon {
    let log = std::fs::File::create(log).expect("log file");
    Daemon(
        kproxy_run(node, &["--manifests", dir.to_str().unwrap()])
            .args(["--nft-table", TABLE])
            .args(["--min-sync-period", "50ms", "--sync-period", "30s"])
            .stderr(log)
            .spawn()
            .expect("start kproxy run"),
    )
}

/// `nft ARGS` in the node namespace; whether it succeeded.
fn nft(node: &Netns, args: &str) -> bool {
    Command::new("ip")
        .args(["netns", "exec", &node.0, "nft"])
        .args(args.split(' '))
        .stderr(Stdio::null())
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `nft list ...` output in the node namespace (empty when it fails).
fn nft_list(node: &Netns, what: &str) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &node.0, "nft", "list"])
        .args(what.split(' '))
        .output()
        .expect("nft");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A node namespace with `kproxy run` up (dropped first: killed before the namespaces
/// go), its log file.
struct Up {
    _daemon: Daemon,
    fab: Fabric,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

fn up(tag: char) -> Up {
    let fab = fabric(tag);
    let dir = manifests();
    let log = dir.path().join("kproxy.log");
    let daemon = start_daemon(&fab.node, dir.path(), &log);
    ready(&fab.node);
    Up {
        _daemon: daemon,
        fab,
        log,
        _dir: dir,
    }
}

/// The daemon up: the cluster IP answers, `/healthz` says 200.
fn ready(node: &Netns) {
    eventually(node, "the cluster IP to answer", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });
    eventually(node, "/healthz 200", || {
        http_get("127.0.0.1:10256".parse().unwrap(), "/healthz").filter(|(c, _)| *c == 200)
    });
}

/// Probes `/healthz` in the node namespace every few milliseconds until stopped;
/// the statuses seen.
struct Prober {
    done: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<u16>>,
}

impl Prober {
    fn start(node: &Netns) -> Prober {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        let thread = node.spawn(move || {
            let mut seen = Vec::new();
            while !d.load(Ordering::SeqCst) {
                if let Some((c, _)) = http_get("127.0.0.1:10256".parse().unwrap(), "/healthz") {
                    seen.push(c);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            seen
        });
        Prober { done, thread }
    }

    fn stop(self) -> Vec<u16> {
        self.done.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}

#[test]
fn a_flushed_ruleset_is_restored_and_the_log_names_the_process() {
    if !can_run() {
        return;
    }
    let up = up('f');
    let (node, log) = (&up.fab.node, &up.log);
    let prober = Prober::start(node);
    assert!(nft(node, "flush ruleset"));
    eventually(node, "the cluster IP to answer again", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });
    assert!(nft_list(node, &format!("table ip6 {TABLE}")).contains("nat-prerouting"));
    eventually(node, "/healthz 200 again", || {
        http_get("127.0.0.1:10256".parse().unwrap(), "/healthz").filter(|(c, _)| *c == 200)
    });
    let seen = prober.stop();
    // Detection to repair takes milliseconds here: a probe may or may not fall into it.
    eprintln!(
        "/healthz answers during the flush: {} probes, {} of them 503",
        seen.len(),
        seen.iter().filter(|c| **c == 503).count()
    );
    let text = std::fs::read_to_string(log).unwrap();
    let line = text
        .lines()
        .find(|l| l.contains("another process changed kproxy's nftables tables"))
        .unwrap_or_else(|| panic!("no interference logged:\n{text}"));
    assert!(line.contains("process=nft"), "{line}");
    assert!(line.contains("tables_missing=true"), "{line}");
    assert!(text.contains("kproxy's nftables tables repaired"), "{text}");
    let tables = metric(node, r#"kproxy_kernel_interference_total{what="table"}"#);
    assert_eq!(tables, Some(1.0));
    assert_eq!(
        metric(node, "kproxy_kernel_interference_repairs_total"),
        Some(1.0)
    );
}

#[test]
fn a_deleted_element_and_a_flushed_chain_are_restored() {
    if !can_run() {
        return;
    }
    let up = up('e');
    let node = &up.fab.node;
    // The cluster IP's dispatch element: without it the Service is unreachable.
    assert!(nft(
        node,
        &format!("delete element ip {TABLE} service-ips {{ 10.96.0.10 . tcp . 80 }}")
    ));
    let elements = || nft_list(node, &format!("map ip {TABLE} service-ips"));
    poll("the service-ips element restored", || {
        elements().contains("10.96.0.10 . tcp . 80")
    });
    eventually(node, "the cluster IP to answer again", || {
        http_get("10.96.0.10:80".parse().unwrap(), "/").filter(|(c, _)| *c == 200)
    });
    assert!(nft(node, &format!("flush chain ip {TABLE} nat-output")));
    let chain = || nft_list(node, &format!("chain ip {TABLE} nat-output"));
    poll("the nat-output rule restored", || {
        chain().contains("jump services")
    });
    assert_eq!(
        metric(node, r#"kproxy_kernel_interference_total{what="element"}"#),
        Some(1.0)
    );
    assert_eq!(
        metric(node, r#"kproxy_kernel_interference_total{what="rule"}"#),
        Some(1.0)
    );
    assert_eq!(
        metric(node, "kproxy_kernel_interference_repairs_total"),
        Some(2.0)
    );
    // The conntrack table as the kernel shows it (its limit is the host's).
    let max: f64 = std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    poll("the conntrack metrics", || {
        metric(node, "kproxy_conntrack_max") == Some(max)
            && metric(node, "kproxy_conntrack_entries").is_some()
            && metric(node, "kproxy_conntrack_insert_failed_total").is_some()
    });
    // Repairs by delta never removed the tables: /healthz stayed truthful-200.
    let (code, body) = node
        .run(|| http_get("127.0.0.1:10256".parse().unwrap(), "/healthz"))
        .expect("/healthz");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""kernelRules":"intact""#), "{body}");
    assert!(body.contains(r#""conntrackFull":false"#), "{body}");
}

/// Polls `ok` every 50 ms for up to 20 s.
fn poll(what: &str, ok: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !ok() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_process_that_keeps_deleting_the_table_meets_a_backoff_not_a_spin() {
    if !can_run() {
        return;
    }
    let up = up('k');
    let (node, log) = (&up.fab.node, &up.log);
    let prober = Prober::start(node);
    // 40 attempts, 100 ms apart: without a backoff every one would find the table
    // repaired and delete it again.
    const ATTEMPTS: usize = 40;
    let mut deleted = 0;
    for _ in 0..ATTEMPTS {
        if nft(node, &format!("delete table ip {TABLE}")) {
            deleted += 1;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    poll("the table restored after the fight", || {
        nft_list(node, &format!("table ip {TABLE}")).contains("nat-prerouting")
    });
    eventually(node, "/healthz 200 after the fight", || {
        http_get("127.0.0.1:10256".parse().unwrap(), "/healthz").filter(|(c, _)| *c == 200)
    });
    let seen = prober.stop();
    let repairs = metric(node, "kproxy_kernel_interference_repairs_total").expect("metric");
    let text = std::fs::read_to_string(log).unwrap();
    eprintln!(
        "{ATTEMPTS} attempts, {deleted} deletions, {repairs} repairs, {} of {} probes 503",
        seen.iter().filter(|c| **c == 503).count(),
        seen.len()
    );
    assert!(
        deleted >= 3,
        "the loop deleted the table {deleted} times:\n{text}"
    );
    assert!(
        repairs <= (ATTEMPTS / 3) as f64,
        "{repairs} repairs against {ATTEMPTS} attempts ({deleted} deletions): no backoff\n{text}"
    );
    assert!(text.contains("backing off"), "no loud warning:\n{text}");
    // The table stays missing for the backoff's waits: /healthz says so.
    assert!(seen.contains(&503), "no 503 among {} probes", seen.len());
}
