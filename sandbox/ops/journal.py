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
- every record carries an HMAC under the host key (sandbox.ops.trust: outside the store, root-only)
  over all it says, its owner (pid and start time), its boot and its store directory included; its
  operation's host-local state (sandbox.ops.opstate, on tmpfs) names the MAC of the current record,
  written before the record and removed after it. A record read without a valid MAC, written for
  another store directory, or of this boot but not the current one (replayed) is marked untrusted
  (OpRecord.untrusted): recovery signals nothing it names, and it blocks no command (require_clean
  sets it aside). A record of an earlier boot (a power loss) is recovered without signalling anything;
- every file of the journal is opened O_NOFOLLOW | O_NONBLOCK and checked (a regular file of gpusnap's
  user, at most MAX_RECORD bytes) before it is read: a FIFO planted there blocks nothing;
- the helpers an operation starts (CRIU, runsc: sandbox.host.procgroup) are recorded by pid, start
  time and process group as they start, never looked up by command line;
- the test hook (pause, env GPUSNAP_TEST_PAUSE=STAGE:FILE) does nothing unless that variable names
  the stage reached, and pauses at most once per process.
"""
from __future__ import annotations

import enum
import errno
import json
import os
import re
import signal
import stat
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterator, Sequence

from storage.api import EXIT_RECOVER, GpusnapError
from storage.api import pause_at
from storage.api import JOURNAL, path_in
from storage.api import hostkey

from sandbox.host import procgroup
# Proc and the helpers below are named through the journal by the flows and recovery (journal.Proc, ...)
from sandbox.host.processes import Proc, start_time, state_of, wait_gone, with_descendants
from sandbox.ops import opstate
from sandbox.ops.trust import JournalKey, journal_key, legacy_key

PAUSE_ENV = "GPUSNAP_TEST_PAUSE"
boot_id = hostkey.boot_id
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
    WORKLOAD_PREPARED = "workload-prepared"   # a --prepare/--resume step's workload (sandbox.ops.prepared)


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
    resume: dict[str, Any] | None = None     # workload-prepared: {"hook", "timeout_s"}, what recover runs
    boot: str = ""                           # the boot it was written in (boot_id); "" in records of old versions
    store: str = ""                          # the store directory it was written for (Journal.store_id)
    held: tuple[Proc, ...] = ()              # of procs, those stopped or traced before it began: never signalled but to kill
    untrusted: str | None = field(default=None, compare=False)  # why this record is not one we wrote (read side)
    legacy: bool = field(default=False, compare=False)  # honoured under the old in-store key (--trust-old-key)

    @property
    def other_boot(self) -> bool:
        """Written in an earlier boot (a power loss, a reboot): every process it names is gone with that
        boot, and a pid and start time of this boot that match it are somebody else's."""
        return bool(self.boot) and self.boot != boot_id()

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("untrusted")
        d.pop("legacy")
        if not self.boot:  # the dict an older gpusnap made its MAC over
            d.pop("boot")
            d.pop("store")
        d["kind"], d["stage"] = self.kind.value, self.stage.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], untrusted: str | None = None) -> "OpRecord":
        """The record D (without its MAC; Journal.records checks that), UNTRUSTED saying why it is not one to act on."""
        try:
            if not isinstance(d, dict):
                raise TypeError("not an object")
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
                       resume=_resume_field(d.get("resume")),
                       held=tuple(Proc(int(p["pid"]), int(p["start"])) for p in d.get("held", ())),
                       boot=str(d.get("boot", "")), store=str(d.get("store", "")), untrusted=untrusted)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise JournalError(f"unreadable journal record: {e}") from None

    def describe(self) -> str:
        return f"{self.kind.value} of snapshot {self.snapshot!r} (pid {self.owner.pid}, stage {self.stage.value})"


def _resume_field(v: Any) -> dict[str, Any] | None:
    """A record's `resume` ({"hook": str, "timeout_s": number}) or None; anything else is unreadable."""
    if v is None:
        return None
    if (not isinstance(v, dict) or set(v) != {"hook", "timeout_s"} or not isinstance(v["hook"], str)
            or not isinstance(v["timeout_s"], (int, float)) or isinstance(v["timeout_s"], bool)):
        raise ValueError("bad resume step")
    return {"hook": v["hook"], "timeout_s": float(v["timeout_s"])}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_RECORD = 1 << 20   # a journal record is read only up to this size (a bigger one is not gpusnap's)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


@dataclass(frozen=True)
class Unreadable:
    """A file in the journal named like a record that is not one (not a regular file, too big, not JSON)."""

    op: str
    why: str


class Journal:
    """STORE/journal/: one file per operation in flight."""

    def __init__(self, store_path: str, *, trust_old_key: bool = False) -> None:
        self.store_path = store_path
        self.dir = path_in(store_path, JOURNAL)
        self.trust_old_key = trust_old_key   # honour records under the old in-store key (once, to migrate)
        self._key: JournalKey | None = None
        self._store_id: str | None = None

    @property
    def key(self) -> JournalKey:
        """The key of every record and commit MAC here: derived from the host's for this store (sandbox.ops.trust),
        never one in the store."""
        if self._key is None:
            self._key = journal_key(self.store_id)
        return self._key

    @property
    def store_id(self) -> str:
        """This store directory on this host: its inode and real path. A copy of the store (a backup put back,
        another directory) or the store moved is another store: its records are set aside. (Not the device
        number: some file systems number their devices anew at boot, and a record left by a power loss must
        still be this store's.)"""
        if self._store_id is None:
            st = os.stat(self.store_path)
            self._store_id = f"{st.st_ino}:{os.path.realpath(self.store_path)}"
        return self._store_id

    def _path(self, op: str) -> str:
        return os.path.join(self.dir, f"{op}.json")

    def write(self, rec: OpRecord) -> None:
        """REC on disk, atomically and durably, before the caller goes on; its operation's state (sandbox.ops.opstate)
        names it as the current record first, so that no record but this one (or, until the rename, the one before)
        is ever acted on for this operation."""
        if not rec.boot:
            rec = replace(rec, boot=boot_id(), store=self.store_id)
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        tmp = os.path.join(self.dir, f".{rec.op}.{os.getpid()}.tmp")
        d = rec.as_dict()
        mac = d["mac"] = self.key.mac("journal-record", d)
        data = json.dumps(d, sort_keys=True).encode()
        try:
            before = opstate.load(rec.op)
            state = opstate.OpState(rec.op, rec.store, (rec.owner.pid, rec.owner.start),
                                    [*(before.macs[-1:] if before else []), mac], before.filled if before else False)
            state.save()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EINVAL, "a temporary record path is not a regular file")
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, self._path(rec.op))
            _fsync_dir(self.dir)
            state.macs = [mac]
            state.save()
        except OSError as e:
            raise JournalError(f"cannot write the operation journal in {self.dir}: {e.strerror or e}") from None

    def mark_filled(self, op: str) -> None:
        """OP's split fill finished (before its tree continues): its undo never kills that tree."""
        state = opstate.load(op)
        if state is not None:
            state.filled = True
            state.save()

    def filled(self, op: str) -> bool:
        state = opstate.load(op)
        return state is not None and state.filled

    def remove(self, op: str) -> None:
        """OP's record, then its reference log (gc honours a log only while its record exists), then its state."""
        from storage.api import reflog  # lazily: the in-sandbox agent imports this module without blake3
        for path in (self._path(op), os.path.join(self.dir, op + reflog.SUFFIX)):
            try:
                os.unlink(path)
                _fsync_dir(self.dir)
            except FileNotFoundError:
                pass
        opstate.remove(op)

    def ref_log(self, op: str) -> Any:
        """The chunk references OP's gpu/ streams recorded, a storage.repo.reflog.RefLog (None if it kept no log)."""
        from storage.api import reflog
        return reflog.read(self.dir, op)

    def _read(self, name: str) -> Any:
        """The JSON of record file NAME, opened without following a link or blocking, checked before it is read."""
        fd = os.open(os.path.join(self.dir, name), _READ)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            if st.st_uid != os.geteuid():
                raise ValueError(f"owned by uid {st.st_uid}, not gpusnap's uid {os.geteuid()}")
            if st.st_size > MAX_RECORD:
                raise ValueError(f"{st.st_size} bytes, more than a record ever holds")
            return json.loads(os.read(fd, MAX_RECORD + 1))
        finally:
            os.close(fd)

    def scan(self) -> tuple[list[OpRecord], list[Unreadable]]:
        """Every record, each marked untrusted unless it is one to act on (_trust), and the files named like
        records that cannot be read as one."""
        try:
            names = sorted(os.listdir(self.dir))
        except FileNotFoundError:
            return [], []
        out, bad = [], []
        for n in names:
            if not (n.endswith(".json") and _OP_RE.fullmatch(n[:-5])):
                continue
            try:
                d = self._read(n)
                if not isinstance(d, dict):
                    raise ValueError("not an object")
                d = dict(d)
                mac = d.pop("mac", None)
                rec = OpRecord.from_dict(d)
                if rec.op != n[:-5]:
                    raise ValueError("its op id is not its file's name")
            except (OSError, ValueError, RecursionError, JournalError) as e:
                bad.append(Unreadable(n[:-5], f"unreadable journal record: {getattr(e, 'strerror', None) or e}"))
                continue
            why, legacy = self._trust(d, rec, mac)
            out.append(replace(rec, untrusted=why, legacy=legacy))
        return out, bad

    def records(self) -> list[OpRecord]:
        """Every readable record (scan)."""
        return self.scan()[0]

    def _trust(self, d: dict[str, Any], rec: OpRecord, mac: Any) -> tuple[str | None, bool]:
        """Why REC (D as read, MAC its MAC) is not one to act on (None: it is), and whether it is trusted under
        the old in-store key only. One to act on: a valid MAC under the host key over all it says, written for
        this very store directory, and either of another boot (nothing it names runs: recovery signals nothing)
        or the current record of its operation as that operation's host-local state names it."""
        if not rec.boot:  # written by a gpusnap that kept its key in the store
            try:
                old = legacy_key(self.dir)
            except GpusnapError as e:
                return f"written under the old in-store journal key, which cannot be read safely ({e})", False
            if old is None or not old.check("journal-record", d, mac):
                return "it carries no valid MAC: gpusnap did not write it", False
            if not self.trust_old_key:
                return ("it was written under the old in-store journal key, which travels with every copy of the "
                        "store; if this store was never copied from elsewhere, `gpusnap recover --trust-old-key` "
                        "acts on it once"), False
            return None, True
        if rec.store != self.store_id:  # (its MAC, under that store's key, could not check here either)
            return "it was written for another store directory (this store, or the record, was copied or moved)", False
        if not self.key.check("journal-record", d, mac):
            return "it carries no valid MAC under this store's journal key: gpusnap did not write it here", False
        if rec.other_boot:
            return None, False
        state = opstate.load(rec.op)
        if state is None or state.store != rec.store or mac not in state.macs:
            return ("it is not the current record of its operation (replayed: kept and put back, or copied, after "
                    "the operation went on or finished)"), False
        return None, False

    def set_aside(self, op: str) -> str:
        """Move OP's record out of the way (journal/rejected-OP.json), so that it blocks nothing and is kept
        for whoever investigates; its path."""
        dst = os.path.join(self.dir, f"rejected-{op}.json")
        os.rename(self._path(op), dst)
        _fsync_dir(self.dir)
        return dst

    def unfinished(self) -> list[OpRecord]:
        """Records whose owner died: interrupted operations `gpusnap recover` must finish or undo (or set aside)."""
        return [r for r in self.records() if r.other_boot or not r.owner.alive()]

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
    """Refuse (exit 5) while an interrupted operation waits for `gpusnap recover`. Only records recovery would
    act on block: one it would set aside (no valid MAC, another store's, replayed, unreadable) is set aside here
    and now, with a warning, and blocks nothing."""
    j = Journal(store_path)
    recs, bad = j.scan()
    left = []
    for r in recs:
        if not (r.other_boot or not r.owner.alive()):
            continue
        if r.untrusted is None:
            left.append(r)
            continue
        _set_aside_quietly(j, r.op, r.untrusted)
    for b in bad:
        _set_aside_quietly(j, b.op, b.why)
    if left:
        raise RecoveryNeeded(f"an interrupted {left[0].describe()} must be finished first: run `gpusnap recover`"
                             + (f" ({len(left)} operations)" if len(left) > 1 else ""))


def _set_aside_quietly(j: Journal, op: str, why: str) -> None:
    try:
        where = j.set_aside(op)
    except OSError as e:
        where = f"left in place ({e.strerror or e})"
    print(f"gpusnap: journal record {op} ignored ({why}); set aside as {where}", file=sys.stderr)


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
    j = Journal(store_path)
    op = Op(j, OpRecord(uuid.uuid4().hex, kind, Stage.STARTED, owner, snapshot, procs=procs, started=time.time(),
                        boot=boot_id(), store=j.store_id, **fields))
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
