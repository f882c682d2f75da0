"""What every kind of journaled work shares: the Operation (one per kind, with the one undo() that both its
own failure path and `gpusnap recover` run), the registry recovery dispatches by, and what an undo
works with.

An operation's journal record (sandbox.ops.journal.OpRecord) says how far it got; its undo() puts the
workload back from there. Each kind lives beside its flow and registers itself on import (@kind):
sandbox.criu.operations (a CRIU dump resumes its stopped tree, or, once the snapshot that this very
operation committed exists, kills it as asked; a CRIU restore kills a tree it left half-filled and
gives restored processes their GPU state back), sandbox.gpu.operations (a GPU checkpoint resumes its
processes unless it committed; a GPU restore unlocks the processes whose memory is back and leaves
the rest restorable) and sandbox.runsc.operations. The flows import their own kinds; sandbox.recover
imports all of them, so recovery dispatches by kind without knowing any flow's private helpers, and
this module imports no flow (it sits on the floor below them).

What an undo needs beyond the record comes in an Undo: the store, how to reach the GPU (the flow's own
driver and engine, or new ones in recovery) and where a process's GPU memory is (the operation's
chunk-reference log, or the snapshot a restore reads or the operation committed).

Guarantees kept here: recovery undoes a record only through its kind's registered Operation (a kind
whose module was not imported is an error, never a guess); a flow whose own undo fails keeps its
record (undone_on_failure sets op.keep), so that `gpusnap recover` tries again and the error says
both failures. What each kind guarantees is in its module's docstring.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, ContextManager, Iterator

from storage.api import SnapshotStore

from sandbox.ops import journal
from sandbox.ops.journal import OpKind, OpRecord, Stage
from sandbox.ops.trust import legacy_key


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


def _new_engine(device: Callable[[], Any]) -> Callable[[int], ContextManager[Any]]:
    def make(chunk_size: int) -> ContextManager[Any]:
        from storage.api import GpuEngine
        return GpuEngine(device(), chunk_size=chunk_size, lanes=2)
    return make


@dataclass(frozen=True)
class GpuAccess:
    """How an undo reaches the GPU: the CheckpointDriver (None: the machine's CUDA driver, made by
    sandbox.gpu.operations), and a GPU engine (a context manager, given the largest chunk it must take)
    for a custom-storage restore; both made only when a record needs them."""

    driver: Callable[[], Any] | None = None
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
            j = journal.Journal(self.store.path)
            key = (legacy_key(j.dir) or j.key) if rec.legacy else j.key
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
    """The Operation that undoes REC (its kind's module must have been imported: the flow's own, or
    sandbox.recover, which imports every kind)."""
    try:
        return _KINDS[rec.kind](rec, ctx)
    except KeyError:
        raise journal.JournalError(f"no undo is known for a {rec.kind.value} operation here (its kind's module "
                                   "was not imported)") from None


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
