"""How `criu restore` gets a snapshot's images, by either path (sandbox.criu.images): served from the store
through the serve socket, the large page runs written into the stopped tree afterwards (streamed), or
materialized as verified files first (staged). One RestoreRun carries what both need.

Guarantees kept here:
- streamed: with a split, CRIU leaves the tree stopped; on_stopped (the caller journals the stopped
  tree) runs before the fill, and a process continues only once every moved run of it is written
  (the whole tree at the end of the fill; a process of fill_first as soon as its own runs are in,
  so that its GPU state can come back while the fill goes on: on_filled); gpusnap continues no
  process half-restored (one of the tree's own processes, once running, can continue a held
  sibling: its own doing; the fill's later writes go through memory opened while all were held,
  sandbox.criu.split.Filler.write, so nothing of the snapshot reaches another program or a reused
  pid); if the fill fails, the tree CRIU restored is killed with every descendant and whatever it
  orphaned meanwhile (kill_restored: pid and start time, only processes this restore made);
- a CRIU failure caused by the store (a damaged chunk, a remote that failed) is raised as that
  failure, not as CRIU's broken pipe; if CRIU itself dies mid-restore, the tasks it had created come
  back to gpusnap (child subreaper meanwhile) and are killed, so the snapshot's pids are free for the
  next restore;
- THP is set for the restore (CRIU faults the whole image in) and put back after
  (sandbox.gpu.state.restore_huge_pages, recorded for `gpusnap recover`).
"""
from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from storage.api import put as pipeline
from storage.api import FileTreeSink
from storage.api import Manifest
from storage.api import Progress
from storage.api import SnapshotStore
from storage.api import WakeProbe, wanted as wake_probe_wanted

from sandbox.criu.restored import (adopting_orphans, boot_ticks, in_restored_tree, kill_half_restored, restored_procs,
                                   wait_stopped)
from sandbox.criu.runner import Criu, CriuError
from sandbox.criu.serve import Arrivals, ServeSource, split_min
from sandbox.host.processes import Proc, children_of, kill_with_descendants, state_of
from sandbox.gpu.state import restore_huge_pages
from sandbox.ops import journal


@dataclass(frozen=True)
class RestoreRun:
    """One `criu restore` of a snapshot's CRIU images, as both paths need it."""

    criu: Criu
    store: SnapshotStore
    files: Manifest                  # the snapshot's CRIU images (its gpu/ streams left out)
    stage: str                       # the operation's private directory (sandbox.criu.staging)
    pids: list[int]                  # the snapshot's pids
    shell_job: bool
    extra: tuple[str, ...] = ()      # CRIU options (the dump's that CRIU needs again)
    progress: Progress | None = None  # the staged path's materialize
    arrivals: Arrivals | None = None  # chunks still on their way from a remote (the streamed path)
    on_stopped: Callable[[list[int]], None] | None = None  # CRIU done, the tree (its pids) stopped for the split fill
    fill_first: tuple[int, ...] = ()  # processes the fill completes first, in this order (their GPU state comes back early)
    on_filled: Callable[[int], None] | None = None  # a pid of fill_first is complete and running (from a fill thread)
    on_fill_done: Callable[[], None] | None = None  # the split fill finished, before the tree continues (journaled)
    early: Any = None                # serve.EarlyReads started since the manifest loaded (the streamed path stops it)

    @property
    def pidfile(self) -> str:
        """Where CRIU writes the restored tree's root pid."""
        return os.path.join(self.stage, "restored.pid")


def streamed(run: RestoreRun, *, thp_mode: str | None = "always",
             split_bytes: int | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """`criu restore --stream -d` of RUN's images served from the store (stage/images: the socket and
    CRIU's log), THP set to THP_MODE meanwhile. With a split (runs of at least SPLIT_BYTES, default
    split_min()), CRIU leaves the tree stopped, on_stopped runs, the moved runs are written in, then
    the tree continues; if that fails the tree is killed. Returns seconds per stage and what was
    served. A CRIU failure caused by the store (a damaged chunk, a remote that failed: the arrivals'
    error) is raised as that error; otherwise CRIU's."""
    images = os.path.join(run.stage, "images")
    os.mkdir(images, 0o700)
    criu, pidfile, on_stopped = run.criu, run.pidfile, run.on_stopped
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    marks = info["monotonic"] = {"serve_begin": time.monotonic()}  # phase boundaries, for benchmarks' timelines
    born_after = boot_ticks()  # what CRIU restores starts after this
    # THP: host-wide, so for as short a time as the restore allows. A local restore sets it first,
    # before any deep read-ahead: setting it (its crash record fsynced, the sysfs write) took 0.24 s on
    # the H200 with the read-ahead of CRIU's chunks in the disk's queue, 2 ms without. The early reads
    # (serve.EarlyReads) run by then, but keep at most one 16 MiB read in the queue. A restore from a
    # remote sets it only once its planning (network waits) is done.
    thp = ExitStack()
    try:
        if run.arrivals is None:
            thp.enter_context(restore_huge_pages(thp_mode))
        with ServeSource(run.store, run.files, images, split_min=split_min() if split_bytes is None else split_bytes,
                         arrivals=run.arrivals, fill_first=run.fill_first, early=run.early) as srv:
            try:
                extra = run.extra + (("--stream", "--leave-stopped") if srv.plans else ("--stream",))
                pids = list(dict.fromkeys([*run.pids, *srv.pstree]))
                marks.update(srv.marks)
                if run.arrivals is not None:
                    thp.enter_context(restore_huge_pages(thp_mode))
                marks["criu_begin"] = time.monotonic()
                probe = WakeProbe().start() if wake_probe_wanted() else None
                if probe is not None:
                    thp.callback(probe.stop)
                try:
                    with adopting_orphans():
                        try:
                            criu.restore(images, detach=True, shell_job=run.shell_job, pidfile=pidfile, extra=extra)
                        except CriuError:
                            kill_half_restored(pids)
                            raise
                except CriuError:
                    srv.raise_if_failed()
                    raise
                srv.raise_if_failed()
                seconds["criu_restore"] = time.perf_counter() - t0
                marks["criu_done"] = time.monotonic()
                if probe is not None:  # how late this process's threads woke while CRIU ran (GIL, scheduler)
                    probe.stop()
                    info["criu_wake_late"] = probe.report()
                root = _root_pid(pidfile)
                tree = restored_tree(root, srv.pstree, born_after)
                info["restored_pids"] = tree
                if srv.plans:
                    t1 = time.perf_counter()
                    early: dict[str, float] = {}
                    wait_stopped(tree)  # the stop CRIU left pending, in effect (else the fill refuses the pid)
                    procs = {p.pid: p for p in restored_procs(tree, born_after)}  # taken while all are held

                    def filled(pid: int) -> None:  # every moved run of PID is in: it may run (its GPU state come back)
                        if pid in procs and procs[pid].signal(signal.SIGCONT):
                            early[str(pid)] = time.monotonic()
                            if run.on_filled is not None:
                                run.on_filled(pid)

                    # with fill_first, processes run before the fill ends: whatever they fork and orphan
                    # comes to this process (not init), so that a failed fill can kill it too
                    ours = set(children_of(os.getpid()))  # this process's own children (the fill's workers, ...)
                    with adopting_orphans() if run.fill_first else nullcontext():
                        try:
                            if on_stopped is not None:
                                on_stopped(tree)
                            info["split"] = srv.fill(lambda p: in_restored_tree(p, root, srv.pstree, born_after, stopped=True),
                                                     filled)
                            if early:
                                marks.update({f"filled_{p}": t for p, t in early.items()})
                        except BaseException:
                            srv.stop_fill()  # no write of the fill's goes on while the tree is killed
                            kill_restored(tuple(procs.values()), born_after,
                                          keep=(ours | srv.helper_pids()) if run.fill_first else None)
                            raise
                    if run.on_fill_done is not None:
                        run.on_fill_done()  # from here on, no undo kills this tree: it is whole
                    for p in procs.values():
                        p.signal(signal.SIGCONT)
                    journal.pause("fill-done")  # test hook: the tree runs whole, the record still says FILLING
                    seconds["split_fill"] = time.perf_counter() - t1
                    marks["fill_done"] = time.monotonic()
            finally:
                thp.close()  # THP back before the fill's workers are waited for (one stuck in the disk must not hold it)
            info.update(served=len(srv.served), absent_images=srv.absent, bytes=srv.bytes, stages=srv.stages.table(),
                        moved_bytes=sum(p.moved_bytes for p in srv.plans.values()),
                        cow_kept_bytes=sum(p.cow_kept for p in srv.plans.values()),
                        stack_kept_bytes=sum(p.stack_kept for p in srv.plans.values()), feed_buffers=srv.feed_buffers,
                        window=srv.window)
            if srv.split_skipped_because is not None:
                info["split_skipped_because"] = srv.split_skipped_because
            if srv.file_hints is not None:
                info["file_hints"] = srv.file_hints  # the mapped files warmed for CRIU (sandbox.criu.filehints)
            if srv.fill_memory:
                info["fill_memory"] = srv.fill_memory  # what the fill could hold and read ahead, and why
            if srv.connected_at is not None:
                info["criu_connected_monotonic"] = srv.connected_at
    finally:
        thp.close()
    return seconds, info


def kill_restored(procs: tuple[Proc, ...], born_after: int, keep: set[int] | None) -> list[int]:
    """PROCS (a tree this restore made) killed with every descendant; with KEEP (this process was the
    child subreaper while the tree could run), also every child of this process that started after
    BORN_AFTER but KEEP (its own: the fill's workers, the children it had before): what the tree
    forked and orphaned; reaped. Returns the pids."""
    me = os.getpid()

    def adopted() -> tuple[Proc, ...]:
        if keep is None:
            return ()
        kids = (Proc.of(p) for p in children_of(me) if p not in keep)
        return tuple(p for p in kids if p is not None and p.start >= born_after - 1)

    killed = kill_with_descendants(procs + adopted())
    for _ in range(16):  # each killed one's orphans come to us next
        more = tuple(p for p in adopted() if state_of(p.pid) not in ("Z", "X", "gone"))
        if not more:
            break
        killed += kill_with_descendants(more)
    for p in adopted():  # our zombies now
        try:
            os.waitpid(p.pid, os.WNOHANG)
        except ChildProcessError:
            pass
    return killed


def restored_tree(root: int, pstree: list[int], born_after: int) -> list[int]:
    """The pids of PSTREE (the snapshot's process tree image) that are the tree CRIU restored under
    ROOT (sandbox.criu.restored.in_restored_tree): all that is ever written into, signalled or
    journaled as this restore's processes."""
    return [p for p in pstree if in_restored_tree(p, root, pstree, born_after)]


def pstree_of(images_dir: str) -> list[int]:
    """The pids a materialized pstree.img in IMAGES_DIR lists ([] when it cannot be read)."""
    from sandbox.criu.split import SplitError, pstree_pids
    try:
        with open(os.path.join(images_dir, "pstree.img"), "rb") as f:
            return pstree_pids(f.read())
    except (OSError, SplitError):
        return []


def _root_pid(pidfile: str) -> int:
    """The pid CRIU wrote into PIDFILE (the restored tree's root); 0 when there is none."""
    try:
        with open(pidfile) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0


def staged(run: RestoreRun) -> dict[str, float]:
    """RUN's images materialized (every chunk verified) in stage/out, then `criu restore -d` of them
    (the staging path: sandbox.criu.images says why it stays). Seconds per stage."""
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    pipeline.get(run.store, run.files, FileTreeSink(os.path.join(run.stage, "out")), progress=run.progress)
    seconds["materialize"] = time.perf_counter() - t0
    images = os.path.join(run.stage, "out", "images")
    t0 = time.perf_counter()
    with restore_huge_pages("always"):  # CRIU faults every page in: huge pages make that ~1.4x faster
        run.criu.restore(images, detach=True, shell_job=run.shell_job, pidfile=run.pidfile, extra=run.extra)
    seconds["criu_restore"] = time.perf_counter() - t0
    return seconds
