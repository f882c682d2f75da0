"""How a CRIU dump's images reach the store: CRIU in a thread of its own (CriuThread, the one helper that
runs it so) while the calling thread ingests, by either path (sandbox.criu.images): streamed through
the capture socket (streamed), or written as files into the operation's directory and ingested as
they grow (staged). One DumpContext carries what both need.

Guarantees kept here:
- CRIU dumps with --leave-stopped (unless the tree keeps running): the tree is killed only after the
  snapshot commits (sandbox.criu.snapshot); until then a failure of either side leaves it stopped
  for the undo to resume, or CRIU resumes it itself (a broken pipe fails a CRIU still dumping);
- the stage is journaled before it happens: DUMPING before CRIU starts, DUMPED (with what CRIU
  froze, children forked during the dump included, unless the tree runs on) as soon as CRIU is done,
  in CRIU's thread, before anything else;
- the calling thread waits for CRIU's end even when a signal interrupts it (the undo needs that end),
  and CRIU's failure is raised with its log kept in the store's logs/.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from storage.api import put as pipeline
from storage.api import FollowedDirSource
from storage.api import Progress
from storage.api import SnapshotStore

from sandbox.criu.capture import CaptureSource
from sandbox.criu.gpu_side import GpuSide
from sandbox.criu.images import is_page_image, late_reads, late_reads_in
from sandbox.criu.report import CriuReport
from sandbox.criu.runner import Criu, CriuError, DumpOptions
from sandbox.criu.staging import keep_log, rss_bytes
from sandbox.ops import journal
from sandbox.ops.journal import Stage


@dataclass(frozen=True)
class DumpContext:
    """One `criu dump` into a snapshot, as both paths need it."""

    store: SnapshotStore
    name: str                 # the snapshot
    op: journal.Op            # its journal record
    w: Any                    # its storage.repo.store.SnapshotWriter
    criu: Criu
    pid: int                  # the tree's root
    pids: list[int]           # the tree as found before the dump
    opts: DumpOptions
    gpu: GpuSide
    report: CriuReport
    leave_running: bool
    progress: Progress | None = None
    images: str = ""          # the directory CRIU's images (or its socket and log) are in
    parent: Any = None        # the storage.format.manifest.Manifest its changed chunks are deltas against (or None)


class CriuThread:
    """DUMP (`criu dump`) in a thread of its own while the caller ingests what it writes. `done` is set
    once it has ended, error() is its failure, `seconds` its own time. AFTER runs in that thread right
    after DUMP succeeds (the tree is dumped: journal it, give GPU state back); its failure counts as
    CRIU's."""

    def __init__(self, dump: Callable[[], object], after: Callable[[], None]) -> None:
        self.done = threading.Event()
        self.seconds: float | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(dump, after), name="gpusnap-criu-dump", daemon=True)

    def _run(self, dump: Callable[[], object], after: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            dump()
            self.seconds = time.perf_counter() - t0
            after()
        except BaseException as e:  # noqa: BLE001 - handed to the ingesting thread
            self._error = e
        finally:
            self.done.set()

    def start(self) -> None:
        self._thread.start()

    def error(self) -> BaseException | None:
        return self._error

    def join(self) -> BaseException | None:
        """Until CRIU has ended, even if a signal's exception interrupts the wait; that exception, if
        one came (later signals are ignored: sandbox.host.interrupts)."""
        caught = None
        while self._thread.is_alive():
            try:
                self._thread.join()
            except BaseException as e:  # noqa: BLE001 - Interrupted
                caught = caught or e
        return caught

    def raise_failure(self, ctx: DumpContext) -> None:
        """CRIU's failure, its log kept in the store's logs/ (or AFTER's), if it failed."""
        err = self._error
        if isinstance(err, CriuError):
            raise err.with_log(keep_log(ctx.store, err, f"dump-{ctx.name}")) from None
        if err is not None:
            raise err


def _dumped(ctx: DumpContext) -> None:
    """In CRIU's thread, once CRIU is done: the journal says DUMPED (unless the tree runs on: with the
    processes CRIU left stopped; the list taken before the dump lacks any child forked while CRIU
    froze the tree); with --leave-running the GPU state comes back at once."""
    ctx.op.advance(Stage.DUMPED, **({} if ctx.leave_running else {"procs": journal.with_descendants(ctx.op.rec.procs)}))
    journal.pause("ingest")  # CRIU is done, the pipeline still ingesting
    if ctx.leave_running and ctx.gpu.cuda_pids:
        t1 = time.perf_counter()
        ctx.gpu.swap_in(ctx.store, ctx.name, ctx.w.streams)
        ctx.report.seconds["gpu_resume"] = time.perf_counter() - t1


def _ingested(ctx: DumpContext, res: pipeline.Result, followed: list[str], t0: float, criu_s: float,
              late: str | None = None) -> None:
    r = ctx.report
    if late:  # CRIU reads some images late on a restore: the default restore stages this snapshot's images
        ctx.w.meta["staged_restore"] = r.staged_restore = late
    r.seconds["criu_dump"] = criu_s
    r.seconds["dump+ingest"] = time.perf_counter() - t0
    r.seconds["ingest_after_dump"] = r.seconds["dump+ingest"] - criu_s
    ctx.w.meta["ingest_stages"] = r.stages = res.stages.table()
    ctx.w.meta["ingested_while_dumping"] = followed


def streamed(ctx: DumpContext) -> None:
    """`criu dump --stream` straight into the store: each page image flows from CRIU's pipe into the
    pipeline (sandbox.criu.capture), no staging copy. A failure of the store side closes the capture
    source first, so a CRIU still dumping sees its pipes break and fails (resuming the tree)."""
    o = ctx.opts
    stop = () if o.leave_running or o.leave_stopped else ("--leave-stopped",)
    opts = DumpOptions(**{**o.__dict__, "extra": tuple(o.extra) + ("--stream",) + stop})
    if ctx.progress is not None:
        ctx.progress.start(rss_bytes(ctx.pids))
    ctx.op.advance(Stage.DUMPING)
    criu = CriuThread(lambda: ctx.criu.dump(ctx.pid, ctx.images, opts), lambda: _dumped(ctx))
    t0 = time.perf_counter()
    src = CaptureSource(ctx.images, criu_done=criu.done, criu_failed=criu.error)
    criu.start()
    try:
        res = pipeline.put(ctx.w, src, progress=ctx.progress, chunker="pages", parent=ctx.parent)
    except BaseException:
        src.close()  # CRIU's pipes break: a CRIU still dumping fails and resumes the tree itself
        criu.join()
        raise  # the store's failure (a CRIU failure then is its broken pipe's consequence)
    interrupted = criu.join()
    src.close()
    if interrupted is not None:
        raise interrupted
    criu.raise_failure(ctx)
    assert criu.seconds is not None
    _ingested(ctx, res, src.page_images, t0, criu.seconds, late_reads(src.small_images))


def staged(ctx: DumpContext) -> None:
    """`criu dump` into ctx.images while the pipeline ingests its page images as they grow
    (storage.archive.follow), the rest of the images after CRIU exits (the staging path: sandbox.criu.images
    says why it stays). report.seconds["criu_dump"] is set as soon as CRIU has dumped, also when the
    ingest then fails; CRIU's failure is raised in preference to the ingest's (the ingest failed
    because CRIU did)."""
    ctx.op.advance(Stage.DUMPING)
    criu = CriuThread(lambda: ctx.criu.dump(ctx.pid, ctx.images, ctx.opts), lambda: _dumped(ctx))
    t0 = time.perf_counter()
    with FollowedDirSource(ctx.images, follow=is_page_image, writer_done=criu.done, writer_failed=criu.error,
                           handoff_min=2 * pipeline.SEGMENT) as src:
        criu.start()
        if ctx.progress is not None:
            ctx.progress.start(rss_bytes(ctx.pids))
        try:
            res = pipeline.put(ctx.w, src, progress=ctx.progress, chunker="pages", parent=ctx.parent)
        finally:
            interrupted = criu.join()  # CRIU's end is awaited even when a signal came: the undo needs it
            if criu.seconds is not None:
                ctx.report.seconds["criu_dump"] = criu.seconds
            if interrupted is not None:
                raise interrupted
            criu.raise_failure(ctx)
    assert criu.seconds is not None
    _ingested(ctx, res, src.followed, t0, criu.seconds, late_reads_in(ctx.images))
