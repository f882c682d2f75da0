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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Row:
    ppid: int
    sid: int
    start: int


def _processes() -> dict[int, _Row]:
    """Every process now: its parent, session and start time (clock ticks since boot)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[int(name)] = _Row(int(fields[1]), int(fields[3]), int(fields[19]))
    return out


def _boot_ticks() -> int:
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


@contextmanager
def adopting_escapees() -> Iterator[Callable[[], list[int]]]:
    """While open, this process is a child subreaper: a process a helper left behind in a session of
    its own (setsid, a double fork) becomes our child when its parent dies, instead of init's. Yields
    SWEEP(): SIGKILL and reap every child we adopted that started after the block began and is in
    none of the sessions of the processes we had below us then (a restored workload may be our child,
    and its orphans come to us too: never theirs), and the children their deaths hand to us, until
    none is left; the pids it ended. Call it once the helper's own group was ended."""
    was = _prctl(_PR_GET_CHILD_SUBREAPER, 0)
    me, born_after = os.getpid(), _boot_ticks() - 1
    table = _processes()
    before = {pid for pid, r in table.items() if r.ppid == me}
    below, todo = set(before), list(before)
    while todo:  # what we had below us: its sessions are not the helper's
        parent = todo.pop()
        for pid, r in table.items():
            if r.ppid == parent and pid not in below:
                below.add(pid)
                todo.append(pid)
    kept_sessions = {table[p].sid for p in below if p in table}
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)

    def sweep() -> list[int]:
        ended: list[int] = []
        for _ in range(10000):  # each round ends one generation: a runaway cannot fork faster than SIGKILL
            new = sorted(pid for pid, r in _processes().items()
                         if r.ppid == me and pid not in before and r.start >= born_after
                         and r.sid not in kept_sessions)
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
