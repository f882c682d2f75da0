"""A remote snapshot pulled into the local store in the background while a reader waits for its chunks.

RemoteFill is what `gpusnap pull` and a restore `--from` a remote use: it reads and validates the
remote manifest and the remote's index objects, then a fixed number of fetch threads (the
back-pressure: at most JOBS requests in flight, one buffer of at most RANGE_MAX each) fetch every
chunk the local store lacks, in an order the reader may change while they run (`first`): a thread
takes the next chunk and, with it, the entries that follow it in its remote pack while they are
wanted and not yet taken (one range read; a chunk no index lists is one GET of its version 1 chunk
object); each entry is verified against its id on arrival and written through the local store's
writer, whose pack is closed and indexed after each range. A reader (the CRIU image streamer) calls `wait(id)` before it reads a chunk:
it returns as soon as that chunk is local (a chunk not yet fetched is moved to the front).

Guarantees kept here:
- nothing unverified enters the local store (storage.remote.client's check; a bad chunk is fetched once
  more, then reported as damage);
- the local manifest is committed only by `finish`, once every chunk is local and verified; leaving
  the context without it (a failure, a signal, a failed restore) stops the fetches and commits
  nothing: no half snapshot is visible, the chunks already stored are reused by the next attempt
  (until the local gc, which the writer's shared lock keeps away meanwhile);
- a fetch that fails (the object store down after the retries, damage) stops the other fetches and
  is raised to every waiter and by `finish`, so a reader fails at once instead of hanging;
- the remote's `pull` lock object is held from before the manifest is read to the end, so a
  `remote gc` cannot delete chunks this pull is about to fetch (a gc that took the lock for stale
  may have: the missing chunk then fails the pull, which commits nothing).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Iterable

from storage.base.progress import Progress
from storage.format.chunkfile import HEADER_SIZE
from storage.fs.directio import BufferPool
from storage.base.errors import GpusnapError
from storage.format.manifest import ChunkRef, Manifest
from storage.format.chunkfile import ChunkHeader
from storage.fs.directio import AlignedBuffer
from storage.format.packs import Loc
from storage.remote.client import (
    DEFAULT_JOBS,
    RANGE_MAX,
    Remote,
    RemoteDamageError,
    RemoteError,
    TransferReport,
    _buffer_size,
    check_fetched,
    distinct_refs,
    pause_for_tests,
    usable,
)
from storage.repo.store import SnapshotDamaged, SnapshotStore, StoreError
from storage.repo.tier import Verified

if TYPE_CHECKING:
    from storage.gpu.device import HostBuffer

HANDOFF_BYTES = 128 << 20  # verified payloads held for the reader, at most


class RemoteFill:
    """Snapshot NAME of REMOTE into STORE, fetched in the background; a context manager.

    In the context: `manifest` (validated), `already_there` (the same snapshot is local: nothing to
    do), `start()` launches the fetches, `first(refs)` moves chunks to the front, `wait(id)` blocks
    until a chunk is local, `take(id)` hands over its verified payload when it is still held (the
    chunks the reader asked for, up to HANDOFF_BYTES, so the reader need not read and hash them
    again), `finish()` waits for all and commits."""

    def __init__(self, remote: Remote, store: SnapshotStore, name: str, *, replace: bool = False,
                 progress: Progress | None = None, handoff_bytes: int = HANDOFF_BYTES) -> None:
        self.remote, self.store, self.name = remote, store, name
        self.replace, self.progress = replace, progress
        self.report = TransferReport(name, remote.cfg.name, "pull")
        self.manifest: Manifest | None = None
        self.already_there = False
        self._stack = ExitStack()
        self._w: Any = None
        self._lk: Any = None
        self._refs: dict[str, ChunkRef] = {}
        self._at: dict[str, Loc] = {}                 # chunk -> its entry in a remote pack (absent: a chunk object)
        self._pack_order: dict[str, list[tuple[str, Loc]]] = {}  # pack -> its entries we may want, by offset
        self._pos: dict[tuple[str, int], int] = {}    # (pack, offset) -> position in _pack_order[pack]
        self._doomed: dict[str, str] = {}             # chunk -> why no remote copy of it can be sound
        self._events: dict[str, threading.Event] = {}
        self._queue: deque[str] = deque()
        self._lock = threading.Lock()  # the queue, the report, the error
        self._started: set[str] = set()
        self._error: BaseException | None = None
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._wanted: set[str] = set()             # chunks a reader asked for (first): kept for take()
        self._kept: dict[str, tuple[str, bytes]] = {}  # verified (codec, payload) not yet taken
        self._kept_bytes = 0
        self.handoff_bytes = handoff_bytes
        self.began = time.monotonic()
        self.seconds_to_all_local: float | None = None  # from began
        self.seconds_to_first_read: float | None = None  # from began: a reader had its first chunk

    # ---- setup ----
    def __enter__(self) -> "RemoteFill":
        try:
            self._open()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _open(self) -> None:
        r, rep = self.remote, self.report
        r.check()
        self._lk = self._stack.enter_context(r.lock("pull"))  # before the manifest is read: gc deletes nothing meanwhile
        m = self.manifest = r.load(self.name)
        refs = distinct_refs(m, smallest_streams_first=True)
        rep.chunks_total = len(refs)
        rep.bytes_total = sum(HEADER_SIZE + c.stored_len for c in refs)
        if self.store.exists(self.name):
            if self.store.load(self.name).dumps() == m.dumps():
                self.already_there = True
                return
            if not self.replace:
                raise StoreError(f"snapshot {self.name!r} already exists locally and differs from the remote's "
                                 "(use --replace to overwrite it)")
        self._w = self._stack.enter_context(self.store.writer(
            self.name, replace=self.replace, meta=m.meta, tags=m.tags, created=m.created, host=m.host))
        missing = set(self.store.missing(m))
        index = r.read_index(missing) if missing else None
        sizes = r.pack_sizes() if missing else {}
        for c in refs:
            if c.id in missing:
                assert c.id is not None
                self._refs[c.id] = c
                self._events[c.id] = threading.Event()
                self._queue.append(c.id)
                locs = usable(index, sizes, c) if index is not None else []
                if locs:
                    self._at[c.id] = locs[0]
                elif index is not None and index.find(c.id):
                    loc = index.find(c.id)[0]  # its only entries lie in a pack cut short: damage, when reached
                    self._doomed[c.id] = (f"its pack {loc.pack[:12]}… is {sizes.get(loc.pack, 0)} bytes on the remote, "
                                          f"shorter than its index says ({index.packs[loc.pack]})")
        for cid, loc in self._at.items():
            self._pack_order.setdefault(loc.pack, []).append((cid, loc))
        for pack, ents in self._pack_order.items():
            ents.sort(key=lambda e: e[1].offset)
            for i, (_, loc) in enumerate(ents):
                self._pos[(pack, loc.offset)] = i

    def __exit__(self, *exc: object) -> None:
        self._halt()
        self._stack.close()  # an uncommitted writer leaves no snapshot; the lock object goes

    def _halt(self) -> None:
        with self._lock:
            self._stop = True
        for t in self._threads:
            t.join()

    # ---- the fetches ----
    def start(self) -> None:
        """Launch the fetch threads (JOBS of the remote), each with one chunk buffer."""
        if self._threads or not self._queue:
            return
        todo = [self._refs[c] for c in self._queue]
        if self.progress is not None:
            self.progress.start(sum(HEADER_SIZE + c.stored_len for c in todo))
        jobs = min(self.remote.jobs, len(todo))
        entries = [loc.length for loc in self._at.values()]
        legacy = [c for c in todo if c.id not in self._at]
        size = max([_buffer_size(legacy) if legacy else 0, min(RANGE_MAX, sum(entries))] + entries)
        pool = self._stack.enter_context(BufferPool(jobs, size))
        for i in range(jobs):
            t = threading.Thread(target=self._run, args=(pool,), name=f"gpusnap-remote-fill-{i}", daemon=True)
            self._threads.append(t)
            t.start()

    def first(self, refs: Iterable[ChunkRef]) -> None:
        """Fetch these chunks (those still queued) before any other, in this order."""
        ids = [c.id for c in refs if c.id is not None]
        with self._lock:
            self._wanted.update(cid for cid in ids if cid in self._events)
            front = [cid for cid in dict.fromkeys(ids) if cid in self._events and cid not in self._started]
            if not front:
                return
            chosen = set(front)
            self._queue = deque(front + [cid for cid in self._queue if cid not in chosen])

    def _next(self) -> list[str]:
        """The next chunk to fetch and, when it lies in a remote pack, the entries that follow it there
        while they are wanted, not yet taken and within RANGE_MAX: one range read. [] when done."""
        with self._lock:
            while self._queue and not self._stop:
                cid = self._queue.popleft()
                if cid in self._started:
                    continue
                self._started.add(cid)
                run = [cid]
                loc = self._at.get(cid)
                if loc is not None:
                    ents = self._pack_order[loc.pack]
                    end = loc.offset + loc.length
                    for nxt, nloc in ents[self._pos[(loc.pack, loc.offset)] + 1:]:
                        if (nloc.offset != end or nxt in self._started or self._at.get(nxt) != nloc
                                or nloc.offset + nloc.length - loc.offset > RANGE_MAX):
                            break
                        self._started.add(nxt)
                        run.append(nxt)
                        end = nloc.offset + nloc.length
                return run
            return []

    def _run(self, pool: BufferPool) -> None:
        while run := self._next():
            try:
                if run[0] in self._doomed:
                    raise RemoteDamageError(f"remote {self.remote.cfg.name!r}: chunk {run[0][:16]}… of {self.name!r}: "
                                            f"{self._doomed[run[0]]}; nothing was committed locally")
                with pool.borrowed() as buf:
                    if run[0] in self._at:
                        self._fetch_range(buf, run)
                    else:
                        self._fetch_object(buf, self._refs[run[0]])
            except BaseException as e:  # noqa: BLE001 - handed to every waiter and to finish()
                self._fail(e)
                return

    def _fetch_range(self, buf: AlignedBuffer, run: list[str]) -> None:
        """The entries RUN of one remote pack, one range read, each checked; a bad one: once more."""
        r, rep = self.remote, self.report
        wanted = [(self._refs[cid], self._at[cid]) for cid in run]
        for attempt in (1, 2):
            got = r.fetch_run(wanted, buf)
            with self._lock:
                rep.ranges += 1
                rep.bytes_sent += sum(loc.length for _, loc in wanted)
            bad = [(cid, why) for cid, why, _, _ in got if why is not None]
            if not bad:
                break
            if attempt == 2:
                cid, why = bad[0]
                if "missing" in why and self._lk.lost():
                    raise RemoteError(f"remote {r.cfg.name!r}: a gc took this pull's lock for stale (the pull was "
                                      f"stopped for longer than the stale time) and deleted chunk {cid[:16]}…; "
                                      "nothing was committed locally")
                raise RemoteDamageError(f"remote {r.cfg.name!r}: chunk {cid[:16]}… of {self.name!r} {why} "
                                        "(fetched twice); nothing was committed locally")
            with self._lock:
                rep.refetched += len(bad)
        stored = []
        for (ref, _), (cid, _, header, entry) in zip(wanted, got):
            assert header is not None
            stored.append(self._store(ref, header, entry))
        # durable as they arrive (the local pack closed and indexed after each range): a killed pull's
        # retry fetches only what is missing; a pull is bound by the network, not by this fsync
        self._w.sync_chunks(stored)
        for (ref, _), (_, _, header, entry) in zip(wanted, got):
            assert header is not None
            self._keep(ref, header.codec, entry[HEADER_SIZE:HEADER_SIZE + header.stored_len])
        self._arrived([ref for ref, _ in wanted])

    def _fetch_object(self, buf: AlignedBuffer, ref: ChunkRef) -> None:
        """Chunk REF from its version 1 chunk object (no index lists it), checked; a bad one: once more."""
        r, rep = self.remote, self.report
        assert ref.id is not None
        for attempt in (1, 2):
            n = r.backend.get_into(r.chunk_key(ref.id), buf.view)
            with self._lock:
                rep.bytes_sent += n or 0
            why, header = check_fetched(ref, buf, n)
            if why is None:
                break
            if attempt == 2:
                if n is None and self._lk.lost():
                    raise RemoteError(f"remote {r.cfg.name!r}: a gc took this pull's lock for stale (the pull was "
                                      f"stopped for longer than the stale time) and deleted chunk {ref.id[:16]}…; "
                                      "nothing was committed locally")
                raise RemoteDamageError(f"remote {r.cfg.name!r}: chunk {ref.id[:16]}… of {self.name!r} {why} "
                                        "(fetched twice); nothing was committed locally")
            with self._lock:
                rep.refetched += 1
        assert header is not None
        got = self._store(ref, header, buf.view)
        self._w.sync_chunks([got])
        self._keep(ref, header.codec, buf.view[HEADER_SIZE:HEADER_SIZE + header.stored_len])
        self._arrived([ref])

    def _store(self, ref: ChunkRef, header: ChunkHeader, frame: memoryview) -> ChunkRef:
        """The verified chunk REF (HEADER, its payload in FRAME after the header's room) into the local store."""
        got: ChunkRef = self._w.put_chunk(header.codec, header.raw_len, frame, header.stored_len,
                                          raw_id=ref.id if header.raw_id else None,
                                          verified_id=None if header.raw_id else ref.id)
        assert got.id == ref.id
        return got

    def _arrived(self, refs: list[ChunkRef]) -> None:
        with self._lock:
            before = self.report.chunks_sent
            self.report.chunks_sent += len(refs)
            done = self.report.chunks_sent
            if done == len(self._events):
                self.seconds_to_all_local = time.monotonic() - self.began
        for ref in refs:
            assert ref.id is not None
            self._events[ref.id].set()
        if self.progress is not None:
            self.progress.advance(sum(HEADER_SIZE + ref.stored_len for ref in refs))
        pause_for_tests(done, before)

    def _keep(self, ref: ChunkRef, codec: str, payload: memoryview) -> None:
        with self._lock:
            if ref.id in self._wanted and self._kept_bytes + len(payload) <= self.handoff_bytes:
                self._kept[ref.id] = (codec, bytes(payload))
                self._kept_bytes += len(payload)

    def take(self, cid: str) -> tuple[str, bytes] | None:
        """(codec, payload) of chunk CID, verified on arrival (for a raw-addressed chunk: decoded and
        bound to its id), once, if it arrived from the remote and is still held; None otherwise (read
        it from the store)."""
        with self._lock:
            got = self._kept.pop(cid, None)
            if got is not None:
                self._kept_bytes -= len(got[1])
            return got

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = e if isinstance(e, GpusnapError) else RemoteError(
                    f"remote {self.remote.cfg.name!r}: pulling {self.name!r} failed: {e}")
            self._stop = True
        for ev in self._events.values():
            ev.set()  # waiters wake and find the error

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    # ---- the reader's side ----
    def wait(self, cid: str) -> None:
        """Until chunk CID is in the local store (at once for a chunk that was already there); raises
        the fill's error if it failed first."""
        ev = self._events.get(cid)
        if ev is None:
            return
        if not ev.is_set():
            with self._lock:
                if cid not in self._started and self._queue and self._queue[0] != cid:
                    self._queue.remove(cid)
                    self._queue.appendleft(cid)
            ev.wait()
        with self._lock:
            self._raise()
            if self.seconds_to_first_read is None:
                self.seconds_to_first_read = time.monotonic() - self.began

    def finish(self) -> TransferReport:
        """Every chunk fetched (start() first if not yet), then the local manifest committed."""
        rep = self.report
        if self.already_there:
            rep.already_there = True
        else:
            assert self.manifest is not None
            self.start()
            for ev in self._events.values():
                ev.wait()
            self._raise()
            if self.seconds_to_all_local is None:  # nothing was missing
                self.seconds_to_all_local = time.monotonic() - self.began
            for s in self.manifest.streams:
                self._w.add_stream(s)
            self._w.commit()
        rep.seconds = time.monotonic() - self.began
        return rep


class ArrivingSource:
    """The chunk tier of a snapshot still arriving from a remote (storage/repo/tier.py): STORE while FILL
    brings the snapshot's chunks. read_verified waits for a chunk that has not arrived (moving it to the
    front of the fetches), then reads it from the local store, verified there as every local read is;
    a chunk the remote holds damaged fails the fill with RemoteDamageError (exit 3), raised to every
    reader. So a GPU restore runs while the pull does."""

    error = SnapshotDamaged

    def __init__(self, store: SnapshotStore, fill: RemoteFill) -> None:
        self.store, self.fill = store, fill

    def has(self, cid: str) -> bool:
        """Whether chunk CID is local already (arrived, verified, or there before the pull)."""
        return self.store.has(cid)

    def missing(self, manifest: Manifest) -> list[str]:
        """Nothing is missing up front: what the local store lacks is on its way (a chunk the remote
        lacks fails its wait)."""
        return []

    def read_verified(self, ref: ChunkRef, frame: HostBuffer) -> Verified:
        assert ref.id is not None
        self.fill.wait(ref.id)
        return self.store.read_verified(ref, frame)


def pull(remote: Remote, store: SnapshotStore, name: str, *, replace: bool = False,
         progress: Progress | None = None) -> TransferReport:
    """Snapshot NAME into STORE: the chunks it lacks, smallest streams first (what a restore opens
    first), each verified on arrival; then the remote's manifest, committed by the store's writer."""
    with RemoteFill(remote, store, name, replace=replace, progress=progress) as f:
        return f.finish()


def ensure_local(store: SnapshotStore, name: str, remote: str, *, progress: Progress | None = None,
                 jobs: int = DEFAULT_JOBS) -> TransferReport | None:
    """Make snapshot NAME local before a restore that reads it whole first, pulling it from REMOTE
    when this store lacks it. None when it was already here."""
    if store.exists(name):
        return None
    return pull(Remote.open(store, remote, jobs), store, name, progress=progress)
