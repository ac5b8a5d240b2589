//! The objects `kproxy connectivity-test` creates (pure: each as the API's JSON): its
//! namespace, the Services whose paths it checks, a server pod pinned to every node
//! and two client pods per node (the node's view, hostNetwork, and a pod's view).

use serde_json::{Value, json};

/// The label that marks everything the test creates (and finds leftovers by).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "kproxy-connectivity-test");
/// The namespace's generateName: the API server appends a unique suffix.
pub const NAMESPACE_PREFIX: &str = "kproxy-connectivity-";
/// The label naming a pod's role (`server`, `client`).
const ROLE: &str = "kproxy.io/connectivity";
/// The label of the one server behind the Local-policy Services.
const LOCAL_ENDPOINT: &str = "kproxy.io/local-endpoint";

/// The Services' ports and the servers' (netexec's) ports.
pub const TCP_PORT: u16 = 80;
pub const UDP_PORT: u16 = 81;
const HTTP_TARGET: u16 = 8080;
const UDP_TARGET: u16 = 8081;

/// The Services, by name.
pub const MAIN: &str = "main";
pub const AFFINITY: &str = "affinity";
pub const LOCAL: &str = "etp-local";
pub const INTERNAL_LOCAL: &str = "itp-local";
pub const NO_ENDPOINTS: &str = "no-endpoints";
pub const TERMINATING: &str = "terminating";
/// The pod behind [`TERMINATING`], deleted once ready.
pub const TERMINATING_POD: &str = "terminating-0";

/// `key=value` for a label selector.
pub fn selector((key, value): (&str, &str)) -> String {
    format!("{key}={value}")
}

/// The role label's selector for `role`.
pub fn role_selector(role: &str) -> String {
    selector((ROLE, role))
}

/// The test's namespace (admitting hostNetwork pods under Pod Security admission).
pub fn namespace() -> Value {
    json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {
            "generateName": NAMESPACE_PREFIX,
            "labels": {
                MANAGED_BY.0: MANAGED_BY.1,
                "pod-security.kubernetes.io/enforce": "privileged",
            },
        },
    })
}

fn service(name: &str, selector: Value, spec: Value) -> Value {
    let mut s = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": {MANAGED_BY.0: MANAGED_BY.1}},
        "spec": {
            "selector": selector,
            "ports": [{"name": "http", "protocol": "TCP", "port": TCP_PORT, "targetPort": HTTP_TARGET}],
        },
    });
    merge_spec(&mut s, spec);
    s
}

/// `object`'s spec with `spec`'s fields set over it.
fn merge_spec(object: &mut Value, spec: Value) {
    if let (Some(to), Value::Object(from)) = (object["spec"].as_object_mut(), spec) {
        to.extend(from);
    }
}

/// The six Services: `main` (LoadBalancer, externalTrafficPolicy Cluster, TCP and
/// UDP, the external IP if any) over every server; `affinity` (ClientIP) over every
/// server; `etp-local` (LoadBalancer, externalTrafficPolicy Local: a
/// healthCheckNodePort) and `itp-local` (internalTrafficPolicy Local) over the one
/// local server; `no-endpoints` selecting nothing; `terminating` (LoadBalancer,
/// externalTrafficPolicy Local) over the pod that will be terminating.
/// With `proxy_name`, each is labelled `service.kubernetes.io/service-proxy-name` with
/// it: only a proxy run with that `--service-proxy-name` serves them.
pub fn services(external_ip: Option<&str>, proxy_name: Option<&str>) -> Vec<Value> {
    let all = json!({ROLE: "server"});
    let local = json!({ROLE: "server", LOCAL_ENDPOINT: "true"});
    let mut main = json!({
        "type": "LoadBalancer",
        "externalTrafficPolicy": "Cluster",
        "ports": [
            {"name": "http", "protocol": "TCP", "port": TCP_PORT, "targetPort": HTTP_TARGET},
            {"name": "udp", "protocol": "UDP", "port": UDP_PORT, "targetPort": UDP_TARGET},
        ],
    });
    if let Some(ip) = external_ip {
        main["externalIPs"] = json!([ip]);
    }
    let mut out = vec![
        service(MAIN, all.clone(), main),
        service(
            AFFINITY,
            all,
            json!({"sessionAffinity": "ClientIP",
                   "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}}}),
        ),
        service(
            LOCAL,
            local.clone(),
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local"}),
        ),
        service(
            INTERNAL_LOCAL,
            local,
            json!({"internalTrafficPolicy": "Local"}),
        ),
        service(NO_ENDPOINTS, json!({ROLE: "none"}), json!({})),
        service(
            TERMINATING,
            json!({ROLE: TERMINATING}),
            json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local"}),
        ),
    ];
    if let Some(name) = proxy_name {
        for s in &mut out {
            s["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] = json!(name);
        }
    }
    out
}

/// What every test pod shares: pinned to `node` by `nodeName` (no scheduler, every
/// taint tolerated, as the proxy's own DaemonSet), no service-account token, a short
/// grace period (the namespace's deletion is quick).
fn pod(name: &str, node: &str, labels: Value, spec: Value) -> Value {
    let mut p = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeName": node,
            "tolerations": [{"operator": "Exists"}],
            "automountServiceAccountToken": false,
            "enableServiceLinks": false,
            "terminationGracePeriodSeconds": 1,
        },
    });
    merge_spec(&mut p, spec);
    p
}

/// The server on `node`: agnhost netexec (HTTP `/hostname` on 8080, UDP `hostname` on
/// 8081), ready once it listens; `local` marks the Local-policy Services' endpoint.
pub fn server(name: &str, node: &str, image: &str, local: bool) -> Value {
    let mut labels = json!({MANAGED_BY.0: MANAGED_BY.1, ROLE: "server"});
    if local {
        labels[LOCAL_ENDPOINT] = json!("true");
    }
    netexec(name, node, image, labels)
}

/// The server behind the `terminating` Service on `node`: once deleted, its preStop
/// hook sleeps `seconds` while netexec keeps serving (and passing its readiness
/// probe): a terminating, serving endpoint for as long as the test runs.
pub fn terminating_server(node: &str, image: &str, seconds: u64) -> Value {
    let mut p = netexec(
        TERMINATING_POD,
        node,
        image,
        json!({MANAGED_BY.0: MANAGED_BY.1, ROLE: TERMINATING}),
    );
    p["spec"]["terminationGracePeriodSeconds"] = json!(seconds + 5);
    p["spec"]["containers"][0]["lifecycle"] =
        json!({"preStop": {"exec": {"command": ["sleep", seconds.to_string()]}}});
    p
}

fn netexec(name: &str, node: &str, image: &str, labels: Value) -> Value {
    pod(
        name,
        node,
        labels,
        json!({"containers": [{
            "name": "netexec",
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "args": ["netexec", format!("--http-port={HTTP_TARGET}"), format!("--udp-port={UDP_TARGET}")],
            "ports": [
                {"name": "http", "containerPort": HTTP_TARGET, "protocol": "TCP"},
                {"name": "udp", "containerPort": UDP_TARGET, "protocol": "UDP"},
            ],
            "readinessProbe": {"tcpSocket": {"port": HTTP_TARGET}, "periodSeconds": 1},
        }]}),
    )
}

/// A client on `node` running `script` once (hostNetwork for the node's view), ended
/// by the kubelet after `deadline_seconds`.
pub fn client(
    name: &str,
    node: &str,
    image: &str,
    host_network: bool,
    script: &str,
    deadline_seconds: u64,
) -> Value {
    pod(
        name,
        node,
        json!({MANAGED_BY.0: MANAGED_BY.1, ROLE: "client"}),
        json!({
            "hostNetwork": host_network,
            "restartPolicy": "Never",
            "activeDeadlineSeconds": deadline_seconds.max(1),
            "containers": [{
                "name": "probe",
                "image": image,
                "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", script],
            }],
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each Service as the checks need it: types, policies, selectors, ports.
    #[test]
    fn the_services_hold_each_policy() {
        let s = services(Some("198.51.100.7"), None);
        let by = |n: &str| s.iter().find(|x| x["metadata"]["name"] == n).unwrap();
        let main = by(MAIN);
        assert_eq!(main["spec"]["type"], "LoadBalancer");
        assert_eq!(main["spec"]["externalTrafficPolicy"], "Cluster");
        assert_eq!(main["spec"]["externalIPs"], json!(["198.51.100.7"]));
        assert_eq!(main["spec"]["ports"][1]["protocol"], "UDP");
        assert_eq!(by(AFFINITY)["spec"]["sessionAffinity"], "ClientIP");
        assert_eq!(by(LOCAL)["spec"]["externalTrafficPolicy"], "Local");
        assert_eq!(by(LOCAL)["spec"]["type"], "LoadBalancer");
        assert_eq!(by(LOCAL)["spec"]["selector"][LOCAL_ENDPOINT], "true");
        assert_eq!(by(INTERNAL_LOCAL)["spec"]["internalTrafficPolicy"], "Local");
        assert_eq!(
            by(INTERNAL_LOCAL)["spec"]["selector"][LOCAL_ENDPOINT],
            "true"
        );
        assert_eq!(by(NO_ENDPOINTS)["spec"]["selector"][ROLE], "none");
        assert_eq!(by(NO_ENDPOINTS)["spec"]["ports"][0]["port"], 80);
        assert_eq!(by(TERMINATING)["spec"]["externalTrafficPolicy"], "Local");
        assert_eq!(by(TERMINATING)["spec"]["selector"][ROLE], TERMINATING);
        let t = terminating_server("n1", "img", 120);
        assert_eq!(t["metadata"]["name"], TERMINATING_POD);
        assert_eq!(t["spec"]["terminationGracePeriodSeconds"], 125);
        assert_eq!(
            t["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"],
            json!(["sleep", "120"])
        );
        assert!(t["spec"]["containers"][0]["readinessProbe"].is_object());
        assert!(services(None, None)[0]["spec"].get("externalIPs").is_none());
        assert!(s.iter().all(|x| {
            x["metadata"]["labels"]
                .get("service.kubernetes.io/service-proxy-name")
                .is_none()
        }));
        let named = services(None, Some("kproxy"));
        assert_eq!(named.len(), 6);
        assert!(named.iter().all(
            |x| x["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"] == "kproxy"
        ));
        let srv = server("server-0", "n1", "img", true);
        assert_eq!(srv["metadata"]["labels"][LOCAL_ENDPOINT], "true");
        assert_eq!(srv["spec"]["nodeName"], "n1");
        let c = client("client-node-0", "n1", "img", true, "echo", 60);
        assert_eq!(c["spec"]["hostNetwork"], true);
        assert_eq!(c["spec"]["restartPolicy"], "Never");
    }
}
