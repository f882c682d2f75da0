"""The chunks a store holds, wherever they lie (pack entries of version 3, chunk files of versions 1/2),
for tests that read or damage one chunk on disk the way a bad disk or a hostile user would."""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from storage.format.manifest import ChunkRef
from storage.format.packs import PACK_NAME, decode_index, encode_index


@dataclass(frozen=True)
class Entry:
    """One stored chunk: CID at OFFSET of PATH, LENGTH bytes (a chunk file: offset 0, its size)."""

    cid: str
    path: Path
    offset: int
    length: int
    in_pack: bool

    @property
    def size(self) -> int:
        return self.length

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            return f.read(self.length)

    def write(self, data: bytes) -> None:
        """Overwrite the entry in place with DATA (for a pack entry, at most its length; the rest is
        zeroed, as padding is)."""
        if self.in_pack:
            assert len(data) <= self.length, "a pack entry cannot grow in place"
            data = data.ljust(self.length, b"\0")
            with open(self.path, "r+b") as f:
                f.seek(self.offset)
                f.write(data)
        else:
            self.path.write_bytes(data)

    def flip(self, at: int) -> None:
        """Flip the low bit of byte AT of the entry (AT counts from the entry's header)."""
        b = bytearray(self.read())
        b[at] ^= 0x01
        self.write(bytes(b))

    @property
    def stored_len(self) -> int:
        """The payload length its header records."""
        return struct.unpack_from("<Q", self.read()[:32], 24)[0]

    def flip_payload(self, frac: float = 0.0) -> None:
        """Flip a byte of the payload, FRAC of the way into it."""
        self.flip(4096 + int(frac * max(self.stored_len - 1, 0)))

    def truncate(self) -> None:
        """Cut the entry in half (a pack is cut there, so every later entry of it is lost too)."""
        os.truncate(self.path, self.offset + self.length // 2)

    def remove(self) -> None:
        """Make the chunk missing: a chunk file is unlinked, a pack entry dropped from its index."""
        if not self.in_pack:
            self.path.unlink()
            return
        idx = self.path.parent.parent / "index" / self.path.name
        pack_len, ents = decode_index(idx.name, idx.read_bytes())
        idx.write_bytes(encode_index(idx.name, pack_len, [e for e in ents if e[1] != self.offset]))


def chunk_entries(store: Path) -> list[Entry]:
    """Every chunk entry of STORE: those its index files name, then its chunk files, by id."""
    out: list[Entry] = []
    index = store / "index"
    if index.is_dir():
        for idx in sorted(index.iterdir()):
            if not PACK_NAME.fullmatch(idx.name):
                continue
            _, ents = decode_index(idx.name, idx.read_bytes())
            out += [Entry(cid, store / "packs" / idx.name, off, length, True) for cid, off, length in ents]
    chunks = store / "chunks"
    if chunks.is_dir():
        out += [Entry(p.name, p, 0, p.stat().st_size, False) for p in chunks.glob("*/*") if p.is_file()]
    return sorted(out, key=lambda e: (e.cid, e.path.name, e.offset))


def chunk_ids(store: Path) -> set[str]:
    return {e.cid for e in chunk_entries(store)}


def to_chunk_files(store: Path, version: int) -> None:
    """Make STORE what a version 1/2 gpusnap left: every pack entry as its own chunk file chunks/XY/<id>
    (a chunk file's bytes are exactly an entry's), no packs/ or index/, the marker at VERSION."""
    for e in chunk_entries(store):
        if e.in_pack:
            d = store / "chunks" / e.cid[:2]
            d.mkdir(mode=0o700, exist_ok=True)
            (d / e.cid).write_bytes(e.read()[:4096 + e.stored_len])
    for sub in ("packs", "index"):
        for p in (store / sub).iterdir():
            p.unlink()
        (store / sub).rmdir()
    marker = json.loads((store / "gpusnap-store.json").read_text())
    marker.pop("requires", None)  # a version 1/2 marker has no requires list (version 8's)
    (store / "gpusnap-store.json").write_text(json.dumps({**marker, "version": version}))


def ref_id(c: ChunkRef) -> str:
    """C's chunk id: a test reads only chunks that have one (a zero-filled range has none)."""
    assert c.id is not None, c
    return c.id


def entry_of(store: Path, cid: str) -> Entry:
    """The (first) stored entry of chunk CID."""
    return next(e for e in chunk_entries(store) if e.cid == cid)
