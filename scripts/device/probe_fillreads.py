"""Why the split fill reads below the disk's rate (BENCHMARKS.md section 37: 1.5-1.8 GB/s where four plain
readers of one file read 1.7-2.1): the fill's I/O pattern taken apart, with no decoding and no CRIU.

A set of cold files like a store's packs (PACK_MIB each) is read whole, four ways, each after the page
cache is dropped, each with READERS threads taking contiguous shares in order (as the fill's workers
take theirs):
- plain:     one descriptor per reader, 16 MiB preadv after preadv (what the disk floor measures);
- per-run:   a fresh descriptor for every 16 MiB run (open, read, close: what readstage does);
- willneed:  per-run, plus a thread per reader asking POSIX_FADV_WILLNEED in STEP bytes up to AHEAD
             bytes past that reader (the fill's read-ahead once CRIU is done);
- willneed-big: the same with the device's read-ahead size as the step;
- dealt-*: the same ways with the runs dealt round-robin to the readers (one process's readers
  taking runs from one list) instead of contiguous shares (one worker process each).
One JSON line per way (GB/s), a plain read between every two ways (a disk's rate drifts: on the dev
VM the first plain read 3.3-3.6 GB/s and the last 1.8-2.1), then each way's ratio to the mean of the
plain reads on either side of it. Needs root (drop_caches). Usage:
    python3 -m scripts.device.probe_fillreads [--dir /var/tmp] [--gb 4] [--readers 4] [--pack-mib 256]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

from scripts.helpers import drop_caches

MIB = 1 << 20
RUN = 16 * MIB


def write_packs(d: str, gb: float, pack: int) -> list[str]:
    block = os.urandom(RUN)
    paths: list[str] = []
    left = int(gb * (1 << 30))
    while left > 0:
        p = os.path.join(d, f"pack-{len(paths):04d}")
        with open(p, "wb") as f:
            n = min(pack, left)
            for off in range(0, n, RUN):
                f.write(block[:min(RUN, n - off)])
            f.flush()
            os.fsync(f.fileno())
        paths.append(p)
        left -= n
    return paths


def runs_of(paths: list[str]) -> list[tuple[str, int, int]]:
    out = []
    for p in paths:
        size = os.path.getsize(p)
        out += [(p, off, min(RUN, size - off)) for off in range(0, size, RUN)]
    return out


def device_ra_bytes(path: str) -> int:
    """The read-ahead size of the block device holding PATH (read_ahead_kb; a partition's is its
    disk's), else 128 KiB."""
    st = os.stat(path)
    dev = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    for q in (f"{dev}/queue/read_ahead_kb", f"{dev}/../queue/read_ahead_kb"):
        try:
            with open(q) as f:
                return int(f.read()) * 1024 or 128 * 1024
        except (OSError, ValueError):
            continue
    return 128 * 1024


def read_share(share: list[tuple[str, int, int]], how: str, step: int, ahead: int) -> int:
    buf = bytearray(RUN)
    got = 0
    taken = [0]
    stop = threading.Event()
    lock = threading.Condition()

    def advise() -> None:
        asked = 0
        fds: dict[str, int] = {}
        try:
            for p, off, n in share:
                with lock:
                    lock.wait_for(lambda: stop.is_set() or asked - taken[0] < ahead)
                if stop.is_set():
                    return
                fd = fds.get(p)
                if fd is None:
                    fd = fds[p] = os.open(p, os.O_RDONLY)
                for o in range(off, off + n, step):
                    os.posix_fadvise(fd, o, min(step, off + n - o), os.POSIX_FADV_WILLNEED)
                asked += n
        finally:
            for fd in fds.values():
                os.close(fd)

    t = threading.Thread(target=advise, daemon=True) if how.startswith("willneed") else None
    if t is not None:
        t.start()
    held: dict[str, int] = {}
    try:
        for p, off, n in share:
            if how == "plain":
                fd = held.get(p)
                if fd is None:
                    fd = held[p] = os.open(p, os.O_RDONLY)
                got += os.preadv(fd, [memoryview(buf)[:n]], off)
            else:
                fd = os.open(p, os.O_RDONLY)
                try:
                    got += os.preadv(fd, [memoryview(buf)[:n]], off)
                finally:
                    os.close(fd)
            with lock:
                taken[0] += n
                lock.notify_all()
    finally:
        stop.set()
        with lock:
            lock.notify_all()
        if t is not None:
            t.join()
        for fd in held.values():
            os.close(fd)
    return got


def one_way(runs: list[tuple[str, int, int]], readers: int, how: str, step: int, ahead: int) -> dict:
    way = how
    drop_caches(required=True)
    per = -(-len(runs) // readers)
    shares = [runs[i * per:(i + 1) * per] for i in range(readers)]
    if how.startswith("dealt-"):  # the runs dealt round-robin (as one process's readers take them from one list)
        shares = [runs[i::readers] for i in range(readers)]
        how = how.removeprefix("dealt-")
    got = [0] * readers

    def go(i: int) -> None:
        got[i] = read_share(shares[i], how, step, ahead)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=go, args=(i,)) for i in range(readers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    s = time.perf_counter() - t0
    return {"way": way, "step": step if how.startswith("willneed") else None, "gbps": sum(got) / s / 1e9,
            "seconds": s, "bytes": sum(got)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--gb", type=float, default=4)
    ap.add_argument("--readers", type=int, default=4)
    ap.add_argument("--pack-mib", type=int, default=256)
    ap.add_argument("--ahead-mib", type=int, default=1024, help="WILLNEED at most this far past each reader")
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="gpusnap-fillreads-", dir=a.dir)
    try:
        paths = write_packs(d, a.gb, a.pack_mib * MIB)
        runs = runs_of(paths)
        ra = device_ra_bytes(paths[0])
        ways = (("per-run", 0), ("willneed", 128 * 1024), ("willneed-big", ra), ("dealt-plain", 0),
                ("dealt-per-run", 0), ("dealt-willneed", 128 * 1024))
        plains = [one_way(runs, a.readers, "plain", 0, 0)]  # between every two ways: a disk's rate drifts
        print(json.dumps(plains[-1]), flush=True)
        ratios = {}
        for how, step in ways:
            r = one_way(runs, a.readers, how, step, a.ahead_mib * MIB)
            print(json.dumps(r), flush=True)
            plains.append(one_way(runs, a.readers, "plain", 0, 0))
            print(json.dumps(plains[-1]), flush=True)
            name = f"{how}{'' if r['step'] is None else '@' + str(r['step'])}"
            ratios[name] = round(r["gbps"] / ((plains[-2]["gbps"] + plains[-1]["gbps"]) / 2), 3)
        print(json.dumps({"summary": ratios, "plain_gbps": [round(p["gbps"], 3) for p in plains],
                          "read_ahead_bytes": ra}))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
