"""The staged, bounded pipeline that moves named byte streams into the store and back out.

put:  source --read--> staging buffer --zero test--> --hash raw bytes: present?--> (new only) --encode-->
      --write chunk--> manifest
get:  manifest --read chunk--> --decode + verify--> sink.write_at

Host chunks are raw-addressed (FORMAT.md, GSNPCHK2): the id is the hash of the raw bytes, so a chunk
already in the store costs one hash and is neither compressed nor written again. Given a parent
snapshot, a new chunk is stored as a delta against the parent's bytes at the same place where that
saves (FORMAT.md, "Delta entries"; put's `parent`).

One reader feeds N workers through a fixed pool of page-aligned staging buffers (allocated once,
reused); a full pool blocks the reader, so memory stays bounded whatever the input size. Sources and
sinks are small protocols: files (storage/archive/filetree.py), CRIU/runsc image streams and pipes, and the
GPU region engine (storage/pipeline/gpu_engine.py) use the same store underneath.
"""
from __future__ import annotations

import collections
import contextlib

import bisect
import functools
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Generic, Iterator, Protocol, TypeVar

from storage.base.progress import Progress
from storage.format.chunkfile import HEADER_SIZE, ChunkError, full_check, raw_chunk_id
from storage.codecs import delta
from storage.codecs import pagekeys
from storage.codecs.registry import DELTA, DELTA_MATCH, DELTA_PAYS_OFF, HostCodecChooser, CodecError
from storage.fs.directio import AlignedBuffer, Arena, BufferPool, align_up, copy_into, is_zero
from storage.pipeline.encodeprocs import EncodeProcs, Encoder, Prepared, encode_procs
from storage.format.manifest import ChunkRef, Manifest, Stream
from storage.repo.readstage import Want, read_chunks
from storage.repo.store import SnapshotDamaged, SnapshotStore, SnapshotWriter, StoreError, base_cache_bytes

from storage.base.errors import GpusnapError
from storage.base.settings import switch

DEFAULT_CHUNK = 4 << 20


class PipelineError(GpusnapError):
    """A source or sink failed while moving a stream; nothing was committed."""


@dataclass(frozen=True)
class StreamSpec:
    name: str
    attrs: dict[str, Any]
    size: int | None = None  # None: unknown (a pipe); read to EOF

    @property
    def has_data(self) -> bool:
        return self.attrs.get("type") in ("file", "blob")


class StreamReader(Protocol):
    def readinto(self, view: memoryview) -> int:
        """Fill VIEW completely unless the stream ends first; return bytes read (0 at EOF)."""


class Source(Protocol):
    def streams(self) -> Iterator[StreamSpec]: ...

    def open(self, spec: StreamSpec) -> AbstractContextManager[StreamReader]: ...


class StreamWriter(Protocol):
    def write_at(self, offset: int, data: bytes | memoryview) -> None: ...

    def close(self) -> None: ...


class Sink(Protocol):
    def open(self, spec: StreamSpec) -> StreamWriter | None:
        """Create the stream (zero-filled to spec.size); None for streams without data."""

    def commit(self) -> None: ...

    def abort(self) -> None: ...


@dataclass
class Stages:
    """Seconds spent per stage, summed over threads, and bytes through each."""

    seconds: dict[str, float] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, stage: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds
            self.nbytes[stage] = self.nbytes.get(stage, 0) + nbytes

    def table(self) -> dict[str, dict[str, float]]:
        return {k: {"thread_seconds": round(self.seconds[k], 4), "bytes": self.nbytes[k],
                    "GBps_per_thread": round(self.nbytes[k] / self.seconds[k] / 1e9, 3) if self.seconds[k] else 0.0}
                for k in self.seconds}


@dataclass
class Result:
    raw_bytes: int
    stored_bytes: int
    seconds: float
    stages: Stages
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.raw_bytes / self.seconds / 1e9 if self.seconds else 0.0


class _Failure:
    """The first exception raised by any worker; later ones are dropped."""

    def __init__(self) -> None:
        self.exc: BaseException | None = None
        self._lock = threading.Lock()

    def set(self, e: BaseException) -> None:
        with self._lock:
            if self.exc is None:
                self.exc = e

    def raise_if_set(self) -> None:
        if self.exc is not None:
            raise self.exc


PAGE = 4096
# The page chunker's cut rule, from its largest chunk (MAX): no chunk shorter than MAX/2 (except a
# stream's last); past that, a page whose fingerprint has the mask bits clear ends it, the mask giving
# one candidate per quarter of the window (MAX/2 .. MAX), so ~98% of chunks end where their content
# says (a forced cut at MAX does not resynchronize after an insertion): 4 MiB chunks average ~2.5 MiB.
# Larger chunks than before (256 KiB minimum, 1 in 256: ~1.25 MiB) because the per-chunk work of a
# Python pipeline (a few dozen calls that give the GIL up and take it back) costs the same for 1 MiB as
# for 4 MiB: on the 16-core H200 host ~1.25 MiB chunks ingested 1.0-1.2 GB/s where 4 MiB chunks did
# 2.6-3.1 GB/s (BENCHMARKS.md, section 14).
def cdc_params(max_len: int) -> tuple[int, int]:
    """(minimum chunk bytes, fingerprint mask) of the page chunker for chunks of at most MAX_LEN."""
    maxp = max(1, max_len // PAGE)
    minp = max(1, maxp // 2)
    quarter = max(1, (maxp - minp) // 4)
    return minp * PAGE, (1 << (quarter.bit_length() - 1)) - 1


_K1, _K2 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F  # page_cuts' fingerprint multipliers (FORMAT.md)


def page_cuts(view: memoryview, max_len: int) -> list[int]:
    """Content-defined chunk ends in VIEW, on page boundaries (cdc_params): after the minimum, the end
    of the first page whose fingerprint matches the mask; never more than MAX_LEN apart. Bytes after the last cut are
    the caller's to carry into the next call.

    CRIU page images (and other page-structured data) shift by whole pages when a process maps or
    unmaps memory between dumps; cutting where the content says, not at fixed offsets, lets the
    unchanged runs of pages produce the same chunks again. Only the cuts depend on the sampled words:
    every chunk is still hashed in full.
    """
    import numpy as np  # noqa: PLC0415 - a restore never cuts: its process does not load numpy
    pages = len(view) // PAGE
    if pages == 0:
        return []
    w = np.frombuffer(view, dtype=np.uint64, count=pages * (PAGE // 8)).reshape(pages, PAGE // 8)
    with np.errstate(over="ignore"):
        fp = (w[:, 0] * np.uint64(_K1)) ^ (w[:, 255] * np.uint64(_K2)) ^ w[:, 511] ^ (w[:, 128] >> np.uint64(7))
    min_len, mask = cdc_params(max_len)
    cand = np.flatnonzero((fp & np.uint64(mask)) == 0) + 1  # page-end indices
    minp, maxp = min_len // PAGE, max(1, max_len // PAGE)
    cuts: list[int] = []
    last = 0
    while True:
        i = int(np.searchsorted(cand, last + minp))
        nxt = int(cand[i]) if i < len(cand) else None
        if nxt is None or nxt - last > maxp:
            if last + maxp > pages:
                break
            nxt = last + maxp
        cuts.append(nxt)
        last = nxt
    return [c * PAGE for c in cuts]


def default_workers() -> int:
    return max(2, min(16, os.cpu_count() or 2))


PUT_WORKERS_MOST = 8  # see put_workers


def put_workers() -> int:
    """put's encoder threads: one per core, at most PUT_WORKERS_MOST ($GPUSNAP_PUT_WORKERS overrides).

    Each chunk's encoding holds the GIL for ~9% of its time (numpy's plane split, the ctypes calls
    into libzstd, the store's bookkeeping), so threads beyond ~10 add more handoffs than work: on the
    16-core H200 host, 6-10 workers ingested a weights image at 1.7-2.5 GB/s and 16 at 1.0-1.8, the
    same compression costing 2-3x the thread-seconds (BENCHMARKS.md, section 19)."""
    try:
        n = int(os.environ.get("GPUSNAP_PUT_WORKERS", ""))
    except ValueError:
        n = 0  # unset or not a count: the default
    if n > 0:
        return n
    return max(2, min(PUT_WORKERS_MOST, os.cpu_count() or 2))


_READ_BLOCK = 32 << 20  # a page image is read in blocks of this size (pieces are views into them)


def _read(reader: StreamReader, view: memoryview, stages: Stages, name: str) -> int:
    t0 = time.perf_counter()
    try:
        n = reader.readinto(view)
    except OSError as e:
        raise PipelineError(f"reading {name}: {e.strerror or e}") from None
    stages.add("read", time.perf_counter() - t0, n)
    return n


@dataclass
class _Piece:
    """One chunk's bytes on their way to a worker: VIEW; FRAME when they lie at HEADER_SIZE of a
    frame of their own (a raw chunk is then written from where it was read); RELEASE when done."""

    view: memoryview
    frame: AlignedBuffer | None
    release: Callable[[], None]


class _Block:
    """A read block shared by the pieces cut from it: back to its pool once every piece is processed
    and its producer has moved on (the carry copied out)."""

    def __init__(self, pool: BufferPool, stages: Stages) -> None:
        t0 = time.perf_counter()
        self.pool, self.buf = pool, pool.acquire()
        stages.add("produce:wait-buffer", time.perf_counter() - t0, 0)  # the workers are behind
        self.left = 1
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self.left += 1

    def done(self) -> None:
        with self._lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self.pool.release(self.buf)


def _fixed_pieces(reader: StreamReader, staging: BufferPool, chunk_size: int, stages: Stages,
                  name: str) -> Generator[_Piece, None, None]:
    """chunk_size pieces read straight into staging frames (payload at HEADER_SIZE, no copy)."""
    while True:
        t0 = time.perf_counter()
        buf = staging.acquire()
        stages.add("produce:wait-buffer", time.perf_counter() - t0, 0)
        try:
            n = _read(reader, buf.view[HEADER_SIZE:HEADER_SIZE + chunk_size], stages, name)
        except BaseException:
            staging.release(buf)
            raise
        if n == 0:
            staging.release(buf)
            return
        yield _Piece(buf.view[HEADER_SIZE:HEADER_SIZE + n], buf, functools.partial(staging.release, buf))
        if n < chunk_size:
            return


def _page_pieces(reader: StreamReader, blocks: BufferPool, chunk_size: int, stages: Stages,
                 name: str) -> Generator[_Piece, None, None]:
    """Content-defined pieces (page_cuts) of READER: read in blocks of _READ_BLOCK bytes, each piece a
    view into its block (nothing is copied but the carry: the bytes after a block's last cut, moved
    to the front of the next block)."""
    blk = _Block(blocks, stages)
    try:
        have = 0
        eof = False
        while not eof or have:
            rb = blk.buf.view
            got = 0 if eof else _read(reader, rb[have:have + _READ_BLOCK], stages, name)
            eof = eof or got < _READ_BLOCK
            n = have + got
            t0 = time.perf_counter()
            cuts = page_cuts(rb[:n], chunk_size)
            stages.add("produce:cut", time.perf_counter() - t0, n)
            if eof and n > (cuts[-1] if cuts else 0):
                cuts.append(n)
            prev = 0
            for c in cuts:
                blk.hold()
                yield _Piece(rb[prev:c], None, blk.done)
                prev = c
            have = n - prev
            if eof and have == 0:
                return
            nxt = _Block(blocks, stages)
            if have:
                t0 = time.perf_counter()
                copy_into(nxt.buf.view, rb[prev:n])  # the carry, to the front of the next block
                stages.add("produce:carry", time.perf_counter() - t0, have)
            blk.done()
            blk = nxt
    finally:
        blk.done()


def chunker_record(chunker: str, chunk_size: int) -> dict[str, Any]:
    """What cut a stream into chunks, with every parameter that decides where the cuts fall (recorded in
    each data stream's attrs as `chunker`, storage/FORMAT.md): enough to cut the same bytes the same way."""
    if chunker == "fixed":
        return {"name": "fixed", "size": chunk_size}
    min_len, mask = cdc_params(chunk_size)
    return {"name": "pages", "max": chunk_size, "min": min_len, "page": PAGE, "mask": mask,
            "fingerprint": "(w[0]*k1) ^ (w[255]*k2) ^ w[511] ^ (w[128] >> 7)", "k1": f"{_K1:#x}",
            "k2": f"{_K2:#x}", "segment": SEGMENT}


def put(writer: SnapshotWriter, source: Source, *, chunk_size: int = DEFAULT_CHUNK,
        workers: int | None = None, compress: bool = True, zstd_level: int = 1,
        progress: Progress | None = None, chunker: str = "fixed", readers: int | None = None,
        known: Callable[[StreamSpec, dict[str, Any]], list[ChunkRef] | None] | None = None,
        parent: Manifest | None = None, procs: int | None = None) -> Result:
    """Read every stream of SOURCE into WRITER's snapshot (the caller commits).

    chunker: "fixed" (chunk_size pieces) or "pages" (content-defined cuts on page boundaries, at most
    chunk_size; see page_cuts). readers: producer threads for page images larger than two SEGMENTs
    (default: one per four workers, at most four). known: a files cache's lookup (storage/archive/files_cache.py):
    given a stream and the chunker record, the references it remembers; used only if every one names a
    sound chunk present now (SnapshotWriter.reuse_ref), else the stream is read.
    parent: a committed snapshot of the same store the new one follows (FORMAT.md, "Delta entries"):
    a new chunk is stored as a delta against the parent's bytes where they were (in whichever of
    the parent's streams its unchanged neighbours were found; at first the same-named stream's same
    offset), or against their base where those are a delta themselves, if the delta's payload is at
    most DELTA_PAYS_OFF of the plain encoding as its sample estimates it (a chunk is encoded plainly
    only when no delta pays: stage "compress"; the estimates are "compress:estimate"); the base is
    read in the workers (stage "delta-base"), the XOR and its compression are stage "delta"; what
    the new chunks took is "delta:stored as deltas" and "delta:stored plain" (payload bytes).
    procs: encoder processes (storage/pipeline/encodeprocs.py) that take each new chunk's CPU work off this
    process's GIL (default encodeprocs.encode_procs(); page images only): without a parent all of
    it, with one the work every chunk costs (zero test, raw id, page keys; a changed chunk's delta
    and encoding stay in the threads); the threads then drive them, one each.
    """
    if chunker not in ("fixed", "pages"):
        raise PipelineError(f"unknown chunker {chunker!r}")
    nprocs = (encode_procs() if procs is None else procs) if chunker == "pages" else 0
    workers = max(workers or put_workers(), nprocs)
    producers = readers or max(1, min(4, workers // 4))
    chooser = HostCodecChooser(level=zstd_level, compress=compress)
    stages = Stages()
    fail = _Failure()
    t_start = time.perf_counter()
    # staging buffers are laid out like chunk files (payload at HEADER_SIZE) so raw chunks are
    # written from where they were read, with no copy
    # (blocks for the page chunker: enough for two pieces per worker, and one being read per producer)
    nblocks = producers + max(3, workers * 2 * chunk_size // _READ_BLOCK) if chunker == "pages" else 0
    at = _parent_chunks(parent) if parent is not None else None
    shifts = _Shifts(at, _cut_by_content(parent)) if at and parent is not None else None
    # where the parent's pages lay, anywhere (its streams' page keys; none in a parent written before them)
    # (built at the first lookup: a put whose chunks are all found unchanged never pays for it)
    pindex = (_Once(functools.partial(pagekeys.PageIndex.of, parent.streams, at))
              if at and parent is not None and os.environ.get("GPUSNAP_PAGE_LOOKUP", "1") != "0" else None)
    collector = pagekeys.Collector() if chunker == "pages" else None  # this put's own page keys
    effort = _Effort() if at else None
    if at:  # neighbouring new chunks share their parent chunks: a larger cache of decoded bases pays here
        writer.store.keep_bases(base_cache_bytes())
    decoded_before = writer.store.bases_decoded
    failed: set[str] = set()  # parent chunks that could not be read as bases during this put
    nstaging = workers * 2 if chunker == "fixed" else 0
    arena_bytes = ((nstaging + workers) * align_up(HEADER_SIZE + chunk_size)
                   + nblocks * align_up(_READ_BLOCK + chunk_size))  # what is carved from it below
    # (the store's packs stay open for the put's header look-ups and base reads; closed after its threads end)
    with writer.store.holding_packs(), \
            _encoders(nprocs, arena_bytes, zstd_level, compress) as (arena, encs), \
            BufferPool(nstaging, HEADER_SIZE + chunk_size, arena) as staging, \
            BufferPool(workers, HEADER_SIZE + chunk_size, arena) as scratch, \
            BufferPool(workers if at else 0, HEADER_SIZE + chunk_size) as dscratch, \
            BufferPool(workers if at else 0, chunk_size) as xscratch, \
            BufferPool(nblocks, _READ_BLOCK + chunk_size, arena) as blocks, \
            _prefetching(writer.store, at) as prefetch, \
            ThreadPoolExecutor(workers, thread_name_prefix="gpusnap-put") as ex, \
            (encs.killed_on_error() if encs is not None else contextlib.nullcontext()):
        futures: list[Future[None]] = []
        flock = threading.Lock()
        whole: list[tuple[Stream, list[list[ChunkRef]]]] = []

        def as_delta(cid: str, view: memoryview, plain_len: int, name: str, off: int,
                     hint: Place | None, plain: Callable[[], tuple[str, int]] | None = None,
                     sample: tuple[Any, Any] | None = None) -> ChunkRef | None:
            """VIEW (at OFF of stream NAME) stored as a delta against what the parent held at the same
            place (its full chunks' bytes; through a delta chunk, that delta's own bases), if that
            saves DELTA_PAYS_OFF of the plain encoding (PLAIN_LEN bytes, estimated). The same place is: HINT,
            where the lengths of this chunk and the two before it are those of three consecutive
            parent chunks (_Shifts.run_place); the parent stream and shift learned nearby (_Shifts:
            from unchanged chunks found in any of the parent's streams; pages mapped or unmapped
            before it move a page image's later bytes); a parent chunk of the same length close by
            (CDC cuts follow the content); with nothing learned yet, the same offset of the
            parent's stream of the same name. Each candidate's XOR is scored page by page; where no
            one candidate holds the whole chunk (the chunk spans the place where pages were mapped),
            each page takes the candidate that holds it best, in runs. A delta larger than the
            estimate allows is weighed against the real plain encoding, which PLAIN makes (once)."""
            assert at is not None and shifts is not None
            n = len(view)
            tried: list[tuple[float, Place, list[delta.Segment], dict[str, bytes | memoryview], Any]] = []
            held: list[list[delta.Segment] | None] = [None]
            attempted: set[Place] = set()  # every place attempted, scored or not (a failed one is not in TRIED)
            with dscratch.borrowed() as d, xscratch.borrowed() as x:
                def attempt(place: Place) -> float:
                    """The parent's bytes at PLACE as this chunk's reference: scored (the fraction of
                    its bytes they hold) and kept in TRIED; 0 when they cannot be read or cut."""
                    attempted.add(place)  # tried once, whatever comes of it
                    t0 = time.perf_counter()
                    segs = _window(writer.store, at[place[0]], off + place[1], n)
                    raws: dict[str, bytes | memoryview] = {}
                    try:
                        for bid in delta.bases(segs or []):
                            if bid in failed:
                                raise ChunkError(bid, "unreadable earlier in this put")
                            try:
                                raws[bid] = writer.store.delta_base(bid, delta.base_limit(n))
                            except (ChunkError, OSError):
                                failed.add(bid)
                                raise
                    except (ChunkError, OSError):
                        raws = {}  # a base unreadable here: not this candidate (verify reports the parent's damage)
                    stages.add("delta-base", time.perf_counter() - t0, sum(len(r) for r in raws.values()))
                    if not raws or segs is None:
                        return 0.0
                    t1 = time.perf_counter()
                    held[0] = None  # the scratch is written now: it holds no candidate's XOR until this succeeds
                    try:
                        _, same, diffs = delta.xored_pages(view, segs, raws, x.view)
                        held[0] = segs  # what the scratch holds the XOR against now
                    except ValueError:
                        return 0.0  # a reference no reader would take (a parent delta's bad table, too many bases)
                    tried.append((same, place, segs, raws, diffs))
                    stages.add("delta", time.perf_counter() - t1, n)
                    stages.add("delta:tried", 0.0, n)  # one per candidate (stage delta also counts the encoding)
                    return same

                looked: list[tuple[Place, int]] = []
                index = pindex() if pindex is not None else None
                if index is not None:
                    # where its sampled pages lay in the parent (any stream, any distance): tried first
                    # when most of them agree on one place (a restored process's memory is laid out
                    # again, and the neighbours' place is then often not this chunk's: each wrong
                    # candidate costs a base read and an XOR)
                    t0 = time.perf_counter()
                    looked, nsampled = index.lookup(view, off, sample=sample)  # SAMPLE: the page keys' own
                    stages.add("delta-lookup", time.perf_counter() - t0, n)
                    top = looked[0] if looked else None
                    if top is not None and 2 * top[1] > nsampled and off + top[0][1] + n > 0:
                        attempt(top[0])
                for place in shifts.candidates(name, off, n, hint):
                    if max((t[0] for t in tried), default=0.0) >= DELTA_MATCH:
                        break
                    if place not in attempted:
                        attempt(place)
                guess = shifts.guess(name, off)
                best = max((t[0] for t in tried), default=0.0)
                if guess is not None and best < DELTA_MATCH and (hint is None or best < 0.5):
                    # none of the places guessed holds this chunk: look for its pages in the parent
                    # near there (a page image moves by a different shift after each area mapped
                    # before it, and where every chunk changed no unchanged one says by how much);
                    # not where three cuts in a row placed it and half of it held (its bytes are
                    # there, changed more)
                    t0 = time.perf_counter()
                    found = _search_shifts(writer.store, at[guess[0]], view, off, guess[1], failed)
                    stages.add("delta-search", time.perf_counter() - t0, n)
                    for s in found:
                        if (guess[0], s) not in attempted and off + s + n > 0:
                            attempt((guess[0], s))
                best = max((t[0] for t in tried), default=0.0)
                if best < DELTA_MATCH and (hint is None or best < 0.5):
                    # still no place holds it: the other places its sampled pages name (a chunk
                    # straddling two moved regions is mixed from them below); not where three cuts
                    # in a row placed it and half of it held, as for the search
                    for place, _ in looked:
                        if place not in attempted and off + place[1] + n > 0:
                            attempt(place)
                if not tried:
                    return None
                t1 = time.perf_counter()
                same, place_after, segs, raws, diffs = max(tried, key=lambda t: t[0])
                if len(tried) > 1 and same < DELTA_MATCH:
                    mixed = delta.mixed([(t[2], t[4]) for t in tried], n)
                    if mixed is not None:
                        both = {k: v for t in tried for k, v in t[3].items()}
                        held[0] = None
                        try:
                            _, mixed_same = delta.xored(view, mixed[0], both, x.view)
                            held[0] = mixed[0]
                        except ValueError:
                            mixed_same = 0.0  # its bases together are more than a delta may name
                        if mixed_same > same:
                            same, segs, raws, place_after = mixed_same, mixed[0], both, tried[mixed[1]][1]
                            diffs = None  # the mixed XOR's pages are counted again where it is encoded
                if same < 1 - DELTA_PAYS_OFF:
                    stages.add("delta", time.perf_counter() - t1, 0)
                    return None
                # the XOR is still in the scratch when the one taken was the last one made (the first
                # candidate held the chunk, the usual case)
                xv = x.view[:n] if held[0] is segs else delta.xored(view, segs, raws, x.view)[0]
                shifts.note(name, off + n, place_after)  # what holds at the chunk's end holds for the next
                # room for what pays against the plain encoding at its largest (raw), so that a delta
                # beyond what the estimate allows is weighed against the real encoding (a sample of
                # a sparse chunk, a KV pool's, may see only its zeros)
                m = delta.encode_xored(xv, segs, d.view[HEADER_SIZE:HEADER_SIZE + int(DELTA_PAYS_OFF * n)], diffs)
                stages.add("delta", time.perf_counter() - t1, n)
                if m is None:
                    return None
                if m > DELTA_PAYS_OFF * plain_len:
                    if plain is None:
                        return None
                    if m > DELTA_PAYS_OFF * plain()[1]:
                        return None
                return writer.put_delta(n, d.view, m, cid)

        def process(chunks: list[ChunkRef], idx: int, piece: _Piece, name: str, off: int,
                    hint: Place | None = None) -> None:
            t_in = time.perf_counter()
            view = piece.view
            n = len(view)
            try:
                if fail.exc is not None:
                    return
                with encs.borrowed() if encs is not None else contextlib.nullcontext(None) as enc:
                    if enc is not None and not at:
                        chunks[idx] = offloaded(enc, piece, name, off)
                        if progress is not None:
                            progress.advance(n)
                        return
                    # with a parent most chunks are found unchanged: what every chunk costs (zero test,
                    # raw id, page keys) goes to the process where there is one, what a changed one
                    # costs beyond that (its delta, its encoding) stays here
                    prep = prepared(enc, view, name, off)
                if prep.zero:
                    chunks[idx] = writer.note_zero(n)
                else:
                    assert prep.cid is not None
                    sample = prep.sample  # the chunk's sampled pages: recorded, and looked up if it is new
                    cid, present = writer.find_id(prep.cid, n, prep.hash_s)
                    if present is not None:
                        chunks[idx] = present
                        if shifts is not None:
                            shifts.found(name, off, cid)  # an unchanged chunk of the parent: where it was
                    else:
                        with scratch.borrowed() as s:  # the payload is encoded where it is written from
                            got, later = None, False
                            # a chunk set aside as damaged comes back whole, never as a delta: deltas
                            # may name it as their base, and a base is a full entry
                            tries = bool(at) and effort is not None and writer.store.quarantined(cid) is None
                            if tries and prefetch is not None:
                                prefetch.changed(name, off)
                            plain = _Once(lambda: encode_plain(view, s.view))
                            if tries:
                                assert effort is not None
                                # what its plain encoding would take, from a sample: encoded plainly
                                # only if it does not become a delta (most new chunks of a dump with a
                                # parent do)
                                t2 = time.perf_counter()
                                m = chooser.estimate(view)
                                stages.add("compress:estimate", time.perf_counter() - t2, n)
                                if shifts is not None and shifts.unplaced(name, off, hint):
                                    # nothing of the parent placed in this stream yet (a page image
                                    # renumbered, or new): no candidate, and no attempt counted;
                                    # tried once the rest of the put is in, if there is room
                                    later = set_aside(chunks, idx, view, name, off, hint, m, False)
                                    if not later:
                                        stages.add("delta:no place known", 0.0, n)
                                elif effort.worth():
                                    # whether anything after this chunk was placed when its candidates
                                    # were chosen (asked before: a worker may place one meanwhile)
                                    blind = shifts is not None and shifts.nothing_after(name, off)
                                    got = as_delta(cid, view, m, name, off, hint, plain, sample)
                                    later = got is None and blind and set_aside(
                                        chunks, idx, view, name, off, hint, plain.got[1] if plain.got else m,
                                        plain.got is not None)
                                    if later:  # tried again once the rest of the put is in
                                        effort.record(False)
                                    else:
                                        tally(got is not None, hint, n)
                                else:
                                    stages.add("delta:not tried (effort bound)", 0.0, n)
                            if got is not None:
                                chunks[idx] = got
                                count_stored(got)
                            elif not later:
                                codec, m = plain()
                                chunks[idx] = put_plain(view, cid, codec, m, s.view, piece.frame)
                                if tries:
                                    count_stored(chunks[idx])
                if progress is not None:
                    progress.advance(n)
            except BaseException as e:  # noqa: BLE001 - handed to the submitting thread
                fail.set(e)
            finally:
                piece.release()
                stages.add("worker", time.perf_counter() - t_in, n)  # busy; the rest of workers x wall is idle

        def offloaded(enc: Encoder, piece: _Piece, name: str, off: int) -> ChunkRef:
            """process()'s work for a chunk of a put without a parent, done by encoder process ENC:
            the zero test, raw id and page keys, then (a chunk not present) the encoding and the
            stored checksum; here only the lookup and the write."""
            view = piece.view
            n = len(view)
            p = prepared(enc, view, name, off)
            if p.zero:
                return writer.note_zero(n)
            assert p.cid is not None
            cid, present = writer.find_id(p.cid, n, p.hash_s)
            if present is not None:
                return present
            with scratch.borrowed() as s:
                e = enc.encode(view, s.view)
                writer.note_compressed()
                stages.add("compress", e.encode_s, n)
                stages.add("checksum", e.check_s, n)
                if e.codec == "raw":  # (page pieces are views into read blocks: no frame of their own)
                    copy_into(s.view[HEADER_SIZE:], view)
                return writer.put_chunk(e.codec, n, s.view, e.length, raw_id=cid, checksum=e.checksum)

        def prepared(enc: Encoder | None, view: memoryview, name: str, off: int) -> Prepared:
            """VIEW's zero test, raw id and (on a page boundary of a page image) page keys, by encoder
            process ENC or, without one, here; the keys recorded in this put's collector, the times
            in its stages."""
            keyed = collector is not None and off % PAGE == 0
            p = enc.prepare(view, keyed) if enc is not None else _prepare_here(view, keyed)
            stages.add("zero-test", p.zero_s, len(view))
            if keyed and not p.zero:
                assert collector is not None
                stages.add("page-keys", p.keys_s, len(view))
                collector.add(name, off, view, p.sample)
            return p

        def encode_plain(view: memoryview, encoded: memoryview, again: bool = False) -> tuple[str, int]:
            """VIEW's codec as CHOOSER picks it and the payload's length, written into ENCODED at
            HEADER_SIZE (nothing written for "raw"); AGAIN: a chunk encoded once already in this put
            (set aside after its first try weighed the real encoding): its time counts, not it."""
            t0 = time.perf_counter()
            codec, m = chooser.encode_into(view, encoded[HEADER_SIZE:])
            if not again:
                writer.note_compressed()
            stages.add("compress", time.perf_counter() - t0, 0 if again else len(view))
            return codec, m

        def count_stored(ref: ChunkRef) -> None:
            """What a new chunk weighed as a delta took (the entry now present: another writer's
            plain entry of the same bytes counts as plain)."""
            stages.add("delta:stored as deltas" if ref.codec == DELTA else "delta:stored plain", 0.0, ref.stored_len)

        def put_plain(view: memoryview, cid: str, codec: str, m: int, encoded: memoryview,
                      frame: AlignedBuffer | None) -> ChunkRef:
            """VIEW stored as CHOOSER encoded it into ENCODED (payload at HEADER_SIZE; CODEC, M
            bytes), a raw chunk written from FRAME where it was read into one."""
            n = len(view)
            if codec == "raw" and frame is not None:  # written from where it was read
                return writer.put_chunk("raw", n, frame.view, n, raw_id=cid)
            if codec == "raw":
                copy_into(encoded[HEADER_SIZE:], view)
                return writer.put_chunk("raw", n, encoded, n, raw_id=cid)
            return writer.put_chunk(codec, n, encoded, m, raw_id=cid)

        def tally(won: bool, hint: Place | None, n: int, record: bool = True) -> None:
            assert effort is not None
            if record:
                effort.record(won)
            # how many new chunks became deltas, and of how many tried (bytes: raw)
            stages.add("delta:won" if won else "delta:lost", 0.0, n)
            if hint is not None:  # of those, placed by three cuts in a row
                stages.add("delta:placed by cuts", 0.0, n)

        aside: list[tuple[list[ChunkRef], int, bytearray, str, int, Place | None, int, bool]] = []
        aside_bytes = [0]
        alock = threading.Lock()

        def set_aside(chunks: list[ChunkRef], idx: int, view: memoryview, name: str, off: int,
                      hint: Place | None, plain_len: int, encoded: bool) -> bool:
            """Whether a new chunk that found no base was kept (a copy, at most SET_ASIDE bytes in all) to
            be tried again after every other chunk. The caller sets aside only a chunk whose candidates
            were chosen while nothing after it in its stream was placed yet (the first chunks after the
            place where a region of the parent's bytes begins: content-defined cuts meet the parent's
            again a few chunks later, whose unchanged chunks then say where the region went)."""
            n = len(view)
            if shifts is None:
                return False
            with alock:
                if aside_bytes[0] + n > SET_ASIDE:
                    return False
                aside_bytes[0] += n
            keep = bytearray(n)
            copy_into(memoryview(keep), view)
            with alock:
                aside.append((chunks, idx, keep, name, off, hint, plain_len, encoded))
            stages.add("delta:set aside", 0.0, n)
            return True

        def again(chunks: list[ChunkRef], idx: int, keep: bytearray, name: str, off: int,
                  hint: Place | None, plain_len: int, encoded: bool) -> None:
            """A chunk set aside: a delta now if one pays (against PLAIN_LEN, its plain encoding's
            length: estimated, or real where ENCODED, its first try having made it), else encoded
            and stored as any new chunk."""
            view = memoryview(keep)
            n = len(view)
            try:
                if fail.exc is not None:
                    return
                cid, present = writer.find_raw(view)  # the same bytes may have come in meanwhile
                if present is not None:
                    chunks[idx] = present
                    return
                assert effort is not None
                got = None
                with scratch.borrowed() as s:
                    plain = _Once(lambda: encode_plain(view, s.view, again=encoded))
                    if shifts is not None and shifts.unplaced(name, off, hint):
                        stages.add("delta:no place known", 0.0, n)
                    elif effort.worth():
                        got = as_delta(cid, view, plain_len, name, off, hint, plain)
                        tally(got is not None, hint, n, record=got is not None)  # a failed first try counted already
                    else:
                        stages.add("delta:not tried (effort bound)", 0.0, n)
                    if got is not None:
                        stages.add("delta:won when tried again", 0.0, n)
                        count_stored(got)
                        chunks[idx] = got
                        return
                    codec, m = plain()
                    chunks[idx] = put_plain(view, cid, codec, m, s.view, None)
                    count_stored(chunks[idx])
            except BaseException as e:  # noqa: BLE001 - handed to the submitting thread
                fail.set(e)

        def produce(chunks: list[ChunkRef], reader: StreamReader, name: str, off: int = 0) -> None:
            """Cut READER (the stream NAME from its offset OFF) into pieces and hand them to the
            workers; CHUNKS gets their refs in order."""
            pieces = (_fixed_pieces(reader, staging, chunk_size, stages, name) if chunker == "fixed"
                      else _page_pieces(reader, blocks, chunk_size, stages, name))
            submit_s, submitted = 0.0, 0  # summed here, added once: the producer is the ingest's one serial thread
            lens: collections.deque[int] = collections.deque(maxlen=3)  # the last pieces' lengths
            try:
                for piece in pieces:
                    if fail.exc is not None:
                        piece.release()
                        break
                    chunks.append(None)  # type: ignore[arg-type] # filled by the worker
                    t0 = time.perf_counter()
                    lens.append(len(piece.view))
                    hint = shifts.run_place(tuple(lens), off, chunk_size) if shifts is not None and chunker == "pages" else None
                    f = ex.submit(process, chunks, len(chunks) - 1, piece, name, off, hint)
                    off += len(piece.view)
                    with flock:
                        futures.append(f)
                    submit_s += time.perf_counter() - t0
                    submitted += len(piece.view)
            finally:
                pieces.close()  # a page reader's block goes back once its pieces are done
                stages.add("produce:submit", submit_s, submitted)

        def segment(spec: StreamSpec, part: list[ChunkRef], offset: int, length: int) -> None:
            with source.open_range(spec, offset, length) as r:  # type: ignore[attr-defined]
                produce(part, r, spec.name, offset)

        cut_by = chunker_record(chunker, chunk_size)
        reused = [0, 0]  # streams, bytes taken from `known` without reading
        keyed: list[Stream] = []  # the streams read through the page chunker: their page keys recorded
        for spec in source.streams():
            fail.raise_if_set()
            stream = Stream(spec.name, {**spec.attrs, "chunker": cut_by} if spec.has_data else dict(spec.attrs))
            writer.add_stream(stream)
            if not spec.has_data:
                continue
            if known is not None and _reuse(writer, stream, known(spec, cut_by)):
                reused[0] += 1
                reused[1] += stream.size
                if progress is not None:
                    progress.advance(stream.size)
                continue  # not read: no page keys
            if collector is not None:
                keyed.append(stream)
            segs = _segments(spec, source, chunker)
            head: list[ChunkRef] = []
            if segs is None:
                with source.open(spec) as reader:
                    produce(stream.chunks, reader, spec.name)
                    rest = getattr(reader, "handoff", None)
                if rest is None:
                    continue
                # a followed file whose writer finished with much left to read: the rest in segments
                segs, head = _split(*rest), stream.chunks
            # a large page image: several producers, each on its own segment (a cut is forced at
            # every segment boundary); the stream's chunk list is their lists in order
            parts: list[list[ChunkRef]] = [[] for _ in segs]
            whole.append((stream, [head, *parts]))

            with ThreadPoolExecutor(producers, thread_name_prefix="gpusnap-read") as px:
                for f in [px.submit(segment, spec, part, *seg) for part, seg in zip(parts, segs)]:
                    f.result()
        for f in list(futures):
            f.result()
        fail.raise_if_set()
        for f in [ex.submit(again, *a) for a in aside]:
            f.result()
        fail.raise_if_set()
        for stream, parts in whole:
            stream.chunks[:] = [c for p in parts for c in p]
        for stream in keyed:
            assert collector is not None
            stream.attrs["pagekeys"] = collector.record(stream.name)
    if at:  # what the bases cost: decoded once each unless the cache let one go (stage delta-base counts
        # the bases of every candidate tried, cached or not)
        stages.add("delta-base:decoded", 0.0, writer.store.bases_decoded - decoded_before)
    res = writer_result(writer, stages, time.perf_counter() - t_start)
    res.extra.update(files_unchanged=reused[0], bytes_unchanged=reused[1])
    return res


def _prepare_here(view: memoryview, keyed: bool) -> Prepared:
    """What an encoder process's prepare answers (encodeprocs), done in this thread: the zero test,
    then, for a chunk that is not all zeros, its page keys (KEYED) and its raw id."""
    t0 = time.perf_counter()
    zero = is_zero(view)
    t1 = time.perf_counter()
    if zero:
        return Prepared(True, None, None, t1 - t0, 0.0, 0.0)
    sample = pagekeys.sampled(view) if keyed else None
    t2 = time.perf_counter()
    cid = raw_chunk_id(view)
    return Prepared(False, cid, sample, t1 - t0, time.perf_counter() - t2, t2 - t1)


@contextlib.contextmanager
def _encoders(nprocs: int, size: int, level: int, compress: bool) -> Iterator[tuple[Arena | None, EncodeProcs | None]]:
    """A put's encoder processes and the arena of SIZE bytes they share with it: the buffers they read
    and write (none without processes: (None, None))."""
    if not nprocs:
        yield None, None
        return
    with Arena(size, "gpusnap-put") as arena, EncodeProcs(nprocs, arena, level, compress) as encs:
        yield arena, encs


class _Prefetch:
    """Reads ahead, in a thread of its own, the parent chunks that a changed stream's next chunks will
    take as delta bases: once a chunk is found new, the parent's chunks at its offset and the AHEAD
    after it in the same-named stream (where a file's bases lie), each asked once. Without it every
    base was read when its chunk needed it, by the worker that then waited: a put with a parent of a
    store that is not in the page cache took twice the time of a put without one (issue 60). A
    stream found unchanged asks nothing, so an unchanged stretch of a file costs no base read."""

    AHEAD = 8

    def __init__(self, store: SnapshotStore, at: dict[str, tuple[list[int], list[ChunkRef]]]) -> None:
        import queue
        self.store, self.at = store, at
        self.asked: set[str] = set()
        self.q: "queue.SimpleQueue[str | None]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="gpusnap-prefetch", daemon=True)
        self.thread.start()

    def changed(self, name: str, off: int) -> None:
        got = self.at.get(name)
        if got is None:
            return
        starts, refs = got
        i = max(0, bisect.bisect_right(starts, off) - 1)
        for ref in refs[i:i + self.AHEAD + 1]:
            if ref.id is not None and ref.id not in self.asked:
                self.asked.add(ref.id)
                self.q.put(ref.id)

    def _run(self) -> None:
        while (cid := self.q.get()) is not None:
            self.store.prefetch(cid)

    def close(self) -> None:
        self.q.put(None)
        self.thread.join()


@contextlib.contextmanager
def _prefetching(store: SnapshotStore, at: dict[str, tuple[list[int], list[ChunkRef]]] | None
                 ) -> Iterator[_Prefetch | None]:
    if not at or os.environ.get("GPUSNAP_PUT_PREFETCH", "1") == "0":
        yield None
        return
    p = _Prefetch(store, at)
    try:
        yield p
    finally:
        p.close()


def _parent_chunks(parent: Manifest) -> dict[str, tuple[list[int], list[ChunkRef]]]:
    """PARENT's data streams by name: each chunk's offset and reference (where a new chunk's delta
    reference is cut from)."""
    out: dict[str, tuple[list[int], list[ChunkRef]]] = {}
    for s in parent.streams:
        if any(not c.is_zero for c in s.chunks):
            starts, off = [], 0
            for c in s.chunks:
                starts.append(off)
                off += c.raw_len
            out[s.name] = (starts, list(s.chunks))
    return out


def _cut_by_content(parent: Manifest) -> dict[str, int]:
    """PARENT's streams cut by the page chunker, with the maximum chunk length it recorded."""
    out: dict[str, int] = {}
    for s in parent.streams:
        rec = s.attrs.get("chunker")
        if isinstance(rec, dict) and rec.get("name") == "pages" and isinstance(rec.get("max"), int) and rec["max"] > 0:
            out[s.name] = rec["max"]
    return out


def _run_key(lens: tuple[int, ...]) -> int:
    """One int for three chunk lengths (each below 2**32: a chunk is at most MAX_RAW_CHUNK)."""
    return (lens[0] << 64) | (lens[1] << 32) | lens[2]


Place = tuple[str, int]  # (a parent stream's name, shift): the parent's offset is the new offset + shift


class _Shifts:
    """Where a new stream's bytes were in the parent: a parent stream and a shift (parent offset - new
    offset) learned at new offsets, from unchanged chunks (found by id at one place of any parent
    stream) and from deltas whose reference held most of their chunk. The parent stream need not be
    the same-named one: CRIU numbers page images in the order it dumps them, so a process's pages may
    be pages-9.img in one dump and pages-8.img in its parent, or split between two of the parent's
    images. Shared by the workers of one put."""

    def __init__(self, at: dict[str, tuple[list[int], list[ChunkRef]]], cdc: dict[str, int]) -> None:
        """AT: the parent's data streams (_parent_chunks); CDC: those cut by content, with their
        maximum chunk length (their chunker record)."""
        self._lock = threading.Lock()
        self._learned: dict[str, tuple[list[int], list[Place]]] = collections.defaultdict(lambda: ([], []))
        self._where: dict[str, Place | None] = {}  # chunk id -> (parent stream, its offset there)
        self._by_len: dict[str, dict[int, list[int]]] = {}
        self._cuts: dict[str, list[int]] = {}  # the parent's chunk boundaries (content-defined cuts)
        self._starts: dict[str, set[int]] = {}  # the parent's chunk starts
        self._seen: dict[str, collections.Counter[Place]] = collections.defaultdict(collections.Counter)
        self._runs: dict[int, Place | None] = {}  # three chunk lengths (_run_key) -> the third's place
        for name, (starts, refs) in at.items():
            self._cuts[name] = starts[1:] + [starts[-1] + refs[-1].raw_len]
            self._starts[name] = set(starts)
            by_len: dict[int, list[int]] = {}
            for o, r in zip(starts, refs):
                if r.id is not None:
                    self._where[r.id] = None if r.id in self._where else (name, o)  # at two places: says nothing
                    by_len.setdefault(r.raw_len, []).append(o)
            self._by_len[name] = by_len
            most = cdc.get(name)
            if most is None:
                continue  # fixed-size pieces: their lengths say nothing of where the content is
            for k in range(2, len(refs)):
                lens = (refs[k - 2].raw_len, refs[k - 1].raw_len, refs[k].raw_len)
                if max(lens) >= most:
                    continue  # a cut forced at the maximum length is not the content's
                key = _run_key(lens)
                self._runs[key] = None if key in self._runs else (name, starts[k])  # twice: says nothing

    def run_place(self, run: tuple[int, ...], off: int, most: int) -> Place | None:
        """Where the chunk at OFF was in the parent, if the lengths of it and the two chunks before it
        (RUN) are those of three consecutive chunks at one place of the parent: content-defined cuts
        fall where the content says, so three of them in a row place a chunk whose inside changed (a
        KV pool's chunks, every one with a block written) wherever its bytes moved, in any stream."""
        if len(run) != 3 or max(run) >= most:
            return None
        p = self._runs.get(_run_key(run))
        return None if p is None else (p[0], p[1] - off)

    def note(self, name: str, off: int, place: Place) -> None:
        with self._lock:
            offs, vals = self._learned[name]
            i = bisect.bisect_left(offs, off)
            offs.insert(i, off)
            vals.insert(i, place)
            self._seen[name][place] += 1

    def found(self, name: str, off: int, cid: str) -> None:
        w = self._where.get(cid)
        if w is not None:
            self.note(name, off, (w[0], w[1] - off))

    def nothing_after(self, name: str, off: int) -> bool:
        """Whether no place was learned yet beyond OFF of NAME."""
        with self._lock:
            offs = self._learned[name][0] if name in self._learned else []
            return bisect.bisect_right(offs, off) == len(offs)

    def guess(self, name: str, off: int) -> Place | None:
        """The place learned nearest before OFF of NAME (the first one after it when none is before);
        with nothing learned in NAME yet, the parent's stream of the same name at the same offset, if
        it has one."""
        with self._lock:
            offs, vals = self._learned.get(name, ([], []))
            i = bisect.bisect_right(offs, off)
            if vals:
                return vals[i - 1] if i > 0 else vals[0]
        return (name, 0) if name in self._cuts else None

    def unplaced(self, name: str, off: int, hint: Place | None) -> bool:
        """Whether a chunk at OFF of NAME has no place to try: no HINT, nothing learned in NAME and no
        parent stream of that name."""
        return hint is None and self.guess(name, off) is None

    def candidates(self, name: str, off: int, n: int, hint: Place | None = None) -> list[Place]:
        """Places to try for N new bytes at OFF of NAME, the likeliest first (at most six): HINT
        (run_place) first."""
        guess = self.guess(name, off)
        if guess is None:
            guess = hint
        if guess is None:
            return []
        with self._lock:
            offs, vals = self._learned.get(name, ([], []))
            i = bisect.bisect_right(offs, off)
            learned = [vals[j] for j in (i - 1, i) if 0 <= j < len(vals)]
            seen = [v for v, _ in self._seen[name].most_common(SHIFTS_TRIED)] if name in self._seen else []
        pname, shift = guess
        near: list[Place] = []  # places derived from the guess: tried only within SHIFT_REACH of it
        same_len = self._by_len[pname].get(n, [])
        if same_len:
            j = bisect.bisect_left(same_len, off + shift)
            p = min((same_len[k] for k in (j - 1, j) if 0 <= k < len(same_len)), key=lambda q: abs(q - off - shift))
            near.append((pname, p - off))
        # the parent's cut nearest this chunk's end (CDC cuts follow the content: where the bytes
        # after a place where pages were mapped went, when no chunk of the same length says so)
        cuts = self._cuts[pname]
        j = bisect.bisect_left(cuts, off + n + shift)
        ends = [cuts[k] - off - n for k in (j - 1, j) if 0 <= k < len(cuts) and cuts[k] - off - n != shift]
        if ends:
            near.append((pname, min(ends, key=lambda e: abs(e - shift))))
        # any place seen in this stream at which this chunk starts where a chunk of the parent started:
        # a content-defined cut that is the parent's too says the bytes before it are the parent's
        # there (a page image moves by several shifts when areas were mapped at several places, and
        # the workers learn them out of order)
        aligned = [v for v in seen if off + v[1] in self._starts[v[0]]]
        same_place = [(name, 0)] if name in self._cuts else []
        out: list[Place] = []
        # and the stream's two most frequent places: where the bytes around a region that begins
        # after a gap went, when its first chunks come before anything near them is learned
        frequent = seen[:2]
        for c in [*([hint] if hint else []), *aligned[:2], guess, *learned, *near, *same_place, *frequent]:
            close = c[0] == pname and abs(c[1] - shift) <= SHIFT_REACH
            if c not in out and off + c[1] + n > 0 and (close or c == hint or c in aligned or c in learned
                                                        or c in frequent):
                out.append(c)
        return out[:6]


SET_ASIDE = 256 << 20    # new chunks a put keeps to try as deltas again at its end (bytes, copies)
SHIFT_REACH = 256 << 20  # a parent chunk of the same length this far from the guess is taken for a candidate
SEARCH_REACH = 16 << 20  # _search_shifts looks for a chunk's pages this far around the guessed place
SEARCH_PAGES = 8         # ... for at most this many of its non-zero pages, spread over it
SEARCH_CHUNKS = 16       # ... in at most this many parent chunks, the nearest first


class _Effort:
    """Whether trying a delta still pays in this put: after EFFORT_PROBE attempts of which fewer than
    EFFORT_FLOOR succeeded (a parent that is not this data's), only one new chunk in EFFORT_EVERY is
    tried (a success brings the rate back up), so an unrelated parent costs a put little."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.tried = self.won = self._seen = 0

    def worth(self) -> bool:
        with self._lock:
            self._seen += 1
            if self.tried < EFFORT_PROBE or self.won >= EFFORT_FLOOR * self.tried:
                return True
            return self._seen % EFFORT_EVERY == 0

    def record(self, won: bool) -> None:
        with self._lock:
            self.tried += 1
            self.won += int(won)


EFFORT_PROBE, EFFORT_FLOOR, EFFORT_EVERY = 32, 0.1, 16
_PAGE = 4096
_KEY_MULT: Any = None    # numpy weights of page_keys (made on first use)


def page_keys(data: memoryview | bytes | Any) -> Any:
    """A 64-bit key per whole 4 KiB page of DATA, any buffer (a weighted sum of its words: equal pages,
    equal keys; two different pages may share one, which only costs a candidate: the XOR decides).
    The benchmarks' and tests' page lookups use it too."""
    import numpy as np
    global _KEY_MULT
    if _KEY_MULT is None:
        _KEY_MULT = (np.arange(_PAGE // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    n = len(data) // _PAGE * _PAGE
    words = np.frombuffer(data, dtype=np.uint64, count=n // 8).reshape(-1, _PAGE // 8)
    return (words * _KEY_MULT).sum(axis=1, dtype=np.uint64)


def _search_shifts(store: SnapshotStore, chunks: tuple[list[int], list[ChunkRef]], view: memoryview,
                   off: int, guess: int, failed: set[str]) -> list[int]:
    """Shifts at which some of VIEW's non-zero pages (VIEW at OFF of the new stream) lie in the parent
    stream (CHUNKS), looked for in its full chunks within SEARCH_REACH of OFF + GUESS (the nearest
    SEARCH_CHUNKS of them); the most frequent first, at most two. Reads those chunks through the
    store's base cache; FAILED: ids that could not be read in this put (skipped, and added to)."""
    import numpy as np
    keys = page_keys(view)
    zero = page_keys(bytes(_PAGE))[0]
    nonzero = np.nonzero(keys != zero)[0]
    if not len(nonzero):
        return []
    sample = nonzero[np.linspace(0, len(nonzero) - 1, min(SEARCH_PAGES, len(nonzero))).astype(int)]
    want = {int(keys[i]): int(i) * _PAGE for i in sample}
    starts, refs = chunks
    lo, hi = off + guess - SEARCH_REACH, off + guess + len(view) + SEARCH_REACH
    first, last = max(0, bisect.bisect_right(starts, lo) - 1), bisect.bisect_left(starts, hi)
    mid = off + guess
    order = sorted(range(first, min(last, len(refs))), key=lambda k: abs(starts[k] - mid))[:SEARCH_CHUNKS]
    wanted = np.fromiter(want, dtype=np.uint64, count=len(want))
    votes: collections.Counter[int] = collections.Counter()
    for k in order:
        r = refs[k]
        if r.id is None or r.is_zero or r.codec == DELTA or r.id in failed:
            continue
        pk = _KEYS.get(r.id)
        if pk is None:
            try:
                pk = page_keys(store.delta_base(r.id, delta.base_limit(r.raw_len)))
            except (ChunkError, OSError):
                failed.add(r.id)
                continue
            _KEYS.put(r.id, pk)
        hit = np.nonzero(np.isin(pk, wanted))[0]
        for j in hit:
            votes[starts[k] + int(j) * _PAGE - off - want[int(pk[j])]] += 1
        if votes and votes.most_common(1)[0][1] >= max(2, len(want) // 2):
            break  # half the pages sampled agree: that is where they went
    return [v for v, _ in votes.most_common(2)]


class _KeyCache:
    """The page keys of the parent chunks searched last (by chunk id), shared by the workers."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._lock = threading.Lock()
        self._keys: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, cid: str) -> Any:
        with self._lock:
            v = self._keys.get(cid)
            if v is not None:
                self._keys.move_to_end(cid)
            return v

    def put(self, cid: str, keys: Any) -> None:
        with self._lock:
            self._keys[cid] = keys
            while len(self._keys) > self._most:
                self._keys.popitem(last=False)


_KEYS = _KeyCache(512)  # ~512 chunks' pages: 2.6 MB of keys
SHIFTS_TRIED = 32  # the stream's most frequent shifts a chunk's start is checked against


_T = TypeVar("_T")


class _Once(Generic[_T]):
    """FN's result, made on the first call (whichever thread makes it) and kept in GOT: a new chunk's
    plain encoding, which a put with a parent makes at most once and only if it needs it; the
    parent's page index, built at the first lookup."""

    def __init__(self, fn: Callable[[], _T]) -> None:
        self.fn = fn
        self.got: _T | None = None
        self._made = False  # FN may give None (a parent without page keys)
        self._lock = threading.Lock()

    def __call__(self) -> _T:
        if not self._made:
            with self._lock:
                if not self._made:
                    self.got = self.fn()
                    self._made = True
        return self.got  # type: ignore[return-value] # made: FN's own result, None where FN gave None


def _window(store: SnapshotStore, chunks: tuple[list[int], list[ChunkRef]], off: int,
            n: int) -> list[delta.Segment] | None:
    """The reference segments of the bytes [OFF, OFF + N) of a parent stream (CHUNKS: its offsets and
    references): its full chunks' bytes, a delta chunk's own reference (depth 1), zeros for zero
    chunks; None when that needs more than delta.MAX_SEGMENTS segments."""
    starts, refs = chunks
    segs: list[delta.Segment] = []
    if off < 0:  # the bytes before the parent stream's start: zeros (a region that begins after a gap)
        segs.append(delta.Segment(None, 0, min(n, -off)))
        n, off = n + off, 0
    i = max(0, bisect.bisect_right(starts, off) - 1)
    pos, end = off, off + n
    walked = 0
    while pos < end and i < len(refs):
        s0, r = starts[i], refs[i]
        i += 1
        walked += 1
        if walked > 4 * delta.MAX_SEGMENTS:  # a parent of countless tiny chunks: no reference worth walking
            return None
        if s0 + r.raw_len <= pos:
            continue
        lo, hi = pos - s0, min(end, s0 + r.raw_len) - s0
        if r.is_zero or r.id is None:
            segs.append(delta.Segment(None, 0, hi - lo))
        else:
            locs = store.locate(r.id)
            own = store.entry_segments(r.id, locs[0]) if locs else None
            segs += delta.cut(own if own is not None else [delta.Segment(r.id, 0, r.raw_len)], lo, hi)
        pos = s0 + hi
    out = delta.merged(segs)
    return out if len(out) <= delta.MAX_SEGMENTS else None


def _reuse(writer: SnapshotWriter, stream: Stream, refs: list[ChunkRef] | None) -> bool:
    """STREAM's chunks set to REFS if every one is present and sound now (counted as deduplicated)."""
    if refs is None:
        return False
    got = [r if r.is_zero else writer.reuse_ref(r) for r in refs]
    if any(g is None for g in got):
        return False
    for g in got:
        writer.note_reused(g)  # type: ignore[arg-type]
    stream.chunks[:] = got  # type: ignore[assignment]
    return True


SEGMENT = 1 << 30  # page images larger than two of these are read by several producers


def _segments(spec: StreamSpec, source: Source, chunker: str) -> list[tuple[int, int]] | None:
    if chunker != "pages" or spec.size is None or spec.size <= 2 * SEGMENT or not hasattr(source, "open_range"):
        return None
    return _split(0, spec.size)


def _split(offset: int, length: int) -> list[tuple[int, int]]:
    return [(off, min(SEGMENT, offset + length - off)) for off in range(offset, offset + length, SEGMENT)]


def writer_result(writer: SnapshotWriter, stages: Stages, seconds: float, raw_bytes: int | None = None) -> Result:
    """The Result of a put into WRITER: its hash/write stage times and its dedup/zero counts added."""
    st = writer.stats
    stages.add("hash", st.hash_s, st.raw_bytes - st.zero_bytes)
    if st.write_s:
        stages.add("write", st.write_s, st.bytes_new)
    return Result(st.raw_bytes if raw_bytes is None else raw_bytes, st.bytes_new, seconds, stages,
                  {"bytes_dedup": st.bytes_dedup, "zero_bytes": st.zero_bytes, "chunks_new": st.chunks_new,
                   "chunks_dedup": st.chunks_dedup, "chunks_zero": st.chunks_zero,
                   "chunks_compressed": st.chunks_compressed})


class _OpenStream:
    """A sink stream shared by several workers; closed by whoever finishes its last chunk."""

    def __init__(self, writer: StreamWriter, pending: int) -> None:
        self.writer = writer
        self.pending = pending
        self._lock = threading.Lock()

    def done_one(self) -> None:
        with self._lock:
            self.pending -= 1
            last = self.pending == 0
        if last:
            self.writer.close()


def get_direct() -> bool:
    """Whether `get` reads packs with O_DIRECT (default yes, where the file system takes it;
    $GPUSNAP_GET_DIRECT=0 reads them through the page cache, for measuring). Measured on the dev VM
    (2 cores, 1.4 GB of bf16 weights, 8 cold gets each way, interleaved): median 1.82 s (1.16 s of
    it in the kernel) against 3.08 s (2.66 s) buffered; every direct get was faster than every
    buffered one. A get reads each pack byte once, so the page cache only cost a copy. Anything but 0
    or 1 is refused (SettingError)."""
    return bool(switch("GPUSNAP_GET_DIRECT", True))


def put_direct() -> bool:
    """Whether `store put` writes its packs with O_DIRECT (default yes, where the file system takes
    it; $GPUSNAP_PUT_DIRECT=0 writes them through the page cache, for measuring). A put's packs are
    read back by `get` with O_DIRECT (get_direct) or cold by a later restore, so the page cache only
    cost a copy and the pages to hold it. Measured on the dev VM (2 cores, 1.41 GB of bf16 weights,
    0.93 GB of packs, cold, BENCHMARKS.md section 39): puts of 1.03-1.12 s with 0.15 s of kernel time
    direct, 1.47-1.60 s with 0.84-1.03 s buffered; seven rounds against cp, 1.16 s direct and 1.31 s
    buffered. Pulls and `store import` keep buffered packs (a restore on the same node soon after finds
    them in the page cache); dumps and imported container checkpoints do unless
    sandbox.host.dumpwrites says otherwise. Anything but 0 or 1 is refused (SettingError)."""
    return bool(switch("GPUSNAP_PUT_DIRECT", True))


def get(store: SnapshotStore, manifest: Manifest, sink: Sink, *, workers: int | None = None,
        progress: Progress | None = None) -> Result:
    """Materialize MANIFEST's streams into SINK, every chunk verified; sink.abort() on any failure."""
    workers = workers or default_workers()
    direct = get_direct()  # (a bad setting refused before anything is written)
    stages = Stages()
    fail = _Failure()
    t_start = time.perf_counter()
    stored = 0
    try:
        missing = store.missing(manifest)
        if missing:
            raise SnapshotDamaged(f"snapshot {manifest.name!r} is damaged: {len(missing)} chunk(s) cannot be read "
                             f"(first {missing[0][:16]}…: {store.absence(missing[0])}); nothing was written")
        wants: list[Want] = []
        outs: list[_OpenStream] = []
        for s in manifest.streams:
            spec = StreamSpec(s.name, s.attrs, s.size)
            w = sink.open(spec)
            if w is None:
                continue
            out = _OpenStream(w, sum(1 for c in s.chunks if not c.is_zero) + 1)
            outs.append(out)
            offset = 0
            for i, c in enumerate(s.chunks):
                if c.is_zero:
                    if progress is not None:
                        progress.advance(c.raw_len)
                else:
                    stored += c.stored_len
                    wants.append(Want((s, i, offset, out), c))
                offset += c.raw_len

        def deliver(want: Want, data: Any) -> None:
            s, i, offset, out = want.key
            t0 = time.perf_counter()
            try:
                out.writer.write_at(offset, data)
            except OSError as e:
                raise PipelineError(f"writing {s.name}: {e.strerror or e}") from None
            stages.add("write", time.perf_counter() - t0, want.ref.raw_len)
            out.done_one()
            if progress is not None:
                progress.advance(want.ref.raw_len)

        try:
            read_chunks(store, wants, deliver, stages=stages, decoders=workers, direct=direct)
        except ChunkError as e:
            where = next((f"{w.key[0].name} chunk {w.key[1]}: " for w in wants if w.ref.id == e.chunk_id), "")
            raise SnapshotDamaged(f"snapshot {manifest.name!r} is damaged: {where}{e.what}") from None
        except CodecError as e:
            raise StoreError(f"snapshot {manifest.name!r}: {e}") from None
        for out in outs:
            out.done_one()  # the submitter's own reference: a stream with no data is closed here
        sink.commit()
    except BaseException:
        sink.abort()
        raise
    return Result(manifest.size, stored, time.perf_counter() - t_start, stages)
