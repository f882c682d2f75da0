"""`python -m criu_hooks.gpu_agent ACTION [--store DIR --name NAME]`: the GPU agent inside a gVisor sandbox.

`gpusnap runsc checkpoint/restore` starts it with `runsc exec` (gpusnap's code and the store are
bind-mounted into GPU sandboxes at /run/gpusnap/code and /run/gpusnap/store). It sees the sandbox's
own processes and reaches the NVIDIA driver through nvproxy:

  checkpoint  lock + checkpoint every CUDA process of the sandbox, all or nothing. With --store and
              --name, where the driver has custom storage, their GPU memory is streamed into that
              snapshot; otherwise the driver keeps it in the processes' host memory, which
              `runsc checkpoint` then saves with the rest of the sandbox.
  restore     the reverse: after `runsc restore`, or to undo a checkpoint whose runsc step failed.
  toggle      checkpoint the processes that run, restore the ones that are checkpointed (host copy):
              the shape of command runsc's own `checkpoint --save-restore-exec-argv` calls.
  status      the CUDA processes and their states; changes nothing.

Prints one JSON object on stdout. Errors: one line on stderr, exit 1. Only the standard library is
needed until there is a CUDA process to act on.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def _cuda_pids() -> list[int]:
    """CUDA processes in this (sandbox) pid namespace, found by their open NVIDIA device files; the
    agent itself and its ancestors (runsc exec's helpers) are not candidates."""
    from sandbox.gpu.processes import uses_gpu
    mine = {os.getpid()}
    p = os.getppid()
    while p > 1 and p not in mine:
        mine.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                p = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    pids = sorted(int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) not in mine)
    return [q for q in pids if uses_gpu(q)]


def _init_cmdline() -> list[str]:
    """What runs as pid 1 where the agent runs (inside a sandbox: the container's own process)."""
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a][:2]
    except OSError:
        return []


def _checkpointed_pids(drv: Any) -> list[int]:
    """After a checkpoint the device files are closed: ask the driver about every process instead."""
    from sandbox.gpu.driver import ProcessState
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                if drv.get_state(int(d)) != ProcessState.RUNNING:
                    out.append(int(d))
            except Exception:  # noqa: BLE001 - not a CUDA process
                pass
    return out


def run(action: str, store: str | None, name: str | None, *, driver: Any = None, features: Any = None,
        device: Any = None, pids: list[int] | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {"action": action, "init": _init_cmdline(), "cuda_pids": [], "path": None,
                              "snapshot": None}
    if action in ("checkpoint", "status"):
        found = _cuda_pids() if pids is None else pids
    else:
        found = pids
    if found is not None and not found and driver is None:
        return report  # nothing to do, and no reason to load the driver
    from sandbox.gpu.driver import CudaDriver, ProcessState, probe
    drv = driver or CudaDriver()
    cuda = found if found is not None else _checkpointed_pids(drv)
    report["cuda_pids"] = cuda
    if not cuda:
        return report
    feats = features or probe(drv)
    custom = bool(store and name and feats.custom_storage)
    report["path"] = "custom-storage" if custom else "host-staged"
    report["states"] = {str(p): drv.get_state(p).name for p in cuda}
    if action == "status":
        return report
    from sandbox.gpu.checkpoint import checkpoint_all, restore_all
    if custom:
        from sandbox.gpu.snapshot import gpu_checkpoint, gpu_restore
        from storage.store import SnapshotStore
        st = SnapshotStore(store)  # type: ignore[arg-type]
        if action == "checkpoint":
            gpu_checkpoint(st, min(cuda), name, driver=drv, features=feats, device=device, replace=True,  # type: ignore[arg-type]
                           thp_mode=None, pids=cuda)
            report["snapshot"] = name
        elif action == "restore":
            gpu_restore(st, name, min(cuda), driver=drv, features=feats, device=device, thp_mode=None)  # type: ignore[arg-type]
    elif action == "checkpoint":
        checkpoint_all(drv, cuda)
    elif action == "restore":
        restore_all(drv, [p for p in cuda if drv.get_state(p) == ProcessState.CHECKPOINTED])
    elif action == "toggle":
        running = [p for p in cuda if drv.get_state(p) == ProcessState.RUNNING]
        if running:
            checkpoint_all(drv, running)
        else:
            restore_all(drv, [p for p in cuda if drv.get_state(p) == ProcessState.CHECKPOINTED])
    report["states"] = {str(p): drv.get_state(p).name for p in cuda}
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="gpusnap-gpu-agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["checkpoint", "restore", "toggle", "status"])
    ap.add_argument("--store", default=None, help="the store as seen inside the sandbox (custom storage only)")
    ap.add_argument("--name", default=None, help="snapshot for the GPU memory (custom storage only)")
    ap.add_argument("--pids", default=None, help="comma-separated CUDA pids (restore: those the checkpoint reported)")
    a = ap.parse_args(argv)
    try:
        pids = [int(x) for x in a.pids.split(",") if x] if a.pids is not None else None
        out = run(a.action, a.store, a.name, pids=pids)
    except Exception as e:  # noqa: BLE001 - one line for gpusnap to show
        print(f"gpusnap-gpu-agent: {a.action}: {e}".splitlines()[0], file=sys.stderr)
        sys.exit(1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
