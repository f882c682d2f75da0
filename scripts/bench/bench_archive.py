#!/usr/bin/env python3
"""gpusnap as an archive against restic and borg (issue 60), in one run on the same data and disk.

Steps, each timed per tool (wall time of the command) with the bytes the repository grew by:
  first   the first backup of a tree of mixed files (random, zeros, bf16-like weights, text, small files)
  change  a backup after a 5% scattered change: small writes at random places in 5% of the big files'
          bytes, 5% of the small files edited, a few new files (gpusnap: a plain `store put`, which
          chooses its parent itself, as restic does)
  same    an identical re-backup (unchanged files are skipped through each tool's files cache)
  restore the last backup restored into a new directory
  check   a full check that reads every stored byte (gpusnap `store verify`, `restic check
          --read-data`, `borg check --verify-data`)
The ratios printed are gpusnap's time / the other's (below 1: gpusnap faster) and gpusnap's new bytes /
the other's for `change`. restic and borg run with their defaults (restic: repository v2, compression
auto; borg: lz4, no encryption); tools that are not installed are left out (Debian: apt-get install
restic borgbackup). The page cache is not dropped (--drop-caches drops it before each step, as root).

--tools gpusnap,gpusnap-noparent adds gpusnap with every put told --no-parent (what the parent costs).
Usage: python3 -m scripts.bench.bench_archive [--mb 256] [--dir /var/tmp] [--tools gpusnap,restic,borg]
       [--drop-caches] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from scripts.helpers import child_env, drop_caches, report_json

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("first", "change", "same", "restore", "check")


def make_tree(root: str, mb: int, seed: int = 1) -> None:
    """MB of mixed files under ROOT: big files of four kinds, and 1000 small text files."""
    import numpy as np
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "small"))
    big = (mb << 20) * 9 // 10
    kinds = ("random", "zeros", "weights", "text")
    per = big // 16
    for i in range(16):
        kind = kinds[i % 4]
        if kind == "random":
            data = rng.bytes(per)
        elif kind == "zeros":
            data = bytes(per)
        elif kind == "weights":
            w = rng.normal(0, 0.02, per // 2).astype(np.float32)
            data = (w.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        else:
            words = [b"alpha", b"beta", b"gamma", b"delta", b"layer", b"tensor", b"\n"]
            data = b" ".join(words[j] for j in rng.integers(0, len(words), per // 5))[:per]
        with open(os.path.join(root, f"{kind}-{i:02}.bin"), "wb") as f:
            f.write(data)
    small = (mb << 20) // 10
    for i in range(1000):
        with open(os.path.join(root, "small", f"s{i:04}.txt"), "wb") as f:
            f.write(rng.bytes(small // 1000 // 2).hex().encode()[: small // 1000])
    old = time.time() - 3600  # older than any files cache's window for racy mtimes
    for d, _, files in os.walk(root):
        for n in files:
            os.utime(os.path.join(d, n), (old, old))


def change_tree(root: str, seed: int = 2) -> int:
    """A 5% scattered change; returns the bytes written."""
    rnd = random.Random(seed)
    written = 0
    bigs = sorted(n for n in os.listdir(root) if n.endswith(".bin"))
    total = sum(os.path.getsize(os.path.join(root, n)) for n in bigs)
    want = total // 20
    while written < want:
        n = rnd.choice(bigs)
        p = os.path.join(root, n)
        size = os.path.getsize(p)
        length = rnd.choice((4096, 16384, 65536))
        with open(p, "r+b") as f:
            f.seek(rnd.randrange(0, max(1, size - length)))
            f.write(os.urandom(length))
        written += length
    smalls = sorted(os.listdir(os.path.join(root, "small")))
    for n in rnd.sample(smalls, len(smalls) // 20):
        with open(os.path.join(root, "small", n), "ab") as f:
            f.write(b"edited\n")
            written += 7
    for i in range(5):
        with open(os.path.join(root, f"new-{i}.bin"), "wb") as f:
            f.write(os.urandom(1 << 20))
            written += 1 << 20
    return written


def du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for n in files:
            try:
                total += os.lstat(os.path.join(d, n)).st_blocks * 512
            except OSError:
                pass
    return total


class Tool:
    name = ""

    def __init__(self, work: str, src: str) -> None:
        self.work, self.src = work, src
        self.repo = os.path.join(work, f"repo-{self.name}")
        self.env = child_env()

    def run(self, *argv: str) -> None:
        p = subprocess.run(list(argv), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env, cwd=REPO)
        if p.returncode != 0:
            raise SystemExit(f"{self.name}: {' '.join(argv)} exited {p.returncode}: {p.stderr.decode()[-2000:]}")

    def init(self) -> None: ...
    def backup(self, n: int) -> None: ...
    def restore(self, n: int, dest: str) -> None: ...
    def check(self) -> None: ...


class Gpusnap(Tool):
    name = "gpusnap"

    def _g(self, *a: str) -> None:
        self.run(sys.executable, "-m", "cli", "--store", self.repo, *a)

    def init(self) -> None:
        self._g("store", "init")

    def backup(self, n: int) -> None:
        self._g("store", "put", f"b{n}", self.src)

    def restore(self, n: int, dest: str) -> None:
        self._g("store", "get", f"b{n}", dest)

    def check(self) -> None:
        self._g("store", "verify")


class GpusnapNoParent(Gpusnap):
    """gpusnap with every put told --no-parent: what the automatic parent costs or saves."""
    name = "gpusnap-noparent"

    def backup(self, n: int) -> None:
        self._g("store", "put", f"b{n}", self.src, "--no-parent")


class Restic(Tool):
    name = "restic"

    def init(self) -> None:
        self.env = {**self.env, "RESTIC_PASSWORD": "bench", "RESTIC_REPOSITORY": self.repo,
                    "RESTIC_CACHE_DIR": os.path.join(self.work, "restic-cache")}
        self.run("restic", "init")

    def backup(self, n: int) -> None:
        self.run("restic", "backup", "--tag", f"b{n}", self.src)

    def restore(self, n: int, dest: str) -> None:
        self.run("restic", "restore", "latest", "--target", dest)

    def check(self) -> None:
        self.run("restic", "check", "--read-data")


class Borg(Tool):
    name = "borg"

    def init(self) -> None:
        self.env = {**self.env, "BORG_BASE_DIR": os.path.join(self.work, "borg-base"),
                    "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes"}
        self.run("borg", "init", "-e", "none", self.repo)

    def backup(self, n: int) -> None:
        self.run("borg", "create", f"{self.repo}::b{n}", self.src)

    def restore(self, n: int, dest: str) -> None:
        os.makedirs(dest)
        p = subprocess.run(["borg", "extract", f"{self.repo}::b{n}"], cwd=dest, env=self.env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if p.returncode != 0:
            raise SystemExit(f"borg extract exited {p.returncode}: {p.stderr.decode()[-2000:]}")

    def check(self) -> None:
        self.run("borg", "check", "--verify-data", self.repo)


TOOLS = {"gpusnap": Gpusnap, "gpusnap-noparent": GpusnapNoParent, "restic": Restic, "borg": Borg}


def bench(work: str, mb: int, names: list[str], drop: bool) -> dict[str, Any]:
    src = os.path.join(work, "data")
    make_tree(src, mb)
    tools: list[Tool] = [TOOLS[n](work, src) for n in names]
    out: dict[str, Any] = {n: {} for n in names}

    def timed(t: Tool, step: str, fn: Any, *args: Any) -> None:
        if drop:
            drop_caches()
        before = du(t.repo)
        t0 = time.perf_counter()
        fn(*args)
        out[t.name][step] = {"s": round(time.perf_counter() - t0, 3), "new_bytes": du(t.repo) - before}
    for t in tools:
        t.init()
        timed(t, "first", t.backup, 1)
    out["changed_bytes"] = change_tree(src)
    for t in tools:
        timed(t, "change", t.backup, 2)
    for t in tools:
        timed(t, "same", t.backup, 3)
    for t in tools:
        timed(t, "restore", t.restore, 3, os.path.join(work, f"restored-{t.name}"))
        shutil.rmtree(os.path.join(work, f"restored-{t.name}"))
    for t in tools:
        timed(t, "check", t.check)
    return out


def table(res: dict[str, Any], names: list[str]) -> str:
    others = [n for n in names if n != "gpusnap"]
    head = f"{'step':8}" + "".join(f"{' ' + n + ' s':>19}" for n in names) + "".join(f"{' vs ' + o:>19}" for o in others)
    lines = [head]
    for step in STEPS:
        row = f"{step:8}" + "".join(f"{res[n][step]['s']:>19.2f}" for n in names)
        if "gpusnap" in names:
            row += "".join(f"{res['gpusnap'][step]['s'] / max(res[o][step]['s'], 1e-9):>19.2f}" for o in others)
        lines.append(row)
    mbs = "".join(f"{res[n]['change']['new_bytes'] / 1e6:>19.1f}" for n in names)
    ratio = ("".join(f"{res['gpusnap']['change']['new_bytes'] / max(res[o]['change']['new_bytes'], 1):>19.2f}"
                     for o in others) if "gpusnap" in names else "")
    lines.append(f"{'MB new':8}{mbs}{ratio}   (after the change of {res['changed_bytes'] / 1e6:.1f} MB)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="size of the tree (default 256)")
    ap.add_argument("--dir", default="/var/tmp", help="where the tree and repositories go (a real disk)")
    ap.add_argument("--tools", default="gpusnap,restic,borg")
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each step (root)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    names = [n for n in a.tools.split(",") if n.startswith("gpusnap") or shutil.which(n)]
    for n in set(a.tools.split(",")) - set(names):
        print(f"note: {n} is not installed; left out", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="gpusnap-bench-archive-", dir=a.dir)
    try:
        res = bench(work, a.mb, names, a.drop_caches)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(res, names))
    if a.json:
        report_json({"mb": a.mb, "tools": names, "results": res}, a.json)


if __name__ == "__main__":
    main()
