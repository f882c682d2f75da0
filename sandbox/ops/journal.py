"""The journal of operations in flight: what a dump, checkpoint or restore is doing, on disk before it does it.

Each operation that can leave a workload stopped or leave files behind (a CRIU dump or restore, a
runsc checkpoint or restore, a `gpu checkpoint` or `gpu restore`) keeps one record in STORE/journal/OP.json while it
runs (storage/FORMAT.md, "The journal"); one that streams GPU memory through custom storage also keeps
the chunk references of its gpu/ streams in STORE/journal/OP.refs (storage.repo.reflog) as they are
stored. `gpusnap recover` (sandbox.recover) reads the records whose owner died and finishes or undoes
what each describes; every other state-changing command refuses to start while one exists.

Guarantees kept here:
- a record reaches the disk (temp file, fsync, rename, directory fsync) before the step it
  describes starts, and is removed only after the operation finished or was undone; its reference
  log goes after it (a log without a record names nothing gc keeps, and recover removes it);
- processes are named by pid AND start time (Proc, sandbox.host.processes), so a pid reused by an
  unrelated process is never taken for the owner or the workload, and is never signalled;
- every record carries an HMAC under the journal's key (sandbox.ops.trust) over all it says, its
  owner (pid and start time) included; a record read without a valid one is marked untrusted
  (OpRecord.untrusted) and recovery signals nothing it names;
- the helpers an operation starts (CRIU, runsc: sandbox.host.procgroup) are recorded by pid, start
  time and process group as they start, never looked up by command line;
- the test hook (pause, env GPUSNAP_TEST_PAUSE=STAGE:FILE) does nothing unless that variable names
  the stage reached, and pauses at most once per process.
"""
from __future__ import annotations

import enum
import json
import os
import re
import signal
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Sequence

from storage.api import EXIT_RECOVER, GpusnapError
from storage.api import pause_at
from storage.api import JOURNAL, path_in

from sandbox.host import procgroup
# Proc and the helpers below are named through the journal by the flows and recovery (journal.Proc, ...)
from sandbox.host.processes import Proc, start_time, state_of, wait_gone, with_descendants
from sandbox.ops.trust import JournalKey

PAUSE_ENV = "GPUSNAP_TEST_PAUSE"
_OP_RE = re.compile(r"[0-9a-f]{32}")


class JournalError(GpusnapError):
    """A journal record that cannot be written or read."""


class RecoveryNeeded(GpusnapError):
    """An operation was interrupted (its process died); `gpusnap recover` must finish or undo it first."""

    exit_code = EXIT_RECOVER


class OpKind(str, enum.Enum):
    CRIU_DUMP = "criu-dump"
    CRIU_RESTORE = "criu-restore"
    RUNSC_CHECKPOINT = "runsc-checkpoint"
    RUNSC_RESTORE = "runsc-restore"
    GPU_CHECKPOINT = "gpu-checkpoint"
    GPU_RESTORE = "gpu-restore"


class Stage(str, enum.Enum):
    """How far an operation got, in order; recovery decides by the last stage recorded."""

    STARTED = "started"          # staging named, nothing changed yet
    GPU_FROZEN = "gpu-frozen"    # the CUDA processes are being (or were) locked and checkpointed
    DUMPING = "dumping"          # CRIU / runsc checkpoint (or restore) runs
    FILLING = "filling"          # restore: CRIU is done, the tree (procs) stopped while gpusnap writes its large runs
    DUMPED = "dumped"            # images complete in staging; the tree is stopped (not killed)
    COMMITTING = "committing"    # the manifest is being written
    COMMITTED = "committed"      # the snapshot exists; what is left is the kill the user asked for

    def at_least(self, other: "Stage") -> bool:
        order = list(Stage)
        return order.index(self) >= order.index(other)


@dataclass(frozen=True)
class OpRecord:
    """What one operation in flight is doing (the JSON of a journal file)."""

    op: str
    kind: OpKind
    stage: Stage
    owner: Proc
    snapshot: str
    staging: str | None = None
    procs: tuple[Proc, ...] = ()
    cuda_pids: tuple[int, ...] = ()
    gpu_path: str | None = None
    leave_running: bool = False
    runsc: dict[str, Any] | None = None     # container, runsc_args, bundle, net (runsc kinds)
    started: float = 0.0
    helpers: tuple[Proc, ...] = ()           # CRIU / runsc processes it started, each leading its group
    held: tuple[Proc, ...] = ()              # of procs, those stopped or traced before it began: never signalled but to kill
    untrusted: str | None = field(default=None, compare=False)  # why this record is not one we wrote (read side)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("untrusted")
        d["kind"], d["stage"] = self.kind.value, self.stage.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], key: JournalKey | None = None) -> "OpRecord":
        """The record D, checked against its MAC under KEY (untrusted when it has none or a wrong one)."""
        try:
            if not isinstance(d, dict):
                raise TypeError("not an object")
            d = dict(d)
            mac = d.pop("mac", None)
            if not _OP_RE.fullmatch(d["op"]):
                raise ValueError("bad op id")
            staging = d.get("staging")
            if staging is not None and (not isinstance(staging, str) or not os.path.isabs(staging)):
                raise ValueError("staging is not an absolute path")
            return cls(op=d["op"], kind=OpKind(d["kind"]), stage=Stage(d["stage"]),
                       owner=Proc(int(d["owner"]["pid"]), int(d["owner"]["start"])), snapshot=str(d["snapshot"]),
                       staging=staging, procs=tuple(Proc(int(p["pid"]), int(p["start"])) for p in d.get("procs", ())),
                       cuda_pids=tuple(int(p) for p in d.get("cuda_pids", ())), gpu_path=d.get("gpu_path"),
                       leave_running=bool(d.get("leave_running")), runsc=d.get("runsc"),
                       started=float(d.get("started", 0.0)),
                       helpers=tuple(Proc(int(p["pid"]), int(p["start"])) for p in d.get("helpers", ())),
                       held=tuple(Proc(int(p["pid"]), int(p["start"])) for p in d.get("held", ())),
                       untrusted=None if key is not None and key.check("journal-record", d, mac) else
                       "it carries no valid MAC under this journal's key: gpusnap did not write it")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise JournalError(f"unreadable journal record: {e}") from None

    def describe(self) -> str:
        return f"{self.kind.value} of snapshot {self.snapshot!r} (pid {self.owner.pid}, stage {self.stage.value})"


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """STORE/journal/: one file per operation in flight."""

    def __init__(self, store_path: str) -> None:
        self.dir = path_in(store_path, JOURNAL)
        self._key: JournalKey | None = None

    @property
    def key(self) -> JournalKey:
        """This journal's HMAC key (created on first use)."""
        if self._key is None:
            self._key = JournalKey.of(self.dir)
        return self._key

    def _path(self, op: str) -> str:
        return os.path.join(self.dir, f"{op}.json")

    def write(self, rec: OpRecord) -> None:
        """REC on disk, atomically and durably, before the caller goes on."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        tmp = os.path.join(self.dir, f".{rec.op}.{os.getpid()}.tmp")
        d = rec.as_dict()
        d["mac"] = self.key.mac("journal-record", d)
        data = json.dumps(d, sort_keys=True).encode()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self._path(rec.op))
            _fsync_dir(self.dir)
        except OSError as e:
            raise JournalError(f"cannot write the operation journal in {self.dir}: {e.strerror or e}") from None

    def remove(self, op: str) -> None:
        """OP's record, then its reference log (gc honours a log only while its record exists)."""
        from storage.api import reflog  # lazily: the in-sandbox agent imports this module without blake3
        for path in (self._path(op), os.path.join(self.dir, op + reflog.SUFFIX)):
            try:
                os.unlink(path)
                _fsync_dir(self.dir)
            except FileNotFoundError:
                pass

    def ref_log(self, op: str) -> Any:
        """The chunk references OP's gpu/ streams recorded, a storage.repo.reflog.RefLog (None if it kept no log)."""
        from storage.api import reflog
        return reflog.read(self.dir, op)

    def records(self) -> list[OpRecord]:
        """Every readable record (unreadable ones raise JournalError naming the file)."""
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            if not (n.endswith(".json") and _OP_RE.fullmatch(n[:-5])):
                continue
            try:
                fd = os.open(os.path.join(self.dir, n), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                with os.fdopen(fd, "rb") as f:
                    d = json.loads(f.read(1 << 20))
            except (OSError, ValueError, RecursionError) as e:
                raise JournalError(f"{os.path.join(self.dir, n)}: unreadable journal record: {e}") from None
            out.append(OpRecord.from_dict(d, self.key))
        return out

    def set_aside(self, op: str) -> str:
        """Move OP's record out of the way (journal/rejected-OP.json), so that it blocks nothing and is kept
        for whoever investigates; its path."""
        dst = os.path.join(self.dir, f"rejected-{op}.json")
        os.rename(self._path(op), dst)
        _fsync_dir(self.dir)
        return dst

    def unfinished(self) -> list[OpRecord]:
        """Records whose owner died: interrupted operations `gpusnap recover` must finish or undo."""
        return [r for r in self.records() if not r.owner.alive()]

    def stale_temps(self) -> list[str]:
        """Half-written record files of owners that died (the record they were replacing is intact),
        and reference logs whose record is gone (removed between the two unlinks of remove())."""
        from storage.api import reflog
        out = []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        for n in names:
            m = re.fullmatch(r"\.([0-9a-f]{32})\.(\d+)\.tmp", n)
            if m and start_time(int(m.group(2))) is None:
                out.append(os.path.join(self.dir, n))
            m = re.fullmatch(r"([0-9a-f]{32})" + re.escape(reflog.SUFFIX), n)
            if m and m.group(1) + ".json" not in names:
                out.append(os.path.join(self.dir, n))
        return out


def require_clean(store_path: str) -> None:
    """Refuse (exit 5) while an interrupted operation waits for `gpusnap recover`."""
    left = Journal(store_path).unfinished()
    if left:
        raise RecoveryNeeded(f"an interrupted {left[0].describe()} must be finished first: run `gpusnap recover`"
                             + (f" ({len(left)} operations)" if len(left) > 1 else ""))


class Op:
    """One operation's record, kept current as it advances (thread-safe)."""

    def __init__(self, journal: Journal, rec: OpRecord) -> None:
        self.journal, self.rec = journal, rec
        self.keep = False  # set when the in-process undo failed: recovery must try again
        self._lock = threading.Lock()

    @property
    def id(self) -> str:
        return self.rec.op

    def ref_log(self, durable: Any) -> Any:
        """The storage.repo.reflog.RefLogWriter of this operation's chunk-reference log (DURABLE(refs) makes
        the chunks durable before their references are written: the store writer's sync_chunks)."""
        from storage.api import reflog
        return reflog.RefLogWriter(self.journal.dir, self.id, durable)

    def helper_started(self, pid: int) -> None:
        """Record a helper (CRIU, runsc) this operation just started (sandbox.host.procgroup calls it)."""
        p = Proc.of(pid)
        if p is not None:
            with self._lock:
                self.rec = replace(self.rec, helpers=(*self.rec.helpers, p))
                self.journal.write(self.rec)

    def commit_mac(self, pids: Sequence[int]) -> str:
        """What a snapshot this operation commits carries as meta.op_mac: proof that this operation,
        and not whoever else wrote a manifest, committed it with these pids (sandbox.ops.trust)."""
        return commit_mac(self.journal.key, self.id, self.rec.snapshot, pids)

    def advance(self, stage: Stage | None = None, **changes: Any) -> None:
        """Record the next stage (and any changed fields) before doing it."""
        with self._lock:
            if stage is not None:
                changes["stage"] = stage
            self.rec = replace(self.rec, **changes)
            self.journal.write(self.rec)


@contextmanager
def operation(store_path: str, kind: OpKind, snapshot: str, *, pids: Sequence[int] = (), **fields: Any) -> Iterator[Op]:
    """Record an operation for the block; the record goes when the block ends (finished or undone),
    unless the undo failed (op.keep), when it stays for `gpusnap recover`."""
    require_clean(store_path)
    owner = Proc.of(os.getpid())
    assert owner is not None
    procs = tuple(p for p in (Proc.of(x) for x in pids) if p is not None)
    op = Op(Journal(store_path), OpRecord(uuid.uuid4().hex, kind, Stage.STARTED, owner, snapshot, procs=procs,
                                          started=time.time(), **fields))
    op.journal.write(op.rec)
    try:
        with procgroup.recording_helpers(op.helper_started):
            yield op
    except BaseException:
        if not op.keep:
            op.journal.remove(op.id)
        raise
    op.journal.remove(op.id)


def commit_mac(key: JournalKey, op: str, snapshot: str, pids: Sequence[int]) -> str:
    return key.mac("commit", {"op": op, "snapshot": snapshot, "pids": sorted(int(p) for p in pids)})


def committed_by(key: JournalKey, rec: OpRecord, meta: dict[str, Any]) -> bool:
    """A snapshot's META says operation REC committed it: its op id and the MAC over the op id, the
    snapshot name and the pids it names (the ones a committed dump then kills) check out."""
    pids = meta.get("pids", [])
    if meta.get("op") != rec.op or not isinstance(pids, list) or not all(isinstance(p, int) for p in pids):
        return False
    return key.check("commit", {"op": rec.op, "snapshot": rec.snapshot, "pids": sorted(pids)}, meta.get("op_mac"))


def pause(stage: str) -> None:
    """Test hook: with GPUSNAP_TEST_PAUSE=STAGE:FILE, write our pid to FILE and wait until it is removed,
    so that a test can kill or signal gpusnap at exactly this point (the first time it is reached in
    this process). Does nothing otherwise."""
    pause_at(PAUSE_ENV, stage)


def pause_script(images_dir: str) -> str | None:
    """Test hook for the stage inside CRIU ("dumping"): a CRIU action script, written into
    IMAGES_DIR's parent, that pauses at post-dump (every page written, the tree still frozen); None
    unless GPUSNAP_TEST_PAUSE names that stage."""
    want, _, path = os.environ.get(PAUSE_ENV, "").partition(":")
    if want != "dumping" or not path:
        return None
    import shlex
    script = os.path.join(os.path.dirname(images_dir), "test-pause.sh")
    q = shlex.quote(path)
    with open(script, "w") as f:
        f.write(f'#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
                f"echo $$ > {q}.tmp && mv {q}.tmp {q}\nwhile [ -e {q} ]; do sleep 0.05; done\n")
    os.chmod(script, 0o700)
    return script


def signal_helpers(helpers: Sequence[Proc], sig: int = signal.SIGKILL) -> list[int]:
    """SIG to the process group of each recorded helper that is still the one started and still
    leads its own group (as run_group starts them); the pids signalled."""
    out = []
    for h in helpers:
        if not h.alive():
            continue
        try:
            if os.getpgid(h.pid) == h.pid and start_time(h.pid) == h.start:
                os.killpg(h.pid, sig)
                out.append(h.pid)
        except (ProcessLookupError, PermissionError):
            pass
    return out
