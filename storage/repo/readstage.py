"""Reading as its own stage: large reads kept in flight in restore order, decoding and checking in another pool.

A reader thread takes the next run of wanted chunks (adjacent entries of one pack, coalesced into one
read of at most RUN_MAX bytes) and reads it into a run buffer; each entry of the run is then handed
to the decode pool, which makes the full check (or the stored check) and gives the verified bytes
to the caller; a run buffer is reused once all its entries are done, which bounds memory and keeps
the readers at most a few runs ahead of the decoders. Chunks that are not in a pack (version 1/2
chunk files), entries larger than a run buffer, and entries that fail their check in a run (another
copy may be sound) are read one at a time through the store (SnapshotStore.first_sound: the first
copy that passes the check).

Guarantees kept here: no byte reaches the caller before its check (chunkfile.full_check binds raw
bytes to the id, a delta's against its base as the store reads it, SnapshotStore.delta_base; the
stored check binds stored bytes); a run never reads past the entries the
validated index names, and never more than a run buffer; the first failure stops the stage and is
raised to the caller.
"""
from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, TypeVar

from storage.format.chunkfile import HEADER_SIZE, ChunkError, ChunkHeader, full_check, id_check, max_stored_len, stored_check
from storage.fs.directio import ALIGN, BufferPool, align_up, read_into, read_into_direct
from storage.format.manifest import ChunkRef
from storage.base.errors import GpusnapError
from storage.format.packs import Loc, coalesce, open_pack, parse_entry

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from storage.codecs.delta import BaseReader

    from storage.fs.directio import AlignedBuffer


_T = TypeVar("_T")


class PackSource(Protocol):
    """What the read stage needs of a store (storage.repo.store.SnapshotStore has it): where a chunk's pack
    entries are, one chunk read through every copy it has, the largest buffer a snapshot's chunk
    needs, and its packs/ directory as a checked descriptor."""

    def locate(self, cid: str, refresh: bool = False) -> list[Loc]: ...

    def first_sound(self, ref: ChunkRef, buf: "AlignedBuffer", accept: Callable[[ChunkHeader, memoryview], _T],
                    check: bool = True, cached: bool = False) -> _T: ...

    def chunk_buffer_size(self, manifests: list[Any]) -> int: ...

    def subdir(self, name: str) -> "AbstractContextManager[int]": ...

    def delta_base(self, bid: str, most: int) -> "bytes | memoryview": ...

RUN_MAX = 16 << 20    # bytes one read covers at most
READERS = 4           # reads in flight


class StageTimes(Protocol):
    def add(self, stage: str, seconds: float, nbytes: int) -> None: ...


@dataclass(frozen=True)
class Want:
    """One chunk to read: KEY is the caller's (where its bytes go), REF the manifest's reference."""

    key: Any
    ref: ChunkRef
    group: int = 0  # ORDER "pack": the wants of a lower group are read first (each group in pack order)


def read_chunks(store: PackSource, wants: list[Want], deliver: Callable[[Want, Any], None], *,
                stages: StageTimes, decoders: int, check: str = "full", readers: int = READERS,
                stop: Callable[[], bool] = lambda: False,
                on_damage: Callable[[Want, ChunkError], None] | None = None,
                order: str = "given", gap: int = 0, prefetch: int = 0,
                prefetch_from: threading.Event | None = None, direct: bool = False,
                gate: "Callable[[], AbstractContextManager[Any]] | None" = None) -> None:
    """Read every chunk of WANTS (in their order, coalescing adjacent pack entries) and call
    DELIVER(want, data) from a decode thread once it is checked: CHECK "full", the raw bytes after the
    full check; "id", the stored payload after chunkfile.id_check (verify --read-data: GSNPCHK2
    decoded, GSNPCHK1 bound by its stored bytes, whatever the codec); "stored", the stored payload
    after the stored check (verify). DELIVER must be done with DATA
    when it returns (the buffer is reused). STOP: checked between chunks; when it says so, nothing
    more is read. The first error is raised (a ChunkError names the damaged chunk), unless ON_DAMAGE
    is given: it is then called for each damaged chunk (an OSError reading it counts as damage too)
    and the others are read on (verify). ORDER "given": runs in the order of WANTS; "pack": in
    pack and offset order (the order the disk reads best, for a caller that needs every chunk
    before it goes on: the split fill), with runs bridging GAP unwanted bytes between entries, the
    wants of a lower Want.group before those of a higher one (the split fill completes one process
    before the next).
    PREFETCH: a thread asks the kernel to read the runs ahead into the page cache
    (POSIX_FADV_WILLNEED), at most this many bytes past what the readers have taken, so the disk
    stays busy while DELIVER is held up (the split fill before CRIU has made the processes); the
    cache it fills is the kernel's to reclaim. PREFETCH_FROM: the prefetch starts only once this is
    set (the split fill sets it when CRIU is done: measured on the H200, read-ahead while CRIU ran
    made CRIU's part of a 38 GB restore take 5.9-12.7 s instead of 4.4 s). DIRECT: the runs read
    with O_DIRECT (from the aligned block before each, into aligned buffers), past the page cache:
    one copy less for a reader that reads each byte once (get, verify); never for a restore, whose
    reads the read-ahead has put in the page cache. GATE: entered around each run's read (the split
    fill's workers share a machine-wide count of reads in flight through it: sandbox/criu/fill_procs.py);
    its waits are stage "read:wait-gate"."""
    if not wants:
        return
    buf_size = max(RUN_MAX, store.chunk_buffer_size([]))
    most = max(_most(w.ref) for w in wants)
    planned: list[tuple[int, Loc]] = []
    singles: list[int] = []
    for i, w in enumerate(wants):
        locs = store.locate(w.ref.id or "")
        if locs and locs[0].length <= min(buf_size, most):
            planned.append((i, locs[0]))
        else:
            singles.append(i)
    if order == "pack":
        planned.sort(key=lambda p: (wants[p[0]].group, p[1].pack, p[1].offset))
    runs: list[list[tuple[int, Loc]]] = []
    for _, same in itertools.groupby(planned, key=lambda p: wants[p[0]].group):  # no run spans two groups
        runs += coalesce(list(same), gap=gap, most=buf_size)
    if order != "pack":
        runs.sort(key=lambda r: r[0][0])  # restore order, by each run's first chunk
    runs += [[(i, Loc("", 0, 0))] for i in singles]
    if order == "pack" and any(w.group for w in wants):
        runs.sort(key=lambda r: wants[r[0][0]].group)  # stable: pack order within a group, its singles last
    error: list[BaseException] = []
    elock = threading.Lock()

    def failed(e: BaseException) -> None:
        with elock:
            if not error:
                error.append(e)

    def halted() -> bool:
        return bool(error) or stop()

    run_iter: Iterator[list[tuple[int, Loc]]] = iter(runs)
    it_lock = threading.Lock()
    taken = [0]  # bytes of runs the readers have taken (the prefetch stays at most PREFETCH past it)
    taken_cond = threading.Condition(it_lock)
    finished = [False]
    nbuf = readers + max(2, decoders)
    raw_most = max(w.ref.raw_len for w in wants) if check == "full" else 0
    with BufferPool(nbuf, buf_size + (2 * ALIGN if direct else 0)) as pool, \
            BufferPool(decoders, max(most, 4096)) as single_pool, \
            BufferPool(decoders if raw_most else 0, max(raw_most, 4096)) as outs, \
            ThreadPoolExecutor(decoders, thread_name_prefix="gpusnap-decode") as dec:

        stage = "decompress+verify" if check == "full" else "verify"

        def verified(header: ChunkHeader, payload: memoryview, cid: str, w: Want, o: Any) -> Any:
            """The check of CHECK (timed): W's bytes, decoded into O (one of OUTS: nothing is allocated
            per chunk) by a full check; ChunkError when this copy is damaged."""
            t0 = time.perf_counter()
            data = (_checked(check, header, payload, cid, store.delta_base) if o is None
                    else full_check(header, payload, cid, o.view, base=store.delta_base))
            stages.add(stage, time.perf_counter() - t0, w.ref.raw_len)
            return data

        def delivered(w: Want, data: Any) -> None:
            t0 = time.perf_counter()
            deliver(w, data)
            stages.add("deliver", time.perf_counter() - t0, w.ref.raw_len)

        def checked(header: ChunkHeader, payload: memoryview, cid: str, w: Want) -> None:
            """The check of CHECK, then DELIVER (each timed)."""
            with outs.borrowed() if raw_most else _nothing() as o:
                delivered(w, verified(header, payload, cid, w, o))

        def decode(i: int, view: Any, done: Callable[[], None]) -> None:
            try:
                if halted():
                    return
                w = wants[i]
                cid = w.ref.id or ""
                try:
                    header, payload = parse_entry(view, cid)
                    if not header.fits(w.ref.codec, w.ref.raw_len, w.ref.stored_len):
                        raise ChunkError(cid, "header disagrees with the manifest's reference")
                    checked(header, payload, cid, w)
                except ChunkError as e:
                    if e.chunk_id != cid:
                        raise  # not this entry's damage (a caller's own error)
                    single(i)  # another copy may be sound; if none is, that read raises
                    return
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                failed(e)
            finally:
                done()

        def single(i: int) -> None:
            w = wants[i]
            if on_damage is None:
                return single_read(w)
            try:
                single_read(w)
            except ChunkError as e:
                on_damage(w, e)
            except OSError as e:
                on_damage(w, ChunkError(w.ref.id or "", f"unreadable: {e.strerror or e}"))

        def single_read(w: Want) -> None:
            """W's chunk read on its own: the first copy of it that passes CHECK (store.first_sound:
            a damaged or planted copy never hides a sound one), then DELIVER."""
            cid = w.ref.id or ""
            with single_pool.borrowed() as buf, outs.borrowed() if raw_most else _nothing() as o:
                began = [time.perf_counter()]  # of this copy's read

                def check_copy(header: ChunkHeader, payload: memoryview) -> Any:
                    stages.add("read", time.perf_counter() - began[0], header.stored_len)
                    try:
                        return verified(header, payload, cid, w, o)
                    finally:
                        began[0] = time.perf_counter()

                delivered(w, store.first_sound(w.ref, buf, check_copy, check=False, cached=True))

        @contextmanager
        def gated() -> Iterator[None]:
            assert gate is not None  # only entered where GATE is given
            t0 = time.perf_counter()
            with gate():
                stages.add("read:wait-gate", time.perf_counter() - t0, 0)
                yield

        warm = getattr(store, "open_warm", None)  # SnapshotStore.open_warm: None unless a restore opted in

        def reader() -> None:
            while not halted():
                with it_lock:
                    run = next(run_iter, None)
                    if run is not None:
                        taken[0] += _span(run)
                        taken_cond.notify_all()
                if run is None:
                    return
                if not run[0][1].pack:
                    try:
                        single(run[0][0])
                    except BaseException as e:  # noqa: BLE001
                        failed(e)
                    continue
                buf = pool.acquire()
                first, last = run[0][1], run[-1][1]
                length = last.offset + last.length - first.offset
                base = first.offset % ALIGN if direct else 0  # the run's first byte in BUF
                try:
                    with gated() if gate is not None else _nothing():
                        if halted():  # the stage failed while this reader waited at the gate: no more reads
                            pool.release(buf)
                            return
                        t0 = time.perf_counter()
                        fd = warm(first.pack) if warm is not None else None  # the warm tier's copy (a cache)
                        from_warm = fd is not None
                        if fd is None:
                            with store.subdir("packs") as packs:
                                fd = open_pack(packs, first.pack, wants[run[0][0]].ref.id or "", direct=direct)
                        try:
                            n = align_up(base + length, ALIGN) if direct else length
                            got = max(0, (read_into_direct if direct else read_into)(fd, buf.view[:n], first.offset - base)
                                      - base)
                        finally:
                            os.close(fd)
                        stages.add("read:warm" if from_warm else "read", time.perf_counter() - t0, got)
                except BaseException as e:  # noqa: BLE001
                    pool.release(buf)
                    if isinstance(e, ChunkError):
                        for i, _ in run:  # the pack is unusable here: each chunk on its own
                            try:
                                single(i)
                            except BaseException as e2:  # noqa: BLE001
                                failed(e2)
                                return
                        continue
                    failed(e)
                    return
                # bound now (default arguments), not looked up when called: the next run rebinds these names
                def done(b: Any = buf, left: list[int] = [len(run)], llock: threading.Lock = threading.Lock()) -> None:
                    with llock:
                        left[0] -= 1
                        last_one = left[0] == 0
                    if last_one:
                        pool.release(b)  # every entry of the run delivered: only now may it be reused

                for i, loc in run:
                    start = loc.offset - first.offset
                    end = start + loc.length
                    if end > got:  # cut short: that entry (and the rest) read on their own
                        dec.submit(_short, single, i, failed, done)
                    else:
                        dec.submit(decode, i, buf.view[base + start:base + end], done)

        def ahead() -> None:
            """WILLNEED for the runs in order, never more than PREFETCH bytes past the readers."""
            while prefetch_from is not None and not prefetch_from.wait(0.05):
                if halted() or finished[0]:
                    return
            issued = 0
            with _PackFds(store) as fds:
                for run in runs:
                    if not run[0][1].pack:
                        continue
                    with it_lock:
                        taken_cond.wait_for(lambda: halted() or finished[0] or issued - taken[0] < prefetch)
                        if halted() or finished[0]:
                            return
                    _advise(fds, run, halted)  # only a hint: the reader meets (and reports) what is wrong
                    issued += _span(run)

        pre = threading.Thread(target=ahead, name="gpusnap-prefetch", daemon=True) if prefetch > 0 else None
        if pre is not None:
            pre.start()
        try:
            with ThreadPoolExecutor(readers, thread_name_prefix="gpusnap-read") as rx:
                for f in [rx.submit(reader) for _ in range(readers)]:
                    f.result()
        finally:
            if pre is not None:
                with it_lock:
                    finished[0] = True  # every run read (or the stage failed): the prefetch stops
                    taken_cond.notify_all()
                pre.join()
        dec.shutdown(wait=True)
    if error:
        raise error[0]


Run = list[tuple[int, Loc]]  # adjacent pack entries of one pack (index in the refs, where): one read


def plan_runs(store: PackSource, refs: list[ChunkRef], gap: int = 0,
              stop: Callable[[], bool] = lambda: False) -> list[Run] | None:
    """REFS' pack entries (the first copy of each) in the order given, adjacent entries of a pack
    (bridging GAP bytes) grouped into runs of at most RUN_MAX bytes; None when STOP() said so while
    they were found (a manifest of a million refs must not hold up the stop)."""
    planned = []
    for i, ref in enumerate(refs):
        if i % 1024 == 1023 and stop():
            return None
        if ref.is_zero or ref.id is None:
            continue
        locs = store.locate(ref.id)
        if locs:
            planned.append((i, locs[0]))
    return coalesce(planned, gap=gap, most=RUN_MAX)


def read_ahead(store: PackSource, refs: list[ChunkRef], gap: int = 0,
               stop: Callable[[], bool] = lambda: False, resident: bool = False, advise: bool = True,
               step: int = 1 << 20) -> int:
    """Ask the kernel to read REFS' pack entries into the page cache (POSIX_FADV_WILLNEED), in the
    order given, adjacent entries (bridging GAP bytes) in one request; returns the bytes asked for.
    RESIDENT: then read them through the page cache too (reads of STEP bytes), so they are there
    when this returns. ADVISE=False (with RESIDENT): only those reads, no WILLNEED first: each read
    releases the GIL for as long as the disk takes, where a WILLNEED queues 128 KiB and comes back
    for it, so a thread beside pure-Python work (a restore's planning) keeps the disk busy.
    Used to put what CRIU will read in memory before the split fill's reads begin (their 16 MiB
    reads, many in flight, would otherwise queue ahead of CRIU's): a hint only (the reads that
    follow check every byte), so failures are ignored."""
    runs = plan_runs(store, refs, gap, stop)
    return 0 if runs is None else read_runs(store, runs, stop, resident, advise, step)


def read_runs(store: PackSource, runs: list[Run], stop: Callable[[], bool] = lambda: False,
              resident: bool = False, advise: bool = True, step: int = 1 << 20) -> int:
    """read_ahead of runs already planned (plan_runs)."""
    asked = 0
    with _PackFds(store) as fds:  # each pack opened once: a restore's runs are small and scattered
        if advise or not resident:
            for run in runs:
                if stop():
                    break
                if _advise(fds, run, stop):
                    asked += _span(run)
        if resident:
            scratch = bytearray(step)
            for run in runs:
                if stop():
                    break
                if _touch(fds, run, scratch, stop) and not advise:
                    asked += _span(run)
    return asked


def open_pack_quietly(store: PackSource, pack: str) -> int | None:
    """PACK opened as every pack open is checked; None when it cannot be (for read-aheads, which are
    hints: the reads that follow meet and report it). The warm tier's copy where a restore reads from it
    (a read-ahead of memory costs nothing, and it is what the reads that follow read)."""
    warm = getattr(store, "open_warm", None)
    try:
        fd = warm(pack) if warm is not None else None
        if fd is not None:
            return int(fd)
        with store.subdir("packs") as packs:
            return open_pack(packs, pack, "")
    except (OSError, ChunkError, GpusnapError):
        return None


class _PackFds:
    """The packs a read-ahead (read_ahead, read_chunks' prefetch) asks for, each opened (checked, as
    every pack open is) once and closed at the end: per run, an open and a close cost as many GIL handoffs as the read itself, and a restore's
    runs in CRIU's order are a chunk or two each (~1.4 MB on the H200), so beside a restore's planning
    the thread spent most of its time waiting for the GIL between small steps. None for a pack that
    cannot be opened (a hint: the reads that follow meet and report it)."""

    MOST = 32  # open at once at most (the least recently used closed first): a store may hold thousands

    def __init__(self, store: PackSource) -> None:
        self._store = store
        self._fds: collections.OrderedDict[str, int | None] = collections.OrderedDict()

    def __enter__(self) -> "_PackFds":
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()

    def get(self, pack: str) -> int | None:
        if pack in self._fds:
            self._fds.move_to_end(pack)
            return self._fds[pack]
        fd = self._fds[pack] = open_pack_quietly(self._store, pack)
        while len(self._fds) > self.MOST:
            old = self._fds.popitem(last=False)[1]
            if old is not None:
                os.close(old)
        return fd


def _touch(fds: _PackFds, run: list[tuple[int, Loc]], scratch: bytearray, stop: Callable[[], bool]) -> bool:
    """RUN's bytes read (and dropped) through the page cache: they are resident when this returns
    (True: read to the end). A hint only, like _advise: failures are for the reads that follow to meet."""
    first = run[0][1]
    fd = fds.get(first.pack)
    if fd is None:
        return False
    try:
        off, end = first.offset, first.offset + _span(run)
        while off < end and not stop():
            n = os.preadv(fd, [memoryview(scratch)[:min(len(scratch), end - off)]], off)
            if n <= 0:
                break
            off += n
        return off >= end
    except OSError:
        return False


def _advise(fds: _PackFds, run: list[tuple[int, Loc]], stop: Callable[[], bool]) -> bool:
    """WILLNEED over the bytes one read of RUN covers (see willneed); False when its pack could not
    be opened or advised (a hint only: the reads that follow meet and report what is wrong)."""
    first = run[0][1]
    fd = fds.get(first.pack)
    if fd is None:
        return False
    try:
        willneed(fd, first.offset, _span(run), stop)
    except OSError:
        return False
    return True


WILLNEED_STEP = 128 << 10  # bytes one POSIX_FADV_WILLNEED asks for (see willneed)
_step: list[int] = []      # willneed_step(), read once per process


def willneed_step() -> int:
    """$GPUSNAP_WILLNEED_STEP (bytes, 4 KiB to 64 MiB), else WILLNEED_STEP: for measuring (1 and 4 MiB
    steps filled no faster than 128 KiB on an H100 whose read_ahead_kb is 8192: BENCHMARKS.md section
    37); a bad value is refused (SettingError) where a restore checks its settings."""
    if not _step:
        from storage.base.settings import SettingError, setting
        _step.append(int(setting("GPUSNAP_WILLNEED_STEP", WILLNEED_STEP, int, lambda n: 4096 <= n <= 64 << 20,
                                 "bytes, from 4096 to 67108864", SettingError)))
    return _step[0]


def willneed(fd: int, offset: int, length: int, stop: Callable[[], bool] = lambda: False) -> None:
    """POSIX_FADV_WILLNEED over LENGTH bytes of FD from OFFSET, in steps of WILLNEED_STEP: Linux reads
    at most the device's read-ahead size (read_ahead_kb, or its largest request if larger) per call
    and silently drops the rest of a larger range; 128 KiB is the smallest default. Each call returns
    once its reads are queued (it waits when the device's queue is full), so the order of the calls
    is the order the disk serves them."""
    end = offset + length
    try:
        step = willneed_step()
    except GpusnapError:  # refused where the restore checks its settings; a hint here
        step = WILLNEED_STEP
    while offset < end and not stop():
        n = min(step, end - offset)
        os.posix_fadvise(fd, offset, n, os.POSIX_FADV_WILLNEED)
        offset += n


def _span(run: list[tuple[int, Loc]]) -> int:
    """Bytes one read of RUN covers."""
    return run[-1][1].offset + run[-1][1].length - run[0][1].offset


def _checked(check: str, header: ChunkHeader, payload: memoryview, cid: str, base: "BaseReader") -> Any:
    if check == "full":
        return full_check(header, payload, cid, base=base)
    if check == "id":
        id_check(header, payload, cid, base=base)
    else:
        stored_check(header, payload, cid)
    return payload


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


def _short(single: Callable[[int], None], i: int, failed: Callable[[BaseException], None],
           done: Callable[[], None]) -> None:
    try:
        single(i)
    except BaseException as e:  # noqa: BLE001
        failed(e)
    finally:
        done()


def _most(ref: ChunkRef) -> int:
    return HEADER_SIZE + align_up(max(max_stored_len(ref.codec, ref.raw_len, ref.stored_len), 1))
