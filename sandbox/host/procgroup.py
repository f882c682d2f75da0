"""Helpers (CRIU, runsc) run as a process group gpusnap owns: started in their own session, ended whole.

Guarantees kept here: a helper never receives the signals meant for gpusnap's terminal (its own
session), and a timeout or any exception while it runs (a signal turned into one) SIGKILLs its whole
process group and reaps it before the exception propagates, so no child of it is left running.
Processes that leave the group themselves (runsc's sandbox calls setsid) are the caller's to find.
Each helper is told, as it starts, to whoever records helpers (recording_helpers: the operation
journal), so that a later `gpusnap recover` finds it by its recorded pid and process group, never by
its command line.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

_recorders: list[Callable[[int], None]] = []
_recorders_lock = threading.Lock()


@contextmanager
def recording_helpers(record: Callable[[int], None]) -> Iterator[None]:
    """RECORD(pid) for every helper run_group starts meanwhile (from any thread), right after it
    started and before it is waited for."""
    with _recorders_lock:
        _recorders.append(record)
    try:
        yield
    finally:
        with _recorders_lock:
            _recorders.remove(record)


def _started(pid: int) -> None:
    with _recorders_lock:
        recorders = list(_recorders)
    for record in recorders:
        record(pid)


def run_group(argv: Sequence[str], timeout: float, *, stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE,
              finish: bool = False, **kw: Any) -> subprocess.CompletedProcess[str]:
    """ARGV in its own session (stdin /dev/null, output captured unless given); ended as a group on a
    timeout or an exception, which then propagates. FINISH: on an exception other than the timeout
    (a signal), let the command end by itself first (within TIMEOUT): for a step that must not be
    cut in half, like a checkpoint that has stopped its sandbox."""
    deadline = time.monotonic() + timeout
    p = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, text=True,
                         start_new_session=True, **kw)
    try:
        _started(p.pid)
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_group(p)
        raise
    except BaseException:
        if finish:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except BaseException:  # noqa: BLE001 - timed out (later signals are ignored by then)
                pass
        end_group(p)
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def end_group(p: subprocess.Popen[str]) -> None:
    """SIGKILL P's process group (P leads it) and reap P; pipes a runaway grandchild still holds are closed."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.wait()
    try:
        p.communicate(timeout=2)
    except subprocess.TimeoutExpired:
        for f in (p.stdout, p.stderr):
            if f is not None:
                f.close()
