"""The dump side of the image streamer: CaptureSource, a pipeline Source fed by `criu dump --stream`.

Each page image flows from CRIU's pipe into pipeline.put (content-defined page chunks, zero test,
compression, hashing, writes) while CRIU is still dumping; the small images are drained into memory
by one thread each (CRIU writes a pagemap and its page image at the same time, so every pipe must
be drained at once) and stored after CRIU exits. Nothing is staged, nothing is left to ingest after
CRIU exits. sandbox.criu.dump runs CRIU beside it.

Guarantees kept here: closing the source closes the socket and every pipe not yet read, so a CRIU
still dumping sees them break, fails and resumes the tree itself (it dumps with --leave-stopped);
an image streamed twice, or a protocol failure, fails the put; once CRIU has failed the streams end
(the caller reports CRIU's error).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from storage.api import fdread
from storage.api import PipelineError, StreamSpec

from sandbox.criu.images import IMAGES, is_page_image
from sandbox.criu.protocol import BIG_PIPE, CAPTURE_SOCKET, PIPE_SIZE, Listener, StreamerError, dump_pipe_size, read_request, recv_pipe


STATS = "stats-dump"
MAX_STATS = 1 << 16  # a real one is ~100 bytes


class _PipeReader:
    """A pipe read to EOF; readinto fills VIEW unless the writer closed first (storage.fs.fdread: in C,
    without taking the GIL back after every pipeful, where NATIVE)."""

    def __init__(self, fd: int, native: bool = True) -> None:
        self.fd, self.native = fd, native

    def readinto(self, view: memoryview) -> int:
        return fdread.read_full(self.fd, view, self.native)


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
        self._pipe_size = dump_pipe_size()  # checked already by criu_dump, before anything was frozen
        self._native_reads = fdread.way() == "native"  # likewise
        self._listener = Listener(directory, CAPTURE_SOCKET)
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
                    name = read_request(conn)
                    if name is None:
                        break
                    page_image = is_page_image(name)
                    fd = recv_pipe(conn, writable=False, size=self._pipe_size if page_image else BIG_PIPE)
                    if page_image:
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
                b = os.read(fd, PIPE_SIZE)
                if not b:
                    break
                parts.append(b)
        except OSError as e:
            self._error = StreamerError(f"reading image {name} from CRIU: {e.strerror}")
        finally:
            os.close(fd)
        self._small[name] = b"".join(parts)

    def _stats(self) -> None:
        """CRIU's own statistics (stats-dump: the pages it wrote, its timings), which it writes as a file
        into its directory rather than through the streamer, kept with the images as the staging path
        keeps them (`crit show`, zdtm's page-count check)."""
        try:
            fd = os.open(os.path.join(os.path.dirname(self._listener.path), STATS), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_STATS + 1)
        if len(data) <= MAX_STATS and STATS not in self._small:
            self._small[STATS] = data

    @property
    def small_images(self) -> dict[str, bytes]:
        """The small images CRIU streamed (complete once CRIU has exited), by name."""
        return self._small

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
        self._stats()
        for name in sorted(self._small):
            yield self._spec(name, len(self._small[name]))

    @contextmanager
    def open(self, spec: StreamSpec) -> Iterator[_PipeReader | _BytesReader]:
        name = spec.name.partition("/")[2]
        if name in self._fds:
            fd = self._fds[name]
            try:
                yield _PipeReader(fd, self._native_reads)
            finally:
                os.close(self._fds.pop(name))
        else:
            yield _BytesReader(self._small[name])
