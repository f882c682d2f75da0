"""GPU state alone into the store and back (model swap-out / swap-in), by the fastest path the driver offers.

custom-storage (driver with cuCheckpointOperationComplete): the driver maps each process's GPU memory
into this process and storage.gpu_engine streams it, compressed on the GPU, into the snapshot.
host-staged (drivers 550..580): the driver copies GPU memory into the process's own host memory; the
snapshot then records which processes hold their state and how to bring it back (the bytes stay in
the process until CRIU or runsc dumps it). Every snapshot's meta says which path made it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from storage.manifest import Manifest, Stream
from storage.store import SnapshotStore

from sandbox.gpu.driver import CheckpointDriver, CudaDriver, CudaDriverError, Features, ProcessState, probe
from sandbox.gpu.processes import cuda_processes
from sandbox.gpu.checkpoint import GpuCheckpointError, checkpoint_all, custom_checkpoint, custom_restore, restore_all
from sandbox.gpu.hugepages import thp
from sandbox.snapshot_meta import GpuMeta, GpuPath


from storage.errors import GpusnapError

class GpuSnapshotError(GpusnapError):
    """A GPU swap-out/in request that cannot be done as asked (bad pid, bad map, wrong snapshot)."""


@dataclass
class GpuReport:
    name: str
    path: str
    pids: list[int]
    seconds: dict[str, float]
    raw_bytes: int = 0
    stored_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "pids": self.pids,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes}


class EngineSpill:
    """RegionSpill through the engine's device: mapped regions parked in host memory and put back
    (the rollback of a custom-storage checkpoint whose streaming failed)."""

    def __init__(self, dev: Any) -> None:
        self.dev = dev
        self.saved: list[Any] = []

    def _copy(self, regions: list[Any], out: bool) -> None:
        stream = self.dev.new_stream()
        try:
            for r, buf in zip(regions, self.saved):
                if out:
                    self.dev.d2h(buf.ptr, r.dev_ptr, r.size, stream)
                else:
                    self.dev.h2d(r.dev_ptr, buf.ptr, min(r.size, buf.size), stream)
            self.dev.sync(stream)
        finally:
            self.dev.destroy_stream(stream)

    def save(self, regions: list[Any]) -> None:
        self.saved = [self.dev.pinned(r.size) for r in regions]
        self._copy(regions, out=True)

    def load(self, regions: list[Any]) -> None:
        try:
            self._copy(regions, out=False)
        finally:
            for b in self.saved:
                b.close()
            self.saved = []


def swap_out_custom(drv: CheckpointDriver, eng: Any, writer: Any, pids: list[int], *,
                    lock_timeout_s: float = 10.0, progress: Any = None) -> dict[str, float]:
    """Custom storage: lock PIDS, stream each one's mapped GPU memory into WRITER (streams
    gpu/PID/INDEX) through the engine, leaving them CHECKPOINTED (GPU memory released).

    All or nothing: on failure the processes already streamed get their memory back from the chunks
    just written, the rest are rolled back by custom_checkpoint, and every process is unlocked."""
    from storage.gpu_engine import Region
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    locked: list[int] = []
    try:
        for p in pids:
            drv.lock(p, int(lock_timeout_s * 1000))
            locked.append(p)
    except CudaDriverError as e:
        for p in locked:
            drv.unlock(p)
        raise GpuCheckpointError(f"lock failed: {e}; every process left running") from None
    seconds["lock"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    done: list[int] = []
    try:
        for p in pids:
            with custom_checkpoint(drv, p, EngineSpill(eng.dev)) as regions:
                res = eng.checkpoint(writer, [Region(f"gpu/{p}/{r.index}", r.dev_ptr, r.size) for r in regions],
                                     progress=progress)
            done.append(p)
            writer.meta.setdefault("gpu_stages", {})[str(p)] = res.stages.table()
    except BaseException:
        for p in done:
            _swap_back(drv, eng, writer.source, writer.streams, writer.name, p)
        for p in pids:
            if p not in done and drv.get_state(p) == ProcessState.LOCKED:
                drv.unlock(p)
        raise
    seconds["checkpoint+stream"] = time.perf_counter() - t0
    return seconds


def swap_in_custom(drv: CheckpointDriver, eng: Any, source: Any, manifest: Manifest, pids: list[int],
                   gpu_map: dict[str, str] | None = None) -> dict[str, float]:
    """Custom storage: each CHECKPOINTED pid's GPU memory filled from MANIFEST's gpu/PID/* streams, then unlocked."""
    t0 = time.perf_counter()
    for p in pids:
        _swap_back(drv, eng, source, manifest.streams, manifest.name, p, gpu_map)
    return {"restore+unlock": time.perf_counter() - t0}


def cuda_pids_of(root: int, drv: CheckpointDriver) -> list[int]:
    try:
        pids = cuda_processes(root, drv)
    except Exception as e:  # noqa: BLE001 - DiscoveryError: no such pid
        raise GpuSnapshotError(str(e)) from None
    if not pids:
        raise GpuSnapshotError(f"pid {root} and its children have no CUDA process (no /dev/nvidia* open, "
                               "and the driver knows none of them)")
    return pids


def gpu_checkpoint(store: SnapshotStore, root_pid: int, name: str, *, driver: CudaDriver | None = None,
                   lock_timeout_s: float = 10.0, thp_mode: str | None = "always", replace: bool = False,
                   progress: Any = None, features: Features | None = None, device: Any = None,
                   pids: list[int] | None = None) -> GpuReport:
    """Swap out the GPU state of ROOT_PID's CUDA processes into snapshot NAME.

    They are left CHECKPOINTED (GPU memory released) until gpu_restore. On any failure they are
    put back to RUNNING with their memory intact and no snapshot is left. device: the engine's
    storage.device.Device for the custom-storage path (default: GPU 0). pids: the CUDA processes when
    the caller has found them already (the in-sandbox agent: they need not descend from ROOT_PID).
    """
    drv = driver or CudaDriver()
    feats = features or probe(drv)
    pids = list(pids) if pids else cuda_pids_of(root_pid, drv)
    states = {p: drv.get_state(p) for p in pids}
    busy = {p: s for p, s in states.items() if s != ProcessState.RUNNING}
    if busy:
        raise GpuSnapshotError("; ".join(f"pid {p} is {s.name}, not RUNNING" for p, s in busy.items()))
    gpus = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in feats.gpus]
    meta = {"kind": "gpu", "gpu_path": feats.path, "root_pid": root_pid, "pids": pids, "gpus": gpus,
            "driver": feats.driver_version}
    seconds: dict[str, float] = {}
    with store.writer(name, replace=replace, meta=meta) as w:
        if feats.custom_storage:
            from storage.gpu_engine import GpuEngine
            with GpuEngine(0 if device is None else device) as eng:
                seconds.update(swap_out_custom(drv, eng, w, pids, lock_timeout_s=lock_timeout_s, progress=progress))
                try:
                    w.commit()
                except BaseException:
                    for p in pids:
                        _swap_back(drv, eng, store, w.streams, name, p)
                    raise
            return GpuReport(name, feats.path, pids, seconds, w.stats.raw_bytes, w.stats.bytes_new)
        if not feats.checkpoint_api:
            raise GpuSnapshotError(f"this driver has no checkpoint API ({feats.reason or 'driver too old'})")
        with thp(thp_mode):
            t = checkpoint_all(drv, pids, lock_timeout_s=lock_timeout_s)
        seconds.update(lock=t.lock_s, checkpoint=t.checkpoint_s)
        w.meta["held_by"] = "process host memory (driver host copy)"
        try:
            w.commit()
        except BaseException:
            restore_all(drv, pids)
            raise
    return GpuReport(name, feats.path, pids, seconds)


def _swap_back(drv: CheckpointDriver, eng: Any, store: SnapshotStore, streams: list[Stream], name: str,
               pid: int, gpu_map: dict[str, str] | None = None) -> None:
    """Custom-storage restore of PID from STREAMS (named gpu/PID/INDEX), then unlock it."""
    from storage.gpu_engine import Region
    with custom_restore(drv, pid, gpu_map) as op:
        targets = {f"gpu/{pid}/{r.index}": Region(f"gpu/{pid}/{r.index}", r.dev_ptr, r.size) for r in op.regions}
        eng.restore(store, Manifest(name, [s for s in streams if s.name in targets]), targets)
    drv.unlock(pid)


def parse_device_map(items: list[str], snapshot_gpus: list[dict[str, Any]], here: list[Any]) -> dict[str, str]:
    """--device-map OLD=NEW (index or UUID each) -> {old uuid: new uuid}, checked against both machines."""
    if not items:
        return {}
    def find(spec: str, gpus: list[dict[str, Any]], where: str) -> dict[str, Any]:
        for g in gpus:
            if spec == str(g["index"]) or spec == g["uuid"]:
                return g
        raise GpuSnapshotError(f"--device-map: no GPU {spec!r} {where}")
    here_d = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in here]
    out: dict[str, str] = {}
    for item in items:
        old, sep, new = item.partition("=")
        if not sep or not old or not new:
            raise GpuSnapshotError(f"--device-map {item!r}: expected OLD=NEW (GPU index or UUID)")
        g_old = find(old, snapshot_gpus, "in the snapshot")
        g_new = find(new, here_d, "on this machine")
        if g_old["name"] != g_new["name"]:
            raise GpuSnapshotError(f"--device-map {item}: {g_old['name']} state cannot be restored onto a {g_new['name']}")
        out[g_old["uuid"]] = g_new["uuid"]
    if len(set(out.values())) != len(out):
        raise GpuSnapshotError("--device-map maps two GPUs onto one")
    missing = [g["uuid"] for g in snapshot_gpus if g["uuid"] not in out]
    if missing:
        raise GpuSnapshotError(f"--device-map must list every checkpointed GPU; missing {', '.join(missing)}")
    return out


def gpu_restore(store: SnapshotStore, name: str, root_pid: int, *, device_map: list[str] | None = None,
                driver: CudaDriver | None = None, thp_mode: str | None = "always", progress: Any = None,
                features: Features | None = None, device: Any = None) -> GpuReport:
    """Swap the GPU state of snapshot NAME back into its processes and unlock them."""
    m = store.load(name)
    meta = GpuMeta.of(m)
    pids = list(meta.pids)
    if root_pid != meta.root_pid and root_pid not in pids:
        raise GpuSnapshotError(f"snapshot {name!r} was taken of pid {meta.root_pid}, not {root_pid}")
    drv = driver or CudaDriver()
    feats = features or probe(drv)
    gpu_map = parse_device_map(device_map or [], meta.gpus_json, feats.gpus)
    seconds: dict[str, float] = {}
    if meta.gpu_path == GpuPath.CUSTOM_STORAGE:
        from storage.gpu_engine import GpuEngine
        with GpuEngine(0 if device is None else device) as eng:
            seconds.update(swap_in_custom(drv, eng, store, m, pids, gpu_map))
    else:
        with thp(thp_mode):
            t = restore_all(drv, pids, gpu_map=gpu_map)
        seconds.update(restore=t.restore_s, unlock=t.unlock_s)
    return GpuReport(name, meta.gpu_path.value, pids, seconds)
