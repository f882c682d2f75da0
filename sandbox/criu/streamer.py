"""CRIU's images streamed straight into and out of the store (`criu --stream`), with no staging copy.

CRIU 4.x can hand every image to an *image streamer* instead of writing files: it connects to the
unix socket `streamer-capture.sock` (dump) or `streamer-serve.sock` (restore) in the images
directory and, per image, sends a request (a little-endian uint32 length, then a protobuf
`{1: filename}`); on restore the streamer answers `{1: exists}`; then CRIU passes one end of a pipe
(SCM_RIGHTS, with one byte of data) and writes or reads that image through it.

This module is that streamer, served by gpusnap itself:
- dump: each page image flows from CRIU's pipe into pipeline.put (content-defined page chunks,
  zero test, compression, hashing, writes) while CRIU is still dumping; the small images are drained
  into memory by one thread each (CRIU writes a pagemap and its page image at the same time, so
  every pipe must be drained at once) and stored after CRIU exits. Nothing is staged on /dev/shm,
  nothing is left to ingest after CRIU exits.
- restore: for each image CRIU asks for, its chunks are read, verified and decoded by a pool of
  threads a window ahead of CRIU and written into CRIU's pipe in order; no image is materialized.
  A restore from a remote (storage.remote_fill) starts before the snapshot is local: the chunks
  still on their way are asked for in the order CRIU reads them (`read_order`), and a chunk is
  waited for only when CRIU needs it before it has arrived.

Guarantees kept here:
- CRIU is run with --leave-stopped: the tree is killed only after the snapshot commits (the caller,
  sandbox/criu/snapshot.py, journals each stage); any failure before that (CRIU's, the store's, or the streamer's) continues the
  tree where it was. If gpusnap dies mid-stream, CRIU sees a broken pipe, fails, and resumes the
  tree itself;
- restore: every chunk is verified before its bytes enter CRIU's pipe; a damaged chunk, a remote
  that fails mid-restore, or gpusnap dying, breaks the pipe and CRIU fails before any restored
  process runs (and removes its tasks);
  if CRIU itself dies mid-restore, the tasks it had created come back to gpusnap (child subreaper
  meanwhile) and are killed, so the snapshot's pids are free for the next restore;
- the snapshot's layout is the staging path's (`images/NAME` files), so either path restores what
  the other dumped;
- filenames from the socket are checked (one plain name, no path), pipes are the only fds taken.

Threads, not asyncio: every transfer is a blocking read or write that releases the GIL (so the
declared-but-unused aiofiles dependency was dropped rather than used here).
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import queue
import re
import signal
import socket
import stat
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Protocol

from storage.progress import Progress
from sandbox.criu import split
from storage import pipeline
from storage.chunkfile import ChunkError
from storage.codecs import CodecError, decode_host, decode_host_into
from storage.directio import BufferPool
from storage.errors import GpusnapError
from storage.manifest import ChunkRef, Manifest, Stream
from storage.pipeline import PipelineError, Stages, StreamSpec
from storage.readstage import Want, read_chunks
from storage.store import SnapshotStore, StoreError

CAPTURE_SOCKET = "streamer-capture.sock"
SERVE_SOCKET = "streamer-serve.sock"
IMAGES = "images"          # the snapshot's directory stream, as on the staging path
_LEN = struct.Struct("<I")
_MAX_REQUEST = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
_F_SETPIPE_SZ = 1031
FILL_GAP = 1 << 20         # the split fill's reads bridge this many unwanted bytes of a pack
_PIPE_SIZE = 1 << 20       # the unprivileged maximum by default; fewer syscalls per GB
_BIG_PIPE = 16 << 20       # root may go past it: fewer wake-ups between CRIU and the pipeline
_ACCEPT_POLL_S = 0.1


class StreamerError(GpusnapError):
    """The image streamer could not serve CRIU (socket, protocol or pipe failure)."""


def images_path() -> str:
    """Which path CRIU's images take: $GPUSNAP_CRIU_IMAGES ('stream' or 'staging'), default 'stream'."""
    want = os.environ.get("GPUSNAP_CRIU_IMAGES", "stream").strip().lower()
    if want not in ("stream", "staging"):
        raise StreamerError(f"GPUSNAP_CRIU_IMAGES={want!r}: expected 'stream' or 'staging'")
    return want


def is_page_image(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


# -- the wire protocol -------------------------------------------------------------------------
def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    """N bytes, or None if the peer closed before the first one."""
    buf = bytearray()
    while len(buf) < n:
        got = conn.recv(n - len(buf))
        if not got:
            if not buf:
                return None
            raise StreamerError("CRIU closed the streamer socket in the middle of a request")
        buf += got
    return bytes(buf)


def _varint(data: bytes, i: int) -> tuple[int, int]:
    r = split.read_varint(data, i, max_shift=35)
    if r is None:
        raise StreamerError("malformed request from CRIU (bad varint)")
    return r


def parse_request(msg: bytes) -> str:
    """The filename of an img_streamer_request_entry ({1: string}); other fields are skipped."""
    i, name = 0, None
    while i < len(msg):
        key, i = _varint(msg, i)
        field, wire = key >> 3, key & 7
        if wire == 2:
            ln, i = _varint(msg, i)
            if i + ln > len(msg):
                raise StreamerError("malformed request from CRIU (truncated field)")
            if field == 1:
                name = msg[i:i + ln].decode("utf-8", "replace")
            i += ln
        elif wire == 0:
            _, i = _varint(msg, i)
        else:
            raise StreamerError(f"malformed request from CRIU (wire type {wire})")
    if name is None or not _NAME.fullmatch(name) or name in (CAPTURE_SOCKET, SERVE_SOCKET):
        raise StreamerError(f"CRIU asked for an image with an unacceptable name: {name!r}")
    return name


def encode_request(name: str) -> bytes:
    """The request CRIU sends (for tests that play CRIU's side)."""
    raw = name.encode()
    body = b"\x0a" + _encode_varint(len(raw)) + raw
    return _LEN.pack(len(body)) + body


def _encode_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def _read_request(conn: socket.socket) -> str | None:
    head = _recv_exact(conn, _LEN.size)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > _MAX_REQUEST:
        raise StreamerError(f"request from CRIU too long ({n} bytes)")
    body = _recv_exact(conn, n) if n else b""
    if body is None:
        raise StreamerError("CRIU closed the streamer socket in the middle of a request")
    return parse_request(body)


def _send_reply(conn: socket.socket, exists: bool) -> None:
    body = b"\x08" + (b"\x01" if exists else b"\x00")
    conn.sendall(_LEN.pack(len(body)) + body)


def _recv_pipe(conn: socket.socket, writable: bool) -> int:
    """The pipe end CRIU passes for one image; anything else is refused."""
    _msg, fds, _flags, _addr = socket.recv_fds(conn, 1, 4)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise StreamerError(f"CRIU passed {len(fds)} descriptors for one image (expected one pipe)")
    fd = fds[0]
    st = os.fstat(fd)
    mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    if not stat.S_ISFIFO(st.st_mode) or mode != (os.O_WRONLY if writable else os.O_RDONLY):
        os.close(fd)
        raise StreamerError("CRIU passed something other than the expected pipe end")
    for size in (_BIG_PIPE, _PIPE_SIZE):
        try:
            fcntl.fcntl(fd, _F_SETPIPE_SZ, size)
            break
        except OSError:
            continue  # over pipe-max-size without CAP_SYS_RESOURCE: a smaller pipe still works
    return fd


class _Listener:
    """The socket CRIU connects to, in DIRECTORY; accept() gives up when STOP says so."""

    def __init__(self, directory: str, name: str) -> None:
        self.path = os.path.join(directory, name)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self.sock.bind(self.path)
            os.chmod(self.path, 0o600)
            self.sock.listen(1)
        except OSError as e:
            self.sock.close()
            raise StreamerError(f"cannot listen on {self.path}: {e.strerror}") from None
        self.sock.settimeout(_ACCEPT_POLL_S)

    def accept(self, stop: Callable[[], bool]) -> socket.socket | None:
        while not stop():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            return conn
        return None

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


# -- dump ------------------------------------------------------------------------------------------
class _PipeReader:
    """A pipe read to EOF; readinto fills VIEW unless the writer closed first."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def readinto(self, view: memoryview) -> int:
        got = 0
        while got < len(view):
            n = os.readv(self.fd, [view[got:]])
            if n == 0:
                break
            got += n
        return got


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.off = data, 0

    def readinto(self, view: memoryview) -> int:
        n = min(len(view), len(self.data) - self.off)
        view[:n] = self.data[self.off:self.off + n]
        self.off += n
        return n


class CaptureSource:
    """A pipeline Source fed by CRIU's dump through the capture socket in DIRECTORY; a context manager.

    Create it before CRIU starts; `criu_done` is set when CRIU has exited, `criu_failed()` returns its
    error. streams(): the images directory, then each page image as CRIU opens it (read from the
    pipe while CRIU writes), then the small images once CRIU has finished."""

    def __init__(self, directory: str, *, criu_done: threading.Event,
                 criu_failed: Callable[[], BaseException | None]) -> None:
        self._done, self._failed = criu_done, criu_failed
        self._listener = _Listener(directory, CAPTURE_SOCKET)
        self._pages: queue.Queue[tuple[str, int] | None] = queue.Queue()
        self._small: dict[str, bytes] = {}
        self._fds: dict[str, int] = {}
        self._drains: list[threading.Thread] = []
        self._error: BaseException | None = None
        self._closing = False
        self.page_images: list[str] = []
        self._thread = threading.Thread(target=self._serve, name="gpusnap-capture", daemon=True)
        self._thread.start()

    def __enter__(self) -> "CaptureSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving: the socket and every pipe not yet read are closed (CRIU sees them break)."""
        self._closing = True
        self._listener.close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        while True:
            try:
                item = self._pages.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                os.close(item[1])
        self._thread.join()

    def _serve(self) -> None:
        try:
            conn = self._listener.accept(lambda: self._closing or self._done.is_set())
            if conn is None:
                return
            with conn:
                while True:
                    name = _read_request(conn)
                    if name is None:
                        break
                    fd = _recv_pipe(conn, writable=False)
                    if is_page_image(name):
                        self._pages.put((name, fd))
                    else:
                        t = threading.Thread(target=self._drain, args=(name, fd), daemon=True,
                                             name="gpusnap-capture-drain")
                        self._drains.append(t)
                        t.start()
        except BaseException as e:  # noqa: BLE001 - reported through streams()
            self._error = e
        finally:
            for t in self._drains:
                t.join()
            self._pages.put(None)

    def _drain(self, name: str, fd: int) -> None:
        parts = []
        try:
            while True:
                b = os.read(fd, _PIPE_SIZE)
                if not b:
                    break
                parts.append(b)
        except OSError as e:
            self._error = StreamerError(f"reading image {name} from CRIU: {e.strerror}")
        finally:
            os.close(fd)
        self._small[name] = b"".join(parts)

    def _check(self) -> bool:
        """False once CRIU has failed (the streams end there: the put reports its own failure first,
        if it had one, else the caller reports CRIU's); raises on a protocol failure."""
        if self._error is not None:
            raise PipelineError(str(self._error))
        return self._failed() is None

    def _spec(self, name: str, size: int | None) -> StreamSpec:
        return StreamSpec(f"{IMAGES}/{name}", {"type": "file", "mode": 0o600, "mtime_ns": time.time_ns()}, size)

    def streams(self) -> Iterator[StreamSpec]:
        yield StreamSpec(IMAGES, {"type": "dir", "mode": 0o700, "mtime_ns": time.time_ns()}, 0)
        while True:
            if not self._check():
                return
            try:
                item = self._pages.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            name, fd = item
            if name in self._fds or name in self.page_images:
                os.close(fd)
                raise PipelineError(f"CRIU streamed image {name} twice")
            self._fds[name] = fd
            self.page_images.append(name)
            yield self._spec(name, None)
        self._done.wait()
        if not self._check():
            return
        for name in sorted(self._small):
            yield self._spec(name, len(self._small[name]))

    @contextmanager
    def open(self, spec: StreamSpec) -> Iterator[_PipeReader | _BytesReader]:
        name = spec.name.partition("/")[2]
        if name in self._fds:
            fd = self._fds[name]
            try:
                yield _PipeReader(fd)
            finally:
                os.close(self._fds.pop(name))
        else:
            yield _BytesReader(self._small[name])


def dump(criu: Any, pid: int, images: str, opts: Any, w: Any, *, on_dumped: Callable[[], None] | None = None,
         progress: Progress | None = None) -> tuple[pipeline.Result, dict[str, float], list[str]]:
    """`criu dump --stream` of PID (OPTS, with --leave-stopped unless it keeps running) into writer W
    through a CaptureSource in IMAGES. Returns the put's Result, seconds per stage and the page images
    streamed. ON_DUMPED runs in CRIU's thread right after CRIU succeeds (e.g. the GPU resume of a
    --leave-running dump; it marks the tree as dumped). A CRIU failure is raised as its CriuError;
    a failure of the store side breaks CRIU's pipes, so a CRIU still dumping fails and resumes the tree."""
    from sandbox.criu.runner import DumpOptions
    stop = () if opts.leave_running or opts.leave_stopped else ("--leave-stopped",)
    extra = tuple(opts.extra) + ("--stream",) + stop
    run_opts = DumpOptions(**{**opts.__dict__, "extra": extra})
    done = threading.Event()
    box: dict[str, Any] = {}
    seconds: dict[str, float] = {}

    def run_criu() -> None:
        t0 = time.perf_counter()
        try:
            criu.dump(pid, images, run_opts)
            box["criu_dump"] = time.perf_counter() - t0
            if on_dumped is not None:
                on_dumped()
        except BaseException as e:  # noqa: BLE001 - handed to the ingesting thread
            box["error"] = e
        finally:
            done.set()

    t0 = time.perf_counter()
    src = CaptureSource(images, criu_done=done, criu_failed=lambda: box.get("error"))
    th = threading.Thread(target=run_criu, name="gpusnap-criu-dump", daemon=True)
    th.start()
    try:
        res = pipeline.put(w, src, progress=progress, chunker="pages")
    except BaseException:
        src.close()  # CRIU's pipes break: a CRIU still dumping fails and resumes the tree itself
        th.join()
        raise  # the store's failure (a CRIU failure then is its broken pipe's consequence)
    th.join()
    src.close()
    if "error" in box:
        raise box["error"]
    seconds["criu_dump"] = box["criu_dump"]
    seconds["dump+ingest"] = time.perf_counter() - t0
    seconds["ingest_after_dump"] = seconds["dump+ingest"] - box["criu_dump"]
    return res, seconds, src.page_images


# -- restore ---------------------------------------------------------------------------------------
class Arrivals(Protocol):
    """Chunks still on their way into the store while it serves (storage.remote_fill.RemoteFill)."""

    def wait(self, cid: str) -> None: ...

    def first(self, refs: Iterable[ChunkRef]) -> None: ...

    def take(self, cid: str) -> tuple[str, bytes] | None: ...


_PAGES_ID = re.compile(r"pages-(\d+)\.img")
_READ_FIRST = ("inventory.img", "pstree.img")


def read_order(images: dict[str, Stream], plans: dict[str, split.Plan] | None) -> list[ChunkRef]:
    """IMAGES' chunks in the order a streamed restore reads them (what a restore from a remote
    fetches first). CRIU asks for the inventory and the process tree, then each process's small
    images, pagemap and page image, the root's first (page images are numbered in that order, as
    the dump met the processes); the runs a split moves are written after CRIU. Without PLANS (the
    pagemaps not read yet) the small images only."""
    small = sorted((n for n in images if not is_page_image(n)),
                   key=lambda n: (_READ_FIRST.index(n) if n in _READ_FIRST else len(_READ_FIRST), images[n].size, n))
    out = [c for n in small for c in images[n].chunks]
    if plans is None:
        return out
    pages = sorted((n for n in images if is_page_image(n)),
                   key=lambda n: (int(m.group(1)) if (m := _PAGES_ID.fullmatch(n)) else 1 << 62, n))
    for n in pages:  # what CRIU reads: the kept ranges of a split image, else all of it
        pl = plans.get(n)
        out += [c for _, c, _, _ in split.pieces(images[n], pl.kept if pl else None)]
    for n in pages:  # then what split.fill writes
        pl = plans.get(n)
        if pl is not None:
            out += [c for _, c, _, _ in split.pieces(images[n], tuple((r.offset, r.nbytes) for r in pl.moved))]
    return out


class ServeSource:
    """Serves MANIFEST's images to `criu restore --stream` through the serve socket in DIRECTORY;
    a context manager. Chunks are read, verified and decoded by WORKERS threads, up to WINDOW chunks
    ahead of CRIU per image, and written into CRIU's pipe in order."""

    def __init__(self, store: SnapshotStore, manifest: Manifest, directory: str, *, workers: int | None = None,
                 window: int | None = None, split_min: int = 0, arrivals: Arrivals | None = None) -> None:
        """split_min: page runs of at least this many bytes are left out of what CRIU gets, for
        split.fill to write after CRIU (0: CRIU restores everything). arrivals: the chunks the store
        lacks are on their way (a restore from a remote): asked for in read order, each waited for
        when it is needed."""
        self.store, self.manifest, self.arrivals = store, manifest, arrivals
        self.images = {s.name.partition("/")[2]: s for s in manifest.streams
                       if s.name.startswith(IMAGES + "/") and s.attrs.get("type") == "file"}
        missing = store.missing(manifest) if arrivals is None else []
        if arrivals is not None:
            arrivals.first(read_order(self.images, None))
        if missing:
            raise store.error(f"snapshot {manifest.name!r} is damaged: {len(missing)} chunk(s) missing "
                             f"(first {missing[0][:16]}…); nothing was started")
        self.workers = workers or pipeline.default_workers()
        self.window = window or 2 * self.workers
        self._bufs = BufferPool(self.workers, store.chunk_buffer_size([manifest]))  # CRIU's feeds (the fill has its own)
        self._ex = ThreadPoolExecutor(self.workers, thread_name_prefix="gpusnap-serve")
        self.stages = Stages()  # thread-seconds of the store side: read+verify, decode, the fill's stages
        self._zeros = bytes(max((c.raw_len for s in self.images.values() for c in s.chunks), default=0))
        self.plans: dict[str, split.Plan] = {}    # page image -> its split
        self._rewritten: dict[str, bytes] = {}    # pagemap image -> what CRIU gets instead
        # the pids CRIU restores, as its pstree image lists them (a snapshot's own list may lack a child
        # forked while CRIU froze the tree: a --leave-running dump, or one made before that was fixed)
        ps = self.images.get("pstree.img")
        try:
            self.pstree = split.pstree_pids(b"".join(bytes(self._chunk(ps, i, c)) for i, c in enumerate(ps.chunks))) \
                if ps is not None else []
        except split.SplitError:
            self.pstree = []  # CRIU refuses the image itself
        # why the split did not engage (None when it did), for the restore report
        self.split_skipped_because: str | None = "the split is off (GPUSNAP_CRIU_SPLIT_MIN=0)"
        if split_min > 0:
            pagemaps = {name: b"".join(bytes(self._chunk(s, i, c)) for i, c in enumerate(s.chunks))
                        for name, s in self.images.items() if split.PAGEMAP_NAME.fullmatch(name)}
            self.plans, self.split_skipped_because = split.choose(
                pagemaps, {n: s.size for n, s in self.images.items() if is_page_image(n)}, split_min)
            self._rewritten = {f"pagemap-{pl.pid}.img": pl.pagemap for pl in self.plans.values()}
        if arrivals is not None:
            arrivals.first(read_order(self.images, self.plans))
        self.connected_at: float | None = None  # time.monotonic() when CRIU connected
        self._listener = _Listener(directory, SERVE_SOCKET)
        # the moved runs are read from the store from now on, while CRIU restores the rest
        self._filler = split.Filler(list(self.plans.values()), self.images, self._read_moved, self.workers,
                                    fill_budget(), self.stages) if self.plans else None
        self._closing = False
        self._feeds: list[threading.Thread] = []
        self.errors: list[BaseException] = []
        self.served: list[str] = []
        self.absent: list[str] = []  # images CRIU asked for that the dump never wrote (CRIU then goes on)
        self.bytes = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="gpusnap-serve", daemon=True)
        self._thread.start()

    def __enter__(self) -> "ServeSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self._listener.close()
        self._thread.join()
        for t in self._feeds:
            t.join()
        self._ex.shutdown(wait=True, cancel_futures=True)
        if self._filler is not None:
            self._filler.close()
        self._bufs.close()

    def _serve(self) -> None:
        try:
            conn = self._listener.accept(lambda: self._closing)
            if conn is None:
                return
            self.connected_at = time.monotonic()
            with conn:
                while True:
                    name = _read_request(conn)
                    if name is None:
                        break
                    s = self.images.get(name)
                    _send_reply(conn, s is not None)
                    if s is None:
                        self.absent.append(name)
                        continue
                    fd = _recv_pipe(conn, writable=True)
                    pl = self.plans.get(name)
                    t = threading.Thread(target=self._feed, args=(s, fd, pl.kept if pl else None, self._rewritten.get(name)),
                                         daemon=True, name="gpusnap-serve-feed")
                    self._feeds.append(t)
                    t.start()
        except BaseException as e:  # noqa: BLE001 - reported by raise_if_failed
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self.errors.append(e)

    def _chunk(self, s: Stream, i: int, ref: ChunkRef) -> bytes | memoryview:
        return memoryview(self._zeros)[:ref.raw_len] if ref.is_zero else self._fetch(s, i, ref)

    def _fetch(self, s: Stream, i: int, ref: ChunkRef) -> bytes | memoryview:
        """REF's verified, decoded bytes, as an object of their own (CRIU's feeds hold them a window ahead)."""
        fresh = self._arrived(ref)  # before taking a buffer: the waits hold none
        with self._bufs.borrowed() as buf:
            data = self._decoded(s, i, ref, fresh, buf, None)
            return bytes(data) if isinstance(data, memoryview) else data  # the buffer goes back now

    def _read_moved(self, wants: list[Want], deliver: Callable[[Want, memoryview], None],
                    stop: Callable[[], bool]) -> None:
        """The split fill's reads (split.ReadAll): from the store, the read stage in pack order (the
        moved runs are most of the image, so its packs are read nearly whole, in large reads); from a
        remote's arrivals, each chunk as it arrives."""
        if self.arrivals is None:
            try:
                read_chunks(self.store, wants, deliver, stages=self.stages, decoders=self.workers, stop=stop,
                            order="pack", gap=FILL_GAP, prefetch=fill_prefetch())
            except ChunkError as e:
                raise self.store.error(f"snapshot {self.manifest.name!r} is damaged: {e}") from None
            except CodecError as e:
                raise StoreError(f"snapshot {self.manifest.name!r}: {e}") from None
            return
        size = self._bufs.size
        most = max((w.ref.raw_len for w in wants), default=1)
        where = {c.id: (name, i) for name, st in self.images.items() for i, c in enumerate(st.chunks)
                 if c.id is not None}  # for the messages: which image, which chunk
        with BufferPool(self.workers, size) as files, BufferPool(self.workers, most) as outs:

            def one(w: Want) -> None:
                if stop():
                    return
                image, i = where[w.ref.id or ""]
                fresh = self._arrived(w.ref)
                with files.borrowed() as f, outs.borrowed() as o:
                    deliver(w, memoryview(self._decoded(self.images[image], i, w.ref, fresh, f, o.view)))

            with ThreadPoolExecutor(self.workers, thread_name_prefix="gpusnap-fill-arrivals") as ex:
                for _ in ex.map(one, wants):
                    pass

    def _arrived(self, ref: ChunkRef) -> tuple[str, bytes] | None:
        """On a restore --from a remote: (codec, payload) of REF once it has arrived, if the fill
        hands it over (verified on arrival: no read, no second check); None: read it from the store."""
        if self.arrivals is None:
            return None
        assert ref.id is not None
        self.arrivals.wait(ref.id)
        return self.arrivals.take(ref.id)

    def _decoded(self, s: Stream, i: int, ref: ChunkRef, fresh: tuple[str, bytes] | None, buf: Any,
                 out: memoryview | None) -> bytes | memoryview:
        """REF's raw bytes: FRESH decoded, or read from the store into BUF and decoded with the full
        check (the bytes bound to REF's id); into OUT when given (nothing allocated)."""
        t0 = time.perf_counter()
        try:
            if fresh is not None:
                codec, payload = fresh
                data = (decode_host(codec, memoryview(payload), ref.raw_len) if out is None
                        else decode_host_into(codec, memoryview(payload), ref.raw_len, out))
            else:
                data = self.store.read_raw(ref, buf, out, cached=True)
        except ChunkError as e:
            raise self.store.error(f"snapshot {self.manifest.name!r} is damaged: {s.name} chunk {i}: {e.what}") from None
        except CodecError as e:
            raise StoreError(f"snapshot {self.manifest.name!r}: {s.name} chunk {i}: {e}") from None
        self.stages.add("read+decode+verify", time.perf_counter() - t0, ref.raw_len)
        return data

    def _feed(self, s: Stream, fd: int, ranges: tuple[tuple[int, int], ...] | None = None,
              replacement: bytes | None = None) -> None:
        """Stream S (only its RANGES; or REPLACEMENT instead) into CRIU's pipe FD, chunks fetched a window ahead."""
        pending: deque[tuple[Future[bytes | memoryview] | None, int, int]] = deque()
        it = iter(split.pieces(s, ranges) if replacement is None else ())
        last: tuple[int, Future[bytes | memoryview] | None] | None = None
        try:
            if replacement is not None:
                _write_all(fd, replacement)
                self.bytes += len(replacement)
            while True:
                while len(pending) < self.window:
                    nxt = next(it, None)
                    if nxt is None:
                        break
                    i, ref, lo, hi = nxt
                    if last is not None and last[0] == i:
                        fut = last[1]  # the same chunk again: fetched once
                    else:
                        fut = None if ref.is_zero else self._ex.submit(self._fetch, s, i, ref)
                        last = (i, fut)
                    pending.append((fut, lo, hi))
                if not pending:
                    break
                fut, lo, hi = pending.popleft()
                data = memoryview(self._zeros)[lo:hi] if fut is None else memoryview(fut.result())[lo:hi]
                _write_all(fd, data)
                self.bytes += len(data)
            self.served.append(s.name)
        except BaseException as e:  # noqa: BLE001 - CRIU sees the broken pipe; reported by raise_if_failed
            for f, *_ in pending:
                if f is not None:
                    f.cancel()
            self._fail(e if not isinstance(e, OSError) else
                       StreamerError(f"writing image {s.name} to CRIU: {e.strerror}"))
        finally:
            os.close(fd)

    def fill(self, pids_ok: Callable[[int], bool]) -> dict[str, int]:
        """After CRIU: the moved runs written into the (stopped) processes; PIDS_OK(pid) says a
        planned pid is one CRIU restored."""
        if self._filler is None:
            return {"written": 0, "zero_skipped": 0}
        return self._filler.write(pids_ok)

    def raise_if_failed(self) -> None:
        """The first failure of the store side (a damaged chunk, a remote that failed) before a broken pipe."""
        errs = [e for e in self.errors if isinstance(e, GpusnapError) and not isinstance(e, StreamerError)] \
            or self.errors
        if errs:
            e = errs[0]
            raise e if isinstance(e, GpusnapError) else StreamerError(f"serving images to CRIU: {e}")


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        if n <= 0:
            raise OSError(errno.EPIPE, "short write")
        view = view[n:]


def fill_budget() -> int:
    """Bytes of buffers the split restore may read ahead of its writes: an eighth of the memory
    available now, at most 2 GiB (more buys nothing: the reads only need to stay ahead of the
    writers while CRIU runs), at least 256 MiB."""
    return max(256 << 20, min(2 << 30, _mem_available() // 8))


def fill_prefetch() -> int:
    """Bytes of the store the split fill asks the kernel to read ahead into the page cache: while CRIU
    makes the processes, its held buffers (fill_budget) fill in a second, and the disk would then
    idle; the page cache is reclaimable, so half the memory available now, at most 8 GiB."""
    return min(8 << 30, _mem_available() // 2)


def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def split_min() -> int:
    """$GPUSNAP_CRIU_SPLIT_MIN: page runs of at least this many bytes are filled by gpusnap after
    CRIU (0: off); default split.DEFAULT_MIN."""
    v = os.environ.get("GPUSNAP_CRIU_SPLIT_MIN")
    if v is None or v.strip() == "":
        return split.DEFAULT_MIN
    try:
        return int(v)
    except ValueError:
        raise StreamerError(f"GPUSNAP_CRIU_SPLIT_MIN={v!r}: expected a number of bytes") from None


def restore(criu: Any, store: SnapshotStore, manifest: Manifest, images: str, *, shell_job: bool,
            pidfile: str, pids: list[int], thp_mode: str | None = "always",
            split_bytes: int | None = None, arrivals: Arrivals | None = None,
            extra: tuple[str, ...] = (),
            on_stopped: Callable[[], None] | None = None) -> tuple[dict[str, float], dict[str, Any]]:
    """`criu restore --stream -d` of MANIFEST's images served from STORE (IMAGES: a private directory
    for the socket and CRIU's log), THP set to THP_MODE meanwhile (CRIU faults the whole image in).
    With a split (runs of at least SPLIT_BYTES, default split_min()), CRIU leaves the tree PIDS
    stopped, ON_STOPPED runs (the caller journals the stopped tree), the moved runs are written in, then
    the tree continues; if that fails the tree is killed.
    Returns seconds per stage and what was served. A CRIU failure caused by the store (a damaged
    chunk, a remote that failed: ARRIVALS' error) is raised as that error; otherwise CRIU's."""
    from sandbox.criu.runner import CriuError
    from sandbox.gpu.state import restore_huge_pages
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    info: dict[str, Any] = {}
    born_after = boot_ticks()  # what CRIU restores starts after this
    with ServeSource(store, manifest, images, split_min=split_min() if split_bytes is None else split_bytes,
                     arrivals=arrivals) as srv:
        extra = extra + (("--stream", "--leave-stopped") if srv.plans else ("--stream",))  # EXTRA: CRIU options
        pids = list(dict.fromkeys([*pids, *srv.pstree]))
        with restore_huge_pages(thp_mode):
            try:
                with _adopting_orphans():
                    try:
                        criu.restore(images, detach=True, shell_job=shell_job, pidfile=pidfile, extra=extra)
                    except CriuError:
                        _kill_half_restored(pids)
                        raise
            except CriuError:
                srv.raise_if_failed()
                raise
            srv.raise_if_failed()
            seconds["criu_restore"] = time.perf_counter() - t0
            if srv.plans:
                t1 = time.perf_counter()
                try:
                    if on_stopped is not None:
                        on_stopped()
                    info["split"] = srv.fill(lambda p: restored_by_criu(p, pids, born_after))
                except BaseException:
                    _signal_all([p for p in pids if restored_by_criu(p, pids, born_after)], signal.SIGKILL)
                    raise
                _signal_all([p for p in pids if restored_by_criu(p, pids, born_after)], signal.SIGCONT)
                seconds["split_fill"] = time.perf_counter() - t1
        info.update(served=len(srv.served), absent_images=srv.absent, bytes=srv.bytes, stages=srv.stages.table(),
                    moved_bytes=sum(p.moved_bytes for p in srv.plans.values()))
        if srv.split_skipped_because is not None:
            info["split_skipped_because"] = srv.split_skipped_because
        if srv.connected_at is not None:
            info["criu_connected_monotonic"] = srv.connected_at
    return seconds, info


def boot_ticks() -> int:
    """Now, in the clock ticks since boot that /proc/PID/stat's start time counts."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * os.sysconf("SC_CLK_TCK"))


def restored_by_criu(pid: int, pids: list[int], born_after: int) -> bool:
    """Whether the split may write into PID: one of the snapshot's PIDS (all checked free before the
    restore) and started after BORN_AFTER, so a process of someone else's that a snapshot's page
    image names is never written into."""
    from sandbox.ops.journal import start_time
    started = start_time(pid) if pid in pids else None
    return started is not None and started >= born_after - 1


_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


@contextmanager
def _adopting_orphans() -> Iterator[None]:
    """This process as the child subreaper meanwhile: the tasks of a CRIU that dies mid-restore
    (killed, say) come back to us instead of init, so they can be told from anyone else's."""
    libc = ctypes.CDLL(None, use_errno=True)
    prev = ctypes.c_int(0)
    libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(prev), 0, 0, 0)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, prev.value, 0, 0, 0)


def _kill_half_restored(pids: list[int]) -> None:
    """After a failed `criu restore`: the snapshot's pids that are now our children are tasks CRIU
    created and never resumed (CRIU cleans up after its own errors, not after being killed); they
    would hold the pids and block the next restore."""
    me = os.getpid()
    for _ in range(len(pids) + 1):  # a killed task's children come to us next: until none is left
        killed = 0
        for p in pids:
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid != me:
                continue
            try:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
                killed += 1
            except (ProcessLookupError, ChildProcessError):
                pass
        if not killed:
            return


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
