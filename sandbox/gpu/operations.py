"""The GPU kinds of journaled operation (sandbox.ops.operations): `gpu checkpoint`'s and `gpu restore`'s
one undo each, and the GPU state a CRIU operation's undo gives back (resume_gpu), run by the flow when
it fails and by `gpusnap recover` when gpusnap died.

Guarantees kept here: GPU state goes back by the path that took it (host-staged through the driver's
own copy; custom storage from the snapshot a restore reads or the operation committed, else from the
operation's chunk-reference log); a process whose memory cannot come back is named in Recovered.lost
with the state it stays in; a restore's undo touches only the recorded processes (pid AND start time).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

from sandbox.ops import journal
from sandbox.ops.journal import OpKind, OpRecord, Stage
from sandbox.ops.operations import Operation, Recovered, Undo, kind


def real_driver() -> Any:
    """The machine's CUDA driver (an undo's default CheckpointDriver)."""
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


def driver_of(ctx: Undo) -> Any:
    """The CheckpointDriver CTX reaches the GPU through."""
    return (ctx.gpu.driver or real_driver)()


def resume_gpu(rec: OpRecord, ctx: Undo, done: Recovered) -> None:
    """The record's CUDA processes back to RUNNING with their memory, by the path that took it."""
    if not rec.cuda_pids:
        return
    from sandbox.gpu import state
    if rec.gpu_path == "custom-storage":
        _resume_custom(rec, ctx, done)
        return
    r = state.resume(driver_of(ctx), list(rec.cuda_pids))
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
    drv = driver_of(ctx)
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
        r = state.settle(driver_of(self.ctx), mine)
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
