"""The driver stand-in with its state in a file: it outlives the process that drives it.

A gpusnap killed with SIGKILL takes an in-process stand-in's state with it, whereas the real driver's
state lives in the kernel and the GPU. This stand-in saves every process's state and memory to a JSON
file after each transition and loads it when made, so that a test can kill the process driving a
dump and let `recover` (in another process) find the GPU processes as the killed one left them.
"""
from __future__ import annotations

import json
import os
import threading

from sandbox.gpu.driver import ProcessState

from driver_standin import Proc, StandInDriver


class FileStandIn(StandInDriver):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self._save_lock = threading.Lock()  # checkpoint_all drives processes from several threads
        if os.path.exists(path):
            with open(path) as f:
                for pid, p in json.load(f).items():
                    self.procs[int(pid)] = Proc(bytearray.fromhex(p["gpu"]),
                                                None if p["host"] is None else bytearray.fromhex(p["host"]),
                                                ProcessState[p["state"]])

    def save(self) -> None:
        with self._save_lock:
            self._save()

    def _save(self) -> None:
        data = {str(pid): {"gpu": p.gpu.hex(), "host": None if p.host is None else p.host.hex(), "state": p.state.name}
                for pid, p in self.procs.items()}
        with open(self.path + ".tmp", "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(self.path + ".tmp", self.path)

    def add(self, pid: int, data: bytes) -> None:
        super().add(pid, data)
        self.save()

    def lock(self, pid: int, timeout_ms: int) -> None:
        super().lock(pid, timeout_ms)
        self.save()

    def unlock(self, pid: int) -> None:
        super().unlock(pid)
        self.save()

    def checkpoint(self, pid: int) -> None:
        super().checkpoint(pid)
        self.save()

    def restore(self, pid: int, gpu_map: dict[str, str] | None = None) -> None:
        super().restore(pid, gpu_map)
        self.save()
