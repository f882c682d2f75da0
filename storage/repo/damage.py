"""The store's record of damaged chunks (`damaged.json`): what the last verify or repair found, so
that `store ls` can mark the snapshots that name them without reading a chunk.

Guarantees kept here:
- The record is only a hint for listings: nothing is read, written or deleted because of it, so a
  forged record can at worst mark or unmark a snapshot in `store ls` until the next verify.
- It is loaded like every store entry: opened by name in the store directory with O_NOFOLLOW and
  O_NONBLOCK, used only if fstat says it is a regular file, at most MAX_BYTES long, every id 64
  lowercase hex digits, every reason a short string; anything else is taken as no record.
- It is replaced atomically (a new file in tmp/, fsynced, renamed over the old one, the store
  directory fsynced) by a caller holding the store lock exclusively, so two verifies never lose
  each other's findings.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from contextlib import AbstractContextManager
from typing import Iterable, Protocol

from storage.fs.directio import read_small_file, unlink_quietly, write_new_file
from storage.format.manifest import Manifest
from storage.fs.owner import owned_name


class StoreDirs(Protocol):
    """What the marks need of the store (storage.repo.store.SnapshotStore): its checked root and tmp/ fds
    (named here rather than imported: the store imports this module)."""

    def root(self) -> AbstractContextManager[tuple[int, int]]: ...
    def subdir(self, *parts: str) -> AbstractContextManager[int]: ...


RECORD = "damaged.json"
FORMAT = "gpusnap-damage"
VERSION = 1
MAX_BYTES = 16 << 20
MAX_WHY = 512
_ID = re.compile(r"[0-9a-f]{64}")


@dataclass
class DamageMarks:
    """Chunk id -> {"why", "when"} for the chunks the last check found missing or damaged."""
    chunks: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def load(cls, store: StoreDirs) -> "DamageMarks":
        """The store's record, or an empty one where there is none or it is not valid."""
        with store.root() as (root, _):
            data = read_small_file(root, RECORD, MAX_BYTES)
        return cls() if data is None else cls.parse(data)

    @classmethod
    def parse(cls, data: bytes) -> "DamageMarks":
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return cls()
        if not (isinstance(body, dict) and body.get("format") == FORMAT and body.get("version") == VERSION
                and isinstance(body.get("chunks"), dict)):
            return cls()
        out: dict[str, dict[str, str]] = {}
        for cid, rec in body["chunks"].items():
            if not (isinstance(cid, str) and _ID.fullmatch(cid) and isinstance(rec, dict)):
                return cls()
            why, when = rec.get("why"), rec.get("when")
            if not (isinstance(why, str) and isinstance(when, str) and len(why) <= MAX_WHY and len(when) <= 64):
                return cls()
            out[cid] = {"why": why, "when": when}
        return cls(out)

    def damaged_in(self, m: Manifest) -> list[str]:
        """The marked chunk ids that M names (sorted)."""
        return sorted(m.chunk_ids() & self.chunks.keys()) if self.chunks else []

    def dumps(self) -> bytes:
        return json.dumps({"format": FORMAT, "version": VERSION, "chunks": self.chunks}, sort_keys=True).encode()


def update(store: StoreDirs, whole: Iterable[str], bad: dict[str, str]) -> bool:
    """Clear the marks of the chunk ids WHOLE (checked and found sound), mark those of BAD (id -> what
    is wrong). The caller holds STORE's lock exclusively. Returns whether the record changed."""
    marks = DamageMarks.load(store)
    before = dict(marks.chunks)
    for cid in whole:
        marks.chunks.pop(cid, None)
    now = datetime.now(timezone.utc).isoformat()
    for cid, why in bad.items():
        if _ID.fullmatch(cid):
            marks.chunks[cid] = {"why": why[:MAX_WHY], "when": marks.chunks.get(cid, {}).get("when", now)}
    if marks.chunks == before:
        return False
    write(store, marks)
    return True


def write(store: StoreDirs, marks: DamageMarks) -> None:
    """Replace the record with MARKS atomically and durably (removed when MARKS is empty)."""
    with store.root() as (root, _), store.subdir("tmp") as tmp:
        if not marks.chunks:
            try:
                os.unlink(RECORD, dir_fd=root)
            except FileNotFoundError:
                return
        else:
            name = owned_name("record")
            write_new_file(tmp, name, marks.dumps())
            try:
                os.rename(name, RECORD, src_dir_fd=tmp, dst_dir_fd=root)
            except BaseException:
                os.unlink(name, dir_fd=tmp)
                raise
        os.fsync(root)
