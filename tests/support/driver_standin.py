"""The stand-in for the CUDA driver's checkpoint state machine (for CI, which has no GPU): the one module tests use.

StandInDriver implements the documented transitions in memory and refuses every other one with the
error the driver gives (CUDA_ERROR_ILLEGAL_STATE); each process's "GPU memory" is a bytearray so tests
can check that rollback never loses or changes it. Faults are injected per pid and call.
GPUs (gpu_list) and where each process's memory sits on them (Proc.placement: GPU uuid -> bytes) are
modelled too: gpus() reports each GPU's free memory (total, less what other tenants hold (reserved)
and what RUNNING/LOCKED processes hold there), gpu_bytes() what a process holds (as NVML would), and
a restore with a GPU map refuses like the driver (a checkpointed GPU missing: INVALID_VALUE; too
little free memory on a target: OUT_OF_MEMORY) or moves the placement; Proc.maps records every map.
SharedStandIn is the same state machine with its state in a file, for everything that drives the
driver from more than one process (CRIU action scripts, the in-sandbox agent, a gpusnap killed -9 and
the `recover` after it). MemorySpill is a RegionSpill over the in-memory one.
"""
from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field

from sandbox.gpu.driver import CustomOperation, DeviceRegion, GpuInfo, ProcessState, driver_error

S = ProcessState


def address_of(b: bytearray) -> int:
    """The address of B's bytes: a region's devPtr in this process, as custom storage maps it (valid
    while B is not resized; the stand-in replaces buffers, never resizes them)."""
    return ctypes.addressof((ctypes.c_char * len(b)).from_buffer(b)) if len(b) else 0


@dataclass
class Proc:
    gpu: bytearray                       # device memory while RUNNING/LOCKED
    host: bytearray | None = None        # the driver's host copy while CHECKPOINTED (host path)
    state: ProcessState = S.RUNNING
    external: bytearray | None = None    # custom storage: the mapped region while CHECKPOINTING/RESTORING
    alive: bool = True
    ckpt_size: int = 0                   # custom storage: bytes the last custom checkpoint held
    placement: dict[str, int] = field(default_factory=dict)   # GPU uuid -> bytes it holds there
    maps: list[dict[str, str] | None] = field(default_factory=list)  # the GPU map of every restore


def standin_gpus(n: int, total: int = 1 << 30, name: str = "Stand-in GPU") -> list[GpuInfo]:
    """N stand-in GPUs of TOTAL bytes each, uuids GPU-0000000N-... (index N-1)."""
    return [GpuInfo(i, name, f"GPU-{i:08x}-0000-0000-0000-000000000000", total, (9, 0), None, False)
            for i in range(n)]


@dataclass
class StandInDriver:
    procs: dict[int, Proc] = field(default_factory=dict)
    fail: dict[tuple[int, str], str] = field(default_factory=dict)   # (pid, call) -> CUresult name
    delay: dict[tuple[int, str], float] = field(default_factory=dict)
    die_during: set[tuple[int, str]] = field(default_factory=set)   # the process exits mid-call
    calls: list[tuple[int, str]] = field(default_factory=list)
    stamps: list[tuple[int, str, float]] = field(default_factory=list)  # each call's time.monotonic() (system-wide)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _handles: dict[int, tuple[int, str]] = field(default_factory=dict)
    gpu_list: list[GpuInfo] = field(default_factory=list)
    reserved: dict[str, int] = field(default_factory=dict)   # GPU uuid -> bytes other tenants hold

    def add(self, pid: int, data: bytes, placement: dict[str, int] | None = None) -> None:
        self.procs[pid] = Proc(bytearray(data), placement=dict(placement or {}))

    # -- the GPUs (what CudaDriver.gpus() and gpu_bytes() report through NVML) ---------------------
    def gpus(self) -> list[GpuInfo]:
        from dataclasses import replace
        held: dict[str, int] = {}
        for p in self.procs.values():
            if p.alive and p.state not in (S.CHECKPOINTED,):
                for u, n in p.placement.items():
                    held[u] = held.get(u, 0) + n
        return [replace(g, free_bytes=max(0, g.total_bytes - self.reserved.get(g.uuid, 0) - held.get(g.uuid, 0)))
                for g in self.gpu_list]

    def gpu_bytes(self, pids: list[int]) -> dict[int, dict[str, int]]:
        return {p: dict(self.procs[p].placement) for p in pids
                if p in self.procs and self.procs[p].placement and self.procs[p].state != S.CHECKPOINTED}

    def _remap(self, pid: int, p: Proc, call: str, gpu_map: dict[str, str] | None) -> None:
        """The driver's checks of a GPU map, then the placement moved (the state is not changed)."""
        p.maps.append(dict(gpu_map) if gpu_map else None)
        if not gpu_map:
            return
        uuids = {g.uuid for g in self.gpu_list}
        if not set(p.placement) <= set(gpu_map) or not set(gpu_map.values()) <= uuids:
            raise driver_error(pid, call, "CUDA_ERROR_INVALID_VALUE", "the GPU map misses a checkpointed GPU")
        free = {g.uuid: g.free_bytes or 0 for g in self.gpus()}
        moved: dict[str, int] = {}
        for u, n in p.placement.items():
            moved[gpu_map[u]] = moved.get(gpu_map[u], 0) + n
        if any(n > free[u] for u, n in moved.items()):
            raise driver_error(pid, call, "CUDA_ERROR_OUT_OF_MEMORY")
        p.placement = moved

    def _enter(self, pid: int, call: str, allowed: tuple[ProcessState, ...]) -> Proc:
        with self._lock:
            self.calls.append((pid, call))
            self.stamps.append((pid, call, time.monotonic()))
        d = self.delay.get((pid, call))
        if d:
            time.sleep(d)
        p = self.procs.get(pid)
        if p is None or not p.alive:
            raise driver_error(pid, call, "CUDA_ERROR_NOT_FOUND")
        if (pid, call) in self.die_during:
            p.alive = False
            raise driver_error(pid, call, "CUDA_ERROR_NOT_FOUND", "process exited")
        r = self.fail.get((pid, call))
        if r:
            raise driver_error(pid, call, r)
        if p.state not in allowed:
            raise driver_error(pid, call, "CUDA_ERROR_ILLEGAL_STATE", f"is {p.state.name}")
        return p

    def get_state(self, pid: int) -> ProcessState:
        p = self.procs.get(pid)
        if p is None or not p.alive:
            raise driver_error(pid, "get_state", "CUDA_ERROR_NOT_FOUND")
        return p.state

    def lock(self, pid: int, timeout_ms: int) -> None:
        p = self._enter(pid, "lock", (S.RUNNING,))
        p.state = S.LOCKED

    def unlock(self, pid: int) -> None:
        p = self._enter(pid, "unlock", (S.LOCKED,))
        p.state = S.RUNNING

    def checkpoint(self, pid: int) -> None:
        p = self._enter(pid, "checkpoint", (S.LOCKED,))
        p.host, p.gpu, p.state = bytearray(p.gpu), bytearray(), S.CHECKPOINTED

    def restore(self, pid: int, gpu_map: dict[str, str] | None = None) -> None:
        p = self._enter(pid, "restore", (S.CHECKPOINTED,))
        assert p.host is not None
        self._remap(pid, p, "restore", gpu_map)
        p.gpu, p.host, p.state = bytearray(p.host), None, S.LOCKED

    def restore_thread_id(self, pid: int) -> int:
        self._enter(pid, "restore_thread_id", (S.CHECKPOINTED,))
        return pid

    def checkpoint_custom(self, pid: int) -> CustomOperation:
        p = self._enter(pid, "checkpoint_custom", (S.LOCKED,))
        p.external, p.gpu, p.state = p.gpu, bytearray(), S.CHECKPOINTING
        h = id(p.external)
        self._handles[h] = (pid, "checkpoint")
        return CustomOperation(h, [DeviceRegion(0, address_of(p.external), len(p.external), 0)])

    def restore_custom(self, pid: int, gpu_map: dict[str, str] | None = None) -> CustomOperation:
        p = self._enter(pid, "restore_custom", (S.CHECKPOINTED,))
        self._remap(pid, p, "restore_custom", gpu_map)
        p.external, p.state = bytearray(p.ckpt_size), S.RESTORING
        h = id(p.external)
        self._handles[h] = (pid, "restore")
        return CustomOperation(h, [DeviceRegion(0, address_of(p.external), len(p.external), 0)])

    def complete(self, pid: int, op: CustomOperation) -> None:
        owner, kind = self._handles.pop(op.handle, (None, None))
        if owner != pid:
            raise driver_error(pid, "complete", "CUDA_ERROR_INVALID_HANDLE")
        p = self.procs[pid]
        assert p.external is not None, "completing an operation that mapped no memory"
        if kind == "checkpoint":
            p.ckpt_size = len(p.external)
            p.external, p.state = None, S.CHECKPOINTED
        else:
            p.gpu, p.external, p.state = p.external, None, S.LOCKED

    def region_bytes(self, pid: int) -> bytearray:
        """What a region's devPtr points at (the test's stand-in for cuMemcpy)."""
        ext = self.procs[pid].external
        assert ext is not None
        return ext


class MemorySpill:
    """RegionSpill over the stand-in: copies the mapped bytes out and back."""

    def __init__(self, drv: StandInDriver, pid: int) -> None:
        self.drv, self.pid = drv, pid
        self.saved = b""

    def save(self, regions: list[DeviceRegion]) -> None:
        self.saved = bytes(self.drv.region_bytes(self.pid))

    def load(self, regions: list[DeviceRegion]) -> None:
        self.drv.region_bytes(self.pid)[:] = self.saved


class SharedStandIn:
    """The stand-in with its state in a file: one driver for every process that drives it, and one that
    outlives any of them (the real driver's state lives in the kernel and the GPU, not in gpusnap).

    Every call takes an exclusive lock (PATH.lock), loads the state (every process's state, GPU memory,
    host copy, injected faults and the calls made so far), runs StandInDriver's transition and writes
    the state back atomically. So a CRIU action script, an agent run per `runsc exec`, a gpusnap killed
    -9 and the `recover` after it all see one driver. A custom-storage operation maps memory into the
    process that runs it: from checkpoint_custom/restore_custom to complete(), that process keeps its
    copy of the state (the mapped region is its memory), and a process that dies in between leaves the
    state as the file last had it (the target CHECKPOINTING or RESTORING).

    alias: every pid a caller names is taken for this one process (a container's process, which the
    driver knows as one CUDA process while runc shows it under another host pid after a restore).
    """

    def __init__(self, path: str, *, alias: int | None = None) -> None:
        self.path = path
        self.alias = alias
        self._held: StandInDriver | None = None  # during a custom-storage operation: its mapped memory lives here

    @classmethod
    def create(cls, path: str, procs: dict[int, bytes], *, alias: int | None = None, gpus: list[GpuInfo] | None = None,
               placement: dict[int, dict[str, int]] | None = None, reserved: dict[str, int] | None = None
               ) -> "SharedStandIn":
        """A state file with PROCS (pid -> GPU memory) RUNNING; GPUS, each process's PLACEMENT on them
        and what other tenants hold (RESERVED) as StandInDriver models them."""
        d = StandInDriver(gpu_list=list(gpus or []), reserved=dict(reserved or {}))
        for pid, data in procs.items():
            d.add(pid, data, (placement or {}).get(pid))
        s = cls(path, alias=alias)
        s._save(d)
        return s

    def _save(self, d: StandInDriver) -> None:
        import os
        import pickle
        tmp = f"{self.path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"procs": d.procs, "fail": d.fail, "calls": d.calls, "gpu_list": d.gpu_list,
                         "reserved": d.reserved, "stamps": d.stamps}, f)
        os.replace(tmp, self.path)

    def load(self) -> StandInDriver:
        """The state as the file holds it now (an in-memory StandInDriver: procs, calls, fail)."""
        import pickle
        with open(self.path, "rb") as f:
            return StandInDriver(**pickle.load(f))

    @property
    def procs(self) -> dict[int, Proc]:
        return self.load().procs

    def add(self, pid: int, data: bytes) -> None:
        """One more RUNNING process holding GPU memory DATA."""
        self._call("add", pid, data)

    def _call(self, name: str, pid: int, *args: object) -> object:
        import fcntl
        if self.alias is not None:
            pid = self.alias
        with open(self.path + ".lock", "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            d = self._held or self.load()
            try:
                out = getattr(d, name)(pid, *args)
                if name in ("checkpoint_custom", "restore_custom"):
                    self._held = d  # the regions point into this process's copy until complete()
                elif name == "complete":
                    self._held = None
                return out
            finally:
                self._save(d)

    def get_state(self, pid: int) -> ProcessState:
        return self._call("get_state", pid)  # type: ignore[return-value]

    def gpus(self) -> list[GpuInfo]:
        return self.load().gpus()

    def gpu_bytes(self, pids: list[int]) -> dict[int, dict[str, int]]:
        return self.load().gpu_bytes(pids)

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._call("lock", pid, timeout_ms)

    def unlock(self, pid: int) -> None:
        self._call("unlock", pid)

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", pid)

    def restore(self, pid: int, gpu_map: dict[str, str] | None = None) -> None:
        self._call("restore", pid, gpu_map)

    def restore_thread_id(self, pid: int) -> int:
        return self._call("restore_thread_id", pid)  # type: ignore[return-value]

    def checkpoint_custom(self, pid: int) -> CustomOperation:
        return self._call("checkpoint_custom", pid)  # type: ignore[return-value]

    def restore_custom(self, pid: int, gpu_map: dict[str, str] | None = None) -> CustomOperation:
        return self._call("restore_custom", pid, gpu_map)  # type: ignore[return-value]

    def complete(self, pid: int, op: CustomOperation) -> None:
        self._call("complete", pid, op)
