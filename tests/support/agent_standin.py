#!/usr/bin/env python3
"""The GPU agent with the driver stand-in in place of the CUDA driver, for runsc tests without a GPU.

gpusnap starts the agent as `$GPUSNAP_AGENT_PYTHON -m agents.gpu_agent ACTION ...` through
`runsc exec`; with GPUSNAP_AGENT_PYTHON naming this file (as the sandbox sees it), that argv runs
the real agent with a stand-in driver (custom storage offered) whose state lives in the sandbox's own
/tmp, so it survives from one exec to the next and through runsc checkpoint/restore. Its one "CUDA
process" is the sandbox's pid 1, with known bytes (sha256 printed by `digest`)."""
import hashlib
import os
import random
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [TESTS, os.path.dirname(TESTS)]
from support.driver_standin import SharedStandIn  # noqa: E402

STATE = "/tmp/gpusnap-standin.pkl"


def memory() -> bytes:
    return random.Random(11).randbytes(2 << 20) + bytes(1 << 20)


if __name__ == "__main__":
    if not os.path.exists(STATE):
        SharedStandIn.create(STATE, {1: memory()})
    d = SharedStandIn(STATE)
    if sys.argv[1:] == ["digest"]:
        now = d.load()
        print(now.get_state(1).name, hashlib.sha256(now.procs[1].gpu).hexdigest())
        sys.exit(0)
    assert sys.argv[1:3] == ["-m", "agents.gpu_agent"], sys.argv
    from agents.gpu_agent import main
    from sandbox.gpu.driver import Features
    from storage.gpu.device import HostDevice
    main(sys.argv[3:], driver=d, features=Features(checkpoint_api=True, custom_storage=True), device=HostDevice())
