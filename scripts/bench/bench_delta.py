#!/usr/bin/env python3
"""What a second snapshot with a parent costs against one without (issue 21, delta entries).

    python3 -m scripts.bench.bench_delta [--mb 256] [--dir /var/tmp] [--json OUT]

The data: a page image of MB/2 MiB of bf16 N(0, 0.02) weights followed by an MB MiB paged KV pool
with 30% of its 64 KiB blocks filled at random places; then 5% more of the pool's blocks filled (the
changed bytes). `store put --chunker pages` of the first image, then of the changed one twice into
the same store, in the same run: without a parent (removed and gc'd afterwards, so the second put
finds nothing of it) and with `--parent`. Prints, for each, the wall time, the new bytes against the
changed bytes, and the delta stages' thread-seconds (delta: XOR, scoring and encoding; delta-base:
reading and decoding the parent's bytes; compress: the plain encoding, made first for every new chunk).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from scripts.bench.bench_codecs import bf16
from scripts.helpers import REPO, child_env

BLOCK = 64 << 10


def weights(rng: np.random.Generator, n: int) -> bytes:
    return bf16(rng, n).tobytes()


def images(mb: int) -> tuple[bytes, bytes, int]:
    """(the first image, the changed one, bytes changed)."""
    rng = np.random.default_rng(5)
    w = weights(rng, (mb // 2) << 20)
    pool = bytearray(mb << 20)
    blocks = len(pool) // BLOCK
    filled = set(rng.choice(blocks, int(blocks * 0.30), replace=False).tolist())
    for b in filled:
        pool[b * BLOCK:(b + 1) * BLOCK] = weights(rng, BLOCK)
    first = w + bytes(pool)
    empty = [b for b in range(blocks) if b not in filled]
    more = rng.choice(empty, blocks // 20, replace=False)
    for b in more:
        pool[b * BLOCK:(b + 1) * BLOCK] = weights(rng, BLOCK)
    return first, w + bytes(pool), len(more) * BLOCK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="the KV pool's size in MiB (the weights: half of it)")
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    first, second, changed = images(a.mb)
    work = tempfile.mkdtemp(prefix="gpusnap-bench-delta-", dir=a.dir)
    env = child_env()
    g = [sys.executable, "-m", "cli", "--store", os.path.join(work, "store")]

    def run(*args: str) -> str:
        return subprocess.run([*g, *args], capture_output=True, text=True, check=True, cwd=REPO, env=env).stdout

    rows = []
    try:
        src = os.path.join(work, "img")
        os.mkdir(src)
        with open(os.path.join(src, "pages-1.img"), "wb") as f:
            f.write(first)
        run("store", "put", "a", src, "--chunker", "pages")
        with open(os.path.join(src, "pages-1.img"), "wb") as f:
            f.write(second)
        for label, extra in (("without a parent", ()), ("with --parent", ("--parent", "a"))):
            subprocess.run(["sync"], check=False)
            t0 = time.perf_counter()
            rep = json.loads(run("store", "put", "b", src, "--chunker", "pages", "--no-cache", "--json", *extra))
            wall = time.perf_counter() - t0
            run("store", "rm", "b")
            run("store", "gc")
            st = rep["stages"]
            row = {"put": label, "wall_s": round(wall, 3), "new_bytes": rep["new_bytes"], "changed_bytes": changed,
                   "new_over_changed": round(rep["new_bytes"] / changed, 3),
                   "thread_seconds": {k: round(v["thread_seconds"], 3) for k, v in st.items()
                                      if k in ("compress", "hash", "worker", "delta", "delta-base", "delta-search")},
                   "delta_counts_bytes": {k: v["bytes"] for k, v in st.items() if k.startswith("delta:")}}
            rows.append(row)
            print(f"{label:17s} wall {wall:6.2f} s  new {rep['new_bytes'] / 1e6:7.1f} MB "
                  f"({row['new_over_changed']:.2f}x the {changed / 1e6:.1f} MB changed)  thread-s {row['thread_seconds']}",
                  flush=True)
        print(f"with / without a parent: wall {rows[1]['wall_s'] / rows[0]['wall_s']:.2f}x, "
              f"bytes {rows[1]['new_bytes'] / max(1, rows[0]['new_bytes']):.2f}x", flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d"), "mb": a.mb, "rows": rows}, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
