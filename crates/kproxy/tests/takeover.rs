//! Issue 28: `kproxy run` takes a node over from upstream kube-proxy, as root, in network
//! namespaces this test creates. The rules real kube-proxy v1.36.2 programmed for the
//! lab cluster's node-1 (tests/fixtures/kube-proxy, recorded by its capture.sh) are
//! loaded into a node namespace; traffic flows through them to the Service's frontends
//! (cluster IP from the node, load-balancer IP and node port from a client outside)
//! on new and on long-lived keep-alive connections; then kproxy starts. Asserted: not
//! one request fails, every established connection keeps working, kube-proxy's tables
//! and chains are gone and nothing else is (kubelet's KUBE-FIREWALL, other tables and
//! chains stay). Bad cases: a kube-proxy still running (its rules stay until it
//! stops), rules of another kube-proxy version (only the documented names go), a
//! takeover cut off halfway (the next start finishes it).
//!
//! Needs `nft`, and `iptables` (iptables-nft) for the iptables-mode cases.

#![expect(
    clippy::disallowed_types,
    reason = "waits on real processes and packets: wall time"
)]

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{Daemon, Netns, can_run, http_get, metric, sh, write_atomic};
use kproxy_core::model::IpFamily;
use kproxy_core::takeover::{self, XtBackend};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/kube-proxy");
const NODE_IP: &str = "10.200.0.1";
const CLIENT_IP: &str = "10.200.0.100";
const VIP: &str = "203.0.113.10";
const PODS: [&str; 3] = ["10.244.1.2", "10.244.2.2", "10.244.3.2"];

/// The cluster of capture.sh, as kproxy reads it from manifests.
const MANIFESTS: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-1}
spec: {podCIDR: 10.244.1.0/24, podCIDRs: [10.244.1.0/24]}
status: {addresses: [{type: InternalIP, address: 10.200.0.1}]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: lab}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ipFamilies: [IPv4]
  ports: [{name: http, protocol: TCP, port: 80, targetPort: 8080, nodePort: 30080}]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
status: {loadBalancer: {ingress: [{ip: 203.0.113.10}]}}
---
apiVersion: v1
kind: Service
metadata: {name: empty, namespace: lab}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.20
  clusterIPs: [10.96.0.20]
  ipFamilies: [IPv4]
  ports: [{name: http, protocol: TCP, port: 80, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: lab, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, protocol: TCP, port: 8080}]
endpoints:
- {addresses: [10.244.1.2], nodeName: node-1, conditions: {ready: true, serving: true, terminating: false}}
- {addresses: [10.244.2.2], nodeName: node-2, conditions: {ready: true, serving: true, terminating: false}}
- {addresses: [10.244.3.2], nodeName: node-3, conditions: {ready: true, serving: true, terminating: false}}
"#;

/// Runs `f` on a new thread inside `ns` (its sockets stay there).
fn spawn_in<T: Send + 'static>(
    ns: &Netns,
    f: impl FnOnce() -> T + Send + 'static,
) -> JoinHandle<T> {
    ns.spawn(f)
}

/// node-1 (eth0 10.200.0.1, pods behind a veth), one namespace holding the three pods'
/// addresses with an HTTP server on :8080 answering the address it was reached on, and
/// a client (10.200.0.100) beside the node.
struct Cluster {
    node: Netns,
    _pods: Netns,
    client: Netns,
    stop: Arc<AtomicBool>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn cluster(tag: &str) -> Cluster {
    let node = Netns::new(&format!("tk{tag}node"));
    let pods = Netns::new(&format!("tk{tag}pods"));
    let client = Netns::new(&format!("tk{tag}cli"));
    let id = std::process::id() % 100_000;
    let (to_pods, to_client) = (format!("kvp{id}{tag}"), format!("kvc{id}{tag}"));
    sh(&[
        "ip", "link", "add", &to_pods, "netns", &node.0, "type", "veth", "peer", "name", "eth0",
        "netns", &pods.0,
    ]);
    sh(&[
        "ip", "link", "add", &to_client, "netns", &node.0, "type", "veth", "peer", "name", "eth0",
        "netns", &client.0,
    ]);
    node.exec(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    node.exec(&[
        "ip",
        "addr",
        "add",
        &format!("{NODE_IP}/24"),
        "dev",
        &to_client,
    ]);
    node.exec(&["ip", "addr", "add", "10.244.1.1/24", "dev", &to_pods]);
    node.exec(&["ip", "link", "set", &to_client, "up"]);
    node.exec(&["ip", "link", "set", &to_pods, "up"]);
    node.exec(&["ip", "route", "add", "10.244.0.0/16", "dev", &to_pods]);
    // Like a real node's default route: cluster IPs must be routable before DNAT.
    node.exec(&["ip", "route", "add", "10.96.0.0/16", "dev", &to_pods]);
    for p in PODS {
        pods.exec(&["ip", "addr", "add", &format!("{p}/16"), "dev", "eth0"]);
    }
    pods.exec(&["ip", "link", "set", "eth0", "up"]);
    pods.exec(&["ip", "route", "add", "default", "via", "10.244.1.1"]);
    client.exec(&[
        "ip",
        "addr",
        "add",
        &format!("{CLIENT_IP}/24"),
        "dev",
        "eth0",
    ]);
    client.exec(&["ip", "link", "set", "eth0", "up"]);
    client.exec(&["ip", "route", "add", &format!("{VIP}/32"), "via", NODE_IP]);

    let listener = pods.run(|| TcpListener::bind("0.0.0.0:8080").expect("pod listener"));
    let stop = common::accept_forever(listener, serve);
    Cluster {
        node,
        _pods: pods,
        client,
        stop,
    }
}

/// HTTP/1.1 with keep-alive; the body is the pod address the connection reached.
fn serve(c: TcpStream) {
    let me = c
        .local_addr()
        .map(|a| a.ip().to_string())
        .unwrap_or_default();
    common::serve_http(c, &me);
}

/// A request on a keep-alive connection; the body.
fn keepalive_request(s: &mut TcpStream) -> Result<String, String> {
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .map_err(|e| format!("write: {e}"))?;
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        let n = s.read(&mut buf).map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("closed".into());
        }
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .and_then(|v| v.trim().parse().ok())
                .ok_or("no Content-Length")?;
            if body.len() >= len {
                return Ok(body[..len].to_string());
            }
        }
    }
}

/// What a new connection to a frontend is expected to meet.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Expect {
    /// Answered by one of these pods.
    Pods(&'static [&'static str]),
    /// Rejected (a Service without endpoints).
    Refused,
}

/// One new connection; `None` when it met what was expected, else what happened.
fn probe(to: SocketAddr, expect: Expect) -> Option<String> {
    match expect {
        Expect::Pods(pods) => match http_get(to, "/") {
            Some((200, body)) if pods.contains(&body.as_str()) => None,
            Some((code, body)) => Some(format!("{to}: {code} {body}")),
            None => Some(format!("{to}: no answer")),
        },
        Expect::Refused => match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => None,
            Err(e) => Some(format!("{to}: {e} (expected refused)")),
            Ok(_) => Some(format!("{to}: connected (expected refused)")),
        },
    }
}

/// The frontends and from where: the cluster IP from the node itself (nat output), the
/// LB IP and the node port from the client (nat prerouting; eTP Local: node-1's pod
/// only), the endpoint-less Service (reject).
fn frontends() -> Vec<(bool, SocketAddr, Expect)> {
    let a = |s: &str| s.parse::<SocketAddr>().unwrap();
    vec![
        (true, a("10.96.0.10:80"), Expect::Pods(&PODS)),
        (false, a("203.0.113.10:80"), Expect::Pods(&PODS[..1])),
        (false, a("10.200.0.1:30080"), Expect::Pods(&PODS[..1])),
        (true, a("10.96.0.20:80"), Expect::Refused),
    ]
}

/// Traffic while the takeover runs: new connections to every frontend in a loop, and
/// keep-alive connections opened before, each sending a request every 20 ms.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    failures: Arc<Mutex<Vec<String>>>,
    sent: Arc<AtomicUsize>,
    keepalive_requests: Arc<Vec<AtomicUsize>>,
}

impl Load {
    fn start(c: &Cluster) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let sent = Arc::new(AtomicUsize::new(0));
        let mut threads = Vec::new();
        for (from_node, to, expect) in frontends() {
            let ns = if from_node { &c.node } else { &c.client };
            let (stop, failures, sent) = (stop.clone(), failures.clone(), sent.clone());
            threads.push(spawn_in(ns, move || {
                while !stop.load(Ordering::SeqCst) {
                    if let Some(f) = probe(to, expect) {
                        failures.lock().unwrap().push(format!("new connection {f}"));
                    }
                    sent.fetch_add(1, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
        // Long-lived connections, established through kube-proxy's rules.
        let long: Vec<(bool, SocketAddr)> = frontends()
            .into_iter()
            .filter(|(_, _, e)| *e != Expect::Refused)
            .flat_map(|(n, a, _)| [(n, a), (n, a)])
            .collect();
        let keepalive_requests: Arc<Vec<AtomicUsize>> =
            Arc::new(long.iter().map(|_| AtomicUsize::new(0)).collect());
        for (i, (from_node, to)) in long.into_iter().enumerate() {
            let ns = if from_node { &c.node } else { &c.client };
            let (stop, failures, counts) =
                (stop.clone(), failures.clone(), keepalive_requests.clone());
            let (ready_tx, ready_rx) = std::sync::mpsc::channel();
            threads.push(spawn_in(ns, move || {
                let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2))
                    .unwrap_or_else(|e| panic!("keep-alive connection to {to}: {e}"));
                s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                let first = keepalive_request(&mut s);
                let _ = ready_tx.send(());
                let Ok(pod) = first else {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("keep-alive {to}: first request {first:?}"));
                    return;
                };
                while !stop.load(Ordering::SeqCst) {
                    match keepalive_request(&mut s) {
                        Ok(p) if p == pod => {
                            counts[i].fetch_add(1, Ordering::SeqCst);
                        }
                        other => {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("keep-alive {to} (to {pod}): {other:?}"));
                            return;
                        }
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }));
            ready_rx
                .recv_timeout(Duration::from_secs(5))
                .expect("keep-alive connection up");
        }
        Load {
            stop,
            threads,
            failures,
            sent,
            keepalive_requests,
        }
    }

    fn keepalive_counts(&self) -> Vec<usize> {
        self.keepalive_requests
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .collect()
    }

    /// Stops the load; (requests on new connections, failures).
    fn finish(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            t.join().expect("load thread");
        }
        let failures = self.failures.lock().unwrap().clone();
        (self.sent.load(Ordering::SeqCst), failures)
    }
}

/// The recorded rules of kube-proxy's `mode`, loaded into the node namespace.
fn load_kube_proxy(node: &Netns, mode: &str) {
    match mode {
        "nftables" => {
            sh(&[
                "ip",
                "netns",
                "exec",
                &node.0,
                "nft",
                "-f",
                &format!("{FIXTURES}/nftables.nft"),
            ]);
        }
        "iptables" => {
            for (cmd, file) in [
                ("iptables-restore", "iptables.save"),
                ("ip6tables-restore", "ip6tables.save"),
            ] {
                let text = std::fs::read_to_string(format!("{FIXTURES}/{file}")).unwrap();
                // Without kube-proxy's `-m nfacct` matches (the helper says why).
                let text = kproxy_lab::runs::takeover::recorded::without_nfacct(&text);
                restore(node, cmd, &text);
            }
        }
        _ => unreachable!(),
    }
}

fn restore(node: &Netns, cmd: &str, text: &str) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", &node.0, cmd, "--noflush"])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("restore");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{cmd}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn out(node: &Netns, args: &[&str]) -> String {
    let o = Command::new("ip")
        .args(["netns", "exec", &node.0])
        .args(args)
        .output()
        .expect("spawn");
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Every iptables chain of the node namespace, as `table/chain` (IPv4 and IPv6).
fn xt_chains(node: &Netns) -> Vec<String> {
    let mut all = Vec::new();
    for (family, cmd) in [
        (IpFamily::IPv4, "iptables-save"),
        (IpFamily::IPv6, "ip6tables-save"),
    ] {
        let text = out(node, &[cmd]);
        for t in takeover::parse_iptables_save(XtBackend::Nft, family, &text).unwrap() {
            all.extend(
                t.chains
                    .iter()
                    .map(|c| format!("{} {}/{c}", family.as_str(), t.name)),
            );
        }
    }
    all
}

fn nft_tables(node: &Netns) -> Vec<String> {
    takeover::parse_nft_tables(&out(node, &["nft", "list", "tables"]))
        .into_iter()
        .map(|t| format!("{} {}", t.family, t.name))
        .collect()
}

fn has_iptables() -> bool {
    common::require_tool("iptables-restore", "the iptables package");
    true
}

fn start_kproxy(node: &Netns, dir: &Path, log: &Path, extra: &[&str]) -> Daemon {
    let log = std::fs::File::create(log).expect("log file");
    Daemon(
        node.kproxy("run")
            .args(["--manifests", dir.to_str().unwrap()])
            .args([
                "--hostname-override",
                "node-1",
                "--cluster-cidr",
                "10.244.0.0/16",
            ])
            .args(["--healthz-bind-address", "10.200.0.1:10256"])
            .args(["--metrics-bind-address", "127.0.0.1:10249"])
            .args(["--min-sync-period", "50ms", "--sync-period", "30s"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start kproxy run"),
    )
}

fn manifests() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_atomic(dir.path(), "cluster.yaml", MANIFESTS);
    dir
}

/// Polls `f` for up to 20 s.
fn wait_for(what: &str, log: &Path, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; kproxy's log:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of the metric series `series` (name and labels, exactly as exposed).
/// Waits (up to 10 s) until `series` reads `want`: the log line a test waits for and the
/// metrics server are separate channels. Fails with kproxy's log.
fn wait_metric(node: &Netns, series: &str, want: f64, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = metric(node, series);
    while got != Some(want) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        got = metric(node, series);
    }
    assert_eq!(
        got,
        Some(want),
        "{series}; kproxy's log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
}

fn is_kube_proxys(entry: &str) -> bool {
    // "IPv4 nat/KUBE-SVC-…" or "ip kube-proxy"
    match entry.split_once(' ') {
        Some((fam, "kube-proxy")) => fam == "ip" || fam == "ip6",
        Some((_, tc)) => tc
            .split_once('/')
            .is_some_and(|(t, c)| takeover::is_kube_proxy_chain(t, c)),
        None => false,
    }
}

/// The whole takeover from one mode: zero failures, nothing of kube-proxy's left,
/// everything else kept.
fn takeover_from(mode: &str) {
    let c = cluster(&mode[..1]);
    load_kube_proxy(&c.node, mode);
    let before: Vec<String> = [xt_chains(&c.node), nft_tables(&c.node)].concat();
    assert!(before.iter().any(|e| is_kube_proxys(e)), "{before:?}");
    // kube-proxy's rules alone carry the traffic.
    for (from_node, to, expect) in frontends() {
        let ns = if from_node { &c.node } else { &c.client };
        assert_eq!(
            ns.run(move || probe(to, expect)),
            None,
            "through kube-proxy's rules"
        );
    }
    let load = Load::start(&c);
    std::thread::sleep(Duration::from_millis(300));
    let dir = manifests();
    let logdir = tempfile::tempdir().unwrap();
    let log = logdir.path().join("kproxy.log");
    let _kproxy = start_kproxy(&c.node, dir.path(), &log, &[]);
    let gone = || {
        let now = [xt_chains(&c.node), nft_tables(&c.node)].concat();
        !now.iter().any(|e| is_kube_proxys(e)) && now.iter().any(|e| e == "ip kproxy")
    };
    wait_for("kube-proxy's rules to be removed", &log, gone);
    let at_removal = load.keepalive_counts();
    std::thread::sleep(Duration::from_millis(700));
    let after = load.keepalive_counts();
    let (sent, failures) = load.finish();
    let logtext = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {failures:#?}\n{logtext}",
        failures.len()
    );
    // Every long-lived connection kept answering after kube-proxy's rules went.
    for (i, (a, b)) in at_removal.iter().zip(&after).enumerate() {
        assert!(b > a, "keep-alive connection {i} stalled: {a} -> {b}");
    }
    assert!(sent > 100, "only {sent} new connections");
    // Nothing else went: every other table and chain is still there.
    let now: Vec<String> = [xt_chains(&c.node), nft_tables(&c.node)].concat();
    for e in before.iter().filter(|e| !is_kube_proxys(e)) {
        assert!(now.contains(e), "{e} was removed; now {now:?}");
    }
    if mode == "iptables" {
        assert!(
            now.iter().any(|e| e == "IPv4 filter/KUBE-FIREWALL"),
            "kubelet's chain: {now:?}"
        );
    }
    assert_eq!(
        metric(
            &c.node,
            &format!("kproxy_kube_proxy_rules_present{{mode=\"{mode}\"}}")
        ),
        Some(0.0)
    );
    assert!(
        metric(&c.node, "kproxy_kube_proxy_removals_total{result=\"ok\"}").unwrap_or(0.0) > 0.0
    );
    assert!(logtext.contains("removing kube-proxy's rules"), "{logtext}");
    eprintln!(
        "takeover from {mode}: {sent} new connections, 0 failed; keep-alive requests {after:?}"
    );
}

#[test]
fn takeover_from_nftables_mode_loses_nothing() {
    if !can_run() {
        return;
    }
    takeover_from("nftables");
}

#[test]
fn takeover_from_iptables_mode_loses_nothing() {
    if !can_run() || !has_iptables() {
        return;
    }
    takeover_from("iptables");
}

/// A process named kube-proxy in `node`'s network namespace (a copy of `sleep`), and
/// the directory holding its binary.
fn fake_kube_proxy(node: &Netns) -> (tempfile::TempDir, Daemon) {
    let bin = tempfile::tempdir().unwrap();
    let fake = bin.path().join("kube-proxy");
    std::fs::copy("/bin/sleep", &fake).unwrap();
    let process = Daemon(
        Command::new("ip")
            .args(["netns", "exec", &node.0])
            .arg(&fake)
            .arg("600")
            .spawn()
            .unwrap(),
    );
    (bin, process)
}

/// A kube-proxy that still runs keeps its rules (kproxy says so and counts it) until it
/// stops; then kproxy removes them. `--kube-proxy-takeover=off` never removes them.
#[test]
fn a_running_kube_proxy_keeps_its_rules_until_it_stops() {
    if !can_run() {
        return;
    }
    let c = cluster("l");
    load_kube_proxy(&c.node, "nftables");
    let (_bin, mut kube_proxy) = fake_kube_proxy(&c.node);
    let dir = manifests();
    let logdir = tempfile::tempdir().unwrap();
    let log = logdir.path().join("kproxy.log");
    let kproxy = start_kproxy(&c.node, dir.path(), &log, &[]);
    wait_for("kproxy to say kube-proxy runs", &log, || {
        std::fs::read_to_string(&log)
            .is_ok_and(|l| l.contains("kube-proxy still runs on this node"))
    });
    assert!(nft_tables(&c.node).contains(&"ip kube-proxy".to_string()));
    assert!(nft_tables(&c.node).contains(&"ip kproxy".to_string()));
    wait_metric(&c.node, "kproxy_kube_proxy_takeover_waiting", 1.0, &log);
    // kproxy's rules decide meanwhile: the cluster IP works.
    let (to, expect) = ("10.96.0.10:80".parse().unwrap(), Expect::Pods(&PODS));
    assert_eq!(c.node.run(move || probe(to, expect)), None);
    let _ = kube_proxy.0.kill();
    let _ = kube_proxy.0.wait();
    wait_for("kube-proxy's tables to go once it stopped", &log, || {
        !nft_tables(&c.node)
            .iter()
            .any(|t| t.ends_with(" kube-proxy"))
    });
    drop(kproxy);

    // --kube-proxy-takeover=off: found, logged, counted, left.
    load_kube_proxy(&c.node, "nftables");
    let log2 = logdir.path().join("kproxy-off.log");
    let _kproxy = start_kproxy(
        &c.node,
        dir.path(),
        &log2,
        &["--kube-proxy-takeover", "off"],
    );
    wait_for("kproxy to report the rules", &log2, || {
        std::fs::read_to_string(&log2)
            .is_ok_and(|l| l.contains("--kube-proxy-takeover=off leaves them"))
    });
    assert!(nft_tables(&c.node).contains(&"ip kube-proxy".to_string()));
    wait_metric(
        &c.node,
        "kproxy_kube_proxy_rules_present{mode=\"nftables\"}",
        1.0,
        &log2,
    );
}

/// kube-proxy's rules that came back after a completed takeover stayed, and
/// `kproxy_kube_proxy_rules_present` read 0 (the gauge docs/migrate.md tells operators to
/// check). They are reported (gauge 1, a warning), kept while a kube-proxy runs, and
/// removed again once none does.
#[test]
fn kube_proxys_rules_back_after_the_takeover_are_reported_and_removed_once_none_runs() {
    if !can_run() {
        return;
    }
    let c = cluster("b");
    load_kube_proxy(&c.node, "nftables");
    let dir = manifests();
    let logdir = tempfile::tempdir().unwrap();
    let log = logdir.path().join("kproxy.log");
    let _kproxy = start_kproxy(&c.node, dir.path(), &log, &[]);
    let gone = || {
        !nft_tables(&c.node)
            .iter()
            .any(|t| t.ends_with(" kube-proxy"))
    };
    wait_for("the takeover", &log, gone);
    wait_metric(
        &c.node,
        "kproxy_kube_proxy_rules_present{mode=\"nftables\"}",
        0.0,
        &log,
    );
    // A kube-proxy starts again and writes its rules.
    let (_bin, mut kube_proxy) = fake_kube_proxy(&c.node);
    load_kube_proxy(&c.node, "nftables");
    // kproxy looks every 10 s once the node is clear.
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(
        &c.node,
        "kproxy_kube_proxy_rules_present{mode=\"nftables\"}",
    ) != Some(1.0)
    {
        assert!(
            Instant::now() < deadline,
            "the rules that came back are never reported; kproxy's log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("kube-proxy's rules came back"), "{text}");
    assert!(!gone(), "kept while a kube-proxy runs");
    let _ = kube_proxy.0.kill();
    let _ = kube_proxy.0.wait();
    wait_for(
        "kube-proxy's tables to go again once it stopped",
        &log,
        gone,
    );
}

/// Rules of another kube-proxy version: only the documented names go. And a takeover
/// cut off halfway (the nftables tables and the nat chains gone, the rest not; every
/// step is one transaction, so this is what a crash between steps leaves): the next
/// start finishes it.
#[test]
fn unknown_names_stay_and_a_half_done_takeover_finishes() {
    if !can_run() || !has_iptables() {
        return;
    }
    let c = cluster("u");
    load_kube_proxy(&c.node, "iptables");
    load_kube_proxy(&c.node, "nftables");
    // A future kube-proxy's objects, under names upstream's cleanup does not know.
    sh(&[
        "ip",
        "netns",
        "exec",
        &c.node.0,
        "nft",
        "add",
        "table",
        "ip",
        "kube-proxy-next",
    ]);
    sh(&[
        "ip",
        "netns",
        "exec",
        &c.node.0,
        "nft",
        "add",
        "table",
        "inet",
        "kube-proxy",
    ]);
    let svc = xt_chains(&c.node)
        .into_iter()
        .find_map(|e| {
            e.strip_prefix("IPv4 nat/")
                .filter(|c| c.starts_with("KUBE-SVC-"))
                .map(str::to_string)
        })
        .expect("a KUBE-SVC chain");
    restore(
        &c.node,
        "iptables-restore",
        &format!(
            "*nat\n:KUBE-NEW-IN-V2 - [0:0]\n-A KUBE-NEW-IN-V2 -j {svc}\n-A PREROUTING -j KUBE-NEW-IN-V2\nCOMMIT\n"
        ),
    );
    // Half done: the first steps of the plan kproxy would run.
    sh(&[
        "ip",
        "netns",
        "exec",
        &c.node.0,
        "nft",
        "delete",
        "table",
        "ip",
        "kube-proxy",
    ]);
    sh(&[
        "ip",
        "netns",
        "exec",
        &c.node.0,
        "nft",
        "delete",
        "table",
        "ip6",
        "kube-proxy",
    ]);
    let nat = {
        let text = out(&c.node, &["iptables-save"]);
        let inv = takeover::Inventory {
            xt_tables: takeover::parse_iptables_save(XtBackend::Nft, IpFamily::IPv4, &text)
                .unwrap(),
            ..Default::default()
        };
        takeover::removal_plan(&inv)
            .steps
            .into_iter()
            .find_map(|s| match s {
                takeover::Step::XtRestore { table, script, .. } if table == "nat" => Some(script),
                _ => None,
            })
            .expect("a nat step")
    };
    restore(&c.node, "iptables-restore", &nat);
    let left: Vec<String> = xt_chains(&c.node)
        .into_iter()
        .filter(|e| is_kube_proxys(e))
        .collect();
    assert!(
        !left.is_empty() && left.iter().all(|e| !e.starts_with("IPv4 nat/")),
        "{left:?}"
    );

    let dir = manifests();
    let logdir = tempfile::tempdir().unwrap();
    let log = logdir.path().join("kproxy.log");
    let _kproxy = start_kproxy(&c.node, dir.path(), &log, &[]);
    wait_for("the rest of kube-proxy's chains to go", &log, || {
        !xt_chains(&c.node).iter().any(|e| is_kube_proxys(e))
    });
    let chains = xt_chains(&c.node);
    let tables = nft_tables(&c.node);
    for kept in ["IPv4 nat/KUBE-NEW-IN-V2", "IPv4 filter/KUBE-FIREWALL"] {
        assert!(chains.iter().any(|e| e == kept), "{kept} gone: {chains:?}");
    }
    for kept in [
        "ip kube-proxy-next",
        "inet kube-proxy",
        "ip kproxy",
        "ip6 kproxy",
    ] {
        assert!(tables.iter().any(|t| t == kept), "{kept} gone: {tables:?}");
    }
    // The cluster IP works through kproxy alone.
    let (to, expect) = ("10.96.0.10:80".parse().unwrap(), Expect::Pods(&PODS));
    assert_eq!(c.node.run(move || probe(to, expect)), None);
}

/// While both are on the node, kproxy's verdicts win: kproxy knows only 10.244.3.2 as
/// web's endpoint, kube-proxy's recorded rules pick any of three; every connection to
/// the cluster IP (nat output) and to the node port from outside (nat prerouting) ends
/// on 10.244.3.2 — the node port one also only while kproxy's rules decide, since
/// kube-proxy's eTP=Local rules would send it to 10.244.1.2. Fails with kproxy's nat
/// chains at kube-proxy's priorities (dstnat, srcnat).
fn kproxy_decides_over(mode: &str) {
    let c = cluster(&format!("w{}", &mode[..1]));
    let dir = tempfile::tempdir().unwrap();
    let text = MANIFESTS
        .replace("- {addresses: [10.244.1.2], nodeName: node-1, conditions: {ready: true, serving: true, terminating: false}}\n", "")
        .replace("- {addresses: [10.244.2.2], nodeName: node-2, conditions: {ready: true, serving: true, terminating: false}}\n", "")
        .replace("nodeName: node-3", "nodeName: node-1");
    write_atomic(dir.path(), "cluster.yaml", &text);
    let logdir = tempfile::tempdir().unwrap();
    let log = logdir.path().join("kproxy.log");
    let _kproxy = start_kproxy(&c.node, dir.path(), &log, &["--kube-proxy-takeover", "off"]);
    wait_for("kproxy's tables", &log, || {
        nft_tables(&c.node).contains(&"ip kproxy".to_string())
    });
    // kube-proxy's rules arrive after kproxy's (a kube-proxy that (re)starts while
    // kproxy runs, as on the way back): at one priority the kernel would run the newer
    // chain first; kproxy's lower priority still runs first.
    load_kube_proxy(&c.node, mode);
    let only: &'static [&'static str] = &PODS[2..];
    for (ns, to) in [(&c.node, "10.96.0.10:80"), (&c.client, "10.200.0.1:30080")] {
        let to: SocketAddr = to.parse().unwrap();
        let wrong = ns.run(move || {
            (0..30)
                .filter_map(|_| probe(to, Expect::Pods(only)))
                .collect::<Vec<_>>()
        });
        assert!(
            wrong.is_empty(),
            "{mode}: kube-proxy's rules decided: {wrong:?}"
        );
    }
    // Both rule sets are still there: it was the priority, not a removal.
    let all = [xt_chains(&c.node), nft_tables(&c.node)].concat();
    assert!(all.iter().any(|e| is_kube_proxys(e)), "{all:?}");
}

#[test]
fn kproxys_verdicts_win_over_kube_proxys_nftables_rules() {
    if !can_run() {
        return;
    }
    kproxy_decides_over("nftables");
}

#[test]
fn kproxys_verdicts_win_over_kube_proxys_iptables_rules() {
    if !can_run() || !has_iptables() {
        return;
    }
    kproxy_decides_over("iptables");
}

/// A process in the node namespace, stopped with SIGTERM (kube-proxy then leaves its
/// rules, as on a node where its pod is deleted).
fn sigterm_and_wait(d: &mut Daemon) {
    common::sigterm(d);
}

/// Starts real kube-proxy of `$K8S_LAB/bin/kube-proxy` in `mode` in the node namespace.
fn start_real_kube_proxy(
    lab: &kproxy_lab::world::k8s::K8sLab,
    c: &Cluster,
    mode: &str,
    dir: &Path,
    n: usize,
) -> Daemon {
    let cfg = dir.join(format!("kube-proxy-{n}.yaml"));
    std::fs::write(
        &cfg,
        lab.kube_proxy_config(mode, "node-1", "10.200.0.1:10256"),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join(format!("kube-proxy-{n}.log"))).unwrap();
    Daemon(
        Command::new("ip")
            .args(["netns", "exec", &c.node.0])
            .arg(lab.dir.join("bin/kube-proxy"))
            .arg("--config")
            .arg(&cfg)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start kube-proxy"),
    )
}

/// Probes of a health-check node port: (when, answered 200).
#[derive(Default)]
struct HcProbe {
    stop: AtomicBool,
    results: Mutex<Vec<(Instant, bool)>>,
}

impl HcProbe {
    fn run(&self, to: SocketAddr) {
        while !self.stop.load(Ordering::SeqCst) {
            let ok = matches!(http_get(to, "/"), Some((200, _)));
            self.results.lock().unwrap().push((Instant::now(), ok));
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// The longest stretch of consecutive failed probes, first to last failure plus one
/// probe interval, in ms (0 when none failed).
fn longest_bad_ms(probes: &[(Instant, bool)]) -> u128 {
    let mut best = 0;
    let mut run_start: Option<Instant> = None;
    for (t, ok) in probes {
        match (ok, run_start) {
            (false, None) => run_start = Some(*t),
            (false, Some(s)) => best = best.max((*t - s).as_millis() + 100),
            (true, _) => run_start = None,
        }
        if !ok && run_start == Some(*t) {
            best = best.max(100);
        }
    }
    best
}

/// kube-proxy's rules for the web Service are in the kernel (it has synced).
fn kube_proxy_programmed(node: &Netns, mode: &str) -> bool {
    match mode {
        "nftables" => out(node, &["nft", "list", "table", "ip", "kube-proxy"])
            .contains("10.96.0.10 . tcp . 80"),
        _ => {
            out(node, &["iptables-save", "-t", "nat"]).contains("-A KUBE-SERVICES -d 10.96.0.10/32")
        }
    }
}

/// Against the real upstream kube-proxy v1.36.2 and a real API server: kube-proxy runs,
/// is stopped, kproxy takes over (phase `takeover`), then the way back: kube-proxy
/// starts beside kproxy, kproxy stops, `kproxy cleanup --after-kube-proxy-synced`
/// removes kproxy's tables once kube-proxy is healthy (phase `back`). Prints failures
/// per phase and asserts none. `KPROXY_TAKEOVER_MODES=nftables,iptables` (default both).
///
///   export K8S_LAB=/path/to/k8s-lab   # started with its `start.sh start` and `start.sh kcm` (docs/lab.md)
///   sudo -E crates/kproxy/tests/fixtures/kube-proxy/capture.sh nftables   # the objects
///   sudo -E cargo test -p kproxy --test takeover -- --ignored --nocapture
#[test]
#[ignore = "needs K8S_LAB (a k8s-lab instance with capture.sh's objects) with bin/kube-proxy, and root; run with --ignored"]
fn real_kube_proxy_takeover_and_back() {
    assert!(nix::unistd::geteuid().is_root(), "needs root");
    let lab = kproxy_lab::world::k8s::K8sLab::from_env().expect("K8S_LAB names a k8s-lab instance");
    let modes =
        std::env::var("KPROXY_TAKEOVER_MODES").unwrap_or_else(|_| "nftables,iptables".into());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut table = vec![
        "| from | phase | new connections | keep-alive requests | failed (new + keep-alive) | health-check node port probes (not 200) | longest run not 200 |"
            .to_string(),
        "|---|---|---|---|---|---|---|".to_string(),
    ];
    let mut total_failed = Vec::new();
    for mode in modes.split(',') {
        let c = cluster(&format!("r{}", &mode[..1]));
        let _bridge = {
            let _g = rt.enter();
            kproxy_lab::world::k8s::bridge::ApiBridge::start(&c.node.0, lab.api_port)
                .expect("API bridge")
        };
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("kproxy.log");
        let mut kube_proxy = start_real_kube_proxy(&lab, &c, mode, dir.path(), 1);
        wait_for(
            "kube-proxy to program its rules",
            &dir.path().join("kube-proxy-1.log"),
            || kube_proxy_programmed(&c.node, mode),
        );
        let load = Load::start(&c);
        // What a load balancer sees: the health-check node port probed from the client
        // every 100 ms (measured, not asserted: how long a gap a load balancer forgives
        // is its own setting).
        let hc = Arc::new(HcProbe::default());
        let hc_thread = {
            let hc = hc.clone();
            spawn_in(&c.client, move || {
                hc.run("10.200.0.1:32000".parse().unwrap())
            })
        };
        let mut mark = |phase: &str, load: &Load, since: &mut (usize, usize, usize, usize)| {
            let sent = load.sent.load(Ordering::SeqCst);
            let failed = load.failures.lock().unwrap().len();
            let ka: usize = load.keepalive_counts().iter().sum();
            let probes = hc.results.lock().unwrap().clone();
            let window = &probes[since.3..];
            let bad = window.iter().filter(|(_, ok)| !ok).count();
            table.push(format!(
                "| {mode} | {phase} | {} | {} | {} | {} of {} | {} ms |",
                sent - since.0,
                ka - since.2,
                failed - since.1,
                bad,
                window.len(),
                longest_bad_ms(window)
            ));
            *since = (sent, failed, ka, probes.len());
        };
        let mut since = (0, 0, 0, 0);
        std::thread::sleep(Duration::from_secs(1));
        mark("kube-proxy alone", &load, &mut since);
        // Takeover: kube-proxy's pod leaves the node, kproxy's arrives.
        sigterm_and_wait(&mut kube_proxy);
        let kproxy_log = std::fs::File::create(&log).unwrap();
        let mut kproxy = Daemon(
            c.node
                .kproxy("run")
                .arg("--kubeconfig")
                .arg(&lab.proxy_kubeconfig)
                .args([
                    "--hostname-override",
                    "node-1",
                    "--cluster-cidr",
                    "10.244.0.0/16",
                ])
                .args(["--healthz-bind-address", "10.200.0.1:10256"])
                .args(["--metrics-bind-address", "127.0.0.1:10259"])
                .stdout(Stdio::null())
                .stderr(kproxy_log)
                .spawn()
                .unwrap(),
        );
        wait_for("kube-proxy's rules to go", &log, || {
            let now = [xt_chains(&c.node), nft_tables(&c.node)].concat();
            !now.iter().any(|e| is_kube_proxys(e)) && now.iter().any(|e| e == "ip kproxy")
        });
        std::thread::sleep(Duration::from_secs(1));
        mark(
            "takeover (kube-proxy stopped, kproxy started, kube-proxy's rules removed)",
            &load,
            &mut since,
        );
        std::thread::sleep(Duration::from_secs(1));
        mark("kproxy alone", &load, &mut since);
        // Back: kproxy stops (its rules stay and carry the traffic), kube-proxy starts
        // and binds every port at its first sync. With KPROXY_TAKEOVER_BACK=overlap,
        // kube-proxy starts beside the running kproxy instead: its health-check node
        // ports then stay closed until its next periodic sync (upstream binds them
        // only in a sync).
        let overlap = std::env::var("KPROXY_TAKEOVER_BACK").is_ok_and(|v| v == "overlap");
        if !overlap {
            sigterm_and_wait(&mut kproxy);
        }
        let mut kube_proxy = start_real_kube_proxy(&lab, &c, mode, dir.path(), 2);
        wait_for(
            "kube-proxy to program its rules again",
            &dir.path().join("kube-proxy-2.log"),
            || kube_proxy_programmed(&c.node, mode),
        );
        if overlap {
            sigterm_and_wait(&mut kproxy);
        }
        kproxy_test_support::run(
            c.node
                .kproxy("cleanup")
                .arg("--after-kube-proxy-synced=10.200.0.1:10256"),
        );
        assert!(!nft_tables(&c.node).iter().any(|t| t.ends_with(" kproxy")));
        std::thread::sleep(Duration::from_secs(1));
        mark(
            if overlap {
                "back (kube-proxy started beside kproxy and synced, kproxy stopped, its tables removed)"
            } else {
                "back (kproxy stopped, kube-proxy started and synced, kproxy's tables removed)"
            },
            &load,
            &mut since,
        );
        std::thread::sleep(Duration::from_secs(1));
        mark("kube-proxy alone again", &load, &mut since);
        let before_end = load.keepalive_counts();
        std::thread::sleep(Duration::from_millis(300));
        let after = load.keepalive_counts();
        let (_, failures) = load.finish();
        hc.stop.store(true, Ordering::SeqCst);
        hc_thread.join().unwrap();
        for (i, (a, b)) in before_end.iter().zip(&after).enumerate() {
            assert!(b > a, "{mode}: keep-alive connection {i} stalled");
        }
        total_failed.extend(failures.into_iter().map(|f| format!("{mode}: {f}")));
        sigterm_and_wait(&mut kube_proxy);
        // Leave nothing behind in the namespace's kernel state that outlives it: the
        // namespace goes with the cluster.
    }
    let text = table.join("\n");
    eprintln!("{text}");
    assert!(total_failed.is_empty(), "{total_failed:#?}\n{text}");
}
