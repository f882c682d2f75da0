#!/usr/bin/env python3
"""How fast can a resident process get N GB of pinned host memory, and is D2H into it as fast?
cuMemHostAlloc (4 KiB pages) vs an mmap advised to huge pages + cuMemHostRegister (RegisteredBuffer).
Usage: python3 -m scripts.device.probe_pinned_alloc [GB]   (prints one JSON line)"""
import json
import sys
import time

from storage.gpu.device import CudaDevice, PinnedBuffer, RegisteredBuffer, check_cuda, cuda_driver

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 8
n = int(gb * (1 << 30))
dev = CudaDevice(0)
d = cuda_driver()
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
        check_cuda(d.cuMemcpyDtoHAsync(buf.ptr + off, src, m, streams[i % 8]), "d2h")
    for s in streams:
        dev.sync(s)
    t_d2h = time.perf_counter() - t0
    out[label] = {"alloc_s": round(t_alloc, 3), "alloc_GBps": round(n / t_alloc / 1e9, 2),
                  "d2h_GBps": round(n / t_d2h / 1e9, 1)}
    buf.close()
print(json.dumps(out))
