#!/usr/bin/env python3
"""The whole-system benchmark (issues 5 and 7): a CUDA process holding N GB, checkpointed and restored

  1. baseline, NVIDIA's own path: driver lock+checkpoint, plain `criu dump` into a directory on disk
     (synced), process gone, caches dropped, `criu restore -d`, driver restore+unlock, memory verified;
  2. gpusnap host-staged: `gpusnap criu dump` into a store on the same disk, process gone, caches
     dropped, `gpusnap criu restore`, memory verified;
  3. dedup: a second `gpusnap criu dump` of the restored process after it rewrote 5% of its GPU memory.

Same disk, same durability (sync inside the timed region for the baseline; gpusnap fsyncs its chunks),
page cache dropped before both restores. Prints seconds per stage and the ratio to the baseline.
Usage: bench_e2e.py [--gb 24] [--mix realistic] [--dir /var/tmp] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from sandbox.criu.runner import Criu
from sandbox.gpu.driver import CudaDriver
from sandbox.gpu.checkpoint import checkpoint_all, restore_all
from scripts.helpers import REPO, drop_caches
from scripts.workloads.workload_control import Workload




def gpusnap(store: str, *args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "sandbox.cli", "--store", store, *args, "--json"],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"gpusnap {' '.join(args)} failed: {p.stderr.strip()}")
    return json.loads(p.stdout)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def timed(stages: dict, name: str, fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    stages[name] = time.perf_counter() - t0
    return out


def baseline(criu: Criu, drv: CudaDriver, gb: float, mix: str, work: str) -> dict:
    """NVIDIA's own path: driver lock+checkpoint, plain CRIU to disk (+sync), cold restore, driver restore."""
    base: dict = {}
    with Workload(gb, mix=mix, seed=21, detached=True) as w:
        images = os.path.join(work, "baseline")
        os.mkdir(images)
        timed(base, "driver_lock+checkpoint", checkpoint_all, drv, [w.pid])

        def dump() -> None:
            criu.dump(w.pid, images)
            os.sync()
        timed(base, "criu_dump+sync", dump)
        w.reap()
        base["image_bytes"] = du(images)
        drop_caches(required=True)
        timed(base, "criu_restore", criu.restore, images, detach=True)
        timed(base, "driver_restore+unlock", restore_all, drv, [w.pid])
        base["verified"] = w.verify()
        shutil.rmtree(images)
    base["total"] = sum(v for v in base.values() if isinstance(v, float))
    return base


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=24)
    ap.add_argument("--mix", default="realistic")
    ap.add_argument("--dir", default=os.environ.get("GPUSNAP_DISK_DIR", "/var/tmp"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-baseline", action="store_true")
    a = ap.parse_args()
    criu = Criu()
    drv = CudaDriver()
    work = tempfile.mkdtemp(prefix="gpusnap-e2e-", dir=a.dir)
    result: dict = {"date": time.strftime("%Y-%m-%d"), "gb": a.gb, "mix": a.mix, "criu": criu.version}
    try:
        if not a.skip_baseline:
            try:
                result["baseline"] = baseline(criu, drv, a.gb, a.mix, work)
                print("baseline", json.dumps(result["baseline"]))
            except Exception as e:  # noqa: BLE001 - report and still measure gpusnap
                result["baseline_error"] = repr(e)
                print("baseline failed:", repr(e))
        g: dict = {}
        store = os.path.join(work, "store")
        with Workload(a.gb, mix=a.mix, seed=21, detached=True) as w:
            d = timed(g, "gpusnap_criu_dump", gpusnap, store, "criu", "dump", str(w.pid), "e2e")
            g["dump_stages"] = d["seconds"]
            g["ingest_stages"] = d.get("stages")
            g["stored_bytes"] = d["new_bytes"]
            g["image_bytes"] = d["raw_bytes"]
            w.reap()
            drop_caches(required=True)
            r = timed(g, "gpusnap_criu_restore", gpusnap, store, "criu", "restore", "e2e")
            g["restore_stages"] = r["seconds"]
            g["verified"] = w.verify()
            # dedup: the restored process rewrites 5% of its GPU memory, then a second dump (left running)
            w.cmd("mutate 5")
            d2 = gpusnap(store, "criu", "dump", "--leave-running", str(w.pid), "e2e-b")
            g["dedup"] = {"second_new": d2["new_bytes"], "second_over_first": d2["new_bytes"] / max(1, g["stored_bytes"]),
                          "second_dump_s": d2["seconds"]}
            g["verified_after_dedup_dumps"] = w.verify()
        g["total"] = g["gpusnap_criu_dump"] + g["gpusnap_criu_restore"]
        result["gpusnap"] = g
        print("gpusnap", json.dumps(g))
        if "baseline" in result:
            b = result["baseline"]["total"]
            print(f"\ncycle: baseline {b:.1f} s, gpusnap {g['total']:.1f} s -> {b / g['total']:.2f}x; "
                  f"image {result['baseline']['image_bytes'] / 1e9:.1f} GB vs stored {g['stored_bytes'] / 1e9:.1f} GB; "
                  f"dedup second dump wrote {g['dedup']['second_new'] / 1e9:.2f} GB "
                  f"({100 * g['dedup']['second_over_first']:.1f}% of the first)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
