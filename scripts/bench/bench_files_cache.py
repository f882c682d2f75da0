#!/usr/bin/env python3
"""Files-cache benchmark (issue 25 item 8): the wall time of an identical third `gpusnap store put` of
the same tree, with the files cache (the default) and without it (`--no-cache`: every file read and
hashed again, as every put did before the cache), in one run on the same disk; restic and borg on the
same tree where installed (`scripts/bench/bench_startup.py --setup` installs them).

Data: FILES files of random bytes (MB in all) plus SMALL small files. The page cache is dropped
before each timed put (root), so a put that reads the files reads them from the disk.
Usage: python3 -m scripts.bench.bench_files_cache [--mb 1024] [--files 64] [--small 2000] [--dir /var/tmp] [--json F]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

from scripts.helpers import child_env, drop_caches, report_json


def run(argv: list[str], env: dict[str, str] | None = None) -> float:
    drop_caches()
    t0 = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env or child_env())
    return time.perf_counter() - t0


def make_tree(root: str, mb: int, files: int, small: int) -> None:
    os.makedirs(os.path.join(root, "small"))
    per = (mb << 20) // files
    for i in range(files):
        with open(os.path.join(root, f"big{i:03}.bin"), "wb") as f:
            f.write(os.urandom(per))
    for i in range(small):
        with open(os.path.join(root, "small", f"s{i:05}.txt"), "wb") as f:
            f.write(os.urandom(512 + i % 4096))
    old = time.time_ns() - 3_600 * 10**9  # older than the cache's racy window
    for d, _, names in os.walk(root):
        for n in names:
            os.utime(os.path.join(d, n), ns=(old, old))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--small", type=int, default=2000)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    top = tempfile.mkdtemp(prefix="gpusnap-bench-fc-", dir=a.dir)
    out: dict[str, object] = {"mb": a.mb, "files": a.files, "small": a.small}
    try:
        tree = os.path.join(top, "tree")
        make_tree(tree, a.mb, a.files, a.small)
        gs = [sys.executable, "-m", "cli"]
        for label, extra in (("cache", []), ("no_cache", ["--no-cache"])):
            store = os.path.join(top, f"store-{label}")
            times = [run([*gs, "--store", store, "store", "put", f"s{i}", tree, *extra]) for i in range(3)]
            out[f"gpusnap_{label}"] = [round(t, 3) for t in times]
        if shutil.which("restic"):
            repo = os.path.join(top, "restic")
            env = {**os.environ, "RESTIC_PASSWORD": "bench"}
            subprocess.run(["restic", "init", "-q", "-r", repo], check=True, env=env, stdout=subprocess.DEVNULL)
            out["restic"] = [round(run(["restic", "-q", "-r", repo, "backup", tree], env), 3) for _ in range(3)]
        if shutil.which("borg"):
            repo = os.path.join(top, "borg")
            env = {**os.environ, "BORG_PASSPHRASE": "", "BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK": "yes"}
            subprocess.run(["borg", "init", "-e", "none", repo], check=True, env=env)
            out["borg"] = [round(run(["borg", "create", f"{repo}::a{i}", tree], env), 3) for i in range(3)]
    finally:
        shutil.rmtree(top, ignore_errors=True)
    report_json(out, a.json)


if __name__ == "__main__":
    main()
