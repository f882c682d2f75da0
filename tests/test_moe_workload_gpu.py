"""GPU test (marker `gpu`): the MoE-like benchmark workload on a real GPU. Both processes of its tree
hold GPU memory (the driver knows both), it verifies itself, and after the driver's checkpoint and
restore of the whole tree (no CRIU: the memory goes to host memory and back) every tensor of both
processes, the pinned host memory and the CUDA graph's output check out. Skipped where there is no
GPU (conftest.py); scripts/bench/bench_e2e.py --workload moe runs it through CRIU and gpusnap."""
from __future__ import annotations

import pytest

from support.gpu_results import GB, record

pytestmark = pytest.mark.gpu


def test_moe_tree_through_the_driver_checkpoint_verifies_itself() -> None:
    from sandbox.gpu.checkpoint import checkpoint_all, restore_all
    from sandbox.gpu.driver import CudaDriver
    from sandbox.gpu.processes import cuda_processes
    from scripts.workloads.workload_control import Workload
    drv = CudaDriver()
    with Workload(GB, detached=True, script="moe_workload.py", timeout=300) as w:
        assert len(w.pids) == 2 and sorted(cuda_processes(w.pid)) == sorted(w.pids)
        assert w.info["graph"] and w.info["pinned_bytes"] > 0
        first = w.cmd("verify")
        assert first["ok"] and first["graph_equal"], first
        t = checkpoint_all(drv, w.pids)
        r = restore_all(drv, w.pids)
        after = w.cmd("verify")
        assert after["ok"] and after["tensors_equal"], after
        assert w.cmd("mutate 5")["ok"] and w.cmd("verify")["ok"]
        record("moe_driver_cycle", {"gb": w.size / 1e9, "checkpoint_s": t.checkpoint_s, "restore_s": r.restore_s,
                                    "graph_equal_after": after.get("graph_equal"),
                                    "graph_rel_err_after": after.get("graph_rel_err")})
