#!/usr/bin/env python3
"""The MoE-like tree's second dump on the CPU (issue 21): what `criu dump --parent` stores against
what the workload changed, for several put thread counts, with real CRIU and no GPU.

    python3 -m scripts.bench.bench_moe_delta [--gb 1] [--workers 2,8,16] [--restores 1,2] [--dir /var/tmp] [--json OUT]
                                              [--profile-second "py-spy record --gil -f raw -o gil.txt --"]

For each count: scripts/workloads/moe_workload.py --device cpu (numpy arrays in place of device
memory, two processes in one tree) is dumped into a fresh store, restored from it and checked, then
5% of its KV blocks are filled (`mutate 5`) and it is dumped again with `--parent` while it keeps
running ($GPUSNAP_PUT_WORKERS set for both dumps). Prints the second dump's new bytes over the bytes
the workload changed, its wall time and its delta counters (FORMAT.md, "Delta entries"). Also the
pages of the second dump found in no page image of the first (`nowhere_bytes`): what no delta can
take from the parent, whatever it places where (the workload counts only the KV blocks it filled;
the process also changes its heap and its temporaries). --profile-second runs the second dump (only
it) under a profiler's command line. Needs root and CRIU >= 4 ($GPUSNAP_CRIU).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import tempfile
import time
from typing import Any

from scripts.bench.bench_e2e import gpusnap, kill_restored
from scripts.helpers import report_json, second_dump_pages
from scripts.workloads.workload_control import Workload


def one(gb: float, workers: int, root: str, restores: int = 1, wrap: str = "") -> dict[str, Any]:
    store = tempfile.mkdtemp(prefix="gpusnap-moe-delta-", dir=root)
    env = {"GPUSNAP_PUT_WORKERS": str(workers)}
    try:
        with Workload(gb, detached=True, script="moe_workload.py", extra=("--device", "cpu"), timeout=600) as w:
            t0 = time.perf_counter()
            gpusnap(store, "criu", "dump", str(w.pid), "m1", extra_env=env)
            first = time.perf_counter() - t0
            w.reap()
            for i in range(restores):  # restored again after a kill, as bench_e2e's --restore-variant does
                if i:
                    kill_restored(w.pids)
                gpusnap(store, "criu", "restore", "m1", extra_env=env)
                if not w.cmd("verify")["ok"]:
                    raise SystemExit("the restored tree failed its own check")
            changed = int(w.cmd("mutate 5")["bytes"])
            t0 = time.perf_counter()
            rep = gpusnap(store, "criu", "dump", "--leave-running", "--parent", "m1", str(w.pid), "m2", extra_env=env,
                          wrap=shlex.split(wrap))
            wall = time.perf_counter() - t0
            if not w.cmd("verify")["ok"]:
                raise SystemExit("the tree failed its own check after the second dump")
        pages = second_dump_pages(store, "m1", "m2")
        nowhere = pages["nowhere_bytes"]
        stages = rep.get("stages") or {}
        return {"workers": workers, "restores": restores, "changed_bytes": changed, "new_bytes": rep["new_bytes"],
                "new_over_changed": round(rep["new_bytes"] / changed, 3), "nowhere_bytes": nowhere,
                "new_over_nowhere": round(rep["new_bytes"] / max(1, nowhere), 3), "second_dump_s": round(wall, 2),
                "first_dump_s": round(first, 2),
                "delta": {k: v["bytes"] for k, v in stages.items() if k.startswith("delta:")},
                "thread_s": {k: v["thread_seconds"] for k, v in stages.items()
                             if k in ("compress", "delta", "delta-base", "delta-search", "worker")},
                "base_bytes_read": stages.get("delta-base", {}).get("bytes"), "pages": pages["images"]}
    finally:
        shutil.rmtree(store, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--workers", default="2,8,16")
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--restores", default="1", help="restores before the second dump, each after killing the last "
                    "restored tree (comma-separated: one run each)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-second", default="", metavar="CMD",
                    help="a command the second dump runs under (e.g. a py-spy record command line ending in --)")
    a = ap.parse_args()
    rows = []
    for k in [int(x) for x in a.restores.split(",") if x]:
        for n in [int(x) for x in a.workers.split(",") if x]:
            r = one(a.gb, n, a.dir, k, a.profile_second)
            print(json.dumps(r), flush=True)
            rows.append(r)
    report_json({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gb": a.gb, "rows": rows}, a.json)


if __name__ == "__main__":
    main()
