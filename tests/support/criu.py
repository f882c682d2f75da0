"""CRIU test support: the criu_workload.py tree as the tests start it, its health check and a
process's state (both from scripts/workloads/criu_tree.py), and the CRIU requirement every CRIU test
module checks first (shared by the CRIU, crash and trust tests)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.workloads.criu_tree import CriuTree, healthy, proc_state as _state  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parents[2]


def require_criu() -> None:
    """Skip without root; fail (CI must not skip these) without CRIU >= 4."""
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    from sandbox.criu.runner import find_criu
    if not find_criu():
        pytest.fail("CRIU >= 4 not installed: run scripts/setup.sh (CI must not skip these)")


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
