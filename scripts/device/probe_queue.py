"""How long a small cold read waits behind large reads already queued on the disk: the question behind
CRIU's pauses in a split restore (BENCHMARKS.md section 35), where the fill keeps READERS reads of
16 MiB in flight while CRIU opens and checks the libraries it maps (and reads what gpusnap serves).

For each count of background readers (each reading a large cold file sequentially, 16 MiB at a
time, as the fill's readers do), the page cache is dropped and SMALL files are each opened and their
first 64 KiB read, one after another, timing each; the background's own rate is reported too.
One JSON line per count, then a summary. Needs root (drop_caches). Usage:
    python3 -m scripts.device.probe_queue [--dir /var/tmp] [--gb 4] [--readers 0,1,2,4] [--files 40]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

from scripts.helpers import drop_caches

MIB = 1 << 20


def write_file(path: str, nbytes: int) -> None:
    block = os.urandom(16 * MIB)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())


def background(path: str, stop: threading.Event, offset: int, got: list[int]) -> None:
    """Sequential 16 MiB reads of PATH from OFFSET, wrapping, until STOP."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        buf = bytearray(16 * MIB)
        pos = offset
        while not stop.is_set():
            n = os.preadv(fd, [buf], pos)
            os.posix_fadvise(fd, pos, n, os.POSIX_FADV_DONTNEED)  # stays cold: every pass reads the disk
            got[0] += n
            pos = pos + n if n and pos + n < size else 0
    finally:
        os.close(fd)


def one_round(big: str, small: list[str], readers: int) -> dict:
    drop_caches(required=True)
    stop = threading.Event()
    got = [0]
    size = os.path.getsize(big)
    ts = [threading.Thread(target=background, args=(big, stop, i * size // max(1, readers), got), daemon=True)
          for i in range(readers)]
    for t in ts:
        t.start()
    time.sleep(0.5 if readers else 0)  # the queue filled
    t0 = time.perf_counter()
    lat = []
    for p in small:
        a = time.perf_counter()
        fd = os.open(p, os.O_RDONLY)
        try:
            os.pread(fd, 64 * 1024, 0)
        finally:
            os.close(fd)
        lat.append(time.perf_counter() - a)
    span = time.perf_counter() - t0
    before = got[0]
    time.sleep(0.5 if readers else 0)
    rate = (got[0] - before) / 0.5 / 1e9 if readers else 0.0
    stop.set()
    for t in ts:
        t.join()
    lat.sort()
    return {"readers": readers, "files": len(small), "median_ms": round(statistics.median(lat) * 1000, 2),
            "p90_ms": round(lat[int(0.9 * (len(lat) - 1))] * 1000, 2), "max_ms": round(lat[-1] * 1000, 2),
            "all_s": round(span, 3), "background_gbps": round(rate, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--gb", type=float, default=4, help="the large file the background readers read")
    ap.add_argument("--readers", default="0,1,2,4")
    ap.add_argument("--files", type=int, default=40, help="small files (256 KiB each) opened and read cold")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="gpusnap-queue-", dir=a.dir)
    try:
        big = os.path.join(work, "big")
        write_file(big, int(a.gb * 1e9))
        small = []
        for i in range(a.files):
            d = os.path.join(work, f"d{i}")
            os.mkdir(d)
            p = os.path.join(d, "lib.so")
            write_file(p, 256 * 1024)
            small.append(p)
        results: dict[int, list[dict]] = {}
        counts = [int(x) for x in a.readers.split(",")]
        for rnd in range(a.rounds):
            for k in (counts if rnd % 2 == 0 else counts[::-1]):
                r = one_round(big, small, k)
                results.setdefault(k, []).append(r)
                print(json.dumps({"round": rnd, **r}), flush=True)
        print(json.dumps({"summary": {k: {"median_ms": statistics.median(x["median_ms"] for x in v),
                                          "p90_ms": statistics.median(x["p90_ms"] for x in v),
                                          "background_gbps": statistics.median(x["background_gbps"] for x in v)}
                                      for k, v in results.items()}}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
