#!/usr/bin/env python3
"""A quick end-to-end check of the split restore on a GPU: the serving workload (--gb, default 1)
dumped through the streamer, restored with the split (runs >= $GPUSNAP_CRIU_SPLIT_MIN filled by
gpusnap after CRIU, then the driver's restore), verified by the process itself. One JSON line.
Run from the repository root: python3 -m scripts.device.split_check [GB]"""
import ctypes
import json
import os
import sys
import tempfile
import time

from scripts.bench.bench_e2e import gpusnap, kill_restored
from scripts.workloads.workload_control import Workload

gb = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # subreaper: the restored process comes back to us
store = os.path.join(tempfile.mkdtemp(prefix="gpusnap-split-", dir="/var/tmp"), "store")
out: dict = {"gb": gb}
with Workload(gb, detached=True, script="serving_workload.py", timeout=60) as w:
    t0 = time.perf_counter()
    d = gpusnap(store, "criu", "dump", str(w.pid), "s")
    out["dump"] = {"wall": time.perf_counter() - t0, "seconds": d["seconds"], "path": d["images_path"]}
    w.reap()
    t0 = time.perf_counter()
    r = gpusnap(store, "criu", "restore", "s")
    out["restore"] = {"wall": time.perf_counter() - t0, "seconds": r["seconds"], "served": r["stages"].get("served")}
    out["verify"] = w.cmd("verify")
    if os.environ.get("SPLIT_CHECK_TWICE"):  # a second restore: the store's chunks are in the page cache now
        kill_restored(w.pid)
        t0 = time.perf_counter()
        r = gpusnap(store, "criu", "restore", "s")
        out["warm_restore"] = {"wall": time.perf_counter() - t0, "seconds": r["seconds"], "served": r["stages"].get("served")}
        out["warm_verify"] = w.cmd("verify")
print(json.dumps(out))
