"""`gpusnap recover`: finish or undo every operation whose gpusnap process died, as its journal says.

For each journal record whose owner is gone (sandbox.journal), in this order: wait for the helper it
left running (CRIU or runsc still finishing; killed as a group after a grace period); then
- criu-dump: snapshot committed by this operation -> the stopped tree is killed, as the user asked
  (unless --leave-running); otherwise the tree is resumed (SIGCONT) and its GPU state restored and
  unlocked (sandbox.gpu.state.resume);
- runsc-checkpoint: snapshot committed (without --leave-running) -> the sandbox stays stopped, as
  asked; otherwise a sandbox the checkpoint stopped is restarted from the staged checkpoint;
- criu-restore: GPU state of restored processes resumed; runsc-restore: a sandbox that did not come
  up is removed whole;
and always the staging directory and the dead owner's temporary store files are removed and the
record deleted. Finally THP values left switched by dead processes are put back.

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

from sandbox import journal
from sandbox.gpu import hugepages
from sandbox.journal import Journal, OpKind, OpRecord, Stage


@dataclass
class Recovered:
    """What recovery did for one interrupted operation."""

    op: str
    kind: str
    snapshot: str
    stage: str
    actions: list[str] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "kind": self.kind, "snapshot": self.snapshot, "stage": self.stage,
                "actions": self.actions, "error": self.error}


@dataclass
class RecoverReport:
    operations: list[Recovered] = field(default_factory=list)
    thp_put_back: list[dict[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.error is None for o in self.operations)

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "operations": [o.as_dict() for o in self.operations], "thp_put_back": self.thp_put_back}


DriverFactory = Callable[[], Any]


def _real_driver() -> Any:
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


def recover(store: SnapshotStore, *, gpu_driver: DriverFactory = _real_driver, helper_wait_s: float = 600.0,
            thp_record_dir: str = hugepages.RECORD_DIR) -> RecoverReport:
    """Finish or undo every interrupted operation in STORE's journal; put THP back. GPU_DRIVER makes the
    CheckpointDriver when a record names CUDA processes (tests pass a stand-in's factory)."""
    j = Journal(store.path)
    report = RecoverReport()
    with _recover_lock(j):
        _recover_all(store, j, report, gpu_driver, helper_wait_s)
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


def _recover_all(store: SnapshotStore, j: Journal, report: RecoverReport, gpu_driver: DriverFactory,
                 helper_wait_s: float) -> None:
    for rec in j.unfinished():
        done = Recovered(rec.op, rec.kind.value, rec.snapshot, rec.stage.value)
        report.operations.append(done)
        try:
            _wait_for_helpers(rec, helper_wait_s, done)
            _RECOVER[rec.kind](store, rec, gpu_driver, done)
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


def _resume_gpu(rec: OpRecord, gpu_driver: DriverFactory, done: Recovered) -> None:
    if not rec.cuda_pids:
        return
    if rec.gpu_path == "custom-storage":
        raise journal.JournalError(f"GPU processes {list(rec.cuda_pids)} were checkpointed through custom storage, "
                                   "whose uncommitted GPU data recovery cannot read back; they stay locked")
    from sandbox.gpu import state
    r = state.resume(gpu_driver(), list(rec.cuda_pids))
    done.actions.append(f"GPU state resumed (restored {r.restored}, unlocked {r.unlocked}, running {r.running}, "
                        f"gone {r.gone})")


def _criu_dump(store: SnapshotStore, rec: OpRecord, gpu_driver: DriverFactory, done: Recovered) -> None:
    if _committed(store, rec):
        if not rec.leave_running:
            killed = [p.pid for p in rec.procs if p.signal(signal.SIGKILL)]
            done.actions.append(f"snapshot {rec.snapshot!r} was committed: killed the dumped tree {killed}, as asked")
        else:
            done.actions.append(f"snapshot {rec.snapshot!r} was committed")
            if rec.stage.at_least(Stage.GPU_FROZEN):
                _resume_gpu(rec, gpu_driver, done)
        return
    if rec.stage.at_least(Stage.DUMPING):
        resumed = [p.pid for p in rec.procs if p.signal(signal.SIGCONT)]
        done.actions.append(f"no snapshot was committed: resumed the tree {resumed}")
    if rec.stage.at_least(Stage.GPU_FROZEN):
        _resume_gpu(rec, gpu_driver, done)


def _criu_restore(store: SnapshotStore, rec: OpRecord, gpu_driver: DriverFactory, done: Recovered) -> None:
    if rec.stage.at_least(Stage.DUMPING) and rec.cuda_pids:
        _resume_gpu(rec, gpu_driver, done)


def _runsc(store: SnapshotStore, rec: OpRecord) -> tuple[Any, dict[str, Any]]:
    from sandbox.runsc.runner import Runsc
    sb = rec.runsc or {}
    if not isinstance(sb.get("container"), str) or not isinstance(sb.get("runsc_args"), list):
        raise journal.JournalError("runsc record without container or runsc flags")
    return Runsc([str(a) for a in sb["runsc_args"]], log_dir=os.path.join(store.path, "logs")), sb


def _runsc_checkpoint(store: SnapshotStore, rec: OpRecord, gpu_driver: DriverFactory, done: Recovered) -> None:
    from sandbox import netns as nets
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


def _runsc_restore(store: SnapshotStore, rec: OpRecord, gpu_driver: DriverFactory, done: Recovered) -> None:
    r, sb = _runsc(store, rec)
    cid = sb["container"]
    st = r.state(cid)
    if st is not None and st.get("status") == "running" and rec.stage.at_least(Stage.DUMPING):
        done.actions.append(f"sandbox {cid!r} was restored and runs")
        return
    if st is not None or r.sandbox_processes(cid):
        killed = r.clean_up(cid, sb.get("bundle"))
        done.actions.append(f"removed the half-restored sandbox {cid!r}" + (f" (killed {killed})" if killed else ""))


_RECOVER: dict[OpKind, Callable[[SnapshotStore, OpRecord, DriverFactory, Recovered], None]] = {
    OpKind.CRIU_DUMP: _criu_dump, OpKind.CRIU_RESTORE: _criu_restore,
    OpKind.RUNSC_CHECKPOINT: _runsc_checkpoint, OpKind.RUNSC_RESTORE: _runsc_restore,
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
