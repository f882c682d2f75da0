"""gpusnap killed at the GPU stages of a dump or `gpu checkpoint` (the driver stand-in, and a real GPU under
the `gpu` marker): `gpusnap recover` gives every process its GPU memory back (host-staged through the
driver's copy; custom storage from the chunks the journal's reference log lists) or says exactly what
is lost; gc keeps what a record still names and reclaims the rest once it is gone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from support.crash import sleeping_pair
from support.entries import chunk_ids
from support.crash import SIGNALS, STAGES, Paused, assert_nothing_left, expect_exit, processes_mentioning, wait_dead
from support.criu import Tree, healthy

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_root")]


@pytest.fixture(autouse=True)
def same_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run directory the gpusnap children here are given (GPUSNAP_RUN_DIR: THP records, and each
    operation's host-local state) is this process's too, so that its in-process recover finds that state."""
    monkeypatch.setenv("GPUSNAP_RUN_DIR", str(tmp_path / "run"))


GPU_DUMP = """
import sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from sandbox.criu.snapshot import criu_dump
from sandbox.gpu.driver import Features
from storage.repo.store import SnapshotStore
criu_dump(SnapshotStore({store!r}), {pid}, "g", gpu_driver=SharedStandIn({state!r}),
          features=Features(checkpoint_api=True, custom_storage=False))
"""


@pytest.mark.parametrize("stage", ["before-dump", "ingest", "before-commit"])
def test_gpu_dump_killed_then_recovered(stage: str, tmp_path: Path) -> None:
    """The driver-stand-in variant: the tree's two processes are CUDA processes (a file-backed stand-in,
    host-staged path); gpusnap is killed -9 with them CHECKPOINTED (and the tree stopped by CRIU):
    recovery resumes the tree and restores and unlocks their GPU memory, byte-exact."""
    import random
    from support.driver_standin import SharedStandIn
    from sandbox.gpu.driver import ProcessState
    from sandbox.recover import recover
    from storage.repo.store import SnapshotStore
    tree = Tree(mb=16, detached=True)
    try:
        state = str(tmp_path / "driver.pkl")
        before = {pid: random.Random(pid).randbytes(64 << 10) for pid in (tree.pid, tree.child)}
        SharedStandIn.create(state, before)
        store = tmp_path / "store"
        pause = tmp_path / "pause"
        prog = GPU_DUMP.format(tests=str(REPO / "tests"), store=str(store), pid=tree.pid, state=state)
        env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE": f"{stage}:{pause}",
               "GPUSNAP_RUN_DIR": str(tmp_path / "run")}
        p = subprocess.Popen([sys.executable, "-c", prog], env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while not pause.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the dump did not reach the pause"
            time.sleep(0.02)
        assert {SharedStandIn(state).get_state(x) for x in before} == {ProcessState.CHECKPOINTED}
        staging = json.loads(next((store / "journal").glob("*.json")).read_text())["staging"]
        p.kill()
        p.wait()
        pause.unlink()
        rep = recover(SnapshotStore(str(store), create=False), gpu_driver=lambda: SharedStandIn(state),
                      thp_record_dir=str(tmp_path / "run"))
        assert rep.ok, rep.as_dict()
        d = SharedStandIn(state)
        assert all(d.get_state(x) == ProcessState.RUNNING for x in before)
        assert {x: bytes(d.procs[x].gpu) for x in before} == before
        assert_nothing_left(store, staging)
        assert healthy(tree.report())
    finally:
        tree.kill()


@pytest.mark.gpu
@pytest.mark.parametrize("stage", ["before-dump", "ingest"])
def test_real_gpu_dump_killed_then_recovered(stage: str, tmp_path: Path) -> None:
    """On a GPU machine: a real CUDA process (scripts/workloads/gpu_workload.py) is locked and checkpointed by the
    driver, gpusnap is killed -9 (before CRIU, or with CRIU done and the process stopped); `gpusnap
    recover` resumes it and restores and unlocks its GPU memory, verified by the process itself."""
    from scripts.workloads.workload_control import Workload
    store = tmp_path / "store"
    cli = Cli(store)
    with Workload(float(os.environ.get("GPUSNAP_TEST_GB", "1")), seed=5, detached=True) as w:
        p = Paused(store, ["criu", "dump", str(w.pid), "g"], stage, tmp_path)
        assert p.record["cuda_pids"] == [w.pid] and p.record["stage"] == ("gpu-frozen" if stage == "before-dump" else "dumped")
        assert p.stop(signal.SIGKILL).returncode == -signal.SIGKILL
        rec = cli.json("recover")
        assert rec["ok"], rec
        assert any("GPU state resumed" in a for a in rec["operations"][0]["actions"]), rec
        assert_nothing_left(store, p.record["staging"])
        assert w.verify(), "the GPU memory must be intact after recovery"
        assert cli.json("store", "ls") == []



@pytest.mark.gpu
@pytest.mark.parametrize("sig", SIGNALS, ids=["kill9", "term"])
@pytest.mark.parametrize("stage", ["before-restore", "gpu-restored"])
def test_real_gpu_restore_interrupted(stage: str, sig: int, tmp_path: Path) -> None:
    """On a GPU machine: `gpusnap gpu restore` of a real CUDA process (scripts/workloads/gpu_workload.py)
    stopped before any process is touched, or with the driver done restoring and the process still
    locked; kill -9 then `gpusnap recover`, or SIGTERM (its own undo): the process is unlocked and
    runs, or stays CHECKPOINTED for a second `gpu restore`; its GPU memory is verified by itself."""
    from scripts.workloads.workload_control import Workload
    store = tmp_path / "store"
    cli = Cli(store)
    with Workload(float(os.environ.get("GPUSNAP_TEST_GB", "1")), seed=6, detached=True) as w:
        cli.json("gpu", "checkpoint", str(w.pid), "g")
        p = Paused(store, ["gpu", "restore", "g", str(w.pid)], stage, tmp_path)
        assert p.record["kind"] == "gpu-restore" and p.record["cuda_pids"] == [w.pid], p.record
        r = p.stop(sig)
        assert r.returncode == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + signal.SIGTERM), r.stderr
        rec = cli.json("recover")
        assert rec["ok"], rec
        assert len(rec["operations"]) == (1 if sig == signal.SIGKILL else 0), rec
        if stage == "before-restore":  # nothing was touched: it is still CHECKPOINTED, restorable
            cli.json("gpu", "restore", "g", str(w.pid))
        assert w.verify(), "the GPU memory must be intact"
        assert sorted(n.name for n in (store / "journal").iterdir()) == ["recover.lock"]  # the key is the host's, never in the store


GPU_CLI = """
import functools, sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from cli import gpu_cmd, main
from sandbox.gpu.driver import Features
from storage.gpu.device import HostDevice
# the real `gpusnap gpu {command}` command, with the driver stand-in (custom storage offered or not) and
# the engine on host memory in place of the CUDA driver and GPU 0
gpu_cmd.gpu_{command} = functools.partial(gpu_cmd.gpu_{command}, driver=SharedStandIn({state!r}),
                                          features=Features(checkpoint_api=True, custom_storage={custom}),
                                          device=HostDevice())
main(["--store", {store!r}, "gpu", "{command}", *{args!r}, "--json"], prog_name="gpusnap")
"""


def _gpu_cli(command: str, store: Path, w: "GpuWorkload", custom: bool) -> str:
    """The program that runs `gpusnap gpu COMMAND` (checkpoint: PID g; restore: g PID) on W with the stand-in."""
    args = [str(w.pids[0]), "g"] if command == "checkpoint" else ["g", str(w.pids[0])]
    return GPU_CLI.format(tests=str(REPO / "tests"), store=str(store), command=command, args=args, state=w.state,
                          custom=custom)


def _gpu_paused(command: str, store: Path, w: "GpuWorkload", tmp: Path, custom: bool, stage: str | None,
                pause: Path) -> subprocess.Popen:
    """`gpusnap gpu COMMAND` started, and held at STAGE (None: left to run to the end)."""
    env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_RUN_DIR": str(tmp / "run")}
    if stage is not None:
        env["GPUSNAP_TEST_PAUSE"] = f"{stage}:{pause}"
    p = subprocess.Popen([sys.executable, "-c", _gpu_cli(command, store, w, custom)], env=env, cwd=REPO,
                         start_new_session=True, text=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while stage is not None and not pause.exists():
        if p.poll() is not None:
            raise AssertionError(f"gpusnap ended before {stage}: {p.communicate()}")
        assert time.monotonic() < deadline, f"gpusnap never reached {stage}"
        time.sleep(0.02)
    return p


class GpuWorkload:
    """Two real processes (a parent and its child) the file-backed driver stand-in holds as CUDA
    processes with known GPU memory."""

    def __init__(self, tmp: Path) -> None:
        import random
        from support.driver_standin import SharedStandIn
        self.proc, self.pids = sleeping_pair()
        self.state = str(tmp / "driver.pkl")
        # a random part (stored as a chunk file) and a zero part per process
        self.before = {p: random.Random(p).randbytes(3 << 20) + bytes(1 << 20) for p in self.pids}
        SharedStandIn.create(self.state, self.before)

    def driver(self):  # noqa: ANN201 - tests' SharedStandIn
        from support.driver_standin import SharedStandIn
        return SharedStandIn(self.state)

    def states(self) -> dict[int, str]:
        d = self.driver().load()
        return {p: d.procs[p].state.name for p in self.pids}

    def memory(self) -> dict[int, bytes]:
        d = self.driver().load()
        return {p: bytes(d.procs[p].gpu) for p in self.pids}

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def _chunk_files(store: Path) -> set[str]:
    """The chunks stored durably (indexed pack entries, chunk files), and the packs not yet indexed."""
    index = {p.name for p in (store / "index").iterdir()} if (store / "index").is_dir() else set()
    unindexed = {p.name for p in (store / "packs").iterdir() if p.name not in index} if (store / "packs").is_dir() else set()
    return chunk_ids(store) | unindexed


def _logged_chunks(store: Path) -> set[str]:
    """The chunk ids the one reference log in the journal names."""
    (log,) = (store / "journal").glob("*.refs")
    return {json.loads(line.split(" ", 1)[1])["ref"][0] for line in log.read_text().splitlines()
            if '"k":"chunk"' in line} - {None}


def _gpu_checkpoint_paused(store: Path, w: GpuWorkload, stage: str, tmp: Path,
                           custom: bool = True) -> tuple[subprocess.Popen, Path]:
    pause = tmp / f"pause-{stage}"
    # a THP switch (host-staged path) is recorded where _recover puts it back
    return _gpu_paused("checkpoint", store, w, tmp, custom, stage, pause), pause


def _recover(store: Path, w: GpuWorkload):  # noqa: ANN202 - sandbox.recover.RecoverReport
    from sandbox.recover import recover
    from storage.gpu.device import HostDevice
    from storage.repo.store import SnapshotStore
    return recover(SnapshotStore(str(store), create=False), gpu_driver=w.driver, gpu_device=HostDevice,
                   thp_record_dir=str(store.parent / "run"))


def _gc(store: Path):  # noqa: ANN202 - storage.maintenance.gc.GcReport
    from storage.maintenance.gc import collect
    from storage.repo.store import SnapshotStore
    return collect(SnapshotStore(str(store), create=False))


@pytest.mark.parametrize("sig", SIGNALS, ids=["kill9", "term"])
@pytest.mark.parametrize("stage", ["gpu-stream", "before-commit"])
def test_custom_storage_gpu_checkpoint_interrupted(stage: str, sig: int, tmp_path: Path) -> None:
    """`gpusnap gpu checkpoint` on the custom-storage path, stopped (a) after the driver checkpointed the
    first process and its memory was streamed, the second not yet (gpu-stream), (b) with every GPU
    stream written, before the commit. kill -9: the journal's reference log names the chunks, gc
    between the kill and recover keeps them, and `recover` feeds them back through the custom-storage
    restore; SIGTERM: gpusnap gives the memory back itself. Either way both processes are RUNNING with
    their GPU memory byte-identical, nothing is left in tmp/ or journal/, and gc then reclaims the
    orphaned chunks."""
    store = tmp_path / "store"
    cli = Cli(store)
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, stage, tmp_path)
        rec = json.loads(next((store / "journal").glob("*.json")).read_text())
        assert rec["kind"] == "gpu-checkpoint" and rec["gpu_path"] == "custom-storage" and rec["stage"] == "gpu-frozen"
        assert rec["cuda_pids"] == w.pids
        want = ({w.pids[0]: "CHECKPOINTED", w.pids[1]: "LOCKED"} if stage == "gpu-stream"
                else {x: "CHECKPOINTED" for x in w.pids})
        assert w.states() == want, "the driver released the memory of every CHECKPOINTED process"
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait()
        time.sleep(0.2)
        pause.unlink()
        out, err = p.communicate(timeout=120)
        if sig == signal.SIGKILL:
            assert p.returncode == -signal.SIGKILL
            named = _logged_chunks(store)
            assert named and named <= _chunk_files(store), "the log names only durable chunk files"
            assert cli.run("store", "gc", check=False).returncode == 5, "gc refuses until recover has run"
            g = _gc(store)  # and gc itself keeps what the journal names, whoever calls it
            assert g.chunks_removed == 0 and named <= _chunk_files(store)
            assert cli.run("gpu", "restore", "g", str(w.pids[0]), check=False).returncode == 5
            rep = _recover(store, w)
            assert rep.ok, rep.as_dict()
            (op,) = rep.operations
            assert op.kind == "gpu-checkpoint" and any("restored through custom storage" in a for a in op.actions), op
        else:
            assert p.returncode == 128 + signal.SIGTERM and "SIGTERM" in err, (p.returncode, err)
            assert _recover(store, w).operations == [], "gpusnap undid it itself"
        assert w.states() == {x: "RUNNING" for x in w.pids}
        assert w.memory() == w.before, "GPU memory must come back byte-identical"
        assert list((store / "tmp").iterdir()) == []
        assert sorted(n.name for n in (store / "journal").iterdir()) == ["recover.lock"]  # the key is the host's, never in the store
        assert cli.json("store", "ls") == []
        left = _chunk_files(store)
        assert left, "the killed checkpoint's chunks are still there before gc"
        g = _gc(store)
        assert g.chunks_removed + g.packs_removed > 0 and _chunk_files(store) == set(), "gc reclaims the orphaned chunks"
    finally:
        w.close()


def test_host_staged_gpu_checkpoint_killed_before_commit(tmp_path: Path) -> None:
    """The same kill on the host-staged path (the driver's copy stays inside each process): recover
    restores and unlocks both through the driver, byte-identical; no reference log was kept."""
    store = tmp_path / "store"
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, "before-commit", tmp_path, custom=False)
        assert w.states() == {x: "CHECKPOINTED" for x in w.pids}
        p.kill()
        p.wait()
        pause.unlink()
        p.communicate()
        assert list((store / "journal").glob("*.refs")) == []
        rep = _recover(store, w)
        assert rep.ok and "GPU state resumed" in rep.operations[0].actions[0], rep.as_dict()
        assert w.states() == {x: "RUNNING" for x in w.pids} and w.memory() == w.before
        assert sorted(n.name for n in (store / "journal").iterdir()) == ["recover.lock"]  # the key is the host's, never in the store
        assert list((store / "tmp").iterdir()) == []
    finally:
        w.close()


def test_custom_storage_gpu_checkpoint_killed_mid_region_says_what_is_lost(tmp_path: Path) -> None:
    """kill -9 while the first process's region streams (the driver holds it CHECKPOINTING, its memory
    mapped into the dead gpusnap): recover unlocks the second process, says the first one's memory is
    lost and the state it stays in, clears the record, and gc then reclaims the partial chunks."""
    store = tmp_path / "store"
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, "gpu-chunk", tmp_path)
        assert w.states() == {w.pids[0]: "CHECKPOINTING", w.pids[1]: "LOCKED"}
        p.kill()
        p.wait()
        pause.unlink()
        p.communicate()
        rep = _recover(store, w)
        (op,) = rep.operations
        assert not rep.ok and op.error is None, op
        assert len(op.lost) == 1 and f"pid {w.pids[0]}" in op.lost[0] and "CHECKPOINTING" in op.lost[0], op.lost
        assert w.states() == {w.pids[0]: "CHECKPOINTING", w.pids[1]: "RUNNING"}
        assert w.memory()[w.pids[1]] == w.before[w.pids[1]]
        assert sorted(n.name for n in (store / "journal").iterdir()) == ["recover.lock"]  # the key is the host's, never in the store
        assert list((store / "tmp").iterdir()) == []
        assert _chunk_files(store), "the partial region's chunk was stored"
        _gc(store)
        assert _chunk_files(store) == set()
    finally:
        w.close()


def test_custom_storage_torn_reference_log_is_known_incomplete(tmp_path: Path) -> None:
    """A log whose tail was torn (the second process's last lines cut in the middle, as a crash of the
    disk could leave it): recover restores the first process from its complete list and says exactly
    which region of the second is incomplete; it stays CHECKPOINTED."""
    store = tmp_path / "store"
    w = GpuWorkload(tmp_path)
    try:
        p, pause = _gpu_checkpoint_paused(store, w, "before-commit", tmp_path)
        p.kill()
        p.wait()
        pause.unlink()
        p.communicate()
        log = next((store / "journal").glob("*.refs"))
        data = log.read_bytes()
        second = data.index(f'"stream":"gpu/{w.pids[1]}/0"'.encode())
        cut = data.index(b"\n", data.index(b'"k":"chunk"', second)) - 5   # inside the second region's chunk line
        log.write_bytes(data[:cut])
        rep = _recover(store, w)
        (op,) = rep.operations
        assert op.error is None and len(op.lost) == 1, op
        assert f"pid {w.pids[1]}" in op.lost[0] and f"gpu/{w.pids[1]}/0: 0 of 1 chunks recorded" in op.lost[0], op.lost
        assert "CHECKPOINTED" in op.lost[0]
        assert w.states() == {w.pids[0]: "RUNNING", w.pids[1]: "CHECKPOINTED"}
        assert w.memory()[w.pids[0]] == w.before[w.pids[0]]
        assert sorted(n.name for n in (store / "journal").iterdir()) == ["recover.lock"]  # the key is the host's, never in the store
    finally:
        w.close()


CUSTOM_DUMP = """
import sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from sandbox.criu.snapshot import criu_dump
from sandbox.gpu.driver import Features
from storage.gpu.device import HostDevice
from storage.repo.store import SnapshotStore
criu_dump(SnapshotStore({store!r}), {pid}, "g", gpu_driver=SharedStandIn({state!r}),
          features=Features(checkpoint_api=True, custom_storage=True), device=HostDevice())
"""


@pytest.mark.parametrize("stage", ["before-dump", "before-commit"])
def test_custom_storage_criu_dump_killed_then_recovered(stage: str, tmp_path: Path) -> None:
    """`criu dump` of a tree whose two processes are CUDA processes on the custom-storage path (the
    file-backed stand-in, the engine on host memory), killed -9 with their GPU memory streamed into the
    uncommitted snapshot and released by the driver (before CRIU, or with CRIU done and the tree
    stopped): recover resumes the tree and feeds the memory back from the journal's chunk references."""
    import random
    from support.driver_standin import SharedStandIn
    store = tmp_path / "store"
    tree = Tree(mb=16, detached=True)
    try:
        state = str(tmp_path / "driver.pkl")
        before = {pid: random.Random(pid).randbytes(2 << 20) for pid in (tree.pid, tree.child)}
        SharedStandIn.create(state, before)
        pause = tmp_path / "pause"
        prog = CUSTOM_DUMP.format(tests=str(REPO / "tests"), store=str(store), pid=tree.pid, state=state)
        env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE": f"{stage}:{pause}"}
        p = subprocess.Popen([sys.executable, "-c", prog], env=env, start_new_session=True)
        deadline = time.monotonic() + 120
        while not pause.exists():
            assert p.poll() is None and time.monotonic() < deadline, "the dump did not reach the pause"
            time.sleep(0.02)
        d = SharedStandIn(state).load()
        assert {d.procs[x].state.name for x in before} == {"CHECKPOINTED"} and not any(d.procs[x].gpu for x in before)
        staging = json.loads(next((store / "journal").glob("*.json")).read_text())["staging"]
        p.kill()
        p.wait()
        pause.unlink()
        named = _logged_chunks(store)
        _gc(store)  # may take CRIU's page chunks (the tree itself is still there), never the GPU streams'
        assert named and named <= _chunk_files(store)
        from sandbox.recover import recover
        from storage.gpu.device import HostDevice
        from storage.repo.store import SnapshotStore
        rep = recover(SnapshotStore(str(store), create=False), gpu_driver=lambda: SharedStandIn(state),
                      gpu_device=HostDevice, thp_record_dir=str(tmp_path / "run"))
        assert rep.ok, rep.as_dict()
        assert any("restored through custom storage" in a for a in rep.operations[0].actions), rep.as_dict()
        d = SharedStandIn(state).load()
        assert {d.procs[x].state.name for x in before} == {"RUNNING"}
        assert {x: bytes(d.procs[x].gpu) for x in before} == before
        assert_nothing_left(store, staging)
        assert healthy(tree.report())
        _gc(store)
        assert _chunk_files(store) == set()
    finally:
        tree.kill()


def _gpu_restore(store: Path, w: GpuWorkload, tmp: Path, custom: bool, stage: str | None = None
                 ) -> tuple[subprocess.Popen, Path]:
    """`gpusnap gpu restore g` of W's processes, held at STAGE (None: run to the end)."""
    pause = tmp / f"pause-restore-{stage}"
    return _gpu_paused("restore", store, w, tmp, custom, stage, pause), pause


def _checkpointed(store: Path, w: GpuWorkload, tmp: Path, custom: bool) -> None:
    """W's processes checkpointed into snapshot g by the real `gpu checkpoint` (no pause)."""
    r = subprocess.run([sys.executable, "-c", _gpu_cli("checkpoint", store, w, custom)], env={**os.environ, "PYTHONPATH": pythonpath(),
                                                          "GPUSNAP_RUN_DIR": str(tmp / "run")},
                       cwd=REPO, text=True, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert w.states() == {x: "CHECKPOINTED" for x in w.pids}


# (custom storage, stage, what the driver holds there)
RESTORE_STAGES = [
    (False, "before-restore", ["CHECKPOINTED", "CHECKPOINTED"]),   # the record written, no process touched
    (True, "gpu-fill", ["LOCKED", "CHECKPOINTED"]),               # the first process filled, the second not
    (False, "gpu-restored", ["LOCKED", "LOCKED"]),                # every one has its memory back, none unlocked
]


@pytest.mark.parametrize("sig", SIGNALS, ids=["kill9", "term"])
@pytest.mark.parametrize("custom,stage,held", RESTORE_STAGES, ids=[s for _, s, _ in RESTORE_STAGES])
def test_gpu_restore_interrupted(custom: bool, stage: str, held: list[str], sig: int, tmp_path: Path) -> None:
    """`gpusnap gpu restore` is a journaled operation (kind gpu-restore): stopped at each of its stages by
    kill -9 (then `gpusnap recover`) or SIGTERM (its own undo, the same one), every process whose GPU
    memory was back runs, the others stay CHECKPOINTED, nothing is left in journal/ or tmp/, and a
    second `gpu restore` brings every process back RUNNING with its memory byte-identical."""
    store = tmp_path / "store"
    w = GpuWorkload(tmp_path)
    try:
        _checkpointed(store, w, tmp_path, custom)
        p, pause = _gpu_restore(store, w, tmp_path, custom, stage)
        rec = json.loads(next((store / "journal").glob("*.json")).read_text())
        assert rec["kind"] == "gpu-restore" and rec["cuda_pids"] == w.pids, rec
        assert rec["stage"] == ("started" if stage == "before-restore" else "filling"), rec
        assert rec["gpu_path"] == ("custom-storage" if custom else "host-staged")
        assert [w.states()[x] for x in w.pids] == held
        os.kill(p.pid, sig)
        if sig == signal.SIGKILL:
            p.wait()
        time.sleep(0.2)
        pause.unlink()
        out, err = p.communicate(timeout=120)
        if sig == signal.SIGKILL:
            assert p.returncode == -signal.SIGKILL
            assert Cli(store).run("gpu", "restore", "g", str(w.pids[0]), check=False).returncode == 5
            rep = _recover(store, w)
            assert rep.ok, rep.as_dict()
            (op,) = rep.operations
            assert op.kind == "gpu-restore", op
            locked = [x for x, s in zip(w.pids, held) if s == "LOCKED"]
            if locked:
                assert any(f"unlocked {locked}" in a for a in op.actions), op
            after = {x: "RUNNING" if s == "LOCKED" else s for x, s in zip(w.pids, held)}
        else:
            assert p.returncode != 0 and "SIGTERM" in err, (p.returncode, err)
            assert _recover(store, w).operations == [], "gpusnap undid it itself"
            # its undo leaves a process RUNNING or CHECKPOINTED, never LOCKED; with custom storage the
            # engine's own rollback checked the filled one back in (all CHECKPOINTED)
            after = w.states()
            assert set(after.values()) <= {"RUNNING", "CHECKPOINTED"}, after
            if stage == "gpu-restored":
                assert after == {x: "RUNNING" for x in w.pids}, after
        assert w.states() == after
        assert sorted(n.name for n in (store / "journal").iterdir()) == ["recover.lock"]  # the key is the host's, never in the store
        assert list((store / "tmp").iterdir()) == []
        running = [x for x in w.pids if after[x] == "RUNNING"]
        assert {x: w.memory()[x] for x in running} == {x: w.before[x] for x in running}
        p, _ = _gpu_restore(store, w, tmp_path, custom)   # and the restore runs again, to the end
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert w.states() == {x: "RUNNING" for x in w.pids}
        assert w.memory() == w.before, "GPU memory must come back byte-identical"
        assert sorted(n.name for n in (store / "journal").iterdir()) == ["recover.lock"]  # the key is the host's, never in the store
    finally:
        w.close()
