"""The remote tier: a store's snapshots pushed to and pulled from a remote, through the Backend protocol
only (storage/remote/backend.py: an S3-compatible object store, `s3://`, or a shared directory,
`file://`; registry.py picks one by the URL's scheme). Nothing here knows which.

Guarantees kept here (FORMAT.md, "Remote stores", has the layout and the protocol):
- a remote snapshot is visible only once its manifest object exists, and a push writes that object
  only after every chunk the manifest names is present remotely: a killed push leaves no snapshot;
- nothing relies on conditional writes (Swift's S3 API has none): objects have content-derived or
  unique names, and gc and push exclude each other through lock objects with server-side times;
- only chunks the other side lacks travel, in packs: a push uploads packs of the chunks no remote
  index object lists, then their index objects; a pull reads the index objects, then fetches the
  entries it lacks by coalesced range reads of the packs; nothing lists one key per chunk (remotes of
  the one-object-per-chunk layout, version 1, are read chunk by chunk: FORMAT.md, "Remote versions");
- every index object is validated as a local index file, and every range answer must be exactly the
  bytes asked, before any of it is used;
- every chunk fetched is verified against its id before it enters the local store (a raw-addressed
  one decoded and its raw bytes hashed); one that does not match is refetched once, then reported as
  damage; a remote manifest is validated by
  Manifest.loads like a local one; a pulled snapshot is committed through the local store's writer;
- remote gc deletes only chunks no remote manifest names, never while a fresh push or pull lock
  exists, and a push whose lock was removed as stale re-checks every chunk before it commits;
- credentials (S3) come from the environment or a 0600 file; they are never in an argument, a message
  or a remote's config;
- every call ends by the command's deadline, every listing is bounded (backend.list_keys), and index
  objects are streamed, only the entries a command needs held (FORMAT.md, "Bounds on every remote
  command").
Nothing here knows CRIU or runsc: a snapshot is a manifest and chunks.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import socket
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from storage.base.progress import Progress
from storage.format.chunkfile import HEADER_SIZE, ChunkError, ChunkHeader, check_received, max_stored_len
from storage.fs.directio import AlignedBuffer, BufferPool
from storage.base.errors import GpusnapError
from storage.fs.directio import align_up
from storage.base.limits import DEFAULT_JOBS, MAX_MANIFEST, MAX_RECORD
from storage.format.manifest import ChunkRef, Manifest, ManifestError
from storage.base.names import validate_snapshot_name
from storage.format.packs import INDEX_MAX, PACK_NAME, IndexDamage, IndexStream, Loc, PackIndex, coalesce, encode_index
from storage.repo.store import Problem, SnapshotStore, StoreError, VerifyReport
from storage.remote.backend import (CLEANUP_S, Backend, BackendDamage, BackendError, BackendUnavailable, Deadline,
                                    list_keys)
# the configuration's names, re-exported for the callers of this module
from storage.remote.config import (RemoteConfig, add_remote, list_remotes, load_remote, remote_exists, remove_remote,
                                   validate_remote_name)
from storage.remote.credentials import Credentials
from storage.remote.registry import open_backend, resolve_url

REMOTE_FORMAT = "gpusnap-remote"
REMOTE_VERSION = 2              # packs and index objects; 1: one object per chunk (read, FORMAT.md)
READ_VERSIONS = (1, 2)
# a remote pack is closed before an entry would take it past this (env: a test hook, to make packs of one entry)
REMOTE_PACK_TARGET = int(os.environ.get("GPUSNAP_REMOTE_PACK_TARGET", 64 << 20))
# the most bytes one range read of a pack asks for, unless one entry is larger (env: a test hook)
RANGE_MAX = int(os.environ.get("GPUSNAP_REMOTE_RANGE_MAX", 16 << 20))
LOCK_REFRESH_S = float(os.environ.get("GPUSNAP_REMOTE_LOCK_REFRESH_S", 60.0))  # env: a test hook
LOCK_STALE_S = float(os.environ.get("GPUSNAP_REMOTE_LOCK_STALE_S", 30 * 60))
_ID_RE = re.compile(r"[0-9a-f]{64}")
# the layout under a remote's prefix (FORMAT.md, "Remote stores"): this module owns it
MARKER_KEY = "gpusnap-remote.json"
PACKS, INDEX, CHUNKS, SNAPSHOTS, LOCKS, TMP = "packs", "index", "chunks", "snapshots", "locks", "tmp"


# the remote tier's errors are the backend's (one family, the existing exit codes: 1, 4 unavailable, 3 damage)
RemoteError = BackendError
RemoteUnreachableError = BackendUnavailable
RemoteDamageError = BackendDamage


def remote_config(name: str, url: str, endpoint: str | None = None, region: str = "us-east-1",
                  credentials_file: str | None = None) -> RemoteConfig:
    """A new remote's config as `remote add` records it: the URL as its backend resolves it (a file://
    path with its links followed once, here, by the operator who adds it; never afterwards)."""
    return RemoteConfig.make(name, resolve_url(url), endpoint, region, credentials_file)


# ---- reports -------------------------------------------------------------------------------------
@dataclass
class TransferReport:
    snapshot: str
    remote: str
    direction: str
    chunks_total: int = 0       # distinct chunks the manifest names
    chunks_sent: int = 0        # chunks that travelled
    bytes_total: int = 0        # stored bytes of all distinct chunks
    bytes_sent: int = 0         # payload bytes that travelled (chunk objects and the manifest)
    refetched: int = 0
    packs_sent: int = 0         # pack objects a push uploaded (each with its index object)
    ranges: int = 0             # range reads of packs a pull made (each one request)
    rechecked_after_gc: bool = False
    already_there: bool = False
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class RemoteGcReport:
    chunks_removed: int = 0     # chunks no manifest names any more, deleted (pack entries and chunk objects)
    packs_removed: int = 0
    bytes_freed: int = 0
    stale_locks_removed: int = 0
    temps_removed: int = 0      # tmp/ files of killed writes (a file:// remote's), older than the lock stale time


# ---- the remote ----------------------------------------------------------------------------------
def pause_for_tests(done: int, before: int | None = None) -> None:
    """GPUSNAP_TEST_PAUSE_TRANSFER=N:PATH: once the N-th chunk has moved (a pack or a range moves
    several: the count went from BEFORE to DONE past N), create PATH and wait until it is removed (lets
    tests kill -9 or stop the object store at a known point of a real transfer)."""
    spec = os.environ.get("GPUSNAP_TEST_PAUSE_TRANSFER")
    if not spec:
        return
    n, _, path = spec.partition(":")
    if not (done - 1 if before is None else before) < int(n) <= done:
        return
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    while os.path.exists(path):
        time.sleep(0.05)


def _run_bounded(fn: Callable[[Any], None], items: Iterable[Any], jobs: int) -> None:
    """FN over ITEMS on JOBS threads with at most 2*JOBS queued (back-pressure); the first error stops
    the submission and is raised once the running calls end."""
    with ThreadPoolExecutor(jobs) as ex:
        pending: set[Future[None]] = set()
        try:
            for item in items:
                if len(pending) >= 2 * jobs:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        f.result()
                pending.add(ex.submit(fn, item))
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for f in done:
                f.result()
        except BaseException:
            for f in pending:
                f.cancel()
            raise


class Remote:
    """A gpusnap remote: a backend's root laid out as FORMAT.md, "Remote stores", says."""

    def __init__(self, cfg: RemoteConfig, backend: Backend | None = None, jobs: int = DEFAULT_JOBS,
                 deadline: Deadline | float | None = None) -> None:
        """CFG's remote through BACKEND (where None: the one its URL's scheme names, opened with the
        retries and rate limits of storage/remote/backend.py). Every call ends by DEADLINE (seconds
        from now, or GPUSNAP_REMOTE_DEADLINE_S, default an hour): a silent remote fails the command
        then, with one line (exit 4)."""
        self.cfg = cfg
        self.jobs = max(1, jobs)
        self.deadline = deadline if isinstance(deadline, Deadline) else Deadline(deadline)
        self.backend: Backend = backend if backend is not None else open_backend(
            cfg.spec(pool=2 * self.jobs + 2), self.deadline)
        self.version = REMOTE_VERSION  # what check() found

    @classmethod
    def open(cls, store: SnapshotStore, name: str | None, jobs: int = DEFAULT_JOBS,
             deadline: Deadline | float | None = None) -> "Remote":
        return cls(load_remote(store, name), jobs=jobs, deadline=deadline)

    def _list(self, prefix: str) -> Iterator[tuple[str, int, float]]:
        """(key, size, modification time) of every object under PREFIX: bounded in keys, pages and
        time (backend.list_keys)."""
        for o in list_keys(self.backend, prefix, self.deadline):
            yield o.key, o.size, o.mtime

    def _size(self, key: str) -> int | None:
        info = self.backend.stat(key)
        return None if info is None else info.size

    # ---- keys (relative to the remote's root: the backend places them) ----
    def key(self, *parts: str) -> str:
        return "/".join(p for p in parts if p)

    def chunk_key(self, cid: str) -> str:
        """A version 1 chunk object (read, never written now)."""
        return self.key(CHUNKS, cid[:2], cid)

    def pack_key(self, pack: str) -> str:
        return self.key(PACKS, pack)

    def index_key(self, pack: str) -> str:
        return self.key(INDEX, pack)

    def manifest_key(self, name: str) -> str:
        return self.key(SNAPSHOTS, validate_snapshot_name(name) + ".json")

    # ---- setup ----
    def init(self) -> None:
        """Create the bucket if missing and mark PREFIX as a gpusnap remote (checks one already there)."""
        self.backend.ensure()
        marker = self.backend.get(self.key(MARKER_KEY), MAX_RECORD)
        if marker is None:
            self.backend.put(self.key(MARKER_KEY),
                        json.dumps({"format": REMOTE_FORMAT, "version": REMOTE_VERSION}).encode())
        else:
            self._check_marker(marker)

    def check(self) -> None:
        marker = self.backend.get(self.key(MARKER_KEY), MAX_RECORD)
        if marker is None:
            raise RemoteError(f"remote {self.cfg.name!r}: {self.cfg.url} is not a gpusnap remote "
                              "(`gpusnap remote add` creates it)")
        self._check_marker(marker)

    def _check_marker(self, data: bytes) -> None:
        try:
            info = json.loads(data)
        except (ValueError, RecursionError):
            info = None
        if not isinstance(info, dict) or info.get("format") != REMOTE_FORMAT or info.get("version") not in READ_VERSIONS:
            raise RemoteError(f"remote {self.cfg.name!r}: {self.cfg.url} holds something other than a "
                              f"{REMOTE_FORMAT} v{REMOTE_VERSION}")
        self.version = int(info["version"])

    def upgrade(self) -> None:
        """Mark a version 1 remote version 2 before its first pack (FORMAT.md, "Remote versions")."""
        if self.version < REMOTE_VERSION:
            self.backend.put(self.key(MARKER_KEY), json.dumps({"format": REMOTE_FORMAT, "version": REMOTE_VERSION}).encode())
            self.version = REMOTE_VERSION

    # ---- the index objects ----
    def read_index(self, wanted: set[str] | None = None) -> PackIndex:
        """The remote's index objects (one listing of index/, bounded; one streamed GET each, JOBS at
        a time), each validated whole as a local index file as it arrives; of their entries only those
        of the chunks in WANTED are held (all where None), so a remote of many large index objects
        costs a pull time, not memory. One that fails is recorded in .damage, its entries unused; every
        sound one is in .packs (its entries in .entries, the wanted ones only)."""
        return self._read_index(wanted)[0]

    def _read_index(self, wanted: set[str] | None) -> tuple[PackIndex, dict[str, int]]:
        """(read_index's answer, the number of entries of each sound index object)."""
        base = self.key(INDEX) + "/"
        names = [k[len(base):] for k, _, _ in self._list(base) if PACK_NAME.fullmatch(k[len(base):])]
        got: dict[str, tuple[int, int, list[tuple[str, int, int]]] | str] = {}
        lock = threading.Lock()
        keep: Callable[[str], bool] = (lambda cid: True) if wanted is None else wanted.__contains__

        def one(name: str) -> None:
            dec = IndexStream(name, keep, INDEX_MAX)
            res: tuple[int, int, list[tuple[str, int, int]]] | str
            try:
                if not self.backend.get_stream(self.index_key(name), INDEX_MAX, dec.feed):
                    return  # deleted since the listing (a gc): its pack goes too
                res = dec.finish()
            except IndexDamage as e:
                res = f"remote {self.cfg.name!r}: {e}"
            except BackendDamage as e:
                res = str(e)
            with lock:
                got[name] = res
        _run_bounded(one, names, self.jobs)
        idx = PackIndex()
        counts: dict[str, int] = {}
        for name in sorted(got):
            res = got[name]
            if isinstance(res, str):
                idx.damage[name] = res
            else:
                idx.add(name, res[0], res[2])
                counts[name] = res[1]
        return idx, counts

    def pack_sizes(self) -> dict[str, int]:
        """Every pack object present, by name, with its size (one listing of packs/: one key per pack)."""
        base = self.key(PACKS) + "/"
        return {k[len(base):]: size for k, size, _ in self._list(base) if PACK_NAME.fullmatch(k[len(base):])}

    # ---- snapshots ----
    def names(self) -> list[str]:
        base = self.key(SNAPSHOTS) + "/"
        out = []
        for k, _, _ in self._list(base):
            rest = k[len(base):]
            if rest.endswith(".json") and "/" not in rest:
                try:
                    out.append(validate_snapshot_name(rest[:-5]))
                except GpusnapError:
                    continue  # not ours: never becomes a name we use
        return sorted(out)

    def manifest_bytes(self, name: str) -> bytes | None:
        return self.backend.get(self.manifest_key(name), MAX_MANIFEST)

    def load(self, name: str) -> Manifest:
        data = self.manifest_bytes(name)
        if data is None:
            raise RemoteError(f"remote {self.cfg.name!r} has no snapshot named {name!r}")
        return self._parse(name, data)

    def _parse(self, name: str, data: bytes) -> Manifest:
        try:
            m = Manifest.loads(data, where=f"remote {self.cfg.name!r} snapshot {name!r}")
        except ManifestError as e:
            raise RemoteDamageError(str(e)) from None
        if m.name != name:
            raise RemoteDamageError(f"remote snapshot {name!r}: manifest says its name is {m.name!r}")
        return m

    def chunk_sizes(self) -> dict[str, int]:
        """Every chunk object present remotely, by id, with its size (one listing)."""
        base = self.key(CHUNKS) + "/"
        out: dict[str, int] = {}
        for k, size, _ in self._list(base):
            cid = k.rsplit("/", 1)[-1]
            if _ID_RE.fullmatch(cid) and k == self.chunk_key(cid):
                out[cid] = size
        return out

    def remove(self, name: str) -> None:
        if self._size(self.manifest_key(name)) is None:
            raise RemoteError(f"remote {self.cfg.name!r} has no snapshot named {name!r}")
        self.backend.delete(self.manifest_key(name))

    # ---- locks ----
    def _locks(self) -> list[tuple[str, str, float]]:
        """(key, kind, last-modified) of every lock object."""
        base = self.key(LOCKS) + "/"
        out = []
        for k, _, t in self._list(base):
            kind = k[len(base):].split("-", 1)[0]
            out.append((k, kind, t))
        return out

    @contextmanager
    def lock(self, kind: str) -> Iterator["_Lock"]:
        """A lock object for the duration: `push` and `pull` are shared with each other, `gc` is exclusive.

        Created first, then the others are listed (so of two racing sides at least one sees the
        other and backs off); refreshed every LOCK_REFRESH_S; a lock not refreshed for LOCK_STALE_S
        (by the server's clock) that then stays unrefreshed while we watch it for two refresh periods
        (by our own monotonic clock) is stale and ignored.
        """
        lk = _Lock(self, kind)
        lk.write()
        try:
            conflict = self._conflicting_lock(lk)
            if conflict is not None:
                raise RemoteError(f"remote {self.cfg.name!r} is locked by a running {conflict}; "
                                  "try again when it ends")
            lk.start_refresh()
            yield lk
        finally:
            lk.release()

    def _conflicting_lock(self, lk: "_Lock") -> str | None:
        """The first live lock that excludes LK (its kind plus its object name), or None."""
        now = self.backend.now()
        excluding = [(key, other, t) for key, other, t in self._locks()
                     if key != lk.key and (lk.kind == "gc" or other == "gc")]
        dead = self._confirmed_stale({key: t for key, _, t in excluding if _stale(now, t)})
        for key, other, _ in excluding:
            if key not in dead:
                return f"{other} ({key.rsplit('/', 1)[-1]})"
        return None

    def _confirmed_stale(self, looks_stale: dict[str, float]) -> set[str]:
        """Of the locks in LOOKS_STALE (key -> last-modified), old by the server's clock, those that are
        not refreshed while we watch them for two refresh periods by our own monotonic clock: a server
        whose clock jumps (or whose Date disagrees with its object times) cannot make a live lock, which
        its holder rewrites every LOCK_REFRESH_S, look dead."""
        if not looks_stale or LOCK_STALE_S <= 0:
            return set(looks_stale)
        watching = dict(looks_stale)
        deadline = time.monotonic() + 2 * LOCK_REFRESH_S + 1
        while watching and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, max(0.5, LOCK_REFRESH_S / 4)))
            now = {key: t for key, _, t in self._locks()}
            for key in [k for k in watching if now.get(k) != watching[k]]:
                del watching[key]   # rewritten (alive) or removed (released): not stale
        return set(watching)

    def _reacquire(self, lk: "_Lock", timeout: float = 600.0) -> None:
        """LK again after gc removed it as stale: rewritten, then wait for a running gc to end."""
        lk.write()
        deadline = time.monotonic() + timeout
        while (conflict := self._conflicting_lock(lk)) is not None:
            if time.monotonic() > deadline:
                raise RemoteError(f"remote {self.cfg.name!r}: waited {timeout:.0f} s for {conflict} to end; "
                                  "nothing was committed")
            time.sleep(1.0)

    # ---- push ----
    def push(self, store: SnapshotStore, name: str, *, replace: bool = False, progress: Progress | None = None) -> TransferReport:
        t0 = time.perf_counter()
        rep = TransferReport(name, self.cfg.name, "push")
        with store.shared():
            m = store.load(name)
            data = m.dumps_bounded("pushed")  # what the remote's readers load (MAX_MANIFEST)
            refs = distinct_refs(m)
            ids = {_stored_id(r) for r in refs}
            rep.chunks_total = len(refs)
            rep.bytes_total = sum(HEADER_SIZE + r.stored_len for r in refs)
            self.check()
            with self.lock("push") as lk:
                old = self.manifest_bytes(name)
                same = old is not None and self._parse(name, old).dumps() == data
                if old is not None and not same and not replace:
                    raise RemoteError(f"remote {self.cfg.name!r} already has a different snapshot "
                                      f"named {name!r} (use --replace to overwrite it)")
                have = self._present(ids)
                # no sound index lists them in a pack that is all there (never pushed, a lost or damaged
                # index, a lost or truncated pack): sent, in new packs, also under a manifest already
                # there, which is how such damage is repaired
                todo = [r for r in refs if _stored_id(r) not in have]
                if same and not todo:
                    rep.already_there = True
                    rep.seconds = time.perf_counter() - t0
                    return rep
                if todo:
                    self.upgrade()
                self._upload(store, todo, rep, progress)
                if lk.lost():
                    # gc took our lock for stale and may have deleted packs we uploaded or found present
                    rep.rechecked_after_gc = True
                    self._reacquire(lk)
                    have = self._present(ids)
                    self._upload(store, [r for r in refs if _stored_id(r) not in have], rep, progress)
                self.backend.put(self.manifest_key(name), data)  # last: the snapshot is visible from here on
                rep.bytes_sent += len(data)
        rep.seconds = time.perf_counter() - t0
        return rep

    def _present(self, ids: set[str]) -> set[str]:
        """Of IDS, those a sound index lists in a pack object as long as that index says (one listing
        of index/ and one of packs/, one key per pack each)."""
        index, sizes = self.read_index(ids), self.pack_sizes()
        return {cid for pack, ents in index.entries.items() if sizes.get(pack, -1) >= index.packs[pack]
                for cid, _, _ in ents}

    def _upload(self, store: SnapshotStore, refs: list[ChunkRef], rep: TransferReport, progress: Progress | None) -> None:
        """REFS read from STORE (stored check) into packs of at most REMOTE_PACK_TARGET, each uploaded,
        then its index object; JOBS packs at a time, each built in memory by one thread."""
        if not refs:
            return
        if progress is not None:
            progress.start(sum(HEADER_SIZE + r.stored_len for r in refs))
        groups: list[list[ChunkRef]] = [[]]
        size = 0
        for r in refs:  # manifest order: a pull of this snapshot reads each pack front to back
            n = HEADER_SIZE + align_up(max_stored_len(r.codec, r.raw_len, r.stored_len))
            if groups[-1] and size + n > REMOTE_PACK_TARGET:
                groups.append([])
                size = 0
            groups[-1].append(r)
            size += n
        lock = threading.Lock()
        with BufferPool(min(self.jobs, len(groups)), _buffer_size(refs)) as pool:
            def send(group: list[ChunkRef]) -> None:
                pack = bytearray()
                ents: list[tuple[str, int, int]] = []
                with pool.borrowed() as buf:
                    for ref in group:
                        try:
                            # the stored check: a damaged local chunk never travels (a pull checks in full);
                            # a delta entry travels whole (full-checked, no base on the remote: FORMAT.md)
                            header, payload = store.expanded(ref.id or "", *store.read_stored(ref, buf))
                        except ChunkError as e:
                            raise StoreError(f"local snapshot damaged, nothing pushed: {e}") from None
                        n = HEADER_SIZE + align_up(header.stored_len)
                        if pack and len(pack) + n > REMOTE_PACK_TARGET:
                            self._send_pack(pack, ents, rep, progress, lock)
                            pack, ents = bytearray(), []
                        ents.append((_stored_id(ref), len(pack), n))
                        pack += header.pack().ljust(HEADER_SIZE, b"\0")
                        pack += payload
                        pack += bytes(n - HEADER_SIZE - header.stored_len)
                if ents:
                    self._send_pack(pack, ents, rep, progress, lock)
            _run_bounded(send, groups, self.jobs)

    def _send_pack(self, pack: bytearray, ents: list[tuple[str, int, int]], rep: TransferReport,
                   progress: Progress | None, lock: threading.Lock) -> None:
        """Upload PACK, then its index object (a pack without its index is garbage for gc)."""
        name = secrets.token_hex(16)
        index = encode_index(name, len(pack), ents)
        self.backend.put(self.pack_key(name), pack)
        self.backend.put(self.index_key(name), index)
        with lock:
            before = rep.chunks_sent
            rep.chunks_sent += len(ents)
            rep.packs_sent += 1
            rep.bytes_sent += len(pack) + len(index)
            done = rep.chunks_sent
        if progress is not None:
            progress.advance(len(pack))
        pause_for_tests(done, before)

    # ---- verify / gc ----
    def verify(self, names: list[str] | None = None, read_data: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Every named snapshot's manifest valid and every chunk present: an entry of a sound index whose
        pack object is there and as long as its index says (or, not in any index, a version 1 chunk
        object of a possible size: one HEAD each); with READ_DATA every chunk also fetched (coalesced
        range reads) and checked in full."""
        report = VerifyReport()
        self.check()
        manifests = []
        for n in (names if names is not None else self.names()):
            report.snapshots.append(n)
            try:
                manifests.append(self.load(n))
            except RemoteError as e:
                report.problems.append(Problem(n, None, None, str(e)))
        refs = {_stored_id(r): r for m in manifests for r in distinct_refs(m)}
        index = self.read_index(set(refs))
        report.problems += [Problem("(remote)", None, None, why + " (the chunks it lists read as missing)")
                            for why in index.damage.values()]
        sizes = self.pack_sizes()
        bad: dict[str, str] = {}
        at: dict[str, Loc] = {}
        legacy: list[ChunkRef] = []
        for cid, r in refs.items():
            locs = [loc for loc in index.find(cid) if _entry_fits(r, loc)]
            if locs:
                whole = usable(index, sizes, r)
                if whole:
                    at[cid] = whole[0]
                    continue
                loc = locs[0]
                have = sizes.get(loc.pack)
                bad[cid] = (f"its pack {loc.pack[:12]}… is missing on the remote" if have is None else
                            f"its pack {loc.pack[:12]}… is {have} bytes on the remote, not {index.packs[loc.pack]}")
                continue
            size = self._size(self.chunk_key(cid))
            if size is None:
                bad[cid] = "missing on the remote"
            elif not _size_fits(r, size):
                bad[cid] = f"is {size} bytes on the remote, not {HEADER_SIZE + r.stored_len}"
            else:
                legacy.append(r)
        if read_data:
            todo = [refs[c] for c in at] + legacy
            if progress is not None:
                progress.start(sum(HEADER_SIZE + r.stored_len for r in todo))
            lock = threading.Lock()

            def done(ref: ChunkRef, why: str | None) -> None:
                with lock:
                    if why is not None:
                        bad[_stored_id(ref)] = why
                    report.chunks_checked += 1
                    report.bytes_checked += HEADER_SIZE + ref.stored_len
                if progress is not None:
                    progress.advance(HEADER_SIZE + ref.stored_len)
            runs = coalesce(sorted(((i, at[c]) for i, c in enumerate(at)), key=lambda x: (x[1].pack, x[1].offset)),
                            most=RANGE_MAX)
            ids = list(at)
            size = max([_buffer_size(legacy)] + [run[-1][1].offset + run[-1][1].length - run[0][1].offset
                                                 for run in runs])
            with BufferPool(self.jobs, size) as pool:
                def check_run(run: list[tuple[int, Loc]]) -> None:
                    with pool.borrowed() as buf:
                        for cid, why, _, _ in self.fetch_run([(refs[ids[i]], loc) for i, loc in run], buf):
                            done(refs[cid], why)

                def check_one(ref: ChunkRef) -> None:
                    with pool.borrowed() as buf:
                        done(ref, check_fetched(ref, buf, self.backend.get_into(self.chunk_key(_stored_id(ref)), buf.view))[0])
                _run_bounded(check_run, runs, self.jobs)
                _run_bounded(check_one, legacy, self.jobs)
        else:
            report.chunks_checked = len(refs)
        for m in manifests:
            for s in m.streams:
                for i, c in enumerate(s.chunks):
                    if c.id in bad:
                        report.problems.append(Problem(m.name, s.name, i, f"chunk {c.id[:16]}… {bad[c.id]}"))
        return report

    def fetch_run(self, run: list[tuple[ChunkRef, Loc]], buf: AlignedBuffer) -> list[tuple[str, str | None, ChunkHeader | None, memoryview]]:
        """The entries RUN (adjacent entries of one pack, in offset order) fetched with one range read
        into BUF and each checked as a chunk file received: (id, why it is not that chunk or None, its
        header, its entry's bytes in BUF). A range answer of the wrong length fails every entry."""
        first, last = run[0][1], run[-1][1]
        length = last.offset + last.length - first.offset
        try:
            n = self.backend.get_range_into(self.pack_key(first.pack), first.offset, length, buf.view)
            why_all = None if n is not None else f"its pack {first.pack[:12]}… is missing on the remote"
        except RemoteDamageError as e:
            why_all = str(e)
        out: list[tuple[str, str | None, ChunkHeader | None, memoryview]] = []
        for ref, loc in run:
            view = buf.view[loc.offset - first.offset:loc.offset - first.offset + loc.length]
            if why_all is not None:
                out.append((_stored_id(ref), why_all, None, view))
            else:
                why, header = check_entry(ref, view)
                out.append((_stored_id(ref), why, header, view))
        return out

    def _sweep_tmp(self, now: float, report: RemoteGcReport) -> None:
        """Remove tmp/ objects (a file:// remote's unfinished writes) not touched for LOCK_STALE_S: no
        write that is still running is that old (a put takes seconds; the lock of its push would be
        stale too)."""
        for key, _, t in list(self._list(self.key(TMP) + "/")):
            if now - t > max(LOCK_STALE_S, 60.0):
                self.backend.delete(key)
                report.temps_removed += 1

    def gc(self) -> RemoteGcReport:
        """Delete the packs and version 1 chunk objects no remote manifest names, holding the exclusive gc lock."""
        report = RemoteGcReport()
        self.check()
        with self.lock("gc") as lk:
            now = self.backend.now()
            for key in self._confirmed_stale({key: t for key, _, t in self._locks() if key != lk.key and _stale(now, t)}):
                self.backend.delete(key)  # a push that wakes up finds its lock gone and re-checks
                report.stale_locks_removed += 1
            live: set[str] = set()
            for n in self.names():
                try:
                    live |= self.load(n).chunk_ids()
                except RemoteError as e:
                    raise RemoteError(f"remote gc stopped, nothing deleted: {e}; `gpusnap remote forget {n}` "
                                      "it first if it cannot be repaired") from None
            index, counts = self._read_index(live)  # only the live entries are held
            sizes = self.pack_sizes()
            lock = threading.Lock()
            # packs without an index (a killed push's; no push runs now) and packs with nothing live
            dead_packs: list[tuple[str, int, int]] = [(p, size, -1) for p, size in sizes.items() if p not in index.packs and p not in index.damage]
            dead_packs += [(p, sizes.get(p, 0), counts[p]) for p, ents in index.entries.items() if not ents]

            def drop_pack(item: tuple[str, int, int]) -> None:
                pack, size, n = item
                if n >= 0:
                    self.backend.delete(self.index_key(pack))  # the index first: a listed index means its pack is there
                self.backend.delete(self.pack_key(pack))
                with lock:
                    report.packs_removed += 1
                    report.chunks_removed += max(n, 0)
                    report.bytes_freed += size
            _run_bounded(drop_pack, dead_packs, self.jobs)
            self._sweep_tmp(now, report)
            in_packs = {c for ents in index.entries.values() for c, _, _ in ents}
            dead = [(cid, size) for cid, size in self.chunk_sizes().items() if cid not in live or cid in in_packs]

            def drop(item: tuple[str, int]) -> None:
                self.backend.delete(self.chunk_key(item[0]))
                with lock:
                    report.chunks_removed += item[0] not in live
                    report.bytes_freed += item[1]
            _run_bounded(drop, dead, self.jobs)
        return report


def _stale(now: float, modified: float) -> bool:
    """Whether a lock last written at MODIFIED is stale at NOW (both the server's clock). A limit of 0
    (the test hook GPUSNAP_REMOTE_LOCK_STALE_S) takes every lock for stale: a refresh can land between
    the server-time read and the listing, within the same second."""
    return LOCK_STALE_S <= 0 or now - modified > LOCK_STALE_S


class _Lock:
    """One lock object `locks/KIND-HOST-PID-RANDOM.json`, rewritten by a thread to keep it fresh."""

    def __init__(self, remote: Remote, kind: str) -> None:
        self.remote = remote
        self.kind = kind
        host = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname())[:64]
        self.key = remote.key(LOCKS, f"{kind}-{host}-{os.getpid()}-{uuid.uuid4().hex[:12]}.json")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self) -> None:
        body = {"kind": self.kind, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        self.remote.backend.put(self.key, json.dumps(body).encode())

    def lost(self) -> bool:
        return self.remote.backend.stat(self.key) is None

    def start_refresh(self) -> None:
        def run() -> None:
            while not self._stop.wait(LOCK_REFRESH_S):
                try:
                    self.write()
                except GpusnapError:
                    pass  # the next refresh tries again; lost() catches a lock gc removed
        self._thread = threading.Thread(target=run, name="gpusnap-remote-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        try:
            self.remote.backend.delete(self.key, Deadline(CLEANUP_S))  # also once the command's deadline passed
        except GpusnapError:
            pass  # a lock left behind goes stale by itself (FORMAT.md, "Remote locks")


def _stored_id(r: ChunkRef) -> str:
    """The id of a stored (not zero) chunk, as distinct_refs returns them."""
    if r.id is None:
        raise RemoteError("internal: a zero chunk where a stored one was expected")
    return r.id


def distinct_refs(m: Manifest, smallest_streams_first: bool = False) -> list[ChunkRef]:
    """M's stored chunks, each once, in stream order (smallest streams first if asked)."""
    streams = sorted(m.streams, key=lambda s: s.size) if smallest_streams_first else m.streams
    seen: set[str] = set()
    out = []
    for s in streams:
        for c in s.chunks:
            if c.id is not None and c.id not in seen:
                seen.add(c.id)
                out.append(c)
    return out


def check_fetched(ref: ChunkRef, buf: AlignedBuffer, n: int | None) -> tuple[str | None, ChunkHeader | None]:
    """(why the N bytes fetched into BUF are not chunk REF, None) or (None, their header) when they are
    (chunkfile.check_received: a GSNPCHK2 object is decoded and its raw bytes hashed)."""
    if n is None:
        return "is missing on the remote", None
    return _check_image(ref, buf.view[:n])


def check_entry(ref: ChunkRef, entry: memoryview) -> tuple[str | None, ChunkHeader | None]:
    """As check_fetched, for ENTRY, the bytes of a pack entry (a chunk file and its zero padding): its
    header's stored length must fit in it, then the chunk file is checked."""
    assert ref.id is not None
    try:
        header = ChunkHeader.unpack(entry[:64], ref.id)
    except Exception:  # noqa: BLE001 - whatever a hostile entry makes the parser raise
        return "has a malformed header", None
    n = HEADER_SIZE + header.stored_len
    if n > len(entry):
        return f"its entry is {len(entry)} bytes, its header says {n}", None
    return _check_image(ref, entry[:n])


def _check_image(ref: ChunkRef, image: memoryview) -> tuple[str | None, ChunkHeader | None]:
    assert ref.id is not None
    try:
        return None, check_received(ref.id, ref.codec, ref.raw_len, ref.stored_len, image)
    except ChunkError as e:
        return e.what, None
    except Exception:  # noqa: BLE001 - whatever a hostile object makes the parser or decoder raise
        return "has a malformed header or payload", None


def usable(index: PackIndex, sizes: dict[str, int], ref: ChunkRef) -> list[Loc]:
    """The entries of REF that INDEX lists in a pack object (SIZES: a listing of packs/) at least as
    long as its index says, and that can be REF at all (_entry_fits): the ones a reader tries."""
    return [loc for loc in index.find(_stored_id(ref)) if _entry_fits(ref, loc)
            and sizes.get(loc.pack, -1) >= index.packs[loc.pack]]


def _entry_fits(ref: ChunkRef, loc: Loc) -> bool:
    """Whether an index entry LOC can be chunk REF at all (so that a hostile index cannot make a reader
    allocate more than the snapshot's chunk needs)."""
    return HEADER_SIZE < loc.length <= HEADER_SIZE + align_up(max_stored_len(ref.codec, ref.raw_len, ref.stored_len))


def _size_fits(ref: ChunkRef, size: int | None) -> bool:
    """Whether an object of SIZE bytes can be chunk REF without reading it: exactly its file for a GPU
    codec; for raw/zstd, also any other encoding of the same raw bytes (a GSNPCHK2 chunk pushed from
    another host: FORMAT.md, "Trust")."""
    if size is None:
        return False
    if size == HEADER_SIZE + ref.stored_len:
        return True
    return HEADER_SIZE < size <= HEADER_SIZE + max_stored_len(ref.codec, ref.raw_len, ref.stored_len)


def _buffer_size(refs: list[ChunkRef]) -> int:
    """A buffer that holds any object that may be one of REFS (and detects a larger one)."""
    return max((HEADER_SIZE + max_stored_len(r.codec, r.raw_len, r.stored_len) for r in refs),
               default=HEADER_SIZE) + HEADER_SIZE

