"""Files and directories as pipeline streams: the source that `store put` reads, the sink `get` writes.

Guarantees kept here:
- Below the paths a user names, nothing is reached through a path string: both sides walk with
  directory file descriptors (openat/mkdirat with O_NOFOLLOW and O_DIRECTORY), so neither a symlink
  in a tree being stored nor one a manifest defines can make gpusnap read or write outside that tree.
- Put reads what it scanned: every directory and file opened for reading is compared (device, inode,
  type) with the scan; a changed entry is an error naming it, never a silent swap. Files are opened
  O_NONBLOCK and checked with fstat, so a FIFO, socket or device swapped in is refused, never read.
- Get is all or nothing and durable: it materializes into a hidden sibling of DEST, fsyncs every file
  and directory, and renames it into place only on commit. Owners are restored when asked for (by
  default as root, as tar and borg do); whatever's owner is not restored loses setuid/setgid.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from storage.fs.directio import ALIGN, address_of, read_into
from storage.fs.getmark import remove_marker, write_marker
from storage.fs.treewalk import remove_tree
from storage.base.names import InvalidNameError, validate_stream_name
from storage.pipeline.put import PipelineError, StreamSpec, StreamWriter
from storage.archive.files_cache import stat_key
from storage.fs.xattrs import acls_for, read_xattrs, restore_xattrs


from storage.base.errors import GpusnapError

PAUSE_ENV = "GPUSNAP_TEST_PAUSE_AFTER_SCAN"  # test hook, see pause_after_scan
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID

class FileTreeError(GpusnapError):
    """An input path that cannot be stored, or a destination that cannot be written."""


DIRECT_MIN = 64 << 20  # files at least this large are read past the page cache when they are not in it
_CACHESTAT = 451       # cachestat(2) (Linux 6.5+), the same number on x86_64 and arm64


class _CacheStat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


def _not_cached(fd: int, size: int) -> bool:
    """Whether at most an eighth of FD's file (SIZE bytes) is in the page cache and none of it dirty,
    as cachestat(2) counts it: a question with no side effect (a probing read would start the
    kernel's read-ahead and change the answer for the next put). False where the kernel cannot say
    (before 6.5, or a seccomp filter refusing it): buffered reads, as always."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rng = (ctypes.c_uint64 * 2)(0, 0)  # from 0 to the end of the file
        st = _CacheStat()
        if libc.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(st), 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return st.nr_dirty == 0 and st.nr_writeback == 0 and st.nr_cache * 4096 * 8 <= size


class _FdReader:
    """Sequential reads of an open file. A file of at least DIRECT_MIN bytes that is not in the page
    cache is read with O_DIRECT (set on the descriptor) while the reads are aligned: it is read once,
    and a cold read through the cache cost a 2-core VM 0.2-0.7 CPU-seconds per 1.5 GB that the
    encoders then lack, against 0.04 direct at the same disk speed (BENCHMARKS.md, section 27).

    Every direct read is asked with RWF_NOWAIT: a direct read takes the inode's lock, which a tenant
    can hold for as long as it likes with a write into its own file from memory that never faults in
    (userfaultfd, a FUSE mapping), and it first writes back any dirty page of the range at the
    tenant's I/O rate; with RWF_NOWAIT either is EAGAIN at once, and the reader goes on buffered (as
    before this reader had a direct mode), as it does at the first read that is not aligned, a
    short read (the end of the file, or a file system that reads less: the rest is read buffered, to
    the real end) or a refusal."""

    def __init__(self, fd: int, size: int | None = None) -> None:
        self.fd = fd
        self.offset = 0
        self.at_end = False  # a read came back short: the file's end as the reads met it
        self.direct = False
        if (size is not None and size >= DIRECT_MIN and hasattr(os, "O_DIRECT") and hasattr(os, "RWF_NOWAIT")
                and _not_cached(fd, size)):
            self.direct = self._set_direct(True)

    def _set_direct(self, on: bool) -> bool:
        try:
            flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
            fcntl.fcntl(self.fd, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
        except OSError:  # a file system without direct I/O: buffered reads, as always
            return False
        return on

    def readinto(self, view: memoryview) -> int:
        if self.direct and (self.offset % ALIGN or len(view) % ALIGN or address_of(view) % ALIGN):
            self.direct = self._set_direct(False)
        done = 0
        while self.direct and done < len(view):
            try:
                n = os.preadv(self.fd, [view[done:]], self.offset + done, os.RWF_NOWAIT)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                n = -1  # would wait on a lock or a write-back, or refused: the rest buffered
            if n == 0:
                break  # the end of the file, on a block boundary
            if n > 0:
                done += n
            if n < 0 or n % ALIGN:
                self.direct = self._set_direct(False)
        if done < len(view) and not self.direct:
            done += read_into(self.fd, view[done:], self.offset + done)
        self.offset += done
        self.at_end = self.at_end or done < len(view)
        return done


@contextmanager
def read_fd(path: str, error: type[Exception] = PipelineError) -> Iterator[int]:
    """PATH opened read-only (no symlink followed) for the block; ERROR with the reason if it cannot be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO swapped in never blocks
    except OSError as e:
        raise error(f"{path}: {e.strerror or errno.errorcode.get(e.errno or 0, e)}") from None
    try:
        yield fd
    finally:
        os.close(fd)


class RangeReader:
    """Reads [offset, offset + length) of an open file; short only at the range's end."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        self.fd, self.offset, self.end = fd, offset, offset + length

    def readinto(self, view: memoryview) -> int:
        want = min(len(view), self.end - self.offset)
        got = 0
        while got < want:
            n = os.preadv(self.fd, [view[got:want]], self.offset)
            if n <= 0:
                raise PipelineError(f"file shrank while being read (at byte {self.offset})")
            got += n
            self.offset += n
        return got


@dataclass(frozen=True)
class _Seen:
    """What the scan saw at a path: a later open must find the same object there."""
    dev: int
    ino: int
    fmt: int

    @classmethod
    def of(cls, st: os.stat_result) -> "_Seen":
        return cls(st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode))


_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "directory", stat.S_IFLNK: "symlink", stat.S_IFIFO: "FIFO",
          stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device", stat.S_IFBLK: "block device"}


def _reason(e: OSError) -> str:
    return e.strerror or errno.errorcode.get(e.errno or 0, str(e))


def pause_after_scan() -> None:
    """Test hook: with $GPUSNAP_TEST_PAUSE_AFTER_SCAN=DIR, a put creates DIR/scanned once its scan is
    done and waits (up to 120 s) until DIR/go exists, so that a test can change the tree between the
    scan and the reads at an exact point, not by timing luck. Does nothing when the variable is unset."""
    d = os.environ.get(PAUSE_ENV)
    if not d:
        return
    with open(os.path.join(d, "scanned"), "w"):
        pass
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(d, "go")):
        if time.monotonic() > deadline:
            raise FileTreeError(f"{PAUSE_ENV}: no {d}/go within 120 s")
        time.sleep(0.01)


class FileTreeSource:
    """Streams for PATHS: each path stored under its base name, directories recursively.

    Regular files, directories and symbolic links are stored (mode, mtime, uid and gid kept; a file
    seen again through another hard link is stored as a `hardlink` to the first name); anything else
    FIFOs are stored as entries (as tar, restic and borg do: never opened, never read); sockets are
    skipped and listed in `skipped` (nothing can be restored from one); devices are refused up front,
    as is an unreadable or missing path. EXCLUDE: glob patterns (fnmatch, `*` matches `/` too); a
    pattern without `/` matches an entry's base name anywhere, one with `/` its whole stream path
    (top directory first: `data/cache/*`); an excluded directory is left out with all below it.
    Extended attributes (user.*, security.*/trusted.* where this user can read them, and POSIX
    ACLs) are kept in `xattrs` (storage/fs/xattrs.py), unless not XATTRS. The directory
    holding each named path is opened once and kept open (close() or the context manager releases it):
    every later access goes down from it by directory fds, and must find what the scan found.
    """

    def __init__(self, paths: list[str], exclude: tuple[str, ...] | list[str] = (), xattrs: bool = True) -> None:
        self.roots: list[tuple[str, str]] = []
        self.exclude = [p.strip("/") if "/" in p.strip("/") else p for p in exclude]
        self.skipped: list[str] = []            # what was not stored, and why (sockets)
        self.excluded = 0
        self.xattrs = xattrs
        self.keys: dict[str, tuple[str, Any]] = {}  # file stream name -> (its absolute path, files_cache.Key)
        self.scanned_ns = time.time_ns()
        self._anchors: dict[str, int] = {}      # base name -> fd of the directory holding it
        self._seen: dict[str, _Seen] = {}       # stream name -> what the scan found there
        self._links: dict[tuple[int, int], str] = {}  # (dev, ino) of multiply linked files -> first name
        try:
            for p in paths:
                base = os.path.basename(os.path.normpath(os.path.abspath(p)))
                if base in ("", "/"):
                    raise FileTreeError(f"{p}: cannot store the root directory itself; name a directory under it")
                if base in self._anchors:
                    raise FileTreeError(f"two inputs are named {base!r}; they would overwrite each other")
                path = os.path.abspath(p)
                try:
                    self._anchors[base] = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                    os.stat(base, dir_fd=self._anchors[base], follow_symlinks=False)
                except OSError as e:
                    raise FileTreeError(f"{p}: {_reason(e).lower()}") from None
                self.roots.append((path, base))
            self.specs = list(self._scan())
        except BaseException:
            self.close()
            raise
        pause_after_scan()

    def close(self) -> None:
        for fd in self._anchors.values():
            os.close(fd)
        self._anchors.clear()

    def __enter__(self) -> "FileTreeSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_anchors", None):
            self.close()

    def _display(self, name: str) -> str:
        base, _, rest = name.partition("/")
        root = next(p for p, b in self.roots if b == base)
        return os.path.join(root, rest) if rest else root

    def _excluded(self, name: str) -> bool:
        import fnmatch
        base = name.rsplit("/", 1)[-1]
        return any(fnmatch.fnmatchcase(name if "/" in p else base, p) for p in self.exclude)

    def _spec(self, dfd: int, entry: str, name: str, st: os.stat_result) -> StreamSpec | None:
        attrs: dict[str, Any] = {"mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns,
                                 "uid": st.st_uid, "gid": st.st_gid}
        if self.xattrs and not (stat.S_ISREG(st.st_mode) and st.st_nlink > 1
                                and (st.st_dev, st.st_ino) in self._links):
            try:
                xa = read_xattrs(dfd, entry, acls_for(st.st_mode))
            except OSError as e:
                raise FileTreeError(f"{self._display(name)}: reading extended attributes: {_reason(e)}") from None
            if xa:
                attrs["xattrs"] = xa
        if stat.S_ISREG(st.st_mode):
            if not os.access(entry, os.R_OK, dir_fd=dfd):
                raise FileTreeError(f"{self._display(name)}: permission denied")
            if st.st_nlink > 1:
                first = self._links.setdefault((st.st_dev, st.st_ino), name)
                if first != name:
                    return StreamSpec(name, {"type": "hardlink", "target": first}, 0)
            self.keys[name] = (self._display(name), stat_key(st))
            return StreamSpec(name, {"type": "file", **attrs}, st.st_size)
        if stat.S_ISDIR(st.st_mode):
            if not os.access(entry, os.R_OK | os.X_OK, dir_fd=dfd):
                raise FileTreeError(f"{self._display(name)}: permission denied")
            return StreamSpec(name, {"type": "dir", **attrs}, 0)
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(entry, dir_fd=dfd)
            except OSError as e:  # swapped for something else since the stat: EINVAL (not a link), ENOENT
                if e.errno in (errno.EINVAL, errno.ENOENT):
                    raise self._changed(name, "no longer a symlink") from None
                raise FileTreeError(f"{self._display(name)}: {_reason(e)}") from None
            return StreamSpec(name, {"type": "symlink", "target": target, **attrs}, 0)
        if stat.S_ISFIFO(st.st_mode):
            return StreamSpec(name, {"type": "fifo", **attrs}, 0)
        if stat.S_ISSOCK(st.st_mode):
            self.skipped.append(f"{self._display(name)}: a socket (nothing to store; as tar, it is skipped)")
            return None
        raise FileTreeError(f"{self._display(name)}: a {_KINDS.get(stat.S_IFMT(st.st_mode), 'special file')}, not a "
                            "regular file, directory, symlink or FIFO; gpusnap does not store it (leave it out with --exclude)")

    def _scan(self) -> Iterator[StreamSpec]:
        """Every entry under the roots, depth first in name order, by an explicit stack (no recursion:
        no depth of tree can exhaust Python's stack; names.STREAM_DEPTH_MAX bounds it anyway)."""
        for _, base in self.roots:
            spec, fd = self._entry(self._anchors[base], base, base)
            if spec is not None:
                yield spec
            if spec is None or fd is None:
                continue
            stack: list[tuple[int, str, Iterator[str]]] = []
            try:
                stack.append((fd, base, iter(self._children(fd, base))))
                while stack:
                    dfd, dname, children = stack[-1]
                    child = next(children, None)
                    if child is None:
                        stack.pop()
                        os.close(dfd)
                        continue
                    spec, cfd = self._entry(dfd, child, f"{dname}/{child}")
                    if spec is None:
                        continue
                    yield spec
                    if cfd is not None:
                        try:
                            stack.append((cfd, spec.name, iter(self._children(cfd, spec.name))))
                        except BaseException:
                            os.close(cfd)
                            raise
            finally:
                for dfd, _, _ in stack:
                    os.close(dfd)

    def _children(self, fd: int, name: str) -> list[str]:
        try:
            return sorted(os.listdir(fd))
        except OSError as e:
            raise FileTreeError(f"{self._display(name)}: {_reason(e)}") from None

    def _entry(self, dfd: int, entry: str, name: str) -> tuple[StreamSpec | None, int | None]:
        """The spec of ENTRY of DFD, stored as NAME (None: excluded, or a socket skipped), and (for a
        directory) an fd of it, checked."""
        if self.exclude and self._excluded(name):
            self.excluded += 1
            return None, None
        try:
            validate_stream_name(name)
        except InvalidNameError as e:
            raise FileTreeError(f"{self._display(name)[:200]}: {e}; gpusnap does not store it") from None
        try:
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=False)
        except OSError as e:
            raise FileTreeError(f"{self._display(name)}: {_reason(e)}") from None
        spec = self._spec(dfd, entry, name, st)
        if spec is None:
            return None, None
        self._seen[name] = _Seen.of(st)
        if spec.attrs["type"] != "dir":
            return spec, None
        return spec, self._open_dir(dfd, entry, name)

    def _changed(self, name: str, how: str) -> FileTreeError:
        return FileTreeError(f"{self._display(name)} changed while it was being stored ({how}); nothing was "
                             "stored: store it again when nothing modifies it")

    def _same(self, st: os.stat_result, name: str) -> None:
        """ST must be of the object the scan saw at NAME (same device, inode and type), else raise."""
        now, then = _Seen.of(st), self._seen[name]
        if now != then:
            how = (f"was a {_KINDS.get(then.fmt, 'special file')}, now a {_KINDS.get(now.fmt, 'special file')}"
                   if now.fmt != then.fmt else "replaced by another file")
            raise self._changed(name, how)

    def _check(self, fd: int, name: str) -> None:
        """FD must be what the scan saw at NAME; else it is closed and the error raised."""
        try:
            self._same(os.fstat(fd), name)
        except BaseException:
            os.close(fd)
            raise

    def _open_dir(self, dfd: int, entry: str, name: str) -> int:
        try:
            fd = os.open(entry, _DIR_FLAGS, dir_fd=dfd)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                raise self._changed(name, "no longer a directory") from None
            raise FileTreeError(f"{self._display(name)}: {_reason(e)}") from None
        self._check(fd, name)
        return fd

    def _open_file(self, spec: StreamSpec) -> int:
        """The file of SPEC, reached from its anchor by directory fds, checked against the scan."""
        parts = spec.name.split("/")
        dfd, held = self._anchors[parts[0]], []
        try:
            for i in range(len(parts) - 1):
                dfd = self._open_dir(dfd, parts[i], "/".join(parts[:i + 1]))
                held.append(dfd)
            try:  # checked before the open too: opening a device can act on it
                self._same(os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False), spec.name)
                fd = os.open(parts[-1], _READ_FLAGS, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ENOENT:
                    raise self._changed(spec.name, "removed") from None
                if e.errno in (errno.ELOOP, errno.ENXIO):
                    raise self._changed(spec.name, "no longer a regular file") from None
                raise PipelineError(f"{self._display(spec.name)}: {_reason(e)}") from None
            self._check(fd, spec.name)
            return fd
        finally:
            for d in held:
                os.close(d)

    @contextmanager
    def _opened(self, spec: StreamSpec) -> Iterator[int]:
        fd = self._open_file(spec)
        try:
            yield fd
        finally:
            os.close(fd)

    def streams(self) -> Iterator[StreamSpec]:
        return iter(self.specs)

    @contextmanager
    def open(self, spec: StreamSpec) -> Iterator[_FdReader]:
        with self._opened(spec) as fd:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            reader = _FdReader(fd, spec.size)
            yield reader
            # read to its end (the pipeline reads on until a short read, unless the put failed elsewhere
            # and stopped): as long as the scan saw it, else it grew or shrank while it was read, and
            # what was read is not a file that existed
            if reader.at_end and spec.size is not None:
                now = os.fstat(fd).st_size
                if not reader.offset == now == spec.size:
                    raise self._changed(spec.name, f"{spec.size} bytes when scanned, {reader.offset} read, {now} now")

    @contextmanager
    def open_range(self, spec: StreamSpec, offset: int, length: int) -> Iterator[RangeReader]:
        """A reader of LENGTH bytes of SPEC's file from OFFSET (one of several reading it at once)."""
        with self._opened(spec) as fd:
            yield RangeReader(fd, offset, length)

    @property
    def total_bytes(self) -> int:
        return sum(s.size or 0 for s in self.specs if s.has_data)


class _FileWriter:
    """A file being restored: written at offsets by workers; on close its owner, mode and times are
    set through its fd (after the last write, so nothing clears the special bits) and it is fsynced."""

    def __init__(self, fd: int, settle: Any) -> None:
        self.fd = fd
        self._settle = settle

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view = view[n:]
            offset += n

    def close(self) -> None:
        try:
            self._settle(self.fd)
            os.fsync(self.fd)
        finally:
            os.close(self.fd)


class FileTreeSink:
    """Writes streams as files under DEST, which must not exist; all or nothing, fsynced before the
    final rename. same_owner: restore recorded owners (default: when running as root)."""

    def __init__(self, dest: str, *, same_owner: bool | None = None, marker: str | None = None) -> None:
        self.dest = os.path.abspath(dest)
        self._marker = marker
        self.same_owner = os.geteuid() == 0 if same_owner is None else same_owner
        parent, base = os.path.split(self.dest)
        try:
            self._parent = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            raise FileTreeError(f"{parent}: no such directory") from None
        try:
            os.stat(base, dir_fd=self._parent, follow_symlinks=False)
            os.close(self._parent)
            raise FileTreeError(f"{dest} already exists; give a new path to materialize into")
        except FileNotFoundError:
            pass
        self._tmp = f".{base}.gpusnap-{os.getpid()}"
        self.tmp = os.path.join(parent, self._tmp)
        try:
            os.mkdir(self._tmp, 0o700, dir_fd=self._parent)
            self._root = os.open(self._tmp, _DIR_FLAGS, dir_fd=self._parent)
            if marker is not None:
                write_marker(self._root, marker)
        except OSError as e:
            os.close(self._parent)
            raise FileTreeError(f"cannot write under {parent}: {_reason(e)}") from None
        self._chain: list[tuple[str, int]] = []   # open fds of the directories down to the last parent used
        self._dirs: dict[tuple[str, ...], dict[str, Any] | None] = {}  # made here, in order; attrs once known

    # ---- directories, reached only through fds -------------------------------------------------
    def _step(self, dfd: int, comp: str, stream: str, create: bool) -> int:
        try:
            return os.open(comp, _DIR_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            if not create:
                raise FileTreeError(f"{stream}: {comp!r} vanished from the tree being restored") from None
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise FileTreeError(f"{stream}: {comp!r} is a link or not a directory in the restored tree; "
                                    "refusing to write through it (damaged manifest)") from None
            raise
        os.mkdir(comp, 0o700, dir_fd=dfd)
        return self._step(dfd, comp, stream, create=False)

    def _dir(self, parts: list[str], stream: str) -> int:
        """The fd of directory PARTS under the tree's root, made (0700) where missing; borrowed from
        the chain of open directory fds, valid until the next call."""
        keep = 0
        while keep < min(len(parts), len(self._chain)) and self._chain[keep][0] == parts[keep]:
            keep += 1
        for _, fd in self._chain[keep:]:
            os.close(fd)
        del self._chain[keep:]
        for i in range(keep, len(parts)):
            dfd = self._chain[-1][1] if self._chain else self._root
            self._chain.append((parts[i], self._step(dfd, parts[i], stream, create=True)))
            self._dirs.setdefault(tuple(parts[:i + 1]), None)
        return self._chain[-1][1] if self._chain else self._root

    def _open_dir(self, parts: tuple[str, ...] | list[str]) -> int:
        """An fd of its own for directory PARTS (already made), walked down from the root."""
        fd = os.dup(self._root)
        for comp in parts:
            try:
                nxt = self._step(fd, comp, "/".join(parts), create=False)
            finally:
                os.close(fd)
            fd = nxt
        return fd

    # ---- owners and modes ----------------------------------------------------------------------
    def _xattrs_allowed(self) -> bool:
        """security.* and trusted.* are restored only where owners are (as root); user.* always."""
        return self.same_owner and os.geteuid() == 0

    def _settle(self, attrs: dict[str, Any], default_mode: int) -> Any:
        """A function of an fd that gives it ATTRS' owner (when restored), mode and mtime. The special
        bits survive only where the owner is restored (or is the restoring user already)."""
        uid, gid = attrs.get("uid"), attrs.get("gid")
        chown = self.same_owner and uid is not None and gid is not None
        mine = uid == os.geteuid() and gid == os.getegid()
        mode = attrs.get("mode", default_mode)
        if not (chown or mine):
            mode &= ~_SPECIAL_BITS
        ns = attrs.get("mtime_ns")

        xa = attrs.get("xattrs")
        privileged = self._xattrs_allowed()

        def settle(fd: int) -> None:
            if chown and uid is not None and gid is not None:
                os.fchown(fd, uid, gid)  # first: chown clears setuid/setgid
            if xa:
                restore_xattrs(fd, xa, privileged)
            os.fchmod(fd, mode)
            if ns is not None:
                os.utime(fd, ns=(ns, ns))
        return settle

    def _settle_path(self, path: str, attrs: dict[str, Any], default_mode: int) -> None:
        """_settle for an entry that cannot be opened for I/O (a FIFO): PATH is /proc/self/fd/N of
        an O_PATH fd of it, so every call acts on that very inode."""
        uid, gid = attrs.get("uid"), attrs.get("gid")
        chown = self.same_owner and uid is not None and gid is not None
        mine = uid == os.geteuid() and gid == os.getegid()
        mode = attrs.get("mode", default_mode)
        if not (chown or mine):
            mode &= ~_SPECIAL_BITS
        if chown and uid is not None and gid is not None:
            os.chown(path, uid, gid)
        if attrs.get("xattrs"):
            restore_xattrs(path, attrs["xattrs"], self._xattrs_allowed())
        os.chmod(path, mode)
        if attrs.get("mtime_ns") is not None:
            os.utime(path, ns=(attrs["mtime_ns"],) * 2)

    # ---- the Sink protocol ---------------------------------------------------------------------
    def open(self, spec: StreamSpec) -> StreamWriter | None:
        parts = validate_stream_name(spec.name).split("/")
        kind = spec.attrs.get("type")
        pfd = self._dir(parts[:-1], spec.name)
        leaf = parts[-1]
        if kind == "dir":
            try:
                os.mkdir(leaf, 0o700, dir_fd=pfd)
            except FileExistsError:
                pass  # made as the parent of an earlier stream; _dir checks it is a real directory
            self._dir(parts, spec.name)
            self._dirs[tuple(parts)] = spec.attrs
            return None
        if kind == "fifo":
            os.mkfifo(leaf, 0o600, dir_fd=pfd)  # in this get's private 0700 tree: nobody else can swap it
            fd = os.open(leaf, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                self._settle_path(f"/proc/self/fd/{fd}", spec.attrs, 0o644)
            finally:
                os.close(fd)
            return None
        if kind == "symlink":
            os.symlink(spec.attrs["target"], leaf, dir_fd=pfd)
            a = spec.attrs
            if self.same_owner and a.get("uid") is not None and a.get("gid") is not None:
                os.chown(leaf, a["uid"], a["gid"], dir_fd=pfd, follow_symlinks=False)
            if a.get("xattrs") and self._xattrs_allowed():  # user.* cannot be set on a link
                fd = os.open(leaf, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                try:
                    restore_xattrs(f"/proc/self/fd/{fd}", a["xattrs"], True, user=False)
                finally:
                    os.close(fd)
            if a.get("mtime_ns") is not None:
                os.utime(leaf, ns=(a["mtime_ns"],) * 2, dir_fd=pfd, follow_symlinks=False)
            return None
        if kind == "hardlink":
            target = validate_stream_name(spec.attrs["target"]).split("/")
            tfd = self._open_dir(target[:-1])
            try:
                os.link(target[-1], leaf, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
            finally:
                os.close(tfd)
            return None
        if kind not in ("file", "blob"):
            raise FileTreeError(f"{spec.name}: unknown stream type {kind!r}")
        fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
        try:
            os.ftruncate(fd, spec.size or 0)
        except BaseException:
            os.close(fd)
            raise
        return _FileWriter(fd, self._settle(spec.attrs, 0o644))

    def _close_fds(self) -> None:
        for _, fd in self._chain:
            os.close(fd)
        self._chain.clear()
        for fd in (self._root, self._parent):
            if fd >= 0:
                os.close(fd)
        self._root = self._parent = -1

    def commit(self) -> None:
        """Directories get their attributes children first (so their mtimes stick), every directory
        is fsynced (the files were at close), then the tree is renamed to DEST and DEST's directory
        fsynced: after a crash DEST is either absent or complete."""
        for _, fd in self._chain:
            os.close(fd)
        self._chain.clear()
        for parts, attrs in reversed(list(self._dirs.items())):
            fd = self._open_dir(parts)
            try:
                if attrs is not None:
                    self._settle(attrs, 0o755)(fd)
                os.fsync(fd)
            finally:
                os.close(fd)
        if self._marker is not None:
            remove_marker(self._root, self._marker)
        os.fsync(self._root)
        os.rename(self._tmp, os.path.basename(self.dest), src_dir_fd=self._parent, dst_dir_fd=self._parent)
        os.fsync(self._parent)
        self._close_fds()

    def abort(self) -> None:
        if self._parent < 0:
            return
        try:
            remove_tree(self._parent, self._tmp, self.tmp)
        except (OSError, GpusnapError):
            pass  # left for gc (the get's record names it)
        finally:
            self._close_fds()
