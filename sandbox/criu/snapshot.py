"""A process tree's whole state (CPU through CRIU, GPU through the driver) into the store and back.

Design (chosen, measured in BENCHMARKS.md): CRIU dumps into a staging directory (tmpfs when it fits,
else the store's own tmp/) and the images are ingested into the store (chunked, zero-elided, compressed,
deduplicated, checksummed) while CRIU writes them: the page images are read as they grow
(storage.follow), the small images after CRIU exits; then the staging copy is removed. Restore
materializes the verified images into staging and runs `criu restore` on them. CRIU's --stream /
image-streamer protocol is not used (criu-image-streamer is not packaged for Debian 12).

Guarantees kept here:
- a failed dump (the GPU lock/checkpoint, CRIU itself, or the ingest) leaves every process running,
  GPU state restored and unlocked; if CRIU had already killed the tree, it is restored from staging;
- a damaged snapshot is refused before any process is started (get verifies every chunk first).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from storage import pipeline
from storage.filetree import FileTreeSink
from storage.follow import FollowedDirSource
from storage.store import SnapshotStore

from sandbox.criu import streamer
from sandbox.criu.runner import Criu, CriuError, DumpOptions
from sandbox.gpu.processes import process_tree, uses_gpu


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
        return {"name": self.name, "pids": self.pids, "cuda_pids": self.cuda_pids, "stages": self.stages,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()}, "raw_bytes": self.raw_bytes,
                "new_bytes": self.new_bytes, "dedup_bytes": self.dedup_bytes, "restored_pid": self.restored_pid,
                "images_path": self.images_path}


def _rss_bytes(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


def staging_dir(store: SnapshotStore, need: int, prefer: str | None = None) -> str:
    """A fresh private directory for CRIU images: PREFER, else /dev/shm when NEED fits twice, else the store's tmp/."""
    if prefer:
        base = prefer
    elif os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * need + (256 << 20):
        base = "/dev/shm"
    else:
        base = store.tmp_dir
    return tempfile.mkdtemp(prefix="gpusnap-criu-", dir=base)


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

    def swap_out(self, w: Any, lock_timeout_s: float, progress: Any) -> None:
        """Before CRIU: every CUDA process locked and checkpointed (custom storage: streamed into W)."""
        if self.custom:
            from sandbox.gpu.snapshot import swap_out_custom
            swap_out_custom(self.driver, self.engine, w, self.cuda_pids, lock_timeout_s=lock_timeout_s,
                            progress=progress)
            return
        from sandbox.gpu.checkpoint import checkpoint_all
        from sandbox.gpu.hugepages import thp
        with thp("always"):
            checkpoint_all(self.driver, self.cuda_pids, lock_timeout_s=lock_timeout_s)

    def swap_in(self, store: SnapshotStore, name: str, streams: list[Any]) -> None:
        """After CRIU (restore, or a dump that must leave the tree as it was): GPU state back, unlocked."""
        if self.custom:
            from storage.manifest import Manifest
            from sandbox.gpu.snapshot import swap_in_custom
            swap_in_custom(self.driver, self.engine, store, Manifest(name, [s for s in streams if _is_gpu(s)]),
                           self.cuda_pids)
            return
        from sandbox.gpu.checkpoint import restore_all
        from sandbox.gpu.hugepages import thp
        with thp("always"):
            restore_all(self.driver, self.cuda_pids)


def _is_gpu(stream: Any) -> bool:
    return stream.attrs.get("type") == "blob" and stream.name.startswith("gpu/")


def criu_dump(store: SnapshotStore, pid: int, name: str, *, leave_running: bool = False,
              options: DumpOptions | None = None, replace: bool = False, staging: str | None = None,
              lock_timeout_s: float = 10.0, progress: Any = None, criu: Criu | None = None,
              gpu_driver: Any = None, features: Any = None, device: Any = None) -> CriuReport:
    """The tree at PID into snapshot NAME: GPU state first (custom storage or the driver's host copy,
    as the probe says), then CRIU, its page images ingested as they are written.

    gpu_driver/features/device: the CheckpointDriver, its Features and the engine's Device (default:
    the real driver, probed, and GPU 0); tests pass stand-ins."""
    criu = criu or Criu()
    opts = options or DumpOptions()
    opts = DumpOptions(**{**opts.__dict__, "leave_running": leave_running})
    try:
        pids = process_tree(pid)
    except Exception as e:  # noqa: BLE001 - DiscoveryError
        raise CriuSnapshotError(str(e)) from None
    gpu = _GpuSide.discover(pids, pid, gpu_driver, features, device)
    report = CriuReport(name, pids, gpu.cuda_pids, images_path=streamer.images_path())
    meta = {"kind": "criu", "root_pid": pid, "pids": pids, "cuda_pids": gpu.cuda_pids,
            "criu": ".".join(map(str, criu.version or ())), "options": opts.argv(), "gpu_path": gpu.path}
    with store.writer(name, replace=replace, meta=meta) as w, gpu:
        stage = staging_dir(store, _rss_bytes(pids), staging)
        images = os.path.join(stage, "images")
        os.mkdir(images, 0o700)
        try:
            if gpu.cuda_pids:
                t0 = time.perf_counter()
                gpu.swap_out(w, lock_timeout_s, progress)
                report.seconds["gpu_checkpoint"] = time.perf_counter() - t0
            if report.images_path == "stream":
                _dump_streamed(criu, pid, images, opts, w, report, gpu, leave_running, store, name, progress, pids)
            else:
                _dump_and_ingest(criu, pid, images, opts, w, report, gpu, leave_running, store, name, progress, pids)
                w.commit()
        except BaseException as e:
            if "criu_dump" in report.seconds and not leave_running and report.images_path == "staging":
                # CRIU dumped (and killed) the tree
                _resurrect(criu, images, pids, gpu, store, name, w.streams, e)
            raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    report.raw_bytes, report.new_bytes, report.dedup_bytes = w.stats.raw_bytes, w.stats.bytes_new, w.stats.bytes_dedup
    return report


def _is_page_image(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


def _dump_and_ingest(criu: Criu, pid: int, images: str, opts: DumpOptions, w: Any, report: CriuReport,
                     gpu: _GpuSide, leave_running: bool, store: SnapshotStore, name: str, progress: Any,
                     pids: list[int]) -> None:
    """`criu dump` into IMAGES while the pipeline ingests its page images as they grow
    (storage.follow); the rest of the images after CRIU exits. report.seconds["criu_dump"] is set as
    soon as CRIU has dumped (its images are complete in staging), also when the ingest then fails;
    if CRIU failed, raises its error with the log kept (GPU state restored first). With leave_running
    the GPU state is restored as soon as CRIU is done."""
    done = threading.Event()
    box: dict[str, Any] = {}

    def run_criu() -> None:
        t0 = time.perf_counter()
        try:
            criu.dump(pid, images, opts)
            box["criu_dump"] = time.perf_counter() - t0
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
            th.join()
            if "criu_dump" in box:
                report.seconds["criu_dump"] = box["criu_dump"]
            err = box.get("error")
            if isinstance(err, CriuError):
                if gpu.cuda_pids and "criu_dump" not in box:
                    gpu.swap_in(store, name, w.streams)
                raise err.with_log(keep_log(store, err, f"dump-{name}")) from None
            if err is not None:
                raise err
    if "gpu_resume" in box:
        report.seconds["gpu_resume"] = box["gpu_resume"]
    report.seconds["dump+ingest"] = time.perf_counter() - t0
    report.seconds["ingest_after_dump"] = report.seconds["dump+ingest"] - box["criu_dump"]
    w.meta["ingest_stages"] = report.stages = res.stages.table()
    w.meta["ingested_while_dumping"] = src.followed


def _dump_streamed(criu: Criu, pid: int, images: str, opts: DumpOptions, w: Any, report: CriuReport,
                   gpu: _GpuSide, leave_running: bool, store: SnapshotStore, name: str, progress: Any,
                   pids: list[int]) -> None:
    """`criu dump --stream --leave-stopped` straight into the store (sandbox.criu.streamer), committed
    before the tree is killed; any failure continues the tree, GPU state restored."""
    def gpu_back() -> None:
        if gpu.cuda_pids:
            gpu.swap_in(store, name, w.streams)

    with streamer.StoppedTree(pids, leave_running, gpu_back) as tree:
        def dumped() -> None:
            tree.dumped = True  # from here the tree is stopped (or, leave_running, resumed by CRIU)
            if leave_running:
                gpu_back()

        if progress is not None:
            progress.start(_rss_bytes(pids))
        try:
            res, secs, followed = streamer.dump(criu, pid, images, opts, w, progress=progress, on_dumped=dumped)
        except CriuError as e:
            gpu_back()
            raise e.with_log(keep_log(store, e, f"dump-{name}")) from None
        except BaseException:
            if not tree.dumped:
                gpu_back()  # CRIU failed on the broken pipe and resumed the tree
            raise
        report.seconds.update(secs)
        w.meta["ingest_stages"] = report.stages = res.stages.table()
        w.meta["ingested_while_dumping"] = followed
        w.commit()


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


def _resurrect(criu: Criu, images: str, pids: list[int], gpu: _GpuSide, store: SnapshotStore, name: str,
               streams: list[Any], cause: BaseException) -> None:
    """CRIU killed the tree but the snapshot did not commit: bring the tree back from staging
    (once its pids are free: the killed tree's parent may take a moment to reap it)."""
    try:
        taken = _pids_in_use(pids, grace_s=10.0)
        if taken:
            raise CriuSnapshotError(f"pid(s) {taken} are still taken (the killed tree was not reaped by its parent)")
        criu.restore(images, detach=True)
        if gpu.cuda_pids:
            gpu.swap_in(store, name, streams)
    except Exception as e:  # noqa: BLE001
        raise CriuSnapshotError(f"storing the dump failed ({cause}) and restoring the processes from "
                                f"{images} failed too ({e}); the images are kept there") from None


def _pids_in_use(pids: list[int], grace_s: float = 5.0) -> list[int]:
    """PIDS still taken after a short grace (a just-killed tree can take a moment to be reaped)."""
    deadline = time.monotonic() + grace_s
    while True:
        taken = [p for p in pids if os.path.exists(f"/proc/{p}")]
        if not taken or time.monotonic() >= deadline:
            return taken
        time.sleep(0.05)


def criu_restore(store: SnapshotStore, name: str, *, staging: str | None = None, progress: Any = None,
                 criu: Criu | None = None, gpu_driver: Any = None, device: Any = None) -> CriuReport:
    """Snapshot NAME back: images materialized (verified) into staging, `criu restore`, then the GPU
    state by the path that took it (the driver's host copy, or custom storage from the gpu/ streams)."""
    from storage.manifest import Manifest
    criu = criu or Criu()
    with store.shared():
        m = store.load(name)
        if m.meta.get("kind") != "criu":
            raise CriuSnapshotError(f"snapshot {name!r} is a {m.meta.get('kind')!r} snapshot, not a CRIU one")
        taken = _pids_in_use(m.meta["pids"])
        if taken:
            raise CriuSnapshotError(f"pid(s) {taken} of snapshot {name!r} are in use here; CRIU restores "
                                    "processes with their original pids (stop them, or restore in a new pid namespace)")
        report = CriuReport(name, m.meta["pids"], m.meta.get("cuda_pids", []))
        stage = staging_dir(store, m.size, staging)
        try:
            shell_job = "--shell-job" in m.meta.get("options", [])
            pidfile = os.path.join(stage, "restored.pid")
            files = Manifest(m.name, [s for s in m.streams if not _is_gpu(s)], m.meta)
            if progress is not None:
                progress.start(files.size)
            report.images_path = streamer.images_path()
            if report.images_path == "stream":
                images = os.path.join(stage, "images")
                os.mkdir(images, 0o700)
                try:
                    secs, report.stages["served"] = streamer.restore(criu, store, files, images, shell_job=shell_job,
                                                                     pidfile=pidfile, pids=m.meta["pids"])
                except CriuError as e:
                    raise e.with_log(keep_log(store, e, f"restore-{name}")) from None
                report.seconds.update(secs)
            else:
                t0 = time.perf_counter()
                pipeline.get(store, files, FileTreeSink(os.path.join(stage, "out")), progress=progress)
                report.seconds["materialize"] = time.perf_counter() - t0
                images = os.path.join(stage, "out", "images")
                t0 = time.perf_counter()
                try:
                    from sandbox.gpu.hugepages import thp
                    with thp("always"):  # CRIU faults every page in: huge pages make that ~1.4x faster
                        criu.restore(images, detach=True, shell_job=shell_job, pidfile=pidfile)
                except CriuError as e:
                    raise e.with_log(keep_log(store, e, f"restore-{name}")) from None
                report.seconds["criu_restore"] = time.perf_counter() - t0
            with open(pidfile) as f:
                report.restored_pid = int(f.read().strip())
            if report.cuda_pids:
                from sandbox.gpu.driver import CudaDriver
                t0 = time.perf_counter()
                custom = m.meta.get("gpu_path") == "custom-storage"
                with _GpuSide(report.pids, report.cuda_pids, gpu_driver or CudaDriver(), custom, device) as gpu:
                    gpu.swap_in(store, name, m.streams)
                report.seconds["gpu_restore"] = time.perf_counter() - t0
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return report
