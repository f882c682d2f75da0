"""The runsc kinds of journaled operation (sandbox.ops.operations): a checkpoint's and a restore's one undo,
run by the flow when it fails and by `gpusnap recover` when gpusnap died.

The sandbox a record names is in its `runsc` part (SandboxRecord: container, runsc flags, bundle,
network, the GPU agent's report and whether the GPU state is already back), written and read
through the one class.

Guarantees kept here: a checkpoint's undo restarts the sandbox only from the staged images of this
operation and only when runsc has stopped it; the GPU state goes back once (the record says when it
did); a snapshot that this operation committed without --leave-running keeps its sandbox stopped, as
asked; a restore's undo removes only the container the record names under the record's runsc root.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from sandbox.ops import journal
from sandbox.ops.journal import OpKind, OpRecord, Stage
from sandbox.ops.operations import Operation, Recovered, kind
from sandbox.runsc.gpu_agent import gpu_back
from sandbox.runsc.runner import Runsc, restart
from storage.api import LOGS, path_in


@dataclass(frozen=True)
class SandboxRecord:
    """The sandbox part of a runsc operation's journal record."""

    container: str
    runsc_args: tuple[str, ...]
    bundle: str
    net: dict[str, Any] | None = None         # sandbox.host.netns.NetConfig.as_dict()
    gpu_report: dict[str, Any] | None = None  # the GPU agent's checkpoint report (GPU sandboxes)
    gpu_back: bool = False                    # the GPU state was given back already (--leave-running)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["runsc_args"] = list(self.runsc_args)
        return d

    @classmethod
    def of(cls, rec: OpRecord) -> "SandboxRecord":
        sb = rec.runsc or {}
        if (not isinstance(sb.get("container"), str) or not isinstance(sb.get("runsc_args"), list)
                or not isinstance(sb.get("bundle"), str)):
            raise journal.JournalError("runsc record without container, runsc flags or bundle")
        net, rep = sb.get("net"), sb.get("gpu_report")
        return cls(sb["container"], tuple(str(a) for a in sb["runsc_args"]), sb["bundle"],
                   net if isinstance(net, dict) else None, rep if isinstance(rep, dict) else None,
                   bool(sb.get("gpu_back")))

    def with_(self, **changes: Any) -> dict[str, Any]:
        """The record's `runsc` part with CHANGES (for journal.Op.advance(runsc=...))."""
        return replace(self, **changes).as_dict()

    def runsc(self, store_path: str) -> Runsc:
        return Runsc(list(self.runsc_args), log_dir=path_in(store_path, LOGS))


@kind
class RunscCheckpoint(Operation):
    """`runsc checkpoint`: STARTED -> GPU_FROZEN (the agent streams the GPU state out) -> DUMPING (runsc
    checkpoints: the sandbox stops) -> DUMPED -> COMMITTING -> COMMITTED."""

    KIND = OpKind.RUNSC_CHECKPOINT

    def undo(self, done: Recovered) -> None:
        rec, store = self.rec, self.ctx.store
        sb = SandboxRecord.of(rec)
        r, cid = sb.runsc(store.path), sb.container
        committed = self.ctx.committed(rec)
        if committed and not rec.leave_running:
            done.actions.append(f"snapshot {rec.snapshot!r} was committed: sandbox {cid!r} stays stopped, as asked")
            return
        st = r.state(cid)
        images = os.path.join(rec.staging or "/nonexistent", "images")
        if st is not None and st.get("status") == "running":
            done.actions.append(f"sandbox {cid!r} is running")
        elif st is not None and os.path.isdir(images) and os.listdir(images):
            restart(r, cid, sb.bundle, images)
            done.actions.append(f"restarted sandbox {cid!r} from the staged checkpoint")
        else:
            raise journal.JournalError(f"sandbox {cid!r} is {st.get('status') if st else 'gone'} and no staged "
                                       "checkpoint is there to restart it from")
        rep = sb.gpu_report
        if rep is not None and not committed:
            if not sb.gpu_back:
                gpu_back(r, cid, rep, store, rec.snapshot)
                done.actions.append(f"GPU state of sandbox {cid!r} restored by its agent")
            gpu_snap = rep.get("snapshot")
            if isinstance(gpu_snap, str) and gpu_snap == f"{rec.snapshot}.gpu" and store.exists(gpu_snap):
                store.remove(gpu_snap)  # the GPU part of a checkpoint that did not commit
                done.actions.append(f"removed the uncommitted checkpoint's GPU snapshot {gpu_snap!r}")


@kind
class RunscRestore(Operation):
    """`runsc restore`: STARTED (images materialized) -> DUMPING (runsc restores) -> DUMPED (it runs) ->
    GPU state back through the agent (gpu_back recorded). A sandbox that is not up whole is removed."""

    KIND = OpKind.RUNSC_RESTORE

    def undo(self, done: Recovered) -> None:
        rec = self.rec
        sb = SandboxRecord.of(rec)
        r, cid = sb.runsc(self.ctx.store.path), sb.container
        st = r.state(cid)
        whole = sb.gpu_report is None or sb.gpu_back  # no GPU state owed, or given back already
        if st is not None and st.get("status") == "running" and rec.stage.at_least(Stage.DUMPING) and whole:
            done.actions.append(f"sandbox {cid!r} was restored and runs")
            return
        if st is not None or r.sandbox_processes(cid):
            killed = r.clean_up(cid, sb.bundle)
            done.actions.append(f"removed the half-restored sandbox {cid!r}" + (f" (killed {killed})" if killed else ""))
