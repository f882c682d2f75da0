#!/usr/bin/env python3
"""Probe two I/O choices of the host path on this machine (root): how cold pack-like files read fastest
(buffered with a fresh fd per 16 MiB run, as the read stage does; O_DIRECT; WILLNEED ahead of the
readers; 4 or 8 readers), and how fast one thread drains a pipe that another fills with splice (CRIU's
dump), by pipe size and read block, alone and beside 16 busy compressing threads.
Usage: python3 -m scripts.device.probe_hostio [--dir /var/tmp] [--gb 3]"""
from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

RUN = 16 << 20
PACK = 128 << 20


def drop() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def reads(files: list[str], mode: str, readers: int) -> float:
    runs = [(f, o) for f in files for o in range(0, PACK, RUN)]
    drop()
    it, lock = iter(runs), threading.Lock()
    if mode == "willneed":
        def ahead() -> None:
            for f, o in runs:
                fd = os.open(f, os.O_RDONLY)
                os.posix_fadvise(fd, o, RUN, os.POSIX_FADV_WILLNEED)
                os.close(fd)
        threading.Thread(target=ahead, daemon=True).start()

    def rd() -> None:
        buf = mmap.mmap(-1, RUN)
        while True:
            with lock:
                r = next(it, None)
            if r is None:
                buf.close()
                return
            fd = os.open(r[0], os.O_RDONLY | (os.O_DIRECT if mode == "direct" else 0))
            os.preadv(fd, [buf], r[1])
            os.close(fd)
    t = time.perf_counter()
    with ThreadPoolExecutor(readers) as ex:
        for f in [ex.submit(rd) for _ in range(readers)]:
            f.result()
    return len(runs) * RUN / (time.perf_counter() - t) / 1e9


def pipe_rate(src: str, pipe_size: int, block: int, busy: int) -> float:
    stop = threading.Event()

    def spin() -> None:
        import zstandard
        data = os.urandom(1 << 20) * 4
        c = zstandard.ZstdCompressor(level=1)
        while not stop.is_set():
            c.compress(data)
    spinners = [threading.Thread(target=spin, daemon=True) for _ in range(busy)]
    for s in spinners:
        s.start()
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, 1031, pipe_size)  # F_SETPIPE_SZ
    except OSError:
        pass
    size = os.path.getsize(src)

    def push() -> None:
        fd = os.open(src, os.O_RDONLY)
        while os.splice(fd, w, 1 << 20):
            pass
        os.close(fd)
        os.close(w)
    th = threading.Thread(target=push, daemon=True)
    buf = mmap.mmap(-1, block)
    view = memoryview(buf)
    got = 0
    t = time.perf_counter()
    th.start()
    while True:
        n = os.readv(r, [view])
        if n == 0:
            break
        got += n
    dt = time.perf_counter() - t
    th.join()
    os.close(r)
    view.release()
    buf.close()
    stop.set()
    for s in spinners:
        s.join()
    assert got == size
    return size / dt / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--gb", type=float, default=3)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="gpusnap-hostio-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="gpusnap-hostio-", dir="/dev/shm")
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reads_GBps": {}, "pipe_GBps": {}}
    try:
        block = os.urandom(RUN)
        files = []
        for i in range(max(1, int(a.gb * 1e9) // PACK)):
            p = os.path.join(work, f"p{i}")
            with open(p, "wb") as f:
                for _ in range(PACK // RUN):
                    f.write(block)
            files.append(p)
        for mode, readers in (("buffered", 4), ("buffered", 8), ("direct", 4), ("direct", 8), ("willneed", 4)):
            out["reads_GBps"][f"{mode}-{readers}"] = round(reads(files, mode, readers), 3)
            print(json.dumps(out["reads_GBps"]), flush=True)
        src = os.path.join(shm, "img")
        with open(src, "wb") as f:
            for _ in range(2 << 30 >> 24):
                f.write(block)
        for ps, blk, busy in ((1 << 20, 16 << 20, 0), (16 << 20, 16 << 20, 0), (16 << 20, 64 << 20, 0),
                              (1 << 20, 16 << 20, 16), (16 << 20, 64 << 20, 16)):
            key = f"pipe{ps >> 20}M-read{blk >> 20}M-busy{busy}"
            out["pipe_GBps"][key] = round(pipe_rate(src, ps, blk, busy), 3)
            print(json.dumps(out["pipe_GBps"]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
