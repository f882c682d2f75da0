"""CRIU test support: the criu_workload.py tree, its health check, a process's state, and the CRIU
requirement every CRIU test module checks first (shared by the CRIU, crash, trust and soak tests)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def require_criu() -> None:
    """Skip without root; fail (CI must not skip these) without CRIU >= 4."""
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    from sandbox.criu.runner import find_criu
    if not find_criu():
        pytest.fail("CRIU >= 4 not installed: run scripts/setup.sh (CI must not skip these)")


class Tree:
    """The criu_workload.py tree, in its own session, its control dir fresh per run."""

    def __init__(self, mb: int = 32, detached: bool = False, sharing: str = "private") -> None:
        """detached: the tree is not our child (an intermediate shell exits), so when CRIU kills it
        the zombie is reaped by init, as for a real workload, and gpusnap itself can restore it.
        sharing: "private" (the child holds its own bytes) or "cow" (it shares the parent's)."""
        self.dir = Path(tempfile.mkdtemp(prefix="gpusnap-criu-wl-"))
        self.log = open(self.dir / "log", "w")
        argv = [sys.executable, str(REPO / "tests" / "support" / "criu_workload.py"), str(self.dir), str(mb),
                "gpusnap", "random", sharing]
        if detached:
            argv = ["sh", "-c", 'setsid "$@" </dev/null >/dev/null 2>&1 &', "sh", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     start_new_session=True, cwd="/")
        deadline = time.monotonic() + 30
        while not (self.dir / "ready").exists():
            assert (detached or self.proc.poll() is None) and time.monotonic() < deadline, "workload did not start"
            time.sleep(0.02)
        info = json.loads((self.dir / "ready").read_text())
        self.pid, self.child = info["pid"], info["child"]

    def report(self, timeout: float = 20) -> dict:
        rep = self.dir / "report.json"
        if rep.exists():
            rep.unlink()
        (self.dir / "cmd").write_text("report")
        deadline = time.monotonic() + timeout
        while not rep.exists():
            assert time.monotonic() < deadline, "the tree did not answer"
            time.sleep(0.02)
        return json.loads(rep.read_text())

    def alive(self) -> bool:
        return os.path.exists(f"/proc/{self.pid}") and _state(self.pid) != "Z"

    def reap(self) -> None:
        """Collect the original parent after CRIU killed it (a zombie would block the restore)."""
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        for p in (self.child, self.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.reap()
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in (self.pid, self.child)) \
                and time.monotonic() < deadline:
            time.sleep(0.05)

    def close(self) -> None:
        """Kill the tree and remove its control dir (kill() alone keeps it for a restore)."""
        self.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


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


def healthy(rep: dict) -> bool:
    return rep["memory_ok"] and rep["child_memory_ok"] and rep["pipe_ok"] and rep["thread_ok"] and rep["file_offset"] == 234
