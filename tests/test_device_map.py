"""`--device-map` against the driver stand-in: every bad map refused in one line with its exit code before
anything is restored (the stand-in's calls and states show nothing was touched), the memory check
(the bytes of every process landing on a GPU against its free memory), each process restored onto
its own part of the map, the identity map a no-op, and `criu restore --device-map` through real CRIU."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import REPO, pythonpath
from support.crash import sleeping_pair
from support.driver_standin import SharedStandIn, StandInDriver, standin_gpus
from sandbox.gpu.device_map import DeviceMapError, PerProcessMap, check_memory, plan
from sandbox.gpu.driver import Features, ProcessState as S

GIB = 1 << 30
GPUS = standin_gpus(2, total=4 * GIB)
U0, U1 = GPUS[0].uuid, GPUS[1].uuid
SNAP = [{"index": g.index, "uuid": g.uuid, "name": g.name} for g in GPUS]


# ---- the check itself ---------------------------------------------------------------------------

def test_two_processes_onto_a_gpu_without_room_for_both_are_refused() -> None:
    from dataclasses import replace
    usage = {11: {U0: 3 * GIB // 2}, 12: {U0: 3 * GIB // 2}}   # both held 1.5 GiB on GPU 0
    here = [replace(GPUS[0], free_bytes=4 * GIB), replace(GPUS[1], free_bytes=2 * GIB)]
    with pytest.raises(DeviceMapError, match=r"GPU 1 .* has 2.00 GiB free, the 2 process\(es\) \[11, 12\] "
                                             r"mapped onto it held 3.00 GiB") as ei:
        plan(["0=1", "1=0"], SNAP, here, usage)
    assert ei.value.exit_code == 4
    # with room for both it goes ahead, and says what lands where
    here[1] = replace(GPUS[1], free_bytes=3 * GIB)
    p = plan(["0=1", "1=0"], SNAP, here, usage)
    assert p.gpu_map == {U0: U1, U1: U0} and p.need == {U1: 3 * GIB} and p.unchecked is None


def test_one_process_on_two_gpus_needs_room_on_each_target() -> None:
    from dataclasses import replace
    usage = {11: {U0: 2 * GIB, U1: GIB}}
    here = [replace(GPUS[0], free_bytes=GIB // 2), replace(GPUS[1], free_bytes=4 * GIB)]
    with pytest.raises(DeviceMapError, match=r"GPU 0 .* has 0.50 GiB free.*\[11\] mapped onto it held 1.00 GiB"):
        plan(["0=1", "1=0"], SNAP, here, usage)
    with pytest.raises(DeviceMapError, match="two GPUs onto one"):  # both of its GPUs onto one: never
        plan(["0=1", "1=1"], SNAP, here, usage)


def test_unknown_figures_skip_the_memory_check_and_say_so() -> None:
    assert check_memory({U0: U1}, None, GPUS)[1] == "the snapshot does not record its processes' GPU memory"
    assert "free memory unknown" in (check_memory({U0: U1}, {11: {U0: 5}}, GPUS)[1] or "")


def test_only_the_gpus_the_processes_held_must_be_mapped() -> None:
    """A process that held GPU 0 alone is moved with `0=1`; a map missing GPU 0 is refused; with no
    record of what was held, every GPU of the snapshot must be named."""
    assert plan(["0=1"], SNAP, GPUS, {11: {U0: 5}}).gpu_map == {U0: U1}
    with pytest.raises(DeviceMapError, match="missing " + U0):
        plan(["1=0"], SNAP, GPUS, {11: {U0: 5}})
    with pytest.raises(DeviceMapError, match="missing " + U1):
        plan(["0=1"], SNAP, GPUS, None)


def test_identity_map_is_checked_then_dropped() -> None:
    assert plan(["0=0", "1=1"], SNAP, GPUS, None).gpu_map == {}
    with pytest.raises(DeviceMapError, match="no GPU '2' on this machine"):
        plan(["0=0", "1=2"], SNAP, GPUS, None)


def test_each_process_gets_the_pairs_of_its_own_gpus() -> None:
    d = StandInDriver(gpu_list=list(GPUS))
    d.add(11, b"a" * 100, {U0: GIB})
    d.add(12, b"b" * 100, {U1: GIB})
    d.add(13, b"c" * 100)  # no record: the whole map
    for p in (11, 12, 13):
        d.lock(p, 10)
        d.checkpoint(p)
    m = PerProcessMap(d, {U0: U1, U1: U0}, {11: {U0: GIB}, 12: {U1: GIB}})
    for p in (11, 12, 13):
        m.restore(p, {U0: U1, U1: U0})
    assert [d.procs[p].maps for p in (11, 12, 13)] == [[{U0: U1}], [{U1: U0}], [{U0: U1, U1: U0}]]
    assert d.procs[11].placement == {U1: GIB} and d.procs[12].placement == {U0: GIB}
    assert m.get_state(11) == S.LOCKED  # every other call goes to the driver as it is


# ---- `gpusnap gpu restore --device-map` with the stand-in ---------------------------------------

GPU_CLI = """
import functools, sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn, standin_gpus
from cli import gpu_cmd, main
from sandbox.gpu.driver import Features
d = SharedStandIn({state!r})
# the real `gpusnap gpu checkpoint|restore`, the driver stand-in (host-staged path) in place of the CUDA driver
feats = Features(bindings="stand-in", driver_version="stand-in", checkpoint_api=True, custom_storage=False, gpus=d.gpus())
gpu_cmd.gpu_checkpoint = functools.partial(gpu_cmd.gpu_checkpoint, driver=d, features=feats)
gpu_cmd.gpu_restore = functools.partial(gpu_cmd.gpu_restore, driver=d, features=feats)
main(["--store", {store!r}, *sys.argv[1:]], prog_name="gpusnap")
"""


class Pair:
    """Two real processes (a parent and its child) the file-backed stand-in holds as CUDA processes,
    each with known GPU memory, placed on the stand-in's GPUs as PLACEMENT says."""

    def __init__(self, tmp: Path, placement: dict[int, dict[str, int]], reserved: dict[str, int] | None = None,
                 gpus: int = 2) -> None:
        self.proc, self.pids = sleeping_pair()
        self.state = str(tmp / "driver.pkl")
        self.before = {p: os.urandom(64 << 10) for p in self.pids}
        SharedStandIn.create(self.state, self.before, gpus=standin_gpus(gpus, total=4 * GIB), reserved=reserved,
                             placement={self.pids[i]: pl for i, pl in placement.items()})
        self.store = tmp / "store"

    def gpusnap(self, *args: str) -> subprocess.CompletedProcess[str]:
        prog = GPU_CLI.format(tests=str(REPO / "tests"), state=self.state, store=str(self.store))
        return subprocess.run([sys.executable, "-c", prog, *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO)

    def driver(self) -> StandInDriver:
        return SharedStandIn(self.state).load()

    def close(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    # both processes held 1.5 GiB on GPU 0; another tenant holds 2 GiB of GPU 1
    p = Pair(tmp_path, {0: {U0: 3 * GIB // 2}, 1: {U0: 3 * GIB // 2}}, reserved={U1: 2 * GIB})
    yield p
    p.close()


def _checkpointed(pair: Pair) -> None:
    r = pair.gpusnap("gpu", "checkpoint", str(pair.pids[0]), "s", "--json")
    assert r.returncode == 0, r.stderr
    meta = json.loads(subprocess.run([sys.executable, "-m", "cli", "--store", str(pair.store), "store", "inspect",
                                      "s", "--json"], capture_output=True, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": pythonpath()}).stdout)["meta"]
    assert meta["gpu_bytes"] == {str(p): {U0: 3 * GIB // 2} for p in pair.pids}, "recorded before the lock"
    assert [g["uuid"] for g in meta["gpus"]] == [U0, U1]


BAD_MAPS = [  # (the map, what the one line says, the exit code)
    (["0=7,1=0"], "no GPU '7' on this machine (2 GPU(s) here)", 4),
    (["0=1", "0=0"], "names the snapshot's GPU 0", 2),
    (["0=1,1=1"], "maps two GPUs onto one", 2),
    (["1=0"], "must list every checkpointed GPU; missing " + U0, 2),  # GPU 0 held both, GPU 1 neither
    (["3=0,1=1"], "no GPU '3' in the snapshot", 2),
    (["0:1"], "expected OLD=NEW", 2),
    (["0=1,1=0"], "GPU 1 (" + U1 + ") has 2.00 GiB free, the 2 process(es)", 4),  # both land on GPU 1
]


def test_bad_maps_are_refused_in_one_line_before_anything_is_restored(pair: Pair) -> None:
    _checkpointed(pair)
    calls = len(pair.driver().calls)
    for items, says, code in BAD_MAPS:
        r = pair.gpusnap("gpu", "restore", "s", str(pair.pids[0]), *(a for i in items for a in ("--device-map", i)))
        assert r.returncode == code, (items, r.returncode, r.stderr)
        assert len(r.stderr.splitlines()) == 1 and says in r.stderr, (items, r.stderr)
        d = pair.driver()
        assert {d.procs[p].state for p in pair.pids} == {S.CHECKPOINTED}, items
        assert len(d.calls) == calls, f"{items}: the driver was called: {d.calls[calls:]}"
    # the processes are restorable as they were: without a map, in place, byte for byte
    r = pair.gpusnap("gpu", "restore", "s", str(pair.pids[0]))
    assert r.returncode == 0, r.stderr
    d = pair.driver()
    assert {d.procs[p].state for p in pair.pids} == {S.RUNNING}
    assert {p: bytes(d.procs[p].gpu) for p in pair.pids} == pair.before
    assert all(d.procs[p].maps == [None] and d.procs[p].placement == {U0: 3 * GIB // 2} for p in pair.pids)


def test_identity_map_on_one_gpu_is_a_no_op(tmp_path: Path) -> None:
    """`--device-map 0=0` on a one-GPU machine: the driver gets no pairs, exactly as without a map; and
    `0=1` there is refused (exit 4) with the processes left CHECKPOINTED, restorable."""
    p = Pair(tmp_path, {0: {U0: GIB}, 1: {U0: GIB}}, gpus=1)
    try:
        r = p.gpusnap("gpu", "checkpoint", str(p.pids[0]), "s")
        assert r.returncode == 0, r.stderr
        r = p.gpusnap("gpu", "restore", "s", str(p.pids[0]), "--device-map", "0=1")
        assert r.returncode == 4 and "no GPU '1' on this machine (1 GPU(s) here)" in r.stderr, r.stderr
        assert len(r.stderr.splitlines()) == 1
        assert {p.driver().procs[x].state for x in p.pids} == {S.CHECKPOINTED}
        r = p.gpusnap("gpu", "restore", "s", str(p.pids[0]), "--device-map", "0=0")
        assert r.returncode == 0, r.stderr
        d = p.driver()
        assert {d.procs[x].state for x in p.pids} == {S.RUNNING}
        assert {x: bytes(d.procs[x].gpu) for x in p.pids} == p.before
        assert all(d.procs[x].maps == [None] for x in p.pids), "the driver got no GPU pairs"
        assert [c for _, c in d.calls].count("restore") == 2
    finally:
        p.close()


def test_swap_restores_each_process_onto_its_new_gpu(tmp_path: Path) -> None:
    """Tensor-parallel shape: one process on each GPU; `0=1,1=0` moves each onto the other GPU, each
    driver call carrying only the pair of that process's GPU."""
    p = Pair(tmp_path, {0: {U0: GIB}, 1: {U1: GIB}})
    try:
        assert p.gpusnap("gpu", "checkpoint", str(p.pids[0]), "s").returncode == 0
        r = p.gpusnap("gpu", "restore", "s", str(p.pids[0]), "--device-map", "0=1,1=0", "--json")
        assert r.returncode == 0, r.stderr
        d = p.driver()
        a, b = p.pids
        assert d.procs[a].maps == [{U0: U1}] and d.procs[b].maps == [{U1: U0}]
        assert d.procs[a].placement == {U1: GIB} and d.procs[b].placement == {U0: GIB}
        assert {x: bytes(d.procs[x].gpu) for x in p.pids} == p.before
        assert {d.procs[x].state for x in p.pids} == {S.RUNNING}
    finally:
        p.close()


def test_memory_tier_refuses_a_device_map(pair: Pair) -> None:
    r = pair.gpusnap("gpu", "restore", "s", str(pair.pids[0]), "--tier", "memory", "--device-map", "0=1")
    assert r.returncode == 2 and "not supported with --tier memory" in r.stderr


# ---- `gpusnap criu restore --device-map`: real CRIU, the stand-in for the GPU part ----------------

CRIU_CLI = """
import functools, sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from cli import criu_cmd, main
criu_cmd.criu_restore = functools.partial(criu_cmd.criu_restore, gpu_driver=SharedStandIn({state!r}))
main(["--store", {store!r}, *sys.argv[1:]], prog_name="gpusnap")
"""


@pytest.mark.root
def test_criu_restore_checks_and_applies_the_map(tmp_path: Path) -> None:
    """A tree dumped by CRIU whose two processes the stand-in holds as CUDA processes (host-staged, one
    on each GPU): every bad map is refused before CRIU runs (no process, no journal record, the
    stand-in untouched); then `--device-map 0=1,1=0` restores the tree and each process's GPU state
    onto the other GPU, byte for byte."""
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    from sandbox.criu.runner import find_criu
    if not find_criu():
        pytest.fail("CRIU >= 4 not installed: run scripts/setup.sh")
    from support.criu import Tree, healthy
    from sandbox.criu.snapshot import criu_dump
    from storage.repo.store import SnapshotStore
    tree = Tree(mb=4, detached=True)
    try:
        state = str(tmp_path / "driver.pkl")
        pids = [tree.pid, tree.child]
        before = {p: os.urandom(64 << 10) for p in pids}
        SharedStandIn.create(state, before, gpus=list(GPUS), placement={tree.pid: {U0: GIB}, tree.child: {U1: GIB}},
                             reserved={U0: 3 * GIB + GIB // 2})
        store = tmp_path / "store"
        drv = SharedStandIn(state)
        criu_dump(SnapshotStore(str(store)), tree.pid, "c", gpu_driver=drv,
                  features=Features(checkpoint_api=True, custom_storage=False, gpus=drv.gpus()))
        tree.reap()
        # the dump kills the tree once committed; SIGKILL is delivered asynchronously (a loaded CI
        # machine once saw it alive right after the call returned)
        from sandbox.host.processes import wait_gone
        assert not wait_gone(pids, 10), "the committed dump killed the tree"
        calls = len(drv.load().calls)
        prog = CRIU_CLI.format(tests=str(REPO / "tests"), state=state, store=str(store))

        def restore(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-c", prog, "criu", "restore", "c", *args], capture_output=True,
                                  text=True, timeout=120, env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO)
        # GPU 0 has 0.5 GiB free (another tenant holds the rest): the child's 1 GiB cannot land there
        for args, says, code in ((["--device-map", "0=7,1=0"], "no GPU '7' on this machine", 4),
                                 (["--device-map", "0=1"], "must list every checkpointed GPU", 2),
                                 (["--device-map", "0=1,1=0"], "GPU 0 (" + U0 + ") has 0.50 GiB free", 4)):
            r = restore(*args)
            assert r.returncode == code and len(r.stderr.splitlines()) == 1 and says in r.stderr, (args, r.stderr)
            assert not tree.alive(), "nothing was restored"
            assert not list((store / "journal").glob("*.json")), "no operation was begun"
            d = drv.load()
            assert len(d.calls) == calls and {d.procs[p].state for p in pids} == {S.CHECKPOINTED}
        # the other tenant leaves: now the swap fits
        d = drv.load()
        d.reserved = {}
        drv._save(d)
        r = restore("--device-map", "0=1,1=0", "--json")
        assert r.returncode == 0, r.stderr
        assert tree.alive() and healthy(tree.report())
        d = drv.load()
        assert {d.procs[p].state for p in pids} == {S.RUNNING}
        assert {p: bytes(d.procs[p].gpu) for p in pids} == before
        assert d.procs[tree.pid].maps == [{U0: U1}] and d.procs[tree.child].maps == [{U1: U0}]
    finally:
        tree.close()
