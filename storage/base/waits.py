"""Where a command's time goes outside its measured stages: seconds spent waiting on locks, on the
fsyncs that make a commit durable, and for a process tree's death, summed for the whole process, so
that a report can tell its whole wall time apart (cli/common.py, `wall`)."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_totals: dict[str, float] = {}

LOCKS = "locks"
FSYNC = "fsync"
TREE_DEATH = "tree_death"


def add(what: str, seconds: float) -> None:
    with _lock:
        _totals[what] = _totals.get(what, 0.0) + seconds


@contextmanager
def waiting(what: str) -> Iterator[None]:
    """Count the block's wall time as waiting for WHAT."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        add(what, time.perf_counter() - t0)


def totals() -> dict[str, float]:
    with _lock:
        return dict(_totals)
