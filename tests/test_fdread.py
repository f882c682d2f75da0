"""storage.fs.fdread: a descriptor read until a buffer is full, in C and in Python's loop, alike."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest

from storage.fs import fdread

F_SETPIPE_SZ = 1031
WAYS = [True, False]
IDS = ["c", "python"]


def test_built() -> None:
    if os.environ.get("GPUSNAP_NO_NATIVE") or os.environ.get("GPUSNAP_FD_READ"):
        pytest.skip("$GPUSNAP_NO_NATIVE or $GPUSNAP_FD_READ is set")
    assert fdread.way() == "native", "storage/native/libgpusnap_fdread.so is not built (python3 -m storage.native.build)"


def _writer(w: int, data: bytes, piece: int) -> threading.Thread:
    def run() -> None:
        try:
            for off in range(0, len(data), piece):
                os.write(w, data[off:off + piece])
        finally:
            os.close(w)
    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("native", WAYS, ids=IDS)
@pytest.mark.parametrize("size,piece,block", [(3 << 20, 4096 + 3, 1 << 20), (5 << 20, 1 << 20, 2 << 20),
                                              (1000, 7, 4096), (0, 1, 4096)])
def test_blocks_are_filled_across_short_reads_and_the_last_one_ends_at_eof(native: bool, size: int, piece: int,
                                                                           block: int) -> None:
    """A small pipe (one page here) gives a read at most what it holds: every block but the last is
    full, the last holds the rest, then 0; the bytes are the writer's, in order."""
    data = os.urandom(size)
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    t = _writer(w, data, piece)
    got = bytearray()
    buf = bytearray(block + 64)
    try:
        while True:
            buf[block:] = b"\xaa" * 64
            n = fdread.read_full(r, memoryview(buf)[:block], native)
            assert buf[block:] == b"\xaa" * 64  # nothing past the view
            got += buf[:n]
            if n < block:
                assert fdread.read_full(r, memoryview(buf)[:block], native) == 0
                break
    finally:
        t.join()
        os.close(r)
    assert bytes(got) == data


@pytest.mark.parametrize("native", WAYS, ids=IDS)
def test_a_failed_read_raises_with_its_errno(native: bool) -> None:
    r, w = os.pipe()
    os.close(r)
    try:
        with pytest.raises(OSError) as e:
            fdread.read_full(w, memoryview(bytearray(4096)), native)  # a pipe's write end cannot be read
        assert e.value.errno == errno.EBADF
    finally:
        os.close(w)


def test_an_empty_view_reads_nothing() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b"x")
        assert fdread.read_full(r, memoryview(bytearray(0))) == 0
        assert os.read(r, 1) == b"x"  # left for the next read
    finally:
        os.close(r)
        os.close(w)


def test_the_setting_chooses_the_loop_and_refuses_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_FD_READ", "python")
    assert fdread.way() == "python" and fdread.describe() == "Python (GPUSNAP_FD_READ=python)"
    monkeypatch.setenv("GPUSNAP_FD_READ", "fast")
    with pytest.raises(fdread.FdReadError, match="GPUSNAP_FD_READ='fast': expected native or python"):
        fdread.way()


class _Signalled(Exception):
    pass


@contextmanager
def _sigusr1(handler: Callable[[int, Any], None]) -> Iterator[Callable[[], None]]:
    """SIGUSR1 handled by HANDLER for the block; yields a function that sends it to this (the main) thread."""
    main = threading.get_ident()
    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield lambda: signal.pthread_kill(main, signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, old)


def _raise(*_: object) -> None:
    raise _Signalled()


def _stalling_writer(w: int, nbytes: int, stall_s: float) -> int:
    """A child that writes NBYTES into W as fast as the reader takes them, then holds W open for
    STALL_S seconds (CRIU stuck) and exits; its pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            block = b"\x5a" * (1 << 20)
            for off in range(0, nbytes, len(block)):
                os.write(w, block[:min(len(block), nbytes - off)])
            time.sleep(stall_s)
        finally:
            os._exit(0)
    return pid


@pytest.mark.parametrize("native", WAYS, ids=IDS)
@pytest.mark.parametrize("when", ["while-a-read-waits", "while-data-flows"])
def test_a_signal_reaches_its_handler_while_the_writer_stalls(native: bool, when: str) -> None:
    """A writer that sends some bytes and then stalls with its end open (CRIU stuck): a signal's
    Python handler runs and its exception ends the read within a second of the stall, whether the
    signal came while a read waited (EINTR) or while data was still flowing (the loop must not go on
    into a read that waits without going back to Python first). The writer gives up after 4 s, so a
    wrong loop fails the time bound instead of hanging."""
    r, w = os.pipe()
    nbytes = 1000 if when == "while-a-read-waits" else 64 << 20
    pid = _stalling_writer(w, nbytes, stall_s=4.0)
    os.close(w)
    try:
        view = memoryview(bytearray(nbytes + (1 << 20)))
        with _sigusr1(_raise) as send:
            t0 = time.monotonic()
            with pytest.raises(_Signalled):
                threading.Timer(0.3 if when == "while-a-read-waits" else 0.005, send).start()
                fdread.read_full(r, view, native)
            assert time.monotonic() - t0 < 2.5
    finally:
        os.close(r)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.mark.parametrize("native", WAYS, ids=IDS)
def test_signals_whose_handlers_return_lose_no_bytes(native: bool) -> None:
    """Signals every millisecond while a slow writer sends 8 MiB in odd pieces: handlers that return
    leave the stream whole and in order."""
    data = os.urandom(8 << 20)
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    t = _writer(w, data, 12289)
    seen = [0]
    done = threading.Event()

    def count(*_: object) -> None:
        seen[0] += 1

    got = bytearray()
    buf = bytearray(1 << 20)
    try:
        with _sigusr1(count) as send:
            def storm() -> None:
                while not done.wait(0.001):
                    send()
            s = threading.Thread(target=storm)
            s.start()
            try:
                while True:
                    n = fdread.read_full(r, memoryview(buf), native)
                    got += buf[:n]
                    if n < len(buf):
                        break
            finally:
                done.set()
                s.join()
    finally:
        t.join()
        os.close(r)
    assert bytes(got) == data and seen[0] > 0
