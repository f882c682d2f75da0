"""`store put`'s files cache (`files-cache.json`): an unchanged file is not read again (borg's).

An entry maps a file's absolute path to what its stat said when it was last stored (size, mtime_ns,
ctime_ns, inode, device), the chunker record that cut it, and its chunk references. A put that finds
the same path with the same five values and the same chunker takes the references instead of reading
the file, each one checked (SnapshotWriter.reuse_ref) to name a sound chunk file of that raw length
present in the store now; if any is not, the file is read as if there were no entry.

Guarantees kept here:
- The cache is only ever a shortcut: a file whose entry is missing, stale, malformed or names a chunk
  the store lacks is read in full, so a damaged or forged cache costs a re-read; the references it
  gives must exist in the store (checked) and add up to the file's size (checked). Like a manifest,
  the cache can only be changed by whoever can write the store.
- A file changed less than RACY_NS before it was scanned is not entered (git's "racy" rule: a write
  within the file system's timestamp granularity could leave mtime and ctime as they were).
- Loaded as every store record: O_NOFOLLOW | O_NONBLOCK, a regular file, at most MAX_BYTES, a BLAKE3
  checksum over its entries; every value typed and bounded. Replaced atomically (a new file in tmp/,
  fsynced, renamed over the old one, the store directory fsynced); two puts at once: the last wins.
"""
from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import blake3

from storage.fs.directio import read_small_file
from storage.format.manifest import ChunkRef, ManifestError
from storage.format.storedir import FILES_CACHE, TMP

if TYPE_CHECKING:
    from storage.repo.store import SnapshotStore

RECORD = FILES_CACHE
FORMAT = "gpusnap-files-cache"
VERSION = 1
MAX_BYTES = 512 << 20
MAX_ENTRIES = 4_000_000
RACY_NS = 2_000_000_000

Key = tuple[int, int, int, int, int]  # size, mtime_ns, ctime_ns, ino, dev


def stat_key(st: os.stat_result) -> Key:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def _checksum(entries: dict[str, Any]) -> str:
    return blake3.blake3(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class FilesCache:
    def __init__(self, entries: dict[str, Any] | None = None) -> None:
        self.entries: dict[str, Any] = entries or {}

    @classmethod
    def load(cls, store: "SnapshotStore") -> "FilesCache":
        """The store's files cache, or an empty one where there is none or it is not valid."""
        with store.root() as (root, _):
            data = read_small_file(root, RECORD, MAX_BYTES)
        if data is None:
            return cls()
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return cls()
        if not (isinstance(body, dict) and body.get("format") == FORMAT and body.get("version") == VERSION
                and isinstance(body.get("entries"), dict) and len(body["entries"]) <= MAX_ENTRIES
                and body.get("checksum") == _checksum(body["entries"])):
            return cls()
        return cls(body["entries"])

    def lookup(self, path: str, key: Key, chunker: dict[str, Any]) -> list[ChunkRef] | None:
        """The chunk references the cache holds for PATH if its KEY and CHUNKER are those recorded
        and the references are well-formed and add up to its size; None otherwise (read the file)."""
        e = self.entries.get(path)
        if not (isinstance(e, dict) and e.get("key") == list(key) and e.get("chunker") == chunker
                and isinstance(e.get("chunks"), list)):
            return None
        try:
            refs = [ChunkRef.from_json(c) for c in e["chunks"]]
        except ManifestError:
            return None
        if sum(r.raw_len for r in refs) != key[0]:
            return None
        return refs

    def record(self, path: str, key: Key, chunker: dict[str, Any], refs: list[ChunkRef], scanned_ns: int) -> None:
        if scanned_ns - max(key[1], key[2]) < RACY_NS:
            self.entries.pop(path, None)
            return
        self.entries[path] = {"key": list(key), "chunker": chunker, "chunks": [r.to_json() for r in refs]}

    def save(self, store: "SnapshotStore") -> None:
        """Replace the store's cache with this one, atomically and durably."""
        from storage.repo.store import _unlink_quietly, _write_file, owned_name
        data = json.dumps({"format": FORMAT, "version": VERSION, "entries": self.entries,
                           "checksum": _checksum(self.entries)}, separators=(",", ":")).encode()
        with store.root() as (root, _), store.subdir(TMP) as tmp:
            name = owned_name("record")
            _write_file(tmp, name, data)
            try:
                os.rename(name, RECORD, src_dir_fd=tmp, dst_dir_fd=root)
            except BaseException:
                _unlink_quietly(tmp, name)
                raise
            os.fsync(root)


def now_ns() -> int:
    return time.time_ns()
