"""A process as /proc shows it: by pid AND start time (Proc), its state letter, its tree, waiting for it to go.

Guarantees kept here: a process is named by pid and start time, so a pid reused by an unrelated
process is never taken for the one recorded, and Proc.signal never signals it; a zombie counts as gone.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from storage.api import GpusnapError


class DiscoveryError(GpusnapError):
    """A pid or cgroup that does not exist or cannot be inspected."""


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (field 3 first: the name may hold spaces and
    parentheses); OSError where PID is gone."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def start_time(pid: int) -> int | None:
    """PID's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        return int(_stat(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def memory_identity(pid: int) -> tuple[int, ...] | None:
    """What tells PID's process and its current program apart from any other (None if it is gone): its
    start time, and where the kernel laid out its stack, heap, arguments and environment at its last
    exec (/proc/PID/stat fields 22, 28 and 47-51; randomized per exec where address space layout
    randomization is on, read as 0 without the right to trace the process). The same pid with the same
    identity later is the same process, most likely still running the same program (an exec moves
    them)."""
    try:
        v = _stat(pid)
        return (int(v[19]), int(v[25]), *(int(x) for x in v[44:49]))
    except (OSError, IndexError, ValueError):
        return None


def state_of(pid: int) -> str:
    """PID's state letter (R, S, T, Z, ...), "gone" if there is no such process."""
    try:
        return _stat(pid)[0]
    except OSError:
        return "gone"


def held_state(pid: int) -> str | None:
    """How PID is held by someone else, or None (running, or gone): "stopped" (job control: state T),
    "traced" (a tracer is attached: TracerPid in /proc/PID/status, whatever its state, t included).
    A process so held before a dump is left so: no signal of gpusnap's may resume it or reach its tracer."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    if int(line.split()[1]) != 0:
                        return "traced"
                    break
    except (OSError, ValueError, IndexError):
        return None
    return "stopped" if state_of(pid) in ("T", "t") else None


@dataclass(frozen=True)
class Proc:
    """One process, by pid and start time."""

    pid: int
    start: int

    @classmethod
    def of(cls, pid: int) -> "Proc | None":
        st = start_time(pid)
        return None if st is None else cls(pid, st)

    def alive(self) -> bool:
        """The same process still exists (a zombie counts as gone)."""
        return start_time(self.pid) == self.start and state_of(self.pid) not in ("Z", "gone")

    def signal(self, sig: int) -> bool:
        """Send SIG if this is still the same process; True if it was sent."""
        if not self.alive():
            return False
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            return False
        return True


def children_of(pid: int) -> list[int]:
    """PID's children now (every thread's)."""
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return kids


def process_tree(root: int) -> list[int]:
    """ROOT and all its descendants, parents before children."""
    if not os.path.exists(f"/proc/{root}"):
        raise DiscoveryError(f"no process with pid {root}")
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        if p not in out:
            out.append(p)
            todo += children_of(p)
    return out


def kill_with_descendants(procs: tuple[Proc, ...], rounds: int = 16) -> list[int]:
    """SIGKILL PROCS (those still the recorded process) and every descendant they have, including
    ones forked while this runs: the tree is stopped (SIGSTOP) until a pass finds no new process (at
    most ROUNDS passes), then killed. A process that leaves the tree before it is seen (a double
    fork: its orphan goes to a subreaper or init) is not found here: a caller that lets a tree run
    must be that subreaper (see sandbox.criu.restore.kill_restored). Returns the pids signalled."""
    seen: dict[int, Proc] = {}
    for _ in range(rounds):
        now = with_descendants(procs)
        fresh = [p for p in now if p.pid not in seen]
        if not fresh:
            break
        for p in fresh:
            seen[p.pid] = p
            p.signal(signal.SIGSTOP)
    killed = [p.pid for p in seen.values() if p.signal(signal.SIGKILL)]
    return killed


def with_descendants(procs: tuple[Proc, ...]) -> tuple[Proc, ...]:
    """PROCS (those still the recorded process) and every descendant each has now, parents first.
    For a tree CRIU left stopped this is exactly what CRIU froze: a child forked while CRIU was
    seizing the tree is in its image and stopped with it, though no list taken before the dump has it."""
    out: list[Proc] = []
    seen: set[int] = set()
    for p in procs:
        if not p.alive() or p.pid in seen:
            continue
        try:
            tree = process_tree(p.pid)
        except DiscoveryError:
            continue
        for pid in tree:
            q = p if pid == p.pid else Proc.of(pid)
            if q is not None and pid not in seen:
                seen.add(pid)
                out.append(q)
    return tuple(out)


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until PIDS exit (or TIMEOUT); the ones still there."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if os.path.exists(f"/proc/{p}") and start_time(p) is not None
                and state_of(p) != "Z"]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)
