"""The chunk-reference log of an uncommitted writer: which chunks hold each region's data, before any manifest does.

A writer whose data exists nowhere else once it is written (GPU memory the driver released after a
custom-storage checkpoint) appends, as its chunks are stored, a line per chunk reference to
STORE/journal/OP.refs (storage/FORMAT.md, "The journal"). If its process dies before the commit,
`gpusnap recover` reads the log back and restores the regions whose list is complete; gc counts every
chunk the log names as in use while the operation's record (journal/OP.json) exists.

Guarantees kept here:
- a reference is written only after its chunk is durable: the writer's `durable` callback (the
  chunk directories fsynced) runs on each batch before its lines are written, and each batch is
  fsynced before the call that flushed it returns;
- lines are appended in the order given, each with its own CRC32, so that a kill at any point (a
  torn last line, a batch never flushed) leaves for each region either a complete list (its `end`
  line, every index 0..n-1, the sizes adding up) or a list the reader knows is incomplete, and says
  what is missing; a line that does not check is skipped and counted, never trusted;
- the reader opens nothing through a link and reads no more than MAX_LOG bytes.
"""
from __future__ import annotations

import json
import errno
import os
import stat
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from storage.fs.directio import read_to_end
from storage.base.errors import GpusnapError
from storage.format.manifest import ChunkRef, ManifestError, Stream
from storage.base.names import InvalidNameError, validate_stream_name

SUFFIX = ".refs"
MAX_LOG = 256 << 20      # a 1 TiB region in 4 MiB chunks is ~20 MiB of lines
BATCH = 32               # references per fsync (and at every region end)


class RefLogError(GpusnapError):
    """A chunk-reference log that cannot be written, or cannot be read at all."""


def _line(obj: dict[str, Any]) -> bytes:
    body = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def _parse(line: bytes) -> dict[str, Any] | None:
    crc, sep, body = line.partition(b" ")
    if not sep or len(crc) != 8:
        return None
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


class RefLogWriter:
    """Appends to DIR/OP.refs; thread-safe (engine lanes report chunks from many threads). A context
    manager: the file is closed (not removed) at the end; the journal removes it with its record."""

    def __init__(self, directory: str, op: str, durable: Callable[[list[ChunkRef]], None],
                 batch: int = BATCH) -> None:
        self.path = os.path.join(directory, op + SUFFIX)
        self.durable, self.batch = durable, batch
        self._lock = threading.Lock()
        self._lines: list[bytes] = []
        self._refs: list[ChunkRef] = []
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                               | os.O_CLOEXEC, 0o600)
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                os.close(self._fd)
                raise OSError(errno.EINVAL, "not a regular file (planted)")
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            raise RefLogError(f"cannot write the chunk-reference log {self.path}: {e.strerror or e}") from None

    def __enter__(self) -> "RefLogWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def region(self, stream: str, size: int, nchunks: int, chunk_size: int) -> None:
        """A region begins: its stream's name, size in bytes, number of chunks and chunk size."""
        self._add({"k": "region", "stream": stream, "size": size, "chunks": nchunks, "chunk_size": chunk_size})

    def chunk(self, stream: str, index: int, ref: ChunkRef) -> None:
        """Chunk INDEX of STREAM is REF (stored by the caller already; made durable before the line is written)."""
        self._add({"k": "chunk", "stream": stream, "i": index, "ref": ref.to_json()}, ref)

    def end(self, stream: str) -> None:
        """Every chunk of STREAM was reported: written, with everything before it, before this returns."""
        self._add({"k": "end", "stream": stream}, flush=True)

    def group(self, key: str, streams: list[str]) -> None:
        """KEY (e.g. a pid) is complete with STREAMS (each ended): durable before this returns."""
        self._add({"k": "group", "key": key, "streams": streams}, flush=True)

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def _add(self, obj: dict[str, Any], ref: ChunkRef | None = None, flush: bool = False) -> None:
        with self._lock:
            self._lines.append(_line(obj))
            if ref is not None and ref.id is not None:
                self._refs.append(ref)
            if flush or len(self._lines) >= self.batch:
                self._flush()

    def _flush(self) -> None:
        if not self._lines:
            return
        if self._refs:
            self.durable(self._refs)
        data = memoryview(b"".join(self._lines))
        try:
            while data:
                data = data[os.write(self._fd, data):]
            os.fsync(self._fd)
        except OSError as e:
            raise RefLogError(f"cannot write the chunk-reference log {self.path}: {e.strerror or e}") from None
        self._lines, self._refs = [], []


@dataclass
class RegionLog:
    """What the log says about one region (stream)."""

    stream: str
    size: int
    nchunks: int
    chunk_size: int
    chunks: dict[int, ChunkRef] = field(default_factory=dict)
    ended: bool = False

    def missing(self) -> list[int]:
        return [i for i in range(self.nchunks) if i not in self.chunks]

    def problem(self) -> str | None:
        """None if the list is complete, else what is missing."""
        if not self.ended or self.missing():
            return (f"{self.stream}: {len(self.chunks)} of {self.nchunks} chunks recorded "
                    f"({self.size} bytes), the stream did not finish")
        if sum(c.raw_len for c in self.chunks.values()) != self.size:
            return f"{self.stream}: chunk lengths do not add up to {self.size} bytes"
        return None

    def stream_of(self) -> Stream:
        return Stream(self.stream, {"type": "blob", "chunker": {"name": "fixed", "size": self.chunk_size}},
                      [self.chunks[i] for i in range(self.nchunks)])


@dataclass
class RefLog:
    """A log as read back: regions by stream name, completed groups, and lines that did not check."""

    regions: dict[str, RegionLog] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    bad_lines: int = 0
    ids: set[str] = field(default_factory=set)   # every chunk id any checked line names

    def group_problem(self, key: str, prefix: str) -> str | None:
        """None if group KEY finished and every region of it is complete; else what is missing (the
        regions begun whose names start with PREFIX, when the group never finished)."""
        streams = self.groups.get(key)
        if streams is None:
            begun = sorted(n for n in self.regions if n.startswith(prefix))
            if not begun:
                return "no region of it was recorded"
            return "its streaming did not finish: " + "; ".join(self.regions[n].problem() or f"{n}: complete"
                                                               for n in begun)
        found = [self.regions[s].problem() if s in self.regions else f"{s}: not in the log" for s in streams]
        probs = [p for p in found if p]
        return "; ".join(probs) if probs else None

    def streams(self, keys: Iterable[str]) -> list[Stream]:
        return [self.regions[s].stream_of() for k in keys for s in self.groups[k]]


def _add(log: RefLog, o: dict[str, Any]) -> bool:
    """Apply one checked line; False if it is not of a known shape."""
    try:
        k = o["k"]
        if k == "group":
            key, streams = o["key"], o["streams"]
            if not isinstance(key, str) or not isinstance(streams, list):
                return False
            log.groups[key] = tuple(validate_stream_name(s) for s in streams)
            return True
        s = validate_stream_name(o["stream"])
        if k == "region":
            size, n, cs = o["size"], o["chunks"], o["chunk_size"]
            if not all(isinstance(x, int) and x >= 0 for x in (size, n, cs)) or s in log.regions:
                return False
            log.regions[s] = RegionLog(s, size, n, cs)
        elif k == "chunk":
            ref, i = ChunkRef.from_json(o["ref"]), o["i"]
            if ref.id is not None:
                log.ids.add(ref.id)
            r = log.regions.get(s)
            if r is None or not isinstance(i, int) or not 0 <= i < r.nchunks:
                return False
            r.chunks[i] = ref
        elif k == "end":
            r = log.regions.get(s)
            if r is None:
                return False
            r.ended = True
        else:
            return False
    except (KeyError, TypeError, ManifestError, InvalidNameError):
        return False
    return True


def parse(data: bytes) -> RefLog:
    log = RefLog()
    for line in data.split(b"\n"):
        if not line:
            continue
        o = _parse(line)
        if o is None or not _add(log, o):
            log.bad_lines += 1
    return log


def read_at(dir_fd: int, name: str) -> RefLog:
    """The log NAME in directory DIR_FD (opened without following a link; regular files only;
    FileNotFoundError if it is not there)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise RefLogError(f"journal/{name}: cannot open it: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefLogError(f"journal/{name} is not a regular file")
        if st.st_size > MAX_LOG:
            raise RefLogError(f"journal/{name} is larger than {MAX_LOG} bytes")
        return parse(read_to_end(fd, MAX_LOG))
    finally:
        os.close(fd)


def read(directory: str, op: str) -> RefLog | None:
    """The log of operation OP in DIRECTORY, None if it has none."""
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return read_at(dfd, op + SUFFIX)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def pinned(journal_fd: int) -> set[str]:
    """Every chunk id named by a log whose operation record (OP.json) still exists in the journal
    directory JOURNAL_FD: chunks gc must keep. A log that cannot be read raises RefLogError (the
    caller must then delete nothing)."""
    names = set(os.listdir(journal_fd))
    out: set[str] = set()
    for n in sorted(names):
        if n.endswith(SUFFIX) and n[: -len(SUFFIX)] + ".json" in names:
            try:
                out |= read_at(journal_fd, n).ids
            except FileNotFoundError:
                continue  # removed meanwhile: its record went first, so it names nothing to keep
    return out
