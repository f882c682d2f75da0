"""`gpusnap recover`: finish or undo every operation whose gpusnap process died, as its journal says.

For each journal record whose owner is gone (sandbox.ops.journal), in this order: check that it is one
to act on (its MAC under the host key, sandbox.ops.trust, for this store directory, and the current
record of its operation as the host-local state says, or of an earlier boot; a record that fails,
or a file that is no record, is set aside, nothing it names is signalled, and the report is not ok);
a record of an earlier boot (a power loss) signals nothing: only its staging, temporary files and
record are removed; otherwise wait for the helpers it recorded as they
started (CRIU or runsc still finishing; killed as a group after a grace period); then the undo of its
kind (sandbox.ops.operations; each kind's module beside its flow: the same undo the operation runs
itself when it fails):
- criu-dump: snapshot committed by this operation (its manifest names the operation and carries the
  commit MAC) -> the stopped tree is killed, as the user asked (unless --leave-running); otherwise the
  tree is resumed (SIGCONT) and its GPU state restored and unlocked;
- criu-restore: a tree restored stopped for the split fill and not yet filled is killed (it never ran;
  the snapshot restores again); otherwise GPU state of restored processes resumed;
- runsc-checkpoint: snapshot committed (without --leave-running) -> the sandbox stays stopped, as
  asked; otherwise a sandbox the checkpoint stopped is restarted from the staged checkpoint
  (sandbox.runsc.operations); runsc-restore: a sandbox that did not come up is removed whole;
- gpu-checkpoint: snapshot committed -> the processes stay CHECKPOINTED, as asked; otherwise their
  GPU state is resumed;
- gpu-restore: processes whose GPU memory is back (LOCKED) are unlocked; CHECKPOINTED ones stay so
  (`gpu restore` again brings them back); one the driver holds mid-restore is named as lost;
- workload-prepared (after every other kind): a hook step the dead gpusnap left running is waited for
  at most the step's own timeout, then killed as a group; the recorded resume step runs if a
  process the record names still lives and runs (sandbox.ops.prepared);
and always the staging directory and the dead owner's temporary store files are removed and the
record deleted (then its reference log). Finally THP values left switched by dead processes are put back.

GPU state is resumed by the path that took it: host-staged through the driver's own copy; custom
storage through the same custom-storage restore `gpu restore` uses (sandbox.gpu.state.thaw), fed
from the chunks the operation's reference log (journal/OP.refs, storage.repo.reflog) lists for each
process, or from the snapshot a restore reads or the operation committed. A process whose list is
incomplete, or that the driver still holds mid-operation, cannot get its memory back: recovery names
each lost region and the state the process stays in (Recovered.lost, and `ok` is false), and takes
that as the final outcome: the record goes, and its chunks are gc's to reclaim.

Guarantees kept here: only processes named in a record to act on, of this boot, with the same pid
AND start time are signalled, helpers only through the process group they were recorded leading (never
found by command line); only the staging directory named after the record's operation, a directory of
gpusnap's user, is removed; a record whose
recovery failed stays (the next `gpusnap recover` tries again) and the failure is reported.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import stat
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from storage.api import SnapshotStore

from sandbox.ops import journal
from sandbox.host import hugepages
from sandbox.ops import opstate
from sandbox.ops.journal import Journal, OpRecord, Proc
from sandbox.ops.operations import GpuAccess, Recovered, Undo, operation_for
# every kind registers its Operation on import: recover undoes every kind, so it sits above every flow
import sandbox.criu.operations  # noqa: F401
from sandbox.gpu.operations import real_driver
import sandbox.runsc.operations  # noqa: F401
import sandbox.ops.prepared  # noqa: F401


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


def recover(store: SnapshotStore, *, gpu_driver: DriverFactory = real_driver, gpu_device: Callable[[], Any] = lambda: 0,
            helper_wait_s: float = 600.0, thp_record_dir: str = hugepages.RECORD_DIR,
            trust_old_key: bool = False) -> RecoverReport:
    """Finish or undo every interrupted operation in STORE's journal; put THP back. GPU_DRIVER makes the
    CheckpointDriver when a record names CUDA processes, GPU_DEVICE the engine's device for a
    custom-storage restore (tests pass a stand-in's factory and HostDevice). TRUST_OLD_KEY: act on records
    an older gpusnap made under the key it kept inside the store (once, to migrate; never for a copied store)."""
    j = Journal(store.path, trust_old_key=trust_old_key)
    report = RecoverReport()
    with _recover_lock(j):
        _recover_all(store, j, report, GpuAccess(driver=gpu_driver, device=gpu_device), helper_wait_s)
    report.thp_put_back = [{"path": r.path, "value": r.before} for r in hugepages.put_back(thp_record_dir)]
    return report


@contextmanager
def _recover_lock(j: Journal) -> Iterator[None]:
    """One recovery at a time per store (a second waits): no record is handled twice."""
    os.makedirs(j.dir, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(j.dir, "recover.lock"),
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise journal.JournalError(f"{j.dir}/recover.lock is not a regular file; remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _recover_all(store: SnapshotStore, j: Journal, report: RecoverReport, gpu: GpuAccess,
                 helper_wait_s: float) -> None:
    recs, bad = j.scan()
    for b in bad:
        done = Recovered(b.op, "unknown", "", "unknown")
        report.operations.append(done)
        try:
            where = j.set_aside(b.op)
        except OSError as e:
            where = f"left in place ({e.strerror or e})"
        done.error = f"journal record {b.op}: {b.why}: nothing was done for it; set aside as {where}"
    # a workload left prepared is told to resume last: its dump's undo resumes the tree first
    for rec in sorted(recs, key=lambda r: r.kind == journal.OpKind.WORKLOAD_PREPARED):
        if not (rec.other_boot or not rec.owner.alive()):
            continue  # its gpusnap still runs it
        done = Recovered.of(rec)
        report.operations.append(done)
        if rec.untrusted is not None:
            _refuse(j, rec, done)
            continue
        try:
            if rec.other_boot:
                # written before a reboot (a power loss): every process it names went with that boot, and a
                # pid and start time of this boot that match one are somebody else's: nothing is signalled
                done.actions.append("written before this boot: the processes it names are gone, nothing signalled")
            else:
                # a hook step left running by the dead gpusnap gets no longer than the deadline it was given
                wait = (min(helper_wait_s, float(rec.resume["timeout_s"]))
                        if rec.kind == journal.OpKind.WORKLOAD_PREPARED and rec.resume else helper_wait_s)
                _wait_for_helpers(rec, wait, done)
                operation_for(rec, Undo(store, gpu)).undo(done)
            _remove_staging(rec, done)
            _remove_owner_temps(store, rec, done)
            j.remove(rec.op)
        except Exception as e:  # noqa: BLE001 - reported; the record stays for another try
            done.error = str(e) or type(e).__name__
    for tmp in j.stale_temps():
        os.unlink(tmp)
    _forget_orphan_states(j)


def _forget_orphan_states(j: Journal) -> None:
    """This store's host-local operation states whose owner died and whose record is gone (gpusnap killed
    between removing the record and its state, or the record removed by someone else): forgotten, so
    that no record put back later is ever taken for current."""
    for st in opstate.every():
        if (st.store == j.store_id and not Proc(*st.owner).alive()
                and not os.path.lexists(os.path.join(j.dir, f"{st.op}.json"))):
            opstate.remove(st.op)


def _refuse(j: Journal, rec: OpRecord, done: Recovered) -> None:
    """A record gpusnap did not write (no valid MAC): nothing it names is signalled or removed; it is
    set aside so that it blocks no other command, and the report says so (not ok)."""
    try:
        where = j.set_aside(rec.op)
    except OSError as e:
        where = f"left in place ({e.strerror or e})"
    done.error = (f"journal record {rec.op} is not one gpusnap wrote (or not one in force) ({rec.untrusted}): "
                  f"nothing it names was signalled or removed; the record was set aside as {where}")


def _wait_for_helpers(rec: OpRecord, wait_s: float, done: Recovered) -> None:
    """CRIU or runsc started by the dead owner (recorded with pid, start time and process group as they
    started) end first: their end decides the state of the workload. Killed as a group after WAIT_S."""
    helpers = [h for h in rec.helpers if h.alive()]
    if not helpers:
        return
    pids = [h.pid for h in helpers]
    left = journal.wait_gone(pids, wait_s)
    if left:
        killed = journal.signal_helpers([h for h in helpers if h.pid in left], signal.SIGKILL)
        journal.wait_gone(left, 10)
        done.actions.append(f"killed helper process(es) {killed} still running after {wait_s:g} s")
    else:
        done.actions.append(f"waited for helper process(es) {pids} to finish")


def _remove_staging(rec: OpRecord, done: Recovered) -> None:
    """The record's staging directory, only if it is the one named after this operation."""
    if not rec.staging or os.path.basename(rec.staging) != f"gpusnap-op-{rec.op}":
        return
    try:
        st = os.lstat(rec.staging)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return  # not the private directory gpusnap made for it
    shutil.rmtree(rec.staging)
    done.actions.append(f"removed staging {rec.staging}")


def _remove_owner_temps(store: SnapshotStore, rec: OpRecord, done: Recovered) -> None:
    """Temporary store files of the dead owner: tmp/KIND.PID-START-BOOT.... (storage.fs.owner names them),
    this owner's pid and start time, and no longer alive."""
    from storage.api import ProcessOwner
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
