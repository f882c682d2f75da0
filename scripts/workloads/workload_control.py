"""Drive scripts/workloads/gpu_workload.py from tests and benchmarks, and open its memory through CUDA IPC
(the stand-in for the custom-storage mapping on drivers that lack it; never used by the product)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))


class Workload:
    def __init__(self, gb: float, mix: str = "realistic", seed: int = 1, timeout: float = 300,
                 detached: bool = False, script: str = "gpu_workload.py", extra: tuple[str, ...] = ()) -> None:
        """detached: own session, stdio on a log file (what CRIU needs to dump it without --shell-job).
        script: gpu_workload.py (one block of known data), serving_workload.py (a model server) or
        moe_workload.py (a two-process MoE-like tree); EXTRA: more arguments for it."""
        self.dir = tempfile.mkdtemp(prefix="gpusnap-wl-")  # fresh per run: no stale waiter shares it
        module = "scripts.workloads." + os.path.splitext(os.path.basename(script))[0]
        argv = [sys.executable, "-m", module, "--gb", str(gb), "--mix", mix, "--seed", str(seed), "--dir", self.dir, *extra]
        root = os.path.dirname(os.path.dirname(HERE))  # the repository: the workloads run as modules of it
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        if detached:
            self.log = open(os.path.join(self.dir, "log"), "w")
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                         start_new_session=True, cwd="/", env=env)
        else:
            self.proc = subprocess.Popen(argv, env=env)
        deadline = time.monotonic() + timeout
        ready = os.path.join(self.dir, "ready")
        while not os.path.exists(ready):
            if self.proc.poll() is not None:
                raise RuntimeError(f"workload exited with {self.proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError("workload not ready in time")
            time.sleep(0.05)
        with open(ready) as f:
            self.info: dict[str, Any] = json.load(f)
        self.pid: int = self.info["pid"]
        self.pids: list[int] = list(self.info.get("pids", [self.pid]))  # every CUDA process of the tree
        self.size: int = self.info["size"]

    def cmd(self, line: str, timeout: float = 600) -> dict[str, Any]:
        done = os.path.join(self.dir, "cmd.done")
        if os.path.exists(done):
            os.unlink(done)
        tmp = os.path.join(self.dir, "cmd.tmp")
        with open(tmp, "w") as f:
            f.write(line)
        os.rename(tmp, os.path.join(self.dir, "cmd"))
        deadline = time.monotonic() + timeout
        while not os.path.exists(done):
            if not self.alive():
                raise RuntimeError(f"workload {self.pid} is gone during {line!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"workload did not answer {line!r}")
            time.sleep(0.01)
        with open(done) as f:
            return json.load(f)

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def reap(self) -> None:
        """Collect the tree after CRIU killed it: a zombie holding a pid blocks restore. Our child is
        waited for; the tree's other processes come back to us when we are their subreaper (the
        benchmarks are), so every zombie child is collected until none of the tree's pids is left."""
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{p}") for p in self.pids) and time.monotonic() < deadline:
            try:
                os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.02)

    def verify(self) -> bool:
        return bool(self.cmd("verify")["ok"])

    def close(self) -> None:
        if self.alive():
            try:
                self.cmd("exit", timeout=30)
            except RuntimeError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.alive():  # a restored copy is not our child
            import signal
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def __enter__(self) -> "Workload":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def ipc_region(handle_hex: str) -> Iterator[int]:
    """Open another process's cuMemAlloc block in this process (current context); yields the pointer."""
    from cuda.bindings import driver as d
    import ctypes
    h = d.CUipcMemHandle()
    ctypes.memmove(h.getPtr(), bytes.fromhex(handle_hex), 64)
    err, ptr = d.cuIpcOpenMemHandle(h, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    if int(err) != 0:
        raise RuntimeError(f"cuIpcOpenMemHandle failed: {err}")
    try:
        yield int(ptr)
    finally:
        d.cuIpcCloseMemHandle(ptr)
