#!/usr/bin/env python3
"""`kproxy lab rollout`'s scenario on the real nodes: a real Deployment rolled by the real
controllers and kubelets while an emulated load balancer sends traffic to every node's
NodePort, choosing nodes by their health-check node port; every failed request counted.

  rollout.py [--cell default|short-prestop] [--runs N] [--delay-shutdown S] [--timeline]
             [--disruption rollout|drain|shutdown] [--etp Local|Cluster]
             [--json FILE]          (after nodes.sh up && nodes.sh proxy kproxy|kube-proxy)

The cluster side is real: namespace kpn-rollout, a `type: LoadBalancer` Service `web`
with `externalTrafficPolicy: Local` (node port and health-check node port allocated by the
API server; no cloud fills its status), a Deployment `web` of agnhost `netexec` pods, one
per node (required anti-affinity), `maxSurge: 0, maxUnavailable: 1`, a `preStop` sleep
(the kubelet's `sleep` action), a readiness probe on netexec's `/readyz`, and the rolling
update is `kubectl rollout restart`. The pods, probes, preStop, SIGTERM and the endpoint
conditions are the kubelet's, the scheduler's and kube-controller-manager's.

Parameters are `kproxy lab rollout`'s defaults (docs/lab.md, "Parameters") at time scale 1
(a real kubelet runs on real time): replicas = nodes, one pod per node, maxSurge 0,
maxUnavailable 1, preStop 10 s (`short-prestop`: 1 s), grace 30 s, readiness initialDelay
20 s, period 10 s, timeout 1 s, success 1, failure 3; the `gke` load balancer (probe every
3 s, timeout 1 s, healthy after 1 success, unhealthy after 2 failures; nodes start
unhealthy; new connections to the healthy nodes, to all when none is); load 100 new
connections/s plus 4 keep-alive connections at 20 requests/s, 2 s per request, never
retried; warm-up 3 s, settle 8 s.

The load balancer is the lab's model (crates/lab/src/lb.rs, `node-port` mode) run on the
client's side: each new connection (a new request, or a keep-alive connection opening)
picks a node of the pool at random and connects to nodeIP:nodePort, and stays on that
node, as a DNAT load balancer's connection table keeps a flow. The client address is kept
(no SNAT). Outcomes are classified as crates/lab/src/loadgen.rs does: ok, refused, reset,
timeout, closed (the connection ended before a complete answer), unreachable, http_5xx,
http_error.

Other disruptions of the same Deployment under the same load (`--disruption`; the last
node, kpn-nN, is the one that goes; pods then spread by a preferred anti-affinity, so
the evicted pods can land on the nodes that stay):

- `drain`: `kubectl drain` of the node (cordon, every pod but DaemonSets' evicted), then
  its removal as an operator or a cloud's node pool does it: the Node object deleted,
  and REMOVAL_DELAY_S later the machine off (`nodes.sh node-stop`). Afterwards the
  machine comes back and registers again (`nodes.sh node-start`), outside the count.
- `shutdown`: a graceful node shutdown (KEP-2000) as a v1.37 kubelet runs it: the Node's
  condition `GracefulNodeShutdownInProgress` set True (KEP-5683; the v1.36 kubelet here
  has no systemd inhibitor to start a graceful shutdown, so the script does the kubelet's
  part), the node's workload pods deleted with their grace period (what the kubelet's
  shutdown manager does to non-critical pods; the kubelet still runs them down), after
  SHUTDOWN_GRACE_S - SHUTDOWN_CRITICAL_S the kubelet stopped and the node's Service proxy
  sent SIGTERM (kproxy's container, or the kube-proxy process: critical pods last), and
  SHUTDOWN_GRACE_S after the start the machine off. Then it comes back as above, condition cleared.

`--etp Cluster` makes the Service `externalTrafficPolicy: Cluster`; the load balancer then
health-checks the proxy's own `/healthz` on port 10256, as GCP's and AWS's do for
Cluster Services (`Local`: the health-check node port). A keep-alive connection that a
node's going away breaks is counted apart from failed new connections (`new_failed`,
`keep_alive_failed`).

agnhost netexec exits at SIGTERM (the lab's `exit-on-term` profile); with
`--delay-shutdown S` it fails `/readyz` at SIGTERM and keeps serving S seconds
(`fail-readiness-on-term`). Runs in this machine's network namespace and reaches the nodes
through the real-node network's host veth (nodes.sh); API reads use dns.py's client.
"""

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tarfile
import threading
import time

from dns import Records, kubeconfig

NS = "kpn-rollout"
APP = "web"
HTTP_PORT = 8080
# kproxy lab rollout's defaults (crates/lab/src/config.rs), time scale 1.
CELLS = {"default": 10.0, "short-prestop": 1.0}
GRACE_S = 30
READINESS = {"initialDelaySeconds": 20, "periodSeconds": 10, "timeoutSeconds": 1,
             "successThreshold": 1, "failureThreshold": 3}
GKE = {"interval": 3.0, "timeout": 1.0, "healthy": 1, "unhealthy": 2}
RATE, KEEPALIVE, KEEPALIVE_RATE, REQUEST_TIMEOUT = 100.0, 4, 20.0, 2.0
WARMUP_S, SETTLE_S = 3.0, 8.0
PROXY_HEALTHZ_PORT = 10256
# drain: the Node deleted, the machine off this much later (a cloud's instance deletion
# after the API call; the autoscaler's own wait is longer).
REMOVAL_DELAY_S = 10.0
# shutdown: the kubelet's shutdownGracePeriod and shutdownGracePeriodCriticalPods.
SHUTDOWN_GRACE_S, SHUTDOWN_CRITICAL_S = 30.0, 10.0
DISRUPTIONS = ("rollout", "drain", "shutdown")
REQUEST = b"GET /hostname HTTP/1.1\r\nHost: web.lab\r\nUser-Agent: kproxy-real-nodes\r\n"


def log(msg):
    print(f"[rollout {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


def kubectl(*args, stdin=None):
    r = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"rollout.py: kubectl {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def agnhost_image(lab):
    """The tag images.sh gave agnhost (the one the e2e framework asks for)."""
    with tarfile.open(os.path.join(lab, "images", "agnhost.tar")) as t:
        return json.load(t.extractfile("manifest.json"))[0]["RepoTags"][0]


def manifests(image, replicas, pre_stop, delay_shutdown, etp="Local", spread="required"):
    # netexec's /readyz and /healthz answer 200 only once its UDP server (8081) runs.
    args = ["netexec", f"--http-port={HTTP_PORT}"]
    if delay_shutdown:
        args.append(f"--delay-shutdown={delay_shutdown}")
    labels = {"app": APP}
    return {"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": APP, "namespace": NS},
         "spec": {"type": "LoadBalancer", "externalTrafficPolicy": etp, "selector": labels,
                  "ports": [{"name": "http", "port": 80, "targetPort": HTTP_PORT}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": APP, "namespace": NS},
         "spec": {
             "replicas": replicas, "minReadySeconds": 0, "selector": {"matchLabels": labels},
             "strategy": {"type": "RollingUpdate",
                          "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
             "template": {"metadata": {"labels": labels}, "spec": {
                 "terminationGracePeriodSeconds": GRACE_S,
                 "affinity": {"podAntiAffinity": anti_affinity(spread, labels)},
                 "containers": [{
                     "name": "netexec", "image": image, "args": args,
                     "ports": [{"containerPort": HTTP_PORT}],
                     "readinessProbe": {"httpGet": {"path": "/readyz", "port": HTTP_PORT},
                                        **READINESS},
                     "lifecycle": {"preStop": {"sleep": {"seconds": int(pre_stop)}}},
                 }]}}}},
    ]}


def anti_affinity(spread, labels):
    term = {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
    if spread == "required":
        return {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    return {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}


class Clock:
    def __init__(self):
        self.t0 = time.monotonic()

    def now(self):
        return round(time.monotonic() - self.t0, 3)


class Timeline:
    """Events in seconds since the run started: the LB's view, pods, the rollout."""

    def __init__(self, clock):
        self.clock, self.events, self.lock = clock, [], threading.Lock()

    def add(self, kind, what, subject=""):
        with self.lock:
            self.events.append({"t": self.clock.now(), "kind": kind, "subject": subject, "what": what})


def healthz_passes(ip, port):
    """One health check as the load balancer sends it: GET /healthz answered 200."""
    try:
        with socket.create_connection((ip, port), timeout=GKE["timeout"]) as s:
            s.settimeout(GKE["timeout"])
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: lb\r\nUser-Agent: kproxy-lab-lb\r\n"
                      b"Connection: close\r\n\r\n")
            head = s.recv(64)
        return head.startswith((b"HTTP/1.1 200", b"HTTP/1.0 200"))
    except OSError:
        return False


class LoadBalancer(threading.Thread):
    """crates/lab/src/lb.rs's health loop: probe every node's health-check node port every
    interval (in parallel, each with the timeout), thresholds, pool = healthy or all."""

    def __init__(self, nodes, hc_port, timeline, stop):
        super().__init__(daemon=True)
        self.nodes, self.hc_port, self.timeline, self.stop = nodes, hc_port, timeline, stop
        self.healthy = {n: False for n in nodes}
        self.lock = threading.Lock()
        self.pool_now = list(nodes)
        self.fewest = len(nodes)
        self.error = None

    def probe(self, ip, out):
        out[ip] = healthz_passes(ip, self.hc_port)

    def pool(self):
        with self.lock:
            return self.pool_now

    def all_healthy(self):
        with self.lock:
            return all(self.healthy.values())

    def run(self):
        try:
            self.loop()
        except Exception as e:  # a dead LB would freeze the pool: the run must not count
            self.error = f"{type(e).__name__}: {e}"
            raise

    def loop(self):
        ok_run = {n: 0 for n in self.nodes}
        fail_run = {n: 0 for n in self.nodes}
        last = {}
        nxt = time.monotonic()
        while not self.stop.is_set():
            left = nxt - time.monotonic()
            if left > 0:
                time.sleep(min(0.01, left))
                continue
            nxt += GKE["interval"]
            res = {}
            ts = [threading.Thread(target=self.probe, args=(ip, res)) for ip in self.nodes.values()]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            with self.lock:
                for name, ip in self.nodes.items():
                    ok = res[ip]
                    if last.get(name) != ok:
                        last[name] = ok
                        self.timeline.add("health", "passes" if ok else "fails", name)
                    if ok:
                        ok_run[name], fail_run[name] = ok_run[name] + 1, 0
                        if ok_run[name] >= GKE["healthy"]:
                            self.healthy[name] = True
                    else:
                        fail_run[name], ok_run[name] = fail_run[name] + 1, 0
                        if fail_run[name] >= GKE["unhealthy"]:
                            self.healthy[name] = False
                pool = [n for n in self.nodes if self.healthy[n]] or list(self.nodes)
                if pool != self.pool_now:
                    none = not any(self.healthy.values())
                    self.timeline.add("pool", ("no healthy node: all " if none else "") + ",".join(pool))
                    self.pool_now = pool
                self.fewest = min(self.fewest, sum(self.healthy.values()))


def request(sock, deadline):
    """Sends one GET on `sock` and reads the answer: (outcome, pod, server closes)."""
    def remaining():
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout()
        return left
    sock.settimeout(remaining())
    sock.sendall(REQUEST + b"\r\n")
    buf = b""
    while b"\r\n\r\n" not in buf:
        sock.settimeout(remaining())
        chunk = sock.recv(4096)
        if not chunk:
            return "closed", None, True
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return "http_error", None, True
    headers = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        sock.settimeout(remaining())
        chunk = sock.recv(4096)
        if not chunk:
            return "closed", None, True
        body += chunk
    close = headers.get("connection", "").lower() == "close"
    outcome = "ok" if status == 200 else "http_5xx" if 500 <= status < 600 else "http_error"
    return outcome, body[:length].decode("latin-1") if status == 200 else None, close


def classify(e):
    """crates/lab/src/loadgen.rs's classify_io."""
    if isinstance(e, socket.timeout):
        return "timeout"
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, OSError) and e.errno in (113, 101):  # EHOSTUNREACH, ENETUNREACH
        return "unreachable"
    return "reset"


class Load:
    """The lab's load generator: new connections at RATE, KEEPALIVE keep-alive connections
    at KEEPALIVE_RATE each; one record per request started, in-flight ones waited for."""

    def __init__(self, lb, node_port, clock):
        self.lb, self.node_port, self.clock = lb, node_port, clock
        self.records, self.lock = [], threading.Lock()
        self.stop = threading.Event()
        self.threads = []

    def record(self, start, outcome, kind, node, pod):
        with self.lock:
            self.records.append({"start": start, "end": self.clock.now(), "outcome": outcome,
                                 "conn": kind, "node": node, "pod": pod})

    def pick(self):
        name = random.choice(self.lb.pool())
        return name, self.lb.nodes[name]

    def one_shot(self):
        start, (node, ip) = self.clock.now(), self.pick()
        deadline = time.monotonic() + REQUEST_TIMEOUT
        try:
            with socket.create_connection((ip, self.node_port), timeout=REQUEST_TIMEOUT) as s:
                outcome, pod, _ = request(s, deadline)
        except OSError as e:
            outcome, pod = classify(e), None
        self.record(start, outcome, "new", node, pod)

    def new_connections(self):
        period, nxt = 1.0 / RATE, time.monotonic()
        while not self.stop.is_set():
            nxt += period
            t = threading.Thread(target=self.one_shot, daemon=True)
            t.start()
            self.threads.append(t)
            self.threads = [t for t in self.threads if t.is_alive()]
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.monotonic()  # after a stall, keep the rate; do not burst

    def keepalive(self):
        sock, node, nxt = None, None, time.monotonic()
        while not self.stop.is_set():
            nxt += 1.0 / KEEPALIVE_RATE
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.monotonic()
            start, deadline = self.clock.now(), time.monotonic() + REQUEST_TIMEOUT
            try:
                if sock is None:
                    node, ip = self.pick()
                    sock = socket.create_connection((ip, self.node_port), timeout=REQUEST_TIMEOUT)
                outcome, pod, close = request(sock, deadline)
            except OSError as e:
                outcome, pod, close = classify(e), None, True
            self.record(start, outcome, "keep_alive", node, pod)
            if outcome != "ok" or close:
                if sock is not None:
                    sock.close()
                sock = None
        if sock is not None:
            sock.close()

    def start(self):
        # Daemon threads: a run that fails (SystemExit) must not leave the load running.
        self.loops = [threading.Thread(target=self.new_connections, daemon=True)]
        self.loops += [threading.Thread(target=self.keepalive, daemon=True) for _ in range(KEEPALIVE)]
        for t in self.loops:
            t.start()

    def finish(self):
        self.stop.set()
        for t in self.loops:
            t.join()
        for t in list(self.threads):
            t.join()
        return self.records


def bursts(records):
    """Failures closer than 1 s form a burst (docs/lab.md, "The report")."""
    out = []
    for r in sorted((r for r in records if r["outcome"] != "ok"), key=lambda r: r["start"]):
        if out and r["start"] - out[-1]["last"] < 1.0:
            b = out[-1]
        else:
            b = {"first": r["start"], "last": r["start"], "failed": 0, "kinds": {}, "nodes": {}}
            out.append(b)
        b["last"] = r["start"]
        b["failed"] += 1
        b["kinds"][r["outcome"]] = b["kinds"].get(r["outcome"], 0) + 1
        key = f"{r['node']} ({r['conn']})"
        b["nodes"][key] = b["nodes"].get(key, 0) + 1
    return out


def watch_pods(api, timeline, stop):
    """Pod transitions as the API shows them, polled every 0.25 s."""
    seen = {}
    while not stop.is_set():
        try:
            pods = api.get(f"/api/v1/namespaces/{NS}/pods")["items"]
        except OSError:
            time.sleep(0.25)
            continue
        now = {}
        for p in pods:
            name = p["metadata"]["name"]
            ready = any(c["type"] == "Ready" and c["status"] == "True"
                        for c in p.get("status", {}).get("conditions", []))
            state = (p["spec"].get("nodeName"), ready, bool(p["metadata"].get("deletionTimestamp")))
            now[name] = state
            old = seen.get(name)
            if old is None:
                timeline.add("pod", f"created on {state[0] or '(unscheduled)'}", name)
            elif old[0] != state[0]:
                timeline.add("pod", f"scheduled to {state[0]}", name)
            if (old is None and ready) or (old is not None and old[1] != ready):
                timeline.add("pod", "ready" if ready else "not ready", name)
            if state[2] and not (old and old[2]):
                timeline.add("pod", "terminating", name)
        for name in set(seen) - set(now):
            timeline.add("pod", "gone", name)
        seen = now
        time.sleep(0.25)


def wait(what, cond, timeout):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise SystemExit(f"rollout.py: timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def nodes_script(*args):
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([os.path.join(here, "nodes.sh"), *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"rollout.py: nodes.sh {' '.join(args)}: {r.stderr.strip()[-2000:]}")


def set_condition(api_node, status, timeline):
    """The Node's GracefulNodeShutdownInProgress condition, as a v1.37 kubelet writes it."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cond = {"type": "GracefulNodeShutdownInProgress", "status": status, "reason": "KpnShutdown",
            "message": "rollout.py: the kubelet's graceful node shutdown",
            "lastHeartbeatTime": now, "lastTransitionTime": now}
    kubectl("patch", "node", api_node, "--subresource=status", "--type=strategic",
            "-p", json.dumps({"status": {"conditions": [cond]}}))
    timeline.add("node", f"GracefulNodeShutdownInProgress={status}", api_node)


def sigterm_proxy(proxy, node, lab):
    """SIGTERM to the node's Service proxy: kproxy's container (through the node's
    containerd) or the kube-proxy process nodes.sh started."""
    state = os.path.join(lab, "nodes", "n" + node.removeprefix("kpn-n"))
    if proxy == "kube-proxy":
        with open(os.path.join(state, "kube-proxy.pid")) as f:
            os.kill(int(f.read()), 15)
        return
    sock = os.path.join(state, "containerd.sock")
    ids = subprocess.run(["ctr", "-a", sock, "-n", "k8s.io", "containers", "ls", "-q",
                          'labels."io.kubernetes.container.name"==kproxy'],
                         capture_output=True, text=True, check=True).stdout.split()
    for cid in ids:
        subprocess.run(["ctr", "-a", sock, "-n", "k8s.io", "tasks", "kill", "-s", "SIGTERM", cid],
                       capture_output=True, text=True)


def disrupt(kind, node, proxy, lab, timeline):
    """The disruption itself (module doc); returns when the node is gone."""
    if kind == "rollout":
        timeline.add("rollout", "kubectl rollout restart")
        kubectl("-n", NS, "rollout", "restart", f"deployment/{APP}")
        kubectl("-n", NS, "rollout", "status", f"deployment/{APP}", "--timeout=600s")
        timeline.add("rollout", "complete (rollout status)")
        return
    if kind == "drain":
        timeline.add("node", "kubectl drain", node)
        kubectl("drain", node, "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s")
        timeline.add("node", "drained", node)
        kubectl("-n", NS, "rollout", "status", f"deployment/{APP}", "--timeout=300s")
        kubectl("delete", "node", node, "--wait=false")
        timeline.add("node", "Node deleted", node)
        time.sleep(REMOVAL_DELAY_S)
    else:
        t0 = time.monotonic()
        set_condition(node, "True", timeline)
        # A shutting-down kubelet admits no new pod (and reports NotReady, whose taint keeps
        # the scheduler away): cordon stands in for both.
        kubectl("cordon", node)
        pods = kubectl("-n", NS, "get", "pods", "--field-selector", f"spec.nodeName={node}",
                       "-o", "name").split()
        for p in pods:
            kubectl("-n", NS, "delete", p, "--wait=false")
        timeline.add("node", f"workload pods deleted ({len(pods)})", node)
        time.sleep(max(0.0, SHUTDOWN_GRACE_S - SHUTDOWN_CRITICAL_S - (time.monotonic() - t0)))
        # The critical pods' turn. The kubelet is stopped first so that nothing restarts
        # the proxy's container, as the kubelet's shutdown manager would not.
        state = os.path.join(lab, "nodes", "n" + node.removeprefix("kpn-n"))
        with open(os.path.join(state, "kubelet.pid")) as f:
            os.kill(int(f.read()), 15)
        timeline.add("node", "kubelet stopped", node)
        sigterm_proxy(proxy, node, lab)
        timeline.add("node", f"{proxy} SIGTERM", node)
        time.sleep(max(0.0, SHUTDOWN_GRACE_S - (time.monotonic() - t0)))
    nodes_script("node-stop", node.removeprefix("kpn-n"))
    timeline.add("node", "machine off", node)


def restore(kind, node, api, nodes):
    """The node back (outside the count) and the Deployment spread over every node again."""
    if kind == "rollout":
        return
    nodes_script("node-start", node.removeprefix("kpn-n"))
    kubectl("uncordon", node)
    if kind == "shutdown":
        set_condition(node, "False", Timeline(Clock()))
    wait(f"{node}'s Service proxy healthy", lambda: healthz_passes(nodes[node], PROXY_HEALTHZ_PORT), 180)
    kubectl("-n", NS, "rollout", "restart", f"deployment/{APP}")
    kubectl("-n", NS, "rollout", "status", f"deployment/{APP}", "--timeout=600s")
    wait("one pod per node", lambda: pods_spread(api) == len(nodes), 120)


def pods_spread(api):
    pods = api.get(f"/api/v1/namespaces/{NS}/pods")["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return len({p["spec"].get("nodeName") for p in live})


def one_run(api, nodes, node_port, hc_port, show_timeline, kind="rollout", proxy="", lab=""):
    clock = Clock()
    timeline, stop = Timeline(clock), threading.Event()
    lb = LoadBalancer(nodes, hc_port, timeline, stop)
    watcher = threading.Thread(target=watch_pods, args=(api, timeline, stop), daemon=True)
    watcher.start()
    lb.start()
    wait("every node healthy in the load balancer", lb.all_healthy, 120)
    lb.fewest = len(nodes)
    load = Load(lb, node_port, clock)
    load.start()
    load_start = clock.now()
    time.sleep(WARMUP_S)
    rollout_start = clock.now()
    gone = list(nodes)[-1]
    disrupt(kind, gone, proxy, lab, timeline)
    rollout_end = clock.now()
    if kind == "rollout":
        wait("the load balancer's pool full again", lb.all_healthy, 120)
    time.sleep(SETTLE_S)
    records = load.finish()
    stop.set()
    lb.join()
    if lb.error:
        raise SystemExit(f"rollout.py: the load balancer stopped during the run ({lb.error})")
    failed = [r for r in records if r["outcome"] != "ok"]
    by_kind = {}
    for r in failed:
        by_kind[r["outcome"]] = by_kind.get(r["outcome"], 0) + 1
    run = {
        "sent": len(records), "ok": len(records) - len(failed), "failed": len(failed),
        "failed_by_kind": by_kind,
        "new_failed": sum(r["conn"] == "new" for r in failed),
        "keep_alive_failed": sum(r["conn"] == "keep_alive" for r in failed),
        "new": sum(r["conn"] == "new" for r in records),
        "keep_alive": sum(r["conn"] == "keep_alive" for r in records),
        "failed_before_rollout": sum(r["start"] < rollout_start for r in failed),
        "failed_during_rollout": sum(rollout_start <= r["start"] <= rollout_end for r in failed),
        "failed_after_rollout": sum(r["start"] > rollout_end for r in failed),
        "load_start_s": load_start, "rollout_start_s": rollout_start, "rollout_end_s": rollout_end,
        "fewest_nodes_in_pool": lb.fewest, "bursts": bursts(records), "failed_records": failed,
        "events": sorted(timeline.events, key=lambda e: e["t"]),
    }
    if show_timeline:
        for e in run["events"]:
            print(f"  {e['t']:8.2f}  {e['kind']:8} {e['subject']:24} {e['what']}")
    return run


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cell", choices=sorted(CELLS), default="default")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--delay-shutdown", type=int, default=0,
                   help="netexec --delay-shutdown: fail /readyz at SIGTERM, serve S s more")
    p.add_argument("--timeline", action="store_true")
    p.add_argument("--disruption", choices=DISRUPTIONS, default="rollout")
    p.add_argument("--etp", choices=("Local", "Cluster"), default="Local",
                   help="the Service's externalTrafficPolicy (Cluster: the LB checks port 10256)")
    p.add_argument("--json", help="write every run (records' summary, bursts, events) here")
    p.add_argument("--keep", action="store_true", help="leave namespace kpn-rollout behind")
    a = p.parse_args()
    lab = os.environ.get("K8S_LAB") or sys.exit("rollout.py: set K8S_LAB (the k8s-lab env.sh)")
    os.environ["KUBECONFIG"] = os.path.join(lab, "kubeconfig")
    try:
        proxy = open(os.path.join(lab, "nodes", "proxy")).read().strip()
    except OSError:
        sys.exit("rollout.py: no real nodes (nodes.sh up; nodes.sh proxy kproxy)")
    if proxy == "none":
        sys.exit("rollout.py: no Service proxy on the nodes (nodes.sh proxy kproxy|kube-proxy)")
    api = Records(*kubeconfig(os.environ["KUBECONFIG"]))
    nodes = {}
    for n in api.get("/api/v1/nodes")["items"]:
        ips = [x["address"] for x in n["status"]["addresses"] if x["type"] == "InternalIP"]
        nodes[n["metadata"]["name"]] = ips[0]
    nodes = dict(sorted(nodes.items()))
    pre_stop = CELLS[a.cell]
    profile = f"fail-readiness-on-term ({a.delay_shutdown} s)" if a.delay_shutdown else "exit-on-term"
    log(f"proxy {proxy}, nodes {nodes}, cell {a.cell} (preStop {pre_stop:g} s), pods {profile}")
    # A fresh Deployment per invocation: its pods carry this cell's preStop from the start.
    kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=true", "--timeout=120s")
    kubectl("apply", "-f", "-", stdin=json.dumps(
        manifests(agnhost_image(lab), len(nodes), pre_stop, a.delay_shutdown, a.etp,
                  "required" if a.disruption == "rollout" else "preferred")))
    kubectl("-n", NS, "rollout", "status", f"deployment/{APP}", "--timeout=300s")
    svc = api.get(f"/api/v1/namespaces/{NS}/services/{APP}")["spec"]
    node_port = svc["ports"][0]["nodePort"]
    hc_port = svc["healthCheckNodePort"] if a.etp == "Local" else PROXY_HEALTHZ_PORT
    if a.disruption != "rollout":
        wait("one pod per node", lambda: pods_spread(api) == len(nodes), 120)
    runs = []
    try:
        for i in range(1, a.runs + 1):
            log(f"run {i}/{a.runs}: NodePort {node_port}, health-check node port {hc_port}")
            r = one_run(api, nodes, node_port, hc_port, a.timeline, a.disruption, proxy, lab)
            r.update(run=i, proxy=proxy, cell=a.cell, pre_stop_s=pre_stop, profile=profile,
                     disruption=a.disruption, etp=a.etp)
            runs.append(r)
            kinds = ", ".join(f"{v} {k}" for k, v in sorted(r["failed_by_kind"].items()))
            print(f"run {i}: proxy {proxy}, {a.disruption}, eTP={a.etp}, {a.cell}, {profile}: sent {r['sent']} "
                  f"({r['new']} new, {r['keep_alive']} keep-alive), failed {r['failed']} "
                  f"({r['new_failed']} new, {r['keep_alive_failed']} keep-alive)"
                  f"{' (' + kinds + ')' if kinds else ''}; rollout {r['rollout_end_s'] - r['rollout_start_s']:.1f} s, "
                  f"fewest nodes in the pool {r['fewest_nodes_in_pool']}", flush=True)
            for b in r["bursts"]:
                print(f"  burst {b['first']:.2f}-{b['last']:.2f} s: {b['failed']} failed {b['kinds']} "
                      f"via {b['nodes']}", flush=True)
            restore(a.disruption, list(nodes)[-1], api, nodes)
    finally:
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"runs": runs, "nodes": nodes}, f, indent=1)
        if not a.keep:
            kubectl("delete", "namespace", NS, "--ignore-not-found", "--wait=false")
    total = sum(r["sent"] for r in runs)
    lost = sum(r["failed"] for r in runs)
    print(f"total: {lost} of {total} failed in {len(runs)} runs")


if __name__ == "__main__":
    main()
