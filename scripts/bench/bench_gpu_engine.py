#!/usr/bin/env python3
"""Benchmark of the GPU data path (issue 4): another process's GPU memory, mapped the way custom storage
maps it (CUDA IPC stand-in), into the memory tier (a directory store on /dev/shm, and the resident
pinned pool of storage/tiers/memory.py) and a directory store on disk, and back.

Prints per stage seconds and GB/s, and each total against its floor measured in the same run:
PCIe (pinned D2H/H2D of the same bytes, same lanes) and the disk (O_DIRECT write/read of the bytes
actually stored). Usage: python3 -m scripts.bench.bench_gpu_engine [--gb 24] [--mix realistic,pessimistic] [--tiers shm,pool,disk] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from typing import Any

from scripts.helpers import drop_caches
from scripts.workloads.workload_control import Workload, ipc_region
from storage.fs.directio import AlignedBuffer, open_for_read, open_for_write, read_into, write_all
from storage.gpu.device import PinnedBuffer, check_cuda, cuda_driver
from storage.pipeline.gpu_engine import GpuEngine, Region
from storage.tiers.memory import PinnedPool
from storage.repo.store import SnapshotStore




def pcie_floor(ptr: int, size: int, lanes: int = 8, piece: int = 256 << 20) -> tuple[float, float]:
    """Seconds for pinned D2H and H2D of SIZE bytes at PTR over LANES streams (the copy floor)."""
    d = cuda_driver()
    bufs = [PinnedBuffer(piece) for _ in range(lanes)]
    scratch = [int(check_cuda(d.cuMemAlloc(piece), "cuMemAlloc")) for _ in range(lanes)]  # H2D must not touch PTR
    streams = [check_cuda(d.cuStreamCreate(1), "stream") for _ in range(lanes)]
    out = []
    for direction in ("d2h", "h2d"):
        t0 = time.perf_counter()
        for i, off in enumerate(range(0, size, piece)):
            n = min(piece, size - off)
            k = i % lanes
            if direction == "d2h":
                check_cuda(d.cuMemcpyDtoHAsync(bufs[k].ptr, ptr + off, n, streams[k]), "d2h")
            else:
                check_cuda(d.cuMemcpyHtoDAsync(scratch[k], bufs[k].ptr, n, streams[k]), "h2d")
        for s in streams:
            check_cuda(d.cuStreamSynchronize(s), "sync")
        out.append(time.perf_counter() - t0)
    for b in bufs:
        b.close()
    for p in scratch:
        d.cuMemFree(p)
    return out[0], out[1]


def disk_floor(directory: str, nbytes: int, threads: int = 8, block: int = 8 << 20) -> tuple[float, float]:
    """GB/s of O_DIRECT writes (+fsync) and cold reads of NBYTES in `threads` files, like the store does."""
    per = max(block, nbytes // threads // block * block)
    paths = [os.path.join(directory, f"floor.{i}") for i in range(threads)]
    def w(p: str) -> None:
        b = AlignedBuffer(block)
        b.view[:] = os.urandom(1024) * (block // 1024)
        fd = open_for_write(p, True)
        for off in range(0, per, block):
            write_all(fd, b.view, off)
        os.fsync(fd)
        os.close(fd)
        b.close()
    def r(p: str) -> None:
        b = AlignedBuffer(block)
        fd, _ = open_for_read(p, True)
        for off in range(0, per, block):
            read_into(fd, b.view, off)
        os.close(fd)
        b.close()
    res = []
    for fn in (w, r):
        if fn is r:
            drop_caches()
        ts = [threading.Thread(target=fn, args=(p,)) for p in paths]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        res.append(per * threads / (time.perf_counter() - t0) / 1e9)
    for p in paths:
        os.unlink(p)
    return res[0], res[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=24)
    ap.add_argument("--mix", default="realistic,pessimistic")
    ap.add_argument("--tiers", default="shm,pool,disk")
    ap.add_argument("--pool-gb", type=float, default=0.0, help="pinned pool size (default: 0.75 x the data)")
    ap.add_argument("--lanes", type=int, default=int(os.environ.get("GPUSNAP_LANES", "24")))
    ap.add_argument("--chunk-mb", type=int, default=64)
    ap.add_argument("--codec", default="nvcomp-ans")
    ap.add_argument("--disk-dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--repeat", type=int, default=1, help="memory tiers: cycles per tier (all reported)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = []
    disk_w, disk_r = disk_floor(a.disk_dir, 4 << 30) if "disk" in a.tiers else (0.0, 0.0)
    print(f"disk floor (O_DIRECT, 8 threads, 4 GiB): write {disk_w:.2f} GB/s, cold read {disk_r:.2f} GB/s")
    for mix in a.mix.split(","):
        with Workload(a.gb, mix=mix, seed=11) as w, GpuEngine(lanes=a.lanes, chunk_size=a.chunk_mb << 20,
                                                                codec=a.codec) as eng, ipc_region(w.info["ipc"]) as ptr:
            size = w.size
            d2h, h2d = pcie_floor(ptr, size)
            assert w.verify(), "workload memory changed by the floor measurement"
            print(f"\n{mix}: {size / 1e9:.1f} GB; PCIe floor D2H {d2h:.3f} s ({size / d2h / 1e9:.1f} GB/s), "
                  f"H2D {h2d:.3f} s ({size / h2d / 1e9:.1f} GB/s)")
            pool = None
            if "pool" in a.tiers:
                t0 = time.perf_counter()
                pool = PinnedPool(eng.dev.pool_memory(int((a.pool_gb or 0.75 * size / 1e9) * 1e9)))
                t_alloc = time.perf_counter() - t0
                buf = pool.buffer
                print(f"  pinned pool of {pool.capacity / 1e9:.1f} GB (huge pages advised: {getattr(buf, 'huge', None)}, "
                      f"NUMA node: {getattr(buf, 'numa_node', None)}) registered in {t_alloc:.2f} s "
                      "(once, when the resident process starts; not in the timings)")
            for tier in a.tiers.split(","):
                sdir = None
                if tier != "pool":
                    sdir = tempfile.mkdtemp(prefix="gpusnap-bench-", dir="/dev/shm" if tier == "shm" else a.disk_dir)
                try:
                    st = pool if tier == "pool" else SnapshotStore(os.path.join(sdir, "store"))
                    region = Region("gpu/0", ptr, size)
                    cycles = []
                    for rep in range(a.repeat if tier != "disk" else 1):
                        if rep and tier == "pool":
                            st.remove("b")
                        elif rep:  # a fresh store: nothing to deduplicate against
                            shutil.rmtree(os.path.join(sdir, "store"))
                            st = SnapshotStore(os.path.join(sdir, "store"))
                        t0 = time.perf_counter()
                        with st.writer("b") as wr:
                            ck = eng.checkpoint(wr, [region])
                            wr.commit()
                        t_ck = time.perf_counter() - t0
                        w.cmd("clear")
                        drop_caches()
                        t0 = time.perf_counter()
                        rs = eng.restore(st, st.load("b"), {"gpu/0": region})
                        t_rs = time.perf_counter() - t0
                        cycles.append(round(t_ck + t_rs, 4))
                    ok = w.verify()
                    extra: dict[str, Any] = {}
                    if tier == "pool":
                        st.remove("b")
                    stored = ck.stored_bytes
                    if tier == "disk":
                        floor_ck = max(d2h, stored / (disk_w * 1e9))
                        floor_rs = max(h2d, stored / (disk_r * 1e9))
                    else:
                        floor_ck, floor_rs = d2h, h2d
                    row = {"mix": mix, "tier": tier, "gb": size / 1e9, "stored_gb": stored / 1e9,
                           "ratio": size / max(stored, 1), "checkpoint_s": t_ck, "restore_s": t_rs,
                           "cycle_s": t_ck + t_rs, "floor_checkpoint_s": floor_ck, "floor_restore_s": floor_rs,
                           "x_floor": (t_ck + t_rs) / (floor_ck + floor_rs), "verified": ok,
                           "stages_checkpoint": ck.stages.table(), "stages_restore": rs.stages.table(),
                           "lanes": a.lanes, "chunk_mb": a.chunk_mb, "codec": a.codec, "cycles_s": cycles, **extra}
                    rows.append(row)
                    print(f"  {tier:5} stored {stored / 1e9:6.2f} GB ({row['ratio']:.2f}x)  checkpoint {t_ck:6.3f} s "
                          f"({size / t_ck / 1e9:6.1f} GB/s)  restore {t_rs:6.3f} s ({size / t_rs / 1e9:6.1f} GB/s)  "
                          f"cycle {t_ck + t_rs:6.3f} s = {row['x_floor']:.2f}x floor {floor_ck + floor_rs:.3f} s  "
                          f"verified={ok}" + (f"  all cycles {cycles}" if len(cycles) > 1 else ""))
                    for label, stages in (("ckpt", ck.stages.table()), ("rest", rs.stages.table())):
                        print("        " + label + ": " + ", ".join(
                            f"{k} {v['thread_seconds']:.2f} thr-s {v['GBps_per_thread']:.1f} GB/s/thr"
                            for k, v in stages.items()))
                finally:
                    if sdir:
                        shutil.rmtree(sdir, ignore_errors=True)
            if pool is not None:
                pool.close()
    result = {"date": time.strftime("%Y-%m-%d"), "disk_write_GBps": disk_w, "disk_read_GBps": disk_r, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
