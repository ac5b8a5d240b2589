#!/usr/bin/env python3
"""The emulated cloud of lab/real-nodes: a load-balancer controller and the load
balancer's data path, run inside the load balancer's own network namespace (kpn-lb, on
the path between this machine and the nodes; nodes.sh wires it).

Controller (what a cloud provider's service controller does, polled every second):
every Service of type LoadBalancer without a loadBalancerClass gets the finalizer
service.kubernetes.io/load-balancer-cleanup, an ingress IP from the pool (kept for the
Service's life, `spec.loadBalancerIP` honoured when it is in the pool and free) written
to status.loadBalancer (ipMode VIP); when the Service is deleted or changes type, the
status is cleared, the IP released and the finalizer removed. allocateLoadBalancerNodePorts
needs nothing: packets keep their destination (below), so no NodePort is used.

Data path (a GCP network load balancer, the lab's `passthrough` mode, crates/lab/src/lb.rs):
packets to ingress IP:port arrive from this machine on `uplink`; a new flow gets a conntrack
mark naming one healthy node of its Service (nftables `numgen random`), every packet of
the flow copies the mark, and `ip rule fwmark N` routes it, destination and source
unchanged, to node N, where the Service proxy handles the load-balancer IP. The nodes
route the client side back through this namespace, so conntrack sees both directions and
keeps a flow on its node while the pool changes. The client's address is never
rewritten (the ESIPP specs check it). A Service with sessionAffinity ClientIP has its
flows picked by a hash of the client's address instead (GCP's CLIENT_IP affinity), since
each node's proxy keeps its own affinity table. loadBalancerSourceRanges are left to the proxy, as
upstream expects of a passthrough load balancer: its rules see the client's address.

Health checks (the lab's gke preset: every 3 s, timeout 1 s, healthy after 1 success,
unhealthy after 2 failures; a node starts unhealthy; no healthy node: all nodes): HTTP
GET to the Service's healthCheckNodePort for externalTrafficPolicy Local, to the proxy's
/healthz on port 10256 for Cluster, 200 is healthy. One probe per (node, port) per round.

  cloud.py --kubeconfig K --pool 172.31.229.0/24 --nodes 1:kpn-n1=192.168.226.11,...

Python's standard library only; nft and ip are the system's.
"""

import argparse
import ipaddress
import json
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

FINALIZER = "service.kubernetes.io/load-balancer-cleanup"
TABLE = "kpn-cloud"
UP_IF = "uplink"


class Gke:
    """crates/lab/src/lb.rs LbPreset::Gke."""
    interval = 3.0
    timeout = 1.0
    healthy_threshold = 1
    unhealthy_threshold = 2


def log(msg):
    print(f"[cloud {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", flush=True)


class Api:
    def __init__(self, path):
        text = open(path).read()
        self.server = re.search(r"server:\s*(\S+)", text).group(1)
        ca = re.search(r"certificate-authority:\s*(\S+)", text).group(1)
        self.token = re.search(r"token:\s*(\S+)", text).group(1)
        self.ctx = ssl.create_default_context(cafile=ca)

    def call(self, method, path, body=None, ctype="application/merge-patch+json"):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Authorization": "Bearer " + self.token, "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = ctype
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, context=self.ctx, timeout=10) as r:
            return json.load(r)


class Lb:
    """What the data path and the health checker need of one Service."""

    def __init__(self, uid, name, ip, ports, local, hc_port, client_ip_affinity):
        self.uid, self.name, self.ip = uid, name, ip
        self.ports = ports  # [(proto, port)]
        self.local, self.hc_port = local, hc_port
        self.client_ip_affinity = client_ip_affinity

    def probe_port(self):
        return self.hc_port if self.local and self.hc_port else 10256

    def key(self):
        return (self.ip, tuple(self.ports), self.probe_port())


class Cloud:
    def __init__(self, api, pool, nodes, hc=Gke):
        self.api, self.hc = api, hc
        self.pool = [str(ip) for ip in ipaddress.ip_network(pool).hosts()][9:]  # .10 on
        self.nodes = nodes  # [(index, name, ip)]
        self.by_uid = {}  # uid -> ingress IP
        self.lbs = {}  # uid -> Lb
        self.lock = threading.Lock()
        # (node ip, port) -> [healthy, ok_run, fail_run]
        self.health = {}
        self.programmed = None

    # --- the controller ---
    def allocate(self, svc):
        uid = svc["metadata"]["uid"]
        if uid in self.by_uid:
            return self.by_uid[uid]
        used = set(self.by_uid.values())
        for ing in svc.get("status", {}).get("loadBalancer", {}).get("ingress") or []:
            if ing.get("ip") in self.pool and ing["ip"] not in used:
                self.by_uid[uid] = ing["ip"]
                return ing["ip"]
        want = svc["spec"].get("loadBalancerIP")
        if want in self.pool and want not in used:
            self.by_uid[uid] = want
            return want
        for ip in self.pool:
            if ip not in used:
                self.by_uid[uid] = ip
                return ip
        return None

    def reconcile(self):
        services = self.api.call("GET", "/api/v1/services")["items"]
        # Addresses already in Services' status first (a restarted controller keeps them).
        for svc in services:
            self.is_ours(svc) and self.allocate(svc)
        lbs = {}
        for svc in services:
            m, spec = svc["metadata"], svc["spec"]
            path = f"/api/v1/namespaces/{m['namespace']}/services/{m['name']}"
            fins = m.get("finalizers") or []
            if self.is_ours(svc):
                if FINALIZER not in fins:
                    self.patch_finalizers(path, m, fins + [FINALIZER])
                    log(f"{m['namespace']}/{m['name']}: finalizer added")
                ip = self.allocate(svc)
                if ip is None:
                    log(f"{m['namespace']}/{m['name']}: the pool is exhausted")
                    continue
                want = {"ingress": [{"ip": ip, "ipMode": "VIP"}]}
                if svc.get("status", {}).get("loadBalancer") != want:
                    self.api.call("PATCH", path + "/status", {"status": {"loadBalancer": want}})
                    log(f"{m['namespace']}/{m['name']}: ingress {ip}")
                ports = [(p.get("protocol", "TCP").lower(), p["port"]) for p in spec.get("ports", [])
                         if p.get("protocol", "TCP") in ("TCP", "UDP")]
                lbs[m["uid"]] = Lb(m["uid"], f"{m['namespace']}/{m['name']}", ip, ports,
                                   spec.get("externalTrafficPolicy") == "Local",
                                   spec.get("healthCheckNodePort"),
                                   spec.get("sessionAffinity") == "ClientIP")
            elif FINALIZER in fins:
                # Deleted, or no longer a LoadBalancer: the load balancer goes, then the status,
                # then the finalizer (as the cloud provider's service controller orders it).
                if svc.get("status", {}).get("loadBalancer"):
                    self.api.call("PATCH", path + "/status", {"status": {"loadBalancer": None}})
                self.patch_finalizers(path, m, [f for f in fins if f != FINALIZER])
                self.by_uid.pop(m["uid"], None)
                log(f"{m['namespace']}/{m['name']}: load balancer removed, finalizer removed")
        live = {s["metadata"]["uid"] for s in services if self.is_ours(s)}
        for uid in list(self.by_uid):
            if uid not in live:
                del self.by_uid[uid]
        with self.lock:
            self.lbs = lbs
        self.program()

    @staticmethod
    def is_ours(svc):
        return (svc["spec"].get("type") == "LoadBalancer"
                and not svc["spec"].get("loadBalancerClass")
                and not svc["metadata"].get("deletionTimestamp"))

    def patch_finalizers(self, path, meta, fins):
        # A JSON patch guarded by the resourceVersion: a concurrent change fails it and the
        # next round retries with what the API then holds.
        body = [{"op": "test", "path": "/metadata/resourceVersion", "value": meta["resourceVersion"]},
                {"op": "replace" if "finalizers" in meta else "add", "path": "/metadata/finalizers",
                 "value": fins}]
        self.api.call("PATCH", path, body, ctype="application/json-patch+json")

    # --- health ---
    def targets(self):
        with self.lock:
            ports = {lb.probe_port() for lb in self.lbs.values()}
        return [(ip, port) for _, _, ip in self.nodes for port in sorted(ports)]

    def healthy(self, ip, port):
        return self.health.get((ip, port), [False])[0]

    def probe(self, target):
        ip, port = target
        try:
            with socket.create_connection((ip, port), timeout=self.hc.timeout) as s:
                s.settimeout(self.hc.timeout)
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: lb\r\nUser-Agent: kpn-cloud\r\nConnection: close\r\n\r\n")
                head = s.recv(64)
            return head.startswith(b"HTTP/1.1 200") or head.startswith(b"HTTP/1.0 200")
        except OSError:
            return False

    def check_round(self, executor):
        targets = self.targets()
        results = list(executor.map(self.probe, targets))
        changed = False
        with self.lock:
            for t, ok in zip(targets, results):
                st = self.health.setdefault(t, [False, 0, 0])
                before = st[0]
                if ok:
                    st[1], st[2] = st[1] + 1, 0
                    if not st[0] and st[1] >= self.hc.healthy_threshold:
                        st[0] = True
                else:
                    st[1], st[2] = 0, st[2] + 1
                    if st[0] and st[2] >= self.hc.unhealthy_threshold:
                        st[0] = False
                if st[0] != before:
                    changed = True
                    log(f"health {t[0]}:{t[1]}: {'healthy' if st[0] else 'unhealthy'}")
        if changed:
            self.program()

    # --- the data path ---
    def pool_of(self, lb):
        """Node indexes new flows of `lb` go to: the healthy ones, or all when none is."""
        up = [i for i, _, ip in self.nodes if self.healthy(ip, lb.probe_port())]
        return up or [i for i, _, _ in self.nodes]

    def render(self):
        with self.lock:
            lbs = sorted(self.lbs.values(), key=lambda lb: lb.ip)
            pools = [(lb, self.pool_of(lb)) for lb in lbs]
        s = [f"table ip {TABLE}", f"delete table ip {TABLE}", f"table ip {TABLE} {{"]
        vips = sorted({lb.ip for lb in lbs})
        s.append("  set vips { type ipv4_addr; " + (f"elements = {{ {', '.join(vips)} }}; " if vips else "") + "}")
        elems = []
        for n, (lb, pool) in enumerate(pools):
            chain = f"svc{n}"
            m = ", ".join(f"{k} : {node}" for k, node in enumerate(pool))
            s.append(f"  chain {chain} {{")
            # sessionAffinity ClientIP: one node per client address, as GCP's target pool
            # with CLIENT_IP affinity (each node's proxy keeps its own affinity table).
            pick = "jhash ip saddr mod" if lb.client_ip_affinity else "numgen random mod"
            s.append(f"    ct mark 0 ct mark set {pick} {len(pool)} map {{ {m} }}")
            s.append("    meta mark set ct mark")
            s.append("  }")
            elems += [f"{lb.ip} . {proto} . {port} : jump {chain}" for proto, port in lb.ports]
        s.append("  chain pre {")
        s.append("    type filter hook prerouting priority mangle; policy accept;")
        # An established flow stays on the node it was given, whatever the pool now is.
        s.append(f'    iifname "{UP_IF}" ct mark != 0 meta mark set ct mark accept')
        if elems:
            s.append(f'    iifname "{UP_IF}" ip daddr . meta l4proto . th dport vmap {{ {", ".join(elems)} }}')
        # Nothing else reaches the nodes through an ingress IP (a port the Service lacks).
        s.append(f'    iifname "{UP_IF}" meta mark 0 ip daddr @vips drop')
        s.append("  }")
        s.append("}")
        return "\n".join(s) + "\n"

    def program(self):
        script = self.render()
        if script == self.programmed:
            return
        r = subprocess.run(["nft", "-f", "-"], input=script, text=True, capture_output=True)
        if r.returncode != 0:
            log(f"nft failed: {r.stderr.strip()}\n{script}")
            return
        self.programmed = script
        with self.lock:
            desc = "; ".join(f"{lb.name} {lb.ip} -> {','.join(f'n{i}' for i in self.pool_of(lb))}"
                             for lb in sorted(self.lbs.values(), key=lambda lb: lb.ip))
        log(f"data path: {desc or 'no load balancers'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--pool", required=True, help="ingress IPs are taken from this CIDR (.10 on)")
    ap.add_argument("--nodes", required=True, help="INDEX:NAME=IP,... (ip rule fwmark INDEX routes to IP)")
    a = ap.parse_args()
    nodes = []
    for item in a.nodes.split(","):
        idx, rest = item.split(":", 1)
        name, ip = rest.split("=", 1)
        nodes.append((int(idx), name, ip))
    cloud = Cloud(Api(a.kubeconfig), a.pool, nodes)
    cloud.program()

    def health():
        executor = ThreadPoolExecutor(max_workers=16)
        nxt = time.monotonic()
        while True:
            nxt += cloud.hc.interval
            try:
                cloud.check_round(executor)
            except Exception as e:  # noqa: BLE001 - a round's failure must not stop the checker
                log(f"health round failed: {e}")
            time.sleep(max(0.0, nxt - time.monotonic()))

    threading.Thread(target=health, daemon=True).start()
    log(f"up: pool {a.pool}, nodes {', '.join(f'{n}={ip}' for _, n, ip in nodes)}")
    while True:
        try:
            cloud.reconcile()
        except urllib.error.HTTPError as e:
            # 409, or 422 from the finalizer patch's resourceVersion test: a stale read; the
            # next round sees the new one.
            if e.code not in (409, 422):
                log(f"reconcile: {e} {e.read()[:300]!r}")
        except Exception as e:  # noqa: BLE001 - the API may be briefly away; keep going
            log(f"reconcile: {e}")
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
