"""The snapshot store: a directory of content-addressed chunks and atomically committed manifests.

Guarantees kept here (FORMAT.md has the full contract):
- a snapshot becomes visible only after every chunk it names is durable, by link/rename of a fsynced
  manifest; a failed or killed writer leaves no visible snapshot;
- every chunk read is verified against its id before its bytes are returned;
- writers and readers hold the store lock shared, gc holds it exclusively, so gc never deletes a chunk
  that a live snapshot or a commit in progress needs; one writer per name at a time.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Iterator

from .chunkfile import HEADER_SIZE, ChunkError, ChunkHeader, chunk_id, read_chunk_file, write_chunk_file
from .directio import AlignedBuffer, BufferPool, align_up, direct_io_supported, fsync_dir
from .manifest import ChunkRef, Manifest, ManifestError, Stream
from .names import validate_snapshot_name

from .errors import GpusnapError

STORE_FORMAT = "gpusnap-store"
STORE_VERSION = 1


class StoreError(GpusnapError):
    """A store operation that cannot be done; the message says what to do about it."""


def default_store_path() -> str:
    """--store default: $GPUSNAP_STORE, else /var/lib/gpusnap as root, else $XDG_DATA_HOME/gpusnap."""
    env = os.environ.get("GPUSNAP_STORE")
    if env:
        return env
    if os.geteuid() == 0:
        return "/var/lib/gpusnap"
    xdg = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(xdg, "gpusnap")


@dataclass
class WriteStats:
    chunks_new: int = 0
    chunks_dedup: int = 0
    chunks_zero: int = 0
    bytes_new: int = 0      # stored bytes of chunk files this writer created
    bytes_dedup: int = 0    # stored bytes found already present
    raw_bytes: int = 0      # logical bytes, zeros included
    zero_bytes: int = 0
    hash_s: float = 0.0     # thread-seconds hashing chunk payloads
    write_s: float = 0.0    # thread-seconds writing + fsyncing chunk files

    def add_zero(self, raw_len: int) -> ChunkRef:
        """Count an all-zero chunk (the caller holds its writer's lock); returns its reference."""
        self.chunks_zero += 1
        self.zero_bytes += raw_len
        self.raw_bytes += raw_len
        return ChunkRef(None, raw_len, "zero", 0)

    def add_chunk(self, raw_len: int, stored_len: int, new: bool, hash_s: float, write_s: float = 0.0) -> None:
        """Count a stored chunk, NEW or found already present (the caller holds its writer's lock)."""
        self.hash_s += hash_s
        self.write_s += write_s
        self.raw_bytes += raw_len
        if new:
            self.chunks_new += 1
            self.bytes_new += stored_len
        else:
            self.chunks_dedup += 1
            self.bytes_dedup += stored_len


@dataclass
class Problem:
    snapshot: str
    stream: str | None
    chunk: int | None
    what: str

    def __str__(self) -> str:
        where = self.snapshot
        if self.stream is not None:
            where += f": {self.stream}"
        if self.chunk is not None:
            where += f" chunk {self.chunk}"
        return f"{where}: {self.what}"


@dataclass
class VerifyReport:
    snapshots: list[str] = field(default_factory=list)
    chunks_checked: int = 0
    bytes_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class GcReport:
    chunks_removed: int = 0
    bytes_freed: int = 0
    tmp_removed: int = 0


class _FileLock:
    """flock(2) on a file; shared or exclusive, blocking with a deadline or not at all."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1

    def acquire(self, exclusive: bool, timeout: float | None) -> bool:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.fd, mode | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if deadline is not None and time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = -1
                    return False
                time.sleep(0.05)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing drops the flock
            self.fd = -1


class SnapshotStore:
    """A store directory (FORMAT.md). Cheap to open; safe to share between processes."""

    error = StoreError  # what a damaged snapshot raises (gpu_engine.ChunkSource)

    def __init__(self, path: str, create: bool = True) -> None:
        self.path = os.path.abspath(path)
        self._open(create)
        self.direct = direct_io_supported(self.tmp_dir)

    # ---- layout -------------------------------------------------------------------------------
    @property
    def snapshots_dir(self) -> str:
        return os.path.join(self.path, "snapshots")

    @property
    def chunks_dir(self) -> str:
        return os.path.join(self.path, "chunks")

    @property
    def tmp_dir(self) -> str:
        return os.path.join(self.path, "tmp")

    def chunk_path(self, cid: str) -> str:
        return os.path.join(self.chunks_dir, cid[:2], cid)

    def manifest_path(self, name: str) -> str:
        return os.path.join(self.snapshots_dir, validate_snapshot_name(name) + ".json")

    def _open(self, create: bool) -> None:
        marker = os.path.join(self.path, "gpusnap-store.json")
        if os.path.exists(marker):
            try:
                with open(marker, "rb") as f:
                    info = json.load(f)
            except (OSError, ValueError) as e:
                raise StoreError(f"{self.path}: unreadable store marker: {e}") from None
            if info.get("format") != STORE_FORMAT or info.get("version") != STORE_VERSION:
                raise StoreError(f"{self.path}: store format {info.get('format')} v{info.get('version')} "
                                 f"is not {STORE_FORMAT} v{STORE_VERSION}")
            return
        if not create:
            raise StoreError(f"{self.path} is not a gpusnap store (no gpusnap-store.json)")
        if os.path.isdir(self.path) and os.listdir(self.path):
            raise StoreError(f"{self.path} exists, is not empty and is not a gpusnap store")
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            os.chmod(self.path, 0o700)
            for d in ("snapshots", "chunks", "tmp", "names"):
                os.makedirs(os.path.join(self.path, d), mode=0o700, exist_ok=True)
            for i in range(256):
                os.makedirs(os.path.join(self.chunks_dir, f"{i:02x}"), mode=0o700, exist_ok=True)
            tmp = os.path.join(self.tmp_dir, "store.json.tmp")
            with open(tmp, "w") as f:
                json.dump({"format": STORE_FORMAT, "version": STORE_VERSION,
                           "created": datetime.now(timezone.utc).isoformat()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(tmp, marker)
            fsync_dir(self.path)
        except OSError as e:
            raise StoreError(f"cannot create store at {self.path}: {e.strerror or e}") from None

    # ---- locks --------------------------------------------------------------------------------
    @contextmanager
    def shared(self) -> Iterator[None]:
        lock = _FileLock(os.path.join(self.path, "lock"))
        lock.acquire(exclusive=False, timeout=None)
        try:
            yield
        finally:
            lock.release()

    @contextmanager
    def exclusive(self, timeout: float) -> Iterator[None]:
        lock = _FileLock(os.path.join(self.path, "lock"))
        if not lock.acquire(exclusive=True, timeout=timeout):
            raise StoreError("store is busy (a put, get or verify is running); try again when it ends")
        try:
            yield
        finally:
            lock.release()

    @contextmanager
    def name_lock(self, name: str) -> Iterator[None]:
        lock = _FileLock(os.path.join(self.path, "names", validate_snapshot_name(name) + ".lock"))
        if not lock.acquire(exclusive=True, timeout=0):
            raise StoreError(f"snapshot {name!r} is being written by another process")
        try:
            yield
        finally:
            lock.release()

    # ---- snapshots ----------------------------------------------------------------------------
    def exists(self, name: str) -> bool:
        return os.path.exists(self.manifest_path(name))

    def names(self) -> list[str]:
        try:
            return sorted(f[:-5] for f in os.listdir(self.snapshots_dir) if f.endswith(".json"))
        except FileNotFoundError:
            return []

    def load(self, name: str) -> Manifest:
        path = self.manifest_path(name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise StoreError(f"no snapshot named {name!r} in {self.path}") from None
        m = Manifest.loads(data, where=f"snapshot {name!r}")
        if m.name != name:
            raise ManifestError(f"snapshot {name!r}: manifest says its name is {m.name!r}")
        return m

    def writer(self, name: str, *, replace: bool = False, meta: dict[str, Any] | None = None,
               created: str | None = None) -> "SnapshotWriter":
        """CREATED keeps the creation time of a snapshot copied from elsewhere (a pull)."""
        return SnapshotWriter(self, name, replace=replace, meta=meta or {}, created=created)

    def remove(self, name: str) -> None:
        path = self.manifest_path(name)
        with self.name_lock(name):
            try:
                os.unlink(path)
            except FileNotFoundError:
                raise StoreError(f"no snapshot named {name!r} in {self.path}") from None
            fsync_dir(self.snapshots_dir)

    def read_chunk(self, ref: ChunkRef, buf: AlignedBuffer) -> memoryview:
        """The verified payload of REF (read into BUF); raises ChunkError when damaged."""
        assert ref.id is not None
        header, payload = read_chunk_file(self.chunk_path(ref.id), ref.id, buf, self.direct)
        if (header.codec, header.raw_len, header.stored_len) != (ref.codec, ref.raw_len, ref.stored_len):
            raise ChunkError(ref.id, "header disagrees with the manifest's reference")
        return payload

    def payload_at(self, ref: ChunkRef, frame: Any) -> tuple[int, str]:
        """Read REF's verified payload into FRAME (a host buffer with .ptr, laid out like a chunk
        file) and return its address there (gpu_engine.ChunkSource)."""
        self.read_chunk(ref, frame)
        return frame.ptr + HEADER_SIZE, "read+verify"

    def missing(self, manifest: Manifest) -> list[str]:
        """Chunk ids MANIFEST names that have no file here (a cheap stat pass before any output)."""
        return [cid for cid in sorted(manifest.chunk_ids()) if not os.path.exists(self.chunk_path(cid))]

    def chunk_buffer_size(self, manifests: list[Manifest]) -> int:
        most = max((c.stored_len for m in manifests for s in m.streams for c in s.chunks), default=0)
        return HEADER_SIZE + align_up(max(most, 1))

    # ---- verify / gc --------------------------------------------------------------------------
    def verify(self, names: list[str] | None = None, workers: int = 4,
               progress: Any = None) -> VerifyReport:
        report = VerifyReport()
        with self.shared():
            wanted = names if names is not None else self.names()
            manifests: list[Manifest] = []
            for n in wanted:
                report.snapshots.append(n)
                try:
                    manifests.append(self.load(n))
                except (ManifestError, StoreError) as e:
                    report.problems.append(Problem(n, None, None, str(e)))
            refs: dict[str, ChunkRef] = {}
            for m in manifests:
                for s in m.streams:
                    for c in s.chunks:
                        if c.id is not None:
                            refs.setdefault(c.id, c)
            if progress is not None:
                progress.start(sum(c.stored_len for c in refs.values()))
            bad: dict[str, str] = {}
            lock = threading.Lock()
            size = self.chunk_buffer_size(manifests)
            with BufferPool(workers, size) as pool:
                def check(ref: ChunkRef) -> None:
                    with pool.borrowed() as buf:
                        try:
                            self.read_chunk(ref, buf)
                        except ChunkError as e:
                            with lock:
                                bad[ref.id] = e.what  # type: ignore[index]
                        except OSError as e:
                            with lock:
                                bad[ref.id] = f"unreadable: {e.strerror or e}"  # type: ignore[index]
                    with lock:
                        report.chunks_checked += 1
                        report.bytes_checked += ref.stored_len
                    if progress is not None:
                        progress.advance(ref.stored_len)
                with ThreadPoolExecutor(workers) as ex:
                    list(ex.map(check, refs.values()))
            for m in manifests:
                for s in m.streams:
                    for i, c in enumerate(s.chunks):
                        if c.id in bad:
                            report.problems.append(Problem(m.name, s.name, i, f"chunk {c.id[:16]}… {bad[c.id]}"))
        return report

    def gc(self, timeout: float = 30.0) -> GcReport:
        report = GcReport()
        with self.exclusive(timeout):
            live: set[str] = set()
            for n in self.names():
                try:
                    live |= self.load(n).chunk_ids()
                except (ManifestError, StoreError) as e:
                    raise StoreError(f"gc stopped, nothing deleted: {e}; "
                                     f"`gpusnap store rm {n}` it first if it cannot be repaired") from None
            for entry in os.scandir(self.tmp_dir):
                try:
                    os.unlink(entry.path)
                    report.tmp_removed += 1
                except OSError:
                    pass
            for d in os.scandir(self.chunks_dir):
                if not d.is_dir():
                    continue
                removed = False
                for entry in os.scandir(d.path):
                    if entry.name not in live:
                        report.bytes_freed += entry.stat().st_size
                        os.unlink(entry.path)
                        report.chunks_removed += 1
                        removed = True
                if removed:
                    fsync_dir(d.path)
        return report


class SnapshotWriter:
    """Writes one snapshot: chunks as they come (any thread), then the manifest on commit().

    Used as a context manager; leaving it without commit() (an exception, a Ctrl-C) removes this
    writer's temporary files and leaves no snapshot. Chunks it already published stay until gc,
    because a concurrent writer may already reference them.
    """

    def __init__(self, store: SnapshotStore, name: str, *, replace: bool, meta: dict[str, Any],
                 created: str | None = None) -> None:
        self.store = store
        self.name = validate_snapshot_name(name)
        self.replace = replace
        self.meta = meta
        self.created = created
        self.streams: list[Stream] = []
        self.stats = WriteStats()
        self._lock = threading.Lock()
        self._touched: set[str] = set()
        self._tmp_files: set[str] = set()
        self._committed = False
        self._stack: list[Any] = []

    def __enter__(self) -> "SnapshotWriter":
        shared = self.store.shared()
        shared.__enter__()
        self._stack.append(shared)
        try:
            nl = self.store.name_lock(self.name)
            nl.__enter__()
            self._stack.append(nl)
            if self.store.exists(self.name) and not self.replace:
                raise StoreError(f"snapshot {self.name!r} already exists (use --replace to overwrite it)")
        except BaseException:
            self._unwind()
            raise
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        try:
            if not self._committed:
                for p in list(self._tmp_files):
                    try:
                        os.unlink(p)
                    except OSError:
                        pass
        finally:
            self._unwind()

    def _unwind(self) -> None:
        while self._stack:
            self._stack.pop().__exit__(None, None, None)

    def _tmp_path(self, what: str) -> str:
        return os.path.join(self.store.tmp_dir, f"{what}.{os.getpid()}.{threading.get_ident()}.{time.monotonic_ns()}")

    @property
    def source(self) -> SnapshotStore:
        """Where this writer's chunks can be read back from, also before it commits."""
        return self.store

    def note_zero(self, raw_len: int) -> ChunkRef:
        with self._lock:
            return self.stats.add_zero(raw_len)

    def put_chunk(self, codec: str, raw_len: int, frame: memoryview, stored_len: int) -> ChunkRef:
        """Store one encoded chunk (thread-safe) whose payload sits at FRAME[HEADER_SIZE:][:stored_len].

        FRAME must have room up to the next 4096-byte boundary after the payload (see
        chunkfile.write_chunk_file); the header is written into its first HEADER_SIZE bytes.
        """
        header = ChunkHeader(codec, raw_len, stored_len)
        payload = frame[HEADER_SIZE:HEADER_SIZE + stored_len]
        t0 = time.perf_counter()
        cid = chunk_id(header, payload)
        t1 = time.perf_counter()
        final = self.store.chunk_path(cid)
        try:
            present = os.stat(final).st_size >= HEADER_SIZE + stored_len
        except FileNotFoundError:
            present = False
        if not present:
            tmp = self._tmp_path("chunk")
            with self._lock:
                self._tmp_files.add(tmp)
            try:
                write_chunk_file(tmp, header, frame, self.store.direct)
                os.rename(tmp, final)
            except OSError as e:
                raise StoreError(_io_message("writing a chunk", e, self.store.path)) from None
            finally:
                with self._lock:
                    self._tmp_files.discard(tmp)
        t2 = time.perf_counter()
        with self._lock:
            self.stats.add_chunk(raw_len, stored_len, not present, t1 - t0, t2 - t1)
            if not present:
                self._touched.add(os.path.dirname(final))
        return ChunkRef(cid, raw_len, codec, stored_len)

    def add_stream(self, stream: Stream) -> None:
        with self._lock:
            self.streams.append(stream)

    def commit(self) -> Manifest:
        """Make the snapshot visible, atomically and durably (FORMAT.md, "What is atomic")."""
        manifest = Manifest(self.name, self.streams, self.meta)
        if self.created is not None:
            manifest.created = self.created
        data = manifest.dumps()
        final = self.store.manifest_path(self.name)
        tmp = self._tmp_path("manifest")
        self._tmp_files.add(tmp)
        try:
            for d in sorted(self._touched):
                fsync_dir(d)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            if self.replace:
                os.rename(tmp, final)
            else:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    raise StoreError(f"snapshot {self.name!r} was created by another writer meanwhile") from None
                os.unlink(tmp)
            self._tmp_files.discard(tmp)
            fsync_dir(self.store.snapshots_dir)
        except OSError as e:
            raise StoreError(_io_message("committing the manifest", e, self.store.path)) from None
        self._committed = True
        return manifest


def _io_message(doing: str, e: OSError, store: str) -> str:
    if e.errno == errno.ENOSPC:
        return (f"no space left on the store's disk while {doing}; nothing was committed "
                f"(`gpusnap --store {store} store gc` reclaims what this attempt left)")
    if e.errno == errno.EDQUOT:
        return f"disk quota exceeded while {doing}; nothing was committed"
    return f"I/O error while {doing}: {e.strerror or e}"
