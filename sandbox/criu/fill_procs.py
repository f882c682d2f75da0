"""The split fill spread over worker processes: each reads, verifies, decodes and writes its share of the moved runs.

Why processes: a fill of a weights-dominated tree is CPU work per chunk (decode, hash, write into the
process) done by threads that each take the GIL between those calls; on the H200 (16 cores) one
process kept only 4-5 cores busy while neither the disk nor the CPU was at its limit (BENCHMARKS.md
section 17). Each worker is this module run by this interpreter in isolated mode (worker_argv),
a process of its own with its own GIL, running the same split.Filler over its share: the chunks in
pack order, cut into PROCS contiguous ranges of about equal stored bytes (so each worker reads its
packs sequentially), each with where its pack entries are (the parent's index).

Protocol (JSON lines): the parent writes the job on the worker's stdin (the store's path, the
worker's chunks with every place their bytes go, its memory budget and read-ahead), then, once CRIU
has made the processes and the parent has checked every pid, the line "go {PID: [IDENTITY], ...}"
(each pid's start time and program layout as checked: the worker opens each process's memory and
binds it to that process, split.pin_memory, before it writes a byte); the worker reads and
holds decoded chunks from the moment it has the job, writes after "go", says {"phase": P} once it
has written its part of phases 0..P (each chunk carries its phase: split.fill_phases; every worker
has its part of every phase, so all complete phase 0 first), and answers one last line on stdout:
{"written": N, "stages": {...}} or {"error": TEXT, "damage": true|false}.

Reads in flight: GPUSNAP_FILL_READERS in all (default FILL_READERS). Where that is fewer than the workers,
they share it through a pipe the parent fills with one byte per read (ReadTokens, its two ends
inherited by every worker and named in the job): a worker's reader takes a byte before each pack
read and puts it back after, so the fill can decode in more processes than it keeps reads queued on
the disk (more reads slow CRIU's own part of the restore: BENCHMARKS.md sections 17 and 27).

Guarantees kept here: a worker writes only the targets the parent computed from the snapshot's
validated page maps, only after the parent has checked each pid is one this restore made (split.Filler
checks nothing again, it is told every pid is fine); every byte is checked against its chunk id
before it is written (the store's full check, as in one process); a worker imports nothing from
the working directory or PYTHON* variables; it dies with the parent (PR_SET_PDEATHSIG, and at the
end of its stdin), and a worker that dies or fails fails the fill at once: the parent kills the
other workers and the tree (as for any fill failure), nothing runs half-restored; every failure is
one line, a damaged chunk reported as damage (exit 3 at the CLI), as in one process.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import IO, TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from storage.api import isolated

from storage.api import settings
from storage.api import ChunkError, ChunkHeader
from storage.api import CodecError
from storage.api import DamageError, GpusnapError
from storage.api import ChunkRef
from storage.api import Loc
from storage.api import Stages
from storage.api import READERS, PackSource, Want, read_chunks
from storage.api import SnapshotStore, StoreError

from sandbox.criu.split import Filler, Job, Key, SplitError, check_pids

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from storage.api import AlignedBuffer

MIN_SHARE = 256 << 20  # a worker process is worth its start-up only for this many stored bytes
FILL_GAP = 1 << 20     # the split fill's reads bridge this many unwanted bytes of a pack


def read_moved(store: PackSource, damaged: Callable[[str], Exception], name: str, wants: list[Want],
               deliver: Callable[[Want, memoryview], None], stop: Callable[[], bool], *, stages: Stages,
               decoders: int, readers: int, prefetch: int, prefetch_from: threading.Event | None,
               gate: "Callable[[], Any] | None" = None) -> None:
    """The split fill's reads of WANTS from STORE (snapshot NAME, for messages), in one process or in a
    worker: the read stage in pack order (the moved runs are most of the image, so its packs are read
    nearly whole, in large reads), the kernel reading ahead once PREFETCH_FROM is set (CRIU done); a
    damaged chunk raised as DAMAGED (the store's damage error) of the snapshot."""
    try:
        read_chunks(store, wants, deliver, stages=stages, decoders=decoders, readers=readers, stop=stop,
                    order="pack", gap=FILL_GAP, prefetch=prefetch, prefetch_from=prefetch_from, gate=gate)
    except ChunkError as e:
        raise damaged(f"snapshot {name!r} is damaged: {e}") from None
    except CodecError as e:
        raise StoreError(f"snapshot {name!r}: {e}") from None


def setting(name: str, default: Any, parse: Callable[[str], Any], ok: Callable[[Any], bool], expected: str,
            error: type[GpusnapError] = SplitError) -> Any:
    """storage.base.settings.setting, refused as a SplitError unless ERROR says otherwise: the split
    restore's settings."""
    return settings.setting(name, default, parse, ok, expected, error)


FILL_READERS = READERS  # the split fill's reads in flight, all workers together (readers())


def readers() -> int:
    """Reads the split fill keeps in flight, all its worker processes together: $GPUSNAP_FILL_READERS,
    else FILL_READERS (storage.repo.readstage.READERS, 4). More were slower while CRIU's own small cold reads
    of the libraries it maps queued behind them (BENCHMARKS.md sections 17 and 27); with those files
    warmed first (sandbox.criu.filehints) CRIU's part no longer grows with them, but 8 reads filled no
    faster than 4 (section 37, one snapshot restored cold in turn in each run: 8 reads 4.24, 4.68,
    12.36 and 4.08 s, 4 reads 4.50-5.02, 4.48, 11.58 and 3.67-4.09 s), so 4 stays. Each worker process reads with its share;
    where there are fewer reads than workers (or a count they do not share evenly), the workers take
    turns through ReadTokens."""
    return int(setting("GPUSNAP_FILL_READERS", FILL_READERS, int, lambda n: 1 <= n <= 64, "a number of reads from 1 to 64"))


def early_readers() -> int:
    """Reads the split fill keeps in flight, all its workers together, while CRIU still runs:
    $GPUSNAP_FILL_READERS_EARLY, else readers() (never more). Off by default: on the H200 (BENCHMARKS.md
    section 36) one read in flight cut CRIU's part of a 20 GB restore from 2.85 to 1.65-1.76 s, but the
    fill after it took 1.4-1.6 s longer, the restore 8.96-8.99 s against 8.52. CRIU's own reads while it restores
    are small and one at a time (opening and checking each library it maps, the page image gpusnap
    serves): each waits behind every read already queued on the disk. Measured on the dev VM
    (scripts/device/probe_queue.py): a small cold read took 0.3 ms on an idle disk, 4.3 ms behind one
    16 MiB reader, 12 ms behind two, 30 ms behind four, and four readers read no faster than one; on
    the H100 CRIU's log showed such pauses of 20-45 ms, about 2 s of a 2.8 s CRIU part (BENCHMARKS.md
    section 35). Once CRIU is done the fill reads with all of readers(). (A chunk read on its own, not
    in a run of its pack's, passes no gate: the rare chunk outside a pack, or read again after a
    damaged run; so a few more reads than this can be in flight.)"""
    n = int(setting("GPUSNAP_FILL_READERS_EARLY", 0, int, lambda n: 1 <= n <= 64, "a number of reads from 1 to 64"))
    return min(n, readers()) if n else readers()


def prefetch_early() -> bool:
    """Whether the split fill's read-ahead (POSIX_FADV_WILLNEED past its readers, fill_prefetch) starts
    as soon as its reads do, while CRIU still runs: $GPUSNAP_FILL_PREFETCH_EARLY=1; default 0, once
    CRIU is done. A deeper queue on the disk delays each small read CRIU makes of its own; with the
    files CRIU reads warmed first (sandbox.criu.filehints) it may make few such reads. For measuring."""
    return bool(settings.switch("GPUSNAP_FILL_PREFETCH_EARLY", False, SplitError))


class EarlyGate:
    """The fill's reads in one process held to EARLY in flight until open() (CRIU is done, or the fill
    stops), then let through: read_chunks' GATE (sandbox.criu.serve's in-process fill)."""

    def __init__(self, early: int) -> None:
        self.early = early
        self._busy = 0
        self._open = False
        self._cond = threading.Condition()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._open or self._busy < self.early)
            self._busy += 1
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify()


def procs_for(cpus: int | None = None) -> tuple[int, int]:
    """(how many worker processes the fill may use, the stored bytes each must have at least):
    $GPUSNAP_FILL_PROCS (then any share is worth a process), else one per 4 cores, at most 8, each
    for at least MIN_SHARE; 1 means the fill runs in this process."""
    n = setting("GPUSNAP_FILL_PROCS", None, int, lambda n: n >= 1, "a number of processes")
    if n is not None:
        return n, 0
    return max(1, min(8, (cpus or os.cpu_count() or 1) // 4)), MIN_SHARE


def shares(jobs: dict[Key, Job], where: Callable[[str], tuple[str, int] | None], procs: int,
           min_share: int = MIN_SHARE, phases: dict[Key, int] | None = None) -> list[dict[Key, Job]]:
    """JOBS cut into at most PROCS shares of about equal stored bytes, each of at least MIN_SHARE bytes
    where there are enough, contiguous in pack order (WHERE(id):
    (pack, offset) of a chunk, None where it is not in a pack: such chunks go last). With PHASES
    (split.fill_phases), each phase is cut so, across the shares (as far as it has chunks), so that
    all the workers complete phase 0 first, then phase 1. All-zero chunks are read by nobody and written
    by nobody (the fresh mapping reads as zero): the first share carries them, for the count of
    bytes skipped."""
    ph = phases or {}
    stored = [(k, j) for k, j in jobs.items() if not j[0].is_zero]
    keyed = [(ph.get(k, 0), where(j[0].id or "") or ("\xff", 0), k, j) for k, j in stored]
    keyed.sort(key=lambda x: x[:2])
    total = sum(j[0].stored_len for *_, j in keyed)
    n = max(1, min(procs, len(keyed), total // min_share if min_share else procs))
    out: list[dict[Key, Job]] = [{} for _ in range(n)]
    per_phase: dict[int, int] = {}
    for p, _, _, j in keyed:
        per_phase[p] = per_phase.get(p, 0) + j[0].stored_len
    acc, i, at = 0, 0, None
    for p, _, k, j in keyed:
        if p != at:  # a phase begins: cut it from the first share again
            acc, i, at = 0, 0, p
        while i < n - 1 and acc >= (i + 1) * per_phase[p] / n:
            i += 1
        out[i][k] = j
        acc += j[0].stored_len
    for k, j in jobs.items():
        if j[0].is_zero:
            out[0][k] = j
    return [s for s in out if s]


def worker_argv() -> list[str]:
    """The worker's command line: this module in an isolated interpreter (storage.fs.isolated)."""
    return isolated.python_argv("sandbox.criu.fill_procs")


def fill_timeout() -> float:
    """Seconds the fill's workers may take once told to write: $GPUSNAP_FILL_TIMEOUT, else an hour (as
    CRIU's own timeout): a store that stops answering (a hung network disk) fails the restore instead
    of keeping the tree stopped for ever."""
    t: float = setting("GPUSNAP_FILL_TIMEOUT", 3600.0, float, lambda t: t > 0, "seconds")
    return t


def where_in_packs(store: SnapshotStore) -> Callable[[str], tuple[str, int] | None]:
    """(pack, offset) of a chunk in STORE (its first copy), None where it is not in a pack."""
    def where(cid: str) -> tuple[str, int] | None:
        locs = store.locate(cid)
        return (locs[0].pack, locs[0].offset) if locs and locs[0].pack else None
    return where


def _job_json(share: dict[Key, Job], where: Callable[[str], list[Loc]], phases: dict[Key, int]) -> list[Any]:
    """SHARE as the job's "chunks": key, reference, targets, where its pack entries are (WHERE:
    the parent's index, so a worker never loads the store's whole index itself) and its phase."""
    return [[k if isinstance(k, str) else list(k), ref.to_json(), [list(t) for t in targets],
             [[loc.pack, loc.offset, loc.length] for loc in where(ref.id)] if ref.id else [], phases.get(k, 0)]
            for k, (ref, targets) in share.items()]


_T = TypeVar("_T")


class _Located:
    """The store as the read stage sees it (readstage.PackSource), chunks located by the parent's
    index (the job's): a worker reads only the entries it was told of, each checked against its id
    as any read is, and asks the store itself only for what the job does not say."""

    def __init__(self, store: SnapshotStore, locs: dict[str, list[Loc]]) -> None:
        self.store, self.locs = store, locs

    def locate(self, cid: str, refresh: bool = False) -> list[Loc]:
        got = self.locs.get(cid)
        return got if got and not refresh else self.store.locate(cid, refresh)

    def first_sound(self, ref: ChunkRef, buf: "AlignedBuffer", accept: Callable[[ChunkHeader, memoryview], _T],
                    check: bool = True, cached: bool = False) -> _T:
        return self.store.first_sound(ref, buf, accept, check, cached)

    def chunk_buffer_size(self, manifests: list[Any]) -> int:
        return self.store.chunk_buffer_size(manifests)

    def subdir(self, name: str) -> "AbstractContextManager[int]":
        return self.store.subdir(name)

    def open_warm(self, pack: str) -> int | None:
        return self.store.open_warm(pack)

    def delta_base(self, bid: str, most: int) -> "bytes | memoryview":
        return self.store.delta_base(bid, most)


class ReadTokens:
    """COUNT reads in flight shared by processes: a pipe holding one byte per read allowed (the
    parent's; its ends are inherited by the workers, which take one with `held`). A worker that dies
    holding a byte takes it along; the fill then fails on that worker's death anyway."""

    def __init__(self, count: int) -> None:
        self.r, self.w = os.pipe()
        try:
            os.write(self.w, b"t" * count)  # at most 64: far below a pipe's buffer, never blocks
        except BaseException:
            self.close()
            raise

    def fds(self) -> tuple[int, int]:
        return self.r, self.w

    def close(self) -> None:
        for fd in (self.r, self.w):
            try:
                os.close(fd)
            except OSError:
                pass


@contextmanager
def held(r: int, w: int) -> Iterator[None]:
    """One read's token taken from the shared pipe (R, W) for the block, then given back."""
    b = os.read(r, 1)  # every worker holds the write end too: never the end of the pipe
    try:
        yield
    finally:
        os.write(w, b)


class FillProcs:
    """split.Filler's interface (write, close, stages; a context manager) over worker processes, one per
    share of JOBS. The workers start now (their imports overlap CRIU); each gets its job once
    START_READS is set (CRIU's own reads are asked of the disk first), reads and holds up to BUDGET /
    workers bytes until `write`, then writes its share."""

    def __init__(self, store: SnapshotStore, name: str, parts: list[dict[Key, Job]], decoders: int, budget: int,
                 prefetch: int, start_reads: threading.Event, stages: Stages,
                 phases: dict[Key, int] | None = None, nphases: int | None = None) -> None:
        """PARTS: shares(...) of the jobs (at least two), cut by PHASES where given (split.fill_phases);
        NAME: the snapshot's (for messages)."""
        self.store, self.name, self.shares, self.stages = store, name, parts, stages
        self.phases = phases or {}
        self.nphases = max(self.phases.values(), default=0) + 1 if nphases is None else nphases
        self.timeout = fill_timeout()  # read now: a bad setting fails before CRIU starts
        self.prefetch_early = prefetch_early()
        self.jobs = {k: j for part in parts for k, j in part.items()}
        n = len(parts)
        # spawned from the thread that runs the restore: a worker's PR_SET_PDEATHSIG fires when the
        # thread that started it ends, and this one outlives the fill
        self.procs: list[subprocess.Popen[str]] = []
        reads = readers()
        self._later = reads - early_readers()  # tokens given out once CRIU is done (write)
        # reads that do not share out evenly (fewer than the workers, or not a multiple of them), or fewer
        # while CRIU runs: each worker gets the share rounded up, and tokens keep the count in all (see
        # ReadTokens); EARLY of them until CRIU is done, the rest then (write)
        tokens = ReadTokens(reads - self._later) if reads % n or self._later else None
        self.tokens = tokens.fds() if tokens is not None else None
        self._more: int | None = None
        try:
            if tokens is not None and self._later:
                self._more = os.dup(tokens.w)
            for _ in range(n):
                self.procs.append(subprocess.Popen(worker_argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   stderr=subprocess.DEVNULL, text=True, cwd="/", close_fds=True,
                                                   pass_fds=self.tokens or ()))
        except OSError as e:
            self.close()
            raise SplitError(f"starting the fill's worker processes: {e.strerror}") from None
        finally:
            if tokens is not None:
                tokens.close()  # the workers hold the pipe now
        # the decoders, the memory and the reads in flight shared out: readers() in all, as one process has
        self._jobs_sent = threading.Thread(target=self._send_jobs, name="gpusnap-fill-jobs", daemon=True,
                                           args=(start_reads, max(1, decoders // n), budget // n, prefetch // n,
                                                 -(-reads // n)))
        self._closed = False
        try:
            self._jobs_sent.start()
        except BaseException:
            self.close()  # the workers killed, the held-back tokens' descriptor closed
            raise

    def _send_jobs(self, start: threading.Event, decoders: int, budget: int, prefetch: int, readers: int) -> None:
        start.wait()
        for p, share in zip(self.procs, self.shares):
            t0 = time.perf_counter()
            job = {"store": self.store.path, "name": self.name, "warm": self.store.warm_in_use, "decoders": decoders, "budget": budget, "prefetch": prefetch,
                   "prefetch_early": self.prefetch_early, "readers": readers, "tokens": self.tokens, "nphases": self.nphases,
                   "chunks": _job_json(share, self.store.locate, self.phases)}
            text = json.dumps(job)
            # this process's Python work while CRIU runs (its threads serving CRIU wait on it for the GIL)
            self.stages.add("fill:jobs", time.perf_counter() - t0, len(text))
            _tell(p, text)

    def write(self, pids_ok: Callable[[int], bool], on_phase: Callable[[int], None] | None = None) -> dict[str, int]:
        """split.Filler.write: every pid checked (PIDS_OK), then "go" to every worker, their results
        gathered (the first failure raised: damage as damage); ON_PHASE(p) once every worker has
        written its part of phases 0..p, each phase in order; bytes written / skipped as zero."""
        checked = check_pids(self.jobs, pids_ok)
        self._jobs_sent.join()
        self._all_reads()
        go = "go " + json.dumps({str(pid): list(ident) for pid, ident in checked.items()})
        for p in self.procs:
            _tell(p, go)  # with each pid's identity as checked: a worker binds its writes to those processes
        results = self._results(on_phase)
        for r in results:
            for stage, v in r.get("stages", {}).items():
                self.stages.add(stage, float(v["thread_seconds"]), int(v["bytes"]))
        return {"written": sum(int(r["written"]) for r in results),
                "zero_skipped": sum(int(r["zero_skipped"]) for r in results)}

    def _results(self, on_phase: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
        """Every worker's answer as it comes, and its {"phase": p} lines before it (ON_PHASE(p) once
        every worker is past p); at the first failure the others are killed (their writes are moot:
        the tree is killed) and it is raised, damage as damage."""
        import selectors
        results: dict[int, dict[str, Any]] = {}
        done = [-1] * len(self.procs)  # the last phase each worker said it wrote
        told = -1
        nphases = self.nphases
        pending = [b""] * len(self.procs)  # a line read in part
        with selectors.DefaultSelector() as sel:
            for i, p in enumerate(self.procs):
                assert p.stdout is not None
                sel.register(p.stdout.fileno(), selectors.EVENT_READ, i)
            deadline = time.monotonic() + self.timeout
            while len(results) < len(self.procs):
                ready = sel.select(timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    self.close()
                    raise SplitError(f"the split fill's workers did not finish within {self.timeout:g} s "
                                     "(GPUSNAP_FILL_TIMEOUT); the restored tree is killed, the snapshot is as it was")
                for key, _ in ready:
                    i = key.data
                    got = os.read(key.fd, 1 << 16)
                    lines = (pending[i] + got).split(b"\n")
                    pending[i] = lines.pop()
                    if len(pending[i]) > 1 << 20:  # no line of the protocol is that long
                        self.close()
                        raise SplitError(f"fill worker {i} wrote a line of over 1 MiB")
                    if not got:  # the worker closed its stdout: whatever it said last is its answer
                        sel.unregister(key.fd)
                        lines.append(pending[i])
                    for line in lines:
                        r = _parsed(line)
                        if i in results:
                            continue
                        if r is not None and set(r) == {"phase"}:
                            p = r["phase"]
                            if type(p) is not int or not done[i] < p < nphases:
                                r = {"error": f"fill worker {i} said phase {p!r} after {done[i]} (of {nphases})"}
                            else:
                                done[i] = p
                                continue
                        elif not _answer(r):
                            if got:
                                continue  # not a line of the protocol: the answer is still to come
                            r = None
                        if r is None:
                            r = {"error": f"fill worker {i} died (exit status {_status(self.procs[i])}) before it reported"}
                        results[i] = r
                        done[i] = nphases - 1
                        if "error" in r:
                            self.close()
                            if r.get("damage"):
                                raise self.store.error(r["error"])
                            raise SplitError(r["error"])
                    if not got and i not in results:  # EOF with no answer (e.g. an unfinished line)
                        results[i] = {"error": f"fill worker {i} died (exit status {_status(self.procs[i])}) before it reported"}
                        self.close()
                        raise SplitError(results[i]["error"])
                    if got and i in results:
                        sel.unregister(key.fd)
                while on_phase is not None and told < min(done):
                    told += 1
                    on_phase(told)
        return [results[i] for i in range(len(self.procs))]

    def _all_reads(self) -> None:
        """CRIU is done (or the fill stops): the tokens held back while it ran are given out."""
        fd, self._more = getattr(self, "_more", None), None
        if fd is None:
            return
        try:
            os.write(fd, b"t" * self._later)  # at most 63 bytes: never blocks
        except OSError:
            pass  # every worker gone: nothing reads them
        finally:
            os.close(fd)

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._all_reads()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
            for f in (p.stdin, p.stdout):
                try:
                    if f is not None:
                        f.close()
                except OSError:
                    pass

    def __enter__(self) -> "FillProcs":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(r: dict[str, Any] | None) -> bool:
    """R is a worker's last line: its error, or what it wrote (counts that are ints, stages an object)."""
    if r is None:
        return False
    if "error" in r:
        return isinstance(r["error"], str)
    stages = r.get("stages", {})
    return (all(type(r.get(k)) is int and r[k] >= 0 for k in ("written", "zero_skipped"))
            and isinstance(stages, dict)
            and all(isinstance(v, dict) and type(v.get("bytes")) is int and isinstance(v.get("thread_seconds"), (int, float))
                    and type(v.get("thread_seconds")) is not bool for v in stages.values()))


def _status(p: "subprocess.Popen[str]") -> int | str:
    """The exit status of a worker that closed its end: waited for a few seconds, then killed."""
    try:
        return p.wait(timeout=5)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return "none: it closed its output and was killed"


def _parsed(line: bytes) -> dict[str, Any] | None:
    """One protocol line of a worker as an object; None for anything else."""
    try:
        r = json.loads(line) if line.strip() else None
    except ValueError:
        return None
    return r if isinstance(r, dict) else None


def _tell(p: "subprocess.Popen[str]", line: str) -> None:
    """LINE to worker P; a worker that is gone is reported by FillProcs.write (its answer is missing)."""
    try:
        assert p.stdin is not None
        p.stdin.write(line + "\n")
        p.stdin.flush()
    except (OSError, ValueError):
        pass


def _parse_job(job: Any) -> tuple[dict[Key, Job], dict[str, list[Loc]], dict[Key, int]]:
    """The parent's job, checked for shape (it is the parent's own, but a malformed line must fail
    cleanly): the jobs, where each chunk's entries are, and each chunk's phase."""
    out: dict[Key, Job] = {}
    locs: dict[str, list[Loc]] = {}
    phases: dict[Key, int] = {}
    for item in job:
        k, ref, targets, where, phase = item
        key: Key = k if isinstance(k, str) else (str(k[0]), int(k[1]))
        phases[key] = int(phase)
        if not 0 <= phases[key] < 1 << 16:
            raise ValueError(f"phase {phase!r}")
        r = ChunkRef.from_json(ref)
        out[key] = (r, [(int(a), int(b), int(c), int(d)) for a, b, c, d in targets])
        if r.id is not None:
            locs[r.id] = [Loc(str(p), int(o), int(n)) for p, o, n in where]
    return out, locs, phases


def _token_pipe(tokens: Any) -> bool:
    """TOKENS (a job's) names two different descriptors past stdio, both pipes (the parent's ReadTokens)."""
    if not (isinstance(tokens, list) and len(tokens) == 2 and all(type(t) is int and t > 2 for t in tokens)
            and tokens[0] != tokens[1]):
        return False
    try:
        return all(stat.S_ISFIFO(os.fstat(t).st_mode) for t in tokens)
    except OSError:
        return False


def _serve_job(inp: IO[str], out: IO[str]) -> int:
    """One job: read it, hold what it reads until "go", write, answer one line (every failure too)."""
    said = threading.Lock()  # the fill's threads tell of phases, the end tells the result

    def answer(r: dict[str, Any]) -> None:
        with said:
            out.write(json.dumps(r) + "\n")
            out.flush()

    line = inp.readline()
    if not line:
        return 0  # the parent closed before the job: nothing to do
    try:
        job = json.loads(line)
        jobs, locs, phases = _parse_job(job["chunks"])
        store = SnapshotStore(job["store"], create=False)
        if job.get("warm"):
            store.use_warm()  # the parent reads from the warm tier: so do its workers
        located = _Located(store, locs)
        go = threading.Event()
        stages = Stages()

        tokens = job.get("tokens")
        if tokens is not None and not _token_pipe(tokens):
            raise SplitError(f"fill worker: bad read tokens {tokens!r}")
        gate = (lambda: held(tokens[0], tokens[1])) if tokens is not None else None

        def read(wants: list[Want], deliver: Callable[[Want, memoryview], None], stop: Callable[[], bool]) -> None:
            read_moved(located, store.error, str(job["name"]), wants, deliver, stop, stages=stages, decoders=int(job["decoders"]),
                       readers=int(job["readers"]), prefetch=int(job["prefetch"]),
                       prefetch_from=None if job.get("prefetch_early") is True else go, gate=gate)

        with Filler(jobs, read, int(job["decoders"]), int(job["budget"]), stages, phases, int(job["nphases"])) as filler:
            go_line = inp.readline().strip()
            if not go_line.startswith("go"):
                return 0  # the parent gave up (CRIU failed): the tree is killed, nothing to write
            go.set()
            # the parent checked every pid before "go" and says each one's identity, which the
            # worker's writes are bound to (split.pin_memory)
            checked = _checked_pids(go_line[2:])
            done = filler.write(lambda pid: False, lambda p: answer({"phase": p}), checked=checked)
    except GpusnapError as e:
        answer({"error": str(e), "damage": isinstance(e, DamageError)})
        return 1
    except Exception as e:  # noqa: BLE001 - one line for the parent, never a traceback on its terminal
        answer({"error": f"fill worker: {type(e).__name__}: {e}", "damage": False})
        return 1
    answer({**done, "stages": stages.table()})
    return 0


def _checked_pids(text: str) -> dict[int, tuple[int, ...]]:
    """The parent's "go" line's pids and identities (split.check_pids), or SplitError."""
    try:
        got = json.loads(text)
        checked = ({int(k): tuple(int(x) for x in v) for k, v in got.items() if isinstance(v, list)}
                   if isinstance(got, dict) else None)
    except (ValueError, TypeError, AttributeError):
        checked = None
    if (checked is None or len(checked) != len(got)
            or any(p <= 0 or not ident or min(ident) < 0 for p, ident in checked.items())):
        raise SplitError(f"fill worker: the parent's go line is not understood: {text[:80]!r}")
    return checked


def main() -> int:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the parent
    if os.getppid() == 1:
        return 1  # the parent is already gone
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but the result line on the protocol's stream
    try:
        try:
            settings.apply_switch_interval()
        except settings.SettingError:
            pass  # the parent refused a bad value before it started any worker
        return _serve_job(sys.stdin, out)
    finally:
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
