"""Read-ahead in a child process: pack entries read into the page cache by a process of its own.

A read-ahead thread in gpusnap's own process (readstage.read_ahead) needs the GIL back after every
read, and the restore plans in pure Python meanwhile (the split's choice): on the H200 such a thread
got 0.05-0.36 GB off the disk in the 0.3-1.2 s a restore plans, where the disk reads ~1.7 GB/s.
A child process has its own interpreter, so its reads follow one another at the disk's pace.

The parent does everything that needs judgement: it finds the entries in the validated index, opens
each pack as every pack open is checked (storage.format.packs.open_pack: directory fds, O_NOFOLLOW, the
owner), and hands the child only those descriptors and a list of (descriptor, offset, length) to read
in order. The child is `python -I -S` running _CHILD below (no site; ctypes, os, select, struct and
time): it dies with the thread that started it (PR_SET_PDEATHSIG, as the fill's workers do), reads
each range through the page cache in steps and drops the bytes, checks before each step whether its
stdin was closed (the parent's stop, or the parent's death) and then reports the bytes it read and
exits. It parses nothing from the store and writes nothing. A hint only, like
every read-ahead: the reads that follow check every byte.
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
from typing import TYPE_CHECKING, Callable

from storage.repo.readstage import open_pack_quietly

if TYPE_CHECKING:
    from storage.repo.readstage import PackSource, Run

PACKS_MOST = 64         # packs one child reads from at most (its descriptors); later runs are left out
STOP_WAIT_S = 5.0       # how long stop() waits for the child to end before it kills it

_SPEC = struct.Struct("<IQQ")  # one range: descriptor, offset, length
_HEAD = struct.Struct("<III")  # the number of ranges, the bytes one read asks for, the parent's pid

# The child. It dies with the thread that started it (PR_SET_PDEATHSIG), reads its ranges from stdin
# (the head, then the ranges), then reads them in order, one step at a time, until the end or until
# stdin is closed; prints "BYTES SECONDS" and exits.
_CHILD = r"""
import ctypes, os, select, struct, time
ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)
def exact(n):
    out = bytearray()
    while len(out) < n:
        b = os.read(0, n - len(out))
        if not b:
            raise SystemExit(0)
        out += b
    return bytes(out)
n, step, parent = struct.unpack("<III", exact(12))
if os.getppid() != parent:
    raise SystemExit(0)
spec = exact(20 * n)
buf = memoryview(bytearray(step))
poll = select.poll()
poll.register(0, select.POLLIN | select.POLLHUP)
t0, got = time.perf_counter(), 0
try:
    for i in range(n):
        fd, off, ln = struct.unpack_from("<IQQ", spec, 20 * i)
        end = off + ln
        while off < end:
            if poll.poll(0):
                raise StopIteration
            k = os.preadv(fd, [buf[:min(step, end - off)]], off)
            if k <= 0:
                break
            off += k
            got += k
except (StopIteration, OSError):
    pass
os.write(1, b"%d %.6f\n" % (got, time.perf_counter() - t0))
"""


class ChildReads:
    """Pack entries (runs of them, readstage.plan_runs) read into the page cache, in the order given,
    by a child process from now until stop(). Use started(), which gives None where no child can be started or nothing is to
    be read (the caller reads without it)."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc
        self._result: tuple[int, float] | None = None

    @classmethod
    def started(cls, store: "PackSource", runs: "list[Run]", step: int = 16 << 20,
                stop: Callable[[], bool] = lambda: False) -> "ChildReads | None":
        """The child, reading RUNS (readstage.plan_runs); None when there is nothing to read, STOP()
        said so, or the child cannot be started (a hint: never an error)."""
        fds: dict[str, int | None] = {}
        spec = bytearray()
        n = 0
        try:
            for run in runs:
                first, last = run[0][1], run[-1][1]
                if first.pack not in fds:
                    fds[first.pack] = open_pack_quietly(store, first.pack) if len(fds) < PACKS_MOST else None
                fd = fds[first.pack]
                if fd is not None:
                    spec += _SPEC.pack(fd, first.offset, last.offset + last.length - first.offset)
                    n += 1
            if not n or stop():
                return None
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _CHILD], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
                                        pass_fds=[fd for fd in fds.values() if fd is not None])
            except (OSError, ValueError, TypeError, subprocess.SubprocessError):  # TypeError: no sys.executable
                return None
        finally:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)  # the child has its own copies
        child = cls(proc)
        try:
            assert proc.stdin is not None
            proc.stdin.write(_HEAD.pack(n, step, os.getpid()) + spec)
            proc.stdin.flush()
        except OSError:
            child.stop()
            return None
        return child

    def stop(self) -> tuple[int, float]:
        """No further read: the child is told (its stdin closed) and waited for, killed if it does not
        end within STOP_WAIT_S. Returns the bytes it read and the seconds it read for ((0, 0.0) when
        it did not say). Stopping twice is stopping once."""
        if self._result is not None:
            return self._result
        proc, got = self._proc, (0, 0.0)
        try:
            try:  # closes its stdin first: the child's signal to stop
                out, _ = proc.communicate(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            fields = out.split()
            if len(fields) == 2 and proc.returncode == 0:
                got = (int(fields[0]), float(fields[1]))
        except (OSError, ValueError):
            pass
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self._result = got
        return got

    @property
    def pid(self) -> int:
        return self._proc.pid

