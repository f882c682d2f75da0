"""A GPU sandbox driven from the host: the bundle's GPU devices and gpusnap's code for the agent
(prepare_gpu), the GPU agent (agents/gpu_agent.py) run inside the sandbox through `runsc exec` with
its channel on the exec's pipes (sandbox/gpu/channel.py), and the GPU state given back through it
(gpu_back). The store is never mounted in the sandbox: GPU memory crosses the channel."""
from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from typing import Any, BinaryIO, Sequence, cast

from storage.api import SnapshotStore

from sandbox.gpu.channel import AgentFrames, AgentReport, ChannelError, ChannelLimits, read_report, receive, send
from sandbox.runsc.oci_bundle import add_bind, add_gpus, load_spec, save_spec
from sandbox.runsc import records
from sandbox.runsc.records import Kind
from sandbox.runsc.runner import Runsc
from sandbox.runsc.errors import RunscSnapshotError
from sandbox.ops.gpu_path import GpuPath
from sandbox.ops.snapshot_meta import GpuMeta

AGENT_CODE = "/run/gpusnap/code"   # gpusnap's code inside a GPU sandbox (read-only bind; the store is never mounted)
AGENT_TIMEOUT_S = 3600.0
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_snapshot_name(name: str) -> str:
    return f"{name}.gpu"


def prepare_gpu(bundle: str, r: Runsc, cid: str, gpus: Sequence[int], *, agent: bool = True,
                driver_version: str | None = None) -> list[str]:
    """Make BUNDLE a GPU sandbox: the NVIDIA devices (nvproxy) for GPUS, gpusnap's code bind-mounted
    read-only for the GPU agent (the store is not: GPU memory reaches it over the agent's pipes);
    recorded for CID (records.py). Returns the extra runsc global flags. Refuses, before touching
    the bundle, when this runsc has no nvproxy."""
    gpu_args = r.features().gpu_args(driver_version=driver_version) if gpus else []
    cfg = load_spec(bundle)
    if gpus:
        add_gpus(cfg, gpus)
    if agent:
        add_bind(cfg, CODE_ROOT, AGENT_CODE, readonly=True)
    save_spec(bundle, cfg)
    records.write(r.root, cid, Kind.GPU, {"gpus": list(gpus), "runsc_args": gpu_args, "agent": agent})
    return gpu_args


class _AgentExit(Exception):
    """The agent exited non-zero (its own stderr line says why)."""


class _AgentExec:
    """The GPU agent (agents/gpu_agent.py) running inside sandbox CID through `runsc exec`, its
    stdin and stdout piped to this process (the channel, sandbox/gpu/channel.py). An agent that has
    not finished within AGENT_TIMEOUT_S is killed, which ends every read and write on its pipes."""

    def __init__(self, r: Runsc, cid: str, args: Sequence[str]) -> None:
        py = os.environ.get("GPUSNAP_AGENT_PYTHON", "python3")
        self.cid, self.action = cid, args[0]
        self.err = tempfile.TemporaryFile()
        try:
            self.p = r.exec_piped(cid, [py, "-m", "agents.gpu_agent", *args], env={"PYTHONPATH": AGENT_CODE},
                                  stderr=self.err)
        except OSError as e:
            self.err.close()
            raise RunscSnapshotError(f"cannot start the GPU agent in {cid!r}: {e.strerror}") from None
        if self.p.stdin is None or self.p.stdout is None:  # exec_piped pipes both
            raise RunscSnapshotError(f"cannot start the GPU agent in {cid!r}: no pipes")
        self.stdin, self.stdout = cast(BinaryIO, self.p.stdin), cast(BinaryIO, self.p.stdout)
        self.watchdog = threading.Timer(AGENT_TIMEOUT_S, self.p.kill)
        self.watchdog.daemon = True
        self.watchdog.start()

    def __enter__(self) -> "_AgentExec":
        return self

    def __exit__(self, et: Any, *exc: object) -> None:
        self.stop()
        self.err.close()

    def stop(self) -> None:
        """Our ends closed (an agent still streaming then fails its next write and rolls back), and
        the agent waited for."""
        self._close()
        try:
            self.p.wait(timeout=AGENT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.watchdog.cancel()

    def _close(self) -> None:
        for f in (self.stdin, self.stdout):
            try:
                f.close()
            except OSError:
                pass

    def failed(self, e: BaseException) -> RunscSnapshotError:
        """E as the agent's failure, with the agent's own one-line reason where it gave one."""
        self.stop()
        rc = self.p.returncode
        self.err.seek(0)
        lines = [l for l in self.err.read().decode(errors="replace").splitlines() if l.strip()]
        agent_says = lines[-1].strip() if rc and lines else None
        ours = None if isinstance(e, _AgentExit) else (str(e).splitlines() or [type(e).__name__])[0]
        why = "; ".join(w for w in (ours, f"the agent: {agent_says}" if ours and agent_says else agent_says) if w)
        return RunscSnapshotError(f"the GPU agent in {self.cid!r} failed to {self.action}: {why or f'exit {rc}'}")

    def finish(self) -> None:
        self.stop()
        if self.p.returncode:
            raise self.failed(_AgentExit())


def agent_checkpoint(r: Runsc, cid: str, store: SnapshotStore, gpu_name: str,
                     limits: ChannelLimits = ChannelLimits(), direct_packs: bool = False) -> dict[str, Any]:
    """The agent's checkpoint in sandbox CID; GPU memory it streams out (custom storage) is committed
    as snapshot GPU_NAME, which the host names. Returns its validated report (+ "snapshot"). On any
    failure the processes whose memory already reached the host get it back, and none stays frozen.
    DIRECT_PACKS: as the checkpoint's own writer (sandbox.host.dumpwrites, decided once per dump)."""
    meta = GpuMeta(GpuPath.CUSTOM_STORAGE).to_json()  # its pids once the agent has reported them
    with _AgentExec(r, cid, ["checkpoint"]) as a, \
            store.writer(gpu_name, replace=True, meta=meta, direct_packs=direct_packs) as w:
        frames = AgentFrames(a.stdout, "checkpoint", limits)
        try:
            try:
                receive(frames, w)
                a.finish()
            except RunscSnapshotError:
                raise
            except Exception as e:  # noqa: BLE001 - the agent's or the channel's failure, one line
                raise a.failed(e) from None
            rep = frames.report
            assert rep is not None
            out = {**rep.as_dict(), "snapshot": None}
            if frames.complete:
                if rep.cuda_pids:  # the record made anew from what the agent reported, not a dict changed in place
                    w.meta = GpuMeta(GpuPath.CUSTOM_STORAGE, min(rep.cuda_pids), tuple(rep.cuda_pids)).to_json()
                w.commit()
                out["snapshot"] = gpu_name
            return out
        except BaseException as e:
            a.stop()
            if frames.complete:  # their memory is in this (uncommitted) writer: hand it back
                try:
                    agent_restore(r, cid, pids=None, path="custom-storage", source=store, streams=w.streams,
                                  have=frames.complete)
                except Exception as u:  # noqa: BLE001 - both failures, in one line
                    raise RunscSnapshotError(f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; and giving "
                                             f"the GPU memory back failed too: {u}") from None
            raise


def agent_restore(r: Runsc, cid: str, *, pids: Sequence[int] | None, path: str | None, source: Any = None,
                  streams: list[Any] | None = None, have: dict[int, list[int]] | None = None) -> dict[str, Any]:
    """The agent's restore in sandbox CID for PIDS (None: every process the driver knows there); with
    custom storage, the GPU memory it asks for is sent from STREAMS (only processes in HAVE, if given)."""
    args = ["restore"] + (["--pids", ",".join(map(str, pids))] if pids is not None else [])
    args += ["--path", path] if path else []
    with _AgentExec(r, cid, args) as a:
        try:
            if path == "custom-storage":
                send(a.stdin, a.stdout, source, streams or [], have)
            rep = read_report(a.stdout, "restore")
            a.finish()
        except RunscSnapshotError:
            raise
        except Exception as e:  # noqa: BLE001
            raise a.failed(e) from None
    return rep.as_dict()


def agent(r: Runsc, cid: str, action: str) -> dict[str, Any]:
    """An agent action that moves no GPU memory (status, toggle), its validated report."""
    with _AgentExec(r, cid, [action]) as a:
        try:
            rep = read_report(a.stdout, action)
            a.finish()
        except RunscSnapshotError:
            raise
        except Exception as e:  # noqa: BLE001
            raise a.failed(e) from None
    return rep.as_dict()


def gpu_back(r: Runsc, cid: str, rep: dict[str, Any] | None, store: SnapshotStore, name: str) -> None:
    """The agent's restore for the CUDA processes the checkpoint of snapshot NAME reported (none:
    nothing to do), their GPU memory fed from NAME.gpu where it took custom storage. The report comes
    from a manifest: only its pids (checked as integers) and path are used, never a snapshot name."""
    if not rep or not rep.get("cuda_pids"):
        return
    try:
        report = AgentReport.from_frame({**rep, "states": {}, "init": []}, str(rep.get("action")))
    except ChannelError as e:
        raise RunscSnapshotError(f"snapshot {name!r}: its GPU agent record is damaged ({e})") from None
    m = store.load(gpu_snapshot_name(name)) if report.path == "custom-storage" else None
    agent_restore(r, cid, pids=list(report.cuda_pids), path=report.path, source=store,
                  streams=m.streams if m is not None else None)
