"""Delta entries: a chunk stored as its raw bytes XOR a reference (compressed), the reference cut from full chunks of the store.

FORMAT.md, "Delta entries": a GSNPCHK2 entry of codec `xor-zstd` (id 3) whose payload is a segment
table and the encoding (one zstd frame, or since store version 5 a shuffle2-zstd payload, as the
table's byte 2 says) of exactly raw-length bytes: the chunk's raw bytes XOR its reference. The
reference is the concatenation of the table's segments (each a byte range of one base chunk's raw
bytes, or zeros), zero-extended to the raw length: for a new chunk of a dump, the bytes the parent
snapshot had where the chunk's bytes were (storage/pipeline/put.py places them). The chunk's id is still the raw id of its own
raw bytes, so the full check binds what a delta decodes to, whatever its bases said.

Guarantees kept here: a delta is decoded only against bases its reader verified (the BaseReader:
storage.repo.store.SnapshotStore.delta_base, which refuses a base that is itself a delta: depth 1, no
recursion); the table is bounded (MAX_SEGMENTS) and checked against the raw length before a base is
read; the frame never decodes to more than the chunk's raw length, nor into anything but the caller's
buffer; a segment never reads outside its base; every failure is a one-line DeltaDamage (chunkfile
makes it a ChunkError naming the delta; what was wrong with its base in the message).
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:  # imported where used: `store --help` and a listing load this module and need no numpy
    import numpy as np

from storage import native
from storage.codecs.registry import DELTA, SAMPLE_PIECE, SAMPLE_PIECES, HostCodecChooser, decode_host_into, CodecError
from storage.fs.directio import address_of
from storage.base.errors import DamageError
from storage.base.limits import MAX_RAW_CHUNK

MAX_SEGMENTS = 64              # a chunk of at most 4 MiB overlaps 3 parent chunks; 64 bounds a hostile table
_HEAD = struct.Struct("<HB5s")  # segment count, how the XOR is encoded (XOR_CODECS), reserved (zero)
XOR_CODECS = ("zstd", "shuffle2-zstd")  # byte 2 of the table -> the host codec of the XOR (1: store version 5)
_SEG = struct.Struct("<32sQQ")  # base id (32 zero bytes: zeros), offset in the base, length
MIN_FRAME = 9                  # the smallest zstd frame
TABLE_MAX = _HEAD.size + MAX_SEGMENTS * _SEG.size  # the most payload bytes before the frame
MIN_PAYLOAD = _HEAD.size + _SEG.size + MIN_FRAME   # one segment and the smallest frame
BASE_WHY = "its delta base"    # how a delta's damage through its base reads (verify keeps it out of quarantine)
_NO_BASE = bytes(32)

# (base id, the largest raw length the base may have) -> the base's raw bytes, verified
BaseReader = Callable[[str, int], "bytes | memoryview"]

_CHOOSER = HostCodecChooser()  # the XOR's encoding, as put picks a chunk's (its sample: non-zero pages)
_RESERVED = bytes(5)


class DeltaDamage(DamageError):
    """A delta entry that does not decode: WHAT says why (chunkfile.full_check names the chunk)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


@dataclass(frozen=True)
class Segment:
    """LENGTH bytes of the reference: BASE's raw bytes from OFFSET, or zeros where BASE is None."""

    base: str | None
    offset: int
    length: int


def base_limit(raw_len: int) -> int:
    """The largest raw length a base of a delta of RAW_LEN bytes may have (FORMAT.md): twice the
    delta's plus 4 MiB (chunks of one chunker differ at most by a factor of two), at most a chunk's."""
    return min(MAX_RAW_CHUNK, 2 * raw_len + (4 << 20))


def bases_limit(raw_len: int) -> int:
    """The most raw bytes all the distinct bases of one delta of RAW_LEN bytes may hold together: two
    bases at their limit. A hostile table naming many large bases would otherwise make a reader hold
    them all at once; the writer keeps to the same bound."""
    return 2 * base_limit(raw_len)


def table_len(segments: list[Segment]) -> int:
    return _HEAD.size + len(segments) * _SEG.size


def pack_table(segments: list[Segment], xor_codec: str = "zstd") -> bytes:
    return _HEAD.pack(len(segments), XOR_CODECS.index(xor_codec), _RESERVED) + b"".join(
        _SEG.pack(bytes.fromhex(s.base) if s.base else _NO_BASE, s.offset, s.length) for s in segments)


def xor_codec(payload: memoryview | bytes) -> str:
    """The host codec that encodes the XOR of a delta payload whose table parse_table accepted."""
    return XOR_CODECS[_HEAD.unpack_from(payload)[1]]


def parse_table(payload: memoryview | bytes, raw_len: int) -> tuple[list[Segment], int]:
    """The segments of a delta payload and where its frame starts; ValueError when the table is not
    one this format allows (count 1..MAX_SEGMENTS, a known encoding of the XOR and zero reserved
    bytes, reference no longer than RAW_LEN, an encoding after it)."""
    if len(payload) < _HEAD.size:
        raise ValueError("shorter than its segment table")
    n, how, reserved = _HEAD.unpack_from(payload)
    if not 1 <= n <= MAX_SEGMENTS:
        raise ValueError(f"{n} segments (1..{MAX_SEGMENTS})")
    if how >= len(XOR_CODECS) or reserved != _RESERVED:
        raise ValueError(f"an unknown encoding of its XOR ({how}, reserved bytes {bytes(reserved).hex()})")
    start = _HEAD.size + n * _SEG.size
    if len(payload) < start + MIN_FRAME:
        raise ValueError("shorter than its segment table and a frame")
    segs, total = [], 0
    for i in range(n):
        bid, off, length = _SEG.unpack_from(payload, _HEAD.size + i * _SEG.size)
        if length == 0 or length > raw_len or off > MAX_RAW_CHUNK:
            raise ValueError(f"segment {i} of {length} bytes at {off}")
        total += length
        segs.append(Segment(None if bid == _NO_BASE else bid.hex(), off, length))
    if total > raw_len:
        raise ValueError(f"a reference of {total} bytes for {raw_len} raw bytes")
    return segs, start


def bases(segments: Iterable[Segment]) -> set[str]:
    return {s.base for s in segments if s.base is not None}


def xor_into(dst: memoryview, src: bytes | memoryview) -> None:
    """DST ^= SRC over their common length (DST writable)."""
    import numpy as np
    k = min(len(dst), len(src))
    if k:
        a = np.frombuffer(dst, dtype=np.uint8, count=k)
        np.bitwise_xor(a, np.frombuffer(src, dtype=np.uint8, count=k), out=a)


def _apply(x: memoryview, segments: list[Segment], raws: dict[str, bytes | memoryview]) -> None:
    """X ^= the reference SEGMENTS make of RAWS; ValueError, with X untouched, when a segment reads
    past its base (every bound is checked before the first XOR)."""
    for s in segments:
        if s.base is not None and s.offset + s.length > len(raws[s.base]):
            raise ValueError(f"a segment reads past its base {s.base[:16]}…")
    pos = 0
    for s in segments:
        if s.base is not None:
            xor_into(x[pos:pos + s.length], memoryview(raws[s.base])[s.offset:s.offset + s.length])
        pos += s.length


def xored(data: memoryview, segments: list[Segment], raws: dict[str, bytes | memoryview],
          scratch: memoryview) -> tuple[memoryview, float]:
    """DATA XOR the reference SEGMENTS make of RAWS (base id -> raw bytes), in SCRATCH (at least
    len(DATA) bytes), and the fraction of its bytes that are zero (how much of DATA the reference
    already holds). ValueError when a segment reads past its base or RAWS hold more than
    bases_limit: such a reference would be refused by every reader (decode), so it is never written."""
    x, same, _ = xored_pages(data, segments, raws, scratch)
    return x, same


def xored_pages(data: memoryview, segments: list[Segment], raws: dict[str, bytes | memoryview],
                scratch: memoryview) -> tuple[memoryview, float, "np.ndarray"]:
    """xored, and page_differences of the XOR (one pass over it for both)."""
    from storage.fs.directio import copy_into
    if sum(len(raws[b]) for b in bases(segments)) > bases_limit(len(data)):
        raise ValueError("the reference's bases hold more than a delta's bases may")
    n = len(data)
    x = scratch[:n]
    copy_into(x, data)  # the GIL released for the copy (a dump's workers try candidates at once)
    _apply(x, segments, raws)
    diffs = page_differences(x)
    same = 1.0 - int(diffs.sum()) / n if n else 1.0
    return x, same, diffs


def _dirty_sample(x: memoryview, diffs: "np.ndarray | None") -> memoryview | None:
    """Up to SAMPLE_PIECES x SAMPLE_PIECE bytes of X's whole non-zero pages, spread over them (DIFFS:
    page_differences of X, computed when None), as one view of a buffer of its own; None when X has
    no such page (the chooser then samples X as it does any chunk)."""
    import numpy as np
    if diffs is None:
        diffs = page_differences(x)
    dirty = np.flatnonzero(diffs[:len(x) // PAGE])
    if not len(dirty):
        return None
    k = min(len(dirty), SAMPLE_PIECES * SAMPLE_PIECE // PAGE)
    out = memoryview(bytearray(k * PAGE))
    for j, p in enumerate(dirty[np.linspace(0, len(dirty) - 1, k).astype(np.int64)].tolist()):
        out[j * PAGE:(j + 1) * PAGE] = x[p * PAGE:(p + 1) * PAGE]
    return out


def encode_xored(x: memoryview, segments: list[Segment], dst: memoryview,
                 diffs: "np.ndarray | None" = None) -> int | None:
    """The delta payload of X (xored: the chunk XOR its reference SEGMENTS) written into DST; its
    length, or None when it does not fit in len(DST) bytes (the caller sizes DST to what pays off).
    The XOR is encoded with zstd or as byte planes (shuffle2-zstd), as its non-zero pages favour
    (DIFFS: X's page_differences, when the caller has them); X and DST must not overlap."""
    head = table_len(segments)
    if len(dst) < head + MIN_FRAME:
        return None
    got = _CHOOSER.encode_within(x, dst[head:], _dirty_sample(x, diffs))
    if got is None:
        return None
    dst[:head] = pack_table(segments, got[0])
    return head + got[1]


def encode_into(data: memoryview, segments: list[Segment], raws: dict[str, bytes | memoryview],
                scratch: memoryview, dst: memoryview) -> int | None:
    """The delta payload of DATA against the reference SEGMENTS make of RAWS, written into DST (see
    xored and encode_xored)."""
    return encode_xored(xored(data, segments, raws, scratch)[0], segments, dst)


def decode(codec: str, raw_len: int, payload: memoryview, cid: str, out: memoryview | None,
           base: BaseReader | None) -> memoryview:
    """The RAW_LEN raw bytes of the delta entry CID (codec CODEC, PAYLOAD), into OUT when given (at
    least RAW_LEN bytes), not yet bound to CID (chunkfile.full_check hashes them); DeltaDamage when
    the delta, or a base as BASE reads it (raising a DamageError), is damaged."""
    if base is None:
        raise DeltaDamage("is a delta entry, which is not accepted here (only a store's own reads resolve bases)")
    if codec != DELTA:
        raise DeltaDamage("is not a delta entry")
    try:
        segs, start = parse_table(payload, raw_len)
    except ValueError as e:
        raise DeltaDamage(f"delta entry with a bad segment table (corrupted): {e}") from None
    raws: dict[str, bytes | memoryview] = {}
    held = 0
    for s in segs:
        if s.base is None:
            continue
        if s.base == cid:
            raise DeltaDamage("delta entry names itself as its base (corrupted)")
        if s.base not in raws:
            try:
                raws[s.base] = base(s.base, base_limit(raw_len))
            except DamageError as e:
                raise DeltaDamage(f"{BASE_WHY} {s.base[:16]}… {getattr(e, 'what', e)}") from None
            held += len(raws[s.base])
            if held > bases_limit(raw_len):  # checked as each base arrives: at most one more is held
                raise DeltaDamage(f"delta entry names bases holding more than {bases_limit(raw_len)} bytes "
                                  "together (corrupted)")
        if s.offset + s.length > len(raws[s.base]):
            raise DeltaDamage(f"delta segment reads past its base {s.base[:16]}… (corrupted)")
    target = out if out is not None else memoryview(bytearray(raw_len))
    try:
        got = decode_host_into(xor_codec(payload), payload[start:], raw_len, target)
    except CodecError as e:
        raise DeltaDamage(f"delta does not decode (corrupted): {e}") from None
    _apply(got, segs, raws)
    return got


def cut(segments: list[Segment], lo: int, hi: int) -> list[Segment]:
    """The part [LO, HI) of the reference SEGMENTS make (zeros past their end)."""
    out: list[Segment] = []
    pos = 0
    for s in segments:
        a, b = max(lo, pos), min(hi, pos + s.length)
        if a < b:
            out.append(Segment(s.base, s.offset + (a - pos) if s.base else 0, b - a))
        pos += s.length
    if hi > max(lo, pos):
        out.append(Segment(None, 0, hi - max(lo, pos)))
    return out


def merged(segments: list[Segment]) -> list[Segment]:
    """SEGMENTS with adjacent pieces of the same base (or zeros) joined, trailing zeros dropped
    (the reference is zero-extended anyway)."""
    out: list[Segment] = []
    for s in segments:
        if out and out[-1].base == s.base and (s.base is None or out[-1].offset + out[-1].length == s.offset):
            p = out[-1]
            out[-1] = Segment(p.base, p.offset, p.length + s.length)
        else:
            out.append(s)
    while out and out[-1].base is None:
        out.pop()
    return out


PAGE = 4096  # the unit in which candidate references are mixed


_pages: Any = None  # storage/native's page counter: None not loaded yet, False not there


def native_page_counts() -> bool:
    """Whether page_differences runs in C (the library built, loadable, not turned off)."""
    return _pages_lib() is not None


def _pages_lib() -> Any:
    global _pages
    if _pages is None:
        _pages = native.load(native.path_of("libgpusnap_pages.so"), "gs_pages_version", 1, [
            ("gs_page_differences", ctypes.c_int64, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                                     ctypes.c_void_p])]) or False
    return _pages or None


def page_differences(x: memoryview) -> "np.ndarray":
    """For each 4096-byte page of X (an XOR against a candidate reference), how many bytes differ.
    One C call where storage/native's library is built (the GIL released once: numpy's five calls
    each gave it up and took it back among a put's threads), else numpy; the same counts."""
    import numpy as np
    n = len(x)
    lib = _pages_lib()
    if lib is not None:
        out = np.empty((n + PAGE - 1) // PAGE, dtype=np.int64)
        if n:
            lib.gs_page_differences(address_of(x), n, PAGE, out.ctypes.data)
        return out
    v = np.frombuffer(x, dtype=np.uint8)
    full = n // PAGE
    out = np.zeros(full + (1 if n % PAGE else 0), dtype=np.int64)
    if full:
        # bytes are counted only in the pages with a differing word: a good candidate leaves few
        # (np.add.reduceat over the whole XOR took 20x as long, the most of a dump's delta stage)
        pages = v[:full * PAGE].reshape(full, PAGE)
        dirty = np.flatnonzero(pages.view(np.uint64).any(axis=1))
        if len(dirty):
            out[dirty] = np.count_nonzero(pages[dirty], axis=1)
    if n % PAGE:
        out[-1] = np.count_nonzero(v[full * PAGE:])
    return out


def mixed(candidates: list[tuple[list[Segment], "np.ndarray"]], n: int) -> tuple[list[Segment], int] | None:
    """One reference for N bytes made of the CANDIDATES' (their segments, their page_differences),
    each page taken from the candidate that differs least there, in runs; and which candidate the last
    run is. None when that needs more than MAX_SEGMENTS segments."""
    import numpy as np
    pick = np.argmin(np.stack([c[1] for c in candidates]), axis=0)
    segs: list[Segment] = []
    start = 0
    for i in range(1, len(pick) + 1):
        if i == len(pick) or pick[i] != pick[start]:
            segs += cut(candidates[int(pick[start])][0], start * PAGE, min(i * PAGE, n))
            if len(segs) > 4 * MAX_SEGMENTS:
                return None
            start = i
    out = merged(segs)
    return (out, int(pick[-1])) if len(out) <= MAX_SEGMENTS and len(pick) else None
