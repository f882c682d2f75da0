"""Snapshots as byte streams: `store cat` (one stream, verified, in order) and `store export`/`import`
(a whole snapshot as one zstd-compressed tar that another store can take in).

Export format (FORMAT.md, "Export archives"): a tar whose first member is `gpusnap-export.json`
({"format": "gpusnap-export", "version": 2, "snapshot": NAME}; version 1 archives are read too), then `manifest.json` (the manifest as
stored, self-checksummed), then `chunks/<id>` for every distinct chunk (the chunk file: header +
payload, no padding), the whole tar compressed with zstd.
Guarantees kept here: export reads every chunk checked (its stored bytes); import trusts nothing in the
archive: the manifest must pass its checksum and validation, every chunk must be bound to the id it is
filed under (chunkfile.check_received: a raw-addressed one decoded and its raw bytes hashed) and
be one the manifest names, member names and sizes are bounded, and the snapshot is committed through
the store's writer (visible only once every chunk it names is durable), so a truncated or forged
archive leaves no snapshot.
"""
from __future__ import annotations

import io
import json
import tarfile
import time
from typing import IO, Iterator

import zstandard

from storage.format.chunkfile import HEADER_SIZE, ChunkError, check_received, max_stored_len
from storage.fs.directio import AlignedBuffer, align_up
from storage.base.errors import DamageError, GpusnapError
from storage.base.limits import MAX_MANIFEST
from storage.format.manifest import Manifest, ManifestError
from storage.base.names import validate_snapshot_name
from storage.repo.store import SnapshotStore

EXPORT_FORMAT = "gpusnap-export"
EXPORT_VERSION = 2  # version 2 archives may hold raw-addressed (GSNPCHK2) chunks
READ_VERSIONS = (1, 2)
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


class PortableError(GpusnapError):
    """An export or import that cannot be done (bad archive, unknown stream, name taken)."""


def cat(store: SnapshotStore, manifest: Manifest, stream: str, out: IO[bytes]) -> int:
    """Write STREAM of MANIFEST to OUT in order, each chunk verified before its bytes go out; returns
    the bytes written. A damaged chunk stops the output with DamageError (what was written is a prefix)."""
    by_name = {x.name: x for x in manifest.streams}
    s = by_name.get(stream.strip("/"))
    if s is None:
        raise PortableError(f"snapshot {manifest.name!r} has no stream {stream!r} (`gpusnap store ls {manifest.name}` lists them)")
    if s.attrs.get("type") == "hardlink":  # another name of a file stored once: its bytes (check_tree
        s = by_name[s.attrs["target"]]     # made sure the target is an earlier file stream)
    if s.attrs.get("type") not in (None, "file", "blob"):
        raise PortableError(f"stream {stream!r} is a {s.attrs.get('type')}, not a file")
    buf = AlignedBuffer(store.chunk_buffer_size([manifest]))
    written = 0
    zero = bytes(1 << 20)
    try:
        for i, ref in enumerate(s.chunks):
            if ref.is_zero:
                left = ref.raw_len
                while left:
                    n = min(left, len(zero))
                    out.write(zero[:n])
                    left -= n
            else:
                try:
                    data = store.read_raw(ref, buf)
                except GpusnapError as e:
                    raise DamageError(f"snapshot {manifest.name!r}: {stream} chunk {i}: {e}") from None
                out.write(data)
            written += ref.raw_len
        out.flush()
    finally:
        buf.close()
    return written


def _add(tar: tarfile.TarFile, name: str, data: bytes | memoryview) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    info.mode = 0o600
    tar.addfile(info, io.BytesIO(bytes(data)))


def export(store: SnapshotStore, name: str, out: IO[bytes], level: int = 3) -> dict[str, int]:
    """Write snapshot NAME as an export archive to OUT (zstd-compressed tar); every chunk verified."""
    with store.shared():
        m = store.load(validate_snapshot_name(name))
        refs = {c.id: c for s in m.streams for c in s.chunks if c.id is not None}
        manifest = m.dumps_bounded("exported")  # what import loads (MAX_MANIFEST): refused before a byte is written
        buf = AlignedBuffer(store.chunk_buffer_size([m]))
        cctx = zstandard.ZstdCompressor(level=level, threads=-1)
        stored = 0
        try:
            with cctx.stream_writer(out, closefd=False) as zw, tarfile.open(fileobj=zw, mode="w|") as tar:
                _add(tar, "gpusnap-export.json", json.dumps(
                    {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "snapshot": m.name}).encode())
                _add(tar, "manifest.json", manifest)
                for cid, ref in sorted(refs.items()):
                    try:
                        header, payload = store.expanded(cid, *store.read_stored(ref, buf))  # a delta: whole
                    except GpusnapError as e:
                        raise DamageError(f"snapshot {name!r} is damaged, not exported: {e}") from None
                    _add(tar, f"chunks/{cid}", header.pack().ljust(HEADER_SIZE, b"\0") + bytes(payload))
                    stored += header.stored_len
        finally:
            buf.close()
    return {"chunks": len(refs), "stored_bytes": stored, "raw_bytes": m.size}


def _members(fileobj: IO[bytes]) -> Iterator[tuple[tarfile.TarInfo, IO[bytes]]]:
    head = fileobj.read(4)
    rest = io.BufferedReader(_Prefixed(head, fileobj))
    stream: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(rest) if head == _ZSTD_MAGIC else rest
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            if not info.isfile():
                raise DamageError(f"export archive member {info.name!r} is not a regular file")
            f = tar.extractfile(info)
            assert f is not None
            yield info, f


class _Prefixed(io.RawIOBase):
    """A raw stream that first gives back bytes already read from it."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self.head, self.rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        if self.head:
            n = min(len(b), len(self.head))
            b[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.rest.read(len(b))
        b[:len(data)] = data
        return len(data)


def import_(store: SnapshotStore, src: IO[bytes], name: str | None = None, *, replace: bool = False) -> dict[str, object]:
    """Take in an export archive from SRC as snapshot NAME (default: its recorded name)."""
    try:
        return _import(store, src, name, replace)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as e:
        raise DamageError(f"not a readable export archive (truncated or corrupted): {e}; nothing was imported") from None


def _import(store: SnapshotStore, src: IO[bytes], name: str | None, replace: bool) -> dict[str, object]:
    members = _members(src)
    first = next(members, None)
    if first is None or first[0].name != "gpusnap-export.json" or first[0].size > 4096:
        raise DamageError("not a gpusnap export archive (its first member is not gpusnap-export.json)")
    info, f = first
    try:
        head = json.loads(f.read())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise DamageError("not a gpusnap export archive (unreadable header)") from None
    if not isinstance(head, dict) or head.get("format") != EXPORT_FORMAT or head.get("version") not in READ_VERSIONS:
        raise DamageError(f"not a gpusnap export archive this version reads ({head!r:.80})")
    second = next(members, None)
    if second is None or second[0].name != "manifest.json" or second[0].size > MAX_MANIFEST:
        raise DamageError("export archive has no manifest.json after its header")
    info, f = second
    try:
        m = Manifest.loads(f.read(), "the archive's manifest")
    except ManifestError as e:
        raise DamageError(str(e)) from None
    target = validate_snapshot_name(name or m.name)
    wanted = {c.id: c for s in m.streams for c in s.chunks if c.id is not None}
    got: set[str] = set()
    buf = AlignedBuffer(HEADER_SIZE + align_up(max((max_stored_len(c.codec, c.raw_len, c.stored_len)
                                                    for c in wanted.values()), default=1)))
    try:
        with store.writer(target, replace=replace, meta=m.meta, tags=m.tags, created=m.created, host=m.host) as w:
            for info, f in members:
                cid = info.name.removeprefix("chunks/")
                ref = wanted.get(cid)
                if not info.name.startswith("chunks/") or ref is None:
                    raise DamageError(f"export archive member {info.name!r} is not a chunk its manifest names")
                most = HEADER_SIZE + max_stored_len(ref.codec, ref.raw_len, ref.stored_len)
                if not HEADER_SIZE <= info.size <= most:
                    raise DamageError(f"export archive chunk {cid[:16]}… has {info.size} bytes, the manifest allows "
                                      f"at most {most}")
                view = buf.view[: info.size]
                n = f.readinto(view)  # type: ignore[attr-defined]
                if n != info.size:
                    raise DamageError(f"export archive chunk {cid[:16]}… is truncated")
                try:
                    header = check_received(cid, ref.codec, ref.raw_len, ref.stored_len, view)
                except ChunkError as e:
                    raise DamageError(f"export archive chunk {cid[:16]}… does not match its id (corrupted or forged: "
                                      f"{e.what}); nothing was imported") from None
                w.put_chunk(header.codec, header.raw_len, buf.view, header.stored_len,
                            raw_id=cid if header.raw_id else None)
                got.add(cid)
            absent = store.missing(m)
            if absent:
                raise DamageError(f"export archive lacks {len(absent)} chunk(s) its manifest names "
                                  f"(first {absent[0][:16]}…); nothing was imported")
            for s in m.streams:
                w.add_stream(s)
            w.commit()
    finally:
        buf.close()
    return {"name": target, "chunks": len(wanted), "chunks_received": len(got), "raw_bytes": m.size}
