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

import ctypes
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


# -- processes that left the group ---------------------------------------------------------------------
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, arg: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    if option == _PR_GET_CHILD_SUBREAPER:
        out = ctypes.c_int(0)
        rc = libc.prctl(option, ctypes.byref(out), 0, 0, 0)
        arg = out.value
    else:
        rc = libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return arg


def children() -> set[int]:
    """The pids whose parent is this process now (zombies included)."""
    me, out = os.getpid(), set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(b")", 1)[1].split()[1]) == me:
            out.add(int(name))
    return out


@contextmanager
def adopting_escapees() -> Iterator[Callable[[], list[int]]]:
    """While open, this process is a child subreaper: a process a helper left behind in a session of
    its own (setsid, a double fork) becomes our child when its parent dies, instead of init's. Yields
    SWEEP(): SIGKILL and reap every child we did not have when the block began, and the children
    their deaths hand to us, until none is left; the pids it ended. Call it once the helper's own group
    was ended (no other thread of this process may start children meanwhile: they would be swept too)."""
    was = _prctl(_PR_GET_CHILD_SUBREAPER, 0)
    before = children()
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)

    def sweep() -> list[int]:
        ended: list[int] = []
        for _ in range(10000):  # each round ends one generation: a runaway cannot fork faster than SIGKILL
            new = sorted(children() - before)
            if not new:
                break
            for pid in new:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for pid in new:
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
            ended += new
        return ended
    try:
        yield sweep
    finally:
        if not was:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)
