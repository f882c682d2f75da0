"""`gpusnap-criu-hook`: the CRIU action script (criu --action-script, or `action-script` in a CRIU
config file such as runc's /etc/criu/runc.conf).

CRIU runs it at each stage with CRTOOLS_SCRIPT_ACTION, CRTOOLS_INIT_PID and CRTOOLS_IMAGE_DIR set.
It handles the GPU state of the CUDA processes in the tree:
  pre-dump     lock and checkpoint every CUDA process (all or nothing; a failure aborts the dump
               with the processes running and unlocked)
  post-dump    with GPUSNAP_LEAVE_RUNNING=1 (the dump keeps the tree running): restore and unlock
  post-resume  after `criu restore`: restore GPU memory and unlock
By default through the driver's host copy (the GPU memory becomes part of the CPU image CRIU dumps).
Where the driver offers custom storage and GPUSNAP_GPU_SNAPSHOT names a snapshot (in GPUSNAP_STORE,
or the default store), the GPU memory is streamed into that snapshot instead (replaced if it exists)
and CRIU dumps processes that hold no GPU bytes; post-dump/post-resume bring it back from there.
Every other action does nothing and exits 0. Errors: one line on stderr, exit 1 (CRIU then aborts).
"""
from __future__ import annotations

import os
import sys
from typing import Any

HANDLED = ("pre-dump", "post-dump", "post-resume")


def _cuda_pids(root: int) -> list[int]:
    from sandbox.gpu.processes import cuda_processes, process_tree, uses_gpu
    if not any(uses_gpu(p) for p in process_tree(root)) and not os.path.exists("/dev/nvidiactl"):
        return []
    from sandbox.gpu.driver import CudaDriver
    return cuda_processes(root, CudaDriver())


def _custom_target(drv: Any, features: Any) -> tuple[Any, str] | None:
    """(store, snapshot name) when GPU state goes through custom storage, else None (host copy)."""
    name = os.environ.get("GPUSNAP_GPU_SNAPSHOT")
    if not name:
        return None
    from sandbox.gpu.driver import probe
    feats = features or probe(drv)
    if not feats.custom_storage:
        return None
    from storage.store import SnapshotStore, default_store_path
    return SnapshotStore(os.environ.get("GPUSNAP_STORE") or default_store_path()), name


def run(action: str, init_pid: int | None, *, driver: Any = None, features: Any = None, device: Any = None,
        pids: list[int] | None = None) -> int:
    """One CRIU action (driver/features/device/pids: stand-ins for tests; default the real driver)."""
    if action not in HANDLED:
        return 0
    if init_pid is None:
        print(f"gpusnap-criu-hook: {action}: CRTOOLS_INIT_PID is not set", file=sys.stderr)
        return 1
    from sandbox.gpu.driver import CudaDriver, ProcessState
    from sandbox.gpu.checkpoint import checkpoint_all, restore_all
    from sandbox.gpu.hugepages import thp
    pids = _cuda_pids(init_pid) if pids is None else pids
    if not pids:
        return 0
    drv = driver or CudaDriver()
    custom = _custom_target(drv, features)
    if custom is not None:
        from sandbox.gpu.snapshot import gpu_checkpoint, gpu_restore
        store, name = custom
        if action == "pre-dump":
            gpu_checkpoint(store, init_pid, name, driver=drv, features=features, device=device, replace=True)
        elif action == "post-resume" or os.environ.get("GPUSNAP_LEAVE_RUNNING") == "1":
            if any(drv.get_state(p) == ProcessState.CHECKPOINTED for p in pids):
                gpu_restore(store, name, init_pid, driver=drv, features=features, device=device)
        return 0
    if action == "pre-dump":
        with thp("always"):
            checkpoint_all(drv, pids, lock_timeout_s=float(os.environ.get("GPUSNAP_LOCK_TIMEOUT", "10")))
    elif action == "post-dump":
        if os.environ.get("GPUSNAP_LEAVE_RUNNING") == "1":
            restore_all(drv, pids)
    elif action == "post-resume":
        ready = [p for p in pids if drv.get_state(p) == ProcessState.CHECKPOINTED]
        if ready:
            with thp("always"):
                restore_all(drv, ready)
    return 0


def main() -> None:
    action = os.environ.get("CRTOOLS_SCRIPT_ACTION", "")
    pid_s = os.environ.get("CRTOOLS_INIT_PID")
    try:
        code = run(action, int(pid_s) if pid_s and pid_s.isdigit() else None)
    except Exception as e:  # noqa: BLE001 - one line for CRIU's log, non-zero to abort the dump
        print(f"gpusnap-criu-hook: {action}: {e}".splitlines()[0], file=sys.stderr)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
