"""The one owner of GPU freeze/thaw: which path, lock/checkpoint/restore/unlock, THP, rollback, idempotence.

Every caller (the `gpu`, `criu` and `runsc` flows, the pool daemon, the CRIU action script, the
in-sandbox agent, crash recovery) goes through this module; none calls the driver's checkpoint
sequence itself, and none picks a mechanism: plan() chooses, from the driver probe (for a restore:
from what the snapshot says made it) and whether the bytes have somewhere to go, and the Plan wires
the backend to where they go. Its shape is CRIU's cuda plugin's: one table of operations (Backend:
checkpoint locked processes, restore checkpointed ones) and a backend per mechanism:

  host-staged     the driver copies GPU memory into each process's own host memory (parallel, THP
                  `always` for the duration of the copies, set once per operation)
  custom-storage  the driver maps each process's GPU memory into this process and a RegionStore takes
                  the bytes (the GPU engine into a snapshot or the memory tier; the in-sandbox agent's
                  pipe to the host) and gives them back on restore

Guarantees kept here:
- freeze/checkpoint: every RUNNING pid is locked (in parallel, with a grace period for late locks)
  and checkpointed; a pid already CHECKPOINTED is left as it is (a second pre-dump is harmless); on
  any failure every pid this call touched is RUNNING again with its GPU memory, and the error says so.
  The freeze() context manager also thaws what it froze when its block raises.
- thaw: every CHECKPOINTED pid restored, all or nothing (on a failure they all stay CHECKPOINTED and
  the thaw can be retried; those an EarlyRestore had restored stay LOCKED, which settle() and
  another thaw unlock), then every pid unlocked; a RUNNING pid is not touched, a LOCKED one only
  unlocked (a second post-resume is harmless).
- EarlyRestore: on the host-staged path, a process's copy may start before thaw() (as soon as the
  split fill has written its memory: the copies overlap the fill); thaw() then restores only what is
  left and unlocks all, after every early copy has ended; a failed early copy fails the swap, and
  recovery (settle/resume) finishes it as it finishes a failed thaw.
- settle(driver, pids) finishes an interrupted thaw without guessing: a process whose memory is back
  (LOCKED) is unlocked, a CHECKPOINTED one stays restorable, one the driver holds mid-operation is named.
- resume(driver, pids) puts every listed process back to RUNNING (host-staged state), whatever an
  interrupted operation left it in, best effort per pid, and is idempotent: a RUNNING process is not
  touched, a gone one is skipped and named.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FutureTimeout
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from storage.api import GpusnapError

from sandbox.ops import journal
from sandbox.ops.gpu_path import GpuPath
from sandbox.gpu.checkpoint import (GpuCheckpointError, RegionSpill, checkpoint_all, custom_checkpoint,
                                    custom_restore, lock_all, restore_all)
from sandbox.gpu.driver import CheckpointDriver, DeviceRegion, Features, ProcessState
from sandbox.host.hugepages import thp, wanted


class GpuStateError(GpusnapError):
    """A freeze, thaw or resume of GPU processes that failed; says what state each was left in."""


def path_for(features: Features) -> GpuPath:
    """The path this machine's driver offers (custom storage where it can); refuses a driver without
    the checkpoint API, saying why."""
    if features.custom_storage:
        return GpuPath.CUSTOM_STORAGE
    if features.checkpoint_api:
        return GpuPath.HOST_STAGED
    raise GpuStateError(f"this driver has no checkpoint API ({features.reason or 'driver too old'})")


@dataclass(frozen=True)
class Limits:
    lock_timeout_s: float = 10.0   # the driver's lock timeout (the process must finish its CUDA calls)
    op_timeout_s: float = 600.0    # one checkpoint/restore call
    grace_s: float = 60.0          # how long a call past its timeout may still finish before it is undone


class RegionStore(Protocol):
    """Where a custom-storage checkpoint's bytes go and come back from."""

    def save(self, pid: int, regions: list[DeviceRegion]) -> None:
        """Take PID's mapped GPU memory (the checkpoint is completed after this returns)."""

    def load(self, pid: int, regions: list[DeviceRegion]) -> None:
        """Fill PID's mapped regions with what save() took."""


class Backend(Protocol):
    """The table of operations, one implementation per GpuPath."""

    path: GpuPath

    def checkpoint(self, drv: CheckpointDriver, pids: list[int], limits: Limits) -> dict[str, float]:
        """RUNNING PIDS -> CHECKPOINTED; on failure every one is RUNNING again with its memory."""

    def restore(self, drv: CheckpointDriver, pids: list[int], gpu_map: dict[str, str] | None,
                limits: Limits) -> dict[str, float]:
        """CHECKPOINTED PIDS -> LOCKED with their memory; on failure every one stays CHECKPOINTED."""


class HostStaged:
    """The driver copies GPU memory into each process's host memory (and back), all pids in parallel."""

    path = GpuPath.HOST_STAGED

    def __init__(self, thp_mode: str | None = "always") -> None:
        self.thp_mode = thp_mode

    def checkpoint(self, drv: CheckpointDriver, pids: list[int], limits: Limits) -> dict[str, float]:
        with thp(wanted(self.thp_mode)):
            t = checkpoint_all(drv, pids, lock_timeout_s=limits.lock_timeout_s, op_timeout_s=limits.op_timeout_s,
                               grace_s=limits.grace_s)
        return {"lock": t.lock_s, "checkpoint": t.checkpoint_s}

    def restore(self, drv: CheckpointDriver, pids: list[int], gpu_map: dict[str, str] | None,
                limits: Limits) -> dict[str, float]:
        with thp(wanted(self.thp_mode)):
            t = restore_all(drv, pids, gpu_map=gpu_map, op_timeout_s=limits.op_timeout_s, unlock=False)
        return {"restore": t.restore_s}


class CustomStorage:
    """The driver maps each process's GPU memory into this process; REGIONS takes and gives back the
    bytes. SPILL parks the regions of a process whose streaming failed (the rollback needs them)."""

    path = GpuPath.CUSTOM_STORAGE

    def __init__(self, regions: RegionStore, spill: RegionSpill | None = None) -> None:
        self.regions, self.spill = regions, spill

    def checkpoint(self, drv: CheckpointDriver, pids: list[int], limits: Limits) -> dict[str, float]:
        if self.spill is None:
            raise GpuStateError("a custom-storage checkpoint needs somewhere to spill GPU memory on failure")
        lock_s = lock_all(drv, pids, lock_timeout_s=limits.lock_timeout_s, grace_s=limits.grace_s)
        t1 = time.perf_counter()
        done: list[int] = []
        try:
            for p in pids:
                # on a failure custom_checkpoint gives P its memory back from the spill and unlocks it
                with custom_checkpoint(drv, p, self.spill) as regions:
                    self.regions.save(p, regions)
                done.append(p)
                journal.pause("gpu-stream")  # test hook: a process CHECKPOINTED, the next not yet streamed
        except BaseException as e:
            errs: list[str] = []
            for p in pids:
                try:
                    if p in done:
                        try:
                            self._fill(drv, p, None)
                        except Exception:
                            _check_in(drv, p)  # not filled: CHECKPOINTED again, its bytes where save() put them
                            raise
                    if _state(drv, p) == ProcessState.LOCKED:
                        drv.unlock(p)
                except Exception as u:  # noqa: BLE001 - keep undoing the others, report each
                    errs.append(f"pid {p} stays CHECKPOINTED: {_one_line(u)}")
            if errs:
                raise GpuStateError(f"custom-storage checkpoint failed ({_one_line(e)}) and could not be fully "
                                    f"undone: {'; '.join(errs)}") from None
            raise
        return {"lock": lock_s, "checkpoint+stream": time.perf_counter() - t1}

    def _fill(self, drv: CheckpointDriver, pid: int, gpu_map: dict[str, str] | None) -> None:
        with custom_restore(drv, pid, gpu_map) as op:
            self.regions.load(pid, op.regions)

    def restore(self, drv: CheckpointDriver, pids: list[int], gpu_map: dict[str, str] | None,
                limits: Limits) -> dict[str, float]:
        t0 = time.perf_counter()
        touched: list[int] = []
        try:
            for p in pids:
                touched.append(p)
                self._fill(drv, p, gpu_map)
                journal.pause("gpu-fill")  # test hook: a process filled (LOCKED), the next not yet
        except BaseException as e:
            # the bytes are still where save() put them: check every touched pid back in without
            # streaming, so the set stays CHECKPOINTED and the thaw can be retried
            errs: list[str] = []
            for p in touched:
                try:
                    _check_in(drv, p)
                except Exception as u:  # noqa: BLE001
                    errs.append(str(u))
            raise GpuStateError(f"custom-storage restore failed: {_one_line(e)}; "
                                + (f"could not undo: {'; '.join(errs)}" if errs else
                                   "every process stays CHECKPOINTED, the restore can be retried")) from None
        return {"restore+fill": time.perf_counter() - t0}


def _check_in(drv: CheckpointDriver, pid: int) -> None:
    """A LOCKED pid (filled, or filled wrongly) back to CHECKPOINTED without streaming anything: its
    bytes are still where the checkpoint put them."""
    if _state(drv, pid) == ProcessState.LOCKED:
        drv.complete(pid, drv.checkpoint_custom(pid))


def backend_for(path: GpuPath, *, regions: RegionStore | None = None, spill: RegionSpill | None = None,
                thp_mode: str | None = "always") -> Backend:
    """The backend of PATH (custom storage needs where the bytes go: REGIONS, and a SPILL to checkpoint;
    by default the region store's own, where it has one)."""
    if path == GpuPath.HOST_STAGED:
        return HostStaged(thp_mode)
    if regions is None:
        raise GpuStateError("the custom-storage path needs a place for the GPU memory (a snapshot or a pool)")
    if spill is None and callable(getattr(regions, "spill", None)):
        spill = regions.spill()  # type: ignore[attr-defined]
    return CustomStorage(regions, spill)


@dataclass(frozen=True)
class Plan:
    """How one operation's GPU memory moves: the path chosen, and THP for the host-staged copies."""

    path: GpuPath
    thp_mode: str | None = "always"

    @property
    def streams(self) -> bool:
        """The bytes go through a RegionStore (custom storage): the caller provides one to backend()."""
        return self.path == GpuPath.CUSTOM_STORAGE

    def backend(self, regions: RegionStore | None = None, spill: RegionSpill | None = None) -> Backend:
        """The backend of this plan, its bytes going to (and coming from) REGIONS where it streams."""
        return backend_for(self.path, regions=regions if self.streams else None, spill=spill, thp_mode=self.thp_mode)


def plan(*, features: Features | None = None, recorded: GpuPath | str | None = None, streams: bool = True,
         thp_mode: str | None = "always") -> Plan:
    """The one choice of a GPU path. A restore goes back the way its memory left (RECORDED, from the
    snapshot); a checkpoint takes what the probed driver offers (FEATURES: custom storage where it can,
    refused without the checkpoint API); host-staged when neither is known. Custom storage only where
    its bytes have somewhere to go (STREAMS: a snapshot writer, the memory tier, the agent's channel);
    otherwise the driver's host copy. THP_MODE: THP during host-staged copies (None: leave it alone,
    as inside gVisor)."""
    if recorded is not None:
        path = GpuPath(recorded)
    elif features is not None:
        path = path_for(features)
    else:
        path = GpuPath.HOST_STAGED
    if path == GpuPath.CUSTOM_STORAGE and not streams:
        path = GpuPath.HOST_STAGED
    return Plan(path, thp_mode)


def restore_huge_pages(mode: str | None = "always") -> AbstractContextManager[object]:
    """THP MODE (None: unchanged) for a restore that faults a whole memory image in: CRIU's restore
    (about 1.4x faster with huge pages) and the host-staged copies. The one place a restore sets THP;
    sandbox.host.hugepages does the switching and puts it back (also after a crash, via recover);
    $GPUSNAP_THP=keep leaves it alone (hugepages.policy)."""
    return thp(wanted(mode))


@dataclass(frozen=True)
class FreezeReport:
    path: GpuPath
    frozen: tuple[int, ...]       # checkpointed by this call
    already: tuple[int, ...]      # were CHECKPOINTED already: left as they were
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ThawReport:
    path: GpuPath
    restored: tuple[int, ...]     # CHECKPOINTED -> restored and unlocked
    unlocked: tuple[int, ...]     # were LOCKED: unlocked
    running: tuple[int, ...]      # were RUNNING: untouched
    seconds: dict[str, float] = field(default_factory=dict)


def _state(driver: CheckpointDriver, pid: int) -> ProcessState | None:
    try:
        return driver.get_state(pid)
    except Exception:  # noqa: BLE001 - gone, or not a CUDA process
        return None


def _one_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0]


def _name(s: ProcessState | None) -> str:
    return s.name if s is not None else "gone (or not a CUDA process)"


def checkpoint(drv: CheckpointDriver, pids: list[int], backend: Backend, limits: Limits = Limits()) -> FreezeReport:
    """Checkpoint every RUNNING pid of PIDS through BACKEND (all or nothing); CHECKPOINTED ones are left
    alone. A pid in any other state (another operation holds it) refuses the whole call, nothing changed."""
    if not pids:
        raise GpuStateError("no CUDA processes to checkpoint")
    states = {p: _state(drv, p) for p in pids}
    odd = {p: s for p, s in states.items() if s not in (ProcessState.RUNNING, ProcessState.CHECKPOINTED)}
    if odd:
        raise GpuStateError("; ".join(f"pid {p} is {_name(s)}" for p, s in odd.items())
                            + ": another checkpoint or restore holds it, or one was interrupted "
                            "(`gpusnap recover` brings interrupted ones back); nothing was changed")
    todo = [p for p in pids if states[p] == ProcessState.RUNNING]
    already = tuple(p for p in pids if states[p] == ProcessState.CHECKPOINTED)
    seconds = backend.checkpoint(drv, todo, limits) if todo else {}
    return FreezeReport(backend.path, tuple(todo), already, seconds)


def thaw(drv: CheckpointDriver, pids: list[int], backend: Backend, *, gpu_map: dict[str, str] | None = None,
         unlock: bool = True, limits: Limits = Limits()) -> ThawReport:
    """Every CHECKPOINTED pid restored through BACKEND (all or nothing), then every pid unlocked
    (unless UNLOCK is false); RUNNING ones untouched. A gone pid refuses the call before any change."""
    states = {p: _state(drv, p) for p in pids}
    odd = {p: s for p, s in states.items()
           if s not in (ProcessState.RUNNING, ProcessState.LOCKED, ProcessState.CHECKPOINTED)}
    if odd:
        raise GpuStateError("cannot restore: " + "; ".join(f"pid {p} is {_name(s)}" for p, s in odd.items())
                            + "; nothing was changed")
    todo = [p for p in pids if states[p] == ProcessState.CHECKPOINTED]
    locked = [p for p in pids if states[p] == ProcessState.LOCKED]
    seconds = backend.restore(drv, todo, gpu_map, limits) if todo else {}
    journal.pause("gpu-restored")  # test hook: every process has its memory back (LOCKED), none unlocked yet
    if unlock and (todo or locked):
        t0 = time.perf_counter()
        _unlock_all(drv, todo + locked, limits)
        seconds["unlock"] = time.perf_counter() - t0
    return ThawReport(backend.path, tuple(todo), tuple(locked),
                      tuple(p for p in pids if states[p] == ProcessState.RUNNING), seconds)


class EarlyRestore:
    """Host-staged restores started one process at a time, each as soon as the process's host memory
    is complete (the split fill calls start(PID) while it goes on with the others), so that the
    driver's copies overlap the fill; thaw() then restores what is left and unlocks them all. The
    driver's copy of one process runs on one core, so a tree of several CUDA processes that waits for
    its whole fill waits for the largest copy after it. A context manager: on exit every restore
    started has ended. THP is the caller's to hold (restore_huge_pages) across the fill and thaw."""

    def __init__(self, drv: CheckpointDriver, pids: list[int], gpu_map: dict[str, str] | None = None,
                 limits: Limits = Limits()) -> None:
        self.drv, self.pids, self.gpu_map, self.limits = drv, set(pids), gpu_map or None, limits
        self._ex = ThreadPoolExecutor(max(1, len(pids)), thread_name_prefix="gpusnap-gpu-early")
        self._started: dict[int, "Future[None]"] = {}
        self._lock = threading.Lock()
        self.seconds: dict[int, float] = {}  # per pid: the driver's restore, as it ran beside the fill

    def start(self, pid: int) -> None:
        """PID's host memory is complete and it runs: its GPU state may come back now (once)."""
        with self._lock:
            if pid in self.pids and pid not in self._started:
                self._started[pid] = self._ex.submit(self._one, pid)

    def _one(self, pid: int) -> None:
        if _state(self.drv, pid) != ProcessState.CHECKPOINTED:
            return  # thaw() says what is wrong with it
        t0 = time.perf_counter()
        self.drv.restore(pid, self.gpu_map)
        self.seconds[pid] = time.perf_counter() - t0

    def wait(self) -> None:
        """Every restore started has ended; a failed one raised (the restore fails, its tree is killed)."""
        errs: list[str] = []
        with self._lock:
            started = list(self._started.items())
        deadline = time.monotonic() + self.limits.op_timeout_s  # one bound for all: they run side by side
        for p, f in started:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                errs.append(f"pid {p} did not finish within {self.limits.op_timeout_s:g} s")
            except Exception as e:  # noqa: BLE001 - report every one
                said = _one_line(e)
                errs.append(said if f"pid {p}" in said else f"pid {p}: {said}")
        if errs:
            raise GpuStateError("restore failed: " + "; ".join(errs))

    def __enter__(self) -> "EarlyRestore":
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.pids = set()  # nothing more starts
        # after a failure (the fill's: the tree is killed) a copy still in the driver is not waited for
        # here; it ends with its process, and the error goes up now
        self._ex.shutdown(wait=exc[0] is None, cancel_futures=True)


def _unlock_all(drv: CheckpointDriver, pids: list[int], limits: Limits) -> None:
    errs: list[str] = []
    with ThreadPoolExecutor(len(pids)) as ex:
        for p, f in [(p, ex.submit(drv.unlock, p)) for p in pids]:
            try:
                f.result(timeout=limits.op_timeout_s)
            except Exception as e:  # noqa: BLE001 - unlock the others, then report
                errs.append(f"pid {p}: {_one_line(e)}")
    if errs:
        raise GpuStateError("unlock failed: " + "; ".join(errs))


@contextmanager
def freeze(drv: CheckpointDriver, pids: list[int], backend: Backend, limits: Limits = Limits()
           ) -> Iterator[FreezeReport]:
    """checkpoint() for the block; if the block raises, what this call froze is thawed again (through the
    same backend, which for custom storage still reads the bytes the block may not have committed)."""
    rep = checkpoint(drv, pids, backend, limits)
    try:
        yield rep
    except BaseException as e:
        if rep.frozen:
            try:
                thaw(drv, list(rep.frozen), backend, limits=limits)
            except Exception as u:  # noqa: BLE001
                raise GpuStateError(f"{_one_line(e)}; and giving the GPU processes back failed too: "
                                    f"{_one_line(u)}") from e
        raise


@dataclass
class ResumeReport:
    restored: list[int] = field(default_factory=list)   # CHECKPOINTED -> restored and unlocked
    unlocked: list[int] = field(default_factory=list)   # LOCKED -> unlocked
    running: list[int] = field(default_factory=list)    # already RUNNING: untouched
    gone: list[int] = field(default_factory=list)       # not a CUDA process any more


@dataclass
class SettleReport:
    unlocked: list[int] = field(default_factory=list)       # LOCKED (their memory back) -> RUNNING
    checkpointed: list[int] = field(default_factory=list)   # still CHECKPOINTED: another thaw restores them
    running: list[int] = field(default_factory=list)        # already RUNNING: untouched
    gone: list[int] = field(default_factory=list)           # not a CUDA process any more
    held: dict[int, ProcessState] = field(default_factory=dict)  # mid-operation in the driver: cannot run again


def settle(driver: CheckpointDriver, pids: list[int]) -> SettleReport:
    """After an interrupted thaw (a restore that failed or whose gpusnap died): every LOCKED pid has its
    GPU memory back and is unlocked; a CHECKPOINTED one is left as it is (its memory is where the
    checkpoint put it: another thaw restores it); a RUNNING one is not touched; one the driver holds
    mid-operation (CHECKPOINTING, RESTORING: its memory was mapped into a gpusnap that died) is named
    in `held`. Idempotent; raises GpuStateError naming a pid whose unlock failed (after trying all)."""
    rep = SettleReport()
    errors: list[str] = []
    for p in pids:
        st = _state(driver, p)
        if st is None:
            rep.gone.append(p)
        elif st == ProcessState.RUNNING:
            rep.running.append(p)
        elif st == ProcessState.CHECKPOINTED:
            rep.checkpointed.append(p)
        elif st == ProcessState.LOCKED:
            try:
                driver.unlock(p)
                rep.unlocked.append(p)
            except Exception as e:  # noqa: BLE001 - unlock the others, then report
                errors.append(f"pid {p}: {_one_line(e)}")
        else:
            rep.held[p] = st
    if errors:
        raise GpuStateError("could not unlock every restored GPU process: " + "; ".join(errors))
    return rep


def resume(driver: CheckpointDriver, pids: list[int]) -> ResumeReport:
    """Every pid back to RUNNING (host-staged state): CHECKPOINTED ones restored, then all LOCKED
    ones unlocked; RUNNING ones untouched. Raises GpuStateError naming what could not be resumed."""
    rep = ResumeReport()
    errors: list[str] = []
    for p in pids:
        st = _state(driver, p)
        if st is None:
            rep.gone.append(p)
            continue
        try:
            if st == ProcessState.RUNNING:
                rep.running.append(p)
                continue
            if st == ProcessState.CHECKPOINTED:
                driver.restore(p)
                rep.restored.append(p)
                st = _state(driver, p)
            if st == ProcessState.LOCKED:
                driver.unlock(p)
                if p not in rep.restored:
                    rep.unlocked.append(p)
            elif st != ProcessState.RUNNING:
                errors.append(f"pid {p} is {st.name if st else 'gone'}")
        except Exception as e:  # noqa: BLE001 - keep resuming the others, report each failure
            errors.append(str(e))
    if errors:
        raise GpuStateError("could not resume every GPU process: " + "; ".join(errors))
    return rep


__all__ = ["Backend", "CustomStorage", "FreezeReport", "GpuCheckpointError", "GpuPath", "GpuStateError",
           "HostStaged", "Limits", "Plan", "RegionStore", "ResumeReport", "SettleReport", "ThawReport", "backend_for",
           "checkpoint", "freeze", "path_for", "plan", "restore_huge_pages", "resume", "settle", "thaw"]
