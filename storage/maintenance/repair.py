"""Repair: rewrite missing or damaged chunks from wherever their exact bytes still are; report what is lost.

Guarantees kept here: repair holds the store lock exclusively; damaged chunk files go to quarantine/
first (FORMAT.md, "Damage and healing"); a chunk is written back only if the bytes found hash to the id a snapshot asks
for, so a source can heal a store but never change what any snapshot means. Sources: another gpusnap
store (its chunk of the same id, bound to it by chunkfile.id_check), or files and directories, re-read
at the offsets and lengths the snapshots record for each chunk: raw bytes that derive the id are
written raw-addressed (GSNPCHK2, encoded as put encodes); else they are re-encoded with the chunk's
codec (the registry's encoder of that host codec: storage/codecs/registry.py) and must hash to its
stored-addressed id (host codecs only; a chunk encoded on the GPU can come back only from a store
that has it). Files are
opened without following links and only if regular: a FIFO or device among the sources is skipped.
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from storage.base.progress import Progress
from storage.format.chunkfile import HEADER_SIZE, ChunkHeader, chunk_id, id_check, raw_chunk_id
from storage.codecs.delta import BASE_WHY
from storage.codecs.registry import HostCodecChooser, entry, host_codecs
from storage.fs.directio import AlignedBuffer, BufferPool, copy_into
from storage.base.errors import GpusnapError
from storage.format.manifest import ChunkRef, Manifest
from storage.repo.store import Problem, Stray, chunk_refs
from storage.format.storedir import CHUNKS, MARKER, QUARANTINE, TMP

if TYPE_CHECKING:
    from storage.format.packs import PackWriter
    from storage.repo.store import SnapshotStore



class RepairError(GpusnapError):
    """A repair source that cannot be used."""


@dataclass
class RepairReport:
    damaged: int = 0                                        # wanted chunks that were missing or damaged
    repaired: dict[str, str] = field(default_factory=dict)  # chunk id -> where its bytes came from
    lost: list[Problem] = field(default_factory=list)
    strays: list[Stray] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.lost and not self.strays


def repair(store: "SnapshotStore", sources: Sequence[str] = (), *, workers: int = 4, timeout: float = 30.0,
           progress: Progress | None = None) -> RepairReport:
    """Verify every snapshot of STORE, quarantine damaged chunks, and rewrite every missing or damaged
    chunk from the first place that has its exact bytes: its quarantined copy if that verifies after
    all, then SOURCES in order (another gpusnap store, or files and directories). What no source has is
    reported, per snapshot, stream and chunk, as lost."""
    report = RepairReport()
    with store.exclusive(timeout):
        names, report.strays = store.scan()
        manifests = store.load_all(names, report.lost)
        refs = chunk_refs(manifests)
        size = store.chunk_buffer_size(manifests)
        bases = store.delta_bases(refs)  # the closure over delta bases: a base is repaired as any chunk is
        for bid in set().union(*bases.values()) - set(refs):
            bref = store.base_ref(bid)
            if bref is not None:
                refs[bid] = bref
        bad = store.check_chunks(refs, size, workers, progress)
        report.damaged = len(bad)
        need = {cid: refs[cid] for cid in bad}
        with BufferPool(1, size) as pool, pool.borrowed() as buf:
            for cid, why in bad.items():
                if not why.startswith("missing"):
                    store.quarantine_chunk(cid, why)
            for cid, ref in list(need.items()):
                if store.unquarantine_chunk(ref, buf):
                    report.repaired[cid] = f"{QUARANTINE}/ (the copy there verifies)"
                    del need[cid]
        if need:
            with store.subdir(TMP) as tmp, store.subdir(CHUNKS) as chunks, store.packing(tmp) as pw:
                for cid, where in rebuild(store, pw, chunks, manifests, need, list(sources), size).items():
                    report.repaired[cid] = where
                    del need[cid]
        for did, bids in bases.items():  # a delta whose base is lost is lost with it
            lost = next((b for b in sorted(bids) if b in need or b not in refs), None)
            if lost is not None and did not in need:
                need[did] = refs[did]
                bad[did] = f"{BASE_WHY} {lost[:16]}… {bad.get(lost, 'missing')}"
        from storage.repo import damage
        damage.update(store, [c for c in refs if c not in need], {c: bad[c] for c in need})
        for m in manifests:
            for s in m.streams:
                for i, c in enumerate(s.chunks):
                    if c.id in need:
                        report.lost.append(Problem(m.name, s.name, i, f"chunk {c.id[:16]}… lost: "
                                                   f"{bad[c.id]}; no source has its bytes"))
    return report


def rebuild(store: "SnapshotStore", pw: "PackWriter", chunks_fd: int, manifests: list[Manifest],
            need: dict[str, ChunkRef], sources: list[str], size: int) -> dict[str, str]:
    """Write every chunk of NEED that a source in SOURCES has; returns id -> the source it came from."""
    found: dict[str, str] = {}
    buf = AlignedBuffer(max(size, HEADER_SIZE + max((r.raw_len for r in need.values()), default=1)) * 2)
    try:
        for src in sources:
            if not need.keys() - found.keys():
                break
            src = os.path.abspath(src)
            if os.path.isfile(os.path.join(src, MARKER)):
                got = _from_store(store, pw, chunks_fd, src, {k: v for k, v in need.items() if k not in found},
                                  buf)
            else:
                got = _from_files(store, pw, chunks_fd, src, manifests,
                                  {k: v for k, v in need.items() if k not in found}, buf)
            found.update(got)
    finally:
        buf.close()
    return found


def _keep(store: "SnapshotStore", pw: "PackWriter", chunks_fd: int, ref: ChunkRef, header: ChunkHeader,
          payload: bytes | memoryview, buf: AlignedBuffer) -> bool:
    """Write PAYLOAD as chunk REF (its file's header: HEADER) if it is bound to REF's id: a GSNPCHK1
    payload hashes to it; a GSNPCHK2 one was checked by the caller (its raw bytes derive the id)."""
    assert ref.id is not None
    if len(payload) != header.stored_len or (not header.raw_id and chunk_id(header, payload) != ref.id):
        return False
    copy_into(buf.view[HEADER_SIZE:], payload)
    store.store_chunk(pw, chunks_fd, header, buf.view, ref.id)
    return True


_PUT_ENCODER = HostCodecChooser()  # how put encodes a new host chunk (storage.codecs.registry: the per-chunk choice)


def _keep_raw(store: "SnapshotStore", pw: "PackWriter", chunks_fd: int, ref: ChunkRef, raw: bytes,
              buf: AlignedBuffer) -> bool:
    """Write the raw bytes RAW as chunk REF: raw-addressed if they derive its id, else re-encoded
    with REF's codec if that hashes to its stored-addressed id."""
    assert ref.id is not None
    if raw_chunk_id(raw) == ref.id:
        enc = _PUT_ENCODER.encode(memoryview(raw))
        n = len(enc.payload)
        return _keep(store, pw, chunks_fd, ref, ChunkHeader(enc.codec, len(raw), n, raw_id=True),
                     enc.payload, buf)
    if ref.codec not in host_codecs():
        return False
    encode = entry(ref.codec).encode  # the registry's encoder: zstd at level 1, as version 1 wrote it
    if encode is None:
        return False
    payload = encode(memoryview(raw))
    return _keep(store, pw, chunks_fd, ref, ChunkHeader(ref.codec, ref.raw_len, ref.stored_len), payload, buf)


def _from_store(store: "SnapshotStore", pw: "PackWriter", chunks_fd: int, path: str, need: dict[str, ChunkRef],
                buf: AlignedBuffer) -> dict[str, str]:
    from storage.repo.store import SnapshotStore  # noqa: PLC0415 - the type is imported for checking only above
    other = SnapshotStore(path, create=False)
    got: dict[str, str] = {}
    with other.shared():
        for cid, ref in need.items():
            def whole(header: "ChunkHeader", payload: memoryview, cid: str = cid) -> tuple["ChunkHeader", memoryview]:
                header, payload = other.expanded(cid, header, payload)  # a delta there comes here whole
                id_check(header, payload, cid)
                return header, payload
            try:
                header, payload = other.first_sound(ref, buf, whole, check=False)  # its first sound copy
            except (GpusnapError, OSError):
                continue
            data = bytes(payload)
            if _keep(store, pw, chunks_fd, ref, header, data, buf):
                got[cid] = f"store {path}"
    return got


def _regular_files(top: str) -> Iterator[tuple[str, str]]:
    """(path, name as `put` would store it) of every file under TOP, links not followed."""
    base = os.path.basename(os.path.normpath(top))
    if not os.path.isdir(top) or os.path.islink(top):
        yield top, base
        return
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames.sort()
        rel = os.path.relpath(dirpath, top)
        for n in sorted(filenames):
            yield os.path.join(dirpath, n), f"{base}/{n}" if rel == "." else f"{base}/{rel}/{n}"


def _from_files(store: "SnapshotStore", pw: "PackWriter", chunks_fd: int, top: str, manifests: list[Manifest],
                need: dict[str, ChunkRef], buf: AlignedBuffer) -> dict[str, str]:
    # where each needed chunk sits in its streams: stream name -> [(offset, ref)], and stream sizes
    wanted: dict[str, list[tuple[int, ChunkRef]]] = {}
    sizes: dict[str, int] = {}
    for m in manifests:
        for s in m.streams:
            off = 0
            for c in s.chunks:
                if c.id in need:
                    wanted.setdefault(s.name, []).append((off, c))
                    sizes[s.name] = s.size
                off += c.raw_len
    got: dict[str, str] = {}
    for path, name in _regular_files(top):
        if not wanted:
            break
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                continue
            # the stream stored under this file's name first, then any stream of the same size
            streams = [n for n in wanted if n == name] + [n for n in wanted if n != name and sizes[n] == st.st_size]
            for sname in streams:
                for off, ref in list(wanted.get(sname, [])):
                    if ref.id in got or ref.codec not in host_codecs() or off + ref.raw_len > st.st_size:
                        continue
                    raw = os.pread(fd, ref.raw_len, off)
                    if _keep_raw(store, pw, chunks_fd, ref, raw, buf):
                        got[ref.id] = f"{path} at offset {off}"  # type: ignore[index]
                for sn in list(wanted):
                    wanted[sn] = [(o, r) for o, r in wanted[sn] if r.id not in got]
                    if not wanted[sn]:
                        del wanted[sn]
        finally:
            os.close(fd)
    return got
