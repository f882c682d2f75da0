"""A workload told to prepare for a snapshot, and told to resume after it: the journaled part of the hooks
(sandbox.ops.hooks runs the steps).

`prepared(...)` wraps a dump or checkpoint: it journals a `workload-prepared` record (the workload's
processes and the resume step, MACed like every record) before the prepare step runs, and removes it
once the workload was resumed or is gone. `resumed(...)` does the same around the resume step after a
restore. The `workload-prepared` kind's undo (WorkloadPrepared, registered here) is what `gpusnap recover`
runs for a gpusnap killed in between: the recorded resume step, if a process the record names (pid AND
start time) still lives; recovery runs it after the other kinds' undos, so that the tree was resumed
(SIGCONT, GPU state back) before it is told to go on.

Guarantees kept here:
- the record is on disk before the prepare step starts; a record whose resume step failed stays (op.keep)
  so that `gpusnap recover` tries again;
- a prepare step that fails or times out: the resume step runs (the workload goes on), no snapshot is
  taken, and one HookError says what happened;
- a dump or checkpoint that fails after the prepare: the resume step runs once the flow's own undo has
  put the tree back, and the flow's error propagates (naming the resume step's failure if it failed too);
- success: the resume step runs when the workload still runs (--leave-running, a restore); a dump that
  ended the workload as asked runs none (the snapshot records it for its restore).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from storage.api import SnapshotStore

from sandbox.host.processes import process_tree, state_of
from sandbox.ops import hooks, journal
from sandbox.ops.hooks import HookError, HookRun, Step, WorkloadHooks
from sandbox.ops.journal import OpKind
from sandbox.ops.operations import Operation, Recovered, kind


@dataclass
class HookReport:
    """The steps run for one command, in order (its JSON report's `hooks`)."""

    runs: list[HookRun] = field(default_factory=list)

    def as_list(self) -> list[dict[str, object]]:
        return [r.as_dict() for r in self.runs]


def _record(h: WorkloadHooks) -> dict[str, object] | None:
    return {"hook": h.resume.spec, "timeout_s": h.timeout_s} if h.resume is not None else None


def _resume_after_failure(h: WorkloadHooks, op: journal.Op, report: HookReport, snapshot: str, pid: int,
                          why: BaseException) -> None:
    """The resume step after a failure WHY (the workload is running again); its own failure keeps the
    record for `gpusnap recover` and is told with WHY."""
    if h.resume is None:
        return
    try:
        report.runs.append(hooks.run(h.resume, Step.RESUME, h.timeout_s, snapshot=snapshot, pid=pid))
    except HookError as e:
        op.keep = True
        raise HookError(f"{why or type(why).__name__}; the resume step failed too ({e}): the workload may still "
                        "be prepared: `gpusnap recover` tries it again") from None


@contextmanager
def prepared(store_path: str, h: WorkloadHooks, snapshot: str, pid: int, *,
             resume_after: bool, report: HookReport) -> Iterator[None]:
    """The block (a dump or checkpoint of PID's tree into SNAPSHOT) with the workload prepared by
    H.prepare first, and resumed by H.resume after a failure, or after success when RESUME_AFTER (the
    workload still runs). Nothing is journaled or run when H has no step."""
    if not h:
        yield
        return
    pids = tree_of(pid)
    with journal.operation(store_path, OpKind.WORKLOAD_PREPARED, snapshot, pids=pids, resume=_record(h)) as op:
        if h.prepare is not None:
            try:
                report.runs.append(hooks.run(h.prepare, Step.PREPARE, h.timeout_s, snapshot=snapshot, pid=pid))
            except HookError as e:
                _resume_after_failure(h, op, report, snapshot, pid, e)
                raise HookError(f"{e}; no snapshot was taken"
                                + ("; the workload was resumed" if h.resume is not None else "")) from None
            except BaseException as e:  # a signal (Interrupted) while the step ran: it may be half prepared
                _resume_after_failure(h, op, report, snapshot, pid, e)
                raise
        journal.pause("after-prepare")
        try:
            yield
        except BaseException as e:
            _resume_after_failure(h, op, report, snapshot, pid, e)
            raise
        if resume_after and h.resume is not None:
            _resume_or_keep(op, h.resume, h.timeout_s, snapshot, pid, report,
                            lambda e: f"snapshot {snapshot!r} is committed, but {e}: the workload may still be "
                                      "prepared; `gpusnap recover` tries the resume step again")


def _resume_or_keep(op: journal.Op, resume: hooks.Hook, timeout_s: float, snapshot: str, pid: int,
                    report: HookReport, failed: Callable[[HookError], str]) -> None:
    """RESUME run for PID inside OP's record; a failure keeps the record for `gpusnap recover` (a
    HookError saying FAILED(e)), and so does a signal that cuts the step short."""
    journal.pause("before-resume")
    try:
        report.runs.append(hooks.run(resume, Step.RESUME, timeout_s, snapshot=snapshot, pid=pid))
    except HookError as e:
        op.keep = True
        raise HookError(failed(e)) from None
    except BaseException:  # a signal cut the step short: recover runs it again
        op.keep = True
        raise


def tree_of(pid: int) -> list[int]:
    """PID and its descendants now (HookError if there is no such process)."""
    try:
        return process_tree(pid)
    except Exception as e:  # noqa: BLE001 - DiscoveryError and its kin
        raise HookError(f"cannot find the workload's processes: {e}") from None


def resumed(store_path: str, resume: hooks.Hook, timeout_s: float, snapshot: str, pid: int, pids: Sequence[int],
            report: HookReport) -> None:
    """RESUME run for the restored workload PID (its tree PIDS), journaled first: a gpusnap killed
    meanwhile leaves a record `gpusnap recover` finishes. HookError if it fails (the record stays)."""
    with journal.operation(store_path, OpKind.WORKLOAD_PREPARED, snapshot, pids=pids,
                           resume={"hook": resume.spec, "timeout_s": timeout_s}) as op:
        _resume_or_keep(op, resume, timeout_s, snapshot, pid, report,
                        lambda e: f"snapshot {snapshot!r} was restored, but {e}: `gpusnap recover` tries the "
                                  "resume step again")


@kind
class WorkloadPrepared(Operation):
    """A workload a --prepare step may have prepared, or a restore left to resume: recovery runs its
    recorded resume step if a process it names still lives (and is not stopped: the other kinds' undos
    run first)."""

    KIND = OpKind.WORKLOAD_PREPARED

    def undo(self, done: Recovered) -> None:
        rec = self.rec
        if rec.resume is None:
            done.actions.append("no resume step was recorded")
            return
        live = [p for p in rec.procs if p.alive()]
        if not live:
            done.actions.append("the workload is gone (a committed dump ended it): nothing to resume")
            return
        stopped = [p.pid for p in live if state_of(p.pid) == "T"]
        if stopped:
            # a tree still stopped here was not resumed by its dump's undo: told to go on it would hang
            raise HookError(f"the workload's processes {stopped} are stopped: not resuming them")
        hook = hooks.Hook.parse(rec.resume["hook"])
        run = hooks.run(hook, Step.RESUME, float(rec.resume["timeout_s"]), snapshot=rec.snapshot, pid=live[0].pid)
        done.actions.append(f"ran the resume step {hook.describe()} ({run.detail})")


def restore_resume(store: SnapshotStore, name: str, h: WorkloadHooks, no_resume: bool,
                   restored: str | None = None) -> hooks.Hook | None:
    """The resume step a restore of NAME runs: --resume's, none with --no-resume, else the one the
    snapshot records if its MAC checks under this store's journal key (HookError otherwise, before
    anything is restored). None too while NAME is not in the store yet (a restore --from a remote:
    called again once it is, with RESTORED saying what was restored, for the error)."""
    if h.resume is not None or no_resume:
        return h.resume
    if not store.exists(name):
        return None
    return hooks.recorded(journal.Journal(store.path).key, name, store.load(name).meta, restored)
