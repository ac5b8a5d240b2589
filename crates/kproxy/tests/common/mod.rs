//! Helpers shared by the `kproxy run` end-to-end tests (run_daemon.rs, run_kube.rs):
//! network namespaces this test process creates (removed on drop, even on panic), a node
//! namespace with one pod behind a veth and the pod's tiny HTTP server, the daemon as a
//! child process (killed on drop), a one-shot HTTP client and polling.

#![expect(
    clippy::disallowed_types,
    reason = "waits on real processes: wall time"
)]
// Each test binary uses its own subset of these helpers.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Command};

use kproxy_test_support::netns;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A network namespace named after this process and `tag`; deleted on drop.
pub struct Netns(pub String);

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let name = format!("kpt-run-{}-{tag}", std::process::id());
        netns::add(&name);
        Netns(name)
    }

    pub fn exec(&self, args: &[&str]) {
        netns::exec(&self.0, args);
    }

    /// `kproxy SUBCOMMAND` in this namespace (`ip netns exec`), its arguments to follow.
    pub fn kproxy(&self, subcommand: &str) -> Command {
        self.kproxy_through(&[], subcommand)
    }

    /// [`Self::kproxy`] started through `prefix`, a command that execs the rest
    /// (`setpriv …`, `sh -c '…; exec "$@"' sh`).
    pub fn kproxy_through(&self, prefix: &[&str], subcommand: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.0])
            .args(prefix)
            .args([env!("CARGO_BIN_EXE_kproxy"), subcommand]);
        cmd
    }

    /// Runs `f` on a thread that has entered this namespace and waits for it. Sockets
    /// made there stay in the namespace, whichever thread uses them later.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        self.spawn(f).join().expect("netns thread")
    }

    /// Runs `f` on a new thread that has entered this namespace.
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let name = self.0.clone();
        std::thread::spawn(move || {
            netns::enter(&name);
            f()
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        netns::del(&self.0);
    }
}

/// A child process, killed and reaped on drop.
pub struct Daemon(pub Child);

/// Where a test's daemon writes its log: a file in a directory of its own (not a
/// watched manifest directory), printed when the test fails (dropped while
/// panicking), so a failure explains itself while a passing test's output stays the
/// harness's own.
pub struct DaemonLog {
    path: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl DaemonLog {
    pub fn new() -> DaemonLog {
        let dir = tempfile::tempdir().expect("a directory for the daemon's log");
        DaemonLog {
            path: dir.path().join("kproxy.log"),
            _dir: dir,
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file to hand a child as its stderr; appended to, so a restarted daemon's
    /// log follows the first one's.
    pub fn stderr(&self) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .expect("daemon log")
    }
}

impl Drop for DaemonLog {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let text = std::fs::read_to_string(&self.path).unwrap_or_default();
            eprintln!("--- kproxy run log ---\n{text}");
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Sends SIGTERM without waiting.
pub fn send_sigterm(daemon: &Daemon) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
}

/// Waits up to `secs` for the daemon to exit (after a SIGTERM), polling every 50 ms.
pub fn wait_exit(daemon: &mut Daemon, secs: u64) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(status) = daemon.0.try_wait().unwrap() {
            return status;
        }
        assert!(
            Instant::now() < deadline,
            "kproxy run did not exit within {secs} s after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends SIGTERM and waits for the exit.
pub fn sigterm(daemon: &mut Daemon) -> std::process::ExitStatus {
    send_sigterm(daemon);
    daemon.0.wait().unwrap()
}

pub fn sh(args: &[&str]) {
    kproxy_test_support::run(Command::new(args[0]).args(&args[1..]));
}

/// Whether a root-only test can run (the policy of `kproxy_test_support::root`). As
/// root a missing `nft` fails the test: `.ci/run` installs it, so a green run means
/// the test ran.
pub fn can_run() -> bool {
    if !kproxy_test_support::root("network namespaces, nftables") {
        return false;
    }
    require_tool("nft", "nftables");
    true
}

/// Where the `kproxy run` of these tests answers: `/healthz` and `/livez`, and
/// `/metrics` (the addresses [`metric`] and the probes ask).
pub const HEALTHZ: &str = "127.0.0.1:10256";
pub const METRICS: &str = "127.0.0.1:10249";

/// `kproxy run` in `node` as node-a reading `input` (`--manifests DIR` or
/// `--kubeconfig FILE`), serving on [`HEALTHZ`] and [`METRICS`], its stdout dropped;
/// the test's own flags and stderr to follow.
pub fn kproxy_run(node: &Netns, input: &[&str]) -> Command {
    kproxy_run_through(node, &[], input)
}

/// [`kproxy_run`] started through `prefix` ([`Netns::kproxy_through`]).
pub fn kproxy_run_through(node: &Netns, prefix: &[&str], input: &[&str]) -> Command {
    let mut cmd = node.kproxy_through(prefix, "run");
    cmd.args(input)
        .args(["--hostname-override", "node-a"])
        .args(["--healthz-bind-address", HEALTHZ])
        .args(["--metrics-bind-address", METRICS])
        .stdout(std::process::Stdio::null());
    cmd
}

/// `kproxy explain shop/web` for node-a with the manifests of `dir`, asking the
/// daemon's metrics server at `server` what it holds.
pub fn explain_web(node: &Netns, dir: &Path, server: &str) -> std::process::Output {
    node.kproxy("explain")
        .args(["--manifests", dir.to_str().unwrap(), "--node", "node-a"])
        .args(["--server", server, "shop/web"])
        .output()
        .expect("kproxy explain")
}

/// Fails the test when `tool --version` does not run: as root, a missing tool is a
/// broken setup (`.ci/run` installs `package`), never a silent skip.
pub fn require_tool(tool: &str, package: &str) {
    let ok = Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "running as root but `{tool}` is missing (install {package})"
    );
}

pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    // One write: a request split over segments would let the test pod answer and
    // close before reading it all, which resets the connection.
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let code = buf.split_whitespace().nth(1)?.parse().ok()?;
    let body = buf.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
    Some((code, body))
}

/// The value of the metric series `series` (name and labels, exactly as exposed) on
/// the daemon's metrics server in `node` (127.0.0.1:10249); `None` until it answers
/// and shows the series.
pub fn metric(node: &Netns, series: &str) -> Option<f64> {
    let series = format!("{series} ");
    let (_, text) = node.run(|| http_get("127.0.0.1:10249".parse().unwrap(), "/metrics"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// Polls `f` in the namespace until it returns Some, for up to 20 s.
pub fn eventually<T: Send + 'static>(
    ns: &Netns,
    what: &str,
    f: impl Fn() -> Option<T> + Send + Clone + 'static,
) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = ns.run(f.clone()) {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A node namespace (node IP 10.200.0.11, pod CIDR route 10.244.1.0/24, cluster IPs
/// 10.96.0.0/16 routed) with one pod namespace (10.244.1.5) behind a veth, and the
/// pod's HTTP server on :8080 (keep-alive aware) answering "pod-1".
pub struct Fabric {
    pub node: Netns,
    pub pod: Netns,
    stop: Arc<AtomicBool>,
}

impl Drop for Fabric {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

pub fn fabric(tag: char) -> Fabric {
    let node = Netns::new(&format!("{tag}node"));
    let veth_node = format!("kv{}{tag}", std::process::id() % 100_000);
    node.exec(&["ip", "addr", "add", "10.200.0.11/32", "dev", "lo"]);
    let pod = pod_behind_veth(
        &node,
        &format!("{tag}pod"),
        &veth_node,
        "10.244.1.1",
        "10.244.1.5",
    );
    // Like a real node's default route: the cluster IP must be routable before DNAT.
    node.exec(&["ip", "route", "add", "10.96.0.0/16", "dev", &veth_node]);
    let listener = pod.run(|| TcpListener::bind("10.244.1.5:8080").expect("pod listener"));
    let stop = serve_forever(listener, "pod-1");
    Fabric { node, pod, stop }
}

/// A pod namespace (`tag`) joined to `node` by the veth `veth`: the node's side has
/// `gateway`/24, the pod's `eth0` has `ip`/24 and its default route through `gateway`.
pub fn pod_behind_veth(node: &Netns, tag: &str, veth: &str, gateway: &str, ip: &str) -> Netns {
    let pod = Netns::new(tag);
    sh(&[
        "ip", "link", "add", veth, "netns", &node.0, "type", "veth", "peer", "name", "eth0",
        "netns", &pod.0,
    ]);
    node.exec(&["ip", "addr", "add", &format!("{gateway}/24"), "dev", veth]);
    node.exec(&["ip", "link", "set", veth, "up"]);
    pod.exec(&["ip", "addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
    pod.exec(&["ip", "link", "set", "eth0", "up"]);
    pod.exec(&["ip", "route", "add", "default", "via", gateway]);
    pod
}

/// Answers every connection `listener` accepts with [`serve_http`] and `body`, on
/// threads of their own, until the returned flag is set (looked at on each accept).
pub fn serve_forever(listener: TcpListener, body: &'static str) -> Arc<AtomicBool> {
    accept_forever(listener, move |c| serve_http(c, body))
}

/// Hands every connection `listener` accepts to `serve` on a thread of its own, until
/// the returned flag is set (looked at on each accept).
pub fn accept_forever(
    listener: TcpListener,
    serve: impl Fn(TcpStream) + Send + Copy + 'static,
) -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = stop.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            if stop2.load(Ordering::SeqCst) {
                break;
            }
            let Ok(c) = conn else { continue };
            std::thread::spawn(move || serve(c));
        }
    });
    stop
}

/// Answers requests on one connection with `body` until the client closes it or asks to.
pub fn serve_http(mut c: TcpStream, body: &str) {
    loop {
        let mut req = Vec::new();
        let mut buf = [0u8; 1024];
        while !req.windows(4).any(|w| w == b"\r\n\r\n") {
            match c.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => req.extend_from_slice(&buf[..n]),
            }
        }
        let close = String::from_utf8_lossy(&req)
            .to_ascii_lowercase()
            .contains("connection: close");
        let header = if close { "close" } else { "keep-alive" };
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: {header}\r\n\r\n{body}",
            body.len()
        );
        if c.write_all(resp.as_bytes()).is_err() || close {
            return;
        }
    }
}

/// The manifests of the `--manifests` tests: node-a, a LoadBalancer Service `shop/web`
/// (eTP Local, health-check node port 32000) and its EndpointSlice with pod-1 on node-a.
pub const NODE: &str = r#"
apiVersion: v1
kind: Node
metadata: {name: node-a, labels: {topology.kubernetes.io/zone: zone-a}}
status: {addresses: [{type: InternalIP, address: 10.200.0.11}]}
"#;

pub const SERVICE: &str = r#"
apiVersion: v1
kind: Service
metadata: {name: web, namespace: shop}
spec:
  type: LoadBalancer
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ipFamilies: [IPv4]
  externalTrafficPolicy: Local
  healthCheckNodePort: 32000
  ports: [{name: http, port: 80, targetPort: 8080, nodePort: 30080, protocol: TCP}]
status: {loadBalancer: {ingress: [{ip: 203.0.113.10}]}}
"#;

pub fn slice(ready: bool) -> String {
    slice_of(&[("10.244.1.5", ready, !ready)])
}

/// The EndpointSlice `shop/web-1` with these endpoints on node-a, each (IP, ready,
/// terminating) and serving.
pub fn slice_of(endpoints: &[(&str, bool, bool)]) -> String {
    let mut s = r#"
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: shop, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
"#
    .to_string();
    for (ip, ready, terminating) in endpoints {
        s += &format!(
            "- addresses: [{ip}]\n  nodeName: node-a\n  conditions: {{ready: {ready}, serving: true, terminating: {terminating}}}\n"
        );
    }
    s
}

/// Writes `name` in `dir` as editors do: a temporary file renamed over it.
pub fn write_atomic(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

/// A manifest directory with [`NODE`], [`SERVICE`] and a ready [`slice`].
pub fn manifests() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_atomic(dir.path(), "node.yaml", NODE);
    write_atomic(dir.path(), "service.yaml", SERVICE);
    write_atomic(dir.path(), "slice.yaml", &slice(true));
    dir
}

/// A `kproxy lab … -o json` run's report, or a failure showing its exit, stderr and
/// stdout.
pub fn json_report(out: &std::process::Output) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "no JSON report ({e}); exit {:?}\nstderr:\n{}\nstdout:\n{stdout}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// A lab phase's report (`kproxy lab restart|takeover -o json`), both paths (through
/// the LB and through a cluster IP): load really ran, on new and held connections,
/// and nothing failed or broke. `name` and `stderr` go into the messages.
pub fn assert_phase_lost_nothing(phase: &serde_json::Value, name: &str, stderr: &str) {
    for path in ["lb", "cluster-ip"] {
        let c = &phase["by_path"][path];
        let n = |k: &str| {
            c[k].as_u64()
                .unwrap_or_else(|| panic!("{name} {path} {k}: {c}"))
        };
        assert!(n("new_sent") >= 20, "{name} {path}: {c}");
        assert!(n("keepalive_sent") >= 20, "{name} {path}: {c}");
        assert_eq!(n("new_failed"), 0, "{name} {path}: {c}\n{stderr}");
        assert_eq!(n("established_broken"), 0, "{name} {path}: {c}\n{stderr}");
        assert_eq!(
            n("keepalive_other_failed"),
            0,
            "{name} {path}: {c}\n{stderr}"
        );
    }
}

/// A client in the node namespace opening a new connection to the cluster IP every
/// 20 ms (and probing the health-check node port with it, when asked), counting failures.
pub struct Load {
    done: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<(u32, u32, u32)>,
}

impl Load {
    pub fn start(node: &Netns, probe_health: bool) -> Load {
        let done = Arc::new(AtomicBool::new(false));
        let done2 = done.clone();
        let thread = node.spawn(move || {
            let (mut sent, mut failed, mut unhealthy) = (0u32, 0u32, 0u32);
            while !done2.load(Ordering::SeqCst) {
                sent += 1;
                if http_get("10.96.0.10:80".parse().unwrap(), "/")
                    != Some((200, "pod-1".to_string()))
                {
                    failed += 1;
                }
                if probe_health
                    && http_get("10.200.0.11:32000".parse().unwrap(), "/").map(|(c, _)| c)
                        != Some(200)
                {
                    unhealthy += 1;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            (sent, failed, unhealthy)
        });
        Load { done, thread }
    }

    /// (sent, failed connections, health probes not 200)
    pub fn stop(self) -> (u32, u32, u32) {
        self.done.store(true, Ordering::SeqCst);
        self.thread.join().unwrap()
    }
}
