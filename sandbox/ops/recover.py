"""`gpusnap recover`: finish or undo every operation whose gpusnap process died, as its journal says.

For each journal record whose owner is gone (sandbox.ops.journal), in this order: wait for the helper it
left running (CRIU or runsc still finishing; killed as a group after a grace period); then
- criu-dump: snapshot committed by this operation -> the stopped tree is killed, as the user asked
  (unless --leave-running); otherwise the tree is resumed (SIGCONT) and its GPU state restored and
  unlocked (sandbox.gpu.state.resume);
- runsc-checkpoint: snapshot committed (without --leave-running) -> the sandbox stays stopped, as
  asked; otherwise a sandbox the checkpoint stopped is restarted from the staged checkpoint;
- criu-restore: GPU state of restored processes resumed; runsc-restore: a sandbox that did not come
  up is removed whole;
- gpu-checkpoint: snapshot committed -> the processes stay CHECKPOINTED, as asked; otherwise their
  GPU state is resumed;
and always the staging directory and the dead owner's temporary store files are removed and the
record deleted (then its reference log). Finally THP values left switched by dead processes are put back.

GPU state is resumed by the path that took it: host-staged through the driver's own copy; custom
storage through the same custom-storage restore `gpu restore` uses (sandbox.gpu.state.thaw), fed
from the chunks the operation's reference log (journal/OP.refs, storage.reflog) lists for each
process, or from the snapshot a restore reads or the operation committed. A process whose list is
incomplete, or that the driver still holds mid-operation, cannot get its memory back: recovery names
each lost region and the state the process stays in (Recovered.lost, and `ok` is false), and takes
that as the final outcome: the record goes, and its chunks are gc's to reclaim.

Guarantees kept here: only processes named in a record with the same pid AND start time are
signalled; only the staging directory named after the record's operation is removed; a record whose
recovery failed stays (the next `gpusnap recover` tries again) and the failure is reported.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from storage.store import SnapshotStore

from sandbox.ops import journal
from sandbox.host import hugepages
from sandbox.ops.journal import Journal, OpKind, OpRecord, Stage


@dataclass
class Recovered:
    """What recovery did for one interrupted operation."""

    op: str
    kind: str
    snapshot: str
    stage: str
    actions: list[str] = field(default_factory=list)
    error: str | None = None     # recovery failed; the record stays for another try
    lost: list[str] = field(default_factory=list)   # what no recovery can give back (final)

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "kind": self.kind, "snapshot": self.snapshot, "stage": self.stage,
                "actions": self.actions, "error": self.error, "lost": self.lost}


@dataclass
class RecoverReport:
    operations: list[Recovered] = field(default_factory=list)
    thp_put_back: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.error is None and not o.lost for o in self.operations)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "operations": [o.as_dict() for o in self.operations], "thp_put_back": self.thp_put_back}


DriverFactory = Callable[[], Any]


def _real_driver() -> Any:
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


@dataclass(frozen=True)
class GpuAccess:
    """How recovery reaches the GPU: the CheckpointDriver, and the engine's device (storage.device.Device
    or a GPU index) for a custom-storage restore; both made only when a record needs them."""

    driver: DriverFactory = _real_driver
    device: Callable[[], Any] = lambda: 0


def recover(store: SnapshotStore, *, gpu_driver: DriverFactory = _real_driver, gpu_device: Callable[[], Any] = lambda: 0,
            helper_wait_s: float = 600.0, thp_record_dir: str = hugepages.RECORD_DIR) -> RecoverReport:
    """Finish or undo every interrupted operation in STORE's journal; put THP back. GPU_DRIVER makes the
    CheckpointDriver when a record names CUDA processes, GPU_DEVICE the engine's device for a
    custom-storage restore (tests pass a stand-in's factory and HostDevice)."""
    j = Journal(store.path)
    report = RecoverReport()
    with _recover_lock(j):
        _recover_all(store, j, report, GpuAccess(gpu_driver, gpu_device), helper_wait_s)
    report.thp_put_back = [{"path": r.path, "value": r.before} for r in hugepages.put_back(thp_record_dir)]
    return report


@contextmanager
def _recover_lock(j: Journal) -> Iterator[None]:
    """One recovery at a time per store (a second waits): no record is handled twice."""
    os.makedirs(j.dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(j.dir, "recover.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _recover_all(store: SnapshotStore, j: Journal, report: RecoverReport, gpu: GpuAccess,
                 helper_wait_s: float) -> None:
    for rec in j.unfinished():
        done = Recovered(rec.op, rec.kind.value, rec.snapshot, rec.stage.value)
        report.operations.append(done)
        try:
            _wait_for_helpers(rec, helper_wait_s, done)
            _RECOVER[rec.kind](store, rec, gpu, done)
            _remove_staging(rec, done)
            _remove_owner_temps(store, rec, done)
            j.remove(rec.op)
        except Exception as e:  # noqa: BLE001 - reported; the record stays for another try
            done.error = str(e) or type(e).__name__
    for tmp in j.stale_temps():
        os.unlink(tmp)


def _wait_for_helpers(rec: OpRecord, wait_s: float, done: Recovered) -> None:
    """CRIU or runsc started by the dead owner (their command lines name its staging directory) end
    first: their end decides the state of the workload. Killed as a group after WAIT_S."""
    if not rec.staging:
        return
    helpers = journal.helpers_of(rec.staging)
    if not helpers:
        return
    left = journal.wait_gone(helpers, wait_s)
    if left:
        journal.signal_group_of(rec.staging, signal.SIGKILL)
        journal.wait_gone(left, 10)
        done.actions.append(f"killed helper process(es) {left} still running after {wait_s:g} s")
    else:
        done.actions.append(f"waited for helper process(es) {helpers} to finish")


def _committed(store: SnapshotStore, rec: OpRecord) -> bool:
    """The snapshot this operation wrote exists (its manifest carries the operation's id)."""
    if not rec.stage.at_least(Stage.COMMITTING):
        return False
    try:
        return store.exists(rec.snapshot) and store.load(rec.snapshot).meta.get("op") == rec.op
    except Exception:  # noqa: BLE001 - unreadable: not ours to trust
        return False


def _resume_gpu(store: SnapshotStore, rec: OpRecord, gpu: GpuAccess, done: Recovered) -> None:
    if not rec.cuda_pids:
        return
    from sandbox.gpu import state
    if rec.gpu_path == "custom-storage":
        _resume_custom(store, rec, gpu, done)
        return
    r = state.resume(gpu.driver(), list(rec.cuda_pids))
    done.actions.append(f"GPU state resumed (restored {r.restored}, unlocked {r.unlocked}, running {r.running}, "
                        f"gone {r.gone})")


def _custom_streams(store: SnapshotStore, rec: OpRecord) -> Callable[[int], tuple[list[Any], str | None]]:
    """pid -> (its gpu/ streams, None) where they are complete, else ([], what is missing): from the
    snapshot a restore reads or this operation committed, else from the operation's reference log."""
    if rec.kind == OpKind.CRIU_RESTORE or _committed(store, rec):
        m = store.load(rec.snapshot)

        def from_snapshot(pid: int) -> tuple[list[Any], str | None]:
            mine = [s for s in m.streams if s.name.startswith(f"gpu/{pid}/")]
            return (mine, None) if mine else ([], f"snapshot {rec.snapshot!r} has no GPU stream of it")
        return from_snapshot
    log = Journal(store.path).ref_log(rec.op)

    def from_log(pid: int) -> tuple[list[Any], str | None]:
        if log is None:
            return [], "the operation recorded no chunk of its GPU streams"
        why = log.group_problem(str(pid), f"gpu/{pid}/")
        return ([], why) if why else (log.streams([str(pid)]), None)
    return from_log


def _resume_custom(store: SnapshotStore, rec: OpRecord, gpu: GpuAccess, done: Recovered) -> None:
    """Processes whose GPU memory went through custom storage, back to RUNNING: a CHECKPOINTED one is
    restored through the custom-storage restore from its recorded chunks (sandbox.gpu.state.thaw,
    as `gpu restore` does), a LOCKED one unlocked; one that cannot be is named in done.lost."""
    from contextlib import nullcontext
    from sandbox.gpu import state
    from sandbox.gpu.driver import ProcessState as S
    from sandbox.gpu.regions import EngineRegions
    drv = gpu.driver()
    streams_of = _custom_streams(store, rec)
    thawable: list[int] = []
    streams: list[Any] = []
    for p in rec.cuda_pids:
        st = state._state(drv, p)
        if st is None:
            done.actions.append(f"pid {p} is gone (not a CUDA process any more)")
        elif st in (S.RUNNING, S.LOCKED):
            thawable.append(p)
        elif st == S.CHECKPOINTED:
            mine, why = streams_of(p)
            if why is None:
                thawable.append(p)
                streams += mine
            else:
                done.lost.append(f"pid {p}: its GPU memory is lost ({why}); it stays CHECKPOINTED (locked, "
                                 "without GPU memory: it cannot run again; end it)")
        else:
            done.lost.append(f"pid {p}: its GPU memory is lost (gpusnap died while the driver had it mapped "
                             f"into gpusnap's process); the driver holds it {st.name}: it cannot run again; end it")
    if not thawable:
        return
    # lanes large enough for the biggest chunk (the engine refuses chunks over its lane size)
    chunk = (max([4096, *(max(c.raw_len, c.stored_len) for s in streams for c in s.chunks)]) + 4095) & ~4095
    with (_engine(gpu, chunk) if streams else nullcontext()) as eng:
        regions = EngineRegions(eng, source=store, name=rec.snapshot, streams=streams) if eng is not None else None
        backend = (state.backend_for(state.GpuPath.CUSTOM_STORAGE, regions=regions) if regions is not None
                   else state.HostStaged(None))  # nothing to restore: only unlocks
        r = state.thaw(drv, thawable, backend)
    if r.restored:
        n = sum(len(s.chunks) for s in streams)
        done.actions.append(f"GPU memory of {list(r.restored)} restored through custom storage from the {n} "
                            "recorded chunk(s) and unlocked")
    if r.unlocked:
        done.actions.append(f"unlocked {list(r.unlocked)}")
    if r.running:
        done.actions.append(f"{list(r.running)} already running")


def _engine(gpu: GpuAccess, chunk_size: int) -> Any:
    from storage.gpu_engine import GpuEngine
    return GpuEngine(gpu.device(), chunk_size=chunk_size, lanes=2)


def _gpu_checkpoint(store: SnapshotStore, rec: OpRecord, gpu: GpuAccess, done: Recovered) -> None:
    if _committed(store, rec):
        done.actions.append(f"snapshot {rec.snapshot!r} was committed: its processes stay CHECKPOINTED, as asked "
                            f"(`gpusnap gpu restore {rec.snapshot}` brings them back)")
        return
    if rec.stage.at_least(Stage.GPU_FROZEN):
        _resume_gpu(store, rec, gpu, done)


def _criu_dump(store: SnapshotStore, rec: OpRecord, gpu: GpuAccess, done: Recovered) -> None:
    if _committed(store, rec):
        if not rec.leave_running:
            killed = [p.pid for p in journal.with_descendants(rec.procs) if p.signal(signal.SIGKILL)]
            done.actions.append(f"snapshot {rec.snapshot!r} was committed: killed the dumped tree {killed}, as asked")
        else:
            done.actions.append(f"snapshot {rec.snapshot!r} was committed")
            if rec.stage.at_least(Stage.GPU_FROZEN):
                _resume_gpu(store, rec, gpu, done)
        return
    if rec.stage.at_least(Stage.DUMPING):
        resumed = [p.pid for p in journal.with_descendants(rec.procs) if p.signal(signal.SIGCONT)]
        done.actions.append(f"no snapshot was committed: resumed the tree {resumed}")
    if rec.stage.at_least(Stage.GPU_FROZEN):
        _resume_gpu(store, rec, gpu, done)


def _criu_restore(store: SnapshotStore, rec: OpRecord, gpu: GpuAccess, done: Recovered) -> None:
    if rec.stage.at_least(Stage.DUMPING) and rec.cuda_pids:
        _resume_gpu(store, rec, gpu, done)


def _runsc(store: SnapshotStore, rec: OpRecord) -> tuple[Any, dict[str, Any]]:
    from sandbox.runsc.runner import Runsc
    sb = rec.runsc or {}
    if not isinstance(sb.get("container"), str) or not isinstance(sb.get("runsc_args"), list):
        raise journal.JournalError("runsc record without container or runsc flags")
    return Runsc([str(a) for a in sb["runsc_args"]], log_dir=os.path.join(store.path, "logs")), sb


def _runsc_checkpoint(store: SnapshotStore, rec: OpRecord, gpu: GpuAccess, done: Recovered) -> None:
    from sandbox.host import netns as nets
    from sandbox.runsc.snapshot import _gpu_back, _restart
    r, sb = _runsc(store, rec)
    cid = sb["container"]
    committed = _committed(store, rec)
    st = r.state(cid)
    images = os.path.join(rec.staging or "/nonexistent", "images")
    if committed and not rec.leave_running:
        done.actions.append(f"snapshot {rec.snapshot!r} was committed: sandbox {cid!r} stays stopped, as asked")
        return
    if st is not None and st.get("status") == "running":
        done.actions.append(f"sandbox {cid!r} is running")
    elif st is not None and os.path.isdir(images) and os.listdir(images):
        net = nets.NetConfig.from_dict(sb["net"]) if sb.get("net") else None
        _restart(r, cid, str(sb["bundle"]), images, net)
        done.actions.append(f"restarted sandbox {cid!r} from the staged checkpoint")
    else:
        raise journal.JournalError(f"sandbox {cid!r} is {st.get('status') if st else 'gone'} and no staged "
                                   "checkpoint is there to restart it from")
    rep = sb.get("gpu_report")
    if isinstance(rep, dict) and not committed:
        _gpu_back(r, cid, rep, store, str(rec.snapshot))
        done.actions.append(f"GPU state of sandbox {cid!r} restored by its agent")
        gpu_snap = rep.get("snapshot")
        if isinstance(gpu_snap, str) and store.exists(gpu_snap):
            store.remove(gpu_snap)  # the GPU part of a checkpoint that did not commit
            done.actions.append(f"removed the uncommitted checkpoint's GPU snapshot {gpu_snap!r}")


def _runsc_restore(store: SnapshotStore, rec: OpRecord, gpu: GpuAccess, done: Recovered) -> None:
    r, sb = _runsc(store, rec)
    cid = sb["container"]
    st = r.state(cid)
    if st is not None and st.get("status") == "running" and rec.stage.at_least(Stage.DUMPING):
        done.actions.append(f"sandbox {cid!r} was restored and runs")
        return
    if st is not None or r.sandbox_processes(cid):
        killed = r.clean_up(cid, sb.get("bundle"))
        done.actions.append(f"removed the half-restored sandbox {cid!r}" + (f" (killed {killed})" if killed else ""))


_RECOVER: dict[OpKind, Callable[[SnapshotStore, OpRecord, GpuAccess, Recovered], None]] = {
    OpKind.CRIU_DUMP: _criu_dump, OpKind.CRIU_RESTORE: _criu_restore,
    OpKind.RUNSC_CHECKPOINT: _runsc_checkpoint, OpKind.RUNSC_RESTORE: _runsc_restore,
    OpKind.GPU_CHECKPOINT: _gpu_checkpoint,
}


def _remove_staging(rec: OpRecord, done: Recovered) -> None:
    """The record's staging directory, only if it is the one named after this operation."""
    if not rec.staging or os.path.basename(rec.staging) != f"gpusnap-op-{rec.op}":
        return
    if os.path.islink(rec.staging) or not os.path.isdir(rec.staging):
        return
    shutil.rmtree(rec.staging)
    done.actions.append(f"removed staging {rec.staging}")


def _remove_owner_temps(store: SnapshotStore, rec: OpRecord, done: Recovered) -> None:
    """Temporary store files of the dead owner: tmp/KIND.PID-START-BOOT.... (storage.owner names them),
    this owner's pid and start time, and no longer alive."""
    from storage.owner import ProcessOwner
    n = 0
    for e in os.scandir(store.tmp_dir):
        parts = e.name.split(".")
        owner = ProcessOwner.parse(parts[1]) if len(parts) > 2 else None
        if (owner is not None and (owner.pid, owner.start) == (rec.owner.pid, rec.owner.start)
                and not owner.alive() and e.is_file(follow_symlinks=False)):
            os.unlink(e.path)
            n += 1
    if n:
        done.actions.append(f"removed {n} temporary store file(s) of the dead process {rec.owner.pid}")
