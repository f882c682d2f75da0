"""GPU state alone into the store and back (model swap-out / swap-in), by the fastest path the driver offers.

custom-storage (driver with cuCheckpointOperationComplete): the driver maps each process's GPU memory
into this process and storage.pipeline.gpu_engine streams it, compressed on the GPU, into the snapshot.
host-staged (drivers 550..580): the driver copies GPU memory into the process's own host memory; the
snapshot then records which processes hold their state and how to bring it back (the bytes stay in
the process until CRIU or runsc dumps it). Every snapshot's meta says which path made it.

A checkpoint is an operation in the journal (sandbox.ops.journal, kind gpu-checkpoint): its record is on
disk before the first process is locked, and on the custom-storage path the chunk references of every
gpu/ stream are logged as they are stored (each process's list complete and durable before the
driver releases its memory), so that if gpusnap dies before the commit `gpusnap recover` gives every
process its GPU memory back from the store and unlocks it. A restore is one too (kind gpu-restore):
if it fails or gpusnap dies mid-way, its undo (sandbox.gpu.operations.GpuRestore) unlocks every process
whose memory is back and leaves the others CHECKPOINTED, for `gpu restore` to bring back.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from storage.api import Progress
from storage.api import SnapshotStore

from sandbox.ops import journal
from sandbox.host.dumpwrites import dump_packs_direct

from sandbox.gpu import device_map as dmap
from sandbox.host import hugepages
from sandbox.gpu.driver import CheckpointDriver, CudaDriver, Features, ProcessState, probe
from sandbox.gpu.processes import cuda_processes
from sandbox.gpu.regions import EngineRegions
from sandbox.gpu.state import GpuPath, Limits, Plan, freeze, plan, thaw
from sandbox.ops.journal import OpKind, Stage
from sandbox.ops.operations import GpuAccess, Undo, undone_on_failure
import sandbox.gpu.operations  # noqa: F401 - registers GpuCheckpoint and GpuRestore, the undos this flow runs
from sandbox.ops.hooks import Hook, resume_meta
from sandbox.ops.snapshot_meta import GpuInfo, GpuMeta


from storage.api import GpusnapError

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
                   progress: Progress | None = None, features: Features | None = None, device: Any = None,
                   tags: Sequence[str] = (),
                   pids: list[int] | None = None, resume: Hook | None = None) -> GpuReport:
    """Swap out the GPU state of ROOT_PID's CUDA processes into snapshot NAME.

    They are left CHECKPOINTED (GPU memory released) until gpu_restore. On any failure they are
    put back to RUNNING with their memory intact and no snapshot is left. device: the engine's
    storage.gpu.device.Device for the custom-storage path (default: GPU 0). pids: the CUDA processes when
    the caller has found them already. resume: the workload's resume step, recorded (MACed) in the
    snapshot for `gpu restore` (sandbox.ops.hooks).
    """
    hugepages.policy()  # a bad GPUSNAP_THP fails here, before a process is touched
    direct_packs = dump_packs_direct()  # and a bad GPUSNAP_DUMP_DIRECT
    drv = driver or CudaDriver()
    feats = features or probe(drv)
    gp = plan(features=feats, thp_mode=thp_mode)
    path = gp.path
    pids = list(pids) if pids else cuda_pids_of(root_pid, drv)
    busy = {p: drv.get_state(p) for p in pids}
    busy = {p: s for p, s in busy.items() if s != ProcessState.RUNNING}
    if busy:  # a snapshot of an already checkpointed process would not hold its GPU memory
        raise GpuSnapshotError("; ".join(f"pid {p} is {s.name}, not RUNNING" for p, s in busy.items()))
    gpus = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in feats.gpus]
    usage = _recorded_usage(drv, pids, gpus)  # what a --device-map restore checks against free memory
    with journal.operation(store.path, OpKind.GPU_CHECKPOINT, name, pids=pids, cuda_pids=tuple(pids),
                           gpu_path=path.value) as op:
        # op and op_mac: how recovery tells this operation's commit from any other manifest of the name
        meta = GpuMeta(path, root_pid, tuple(pids), tuple(GpuInfo(g.index, g.uuid, g.name) for g in feats.gpus),
                       feats.driver_version, {int(p): u for p, u in usage.items()},
                       extra={"op": op.id, "op_mac": op.commit_mac(pids), **resume_meta(op, name, resume)}).to_json()
        with store.writer(name, replace=replace, meta=meta, tags=tuple(tags), direct_packs=direct_packs) as w, \
                _engine(path, device) as eng, \
                (op.ref_log(w.sync_chunks) if eng is not None else nullcontext()) as log:
            rep = _checkpoint_in(op, w, eng, log, drv, pids, gp, lock_timeout_s, progress)
    return GpuReport(name, path.value, pids, dict(rep.seconds), w.stats.raw_bytes, w.stats.bytes_new)


def _recorded_usage(drv: CheckpointDriver, pids: list[int], gpus: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{"PID": {GPU uuid: bytes}} the processes hold now, on the GPUs the snapshot records ({}: unknown)."""
    known = {g["uuid"] for g in gpus}
    return {str(p): {u: n for u, n in per.items() if u in known}
            for p, per in dmap.usage_of(drv, pids).items() if any(u in known for u in per)}


def _checkpoint_in(op: journal.Op, w: Any, eng: Any, log: Any, drv: CheckpointDriver, pids: list[int],
                   gp: Plan, lock_timeout_s: float, progress: Progress | None) -> Any:
    """Freeze, stream (custom storage) and commit inside the operation's record and writer."""
    regions = EngineRegions.into(eng, w, progress, log=log) if eng is not None else None
    backend = gp.backend(regions)
    op.advance(Stage.GPU_FROZEN)
    try:
        with freeze(drv, pids, backend, Limits(lock_timeout_s=lock_timeout_s)) as rep:
            if gp.path == GpuPath.HOST_STAGED:
                w.meta["held_by"] = "process host memory (driver host copy)"
            journal.pause("before-commit")
            op.advance(Stage.COMMITTING)
            w.commit()
            op.advance(Stage.COMMITTED)
    except BaseException:
        # the undo (freeze's) failed to give some process its memory back: recovery must try again
        op.keep = not _all_running(drv, pids)
        raise
    return rep


def _all_running(drv: CheckpointDriver, pids: list[int]) -> bool:
    """Every pid RUNNING (or gone: nothing to give back)."""
    for p in pids:
        try:
            if drv.get_state(p) != ProcessState.RUNNING:
                return False
        except Exception:  # noqa: BLE001 - gone
            continue
    return True


@contextmanager
def _engine(path: GpuPath, device: Any) -> Iterator[Any]:
    """The GPU engine the custom-storage path streams through (None for the host-staged path)."""
    if path != GpuPath.CUSTOM_STORAGE:
        yield None
        return
    from storage.api import GpuEngine
    with GpuEngine(0 if device is None else device) as eng:
        yield eng


def parse_device_map(items: list[str], snapshot_gpus: list[dict[str, Any]], here: list[Any]) -> dict[str, str]:
    """--device-map OLD=NEW (index or UUID each) -> {old uuid: new uuid}, checked against both machines
    (sandbox.gpu.device_map.parse; DeviceMapError names what is wrong)."""
    return dmap.parse(items, snapshot_gpus, here)


def gpu_restore(store: SnapshotStore, name: str, root_pid: int, *, device_map: list[str] | None = None,
                driver: CudaDriver | None = None, thp_mode: str | None = "always", progress: Progress | None = None,
                features: Features | None = None, device: Any = None, from_remote: str | None = None,
                jobs: int | None = None) -> GpuReport:
    """Swap the GPU state of snapshot NAME back into its processes and unlock them (those already
    RUNNING are left alone). FROM_REMOTE: a store that lacks NAME gets it from that remote (JOBS
    requests at once) while the engine restores: each region's chunks are read as they arrive, and
    the local snapshot is committed once every chunk is local; a failure commits nothing."""
    hugepages.policy()  # a bad GPUSNAP_THP fails here, before anything is read or touched
    with ExitStack() as stack:
        fill = None
        if from_remote is not None and not store.exists(name):
            from storage.api import DEFAULT_JOBS, Remote
            from storage.api import RemoteFill
            fill = stack.enter_context(RemoteFill(Remote.open(store, from_remote, jobs or DEFAULT_JOBS), store, name,
                                                  progress=progress))
        m = fill.manifest if fill is not None else store.load(name)
        assert m is not None
        meta = GpuMeta.of(m)
        pids = list(meta.pids)
        if root_pid != meta.root_pid and root_pid not in pids:
            raise GpuSnapshotError(f"snapshot {name!r} was taken of pid {meta.root_pid}, not {root_pid}")
        drv = driver or CudaDriver()
        feats = features or probe(drv)
        gpu_map: dict[str, str] = {}
        if device_map:  # checked before anything is pulled or restored: a bad map changes nothing
            gpu_map = dmap.plan(device_map, meta.gpus_json, dmap.gpus_here(drv, feats), meta.gpu_bytes).gpu_map
        gp = plan(recorded=meta.gpu_path, thp_mode=thp_mode)
        path = gp.path
        op = stack.enter_context(journal.operation(store.path, OpKind.GPU_RESTORE, name, pids=pids,
                                                   cuda_pids=tuple(pids), gpu_path=path.value))
        # the one undo (sandbox.gpu.operations.GpuRestore), run here on a failure and by `gpusnap recover`
        stack.enter_context(undone_on_failure(op, Undo(store, GpuAccess(driver=lambda: drv)), GpuSnapshotError,
                                              what="GPU restore"))
        source: Any = store
        if fill is not None:
            from storage.api import ArrivingSource
            source = ArrivingSource(store, fill)
            fill.first([c for s in m.streams for c in s.chunks])  # in the order the engine restores them
            fill.start()
        journal.pause("before-restore")
        with _engine(path, device) as eng:
            regions = EngineRegions.of(eng, source, m, progress) if eng is not None else None
            op.advance(Stage.FILLING)
            rep = thaw(dmap.for_restore(drv, gpu_map, meta.gpu_bytes), pids, gp.backend(regions),
                       gpu_map=gpu_map or None)
        seconds = dict(rep.seconds)
        if fill is not None:  # the processes run; the local copy is committed once every chunk is in
            fill.finish()
            seconds["all_local"] = fill.seconds_to_all_local or 0.0
            if fill.seconds_to_first_read is not None:
                seconds["first_chunk_read"] = fill.seconds_to_first_read
    return GpuReport(name, path.value, pids, seconds)
