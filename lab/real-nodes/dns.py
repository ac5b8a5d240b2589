#!/usr/bin/env python3
"""A stand-in for cluster DNS on the real nodes: answers A and AAAA queries for
<service>.<namespace>.svc.cluster.local (the cluster IP; a headless Service's ready
endpoint addresses; an ExternalName Service's CNAME, followed when the target is a
Service) and <a-b-c-d>.<namespace>.pod.cluster.local, from the API server, polled every
second. Everything else is NXDOMAIN.

Why: many of upstream's Service e2e tests reach a Service by name (`affinity-nodeport:80`),
and no CoreDNS image can be pulled here. Unlike CoreDNS it runs outside the cluster (on the
host's end of the nodes' network, 192.168.226.1:53, the kubelets' clusterDNS), so DNS
answers do not themselves go through the Service proxy under test; the connections to the
names they resolve do.

  dns.py --listen 192.168.226.1 --kubeconfig $K8S_LAB/kubeconfig

Python's standard library only (the query format is RFC 1035's; the answers need nothing
more than A, AAAA and CNAME records). A dual-stack Service has both: A for its IPv4
cluster IP, AAAA for its IPv6 one (dual-stack nodes, nodes.sh FAMILIES=dual|dual-ipv6).
"""

import argparse
import json
import re
import socket
import ssl
import struct
import threading
import time
import urllib.request

DOMAIN = "cluster.local"


def kubeconfig(path):
    text = open(path).read()
    server = re.search(r"server:\s*(\S+)", text).group(1)
    ca = re.search(r"certificate-authority:\s*(\S+)", text).group(1)
    token = re.search(r"token:\s*(\S+)", text).group(1)
    return server, ca, token


class Records:
    def __init__(self, server, ca, token):
        self.server, self.token = server, token
        self.ctx = ssl.create_default_context(cafile=ca)
        self.names = {}
        self.cnames = {}
        self.lock = threading.Lock()

    def get(self, path):
        req = urllib.request.Request(self.server + path,
                                     headers={"Authorization": "Bearer " + self.token})
        with urllib.request.urlopen(req, context=self.ctx, timeout=5) as r:
            return json.load(r)

    def refresh(self):
        names, cnames = {}, {}
        headless = {}
        for s in self.get("/api/v1/services")["items"]:
            m, spec = s["metadata"], s["spec"]
            name = f"{m['name']}.{m['namespace']}.svc.{DOMAIN}"
            if spec.get("type") == "ExternalName" and spec.get("externalName"):
                cnames[name] = spec["externalName"].rstrip(".").lower()
                continue
            ips = [ip for ip in spec.get("clusterIPs", []) if ip != "None"]
            if ips:
                names[name] = ips
            elif spec.get("clusterIP") == "None":
                headless[(m["namespace"], m["name"])] = name
        for sl in self.get("/apis/discovery.k8s.io/v1/endpointslices")["items"]:
            m = sl["metadata"]
            svc = m.get("labels", {}).get("kubernetes.io/service-name")
            key = (m["namespace"], svc)
            if key not in headless or sl.get("addressType") not in ("IPv4", "IPv6"):
                continue
            for ep in sl.get("endpoints") or []:
                if ep.get("conditions", {}).get("ready", True):
                    names.setdefault(headless[key], []).extend(ep["addresses"])
        with self.lock:
            self.names, self.cnames = names, cnames

    def lookup(self, qname):
        qname = qname.rstrip(".").lower()
        m = re.fullmatch(r"(\d+)-(\d+)-(\d+)-(\d+)\.[^.]+\.pod\." + re.escape(DOMAIN), qname)
        if m:
            return [".".join(m.groups())]
        with self.lock:
            if qname in self.cnames:
                target = self.cnames[qname]
                return ("cname", target, self.names.get(target, []))
            return self.names.get(qname)


def address_records(owner, qtype, ips):
    """The A (qtype 1) or AAAA (28) records of IPS for the question's type (ANY: both)."""
    out, n = b"", 0
    for ip in ips:
        family, rtype = (socket.AF_INET6, 28) if ":" in ip else (socket.AF_INET, 1)
        if qtype not in (rtype, 255):
            continue
        rdata = socket.inet_pton(family, ip)
        out += owner + struct.pack("!HHLH", rtype, 1, 5, len(rdata)) + rdata
        n += 1
    return out, n


def answer(query, records):
    if len(query) < 12:
        return None
    qid, _flags, qd = struct.unpack("!HHH", query[:6])
    if qd != 1:
        return None
    labels, i = [], 12
    while i < len(query) and query[i]:
        n = query[i]
        labels.append(query[i + 1:i + 1 + n].decode(errors="replace"))
        i += 1 + n
    qend = i + 5
    if qend > len(query):
        return None
    qtype, _qclass = struct.unpack("!HH", query[i + 1:qend])
    question = query[12:qend]
    ips = records.lookup(".".join(labels))
    if ips is None:
        return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question  # NXDOMAIN
    answers = b""
    if isinstance(ips, tuple):  # ExternalName: the CNAME, then the target's A records
        _, target, ips = ips
        rdata = b"".join(bytes([len(x)]) + x.encode() for x in target.split(".")) + b"\0"
        answers += struct.pack("!HHHLH", 0xC00C, 5, 1, 5, len(rdata)) + rdata
        # Owner name written out (no compression pointer to the CNAME target).
        addresses, n = address_records(rdata, qtype, ips)
        return struct.pack("!HHHHHH", qid, 0x8180, 1, 1 + n, 0, 0) + question + answers + addresses
    answers, n = address_records(struct.pack("!H", 0xC00C), qtype, ips)
    return struct.pack("!HHHHHH", qid, 0x8180, 1, n, 0, 0) + question + answers


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--listen", required=True)
    p.add_argument("--kubeconfig", required=True)
    a = p.parse_args()
    records = Records(*kubeconfig(a.kubeconfig))

    def poll():
        while True:
            try:
                records.refresh()
            except Exception as e:  # the API server restarting: keep the last answers
                print(f"dns: refresh failed: {e}", flush=True)
            time.sleep(1)

    threading.Thread(target=poll, daemon=True).start()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((a.listen, 53))
    print(f"dns: serving {DOMAIN} on {a.listen}:53", flush=True)
    while True:
        query, peer = sock.recvfrom(512)
        reply = answer(query, records)
        if reply:
            sock.sendto(reply, peer)


if __name__ == "__main__":
    main()
