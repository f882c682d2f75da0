"""Files and directories as pipeline streams: the source that `store put` reads, the sink `get` writes.

The sink materializes into a hidden sibling of DEST and renames it into place only on commit, so DEST
never holds a partial result.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from contextlib import contextmanager
from typing import Iterator

from .directio import read_into
from .pipeline import PipelineError, StreamSpec, StreamWriter


from .errors import GpusnapError

class FileTreeError(GpusnapError):
    """An input path that cannot be stored, or a destination that cannot be written."""


class _FdReader:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.offset = 0

    def readinto(self, view: memoryview) -> int:
        n = read_into(self.fd, view, self.offset)
        self.offset += n
        return n


@contextmanager
def read_fd(path: str, error: type[Exception] = PipelineError) -> Iterator[int]:
    """PATH opened read-only (no symlink followed) for the block; ERROR with the reason if it cannot be."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
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


class FileTreeSource:
    """Streams for PATHS: each path stored under its base name, directories recursively.

    Regular files, directories and symbolic links are stored (mode and mtime kept); anything else
    (sockets, fifos, devices) is refused up front, as is an unreadable or missing path.
    """

    def __init__(self, paths: list[str]) -> None:
        self.roots: list[tuple[str, str]] = []
        seen: set[str] = set()
        for p in paths:
            try:
                os.lstat(p)
            except OSError as e:
                raise FileTreeError(f"{p}: {e.strerror.lower()}") from None
            base = os.path.basename(os.path.normpath(os.path.abspath(p)))
            if base in ("", "/"):
                raise FileTreeError(f"{p}: cannot store the root directory itself; name a directory under it")
            if base in seen:
                raise FileTreeError(f"two inputs are named {base!r}; they would overwrite each other")
            seen.add(base)
            self.roots.append((os.path.abspath(p), base))
        self.specs = list(self._scan())

    def _spec(self, path: str, name: str) -> StreamSpec:
        try:
            st = os.lstat(path)
        except OSError as e:
            raise FileTreeError(f"{path}: {e.strerror}") from None
        attrs = {"mode": stat.S_IMODE(st.st_mode), "mtime_ns": st.st_mtime_ns}
        if stat.S_ISREG(st.st_mode):
            if not os.access(path, os.R_OK):
                raise FileTreeError(f"{path}: permission denied")
            return StreamSpec(name, {"type": "file", **attrs}, st.st_size)
        if stat.S_ISDIR(st.st_mode):
            if not os.access(path, os.R_OK | os.X_OK):
                raise FileTreeError(f"{path}: permission denied")
            return StreamSpec(name, {"type": "dir", **attrs}, 0)
        if stat.S_ISLNK(st.st_mode):
            return StreamSpec(name, {"type": "symlink", "target": os.readlink(path), **attrs}, 0)
        raise FileTreeError(f"{path}: not a regular file, directory or symlink; gpusnap does not store it")

    def _scan(self) -> Iterator[StreamSpec]:
        for path, base in self.roots:
            top = self._spec(path, base)
            yield top
            if top.attrs["type"] != "dir":
                continue
            for dirpath, dirnames, filenames in os.walk(path, onerror=_raise):
                dirnames.sort()
                rel = os.path.relpath(dirpath, path)
                prefix = base if rel == "." else f"{base}/{rel}"
                for n in sorted(dirnames + filenames):
                    yield self._spec(os.path.join(dirpath, n), f"{prefix}/{n}")
                # symlinks to directories appear in dirnames but os.walk does not follow them
                dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]

    def streams(self) -> Iterator[StreamSpec]:
        return iter(self.specs)

    def _path(self, spec: StreamSpec) -> str:
        base, _, rest = spec.name.partition("/")
        root = next(p for p, b in self.roots if b == base)
        return os.path.join(root, rest) if rest else root

    @contextmanager
    def open(self, spec: StreamSpec) -> Iterator[_FdReader]:
        with read_fd(self._path(spec)) as fd:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            yield _FdReader(fd)

    @contextmanager
    def open_range(self, spec: StreamSpec, offset: int, length: int) -> Iterator[RangeReader]:
        """A reader of LENGTH bytes of SPEC's file from OFFSET (one of several reading it at once)."""
        with read_fd(self._path(spec)) as fd:
            yield RangeReader(fd, offset, length)

    @property
    def total_bytes(self) -> int:
        return sum(s.size or 0 for s in self.specs if s.has_data)


def _raise(e: OSError) -> None:
    raise FileTreeError(f"{e.filename}: {e.strerror}")


class _FileWriter:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, offset)
            view = view[n:]
            offset += n

    def close(self) -> None:
        os.close(self.fd)


class FileTreeSink:
    """Writes streams as files under DEST, which must not exist; all or nothing."""

    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(dest)
        if os.path.lexists(self.dest):
            raise FileTreeError(f"{dest} already exists; give a new path to materialize into")
        parent = os.path.dirname(self.dest)
        if not os.path.isdir(parent):
            raise FileTreeError(f"{parent}: no such directory")
        self.tmp = os.path.join(parent, f".{os.path.basename(self.dest)}.gpusnap-{os.getpid()}")
        try:
            os.mkdir(self.tmp, 0o700)
        except OSError as e:
            raise FileTreeError(f"cannot write under {parent}: {e.strerror}") from None
        self._dirs: list[tuple[str, dict]] = []
        self._times: list[tuple[str, int]] = []

    def _path(self, name: str) -> str:
        return os.path.join(self.tmp, *name.split("/"))

    def open(self, spec: StreamSpec) -> StreamWriter | None:
        path = self._path(spec.name)
        kind = spec.attrs.get("type")
        if kind == "dir":
            os.makedirs(path, 0o700, exist_ok=True)
            self._dirs.append((path, spec.attrs))
            return None
        os.makedirs(os.path.dirname(path), 0o700, exist_ok=True)
        if kind == "symlink":
            os.symlink(spec.attrs["target"], path)
            return None
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, spec.size or 0)
        os.fchmod(fd, spec.attrs.get("mode", 0o644))
        self._times.append((path, spec.attrs.get("mtime_ns", 0)))
        return _FileWriter(fd)

    def commit(self) -> None:
        for path, ns in self._times:
            os.utime(path, ns=(ns, ns))
        for path, attrs in reversed(self._dirs):  # children before parents: mtimes stick
            os.chmod(path, attrs.get("mode", 0o755))
            os.utime(path, ns=(attrs.get("mtime_ns", 0),) * 2)
        os.rename(self.tmp, self.dest)

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
