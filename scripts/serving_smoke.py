#!/usr/bin/env python3
"""A quick check of scripts/serving_workload.py on a GPU (1 GB): it starts, verifies, changes its KV
pool and verifies again; prints one JSON line with "ok"."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload_control import Workload  # noqa: E402

with Workload(1, detached=True, script="serving_workload.py", timeout=100) as w:
    first = w.cmd("verify")
    w.cmd("mutate 5")
    second = w.cmd("verify")
    print(json.dumps({"ok": bool(first["ok"] and second["ok"]), "info": w.info, "first": first, "second": second}))
