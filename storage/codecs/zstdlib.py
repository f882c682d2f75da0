"""zstd through the system's libzstd: compress into and decompress into buffers the caller owns, the GIL released.

Why not only python-zstandard (which the store also uses, and which this module falls back to): its
compress() and decompress() return a new bytes object per call. On the host path that is a fresh
multi-MiB allocation per chunk plane, and under many threads those allocations (page faults, and
the unmaps' TLB shootdowns across every core) are what stopped the byte-plane codec from scaling:
on the 16-core H200 host it encoded 0.98 GB/s on one thread and only 2.9 GB/s on sixteen, where
zstd alone scaled to 6.8 (BENCHMARKS.md, section 13). Here a compression writes into the chunk's
frame and a decompression into its destination, nothing is allocated per call, and ctypes releases
the GIL for the whole call.

Guarantees kept here: a decompression never writes outside the destination view it is given and
returns its size or raises ZstdLibError (libzstd checks the capacity itself); a payload is decoded
only once its frame header declares exactly the expected size and the frame spans the whole
payload (one frame, nothing after it); a compression that does not fit the capacity given (the
caller's "pays off" bound) is reported as None, never truncated. Contexts are pooled (at most one
per concurrent caller), never shared between threads at once.

`available()` says whether libzstd was found (libzstd.so.1; every Debian and Ubuntu has it: apt
links it) and is not turned off ($GPUSNAP_NO_LIBZSTD set). Without it codecs.py uses
python-zstandard's calls, which write and read the same frames.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from storage.fs.directio import address_of
from storage.base.errors import GpusnapError

# libzstd's stable parameter ids (zstd.h, ZSTD_cParameter) and strategy values
C_LEVEL, C_WINDOW_LOG, C_HASH_LOG, C_CHAIN_LOG, C_SEARCH_LOG, C_MIN_MATCH, C_STRATEGY = 100, 101, 102, 103, 104, 105, 107
C_CONTENT_SIZE, C_CHECKSUM = 200, 201
STRATEGIES = {"fast": 1, "dfast": 2, "greedy": 3, "lazy": 4, "lazy2": 5, "btlazy2": 6, "btopt": 7}
_UNKNOWN, _ERROR = (1 << 64) - 1, (1 << 64) - 2  # ZSTD_CONTENTSIZE_UNKNOWN / _ERROR
_DST_TOO_SMALL = 70                              # ZSTD_error_dstSize_tooSmall
_PARAMS = {"window_log": C_WINDOW_LOG, "hash_log": C_HASH_LOG, "chain_log": C_CHAIN_LOG,
           "search_log": C_SEARCH_LOG, "min_match": C_MIN_MATCH}


class ZstdLibError(GpusnapError):
    """libzstd refused a payload or a parameter."""


def _load() -> Any:
    if os.environ.get("GPUSNAP_NO_LIBZSTD"):  # python-zstandard only (a comparison, or a libzstd to avoid)
        return None
    name = ctypes.util.find_library("zstd") or "libzstd.so.1"
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        try:
            lib = ctypes.CDLL("libzstd.so.1")
        except OSError:
            return None
    sz, vp, u = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_uint
    for fn, res, args in (
            ("ZSTD_versionNumber", u, []),
            ("ZSTD_createCCtx", vp, []), ("ZSTD_freeCCtx", sz, [vp]),
            ("ZSTD_createDCtx", vp, []), ("ZSTD_freeDCtx", sz, [vp]),
            ("ZSTD_CCtx_setParameter", sz, [vp, ctypes.c_int, ctypes.c_int]),
            ("ZSTD_compress2", sz, [vp, vp, sz, vp, sz]),
            ("ZSTD_decompressDCtx", sz, [vp, vp, sz, vp, sz]),
            ("ZSTD_getFrameContentSize", ctypes.c_ulonglong, [vp, sz]),
            ("ZSTD_findFrameCompressedSize", sz, [vp, sz]),
            ("ZSTD_isError", u, [sz]), ("ZSTD_getErrorCode", ctypes.c_int, [sz]),
            ("ZSTD_getErrorName", ctypes.c_char_p, [sz])):
        f = getattr(lib, fn, None)
        if f is None:
            return None
        f.restype, f.argtypes = res, args
    if lib.ZSTD_versionNumber() < 10400:  # the advanced API (setParameter, compress2) is stable from 1.4.0
        return None
    return lib


def _quick(lib: Any) -> Any:
    """LIB's functions that return at once (a frame header read, an error code's meaning) through a
    handle that keeps the GIL: giving it up for them cost a hand-over each, and beside a thread that
    runs Python, taking it back can wait for that thread's switch interval (sys.getswitchinterval)."""
    if lib is None:
        return None
    try:
        quick = ctypes.PyDLL(lib._name)  # the same loaded library, called without releasing the GIL
    except OSError:
        return lib  # as before: each of these calls gives the GIL up
    for fn in ("ZSTD_getFrameContentSize", "ZSTD_findFrameCompressedSize", "ZSTD_isError", "ZSTD_getErrorCode",
               "ZSTD_getErrorName"):
        src, f = getattr(lib, fn), getattr(quick, fn)
        f.restype, f.argtypes = src.restype, src.argtypes
    return quick


_LIB = _load()
_Q = _quick(_LIB)
# ZSTD_decompressDCtx's address, for native code that decodes frames inside a larger call (storage/shufflelib)
DECOMPRESS_DCTX: int | None = ctypes.cast(_LIB.ZSTD_decompressDCtx, ctypes.c_void_p).value if _LIB is not None else None


def available() -> bool:
    """Whether libzstd is loaded here."""
    return _LIB is not None


def version() -> str:
    v = _LIB.ZSTD_versionNumber() if _LIB is not None else 0
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v else "absent"


def _err(code: int) -> str:
    return _Q.ZSTD_getErrorName(code).decode("ascii", "replace")


class _Pool:
    """Contexts made on demand, handed to one caller at a time, kept for the next (never freed: at most
    one per caller that ever ran at once, a few hundred KiB each)."""

    def __init__(self, make: Any) -> None:
        self._make = make
        self._idle: list[int] = []
        self._lock = threading.Lock()

    @contextmanager
    def ctx(self) -> Iterator[int]:
        with self._lock:
            c = self._idle.pop() if self._idle else None
        if c is None:
            c = self._make()
            if not c:
                raise MemoryError("libzstd could not allocate a context")
        try:
            yield c
        finally:
            with self._lock:
                self._idle.append(c)


class Compressor:
    """One compression setting (a level, or explicit parameters), usable from any number of threads."""

    def __init__(self, level: int = 1, params: dict[str, Any] | None = None) -> None:
        if _LIB is None:
            raise ZstdLibError("libzstd is not available here")
        settings: list[tuple[int, int]] = [(C_CONTENT_SIZE, 1), (C_CHECKSUM, 0)]
        if params is None:
            settings.append((C_LEVEL, level))
        else:
            for k, v in params.items():
                if k == "strategy":
                    settings.append((C_STRATEGY, STRATEGIES[str(v)]))
                else:
                    settings.append((_PARAMS[k], int(v)))
        self._settings = settings
        self._pool = _Pool(self._new)

    def _new(self) -> int:
        c = _LIB.ZSTD_createCCtx()
        for p, v in self._settings:
            r = _LIB.ZSTD_CCtx_setParameter(c, p, v)
            if _LIB.ZSTD_isError(r):
                _LIB.ZSTD_freeCCtx(c)
                raise ZstdLibError(f"zstd parameter {p}={v}: {_err(r)}")
        return c

    def compress_into(self, src: memoryview, dst: memoryview) -> int | None:
        """SRC compressed into DST as one frame (its content size recorded); its length, or None when
        the frame would not fit in len(DST) bytes (DST is then garbage)."""
        if len(dst) == 0:
            return None
        with self._pool.ctx() as c:
            r = _LIB.ZSTD_compress2(c, address_of(dst), len(dst), address_of(src) if len(src) else None, len(src))
        if _Q.ZSTD_isError(r):
            if _Q.ZSTD_getErrorCode(r) == _DST_TOO_SMALL:
                return None
            raise ZstdLibError(f"zstd compression failed: {_err(r)}")
        return int(r)


_DCTX = _Pool(lambda: _LIB.ZSTD_createDCtx()) if _LIB is not None else None


@contextmanager
def dctx() -> Iterator[int]:
    """A decompression context of the pool, this caller's alone until the block ends."""
    if _DCTX is None:
        raise ZstdLibError("libzstd is not available here")
    with _DCTX.ctx() as d:
        yield d


def frame_content_size(payload: memoryview) -> int | None:
    """The content size PAYLOAD's first frame header declares; None when it declares none or is not a frame."""
    if _Q is None or len(payload) == 0:
        return None
    r = _Q.ZSTD_getFrameContentSize(address_of(payload), len(payload))
    return None if r in (_UNKNOWN, _ERROR) else int(r)


QUICK_SPAN_MOST = 64 << 10  # check_frame walks a frame of at most this many bytes with the GIL kept


ZSTD_MAGIC = 0xFD2FB528


def _declared_check(declared: int | None, n: int) -> None:
    if declared is None:
        raise ZstdLibError("zstd payload is not a frame that declares its size")
    if declared > n:
        raise ZstdLibError(f"zstd payload decodes to more than the {n} bytes expected (its frame declares {declared})")
    if declared < n:
        raise ZstdLibError(f"zstd payload decoded to {declared} bytes, expected {n} (as its frame declares)")


def frame_layout(payload: memoryview) -> tuple[int | None, int]:
    """The content size PAYLOAD's frame header declares (None: none) and the length of that frame, read
    from its header and block headers as libzstd's ZSTD_getFrameContentSize and ZSTD_findFrameCompressedSize
    read them (RFC 8878, section 3.1.1); ZstdLibError for anything but a zstd frame (a skippable frame,
    another magic, reserved bits set, a reserved block type, a frame cut short). Pure Python: the
    decode path without libzstd accepts exactly the frames the libzstd path does (check_frame)."""
    m = len(payload)
    if m < 6 or int.from_bytes(payload[0:4], "little") != ZSTD_MAGIC:
        raise ZstdLibError("zstd payload is not a zstd frame")
    fhd = payload[4]
    if fhd & 0x08:
        raise ZstdLibError("zstd frame is malformed: reserved bit set in its header")
    single, checksum, did = (fhd >> 5) & 1, (fhd >> 2) & 1, fhd & 3
    fcs_len = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    pos = 5 + (0 if single else 1) + (0, 1, 2, 4)[did]
    if m < pos + fcs_len:
        raise ZstdLibError("zstd frame is malformed: its header is cut short")
    declared = None
    if fcs_len:
        declared = int.from_bytes(payload[pos:pos + fcs_len], "little") + (256 if fcs_len == 2 else 0)
    pos += fcs_len
    while True:
        if pos + 3 > m:
            raise ZstdLibError("zstd frame is malformed: a block header is cut short")
        h = int.from_bytes(payload[pos:pos + 3], "little")
        pos += 3
        kind = (h >> 1) & 3
        if kind == 3:
            raise ZstdLibError("zstd frame is malformed: reserved block type")
        pos += 1 if kind == 1 else h >> 3
        if pos > m:
            raise ZstdLibError("zstd frame is malformed: a block is cut short")
        if h & 1:
            break
    pos += 4 if checksum else 0
    if pos > m:
        raise ZstdLibError("zstd frame is malformed: its checksum is cut short")
    return declared, pos


def check_frame_py(payload: memoryview, n: int) -> None:
    """check_frame's rules, without libzstd (frame_layout): exactly one zstd frame declaring N bytes."""
    if len(payload) == 0:
        raise ZstdLibError("empty zstd payload")
    declared, span = frame_layout(payload)
    _declared_check(declared, n)
    if span != len(payload):
        raise ZstdLibError("zstd payload is not exactly one frame")


def check_frame(payload: memoryview, n: int) -> int:
    """PAYLOAD's address once it is exactly one zstd frame (never a skippable one) that declares N bytes;
    ZstdLibError otherwise. The same frames pass check_frame_py."""
    if _Q is None:
        raise ZstdLibError("libzstd is not available here")
    m = len(payload)
    if m == 0:
        raise ZstdLibError("empty zstd payload")
    if m < 6 or int.from_bytes(payload[0:4], "little") != ZSTD_MAGIC or payload[4] & 0x08:
        raise ZstdLibError("zstd payload is not a zstd frame")  # (libzstd takes a skippable frame as one)
    src = address_of(payload)
    declared = _Q.ZSTD_getFrameContentSize(src, m)
    _declared_check(None if declared in (_UNKNOWN, _ERROR) else int(declared), n)
    # the walk over the frame's block headers costs what the payload's bytes say (a crafted frame of
    # millions of empty blocks: ~1 ns a byte): past a small payload, the GIL is given up for it
    span = (_Q if m <= QUICK_SPAN_MOST else _LIB).ZSTD_findFrameCompressedSize(src, m)
    if _Q.ZSTD_isError(span) or span != m:
        raise ZstdLibError("zstd payload is not exactly one frame" if not _Q.ZSTD_isError(span)
                           else f"zstd frame is malformed: {_err(span)}")
    return src


def decompress_into(payload: memoryview, dst: memoryview) -> int:
    """PAYLOAD (exactly one zstd frame declaring len(DST) bytes) decoded into DST; returns len(DST).
    ZstdLibError for anything else; nothing is written outside DST."""
    if _LIB is None:
        raise ZstdLibError("libzstd is not available here")
    n, m = len(dst), len(payload)
    src = check_frame(payload, n)
    with dctx() as d:
        r = _LIB.ZSTD_decompressDCtx(d, address_of(dst) if n else None, n, src, m)
    if _Q.ZSTD_isError(r):
        raise ZstdLibError(f"zstd payload does not decode: {_err(r)}")
    if r != n:
        raise ZstdLibError(f"zstd payload decoded to {r} bytes, expected {n}")
    return n
