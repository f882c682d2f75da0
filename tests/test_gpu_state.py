"""sandbox/gpu/state.py, the one owner of GPU freeze/thaw, against the driver stand-in: idempotence
(a second checkpoint or thaw changes nothing), rollback on every path (nothing lost, nobody left
frozen), parallel locking, and the path chosen from the probe."""
from __future__ import annotations

import os
import time

import pytest

from support.driver_standin import StandInDriver
from sandbox.gpu import state
from sandbox.gpu.driver import DeviceRegion, Features, ProcessState as S
from sandbox.gpu.regions import EngineSpill
from storage.gpu.device import HostDevice

PIDS = [201, 202, 203, 204]


def fleet() -> StandInDriver:
    d = StandInDriver()
    for p in PIDS:
        d.add(p, os.urandom(8192) + bytes([p % 256]) * 300)
    return d


def memory(d: StandInDriver) -> dict[int, bytes]:
    return {p: bytes(d.procs[p].gpu) for p in PIDS}


class MemRegions:
    """A RegionStore over host memory: what save() took, load() gives back; faults per pid."""

    def __init__(self, d: StandInDriver) -> None:
        self.d = d
        self.saved: dict[int, bytes] = {}
        self.fail_save: set[int] = set()
        self.fail_load: set[int] = set()

    def save(self, pid: int, regions: list[DeviceRegion]) -> None:
        if pid in self.fail_save:
            raise OSError(f"No space left on device (pid {pid})")
        self.saved[pid] = bytes(self.d.region_bytes(pid))

    def load(self, pid: int, regions: list[DeviceRegion]) -> None:
        if pid in self.fail_load:
            raise OSError(f"read error (pid {pid})")
        self.d.region_bytes(pid)[:] = self.saved[pid]


def host() -> state.Backend:
    return state.backend_for(state.GpuPath.HOST_STAGED, thp_mode=None)


def custom(d: StandInDriver) -> tuple[state.Backend, MemRegions]:
    r = MemRegions(d)
    return state.backend_for(state.GpuPath.CUSTOM_STORAGE, regions=r, spill=EngineSpill(HostDevice())), r


def count(d: StandInDriver, call: str) -> int:
    return sum(1 for _, c in d.calls if c == call)


@pytest.mark.parametrize("path", ["host", "custom"])
def test_checkpoint_and_thaw_are_idempotent(path: str) -> None:
    d = fleet()
    before = memory(d)
    b = host() if path == "host" else custom(d)[0]
    rep = state.checkpoint(d, PIDS, b)
    assert rep.frozen == tuple(PIDS) and rep.already == () and rep.path.value == ("host-staged" if path == "host" else "custom-storage")
    calls = len(d.calls)
    again = state.checkpoint(d, PIDS, b)           # CRIU's second pre-dump
    assert again.frozen == () and again.already == tuple(PIDS) and len(d.calls) == calls + 0
    assert all(d.get_state(p) == S.CHECKPOINTED for p in PIDS)
    t = state.thaw(d, PIDS, b)
    assert t.restored == tuple(PIDS) and memory(d) == before
    calls = len(d.calls)
    t2 = state.thaw(d, PIDS, b)                    # a second post-resume
    assert t2.restored == () and t2.running == tuple(PIDS) and len(d.calls) == calls
    assert all(d.get_state(p) == S.RUNNING for p in PIDS)


def test_checkpoint_freezes_only_the_running_ones_and_refuses_a_held_one() -> None:
    d = fleet()
    b = host()
    state.checkpoint(d, PIDS[:2], b)
    rep = state.checkpoint(d, PIDS, b)
    assert rep.frozen == tuple(PIDS[2:]) and rep.already == tuple(PIDS[:2])
    assert count(d, "checkpoint") == len(PIDS)
    e = fleet()
    e.lock(203, 10)
    calls = len(e.calls)
    with pytest.raises(state.GpuStateError, match="pid 203 is LOCKED.*nothing was changed"):
        state.checkpoint(e, PIDS, host())
    assert len(e.calls) == calls and [e.get_state(p) for p in PIDS] == [S.RUNNING, S.RUNNING, S.LOCKED, S.RUNNING]


def test_thaw_unlocks_a_locked_one_and_refuses_a_gone_one() -> None:
    d = fleet()
    b = host()
    state.checkpoint(d, PIDS, b)
    d.restore(201)                                  # restored but never unlocked
    rep = state.thaw(d, PIDS, b)
    assert rep.unlocked == (201,) and rep.restored == tuple(PIDS[1:]) and all(d.get_state(p) == S.RUNNING for p in PIDS)
    with pytest.raises(state.GpuStateError, match="pid 999 is gone.*nothing was changed"):
        state.thaw(d, [201, 999], b)


@pytest.mark.parametrize("path", ["host", "custom"])
def test_freeze_block_failure_thaws_what_it_froze(path: str) -> None:
    d = fleet()
    before = memory(d)
    b = host() if path == "host" else custom(d)[0]
    with pytest.raises(RuntimeError, match="commit failed"):
        with state.freeze(d, PIDS, b) as rep:
            assert rep.frozen == tuple(PIDS) and all(d.get_state(p) == S.CHECKPOINTED for p in PIDS)
            raise RuntimeError("commit failed")
    assert all(d.get_state(p) == S.RUNNING for p in PIDS) and memory(d) == before


def test_freeze_thaws_only_what_it_froze() -> None:
    d = fleet()
    b = host()
    state.checkpoint(d, [201], b)                   # someone else's checkpoint
    with pytest.raises(RuntimeError):
        with state.freeze(d, PIDS, b):
            raise RuntimeError("x")
    assert d.get_state(201) == S.CHECKPOINTED and all(d.get_state(p) == S.RUNNING for p in PIDS[1:])


def test_custom_streaming_failure_midway_gives_everyone_their_memory_back() -> None:
    """The third process's bytes cannot be stored: it gets its memory back from the spill, the first
    two from what was already stored, the fourth (locked, not started) is unlocked."""
    d = fleet()
    before = memory(d)
    b, r = custom(d)
    r.fail_save.add(203)
    with pytest.raises(OSError, match="No space left"):
        state.checkpoint(d, PIDS, b)
    assert all(d.get_state(p) == S.RUNNING for p in PIDS) and memory(d) == before
    assert count(d, "restore_custom") == 3  # 201 and 202 from the store, 203 from the spill


def test_custom_rollback_that_cannot_fill_leaves_it_checkpointed_and_says_so() -> None:
    """The bytes of a process already handed over cannot come back now (the agent's pipe): it is
    checked in again (CHECKPOINTED, bytes kept where they went), the error names it, the others run."""
    d = fleet()
    b, r = custom(d)
    r.fail_save.add(203)
    r.fail_load.add(201)
    with pytest.raises(state.GpuStateError, match="pid 201 stays CHECKPOINTED"):
        state.checkpoint(d, PIDS, b)
    assert d.get_state(201) == S.CHECKPOINTED and all(d.get_state(p) == S.RUNNING for p in PIDS[1:])
    r.fail_load.clear()
    state.thaw(d, PIDS, b)
    assert d.get_state(201) == S.RUNNING and bytes(d.procs[201].gpu) == r.saved[201]


def test_custom_restore_failure_keeps_the_set_checkpointed_and_retry_works() -> None:
    d = fleet()
    before = memory(d)
    b, r = custom(d)
    state.checkpoint(d, PIDS, b)
    r.fail_load.add(203)
    with pytest.raises(state.GpuStateError, match="every process stays CHECKPOINTED"):
        state.thaw(d, PIDS, b)
    assert all(d.get_state(p) == S.CHECKPOINTED for p in PIDS)
    r.fail_load.clear()
    state.thaw(d, PIDS, b)
    assert all(d.get_state(p) == S.RUNNING for p in PIDS) and memory(d) == before


def test_custom_locks_in_parallel_and_undoes_a_failed_lock() -> None:
    d = fleet()
    for p in PIDS:
        d.delay[(p, "lock")] = 0.3
    b, _ = custom(d)
    t0 = time.perf_counter()
    state.checkpoint(d, PIDS, b)
    assert time.perf_counter() - t0 < 0.3 * len(PIDS) / 2, "locks ran one at a time"
    e = fleet()
    before = memory(e)
    e.fail[(204, "lock")] = "CUDA_ERROR_TIMEOUT"
    with pytest.raises(state.GpuCheckpointError, match="pid 204.*TIMEOUT"):
        state.checkpoint(e, PIDS, custom(e)[0])
    assert all(e.get_state(p) == S.RUNNING for p in PIDS) and memory(e) == before


def test_path_is_chosen_from_the_probe() -> None:
    assert state.path_for(Features(checkpoint_api=True, custom_storage=True)) == state.GpuPath.CUSTOM_STORAGE
    assert state.path_for(Features(checkpoint_api=True)) == state.GpuPath.HOST_STAGED
    with pytest.raises(state.GpuStateError, match="no checkpoint API .driver 535."):
        state.path_for(Features(reason="driver 535"))
    with pytest.raises(state.GpuStateError, match="needs a place"):
        state.backend_for(state.GpuPath.CUSTOM_STORAGE)


def test_plan_is_the_one_choice_of_a_path() -> None:
    """A restore goes back the way its memory left; a checkpoint takes what the probe offers; custom
    storage only where its bytes have somewhere to go; the plan's backend is wired to where they go."""
    both = Features(checkpoint_api=True, custom_storage=True)
    assert state.plan(features=both).path == state.GpuPath.CUSTOM_STORAGE
    assert state.plan(features=both, streams=False).path == state.GpuPath.HOST_STAGED
    assert state.plan(features=Features(checkpoint_api=True)).path == state.GpuPath.HOST_STAGED
    assert state.plan(recorded="custom-storage", features=Features(checkpoint_api=True)).path \
        == state.GpuPath.CUSTOM_STORAGE
    assert state.plan(recorded=state.GpuPath.HOST_STAGED, features=both).path == state.GpuPath.HOST_STAGED
    assert state.plan().path == state.GpuPath.HOST_STAGED
    with pytest.raises(state.GpuStateError, match="no checkpoint API"):
        state.plan(features=Features(reason="driver 535"))
    _, regions = custom(fleet())
    p = state.plan(features=both)
    assert p.streams and isinstance(p.backend(regions), state.CustomStorage)
    host = state.plan(features=Features(checkpoint_api=True), thp_mode=None)
    assert not host.streams and isinstance(host.backend(regions), state.HostStaged)


def test_resume_brings_back_whatever_an_interrupted_operation_left() -> None:
    d = fleet()
    d.lock(201, 10)
    d.lock(202, 10)
    d.checkpoint(202)
    rep = state.resume(d, [201, 202, 203, 999])
    assert rep.unlocked == [201] and rep.restored == [202] and rep.running == [203] and rep.gone == [999]
    assert all(d.get_state(p) == S.RUNNING for p in PIDS)
