#!/usr/bin/env python3
"""docs/e2e.md's side-by-side table from the junit reports of two e2e.sh runs.

  e2e-table.py DIR_KUBE_PROXY DIR_KPROXY > table.md
  e2e-table.py DIR_A+DIR_B DIR_KPROXY      runs of one proxy merged, a later run's result
                                           for a spec replacing an earlier one's

Lists every spec the runs' --ginkgo.focus selects (from run.txt): passed, failed (with the
first line of its failure), or skipped (with the reason: the spec's own e2eskipper message,
or the --ginkgo.skip pattern that excluded it). Ginkgo reports specs left out by the
focus as skipped with no message; they are not listed.
"""

import re
import sys
import xml.etree.ElementTree as ET


def run_info(d):
    info = {}
    with open(f"{d}/run.txt") as f:
        for line in f:
            k, _, v = line.rstrip("\n").partition("=")
            info[k] = v
    return info


def results(d):
    info = run_info(d)
    focus, skip = re.compile(info["focus"]), re.compile(info["skip"])
    out = {}
    for path in sorted(__import__("glob").glob(f"{d}/junit*.xml")):
        for tc in ET.parse(path).getroot().iter("testcase"):
            name = re.sub(r"^\[It\]\s*", "", tc.get("name", ""))
            if not name.startswith("[sig-") or not focus.search(name):
                continue
            secs = float(tc.get("time", "0") or 0)
            fail = tc.find("failure")
            if fail is None:
                fail = tc.find("error")
            skipped = tc.find("skipped")
            if fail is not None:
                msg = (fail.get("message") or fail.text or "").strip().splitlines()
                out[name] = ("failed", msg[0][:160] if msg else "", secs)
            elif skipped is not None:
                msg = (skipped.get("message") or "").strip()
                if skip.search(name):
                    msg = "excluded by --ginkgo.skip: " + skip.search(name).group(0)
                elif msg in ("", "skipped"):
                    continue  # not selected
                out[name] = ("skipped", re.sub(r"^skipped - ", "", msg).splitlines()[0][:160], secs)
            else:
                out[name] = ("passed", "", secs)
    return info, out


def merged(dirs):
    info, out = None, {}
    for d in dirs.split("+"):
        i, r = results(d)
        info = info or i
        out.update(r)
    return info, out


def cell(r):
    if r is None:
        return "not run"
    return {"passed": "passed", "failed": "**failed**", "skipped": "skipped"}[r[0]]


def main():
    (ia, a), (ib, b) = merged(sys.argv[1]), merged(sys.argv[2])
    names = sorted(set(a) | set(b))
    count = lambda r, s: sum(1 for v in r.values() if v[0] == s)
    print(f"| | {ia['proxy']} | {ib['proxy']} |\n|---|---|---|")
    for s in ("passed", "failed", "skipped"):
        print(f"| {s} | {count(a, s)} | {count(b, s)} |")
    print()
    print(f"| Test | {ia['proxy']} | {ib['proxy']} | Note |\n|---|---|---|---|")
    for n in names:
        ra, rb = a.get(n), b.get(n)
        notes = []
        for label, r in ((ia["proxy"], ra), (ib["proxy"], rb)):
            if r and r[0] != "passed" and r[1]:
                notes.append(f"{label}: {r[1]}")
        if ra and rb and ra[0] == rb[0] == "skipped" and ra[1] == rb[1]:
            notes = [ra[1]]
        note = "; ".join(notes).replace("|", "\\|")
        t = lambda r: "" if not r or r[0] == "skipped" else f" ({r[2]:.0f} s)"
        print(f"| {n.replace('|', chr(92) + '|')} | {cell(ra)}{t(ra)} | {cell(rb)}{t(rb)} | {note} |")


if __name__ == "__main__":
    main()
