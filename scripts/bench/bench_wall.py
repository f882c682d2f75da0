#!/usr/bin/env python3
"""Where a command's wall time goes (issue 25 item 10): `store put`, `store get`, `criu dump` and
`criu restore` of a process holding MB of memory, each with `--json`, printing the report's `wall`
(start-up, the stages it times, waits for locks / the commit's fsyncs / a tree's death, other) next
to the wall time measured outside the command. Root (CRIU). Page cache dropped before each command.
Usage: python3 -m scripts.bench.bench_wall [--mb 256] [--json F]
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

from scripts.helpers import REPO, child_env, drop_caches, report_json


def timed_json(argv: list[str]) -> tuple[float, dict]:
    drop_caches()
    t0 = time.perf_counter()
    p = subprocess.run(argv, check=True, capture_output=True, text=True, env=child_env())
    return time.perf_counter() - t0, json.loads(p.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    top = tempfile.mkdtemp(prefix="gpusnap-bench-wall-", dir="/var/tmp")
    g = [sys.executable, "-m", "cli", "--store", os.path.join(top, "store")]
    out: dict[str, object] = {}
    try:
        data = os.path.join(top, "data")
        os.makedirs(data)
        with open(os.path.join(data, "blob"), "wb") as f:
            f.write(os.urandom(a.mb << 20))
        for label, argv in (("store put", [*g, "store", "put", "p", data, "--json"]),
                            ("store get", [*g, "store", "get", "p", os.path.join(top, "out"), "--json"])):
            wall, rep = timed_json(argv)
            out[label] = {"outside_s": round(wall, 3), "wall": rep["wall"]}
        count = os.path.join(top, "count")
        proc = subprocess.Popen(["setsid", sys.executable, os.path.join(REPO, "scripts", "workloads", "demo_counter.py"),
                                 count], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not (os.path.exists(count) and os.path.getsize(count)):
            assert time.monotonic() < deadline, "the counter did not start"
            time.sleep(0.1)
        wall, rep = timed_json([*g, "criu", "dump", str(proc.pid), "c", "--json"])
        proc.wait(timeout=30)
        out["criu dump"] = {"outside_s": round(wall, 3), "wall": rep["wall"], "seconds": rep["seconds"]}
        wall, rep = timed_json([*g, "criu", "restore", "c", "--json"])
        out["criu restore"] = {"outside_s": round(wall, 3), "wall": rep["wall"], "seconds": rep["seconds"]}
        subprocess.run(["kill", "-9", str(rep["restored_pid"])], check=False)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    report_json(out, a.json)


if __name__ == "__main__":
    main()
