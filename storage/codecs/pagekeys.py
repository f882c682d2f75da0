"""Page keys: a content-chosen sample of a page-cut stream's 4 KiB pages, recorded in its manifest, and
the lookup a later put with that snapshot as its parent uses to find a page wherever it lay.

Guarantees kept here (storage/FORMAT.md, "Page keys"): the record a put writes is exactly the form
`check` accepts; a record of this kind in any other form is refused (a manifest carrying one is
damaged), and a record of another kind (a later writer's key or sampling) is kept and ignored; a page
index built from a parent only ever yields candidate places (a stream of that parent and a shift),
never bytes: a wrong or hostile record costs attempts, bounded per chunk, and nothing else, because
every candidate reference is scored by its XOR and every chunk is verified by its id.
"""
from __future__ import annotations

import base64
import binascii
import collections
import functools
import itertools
import operator
import struct
import sys
import threading
from array import array
from typing import TYPE_CHECKING, Any, Container

if TYPE_CHECKING:
    import numpy as np

PAGE = 4096
KEY = "strided8"        # the key's name in the record: eight words, one per 512-byte eighth of a page
EVERY = 32              # one page in EVERY is sampled (by content: its key's top 5 bits are zero)
_SAMPLE_SHIFT = 59      # a page is sampled when key >> _SAMPLE_SHIFT == 0 (32 = 2**(64 - 59))
_KEPT_SHIFT = 27        # the record keeps bits 27..58 of a sampled key
_STRIDE = PAGE // 8 // 8  # the words keyed: 0, 64, ..., 448
MAX_HITS_PER_KEY = 4    # a key found at more places than this (repeated pages) votes for its first ones only
PLACES = 3              # a lookup returns at most this many places
MAX_PAGES = 1 << 32     # pages from this index on are not recorded (32-bit indices)


@functools.cache
def _numpy() -> tuple[Any, Any]:
    """numpy and the keys' multipliers, loaded on first use: only a put computes or searches keys, so a
    restore (which only checks a record as its manifest loads) never loads numpy."""
    import numpy  # noqa: PLC0415
    u = numpy.uint64
    return numpy, (numpy.arange(8, dtype=u) * u(2) + u(1)) * u(0x9E3779B97F4A7C15)


def keys(data: memoryview | bytes | Any) -> "np.ndarray":
    """The key of every whole 4 KiB page of DATA (uint64; FORMAT.md, "Page keys"): one strided view and
    one product, few numpy calls per chunk (each takes the GIL back among the put's workers)."""
    np, mult = _numpy()
    n = len(data) // PAGE
    if not n:
        return np.zeros(0, np.uint64)
    words = np.frombuffer(data, dtype=np.uint64, count=n * PAGE // 8).reshape(n, PAGE // 8)[:, ::_STRIDE]
    return words @ mult  # uint64 arithmetic wraps: the sum modulo 2**64


def sampled(data: memoryview | bytes | Any) -> tuple["np.ndarray", "np.ndarray"]:
    """The sampled pages of DATA: their indices in DATA (int64) and kept keys (uint32), in order."""
    np, _ = _numpy()
    k = keys(data)
    pick = np.flatnonzero((k - np.uint64(1)) < np.uint64((1 << _SAMPLE_SHIFT) - 1))  # 0 < key < 2**59 (0 wraps)
    return pick, (k[pick] >> np.uint64(_KEPT_SHIFT)).astype(np.uint32)


class PageKeyError(ValueError):
    """A page keys record of another form than FORMAT.md describes."""


class Collector:
    """The sampled pages of the streams one put writes, gathered from its workers in any order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._parts: dict[str, list[tuple["np.ndarray", "np.ndarray"]]] = collections.defaultdict(list)

    def add(self, stream: str, offset: int, data: memoryview,
            sample: tuple["np.ndarray", "np.ndarray"] | None = None) -> None:
        """The pages of DATA, which lies at OFFSET (a whole page) of STREAM (SAMPLE: sampled(DATA), where
        the caller has it already). A key seen again in the same chunk is recorded once (a repeated page
        says nothing more about where it lay), and no page from the 2**32nd on is recorded (the
        record's indices are 32-bit)."""
        np, _ = _numpy()
        at, kept = sample if sample is not None else sampled(data)
        if len(at):
            _, first = np.unique(kept, return_index=True)
            first.sort()
            at, kept = at[first] + offset // PAGE, kept[first]
            keep = at < MAX_PAGES
            with self._lock:
                self._parts[stream].append((at[keep], kept[keep]))

    def record(self, stream: str) -> dict[str, Any]:
        """STREAM's attrs record (possibly with no entries)."""
        np, _ = _numpy()
        with self._lock:
            parts = list(self._parts.get(stream, ()))
        if parts:
            at = np.concatenate([p[0] for p in parts])
            kept = np.concatenate([p[1] for p in parts])
            if len(at) > 2 * (int(at.max()) + 1) // EVERY + 16:
                # a stream crafted so that every page is sampled (the key is linear in its words):
                # kept to twice the usual share, spread evenly, so that no tenant grows a manifest
                keep = np.linspace(0, len(at) - 1, 2 * (int(at.max()) + 1) // EVERY + 16).astype(np.int64)
                order = np.argsort(at, kind="stable")[keep]
            else:
                order = np.argsort(at, kind="stable")
            at, kept = at[order].astype("<u4"), kept[order].astype("<u4")
        else:
            at, kept = np.zeros(0, "<u4"), np.zeros(0, "<u4")
        return {"key": KEY, "every": EVERY, "at": base64.b64encode(at.tobytes()).decode(),
                "keys": base64.b64encode(kept.tobytes()).decode()}


def _decode(v: Any, what: str) -> bytes:
    """The little-endian uint32 values of a record's base64 field V, as bytes."""
    if not isinstance(v, str):
        raise PageKeyError(f"pagekeys {what} is not a string")
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise PageKeyError(f"pagekeys {what} is not base64") from None
    if len(raw) % 4:
        raise PageKeyError(f"pagekeys {what} is not whole uint32 values")
    return raw


def known(record: Any) -> bool:
    """Whether RECORD (a dict) is of the kind this reader computes: another `key` or `every` (a later
    writer's) is kept and ignored, never damage, since a record is only a hint."""
    return record.get("key") == KEY and type(record.get("every")) is int and record["every"] == EVERY


def _u32(raw: bytes) -> "array[int] | list[int]":
    """RAW (little-endian uint32 values) as a sequence of them, without numpy."""
    a = array("I")
    if a.itemsize != 4:  # no 4-byte "I" on this platform: one value at a time
        return [v for (v,) in struct.iter_unpack("<I", raw)]
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a


def _checked(record: Any, size: int) -> tuple[bytes, bytes] | None:
    """The `at` and `keys` bytes (little-endian uint32) of RECORD, the `pagekeys` of a stream of SIZE
    bytes, once every rule of FORMAT.md holds (None: a record of another kind); PageKeyError for any
    other form. Pure Python: a manifest's load checks every record, and a restore loads no numpy."""
    if not isinstance(record, dict) or not isinstance(record.get("key"), str) or len(record["key"]) > 64:
        raise PageKeyError("pagekeys is not a record with a key name")
    if not known(record):
        return None
    if set(record) != {"key", "every", "at", "keys"}:
        raise PageKeyError("pagekeys is not a record of key, every, at and keys")
    at, kept = _decode(record["at"], "at"), _decode(record["keys"], "keys")
    if len(at) != len(kept):
        raise PageKeyError(f"pagekeys name {len(at) // 4} pages but {len(kept) // 4} keys")
    pages, n = size // PAGE, len(at) // 4
    if n > pages:
        raise PageKeyError("pagekeys name pages beyond the stream")
    if n:
        idx = _u32(at)
        if idx[-1] >= pages:
            raise PageKeyError("pagekeys name pages beyond the stream")
        if n > 1 and not all(map(operator.lt, idx, itertools.islice(idx, 1, None))):
            raise PageKeyError("pagekeys pages are not in increasing order")
    return at, kept


def load(record: Any, size: int) -> tuple["np.ndarray", "np.ndarray"]:
    """The page indices and kept keys of RECORD, the `pagekeys` of a stream of SIZE bytes (empty for a
    record of another kind); PageKeyError for any other form."""
    np, _ = _numpy()
    got = _checked(record, size)
    if got is None:
        return np.zeros(0, "<u4"), np.zeros(0, "<u4")
    return np.frombuffer(got[0], dtype="<u4"), np.frombuffer(got[1], dtype="<u4")


def check(record: Any, size: int) -> str:
    """What is wrong with a stream's `pagekeys` RECORD (SIZE: the stream's bytes); empty: nothing."""
    try:
        _checked(record, size)
    except PageKeyError as e:
        return str(e)
    return ""


class PageIndex:
    """Every sampled page of a parent snapshot's page-cut streams, by kept key: where a new chunk's
    pages lay in the parent, at any distance and in any stream."""

    def __init__(self, streams: list[tuple[str, Any, int]]) -> None:
        """STREAMS: (name, its `pagekeys` record, its size); a stream without a record is left out (a
        record of another form cannot reach here: the manifest carrying it was refused at load)."""
        np, _ = _numpy()
        self.names = [name for name, _, _ in streams]
        ats, keys_, ids = [], [], []
        for i, (_, record, size) in enumerate(streams):
            at, kept = load(record, size)
            ats.append(at.astype(np.int64))
            keys_.append(kept)
            ids.append(np.full(len(at), i, np.int32))
        cat = (lambda parts, dt: np.concatenate(parts) if parts else np.zeros(0, dt))
        k, a, s = cat(keys_, np.uint32), cat(ats, np.int64), cat(ids, np.int32)
        order = np.argsort(k, kind="stable")
        self._keys, self._at, self._stream = k[order], a[order], s[order]

    def __len__(self) -> int:
        return len(self._keys)

    @classmethod
    def of(cls, streams: list[Any], among: Container[str]) -> "PageIndex | None":
        """The index of those of a parent's STREAMS (manifest Streams) named in AMONG (the streams a
        delta can be cut from: a record on any other, say one of zero chunks only, would name places
        no candidate can take), or None when none of them carries page keys of this kind."""
        have = [(s.name, s.attrs["pagekeys"], s.size) for s in streams
                if s.name in among and isinstance(s.attrs.get("pagekeys"), dict) and known(s.attrs["pagekeys"])]
        return cls(have) if have else None

    def lookup(self, data: memoryview, offset: int, most: int = PLACES,
               sample: tuple["np.ndarray", "np.ndarray"] | None = None) -> tuple[list[tuple[tuple[str, int], int]], int]:
        """Where DATA's sampled pages (DATA at OFFSET of the new stream; SAMPLE: sampled(DATA), where the
        caller has it already) lie in the parent: at most MOST places (parent stream, shift = parent
        offset - new offset), each with how many sampled pages lie there, the most first; and how many
        pages of DATA are sampled."""
        np, _ = _numpy()
        at, kept = sample if sample is not None else sampled(data)
        if not len(at) or not len(self._keys):
            return [], len(at)
        lo = np.searchsorted(self._keys, kept, "left")
        hi = np.minimum(np.searchsorted(self._keys, kept, "right"), lo + MAX_HITS_PER_KEY)
        votes: collections.Counter[tuple[int, int]] = collections.Counter()
        for j, a, b in zip(at.tolist(), lo.tolist(), hi.tolist()):
            for h in range(a, b):
                votes[(int(self._stream[h]), int(self._at[h]) * PAGE - offset - j * PAGE)] += 1
        return [((self.names[s], shift), v) for (s, shift), v in votes.most_common(most)], len(at)

    def places(self, data: memoryview, offset: int, most: int = PLACES) -> list[tuple[str, int]]:
        """lookup's places alone, the most agreeing first."""
        return [p for p, _ in self.lookup(data, offset, most)[0]]
