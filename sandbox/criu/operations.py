"""The CRIU kinds of journaled operation (sandbox.ops.operations): `criu dump`'s and `criu restore`'s one
undo each, run by the flow when it fails and by `gpusnap recover` when gpusnap died.

Guarantees kept here: only processes a trusted record names (pid AND start time) are signalled; the
tree of a committed dump is killed only when the snapshot's manifest names this operation and carries
its commit MAC (sandbox.ops.journal.committed_by), and only the pids that manifest names (with the
descendants they have now: what CRIU froze); a restored tree is killed only while its split fill did
not finish (the fill's marker in the operation's host-local state, sandbox.ops.opstate, is absent)
and some process of it is still stopped (/proc state T): a running, fully restored tree is never
signalled (no process of a killed tree ran with its memory incomplete; one the fill had completed
may have been continued early, and is killed with every descendant it has), and only if it is
provably this operation's.
"""
from __future__ import annotations

import os
import signal
import stat

from sandbox.gpu.operations import resume_gpu
from sandbox.host.processes import Proc, kill_with_descendants, process_tree, state_of, wait_gone, with_descendants
from sandbox.ops.journal import Journal, OpKind, Stage
from sandbox.ops.operations import Operation, Recovered, kind


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
                tree = with_descendants(tuple(p for p in rec.procs if p.pid in named))
                killed = [p.pid for p in tree if p.signal(signal.SIGKILL)]
                done.actions.append(f"snapshot {rec.snapshot!r} was committed: killed the dumped tree {killed}, as asked")
            else:
                done.actions.append(f"snapshot {rec.snapshot!r} was committed")
                if rec.stage.at_least(Stage.GPU_FROZEN):
                    resume_gpu(rec, self.ctx, done)
            return
        if rec.stage.at_least(Stage.DUMPING):
            # each process back as it was found: one stopped or traced before the dump gets no signal (CRIU
            # leaves it so; a SIGCONT would resume a stopped one, and stop a traced one again for its tracer)
            held = set(rec.held)
            resumed = [p.pid for p in with_descendants(rec.procs) if p not in held and p.signal(signal.SIGCONT)]
            done.actions.append(f"no snapshot was committed: resumed the tree {resumed}"
                                + (f", left {[p.pid for p in rec.held]} stopped or traced as they were" if held else ""))
        if rec.stage.at_least(Stage.GPU_FROZEN):
            resume_gpu(rec, self.ctx, done)


@kind
class CriuRestore(Operation):
    """`criu restore`: STARTED -> DUMPING (CRIU restores) -> FILLING (the tree restored, held stopped
    but for processes already complete, its large page runs being written by gpusnap: procs recorded)
    -> DUMPED (the tree runs) -> GPU state back."""

    KIND = OpKind.CRIU_RESTORE

    def undo(self, done: Recovered) -> None:
        rec = self.rec
        if rec.stage == Stage.FILLING:
            # checked first: what it would undo must still be there. A fill that finished (its own marker, in
            # the operation's host-local state) left a whole tree that runs; a tree none of whose processes is
            # stopped any more is not the one the fill held: neither is ever signalled
            stopped = [p for p in rec.procs if p.alive() and state_of(p.pid) in ("T", "t")]
            if Journal(self.ctx.store.path).filled(rec.op):
                done.actions.append("the split fill had finished: the restored tree is whole and runs; nothing signalled")
            elif not stopped:
                done.actions.append("no process of the restored tree is stopped any more (it runs, or is gone): "
                                    "nothing signalled")
                return
            else:
                # its memory partly written: it must not run; the pids must be freed. A process of it the fill
                # had completed and continued early (its GPU copy started) may have forked: all descendants too
                killed = kill_with_descendants(rec.procs)
                if killed:
                    wait_gone(killed, 10)
                done.actions.append(f"killed the half-filled restored tree {killed} (no process of it ran with its "
                                    "memory incomplete; the snapshot restores again)")
                return
        if rec.stage == Stage.DUMPING:
            tree = self._left_stopped()
            if tree:
                killed = [p.pid for p in tree if p.signal(signal.SIGKILL)]
                wait_gone(killed, 10)
                done.actions.append(f"killed the restored tree {killed}: CRIU had restored it stopped for the split "
                                    "fill, which never ran (the snapshot restores again)")
                return
        if rec.stage.at_least(Stage.DUMPING) and rec.cuda_pids:
            resume_gpu(rec, self.ctx, done)

    def _left_stopped(self) -> list[Proc]:
        """The tree a `criu restore --leave-stopped` finished restoring after gpusnap died (so before
        FILLING was recorded): rooted at the pid CRIU wrote into this operation's staging directory,
        stopped, every process of it started after this operation's owner. Nothing otherwise."""
        rec = self.rec
        if not rec.staging or os.path.basename(rec.staging) != f"gpusnap-op-{rec.op}":
            return []
        try:
            fd = os.open(os.path.join(rec.staging, "restored.pid"),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return []
                root = int(os.read(fd, 32).strip())
            finally:
                os.close(fd)
            pids = process_tree(root)
        except Exception:  # noqa: BLE001 - no pid file, or no such tree: nothing CRIU finished
            return []
        procs = [p for p in (Proc.of(x) for x in pids) if p is not None and p.start >= rec.owner.start]
        if len(procs) != len(pids) or state_of(root) != "T":
            return []  # a tree that runs (no split) is restored whole; one we cannot prove ours is left alone
        return procs
