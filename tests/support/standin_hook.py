"""A CRIU action script for tests: gpusnap's hook (criu_hooks.action_script.run) with the file-backed
driver stand-in (driver_standin.SharedStandIn), the container's init process standing for its one GPU
process (STANDIN_PID: whatever host pid CRIU names, the driver knows one CUDA process).

usage: standin_hook.py STATE_FILE   (CRIU sets CRTOOLS_SCRIPT_ACTION and CRTOOLS_INIT_PID)
A file STATE_FILE.fail-at-ACTION makes the script exit 1 at ACTION after the hook ran (a failed dump);
STATE_FILE.stall-at-ACTION makes ACTION hang (as a driver call that never returns) under the hook's
deadline (GPUSNAP_HOOK_TIMEOUT), which ends it with the hook's exit status for that action.
Each run appends "ACTION EXIT" to STATE_FILE.runs.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for support.*

import time  # noqa: E402

from criu_hooks.action_script import deadline, exit_on_failure, hook_timeout, run  # noqa: E402
from support.driver_standin import SharedStandIn  # noqa: E402

STANDIN_PID = 1  # the key of the one GPU process of the container in the state file


def main() -> int:
    state = sys.argv[1]
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION", "")
    pid_s = os.environ.get("CRTOOLS_INIT_PID", "")
    pid = int(pid_s) if pid_s.isdigit() else None
    try:
        with deadline(hook_timeout()):
            if os.path.exists(f"{state}.stall-at-{action}"):
                time.sleep(3600)
            out = run(action, pid, driver=SharedStandIn(state, alias=STANDIN_PID), pids=None if pid is None else [pid])
        code = out if isinstance(out, int) else 0   # an exit status, or (newer hooks) what it did
    except BaseException as e:  # noqa: BLE001 - as the real hook: one line, the status that lets CRIU go on
        print(f"standin-hook: {action}: {e}".splitlines()[0], file=sys.stderr)
        code = exit_on_failure(action)
    if code == 0 and os.path.exists(f"{state}.fail-at-{action}"):
        code = 1
    with open(f"{state}.runs", "a") as f:
        f.write(f"{action} {code}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
