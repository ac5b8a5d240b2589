//! kube-proxy as recorded (docs/migrate.md, "The lab from recorded rulesets"): what real kube-proxy
//! v1.36.2 put on each node of the lab's cluster — its rules (`nft list ruleset`, or
//! `iptables-save` and `ip6tables-save`) and the answers of its health servers (the
//! health-check node port and `/healthz`) — captured by the real mode
//! (`kproxy lab takeover --from MODE --record-rules DIR`, see [`capture`]) and committed
//! under `crates/lab/fixtures/kube-proxy/`. The recorded mode loads a node's rules into
//! its namespace ([`load`]) and serves the recorded answers from a stand-in
//! ([`HealthStandIn`]) that holds kube-proxy's ports until "kube-proxy stops".
//!
//! What a recording is not: kube-proxy's process. Its rules appear at once (no process
//! start, no list of the API server, no first sync), and the stand-in replays the
//! answers of a kube-proxy whose node has its one ready pod. docs/migrate.md says what
//! the recorded mode proves and what only the real mode does.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::LabError;
use crate::scenario::service::{HEALTH_CHECK_NODE_PORT, PROXY_HEALTHZ_PORT};
use crate::world::fabric::NodeNet;
use crate::world::netns::{enter_netns_by_name, run_cmd_input};

/// The lab cluster the recordings are of: its node count (one pod per node).
pub const RECORDED_NODES: usize = 3;

/// One recorded HTTP answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

/// What kube-proxy's two health servers answered on a node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HealthAnswers {
    /// kube-proxy's `--version` and mode, and when.
    pub recorded: String,
    /// `GET http://NODE_IP:32000/` (the eTP=Local Service's health-check node port).
    pub health_check_node_port: Answer,
    /// `GET http://NODE_IP:10256/healthz`.
    pub healthz: Answer,
}

/// One node's recording, as committed.
struct Recording {
    /// `nft list ruleset` (nftables mode).
    nft: Option<&'static str>,
    /// `iptables-save` and `ip6tables-save` (iptables mode, iptables-nft).
    iptables: Option<(&'static str, &'static str)>,
    health: &'static str,
}

macro_rules! nft_node {
    ($n:literal) => {
        Recording {
            nft: Some(include_str!(concat!(
                "../../../fixtures/kube-proxy/nftables/node-",
                $n,
                ".nft"
            ))),
            iptables: None,
            health: include_str!(concat!(
                "../../../fixtures/kube-proxy/nftables/node-",
                $n,
                ".health.json"
            )),
        }
    };
}

macro_rules! xt_node {
    ($n:literal) => {
        Recording {
            nft: None,
            iptables: Some((
                include_str!(concat!(
                    "../../../fixtures/kube-proxy/iptables/node-",
                    $n,
                    ".iptables.save"
                )),
                include_str!(concat!(
                    "../../../fixtures/kube-proxy/iptables/node-",
                    $n,
                    ".ip6tables.save"
                )),
            )),
            health: include_str!(concat!(
                "../../../fixtures/kube-proxy/iptables/node-",
                $n,
                ".health.json"
            )),
        }
    };
}

fn recording(mode: &str, index: usize) -> Option<Recording> {
    Some(match (mode, index) {
        ("nftables", 1) => nft_node!("1"),
        ("nftables", 2) => nft_node!("2"),
        ("nftables", 3) => nft_node!("3"),
        ("iptables", 1) => xt_node!("1"),
        ("iptables", 2) => xt_node!("2"),
        ("iptables", 3) => xt_node!("3"),
        _ => return None,
    })
}

fn no_recording(mode: &str, node: &NodeNet) -> LabError {
    LabError::Invalid(format!(
        "no recording of kube-proxy's {mode} mode for {} (recorded: node-1..node-{RECORDED_NODES}, nftables and iptables)",
        node.name
    ))
}

/// kube-proxy's `-m nfacct --nfacct-name NAME` matches (iptables mode, two rules) left
/// out: they only count packets and always match, and their accounting objects are
/// made by kube-proxy over netlink, which no packaged tool here does, so a restore
/// that keeps them fails.
pub fn without_nfacct(save: &str) -> String {
    const MATCH: &str = " -m nfacct --nfacct-name";
    save.lines()
        .map(|line| {
            let mut out = String::new();
            let mut rest = line;
            while let Some(at) = rest.find(MATCH) {
                out.push_str(&rest[..at]);
                let after = rest[at + MATCH.len()..].trim_start();
                // Skip the accounting object's name.
                rest = after.find(' ').map_or("", |end| &after[end..]);
            }
            out.push_str(rest);
            out + "\n"
        })
        .collect()
}

/// "kube-proxy syncs": node `node`'s recorded rules of `mode`, loaded into its
/// namespace as kube-proxy writes them (one `nft -f`; `iptables-restore --noflush` per
/// family, as kube-proxy's iptables mode restores).
pub fn load(node: &NodeNet, mode: &str) -> Result<(), LabError> {
    let r = recording(mode, node.index).ok_or_else(|| no_recording(mode, node))?;
    if let Some(nft) = r.nft {
        node.ns.nft(nft)?;
    }
    if let Some((v4, v6)) = r.iptables {
        for (cmd, text) in [("iptables-restore", v4), ("ip6tables-restore", v6)] {
            run_cmd_input(
                "ip",
                &["netns", "exec", node.ns.name(), cmd, "--noflush"],
                &without_nfacct(text),
            )?;
        }
    }
    Ok(())
}

/// The recorded answers of `node`'s kube-proxy in `mode`.
pub fn health_answers(node: &NodeNet, mode: &str) -> Result<HealthAnswers, LabError> {
    let r = recording(mode, node.index).ok_or_else(|| no_recording(mode, node))?;
    serde_json::from_str(r.health).map_err(|e| {
        LabError::Invalid(format!(
            "fixtures/kube-proxy/{mode}/{}.health.json: {e}",
            node.name
        ))
    })
}

/// Writes what kube-proxy (`version`, `mode`) has put on `node` into
/// `dir/MODE/NODE.*`: the files [`load`] and [`health_answers`] read.
pub fn capture(node: &NodeNet, mode: &str, version: &str, dir: &Path) -> Result<(), LabError> {
    let dir = dir.join(mode);
    std::fs::create_dir_all(&dir).map_err(|e| LabError::Io {
        what: format!("mkdir {}", dir.display()),
        source: e,
    })?;
    let date = jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC");
    let header = format!(
        "# {version}, mode {mode}, {} of `kproxy lab takeover` ({RECORDED_NODES} nodes, one pod each); recorded by `kproxy lab takeover --from {mode} --record-rules` {date}\n",
        node.name
    );
    let write = |file: String, text: String| {
        let path = dir.join(file);
        std::fs::write(&path, text).map_err(|e| LabError::Io {
            what: format!("write {}", path.display()),
            source: e,
        })
    };
    // Without the save's timestamped comment lines: a recording changes only when the
    // rules do.
    let save = |cmd: &str| -> Result<String, LabError> {
        Ok(node
            .ns
            .exec(cmd, &[])?
            .lines()
            .filter(|l| !l.starts_with("# Generated") && !l.starts_with("# Completed"))
            .map(|l| format!("{l}\n"))
            .collect())
    };
    match mode {
        "nftables" => write(
            format!("{}.nft", node.name),
            header.clone() + &node.ns.exec("nft", &["list", "ruleset"])?,
        )?,
        _ => {
            write(
                format!("{}.iptables.save", node.name),
                header.clone() + &save("iptables-save")?,
            )?;
            write(
                format!("{}.ip6tables.save", node.name),
                header.clone() + &save("ip6tables-save")?,
            )?;
        }
    }
    let get = |port: u16, path: &str| http_get(node, SocketAddr::from((node.ip, port)), path);
    let answers = HealthAnswers {
        recorded: header.trim_start_matches("# ").trim_end().to_string(),
        health_check_node_port: get(HEALTH_CHECK_NODE_PORT, "/")?,
        healthz: get(PROXY_HEALTHZ_PORT, "/healthz")?,
    };
    let json = serde_json::to_string_pretty(&answers)
        .map_err(|e| LabError::Invalid(format!("health answers: {e}")))?;
    write(format!("{}.health.json", node.name), json + "\n")
}

/// `GET path` from inside `node`'s namespace (a thread of its own enters it): status
/// and body.
fn http_get(node: &NodeNet, to: SocketAddr, path: &str) -> Result<Answer, LabError> {
    let ns = node.ns.name().to_string();
    let path = path.to_string();
    let what = format!("GET http://{to}{path} on {}", node.name);
    let w = what.clone();
    let io = move |e: std::io::Error| LabError::Io {
        what: w.clone(),
        source: e,
    };
    let handle = std::thread::spawn(move || -> Result<String, LabError> {
        enter_netns_by_name(&ns)?;
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(2)).map_err(&io)?;
        s.set_read_timeout(Some(Duration::from_secs(2)))
            .map_err(&io)?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {to}\r\nUser-Agent: kproxy-lab\r\nConnection: close\r\n\r\n"
        )
        .map_err(&io)?;
        let mut text = String::new();
        s.read_to_string(&mut text).map_err(&io)?;
        Ok(text)
    });
    let text = handle
        .join()
        .map_err(|_| LabError::Invalid(format!("{what}: thread panicked")))??;
    parse_response(&text).ok_or_else(|| LabError::Invalid(format!("{what}: answered {text:?}")))
}

/// Status and body of an HTTP/1.1 response with a `Content-Length` (what Go's
/// net/http writes for kube-proxy's small JSON answers).
fn parse_response(text: &str) -> Option<Answer> {
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    Some(Answer {
        status,
        body: body.to_string(),
    })
}

fn response(a: &Answer) -> String {
    let reason = match a.status {
        200 => "OK",
        503 => "Service Unavailable",
        _ => "",
    };
    format!(
        "HTTP/1.1 {} {reason}\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        a.status,
        a.body.len(),
        a.body
    )
}

/// kube-proxy's two health servers on a node, as recorded: the health-check node port
/// (all addresses, as kube-proxy binds it without `nodePortAddresses`) and `/healthz`
/// on the node's address. Holds both ports until [`HealthStandIn::stop`].
pub struct HealthStandIn {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HealthStandIn {
    /// Binds both ports in `node`'s namespace (an error if another process holds one)
    /// and answers every request with the recorded answer of its port.
    pub fn start(node: &NodeNet, answers: HealthAnswers) -> Result<HealthStandIn, LabError> {
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel::<Result<(), LabError>>();
        let ns = node.ns.name().to_string();
        let ip = node.ip;
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kube-proxy-stand-in-{}", node.name))
            .spawn(move || {
                let bound = enter_netns_by_name(&ns).and_then(|_| {
                    let listen = |addr: SocketAddr| {
                        TcpListener::bind(addr)
                            .and_then(|l| l.set_nonblocking(true).map(|_| l))
                            .map_err(|e| LabError::Io {
                                what: format!("bind {addr} in {ns}"),
                                source: e,
                            })
                    };
                    Ok([
                        (
                            listen(SocketAddr::from((
                                Ipv4Addr::UNSPECIFIED,
                                HEALTH_CHECK_NODE_PORT,
                            )))?,
                            response(&answers.health_check_node_port),
                        ),
                        (
                            listen(SocketAddr::from((ip, PROXY_HEALTHZ_PORT)))?,
                            response(&answers.healthz),
                        ),
                    ])
                });
                match bound {
                    Ok(listeners) => {
                        let _ = tx.send(Ok(()));
                        serve(&listeners, &flag);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| LabError::Io {
                what: "spawn the kube-proxy stand-in".into(),
                source: e,
            })?;
        rx.recv()
            .map_err(|_| LabError::Invalid("kube-proxy stand-in thread ended".into()))??;
        Ok(HealthStandIn {
            stop,
            thread: Some(thread),
        })
    }

    /// "kube-proxy stops": both ports closed when this returns.
    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for HealthStandIn {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Answers one request per connection until `stop`; the listeners close on return.
fn serve(listeners: &[(TcpListener, String); 2], stop: &AtomicBool) {
    while !stop.load(Ordering::SeqCst) {
        let mut idle = true;
        for (l, answer) in listeners {
            if let Ok((mut s, _)) = l.accept() {
                idle = false;
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
                let mut buf = [0u8; 2048];
                let mut got = 0;
                while got < buf.len() {
                    match s.read(&mut buf[got..]) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => got += n,
                    }
                    if buf[..got].windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
                let _ = s.write_all(answer.as_bytes());
            }
        }
        if idle {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nfacct_matches_go_and_the_rest_of_the_rule_stays() {
        let save = "-A KUBE-NODEPORTS -d 127.0.0.0/8 -p tcp -m comment --comment \"lab/web:http\" -m tcp --dport 30080 -m nfacct --nfacct-name  localhost_nps_accepted_pkts -j KUBE-EXT-X\n-A KUBE-FORWARD -m conntrack --ctstate INVALID -m nfacct --nfacct-name  ct_state_invalid_dropped_pkts -j DROP\n-A KUBE-SERVICES -j RETURN\n";
        assert_eq!(
            without_nfacct(save),
            "-A KUBE-NODEPORTS -d 127.0.0.0/8 -p tcp -m comment --comment \"lab/web:http\" -m tcp --dport 30080 -j KUBE-EXT-X\n-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP\n-A KUBE-SERVICES -j RETURN\n"
        );
    }

    #[test]
    fn recorded_answers_round_trip_through_the_stand_ins_response() {
        let a = Answer {
            status: 200,
            body: "{\"localEndpoints\": 1}".into(),
        };
        assert_eq!(parse_response(&response(&a)), Some(a));
        assert_eq!(parse_response("HTTP/1.1 503"), None);
    }
}
