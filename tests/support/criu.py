"""CRIU test support: the criu_workload.py tree as the tests start it, its health check and a
process's state (both from scripts/workloads/criu_tree.py), and the CRIU requirement every CRIU test
module checks first (shared by the CRIU, crash and trust tests), and the CRIU a `gpusnap` process runs."""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Literal

import pytest

from scripts.workloads.criu_tree import CriuTree, healthy, proc_state as _state  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parents[2]


def require_criu(missing: Literal["fail", "skip"] = "fail") -> None:
    """Skip without root; without CRIU >= 4, fail (CI must not skip these), or skip where MISSING says so
    (the GPU machine's tests, which run where CRIU may not be installed)."""
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    from sandbox.criu.runner import find_criu
    if not find_criu():
        if missing == "skip":
            pytest.skip("needs CRIU >= 4 (GPUSNAP_CRIU)")
        pytest.fail("CRIU >= 4 not installed: run scripts/setup.sh (CI must not skip these)")


def criu_path() -> str:
    """The CRIU the tests run (need_criu has made sure there is one)."""
    from sandbox.criu.runner import find_criu
    criu = find_criu()
    assert criu is not None, "no CRIU >= 4: run scripts/setup.sh"
    return criu


class Tree(CriuTree):
    """The criu_workload.py tree (scripts/workloads/criu_tree.py), random bytes by default, as the tests start it."""

    def __init__(self, mb: int = 32, detached: bool = False, sharing: str = "private", data: str = "random") -> None:
        super().__init__(mb, data=data, sharing=sharing, detached=detached, start_timeout=30)


def pids_with(needle: bytes) -> list[int]:
    """Pids of the processes on this machine whose command line holds NEEDLE."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if needle in f.read():
                        out.append(int(d))
            except OSError:
                pass
    return out


def children_of(pid: int) -> list[int]:
    """The pids whose parent is PID."""
    out: list[int] = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(p))
            except OSError:
                pass
    return out


def criu_of(proc: subprocess.Popen, timeout: float = 30) -> int:
    """The `criu dump|restore` that PROC runs (not its `criu --version` probe)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for c in children_of(proc.pid):
            try:
                argv = Path(f"/proc/{c}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if Path(argv[0].decode()).name == "criu" and argv[1:2] in ([b"dump"], [b"restore"]):
                return c
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    raise AssertionError("CRIU did not start")
