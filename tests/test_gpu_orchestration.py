"""Orchestration over many CUDA processes against the driver state-machine stand-in: ordering,
parallelism, failures and timeouts in the middle, and rollback that never loses GPU memory."""
from __future__ import annotations

import os

import pytest

from support.driver_standin import MemorySpill, StandInDriver
from sandbox.gpu.driver import CudaDriverError, ProcessState as S
from sandbox.gpu.checkpoint import (GpuCheckpointError, checkpoint_all, custom_checkpoint, custom_restore,
                                    restore_all)

PIDS = [101, 102, 103, 104, 105]


def fleet() -> StandInDriver:
    d = StandInDriver()
    for p in PIDS:
        d.add(p, os.urandom(4096) + bytes([p % 256]) * 100)
    return d


def snapshot_memory(d: StandInDriver) -> dict[int, bytes]:
    return {p: bytes(d.procs[p].gpu) for p in PIDS}


def test_checkpoint_then_restore_all() -> None:
    d = fleet()
    before = snapshot_memory(d)
    checkpoint_all(d, PIDS)
    assert all(d.get_state(p) == S.CHECKPOINTED for p in PIDS)
    locks = [i for i, (_, c) in enumerate(d.calls) if c == "lock"]
    ckpts = [i for i, (_, c) in enumerate(d.calls) if c == "checkpoint"]
    assert max(locks) < min(ckpts), "every process is locked before any is checkpointed"
    restore_all(d, PIDS)
    assert all(d.get_state(p) == S.RUNNING for p in PIDS)
    assert snapshot_memory(d) == before


def test_checkpoints_run_in_parallel() -> None:
    d = fleet()
    for p in PIDS:
        d.delay[(p, "checkpoint")] = 0.3
    import time
    t0 = time.perf_counter()
    checkpoint_all(d, PIDS)
    assert time.perf_counter() - t0 < 0.3 * len(PIDS) / 2


@pytest.mark.parametrize("call", ["lock", "checkpoint"])
def test_failure_in_the_middle_rolls_everyone_back(call: str) -> None:
    d = fleet()
    before = snapshot_memory(d)
    d.fail[(103, call)] = "CUDA_ERROR_NOT_SUPPORTED"
    with pytest.raises(GpuCheckpointError, match="pid 103") as ei:
        checkpoint_all(d, PIDS)
    assert "CUDA_ERROR_NOT_SUPPORTED" in str(ei.value)
    assert all(d.get_state(p) == S.RUNNING for p in PIDS)
    assert snapshot_memory(d) == before


def test_lock_timeout_rolls_back() -> None:
    d = fleet()
    d.fail[(102, "lock")] = "CUDA_ERROR_TIMEOUT"
    with pytest.raises(GpuCheckpointError, match="timed out"):
        checkpoint_all(d, PIDS, lock_timeout_s=0.1)
    assert all(d.get_state(p) == S.RUNNING for p in PIDS)


def test_checkpoint_that_hangs_past_the_timeout_is_undone_when_it_finishes() -> None:
    d = fleet()
    before = snapshot_memory(d)
    d.delay[(104, "checkpoint")] = 1.0
    with pytest.raises(GpuCheckpointError, match="pid 104: checkpoint did not finish"):
        checkpoint_all(d, PIDS, op_timeout_s=0.2, grace_s=5)
    assert all(d.get_state(p) == S.RUNNING for p in PIDS)
    assert snapshot_memory(d) == before


def test_process_exiting_mid_checkpoint_leaves_the_others_running() -> None:
    d = fleet()
    before = snapshot_memory(d)
    d.die_during.add((105, "checkpoint"))
    with pytest.raises(GpuCheckpointError, match="pid 105"):
        checkpoint_all(d, PIDS)
    for p in PIDS[:-1]:
        assert d.get_state(p) == S.RUNNING and bytes(d.procs[p].gpu) == before[p]


def test_restore_failure_keeps_the_set_checkpointed_and_retry_works() -> None:
    d = fleet()
    before = snapshot_memory(d)
    checkpoint_all(d, PIDS)
    d.fail[(102, "restore")] = "CUDA_ERROR_OUT_OF_MEMORY"
    with pytest.raises(GpuCheckpointError, match="OUT_OF_MEMORY"):
        restore_all(d, PIDS)
    assert all(d.get_state(p) == S.CHECKPOINTED for p in PIDS)
    del d.fail[(102, "restore")]
    restore_all(d, PIDS)
    assert snapshot_memory(d) == before and all(d.get_state(p) == S.RUNNING for p in PIDS)


def test_restore_refuses_processes_not_checkpointed() -> None:
    d = fleet()
    with pytest.raises(GpuCheckpointError, match="pid 101 is RUNNING.*nothing was changed"):
        restore_all(d, PIDS)
    assert all(d.get_state(p) == S.RUNNING for p in PIDS)


def test_no_processes() -> None:
    with pytest.raises(GpuCheckpointError, match="no CUDA processes"):
        checkpoint_all(StandInDriver(), [])


def test_custom_storage_round_trip() -> None:
    d = fleet()
    pid = 101
    before = bytes(d.procs[pid].gpu)
    d.lock(pid, 1000)
    stored = b""
    with custom_checkpoint(d, pid, MemorySpill(d, pid)) as regions:
        assert d.get_state(pid) == S.CHECKPOINTING and regions[0].size == len(before)
        stored = bytes(d.region_bytes(pid))
    assert d.get_state(pid) == S.CHECKPOINTED
    with custom_restore(d, pid):
        assert d.get_state(pid) == S.RESTORING
        d.region_bytes(pid)[:] = stored
    assert d.get_state(pid) == S.LOCKED
    d.unlock(pid)
    assert bytes(d.procs[pid].gpu) == before


def test_custom_checkpoint_streaming_failure_rolls_back_with_memory_intact() -> None:
    d = fleet()
    pid = 102
    before = bytes(d.procs[pid].gpu)
    d.lock(pid, 1000)
    with pytest.raises(OSError, match="disk full"):
        with custom_checkpoint(d, pid, MemorySpill(d, pid)):
            raise OSError("disk full")
    assert d.get_state(pid) == S.RUNNING
    assert bytes(d.procs[pid].gpu) == before


def test_illegal_transitions_are_refused_like_the_driver() -> None:
    d = fleet()
    with pytest.raises(CudaDriverError, match="ILLEGAL_STATE"):
        d.checkpoint(101)  # not locked
    with pytest.raises(CudaDriverError, match="NOT_FOUND"):
        d.lock(999, 10)


def test_device_map_is_checked_against_both_machines() -> None:
    from sandbox.gpu.device_map import DeviceMapError
    from sandbox.gpu.driver import GpuInfo
    from sandbox.gpu.snapshot import parse_device_map
    snap = [{"index": 0, "uuid": "GPU-a", "name": "NVIDIA H200"}, {"index": 1, "uuid": "GPU-b", "name": "NVIDIA H200"}]
    here = [GpuInfo(0, "NVIDIA H200", "GPU-x", 1, (9, 0), None, False),
            GpuInfo(1, "NVIDIA H200", "GPU-y", 1, (9, 0), None, False),
            GpuInfo(2, "NVIDIA B200", "GPU-z", 1, (10, 0), None, True)]
    assert parse_device_map([], snap, here) == {}
    assert parse_device_map(["0=1", "GPU-b=GPU-x"], snap, here) == {"GPU-a": "GPU-y", "GPU-b": "GPU-x"}
    # a map wrong in itself is a usage error (2); one this machine cannot meet, machine-lacks (4)
    for bad, why, code in ((["0=7", "1=0"], "no GPU '7' on this machine", 4),
                           (["5=0", "1=1"], "no GPU '5' in the snapshot", 2),
                           (["0=2", "1=1"], "cannot be restored onto a NVIDIA B200", 4),
                           (["0=1"], "must list every", 2), (["0=1", "1=1"], "two GPUs onto one", 2),
                           (["0=1", "0=0"], "names the snapshot's GPU 0 .* twice", 2),
                           (["01"], "expected OLD=NEW", 2)):
        with pytest.raises(DeviceMapError, match=why) as ei:
            parse_device_map(bad, snap, here)
        assert ei.value.exit_code == code, (bad, ei.value.exit_code)
