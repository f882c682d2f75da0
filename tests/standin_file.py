"""The driver stand-in with its state in a JSON file, for GPU orchestration across processes (test only).

CRIU runs the action script as a new process at every action, so the "GPU process" state the stand-in
keeps (state, device bytes, host copy) must outlive each run: every driver call loads the file under an
exclusive lock, runs the in-memory StandInDriver's transition, and writes the file back. The file holds
one "GPU process" (a container's process): any pid names it, as a restored container's process gets a
new host pid but is the same CUDA process to the driver.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from driver_standin import Proc, StandInDriver
from sandbox.gpu.driver import ProcessState

_ONE = 1   # the key of the one process inside the in-memory stand-in


def create(path: str, gpu: bytes, fail: dict[str, str] | None = None) -> None:
    """A state file with one RUNNING process holding GPU bytes GPU; FAIL: call -> CUresult to inject."""
    with open(path, "w") as f:
        json.dump({"state": "RUNNING", "gpu": gpu.hex(), "host": None, "calls": [], "fail": fail or {}}, f)


def load(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


class FileStandIn:
    """A CheckpointDriver whose one process's state lives in PATH (shared by every hook run)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    @contextmanager
    def _driver(self) -> Iterator[StandInDriver]:
        with self._lock, open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            s = json.load(f)
            drv = StandInDriver()
            drv.procs[_ONE] = Proc(bytearray.fromhex(s["gpu"]), None if s["host"] is None else bytearray.fromhex(s["host"]),
                                   ProcessState[s["state"]])
            drv.fail = {(_ONE, call): r for call, r in s["fail"].items()}
            try:
                yield drv
            finally:
                p = drv.procs[_ONE]
                s.update(state=p.state.name, gpu=p.gpu.hex(), host=None if p.host is None else p.host.hex(),
                         calls=s["calls"] + [c for _, c in drv.calls])
                f.seek(0)
                f.truncate()
                json.dump(s, f)
                f.flush()
                os.fsync(f.fileno())

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(pid: int, *args: Any, **kwargs: Any) -> Any:
            with self._driver() as drv:
                return getattr(drv, name)(_ONE, *args, **kwargs)
        return call
