"""Native helpers gpusnap builds from C at setup (storage/native/build.py) and loads through ctypes.

Each is optional: without it (no compiler at setup, or $GPUSNAP_NO_NATIVE set) the module that uses
it falls back to numpy, with the same results. `load` is the one way they are loaded: only from this
directory, only a regular file owned by root or this process's user that no one else may write,
only at the ABI version its caller was written for.
"""
from __future__ import annotations

import ctypes
import os
import stat
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))


def path_of(name: str) -> str:
    """Where the library NAME (e.g. "libgpusnap_shuffle2.so") is built and loaded from."""
    return os.path.join(HERE, name)


_HELD: list[int] = []  # descriptors of the libraries loaded (see load)


def load(path: str, version: str, abi: int, functions: Sequence[tuple[str, Any, Sequence[Any]]]) -> Any:
    """The library at PATH with FUNCTIONS' (name, restype, argtypes) set, if VERSION() returns ABI;
    None when it is turned off ($GPUSNAP_NO_NATIVE), missing, a link, writable by group or others,
    owned by anyone but root or this process's user (not loaded into a process that runs as root),
    not loadable, or another version."""
    if os.environ.get("GPUSNAP_NO_NATIVE"):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None  # missing, or a link
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                or st.st_uid not in (0, os.geteuid())):
            os.close(fd)
            return None  # another user's file may not run inside this process (root's, often)
        # loaded through the descriptor just checked: a file swapped in at PATH meanwhile is not the one loaded
        lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except OSError:
        os.close(fd)
        return None
    # the descriptor stays open while the process lives: the dynamic loader knows the library by the
    # name /proc/self/fd/N, and a later load through a reused N would be handed this library again
    _HELD.append(fd)
    try:
        v = getattr(lib, version)
        v.restype, v.argtypes = ctypes.c_int, []
        if v() != abi:
            return None
        for name, res, args in functions:
            f = getattr(lib, name)
            f.restype, f.argtypes = res, list(args)
    except (OSError, AttributeError):
        return None
    return lib
