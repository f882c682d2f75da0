"""gVisor sandboxes through the store: run (with a pyroute2 network), checkpoint, restore, delete.

checkpoint: `runsc checkpoint` into a staging directory, ingested into the store (page-granular
content-defined chunks, zero-elided, compressed, deduplicated), with runsc's global flags and the
sandbox's network configuration recorded in the snapshot. restore: the images are materialized
(every chunk verified, so a damaged snapshot is refused before anything starts), the network is
recreated with the same address, and `runsc restore` runs with the recorded flags under a new id.
A failed or interrupted checkpoint (SIGTERM/SIGHUP/SIGINT included) leaves the sandbox running; a
failed restore leaves nothing behind. Both are in the operation journal before each step, so that
if gpusnap dies, `gpusnap recover` restarts a sandbox the checkpoint stopped from the staged images
(runsc has no --leave-stopped) and removes the staging.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from storage import pipeline
from storage.filetree import FileTreeSink, FileTreeSource
from storage.store import SnapshotStore

from sandbox import journal
from sandbox import netns as nets
from sandbox.criu.snapshot import new_staging
from sandbox.interrupts import Interrupted
from sandbox.journal import OpKind, Stage
from sandbox.runsc.oci_bundle import add_bind, add_gpus, bundle_netns, load_spec, save_spec, set_bundle_netns
from sandbox.runsc.runner import Runsc, RunscError

from storage.errors import GpusnapError

NET_SIDECAR = "gpusnap-net.json"  # in the bundle: the NetConfig gpusnap made for this sandbox
RUN_SIDECAR = "gpusnap-run.json"  # in the bundle: where the sandbox's output goes
GPU_SIDECAR = "gpusnap-gpu.json"  # in the bundle: GPUs, nvproxy flags, where the GPU agent finds code and store
AGENT_CODE = "/run/gpusnap/code"   # gpusnap's code inside a GPU sandbox (read-only bind)
AGENT_STORE = "/run/gpusnap/store"  # the store inside a GPU sandbox (bind), for custom storage
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RunscSnapshotError(GpusnapError):
    """A sandbox request that cannot be done as asked."""


@dataclass
class RunscReport:
    name: str
    container: str
    seconds: dict[str, float] = field(default_factory=dict)
    raw_bytes: int = 0
    new_bytes: int = 0
    dedup_bytes: int = 0
    address: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "container": self.container, "address": self.address,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "raw_bytes": self.raw_bytes, "new_bytes": self.new_bytes, "dedup_bytes": self.dedup_bytes}


def _hostinet(args: Sequence[str]) -> bool:
    return any(a in ("--network=host", "-network=host") for a in args) or any(
        a in ("--network", "-network") and b == "host" for a, b in zip(args, list(args)[1:]))


def _net_of(bundle: str) -> nets.NetConfig | None:
    try:
        with open(os.path.join(bundle, NET_SIDECAR)) as f:
            return nets.NetConfig.from_dict(json.load(f))
    except FileNotFoundError:
        return None


def _with_reason(e: RunscError, output: str) -> RunscError:
    """runsc -detach shares stderr with the sandbox: take the reason from the output file's tail."""
    if "exit " not in str(e):
        return e
    try:
        with open(output, "rb") as f:
            f.seek(max(0, os.path.getsize(output) - 4096))
            tail = [l for l in f.read().decode(errors="replace").splitlines() if l.strip()]
    except OSError:
        return e
    return RunscError(f"{e}: {tail[-1].strip()}" if tail else str(e))


def _gpu_of(bundle: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(bundle, GPU_SIDECAR)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def prepare_gpu(bundle: str, r: Runsc, gpus: Sequence[int], store_path: str, *, agent: bool = True,
                driver_version: str | None = None) -> list[str]:
    """Make BUNDLE a GPU sandbox: the NVIDIA devices (nvproxy) for GPUS, gpusnap's code and the store
    bind-mounted for the GPU agent; recorded in the bundle. Returns the extra runsc global flags.
    Refuses, before touching the bundle, when this runsc has no nvproxy."""
    gpu_args = r.features().gpu_args(driver_version=driver_version) if gpus else []
    cfg = load_spec(bundle)
    if gpus:
        add_gpus(cfg, gpus)
    if agent:
        add_bind(cfg, CODE_ROOT, AGENT_CODE, readonly=True)
        add_bind(cfg, store_path, AGENT_STORE)
    save_spec(bundle, cfg)
    with open(os.path.join(bundle, GPU_SIDECAR), "w") as f:
        json.dump({"gpus": list(gpus), "runsc_args": gpu_args, "agent": agent}, f)
    return gpu_args


def agent(r: Runsc, cid: str, action: str, *, name: str | None = None, pids: Sequence[int] | None = None,
          timeout: float = 600) -> dict[str, Any]:
    """Run the GPU agent (criu_hooks/gpu_agent.py) inside sandbox CID through `runsc exec`."""
    py = os.environ.get("GPUSNAP_AGENT_PYTHON", "python3")
    argv = [py, "-m", "criu_hooks.gpu_agent", action]
    if name:
        argv += ["--store", AGENT_STORE, "--name", name]
    if pids is not None:
        argv += ["--pids", ",".join(map(str, pids))]
    try:
        out = r.exec(cid, argv, timeout=timeout, env={"PYTHONPATH": AGENT_CODE})
    except RunscError as e:
        raise RunscSnapshotError(f"the GPU agent in {cid!r} failed to {action}: {e}") from None
    try:
        return json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise RunscSnapshotError(f"the GPU agent in {cid!r} gave no report for {action}: {out[-200:]!r}") from None


def run(cid: str, bundle: str, runsc_args: Sequence[str], output: str, net: nets.NetConfig | None = None, *,
        gpus: Sequence[int] = (), gpu_agent: bool = False, store_path: str | None = None,
        driver_version: str | None = None) -> None:
    """Start sandbox CID from BUNDLE; with NET, in its own namespace (made here, recorded in the bundle);
    with GPUS (or gpu_agent), as a GPU sandbox (prepare_gpu) whose GPU state checkpoint handles."""
    r = Runsc(runsc_args)
    if r.state(cid) is not None:
        raise RunscSnapshotError(f"container {cid!r} already exists")
    spec_path = os.path.join(bundle, "config.json")
    original = None
    if gpus or gpu_agent:
        if store_path is None:
            raise RunscSnapshotError("a GPU sandbox needs the store path (for the GPU agent)")
        with open(spec_path) as f:
            original = f.read()
        try:
            r = Runsc([*runsc_args, *prepare_gpu(bundle, r, gpus, store_path, driver_version=driver_version)])
        except BaseException:
            _undo_gpu(bundle, original)
            raise
    if net is not None:
        nets.create(net)
        set_bundle_netns(bundle, net.path)
        with open(os.path.join(bundle, NET_SIDECAR), "w") as f:
            json.dump(net.as_dict(), f)
    with open(os.path.join(bundle, RUN_SIDECAR), "w") as f:
        json.dump({"output": os.path.abspath(output)}, f)
    try:
        with open(output, "ab") as out:
            try:
                r.run(cid, bundle, stdout=out, stderr=out)
            except RunscError as e:
                raise _with_reason(e, output) from None
    except BaseException:
        if net is not None:
            nets.remove(net)
            os.unlink(os.path.join(bundle, NET_SIDECAR))
        if original is not None:
            _undo_gpu(bundle, original)
        raise


def _undo_gpu(bundle: str, original: str) -> None:
    """Put BUNDLE's spec back as it was and forget the GPU record (a GPU sandbox that did not start)."""
    with open(os.path.join(bundle, "config.json"), "w") as f:
        f.write(original)
    try:
        os.unlink(os.path.join(bundle, GPU_SIDECAR))
    except FileNotFoundError:
        pass


def delete(cid: str, runsc_args: Sequence[str]) -> None:
    """Delete the sandbox and the network gpusnap made for it."""
    r = Runsc(runsc_args)
    st = r.state(cid)
    if st is None:
        raise RunscSnapshotError(f"no container {cid!r}")
    r.delete(cid)
    net = _net_of(st["bundle"])
    if net is not None:
        nets.remove(net)


def _gpu_name(name: str) -> str:
    return f"{name}.gpu"


def checkpoint(store: SnapshotStore, cid: str, name: str, runsc_args: Sequence[str], *, leave_running: bool = False,
               replace: bool = False, progress: Any = None) -> RunscReport:
    """Sandbox CID into snapshot NAME: the GPU agent first where it is a GPU sandbox (custom storage
    into snapshot NAME.gpu, or the driver's host copy that runsc then saves), then `runsc checkpoint`
    and the ingest. A failure at any step leaves the sandbox running with its GPU state back."""
    journal.require_clean(store.path)
    r = Runsc(runsc_args, log_dir=os.path.join(store.path, "logs"))
    st = r.state(cid)
    if st is None:
        raise RunscSnapshotError(f"no container {cid!r} (runsc {' '.join(runsc_args)})")
    if st.get("status") != "running":
        raise RunscSnapshotError(f"container {cid!r} is {st.get('status')}, not running")
    if _hostinet(runsc_args):
        raise RunscSnapshotError(f"cannot checkpoint {cid!r}: it uses the host network (--network=host), which "
                                 "runsc cannot checkpoint; run it with --network=none or its own netstack")
    bundle = st["bundle"]
    net = _net_of(bundle)
    gpu = _gpu_of(bundle)
    if gpu and gpu.get("runsc_args"):
        r = Runsc([*runsc_args, *gpu["runsc_args"]], log_dir=r.log_dir)
    report = RunscReport(name, cid, address=net.address if net else None)
    meta = {"kind": "runsc", "container": cid, "runsc_args": list(runsc_args), "bundle": bundle,
            "net": net.as_dict() if net else None, "netns_path": bundle_netns(bundle), "gpu": None}
    sandbox = {"container": cid, "runsc_args": list(r.global_args), "bundle": bundle,
               "net": net.as_dict() if net else None, "gpu_report": None}
    with journal.operation(store.path, OpKind.RUNSC_CHECKPOINT, name, leave_running=leave_running,
                           runsc=sandbox) as op, store.writer(name, replace=replace, meta=meta) as w:
        meta["op"] = op.id  # how recovery tells this commit from an older snapshot of the same name
        stage = new_staging(store, 1 << 30, None, op)
        images = os.path.join(stage, "images")
        os.mkdir(images, 0o700)
        gpu_rep: dict[str, Any] | None = None
        try:
            if gpu and gpu.get("agent"):
                op.advance(Stage.GPU_FROZEN)
                t0 = time.perf_counter()
                gpu_rep = agent(r, cid, "checkpoint", name=_gpu_name(name))
                op.advance(runsc={**sandbox, "gpu_report": gpu_rep})
                meta["gpu"] = {**gpu, "agent_report": gpu_rep}
                report.seconds["gpu_checkpoint"] = time.perf_counter() - t0
            journal.pause("before-dump")
            op.advance(Stage.DUMPING)
            t0 = time.perf_counter()
            try:
                # runsc's own -leave-running hangs or exits 120 with Debian's 20221219 build here
                # (seen 2026-11-29); gpusnap restarts the sandbox from the checkpoint it just took
                # runsc compresses its image unless told not to (newer builds): an uncompressed image
                # is what the store can deduplicate and compress per chunk
                r.checkpoint(cid, images, uncompressed=r.features().can_store_uncompressed)
            except RunscError as e:
                if "hostinet" in str(e):
                    raise RunscSnapshotError(f"cannot checkpoint {cid!r}: it uses the host network, which this "
                                             "runsc cannot checkpoint") from None
                raise
            report.seconds["runsc_checkpoint"] = time.perf_counter() - t0
            op.advance(Stage.DUMPED)
            if leave_running:
                t0 = time.perf_counter()
                _restart(r, cid, bundle, images, net)
                _gpu_back(r, cid, gpu_rep)
                report.seconds["restart"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            journal.pause("ingest")
            src = FileTreeSource([images])
            if progress is not None:
                progress.start(src.total_bytes)
            pipeline.put(w, src, progress=progress, chunker="pages")
            journal.pause("before-commit")
            op.advance(Stage.COMMITTING)
            w.commit()
            op.advance(Stage.COMMITTED)
            report.seconds["ingest"] = time.perf_counter() - t0
            journal.pause("after-commit")
        except Interrupted:
            if op.rec.stage != Stage.COMMITTED:  # after the commit a signal only hurries the end
                _undo_checkpoint(r, cid, bundle, images, net, leave_running, report, gpu_rep, store, op)
                raise
        except BaseException as e:
            _undo_checkpoint(r, cid, bundle, images, net, leave_running, report, gpu_rep, store, op, e)
            raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    report.raw_bytes, report.new_bytes, report.dedup_bytes = w.stats.raw_bytes, w.stats.bytes_new, w.stats.bytes_dedup
    return report


def _undo_checkpoint(r: Runsc, cid: str, bundle: str, images: str, net: nets.NetConfig | None, leave_running: bool,
                     report: RunscReport, gpu_rep: dict[str, Any] | None, store: SnapshotStore, op: journal.Op,
                     cause: BaseException | None = None) -> None:
    """The sandbox running again as before the checkpoint: restarted from the staged images if runsc
    had stopped it, GPU state back, the GPU snapshot of this attempt removed. If that fails, the
    journal record stays for `gpusnap recover`."""
    try:
        _put_back(r, cid, bundle, images, net, leave_running, report, gpu_rep, store)
    except Exception as e:  # noqa: BLE001
        op.keep = True
        raise RunscSnapshotError(f"the checkpoint failed ({cause or 'interrupted'}) and restarting {cid!r} failed "
                                 f"too ({e}); run `gpusnap recover`") from None


def _put_back(r: Runsc, cid: str, bundle: str, images: str, net: nets.NetConfig | None, leave_running: bool,
              report: RunscReport, gpu_rep: dict[str, Any] | None, store: SnapshotStore) -> None:
    state = r.state(cid)
    if state is not None and state.get("status") != "running" and os.listdir(images):
        # runsc stopped it but the snapshot did not commit: bring it back from staging
        _restart(r, cid, bundle, images, net)
    if not leave_running or "restart" not in report.seconds:
        _gpu_back(r, cid, gpu_rep)
    if gpu_rep and gpu_rep.get("snapshot") and store.exists(gpu_rep["snapshot"]):
        store.remove(gpu_rep["snapshot"])


def _gpu_back(r: Runsc, cid: str, rep: dict[str, Any] | None) -> None:
    """The agent's restore for the CUDA processes its checkpoint reported (none: nothing to do)."""
    if rep and rep.get("cuda_pids"):
        agent(r, cid, "restore", name=rep.get("snapshot"), pids=rep["cuda_pids"])


def _restart(r: Runsc, cid: str, bundle: str, images: str, net: nets.NetConfig | None) -> None:
    """Run CID again, under the same id, from the checkpoint images just taken."""
    try:
        with open(os.path.join(bundle, RUN_SIDECAR)) as f:
            output = json.load(f)["output"]
    except (OSError, ValueError, KeyError):
        output = os.devnull
    r.delete(cid)
    with open(output, "ab") as out:
        r.restore(cid, bundle, images, stdout=out, stderr=out)


def restore(store: SnapshotStore, name: str, cid: str, bundle: str, *, runsc_args: Sequence[str] | None = None,
            output: str, progress: Any = None) -> RunscReport:
    journal.require_clean(store.path)
    with store.shared():
        m = store.load(name)
        if m.meta.get("kind") != "runsc":
            raise RunscSnapshotError(f"snapshot {name!r} is a {m.meta.get('kind')!r} snapshot, not a runsc one")
        args = list(runsc_args) if runsc_args else list(m.meta["runsc_args"])
        gpu = m.meta.get("gpu") or {}
        r = Runsc([*args, *gpu.get("runsc_args", [])], log_dir=os.path.join(store.path, "logs"))
        if r.state(cid) is not None:
            raise RunscSnapshotError(f"container {cid!r} already exists; restore under a new id")
        if not os.path.exists(os.path.join(bundle, "config.json")):
            raise RunscSnapshotError(f"{bundle}: no config.json (not an OCI bundle)")
        net = nets.NetConfig.from_dict(m.meta["net"]) if m.meta.get("net") else None
        report = RunscReport(name, cid, address=net.address if net else None)
        with journal.operation(store.path, OpKind.RUNSC_RESTORE, name,
                               runsc={"container": cid, "runsc_args": [*args, *gpu.get("runsc_args", [])],
                                      "bundle": bundle, "net": m.meta.get("net"), "gpu_report": None}) as op:
            stage = new_staging(store, m.size, None, op)
            made_net = False
            try:
                t0 = time.perf_counter()
                pipeline.get(store, m, FileTreeSink(os.path.join(stage, "out")), progress=progress)
                report.seconds["materialize"] = time.perf_counter() - t0
                if gpu:
                    prepare_gpu(bundle, Runsc(args), gpu.get("gpus", []), store.path, agent=bool(gpu.get("agent")))
                if net is not None:
                    if not nets.exists(net):
                        nets.create(net)
                        made_net = True
                    set_bundle_netns(bundle, net.path)
                    with open(os.path.join(bundle, NET_SIDECAR), "w") as f:
                        json.dump(net.as_dict(), f)
                t0 = time.perf_counter()
                journal.pause("before-restore")
                op.advance(Stage.DUMPING)
                with open(output, "ab") as out:
                    try:
                        r.restore(cid, bundle, os.path.join(stage, "out", "images"), stdout=out,
                                  stderr=out)
                    except RunscError as e:
                        raise _with_reason(e, output) from None
                report.seconds["runsc_restore"] = time.perf_counter() - t0
                op.advance(Stage.DUMPED)
                journal.pause("after-restore")
                if gpu.get("agent_report", {}).get("cuda_pids"):
                    t0 = time.perf_counter()
                    _gpu_back(r, cid, gpu["agent_report"])
                    report.seconds["gpu_restore"] = time.perf_counter() - t0
            except BaseException:
                if r.state(cid) is not None:
                    try:
                        r.delete(cid)
                    except RunscError:
                        pass
                if made_net and net is not None:
                    nets.remove(net)
                raise
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    return report
