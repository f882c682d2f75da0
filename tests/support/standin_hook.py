"""A CRIU action script for tests: gpusnap's hook (criu_hooks.action_script.run) with the file-backed
driver stand-in (driver_standin.SharedStandIn), the container's init process standing for its one GPU
process (STANDIN_PID: whatever host pid CRIU names, the driver knows one CUDA process).

usage: standin_hook.py STATE_FILE   (CRIU sets CRTOOLS_SCRIPT_ACTION and CRTOOLS_INIT_PID)
A file STATE_FILE.fail-at-ACTION makes the script exit 1 at ACTION after the hook ran (a failed dump).
Each run appends "ACTION EXIT" to STATE_FILE.runs.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for support.*

from criu_hooks.action_script import run  # noqa: E402
from support.driver_standin import SharedStandIn  # noqa: E402

STANDIN_PID = 1  # the key of the one GPU process of the container in the state file


def main() -> int:
    state = sys.argv[1]
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION", "")
    pid_s = os.environ.get("CRTOOLS_INIT_PID", "")
    pid = int(pid_s) if pid_s.isdigit() else None
    try:
        out = run(action, pid, driver=SharedStandIn(state, alias=STANDIN_PID), pids=None if pid is None else [pid])
        code = out if isinstance(out, int) else 0   # an exit status, or (newer hooks) what it did
    except Exception as e:  # noqa: BLE001 - as the real hook: one line, non-zero
        print(f"standin-hook: {action}: {e}".splitlines()[0], file=sys.stderr)
        code = 1
    if code == 0 and os.path.exists(f"{state}.fail-at-{action}"):
        code = 1
    with open(f"{state}.runs", "a") as f:
        f.write(f"{action} {code}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
