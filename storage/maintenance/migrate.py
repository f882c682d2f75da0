"""Migration of a version 1/2 store's chunk files into packs (`gpusnap store migrate`; FORMAT.md, "Store versions").

Guarantees kept here: it holds the store lock exclusively; each chunk file is read with the stored
check, a GSNPCHK2 (raw-addressed) one then with the full check too (decoded once, into a buffer reused
from chunk to chunk: its raw bytes must derive the id, which the stored checksum alone does not bind:
FORMAT.md, "Chunk files"), and only then appended to a pack as it is (its bytes are an entry's); a
chunk file is deleted only after the pack holding its copy is fsynced and indexed; a chunk file that
fails either check, or is not a regular file, is left where it is and reported (evidence for
`repair`). A killed migration leaves chunks in both places, which readers accept and gc resolves.
The store itself becomes version 8 first (its marker's `requires` computed from what it holds:
SnapshotStore.upgrade), and its marker drops `feature:chunk-files` once no chunk file is left.
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from storage.format.chunkfile import HEADER_SIZE, MAX_RAW_CHUNK, ChunkError, ChunkHeader, full_check, read_chunk_file
from storage.fs.directio import AlignedBuffer, align_up
from storage.format.storedir import CHUNKS, TMP, StoreDamage, entries, opened_child
from storage.repo.store import CHUNK_ID

if TYPE_CHECKING:
    from storage.repo.store import SnapshotStore

_BATCH = 1 << 30  # chunk files deleted after each GiB moved (its packs indexed first)


@dataclass
class MigrateReport:
    moved: int = 0
    bytes_moved: int = 0
    left: list[str] = field(default_factory=list)   # chunk files not moved, and why


def migrate(store: "SnapshotStore", timeout: float = 30.0) -> MigrateReport:
    """Move every chunk file of STORE's chunks/XY/ into packs."""
    report = MigrateReport()
    store.upgrade()
    with store.exclusive(timeout), store.subdir(TMP) as tmp, store.subdir(CHUNKS) as chunks:
        buf = AlignedBuffer(HEADER_SIZE + align_up(1 << 20))
        raw_buf = bytearray()  # what GSNPCHK2 payloads decode into, grown to the largest raw length met
        try:
            todo: list[tuple[str, str]] = []
            for d in entries(chunks):
                if re.fullmatch(r"[0-9a-f]{2}", d.name):
                    try:
                        with opened_child(chunks, d.name, f"{CHUNKS}/{d.name}") as xy:
                            todo += [(d.name, e.name) for e in entries(xy)
                                     if CHUNK_ID.fullmatch(e.name) and e.name.startswith(d.name)]
                    except StoreDamage as e:
                        report.left.append(str(e))
            while todo:
                batch: list[tuple[str, str]] = []
                size = 0
                with store.packing(tmp) as pw:
                    while todo and size < _BATCH:
                        xy_name, cid = todo.pop(0)
                        with opened_child(chunks, xy_name, f"{CHUNKS}/{xy_name}") as xy:
                            st = os.stat(cid, dir_fd=xy, follow_symlinks=False)
                            if not stat.S_ISREG(st.st_mode) or st.st_size > HEADER_SIZE + MAX_RAW_CHUNK:
                                report.left.append(f"{CHUNKS}/{xy_name}/{cid}: not a chunk file; left alone")
                                continue
                            if align_up(st.st_size) > buf.size:
                                buf.close()
                                buf = AlignedBuffer(align_up(st.st_size))
                            try:
                                header, payload = read_chunk_file(xy, cid, buf, False)
                                raw_buf = _bound_to_id(header, payload, cid, raw_buf)
                            except ChunkError as e:
                                report.left.append(f"{CHUNKS}/{xy_name}/{cid}: {e.what}; left alone")
                                continue
                        pw.append(cid, header, buf.view)
                        batch.append((xy_name, cid))
                        size += HEADER_SIZE + header.stored_len
                        report.bytes_moved += header.stored_len
                for xy_name, cid in batch:  # their copies are durable and indexed now
                    with opened_child(chunks, xy_name, f"{CHUNKS}/{xy_name}") as xy:
                        os.unlink(cid, dir_fd=xy)
                        report.moved += 1
                for xy_name in sorted({x for x, _ in batch}):
                    with opened_child(chunks, xy_name, f"{CHUNKS}/{xy_name}") as xy:
                        os.fsync(xy)
        finally:
            buf.close()
        if not report.left:  # no chunk file is left in chunks/XY/ (nothing writes one since version 3)
            store.chunk_files_gone()
    return report


def _bound_to_id(header: ChunkHeader, payload: memoryview, cid: str, raw_buf: bytearray) -> bytearray:
    """After the stored check: a GSNPCHK2 chunk file's full check (its payload decoded into RAW_BUF, grown
    if its raw length needs more, and the raw bytes must derive CID; ChunkError otherwise), since a
    forged file whose stored checksum matches its own header and payload passes the stored check.
    GSNPCHK1's stored check already binds its stored bytes to CID (its id covers them), and decoding
    it would need the GPU for nvCOMP codecs. Returns the buffer to reuse for the next chunk."""
    if not header.raw_id:
        return raw_buf
    if len(raw_buf) < header.raw_len:  # bounded by ChunkHeader.unpack: at most MAX_RAW_CHUNK
        raw_buf = bytearray(header.raw_len)
    full_check(header, payload, cid, out=memoryview(raw_buf)[:header.raw_len])
    return raw_buf
