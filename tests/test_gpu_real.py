"""GPU tests on real hardware (marker `gpu`): the driver checkpoint API through our layer, many
processes, rollback, the feature probe, the CLI, THP, and the GPU data path engine.
Run by scripts/gpu-tests.sh on the H200 test machine; skipped where there is no GPU."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Cli
from support.gpu_results import GB, record

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def drv():
    from sandbox.gpu.driver import CudaDriver
    return CudaDriver()


def test_probe_on_the_real_driver(drv) -> None:
    from sandbox.gpu.driver import probe
    f = probe(drv)
    assert f.checkpoint_api, f.reason
    assert f.gpus and f.gpus[0].uuid.startswith("GPU-")
    assert f.driver_version is not None
    major, minor = (int(x) for x in f.driver_version.split("."))
    from cuda.bindings import driver as cu
    has_complete = hasattr(cu, "cuCheckpointOperationComplete")  # bindings older than 13.4 lack it
    if has_complete:
        try:
            drv._call("cuCheckpointOperationComplete", None, 0)
        except Exception as e:  # noqa: BLE001 - an invalid handle is fine: the entry point exists
            has_complete = "FUNCTION_NOT_FOUND" not in str(e) and "not available" not in str(e)
    assert f.custom_storage == has_complete
    record("probe", {"driver": f.driver_version, "custom_storage": f.custom_storage, "path": f.path,
                     "gpus": [g.name for g in f.gpus]})


def test_one_process_checkpoint_restore_data_verified(drv) -> None:
    from sandbox.gpu.driver import ProcessState as S
    from sandbox.gpu.checkpoint import checkpoint_all, restore_all
    from scripts.workloads.workload_control import Workload
    with Workload(GB) as w:
        t = checkpoint_all(drv, [w.pid])
        assert drv.get_state(w.pid) == S.CHECKPOINTED
        r = restore_all(drv, [w.pid])
        assert drv.get_state(w.pid) == S.RUNNING
        assert w.verify()
        record("one_process", {"gb": w.size / 1e9, "lock_s": t.lock_s, "checkpoint_s": t.checkpoint_s,
                               "restore_s": r.restore_s, "unlock_s": r.unlock_s})


def test_three_processes_at_once(drv) -> None:
    from sandbox.gpu.driver import ProcessState as S
    from sandbox.gpu.checkpoint import checkpoint_all, restore_all
    from scripts.workloads.workload_control import Workload
    ws = [Workload(GB / 2, mix=m, seed=i) for i, m in enumerate(["realistic", "pessimistic", "random"])]
    try:
        pids = [w.pid for w in ws]
        t = checkpoint_all(drv, pids)
        assert all(drv.get_state(p) == S.CHECKPOINTED for p in pids)
        restore_all(drv, pids)
        assert all(w.verify() for w in ws)
        record("three_processes", {"checkpoint_s": t.checkpoint_s, "per_pid": t.per_pid})
    finally:
        for w in ws:
            w.close()


def test_rollback_when_one_fails(drv) -> None:
    from sandbox.gpu.driver import ProcessState as S
    from sandbox.gpu.checkpoint import GpuCheckpointError, checkpoint_all
    from scripts.workloads.workload_control import Workload
    sleeper = subprocess.Popen(["sleep", "60"])
    ws = [Workload(GB / 2, seed=i) for i in range(2)]
    try:
        with pytest.raises(GpuCheckpointError, match=f"pid {sleeper.pid}"):
            checkpoint_all(drv, [ws[0].pid, sleeper.pid, ws[1].pid])
        assert all(drv.get_state(w.pid) == S.RUNNING for w in ws)
        assert all(w.verify() for w in ws)
    finally:
        sleeper.kill()
        for w in ws:
            w.close()


def test_cli_gpu_checkpoint_and_restore(tmp_path: Path, drv) -> None:
    from sandbox.gpu.driver import ProcessState as S
    from scripts.workloads.workload_control import Workload
    cli = Cli(tmp_path / "store")
    with Workload(GB) as w:
        rep = cli.json("gpu", "checkpoint", str(w.pid), "swap1")
        assert rep["path"] in ("host-staged", "custom-storage") and rep["pids"] == [w.pid]
        assert drv.get_state(w.pid) == S.CHECKPOINTED
        info = cli.json("store", "inspect", "swap1")
        assert info["meta"]["kind"] == "gpu" and info["meta"]["gpu_path"] == rep["path"]
        # a wrong device map is refused before anything changes
        bad = cli.run("gpu", "restore", "swap1", str(w.pid), "--device-map", "0=7", check=False)
        assert bad.returncode == 4 and "no GPU '7'" in bad.stderr and len(bad.stderr.splitlines()) == 1
        assert drv.get_state(w.pid) == S.CHECKPOINTED
        uuid = info["meta"]["gpus"][0]["uuid"]
        cli.json("gpu", "restore", "swap1", str(w.pid), "--device-map", f"{uuid}=0")
        assert drv.get_state(w.pid) == S.RUNNING
        assert w.verify()
        record("cli_gpu", {"checkpoint": rep["seconds"]})


def test_cli_errors_for_non_cuda_and_missing_pids(tmp_path: Path) -> None:
    cli = Cli(tmp_path / "store")
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        p = cli.run("gpu", "checkpoint", str(sleeper.pid), "x", check=False)
        assert p.returncode == 1 and "no CUDA process" in p.stderr and len(p.stderr.splitlines()) == 1
        assert sleeper.poll() is None  # not killed
    finally:
        sleeper.kill()
    p = cli.run("gpu", "checkpoint", "4194000", "x", check=False)
    assert p.returncode == 1 and "no process with pid" in p.stderr
    assert cli.json("store", "ls") == []


def test_process_exiting_mid_checkpoint_leaves_others_running(drv) -> None:
    """A process killed while the others are being checkpointed: clear error, the rest run on."""
    import threading
    from sandbox.gpu.driver import ProcessState as S
    from sandbox.gpu.checkpoint import GpuCheckpointError, checkpoint_all
    from scripts.workloads.workload_control import Workload
    victim, keeper = Workload(GB, seed=5), Workload(GB / 2, seed=6)
    try:
        killer = threading.Timer(0.05, victim.proc.kill)
        killer.start()
        try:
            checkpoint_all(drv, [keeper.pid, victim.pid])
            outcome = "finished before the kill"
        except GpuCheckpointError as e:
            outcome = str(e)
        killer.join()
        victim.proc.wait()
        st = drv.get_state(keeper.pid)
        if st == S.CHECKPOINTED:  # it finished first: bring it back the normal way
            from sandbox.gpu.checkpoint import restore_all
            restore_all(drv, [keeper.pid])
        assert drv.get_state(keeper.pid) == S.RUNNING
        assert keeper.verify()
        record("exit_mid_checkpoint", {"outcome": outcome[:200]})
    finally:
        keeper.close()
        victim.close()


def test_thp_always_vs_madvise_on_the_drivers_host_copy(drv) -> None:
    from sandbox.gpu.checkpoint import checkpoint_all, restore_all
    from sandbox.host.hugepages import thp, thp_mode
    from scripts.workloads.workload_control import Workload
    before = thp_mode()
    res = {}
    for mode in ("madvise", "always"):
        with Workload(GB * 2, mix="pessimistic", seed=9) as w:
            with thp(mode):
                t = checkpoint_all(drv, [w.pid])
                r = restore_all(drv, [w.pid])
            assert w.verify()
            res[mode] = {"checkpoint_GBps": w.size / t.checkpoint_s / 1e9, "restore_GBps": w.size / r.restore_s / 1e9}
    assert thp_mode() == before
    record("thp", res)


# ---- the GPU data path engine, driven through CUDA IPC (the stand-in for custom storage) ----

@pytest.mark.parametrize("tier", ["shm", "disk", "pool"])
@pytest.mark.parametrize("mix", ["realistic", "pessimistic", "random", "zeros"])
def test_engine_round_trip(tmp_path: Path, tier: str, mix: str) -> None:
    from storage.pipeline.gpu_engine import GpuEngine, Region
    from storage.tiers.memory import PinnedPool
    from storage.repo.store import SnapshotStore
    from scripts.workloads.workload_control import Workload, ipc_region
    root = Path("/dev/shm") if tier == "shm" else tmp_path
    sdir = Path(os.path.join(root, f"gpusnap-test-{os.getpid()}-{mix}"))
    try:
        with Workload(GB, mix=mix, seed=3) as w, GpuEngine() as eng, ipc_region(w.info["ipc"]) as ptr:
            st = PinnedPool(eng.dev.pool_memory(int(w.size * 1.05))) if tier == "pool" else SnapshotStore(str(sdir))
            region = Region("gpu/0", ptr, w.size)
            with st.writer("e1") as wr:
                res = eng.checkpoint(wr, [region])
                wr.commit()
            assert w.cmd("clear")["ok"] and not w.verify()
            back = eng.restore(st, st.load("e1"), {"gpu/0": region})
            assert w.verify()
            assert eng.lanes_free == eng.nlanes
            if isinstance(st, PinnedPool):
                assert st.usage()["used"] >= res.stored_bytes
                st.close()
            record("engine", {"mix": mix, "tier": tier, "gb": w.size / 1e9, "stored": res.stored_bytes,
                              "ckpt_GBps": res.gbps, "restore_GBps": back.gbps,
                              "stages": res.stages.table(), "restore_stages": back.stages.table()})
    finally:
        shutil.rmtree(sdir, ignore_errors=True)


def test_engine_refuses_a_corrupted_stream(tmp_path: Path) -> None:
    from storage.pipeline.gpu_engine import GpuEngine, Region
    from storage.repo.store import SnapshotStore, StoreError
    from scripts.workloads.workload_control import Workload, ipc_region
    st = SnapshotStore(str(tmp_path / "s"))
    with Workload(0.5, mix="realistic", seed=4) as w, GpuEngine() as eng, ipc_region(w.info["ipc"]) as ptr:
        region = Region("gpu/0", ptr, w.size)
        with st.writer("c") as wr:
            eng.checkpoint(wr, [region])
            wr.commit()
        from support.entries import chunk_entries
        victim = max(chunk_entries(tmp_path / "s"), key=lambda e: e.length)  # a pack entry or a chunk file
        victim.flip(5000)
        with pytest.raises(StoreError, match="damaged"):
            eng.restore(st, st.load("c"), {"gpu/0": region})


def test_engine_dedup_after_5_percent_change(tmp_path: Path) -> None:
    """A second snapshot after 5% of the memory changed writes only what changed (Bitcomp here; the
    default codec's unchanged re-checkpoint: tests/test_gpu_determinism.py)."""
    from storage.pipeline.gpu_engine import GpuEngine, Region
    from storage.repo.store import SnapshotStore
    from scripts.workloads.workload_control import Workload, ipc_region
    st = SnapshotStore(str(tmp_path / "s"))
    with Workload(GB * 2, mix="realistic", seed=8) as w, GpuEngine(codec="nvcomp-bitcomp") as eng, \
            ipc_region(w.info["ipc"]) as ptr:
        region = Region("gpu/0", ptr, w.size)
        with st.writer("d1") as wr:
            first = eng.checkpoint(wr, [region])
            wr.commit()
        w.cmd("mutate 5")
        with st.writer("d2") as wr:
            second = eng.checkpoint(wr, [region])
            wr.commit()
        assert second.stored_bytes <= 0.15 * first.stored_bytes, (first.stored_bytes, second.stored_bytes)
        w.cmd("clear")
        eng.restore(st, st.load("d2"), {"gpu/0": region})
        assert w.verify()
        record("engine_dedup", {"first": first.stored_bytes, "second": second.stored_bytes})


class IpcDriver:
    """The custom-storage half of the driver's state machine over one real GPU allocation of another
    process, opened through CUDA IPC: the stand-in for the driver mapping a checkpointed process's
    GPU memory into ours (driver 580 has no custom-storage API)."""

    def __init__(self, pid: int, ptr: int, size: int) -> None:
        from sandbox.gpu.driver import ProcessState as S
        self.pid, self.ptr, self.size, self.state = pid, ptr, size, S.RUNNING

    def _move(self, pid: int, call: str, want: Any, to: Any) -> None:
        from sandbox.gpu.driver import driver_error
        if pid != self.pid or self.state != want:
            raise driver_error(pid, call, "CUDA_ERROR_ILLEGAL_STATE", f"is {self.state.name}")
        self.state = to

    def get_state(self, pid: int) -> Any:
        from sandbox.gpu.driver import driver_error
        if pid != self.pid:
            raise driver_error(pid, "cuCheckpointProcessGetState", "CUDA_ERROR_NOT_FOUND")
        return self.state

    def lock(self, pid: int, timeout_ms: int) -> None:
        from sandbox.gpu.driver import ProcessState as S
        self._move(pid, "cuCheckpointProcessLock", S.RUNNING, S.LOCKED)

    def unlock(self, pid: int) -> None:
        from sandbox.gpu.driver import ProcessState as S
        self._move(pid, "cuCheckpointProcessUnlock", S.LOCKED, S.RUNNING)

    def _op(self) -> Any:
        from sandbox.gpu.driver import CustomOperation, DeviceRegion
        return CustomOperation(1, [DeviceRegion(0, self.ptr, self.size, 0)])

    def checkpoint_custom(self, pid: int) -> Any:
        from sandbox.gpu.driver import ProcessState as S
        self._move(pid, "cuCheckpointProcessCheckpoint", S.LOCKED, S.CHECKPOINTING)
        return self._op()

    def restore_custom(self, pid: int, gpu_map: Any = None) -> Any:
        from sandbox.gpu.driver import ProcessState as S
        self._move(pid, "cuCheckpointProcessRestore", S.CHECKPOINTED, S.RESTORING)
        return self._op()

    def complete(self, pid: int, op: Any) -> None:
        from sandbox.gpu.driver import ProcessState as S
        self._move(pid, "cuCheckpointOperationComplete", self.state,
                   S.CHECKPOINTED if self.state == S.CHECKPOINTING else S.LOCKED)


def _agent(action: str, drv: IpcDriver, **kw: Any) -> tuple[Any, Any, Any]:
    """agents.gpu_agent.run on its own thread (its own CUDA device binding, as in a sandbox), its
    stdout/stdin real pipes: (host's read end, host's write end, thread with .error)."""
    import threading
    from agents.gpu_agent import run
    from sandbox.gpu.channel import report_frame, write_header
    from sandbox.gpu.driver import Features
    r_out, w_out = os.pipe()
    r_in, w_in = os.pipe()
    a_out, a_in = os.fdopen(w_out, "wb"), os.fdopen(r_in, "rb")

    def body() -> None:
        try:
            rep = run(action, out=a_out, inp=a_in, driver=drv, pids=[drv.pid],
                      features=Features(checkpoint_api=True, custom_storage=True), **kw)
            write_header(a_out, report_frame(rep))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            th.error = e  # type: ignore[attr-defined]
        finally:
            a_out.close()
            a_in.close()

    th = threading.Thread(target=body, daemon=True)
    th.error = None  # type: ignore[attr-defined]
    th.start()
    return os.fdopen(r_out, "rb"), os.fdopen(w_in, "wb"), th


def test_agent_channel_on_the_gpu_through_the_ipc_stand_in(tmp_path: Path) -> None:
    """Issue 11's channel on real hardware: the in-sandbox agent's code copies another process's GPU
    memory (opened by CUDA IPC, as custom storage maps it) over its stdout pipe into the host's store,
    and back from the store over its stdin after the process's memory was wiped; the process verifies
    its own data. The host names the streams; the agent sees no store."""
    from sandbox.gpu.channel import AgentFrames, read_report, receive, send
    from sandbox.gpu.driver import ProcessState as S
    from storage.gpu.device import CudaDevice
    from storage.repo.store import SnapshotStore
    from scripts.workloads.workload_control import Workload, ipc_region
    st = SnapshotStore(str(tmp_path / "store"))
    with Workload(GB, mix="realistic", seed=6) as w:
        CudaDevice(0)  # the primary context, current in this thread, for the IPC mapping
        with ipc_region(w.info["ipc"]) as ptr:
            drv = IpcDriver(w.pid, ptr, w.size)
            out, inp, th = _agent("checkpoint", drv)
            t0 = time.perf_counter()
            with st.writer("sb.gpu", meta={"kind": "gpu", "gpu_path": "custom-storage", "root_pid": w.pid,
                                           "pids": [w.pid]}) as wr:
                frames = AgentFrames(out, "checkpoint")
                receive(frames, wr)
                wr.commit()
            ckpt_s = time.perf_counter() - t0
            th.join(120)
            out.close()
            inp.close()
            assert th.error is None, th.error
            assert drv.state == S.CHECKPOINTED and frames.report is not None
            m = st.load("sb.gpu")
            assert [(s.name, s.size) for s in m.streams] == [(f"gpu/{w.pid}/0", w.size)]
            assert st.verify(["sb.gpu"]).ok
            assert w.cmd("clear")["ok"] and not w.verify()
            out, inp, th = _agent("restore", drv, path="custom-storage")
            t0 = time.perf_counter()
            assert send(inp, out, st, m.streams) == [w.pid]
            inp.close()
            assert read_report(out, "restore").states == {str(w.pid): "RUNNING"}
            restore_s = time.perf_counter() - t0
            th.join(120)
            out.close()
            assert th.error is None, th.error
        assert w.verify(), "the process's GPU memory is back, byte for byte"
    record("agent_channel", {"gb": w.size / 1e9, "checkpoint_s": round(ckpt_s, 2), "restore_s": round(restore_s, 2),
                             "stored": m.size})
