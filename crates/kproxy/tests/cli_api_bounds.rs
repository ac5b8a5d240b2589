//! `kproxy plan|explain` (the real binary) against API servers that misbehave, each
//! started here on 127.0.0.1: one that never answers, one that answers a byte per
//! second, endless bodies, a refused port, a full accept queue, a name that does not
//! resolve, a TLS certificate no CA signs; kubeconfigs that are a FIFO or run an exec
//! plugin that sleeps. Each run must end with the error that names its cause. No duration is asserted: the hang
//! guard only stops a run that would otherwise never end. No root needed.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const REPO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

/// A run still going after this is a hang: the test fails instead of waiting forever.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// Runs kproxy with `args` and `env` (no inherited KUBECONFIG, HOME a directory with no
/// ~/.kube): exit code, stdout, stderr. Panics when the run outlives [`HANG_GUARD`].
fn kproxy_env(args: &[&str], env: &[(&str, &str)], home: &Path) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kproxy"))
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBECONFIG")
        .env("HOME", home)
        .envs(env.iter().copied())
        .current_dir(REPO)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kproxy");
    #[expect(clippy::disallowed_types, reason = "a real process's hang guard")]
    let started = std::time::Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if started.elapsed() > HANG_GUARD {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "kproxy {args:?} hung: still running after the hang guard; stderr: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// A kubeconfig for `server` (a URL), with `user` as the user's YAML mapping.
fn kubeconfig_for(server: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"{server}\"}}\n\
         users:\n- name: u\n  user: {user}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\ncurrent-context: c\n"
    )
}

/// A temporary directory: kubeconfigs, scripts and an empty HOME.
struct Scratch(tempfile::TempDir);

impl Scratch {
    fn new() -> Scratch {
        let s = Scratch(tempfile::tempdir().unwrap());
        std::fs::create_dir(s.home()).unwrap();
        s
    }
    fn home(&self) -> PathBuf {
        self.0.path().join("home")
    }
    fn write(&self, name: &str, text: &str) -> String {
        let path = self.0.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }
    /// `plan` for node-a against the kubeconfig `name`, with `extra` flags.
    fn plan(&self, kubeconfig: &str, extra: &[&str]) -> (i32, String, String) {
        let mut args = vec!["plan", "--node", "node-a", "--kubeconfig", kubeconfig];
        args.extend_from_slice(extra);
        kproxy_env(&args, &[], &self.home())
    }
}

/// What the misbehaving server does with a request for a path.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// Reads the request and never writes.
    Silent,
    /// A complete answer, one byte per second.
    Drip,
    /// 200 with a JSON body that never ends (an object with an endless string).
    Endless,
    /// 200 with a small JSON body.
    Json(&'static str),
}

/// A plain-HTTP server on 127.0.0.1 that answers each request by `answer(path)`, and
/// keeps the request heads it read.
struct Misbehaving {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

impl Misbehaving {
    fn start(answer: fn(&str) -> Answer) -> Misbehaving {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let seen = heads.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { return };
                let seen = seen.clone();
                std::thread::spawn(move || serve(conn, answer, &seen));
            }
        });
        Misbehaving { addr, heads }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Serves one connection's requests until the client goes or an answer never ends.
fn serve(conn: TcpStream, answer: fn(&str) -> Answer, seen: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let end = line == "\r\n";
            head.push_str(&line);
            if end {
                break;
            }
        }
        let path = head.split(' ').nth(1).unwrap_or("/").to_string();
        seen.lock().unwrap().push(head);
        let path = path.split('?').next().unwrap_or("/").to_string();
        let ok = match answer(&path) {
            Answer::Silent => {
                // Hold the connection open, reading nothing more, answering nothing.
                let _ = reader.read(&mut [0; 1]);
                return;
            }
            Answer::Drip => {
                let body = "{\"kind\":\"Status\"}";
                let text = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                text.bytes().all(|b| {
                    std::thread::sleep(Duration::from_secs(1));
                    conn.write_all(&[b]).is_ok()
                })
            }
            Answer::Endless => {
                let start = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
                let first = "{\"apiVersion\":\"v1\",\"kind\":\"ConfigMap\",\"metadata\":{\"name\":\"kproxy\"},\"items\":[{\"metadata\":{\"name\":\"";
                let chunk = |data: &str| format!("{:x}\r\n{data}\r\n", data.len());
                let filler = "a".repeat(64 << 10);
                let _ = conn.write_all(start.as_bytes());
                let _ = conn.write_all(chunk(first).as_bytes());
                let filler = chunk(&filler);
                while conn.write_all(filler.as_bytes()).is_ok() {}
                return;
            }
            Answer::Json(body) => {
                let text = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                conn.write_all(text.as_bytes()).is_ok()
            }
        };
        if !ok {
            return;
        }
    }
}

const VERSION: &str = r#"{"major":"1","minor":"34","gitVersion":"v1.34.0"}"#;

/// `--config FILE`: no ConfigMap read, the lists come right after /version.
fn config_file(scratch: &Scratch) -> String {
    scratch.write(
        "config.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\nmode: nftables\n",
    )
}

#[test]
fn a_server_that_never_answers_ends_at_the_idle_timeout() {
    let server = Misbehaving::start(|_| Answer::Silent);
    let s = Scratch::new();
    let kc = s.write("kc", &kubeconfig_for(&server.url(), "{}"));
    let (code, _, err) = s.plan(&kc, &["--idle-timeout", "2s"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "{}/version: no byte from the API server for 2s (--idle-timeout)",
            server.url()
        )),
        "{err}"
    );
}

#[test]
fn a_server_that_answers_a_byte_per_second_ends_at_the_request_timeout() {
    let server = Misbehaving::start(|_| Answer::Drip);
    let s = Scratch::new();
    let kc = s.write("kc", &kubeconfig_for(&server.url(), "{}"));
    // Each byte comes well within the idle bound: only the request's deadline ends it.
    let (code, _, err) = s.plan(&kc, &["--idle-timeout", "20s", "--request-timeout", "4s"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("/version: no complete answer within 4s (--request-timeout)"),
        "{err}"
    );
}

#[test]
fn an_endless_config_map_is_cut_and_said() {
    let server = Misbehaving::start(|path| match path {
        "/version" => Answer::Json(VERSION),
        p if p.contains("/configmaps/") => Answer::Endless,
        _ => Answer::Json(r#"{"kind":"List","metadata":{"resourceVersion":"1"},"items":[]}"#),
    });
    let s = Scratch::new();
    let kc = s.write("kc", &kubeconfig_for(&server.url(), "{}"));
    let (code, out, err) = s.plan(&kc, &[]);
    // The configuration cannot be read: said, and upstream's defaults plan the rest.
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("node-a"), "{out}");
    assert!(
        err.contains("reading ConfigMap kube-system/kproxy: the answer is larger than 4194304 bytes (a ConfigMap holds at most 1 MiB)"),
        "{err}"
    );
}

#[test]
fn an_endless_list_stops_at_the_byte_cap() {
    let server = Misbehaving::start(|path| match path {
        "/version" => Answer::Json(VERSION),
        _ => Answer::Endless,
    });
    let s = Scratch::new();
    let kc = s.write("kc", &kubeconfig_for(&server.url(), "{}"));
    let config = config_file(&s);
    let (code, _, err) = s.plan(&kc, &["--config", &config, "--max-read-bytes", "50000000"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("from the API server failed"), "{err}");
    assert!(!err.contains("ServiceError"), "{err}");
    assert!(
        err.contains("the API server sent more than 50000000 bytes in all (--max-read-bytes)"),
        "{err}"
    );
}

#[test]
fn a_refused_port_is_said_as_refused() {
    let addr = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // The listener is closed: nothing listens there any more.
    let s = Scratch::new();
    let kc = s.write("kc", &kubeconfig_for(&format!("http://{addr}"), "{}"));
    let (code, _, err) = s.plan(&kc, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "cannot connect to the API server http://{addr}: connection refused"
        )),
        "{err}"
    );
    // Which server, from which kubeconfig, and what to give for another.
    assert!(
        err.contains(&format!("credentials: --kubeconfig ({kc})")),
        "{err}"
    );
    assert!(err.contains("--context NAME"), "{err}");
    assert!(!err.contains("client error (Connect)"), "{err}");
}

#[test]
fn a_connection_nobody_accepts_ends_at_the_connect_timeout() {
    use nix::sys::socket::{Backlog, listen};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    // An accept queue of one, filled: the kernel drops the next handshake's SYN, as a
    // firewall that drops packets does.
    listen(&listener, Backlog::new(0).unwrap()).unwrap();
    let _held = TcpStream::connect(addr).unwrap();
    let s = Scratch::new();
    let kc = s.write("kc", &kubeconfig_for(&format!("http://{addr}"), "{}"));
    let (code, _, err) = s.plan(&kc, &["--connect-timeout", "2s"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "cannot connect to the API server http://{addr}: no answer to the connection attempt within --connect-timeout"
        )),
        "{err}"
    );
    drop(listener);
}

#[test]
fn a_name_that_does_not_resolve_is_said_as_dns() {
    let s = Scratch::new();
    // .invalid never resolves (RFC 6761).
    let kc = s.write(
        "kc",
        &kubeconfig_for("https://kproxy-test.invalid:6443", "{}"),
    );
    let (code, _, err) = s.plan(&kc, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot connect to the API server https://kproxy-test.invalid:6443: its host name does not resolve (DNS"),
        "{err}"
    );
}

#[test]
fn a_certificate_no_trusted_ca_signed_is_said_as_tls() {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tls");
    let cert = CertificateDer::from_pem_file(dir.join("server.crt")).unwrap();
    let key = PrivateKeyDer::from_pem_file(dir.join("server.key")).unwrap();
    let config = Arc::new(
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap(),
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let mut tls = rustls::ServerConnection::new(config.clone()).unwrap();
            // The handshake, until the client refuses the certificate.
            while tls.complete_io(&mut conn).is_ok() && tls.is_handshaking() {}
        }
    });
    let s = Scratch::new();
    let kc = s.write("kc", &kubeconfig_for(&format!("https://{addr}"), "{}"));
    let (code, _, err) = s.plan(&kc, &[]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("cannot connect to the API server https://{addr}: TLS: the server's certificate is not signed by a CA this kubeconfig trusts")),
        "{err}"
    );
}

/// An exec credential plugin: a script that records its pid, then runs `body`.
fn exec_user(s: &Scratch, body: &str) -> (String, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let pid = s.0.path().join("plugin.pid");
    let script = s.write(
        "plugin.sh",
        &format!("#!/bin/sh\necho $$ > {}\n{body}\n", pid.display()),
    );
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let user = format!(
        "{{exec: {{apiVersion: client.authentication.k8s.io/v1, command: \"{script}\", interactiveMode: Never}}}}"
    );
    (user, pid)
}

#[test]
fn an_exec_plugin_that_hangs_is_killed_at_the_exec_timeout() {
    let server = Misbehaving::start(|_| Answer::Json(VERSION));
    let s = Scratch::new();
    // `exec`: the pid recorded is the sleep's.
    let (user, pid) = exec_user(&s, "exec sleep 600");
    let kc = s.write("kc", &kubeconfig_for(&server.url(), &user));
    let (code, _, err) = s.plan(&kc, &["--exec-timeout", "1s"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("plugin.sh\": did not finish within 1s (--exec-timeout); killed"),
        "{err}"
    );
    let pid = std::fs::read_to_string(pid).unwrap();
    let alive = Path::new("/proc").join(pid.trim());
    // Killed, then reaped by init: give the kernel a moment (hang guard only).
    for _ in 0..100 {
        let state = std::fs::read_to_string(alive.join("stat")).unwrap_or_default();
        if state.is_empty() || state.contains(") Z ") {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("the plugin {} still runs", pid.trim());
}

#[test]
fn an_exec_plugins_token_is_sent() {
    let server = Misbehaving::start(|path| match path {
        "/version" => Answer::Json(VERSION),
        _ => Answer::Silent,
    });
    let s = Scratch::new();
    let (user, _) = exec_user(
        &s,
        r#"echo '{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"tok-123"}}'"#,
    );
    let kc = s.write("kc", &kubeconfig_for(&server.url(), &user));
    // The ConfigMap read hangs after /version: the idle timeout ends the run.
    let (_, _, err) = s.plan(&kc, &["--idle-timeout", "1s"]);
    let heads = server.heads.lock().unwrap();
    let version = heads
        .iter()
        .find(|h| h.starts_with("GET /version"))
        .unwrap_or_else(|| panic!("no /version request: {err}"));
    assert!(
        version
            .to_ascii_lowercase()
            .contains("authorization: bearer tok-123"),
        "{version}"
    );
}

#[test]
fn a_fifo_as_kubeconfig_ends_with_an_error() {
    let s = Scratch::new();
    let fifo = s.0.path().join("kubeconfig.fifo");
    nix::unistd::mkfifo(
        &fifo,
        nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
    )
    .unwrap();
    let (code, _, err) = s.plan(fifo.to_str().unwrap(), &["--connect-timeout", "1s"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!(
            "cannot read kubeconfig {}: not a regular file, and it did not end within 1s (--connect-timeout): a FIFO nobody writes to?",
            fifo.display()
        )),
        "{err}"
    );
}
