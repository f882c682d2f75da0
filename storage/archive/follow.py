"""A directory that another process is still writing, as a pipeline source: ingest overlapped with the dump.

CRIU writes a process's memory into pages-*.img files at a couple of GB/s; reading those files only
after CRIU exits puts the whole ingest after the dump. FollowedDirSource hands the pipeline the files
named by `follow` while they grow, in the order they appear: its reader reads up to the current end,
and waits at the end until more is written, or until the file is closed for writing (inotify
IN_CLOSE_WRITE) or the writer has finished. Every other file is read after the writer has finished.

The writer is an opaque job: `writer_done` is set when it has ended (successfully or not) and
`writer_failed()` returns its exception, if any; a failed writer stops the ingest with a
FollowError, a PipelineError (the caller reports the writer's own error). A followed file must only ever grow and
must not be reopened for writing once closed (true of CRIU's page images).

Linux only (inotify through libc, no extra dependency).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import stat
import struct
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from storage.archive.filetree import RangeReader, read_fd
from storage.pipeline.put import PipelineError, StreamSpec

class FollowError(PipelineError):
    """The directory cannot be watched or read, or its writer failed."""


IN_CLOSE_WRITE = 0x00000008
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


class _Inotify:
    """One inotify watch on a directory; events read without blocking longer than asked."""

    def __init__(self, path: str, mask: int) -> None:
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise FollowError(f"inotify_init1: {os.strerror(e)}")
        self.fd = fd
        if _libc.inotify_add_watch(fd, os.fsencode(path), mask) < 0:
            e = ctypes.get_errno()
            os.close(fd)
            raise FollowError(f"watching {path}: {os.strerror(e)}")

    def events(self, timeout: float) -> list[tuple[int, str]]:
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return []
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        out, off = [], 0
        while off + _EVENT.size <= len(data):
            _wd, mask, _cookie, ln = _EVENT.unpack_from(data, off)
            name = data[off + _EVENT.size: off + _EVENT.size + ln].split(b"\0", 1)[0]
            out.append((mask, os.fsdecode(name)))
            off += _EVENT.size + ln
        return out

    def close(self) -> None:
        os.close(self.fd)


class _FollowReader:
    """Reads a growing file; readinto fills VIEW completely unless the file has truly ended."""

    def __init__(self, src: "FollowedDirSource", name: str, fd: int) -> None:
        self.src, self.name, self.fd, self.offset = src, name, fd, 0
        self.handoff: tuple[int, int] | None = None  # (offset, length) left for others to read

    def readinto(self, view: memoryview) -> int:
        if self.src.handoff_min and self.handoff is None and self.src.finished(self.name):
            left = os.fstat(self.fd).st_size - self.offset
            if left >= self.src.handoff_min:
                # the file is complete and much is left: end here, the pipeline reads the rest
                # with several readers (FollowedDirSource.open_range)
                self.handoff = (self.offset, left)
                return 0
        got = 0
        while got < len(view):
            n = os.preadv(self.fd, [view[got:]], self.offset)
            if n > 0:
                got += n
                self.offset += n
                continue
            if self.src.finished(self.name):
                # finished may have been decided after that read: one more read settles it
                n = os.preadv(self.fd, [view[got:]], self.offset)
                if n <= 0:
                    break
                got += n
                self.offset += n
                continue
            self.src.wait()
        return got


class FollowedDirSource:
    """The flat directory PATH (stored under its base name) while a writer fills it; a context manager.

    Create it before the writer starts (the watch must see every file appear)."""

    def __init__(self, path: str, *, follow: Callable[[str], bool], writer_done: threading.Event,
                 writer_failed: Callable[[], BaseException | None], poll_s: float = 0.005,
                 handoff_min: int = 0) -> None:
        """handoff_min: when a followed file is complete and at least this much of it is unread, its
        reader stops there and reports the rest as `handoff` (0: never)."""
        self.path = os.path.abspath(path)
        self.base = os.path.basename(self.path)
        self._follow, self._done, self._failed, self._poll = follow, writer_done, writer_failed, poll_s
        self.handoff_min = handoff_min
        self._ino = _Inotify(self.path, IN_CREATE | IN_CLOSE_WRITE | IN_MOVED_TO)
        self._created: list[str] = sorted(os.listdir(self.path))
        self._closed: set[str] = set()
        self._yielded: set[str] = set()
        self.followed: list[str] = []   # the files read while the writer was still running

    def __enter__(self) -> "FollowedDirSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self._ino.close()

    # -- the writer's progress -----------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        for mask, name in self._ino.events(timeout):
            if mask & (IN_CREATE | IN_MOVED_TO) and name not in self._created:
                self._created.append(name)
            if mask & (IN_CLOSE_WRITE | IN_MOVED_TO):
                self._closed.add(name)

    def _check_writer(self) -> None:
        e = self._failed()
        if e is not None:
            raise FollowError(f"the writer of {self.path} failed ({str(e).splitlines()[0] if str(e) else type(e).__name__})")

    def wait(self) -> None:
        """Block briefly for the writer's next step; raises if it failed."""
        self._check_writer()
        self._pump(self._poll)

    def finished(self, name: str) -> bool:
        self._check_writer()
        self._pump(0)
        return name in self._closed or self._done.is_set()

    # -- Source --------------------------------------------------------------------------------
    def _spec(self, name: str, size: int | None) -> StreamSpec:
        p = os.path.join(self.path, name)
        try:
            st = os.lstat(p)
        except OSError as e:
            raise FollowError(f"{p}: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise FollowError(f"{p}: not a regular file; a followed directory holds only files")
        return StreamSpec(f"{self.base}/{name}", {"type": "file", "mode": stat.S_IMODE(st.st_mode),
                                                  "mtime_ns": st.st_mtime_ns}, size)

    def streams(self) -> Iterator[StreamSpec]:
        st = os.stat(self.path)
        yield StreamSpec(self.base, {"type": "dir", "mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns}, 0)
        while not self._done.is_set():
            nxt = next((n for n in self._created if n not in self._yielded and self._follow(n)), None)
            if nxt is None:
                self.wait()
                continue
            self._yielded.add(nxt)
            self.followed.append(nxt)
            yield self._spec(nxt, None)
        self._check_writer()
        self._pump(0)
        for name in sorted(os.listdir(self.path)):
            if name not in self._yielded:
                self._yielded.add(name)
                yield self._spec(name, os.lstat(os.path.join(self.path, name)).st_size)

    @contextmanager
    def open_range(self, spec: StreamSpec, offset: int, length: int) -> Iterator[RangeReader]:
        """Part of a file the writer has finished: one of several readers."""
        with read_fd(os.path.join(self.path, spec.name.partition("/")[2]), FollowError) as fd:
            yield RangeReader(fd, offset, length)

    @contextmanager
    def open(self, spec: StreamSpec) -> Iterator[_FollowReader | RangeReader]:
        """A followed file (size unknown) is read as it grows; any other one, whole."""
        name = spec.name.partition("/")[2]
        with read_fd(os.path.join(self.path, name), FollowError) as fd:
            yield _FollowReader(self, name, fd) if spec.size is None else RangeReader(fd, 0, spec.size)
