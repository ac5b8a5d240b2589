#!/usr/bin/env python3
"""Traffic through Service addresses while something changes, every failure counted.

  load.py --target 10.96.0.10:80 --target 192.168.226.12:30080 --stop-file F [--json]

Per target, two kinds of traffic until the stop file exists:
- new connections: one TCP connection per HTTP GET /hostname, back to back (a refused,
  reset, timed-out or empty answer is a failed new connection);
- established: KEEP connections opened at the start, each sending GET /hostname with
  keep-alive every 100 ms (a connection that errors is broken, counted once, and replaced
  so that later breaks are seen too).
Each failure is also listed (up to 100 per target: when it started, UTC with ms, how long
it took, what failed) so that it can be matched to the proxy's log and the kernel's events.
Run inside a node's network namespace (`ip netns exec kpn-n1 load.py ...`): the traffic
stays in the lab's namespaces. Prints one JSON object with the counts per target.
"""

import argparse
import http.client
import json
import os
import socket
import threading
import time


def record(out, kind, started, err, sport=None):
    """One failure, kept with its time and client port (the first 100 per target), so
    that it can be found in the nodes' conntrack events."""
    name = type(err).__name__
    out["errors"][name] = out["errors"].get(name, 0) + 1
    if len(out["failures"]) < 100:
        ms = int(started * 1000) % 1000
        out["failures"].append({
            "at": time.strftime("%H:%M:%S", time.gmtime(started)) + f".{ms:03d}",
            "took_s": round(time.time() - started, 3),
            "kind": kind,
            "sport": sport,
            "error": f"{name}: {err}",
        })


def connected(host, port):
    """An HTTPConnection on a socket bound first, so its client port is known even when
    the connect fails: (connection, client port)."""
    c = http.client.HTTPConnection(host, port, timeout=2)
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(2)
    s.bind(("", 0))
    sport = s.getsockname()[1]
    try:
        s.connect((host, port))
    except OSError as e:
        s.close()
        e.sport = sport
        raise
    c.sock = s
    return c, sport


def new_connections(host, port, stop, out):
    while not os.path.exists(stop):
        started = time.time()
        sport = None
        try:
            c, sport = connected(host, port)
            c.request("GET", "/hostname", headers={"Connection": "close"})
            r = c.getresponse()
            body = r.read()
            c.close()
            ok = r.status == 200 and body
            if not ok:
                record(out, "new", started, http.client.HTTPException(f"status {r.status}, {len(body)} bytes"), sport)
        except (OSError, http.client.HTTPException) as e:
            ok = False
            record(out, "new", started, e, getattr(e, "sport", sport))
        out["new_ok" if ok else "new_failed"] += 1
        if not ok:
            time.sleep(0.05)


def established(host, port, stop, out):
    c = None
    while not os.path.exists(stop):
        started = time.time()
        try:
            if c is None:
                c = http.client.HTTPConnection(host, port, timeout=2)
                c.connect()
            c.request("GET", "/hostname")
            r = c.getresponse()
            r.read()
            if r.status != 200:
                raise http.client.HTTPException(f"status {r.status}")
            out["est_requests"] += 1
        except (OSError, http.client.HTTPException) as e:
            if c is not None and c.sock is not None:
                out["est_broken"] += 1
                record(out, "established", started, e)
            elif c is not None:
                out["est_broken"] += 1
            c = None
        time.sleep(0.1)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", action="append", required=True, help="HOST:PORT")
    p.add_argument("--stop-file", required=True)
    p.add_argument("--keep", type=int, default=4, help="established connections per target")
    a = p.parse_args()
    results, threads = {}, []
    for t in a.target:
        host, _, port = t.rpartition(":")
        out = {"new_ok": 0, "new_failed": 0, "est_requests": 0, "est_broken": 0, "errors": {},
               "failures": []}
        results[t] = out
        threads.append(threading.Thread(target=new_connections, args=(host, int(port), a.stop_file, out)))
        for _ in range(a.keep):
            threads.append(threading.Thread(target=established, args=(host, int(port), a.stop_file, out)))
    t0 = time.time()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    print(json.dumps({"seconds": round(time.time() - t0, 1), "targets": results}, sort_keys=True))


if __name__ == "__main__":
    main()
