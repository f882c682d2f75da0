"""Runtime checkpoints in the store: Podman's `container checkpoint --export` archives and runc's
checkpoint image directories, imported as snapshots and exported back in the form the runtime reads.

Guarantees: the checkpoint's files are chunked, deduplicated and checksummed like every snapshot
(content-defined cuts on pages, so the memory images of successive checkpoints share chunks); an
archive is read in place (a compressed one is first decompressed to an unlinked temporary file in the
store), and refused whole if any member is unsafe; import commits the snapshot atomically or not at
all; export never replaces an existing path and leaves nothing behind on failure.
Podman archives are exported as an uncompressed tar (`podman container restore --import` reads it).
"""
from __future__ import annotations

import enum
import gzip
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator
from contextlib import contextmanager

import zstandard

from storage.api import Progress
from storage.api import put as pipeline
from sandbox.host.dumpwrites import dump_packs_direct
from storage.api import GpusnapError
from storage.api import FileTreeSink, FileTreeSource
from storage.api import validate_snapshot_name
from storage.api import SnapshotStore

from sandbox.containers.tar_streams import TarSink, TarSource


class ArchiveError(GpusnapError):
    """A runtime checkpoint that cannot be imported or exported (what it is and why)."""


class CheckpointKind(enum.Enum):
    PODMAN = "podman-checkpoint"   # a `podman container checkpoint --export` archive
    RUNC = "runc-checkpoint"       # a `runc checkpoint --image-path` directory


@dataclass(frozen=True)
class Moved:
    name: str
    kind: CheckpointKind
    path: str
    raw_bytes: int
    new_bytes: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind.value, "path": self.path, "raw_bytes": self.raw_bytes,
                "new_bytes": self.new_bytes, "seconds": round(self.seconds, 3)}


_ZSTD = b"\x28\xb5\x2f\xfd"
_GZIP = b"\x1f\x8b"


@contextmanager
def _uncompressed(path: str, tmp_dir: str) -> Iterator[tuple[BinaryIO, str]]:
    """PATH as an uncompressed tar file object, and the compression it had ("none", "gzip", "zstd")."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ArchiveError(f"{path}: {(e.strerror or str(e)).lower()}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ArchiveError(f"{path}: not a regular file (a Podman checkpoint archive is one file)")
        magic = f.read(4)
        f.seek(0)
        if not magic.startswith(_ZSTD) and not magic.startswith(_GZIP):
            yield f, "none"
            return
        os.makedirs(tmp_dir, 0o700, exist_ok=True)
        with tempfile.TemporaryFile(dir=tmp_dir) as out:   # unlinked at once: nothing left on a crash
            try:
                if magic.startswith(_ZSTD):
                    zstandard.ZstdDecompressor().copy_stream(f, out, write_size=1 << 20)
                    kind = "zstd"
                else:
                    with gzip.GzipFile(fileobj=f) as g:
                        shutil.copyfileobj(g, out, 1 << 20)
                    kind = "gzip"
            except (zstandard.ZstdError, OSError, EOFError) as e:
                raise ArchiveError(f"{path}: damaged {'zstd' if magic.startswith(_ZSTD) else 'gzip'} "
                                   f"archive ({e})") from None
            out.flush()
            out.seek(0)
            yield out, kind


def _put(store: SnapshotStore, name: str, source: Any, meta: dict[str, Any], replace: bool,
         progress: Progress | None, direct_packs: bool) -> pipeline.Result:
    with store.writer(name, replace=replace, meta=meta, direct_packs=direct_packs) as w:
        if progress is not None:
            progress.start(source.total_bytes)
        res = pipeline.put(w, source, progress=progress, chunker="pages")
        w.commit()
    return res


def import_podman(store: SnapshotStore, archive: str, name: str, *, replace: bool = False,
                  progress: Progress | None = None) -> Moved:
    """Store a `podman container checkpoint --export` archive (tar; none, gzip or zstd) as NAME."""
    validate_snapshot_name(name)
    direct_packs = dump_packs_direct()  # (a bad setting refused before the archive is unpacked)
    path = os.path.abspath(archive)
    with _uncompressed(path, store.tmp_dir) as (f, compression):
        source = TarSource(f, path)
        if not any(s.name.startswith("checkpoint/") for s in source.specs):
            raise ArchiveError(f"{path}: no checkpoint/ directory inside; not a Podman checkpoint archive")
        meta = {"kind": CheckpointKind.PODMAN.value, "source": path, "compression": compression}
        res = _put(store, name, source, meta, replace, progress, direct_packs)
    return Moved(name, CheckpointKind.PODMAN, path, res.raw_bytes, res.stored_bytes, res.seconds)


def import_runc(store: SnapshotStore, image_dir: str, name: str, *, replace: bool = False,
                progress: Progress | None = None) -> Moved:
    """Store a runc checkpoint image directory (`runc checkpoint --image-path DIR`) as NAME."""
    validate_snapshot_name(name)
    direct_packs = dump_packs_direct()
    path = os.path.abspath(image_dir)
    if not os.path.isdir(path) or os.path.islink(path):
        raise ArchiveError(f"{path}: not a directory (a runc checkpoint is the --image-path directory)")
    if not os.path.exists(os.path.join(path, "inventory.img")):
        raise ArchiveError(f"{path}: no inventory.img; not a CRIU image directory")
    meta = {"kind": CheckpointKind.RUNC.value, "source": path, "root": os.path.basename(path)}
    with FileTreeSource([path]) as source:
        res = _put(store, name, source, meta, replace, progress, direct_packs)
    return Moved(name, CheckpointKind.RUNC, path, res.raw_bytes, res.stored_bytes, res.seconds)


def export(store: SnapshotStore, name: str, dest: str, *, progress: Progress | None = None) -> Moved:
    """Write snapshot NAME back as the runtime reads it: a tar archive (Podman) or a directory (runc)."""
    dest = os.path.abspath(dest)
    if os.path.lexists(dest):
        raise ArchiveError(f"{dest} already exists; give a new path")
    with store.shared():
        m = store.load(validate_snapshot_name(name))
        try:
            kind = CheckpointKind(m.meta.get("kind"))
        except ValueError:
            raise ArchiveError(f"snapshot {name!r} is a {m.meta.get('kind')!r} snapshot, not a runtime "
                               f"checkpoint (`gpusnap import podman|runc` makes those)") from None
        if progress is not None:
            progress.start(m.size)
        if kind is CheckpointKind.PODMAN:
            res = pipeline.get(store, m, TarSink(dest), progress=progress)
        else:
            res = _export_dir(store, m, dest, progress)
    return Moved(name, kind, dest, res.raw_bytes, 0, res.seconds)


def _export_dir(store: SnapshotStore, m: Any, dest: str, progress: Progress | None) -> pipeline.Result:
    root = m.meta.get("root")
    if not isinstance(root, str) or not root or "/" in root or root in (".", ".."):
        raise ArchiveError(f"snapshot {m.name!r}: its recorded image directory name {root!r} is not a plain name")
    staging = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.gpusnap-export-{os.getpid()}")
    res = pipeline.get(store, m, FileTreeSink(staging), progress=progress)
    try:
        inner = os.path.join(staging, root)
        if not os.path.isdir(inner) or os.path.islink(inner):
            raise ArchiveError(f"snapshot {m.name!r} holds no {root}/ directory")
        os.rename(inner, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return res
