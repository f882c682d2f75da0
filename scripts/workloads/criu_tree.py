"""The CPU process tree of criu_workload.py, driven from outside: started (our child, or detached so
that init reaps it as it would a real workload), asked for its report, checked, killed. One driver for
the CRIU tests (tests/support/criu.py), bench_criu and the kill soak."""
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
from typing import Any

from sandbox.host.processes import state_of as proc_state

WORKLOAD = Path(__file__).resolve().with_name("criu_workload.py")


class TreeError(RuntimeError):
    """The tree did not start, or did not answer in time."""


def healthy(rep: dict[str, Any]) -> bool:
    """A report whose every check from inside the tree held: both processes' memory, the pipe between
    them, the thread, the file offset."""
    return bool(rep["memory_ok"] and rep["child_memory_ok"] and rep["pipe_ok"] and rep["thread_ok"]
                and rep["file_offset"] == 234)


class CriuTree:
    """A parent (a thread, a pipe to its child, a file at an offset) and its forked child, holding MB MiB
    of DATA ("random": incompressible; "weights": bf16) that the child keeps as its own ("private"),
    shares copy-on-write ("cow") or half of each ("half"). In its own session, its control dir fresh.
    DETACHED: started through an intermediate shell that exits, so the tree is not our child."""

    def __init__(self, mb: int = 32, *, data: str = "random", sharing: str = "private", detached: bool = False,
                 prefix: str = "gpusnap-criu-wl-", start_timeout: float = 60) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        self.log = open(self.dir / "log", "w")
        argv = [sys.executable, str(WORKLOAD), str(self.dir), str(mb), "gpusnap", data, sharing]
        if detached:
            argv = ["sh", "-c", 'setsid "$@" </dev/null >/dev/null 2>&1 &', "sh", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     start_new_session=True, cwd="/")
        deadline = time.monotonic() + start_timeout
        while not (self.dir / "ready").exists():
            if (not detached and self.proc.poll() is not None) or time.monotonic() > deadline:
                self.log.close()
                raise TreeError(f"the workload did not start: see {self.dir}/log")
            time.sleep(0.02)
        info = json.loads((self.dir / "ready").read_text())
        self.pid: int = info["pid"]
        self.child: int = info["child"]

    @property
    def pids(self) -> tuple[int, int]:
        return self.pid, self.child

    def states(self) -> dict[int, str]:
        return {p: proc_state(p) for p in self.pids}

    def report(self, timeout: float = 20) -> dict[str, Any]:
        """What the tree checks from inside (its memory, the child's, the pipe, the thread, the file)."""
        rep = self.dir / "report.json"
        rep.unlink(missing_ok=True)
        (self.dir / "cmd").write_text("report")
        deadline = time.monotonic() + timeout
        while not rep.exists():
            if time.monotonic() > deadline:
                raise TreeError(f"the tree did not answer (states {self.states()})")
            time.sleep(0.02)
        out: dict[str, Any] = json.loads(rep.read_text())
        return out

    def ok(self, timeout: float = 30) -> bool:
        """healthy(report()), False where the tree does not answer."""
        try:
            return healthy(self.report(timeout))
        except TreeError:
            return False

    def alive(self) -> bool:
        """The parent is there and not a zombie."""
        return proc_state(self.pid) not in ("gone", "Z")

    def running(self) -> bool:
        """Both processes are there, neither a zombie."""
        return all(s not in ("gone", "Z") for s in self.states().values())

    def reap(self) -> None:
        """Collect the original parent once CRIU (or a kill) ended it: a zombie holds its pid."""
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def gone(self, timeout: float = 60, zombies: bool = False) -> bool:
        """Until neither pid is held (ZOMBIES: or each is at most a zombie): CRIU restores the same pids."""
        self.reap()
        done = ("gone", "Z") if zombies else ("gone",)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(s in done for s in self.states().values()):
                return True
            time.sleep(0.02)
        return False

    def kill(self, timeout: float = 10) -> None:
        """SIGKILL both processes; wait until they are gone or zombies. The control dir stays (a
        restore of the tree uses it)."""
        for p in (self.child, self.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.gone(timeout, zombies=True)

    def close(self) -> None:
        """Kill the tree and remove its control dir."""
        self.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
