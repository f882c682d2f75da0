"""SIGTERM, SIGHUP and SIGINT become an exception, so that a stopped gpusnap runs its own undo path.

A service manager's stop (SIGTERM), a closed terminal (SIGHUP) and Ctrl-C (SIGINT) raise Interrupted
in the main thread; the flows' except/finally blocks then put the workload back exactly as they do
for any other failure. Guarantees kept here: the undo runs once and is not itself interrupted (the
three signals are ignored from the first one until the block ends); handlers are put back afterwards;
outside the main thread nothing is installed; a process forked inside the block (pyroute2 and
multiprocessing fork helpers) gets the default action, never the undo path of its parent.
"""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import Iterator

from storage.api import GpusnapError

SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class Interrupted(GpusnapError):
    """gpusnap was asked to stop by a signal; what it was doing has been undone."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}; the operation was undone and nothing was committed")


@contextmanager
def undo_on_signals() -> Iterator[None]:
    """Inside the block, the first SIGTERM/SIGHUP/SIGINT raises Interrupted; later ones are ignored
    until the block ends (the undo path is not cut short)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner:  # a forked child (pyroute2, multiprocessing): the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        for s in SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Interrupted(signum)

    old = {s: signal.signal(s, handler) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
