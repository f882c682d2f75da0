"""gVisor sandboxes through the store: run (with a pyroute2 network), checkpoint, restore, delete.

checkpoint: `runsc checkpoint` into a staging directory, ingested into the store (page-granular
content-defined chunks, zero-elided, compressed, deduplicated), with runsc's global flags and the
sandbox's network configuration recorded in the snapshot. restore: the images are materialized
(every chunk verified, so a damaged snapshot is refused before anything starts), the network is
recreated with the same address, and `runsc restore` runs with the recorded flags under a new id.
A failed checkpoint leaves the sandbox running; a failed restore leaves nothing behind.
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

from sandbox import netns as nets
from sandbox.criu.snapshot import staging_dir
from sandbox.runsc.oci_bundle import add_bind, add_gpus, bundle_netns, load_spec, save_spec, set_bundle_netns
from sandbox.runsc import records
from sandbox.runsc.records import Kind
from sandbox.runsc.runner import Runsc, RunscError

from storage.errors import GpusnapError

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
    output: str | None = None           # restore: where the restored sandbox's stdout/stderr go
    recorded_output: str | None = None  # restore: where the checkpointed sandbox's went

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "container": self.container, "address": self.address,
                "output": self.output, "recorded_output": self.recorded_output,
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "raw_bytes": self.raw_bytes, "new_bytes": self.new_bytes, "dedup_bytes": self.dedup_bytes}


def _hostinet(args: Sequence[str]) -> bool:
    return any(a in ("--network=host", "-network=host") for a in args) or any(
        a in ("--network", "-network") and b == "host" for a, b in zip(args, list(args)[1:]))


def _net_of(r: Runsc, cid: str) -> nets.NetConfig | None:
    d = records.read(r.root, cid, Kind.NET)
    return nets.NetConfig.from_dict(d) if d else None


def check_bundle(bundle: str) -> None:
    """BUNDLE must be a directory holding config.json (an OCI bundle); a one-line error otherwise."""
    if not os.path.isdir(bundle):
        raise RunscSnapshotError(f"--bundle {bundle}: no such directory")
    if not os.path.isfile(os.path.join(bundle, "config.json")):
        raise RunscSnapshotError(f"--bundle {bundle}: no config.json (not an OCI bundle)")


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


def prepare_gpu(bundle: str, r: Runsc, cid: str, gpus: Sequence[int], store_path: str, *, agent: bool = True,
                driver_version: str | None = None) -> list[str]:
    """Make BUNDLE a GPU sandbox: the NVIDIA devices (nvproxy) for GPUS, gpusnap's code and the store
    bind-mounted for the GPU agent; recorded for CID (records.py). Returns the extra runsc global flags.
    Refuses, before touching the bundle, when this runsc has no nvproxy."""
    gpu_args = r.features().gpu_args(driver_version=driver_version) if gpus else []
    cfg = load_spec(bundle)
    if gpus:
        add_gpus(cfg, gpus)
    if agent:
        add_bind(cfg, CODE_ROOT, AGENT_CODE, readonly=True)
        add_bind(cfg, store_path, AGENT_STORE)
    save_spec(bundle, cfg)
    records.write(r.root, cid, Kind.GPU, {"gpus": list(gpus), "runsc_args": gpu_args, "agent": agent})
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
    """Start sandbox CID from BUNDLE; with NET, in its own namespace (made here); with GPUS (or
    gpu_agent), as a GPU sandbox (prepare_gpu) whose GPU state checkpoint handles. What gpusnap made is
    recorded for CID (records.py, not in the bundle) and undone, record included, if the start fails."""
    records.check_id(cid)
    check_bundle(bundle)
    r = Runsc(runsc_args)
    if r.state(cid) is not None:
        raise RunscSnapshotError(f"container {cid!r} already exists under runsc root {r.root}")
    records.forget(r.root, cid)  # whatever a sandbox of this id that runsc no longer knows left
    spec_path = os.path.join(bundle, "config.json")
    original = None
    if gpus or gpu_agent or net is not None:  # the spec is changed below: put back if the start fails
        with open(spec_path) as f:
            original = f.read()
    if gpus or gpu_agent:
        if store_path is None:
            raise RunscSnapshotError("a GPU sandbox needs the store path (for the GPU agent)")
        try:
            r = Runsc([*runsc_args, *prepare_gpu(bundle, r, cid, gpus, store_path, driver_version=driver_version)])
        except BaseException:
            _put_back(bundle, original, r, cid)
            raise
    if net is not None:
        try:
            nets.create(net)  # refuses a namespace that exists already (not ours: left alone)
        except BaseException:
            if original is not None:
                _put_back(bundle, original, r, cid)
            raise
        set_bundle_netns(bundle, net.path)
        records.write(r.root, cid, Kind.NET, net.as_dict())
    records.write(r.root, cid, Kind.RUN, {"output": os.path.abspath(output)})
    try:
        with open(output, "ab") as out:
            try:
                r.run(cid, bundle, stdout=out, stderr=out)
            except RunscError as e:
                raise _with_reason(e, output) from None
    except BaseException:
        if net is not None:
            nets.remove(net)
        if original is not None:
            _put_back(bundle, original, r, cid)
        records.forget(r.root, cid)
        raise


def _put_back(bundle: str, original: str, r: Runsc, cid: str) -> None:
    """Put BUNDLE's spec back as it was and forget CID's records (a sandbox that did not start)."""
    with open(os.path.join(bundle, "config.json"), "w") as f:
        f.write(original)
    records.forget(r.root, cid)


def delete(cid: str, runsc_args: Sequence[str]) -> None:
    """Delete the sandbox, the network gpusnap made for it and gpusnap's record of it. runsc's own
    reason when it cannot find exactly CID (none, or an ambiguous id)."""
    r = Runsc(runsc_args)
    r.lookup(cid)
    r.delete(cid)
    net = _net_of(r, cid)
    if net is not None:
        nets.remove(net)
    records.forget(r.root, cid)


def _gpu_name(name: str) -> str:
    return f"{name}.gpu"


def checkpoint(store: SnapshotStore, cid: str, name: str, runsc_args: Sequence[str], *, leave_running: bool = False,
               replace: bool = False, progress: Any = None) -> RunscReport:
    """Sandbox CID into snapshot NAME: the GPU agent first where it is a GPU sandbox (custom storage
    into snapshot NAME.gpu, or the driver's host copy that runsc then saves), then `runsc checkpoint`
    and the ingest. A failure at any step leaves the sandbox running with its GPU state back."""
    r = Runsc(runsc_args, log_dir=os.path.join(store.path, "logs"))
    st = r.lookup(cid)
    if st.get("status") != "running":
        raise RunscSnapshotError(f"container {cid!r} is {st.get('status')}, not running")
    if _hostinet(runsc_args):
        raise RunscSnapshotError(f"cannot checkpoint {cid!r}: it uses the host network (--network=host), which "
                                 "runsc cannot checkpoint; run it with --network=none or its own netstack")
    bundle = st["bundle"]
    net = _net_of(r, cid)
    gpu = records.read(r.root, cid, Kind.GPU)
    if gpu and gpu.get("runsc_args"):
        r = Runsc([*runsc_args, *gpu["runsc_args"]], log_dir=r.log_dir)
    report = RunscReport(name, cid, address=net.address if net else None)
    meta = {"kind": "runsc", "container": cid, "runsc_args": list(runsc_args), "bundle": bundle,
            "net": net.as_dict() if net else None, "netns_path": bundle_netns(bundle), "gpu": None,
            "output": (records.read(r.root, cid, Kind.RUN) or {}).get("output")}
    with store.writer(name, replace=replace, meta=meta) as w:
        stage = staging_dir(store, 1 << 30)
        images = os.path.join(stage, "images")
        os.mkdir(images, 0o700)
        gpu_rep: dict[str, Any] | None = None
        try:
            if gpu and gpu.get("agent"):
                t0 = time.perf_counter()
                gpu_rep = agent(r, cid, "checkpoint", name=_gpu_name(name))
                meta["gpu"] = {**gpu, "agent_report": gpu_rep}
                report.seconds["gpu_checkpoint"] = time.perf_counter() - t0
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
            if leave_running:
                t0 = time.perf_counter()
                _restart(r, cid, bundle, images, net)
                _gpu_back(r, cid, gpu_rep)
                report.seconds["restart"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            src = FileTreeSource([images])
            if progress is not None:
                progress.start(src.total_bytes)
            pipeline.put(w, src, progress=progress, chunker="pages")
            w.commit()
            report.seconds["ingest"] = time.perf_counter() - t0
        except BaseException:
            state = r.state(cid)
            if state is not None and state.get("status") != "running" and os.listdir(images):
                # runsc stopped it but the snapshot did not commit: bring it back from staging
                _restart(r, cid, bundle, images, net)
            if not leave_running or "restart" not in report.seconds:
                _gpu_back(r, cid, gpu_rep)
            if gpu_rep and gpu_rep.get("snapshot") and store.exists(gpu_rep["snapshot"]):
                store.remove(gpu_rep["snapshot"])
            raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    report.raw_bytes, report.new_bytes, report.dedup_bytes = w.stats.raw_bytes, w.stats.bytes_new, w.stats.bytes_dedup
    return report


def _gpu_back(r: Runsc, cid: str, rep: dict[str, Any] | None) -> None:
    """The agent's restore for the CUDA processes its checkpoint reported (none: nothing to do)."""
    if rep and rep.get("cuda_pids"):
        agent(r, cid, "restore", name=rep.get("snapshot"), pids=rep["cuda_pids"])


def _restart(r: Runsc, cid: str, bundle: str, images: str, net: nets.NetConfig | None) -> None:
    """Run CID again, under the same id, from the checkpoint images just taken."""
    output = (records.read(r.root, cid, Kind.RUN) or {}).get("output") or os.devnull
    r.delete(cid)
    with open(output, "ab") as out:
        r.restore(cid, bundle, images, stdout=out, stderr=out)


def restore(store: SnapshotStore, name: str, cid: str, bundle: str, *, runsc_args: Sequence[str] | None = None,
            output: str, progress: Any = None) -> RunscReport:
    with store.shared():
        m = store.load(name)
        if m.meta.get("kind") != "runsc":
            raise RunscSnapshotError(f"snapshot {name!r} is a {m.meta.get('kind')!r} snapshot, not a runsc one")
        args = list(runsc_args) if runsc_args else list(m.meta["runsc_args"])
        gpu = m.meta.get("gpu") or {}
        r = Runsc([*args, *gpu.get("runsc_args", [])], log_dir=os.path.join(store.path, "logs"))
        if r.state(cid) is not None:
            raise RunscSnapshotError(f"container {cid!r} already exists; restore under a new id")
        records.check_id(cid)
        check_bundle(bundle)
        net = nets.NetConfig.from_dict(m.meta["net"]) if m.meta.get("net") else None
        report = RunscReport(name, cid, address=net.address if net else None, output=os.path.abspath(output),
                             recorded_output=m.meta.get("output") if isinstance(m.meta.get("output"), str) else None)
        stage = staging_dir(store, m.size)
        made_net = False
        try:
            t0 = time.perf_counter()
            pipeline.get(store, m, FileTreeSink(os.path.join(stage, "out")), progress=progress)
            report.seconds["materialize"] = time.perf_counter() - t0
            records.forget(r.root, cid)
            if gpu:
                prepare_gpu(bundle, Runsc(args), cid, gpu.get("gpus", []), store.path, agent=bool(gpu.get("agent")))
            if net is not None:
                if not nets.exists(net):
                    nets.create(net)
                    made_net = True
                set_bundle_netns(bundle, net.path)
                records.write(r.root, cid, Kind.NET, net.as_dict())
            records.write(r.root, cid, Kind.RUN, {"output": os.path.abspath(output)})
            t0 = time.perf_counter()
            with open(output, "ab") as out:
                try:
                    r.restore(cid, bundle, os.path.join(stage, "out", "images"), stdout=out,
                              stderr=out)
                except RunscError as e:
                    raise _with_reason(e, output) from None
            report.seconds["runsc_restore"] = time.perf_counter() - t0
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
            records.forget(r.root, cid)
            raise
        finally:
            shutil.rmtree(stage, ignore_errors=True)
    return report
