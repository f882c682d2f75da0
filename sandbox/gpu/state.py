"""The one owner of GPU freeze/thaw: which path, lock/checkpoint/restore/unlock, rollback, idempotence.

Every caller (the `gpu`, `criu` and `runsc` flows, the pool daemon, the CRIU action script, the
in-sandbox agent, crash recovery) goes through this module; none calls the driver's checkpoint
sequence itself. (Skeleton: `resume` is the contract crash recovery and the hook build on; the
freeze/thaw context managers and per-path backends are filled in next.)

Guarantees kept here:
- resume(driver, pids) puts every listed process back to RUNNING with its GPU memory, whatever state
  an interrupted operation left it in, and is idempotent: a RUNNING process is not touched, a gone one
  is skipped and named.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from storage.errors import GpusnapError

from sandbox.gpu.driver import CheckpointDriver, ProcessState


class GpuStateError(GpusnapError):
    """A freeze, thaw or resume of GPU processes that failed; says what state each was left in."""


class GpuPath(enum.Enum):
    """How GPU memory leaves the process: the driver's host copy, or custom storage (streamed by us)."""

    HOST_STAGED = "host-staged"
    CUSTOM_STORAGE = "custom-storage"


@dataclass
class ResumeReport:
    restored: list[int] = field(default_factory=list)   # CHECKPOINTED -> restored and unlocked
    unlocked: list[int] = field(default_factory=list)   # LOCKED -> unlocked
    running: list[int] = field(default_factory=list)    # already RUNNING: untouched
    gone: list[int] = field(default_factory=list)       # not a CUDA process any more


def _state(driver: CheckpointDriver, pid: int) -> ProcessState | None:
    try:
        return driver.get_state(pid)
    except Exception:  # noqa: BLE001 - gone, or not a CUDA process
        return None


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
