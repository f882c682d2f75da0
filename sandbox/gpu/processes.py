"""Discovery of the CUDA processes in a process tree (or a cgroup), from /proc alone."""
from __future__ import annotations

import os

from sandbox.host.processes import DiscoveryError, process_tree

__all__ = ["DiscoveryError", "cgroup_pids", "cuda_processes", "process_tree", "uses_gpu"]


def cgroup_pids(cgroup_dir: str) -> list[int]:
    """Every pid in a cgroup v2 directory and its sub-cgroups."""
    if not os.path.isdir(cgroup_dir):
        raise DiscoveryError(f"{cgroup_dir}: no such cgroup")
    pids: list[int] = []
    for dirpath, _, files in os.walk(cgroup_dir):
        if "cgroup.procs" in files:
            with open(os.path.join(dirpath, "cgroup.procs")) as f:
                pids += [int(x) for x in f.read().split()]
    return sorted(set(pids))


def uses_gpu(pid: int) -> bool:
    """True if PID has an NVIDIA device open or mapped (a running CUDA process always has both).

    After a checkpoint the driver drops every /dev/nvidia* mapping, so callers that may meet
    checkpointed processes also ask the driver (CheckpointDriver.get_state).
    """
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                    return True
            except OSError:
                continue
        with open(f"/proc/{pid}/maps") as f:
            return any("/dev/nvidia" in line for line in f)
    except OSError:
        return False


def cuda_processes(root: int, driver: object | None = None) -> list[int]:
    """The CUDA processes among ROOT's tree: those with NVIDIA devices open, plus, when a driver is
    given, those the driver reports a checkpoint state for (locked or checkpointed ones)."""
    found = []
    for pid in process_tree(root):
        if uses_gpu(pid):
            found.append(pid)
        elif driver is not None:
            try:
                driver.get_state(pid)  # type: ignore[attr-defined]
                found.append(pid)
            except Exception:  # noqa: BLE001 - not a CUDA process: the driver says "not found"
                continue
    return found
