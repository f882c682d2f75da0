"""A process tree's whole state (CPU through CRIU, GPU through the driver) into the store and back: the two
entry points, criu_dump and criu_restore, and the stages their journal records name.

Design (chosen, measured in BENCHMARKS.md): by default CRIU's images stream (`criu --stream`, gpusnap
itself serving CRIU's image-streamer protocol) straight into the store on a dump (chunked,
zero-elided, compressed, deduplicated, checksummed) and out of it on a restore, with the large page
runs written by gpusnap after CRIU (the split fill); GPUSNAP_CRIU_IMAGES=staging takes the other
path (sandbox.criu.images: both, and why the staging path stays). The parts, each in its module:
the wire protocol (protocol), the dump's capture source (capture), the restore's serve source
(serve) and split (split), the CRIU thread of a dump and its two paths (dump), the two ways a
restore gets its images (restore), the restored tasks (restored), the operation's directory
(staging), the GPU side (gpu_side). Every failure path runs the operation's one undo
(sandbox.criu.operations), the same one `gpusnap recover` runs after a crash.

Guarantees kept here:
- the tree is killed only after its snapshot is committed: CRIU dumps with --leave-stopped, the
  snapshot commits, then gpusnap kills the stopped tree (pid and start time checked), all of it: what
  CRIU froze is read from /proc once CRIU is done (nothing forks then), so a child forked while CRIU
  was freezing the tree is journaled, recorded in the snapshot's pids, and killed (or resumed) with it;
- a failed or interrupted dump (the GPU lock/checkpoint, CRIU itself, the ingest, SIGTERM/SIGHUP/
  SIGINT) leaves every process running, GPU state restored and unlocked, staging removed;
- every step is in the operation journal before it starts, so that if gpusnap itself dies,
  `gpusnap recover` resumes the stopped tree (or, when the snapshot committed, finishes the kill);
- a damaged snapshot is refused before any process is started (get verifies every chunk first);
- a restore from a remote (`--from`) commits the local snapshot only once every chunk is local and
  verified; if the remote fails meanwhile, CRIU's pipe breaks and the restore fails like one of a
  damaged chunk, and a tree CRIU had restored is killed: nothing runs half-restored.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from storage.api import Progress
from storage.api import encodeprocs
from storage.api import fdread
from storage.api import waits
from storage.api import DEFAULT_JOBS
from storage.api import SnapshotStore

from sandbox.ops import journal
from sandbox.criu.gpu_side import GpuSide, is_gpu_stream
from sandbox.criu import netlock
from sandbox.criu.criu_options import RestoreOptions
from sandbox.criu.images import images_path, restore_path
from sandbox.criu.parent import choose_parent
from sandbox.criu.protocol import dump_pipe_size
from sandbox.criu.report import CriuReport, CriuSnapshotError
from sandbox.criu.restored import boot_ticks, restored_procs
from sandbox.criu.runner import Criu, CriuError, DumpOptions
from sandbox.criu.staging import keep_log, new_staging, rss_bytes
from sandbox.host import hugepages
from sandbox.host.dumpwrites import dump_packs_direct
from sandbox.host.processes import Proc, held_state, process_tree
from sandbox.gpu.state import GpuPath, plan as gpu_plan
from sandbox.ops.hooks import Hook, resume_meta
from sandbox.ops.snapshot_meta import CriuMeta, GpuInfo
from sandbox.host.interrupts import Interrupted
from sandbox.ops.journal import OpKind, Stage
from sandbox.ops.operations import GpuAccess, Undo, undone_on_failure
import sandbox.criu.operations  # noqa: F401 - registers CriuDump and CriuRestore, the undos this flow runs

if TYPE_CHECKING:  # imported where used: a restore needs neither the dump side nor the remote's client, a dump
    # not the restore side (each import is start-up time of every call: issue 61's fixed cost)
    from sandbox.criu import restore
    from sandbox.criu.dump import DumpContext
    from storage.api import RemoteFill
    from sandbox.gpu.state import EarlyRestore

__all__ = ["CriuReport", "CriuSnapshotError", "criu_dump", "criu_restore", "describe_pids", "kill_tree", "new_staging"]


def criu_dump(store: SnapshotStore, pid: int, name: str, *, leave_running: bool = False,
              options: DumpOptions | None = None, replace: bool = False, staging: str | None = None,
              lock_timeout_s: float = 10.0, progress: Progress | None = None, criu: Criu | None = None, tags: Sequence[str] = (),
              gpu_driver: Any = None, features: Any = None, device: Any = None, parent: str | None = None,
              resume: Hook | None = None) -> CriuReport:
    """The tree at PID into snapshot NAME: GPU state first (custom storage or the driver's host copy,
    as the probe says), then CRIU (the tree left stopped), its page images ingested as they are
    written, the commit, and only then the kill (unless leave_running).

    gpu_driver/features/device: the CheckpointDriver, its Features and the engine's Device (default:
    the real driver, probed, and GPU 0); tests pass stand-ins. PARENT: the snapshot whose chunks the
    changed ones are stored as deltas against (sandbox.criu.parent; None: every chunk whole). RESUME:
    the workload's resume step, recorded (MACed) in the snapshot for its restore (sandbox.ops.hooks)."""
    from sandbox.criu.dump import DumpContext  # the dump side: imported by dumps only
    criu = criu or Criu()
    journal.require_clean(store.path)
    encodeprocs.check_settings()  # a bad setting fails the dump here, before anything is frozen
    dump_pipe_size()
    pipe_reads = fdread.describe()
    direct_packs = dump_packs_direct()  # (a bad GPUSNAP_DUMP_DIRECT refused before anything is frozen)
    hugepages.policy()
    opts = options or DumpOptions()
    opts = DumpOptions(**{**opts.__dict__, "leave_running": leave_running, "leave_stopped": not leave_running})
    if opts.tcp_established:  # CRIU's network lock can work here (else the cause and the choices, nothing frozen)
        netlock.require("criu dump", opts.network_lock, criu.binary)
    try:
        pids = process_tree(pid)
    except Exception as e:  # noqa: BLE001 - DiscoveryError
        raise CriuSnapshotError(str(e)) from None
    base = choose_parent(store, parent)
    gpu = GpuSide.discover(pids, pid, gpu_driver, features, device)
    report = CriuReport(name, pids, gpu.cuda_pids, images_path=images_path())
    if report.images_path == "stream":
        report.pipe_reads = pipe_reads
    usage: dict[int, dict[str, int]] = {}
    if gpu.cuda_pids:  # what `criu restore --device-map` checks a map against
        from sandbox.gpu.device_map import usage_of
        known = {g["uuid"] for g in gpu.gpus}
        usage = {int(p): {u: n for u, n in per.items() if u in known}
                 for p, per in usage_of(gpu.driver, gpu.cuda_pids).items() if any(u in known for u in per)}
    held = tuple(p for p in (Proc.of(x) for x in pids if held_state(x)) if p is not None)  # before CRIU seizes any
    with journal.operation(store.path, OpKind.CRIU_DUMP, name, pids=pids, cuda_pids=tuple(gpu.cuda_pids),
                           gpu_path=gpu.path, leave_running=leave_running, held=held) as op:
        # op and op_mac: how recovery tells this operation's commit from any other manifest of the name
        meta = CriuMeta(pid, tuple(pids), tuple(gpu.cuda_pids), ".".join(map(str, criu.version or ())),
                        tuple(opts.argv()), GpuPath(gpu.path) if gpu.path else None,
                        gpus=tuple(GpuInfo(g["index"], g["uuid"], g["name"]) for g in gpu.gpus), gpu_bytes=usage,
                        extra={"op": op.id, "op_mac": op.commit_mac(pids),
                               **resume_meta(op, name, resume)}).to_json()
        with store.writer(name, replace=replace, meta=meta, tags=tuple(tags), direct_packs=direct_packs) as w, gpu:
            _dump_in(DumpContext(store, name, op, w, criu, pid, pids, opts, gpu, report, leave_running, progress,
                                 parent=base), staging, lock_timeout_s)
    report.parent = base.name if base is not None else None
    report.raw_bytes, report.new_bytes, report.dedup_bytes = w.stats.raw_bytes, w.stats.bytes_new, w.stats.bytes_dedup
    report.pack_writes = w.pack_writes
    return report


def _dump_in(ctx: DumpContext, staging: str | None, lock_timeout_s: float) -> None:
    """The dump's stages inside its journal record and writer; on a failure, the operation's undo
    (sandbox.criu.operations.CriuDump) from the stage the record reached."""
    from sandbox.criu import dump
    op, w, gpu, report = ctx.op, ctx.w, ctx.gpu, ctx.report
    stage = new_staging(ctx.store, rss_bytes(ctx.pids), staging, op)
    images = os.path.join(stage, "images")
    os.mkdir(images, 0o700)
    opts = ctx.opts
    if opts.action_script is None:
        opts = DumpOptions(**{**opts.__dict__, "action_script": journal.pause_script(images)})
    ctx = dataclasses.replace(ctx, images=images, opts=opts)
    # a signal after the commit only hurries the end: the snapshot is there, the kill follows
    after_commit = lambda e: op.rec.stage == Stage.COMMITTED and isinstance(e, Interrupted)  # noqa: E731
    try:
        with undone_on_failure(op, Undo(ctx.store, GpuAccess.of_flow(gpu.driver, gpu.engine)), CriuSnapshotError,
                               what="dump", keep_going=after_commit):
            if gpu.cuda_pids:
                op.advance(Stage.GPU_FROZEN)
                t0 = time.perf_counter()
                gpu.swap_out(w, lock_timeout_s, ctx.progress, op)
                report.seconds["gpu_checkpoint"] = time.perf_counter() - t0
            journal.pause("before-dump")
            (dump.streamed if report.images_path == "stream" else dump.staged)(ctx)
            if not ctx.leave_running:  # what CRIU froze, children forked during the dump included
                report.pids = w.meta["pids"] = [p.pid for p in op.rec.procs]
                w.meta["op_mac"] = op.commit_mac(report.pids)  # the MAC names the pids the commit names
            journal.pause("before-commit")
            op.advance(Stage.COMMITTING)
            w.commit()
            op.advance(Stage.COMMITTED)
            journal.pause("after-commit")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if not ctx.leave_running:  # committed: now the tree ends, as asked
        kill_tree(op.rec.procs)


def kill_tree(procs: tuple[journal.Proc, ...]) -> None:
    """SIGKILL each process of a committed dump that is still the one dumped (a reused pid is left
    alone), and every descendant it has now: the tree is stopped, so that is all CRIU froze."""
    for p in journal.with_descendants(procs):
        p.signal(signal.SIGKILL)


def describe_pids(pids: list[int]) -> str:
    """Who holds each of PIDS, for an error a user can act on: 'pid 7 (sleep, state T, ppid 1, session 5)'."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            state, ppid, _pgrp, sid = stat[stat.rindex(")") + 2:].split()[:4]
            out.append(f"pid {pid} ({comm}, state {state}, ppid {ppid}, session {sid})")
        except (OSError, ValueError):
            out.append(f"pid {pid} (gone now)")
    return ", ".join(out)


def _held(e: CriuError, pids: list[int]) -> CriuError:
    """E, naming who holds the snapshot's pids when CRIU could not fork one (a pid taken meanwhile)."""
    if "File exists" not in e.reason:
        return e
    taken = [p for p in pids if os.path.exists(f"/proc/{p}")]
    return CriuError(f"{e.reason}; held by {describe_pids(taken)}" if taken else e.reason, e.log_tail, e.log_path,
                     e.what)


def _pids_in_use(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """PIDS still taken after a short grace (a just-killed tree can take a moment to be reaped)."""
    deadline = time.monotonic() + grace_s
    while True:
        taken = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if not taken or time.monotonic() >= deadline:
            return taken
        time.sleep(0.05)


@contextmanager
def _from_remote(store: SnapshotStore, name: str, remote: str | None, jobs: int,
                 progress: Progress | None) -> Iterator[RemoteFill | None]:
    """NAME on its way from REMOTE when this store lacks it: a RemoteFill the streamed restore reads
    through while it fetches. The staging path reads every image before CRIU starts, so there the
    snapshot is pulled first. None when NAME is local (or no remote was named)."""
    if remote is None or store.exists(name):
        yield None
        return
    from storage.api import Remote
    from storage.api import RemoteFill, ensure_local
    if images_path() != "stream":
        ensure_local(store, name, remote, progress=progress, jobs=jobs)
        yield None
    else:
        with RemoteFill(Remote.open(store, remote, jobs), store, name, progress=progress) as fill:
            yield fill


def criu_restore(store: SnapshotStore, name: str, *, staging: str | None = None, progress: Progress | None = None,
                 criu: Criu | None = None, gpu_driver: Any = None, device: Any = None,
                 from_remote: str | None = None, jobs: int = DEFAULT_JOBS, device_map: Sequence[str] = (),
                 features: Any = None, tcp_established: bool = False,
                 options: RestoreOptions | None = None) -> CriuReport:
    """Snapshot NAME back: images served (verified) to `criu restore`, then the GPU state by the path
    that took it (the driver's host copy, or custom storage from the gpu/ streams). FROM_REMOTE: a
    store that lacks NAME gets it from that remote (JOBS requests at once) while CRIU restores.
    DEVICE_MAP (OLD=NEW items): the GPU state onto other GPUs, the map checked before CRIU starts.
    The dump's --tcp-established/--ext-unix-sk/--file-locks are given to CRIU again;
    TCP_ESTABLISHED asks for the first even when the dump did not record it. OPTIONS: what the user adds
    (checked: sandbox.criu.criu_options); --tcp-close restores the connections closed instead."""
    entered = time.monotonic()  # the interpreter and the imports before it (the report's marks)
    criu = criu or Criu()
    journal.require_clean(store.path)
    hugepages.policy()  # a bad GPUSNAP_THP fails here, before a process is restored
    with store.shared(), _from_remote(store, name, from_remote, jobs, progress) as fill, ExitStack() as held:
        m = (fill.manifest if fill is not None else None) or store.load(name)
        loaded = time.monotonic()  # the store's lock, its journal and the manifest since `entered`
        meta = CriuMeta.of(m)
        path = restore_path(meta.staged_restore)  # stream, unless CRIU reads some of its images late
        pulled = None
        if fill is not None and path != "stream":  # the staged path reads every image first: all of it here
            pulled, fill = fill.finish(), None
        with waits.waiting(waits.TREE_DEATH):
            taken = _pids_in_use(list(meta.pids))
        if taken:
            raise CriuSnapshotError(f"pid(s) of snapshot {name!r} in use here: {describe_pids(taken)}; CRIU restores "
                                    "processes with their original pids: stop the processes that hold them, then restore")
        gpu_map: dict[str, str] = {}
        if device_map:  # checked before a process is restored: a bad map changes nothing
            if not meta.cuda_pids:
                from sandbox.gpu.device_map import DeviceMapError
                raise DeviceMapError(f"--device-map: snapshot {name!r} holds no GPU state")
            from sandbox.gpu import device_map as dmap
            if gpu_driver is None:
                from sandbox.gpu.driver import CudaDriver
                gpu_driver = CudaDriver()
            gpu_map = dmap.plan(device_map, meta.gpus_json, dmap.gpus_here(gpu_driver, features), meta.gpu_bytes).gpu_map
        # the restore is accepted (its pids free, its map checked): a local streamed restore's disk starts
        # on what it reads first now, while the journal, the CUDA driver and THP get ready
        from sandbox.criu.serve import early_reads_of  # the restore side: imported by restores only
        early = held.enter_context(early_reads_of(store, m)) if fill is None and path == "stream" else None
        early_begin = time.monotonic()
        report = CriuReport(name, list(meta.pids), list(meta.cuda_pids), images_path=path)
        if pulled is not None:
            report.stages["pull"] = pulled.as_dict()
        with journal.operation(store.path, OpKind.CRIU_RESTORE, name, cuda_pids=tuple(report.cuda_pids),
                               gpu_path=meta.gpu_path.value if meta.gpu_path else None) as op:
            stage = new_staging(store, m.size, staging, op)
            gpu = GpuAccess(driver=lambda: gpu_driver or _cuda_driver(), device=lambda: 0 if device is None else device)
            try:
                with undone_on_failure(op, Undo(store, gpu), CriuSnapshotError, what="restore"):
                    try:
                        if fill is not None:
                            fill.start()
                        run = _restore_run(criu, store, m, meta, stage, None if fill else progress, fill,
                                           ("--tcp-established",) if tcp_established else (), early, options)
                        _restore_from(run, m, meta, report, op, fill, gpu_driver, device, gpu_map)
                    except BaseException:
                        if early is not None:
                            early.stop()  # no read of the snapshot goes on while the restore is undone
                        raise
                    if "served" in report.stages and "monotonic" in report.stages["served"]:
                        report.stages["served"]["monotonic"].update(
                            entered=entered, loaded=loaded, **({"early_begin": early_begin} if early is not None else {}))
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    return report


# dump options that CRIU needs again on restore (a snapshot's own options say which were used)
RESTORE_TOO = ("--tcp-established", "--ext-unix-sk", "--file-locks")


def _cuda_driver() -> Any:
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


def _restore_run(criu: Criu, store: SnapshotStore, m: Any, meta: CriuMeta, stage: str, progress: Progress | None,
                 fill: RemoteFill | None, tcp: tuple[str, ...], early: Any = None,
                 options: RestoreOptions | None = None) -> restore.RestoreRun:
    """The `criu restore` of M's CRIU images (its gpu/ streams left out) in STAGE: the dump's options
    that CRIU needs again (its network lock method included), TCP (asked for even when the dump did not
    record it), and the user's OPTIONS (with --tcp-close, no --tcp-established)."""
    from storage.api import Manifest
    from sandbox.criu import restore
    files = Manifest(m.name, [s for s in m.streams if not is_gpu_stream(s)], m.meta)
    options = options or RestoreOptions()
    extra = tuple(o for o in meta.options if o in RESTORE_TOO) + tuple(o for o in tcp if o not in meta.options)
    if options.tcp_close:
        extra = tuple(o for o in extra if o != "--tcp-established")
    lock = options.network_lock or netlock.method_of(meta.options)
    if "--tcp-established" in extra:  # CRIU unlocks the connections the dump locked: the same method
        netlock.require("criu restore", lock, criu.binary)
    extra += dataclasses.replace(options, network_lock=lock).argv()
    return restore.RestoreRun(criu, store, files, stage, list(meta.pids), meta.shell_job, extra, progress=progress,
                              arrivals=fill, early=early)


def _restore_from(run: restore.RestoreRun, m: Any, meta: CriuMeta, report: CriuReport, op: journal.Op,
                  fill: RemoteFill | None, gpu_driver: Any, device: Any, gpu_map: dict[str, str]) -> None:
    """RUN's images served to (or materialized for) `criu restore`, then the GPU state of M (journaled).
    FILL: M's chunks are still arriving from a remote (RUN's arrivals); it commits once CRIU is done
    (before the GPU state, which is read from the store), or the restored tree is killed."""
    store, name = run.store, m.name
    if run.progress is not None:
        run.progress.start(run.files.size)
    journal.pause("before-restore")
    op.advance(Stage.DUMPING)
    born_after = boot_ticks()  # what this restore makes starts after this

    def restored_stopped(tree: list[int]) -> None:  # CRIU is done, the tree stopped for the split fill: journaled first
        op.advance(Stage.FILLING, procs=restored_procs(tree, born_after))
        journal.pause("split-fill")

    run = dataclasses.replace(run, on_stopped=restored_stopped, on_fill_done=lambda: op.journal.mark_filled(op.id))
    with ExitStack() as held:
        gpu_side = {"gpu_side_begin": time.monotonic()}  # the driver loaded, THP set: the report's marks
        early = _early_gpu(held, run, report, meta, fill, gpu_driver, device, gpu_map)
        gpu_side["gpu_side_done"] = time.monotonic()
        if early is not None:
            run = dataclasses.replace(run, fill_first=fill_order(report.cuda_pids, meta.gpu_bytes),
                                      on_filled=early[1].start)
        _restore_tree(run, m, meta, report, op, fill, born_after)
        journal.pause("after-restore")
        marks = report.stages.get("served", {}).get("monotonic")
        if marks is not None and early is not None:
            marks.update(gpu_side)
        if report.cuda_pids:
            t0 = time.perf_counter()
            if marks is not None:
                marks["gpu_begin"] = time.monotonic()
            if early is not None:
                gpu, started = early
                gpu.swap_in(store, name, m.streams, gpu_map, meta.gpu_bytes, early=started)
                report.stages["gpu_early"] = {str(p): round(s, 3) for p, s in started.seconds.items()}
            else:
                with GpuSide(report.pids, report.cuda_pids, gpu_driver or _cuda_driver(),
                             gpu_plan(recorded=meta.gpu_path), device) as gpu:
                    gpu.swap_in(store, name, m.streams, gpu_map, meta.gpu_bytes)
            report.seconds["gpu_restore"] = time.perf_counter() - t0
            if marks is not None:
                marks["gpu_done"] = time.monotonic()


def fill_order(cuda_pids: Sequence[int], gpu_bytes: Any) -> tuple[int, ...]:
    """The CUDA processes in the order the split fill completes them: most GPU memory first (GPU_BYTES:
    the snapshot's {pid: {uuid: bytes}}). Each one's driver copy (one core per process) then starts
    as soon as its host memory is in, the longest first, and overlaps the fill of the others."""
    def held(p: int) -> int:
        return sum((gpu_bytes or {}).get(p, {}).values())
    return tuple(sorted(cuda_pids, key=held, reverse=True))


def early_gpu_on() -> bool:
    """$GPUSNAP_EARLY_GPU=0 turns the early driver restores off (for measuring): the GPU state of every
    process then comes back after the whole fill."""
    return os.environ.get("GPUSNAP_EARLY_GPU", "1").strip() != "0"


def _early_gpu(held: ExitStack, run: restore.RestoreRun, report: CriuReport, meta: CriuMeta, fill: Any,
               gpu_driver: Any, device: Any, gpu_map: dict[str, str]) -> "tuple[GpuSide, EarlyRestore] | None":
    """Where the driver's host copy restores a local streamed restore's CUDA processes: the GPU side
    and its EarlyRestore, entered in HELD with THP set for the fill and the copies together (so it
    stays set from the first copy to the last). None elsewhere: custom storage (its bytes come from
    the store, not from the process), the staged path, a restore from a remote, or turned off."""
    plan = gpu_plan(recorded=meta.gpu_path)
    if not (report.cuda_pids and report.images_path == "stream" and fill is None and not plan.streams
            and early_gpu_on()):
        return None
    from sandbox.gpu.state import restore_huge_pages
    held.enter_context(restore_huge_pages(plan.thp_mode))
    gpu = held.enter_context(GpuSide(report.pids, report.cuda_pids, gpu_driver or _cuda_driver(), plan, device))
    started = gpu.early_restore(gpu_map, meta.gpu_bytes)
    if started is None:
        return None
    return gpu, held.enter_context(started)


def _restore_tree(run: restore.RestoreRun, m: Any, meta: CriuMeta, report: CriuReport, op: journal.Op,
                  fill: RemoteFill | None, born_after: int) -> None:
    """`criu restore` of RUN (streamed or staged), the restored tree journaled; FILL's pull finished."""
    from sandbox.criu import restore
    store, name = run.store, m.name
    try:
        if report.images_path == "stream":  # chunks decoded straight into CRIU's pipes: no materialize step
            secs, report.stages["served"] = restore.streamed(run)
        else:
            secs = restore.staged(run)
    except CriuError as e:
        raise _held(e, list(meta.pids)).with_log(keep_log(store, e, f"restore-{name}")) from None
    report.seconds.update(secs)
    connected = report.stages["served"].pop("criu_connected_monotonic", None) if "served" in report.stages else None
    if fill is not None and connected is not None:  # from the start of the pull
        report.seconds["criu_started"] = connected - fill.began
        report.seconds["tree_running"] = time.monotonic() - fill.began
    with open(run.pidfile) as f:
        report.restored_pid = int(f.read().strip())
    # this restore's processes: the tree CRIU made under the pidfile's root, never just the pids the
    # snapshot names (a hostile one may name anyone's)
    served = report.stages.get("served") or {}
    tree = served["restored_pids"] if "restored_pids" in served else restore.restored_tree(
        report.restored_pid, restore.pstree_of(os.path.join(run.stage, "out", "images")), born_after)
    op.advance(Stage.DUMPED, procs=restored_procs(tree, born_after))
    if fill is not None:  # CRIU has read its images; what is left (GPU streams) arrives, then the commit
        try:
            pulled = fill.finish()
        except BaseException:
            kill_tree(op.rec.procs)
            raise
        report.stages["pull"] = pulled.as_dict()
        report.seconds["all_local"] = fill.seconds_to_all_local or 0.0
