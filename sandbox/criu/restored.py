"""The processes a CRIU restore creates: told from anyone else's, adopted if CRIU dies, killed if half-restored.

Guarantees kept here: a process is taken for one this restore made only if it is one of the
snapshot's pids and started after the restore began (restored_by_criu), so the split never writes
into someone else's process; while CRIU restores, this process is the child subreaper
(adopting_orphans), so the tasks of a CRIU that dies mid-restore come back to gpusnap and are killed
(kill_half_restored), freeing the snapshot's pids for the next restore.
"""
from __future__ import annotations

import ctypes
import os
import signal
import time
from contextlib import contextmanager
from typing import Iterator

from sandbox.host.processes import Proc, start_time


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat's start time counts."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def restored_by_criu(pid: int, pids: list[int], born_after: int) -> bool:
    """Whether PID may be one this restore made: one of PIDS (all checked free before the restore)
    and started after BORN_AFTER. Necessary, not enough: gpusnap's own threads and helpers start
    after BORN_AFTER too (see in_restored_tree)."""
    started = start_time(pid) if pid in pids else None
    return started is not None and started >= born_after - 1


MAX_TREE_DEPTH = 4096  # a process tree deeper than this is not one CRIU made here


def _status(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    except OSError:
        return {}


def in_restored_tree(pid: int, root: int, pstree: list[int], born_after: int, stopped: bool = False) -> bool:
    """Whether PID is a process of the tree CRIU restored under ROOT (its pidfile's pid): listed in the
    snapshot's process tree image (PSTREE; the manifest's own pid list is not enough, a snapshot may
    name any pid there), started after BORN_AFTER, a process and not a thread (its Tgid), not gpusnap
    itself, ROOT or a descendant of ROOT (every process CRIU restores is), and, with STOPPED, stopped
    (CRIU leaves the tree stopped for the split fill). So a snapshot that names a pid gpusnap's own
    threads, fill workers or another user's processes may hold never gets bytes written or signals
    sent to them."""
    if pid == os.getpid() or root <= 1 or not restored_by_criu(pid, pstree, born_after):
        return False
    st = _status(pid)
    if st.get("Tgid", "").strip() != str(pid) or (stopped and not st.get("State", "").startswith("T")):
        return False
    p = pid
    for _ in range(MAX_TREE_DEPTH):
        if p == root:
            return True
        if p <= 1 or p == os.getpid():
            return False
        try:
            p = int(_status(p).get("PPid", "0").strip())
        except ValueError:
            return False
    return False


_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


@contextmanager
def adopting_orphans() -> Iterator[None]:
    """This process as the child subreaper meanwhile: the tasks of a CRIU that dies mid-restore
    (killed, say) come back to us instead of init, so they can be told from anyone else's."""
    libc = ctypes.CDLL(None, use_errno=True)
    prev = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(prev), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, prev.value, 0, 0, 0)


def kill_half_restored(pids: list[int]) -> None:
    """After a failed `criu restore`: the snapshot's pids that are now our children are tasks CRIU
    created and never resumed (CRIU cleans up after its own errors, not after being killed); they
    would hold the pids and block the next restore."""
    me = os.getpid()
    for _ in range(len(pids) + 1):  # a killed task's children come to us next: until none is left
        killed = 0
        for p in pids:
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid != me:
                continue
            try:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
                killed += 1
            except (ProcessLookupError, ChildProcessError):
                pass
        if not killed:
            return


def wait_stopped(pids: list[int], timeout: float = 5.0) -> list[int]:
    """Wait (up to TIMEOUT s) until no process of PIDS is running or sleeping (stopped, or a zombie,
    which CRIU restores as one and never stops); the ones that still are, returned. `criu restore --leave-stopped` returns once it has detached from the tree, and
    the stop it left pending takes effect when each task next runs: on a loaded machine a few
    milliseconds later, so the split fill's check that the tree is stopped must not race it."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while True:
        running = [p for p in pids if (st := _status(p)) and st.get("State", "")[:1] in ("R", "S", "D", "I")]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def restored_procs(pids: list[int], born_after: int) -> tuple[Proc, ...]:
    """PIDS (a tree this restore made) as processes started after BORN_AFTER, by pid and start time
    (a pid taken again by another process is not one)."""
    procs = (Proc.of(p) for p in pids)
    return tuple(p for p in procs if p is not None and p.start >= born_after - 1)
