#!/usr/bin/env python3
"""Builds a single-layer container image as a `docker save` archive, from files on this
machine, for `ctr images import`: the real nodes pull nothing, so every image they run
(pause, agnhost, busybox, kproxy) is assembled here from local binaries.

Python's standard library only: the archive format is a tar of the layer, its config and a
manifest.json naming the image, which every containerd since 1.3 imports, and no image
builder (docker, buildah) is needed on the machine.

  mkimage.py --tag registry.k8s.io/pause:3.10.2 --out pause.tar \
      --copy bin-nodes/pause:/pause --entrypoint '["/pause"]'

--bin PATH copies an executable to the same path in the image with the shared libraries
`ldd` names (so a Debian binary runs in the image as it runs here); the image has a
merged /usr (bin, sbin, lib, lib64 link into usr/) like Debian's, so one copy serves
both spellings of a library's path.
"""

import argparse
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile

MERGED = ("bin", "sbin", "lib", "lib64")


def image_path(path):
    """The path in the image for a path on this machine: /lib/x → /usr/lib/x (merged /usr)."""
    parts = path.lstrip("/").split("/")
    if parts[0] in MERGED:
        parts = ["usr"] + parts
    return "/".join(parts)


def shared_libraries(binary):
    """The libraries (and loader) `ldd` resolves for a dynamic binary; none for a static one."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True)
    if out.returncode != 0:
        return []  # "not a dynamic executable"
    libs = []
    for line in out.stdout.splitlines():
        m = re.search(r"(/\S+)\s+\(0x", line)
        if m:
            libs.append(m.group(1))
        if "not found" in line:
            sys.exit(f"mkimage: {binary}: {line.strip()}")
    return libs


class Layer:
    def __init__(self):
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)
        self.seen = set()

    def _parents(self, path):
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            self.dir("/".join(parts[:i]))

    def _add(self, path, content=None, **attrs):
        """One entry (its parent directories first), once: the first writer of a path wins."""
        path = path.strip("/")
        if not path or path in self.seen:
            return
        self.seen.add(path)
        self._parents(path)
        info = tarfile.TarInfo(path)
        for k, v in attrs.items():
            setattr(info, k, v)
        if content is not None:
            info.size = len(content)
        self.tar.addfile(info, io.BytesIO(content) if content is not None else None)

    def dir(self, path, mode=0o755):
        self._add(path, type=tarfile.DIRTYPE, mode=mode)

    def link(self, path, target):
        self._add(path, type=tarfile.SYMTYPE, linkname=target)

    def data(self, path, content, mode=0o644):
        self._add(path, content, mode=mode)

    def file(self, src, dst):
        with open(src, "rb") as f:
            content = f.read()
        self.data(dst, content, os.stat(src).st_mode & 0o7777)

    def close(self):
        self.tar.close()
        return self.buf.getvalue()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tag", action="append", required=True, help="name:tag (repeatable)")
    p.add_argument("--out", required=True)
    p.add_argument("--merged-usr", action="store_true", help="bin, sbin, lib, lib64 → usr/")
    p.add_argument("--bin", action="append", default=[], help="PATH[:DST] executable with its libraries")
    p.add_argument("--copy", action="append", default=[], help="SRC:DST")
    p.add_argument("--link", action="append", default=[], help="PATH:TARGET (symlink)")
    p.add_argument("--dir", action="append", default=[], help="DIR[:MODE octal]")
    p.add_argument("--text", action="append", default=[], help="DST:CONTENT")
    p.add_argument("--entrypoint", default="null", help="JSON list")
    p.add_argument("--cmd", default="null", help="JSON list")
    p.add_argument("--env", action="append", default=[])
    a = p.parse_args()

    layer = Layer()
    if a.merged_usr or a.bin:
        for d in MERGED:
            layer.dir("usr/" + d)
            layer.link(d, "usr/" + d)
    for spec in a.dir:
        path, _, mode = spec.partition(":")
        layer.dir(path, int(mode, 8) if mode else 0o755)
    for spec in a.bin:
        b, _, dst = spec.partition(":")
        for lib in shared_libraries(b):
            layer.file(os.path.realpath(lib), image_path(lib))
        layer.file(os.path.realpath(b), dst or image_path(b))
    for spec in a.copy:
        src, _, dst = spec.partition(":")
        layer.file(src, dst)
    for spec in a.link:
        path, _, target = spec.partition(":")
        layer.link(path, target)
    for spec in a.text:
        path, _, content = spec.partition(":")
        layer.data(path, content.encode().decode("unicode_escape").encode())
    blob = layer.close()
    diff_id = "sha256:" + hashlib.sha256(blob).hexdigest()
    env = a.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": json.loads(a.entrypoint), "Cmd": json.loads(a.cmd),
                   "Env": env, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }, sort_keys=True).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": a.tag,
                            "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(a.out, "w") as out:
        for name, content in (("layer.tar", blob), (config_name, config),
                              ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            out.addfile(info, io.BytesIO(content))
    print(f"mkimage: {a.out}: {', '.join(a.tag)} ({len(blob) >> 20} MiB layer)")


if __name__ == "__main__":
    main()
