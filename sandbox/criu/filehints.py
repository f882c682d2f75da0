"""The mapped files CRIU reads while it restores, read into the page cache before the split fill's reads queue.

CRIU maps every file mapping of the restored processes (their libraries' code and data) and writes the
dumped pages of each private one into it: the first write to a page faults the file's page in (copy
on write), and CRIU checks each mapped ELF file against its build-id (its first pages). With a cold
cache each of these is a small read, one at a time, and each waits behind every read already queued on
the disk, where the split fill keeps four 16 MiB reads. Read from a 20 GB restore's CRIU log on the H200
(BENCHMARKS.md section 37): of CRIU's 2.4 s, ~2.1 s were ~50 such waits of 20-70 ms, each at the
first page CRIU wrote into a library's data area, or at a library's premap. Reading those pages
(and each file's head) before the fill's reads begin makes them page-cache hits.

What is read: for each process whose pages are served (in the process tree's order), each area of its
mm image that maps a regular file (CRIU's VMA_FILE_PRIVATE or VMA_FILE_SHARED; the file named by
files.img), the file's first HEAD bytes, and the file's bytes behind every page CRIU writes into the
area (the pagemap CRIU gets: area start + pgoff). Nothing when the snapshot restores a mount namespace
(mountpoints images: the paths are the namespace's, not this host's) or names remapped files
(remap-fpath.img: a path then names another file than the one mapped).

Guarantees kept here: a hint only: nothing read here reaches a process or a file, and every failure
is ignored (CRIU opens the files itself and reports what is wrong). Every path is a snapshot's claim,
from a store that may hold a hostile snapshot, and gpusnap is root:
- a path is resolved with openat2(O_PATH, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) (CRIU's names
  are the kernel's, with no link in them; no /proc/PID/root detour), then read only where it is a
  regular file of a file system that holds files on a disk or in memory (ext4, xfs, btrfs, overlay,
  squashfs, erofs, f2fs, tmpfs: never procfs, sysfs, debugfs, tracefs, FUSE or a network file
  system, whose reads may consume, act or block), of the size files.img records (CRIU refuses
  another), opened through that very inode with O_NONBLOCK (a lease makes the open fail, not wait),
  never for writing, atime untouched; ranges clamped to the file's size;
- at most MAX_FILES files and MAX_BYTES bytes, at most OPEN_MOST files open at once; images parsed in
  time linear in their sizes (overlapping pagemap entries, which CRIU never writes, give no hints);
- a lookup that does not answer (an automount, a stalled mount on the way) holds up only the thread
  that warms: the restore waits DEADLINE_S at most (warm_within).
Where openat2 is missing (kernels before 5.6) nothing is warmed."""
from __future__ import annotations

import collections
import ctypes
import os
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from storage.errors import GpusnapError

from sandbox.criu.split import (MAX_MM_BYTES, PAGE, VMA_FILE_PRIVATE, VMA_FILE_SHARED, VMA_REGULAR, Pagemap,
                                SplitError, _LEN, _MAGICS, _one_record, _skip_field, _varint)

HEAD = 64 << 10            # bytes of each file's start read (its ELF header, program headers and build-id note)
MAX_FILES = 4096           # files warmed at most
MAX_BYTES = 256 << 20      # bytes asked for at most, all files together
MAX_RANGES = 1 << 16       # ranges planned at most, all files together
MAX_FILES_IMG = 16 << 20   # a files.img larger than this is not read (~300 bytes a file: ~50,000 files)
MAX_PATH = 4096
OPEN_MOST = 16             # files open at once while warming
FD_REG = 1                 # CRIU's fd_types: a regular file
DEADLINE_S = 2.0           # how long a restore waits for the warming (warm_within)
OFF_MOST = 1 << 62         # file offsets past this are no file's (and would overflow the kernel's loff_t)
# file systems whose regular files are plain data on a disk or in memory (statfs f_type)
DATA_FS = {0xEF53: "ext2/3/4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlay",
           0x73717368: "squashfs", 0xE0F5E1E2: "erofs", 0xF2F52010: "f2fs", 0x01021994: "tmpfs"}


class FileHintError(GpusnapError):
    """An image this module reads is not what CRIU writes (the hints are then left out), or a bad setting."""


@dataclass(frozen=True)
class Hint:
    """Byte ranges (offset, length) of the file at PATH, sorted and merged; SIZE: its size as files.img
    records it (None where it does not)."""

    path: str
    ranges: tuple[tuple[int, int], ...]
    size: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.ranges)


def reg_paths(data: bytes) -> dict[int, tuple[str, int | None]]:
    """The regular files of a CRIU files.img (records FileEntry {1: type, 2: id, 3: reg {6: name, 8: size}}),
    by id: (path, size); absolute paths only (CRIU's own, as it opens them on restore), each at most
    MAX_PATH bytes."""
    if len(data) > MAX_FILES_IMG:
        raise FileHintError(f"files.img: {len(data)} bytes, more than the {MAX_FILES_IMG} read")
    out: dict[int, tuple[str, int | None]] = {}
    i = _MAGICS
    try:
        while i < len(data):
            if i + _LEN.size > len(data):
                raise FileHintError("files.img: truncated record")
            (n,) = _LEN.unpack_from(data, i)
            start, end = i + _LEN.size, i + _LEN.size + n
            if end > len(data):
                raise FileHintError("files.img: truncated record")
            kind, fid, reg = _file_entry(data, start, end)
            if kind == FD_REG and fid is not None and reg is not None and reg[0] is not None:
                out[fid] = (reg[0], reg[1])
            i = end
    except (SplitError, struct.error) as e:
        raise FileHintError(f"files.img: {e}") from None
    return out


def _file_entry(data: bytes, i: int, end: int) -> tuple[int | None, int | None, tuple[str | None, int | None] | None]:
    kind = fid = None
    reg = None
    while i < end:
        key, i = _varint(data, i)
        if key & 7 == 0:
            v, i = _varint(data, i)
            if key >> 3 == 1:
                kind = v
            elif key >> 3 == 2:
                fid = v
        elif key & 7 == 2 and key >> 3 == 3:
            ln, i = _varint(data, i)
            if i + ln > end:
                raise FileHintError("files.img: truncated field")
            reg = _reg_file(data, i, i + ln)
            i += ln
        else:
            i = _skip_field(data, i, key & 7)
    if i != end:
        raise FileHintError("files.img: malformed record")
    return kind, fid, reg


def _reg_file(data: bytes, i: int, end: int) -> tuple[str | None, int | None]:
    name: str | None = None
    size: int | None = None
    while i < end:
        key, i = _varint(data, i)
        if key & 7 == 2:
            ln, i = _varint(data, i)
            if i + ln > end:
                raise FileHintError("files.img: truncated name")
            if key >> 3 == 6:
                raw = data[i:i + ln]
                name = None
                if 1 < ln <= MAX_PATH and raw[:1] == b"/" and b"\0" not in raw:
                    name = raw.decode("utf-8", "surrogateescape")
            i += ln
        elif key & 7 == 0:
            v, i = _varint(data, i)
            if key >> 3 == 8:
                size = v
        else:
            i = _skip_field(data, i, key & 7)
    if i != end:
        raise FileHintError("files.img: malformed name")
    return name, size


def file_areas(mm: bytes) -> list[tuple[int, int, int, int]]:
    """(start, end, pgoff, file id) of each area of a CRIU mm image (MmEntry {14: VmaEntry {1: start,
    2: end, 3: pgoff, 4: shmid, 7: status}}) that maps a regular file, sorted by start."""
    try:
        i, end = _one_record(mm, "mm", MAX_MM_BYTES)
        out: list[tuple[int, int, int, int]] = []
        while i < end:
            key, i = _varint(mm, i)
            if key >> 3 != 14 or key & 7 != 2:
                i = _skip_field(mm, i, key & 7)
                continue
            ln, i = _varint(mm, i)
            vend = i + ln
            if vend > end:
                raise FileHintError("mm: truncated area")
            f: dict[int, int] = {}
            while i < vend:
                k, i = _varint(mm, i)
                if k & 7 == 0:
                    f[k >> 3], i = _varint(mm, i)
                else:
                    i = _skip_field(mm, i, k & 7)
            st = f.get(7, 0)
            if st & VMA_REGULAR and st & (VMA_FILE_PRIVATE | VMA_FILE_SHARED) and f.get(1, 0) < f.get(2, 0):
                out.append((f.get(1, 0), f.get(2, 0), f.get(3, 0), f.get(4, 0)))
    except SplitError as e:
        raise FileHintError(str(e)) from None
    out.sort()
    for k in range(1, len(out)):
        if out[k][0] < out[k - 1][1]:
            raise FileHintError(f"mm: areas overlap at {out[k][0]:#x}")
    return out


def plan(paths: dict[int, tuple[str, int | None]], processes: Sequence[tuple[bytes, Pagemap]]) -> list[Hint]:
    """The hints for PROCESSES (each its mm image and the pagemap CRIU gets, in the tree's order): per
    file mapped, its head and the file bytes behind each page CRIU writes into its areas; at most
    MAX_FILES files, MAX_RANGES ranges and MAX_BYTES bytes (the first met kept). FileHintError where
    areas or pagemap entries overlap (CRIU writes neither)."""
    want: dict[str, list[tuple[int, int]]] = {}
    sizes: dict[str, int | None] = {}
    nranges = 0
    for mm, pm in processes:
        areas = file_areas(mm)
        entries = sorted((e.vaddr, e.vaddr + e.nbytes) for e in pm.entries if e.offset is not None)
        for k in range(1, len(entries)):
            if entries[k][0] < entries[k - 1][1]:
                raise FileHintError(f"pagemap: entries overlap at {entries[k][0]:#x}")
        k = 0  # areas and entries are sorted and apart: their ends are sorted too, one sweep over both
        for a, b, pgoff, fid in areas:
            named = paths.get(fid)
            if named is None:
                continue
            path = named[0]
            if path not in want:
                if len(want) >= MAX_FILES:
                    continue
                want[path], sizes[path] = [(0, HEAD)], named[1]
                nranges += 1
            while k < len(entries) and entries[k][1] <= a:
                k += 1
            j = k
            while j < len(entries) and entries[j][0] < b and nranges < MAX_RANGES:
                lo, hi = max(a, entries[j][0]), min(b, entries[j][1])
                off = pgoff + lo - a
                if hi > lo and off + (hi - lo) <= OFF_MOST:
                    want[path].append((off, hi - lo))
                    nranges += 1
                j += 1
    hints, total = [], 0
    for path, ranges in want.items():
        merged: list[list[int]] = []
        for off, n in sorted(ranges):
            off, n = off - off % PAGE, n + off % PAGE
            if merged and off <= merged[-1][0] + merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], off + n - merged[-1][0])
            else:
                merged.append([off, n])
        kept: list[tuple[int, int]] = []
        for off, n in merged:
            n = min(n, MAX_BYTES - total)
            if n <= 0:
                break
            kept.append((off, n))
            total += n
        if kept:
            hints.append(Hint(path, tuple(kept), sizes[path]))
    return hints


def warm(hints: Sequence[Hint], stop: Callable[[], bool] = lambda: False) -> tuple[int, int]:
    """HINTS read into the page cache, so they are resident when this returns: each file opened (see
    open_data_file), its ranges asked for (POSIX_FADV_WILLNEED), then read through, OPEN_MOST files
    asked for ahead of the one being read; STOP is checked between steps. Returns (files warmed,
    bytes read). A hint only: every failure is ignored."""
    ahead: collections.deque[tuple[int, Hint, int]] = collections.deque()
    scratch = bytearray(1 << 20)
    files = got = 0

    def read_through(fd: int, h: Hint, size: int) -> int:
        n = 0
        for off, ln in h.ranges:
            end = min(off + ln, size)
            while off < end and not stop():
                try:
                    r = os.preadv(fd, [memoryview(scratch)[:min(len(scratch), end - off)]], off)
                except (OSError, OverflowError, ValueError):
                    r = 0
                if r <= 0:
                    break
                off += r
                n += r
        return n

    try:
        for h in hints:
            if stop():
                break
            opened = open_data_file(h.path, h.size)
            if opened is None:
                continue
            fd, size = opened
            ahead.append((fd, h, size))
            files += 1
            for off, n in h.ranges:
                if off >= size:
                    break
                try:
                    os.posix_fadvise(fd, off, min(n, size - off), os.POSIX_FADV_WILLNEED)
                except (OSError, OverflowError, ValueError):
                    break
            if len(ahead) > OPEN_MOST:
                fd, old, sz = ahead.popleft()
                try:
                    got += read_through(fd, old, sz)
                finally:
                    os.close(fd)
        while ahead:
            fd, old, sz = ahead.popleft()
            try:
                if not stop():
                    got += read_through(fd, old, sz)
            finally:
                os.close(fd)
        return files, got
    finally:
        for fd, _, _ in ahead:
            os.close(fd)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


SYS_OPENAT2 = 437                 # the same number on x86-64 and aarch64 (the generic table)
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS = 0x02, 0x04
AT_FDCWD = -100
_libc = None


def _openat2_path(path: str) -> int | None:
    """PATH resolved with no symbolic or magic link on the way, as an O_PATH descriptor; None where it
    cannot be (or the kernel lacks openat2)."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    try:
        raw = os.fsencode(path)
    except (UnicodeError, ValueError):
        return None
    if b"\0" in raw:
        return None
    how = _OpenHow(os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(raw), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    return None if fd < 0 else int(fd)


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]  # the kernel's struct statfs (64-bit)


def _fs_type(fd: int) -> int | None:
    assert _libc is not None
    st = _Statfs()
    return None if _libc.fstatfs(ctypes.c_int(fd), ctypes.byref(st)) != 0 else st.f_type & 0xFFFFFFFF


def open_data_file(path: str, size: int | None = None) -> tuple[int, int] | None:
    """PATH opened for reading, with its size, if it is a regular file of a data file system (DATA_FS)
    whose size is SIZE (where given), reached without a link; else None. Looked up as O_PATH first (no
    open of a device, a FIFO or a socket runs), then that same inode opened through /proc/self/fd with
    O_NONBLOCK (a lease on it makes the open fail instead of waiting) and O_NOATIME."""
    p = _openat2_path(path)
    if p is None:
        return None
    try:
        st = os.fstat(p)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0 or (size is not None and st.st_size != size):
            return None
        if _fs_type(p) not in DATA_FS:
            return None
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
        try:
            return os.open(f"/proc/self/fd/{p}", flags | os.O_NOATIME), st.st_size
        except PermissionError:  # O_NOATIME: only the owner or CAP_FOWNER
            return os.open(f"/proc/self/fd/{p}", flags), st.st_size
    except OSError:
        return None
    finally:
        os.close(p)


def warm_within(hints: Sequence[Hint], deadline_s: float = DEADLINE_S) -> dict[str, float]:
    """warm(HINTS) in a thread of its own, waited for at most DEADLINE_S seconds (then told to stop
    and left to end on its own: a lookup that does not answer holds only that thread). Returns
    {"files", "bytes", "seconds", "timed_out"} as of the return, for the restore's report."""
    out: dict[str, float] = {"files": 0, "bytes": 0, "timed_out": 0}
    stop = threading.Event()

    def run() -> None:
        try:
            files, got = warm(hints, stop.is_set)
            out["files"], out["bytes"] = files, got
        except Exception:  # noqa: BLE001 - a hint
            pass

    t0 = time.perf_counter()
    t = threading.Thread(target=run, daemon=True, name="gpusnap-criu-files")
    t.start()
    t.join(deadline_s)
    if t.is_alive():
        stop.set()
    report = dict(out)  # what the thread does after the deadline is not reported
    report["timed_out"] = int(t.is_alive())
    report["seconds"] = time.perf_counter() - t0
    return report


def hints_on() -> bool:
    """$GPUSNAP_CRIU_FILE_HINTS: 1 (default) warms the mapped files before the fill's reads, 0 does not
    (for measuring)."""
    from storage import settings
    return bool(settings.setting("GPUSNAP_CRIU_FILE_HINTS", 1, int, lambda v: v in (0, 1), "0 or 1", FileHintError))
