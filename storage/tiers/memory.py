"""The memory tier: a resident pool of pinned host memory holding snapshots' chunks, for model swapping.

The directory store on tmpfs is a memory tier too, but every chunk is copied from the staging frame
into freshly faulted tmpfs pages, and read back through the page cache. Here the device copies a
chunk's encoded bytes straight into its place in the pool (pinned, so the DMA lands there with no
bounce), and restore copies them from there to the device: no file, no page fault, no second copy.
The pool lives as long as the process that owns it (a resident process: the engine's host); it is not
durable, by design: a swap tier, not a backup. Chunks carry the same ids as in the directory store
(BLAKE3 of the chunk header's first 32 bytes and the payload), so identical chunks are kept once
across the pool's snapshots, and every payload is verified against its id when read (the memory tier
is a chunk tier, storage/repo/tier.py: read_verified is its one read).

Space is managed in 4096-byte units by a first-fit extent allocator that coalesces on free. A
snapshot becomes visible only when its writer commits; a writer that leaves without committing
returns every chunk it added. Thread-safe.
"""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, cast

from storage.format.chunkfile import ChunkError, ChunkHeader, chunk_id
from storage.fs.directio import ALIGN, align_up
from storage.base.errors import DamageError, GpusnapError
from storage.format.manifest import ChunkRef, Manifest, Stream
from storage.base.names import validate_snapshot_name
from storage.repo.store import WriteStats
from storage.repo.tier import Landing, Verified


class MemoryTierError(GpusnapError):
    """The pool is full, a snapshot name is taken or unknown, or a chunk is not in the pool."""


class MemoryTierDamage(MemoryTierError, DamageError):
    """A snapshot of the memory tier whose chunks are missing or do not match their ids (exit 3)."""


class Extents:
    """First-fit allocation of byte ranges (multiples of ALIGN) in [0, capacity); free coalesces."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // ALIGN * ALIGN
        self._starts: list[int] = [0] if self.capacity else []
        self._lens: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self.used = 0

    def alloc(self, n: int) -> int | None:
        n = align_up(max(n, 1))
        for i, s in enumerate(self._starts):
            ln = self._lens[s]
            if ln >= n:
                del self._lens[s]
                if ln == n:
                    del self._starts[i]
                else:
                    self._starts[i] = s + n
                    self._lens[s + n] = ln - n
                self.used += n
                return s
        return None

    def free(self, off: int, n: int) -> None:
        n = align_up(max(n, 1))
        i = bisect.bisect_left(self._starts, off)
        if (i < len(self._starts) and self._starts[i] < off + n) or \
                (i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] > off):
            raise MemoryTierError(f"double free of pool range {off}+{n}")
        self.used -= n
        # merge with the following free range, then with the preceding one
        if i < len(self._starts) and self._starts[i] == off + n:
            n += self._lens.pop(self._starts[i])
            del self._starts[i]
        if i > 0 and self._starts[i - 1] + self._lens[self._starts[i - 1]] == off:
            self._lens[self._starts[i - 1]] += n
            return
        self._starts.insert(i, off)
        self._lens[off] = n

    @property
    def free_ranges(self) -> int:
        return len(self._starts)

    @property
    def largest_free(self) -> int:
        return max(self._lens.values(), default=0)


@dataclass
class Slot:
    """A reserved range of the pool: the device copies a chunk's payload to ptr."""

    offset: int
    size: int
    ptr: int
    view: memoryview


@dataclass
class _Entry:
    offset: int
    ref: ChunkRef
    refs: int


class PinnedPool:
    """Snapshots held in one block of host memory (pinned when the buffer comes from a CUDA device)."""

    error = MemoryTierDamage  # what a damaged snapshot raises (storage/repo/tier.py: a ChunkTier)

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self._ext = Extents(buffer.size)
        self._chunks: dict[str, _Entry] = {}
        self._snapshots: dict[str, Manifest] = {}
        self._writing: set[str] = set()
        self._lock = threading.Lock()

    # -- resource ------------------------------------------------------------------------------
    def __enter__(self) -> "PinnedPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._snapshots.clear()
            self._chunks.clear()
        self.buffer.close()

    # -- accounting ----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self._ext.capacity

    @property
    def used(self) -> int:
        with self._lock:
            return self._ext.used

    def usage(self) -> dict[str, int]:
        with self._lock:
            return {"capacity": self._ext.capacity, "used": self._ext.used, "chunks": len(self._chunks),
                    "snapshots": len(self._snapshots), "free_ranges": self._ext.free_ranges,
                    "largest_free": self._ext.largest_free}

    # -- space ---------------------------------------------------------------------------------
    def reserve(self, n: int) -> Slot:
        with self._lock:
            off = self._ext.alloc(n)
            if off is None:
                raise MemoryTierError(f"the memory tier is full: {n} bytes asked, {self._ext.capacity - self._ext.used} "
                                      f"free of {self._ext.capacity} (largest free range {self._ext.largest_free})")
        size = align_up(max(n, 1))
        return Slot(off, size, self.buffer.ptr + off, self.buffer.view[off:off + size])

    def release(self, slot: Slot) -> None:
        slot.view.release()
        with self._lock:
            self._ext.free(slot.offset, slot.size)

    # -- snapshots -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._snapshots)

    def exists(self, name: str) -> bool:
        with self._lock:
            return name in self._snapshots

    def load(self, name: str) -> Manifest:
        with self._lock:
            m = self._snapshots.get(name)
        if m is None:
            raise MemoryTierError(f"no snapshot named {name!r} in the memory tier")
        return m

    def writer(self, name: str, *, replace: bool = False, meta: dict[str, Any] | None = None) -> "PoolWriter":
        return PoolWriter(self, validate_snapshot_name(name), replace=replace, meta=meta or {})

    def remove(self, name: str) -> None:
        with self._lock:
            m = self._snapshots.pop(name, None)
            if m is None:
                raise MemoryTierError(f"no snapshot named {name!r} in the memory tier")
            self._unref_locked(c.id for s in m.streams for c in s.chunks if c.id is not None)

    def _unref_locked(self, ids: Iterator[str] | list[str]) -> None:
        for cid in ids:
            e = self._chunks[cid]
            e.refs -= 1
            if e.refs == 0:
                del self._chunks[cid]
                self._ext.free(e.offset, e.ref.stored_len)

    # -- chunks --------------------------------------------------------------------------------
    def _adopt(self, slot: Slot, codec: str, raw_len: int, stored_len: int) -> tuple[ChunkRef, bool, float]:
        """Take SLOT's payload as a chunk: (its ref, True, seconds hashing) if new; if an equal chunk is
        already held, SLOT is released and (the existing ref, False, seconds) returned."""
        header = ChunkHeader(codec, raw_len, stored_len)
        t0 = time.perf_counter()
        cid = chunk_id(header, slot.view[:stored_len])
        hash_s = time.perf_counter() - t0
        ref = ChunkRef(cid, raw_len, codec, stored_len)
        with self._lock:
            e = self._chunks.get(cid)
            if e is not None:
                e.refs += 1
                self._ext.free(slot.offset, slot.size)
                new = False
            else:
                self._chunks[cid] = _Entry(slot.offset, ref, 1)
                new = True
        slot.view.release()
        return ref, new, hash_s

    def has(self, cid: str) -> bool:
        with self._lock:
            return cid in self._chunks

    def read_verified(self, ref: ChunkRef, frame: Any = None) -> Verified:
        """REF's payload where it lies in the pool (no copy: FRAME is not used), after BLAKE3 of its
        header and payload matched its id; ChunkError when it is not held or does not match."""
        assert ref.id is not None
        with self._lock:
            e = self._chunks.get(ref.id)
        if e is None or e.ref != ref:
            raise ChunkError(ref.id, "not in the memory tier")
        header = ChunkHeader(ref.codec, ref.raw_len, ref.stored_len)
        view = self.buffer.view[e.offset:e.offset + ref.stored_len]
        if chunk_id(header, view) != ref.id:
            view.release()
            raise ChunkError(ref.id, "payload in the memory tier does not match its id (memory corrupted)")
        return Verified(self.buffer.ptr + e.offset, view, header, "verify")

    def missing(self, manifest: Manifest) -> list[str]:
        with self._lock:
            return [c.id for s in manifest.streams for c in s.chunks if c.id is not None and c.id not in self._chunks]


class PoolWriter:
    """One snapshot into the pool; a context manager like SnapshotWriter (no commit = nothing kept)."""

    def __init__(self, pool: PinnedPool, name: str, *, replace: bool, meta: dict[str, Any]) -> None:
        self.pool = pool
        self.name = name
        self.replace = replace
        self.meta = meta
        self.streams: list[Stream] = []
        self.stats = WriteStats()
        self._held: list[str] = []
        self._lock = threading.Lock()
        self._committed = False

    def __enter__(self) -> "PoolWriter":
        p = self.pool
        with p._lock:
            if self.name in p._writing:
                raise MemoryTierError(f"snapshot {self.name!r} is being written by another writer")
            if self.name in p._snapshots and not self.replace:
                raise MemoryTierError(f"snapshot {self.name!r} already exists in the memory tier")
            p._writing.add(self.name)
        return self

    def __exit__(self, *exc: object) -> None:
        p = self.pool
        with p._lock:
            p._writing.discard(self.name)
            if not self._committed:
                p._unref_locked(self._held)
                self._held.clear()

    @property
    def source(self) -> PinnedPool:
        """Where this writer's chunks can be read back from, also before it commits."""
        return self.pool

    def note_zero(self, raw_len: int) -> ChunkRef:
        with self._lock:
            return self.stats.add_zero(raw_len)

    def put_slot(self, slot: Slot, codec: str, raw_len: int, stored_len: int) -> ChunkRef:
        """Keep the payload the device copied into SLOT as one chunk (thread-safe)."""
        ref, new, hash_s = self.pool._adopt(slot, codec, raw_len, stored_len)
        with self._lock:
            self._held.append(ref.id)  # type: ignore[arg-type]
            self.stats.add_chunk(raw_len, stored_len, new, hash_s)
        return ref

    # ---- as a TierWriter (storage/repo/tier.py) ----
    def landing(self, frame: Any, stored_len: int) -> Landing:
        """A slot of the pool for STORED_LEN bytes (the device copies straight into it; FRAME unused)."""
        slot = self.pool.reserve(stored_len)
        return Landing(slot.ptr, slot.view[:stored_len], None, slot)

    def write(self, landing: Landing, codec: str, raw_len: int, stored_len: int) -> ChunkRef:
        landing.view.release()
        slot = cast(Slot, landing.slot)  # the landing this writer made
        landing.slot = None
        return self.put_slot(slot, codec, raw_len, stored_len)

    def drop(self, landing: Landing) -> None:
        landing.view.release()
        if landing.slot is not None:
            self.pool.release(cast(Slot, landing.slot))
            landing.slot = None

    def add_stream(self, stream: Stream) -> None:
        with self._lock:
            self.streams.append(stream)

    def commit(self) -> Manifest:
        m = Manifest(self.name, self.streams, self.meta)
        p = self.pool
        with p._lock:
            old = p._snapshots.get(self.name)
            p._snapshots[self.name] = m
            if old is not None:
                p._unref_locked(c.id for s in old.streams for c in s.chunks if c.id is not None)
        self._committed = True
        return m
