"""A descriptor read until a buffer is full, the GIL released once per buffer (storage/native/fdread.c).

Why: the dump reads each page image from CRIU's pipe in 32 MiB blocks. A pipe gives at most what it
holds per read, 1 MiB where fs.pipe-max-size is the kernel's default (the GPU hosts we measure on),
so a Python loop over os.readv made ~32 reads per block, and took the GIL back after each one. Beside
the put's worker threads each taking back can wait for a worker's hand-over, and CRIU, whose page
pipe is then full, waits too: on an H100 host CRIU's log showed each 1 MiB splice into gpusnap's
pipe taking 0.3-0.4 ms (~2.5-3 GB/s) for the whole page dump, while gpusnap's reader spent 89% of
the dump in its reads. In C the reads follow each other without the GIL.

`read_full` falls back to the Python loop, with the same result, where the library is not there
(no compiler at setup, $GPUSNAP_NO_NATIVE) or the view is not one ctypes can address (read-only,
strided), or where $GPUSNAP_FD_READ=python asks for it (for measuring).

Guarantees kept here: at most len(VIEW) bytes are written, into VIEW only (the length passed is the
view's own); fewer are read only at end of file; a failed read raises OSError with its errno.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

from . import native
from .directio import address_of
from .errors import GpusnapError
from .settings import setting

LIBRARY = native.path_of("libgpusnap_fdread.so")
ABI = 1  # gs_fdread_version() of the library this module was written for
WAYS = ("native", "python")


class FdReadError(GpusnapError):
    """A bad $GPUSNAP_FD_READ."""


def _load(path: str = LIBRARY) -> Any:
    return native.load(path, "gs_fdread_version", ABI,
                       [("gs_read_full", ctypes.c_long, [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t])])


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
    return "Python (storage/native's libgpusnap_fdread.so not loaded)"


def read_full(fd: int, view: memoryview, use_native: bool = True) -> int:
    """Read FD into VIEW until it is full or the writer is done; the bytes read (fewer than
    len(VIEW) only at end of file). USE_NATIVE False: the Python loop (see way())."""
    if use_native and _lib is not None and len(view) and not view.readonly and view.c_contiguous \
            and view.format == "B" and view.ndim == 1:
        n = int(_lib.gs_read_full(fd, address_of(view), len(view)))
        if n < 0:
            raise OSError(-n, os.strerror(-n))
        return n
    got = 0
    while got < len(view):
        k = os.readv(fd, [view[got:]])  # EINTR retried by Python itself (PEP 475)
        if k == 0:
            break
        got += k
    return got

