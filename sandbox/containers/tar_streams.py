"""A tar archive as pipeline streams: a Source reading each member in place, a Sink writing a tar.

Guarantees: TarSource accepts only regular files, directories and symbolic links whose names are
relative paths without '', '.' or '..' components, none under a link or file member (a hostile archive is refused whole, before anything
is stored); members are read by range straight from the archive (no extraction to disk). TarSink
writes a new tar next to DEST and links it into place only on commit (DEST never holds a partial
archive, an existing DEST is never replaced); headers are laid out as streams open, data is written
at its place by the pipeline's workers.
"""
from __future__ import annotations

import os
import tarfile
from contextlib import contextmanager
from typing import BinaryIO, Iterator

from storage.api import GpusnapError
from storage.api import RangeReader
from storage.api import Stream, check_tree
from storage.api import InvalidNameError, validate_stream_name
from storage.api import StreamSpec, StreamWriter

BLOCK = 512


class TarError(GpusnapError):
    """An archive gpusnap does not store (bad member name or type, not a tar) or cannot write."""


def _member_name(raw: str) -> str:
    name = raw[2:] if raw.startswith("./") else raw
    name = name.rstrip("/")
    try:
        return validate_stream_name(name)
    except InvalidNameError as e:
        raise TarError(f"archive member {raw!r}: {e}; refusing the archive") from None


class TarSource:
    """The members of the uncompressed tar open as FILE (read by range from its fd)."""

    def __init__(self, file: BinaryIO, where: str) -> None:
        self.fd = file.fileno()
        self.offsets: dict[str, int] = {}
        self.specs: list[StreamSpec] = []
        try:
            with tarfile.open(fileobj=file, mode="r:") as tar:
                members = tar.getmembers()
        except tarfile.TarError as e:
            raise TarError(f"{where}: not a tar archive ({e})") from None
        for m in members:
            name = _member_name(m.name)
            if name in self.offsets:
                raise TarError(f"{where}: member {name!r} appears twice; refusing the archive")
            attrs = {"mode": m.mode & 0o7777, "mtime_ns": int(m.mtime) * 10**9}
            if m.isreg() and not m.sparse:
                spec = StreamSpec(name, {"type": "file", **attrs}, m.size)
            elif m.isdir():
                spec = StreamSpec(name, {"type": "dir", **attrs}, 0)
            elif m.issym():
                spec = StreamSpec(name, {"type": "symlink", "target": m.linkname, **attrs}, 0)
            else:
                raise TarError(f"{where}: member {name!r} is not a regular file, directory or symlink; "
                               f"refusing the archive")
            self.offsets[name] = m.offset_data
            self.specs.append(spec)
        problems = check_tree([Stream(s.name, dict(s.attrs)) for s in self.specs])
        if problems:  # e.g. a member under a symlink member: a snapshot the store would call damaged
            raise TarError(f"{where}: {problems[0]}; refusing the archive")

    def streams(self) -> Iterator[StreamSpec]:
        return iter(self.specs)

    @contextmanager
    def open(self, spec: StreamSpec) -> Iterator[RangeReader]:
        yield RangeReader(self.fd, self.offsets[spec.name], spec.size or 0)

    @contextmanager
    def open_range(self, spec: StreamSpec, offset: int, length: int) -> Iterator[RangeReader]:
        yield RangeReader(self.fd, self.offsets[spec.name] + offset, length)

    @property
    def total_bytes(self) -> int:
        return sum(s.size or 0 for s in self.specs if s.has_data)


class _MemberWriter:
    def __init__(self, fd: int, base: int) -> None:
        self.fd, self.base = fd, base

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        offset += self.base
        while view:
            n = os.pwrite(self.fd, view, offset)
            view, offset = view[n:], offset + n

    def close(self) -> None:
        pass


class TarSink:
    """Streams written as the members of a new uncompressed tar at DEST (mode 0600); all or nothing."""

    def __init__(self, dest: str) -> None:
        self.dest = os.path.abspath(dest)
        if os.path.lexists(self.dest):
            raise TarError(f"{dest} already exists; give a new path for the archive")
        parent = os.path.dirname(self.dest)
        self.tmp = os.path.join(parent, f".{os.path.basename(self.dest)}.gpusnap-{os.getpid()}")
        try:
            self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise TarError(f"cannot write under {parent}: {e.strerror}") from None
        self.pos = 0

    def _header(self, spec: StreamSpec) -> bytes:
        ti = tarfile.TarInfo(spec.name)
        kind = spec.attrs.get("type")
        ti.mode = int(spec.attrs.get("mode", 0o644)) & 0o7777
        ti.mtime = int(spec.attrs.get("mtime_ns", 0)) // 10**9
        if kind == "dir":
            ti.type = tarfile.DIRTYPE
        elif kind == "symlink":
            ti.type, ti.linkname = tarfile.SYMTYPE, str(spec.attrs.get("target", ""))
        elif kind in ("file", "blob"):
            ti.size = spec.size or 0
        else:
            raise TarError(f"stream {spec.name!r} of type {kind!r} cannot go into a tar archive")
        return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def open(self, spec: StreamSpec) -> StreamWriter | None:
        header = self._header(spec)
        _MemberWriter(self.fd, self.pos).write_at(0, header)
        self.pos += len(header)
        if not spec.has_data:
            return None
        w = _MemberWriter(self.fd, self.pos)
        self.pos += -(-(spec.size or 0) // BLOCK) * BLOCK   # data padded to a block (holes read as zeros)
        os.ftruncate(self.fd, self.pos)
        return w

    def commit(self) -> None:
        os.ftruncate(self.fd, self.pos + 2 * BLOCK)          # two zero blocks end the archive
        os.fsync(self.fd)
        os.close(self.fd)
        try:
            os.link(self.tmp, self.dest)                     # never replaces an existing DEST
        except OSError as e:
            self.abort()
            raise TarError(f"{self.dest}: {e.strerror}") from None
        os.unlink(self.tmp)

    def abort(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass
