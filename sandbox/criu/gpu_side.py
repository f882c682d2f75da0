"""The GPU side of a CRIU dump or restore: the tree's CUDA processes and how their GPU state moves (GpuSide).

The driver's host copy (it then travels inside CRIU's images) or custom storage (the engine streams
it into the same snapshot as gpu/PID/INDEX streams, and CRIU dumps processes that hold no GPU
bytes); sandbox.gpu.state chooses (plan) and does the freezing and thawing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from storage.api import Progress
from storage.api import SnapshotStore

from sandbox.gpu.processes import uses_gpu
from sandbox.gpu.state import Plan as GpuPlan, plan as gpu_plan
from sandbox.ops import journal

if TYPE_CHECKING:
    from sandbox.gpu.state import EarlyRestore


class GpuSide:
    """The CUDA processes of a tree and how their GPU state moves: the driver's host copy (it then
    travels inside CRIU's images) or custom storage (the engine streams it into the same snapshot as
    gpu/PID/INDEX streams and CRIU dumps processes that hold no GPU bytes). The probe decides."""

    def __init__(self, pids: list[int], cuda_pids: list[int], driver: Any, plan: GpuPlan, device: Any) -> None:
        self.pids, self.cuda_pids, self.driver, self.device = pids, cuda_pids, driver, device
        self.plan = plan
        self.custom = bool(cuda_pids) and plan.streams
        self.engine: Any = None
        self.gpus: list[dict[str, Any]] = []  # this machine's GPUs, as the snapshot records them

    @classmethod
    def discover(cls, pids: list[int], root: int, driver: Any, features: Any, device: Any,
                 recorded: list[int] | None = None) -> "GpuSide":
        if recorded is not None:
            cuda = list(recorded)
        elif driver is not None:
            from sandbox.gpu.processes import cuda_processes
            cuda = [p for p in cuda_processes(root, driver) if p in pids]
        else:
            cuda = [p for p in pids if uses_gpu(p)]
        if cuda and driver is None:
            from sandbox.gpu.driver import CudaDriver
            driver = CudaDriver()
        if cuda and features is None:
            from sandbox.gpu.driver import probe
            features = probe(driver)
        side = cls(pids, cuda, driver, gpu_plan(features=features if cuda else None), device)
        side.gpus = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in features.gpus] if cuda else []
        return side

    @property
    def path(self) -> str | None:
        return None if not self.cuda_pids else "custom-storage" if self.custom else "host-staged"

    def __enter__(self) -> "GpuSide":
        if self.custom:
            from storage.api import GpuEngine
            self.engine = GpuEngine(0 if self.device is None else self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.engine is not None:
            self.engine.close()

    def _backend(self, regions: Any) -> Any:
        return self.plan.backend(regions)

    def swap_out(self, w: Any, lock_timeout_s: float, progress: Progress | None, op: journal.Op) -> None:
        """Before CRIU: every CUDA process locked and checkpointed (custom storage: streamed into W,
        the chunk references logged in OP's journal for recovery)."""
        from contextlib import nullcontext
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.state import Limits, checkpoint
        with (op.ref_log(w.sync_chunks) if self.custom else nullcontext()) as log:
            regions = EngineRegions.into(self.engine, w, progress, log=log) if self.custom else None
            checkpoint(self.driver, self.cuda_pids, self._backend(regions), Limits(lock_timeout_s=lock_timeout_s))

    def early_restore(self, gpu_map: dict[str, str] | None = None, usage: Any = None) -> "EarlyRestore | None":
        """On the driver's host copy: an EarlyRestore of the CUDA processes, through the driver swap_in
        uses (GPU_MAP, USAGE as there), for the split fill to start each one's copy as soon as its
        host memory is in; swap_in(early=...) then waits for them. None on custom storage (its bytes
        come from the store, not from the process's memory)."""
        if self.custom or not self.cuda_pids:
            return None
        from sandbox.gpu.device_map import for_restore
        from sandbox.gpu.state import EarlyRestore
        return EarlyRestore(for_restore(self.driver, gpu_map or {}, usage), self.cuda_pids, gpu_map)

    def swap_in(self, store: SnapshotStore, name: str, streams: list[Any], gpu_map: dict[str, str] | None = None,
                usage: Any = None, early: "EarlyRestore | None" = None) -> None:
        """After CRIU (restore, or a dump that must leave the tree as it was): GPU state back, unlocked;
        onto other GPUs by GPU_MAP (checked by sandbox.gpu.device_map.plan; USAGE: the snapshot's
        gpu_bytes, which GPUs each process held). EARLY: the copies early_restore() started, waited
        for first (a failed one fails the swap); the processes they restored are then only unlocked."""
        from sandbox.gpu.device_map import for_restore
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.state import thaw
        if early is not None:
            early.wait()
        regions = (EngineRegions(self.engine, source=store, name=name, streams=[s for s in streams if is_gpu_stream(s)])
                   if self.custom else None)
        thaw(early.drv if early is not None else for_restore(self.driver, gpu_map or {}, usage), self.cuda_pids,
             self._backend(regions), gpu_map=gpu_map or None)


def is_gpu_stream(stream: Any) -> bool:
    """A gpu/PID/INDEX stream (custom-storage GPU memory), not one of CRIU's images."""
    return stream.attrs.get("type") == "blob" and stream.name.startswith("gpu/")
