"""Checkpoint and restore the GPU state of many CUDA processes at once, all or nothing.

Guarantees kept here:
- checkpoint_all: every pid is locked, then all are checkpointed in parallel. If any lock or
  checkpoint fails or times out, every process this call touched is put back to RUNNING with its GPU
  memory intact (checkpointed ones restored, then all unlocked), and the error names the culprit.
- restore_all: all checkpointed pids are restored in parallel and unlocked only when all succeeded;
  on a failure the ones already restored are checkpointed again, so the set stays consistent
  (all CHECKPOINTED) and the restore can be retried, e.g. onto another GPU.
- custom_checkpoint / custom_restore: a custom-storage operation is always completed; if the caller's
  streaming fails, the mapped memory is spilled to host memory and written back, so the process
  returns to RUNNING with its data.
"""
from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from sandbox.gpu.driver import CheckpointDriver, CudaDriverError, CustomOperation, DeviceRegion, ProcessState


from storage.api import GpusnapError

class GpuCheckpointError(GpusnapError):
    """A multi-process checkpoint or restore that failed; says what was rolled back."""


@dataclass
class Timing:
    lock_s: float = 0.0
    checkpoint_s: float = 0.0
    restore_s: float = 0.0
    unlock_s: float = 0.0
    per_pid: dict[int, float] = field(default_factory=dict)


def _run_all(pids: list[int], fn: Callable[[int], None], timeout_s: float,
             ex: ThreadPoolExecutor) -> tuple[list[int], dict[int, BaseException], list[int]]:
    """Run FN(pid) for all pids in parallel: (succeeded, failed with error, still running at timeout)."""
    futs: dict[Future[None], int] = {ex.submit(fn, p): p for p in pids}
    done, pending = wait(futs, timeout=timeout_s)
    ok, bad = [], {}
    for f in done:
        e = f.exception()
        if e is None:
            ok.append(futs[f])
        else:
            bad[futs[f]] = e
    return sorted(ok), bad, sorted(futs[f] for f in pending)


def _describe(bad: dict[int, BaseException], stuck: list[int], what: str, timeout_s: float) -> str:
    parts = [str(e) for _, e in sorted(bad.items())]
    parts += [f"pid {p}: {what} did not finish within {timeout_s:g} s" for p in stuck]
    return "; ".join(parts)


def _safe(fn: Callable[[], None], errors: list[str]) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - rollback keeps going, collects what it could not undo
        errors.append(str(e))


def _lock_all(driver: CheckpointDriver, pids: list[int], lock_timeout_s: float, grace_s: float,
              ex: ThreadPoolExecutor) -> float:
    t0 = time.perf_counter()
    locked, bad, stuck = _run_all(pids, lambda p: driver.lock(p, int(lock_timeout_s * 1000)),
                                  lock_timeout_s + grace_s, ex)
    if bad or stuck:
        errs: list[str] = []
        if stuck:  # a lock still pending cannot be cancelled: wait out the grace, then undo it too
            _run_all(stuck, lambda p: _wait_not_busy(driver, p, grace_s), grace_s + 1, ex)
            locked += [p for p in stuck if _state(driver, p) == ProcessState.LOCKED]
        for p in locked:
            _safe(functools.partial(driver.unlock, p), errs)
        raise GpuCheckpointError(f"lock failed: {_describe(bad, stuck, 'lock', lock_timeout_s)}; "
                                 f"unlocked {len(locked)} process(es), all left running"
                                 + (f"; could not undo: {'; '.join(errs)}" if errs else ""))
    return time.perf_counter() - t0


def lock_all(driver: CheckpointDriver, pids: list[int], *, lock_timeout_s: float = 10.0,
             grace_s: float = 60.0) -> float:
    """Lock every pid in parallel (seconds taken); on any failure or timeout every pid this call
    locked is unlocked again (a late lock after a grace period too) and the error names the culprit."""
    if not pids:
        raise GpuCheckpointError("no CUDA processes to lock")
    with ThreadPoolExecutor(len(pids)) as ex:
        return _lock_all(driver, pids, lock_timeout_s, grace_s, ex)


def checkpoint_all(driver: CheckpointDriver, pids: list[int], *, lock_timeout_s: float = 10.0,
                   op_timeout_s: float = 600.0, grace_s: float = 60.0) -> Timing:
    """Lock every pid, then checkpoint all in parallel; roll everything back on any failure."""
    if not pids:
        raise GpuCheckpointError("no CUDA processes to checkpoint")
    t = Timing()
    with ThreadPoolExecutor(max(1, len(pids))) as ex:
        t.lock_s = _lock_all(driver, pids, lock_timeout_s, grace_s, ex)

        def one(p: int) -> None:
            s = time.perf_counter()
            driver.checkpoint(p)
            t.per_pid[p] = time.perf_counter() - s

        t0 = time.perf_counter()
        done, bad, stuck = _run_all(pids, one, op_timeout_s, ex)
        t.checkpoint_s = time.perf_counter() - t0
        if bad or stuck:
            msg = _describe(bad, stuck, "checkpoint", op_timeout_s)
            errs = []
            # a checkpoint still running cannot be cancelled: give it a grace period, then undo it too
            if stuck:
                late, late_bad, still = _run_all(stuck, lambda p: _wait_not_busy(driver, p, grace_s), grace_s + 1, ex)
                done += [p for p in late if _state(driver, p) == ProcessState.CHECKPOINTED]
                errs += [f"pid {p} still busy after {grace_s:g} s grace" for p in still]
            for p in pids:
                if p in still_gone(bad, p):
                    continue
                st = _state(driver, p)
                if st == ProcessState.CHECKPOINTED:
                    _safe(functools.partial(driver.restore, p), errs)
                    st = _state(driver, p)
                if st == ProcessState.LOCKED:
                    _safe(functools.partial(driver.unlock, p), errs)
            raise GpuCheckpointError(f"checkpoint failed: {msg}; every other process was restored and "
                                     "unlocked" + (f"; could not undo: {'; '.join(errs)}" if errs else ""))
    return t


def still_gone(bad: dict[int, BaseException], p: int) -> set[int]:
    """Pids whose failure says the process no longer exists (nothing to roll back)."""
    e = bad.get(p)
    if isinstance(e, CudaDriverError) and e.result in ("CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_INVALID_VALUE"):
        return {p}
    return set()


def _state(driver: CheckpointDriver, pid: int) -> ProcessState | None:
    try:
        return driver.get_state(pid)
    except Exception:  # noqa: BLE001 - gone, or not a CUDA process
        return None


def _wait_not_busy(driver: CheckpointDriver, pid: int, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if _state(driver, pid) not in (ProcessState.CHECKPOINTING, ProcessState.RESTORING, ProcessState.RUNNING):
            return
        time.sleep(0.05)
    raise GpuCheckpointError(f"pid {pid} still busy")


def restore_all(driver: CheckpointDriver, pids: list[int], *, gpu_map: dict[str, str] | None = None,
                op_timeout_s: float = 600.0, unlock: bool = True) -> Timing:
    """Restore every checkpointed pid in parallel; unlock all only if all restored."""
    t = Timing()
    not_ready = {p: _state(driver, p) for p in pids}
    not_ready = {p: s for p, s in not_ready.items() if s != ProcessState.CHECKPOINTED}
    if not_ready:
        desc = ", ".join(f"pid {p} is {s.name if s else 'gone or not a CUDA process'}" for p, s in not_ready.items())
        raise GpuCheckpointError(f"cannot restore: {desc}; nothing was changed")
    with ThreadPoolExecutor(max(1, len(pids))) as ex:
        t0 = time.perf_counter()

        def one(p: int) -> None:
            s = time.perf_counter()
            driver.restore(p, gpu_map)
            t.per_pid[p] = time.perf_counter() - s

        done, bad, stuck = _run_all(pids, one, op_timeout_s, ex)
        t.restore_s = time.perf_counter() - t0
        if bad or stuck:
            errs: list[str] = []
            for p in done:
                _safe(functools.partial(driver.checkpoint, p), errs)
            raise GpuCheckpointError(
                f"restore failed: {_describe(bad, stuck, 'restore', op_timeout_s)}; the "
                f"{len(done)} process(es) already restored were checkpointed again, all stay CHECKPOINTED"
                + (f"; could not undo: {'; '.join(errs)}" if errs else ""))
        if unlock:
            t0 = time.perf_counter()
            done, bad, stuck = _run_all(pids, driver.unlock, op_timeout_s, ex)
            t.unlock_s = time.perf_counter() - t0
            if bad or stuck:
                raise GpuCheckpointError(f"unlock failed: {_describe(bad, stuck, 'unlock', op_timeout_s)}")
    return t


class RegionSpill(Protocol):
    """Somewhere to park mapped GPU regions when streaming them to the store fails."""

    def save(self, regions: list[DeviceRegion]) -> None: ...
    def load(self, regions: list[DeviceRegion]) -> None: ...


@contextmanager
def custom_checkpoint(driver: CheckpointDriver, pid: int, spill: RegionSpill) -> Iterator[list[DeviceRegion]]:
    """Custom-storage checkpoint of a LOCKED pid: yields the mapped regions to stream.

    On normal exit the operation is completed (pid CHECKPOINTED, GPU memory released). If the block
    raises, the regions are spilled to host memory, the operation completed, the pid restored through
    custom storage from the spill, and unlocked: it runs on with its memory as it was.
    """
    op = driver.checkpoint_custom(pid)
    try:
        yield op.regions
    except BaseException:
        errs: list[str] = []
        try:
            spill.save(op.regions)
            driver.complete(pid, op)
            rop = driver.restore_custom(pid)
            spill.load(rop.regions)
            driver.complete(pid, rop)
            driver.unlock(pid)
        except Exception as e:  # noqa: BLE001
            errs.append(str(e))
        if errs:
            raise GpuCheckpointError(f"pid {pid}: streaming failed and the rollback failed too: {errs[0]}")
        raise
    driver.complete(pid, op)


@contextmanager
def custom_restore(driver: CheckpointDriver, pid: int, gpu_map: dict[str, str] | None = None
                   ) -> Iterator[CustomOperation]:
    """Custom-storage restore of a CHECKPOINTED pid: yields the regions to fill, completes after."""
    op = driver.restore_custom(pid, gpu_map)
    try:
        yield op
    finally:
        # completing is mandatory; a failed fill leaves the process LOCKED with wrong memory, so the
        # caller must not unlock it (it re-raises and the process stays locked for a retry)
        driver.complete(pid, op)
