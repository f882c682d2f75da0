"""The byte planes of 2-byte and 4-byte elements in C (storage/native/shuffle2.c), one call per plane, the GIL
released.

Why: storage.codecs.registry.Shuffle2Codec split and merged planes with numpy, five array operations per
block of each chunk. Each operation takes the GIL back when it returns, and under the put's sixteen
threads those hand-overs, not the arithmetic, were the cost: a profile of a second dump on the H200
found 30% of its workers' time in the split and the merge (BENCHMARKS.md section 30). One pass in C
does the same work 4-6x faster on one thread (a 4 MiB chunk: numpy 5 GB/s, C 24-33 GB/s on the dev
VM) and releases the GIL once.

A decode goes further: `decode_planes` decodes both planes' zstd frames (through the libzstd that
storage.codecs.zstdlib loaded) and merges them in one call, one hand-over of the GIL instead of three.
Beside a thread that runs Python, each hand-over can cost that thread's switch interval: on the dev
VM a 4 MiB bf16 chunk's verified decode took 18 ms there in three calls and 12 ms in one (1.6 ms
alone either way). `merge_views` and `decode_planes` take plain byte views, so a restore decodes
without loading numpy.

`plane` and `merge` return False, `merge_views` False and `decode_planes` None, when the library is
not there (not built: no compiler at setup; or $GPUSNAP_NO_NATIVE set, for measuring) or the
buffers are not what the C functions take (other dtypes, strided, overlapping, read-only); the
caller then does it step by step (numpy for the planes), with the same result. The library is
loaded as storage.native.load loads every native helper (from storage/native/ only, a regular file
of root or this user that no one else may write).

Guarantees kept here: the C functions read exactly N elements and write exactly N bytes (or
elements), N taken from the buffers' own sizes, checked here before the call; `decode_planes`
writes only its output (2 * N bytes) and its scratch (N bytes per zstd plane), never over an
input, and a frame that does not decode to exactly N bytes fails the call (libzstd checks the
capacity it is given).
"""
from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from storage import native
from storage.fs.directio import address_of

if TYPE_CHECKING:
    import numpy as np

LIBRARY = native.path_of("libgpusnap_shuffle2.so")
ABI = 3  # gs_shuffle2_version() of the library this module was written for (3: the 4-byte planes too)


def _load(path: str = LIBRARY) -> Any:
    """The library at PATH with its functions' signatures set, or None (storage/native: native.load)."""
    vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
    return native.load(path, "gs_shuffle2_version", ABI, [
        ("gs_shuffle2_plane", None, [vp, sz, i, i, vp]),
        ("gs_shuffle2_merge", None, [vp, vp, sz, i, vp]),
        ("gs_shuffle2_decode", i, [vp, sz, i, vp, sz, i, sz, i, vp, vp, vp, vp]),
        ("gs_shuffle4_plane", None, [vp, sz, i, vp]),
        ("gs_shuffle4_merge", None, [vp, vp, vp, vp, sz, vp]),
        ("gs_shuffle4_decode", i, [vp, vp, vp, sz, vp, vp, vp, vp])])


_lib = _load()


def available() -> bool:
    """Whether the C planes are used (built, loadable, not turned off)."""
    return _lib is not None


def _addr(a: "np.ndarray") -> int:
    return int(a.__array_interface__["data"][0])


def _flat(a: "np.ndarray", itemsize: int, writable: bool = False) -> bool:
    return (a.ndim == 1 and a.itemsize == itemsize and a.dtype.kind == "u" and a.flags.c_contiguous
            and (not writable or a.flags.writeable))


def _spans_apart(*spans: tuple[int, int]) -> bool:
    """Whether no two of SPANS ((start, end) addresses; empty ones left out) share a byte."""
    ordered = sorted(sp for sp in spans if sp[1] > sp[0])
    return all(e <= s for (_, e), (s, _) in zip(ordered, ordered[1:]))


def _apart(*arrays: "np.ndarray") -> bool:
    return _spans_apart(*((_addr(a), _addr(a) + a.nbytes) for a in arrays))


def plane(a: "np.ndarray", which: int, into: "np.ndarray", layout: int) -> bool:
    """Plane WHICH (0 low bytes, 1 high) of the uint16 elements A in LAYOUT (1 or 2) into INTO (uint8,
    as many as A has): True when done here, False when the caller must (see the module's doc)."""
    if (_lib is None or layout not in (1, 2) or which not in (0, 1) or not _flat(a, 2) or not _flat(into, 1, True)
            or into.size != a.size or not _apart(a, into)):
        return False
    if a.size:
        _lib.gs_shuffle2_plane(_addr(a), a.size, which, layout, _addr(into))
    return True


def merge(lo: "np.ndarray", hi: "np.ndarray", out: "np.ndarray", layout: int) -> bool:
    """The uint16 elements OUT from their planes LO and HI (uint8, as many as OUT has) in LAYOUT: True
    when done here, False when the caller must."""
    if (_lib is None or layout not in (1, 2) or not _flat(lo, 1) or not _flat(hi, 1) or not _flat(out, 2, True)
            or not lo.size == hi.size == out.size or not _apart(lo, out) or not _apart(hi, out)):
        return False
    if out.size:
        _lib.gs_shuffle2_merge(_addr(lo), _addr(hi), out.size, layout, _addr(out))
    return True


def _address(view: memoryview) -> int | None:
    """The address of VIEW's first byte: a C-contiguous byte view of writable memory (ctypes takes no
    other without numpy); None for anything else (the caller then uses the numpy path)."""
    if view.format != "B" or view.ndim != 1 or not view.c_contiguous or view.readonly or not len(view):
        return None
    try:
        return address_of(view)  # a writable view: through ctypes, no numpy
    except (TypeError, ValueError, BufferError):
        return None


def decode_planes(p0: memoryview, k0: int, p1: memoryview, k1: int, layout: int, scratch: memoryview,
                  out: memoryview, dctx: int, decompress: int) -> int | None:
    """A shuffle2 payload's planes P0 and P1 (kind 0: stored, len(OUT) // 2 bytes; kind 1: one zstd frame the
    caller has checked declares that many and spans the view) decoded and merged into OUT in LAYOUT, in
    one C call: zstd's frames through DECOMPRESS (libzstd's ZSTD_decompressDCtx, storage.codecs.zstdlib) with
    the context DCTX, into SCRATCH (len(OUT) // 2 bytes per zstd plane). 0 when done; -1 or -2 when
    plane 0 or 1 did not decode to its size; None where the caller must do it (no library, a view
    that is read-only, strided or overlapping, other lengths)."""
    h = len(out) // 2
    if (_lib is None or layout not in (1, 2) or k0 not in (0, 1) or k1 not in (0, 1) or not h or len(out) % 2
            or len(scratch) < h * (k0 + k1) or (not k0 and len(p0) != h) or (not k1 and len(p1) != h)
            or not dctx or not decompress):
        return None
    at = [_address(v) for v in (p0, p1, scratch, out)]
    if None in at:
        return None
    a0, a1, a_s, a_out = (int(a) for a in at if a is not None)
    if a_out % 2:
        return None  # the C code writes 2-byte elements: an aligned output only
    s0, s1, ss, so = (a0, a0 + len(p0)), (a1, a1 + len(p1)), (a_s, a_s + h * (k0 + k1)), (a_out, a_out + 2 * h)
    if not all(_spans_apart(so, sp) for sp in (s0, s1, ss)):
        return None  # the output over an input or the scratch
    if not all(_spans_apart(ss, sp) for sp in (s0, s1)):
        return None  # the scratch over a plane
    rc: int = _lib.gs_shuffle2_decode(a0, len(p0), k0, a1, len(p1), k1, h, layout, a_s, a_out, dctx, decompress)
    return rc


def merge_views(lo: memoryview, hi: memoryview, out: memoryview, layout: int) -> bool:
    """merge on plain byte views (no numpy: a restore decodes without loading it): OUT's 2-byte elements
    from the planes LO and HI, each len(OUT) // 2 bytes. True when done here; False where the caller
    must merge (no library, a read-only or strided view, overlapping views, other lengths)."""
    if _lib is None or layout not in (1, 2) or len(out) % 2 or not len(lo) == len(hi) == len(out) // 2:
        return False
    if not len(out):
        return True
    at = [_address(v) for v in (lo, hi, out)]
    if None in at:
        return False
    a_lo, a_hi, a_out = (int(a) for a in at if a is not None)
    if a_out % 2:
        return False  # the C code writes 2-byte elements: an aligned output only
    n = len(lo)
    so = (a_out, a_out + 2 * n)
    if not (_spans_apart(so, (a_lo, a_lo + n)) and _spans_apart(so, (a_hi, a_hi + n))):
        return False
    _lib.gs_shuffle2_merge(a_lo, a_hi, n, layout, a_out)
    return True


def plane4(a: "np.ndarray", which: int, into: "np.ndarray") -> bool:
    """Plane WHICH (0..3: byte WHICH of each little-endian element) of the uint32 elements A into INTO
    (uint8, as many as A has): True when done here, False when the caller must."""
    if (_lib is None or which not in (0, 1, 2, 3) or not _flat(a, 4) or _addr(a) % 4 or not _flat(into, 1, True)
            or into.size != a.size or not _apart(a, into)):
        return False
    if a.size:
        _lib.gs_shuffle4_plane(_addr(a), a.size, which, _addr(into))
    return True


def merge4(planes: list["np.ndarray"], out: "np.ndarray") -> bool:
    """The uint32 elements OUT from their four byte PLANES (uint8, as many as OUT has each): True when
    done here, False when the caller must. Takes read-only planes (merge4_views does not)."""
    if (_lib is None or len(planes) != 4 or not _flat(out, 4, True) or _addr(out) % 4
            or any(not _flat(p, 1) for p in planes)
            or any(p.size != out.size for p in planes) or not all(_apart(p, out) for p in planes)):
        return False
    if out.size:
        _lib.gs_shuffle4_merge(*(_addr(p) for p in planes), out.size, _addr(out))
    return True


def _planes_and_out(planes: list[memoryview], out: memoryview) -> tuple[list[int], int] | None:
    """The addresses of four planes of len(OUT) // 4 bytes each and of OUT (writable, 4-byte aligned, over
    no plane): what the C merge takes; None where it cannot."""
    q = len(out) // 4
    if len(planes) != 4 or len(out) % 4 or any(len(v) != q for v in planes) or not q:
        return None
    at = [_address(v) for v in (*planes, out)]
    if None in at:
        return None
    a = [int(x) for x in at if x is not None]
    if a[4] % 4 or not all(_spans_apart((a[4], a[4] + 4 * q), (x, x + q)) for x in a[:4]):
        return None
    return a[:4], a[4]


def merge4_views(planes: list[memoryview], out: memoryview) -> bool:
    """OUT's 4-byte elements from their four byte PLANES (len(OUT) // 4 bytes each), in C: True when done
    here; False where the caller must (no library, read-only, strided or overlapping views, other lengths)."""
    if _lib is None:
        return False
    got = _planes_and_out(planes, out)
    if got is None:
        return False
    p, a_out = got
    _lib.gs_shuffle4_merge(p[0], p[1], p[2], p[3], len(out) // 4, a_out)
    return True


def decode_planes4(stored: list[memoryview], kinds: list[int], scratch: memoryview, out: memoryview,
                   dctx: int, decompress: int) -> int | None:
    """A shuffle4 payload's four planes STORED (kind 0: len(OUT) // 4 bytes as they are; kind 1: one zstd
    frame the caller has checked declares that many and spans its view) decoded and merged into OUT in
    one C call, zstd planes into SCRATCH (len(OUT) // 4 bytes per zstd plane) through DECOMPRESS with
    DCTX, as decode_planes. 0 when done; -1 - K when plane K did not decode to its size; None where the
    caller must do it."""
    q = len(out) // 4
    nz = sum(kinds)
    if (_lib is None or len(stored) != 4 or len(kinds) != 4 or any(k not in (0, 1) for k in kinds) or not q
            or len(out) % 4 or len(scratch) < q * nz or any(not k and len(v) != q for v, k in zip(stored, kinds))
            or not dctx or not decompress):
        return None
    at = [_address(v) for v in (*stored, scratch, out)]
    if None in at:
        return None
    a = [int(x) for x in at if x is not None]
    a_s, a_out = a[4], a[5]
    if a_out % 4:
        return None
    spans = [(x, x + len(v)) for x, v in zip(a[:4], stored)]
    so, ss = (a_out, a_out + 4 * q), (a_s, a_s + q * nz)
    if not all(_spans_apart(so, sp) and _spans_apart(ss, sp) for sp in spans) or not _spans_apart(so, ss):
        return None
    ptrs = (ctypes.c_void_p * 4)(*a[:4])
    lens = (ctypes.c_size_t * 4)(*(len(v) for v in stored))
    ks = (ctypes.c_int * 4)(*kinds)
    rc: int = _lib.gs_shuffle4_decode(ptrs, lens, ks, q, a_s, a_out, dctx, decompress)
    return rc

