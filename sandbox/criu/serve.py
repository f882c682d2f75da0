"""The restore side of the image streamer: ServeSource serves a snapshot's images to `criu restore --stream`.

For each image CRIU asks for, its chunks are read, verified and decoded by a pool of threads a
window ahead of CRIU and written into CRIU's pipe in order; no image is materialized. With a split
(sandbox.criu.split) the large page runs are left out of what CRIU gets and written into the
stopped tree afterwards (fill()). A restore from a remote (storage.remote.fill) starts before the
snapshot is local: the chunks still on their way are asked for in the order CRIU reads them
(read_order), and a chunk is waited for only when CRIU needs it before it has arrived.
sandbox.criu.restore runs CRIU against it.

Guarantees kept here: every chunk is verified before its bytes enter CRIU's pipe (read from the
store with the full check, or handed over by the remote fill verified on arrival); a damaged chunk,
a missing one (refused before anything starts), a remote that fails mid-restore, or gpusnap dying
breaks the pipe, and CRIU fails before any restored process runs; raise_if_failed names the store
side's failure before the broken pipe's.

Threads, not asyncio: every transfer is a blocking read or write that releases the GIL.
"""
from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol

from storage.api import put as pipeline

from storage.api import readstage
from storage.api import ChildReads
from storage.api import ChunkError
from storage.api import CodecError, decode_host, decode_host_into
from storage.api import AlignedBuffer, BufferPool, Recycler, address_of, copy_into
from storage.api import GpusnapError
from storage.api import ChunkRef, Manifest, Stream
from storage.api import Stages
from storage.api import Want, plan_runs, read_ahead, read_runs
from storage.api import SnapshotStore, StoreError

from sandbox.criu import filehints, fill_procs, split
from sandbox.criu.fill_procs import FILL_GAP, FillProcs, read_moved, setting
from sandbox.host.meminfo import available_bytes
from sandbox.criu.images import IMAGES, is_page_image
from sandbox.criu.protocol import SERVE_SOCKET, Listener, StreamerError, read_request, recv_pipe, send_reply, write_all



class Arrivals(Protocol):
    """Chunks still on their way into the store while it serves (storage.remote.fill.RemoteFill)."""

    def wait(self, cid: str) -> None: ...

    def first(self, refs: Iterable[ChunkRef]) -> None: ...

    def take(self, cid: str) -> tuple[str, bytes] | None: ...


_PAGES_ID = re.compile(r"pages-(\d+)\.img")
_READ_FIRST = ("inventory.img", "pstree.img")


def read_order(images: dict[str, Stream], plans: dict[str, split.Plan] | None) -> list[ChunkRef]:
    """IMAGES' chunks in the order a streamed restore reads them (what a restore from a remote
    fetches first): what CRIU reads (criu_reads), then the runs a split moves, written after CRIU.
    Without PLANS (the pagemaps not read yet) the small images only."""
    out = criu_reads(images, plans)
    if plans is None:
        return out
    for n in _page_images(images):  # then what split.fill writes
        pl = plans.get(n)
        if pl is not None:
            out += [c for _, c, _, _ in split.pieces(images[n], tuple((r.offset, r.nbytes) for r in pl.moved))]
    return out


def criu_reads(images: dict[str, Stream], plans: dict[str, split.Plan] | None) -> list[ChunkRef]:
    """The chunks CRIU reads, in its order: the inventory and the process tree, then each process's
    small images, pagemap and page image, the root's first (page images are numbered in that order,
    as the dump met the processes); of a split page image only its kept ranges. Without PLANS the
    small images only."""
    small = sorted((n for n in images if not is_page_image(n)),
                   key=lambda n: (_READ_FIRST.index(n) if n in _READ_FIRST else len(_READ_FIRST), images[n].size, n))
    out = [c for n in small for c in images[n].chunks]
    if plans is None:
        return out
    for n in _page_images(images):
        pl = plans.get(n)
        out += [c for _, c, _, _ in split.pieces(images[n], pl.kept if pl else None)]
    return out


def _page_images(images: dict[str, Stream]) -> list[str]:
    return sorted((n for n in images if is_page_image(n)),
                  key=lambda n: (int(m.group(1)) if (m := _PAGES_ID.fullmatch(n)) else 1 << 62, n))


def early_reads(images: dict[str, Stream], most: int, refs_most: int = 1 << 16) -> list[ChunkRef]:
    """What a restore reads first, for EarlyReads: the small images (the process tree and the pagemaps
    that planning reads among them), then the page images' chunks in CRIU's order, up to MOST bytes
    of them (each counted at its larger length, at least a page: a manifest's lengths are claims) and
    REFS_MOST refs in all. Every byte of a page image is read once either way (by CRIU, or by the
    split fill), so whatever of them is in the page cache when the reads begin is read from memory."""
    out = criu_reads(images, None)[:refs_most]
    for n in _page_images(images):
        for c in images[n].chunks:
            if c.is_zero:
                continue
            cost = max(c.raw_len, c.stored_len, 4096)
            if most < cost or len(out) >= refs_most:
                return out
            out.append(c)
            most -= cost
    return out


def early_budget(avail: int) -> int:
    """Bytes EarlyReads may ask for, of AVAIL bytes of memory available now: what the fill may read
    ahead ($GPUSNAP_FILL_PREFETCH, else fill_prefetch), at most 4 GiB. Planning takes well under a
    second (0.5 s of a 20 GB restore on the H200, where the disk reads ~1.4 GB/s), so the stop, not
    this, is what ends the reads."""
    return min(4 << 30, _bytes_env("GPUSNAP_FILL_PREFETCH", fill_prefetch(avail)))


EARLY_STEP = 16 << 20   # bytes one of EarlyReads' reads asks for
EARLY_SWITCH_S = 0.001  # the interpreter's switch interval while EarlyReads runs (see EarlyReads)
_switch_lock = threading.Lock()
_switch = {"running": 0, "before": 0.0}  # EarlyReads running; the interval before the first of them


def _short_switch(on: bool) -> None:
    """The switch interval EARLY_SWITCH_S while any EarlyReads runs in this process, as it was after
    the last one stops (several may overlap: the first one's setting is the one put back)."""
    with _switch_lock:
        if on:
            if not _switch["running"]:
                _switch["before"] = sys.getswitchinterval() or 1e-6  # never 0, which cannot be set back
                sys.setswitchinterval(min(_switch["before"], EARLY_SWITCH_S))
            _switch["running"] += 1
        elif _switch["running"]:
            _switch["running"] -= 1
            if not _switch["running"]:
                sys.setswitchinterval(_switch["before"])


class EarlyReads:
    """REFS' pack entries read into the page cache, in order, from now until stop(): the disk reads
    while gpusnap plans a restore instead of idling. Measured on the H200 (20 GB MoE-like tree, the
    same run): 11.4 s restores with it, 11.9 s without.

    The reads are a child process's (storage.repo.childreads: EARLY_STEP bytes a read, through the page
    cache), started and stopped by one thread here. Planning is pure-Python work that holds the GIL,
    and a thread of this process reading beside it got little: on the H200 0.05-0.36 GB while a
    restore planned (the disk reads ~1.7 GB/s); on the dev VM, over 0.4 s beside a pure-Python loop,
    a thread asking WILLNEED got 11 MB of a cold store, reading 16 MiB at a time 227-260 MB, with
    the switch interval at EARLY_SWITCH_S 537-563 MB (806 MB with the loop idle). Where no child can
    be started, or with $GPUSNAP_EARLY_READS=thread (for measuring), the thread reads itself that
    last way.

    A hint only, like read_ahead: every byte read later is verified as ever, and a failure here is
    for those reads to meet. Stopped before CRIU's own reads are queued (_read_ahead_for_criu):
    what can still be ahead of them then is one read of EARLY_STEP bytes."""

    def __init__(self, store: SnapshotStore, refs: list[ChunkRef], stages: Stages) -> None:
        self._stop = threading.Event()
        self.stages = stages  # where the reads are reported, once stopped
        _short_switch(True)

        def run() -> None:
            t0 = time.perf_counter()
            try:
                runs = plan_runs(store, refs, gap=FILL_GAP, stop=self._stop.is_set)
                child = None if early_reads_mode() == "thread" or not runs else ChildReads.started(
                    store, runs, step=EARLY_STEP, stop=self._stop.is_set)
                if child is not None:
                    self._stop.wait()
                    got, read_s = child.stop()
                    stages.add("early read", time.perf_counter() - t0, got)  # from the start to the stop
                    stages.add("early read:disk", read_s, got)  # the child's own reading: the disk's rate
                    return
                asked = 0 if runs is None else read_runs(store, runs, stop=self._stop.is_set, resident=True,
                                                         advise=False, step=EARLY_STEP)
            except Exception:  # noqa: BLE001 - a hint (a damaged index is reported by the reads that follow)
                return
            stages.add("early read", time.perf_counter() - t0, asked)

        self._thread = threading.Thread(target=run, daemon=True, name="gpusnap-early-read")
        try:
            self._thread.start()
        except BaseException:
            _short_switch(False)
            raise
        self._stopped = False

    @classmethod
    def started(cls, store: SnapshotStore, refs: list[ChunkRef], stages: Stages) -> "EarlyReads | None":
        """EarlyReads, or None where its thread cannot be started (the restore goes on without it)."""
        try:
            return cls(store, refs, stages)
        except RuntimeError:  # can't start new thread
            return None

    def stop(self) -> None:
        """No further read; returns once the thread has ended, the switch interval as it was (once
        no other EarlyReads runs). Stopping twice is stopping once."""
        self._stop.set()
        try:
            self._thread.join()
        finally:
            if not self._stopped:
                self._stopped = True
                _short_switch(False)


def image_streams(manifest: Manifest) -> dict[str, Stream]:
    """MANIFEST's CRIU images (its images/NAME file streams), by NAME."""
    return {s.name.partition("/")[2]: s for s in manifest.streams
            if s.name.startswith(IMAGES + "/") and s.attrs.get("type") == "file"}


@contextmanager
def early_reads_of(store: SnapshotStore, manifest: Manifest) -> Iterator[EarlyReads | None]:
    """EarlyReads of MANIFEST's images started now, as soon as a restore is accepted (the disk reads
    while the restore journals, loads the CUDA driver and plans: on the H200 0.11 s of one busy core
    before the plan); stopped when the block ends, if ServeSource (or a failure) has not stopped it
    by then. None where it is turned off or cannot start. Its 'early read' stage then counts from
    here to the stop: its rate is not comparable with a start at the plan ($GPUSNAP_EARLY_READS=late)."""
    early = (EarlyReads.started(store, early_reads(image_streams(manifest), early_budget(available_bytes())), Stages())
             if early_reads_on() and early_reads_mode() != "late" else None)
    try:
        yield early
    finally:
        if early is not None:
            early.stop()


class ServeSource:
    """Serves MANIFEST's images to `criu restore --stream` through the serve socket in DIRECTORY;
    a context manager. Chunks are read, verified and decoded by WORKERS threads, up to WINDOW chunks
    ahead of CRIU per image, and written into CRIU's pipe in order."""

    def __init__(self, store: SnapshotStore, manifest: Manifest, directory: str, *, workers: int | None = None,
                 window: int | None = None, split_min: int = 0, arrivals: Arrivals | None = None,
                 fill_first: tuple[int, ...] = (), early: EarlyReads | None = None) -> None:
        """split_min: page runs of at least this many bytes are left out of what CRIU gets, for
        split.fill to write after CRIU (0: CRIU restores everything). arrivals: the chunks the store
        lacks are on their way (a restore from a remote): asked for in read order, each waited for
        when it is needed. fill_first: the pids whose moved runs the fill completes first, one after
        the other in this order (split.fill_phases; `fill` says when each is done). early: EarlyReads the
        caller started (early_reads_of), stopped here once the plan is made (the caller stops them too,
        for a failure before that); else they start here."""
        self.store, self.manifest, self.arrivals = store, manifest, arrivals
        self.fill_first = fill_first
        self.images = image_streams(manifest)
        self.marks: dict[str, float] = {}  # time.monotonic() at the steps below (the restore reports them)
        # thread-seconds of the store side: read+verify, decode, the fill's stages (the early reads' too)
        self.stages = early.stages if early is not None else Stages()
        self.workers = workers or pipeline.default_workers()
        self.window = window or 2 * self.workers
        self._bufs = BufferPool(self.workers, store.chunk_buffer_size([manifest]))  # CRIU's feeds (the fill has its own)
        # what the feeds' chunks are decoded into, a window ahead of CRIU: reused, not a new object per chunk
        self._outs = Recycler(max((c.raw_len for st in self.images.values() for c in st.chunks), default=1))
        try:
            # the disk reads what the restore reads first while the pagemaps are read and the split chosen
            if early is None and arrivals is None and early_reads_on():
                early = EarlyReads.started(store, early_reads(self.images, early_budget(available_bytes())),
                                           self.stages)
            self._plan(store, manifest, arrivals, split_min)
            self._listener = Listener(directory, SERVE_SOCKET)
        except BaseException:
            self._bufs.close()
            self._outs.close()
            raise
        finally:
            if early is not None:
                early.stop()  # before the CRIU-first read-ahead: CRIU's reads queue behind nothing
        self._ex = ThreadPoolExecutor(self.workers, thread_name_prefix="gpusnap-serve")
        self.connected_at: float | None = None  # time.monotonic() when CRIU connected
        # the moved runs are read from the store from now on, while CRIU restores the rest
        self.fill_memory: dict[str, int] = {}
        self._closing = False
        self._criu_done = threading.Event()  # the fill's read-ahead waits for it (see fill_prefetch)
        self._early_gate: fill_procs.EarlyGate | None = None  # the in-process fill's reads while CRIU runs
        # what CRIU reads goes to the disk's queue before the fill's reads (see _criu_first)
        self._criu_first: threading.Thread | None = None
        self._criu_asked = threading.Event()  # CRIU's reads are queued (or not asked for): the fill's may start
        if not (self.plans and arrivals is None and fill_criu_first()):
            self._criu_asked.set()
        else:
            self._criu_first = threading.Thread(target=self._read_ahead_for_criu, daemon=True,
                                                name="gpusnap-criu-first")
            self._criu_first.start()
        self.marks["planned"] = time.monotonic()
        self._filler: "split.Filler | FillProcs | None" = None
        self._feeds: list[threading.Thread] = []
        self._thread: threading.Thread | None = None
        try:
            self._filler = self._make_filler() if self.plans else None
            self.marks["fill_started"] = time.monotonic()
            self.errors: list[BaseException] = []
            self.served: list[str] = []
            self.absent: list[str] = []  # images CRIU asked for that the dump never wrote (CRIU then goes on)
            self.bytes = 0
            self._lock = threading.Lock()
            self._thread = threading.Thread(target=self._serve, name="gpusnap-serve", daemon=True)
            self._thread.start()
        except BaseException:
            self.__exit__()  # the fill's workers, the read-ahead thread, the socket: nothing left behind
            raise

    def _plan(self, store: SnapshotStore, manifest: Manifest, arrivals: Arrivals | None, split_min: int) -> None:
        """Everything before the serve socket: the check that no chunk is missing, the process tree,
        the split (the pagemaps read and rewritten), the order a remote sends chunks in."""
        missing = store.missing(manifest) if arrivals is None else []
        if arrivals is not None:
            arrivals.first(read_order(self.images, None))
        if missing:
            raise store.error(f"snapshot {manifest.name!r} is damaged: {len(missing)} chunk(s) missing "
                             f"(first {missing[0][:16]}…); nothing was started")
        self._zeros = bytes(max((c.raw_len for s in self.images.values() for c in s.chunks), default=0))
        self.plans: dict[str, split.Plan] = {}    # page image -> its split
        self._file_hints: list[filehints.Hint] = []  # the mapped files CRIU reads, warmed before the fill reads
        self.file_hints: dict[str, float] | None = None  # what warming them did (filehints.warm_within)
        self._rewritten: dict[str, bytes] = {}    # pagemap image -> what CRIU gets instead
        # the pids CRIU restores, as its pstree image lists them (a snapshot's own list may lack a child
        # forked while CRIU froze the tree: a --leave-running dump, or one made before that was fixed)
        ps = self.images.get("pstree.img")
        if ps is not None and ps.size > split.MAX_PSTREE_BYTES:
            ps = None  # not read: no split, and no pid of it is taken for one CRIU restored (CRIU refuses it itself)
        ps_bytes = b"".join(bytes(self._chunk(ps, i, c)) for i, c in enumerate(ps.chunks)) if ps is not None else b""
        try:
            records, threads = split.pstree_records(ps_bytes), split.pstree_threads(ps_bytes)
        except split.SplitError:
            records, threads = [], {}  # CRIU refuses the image itself
        self.pstree = [pid for pid, _ in records]
        # why the split did not engage (None when it did), for the restore report
        self.split_skipped_because: str | None = "the split is off (GPUSNAP_CRIU_SPLIT_MIN=0)"
        too_large = split.images_too_large({n: s.size for n, s in self.images.items()})
        if split_min > 0 and too_large is not None:
            self.split_skipped_because = too_large
        elif split_min > 0:
            whole = lambda s: b"".join(bytes(self._chunk(s, i, c)) for i, c in enumerate(s.chunks))  # noqa: E731
            pagemaps = {n: whole(s) for n, s in self.images.items() if split.PAGEMAP_NAME.fullmatch(n)}
            served = {f"mm-{m.group(1)}.img" for m in map(split.PAGEMAP_NAME.fullmatch, pagemaps) if m is not None}
            mms = {n: whole(s) for n, s in self.images.items() if n in served}  # each under MAX_MM_BYTES (above)

            def core(name: str) -> bytes | None:  # a thread's registers: where its stack is
                st = self.images.get(name)
                if st is not None and st.size > split.MAX_CORE_BYTES:
                    raise split.SplitError(f"{st.size} bytes, more than the {split.MAX_CORE_BYTES} a real one needs")
                return None if st is None else whole(st)
            stacks, why = split.process_stacks([int(n[3:-4]) for n in served], threads, core)
            self.marks["pagemaps_read"] = time.monotonic()
            if why is not None:
                self.split_skipped_because = why
            else:
                self.plans, self.split_skipped_because = split.choose(
                    pagemaps, {n: s.size for n, s in self.images.items() if is_page_image(n)}, split_min,
                    parents=dict(records), streams={n: s for n, s in self.images.items() if is_page_image(n)},
                    mms=mms, cautious_min=split_shared_min(), stacks=stacks)
            self._rewritten = {f"pagemap-{pl.pid}.img": pl.pagemap for pl in self.plans.values()}
            if self.plans:
                self._file_hints = self._plan_file_hints(mms, whole)
        if arrivals is not None:
            arrivals.first(read_order(self.images, self.plans))

    def _plan_file_hints(self, mms: dict[str, bytes], whole: Callable[[Stream], bytes]) -> list[filehints.Hint]:
        """What CRIU will read of the processes' mapped files (sandbox.criu.filehints), to be warmed
        before the fill's reads queue; none where turned off (a bad setting fails the restore here,
        as every fill setting does), where the snapshot restores a mount namespace or names remapped
        files (its paths are then not the files mapped), or where an image is not understood (a hint)."""
        files = self.images.get("files.img")
        if (not filehints.hints_on() or files is None or files.size > filehints.MAX_FILES_IMG
                or "remap-fpath.img" in self.images or any(n.startswith("mountpoints-") for n in self.images)):
            return []
        t0 = time.perf_counter()
        try:
            by_pid = {pl.pid: pl for pl in self.plans.values()}
            order = [p for p in dict.fromkeys([*self.pstree, *sorted(by_pid)]) if p in by_pid and f"mm-{p}.img" in mms]
            areas = {p: filehints.file_areas(mms[f"mm-{p}.img"]) for p in order}  # the tree's order
            paths = filehints.reg_paths(whole(files), {fid for a in areas.values() for *_, fid in a})
            # the pagemaps CRIU gets (the moved runs left out: far fewer entries than the dump's), one at a time
            return filehints.plan(paths, ((areas[p], split.parse_pagemap(by_pid[p].pagemap)) for p in order))
        except (filehints.FileHintError, split.SplitError):
            return []
        finally:
            self.stages.add("criu-first files:plan", time.perf_counter() - t0, 0)

    def __enter__(self) -> "ServeSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self._listener.close()
        if self._thread is not None:
            self._thread.join()
        for t in self._feeds:
            t.join()
        self._ex.shutdown(wait=True, cancel_futures=True)
        self._open_gate()
        if self._filler is not None:
            self._filler.close()
        if self._criu_first is not None:
            self._criu_first.join()
        self._bufs.close()
        self._outs.close()

    def _serve(self) -> None:
        try:
            conn = self._listener.accept(lambda: self._closing)
            if conn is None:
                return
            self.connected_at = time.monotonic()
            with conn:
                while True:
                    name = read_request(conn)
                    if name is None:
                        break
                    s = self.images.get(name)
                    send_reply(conn, s is not None)
                    if s is None:
                        self.absent.append(name)
                        continue
                    fd = recv_pipe(conn, writable=True)
                    pl = self.plans.get(name)
                    t = threading.Thread(target=self._feed, args=(s, fd, pl.kept if pl else None, self._rewritten.get(name)),
                                         daemon=True, name="gpusnap-serve-feed")
                    self._feeds.append(t)
                    t.start()
        except BaseException as e:  # noqa: BLE001 - reported by raise_if_failed
            self._fail(e)

    def _read_ahead_for_criu(self) -> None:
        """Every chunk CRIU will read (the small images, the kept ranges of the page images) read into
        the page cache before the fill's reads begin. Measured on the H200 (BENCHMARKS.md sections 15
        and 17): with the fill's reads queued first, CRIU's part of a 20 GB restore took 6.8-7.3 s
        instead of 3.3 s (its reads waiting behind gigabytes of the fill's), and with the fill in
        worker processes, 16-32 reads of 16 MiB in flight, 5.4-7.5 s instead of 4.9 s."""
        t0 = time.perf_counter()
        try:
            asked = read_ahead(self.store, criu_reads(self.images, self.plans), gap=FILL_GAP,
                               stop=lambda: self._closing, resident=True)
            self.stages.add("criu-first read", time.perf_counter() - t0, asked)
            if self._file_hints and not self._closing:
                self.file_hints = filehints.warm_within(self._file_hints)
                self.stages.add("criu-first files", self.file_hints["seconds"], int(self.file_hints["bytes"]))
        finally:
            self._criu_asked.set()

    def _make_filler(self) -> "split.Filler | FillProcs":
        """The split fill of the moved runs (sandbox.criu.split): in worker processes, each with a share
        of the chunks in pack order (sandbox.criu.fill_procs), where the host has the cores and the
        fill the bytes; else in this process, its chunks read by _read_moved."""
        avail = available_bytes()
        self.fill_memory = {"held_budget": _bytes_env("GPUSNAP_FILL_HELD", fill_budget(avail)),
                            "prefetch": _bytes_env("GPUSNAP_FILL_PREFETCH", fill_prefetch(avail)),
                            "mem_available": avail}
        jobs = split.fill_jobs(list(self.plans.values()), self.images)
        phases = split.fill_phases(jobs, self.fill_first) if self.fill_first else None
        nphases = len(self.fill_first) + 1  # one per process of fill_first, then the rest
        procs, min_share = fill_procs.procs_for() if self.arrivals is None else (1, 0)
        parts = (fill_procs.shares(jobs, fill_procs.where_in_packs(self.store), procs, min_share, phases)
                 if procs > 1 else [jobs])
        self.fill_memory["procs"] = len(parts)
        self.fill_memory["readers"] = fill_procs.readers()  # a bad setting fails here, before CRIU starts
        self.fill_memory["prefetch_early"] = int(fill_procs.prefetch_early())
        readstage.willneed_step()  # a bad GPUSNAP_WILLNEED_STEP fails here, before CRIU starts
        if self.arrivals is None:  # (a fill from a remote's arrivals reads no disk)
            self.fill_memory["readers_early"] = early = fill_procs.early_readers()  # while CRIU runs
            if len(parts) == 1 and early < self.fill_memory["readers"]:
                self._early_gate = fill_procs.EarlyGate(early)
        if len(parts) > 1:
            return FillProcs(self.store, self.manifest.name, parts, self.workers, self.fill_memory["held_budget"],
                             self.fill_memory["prefetch"], self._criu_asked, self.stages, phases, nphases)
        return split.Filler(jobs, self._read_moved, self.workers, self.fill_memory["held_budget"], self.stages,
                            phases, nphases)

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self.errors.append(e)

    def _chunk(self, s: Stream, i: int, ref: ChunkRef) -> bytes | memoryview:
        return memoryview(self._zeros)[:ref.raw_len] if ref.is_zero else self._fetch(s, i, ref)

    def _fetch(self, s: Stream, i: int, ref: ChunkRef) -> bytes | memoryview:
        """REF's verified, decoded bytes, as an object of their own (planning's reads of the process tree
        and the pagemaps; CRIU's feeds use _fetch_out)."""
        fresh = self._arrived(ref)  # before taking a buffer: the waits hold none
        with self._bufs.borrowed() as buf:
            data = self._decoded(s, i, ref, fresh, buf, None)
            return bytes(data) if isinstance(data, memoryview) else data  # the buffer goes back now

    def _fetch_out(self, s: Stream, i: int, ref: ChunkRef, asked: float | None = None) -> tuple[AlignedBuffer, memoryview]:
        """REF's verified, decoded bytes in a buffer of the feeds' Recycler (give it back once written);
        ASKED: when a feed submitted it (time.perf_counter()), for the stage "feed:queued" (the wait for
        a free thread of the pool)."""
        if asked is not None:
            self.stages.add("feed:queued", time.perf_counter() - asked, 0)
        fresh = self._arrived(ref)  # before taking a buffer: the waits hold none
        out = self._outs.take()
        try:
            view = out.view[:ref.raw_len]
            with self._bufs.borrowed() as buf:
                data = self._decoded(s, i, ref, fresh, buf, view)
                if len(data) and address_of(data) != address_of(view):
                    copy_into(view, data)  # a `raw` payload, where it was read: copied before its buffer goes back
                return out, view[:len(data)]
        except BaseException:
            self._outs.give(out)
            raise

    def _read_moved(self, wants: list[Want], deliver: Callable[[Want, memoryview], None],
                    stop: Callable[[], bool]) -> None:
        """The split fill's reads (split.ReadAll): from the store, the read stage in pack order (the
        moved runs are most of the image, so its packs are read nearly whole, in large reads, with
        the kernel reading ahead while CRIU runs); from a remote's arrivals, each chunk as it arrives."""
        if self.arrivals is None:
            if self._criu_first is not None:
                self._criu_first.join()  # CRIU's reads are queued: now the fill's
            read_moved(self.store, self.store.error, self.manifest.name, wants, deliver, stop, stages=self.stages, decoders=self.workers,
                       readers=fill_procs.readers(), prefetch=self.fill_memory["prefetch"],
                       prefetch_from=None if self.fill_memory.get("prefetch_early") else self._criu_done,
                       gate=self._early_gate.held if self._early_gate is not None else None)
            return
        size = self._bufs.size
        most = max((w.ref.raw_len for w in wants), default=1)
        where = {c.id: (name, i) for name, st in self.images.items() for i, c in enumerate(st.chunks)
                 if c.id is not None}  # for the messages: which image, which chunk
        with BufferPool(self.workers, size) as files, BufferPool(self.workers, most) as outs:

            def one(w: Want) -> None:
                if stop():
                    return
                image, i = where[w.ref.id or ""]
                fresh = self._arrived(w.ref)
                with files.borrowed() as f, outs.borrowed() as o:
                    deliver(w, memoryview(self._decoded(self.images[image], i, w.ref, fresh, f, o.view)))

            with ThreadPoolExecutor(self.workers, thread_name_prefix="gpusnap-fill-arrivals") as ex:
                for _ in ex.map(one, wants):
                    pass

    def _arrived(self, ref: ChunkRef) -> tuple[str, bytes] | None:
        """On a restore --from a remote: (codec, payload) of REF once it has arrived, if the fill
        hands it over (verified on arrival: no read, no second check); None: read it from the store."""
        if self.arrivals is None:
            return None
        assert ref.id is not None
        self.arrivals.wait(ref.id)
        return self.arrivals.take(ref.id)

    def _decoded(self, s: Stream, i: int, ref: ChunkRef, fresh: tuple[str, bytes] | None, buf: Any,
                 out: memoryview | None) -> bytes | memoryview:
        """REF's raw bytes: FRESH decoded, or read from the store into BUF and decoded with the full
        check (the bytes bound to REF's id); into OUT when given (nothing allocated)."""
        t0 = time.perf_counter()
        try:
            if fresh is not None:
                codec, payload = fresh
                data = (decode_host(codec, memoryview(payload), ref.raw_len) if out is None
                        else decode_host_into(codec, memoryview(payload), ref.raw_len, out))
            else:
                data = self.store.read_raw(ref, buf, out, cached=True)
        except ChunkError as e:
            raise self.store.error(f"snapshot {self.manifest.name!r} is damaged: {s.name} chunk {i}: {e.what}") from None
        except CodecError as e:
            raise StoreError(f"snapshot {self.manifest.name!r}: {s.name} chunk {i}: {e}") from None
        self.stages.add("read+decode+verify", time.perf_counter() - t0, ref.raw_len)
        return data

    def _feed(self, s: Stream, fd: int, ranges: tuple[tuple[int, int], ...] | None = None,
              replacement: bytes | None = None) -> None:
        """Stream S (only its RANGES; or REPLACEMENT instead) into CRIU's pipe FD, chunks fetched a window
        ahead. The window counts chunks, not pieces: a split page image leaves CRIU many small ranges,
        several in one chunk, and a window of pieces then held one chunk in flight, CRIU waiting on each."""
        Got = tuple[AlignedBuffer, memoryview]
        pending: deque[tuple[Future[Got] | None, int, int]] = deque()
        uses: dict[Future[Got], int] = {}  # a chunk's pieces still to write: its buffer goes back after the last
        it = iter(split.pieces(s, ranges) if replacement is None else ())
        last: tuple[int, Future[Got] | None] | None = None
        try:
            if replacement is not None:
                write_all(fd, replacement)
                self.bytes += len(replacement)
            while True:
                while len(uses) < self.window and len(pending) < 64 * self.window:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    i, ref, lo, hi = nxt
                    if last is not None and last[0] == i:
                        fut = last[1]  # the same chunk again: fetched once
                    else:
                        fut = None if ref.is_zero else self._ex.submit(self._fetch_out, s, i, ref, time.perf_counter())
                        last = (i, fut)
                    if fut is not None:
                        uses[fut] = uses.get(fut, 0) + 1
                    pending.append((fut, lo, hi))
                if not pending:
                    break
                fut, lo, hi = pending.popleft()
                if fut is None:
                    write_all(fd, memoryview(self._zeros)[lo:hi])
                else:
                    t0 = time.perf_counter()
                    out, view = fut.result()
                    t1 = time.perf_counter()
                    self.stages.add("feed:wait", t1 - t0, 0)  # CRIU's next bytes not decoded yet
                    write_all(fd, view[lo:hi])
                    self.stages.add("feed:write", time.perf_counter() - t1, hi - lo)  # CRIU not reading yet
                    uses[fut] -= 1
                    if not uses[fut]:
                        del uses[fut]
                        self._outs.give(out)
                self.bytes += hi - lo
            self.served.append(s.name)
        except BaseException as e:  # noqa: BLE001 - CRIU sees the broken pipe; reported by raise_if_failed
            for f in uses:
                if not f.cancel():  # done or running: its buffer back once it has one
                    f.add_done_callback(self._give_back)
            self._fail(e if not isinstance(e, OSError) else
                       StreamerError(f"writing image {s.name} to CRIU: {e.strerror}"))
        finally:
            os.close(fd)

    @property
    def feed_buffers(self) -> int:
        """Buffers the feeds decoded into (the peak in flight at once; reused after that)."""
        return self._outs.mapped

    def _give_back(self, fut: "Future[tuple[AlignedBuffer, memoryview]]") -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._outs.give(fut.result()[0])

    def fill(self, pids_ok: Callable[[int], bool], filled: Callable[[int], None] | None = None) -> dict[str, int]:
        """After CRIU: the moved runs written into the (stopped) processes; PIDS_OK(pid) says a
        planned pid is one CRIU restored. FILLED(pid) is called for each pid of fill_first, in that
        order, as soon as its moved runs are all written (from a fill thread), before the fill ends."""
        first = self.fill_first

        def on_phase(p: int) -> None:
            if filled is not None and p < len(first):
                filled(first[p])

        if self._filler is None:
            for p in range(len(first)):
                on_phase(p)
            return {"written": 0, "zero_skipped": 0}
        self._criu_done.set()  # the disk is the fill's alone now: the kernel may read ahead for it
        self._open_gate()  # and every reader may read
        return self._filler.write(pids_ok, on_phase)

    def _open_gate(self) -> None:
        if self._early_gate is not None:
            self._early_gate.open()

    def stop_fill(self) -> None:
        """The fill stopped now, its workers gone and no write of it in flight (before the tree is killed)."""
        self._open_gate()  # no reader stays held at the gate
        if self._filler is not None:
            self._filler.close()

    def helper_pids(self) -> set[int]:
        """The processes this source started (the fill's workers): not the tree's."""
        return {p.pid for p in getattr(self._filler, "procs", [])}

    def raise_if_failed(self) -> None:
        """The first failure of the store side (a damaged chunk, a remote that failed) before a broken pipe."""
        errs = [e for e in self.errors if isinstance(e, GpusnapError) and not isinstance(e, StreamerError)] \
            or self.errors
        if errs:
            e = errs[0]
            raise e if isinstance(e, GpusnapError) else StreamerError(f"serving images to CRIU: {e}")


def fill_budget(avail: int) -> int:
    """Bytes of buffers the split fill may hold decoded before CRIU has made the processes, of AVAIL
    bytes of memory available now: a quarter, at most 16 GiB, at least 256 MiB. Once CRIU is done the
    fill is bound by the CPU (decoding, hashing, writing into the processes), so what is decoded while
    CRIU runs is time saved; 2 GiB (the earlier cap) held only 1.2 GB of a 38 GB MoE restore's 42 GB."""
    return max(256 << 20, min(16 << 30, avail // 4))


def fill_prefetch(avail: int) -> int:
    """Bytes of the store the split fill asks the kernel to read ahead into the page cache (reclaimable),
    of AVAIL bytes of memory available now: half, at most 16 GiB. It starts once CRIU is done: then
    the fill's 16 decoding threads keep every core busy and the kernel's read-ahead keeps the disk
    reading while the read stage's own threads wait for the GIL. Not before: measured on the H200
    (38 GB MoE-like tree), read-ahead while CRIU ran made CRIU's part take 5.9-12.7 s instead of 4.4 s."""
    return min(16 << 30, avail // 2)


def _bytes_env(name: str, default: int) -> int:
    """$NAME as a number of bytes (unset or empty: DEFAULT): the split fill's memory, for a host
    that must keep it smaller, and for measuring."""
    n: int = setting(name, default, int, lambda n: n >= 0, "a number of bytes", StreamerError)
    return n


def fill_criu_first() -> bool:
    """Whether what CRIU reads is asked of the disk before the fill's reads (default yes;
    $GPUSNAP_FILL_CRIU_FIRST=0 turns it off, for measuring)."""
    return os.environ.get("GPUSNAP_FILL_CRIU_FIRST", "1").strip() != "0"


def early_reads_mode() -> str:
    """$GPUSNAP_EARLY_READS: "child" (the default: EarlyReads' reads are a child process's, started once
    the manifest is loaded), "late" (the same, started only when the serve side plans, as it was
    before the restore started them at the load), "thread" (a thread of this process reads them) or
    "0" (none); all but the default for measuring."""
    v = os.environ.get("GPUSNAP_EARLY_READS", "child").strip()
    return v if v in ("0", "thread", "late") else "child"


def early_reads_on() -> bool:
    """Whether the disk reads the page images while a restore plans (EarlyReads; default yes;
    $GPUSNAP_EARLY_READS=0 turns it off, for measuring)."""
    return early_reads_mode() != "0"


def split_min() -> int:
    """$GPUSNAP_CRIU_SPLIT_MIN: page runs of at least this many bytes are filled by gpusnap after
    CRIU (0: off); default split.DEFAULT_MIN."""
    n: int = setting("GPUSNAP_CRIU_SPLIT_MIN", split.DEFAULT_MIN, int, lambda n: True, "a number of bytes",
                     StreamerError)
    return n


def split_shared_min() -> int:
    """$GPUSNAP_CRIU_SPLIT_SHARED_MIN: the size from which runs a parent and its child may share (pages
    at addresses both have pages at) and runs in read-only areas are filled by gpusnap too (0: never);
    default split.CAUTIOUS_MIN."""
    n: int = setting("GPUSNAP_CRIU_SPLIT_SHARED_MIN", split.CAUTIOUS_MIN, int, lambda n: n >= 0,
                     "a number of bytes, 0 or more", StreamerError)
    return n


if TYPE_CHECKING:  # the remote fill is the Arrivals a restore --from a remote passes: checked here, not at run time
    from storage.api import RemoteFill

    _ARRIVALS_OF_A_REMOTE: type[Arrivals] = RemoteFill
