"""A descriptor read until a buffer is full, without going back to Python while data is ready
(storage/native/fdread.c).

Why: the dump reads each page image from CRIU's pipe in 32 MiB blocks. A pipe gives at most what it
holds per read, 1 MiB where fs.pipe-max-size is the kernel's default (the GPU hosts we measure on),
so a Python loop over os.readv made ~32 reads per block and took the GIL back after each one, beside
the put's worker threads. CRIU's log of a 40 GB dump on an H100 host showed each 1 MiB splice into
gpusnap's pipe taking 0.3-0.4 ms, with gpusnap's reader in its reads 89% of the dump; the GIL's
hand-overs were the suspect. In C the reads follow each other without it. Measured in one run
(BENCHMARKS.md section 38): CRIU's time in its transfers 12.8-14.0 s with C, 14.4 s with Python's
loop, and the whole dump the same either way (37.3-39.2 s against 38.0 s): the hand-overs were not
what bounds it there. Kept: no slower in that run. (The version measured went back to Python only
once per block; this one also goes back whenever the pipe has run dry, see below, and ran on no GPU.)

`read_full` falls back to the Python loop, with the same result, where the library is not there
(no compiler at setup, $GPUSNAP_NO_NATIVE) or the view is not one ctypes can address (read-only,
strided), or where $GPUSNAP_FD_READ=python asks for it (for measuring).

Guarantees kept here: at most len(VIEW) bytes are written, into VIEW only (the length passed is the
view's own); fewer are read only at end of file; a failed read raises OSError with its errno; a
signal's Python handler never waits for a stalled writer: the C loop goes back to Python whenever
a read is interrupted and before any read that would wait (so the GIL is taken back only when the
pipe has run dry, or once per block).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

from storage import native
from storage.fs.directio import address_of
from storage.base.errors import GpusnapError
from storage.base.settings import setting

LIBRARY = native.path_of("libgpusnap_fdread.so")
ABI = 3  # gs_fdread_version() of the library this module was written for
WAYS = ("native", "python")


class FdReadError(GpusnapError):
    """A bad $GPUSNAP_FD_READ."""


def _load(path: str = LIBRARY) -> Any:
    return native.load(path, "gs_fdread_version", ABI,
                       [("gs_read_full", ctypes.c_long,
                         [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int)])])


_lib = _load()


def _asked() -> str:
    asked: str = setting("GPUSNAP_FD_READ", "native", str, lambda v: v in WAYS, " or ".join(WAYS), FdReadError)
    return asked


def way() -> str:
    """How read_full reads: "native" (the C loop, when the library is there) or "python";
    $GPUSNAP_FD_READ=python chooses the Python loop (FdReadError for another value)."""
    return "native" if _asked() == "native" and _lib is not None else "python"


def describe() -> str:
    """way() in words, with why it is Python where it is (gpusnap doctor)."""
    if way() == "native":
        return "C"
    if _asked() == "python":
        return "Python (GPUSNAP_FD_READ=python)"
    return "Python (storage/native's libgpusnap_fdread.so not loaded: python3 -m storage.native.build)"


def read_full(fd: int, view: memoryview, use_native: bool = True) -> int:
    """Read FD into VIEW until it is full or the writer is done; the bytes read (fewer than
    len(VIEW) only at end of file). USE_NATIVE False: the Python loop (see way())."""
    if use_native and _lib is not None and len(view) and not view.readonly and view.c_contiguous \
            and view.format == "B" and view.ndim == 1:
        base, want, got = address_of(view), len(view), 0
        again = ctypes.c_int(0)
        while got < want:
            n = int(_lib.gs_read_full(fd, base + got, want - got, ctypes.byref(again)))
            if n < 0:
                raise OSError(-n, os.strerror(-n))
            got += n
            if not again.value:
                break  # full, or the writer is done
            # the pipe ran dry or a signal came: back here a pending handler runs (SIGTERM raises in
            # the main thread) before the next read waits
        return got
    got = 0
    while got < len(view):
        k = os.readv(fd, [view[got:]])  # EINTR retried by Python itself (PEP 475)
        if k == 0:
            break
        got += k
    return got

