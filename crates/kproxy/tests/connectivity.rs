//! `kproxy connectivity-test` through the real binary against the fake API server
//! (`kproxy_source::fake_api`, its object store), which runs no pods: the test plays the
//! API server's allocations (cluster IPs, node ports, the load balancer), the kubelet
//! (pod status) and a correct Service proxy (each client's script answered from the
//! Services, selectors and pods the command created), with one fault injected. Checks
//! the objects created, the table, the exit status, the leftovers and that the
//! namespace is deleted after a run, a timeout and a signal. No root needed.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kproxy_source::fake_api::{self, FakeApi};
use serde_json::{Value, json};

const NODES: [(&str, &str); 2] = [("node-a", "192.168.0.10"), ("node-b", "192.168.0.11")];
const LABEL: &str = "app.kubernetes.io/managed-by";
const OURS: &str = "kproxy-connectivity-test";

struct Cluster {
    api: Arc<FakeApi>,
    _runtime: tokio::runtime::Runtime,
    dir: tempfile::TempDir,
    stop: Arc<AtomicBool>,
    /// Every pod the kubelet saw, by name.
    pods: Arc<Mutex<BTreeMap<String, Value>>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn node(name: &str, ip: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/os": "linux"}},
        "spec": {},
        "status": {"conditions": [{"type": "Ready", "status": "True"}],
                   "addresses": [{"type": "InternalIP", "address": ip}]}})
}

/// The API server's allocations: a cluster IP per Service, node ports, a health-check
/// node port for externalTrafficPolicy Local, and (with `lb`) an ingress IP.
fn allocate(api: &FakeApi, lb: bool) {
    let next = Mutex::new(0u16);
    api.objects.on_create(move |collection, object| {
        if !collection.ends_with("/services") {
            return;
        }
        let n = {
            let mut n = next.lock().unwrap();
            *n += 1;
            *n
        };
        let spec = &mut object["spec"];
        spec["clusterIP"] = json!(format!("10.96.0.{n}"));
        let typ = spec["type"].as_str().unwrap_or("ClusterIP").to_string();
        if typ != "ClusterIP" {
            for (i, port) in spec["ports"].as_array_mut().unwrap().iter_mut().enumerate() {
                port["nodePort"] = json!(30000 + n * 10 + i as u16);
            }
        }
        if typ == "LoadBalancer" {
            if spec["externalTrafficPolicy"] == "Local" {
                spec["healthCheckNodePort"] = json!(32000 + n);
            }
            if lb {
                object["status"] =
                    json!({"loadBalancer": {"ingress": [{"ip": format!("172.31.229.{n}")}]}});
            }
        }
    });
}

/// A pod that is not being deleted.
fn is_ready(pod: &Value) -> bool {
    pod["metadata"]["deletionTimestamp"].is_null()
}

/// What a correct proxy answers to one try of a client's script on `node`.
fn answer(services: &[Value], pods: &[Value], node: &str, line: &[&str]) -> String {
    let (cmd, addr) = match line {
        ["connect", proto, addr] => (format!("connect-{proto}"), *addr),
        [cmd, addr, ..] => (cmd.to_string(), *addr),
        _ => return "error unreadable".into(),
    };
    let (ip, port) = addr.rsplit_once(':').unwrap();
    let port: u16 = port.parse().unwrap();
    let ip_node = NODES.iter().find(|n| n.1 == ip).map(|n| n.0);
    let selects = |svc: &Value, pod: &Value| {
        let sel = svc["spec"]["selector"].as_object().unwrap();
        sel.iter().all(|(k, v)| &pod["metadata"]["labels"][k] == v)
    };
    if cmd == "healthz" {
        let svc = services
            .iter()
            .find(|s| s["spec"]["healthCheckNodePort"] == port)
            .expect("a health-check node port");
        let probed = ip_node.expect("a node's address");
        let local = pods
            .iter()
            .filter(|p| selects(svc, p) && is_ready(p) && p["spec"]["nodeName"] == probed)
            .count();
        return format!("status {}", if local > 0 { 200 } else { 503 });
    }
    let frontend = |s: &Value| {
        let spec = &s["spec"];
        let ports = spec["ports"].as_array().unwrap();
        let by_port = ports.iter().any(|p| p["port"] == port);
        let vip = spec["clusterIP"] == ip
            || s["status"]["loadBalancer"]["ingress"][0]["ip"] == ip
            || spec["externalIPs"]
                .as_array()
                .is_some_and(|a| a.iter().any(|x| x == ip));
        (vip && by_port) || (ip_node.is_some() && ports.iter().any(|p| p["nodePort"] == port))
    };
    let Some(svc) = services.iter().find(|s| frontend(s)) else {
        return "timeout".into();
    };
    let selected: Vec<&Value> = pods.iter().filter(|p| selects(svc, p)).collect();
    if selected.is_empty() {
        return "refused".into();
    }
    // Ready endpoints, else the terminating ones (all serving here).
    let ready: Vec<&Value> = selected.iter().copied().filter(|p| is_ready(p)).collect();
    let mut endpoints = if ready.is_empty() { selected } else { ready };
    if svc["spec"]["internalTrafficPolicy"] == "Local" {
        endpoints.retain(|p| p["spec"]["nodeName"] == node);
        if endpoints.is_empty() {
            return "timeout".into();
        }
    }
    let name = endpoints[0]["metadata"]["name"].as_str().unwrap();
    match cmd.as_str() {
        "hostname" => format!("answer {name}"),
        "hostnames" => format!(
            "answer{}",
            format!(" {name}").repeat(line[2].parse().unwrap())
        ),
        _ => "answer".into(),
    }
}

/// The client's log: its script's probes answered, with `fault` on the pod it names.
fn run_script(
    script: &str,
    services: &[Value],
    pods: &[Value],
    client: &Value,
    fault: Option<(&str, &str)>,
) -> String {
    let node = client["spec"]["nodeName"].as_str().unwrap();
    let name = client["metadata"]["name"].as_str().unwrap();
    let mut log = String::from("starting\n");
    for line in script.lines().filter(|l| l.starts_with("p ")) {
        // p INDEX 'WANT' COMMAND ARGS…
        let (head, rest) = line.split_once(" '").unwrap();
        let index = head.trim_start_matches("p ");
        let (_want, command) = rest.split_once("' ").unwrap();
        let words: Vec<&str> = command.split_whitespace().collect();
        let result = match fault {
            Some((pod, cmd)) if pod == name && command.starts_with(cmd) => "timeout".to_string(),
            _ => answer(services, pods, node, &words),
        };
        log += &format!("kproxy-probe {index} {result}\n");
    }
    log + "kproxy-probe-done\n"
}

impl Cluster {
    /// The fake API with two Ready nodes; with `kubelet`, a thread that runs the pods
    /// (servers ready, clients' scripts answered as a correct proxy would, `fault`
    /// aside).
    fn new(lb: bool, kubelet: bool, fault: Option<(&'static str, &'static str)>) -> Cluster {
        let api = Arc::new(FakeApi::new());
        let (runtime, addr) = fake_api::serve_on_loopback(api.clone()).unwrap();
        api.nodes
            .set_list("5", NODES.iter().map(|(n, ip)| node(n, ip)).collect());
        allocate(&api, lb);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("kubeconfig"), fake_api::kubeconfig(addr)).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let pods = Arc::new(Mutex::new(BTreeMap::new()));
        if kubelet {
            let (api, stop, seen) = (api.clone(), stop.clone(), pods.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    kubelet_pass(&api, &seen, fault);
                    std::thread::sleep(Duration::from_millis(20));
                }
            });
        }
        Cluster {
            api,
            _runtime: runtime,
            dir,
            stop,
            pods,
        }
    }

    fn kubeconfig(&self) -> String {
        self.dir.path().join("kubeconfig").display().to_string()
    }

    fn spawn(&self, args: &[&str]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_kproxy"))
            .arg("connectivity-test")
            .args(["--kubeconfig", &self.kubeconfig()])
            .args(args)
            .env_remove("KUBECONFIG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// The test's namespaces in the store now.
    fn namespaces(&self) -> Vec<String> {
        self.api
            .objects
            .under("/api/v1/namespaces/")
            .into_iter()
            .filter(|(p, _)| p.matches('/').count() == 4)
            .map(|(_, v)| v["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    }

    fn deletes(&self) -> Vec<String> {
        self.api
            .objects
            .calls()
            .into_iter()
            .filter(|(m, _)| m.as_str() == "DELETE")
            .map(|(_, p)| p)
            .collect()
    }
}

/// One pass of the kubelet: every pod without a status gets one; a client's log is its
/// script answered.
fn kubelet_pass(api: &FakeApi, seen: &Mutex<BTreeMap<String, Value>>, fault: Option<(&str, &str)>) {
    let all = api.objects.under("/api/v1/namespaces/");
    for (path, pod) in all.iter().filter(|(p, _)| p.contains("/pods/")) {
        // The EndpointSlice controller: a deleted pod behind a Service, its preStop
        // hook running, is a terminating, serving endpoint.
        if !is_ready(pod) && pod["metadata"]["labels"]["kproxy.io/connectivity"] == "terminating" {
            let ns = pod["metadata"]["namespace"].as_str().unwrap();
            let name = pod["metadata"]["name"].as_str().unwrap();
            api.objects.insert(
                &format!("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices/terminating-x"),
                json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                    "metadata": {"name": "terminating-x", "namespace": ns,
                                 "labels": {"kubernetes.io/service-name": "terminating"}},
                    "endpoints": [{"addresses": ["10.244.0.9"], "targetRef": {"kind": "Pod", "name": name},
                        "conditions": {"ready": false, "serving": true, "terminating": true}}]}),
            );
        }
        if !pod["status"].is_null() {
            continue;
        }
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        seen.lock().unwrap().insert(name, pod.clone());
        let ns = pod["metadata"]["namespace"].as_str().unwrap();
        let in_ns = |kind: &str| -> Vec<Value> {
            all.iter()
                .filter(|(p, _)| p.starts_with(&format!("/api/v1/namespaces/{ns}/{kind}/")))
                .map(|(_, v)| v.clone())
                .collect()
        };
        let role = pod["metadata"]["labels"]["kproxy.io/connectivity"].as_str();
        if role == Some("client") {
            let script = pod["spec"]["containers"][0]["command"][2].as_str().unwrap();
            let servers: Vec<Value> = in_ns("pods")
                .into_iter()
                .filter(|p| p["metadata"]["labels"]["kproxy.io/connectivity"] != "client")
                .collect();
            let log = run_script(script, &in_ns("services"), &servers, pod, fault);
            api.objects.set_log(path, &log);
            api.objects.update(path, |p| {
                p["status"] = json!({"phase": "Succeeded"});
            });
        } else {
            api.objects.update(path, |p| {
                p["status"] = json!({"phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True"}]});
            });
        }
    }
}

fn wait(child: Child) -> (Option<i32>, String, String) {
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ns_object(name: &str, created: &str, ours: bool) -> Value {
    let labels = if ours {
        json!({LABEL: OURS})
    } else {
        json!({})
    };
    json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": labels, "creationTimestamp": created}})
}

/// A whole run: the objects as created, one injected fault named in the table, exit 1,
/// the namespace and the old leftovers deleted, the rest kept.
#[test]
fn a_run_creates_its_workloads_reports_a_fault_and_cleans_up() {
    let c = Cluster::new(true, true, Some(("client-pod-1", "connect udp")));
    let old = "2020-01-01T00:00:00Z";
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    for (name, created, ours) in [
        ("kproxy-connectivity-old", old, true),
        ("kproxy-connectivity-fresh", now.as_str(), true),
        ("someone-elses", old, false),
    ] {
        c.api.objects.insert(
            &format!("/api/v1/namespaces/{name}"),
            ns_object(name, created, ours),
        );
    }
    let (code, out, err) = wait(c.spawn(&["--timeout", "60s", "--load-balancer-timeout", "5s"]));
    assert_eq!(code, Some(1), "stdout:\n{out}\nstderr:\n{err}");
    assert!(
        err.contains("deleted namespace kproxy-connectivity-old, left by an earlier run"),
        "{err}"
    );
    let expected_rows = "\
NODE    FROM  clusterip-tcp  clusterip-udp  nodeport  loadbalancer  external-ip  affinity  etp-local-hc  itp-local  no-endpoints  terminating  terminating-hc
node-a  node  ok             ok             ok        ok            skip         ok        ok            ok         ok            ok           ok
node-a  pod   ok             ok             ok        ok            skip         ok        ok            ok         ok            ok           ok
node-b  node  ok             ok             ok        ok            skip         ok        ok            ok         ok            ok           ok
node-b  pod   ok             FAIL           ok        ok            skip         ok        ok            ok         ok            ok           ok
FAIL node-b clusterip-udp from the pod: a timeout, expected an answer
";
    assert!(out.starts_with(expected_rows), "{out}\n{err}");
    let created = err
        .lines()
        .find_map(|l| l.strip_prefix("kproxy: connectivity-test in namespace "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap_or_else(|| panic!("{err}"))
        .to_string();
    assert!(
        out.ends_with(&format!(
            "connectivity-test: 2 nodes, 44 checks: 39 ok, 1 failed, 4 skipped; namespace {created} deleted\n"
        )),
        "{out}"
    );
    // The pods as created: a server pinned to each node (the first the Local
    // Services' endpoint), and per node a hostNetwork client and a pod client.
    let pods = c.pods.lock().unwrap().clone();
    let names: Vec<&str> = pods.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "client-node-0",
            "client-node-1",
            "client-pod-0",
            "client-pod-1",
            "server-0",
            "server-1",
            "terminating-0"
        ]
    );
    assert_eq!(pods["terminating-0"]["spec"]["nodeName"], "node-a");
    // Deleted gracefully once ready (the checks run while it terminates), then at
    // once (grace 0) before the namespace.
    let deletes = c.deletes();
    let term = format!("/api/v1/namespaces/{created}/pods/terminating-0");
    assert_eq!(
        deletes.iter().filter(|d| **d == term).count(),
        2,
        "{deletes:?}"
    );
    for (name, node, host) in [
        ("client-node-0", "node-a", true),
        ("client-pod-0", "node-a", false),
        ("client-node-1", "node-b", true),
        ("client-pod-1", "node-b", false),
    ] {
        assert_eq!(pods[name]["spec"]["nodeName"], node, "{name}");
        assert_eq!(pods[name]["spec"]["hostNetwork"], host, "{name}");
        assert_eq!(
            pods[name]["spec"]["containers"][0]["image"],
            "registry.k8s.io/e2e-test-images/agnhost:2.63.0"
        );
        assert_eq!(pods[name]["metadata"]["namespace"], created.as_str());
    }
    assert_eq!(pods["server-0"]["spec"]["nodeName"], "node-a");
    assert_eq!(pods["server-1"]["spec"]["nodeName"], "node-b");
    assert_eq!(
        pods["server-0"]["metadata"]["labels"]["kproxy.io/local-endpoint"],
        "true"
    );
    assert!(pods["server-1"]["metadata"]["labels"]["kproxy.io/local-endpoint"].is_null());
    // The namespace is gone (its objects with it), as is the old leftover; the fresh
    // one and another's namespace stay.
    let deletes = c.deletes();
    assert!(
        deletes.contains(&format!("/api/v1/namespaces/{created}")),
        "{deletes:?}"
    );
    assert_eq!(
        c.namespaces(),
        ["kproxy-connectivity-fresh", "someone-elses"],
        "{deletes:?}"
    );
    assert!(
        c.api
            .objects
            .under(&format!("/api/v1/namespaces/{created}/"))
            .is_empty()
    );
}

/// As `kubectl kproxy` (the binary under the plugin's name, kubectl's $KUBECONFIG),
/// `-o json`, no load balancer: the loadbalancer check is skipped with why, every
/// other check passes, exit 0.
#[test]
fn without_a_load_balancer_the_check_is_skipped_and_json_says_why() {
    let c = Cluster::new(false, true, None);
    let plugin = c.dir.path().join("kubectl-kproxy");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kproxy"), &plugin).unwrap();
    let child = Command::new(&plugin)
        .arg("connectivity-test")
        .env("KUBECONFIG", c.kubeconfig())
        .env("HOME", c.dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .args([
            "-o",
            "json",
            "--load-balancer-timeout",
            "1s",
            "--external-ip",
            "198.51.100.7",
        ])
        .spawn()
        .unwrap();
    let (code, out, err) = wait(child);
    assert_eq!(code, Some(0), "{out}\n{err}");
    let report: Value = serde_json::from_str(&out).unwrap();
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 44);
    for cell in cells {
        let want = if cell["check"] == "loadbalancer" {
            "skipped"
        } else {
            "ok"
        };
        assert_eq!(cell["status"], want, "{cell}");
    }
    let lb = cells.iter().find(|c| c["check"] == "loadbalancer").unwrap();
    assert!(
        lb["reason"]
            .as_str()
            .unwrap()
            .starts_with("no ingress IP within --load-balancer-timeout 1s"),
        "{lb}"
    );
    assert!(c.namespaces().is_empty());
}

/// No kubelet: the servers never become ready. Past --timeout the run fails naming
/// them, and deletes its namespace.
#[test]
fn a_run_past_its_timeout_deletes_its_namespace() {
    let c = Cluster::new(true, false, None);
    let (code, out, err) = wait(c.spawn(&["--timeout", "3s"]));
    assert_eq!(code, Some(1), "{out}\n{err}");
    assert!(
        err.contains("the servers were not ready within --timeout: server-0 on node-a: no status yet; server-1 on node-b: no status yet"),
        "{err}"
    );
    assert!(err.contains("deleted"), "{err}");
    assert!(c.namespaces().is_empty(), "{:?}", c.deletes());
    // The terminating pod's forced deletion (not there: never ready, never
    // deleted… but created: it goes with grace 0), then the namespace.
    assert_eq!(c.deletes().len(), 2, "{:?}", c.deletes());
}

/// SIGTERM and SIGINT mid-run: the namespace is deleted, exit 143 and 130.
#[test]
fn an_interrupted_run_deletes_its_namespace() {
    for (signal, code) in [
        (nix::sys::signal::Signal::SIGTERM, 143),
        (nix::sys::signal::Signal::SIGINT, 130),
    ] {
        let c = Cluster::new(true, false, None);
        let child = c.spawn(&["--timeout", "60s"]);
        let mut waited = 0;
        while c.namespaces().is_empty() || c.api.objects.under("/api/v1/namespaces/").len() < 8 {
            std::thread::sleep(Duration::from_millis(20));
            waited += 1;
            assert!(waited < 1500, "no namespace and objects within 30 s");
        }
        let created = c.namespaces()[0].clone();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), signal).unwrap();
        let (got, out, err) = wait(child);
        assert_eq!(got, Some(code), "{signal}: {out}\n{err}");
        assert!(
            err.contains(&format!(
                "{signal}: connectivity-test stopped; namespace {created} deleted"
            )),
            "{err}"
        );
        assert!(c.namespaces().is_empty(), "{signal}: {:?}", c.deletes());
    }
}
