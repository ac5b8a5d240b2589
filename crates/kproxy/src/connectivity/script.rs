//! The clients' side (pure): the shell script a client pod runs for its probes, and
//! the reading of what it printed (its log) back into observations.
//!
//! A client is a pod that probes by itself and reports on stdout, one line per probe
//! (`kproxy-probe INDEX RESULT`), read back through the pod's `log` subresource: no
//! exec (which needs a SPDY or websocket stream through the API server). The script
//! needs `/bin/sh`, `curl` and `/agnhost` (its `connect` subcommand names a refused
//! connection and a timeout apart): agnhost's image has all three.

use std::net::IpAddr;
use std::time::Duration;

use super::checks::{Action, Expect, Probe};
use super::report::Observed;

/// The prefix of a probe's line.
const PREFIX: &str = "kproxy-probe ";
/// The script's last line: every probe ran.
pub const DONE: &str = "kproxy-probe-done";

/// Tries per probe while the result is not the one expected (1 s apart): the first
/// tries may run before the node's proxy programmed the test's new Services.
pub const ATTEMPTS: u32 = 4;

/// The script's functions: each sets `R` to the result of one try.
const FUNCTIONS: &str = r#"R=
AG=${AG:-/agnhost}
failed() {
  # curl could not connect (exit 7 says "Couldn't connect" for a refusal and for no
  # route alike): agnhost connect names a refusal or the error.
  case "$2" in
    *"exit 7:"*) connect tcp "$1"; [ "$R" = answer ] && R="error $2" ;;
    *) R="error $2" ;;
  esac
}
hostname() {
  out=$(curl -sS --connect-timeout "$T" -m "$T" -w '\nkproxy-code %{http_code}' "http://$1/hostname" 2>&1); rc=$?
  code=$(printf '%s\n' "$out" | sed -n 's/^kproxy-code //p')
  case $rc in
    0) if [ "$code" = 200 ]; then R="answer $(printf '%s\n' "$out" | head -n 1 | tr -cd 'a-zA-Z0-9.-')"; else R="status $code"; fi ;;
    28) R=timeout ;;
    *) failed "$1" "curl exit $rc: $(printf '%s' "$out" | grep -v '^kproxy-code' | tr '\n' ' ' | cut -c1-160)" ;;
  esac
}
hostnames() {
  names=
  k=0
  while [ "$k" -lt "$2" ]; do
    k=$((k+1))
    hostname "$1"
    case "$R" in
      "answer "*) names="$names ${R#answer }" ;;
      *) return ;;
    esac
  done
  R="answer$names"
}
healthz() {
  out=$(curl -sS --connect-timeout "$T" -m "$T" -o /dev/null -w 'kproxy-code %{http_code}' "http://$1/healthz" 2>&1); rc=$?
  case $rc in
    0) R="status $(printf '%s\n' "$out" | sed -n 's/.*kproxy-code //p')" ;;
    28) R=timeout ;;
    *) failed "$1" "curl exit $rc: $(printf '%s' "$out" | sed 's/kproxy-code.*//' | tr '\n' ' ' | cut -c1-160)" ;;
  esac
}
connect() {
  out=$("$AG" connect --timeout="${T}s" --protocol="$1" "$2" 2>&1); rc=$?
  if [ "$rc" = 0 ]; then R=answer; return; fi
  case "$out" in
    TIMEOUT*) R=timeout ;;
    REFUSED*) R=refused ;;
    *) R="error $(printf '%s' "$out" | tr '\n' ' ' | cut -c1-160)" ;;
  esac
}
p() {
  i=$1; w=$2; shift 2; n=0
  while :; do
    n=$((n+1))
    "$@"
    case "$R" in $w) break ;; esac
    [ "$n" -ge "$A" ] && break
    sleep 1
  done
  echo "kproxy-probe $i $R"
}
"#;

/// `IP:PORT`, bracketed for IPv6.
fn host_port(ip: IpAddr, port: u16) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}:{port}"),
        IpAddr::V6(v6) => format!("[{v6}]:{port}"),
    }
}

/// The shell pattern of the results that stop the retries of a probe.
fn want_pattern(expect: &Expect) -> String {
    match expect {
        Expect::Answer => "answer*".into(),
        Expect::AnswerFrom(server) => format!("answer {server}"),
        Expect::OneServer => "answer *".into(),
        Expect::Status(code) => format!("status {code}"),
        Expect::Refused => "refused".into(),
        Expect::Timeout => "timeout".into(),
    }
}

/// The command of one try.
fn command(action: &Action) -> String {
    match *action {
        Action::Hostname { ip, port } => format!("hostname {}", host_port(ip, port)),
        Action::Hostnames { ip, port, tries } => {
            format!("hostnames {} {tries}", host_port(ip, port))
        }
        Action::Healthz { ip, port } => format!("healthz {}", host_port(ip, port)),
        Action::Udp { ip, port } => format!("connect udp {}", host_port(ip, port)),
        Action::Connect { ip, port } => format!("connect tcp {}", host_port(ip, port)),
    }
}

/// The script running `probes` in order, each try bounded by `timeout` (whole
/// seconds, at least 1), printing one line per probe and [`DONE`] last.
pub fn render(probes: &[Probe], timeout: Duration) -> String {
    let seconds = timeout.as_secs().max(1);
    let mut s = format!("T={seconds}\nA={ATTEMPTS}\n{FUNCTIONS}");
    for (i, probe) in probes.iter().enumerate() {
        s += &format!(
            "p {i} '{}' {}\n",
            want_pattern(&probe.expect),
            command(&probe.action)
        );
    }
    s += &format!("echo {DONE}\n");
    s
}

/// One printed result.
fn parse_result(text: &str) -> Observed {
    let text = text.trim();
    match text.split_once(' ').unwrap_or((text, "")) {
        ("answer", names) => Observed::Answer(names.split_whitespace().map(String::from).collect()),
        ("status", code) => match code.trim().parse() {
            Ok(c) => Observed::Status(c),
            Err(_) => Observed::Error(format!("unreadable status {code:?}")),
        },
        ("refused", _) => Observed::Refused,
        ("timeout", _) => Observed::Timeout,
        ("error", why) => Observed::Error(why.to_string()),
        _ => Observed::Error(format!("unreadable result {text:?}")),
    }
}

/// The observations of `count` probes from a client's log (`None`: no line for it),
/// and whether the script printed its last line.
pub fn parse(log: &str, count: usize) -> (Vec<Option<Observed>>, bool) {
    let mut out = vec![None; count];
    let mut done = false;
    for line in log.lines() {
        let line = line.trim_end();
        if line == DONE {
            done = true;
            continue;
        }
        let Some(rest) = line.strip_prefix(PREFIX) else {
            continue;
        };
        let (index, result) = rest.split_once(' ').unwrap_or((rest, ""));
        if let Some(slot) = index.parse::<usize>().ok().and_then(|i| out.get_mut(i)) {
            *slot = Some(parse_result(result));
        }
    }
    (out, done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::connectivity::checks::{probes, tests::setup};

    #[test]
    fn results_are_read_back() {
        let log = "some noise\nkproxy-probe 0 answer server-1\nkproxy-probe 1 answer\n\
                   kproxy-probe 2 status 503\nkproxy-probe 3 refused\nkproxy-probe 4 timeout\n\
                   kproxy-probe 5 error curl exit 7: no route\nkproxy-probe 6 answer server-0 server-0\n\
                   kproxy-probe 99 answer x\nkproxy-probe 7 status x\n";
        let (got, done) = parse(log, 9);
        assert!(!done);
        assert_eq!(
            got,
            [
                Some(Observed::Answer(vec!["server-1".into()])),
                Some(Observed::Answer(vec![])),
                Some(Observed::Status(503)),
                Some(Observed::Refused),
                Some(Observed::Timeout),
                Some(Observed::Error("curl exit 7: no route".into())),
                Some(Observed::Answer(vec!["server-0".into(), "server-0".into()])),
                Some(Observed::Error("unreadable status \"x\"".into())),
                None,
            ]
        );
        assert!(parse(&format!("{DONE}\n"), 0).1);
    }

    /// One line per probe, in order, each with the pattern that stops its retries.
    #[test]
    fn the_script_runs_every_probe() {
        let s = setup(2, 0);
        let p = probes(&s, 1);
        let script = render(&p, Duration::from_millis(2500));
        assert!(script.starts_with("T=2\nA=4\n"), "{script}");
        let lines: Vec<&str> = script.lines().filter(|l| l.starts_with("p ")).collect();
        assert_eq!(lines.len(), p.len());
        assert_eq!(lines[0], "p 0 'answer*' hostname 10.96.0.10:80");
        assert!(
            lines.contains(&"p 1 'answer*' connect udp 10.96.0.10:81"),
            "{lines:?}"
        );
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with("'status 503' healthz 192.168.0.11:30999"))
        );
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with("'answer *' hostnames 10.96.0.11:80 10"))
        );
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with("'timeout' hostname 10.96.0.12:80"))
        );
        assert!(
            lines
                .iter()
                .any(|l| l.ends_with("'refused' connect tcp 10.96.0.13:80"))
        );
        assert!(script.ends_with(&format!("echo {DONE}\n")));
        assert_eq!(host_port("fd00::1".parse().unwrap(), 80), "[fd00::1]:80");
    }

    /// The script is valid POSIX shell, and its functions classify what curl and
    /// agnhost print (curl and agnhost replaced by stand-ins printing their outputs).
    #[test]
    fn the_script_classifies_results() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path();
        // curl: the URL's host decides what it prints and its exit status.
        std::fs::write(
            bin.join("curl"),
            r#"#!/bin/sh
for a; do url=$a; done
case "$url" in
  *10.0.0.1*) printf 'server-1\nkproxy-code 200' ;;
  *10.0.0.2*) echo 'curl: (28) Connection timed out after 2001 milliseconds'; printf 'kproxy-code 000'; exit 28 ;;
  *10.0.0.3*) echo 'curl: (7) Failed to connect to 10.0.0.3 port 80: Connection refused'; printf 'kproxy-code 000'; exit 7 ;;
  *10.0.0.4*) printf 'kproxy-code 503' ;;
  *10.0.0.5*|*10.0.0.6*) echo "curl: (7) Failed to connect to $url port 80 after 0 ms: Couldn't connect to server"; printf 'kproxy-code 000'; exit 7 ;;
esac
"#,
        )
        .unwrap();
        // agnhost connect: a refusal at 10.0.0.3 and .5, no route at 10.0.0.6.
        std::fs::write(
            bin.join("agnhost"),
            r#"#!/bin/sh
for a; do dest=$a; done
case "$dest" in
  10.0.0.3:*|10.0.0.5:*) echo REFUSED >&2; exit 1 ;;
  *) echo "OTHER: dial tcp $dest: connect: no route to host" >&2; exit 1 ;;
esac
"#,
        )
        .unwrap();
        let script = format!(
            "T=1\nA=1\n{FUNCTIONS}p 0 'answer*' hostname 10.0.0.1:80\np 1 'answer*' hostname 10.0.0.2:80\n\
             p 2 'x' hostname 10.0.0.3:80\np 3 'status 503' healthz 10.0.0.4:1\np 4 'answer *' hostnames 10.0.0.1:80 3\n\
             p 5 'x' healthz 10.0.0.5:1\np 6 'x' hostname 10.0.0.6:80\necho {DONE}\n"
        );
        use std::os::unix::fs::PermissionsExt;
        for tool in ["curl", "agnhost"] {
            std::fs::set_permissions(bin.join(tool), std::fs::Permissions::from_mode(0o755))
                .unwrap();
        }
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(&script)
            .env(
                "PATH",
                format!("{}:{}", bin.display(), std::env::var("PATH").unwrap()),
            )
            .env("AG", bin.join("agnhost"))
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stdout);
        let (got, done) = parse(&log, 7);
        assert!(done, "{log}");
        assert_eq!(
            got,
            [
                Some(Observed::Answer(vec!["server-1".into()])),
                Some(Observed::Timeout),
                Some(Observed::Refused),
                Some(Observed::Status(503)),
                Some(Observed::Answer(vec!["server-1".into(); 3])),
                Some(Observed::Refused),
                Some(Observed::Error(
                    "OTHER: dial tcp 10.0.0.6:80: connect: no route to host".into()
                )),
            ],
            "{log}"
        );
    }
}
