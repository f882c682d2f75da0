#!/usr/bin/env python3
"""A quick check of scripts/workloads/serving_workload.py on a GPU (1 GB): it starts, verifies, changes its KV
pool and verifies again; prints one JSON line with "ok"."""
import json

from scripts.workloads.workload_control import Workload

with Workload(1, detached=True, script="serving_workload.py", timeout=100) as w:
    first = w.cmd("verify")
    w.cmd("mutate 5")
    second = w.cmd("verify")
    print(json.dumps({"ok": bool(first["ok"] and second["ok"]), "info": w.info, "first": first, "second": second}))
