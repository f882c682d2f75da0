"""Each server's state and figures as the daemon keeps them (changed only on the event loop's thread),
and the state file that lets a restarted daemon adopt what its predecessor left.

States: stopped (no process; the command starts it) -> starting -> resident (answers requests) ->
swapping-out -> swapped-out (criu: dumped into the store, no process; gpu: the process CHECKPOINTED,
no GPU memory) -> swapping-in -> resident; failed (the last start or swap failed: the next request
tries again). A server whose process dies goes back to stopped (criu mode: its last snapshot, if any,
restores it).
"""
from __future__ import annotations

import enum
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sandbox.host.processes import Proc
from sandbox.swap.config import Model
from sandbox.swap.policy import Slot


class Unavailable(Exception):
    """A request's server cannot take it (deadline, failure): the request is answered 503 with this reason."""


class State(str, enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    RESIDENT = "resident"
    SWAPPING_OUT = "swapping-out"
    SWAPPED_OUT = "swapped-out"
    SWAPPING_IN = "swapping-in"
    FAILED = "failed"

    @property
    def holds_gpu(self) -> bool:
        return self in (State.STARTING, State.RESIDENT, State.SWAPPING_OUT, State.SWAPPING_IN)


@dataclass
class Durations:
    """Seconds of each swap of one kind (the last 1000 kept for percentiles)."""

    values: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    count: int = 0
    total: float = 0.0

    def add(self, s: float) -> None:
        self.values.append(s)
        self.count += 1
        self.total += s

    def as_dict(self) -> dict[str, Any]:
        v = sorted(self.values)
        pct = (lambda q: round(v[min(len(v) - 1, int(q * len(v)))], 4)) if v else (lambda q: None)
        return {"count": self.count, "seconds_total": round(self.total, 4), "p50": pct(0.5), "p99": pct(0.99),
                "last": round(self.values[-1], 4) if self.values else None}


@dataclass
class Server:
    """One model's runtime record."""

    model: Model
    state: State = State.STOPPED
    proc: Proc | None = None
    snapshot: str | None = None        # the store snapshot that holds it (criu: while swapped out; gpu: last one)
    in_flight: int = 0
    queued: int = 0
    last_used: float = 0.0
    gpu_bytes: int | None = None       # measured through NVML while resident (None: not known)
    error: str | None = None           # why it failed / was last restarted
    requests: int = 0
    rejected: int = 0                  # requests answered 503 (deadline, failure)
    restarts: int = 0
    swap_outs: Durations = field(default_factory=Durations)
    swap_ins: Durations = field(default_factory=Durations)
    starts: Durations = field(default_factory=Durations)

    @property
    def name(self) -> str:
        return self.model.name

    def slot(self) -> Slot:
        return Slot(self.name, self.state.holds_gpu, self.model.pinned, self.in_flight, self.last_used,
                    self.gpu_bytes if self.gpu_bytes is not None else (self.model.gpu_memory or 0))

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "mode": self.model.mode.value, "state": self.state.value,
                "pid": self.proc.pid if self.proc else None, "pinned": self.model.pinned,
                "port": self.model.port, "snapshot": self.snapshot, "gpu_bytes": self.gpu_bytes,
                "in_flight": self.in_flight, "queued": self.queued, "requests": self.requests,
                "rejected": self.rejected, "restarts": self.restarts, "error": self.error,
                "swap_out": self.swap_outs.as_dict(), "swap_in": self.swap_ins.as_dict(),
                "start": self.starts.as_dict()}


STATE_FILE = "state.json"


def save(run_dir: str, servers: list[Server]) -> None:
    """Where each server is (pid AND start time, snapshot), atomically: a restarted daemon adopts it."""
    d = {s.name: {"pid": s.proc.pid if s.proc else None, "start": s.proc.start if s.proc else None,
                  "snapshot": s.snapshot, "state": s.state.value} for s in servers}
    tmp = os.path.join(run_dir, f".{STATE_FILE}.{os.getpid()}.tmp")
    try:  # a leftover of a killed daemon (or anything planted there) goes; the new file is made fresh
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(d, f)
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, os.path.join(run_dir, STATE_FILE))


def load(run_dir: str) -> dict[str, dict[str, Any]]:
    """The previous daemon's state file, each entry checked (an unreadable one: {})."""
    try:
        fd = os.open(os.path.join(run_dir, STATE_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            d = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return {}
    out: dict[str, dict[str, Any]] = {}
    if not isinstance(d, dict):
        return {}
    for name, e in d.items():
        if not isinstance(e, dict):
            continue
        pid, start, snap = e.get("pid"), e.get("start"), e.get("snapshot")
        out[str(name)] = {"proc": Proc(pid, start) if isinstance(pid, int) and isinstance(start, int) else None,
                          "snapshot": snap if isinstance(snap, str) else None,
                          "state": e.get("state") if isinstance(e.get("state"), str) else None}
    return out
