"""`python -m agents.gpu_agent ACTION [--pids P,..] [--path PATH]`: the GPU agent inside a gVisor sandbox.

`gpusnap runsc checkpoint/restore` starts it with `runsc exec` (gpusnap's code is bind-mounted
read-only into GPU sandboxes at /run/gpusnap/code; the store is NOT: the sandbox never sees it). It
sees the sandbox's own processes and reaches the NVIDIA driver through nvproxy:

  checkpoint  lock + checkpoint every CUDA process of the sandbox, all or nothing. Where the driver
              has custom storage, their GPU memory goes to the host over this agent's stdout (frames,
              sandbox/gpu/channel.py), which stores it; otherwise the driver keeps it in the
              processes' host memory, which `runsc checkpoint` then saves with the rest of the sandbox.
  restore     the reverse: after `runsc restore`, or to undo a checkpoint whose runsc step failed;
              with custom storage it first says which processes it restores and reads their GPU
              memory from stdin.
  toggle      checkpoint the processes that run, restore the ones that are checkpointed (host copy):
              the shape of command runsc's own `checkpoint --save-restore-exec-argv` calls.
  status      the CUDA processes and their states; changes nothing.

Every action ends with one JSON report line on stdout (a "report" frame). Errors: one line on stderr,
exit 1. Only the standard library is needed until there is a CUDA process to act on.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, BinaryIO


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
            return [a.decode(errors="replace")[:256] for a in f.read().split(b"\0") if a][:2]
    except OSError:
        return []


def _driver_pids(drv: Any) -> list[int]:
    """The processes the driver knows (in any state): after a checkpoint the device files are closed,
    so the driver is asked about every process instead."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                drv.get_state(int(d))
            except Exception:  # noqa: BLE001 - not a CUDA process
                continue
            out.append(int(d))
    return sorted(out)


def run(action: str, *, out: BinaryIO, inp: BinaryIO | None = None, path: str | None = None,
        driver: Any = None, features: Any = None, device: Any = None, pids: list[int] | None = None) -> dict[str, Any]:
    """One action; frames to OUT (the host), GPU memory back from INP. driver/features/device/pids:
    stand-ins for tests (default: the real driver, probed, and GPU 0)."""
    report: dict[str, Any] = {"action": action, "init": _init_cmdline(), "cuda_pids": [], "path": None}
    found = _cuda_pids() if pids is None and action in ("checkpoint", "status") else pids
    if found is not None and not found and driver is None:
        return report  # no NVIDIA device open: nothing to do, and no reason to load the driver
    from sandbox.gpu import state
    from sandbox.gpu.channel import PipeRegions, send_need
    from sandbox.gpu.driver import CudaDriver, ProcessState, probe
    drv = driver or CudaDriver()
    cuda = found if found else _driver_pids(drv)
    report["cuda_pids"] = cuda
    if not cuda:
        return report
    # runsc's save/restore exec (toggle): the driver's host copy, which runsc saves; inside gVisor the
    # host's THP setting is out of reach: left alone
    plan = state.plan(recorded=path or None, features=None if path else (features or probe(drv)),
                      streams=action != "toggle", thp_mode=None)
    report["path"] = plan.path.value
    report["states"] = {str(p): drv.get_state(p).name for p in cuda}
    if action == "status":
        return report
    regions = spill = None
    if plan.streams:
        from sandbox.gpu.regions import EngineSpill
        from storage.api import CudaDevice
        dev = device if device is not None else CudaDevice(0)
        # a checkpoint only sends: a process already streamed comes back through a later restore
        regions, spill = PipeRegions(dev, out, inp if action == "restore" else None), EngineSpill(dev)
    backend = plan.backend(regions, spill)
    if action == "toggle":
        action = "checkpoint" if any(drv.get_state(p) == ProcessState.RUNNING for p in cuda) else "restore"
    if action == "checkpoint":
        state.checkpoint(drv, cuda, backend)
    elif action == "restore":
        if regions is not None:
            send_need(out, [p for p in cuda if drv.get_state(p) == ProcessState.CHECKPOINTED])
        state.thaw(drv, cuda, backend)
    report["states"] = {str(p): drv.get_state(p).name for p in cuda}
    return report


def main(argv: list[str] | None = None, *, driver: Any = None, features: Any = None, device: Any = None) -> None:
    """The entry point; driver/features/device: stand-ins for tests (default: the real ones)."""
    ap = argparse.ArgumentParser(prog="gpusnap-gpu-agent", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["checkpoint", "restore", "toggle", "status"])
    ap.add_argument("--pids", default=None, help="comma-separated CUDA pids (restore: those the checkpoint reported)")
    ap.add_argument("--path", default=None, choices=["host-staged", "custom-storage"],
                    help="the path the checkpoint took (restore; default: what the driver offers)")
    a = ap.parse_args(argv)
    out = sys.stdout.buffer
    try:
        pids = [int(x) for x in a.pids.split(",") if x] if a.pids is not None else None
        rep = run(a.action, out=out, inp=sys.stdin.buffer, path=a.path, pids=pids, driver=driver,
                  features=features, device=device)
    except Exception as e:  # noqa: BLE001 - one line for gpusnap to show
        print(f"gpusnap-gpu-agent: {a.action}: {e}".splitlines()[0], file=sys.stderr)
        sys.exit(1)
    from sandbox.gpu.channel import report_frame, write_header
    write_header(out, report_frame(rep))
    out.flush()


if __name__ == "__main__":
    main()
