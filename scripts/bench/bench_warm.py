#!/usr/bin/env python3
"""Which way of holding a warm snapshot's packs in host memory reads back fastest (issue 56, part 3).

Three candidates, each holding the same pack-sized files (--mb in all), then read back the way a restore
reads a pack (storage/repo/readstage.py: pread of 16 MiB runs into an aligned buffer), in a fresh process:
  page-cache  the pack files where they are, mmap'ed and mlock'ed by a holder process (locked page cache)
  tmpfs       a copy on a tmpfs (/dev/shm)
  tmpfs-huge  a copy on a private tmpfs mounted huge=always (transparent huge pages)
  hugetlbfs   a copy on a hugetlbfs mount (written through mmap: hugetlbfs has no write(2)); needs
              vm.nr_hugepages for the copy: set for the run and put back as it was
For each: the time to make warm and the read rate (best of --repeat). Needs root (mlock, mount).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time

RUN = 16 << 20
PACK = 128 << 20


def read_rate(paths: list[str], repeat: int) -> float:
    """GB/s of pread(RUN) over PATHS in a child process (its own page tables, as a restore has)."""
    code = ("import mmap,os,sys,time\nbuf=mmap.mmap(-1,%d)\nmv=memoryview(buf)\nt=time.perf_counter();n=0\n"
            "for p in sys.argv[1:]:\n fd=os.open(p,os.O_RDONLY)\n off=0\n while True:\n"
            "  k=os.preadv(fd,[mv],off)\n  if k<=0: break\n  off+=k;n+=k\n os.close(fd)\n"
            "print(n/(time.perf_counter()-t)/1e9)\n") % RUN
    best = 0.0
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, check=True)
        best = max(best, float(out.stdout))
    return best


def make_packs(d: str, mb: int) -> list[str]:
    paths = []
    left = mb << 20
    i = 0
    while left > 0:
        n = min(PACK, left)
        p = os.path.join(d, f"pack{i}")
        with open(p, "wb") as f:
            for _ in range(0, n, RUN):
                f.write(os.urandom(min(RUN, n)))
            os.fsync(f.fileno())
        paths.append(p)
        left -= n
        i += 1
    return paths


def drop_cache(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--dir", default=None, help="where the packs are (a disk; default a temp dir in /var/tmp)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench-warm-", dir=args.dir or "/var/tmp")
    shm = tempfile.mkdtemp(prefix="bench-warm-", dir="/dev/shm")
    huge = tempfile.mkdtemp(prefix="bench-warm-huge-")
    out: dict[str, dict[str, float]] = {}
    holder = None
    nr_before = open("/proc/sys/vm/nr_hugepages").read().strip()
    mounted = False
    try:
        packs = make_packs(base, args.mb)
        drop_cache(packs)
        out["disk-cold"] = {"warm_s": 0.0, "read_gbps": read_rate(packs, 1)}
        # locked page cache: a holder maps and mlocks every pack (MAP_POPULATE reads them in)
        t = time.perf_counter()
        code = ("import mmap,os,sys\nms=[]\nfor p in sys.argv[1:]:\n fd=os.open(p,os.O_RDONLY)\n"
                " m=mmap.mmap(fd,0,prot=mmap.PROT_READ,flags=mmap.MAP_SHARED|getattr(mmap,'MAP_POPULATE',0))\n"
                " os.close(fd)\n ms.append(m)\nimport ctypes\nlibc=ctypes.CDLL(None,use_errno=True)\n"
                "assert libc.mlockall(1)==0, ctypes.get_errno()\nprint('locked',flush=True)\nsys.stdin.read()\n")
        holder = subprocess.Popen([sys.executable, "-c", code, *packs], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        out["page-cache-mlock"] = {"warm_s": time.perf_counter() - t, "read_gbps": read_rate(packs, args.repeat)}
        holder.communicate("", timeout=30)
        holder = None
        drop_cache(packs)
        # tmpfs copy
        t = time.perf_counter()
        copies = [shutil.copyfile(p, os.path.join(shm, os.path.basename(p))) for p in packs]
        out["tmpfs"] = {"warm_s": time.perf_counter() - t, "read_gbps": read_rate(copies, args.repeat)}
        for c in copies:
            os.unlink(c)
        drop_cache(packs)
        # a private tmpfs with transparent huge pages (huge=always): no pages to reserve beforehand
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,huge=always", "none", huge], check=True)
        try:
            t = time.perf_counter()
            copies = [shutil.copyfile(p, os.path.join(huge, os.path.basename(p))) for p in packs]
            out["tmpfs-huge"] = {"warm_s": time.perf_counter() - t, "read_gbps": read_rate(copies, args.repeat)}
        finally:
            subprocess.run(["umount", huge], check=False)
        drop_cache(packs)
        # hugetlbfs copy (2 MiB pages), written through mmap
        need = (args.mb << 20) // (2 << 20) + 8
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(str(int(nr_before) + need))
        got = int(open("/proc/sys/vm/nr_hugepages").read())
        if got >= int(nr_before) + need:
            subprocess.run(["mount", "-t", "hugetlbfs", "-o", "mode=0700,pagesize=2M", "none", huge], check=True)
            mounted = True
            t = time.perf_counter()
            hcopies = []
            for p in packs:
                n = os.path.getsize(p)
                h = os.path.join(huge, os.path.basename(p))
                fd = os.open(h, os.O_RDWR | os.O_CREAT, 0o600)
                os.ftruncate(fd, n)
                m = mmap.mmap(fd, n)
                with open(p, "rb") as src:
                    src.readinto(memoryview(m))  # type: ignore[arg-type]
                m.close()
                os.close(fd)
                hcopies.append(h)
            out["hugetlbfs"] = {"warm_s": time.perf_counter() - t, "read_gbps": read_rate(hcopies, args.repeat)}
        else:
            out["hugetlbfs"] = {"warm_s": -1.0, "read_gbps": -1.0}  # the kernel found no free huge pages
    finally:
        if holder is not None:
            holder.kill()
        if mounted:
            subprocess.run(["umount", huge], check=False)
        with open("/proc/sys/vm/nr_hugepages", "w") as f:
            f.write(nr_before)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(huge, ignore_errors=True)
    for k, v in out.items():
        print(f"{k:18s} warm {v['warm_s']:6.2f} s   read {v['read_gbps']:6.2f} GB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mb": args.mb, "results": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
