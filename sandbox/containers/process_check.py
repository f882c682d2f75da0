"""Tell a container's process from a host process, so `gpusnap criu dump` can point at the runtime.

A process whose root directory and mount namespace both differ from ours lives in a container: CRIU
needs the container's root, external mounts and cgroups to dump it, which only its runtime knows (a
plain `criu dump` fails with "doesn't have a proper root mount"). Reads only /proc; never fails on a
process that vanished (it is then not reported as a container's).
"""
from __future__ import annotations

import os
import re

from storage.api import GpusnapError

_RUNTIME_CGROUP = re.compile(r"(libpod|docker|crio|cri-containerd)[-_:]?([0-9a-f]{12,64})")


class ContainerProcessError(GpusnapError):
    """A process that must be checkpointed through its container runtime, not by a plain CRIU dump."""


def _same(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return True
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def container_of(pid: int) -> str | None:
    """A short description of the container PID runs in ("podman container 3f2a..."), None for a host process."""
    if _same(f"/proc/{pid}/ns/mnt", "/proc/self/ns/mnt") or _same(f"/proc/{pid}/root", "/"):
        return None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            cgroup = f.read()
    except OSError:
        cgroup = ""
    m = _RUNTIME_CGROUP.search(cgroup)
    if m:
        runtime = {"libpod": "podman", "cri-containerd": "containerd"}.get(m.group(1), m.group(1))
        return f"{runtime} container {m.group(2)[:12]}"
    path = cgroup.strip().splitlines()[-1].split(":", 2)[-1] if cgroup.strip() else "?"
    return f"a container (cgroup {path})"


def refuse_container_process(pid: int) -> None:
    """Raise ContainerProcessError with what to run instead when PID is a container's process."""
    where = container_of(pid)
    if where is None:
        return
    raise ContainerProcessError(
        f"process {pid} runs in {where}: CRIU needs the container's root, mounts and cgroups, which its "
        f"runtime passes; checkpoint it through the runtime (`runc checkpoint`, `podman container checkpoint "
        f"--export FILE`) with `gpusnap hook install` done, then store it with `gpusnap import podman|runc`; "
        f"or, knowing its root and mounts, give them: `gpusnap criu dump --root DIR [--external mnt[...]:...]`")
