#!/usr/bin/env python3
"""Does the kernel's pipe-size limit bound CRIU's page dump? A CPU process holding N GB (bf16-like
weights: incompressible enough to be real work, no zeros) dumped with --leave-running, alternating
/proc/sys/fs/pipe-max-size between the kernel's default (1 MiB) and 64 MiB, in rounds:
- plain `criu dump` into a tmpfs directory (CRIU alone: its page pipes are grown to PIPE_MAX_SIZE,
  ~3.2 MiB, only where pipe-max-size or CAP_SYS_RESOURCE allows);
- `gpusnap criu dump --leave-running` into a store on the disk (CRIU's pages streamed into gpusnap's
  pipeline through a pipe gpusnap grows to $GPUSNAP_DUMP_PIPE, with the same limit): with 16 MiB asked
  ("gpusnap-16") and, under the 64 MiB limit, with 64 MiB asked too ("gpusnap-64"; under 1 MiB both get 1 MiB).
Then (--restore-rounds, default as many as --rounds) the process is dumped for good into the store and
restored by `gpusnap criu restore` under each limit in turn (the restore's pipes to CRIU are grown the
same way; the store's files stay in the page cache, so this times CRIU's side, not the disk), the
restored process killed after each.
The limit is put back as it was at the end. Prints one JSON line per dump or restore, then a summary line.
Usage: python3 -m scripts.device.probe_pipes [--gb 8] [--rounds 3] [--restore-rounds N] [--tools criu,gpusnap-16,gpusnap-64]
       [--dir /var/tmp]"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from sandbox.criu.protocol import cap_sys_resource
from sandbox.criu.runner import Criu

SYSCTL = "/proc/sys/fs/pipe-max-size"
GPUSNAP_PIPES = {"gpusnap-16": 16 << 20, "gpusnap-64": 64 << 20}  # gpusnap dumps, by the GPUSNAP_DUMP_PIPE each runs with
SETTLE_S = 3  # a pause after each restored process is killed; on the dev VM restores still swung 1.9-4.1 s with it
#              (it hands freed memory back to its hypervisor): compare the limits over many rounds
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
    ap.add_argument("--restore-rounds", type=int, default=None)
    ap.add_argument("--tools", default="criu,gpusnap-16,gpusnap-64", help="which dumps to time, comma-separated")
    ap.add_argument("--dir", default="/var/tmp")
    a = ap.parse_args()
    restore_rounds = a.rounds if a.restore_rounds is None else a.restore_rounds
    tools = a.tools.split(",")
    if not set(tools) <= {"criu", *GPUSNAP_PIPES}:
        raise SystemExit(f"--tools: unknown {a.tools!r} (criu, {', '.join(GPUSNAP_PIPES)})")
    # SIGTERM (a timeout, a kill) ends the run through the finally below, which puts the limit back
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    before = open(SYSCTL).read().strip()
    work = tempfile.mkdtemp(prefix="gpusnap-pipes-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="gpusnap-pipes-", dir="/dev/shm")
    ready = os.path.join(work, "ready")
    criu = Criu()
    times: dict[str, list[float]] = {}
    print(json.dumps({"pipe_max_size_before": int(before), "cap_sys_resource": cap_sys_resource(),
                      "criu": criu.binary}), flush=True)
    hog = subprocess.Popen([sys.executable, "-c", HOG, str(a.gb), ready], start_new_session=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.time()
        while not os.path.exists(ready):
            if hog.poll() is not None or time.time() - t0 > 300:
                raise SystemExit("the memory-holding process did not start")
            time.sleep(0.2)
        # the first dump of a process is slower whatever the limit (seen: 7.3-7.8 s against ~3 s after, at
        # 4 GB on a 2-core VM): one warm-up dump, not counted
        warm = os.path.join(shm, "warm-up")
        os.mkdir(warm)
        _criu_dump(criu, hog.pid, warm)
        shutil.rmtree(warm, ignore_errors=True)
        for rnd in range(a.rounds):
            sizes = (1 << 20, 64 << 20) if rnd % 2 == 0 else (64 << 20, 1 << 20)
            for size in sizes:
                with open(SYSCTL, "w") as f:
                    f.write(str(size))
                # gpusnap's own pipe at its default (16 MiB) and, where the limit allows more, at 64 MiB
                for tool in [t for t in tools if size > 1 << 20 or t != "gpusnap-64"]:
                    target = os.path.join(shm if tool == "criu" else work, f"{tool}-{rnd}-{size}")
                    t1 = time.perf_counter()
                    if tool == "criu":
                        os.mkdir(target)
                        r = _criu_dump(criu, hog.pid, target)
                    else:
                        env = {**os.environ, "GPUSNAP_DUMP_PIPE": str(GPUSNAP_PIPES[tool])}
                        r = subprocess.run([sys.executable, "-m", "cli", "--store", target, "criu", "dump",
                                            "--leave-running", str(hog.pid), "p"], capture_output=True, text=True, env=env)
                    s = time.perf_counter() - t1
                    key = f"{tool} pipe-max {size >> 20} MiB"
                    times.setdefault(key, []).append(s)
                    print(json.dumps({"round": rnd, "tool": tool, "pipe_max_size": size, "seconds": round(s, 3),
                                      "gbps": round(a.gb * (1 << 30) / s / 1e9, 2), "rc": r.returncode,
                                      "err": r.stderr[-300:] if r.returncode else ""}), flush=True)
                    shutil.rmtree(target, ignore_errors=True)
        if restore_rounds:
            _restores(hog, work, restore_rounds, a.gb, times)
        print(json.dumps({"summary": {k: {"median_s": round(statistics.median(v), 3), "all": [round(x, 2) for x in v]}
                                      for k, v in times.items()}, "gb": a.gb}), flush=True)
    finally:
        with open(SYSCTL, "w") as f:
            f.write(before)
        _kill(hog.pid)
        hog.poll()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def _criu_dump(criu: Criu, pid: int, target: str) -> subprocess.CompletedProcess[str]:
    """Plain `criu dump --leave-running` of PID into the directory TARGET."""
    return subprocess.run([criu.binary, "dump", "-t", str(pid), "-D", target, "--leave-running", "--shell-job",
                           "-o", "dump.log"], capture_output=True, text=True)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _gone(pid: int, timeout: float = 30) -> None:
    t0 = time.time()
    while os.path.exists(f"/proc/{pid}") and time.time() - t0 < timeout:
        try:  # a zombie of ours (the first, Popen'd process) is reaped; a restored one is reaped by its parent
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)


def _restores(hog: subprocess.Popen[bytes], work: str, rounds: int, gb: float, times: dict[str, list[float]]) -> None:
    """Dump HOG for good into a store under WORK, then restore it under a 1 and a 64 MiB limit in turn."""
    store = os.path.join(work, "restore-store")
    r = subprocess.run([sys.executable, "-m", "cli", "--store", store, "criu", "dump", str(hog.pid), "r"],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"the dump for the restores failed: {r.stderr[-300:]}")
    hog.wait()
    for rnd in range(rounds):
        for size in (1 << 20, 64 << 20) if rnd % 2 == 0 else (64 << 20, 1 << 20):
            with open(SYSCTL, "w") as f:
                f.write(str(size))
            t1 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "cli", "--store", store, "criu", "restore", "r", "--json"],
                               capture_output=True, text=True)
            s = time.perf_counter() - t1
            stages = {}
            if r.returncode == 0:
                st = json.loads(r.stdout)["stages"].get("served", {}).get("stages", {})
                stages = {k: st[k]["thread_seconds"] for k in ("deliver", "decompress+verify") if k in st}
            times.setdefault(f"restore pipe-max {size >> 20} MiB", []).append(s)
            print(json.dumps({"round": rnd, "tool": "gpusnap restore", "pipe_max_size": size, "seconds": round(s, 3),
                              "gbps": round(gb * (1 << 30) / s / 1e9, 2), "rc": r.returncode, "thread_s": stages,
                              "err": r.stderr[-300:] if r.returncode else ""}), flush=True)
            _kill(hog.pid)  # the restored process has the dumped one's pid
            _gone(hog.pid)
            time.sleep(SETTLE_S)


if __name__ == "__main__":
    main()
