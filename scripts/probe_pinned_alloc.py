#!/usr/bin/env python3
"""How fast can a resident process get N GB of pinned host memory, and is D2H into it as fast?
cuMemHostAlloc (4 KiB pages) vs an mmap advised to huge pages + cuMemHostRegister (RegisteredBuffer).
Usage: probe_pinned_alloc.py [GB]   (prints one JSON line)"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from storage.device import CudaDevice, PinnedBuffer, RegisteredBuffer, _ck, _drv  # noqa: E402

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 8
n = int(gb * (1 << 30))
dev = CudaDevice(0)
d = _drv()
src = dev.alloc(1 << 30)
dev.memset0(src, 1 << 30, 0)
out = {"gb": gb, "numa_node": dev.numa_node()}
for label, make in (("cuMemHostAlloc", lambda: PinnedBuffer(n)), ("mmap+THP+cuMemHostRegister", lambda: RegisteredBuffer(n, dev.numa_node()))):
    t0 = time.perf_counter()
    buf = make()
    t_alloc = time.perf_counter() - t0
    streams = [dev.new_stream() for _ in range(8)]
    t0 = time.perf_counter()
    for i, off in enumerate(range(0, n, 1 << 30)):
        m = min(1 << 30, n - off)
        _ck(d.cuMemcpyDtoHAsync(buf.ptr + off, src, m, streams[i % 8]), "d2h")
    for s in streams:
        dev.sync(s)
    t_d2h = time.perf_counter() - t0
    out[label] = {"alloc_s": round(t_alloc, 3), "alloc_GBps": round(n / t_alloc / 1e9, 2),
                  "d2h_GBps": round(n / t_d2h / 1e9, 1)}
    buf.close()
print(json.dumps(out))
