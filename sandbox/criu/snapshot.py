"""A process tree's whole state (CPU through CRIU, GPU through the driver) into the store and back.

Design (chosen, measured in BENCHMARKS.md): CRIU dumps into a staging directory (tmpfs when it fits,
else the store's own tmp/) and the images are ingested into the store (chunked, zero-elided, compressed,
deduplicated, checksummed) while CRIU writes them: the page images are read as they grow
(storage.follow), the small images after CRIU exits; then the staging copy is removed. Restore
materializes the verified images into staging and runs `criu restore` on them. CRIU's --stream /
image-streamer protocol is not used (criu-image-streamer is not packaged for Debian 12).

Guarantees kept here:
- the tree is killed only after its snapshot is committed: CRIU dumps with --leave-stopped, the
  snapshot commits, then gpusnap kills the stopped tree (pid and start time checked);
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

from storage import pipeline, waits
from storage.filetree import FileTreeSink
from storage.follow import FollowedDirSource
from storage.remote import DEFAULT_JOBS, Remote
from storage.remote_fill import RemoteFill, ensure_local
from storage.store import SnapshotStore

from sandbox.ops import journal
from sandbox.criu import streamer
from sandbox.criu.runner import Criu, CriuError, DumpOptions
from sandbox.host.hugepages import thp
from sandbox.gpu.processes import process_tree, uses_gpu
from sandbox.gpu.state import GpuPath
from sandbox.ops.snapshot_meta import CriuMeta
from sandbox.host.interrupts import Interrupted
from sandbox.ops.journal import OpKind, Stage


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

    def __init__(self, pids: list[int], cuda_pids: list[int], driver: Any, custom: bool, device: Any) -> None:
        self.pids, self.cuda_pids, self.driver, self.device = pids, cuda_pids, driver, device
        self.custom = bool(cuda_pids) and custom
        self.engine: Any = None

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
        return cls(pids, cuda, driver, bool(features is not None and features.custom_storage), device)

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
        from sandbox.gpu.state import GpuPath, backend_for
        path = GpuPath.CUSTOM_STORAGE if self.custom else GpuPath.HOST_STAGED
        return backend_for(path, regions=regions, spill=regions.spill() if regions is not None else None)

    def swap_out(self, w: Any, lock_timeout_s: float, progress: Any, op: journal.Op) -> None:
        """Before CRIU: every CUDA process locked and checkpointed (custom storage: streamed into W,
        the chunk references logged in OP's journal for recovery)."""
        from contextlib import nullcontext
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.state import Limits, checkpoint
        with (op.ref_log(w.sync_chunks) if self.custom else nullcontext()) as log:
            regions = EngineRegions.into(self.engine, w, progress, log=log) if self.custom else None
            checkpoint(self.driver, self.cuda_pids, self._backend(regions), Limits(lock_timeout_s=lock_timeout_s))

    def swap_in(self, store: SnapshotStore, name: str, streams: list[Any]) -> None:
        """After CRIU (restore, or a dump that must leave the tree as it was): GPU state back, unlocked."""
        from sandbox.gpu.regions import EngineRegions
        from sandbox.gpu.state import thaw
        regions = (EngineRegions(self.engine, source=store, name=name, streams=[s for s in streams if _is_gpu(s)])
                   if self.custom else None)
        thaw(self.driver, self.cuda_pids, self._backend(regions))


def _is_gpu(stream: Any) -> bool:
    return stream.attrs.get("type") == "blob" and stream.name.startswith("gpu/")


def criu_dump(store: SnapshotStore, pid: int, name: str, *, leave_running: bool = False,
              options: DumpOptions | None = None, replace: bool = False, staging: str | None = None,
              lock_timeout_s: float = 10.0, progress: Any = None, criu: Criu | None = None, tags: Sequence[str] = (),
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
    meta = {"kind": "criu", "root_pid": pid, "pids": pids, "cuda_pids": gpu.cuda_pids,
            "criu": ".".join(map(str, criu.version or ())), "options": opts.argv(), "gpu_path": gpu.path}
    with journal.operation(store.path, OpKind.CRIU_DUMP, name, pids=pids, cuda_pids=tuple(gpu.cuda_pids),
                           gpu_path=gpu.path, leave_running=leave_running) as op, \
            store.writer(name, replace=replace, meta=meta, tags=tuple(tags)) as w, gpu:
        meta["op"] = op.id  # how recovery tells this commit from an older snapshot of the same name
        stage = new_staging(store, _rss_bytes(pids), staging, op)
        images = os.path.join(stage, "images")
        os.mkdir(images, 0o700)
        if opts.action_script is None:
            opts = DumpOptions(**{**opts.__dict__, "action_script": journal.pause_script(images)})
        try:
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
            journal.pause("before-commit")
            op.advance(Stage.COMMITTING)
            w.commit()
            op.advance(Stage.COMMITTED)
            journal.pause("after-commit")
        except BaseException as e:
            # a signal after the commit only hurries the end: the snapshot is there, the kill follows
            if not (op.rec.stage == Stage.COMMITTED and isinstance(e, Interrupted)):
                _undo_dump(op, gpu, leave_running, store, name, w.streams, e)
                raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        if not leave_running:  # committed: now the tree ends, as asked
            kill_tree(op.rec.procs)
    report.raw_bytes, report.new_bytes, report.dedup_bytes = w.stats.raw_bytes, w.stats.bytes_new, w.stats.bytes_dedup
    return report


def _undo_dump(op: journal.Op, gpu: "_GpuSide", leave_running: bool, store: SnapshotStore, name: str,
               streams: list[Any], cause: BaseException) -> None:
    """Put the tree back as it was before the dump, by the stage the dump reached: GPU state back
    once it was touched, and a tree CRIU left stopped running again (SIGCONT). If that fails, the
    journal record stays for `gpusnap recover`."""
    stopped = op.rec.stage.at_least(Stage.DUMPED) and not leave_running
    try:
        resume_tree(op.rec.procs if stopped else (), gpu if op.rec.stage.at_least(Stage.GPU_FROZEN) else None,
                    store, name, streams)
    except Exception as e:  # noqa: BLE001
        op.keep = True
        raise CriuSnapshotError(f"the dump failed ({cause}) and putting the processes back failed too ({e}); "
                                "run `gpusnap recover`") from None


def resume_tree(procs: tuple[journal.Proc, ...], gpu: "_GpuSide | None", store: SnapshotStore, name: str,
                streams: list[Any]) -> None:
    """A tree CRIU left stopped, running again: SIGCONT to each process still the one dumped, then its
    GPU state back and unlocked (idempotent: processes already running are left alone)."""
    for p in procs:
        p.signal(signal.SIGCONT)
    if gpu is None or not gpu.cuda_pids:
        return
    if gpu.custom:
        from sandbox.gpu.driver import ProcessState
        if any(_gpu_state(gpu.driver, p) not in (ProcessState.RUNNING, None) for p in gpu.cuda_pids):
            gpu.swap_in(store, name, streams)
        return
    from sandbox.gpu import state
    state.resume(gpu.driver, list(gpu.cuda_pids))


def _gpu_state(driver: Any, pid: int) -> Any:
    try:
        return driver.get_state(pid)
    except Exception:  # noqa: BLE001 - gone
        return None


def kill_tree(procs: tuple[journal.Proc, ...]) -> None:
    """SIGKILL each process of a committed dump that is still the one dumped (a reused pid is left alone)."""
    for p in procs:
        p.signal(signal.SIGKILL)


def _is_page_image(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


def _dump_and_ingest(criu: Criu, pid: int, images: str, opts: DumpOptions, w: Any, report: CriuReport,
                     gpu: _GpuSide, leave_running: bool, store: SnapshotStore, name: str, progress: Any,
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
            op.advance(Stage.DUMPED)
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
                   gpu: _GpuSide, leave_running: bool, store: SnapshotStore, name: str, progress: Any,
                   pids: list[int], op: journal.Op) -> None:
    """`criu dump --stream` straight into the store (sandbox.criu.streamer): the page data flows from
    CRIU's pipe into the pipeline, no staging copy. The tree is left stopped (journaled as DUMPED once
    CRIU is done) for the caller to commit, then kill; a failure is undone by the caller from the stage
    the journal says. With leave_running the GPU state comes back as soon as CRIU is done."""
    def dumped() -> None:
        op.advance(Stage.DUMPED)
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
                 progress: Any) -> Iterator[RemoteFill | None]:
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


def criu_restore(store: SnapshotStore, name: str, *, staging: str | None = None, progress: Any = None,
                 criu: Criu | None = None, gpu_driver: Any = None, device: Any = None,
                 from_remote: str | None = None, jobs: int = DEFAULT_JOBS) -> CriuReport:
    """Snapshot NAME back: images served (verified) to `criu restore`, then the GPU state by the path
    that took it (the driver's host copy, or custom storage from the gpu/ streams). FROM_REMOTE: a
    store that lacks NAME gets it from that remote (JOBS requests at once) while CRIU restores."""
    criu = criu or Criu()
    journal.require_clean(store.path)
    with store.shared(), _from_remote(store, name, from_remote, jobs, progress) as fill:
        m = fill.manifest if fill is not None else store.load(name)
        meta = CriuMeta.of(m)
        with waits.waiting(waits.TREE_DEATH):
            taken = _pids_in_use(list(meta.pids))
        if taken:
            raise CriuSnapshotError(f"pid(s) {taken} of snapshot {name!r} are in use here; CRIU restores "
                                    "processes with their original pids: stop the processes that hold them, then restore")
        report = CriuReport(name, list(meta.pids), list(meta.cuda_pids))
        with journal.operation(store.path, OpKind.CRIU_RESTORE, name, cuda_pids=tuple(report.cuda_pids),
                               gpu_path=meta.gpu_path.value if meta.gpu_path else None) as op:
            stage = new_staging(store, m.size, staging, op)
            try:
                if fill is not None:
                    fill.start()
                _restore_from(store, m, meta, stage, report, criu, op, None if fill else progress, gpu_driver,
                              device, fill)
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    return report


def _restore_from(store: SnapshotStore, m: Any, meta: CriuMeta, stage: str, report: CriuReport, criu: Criu,
                  op: journal.Op, progress: Any, gpu_driver: Any, device: Any, fill: RemoteFill | None = None) -> None:
    """M's images served to (or materialized in STAGE for) `criu restore`, then the GPU state
    (journaled). FILL: M's chunks are still arriving from a remote; it commits once CRIU is done
    (before the GPU state, which is read from the store), or the restored tree is killed."""
    from storage.manifest import Manifest
    name = m.name
    files = Manifest(m.name, [s for s in m.streams if not _is_gpu(s)], m.meta)
    if progress is not None:
        progress.start(files.size)
    shell_job = meta.shell_job
    pidfile = os.path.join(stage, "restored.pid")
    report.images_path = streamer.images_path()
    journal.pause("before-restore")
    op.advance(Stage.DUMPING)
    if report.images_path == "stream":  # chunks decoded straight into CRIU's pipes: no materialize step
        images = os.path.join(stage, "images")
        os.mkdir(images, 0o700)
        try:
            secs, report.stages["served"] = streamer.restore(criu, store, files, images, shell_job=shell_job,
                                                             pidfile=pidfile, pids=list(meta.pids), arrivals=fill)
        except CriuError as e:
            raise e.with_log(keep_log(store, e, f"restore-{name}")) from None
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
            with thp("always"):  # CRIU faults every page in: huge pages make that ~1.4x faster
                criu.restore(images, detach=True, shell_job=shell_job, pidfile=pidfile)
        except CriuError as e:
            raise e.with_log(keep_log(store, e, f"restore-{name}")) from None
        report.seconds["criu_restore"] = time.perf_counter() - t0
    with open(pidfile) as f:
        report.restored_pid = int(f.read().strip())
    op.advance(Stage.DUMPED, procs=tuple(p for p in (journal.Proc.of(x) for x in report.pids) if p is not None))
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
        custom = meta.gpu_path == GpuPath.CUSTOM_STORAGE
        with _GpuSide(report.pids, report.cuda_pids, gpu_driver or CudaDriver(), custom, device) as gpu:
            gpu.swap_in(store, name, m.streams)
        report.seconds["gpu_restore"] = time.perf_counter() - t0
