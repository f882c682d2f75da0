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
- a path is looked up only where every mount it passes through is a file system that holds files
  on a disk or in memory (ext4, xfs, btrfs, overlay, squashfs, erofs, f2fs, tmpfs, ramfs: never an
  automount, FUSE, a network file system, procfs, sysfs, debugfs or tracefs, whose lookups and reads
  may wait, consume or act), with no ".", ".." or empty component; resolved with openat2(O_PATH,
  RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) (CRIU's names are the kernel's, with no link in them;
  no /proc/PID/root detour); read only where it is a regular file of such a file system, of the
  size files.img records (CRIU refuses another), opened through that very inode with O_NONBLOCK (a
  lease makes the open fail, not wait; its holder is told, as it is of CRIU's own open next), never
  for writing, atime untouched; ranges clamped to the file's size;
- at most MAX_FILES files and MAX_BYTES bytes, at most OPEN_MOST files open at once; only the files
  the mm images map are kept from files.img; images parsed in time linear in their sizes, one
  process's pagemap at a time (entries out of order or overlapping, which CRIU never writes, give
  no hints), no more once the bounds are reached;
- whatever holds a read up (an overlay whose lower layer is remote, say) holds only the thread that
  warms: the restore waits DEADLINE_S at most, and while that thread is held no other starts in this
  process (warm_within), so stuck threads and their descriptors cannot pile up.
Where openat2 is missing (kernels before 5.6) nothing is warmed."""
from __future__ import annotations

import collections
import ctypes
import errno
import os
import re
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from storage.api import GpusnapError

from sandbox.criu.split import (PAGE, VMA_FILE_PRIVATE, VMA_FILE_SHARED, VMA_REGULAR, Pagemap, SplitError, _LEN,
                                _MAGICS, _skip_field, _varint, vma_fields)

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
           0x73717368: "squashfs", 0xE0F5E1E2: "erofs", 0xF2F52010: "f2fs", 0x01021994: "tmpfs",
           0x858458F6: "ramfs"}


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


def reg_paths(data: bytes, wanted: "set[int] | None" = None) -> dict[int, tuple[str, int | None]]:
    """The regular files of a CRIU files.img (records FileEntry {1: type, 2: id, 3: reg {6: name, 8: size}}),
    by id: (path, size); absolute paths only (CRIU's own, as it opens them on restore), each at most
    MAX_PATH bytes; only the ids in WANTED where given (those the mm images map)."""
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
            if (kind == FD_REG and fid is not None and reg is not None and reg[0] is not None
                    and (wanted is None or fid in wanted)):
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
    out: list[tuple[int, int, int, int]] = []
    try:
        for f in vma_fields(mm):
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


def plan(paths: dict[int, tuple[str, int | None]],
         processes: Iterable[tuple[list[tuple[int, int, int, int]], Pagemap]]) -> list[Hint]:
    """The hints for PROCESSES (each its file_areas and the pagemap CRIU gets, in the tree's order): per
    file mapped, its head and the file bytes behind each page CRIU writes into its areas; at most
    MAX_FILES files, MAX_RANGES ranges and MAX_BYTES bytes (the first met kept; no more is parsed
    once they are reached). FileHintError where pagemap entries are out of order or overlap (CRIU
    writes neither)."""
    want: dict[str, list[tuple[int, int]]] = {}
    sizes: dict[str, int | None] = {}
    nranges, asked = 0, 0
    for areas, pm in processes:
        if nranges >= MAX_RANGES or asked >= MAX_BYTES or len(want) >= MAX_FILES:
            break
        entries = [(e.vaddr, e.vaddr + e.nbytes) for e in pm.entries if e.offset is not None]
        for k in range(1, len(entries)):
            if entries[k][0] < entries[k - 1][1]:
                raise FileHintError(f"pagemap: entries out of order or overlapping at {entries[k][0]:#x}")
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
                nranges, asked = nranges + 1, asked + HEAD
            while k < len(entries) and entries[k][1] <= a:
                k += 1
            j = k
            while j < len(entries) and entries[j][0] < b and nranges < MAX_RANGES and asked < MAX_BYTES:
                lo, hi = max(a, entries[j][0]), min(b, entries[j][1])
                off = pgoff + lo - a
                if hi > lo and off + (hi - lo) <= OFF_MOST:
                    want[path].append((off, hi - lo))
                    nranges, asked = nranges + 1, asked + hi - lo
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


def warm(hints: Sequence[Hint], stop: Callable[[], bool] = lambda: False,
         progress: "dict[str, float] | None" = None) -> tuple[int, int]:
    """HINTS read into the page cache, so they are resident when this returns: each file opened (see
    open_data_file), its ranges asked for (POSIX_FADV_WILLNEED), then read through, OPEN_MOST files
    asked for ahead of the one being read; STOP is checked between steps; PROGRESS (where given)
    gets "files" and "bytes" as they grow. Returns (files warmed, bytes read). A hint only: every
    failure is ignored."""
    ahead: collections.deque[tuple[int, Hint, int]] = collections.deque()
    scratch = bytearray(1 << 20)
    done: dict[str, float] = {"files": 0, "bytes": 0} if progress is None else progress
    done.update(files=0, bytes=0)
    try:
        mounts = _mounts()
    except OSError:
        return 0, 0

    def read_through(fd: int, h: Hint, size: int) -> None:
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
                done["bytes"] += r

    try:
        for h in hints:
            if stop():
                break
            why: list[str] = []
            opened = open_data_file(h.path, h.size, mounts, why)
            if opened is None:
                for reason in why:  # the report's count of files passed over, by reason
                    done[f"passed_over_{reason}"] = done.get(f"passed_over_{reason}", 0) + 1
                continue
            fd, size = opened
            ahead.append((fd, h, size))
            done["files"] += 1
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
                    read_through(fd, old, sz)
                finally:
                    os.close(fd)
        while ahead:
            fd, old, sz = ahead.popleft()
            try:
                if not stop():
                    read_through(fd, old, sz)
            finally:
                os.close(fd)
        return int(done["files"]), int(done["bytes"])
    finally:
        for fd, _, _ in ahead:
            os.close(fd)


# the file systems (mountinfo names) a path may pass through: what DATA_FS's magics are
DATA_FS_NAMES = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "overlay", "squashfs", "erofs", "f2fs", "tmpfs",
                           "ramfs", "rootfs"})
_ESCAPE = re.compile(rb"\\([0-7]{3})")


def _mounts() -> dict[str, str]:
    """This mount namespace's mount points and their file system types (/proc/self/mountinfo; where
    several are mounted at one point, the last, the one seen)."""
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            parts = line.split()
            try:
                sep = parts.index(b"-", 6)
            except ValueError:
                continue
            if len(parts) > sep + 1:
                point = _ESCAPE.sub(lambda m: bytes([int(m.group(1), 8) & 0xFF]), parts[4])
                out[os.fsdecode(point)] = os.fsdecode(parts[sep + 1])
    return out


def through_data_mounts(path: str, mounts: dict[str, str]) -> bool:
    """Whether looking PATH up passes only through mounts of DATA_FS_NAMES (never an automount, FUSE,
    a network file system, procfs or sysfs, whose lookups may wait or act): PATH absolute, with no
    empty, "." or ".." component (CRIU's names are the kernel's, with none)."""
    comps = path.split("/")
    if comps[0] != "" or any(c in ("", ".", "..") for c in comps[1:]):
        return False
    if mounts.get("/") not in DATA_FS_NAMES:
        return False
    prefix = ""
    for c in comps[1:]:
        prefix += "/" + c
        fs = mounts.get(prefix)
        if fs is not None and fs not in DATA_FS_NAMES:
            return False
    return True


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _Statfs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]  # the kernel's struct statfs (64-bit)


SYS_OPENAT2 = 437                 # the same number on x86-64 and aarch64 (the generic table)
RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS = 0x02, 0x04
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_openat2_missing: list[bool] = []  # set once openat2 is refused as such (ENOSYS, or EPERM from a filter)


def _openat2_path(path: str) -> int | None:
    """PATH resolved with no symbolic or magic link on the way, as an O_PATH descriptor; None where it
    cannot be (or the kernel lacks openat2)."""
    if _openat2_missing:
        return None
    try:
        raw = os.fsencode(path)
    except (UnicodeError, ValueError):
        return None
    if b"\0" in raw:
        return None
    how = _OpenHow(os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, 0, RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_int(AT_FDCWD), ctypes.c_char_p(raw), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
            _openat2_missing.append(True)
        return None
    return int(fd)


def _fs_type(fd: int) -> int | None:
    st = _Statfs()
    return None if _libc.fstatfs(ctypes.c_int(fd), ctypes.byref(st)) != 0 else st.f_type & 0xFFFFFFFF


PASSED_OVER = ("mount", "lookup", "kind", "size", "fs", "open")  # why a file was not read (open_data_file)


def open_data_file(path: str, size: int | None = None, mounts: "dict[str, str] | None" = None,
                   why: "list[str] | None" = None) -> tuple[int, int] | None:
    """PATH opened for reading, with its size, if it is a regular file of a data file system (DATA_FS)
    whose size is SIZE (where given), reached without a link and, with MOUNTS (_mounts), through data
    file systems only; else None, and WHY (where given) gets the reason, one of PASSED_OVER. Looked up
    as O_PATH first (no open of a device, a FIFO or a socket runs), then that same inode opened
    through /proc/self/fd with O_NONBLOCK (a lease on it makes the open fail instead of waiting; its
    holder is told, as of CRIU's own open next) and O_NOATIME."""
    def no(reason: str) -> tuple[int, int] | None:
        if why is not None:
            why.append(reason)
        return None

    if mounts is not None and not through_data_mounts(path, mounts):
        return no("mount")
    p = _openat2_path(path)
    if p is None:
        return no("lookup")
    try:
        st = os.fstat(p)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
            return no("kind")
        if size is not None and st.st_size != size:
            return no("size")
        if _fs_type(p) not in DATA_FS:
            return no("fs")
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
        try:
            return os.open(f"/proc/self/fd/{p}", flags | os.O_NOATIME), st.st_size
        except PermissionError:  # O_NOATIME: only the owner or CAP_FOWNER
            return os.open(f"/proc/self/fd/{p}", flags), st.st_size
    except OSError:
        return no("open")
    finally:
        os.close(p)


_warming_lock = threading.Lock()
_warming: list[threading.Thread] = []  # this process's warming thread, while it runs


def warm_within(hints: Sequence[Hint], deadline_s: float = DEADLINE_S) -> dict[str, float]:
    """warm(HINTS) in a thread of its own, waited for at most DEADLINE_S seconds (then told to stop
    and left to end on its own: a read that does not answer holds only that thread). One such thread
    per process at a time: while an earlier one is still held up, nothing is warmed ("busy": 1), so
    stuck threads and their descriptors never pile up. Returns {"files", "bytes", "seconds",
    "timed_out", "busy", and "passed_over_REASON" per reason of PASSED_OVER met} as of the return
    (what was done by then), for the restore's report."""
    t0 = time.perf_counter()
    progress: dict[str, float] = {"files": 0, "bytes": 0}
    stop = threading.Event()

    def run() -> None:
        try:
            warm(hints, stop.is_set, progress)
        except Exception:  # noqa: BLE001 - a hint
            pass

    with _warming_lock:
        if _warming and _warming[0].is_alive():
            return {"files": 0, "bytes": 0, "timed_out": 0, "busy": 1, "seconds": time.perf_counter() - t0}
        t = threading.Thread(target=run, daemon=True, name="gpusnap-criu-files")
        _warming[:] = [t]
        t.start()
    t.join(deadline_s)
    if t.is_alive():
        stop.set()
    report = {**dict(progress), "timed_out": int(t.is_alive()), "busy": 0}
    report["seconds"] = time.perf_counter() - t0
    return report


def hints_on() -> bool:
    """$GPUSNAP_CRIU_FILE_HINTS: 1 (default) warms the mapped files before the fill's reads, 0 does not
    (for measuring)."""
    from storage.api import settings
    return bool(settings.switch("GPUSNAP_CRIU_FILE_HINTS", True, FileHintError))
