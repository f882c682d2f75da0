"""What snapshots hold and share (`store stats`, `store diff`): sizes from manifests, no chunk reads.

Per snapshot: raw bytes (logical, zeros included), stored bytes (its distinct chunks' stored sizes),
unique bytes (chunks no other snapshot names: what `rm` + `gc` would free) and shared bytes; by
construction unique + shared = stored. Repository totals count every distinct chunk once. Bases of
delta entries (FORMAT.md, "Delta entries") are not named by manifests, so a chunk of a parent that a
child's deltas use as a base counts as unique to the parent here, though rm + gc of the parent keeps it.

Three savings are told apart, never folded into one ratio:
- zeros: raw bytes of all-zero chunks, elided (nothing stored);
- dedup: the non-zero raw bytes the references name, against the raw bytes of the distinct chunks
  they name (a chunk named twice counts once): dedup_bytes = referenced - distinct, and
  dedup_ratio = referenced / distinct (1.0 for data that deduplicated nothing);
- compression: the distinct chunks' raw bytes against their stored bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from storage.format.manifest import ChunkRef, Manifest


@dataclass
class CodecStats:
    chunks: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0

    def add(self, ref: ChunkRef) -> None:
        self.chunks += 1
        self.raw_bytes += ref.raw_len
        self.stored_bytes += ref.stored_len


@dataclass
class SnapshotStats:
    name: str
    raw_bytes: int = 0
    zero_bytes: int = 0
    referenced_bytes: int = 0   # non-zero raw bytes of every reference (a chunk named twice counts twice)
    distinct_raw_bytes: int = 0  # raw bytes of its distinct chunks
    stored_bytes: int = 0
    unique_bytes: int = 0
    shared_bytes: int = 0
    chunks: int = 0          # distinct stored chunks
    unique_chunks: int = 0
    codecs: dict[str, CodecStats] = field(default_factory=dict)   # distinct chunks per codec

    @property
    def dedup_bytes(self) -> int:
        return self.referenced_bytes - self.distinct_raw_bytes

    @property
    def dedup_ratio(self) -> float:
        return self.referenced_bytes / self.distinct_raw_bytes if self.distinct_raw_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "codecs"}
        d["dedup_bytes"], d["dedup_ratio"] = self.dedup_bytes, round(self.dedup_ratio, 3)
        d["codecs"] = {k: v.__dict__ for k, v in sorted(self.codecs.items())}
        return d


@dataclass
class RepoStats:
    snapshots: int = 0
    raw_bytes: int = 0
    zero_bytes: int = 0
    referenced_bytes: int = 0
    distinct_raw_bytes: int = 0
    stored_bytes: int = 0
    chunks: int = 0
    codecs: dict[str, CodecStats] = field(default_factory=dict)

    @property
    def dedup_bytes(self) -> int:
        return self.referenced_bytes - self.distinct_raw_bytes

    @property
    def dedup_ratio(self) -> float:
        return self.referenced_bytes / self.distinct_raw_bytes if self.distinct_raw_bytes else 1.0

    @property
    def compression_ratio(self) -> float:
        return self.distinct_raw_bytes / self.stored_bytes if self.stored_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"snapshots": self.snapshots, "raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes,
                "zero_bytes": self.zero_bytes, "referenced_bytes": self.referenced_bytes,
                "distinct_raw_bytes": self.distinct_raw_bytes, "dedup_bytes": self.dedup_bytes,
                "compression_ratio": round(self.compression_ratio, 3),
                "chunks": self.chunks, "dedup_ratio": round(self.dedup_ratio, 3),
                "codecs": {k: v.__dict__ for k, v in sorted(self.codecs.items())}}


def _distinct(m: Manifest) -> dict[str, ChunkRef]:
    return {c.id: c for s in m.streams for c in s.chunks if c.id is not None}


def _zeros(m: Manifest) -> int:
    return sum(c.raw_len for s in m.streams for c in s.chunks if c.is_zero)


def _referenced(m: Manifest) -> int:
    return sum(c.raw_len for s in m.streams for c in s.chunks if not c.is_zero)


def compute(all_manifests: list[Manifest], names: list[str] | None = None) -> tuple[list[SnapshotStats], RepoStats]:
    """Stats of the snapshots NAMES (default all) against every manifest in ALL_MANIFESTS."""
    refs_by_snap = {m.name: _distinct(m) for m in all_manifests}
    users: dict[str, int] = {}
    for refs in refs_by_snap.values():
        for cid in refs:
            users[cid] = users.get(cid, 0) + 1
    repo = RepoStats(snapshots=len(all_manifests))
    every: dict[str, ChunkRef] = {}
    for m in all_manifests:
        repo.raw_bytes += m.size
        repo.zero_bytes += _zeros(m)
        repo.referenced_bytes += _referenced(m)
        every.update(refs_by_snap[m.name])
    repo.chunks = len(every)
    for ref in every.values():
        repo.distinct_raw_bytes += ref.raw_len
        repo.stored_bytes += ref.stored_len
        repo.codecs.setdefault(ref.codec, CodecStats()).add(ref)
    wanted = set(names) if names is not None else None
    out: list[SnapshotStats] = []
    for m in all_manifests:
        if wanted is not None and m.name not in wanted:
            continue
        st = SnapshotStats(m.name, raw_bytes=m.size, zero_bytes=_zeros(m), referenced_bytes=_referenced(m))
        for cid, ref in refs_by_snap[m.name].items():
            st.chunks += 1
            st.distinct_raw_bytes += ref.raw_len
            st.stored_bytes += ref.stored_len
            st.codecs.setdefault(ref.codec, CodecStats()).add(ref)
            if users[cid] == 1:
                st.unique_chunks += 1
                st.unique_bytes += ref.stored_len
            else:
                st.shared_bytes += ref.stored_len
        out.append(st)
    return out, repo


@dataclass
class StreamChange:
    name: str
    change: str            # added | removed | changed | attrs
    size_a: int
    size_b: int
    changed_bytes: int     # raw bytes of B's chunks that A's same stream does not have at that place


@dataclass
class Diff:
    a: str
    b: str
    changes: list[StreamChange] = field(default_factory=list)
    unchanged: int = 0

    @property
    def changed_bytes(self) -> int:
        return sum(c.changed_bytes for c in self.changes)

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "unchanged_streams": self.unchanged, "changed_bytes": self.changed_bytes,
                "changes": [c.__dict__ for c in self.changes]}


def _chunk_map(chunks: list[ChunkRef]) -> dict[int, ChunkRef]:
    out, off = {}, 0
    for c in chunks:
        out[off] = c
        off += c.raw_len
    return out


def diff(a: Manifest, b: Manifest) -> Diff:
    """Streams added, removed, changed (content) or with changed attributes between A and B; the
    changed bytes of a stream are B's chunks whose (offset, content) A lacks."""
    sa = {s.name: s for s in a.streams}
    sb = {s.name: s for s in b.streams}
    d = Diff(a.name, b.name)
    for name in sorted(sa.keys() | sb.keys()):
        x, y = sa.get(name), sb.get(name)
        if x is None:
            d.changes.append(StreamChange(name, "added", 0, y.size, y.size))  # type: ignore[union-attr]
        elif y is None:
            d.changes.append(StreamChange(name, "removed", x.size, 0, 0))
        elif x.chunks == y.chunks:
            if {k: v for k, v in x.attrs.items() if k != "mtime_ns"} != {k: v for k, v in y.attrs.items() if k != "mtime_ns"}:
                d.changes.append(StreamChange(name, "attrs", x.size, y.size, 0))
            else:
                d.unchanged += 1
        else:
            ma = _chunk_map(x.chunks)
            changed = sum(c.raw_len for off, c in _chunk_map(y.chunks).items()
                          if ma.get(off) is None or (ma[off].id, ma[off].raw_len, ma[off].codec) != (c.id, c.raw_len, c.codec))
            d.changes.append(StreamChange(name, "changed", x.size, y.size, changed))
    return d
