"""Page-aligned reusable buffers and O_DIRECT file I/O with a clean buffered fallback.

O_DIRECT needs the buffer address, the file offset and the length aligned to the device's logical
block; every buffer here comes from mmap (page aligned) and every length is padded to ALIGN. Where the
filesystem refuses O_DIRECT (tmpfs, some overlay setups) the same calls use the page cache + fsync.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import queue
import threading
from contextlib import contextmanager
from typing import Iterator

ALIGN = 4096


_NOGIL_MIN = 64 << 10


def address_of(view: memoryview | bytes) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too).

    A writable view through ctypes alone (~0.5 us; numpy's .ctypes costs ~3 us, with the GIL held, and
    the pipeline asks this several times per chunk on every worker)."""
    if not len(view):
        return 0
    if isinstance(view, memoryview) and not view.readonly and view.c_contiguous:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    import numpy as np  # noqa: PLC0415
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def copy_into(dst: memoryview, src: memoryview | bytes) -> None:
    """dst[:len(src)] = src, without holding the GIL for large copies (memoryview assignment holds it
    for the whole memcpy, which stalls every other pipeline thread; ctypes.memmove releases it)."""
    n = len(src)
    if n > len(dst):
        raise ValueError(f"copy of {n} bytes into {len(dst)}")
    if n < _NOGIL_MIN:
        dst[:n] = src
        return
    ctypes.memmove(address_of(dst), src if isinstance(src, bytes) else address_of(src), n)


def is_zero(view: memoryview) -> bool:
    """True if every byte of VIEW is zero (a 64-byte probe first: data rarely starts with zeros by chance)."""
    n = len(view)
    if n == 0:
        return True
    head = min(n, 64)
    if any(view[:head]):
        return False
    import numpy as np  # noqa: PLC0415 - numpy is loaded by then in whatever tests chunks
    words = n // 8
    if words and np.frombuffer(view, dtype=np.uint64, count=words).any():
        return False
    return not any(view[words * 8:])


from storage.base.errors import GpusnapError


class DirectIOError(GpusnapError, OSError):
    """An I/O call on a store file failed."""


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class AlignedBuffer:
    """One page-aligned anonymous mapping, allocated once and reused (huge pages advised); or, from an
    Arena, a page-aligned part of a mapping shared with other processes (the arena unmaps it)."""

    def __init__(self, size: int, arena: "Arena | None" = None) -> None:
        self.size = align_up(size)
        if arena is not None:
            self._map = None
            self.view = arena.carve(self.size)
            return
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE") and self.size >= 2 << 20:
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.view = memoryview(self._map)

    def close(self) -> None:
        if self._map is None:
            return  # the arena's
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            # A slice is still referenced (e.g. by an exception's traceback on the error path);
            # the mapping is unmapped when the last reference goes.
            pass

    def __enter__(self) -> "AlignedBuffer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BufferPool:
    """A fixed set of AlignedBuffers handed out one at a time; acquire blocks when all are in use.

    The blocking is the pipeline's back-pressure: a reader can be at most `count` buffers ahead of
    the slowest stage, and nothing on the hot path allocates.
    """

    def __init__(self, count: int, size: int, arena: "Arena | None" = None) -> None:
        self.count = count
        self.size = align_up(size)
        self._all = [AlignedBuffer(self.size, arena) for _ in range(count)]
        self._free: queue.SimpleQueue[AlignedBuffer] = queue.SimpleQueue()
        for b in self._all:
            self._free.put(b)

    def acquire(self, timeout: float | None = None) -> AlignedBuffer:
        try:
            return self._free.get(timeout=timeout)
        except queue.Empty:
            raise DirectIOError(errno.ETIMEDOUT, "no staging buffer became free") from None

    def release(self, buf: AlignedBuffer) -> None:
        self._free.put(buf)

    @contextmanager
    def borrowed(self) -> Iterator[AlignedBuffer]:
        b = self.acquire()
        try:
            yield b
        finally:
            self.release(b)

    def close(self) -> None:
        for b in self._all:
            b.close()

    def __enter__(self) -> "BufferPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Recycler:
    """AlignedBuffers of one size, reused: take() hands out a free one or maps a new one (it never
    blocks, so a consumer that holds several in any order cannot wait on itself), give() takes one
    back. What it maps is the peak in use at once, mapped once and touched once: on the development VM
    a fresh 4 MiB object per chunk cost 1.2-1.8 s per GiB in page faults, a reused one 0.06 s
    (BENCHMARKS.md section 29). A context manager; close() unmaps every buffer."""

    def __init__(self, size: int) -> None:
        self.size = align_up(max(1, size))
        self._free: list[AlignedBuffer] = []
        self._all: list[AlignedBuffer] = []
        self._lock = threading.Lock()

    @property
    def mapped(self) -> int:
        """Buffers mapped so far (the peak in use at once)."""
        return len(self._all)

    def take(self) -> AlignedBuffer:
        with self._lock:
            if self._free:
                return self._free.pop()
        b = AlignedBuffer(self.size)
        with self._lock:
            self._all.append(b)
        return b

    def give(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self._free.append(buf)

    def close(self) -> None:
        with self._lock:
            bufs, self._all, self._free = self._all, [], []
        for b in bufs:
            b.close()

    def __enter__(self) -> "Recycler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def direct_io_supported(directory: str) -> bool:
    """Probe whether files in DIRECTORY can be opened with O_DIRECT and written aligned."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = os.path.join(directory, f".odirect-probe-{os.getpid()}")
    buf = AlignedBuffer(ALIGN)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        buf.close()
        return False
    try:
        os.write(fd, buf.view[:ALIGN])
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        os.unlink(path)
        buf.close()


def open_for_write(path: str, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    if direct:
        flags |= os.O_DIRECT
    return os.open(path, flags, 0o600)


def write_all(fd: int, view: memoryview, offset: int) -> None:
    """pwrite VIEW fully at OFFSET (O_DIRECT callers pass aligned views)."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise DirectIOError(errno.EIO, "short write")
        done += n


def write_all_direct(fd: int, view: memoryview, offset: int) -> None:
    """write_all for an O_DIRECT FD (VIEW aligned, OFFSET and len(VIEW) multiples of ALIGN). A write
    that stops short inside a block cannot go on from there (an unaligned offset is refused): it is
    reported as the full disk it almost always is (ENOSPC, when the file system says less than the rest
    is free), else EIO."""
    done = 0
    while done < len(view):
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0 or n % ALIGN and done + n < len(view):
            st = os.fstatvfs(fd)
            if st.f_bavail * st.f_frsize < len(view) - done - max(n, 0):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise DirectIOError(errno.EIO, "a direct write stopped short")
        done += n


def read_into(fd: int, view: memoryview, offset: int) -> int:
    """preadv into VIEW from OFFSET until it is full or EOF; returns bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def read_into_direct(fd: int, view: memoryview, offset: int) -> int:
    """read_into for an O_DIRECT FD (VIEW aligned, OFFSET and len(VIEW) multiples of ALIGN): a read
    that ends inside a block has met the end of the file (another read there would be refused)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        done += n
        if n == 0 or n % ALIGN:
            break
    return done


def read_to_end(fd: int, limit: int | None = None) -> bytes:
    """What is left in FD up to its end (at most LIMIT bytes), in reads of 1 MiB."""
    parts, got = [], 0
    while limit is None or got < limit:
        b = os.read(fd, 1 << 20 if limit is None else min(1 << 20, limit - got))
        if not b:
            break
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def read_small_file(dir_fd: int, name: str, limit: int) -> bytes | None:
    """NAME in DIR_FD read whole if it is a regular file of at most LIMIT bytes, opened without following
    a link or blocking on a FIFO; None where there is none, it is anything else, or it is larger."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        data = read_to_end(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None


def write_new_file(dir_fd: int, name: str, data: bytes) -> None:
    """A new file NAME in DIR_FD holding DATA, fsynced (removed again if writing fails)."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        unlink_quietly(dir_fd, name)
        raise
    os.close(fd)


def unlink_quietly(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def open_for_read(path: str, direct: bool) -> tuple[int, bool]:
    """Open PATH read-only, with O_DIRECT when asked and allowed; returns (fd, is_direct)."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_DIRECT), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK), False


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Arena:
    """One shared mapping of a memfd, carved into page-aligned buffers: the memory a process started
    with the descriptor (storage/pipeline/encodeprocs.py) sees as the same bytes. Carving only moves forward;
    the whole mapping goes at close."""

    def __init__(self, size: int, name: str = "gpusnap-arena") -> None:
        self.size = align_up(size)
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._map)
        self.base = address_of(self.view)
        self._next = 0
        self._lock = threading.Lock()

    def carve(self, size: int) -> memoryview:
        """The next SIZE bytes (page aligned) of the arena."""
        size = align_up(size)
        with self._lock:
            if self._next + size > self.size:
                raise DirectIOError(errno.ENOMEM, f"arena of {self.size} bytes has no room for {size} more")
            at = self._next
            self._next += size
        return self.view[at:at + size]

    def offset_of(self, view: memoryview) -> int:
        """Where VIEW (a view into this arena) begins in it; ValueError when it does not lie inside."""
        n = len(view)
        off = address_of(view) - self.base if n else 0
        if off < 0 or off + n > self.size:
            raise ValueError("a buffer outside the shared arena")
        return off

    def close(self) -> None:
        try:
            self.view.release()
            self._map.close()
        except BufferError:
            pass  # a slice still referenced (an error path's traceback): unmapped with the last reference
        try:
            os.close(self.fd)
        except OSError:
            pass

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
