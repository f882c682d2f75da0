#!/usr/bin/env python3
"""Does the kernel's pipe-size limit bound CRIU's page dump? A CPU process holding N GB (bf16-like
weights: incompressible enough to be real work, no zeros) dumped with --leave-running, alternating
/proc/sys/fs/pipe-max-size between the kernel's default (1 MiB) and 64 MiB, in rounds:
- plain `criu dump` into a tmpfs directory (CRIU alone: its page pipes are grown to PIPE_MAX_SIZE,
  ~3.2 MiB, only where pipe-max-size or CAP_SYS_RESOURCE allows);
- `gpusnap criu dump --leave-running` into a store on the disk (CRIU's pages streamed into gpusnap's
  pipeline through a pipe gpusnap grows to $GPUSNAP_DUMP_PIPE, with the same limit): at its default
  (16 MiB) and, under the 64 MiB limit, at 64 MiB too ("gpusnap-64").
The limit is put back as it was at the end. Prints one JSON line per dump, then a summary line.
Usage: python3 -m scripts.device.probe_pipes [--gb 8] [--rounds 3] [--dir /var/tmp]"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from sandbox.criu.protocol import cap_sys_resource
from sandbox.criu.runner import Criu

SYSCTL = "/proc/sys/fs/pipe-max-size"
HOG = r"""
import os, sys, time
import numpy as np
n = int(float(sys.argv[1]) * (1 << 30)) // 2
rng = np.random.default_rng(7)
block = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float32).view(np.uint32) >> 16
block = block.astype(np.uint16)
a = np.empty(n, dtype=np.uint16)
for i in range(0, n, block.size):
    a[i:i + block.size] = block[: n - i] ^ np.uint16(i // block.size)
open(sys.argv[2], "w").write("ready")
time.sleep(1e6)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    before = open(SYSCTL).read().strip()
    work = tempfile.mkdtemp(prefix="gpusnap-pipes-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="gpusnap-pipes-", dir="/dev/shm")
    ready = os.path.join(work, "ready")
    criu = Criu()
    times: dict[str, list[float]] = {}
    print(json.dumps({"pipe_max_size_before": int(before), "cap_sys_resource": cap_sys_resource(),
                      "criu": criu.binary}), flush=True)
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(a.gb), ready], start_new_session=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while not os.path.exists(ready):
            if hog.poll() is not None or time.time() - t0 > 300:
                raise SystemExit("the memory-holding process did not start")
            time.sleep(0.2)
        for rnd in range(a.rounds):
            sizes = (1 << 20, 64 << 20) if rnd % 2 == 0 else (64 << 20, 1 << 20)
            for size in sizes:
                with open(SYSCTL, "w") as f:
                    f.write(str(size))
                # gpusnap's own pipe at its default (16 MiB) and, where the limit allows more, at 64 MiB
                for tool in ("criu", "gpusnap") if size == 1 << 20 else ("criu", "gpusnap", "gpusnap-64"):
                    target = os.path.join(shm if tool == "criu" else work, f"{tool}-{rnd}-{size}")
                    t1 = time.perf_counter()
                    if tool == "criu":
                        os.mkdir(target)
                        r = subprocess.run([criu.binary, "dump", "-t", str(hog.pid), "-D", target, "--leave-running",
                                            "--shell-job", "-o", "dump.log"], capture_output=True, text=True)
                    else:
                        env = {**os.environ, **({"GPUSNAP_DUMP_PIPE": str(64 << 20)} if tool == "gpusnap-64" else {})}
                        r = subprocess.run([sys.executable, "-m", "cli", "--store", target, "criu", "dump",
                                            "--leave-running", str(hog.pid), "p"], capture_output=True, text=True, env=env)
                    s = time.perf_counter() - t1
                    key = f"{tool} pipe-max {size >> 20} MiB"
                    times.setdefault(key, []).append(s)
                    print(json.dumps({"round": rnd, "tool": tool, "pipe_max_size": size, "seconds": round(s, 3),
                                      "gbps": round(a.gb * (1 << 30) / s / 1e9, 2), "rc": r.returncode,
                                      "err": r.stderr[-300:] if r.returncode else ""}), flush=True)
                    shutil.rmtree(target, ignore_errors=True)
        print(json.dumps({"summary": {k: {"median_s": round(statistics.median(v), 3), "all": [round(x, 2) for x in v]}
                                      for k, v in times.items()}, "gb": a.gb}), flush=True)
    finally:
        with open(SYSCTL, "w") as f:
            f.write(before)
        os.killpg(hog.pid, 9)
        hog.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
