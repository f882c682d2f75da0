#!/usr/bin/env python3
"""CRIU through the store vs plain CRIU to a directory, same process, same disk, same run (issue 5).

A CPU process tree (tests/support/criu_workload.py) holding N MiB of known memory: plain `criu dump` into a
directory + sync, caches dropped, `criu restore`; then `gpusnap criu dump` / `gpusnap criu restore`
(store on the same disk). Both restores are checked from inside the restored process.
Usage: python3 -m scripts.bench.bench_criu [--mb 1024] [--dir /var/tmp] [--json F]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from sandbox.criu.runner import Criu
from scripts.helpers import REPO, drop_caches




class Tree:
    def __init__(self, mb: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="gpusnap-bench-tree-")
        log = open(os.path.join(self.dir, "log"), "w")
        self.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "support", "criu_workload.py"), self.dir, str(mb)],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, cwd="/")
        while not os.path.exists(os.path.join(self.dir, "ready")):
            if self.proc.poll() is not None:
                raise SystemExit(f"workload died: see {self.dir}/log")
            time.sleep(0.05)
        info = json.load(open(os.path.join(self.dir, "ready")))
        self.pid, self.child = info["pid"], info["child"]

    def ok(self) -> bool:
        rep = os.path.join(self.dir, "report.json")
        if os.path.exists(rep):
            os.unlink(rep)
        open(os.path.join(self.dir, "cmd"), "w").write("report")
        for _ in range(600):
            if os.path.exists(rep):
                r = json.load(open(rep))
                return r["memory_ok"] and r["pipe_ok"] and r["thread_ok"]
            time.sleep(0.05)
        return False

    def gone(self, timeout: float = 60) -> None:
        """Wait until the dumped pids are free again (CRIU restores the same pids)."""
        self.proc.wait()
        deadline = time.monotonic() + timeout
        while any(os.path.exists(f"/proc/{p}") for p in (self.pid, self.child)) and time.monotonic() < deadline:
            time.sleep(0.02)

    def kill(self) -> None:
        for p in (self.child, self.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.gone()


def gpusnap(store: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, "-m", "cli", "--store", store, *args, "--json"], capture_output=True,
                       text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO))
    if p.returncode:
        raise SystemExit(p.stderr)
    return json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    criu = Criu()
    work = tempfile.mkdtemp(prefix="gpusnap-bench-criu-", dir=a.dir)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cores", "mb": a.mb}
    try:
        t = Tree(a.mb)
        img = os.path.join(work, "img")
        os.mkdir(img)
        t0 = time.perf_counter()
        criu.dump(t.pid, img)
        os.sync()
        res["plain_dump"] = time.perf_counter() - t0
        res["plain_bytes"] = sum(os.path.getsize(os.path.join(img, f)) for f in os.listdir(img))
        t.gone()
        drop_caches(required=True)
        t0 = time.perf_counter()
        criu.restore(img, detach=True)
        res["plain_restore"] = time.perf_counter() - t0
        res["plain_ok"] = t.ok()
        t.kill()
        shutil.rmtree(img)
        t = Tree(a.mb)
        store = os.path.join(work, "store")
        t0 = time.perf_counter()
        d = gpusnap(store, "criu", "dump", str(t.pid), "b")
        res["gpusnap_dump"] = time.perf_counter() - t0
        res["gpusnap_dump_stages"] = d["seconds"]
        res["gpusnap_bytes"] = d["new_bytes"]
        t.gone()
        drop_caches(required=True)
        t0 = time.perf_counter()
        r = gpusnap(store, "criu", "restore", "b")
        res["gpusnap_restore"] = time.perf_counter() - t0
        res["gpusnap_restore_stages"] = r["seconds"]
        res["gpusnap_ok"] = t.ok()
        t.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{res['machine']}: process tree with {a.mb} MiB of random memory (worst case for compression)")
    print(f"plain criu   dump {res['plain_dump']:6.2f} s  restore {res['plain_restore']:6.2f} s  "
          f"{res['plain_bytes'] / 1e9:.2f} GB on disk  verified={res['plain_ok']}")
    print(f"gpusnap criu dump {res['gpusnap_dump']:6.2f} s  restore {res['gpusnap_restore']:6.2f} s  "
          f"{res['gpusnap_bytes'] / 1e9:.2f} GB on disk  verified={res['gpusnap_ok']}")
    print(f"  dump stages {res['gpusnap_dump_stages']}, restore stages {res['gpusnap_restore_stages']}")
    print(f"cycle ratio plain/gpusnap: {(res['plain_dump'] + res['plain_restore']) / (res['gpusnap_dump'] + res['gpusnap_restore']):.2f}x")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
