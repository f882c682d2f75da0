"""One Operation per kind of journaled work, each with the one undo() that both its own failure path and
`gpusnap recover` run.

An operation's journal record (sandbox.ops.journal.OpRecord) says how far it got; its undo() puts the
workload back from there: a CRIU dump resumes its stopped tree (or, once the snapshot that this very
operation committed exists, kills it as asked), a CRIU restore kills a tree it left half-filled and
gives restored processes their GPU state back, a GPU checkpoint resumes its processes unless it
committed, a GPU restore unlocks the processes whose memory is back and leaves the rest restorable. The runsc kinds live beside runsc (sandbox.runsc.operations, which registers them on import:
recover imports it, as do the runsc flows), so
recovery dispatches by kind without knowing any flow's private helpers.

What an undo needs beyond the record comes in an Undo: the store, how to reach the GPU (the flow's own
driver and engine, or new ones in recovery) and where a process's GPU memory is (the operation's
chunk-reference log, or the snapshot a restore reads or the operation committed).

Guarantees kept here: only processes a trusted record names (pid AND start time) are signalled; the
tree of a committed dump is killed only when the snapshot's manifest names this operation and carries
its commit MAC (sandbox.ops.journal.committed_by), and only the pids that manifest names; a process
is never signalled for an untrusted record (recovery does not even call undo for one).
"""
from __future__ import annotations

import signal
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Iterator

from storage.store import SnapshotStore

from sandbox.ops import journal
from sandbox.ops.journal import OpKind, OpRecord, Stage


@dataclass
class Recovered:
    """What an undo (or a recovery) did for one operation."""

    op: str
    kind: str
    snapshot: str
    stage: str
    actions: list[str] = field(default_factory=list)
    error: str | None = None     # recovery failed; the record stays for another try (or was set aside)
    lost: list[str] = field(default_factory=list)   # what no recovery can give back (final)

    @classmethod
    def of(cls, rec: OpRecord) -> "Recovered":
        return cls(rec.op, rec.kind.value, rec.snapshot, rec.stage.value)

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "kind": self.kind, "snapshot": self.snapshot, "stage": self.stage,
                "actions": self.actions, "error": self.error, "lost": self.lost}


def real_driver() -> Any:
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


def _new_engine(device: Callable[[], Any]) -> Callable[[int], ContextManager[Any]]:
    def make(chunk_size: int) -> ContextManager[Any]:
        from storage.gpu_engine import GpuEngine
        return GpuEngine(device(), chunk_size=chunk_size, lanes=2)
    return make


@dataclass(frozen=True)
class GpuAccess:
    """How an undo reaches the GPU: the CheckpointDriver, and a GPU engine (a context manager, given the
    largest chunk it must take) for a custom-storage restore; both made only when a record needs them."""

    driver: Callable[[], Any] = real_driver
    device: Callable[[], Any] = lambda: 0
    engine: Callable[[int], ContextManager[Any]] | None = None  # default: a new GpuEngine on device()

    def new_engine(self, chunk_size: int) -> ContextManager[Any]:
        return (self.engine or _new_engine(self.device))(chunk_size)

    @classmethod
    def of_flow(cls, driver: Any, engine: Any) -> "GpuAccess":
        """The flow's own driver and engine (already made; the flow closes them)."""
        return cls(driver=lambda: driver, engine=lambda _size: nullcontext(engine))


@dataclass
class Undo:
    """What an undo works with beyond its record."""

    store: SnapshotStore
    gpu: GpuAccess = field(default_factory=GpuAccess)

    def committed(self, rec: OpRecord) -> bool:
        """The snapshot this operation wrote exists, written by this operation: its manifest names the
        operation and carries the commit MAC under the journal's key (sandbox.ops.journal.committed_by)."""
        return bool(self.committed_meta(rec))

    def committed_meta(self, rec: OpRecord) -> dict[str, Any] | None:
        if not rec.stage.at_least(Stage.COMMITTING):
            return None
        try:
            if not self.store.exists(rec.snapshot):
                return None
            meta = self.store.load(rec.snapshot).meta
            key = journal.Journal(self.store.path).key
            return meta if journal.committed_by(key, rec, meta) else None
        except Exception:  # noqa: BLE001 - unreadable: not ours to trust
            return None


class Operation:
    """One kind of journaled operation: its stages are the journal's (Stage), its record an OpRecord."""

    KIND: ClassVar[OpKind]

    def __init__(self, rec: OpRecord, ctx: Undo) -> None:
        self.rec, self.ctx = rec, ctx

    def undo(self, done: Recovered) -> None:
        """Put the workload back as the record's stage says (idempotent: safe to run again)."""
        raise NotImplementedError


_KINDS: dict[OpKind, type[Operation]] = {}


def kind(cls: type[Operation]) -> type[Operation]:
    """Register CLS as the Operation of its KIND."""
    _KINDS[cls.KIND] = cls
    return cls


def operation_for(rec: OpRecord, ctx: Undo) -> Operation:
    """The Operation that undoes REC."""
    return _KINDS[rec.kind](rec, ctx)


# ---- GPU state back ---------------------------------------------------------------------------------
def resume_gpu(rec: OpRecord, ctx: Undo, done: Recovered) -> None:
    """The record's CUDA processes back to RUNNING with their memory, by the path that took it."""
    if not rec.cuda_pids:
        return
    from sandbox.gpu import state
    if rec.gpu_path == "custom-storage":
        _resume_custom(rec, ctx, done)
        return
    r = state.resume(ctx.gpu.driver(), list(rec.cuda_pids))
    done.actions.append(f"GPU state resumed (restored {r.restored}, unlocked {r.unlocked}, running {r.running}, "
                        f"gone {r.gone})")


def _custom_streams(rec: OpRecord, ctx: Undo) -> Callable[[int], tuple[list[Any], str | None]]:
    """pid -> (its gpu/ streams, None) where they are complete, else ([], what is missing): from the
    snapshot a restore reads or this operation committed, else from the operation's reference log."""
    store = ctx.store
    if rec.kind == OpKind.CRIU_RESTORE or ctx.committed(rec):
        m = store.load(rec.snapshot)

        def from_snapshot(pid: int) -> tuple[list[Any], str | None]:
            mine = [s for s in m.streams if s.name.startswith(f"gpu/{pid}/")]
            return (mine, None) if mine else ([], f"snapshot {rec.snapshot!r} has no GPU stream of it")
        return from_snapshot
    log = journal.Journal(store.path).ref_log(rec.op)

    def from_log(pid: int) -> tuple[list[Any], str | None]:
        if log is None:
            return [], "the operation recorded no chunk of its GPU streams"
        why = log.group_problem(str(pid), f"gpu/{pid}/")
        return ([], why) if why else (log.streams([str(pid)]), None)
    return from_log


def _resume_custom(rec: OpRecord, ctx: Undo, done: Recovered) -> None:
    """Processes whose GPU memory went through custom storage, back to RUNNING: a CHECKPOINTED one is
    restored through the custom-storage restore from its recorded chunks (sandbox.gpu.state.thaw,
    as `gpu restore` does), a LOCKED one unlocked; one that cannot be is named in done.lost."""
    from sandbox.gpu import state
    from sandbox.gpu.driver import ProcessState as S
    from sandbox.gpu.regions import EngineRegions
    drv = ctx.gpu.driver()
    streams_of = _custom_streams(rec, ctx)
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
    with (ctx.gpu.new_engine(chunk) if streams else nullcontext()) as eng:
        regions = (EngineRegions(eng, source=ctx.store, name=rec.snapshot, streams=streams)
                   if eng is not None else None)
        # the way the memory left; with nothing to restore (no streams) only unlocks
        gp = state.plan(recorded=state.GpuPath.CUSTOM_STORAGE, streams=regions is not None, thp_mode=None)
        r = state.thaw(drv, thawable, gp.backend(regions))
    if r.restored:
        n = sum(len(s.chunks) for s in streams)
        done.actions.append(f"GPU memory of {list(r.restored)} restored through custom storage from the {n} "
                            "recorded chunk(s) and unlocked")
    if r.unlocked:
        done.actions.append(f"unlocked {list(r.unlocked)}")
    if r.running:
        done.actions.append(f"{list(r.running)} already running")


# ---- the kinds ------------------------------------------------------------------------------------
@kind
class CriuDump(Operation):
    """`criu dump`: STARTED -> GPU_FROZEN -> DUMPING (CRIU runs) -> DUMPED (tree stopped, images complete)
    -> COMMITTING -> COMMITTED (then the kill, unless --leave-running)."""

    KIND = OpKind.CRIU_DUMP

    def undo(self, done: Recovered) -> None:
        rec = self.rec
        meta = self.ctx.committed_meta(rec)
        if meta is not None:
            if not rec.leave_running:
                named = set(meta.get("pids", []))
                # what CRIU froze: the named pids and every descendant they have now (a child forked while CRIU
                # seized the tree is in its image and stopped with it)
                tree = journal.with_descendants(tuple(p for p in rec.procs if p.pid in named))
                killed = [p.pid for p in tree if p.signal(signal.SIGKILL)]
                done.actions.append(f"snapshot {rec.snapshot!r} was committed: killed the dumped tree {killed}, as asked")
            else:
                done.actions.append(f"snapshot {rec.snapshot!r} was committed")
                if rec.stage.at_least(Stage.GPU_FROZEN):
                    resume_gpu(rec, self.ctx, done)
            return
        if rec.stage.at_least(Stage.DUMPING):
            resumed = [p.pid for p in journal.with_descendants(rec.procs) if p.signal(signal.SIGCONT)]
            done.actions.append(f"no snapshot was committed: resumed the tree {resumed}")
        if rec.stage.at_least(Stage.GPU_FROZEN):
            resume_gpu(rec, self.ctx, done)


@kind
class CriuRestore(Operation):
    """`criu restore`: STARTED -> DUMPING (CRIU restores) -> FILLING (the tree restored but stopped, its
    large page runs being written by gpusnap: procs recorded) -> DUMPED (the tree runs) -> GPU state back."""

    KIND = OpKind.CRIU_RESTORE

    def undo(self, done: Recovered) -> None:
        rec = self.rec
        if rec.stage == Stage.FILLING:
            # stopped before it ever ran, its memory partly written: it must not run; the pids must be freed
            killed = [p.pid for p in rec.procs if p.signal(signal.SIGKILL)]
            if killed:
                journal.wait_gone(killed, 10)
            done.actions.append(f"killed the half-filled restored tree {killed} (it never ran past the restore; "
                                "the snapshot restores again)")
            return
        if rec.stage == Stage.DUMPING:
            tree = self._left_stopped()
            if tree:
                killed = [p.pid for p in tree if p.signal(signal.SIGKILL)]
                journal.wait_gone(killed, 10)
                done.actions.append(f"killed the restored tree {killed}: CRIU had restored it stopped for the split "
                                    "fill, which never ran (the snapshot restores again)")
                return
        if rec.stage.at_least(Stage.DUMPING) and rec.cuda_pids:
            resume_gpu(rec, self.ctx, done)

    def _left_stopped(self) -> list[journal.Proc]:
        """The tree a `criu restore --leave-stopped` finished restoring after gpusnap died (so before
        FILLING was recorded): rooted at the pid CRIU wrote into this operation's staging directory,
        stopped, every process of it started after this operation's owner. Nothing otherwise."""
        import os
        from sandbox.gpu.processes import process_tree
        rec = self.rec
        if not rec.staging or os.path.basename(rec.staging) != f"gpusnap-op-{rec.op}":
            return []
        try:
            fd = os.open(os.path.join(rec.staging, "restored.pid"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                root = int(os.read(fd, 32).strip())
            finally:
                os.close(fd)
            pids = process_tree(root)
        except Exception:  # noqa: BLE001 - no pid file, or no such tree: nothing CRIU finished
            return []
        procs = [p for p in (journal.Proc.of(x) for x in pids) if p is not None and p.start >= rec.owner.start]
        if len(procs) != len(pids) or journal.state_of(root) != "T":
            return []  # a tree that runs (no split) is restored whole; one we cannot prove ours is left alone
        return procs


@kind
class GpuCheckpoint(Operation):
    """`gpu checkpoint`: STARTED -> GPU_FROZEN -> COMMITTING -> COMMITTED (the processes stay CHECKPOINTED)."""

    KIND = OpKind.GPU_CHECKPOINT

    def undo(self, done: Recovered) -> None:
        rec = self.rec
        if self.ctx.committed(rec):
            done.actions.append(f"snapshot {rec.snapshot!r} was committed: its processes stay CHECKPOINTED, as asked "
                                f"(`gpusnap gpu restore {rec.snapshot}` brings them back)")
            return
        if rec.stage.at_least(Stage.GPU_FROZEN):
            resume_gpu(rec, self.ctx, done)


@kind
class GpuRestore(Operation):
    """`gpu restore`: STARTED (the snapshot read, or being pulled; no process touched) -> FILLING (the
    CHECKPOINTED processes get their GPU memory back, all restored before any is unlocked). Its undo
    (sandbox.gpu.state.settle) finishes what is certain and guesses nothing: a process whose memory
    is back (LOCKED) is unlocked and runs, a CHECKPOINTED one stays so (`gpu restore` again brings it
    back), one the driver holds mid-restore is named as lost. Only the recorded processes (pid AND
    start time) are touched."""

    KIND = OpKind.GPU_RESTORE

    def undo(self, done: Recovered) -> None:
        rec = self.rec
        if not rec.stage.at_least(Stage.FILLING):
            return  # no process was touched
        from sandbox.gpu import state
        mine = [p.pid for p in rec.procs if p.alive() and p.pid in rec.cuda_pids]
        r = state.settle(self.ctx.gpu.driver(), mine)
        if r.unlocked:
            done.actions.append(f"unlocked {r.unlocked}: their GPU memory was back")
        if r.checkpointed:
            done.actions.append(f"{r.checkpointed} stay CHECKPOINTED (`gpusnap gpu restore {rec.snapshot}` brings "
                                "them back)")
        if r.running:
            done.actions.append(f"{r.running} already running")
        for p, st in r.held.items():
            done.lost.append(f"pid {p}: the driver holds it {st.name} (gpusnap died while its GPU memory was "
                             "mapped into gpusnap's process): it cannot run again; end it")


@contextmanager
def undone_on_failure(op: journal.Op, ctx: Undo, error: Callable[[str], Exception], *, what: str,
                      keep_going: Callable[[BaseException], bool] = lambda e: False) -> Iterator[None]:
    """The flow's failure path: on an exception from the block (unless KEEP_GOING(it): the block's work
    stands), OP's undo from the stage its record reached, then the exception; if the undo fails, the
    record stays for `gpusnap recover` and ERROR (the flow's own exception type) says both."""
    try:
        yield
    except BaseException as e:
        if keep_going(e):
            return
        try:
            operation_for(op.rec, ctx).undo(Recovered.of(op.rec))
        except Exception as u:  # noqa: BLE001
            op.keep = True
            raise error(f"the {what} failed ({e or type(e).__name__}) and putting the workload back "
                               f"failed too ({u}); run `gpusnap recover`") from None
        raise
