"""The driver's host copy of each CUDA process started as soon as the split fill has written that
process's memory (sandbox.gpu.state.EarlyRestore), through real CRIU with the driver stand-in for the
GPU part: the process with the most GPU memory is filled first and its copy starts while the fill
goes on; every process ends RUNNING with its bytes; a copy that fails fails the restore as a failed
copy after the fill does; GPUSNAP_EARLY_GPU=0 waits for the fill."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, pythonpath
from support.criu import Tree, healthy
from support.driver_standin import SharedStandIn, standin_gpus
from sandbox.gpu.driver import Features, ProcessState as S

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_criu")]
GIB = 1 << 30
GPUS = standin_gpus(1, total=8 * GIB)
SPLIT = {"GPUSNAP_CRIU_IMAGES": "stream", "GPUSNAP_CRIU_SPLIT_MIN": str(8 << 20),
         "GPUSNAP_CRIU_SPLIT_SHARED_MIN": str(8 << 20)}  # the forked tree's own copies too
CRIU_CLI = """
import functools, sys
sys.path.insert(0, {tests!r})
from support.driver_standin import SharedStandIn
from cli import criu_cmd, main
criu_cmd.criu_restore = functools.partial(criu_cmd.criu_restore, gpu_driver=SharedStandIn({state!r}))
main(["--store", {store!r}, *sys.argv[1:]], prog_name="gpusnap")
"""


def _dumped(tmp_path: Path) -> tuple[Tree, SharedStandIn, dict[int, bytes], Path]:
    """A 48 MiB tree whose parent the stand-in holds with 2 GiB of GPU memory, its child with 1 GiB,
    dumped on the host-staged path (the tree is gone after)."""
    from sandbox.criu.snapshot import criu_dump
    from sandbox.host.processes import wait_gone
    from storage.repo.store import SnapshotStore
    tree = Tree(mb=48, detached=True)
    try:
        pids = [tree.pid, tree.child]
        before = {p: os.urandom(64 << 10) for p in pids}
        state = str(tmp_path / "driver.pkl")
        SharedStandIn.create(state, before, gpus=list(GPUS),
                             placement={tree.pid: {GPUS[0].uuid: 2 * GIB}, tree.child: {GPUS[0].uuid: GIB}})
        drv = SharedStandIn(state)
        store = tmp_path / "store"
        criu_dump(SnapshotStore(str(store)), tree.pid, "c", gpu_driver=drv,
                  features=Features(checkpoint_api=True, custom_storage=False, gpus=drv.gpus()))
        tree.reap()
        assert not wait_gone(pids, 10), "the committed dump killed the tree"
    except BaseException:
        tree.close()  # no workload left behind by a failed set-up
        raise
    return tree, drv, before, store


def _restore(drv: SharedStandIn, store: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    prog = CRIU_CLI.format(tests=str(REPO / "tests"), state=drv.path, store=str(store))
    return subprocess.run([sys.executable, "-c", prog, "criu", "restore", "c", "--json"], capture_output=True,
                          text=True, timeout=180, cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath(), **env})


def _restores(drv: SharedStandIn, after: int) -> list[tuple[int, float]]:
    return [(p, t) for p, c, t in drv.load().stamps[after:] if c == "restore"]


@pytest.mark.parametrize("procs", ["1", "3"], ids=["fill-in-process", "fill-in-3-workers"])
def test_each_copy_starts_once_its_process_is_filled_the_largest_first(tmp_path: Path, procs: str) -> None:
    tree, drv, before, store = _dumped(tmp_path)
    try:
        n = len(drv.load().stamps)
        r = _restore(drv, store, {**SPLIT, "GPUSNAP_FILL_PROCS": procs})
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        marks = rep["stages"]["served"]["monotonic"]
        assert rep["stages"]["served"]["fill_memory"]["procs"] == int(procs)
        assert set(rep["stages"]["gpu_early"]) == {str(tree.pid), str(tree.child)}, rep["stages"]
        # the process with the most GPU memory is filled first, each said filled before the fill's
        # end, and each restored once, by the early copies (that a process is let run only once its
        # own memory is in is tested in tests/test_criu_stream.py, its memory hashed at that moment)
        assert marks[f"filled_{tree.pid}"] <= marks[f"filled_{tree.child}"] <= marks["fill_done"], marks
        # the phase marks a benchmark's timeline splits the restore by (bench_e2e._RESTORE_PHASES), in order
        order = ["entered", "loaded", "early_begin", "gpu_side_begin", "gpu_side_done", "serve_begin", "pagemaps_read", "planned", "fill_started", "criu_begin",
                 "criu_done", "fill_done", "gpu_begin", "gpu_done"]
        assert [marks[k] for k in order] == sorted(marks[k] for k in order), marks
        assert "early read" in rep["stages"]["served"]["stages"]  # started at the load, reported by the serve side
        restores = _restores(drv, n)
        assert sorted(p for p, _ in restores) == sorted(before), restores
        d = drv.load()
        assert {d.procs[p].state for p in before} == {S.RUNNING}
        assert {p: bytes(d.procs[p].gpu) for p in before} == before
        assert healthy(tree.report())
    finally:
        tree.close()


def test_early_copies_off_wait_for_the_whole_fill(tmp_path: Path) -> None:
    tree, drv, before, store = _dumped(tmp_path)
    try:
        n = len(drv.load().stamps)
        r = _restore(drv, store, {**SPLIT, "GPUSNAP_EARLY_GPU": "0"})
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        marks = rep["stages"]["served"]["monotonic"]
        assert "gpu_early" not in rep["stages"] and not any(k.startswith("filled_") for k in marks)
        assert all(t > marks["fill_done"] for _, t in _restores(drv, n))
        d = drv.load()
        assert {p: bytes(d.procs[p].gpu) for p in before} == before and healthy(tree.report())
    finally:
        tree.close()


def test_a_failed_early_copy_fails_the_restore_like_any_copy_and_recover_finishes_it(tmp_path: Path) -> None:
    """A copy that fails while the fill goes on fails the restore as a failed copy after the fill does:
    one line naming the process, the restored tree kept (its CPU state is whole) with the failed
    process's GPU state CHECKPOINTED and the operation journaled; once the fault is gone,
    `gpusnap recover` brings its GPU state back."""
    from sandbox.recover import recover
    from storage.repo.store import SnapshotStore
    outs = {}
    for early in ("0", "1"):
        (tmp_path / early).mkdir()
        tree, drv, before, store = _dumped(tmp_path / early)
        try:
            d = drv.load()
            d.fail[(tree.child, "restore")] = "CUDA_ERROR_UNKNOWN"
            drv._save(d)
            r = _restore(drv, store, {**SPLIT, "GPUSNAP_EARLY_GPU": early})
            assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
            assert r.stderr.count(f"pid {tree.child}: restore failed: CUDA_ERROR_UNKNOWN") == 2, r.stderr
            assert "gpusnap recover" in r.stderr
            d = drv.load()
            outs[early] = {p == tree.child: d.procs[p].state for p in before}
            assert tree.alive() and len(list((store / "journal").glob("*.json"))) == 1
            d.fail.clear()
            drv._save(d)
            rep = recover(SnapshotStore(str(store), create=False), gpu_driver=lambda: SharedStandIn(drv.path))
            assert len(rep.operations) == 1, rep
            d = drv.load()
            assert {d.procs[p].state for p in before} == {S.RUNNING}
            assert {p: bytes(d.procs[p].gpu) for p in before} == before and healthy(tree.report())
        finally:
            tree.close()
    assert outs["0"] == outs["1"] == {False: S.RUNNING, True: S.CHECKPOINTED}, outs


def test_early_reads_late_start_where_the_serve_side_plans(tmp_path: Path) -> None:
    """GPUSNAP_EARLY_READS=late (for measuring): no early reads at the load, the serve side starts them."""
    tree, drv, before, store = _dumped(tmp_path)
    try:
        r = _restore(drv, store, {**SPLIT, "GPUSNAP_EARLY_READS": "late"})
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert "early_begin" not in rep["stages"]["served"]["monotonic"]
        assert "early read" in rep["stages"]["served"]["stages"]
        d = drv.load()
        assert {p: bytes(d.procs[p].gpu) for p in before} == before and healthy(tree.report())
    finally:
        tree.close()
