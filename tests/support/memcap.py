"""A memory-limited cgroup for one test's child processes, so that a command that allocates without
bound is killed inside it (exit -9) instead of hurting the machine. cgroup v2 (memory.max) where the
unified hierarchy is mounted, else the v1 memory controller (memory.limit_in_bytes); the group is made
below the cgroup this test runs in, and removed (its processes killed first) when the block ends."""
from __future__ import annotations

import os
import signal
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest


def _mine(controller: str) -> Path | None:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            return Path(path)
    return None


class MemCap:
    def __init__(self, path: Path, v2: bool) -> None:
        self.path, self.v2 = path, v2

    def enter(self) -> None:
        """Move the calling process into the group (as a Popen preexec_fn: the child, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        f = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        try:
            return int((self.path / f).read_text())
        except (OSError, ValueError):
            return -1


@contextmanager
def memory_cgroup(limit: int) -> Iterator[MemCap]:
    """A child cgroup capped at LIMIT bytes (swap too, where the controller has it)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for a memory cgroup")
    name = f"gpusnap-test-{uuid.uuid4().hex[:12]}"
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        here: Path | None = _mine("") or Path("/")
        path, v2 = Path("/sys/fs/cgroup") / str(here).lstrip("/") / name, True
    else:
        here = _mine("memory")
        if here is None:
            pytest.skip("no memory cgroup controller")
        path, v2 = Path("/sys/fs/cgroup/memory") / str(here).lstrip("/") / name, False
    path.mkdir()
    try:
        if v2:
            (path / "memory.max").write_text(str(limit))
            if (path / "memory.swap.max").exists():
                (path / "memory.swap.max").write_text("0")
        else:
            (path / "memory.limit_in_bytes").write_text(str(limit))
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        yield MemCap(path, v2)
    finally:
        for _ in range(50):
            pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:  # only processes this test put there
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        path.rmdir()
