#!/usr/bin/env python3
"""The host pipeline's ingest alone (what `gpusnap criu dump` does after CRIU): a page-image-like
file on /dev/shm into a store on disk with the page chunker, per stage (thread-seconds, GB/s per
thread) and wall time, against the disk floor for the bytes stored. The file: the realistic mix in
64 MiB runs (40% bf16 N(0, 0.02), 55% zeros, 5% random), every page made distinct so nothing dedups.
--procs 0,12 compares the put's chunk work in its own threads (0) with encoder processes
(storage/pipeline/encodeprocs.py) on the same image, in the same run.
Usage: python3 -m scripts.bench.bench_ingest [--gb 24] [--workers N] [--procs 0,12] [--dir /var/tmp] [--json OUT]"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from storage.pipeline import put as pipeline
from storage.archive.filetree import FileTreeSource
from storage.repo.store import SnapshotStore


def make_image(path: str, gb: float) -> int:
    rng = np.random.default_rng(5)
    run = 64 << 20
    bf16 = (rng.normal(0, 0.02, run // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    rnd = np.frombuffer(rng.bytes(run), dtype=np.uint64).copy()
    n = int(gb * 1e9) // run
    with open(path, "wb") as f:
        for i in range(n):
            k = i % 20
            if k < 8:
                a = bf16.view(np.uint64).copy()
            elif k < 19:
                f.write(bytes(run))
                continue
            else:
                a = rnd.copy()
            a[::512] += np.uint64(i + 1)  # one word per page: no two pages equal across runs
            f.write(a.tobytes())
    return n * run


def _cpu_busy() -> float:
    """Core-seconds this machine has spent busy (user, nice, system, irq, softirq, steal) since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / hz


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=24)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--readers", default="", help="comma-separated producer counts to compare on the same image")
    ap.add_argument("--procs", default="", help="comma-separated encoder process counts to compare on the same image")
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    src_dir = tempfile.mkdtemp(prefix="gpusnap-ingest-", dir="/dev/shm")
    work = tempfile.mkdtemp(prefix="gpusnap-ingest-", dir=a.dir)
    try:
        images = os.path.join(src_dir, "images")
        os.mkdir(images)
        t0 = time.perf_counter()
        size = make_image(os.path.join(images, "pages-1.img"), a.gb)
        print(f"image: {size / 1e9:.1f} GB written to /dev/shm in {time.perf_counter() - t0:.1f} s", flush=True)
        rows = []
        counts: list[int | None] = [int(x) for x in a.readers.split(",") if x]
        pcounts: list[int | None] = [int(x) for x in a.procs.split(",") if x]
        for readers, procs in [(r, p) for r in counts or [None] for p in pcounts or [None]]:
            shutil.rmtree(os.path.join(work, "store"), ignore_errors=True)
            st = SnapshotStore(os.path.join(work, "store"))
            os.sync()
            cpu0 = _cpu_busy()
            t0 = time.perf_counter()
            with st.writer("i") as w:
                with FileTreeSource([images]) as src:
                    res = pipeline.put(w, src, chunker="pages", workers=a.workers, readers=readers, procs=procs)
                w.commit()
            wall = time.perf_counter() - t0
            busy = (_cpu_busy() - cpu0) / wall
            out = {"date": time.strftime("%Y-%m-%d"), "gb": size / 1e9, "stored_gb": res.stored_bytes / 1e9,
                   "wall_s": wall, "GBps": size / wall / 1e9, "workers": a.workers or pipeline.put_workers(),
                   "readers": readers, "procs": procs, "busy_cores": busy, "stages": res.stages.table()}
            print(json.dumps(out), flush=True)
            rows.append(out)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows if len(rows) > 1 else rows[0], f, indent=1)
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
