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

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from storage.api import Progress
from storage.api import put as pipeline
from sandbox.host.dumpwrites import dump_packs_direct
from storage.api import FileTreeSink, FileTreeSource
from storage.api import SnapshotStore
from storage.api import LOGS, path_in

from sandbox.ops import journal
from sandbox.host import netns as nets
from sandbox.criu.staging import new_staging
from sandbox.host.interrupts import Interrupted
from sandbox.ops.journal import OpKind, Stage
from sandbox.runsc.oci_bundle import bundle_netns, set_bundle_netns
from sandbox.runsc import records
from sandbox.runsc.records import Kind
from sandbox.runsc.runner import Runsc, RunscError
from sandbox.runsc.operations import SandboxRecord
from sandbox.ops.operations import Recovered, Undo, operation_for, undone_on_failure
from sandbox.ops.snapshot_meta import RunscGpu, RunscMeta, check_runsc_args
from sandbox.gpu.channel import ChannelLimits
from sandbox.runsc.errors import RunscSnapshotError
from sandbox.runsc.gpu_agent import agent_checkpoint, gpu_back, gpu_snapshot_name, prepare_gpu
from sandbox.runsc.runner import restart


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
        """A checkpoint's report (bytes stored) or a restore's (where its output goes): each carries only
        its own fields."""
        d = {"name": self.name, "container": self.container, "address": self.address,
             "seconds": {k: round(v, 3) for k, v in self.seconds.items()}}
        if self.output is not None:
            return {**d, "output": self.output, "recorded_output": self.recorded_output}
        return {**d, "raw_bytes": self.raw_bytes, "new_bytes": self.new_bytes, "dedup_bytes": self.dedup_bytes}


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


def run(cid: str, bundle: str, runsc_args: Sequence[str], output: str, net: nets.NetConfig | None = None, *,
        gpus: Sequence[int] = (), gpu_agent: bool = False,
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
        try:
            r = Runsc([*runsc_args, *prepare_gpu(bundle, r, cid, gpus, driver_version=driver_version)])
        except BaseException:
            if original is not None:
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



def checkpoint(store: SnapshotStore, cid: str, name: str, runsc_args: Sequence[str], *, leave_running: bool = False,
               replace: bool = False, progress: Progress | None = None, tags: Sequence[str] = ()) -> RunscReport:
    """Sandbox CID into snapshot NAME: the GPU agent first where it is a GPU sandbox (custom storage
    into snapshot NAME.gpu, or the driver's host copy that runsc then saves), then `runsc checkpoint`
    and the ingest. A failure at any step leaves the sandbox running with its GPU state back."""
    journal.require_clean(store.path)
    direct_packs = dump_packs_direct()  # (a bad GPUSNAP_DUMP_DIRECT refused before anything is frozen)
    r = Runsc(check_runsc_args(list(runsc_args), "--runsc-arg"), log_dir=path_in(store.path, LOGS))
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
    sandbox = SandboxRecord(cid, tuple(r.global_args), bundle, net.as_dict() if net else None)
    with journal.operation(store.path, OpKind.RUNSC_CHECKPOINT, name, leave_running=leave_running,
                           runsc=sandbox.as_dict()) as op:
        # op and op_mac: how recovery tells this operation's commit from any other manifest of the name
        meta = RunscMeta(cid, tuple(runsc_args), bundle, net, bundle_netns(bundle), None,
                         extra={"output": (records.read(r.root, cid, Kind.RUN) or {}).get("output"),
                                "op": op.id, "op_mac": op.commit_mac([])})
        with store.writer(name, replace=replace, meta=meta.to_json(), tags=tuple(tags), direct_packs=direct_packs) as w:
            _checkpoint_in(CheckpointContext(store, name, op, w, meta, r, cid, bundle, net, gpu, leave_running, report,
                                             progress))
    report.raw_bytes, report.new_bytes, report.dedup_bytes = w.stats.raw_bytes, w.stats.bytes_new, w.stats.bytes_dedup
    return report


@dataclass(frozen=True)
class CheckpointContext:
    """One `runsc checkpoint` into a snapshot, inside its journal record and writer."""

    store: SnapshotStore
    name: str                        # the snapshot
    op: journal.Op                   # its journal record
    w: Any                           # its storage writer (SnapshotWriter)
    meta: RunscMeta                  # what the snapshot records of the sandbox
    runsc: Runsc
    cid: str                         # the sandbox
    bundle: str                      # its OCI bundle
    net: nets.NetConfig | None       # the network gpusnap made for it
    gpu: dict[str, Any] | None       # its GPU record (records.Kind.GPU), if a GPU sandbox
    leave_running: bool
    report: RunscReport
    progress: Progress | None = None


def _checkpoint_in(ctx: CheckpointContext) -> None:
    """The checkpoint's stages inside its journal record and writer; on a failure, the operation's undo
    (sandbox.runsc.operations.RunscCheckpoint) from the stage the record reached."""
    op, w, meta, r, cid, bundle, gpu = ctx.op, ctx.w, ctx.meta, ctx.runsc, ctx.cid, ctx.bundle, ctx.gpu
    store, name, report, progress = ctx.store, ctx.name, ctx.report, ctx.progress
    stage = new_staging(store, 1 << 30, None, op)
    images = os.path.join(stage, "images")
    os.mkdir(images, 0o700)
    # after the commit a signal only hurries the end
    after_commit = lambda e: op.rec.stage == Stage.COMMITTED and isinstance(e, Interrupted)  # noqa: E731
    try:
        with undone_on_failure(op, Undo(store), RunscSnapshotError, what="checkpoint", keep_going=after_commit):
            if gpu and gpu.get("agent"):  # a GPU sandbox's GPU state out through its agent, first
                op.advance(Stage.GPU_FROZEN)
                t0 = time.perf_counter()
                gpu_rep = agent_checkpoint(r, cid, store, gpu_snapshot_name(name),
                                           ChannelLimits.for_gpus(len(gpu.get("gpus") or [])), w.direct_packs)
                op.advance(runsc=SandboxRecord.of(op.rec).with_(gpu_report=gpu_rep))
                # the writer's meta, made anew from the record with the agent's report in it
                w.meta = dataclasses.replace(meta, gpu=RunscGpu(tuple(gpu.get("gpus") or ()),
                                                                tuple(gpu.get("runsc_args") or ()),
                                                                bool(gpu.get("agent")), gpu_rep)).to_json()
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
            if ctx.leave_running:
                t0 = time.perf_counter()
                restart(r, cid, bundle, images)
                sb = SandboxRecord.of(op.rec)
                if sb.gpu_report is not None:
                    gpu_back(r, cid, sb.gpu_report, store, name)
                    op.advance(runsc=sb.with_(gpu_back=True))
                report.seconds["restart"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            journal.pause("ingest")
            with FileTreeSource([images]) as src:
                if progress is not None:
                    progress.start(src.total_bytes)
                pipeline.put(w, src, progress=progress, chunker="pages")
            journal.pause("before-commit")
            op.advance(Stage.COMMITTING)
            w.commit()
            op.advance(Stage.COMMITTED)
            report.seconds["ingest"] = time.perf_counter() - t0
            journal.pause("after-commit")
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def restore(store: SnapshotStore, name: str, cid: str, bundle: str, *, runsc_args: Sequence[str] | None = None,
            output: str, progress: Progress | None = None) -> RunscReport:
    journal.require_clean(store.path)
    with store.shared():
        m = store.load(name)
        meta = RunscMeta.of(m)
        args = list(runsc_args) if runsc_args else list(meta.runsc_args)
        gpu = meta.gpu_json
        r = Runsc([*args, *gpu.get("runsc_args", [])], log_dir=path_in(store.path, LOGS))
        if r.state(cid) is not None:
            raise RunscSnapshotError(f"container {cid!r} already exists; restore under a new id")
        records.check_id(cid)
        check_bundle(bundle)
        net = meta.net
        recorded = meta.extra.get("output")
        report = RunscReport(name, cid, address=net.address if net else None, output=os.path.abspath(output),
                             recorded_output=recorded if isinstance(recorded, str) else None)
        owed = gpu.get("agent_report") if gpu.get("agent_report", {}).get("cuda_pids") else None
        sandbox = SandboxRecord(cid, (*args, *gpu.get("runsc_args", [])), bundle, net.as_dict() if net else None,
                                gpu_report=owed)
        with journal.operation(store.path, OpKind.RUNSC_RESTORE, name, runsc=sandbox.as_dict()) as op:
            stage = new_staging(store, m.size, None, op)
            made_net = False
            try:
                t0 = time.perf_counter()
                pipeline.get(store, m, FileTreeSink(os.path.join(stage, "out")), progress=progress)
                report.seconds["materialize"] = time.perf_counter() - t0
                records.forget(r.root, cid)
                if gpu:
                    prepare_gpu(bundle, Runsc(args), cid, gpu.get("gpus", []), agent=bool(gpu.get("agent")))
                if net is not None:
                    if not nets.exists(net):
                        nets.create(net)
                        made_net = True
                    set_bundle_netns(bundle, net.path)
                    records.write(r.root, cid, Kind.NET, net.as_dict())
                records.write(r.root, cid, Kind.RUN, {"output": os.path.abspath(output)})
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
                if owed is not None:
                    t0 = time.perf_counter()
                    gpu_back(r, cid, owed, store, name)
                    op.advance(runsc=sandbox.with_(gpu_back=True))
                    report.seconds["gpu_restore"] = time.perf_counter() - t0
            except BaseException:
                try:  # the operation's undo (sandbox.runsc.operations.RunscRestore): the container gone whole
                    operation_for(op.rec, Undo(store)).undo(Recovered.of(op.rec))
                except Exception:  # noqa: BLE001 - the record stays: `gpusnap recover` tries again
                    op.keep = True
                if made_net and net is not None:
                    nets.remove(net)
                records.forget(r.root, cid)
                raise
            finally:
                shutil.rmtree(stage, ignore_errors=True)
    return report
