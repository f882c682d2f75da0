#!/usr/bin/env python3
"""A quick check of a benchmark workload on a GPU (1 GB; scripts/workloads/serving_workload.py, or the
one named, e.g. moe_workload.py): it starts, verifies, changes its KV pool and verifies again; prints
one JSON line with "ok"."""
import json
import sys

from scripts.workloads.workload_control import Workload

script = sys.argv[1] if len(sys.argv) > 1 else "serving_workload.py"
with Workload(1, detached=True, script=script, timeout=100) as w:
    first = w.cmd("verify")
    w.cmd("mutate 5")
    second = w.cmd("verify")
    print(json.dumps({"ok": bool(first["ok"] and second["ok"]), "info": w.info, "first": first, "second": second}))
