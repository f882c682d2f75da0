"""A process tree's whole state (CPU through CRIU, GPU through the driver) into the store and back.

Design (chosen, measured in BENCHMARKS.md): by default CRIU's images stream (`criu --stream`, gpusnap
itself serving CRIU's image-streamer protocol: sandbox.criu.streamer) straight into the store on a
dump (chunked, zero-elided, compressed, deduplicated, checksummed) and out of it on a restore, with
the large page runs written by gpusnap after CRIU (the split fill). GPUSNAP_CRIU_IMAGES=staging takes
the other path: CRIU dumps into a staging directory (tmpfs when it fits, else the store's tmp/) whose
page images are ingested as they grow (storage.follow), and a restore materializes the verified images
there first. Every failure path runs the operation's one undo (sandbox.ops.operations), the same one
`gpusnap recover` runs after a crash.

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

import os
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from storage.progress import Progress
from storage import pipeline, waits
from storage.filetree import FileTreeSink
from storage.follow import FollowedDirSource
from storage.remote import DEFAULT_JOBS, Remote
from storage.remote_fill import RemoteFill, ensure_local
from storage.store import SnapshotStore

from sandbox.ops import journal
from sandbox.criu import streamer
from sandbox.criu.runner import Criu, CriuError, DumpOptions
from sandbox.gpu.processes import uses_gpu
from sandbox.host.processes import process_tree
from sandbox.gpu.state import GpuPath, Plan as GpuPlan, plan as gpu_plan, restore_huge_pages
from sandbox.ops.snapshot_meta import CriuMeta, GpuInfo
from sandbox.host.interrupts import Interrupted
from sandbox.ops.journal import OpKind, Stage
from sandbox.ops.operations import GpuAccess, Undo, undone_on_failure
import sandbox.criu.operations  # noqa: F401 - registers CriuDump and CriuRestore, the undos this flow runs


from storage.errors import GpusnapError

class CriuSnapshotError(GpusnapError):
    """A CRIU dump/restore through the store that cannot go ahead or could not be rolled back."""


@dataclass
class CriuReport:
    name: str
    pids: list[int]
    cuda_pids: list[int]
    seconds: dict[str, float] = field(default_factory=dict)
    raw_bytes: int = 0
    new_bytes: int = 0
    dedup_bytes: int = 0
    restored_pid: int | None = None
    stages: dict[str, Any] = field(default_factory=dict)
    images_path: str = "staging"  # how CRIU's images moved: "stream" (sandbox.criu.streamer) or "staging"

    def as_dict(self) -> dict[str, Any]:
        """A dump's report (bytes of images, written, deduplicated) or a restore's (the restored pid):
        each carries only its own fields."""
        d = {"name": self.name, "pids": self.pids, "cuda_pids": self.cuda_pids, "stages": self.stages,
             "seconds": {k: round(v, 3) for k, v in self.seconds.items()}, "images_path": self.images_path}
        if self.restored_pid is not None:
            return {**d, "restored_pid": self.restored_pid}
        return {**d, "raw_bytes": self.raw_bytes, "new_bytes": self.new_bytes, "dedup_bytes": self.dedup_bytes}


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def _staging_base(store: SnapshotStore, need: int, prefer: str | None) -> str:
    """Where CRIU's images are staged: PREFER, else /dev/shm when NEED fits twice, else the store's tmp/."""
    if prefer:
        return prefer
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * need + (256 << 20):
        return "/dev/shm"
    return store.tmp_dir


def new_staging(store: SnapshotStore, need: int, prefer: str | None, op: journal.Op) -> str:
    """A fresh private directory for operation OP's images, named after it and recorded in its journal before it is made
    (so that recovery finds it whenever it exists)."""
    path = os.path.join(os.path.abspath(_staging_base(store, need, prefer)), f"gpusnap-op-{op.id}")
    op.advance(staging=path)
    os.mkdir(path, 0o700)
    return path


class _GpuSide:
    """The CUDA processes of a tree and how their GPU state moves: the driver's host copy (it then
    travels inside CRIU's images) or custom storage (the engine streams it into the same snapshot as
    gpu/PID/INDEX streams and CRIU dumps processes that hold no GPU bytes). The probe decides."""

    def __init__(self, pids: list[int], cuda_pids: list[int], driver: Any, plan: GpuPlan, device: Any) -> None:
        self.pids, self.cuda_pids, self.driver, self.device = pids, cuda_pids, driver, device
        self.plan = plan
        self.custom = bool(cuda_pids) and plan.streams
        self.engine: Any = None
        self.gpus: list[dict[str, Any]] = []  # this machine's GPUs, as the snapshot records them

    @classmethod
    def discover(cls, pids: list[int], root: int, driver: Any, features: Any, device: Any,
                 recorded: list[int] | None = None) -> "_GpuSide":
        if recorded is not None:
            cuda = list(recorded)
        elif driver is not None:
            from sandbox.gpu.processes import cuda_processes
            cuda = [p for p in cuda_processes(root, driver) if p in pids]
        else:
            cuda = [p for p in pids if uses_gpu(p)]
        if cuda and driver is None:
            from sandbox.gpu.driver import CudaDriver
            driver = CudaDriver()
        if cuda and features is None:
            from sandbox.gpu.driver import probe
            features = probe(driver)
        side = cls(pids, cuda, driver, gpu_plan(features=features if cuda else None), device)
        side.gpus = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in features.gpus] if cuda else []
        return side

    @property
    def path(self) -> str | None:
        return None if not self.cuda_pids else "custom-storage" if self.custom else "host-staged"

    def __enter__(self) -> "_GpuSide":
        if self.custom:
            from storage.gpu_engine import GpuEngine
            self.engine = GpuEngine(0 if self.device is None else self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.engine is not None:
            self.engine.close()

    def _backend(self, regions: Any) -> Any:
        return self.plan.backend(regions)

    def swap_out(self, w: Any, lock_timeout_s: float, progress: Progress | None, op: journal.Op) -> None:
        """Before CRIU: every CUDA process locked and checkpointed (custom storage: streamed into W,
        the chunk references logged in OP's journal for recovery)."""
        from contextlib import nullcontext
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.state import Limits, checkpoint
        with (op.ref_log(w.sync_chunks) if self.custom else nullcontext()) as log:
            regions = EngineRegions.into(self.engine, w, progress, log=log) if self.custom else None
            checkpoint(self.driver, self.cuda_pids, self._backend(regions), Limits(lock_timeout_s=lock_timeout_s))

    def swap_in(self, store: SnapshotStore, name: str, streams: list[Any], gpu_map: dict[str, str] | None = None,
                usage: Any = None) -> None:
        """After CRIU (restore, or a dump that must leave the tree as it was): GPU state back, unlocked;
        onto other GPUs by GPU_MAP (checked by sandbox.gpu.device_map.plan; USAGE: the snapshot's
        gpu_bytes, which GPUs each process held)."""
        from sandbox.gpu.device_map import for_restore
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.state import thaw
        regions = (EngineRegions(self.engine, source=store, name=name, streams=[s for s in streams if _is_gpu(s)])
                   if self.custom else None)
        thaw(for_restore(self.driver, gpu_map or {}, usage), self.cuda_pids, self._backend(regions),
             gpu_map=gpu_map or None)


def _is_gpu(stream: Any) -> bool:
    return stream.attrs.get("type") == "blob" and stream.name.startswith("gpu/")


def criu_dump(store: SnapshotStore, pid: int, name: str, *, leave_running: bool = False,
              options: DumpOptions | None = None, replace: bool = False, staging: str | None = None,
              lock_timeout_s: float = 10.0, progress: Progress | None = None, criu: Criu | None = None, tags: Sequence[str] = (),
              gpu_driver: Any = None, features: Any = None, device: Any = None) -> CriuReport:
    """The tree at PID into snapshot NAME: GPU state first (custom storage or the driver's host copy,
    as the probe says), then CRIU (the tree left stopped), its page images ingested as they are
    written, the commit, and only then the kill (unless leave_running).

    gpu_driver/features/device: the CheckpointDriver, its Features and the engine's Device (default:
    the real driver, probed, and GPU 0); tests pass stand-ins."""
    criu = criu or Criu()
    journal.require_clean(store.path)
    opts = options or DumpOptions()
    opts = DumpOptions(**{**opts.__dict__, "leave_running": leave_running, "leave_stopped": not leave_running})
    try:
        pids = process_tree(pid)
    except Exception as e:  # noqa: BLE001 - DiscoveryError
        raise CriuSnapshotError(str(e)) from None
    gpu = _GpuSide.discover(pids, pid, gpu_driver, features, device)
    report = CriuReport(name, pids, gpu.cuda_pids, images_path=streamer.images_path())
    usage: dict[int, dict[str, int]] = {}
    if gpu.cuda_pids:  # what `criu restore --device-map` checks a map against
        from sandbox.gpu.device_map import usage_of
        known = {g["uuid"] for g in gpu.gpus}
        usage = {int(p): {u: n for u, n in per.items() if u in known}
                 for p, per in usage_of(gpu.driver, gpu.cuda_pids).items() if any(u in known for u in per)}
    with journal.operation(store.path, OpKind.CRIU_DUMP, name, pids=pids, cuda_pids=tuple(gpu.cuda_pids),
                           gpu_path=gpu.path, leave_running=leave_running) as op:
        # op and op_mac: how recovery tells this operation's commit from any other manifest of the name
        meta = CriuMeta(pid, tuple(pids), tuple(gpu.cuda_pids), ".".join(map(str, criu.version or ())),
                        tuple(opts.argv()), GpuPath(gpu.path) if gpu.path else None,
                        gpus=tuple(GpuInfo(g["index"], g["uuid"], g["name"]) for g in gpu.gpus), gpu_bytes=usage,
                        extra={"op": op.id, "op_mac": op.commit_mac(pids)}).to_json()
        with store.writer(name, replace=replace, meta=meta, tags=tuple(tags)) as w, gpu:
            _dump_in(op, w, gpu, criu, pid, opts, report, leave_running, store, name, staging, lock_timeout_s,
                     progress, pids)
    report.raw_bytes, report.new_bytes, report.dedup_bytes = w.stats.raw_bytes, w.stats.bytes_new, w.stats.bytes_dedup
    return report


def _dump_in(op: journal.Op, w: Any, gpu: "_GpuSide", criu: Criu, pid: int, opts: DumpOptions, report: CriuReport,
             leave_running: bool, store: SnapshotStore, name: str, staging: str | None, lock_timeout_s: float,
             progress: Progress | None, pids: list[int]) -> None:
    """The dump's stages inside its journal record and writer; on a failure, the operation's undo
    (sandbox.criu.operations.CriuDump) from the stage the record reached."""
    stage = new_staging(store, _rss_bytes(pids), staging, op)
    images = os.path.join(stage, "images")
    os.mkdir(images, 0o700)
    if opts.action_script is None:
        opts = DumpOptions(**{**opts.__dict__, "action_script": journal.pause_script(images)})
    # a signal after the commit only hurries the end: the snapshot is there, the kill follows
    after_commit = lambda e: op.rec.stage == Stage.COMMITTED and isinstance(e, Interrupted)  # noqa: E731
    try:
        with undone_on_failure(op, Undo(store, GpuAccess.of_flow(gpu.driver, gpu.engine)), CriuSnapshotError,
                               what="dump", keep_going=after_commit):
            if gpu.cuda_pids:
                op.advance(Stage.GPU_FROZEN)
                t0 = time.perf_counter()
                gpu.swap_out(w, lock_timeout_s, progress, op)
                report.seconds["gpu_checkpoint"] = time.perf_counter() - t0
            journal.pause("before-dump")
            if report.images_path == "stream":
                _dump_streamed(criu, pid, images, opts, w, report, gpu, leave_running, store, name, progress, pids, op)
            else:
                _dump_and_ingest(criu, pid, images, opts, w, report, gpu, leave_running, store, name, progress,
                                 pids, op)
            if not leave_running:  # what CRIU froze, children forked during the dump included
                report.pids = w.meta["pids"] = [p.pid for p in op.rec.procs]
                w.meta["op_mac"] = op.commit_mac(report.pids)  # the MAC names the pids the commit names
            journal.pause("before-commit")
            op.advance(Stage.COMMITTING)
            w.commit()
            op.advance(Stage.COMMITTED)
            journal.pause("after-commit")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    if not leave_running:  # committed: now the tree ends, as asked
        kill_tree(op.rec.procs)


def kill_tree(procs: tuple[journal.Proc, ...]) -> None:
    """SIGKILL each process of a committed dump that is still the one dumped (a reused pid is left
    alone), and every descendant it has now: the tree is stopped, so that is all CRIU froze."""
    for p in journal.with_descendants(procs):
        p.signal(signal.SIGKILL)


def _frozen(op: journal.Op, leave_running: bool) -> dict[str, Any]:
    """The journal's change once CRIU has dumped: unless the tree runs on, the processes CRIU left
    stopped (the list taken before the dump lacks any child forked while CRIU froze the tree)."""
    return {} if leave_running else {"procs": journal.with_descendants(op.rec.procs)}


def _is_page_image(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


def _dump_and_ingest(criu: Criu, pid: int, images: str, opts: DumpOptions, w: Any, report: CriuReport,
                     gpu: _GpuSide, leave_running: bool, store: SnapshotStore, name: str, progress: Progress | None,
                     pids: list[int], op: journal.Op) -> None:
    """`criu dump` into IMAGES while the pipeline ingests its page images as they grow
    (storage.follow); the rest of the images after CRIU exits. report.seconds["criu_dump"] is set as
    soon as CRIU has dumped (its images are complete in staging), also when the ingest then fails;
    if CRIU failed, raises its error with the log kept (the caller's undo puts the GPU state back).
    With leave_running the GPU state is restored as soon as CRIU is done. A signal during the ingest
    is raised only after CRIU has ended (its end decides what the undo must do)."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run_criu() -> None:
        t0 = time.perf_counter()
        try:
            op.advance(Stage.DUMPING)
            criu.dump(pid, images, opts)
            box["criu_dump"] = time.perf_counter() - t0
            op.advance(Stage.DUMPED, **_frozen(op, leave_running))
            journal.pause("ingest")  # the pipeline is mid-ingest, waiting for CRIU's end
            if leave_running and gpu.cuda_pids:
                t1 = time.perf_counter()
                gpu.swap_in(store, name, w.streams)
                box["gpu_resume"] = time.perf_counter() - t1
        except BaseException as e:  # noqa: BLE001 - handed to the ingesting thread
            box["error"] = e
        finally:
            done.set()

    t0 = time.perf_counter()
    with FollowedDirSource(images, follow=_is_page_image, writer_done=done, writer_failed=lambda: box.get("error"),
                           handoff_min=2 * pipeline.SEGMENT) as src:
        th = threading.Thread(target=run_criu, name="gpusnap-criu-dump", daemon=True)
        th.start()
        if progress is not None:
            progress.start(_rss_bytes(pids))
        try:
            res = pipeline.put(w, src, progress=progress, chunker="pages")
        finally:
            interrupted = _join(th)  # CRIU's end is awaited even when a signal came: the undo needs it
            if "criu_dump" in box:
                report.seconds["criu_dump"] = box["criu_dump"]
            if interrupted is not None:
                raise interrupted
            err = box.get("error")
            if isinstance(err, CriuError):
                raise err.with_log(keep_log(store, err, f"dump-{name}")) from None
            if err is not None:
                raise err
    if "gpu_resume" in box:
        report.seconds["gpu_resume"] = box["gpu_resume"]
    report.seconds["dump+ingest"] = time.perf_counter() - t0
    report.seconds["ingest_after_dump"] = report.seconds["dump+ingest"] - box["criu_dump"]
    w.meta["ingest_stages"] = report.stages = res.stages.table()
    w.meta["ingested_while_dumping"] = src.followed


def _join(th: threading.Thread) -> BaseException | None:
    """Join TH even if a signal's exception interrupts the wait; that exception, if one came."""
    caught = None
    while th.is_alive():
        try:
            th.join()
        except BaseException as e:  # noqa: BLE001 - Interrupted (later signals are ignored)
            caught = caught or e
    return caught


def _dump_streamed(criu: Criu, pid: int, images: str, opts: DumpOptions, w: Any, report: CriuReport,
                   gpu: _GpuSide, leave_running: bool, store: SnapshotStore, name: str, progress: Progress | None,
                   pids: list[int], op: journal.Op) -> None:
    """`criu dump --stream` straight into the store (sandbox.criu.streamer): the page data flows from
    CRIU's pipe into the pipeline, no staging copy. The tree is left stopped (journaled as DUMPED once
    CRIU is done) for the caller to commit, then kill; a failure is undone by the caller from the stage
    the journal says. With leave_running the GPU state comes back as soon as CRIU is done."""
    def dumped() -> None:
        op.advance(Stage.DUMPED, **_frozen(op, leave_running))
        journal.pause("ingest")  # CRIU is done, the pipeline still draining its pipes
        if leave_running and gpu.cuda_pids:
            t1 = time.perf_counter()
            gpu.swap_in(store, name, w.streams)
            report.seconds["gpu_resume"] = time.perf_counter() - t1

    if progress is not None:
        progress.start(_rss_bytes(pids))
    op.advance(Stage.DUMPING)
    try:
        res, secs, followed = streamer.dump(criu, pid, images, opts, w, progress=progress, on_dumped=dumped)
    except CriuError as e:
        raise e.with_log(keep_log(store, e, f"dump-{name}")) from None
    report.seconds.update(secs)
    w.meta["ingest_stages"] = report.stages = res.stages.table()
    w.meta["ingested_while_dumping"] = followed


def keep_log(store: SnapshotStore, e: CriuError, what: str) -> str:
    """Copy CRIU's log out of the staging directory (removed afterwards) into STORE/logs/."""
    logs = os.path.join(store.path, "logs")
    os.makedirs(logs, mode=0o700, exist_ok=True)
    dst = os.path.join(logs, f"criu-{what}-{time.strftime('%Y%m%dT%H%M%S')}.log")
    try:
        shutil.copyfile(e.log_path or "", dst)
    except OSError:
        return e.log_path or "(no log)"
    return dst


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
    elif streamer.images_path() != "stream":
        ensure_local(store, name, remote, progress=progress, jobs=jobs)
        yield None
    else:
        with RemoteFill(Remote.open(store, remote, jobs), store, name, progress=progress) as fill:
            yield fill


def criu_restore(store: SnapshotStore, name: str, *, staging: str | None = None, progress: Progress | None = None,
                 criu: Criu | None = None, gpu_driver: Any = None, device: Any = None,
                 from_remote: str | None = None, jobs: int = DEFAULT_JOBS, device_map: Sequence[str] = (),
                 features: Any = None, tcp_established: bool = False) -> CriuReport:
    """Snapshot NAME back: images served (verified) to `criu restore`, then the GPU state by the path
    that took it (the driver's host copy, or custom storage from the gpu/ streams). FROM_REMOTE: a
    store that lacks NAME gets it from that remote (JOBS requests at once) while CRIU restores.
    DEVICE_MAP (OLD=NEW items): the GPU state onto other GPUs, the map checked before CRIU starts.
    The dump's --tcp-established/--ext-unix-sk/--file-locks are given to CRIU again;
    TCP_ESTABLISHED asks for the first even when the dump did not record it."""
    criu = criu or Criu()
    journal.require_clean(store.path)
    with store.shared(), _from_remote(store, name, from_remote, jobs, progress) as fill:
        m = (fill.manifest if fill is not None else None) or store.load(name)
        meta = CriuMeta.of(m)
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
        report = CriuReport(name, list(meta.pids), list(meta.cuda_pids))
        with journal.operation(store.path, OpKind.CRIU_RESTORE, name, cuda_pids=tuple(report.cuda_pids),
                               gpu_path=meta.gpu_path.value if meta.gpu_path else None) as op:
            stage = new_staging(store, m.size, staging, op)
            gpu = GpuAccess(driver=lambda: gpu_driver or _cuda_driver(), device=lambda: 0 if device is None else device)
            try:
                with undone_on_failure(op, Undo(store, gpu), CriuSnapshotError, what="restore"):
                    if fill is not None:
                        fill.start()
                    _restore_from(store, m, meta, stage, report, criu, op, None if fill else progress, gpu_driver,
                                  device, fill, gpu_map, ("--tcp-established",) if tcp_established else ())
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    return report


# dump options that CRIU needs again on restore (a snapshot's own options say which were used)
RESTORE_TOO = ("--tcp-established", "--ext-unix-sk", "--file-locks")


def _restored(pids: list[int], born_after: int) -> tuple[journal.Proc, ...]:
    """The snapshot's PIDS that this restore made (started after BORN_AFTER), by pid and start time."""
    procs = (journal.Proc.of(x) for x in pids)
    return tuple(p for p in procs if p is not None and p.start >= born_after - 1)


def _cuda_driver() -> Any:
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


def _restore_from(store: SnapshotStore, m: Any, meta: CriuMeta, stage: str, report: CriuReport, criu: Criu,
                  op: journal.Op, progress: Progress | None, gpu_driver: Any, device: Any, fill: RemoteFill | None = None,
                  gpu_map: dict[str, str] | None = None, tcp: tuple[str, ...] = ()) -> None:
    """M's images served to (or materialized in STAGE for) `criu restore`, then the GPU state
    (journaled). FILL: M's chunks are still arriving from a remote; it commits once CRIU is done
    (before the GPU state, which is read from the store), or the restored tree is killed."""
    from storage.manifest import Manifest
    name = m.name
    files = Manifest(m.name, [s for s in m.streams if not _is_gpu(s)], m.meta)
    if progress is not None:
        progress.start(files.size)
    shell_job = meta.shell_job
    extra = tuple(o for o in meta.options if o in RESTORE_TOO) + tuple(o for o in tcp if o not in meta.options)
    pidfile = os.path.join(stage, "restored.pid")
    report.images_path = streamer.images_path()
    journal.pause("before-restore")
    op.advance(Stage.DUMPING)
    born_after = streamer.boot_ticks()  # what this restore makes starts after this

    def restored_stopped() -> None:  # CRIU is done, the tree stopped for the split fill: journaled first
        op.advance(Stage.FILLING, procs=_restored(report.pids, born_after))
        journal.pause("split-fill")

    if report.images_path == "stream":  # chunks decoded straight into CRIU's pipes: no materialize step
        images = os.path.join(stage, "images")
        os.mkdir(images, 0o700)
        try:
            secs, report.stages["served"] = streamer.restore(criu, store, files, images, shell_job=shell_job,
                                                             pidfile=pidfile, pids=list(meta.pids), arrivals=fill,
                                                             extra=extra, on_stopped=restored_stopped)
        except CriuError as e:
            raise _held(e, list(meta.pids)).with_log(keep_log(store, e, f"restore-{name}")) from None
        report.seconds.update(secs)
        connected = report.stages["served"].pop("criu_connected_monotonic", None)
        if fill is not None and connected is not None:  # from the start of the pull
            report.seconds["criu_started"] = connected - fill.began
            report.seconds["tree_running"] = time.monotonic() - fill.began
    else:
        t0 = time.perf_counter()
        pipeline.get(store, files, FileTreeSink(os.path.join(stage, "out")), progress=progress)
        report.seconds["materialize"] = time.perf_counter() - t0
        images = os.path.join(stage, "out", "images")
        t0 = time.perf_counter()
        try:
            with restore_huge_pages("always"):  # CRIU faults every page in: huge pages make that ~1.4x faster
                criu.restore(images, detach=True, shell_job=shell_job, pidfile=pidfile, extra=extra)
        except CriuError as e:
            raise _held(e, list(meta.pids)).with_log(keep_log(store, e, f"restore-{name}")) from None
        report.seconds["criu_restore"] = time.perf_counter() - t0
    with open(pidfile) as f:
        report.restored_pid = int(f.read().strip())
    op.advance(Stage.DUMPED, procs=_restored(report.pids, born_after))
    if fill is not None:  # CRIU has read its images; what is left (GPU streams) arrives, then the commit
        try:
            pulled = fill.finish()
        except BaseException:
            kill_tree(op.rec.procs)
            raise
        report.stages["pull"] = pulled.as_dict()
        report.seconds["all_local"] = fill.seconds_to_all_local or 0.0
    journal.pause("after-restore")
    if report.cuda_pids:
        from sandbox.gpu.driver import CudaDriver
        t0 = time.perf_counter()
        with _GpuSide(report.pids, report.cuda_pids, gpu_driver or CudaDriver(), gpu_plan(recorded=meta.gpu_path),
                      device) as gpu:
            gpu.swap_in(store, name, m.streams, gpu_map, meta.gpu_bytes)
        report.seconds["gpu_restore"] = time.perf_counter() - t0
