"""The store marker's `requires` list (version 8): which codec ids and features a store uses.

FORMAT.md, "The marker's `requires`". A store lists `codec:NAME` for every codec of an entry it may
hold and `feature:NAME` for every feature a reader must understand; a gpusnap opens a store only if
it knows every entry (the registry's codecs: storage/codecs/registry.py; the FEATURES below), so a
new codec is a new registry entry, never a new store version.

Guarantees kept here: a `requires` value is accepted only as a list of at most REQUIRES_MOST
distinct strings of the spelled form (anything else is refused by the caller as an unreadable
marker); held_requirements reads only 32 bytes of each indexed entry and of each chunk file, through
descriptors opened without following links and used only if they are regular files, and never fails
on a damaged entry (damage is verify's business: such an entry is left out).
"""
from __future__ import annotations

import os
import re
import stat
import struct
from typing import Iterable

from storage.codecs.registry import CODEC_IDS, CODEC_NAMES, DELTA
from storage.format.chunkfile import MAGIC, MAGIC_RAW
from storage.format.packs import INDEX_MAX, PACK_NAME, IndexDamage, decode_index, read_small
from storage.format.storedir import CHUNKS, INDEX, PACKS, StoreDamage, entries, opened_child

REQUIRES_VERSION = 8           # the first store version whose marker has `requires`
REQUIRES_MOST = 64             # entries a `requires` list may have
CHUNK_FILES = "feature:chunk-files"  # version 1/2 chunk files may be in chunks/XY/
FEATURES: frozenset[str] = frozenset({CHUNK_FILES})  # every feature this gpusnap understands
_ENTRY = re.compile(r"(codec|feature):[a-z0-9][a-z0-9.+-]{0,63}")
_HEAD = struct.Struct("<8sH")  # a chunk header's magic and codec id
_CHUNK_ID = re.compile(r"[0-9a-f]{64}")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def codec_requirement(codec: str) -> str:
    """The `requires` entry of the codec named CODEC."""
    return "codec:" + codec


DELTAS = codec_requirement(DELTA)  # a delta entry may be in the store (versions 6 and 7: "deltas": true)


def known() -> frozenset[str]:
    """Every `requires` entry this gpusnap understands: its registry's codecs (GPU ids included: their
    headers parse without nvCOMP) and its features."""
    return frozenset(codec_requirement(n) for n in CODEC_IDS) | FEATURES


def parse_requires(value: object) -> frozenset[str]:
    """The `requires` list VALUE of a version 8 marker; ValueError (one line) when it is not one."""
    if not isinstance(value, list):
        raise ValueError(f"requires is {type(value).__name__}, not a list")
    if len(value) > REQUIRES_MOST:
        raise ValueError(f"requires has {len(value)} entries, more than {REQUIRES_MOST}")
    for v in value:
        if not isinstance(v, str) or not _ENTRY.fullmatch(v):
            raise ValueError(f"requires entry {str(v)[:80]!r} is not codec:NAME or feature:NAME")
    got = frozenset(value)
    if len(got) != len(value):
        raise ValueError("requires names an entry twice")
    return got


def missing(requires: Iterable[str]) -> list[str]:
    """The entries of REQUIRES this gpusnap does not understand, sorted."""
    have = known()
    return sorted(r for r in requires if r not in have)


def refusal(path: str, lacking: list[str]) -> str:
    """The one line that refuses the store at PATH for the `requires` entries LACKING."""
    return (f"{path}: this store requires {', '.join(lacking)}, which this gpusnap does not know "
            "(a newer gpusnap wrote it); use one that does")


def held_requirements(root: int) -> set[str]:
    """What a store of version 1 to 7 (the store directory ROOT, already checked) holds, as `requires`
    entries: the codec of every entry of every indexed pack and of every chunk file in chunks/XY/,
    and CHUNK_FILES if there is a chunk file. Unreadable headers, unknown codec ids and damaged
    directories or index files are left out (verify reports them)."""
    out: set[str] = set()
    codecs: set[int] = set()
    try:
        with opened_child(root, INDEX, INDEX) as idx, opened_child(root, PACKS, PACKS) as packs:
            for e in entries(idx):
                if not PACK_NAME.fullmatch(e.name):
                    continue
                try:
                    _, ents = decode_index(e.name, read_small(idx, e.name, INDEX_MAX, f"{INDEX}/{e.name}"))
                except (IndexDamage, OSError):
                    continue
                fd = _open_regular(packs, e.name)
                if fd is None:
                    continue
                try:
                    for _, off, _ in ents:
                        _add_codec(os.pread(fd, _HEAD.size, off), codecs)
                finally:
                    os.close(fd)
    except (FileNotFoundError, StoreDamage):
        pass  # a version 1/2 store (no packs yet), or damage verify reports
    try:
        with opened_child(root, CHUNKS, CHUNKS) as chunks:
            for xy in entries(chunks):
                if not re.fullmatch(r"[0-9a-f]{2}", xy.name):
                    continue
                try:
                    with opened_child(chunks, xy.name, f"{CHUNKS}/{xy.name}") as d:
                        for f in entries(d):
                            if not _CHUNK_ID.fullmatch(f.name):
                                continue
                            fd = _open_regular(d, f.name)
                            if fd is None:
                                continue
                            out.add(CHUNK_FILES)
                            try:
                                _add_codec(os.pread(fd, _HEAD.size, 0), codecs)
                            finally:
                                os.close(fd)
                except (FileNotFoundError, StoreDamage):
                    continue
    except (FileNotFoundError, StoreDamage):
        pass
    return out | {codec_requirement(CODEC_NAMES[c]) for c in codecs}


def _open_regular(dir_fd: int, name: str) -> int | None:
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _add_codec(head: bytes, codecs: set[int]) -> None:
    if len(head) == _HEAD.size:
        magic, cid = _HEAD.unpack(head)
        if magic in (MAGIC, MAGIC_RAW) and cid in CODEC_NAMES:
            codecs.add(cid)
