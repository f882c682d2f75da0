"""The chunk-tier interface: where snapshots' chunks are written, looked up and read back verified.

Three tiers implement it, and every caller (the GPU engine's checkpoint and restore, the pulls that
serve a restore) uses only what is declared here, never asking which tier it holds:
- the directory store: storage/repo/store.py, SnapshotStore (ChunkTier) and SnapshotWriter (TierWriter);
- the memory tier: storage/tiers/memory.py, PinnedPool and PoolWriter;
- chunks arriving from a remote: storage/remote/fill.py, ArrivingSource (a ChunkTier over a local
  store while a RemoteFill brings the snapshot's chunks; what arrives is written through the local
  store's SnapshotWriter, after the remote check).

Guarantees every tier keeps (tests/test_tier_contract.py runs one suite against each, on real files,
real memory and the real local object store):
- read_verified is the one read: it returns a payload only once the bytes are bound to the chunk's
  id (GSNPCHK1: BLAKE3 of header and payload; GSNPCHK2: decoded, the raw bytes derive the id) and its
  header agrees with the manifest's reference; anything else (a flipped byte, a truncated or
  wrong-length entry, a forged entry, a chunk that is not there) raises a DamageError (ChunkError or
  the tier's `error`, both exit 3), and no byte of it is returned;
- has(id) answers for that tier alone, cheaply, without reading a payload: False for an id it has
  never held, so a writer or a pull stores what is absent;
- reads may run from any number of threads at once; each brings its own frame.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from storage.format.chunkfile import ChunkHeader
from storage.base.errors import DamageError
from storage.format.manifest import ChunkRef, Manifest, Stream

if TYPE_CHECKING:
    from storage.gpu.device import HostBuffer


@dataclass(frozen=True)
class Verified:
    """A payload read_verified has bound to its id: at ADDR (host memory), viewed by PAYLOAD, stored as
    HEADER says (codec, raw and stored length); STAGE names what the read cost, for the stage tables."""

    addr: int
    payload: memoryview
    header: ChunkHeader
    stage: str


class ChunkTier(Protocol):
    """Where chunks are looked up and read back, verified."""

    @property
    def error(self) -> type[DamageError]:
        """What a damaged snapshot read from this tier raises (exit 3)."""

    def has(self, cid: str) -> bool:
        """Whether this tier holds chunk CID (not checked here: read_verified checks)."""

    def missing(self, manifest: Manifest) -> list[str]:
        """The chunk ids MANIFEST names that this tier does not hold (a cheap pass before any output)."""

    def read_verified(self, ref: ChunkRef, frame: HostBuffer) -> Verified:
        """REF's payload bound to its id, read into FRAME (a host buffer laid out like a chunk file,
        at least as large as REF's entry) where the tier has to read it at all; DamageError otherwise."""


@dataclass
class Landing:
    """Where a chunk's stored bytes are put before a TierWriter keeps them: PTR/VIEW (the payload's
    place), FRAME (the whole frame, header room first, for the directory store) and the tier's own
    handle (a memory-tier slot) in SLOT."""

    ptr: int
    view: memoryview
    frame: memoryview | None = None
    slot: object | None = None


class TierWriter(Protocol):
    """One snapshot written into a tier: chunks as they come (any thread), then commit()."""

    @property
    def source(self) -> ChunkTier:
        """Where this writer's chunks can be read back from, also before it commits."""

    def landing(self, frame: HostBuffer, stored_len: int) -> Landing:
        """A place for STORED_LEN payload bytes (in FRAME for the directory store, in the pool for the
        memory tier); handed back by write() or drop()."""

    def write(self, landing: Landing, codec: str, raw_len: int, stored_len: int) -> ChunkRef:
        """Keep the payload at LANDING as one chunk (stored-addressed: GSNPCHK1); its reference."""

    def drop(self, landing: Landing) -> None:
        """Give LANDING back without keeping anything."""

    def note_zero(self, raw_len: int) -> ChunkRef: ...

    def add_stream(self, stream: Stream) -> None: ...

    def commit(self) -> Manifest: ...
