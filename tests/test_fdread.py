"""storage.fdread: a descriptor read until a buffer is full, in C and in Python's loop, alike."""
from __future__ import annotations

import errno
import fcntl
import os
import threading

import pytest

from storage import fdread

F_SETPIPE_SZ = 1031
WAYS = [True, False]
IDS = ["c", "python"]


def test_built() -> None:
    if os.environ.get("GPUSNAP_NO_NATIVE"):
        pytest.skip("$GPUSNAP_NO_NATIVE is set")
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


class _Alarm(Exception):
    pass


@pytest.mark.parametrize("native", WAYS, ids=IDS)
def test_a_signal_reaches_its_handler_while_the_writer_stalls(native: bool) -> None:
    """A writer that has written some bytes and then stalls (CRIU stuck): a signal's Python handler
    runs during the read and its exception ends it (as SIGTERM does a dump), not the writer."""
    import signal
    import time
    r, w = os.pipe()
    old = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Alarm()))
    try:
        os.write(w, b"x" * 1000)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(_Alarm):
            fdread.read_full(r, memoryview(bytearray(1 << 20)), native)
        assert time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        os.close(r)
        os.close(w)
