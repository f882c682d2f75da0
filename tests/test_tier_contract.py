"""The chunk-tier contract (storage/repo/tier.py), one suite run against every tier: the directory store
(real pack files on the real disk), the memory tier (a pool of host memory) and chunks arriving from a
remote (a real store on disk pulling from the real local Swift on 127.0.0.1).

Each tier is written through its own writer, then read back with its one verified read; damage is
made where that tier keeps the bytes (a pack file, the pool's memory, the remote's pack object): a
flipped byte, an entry cut short, an entry whose header or record says another length, a forged
entry (for raw-addressed chunks: a sound stored checksum over other bytes). Every damaged read raises
a DamageError (exit 3) and returns no bytes; every other read returns exactly the bytes written."""
from __future__ import annotations

import os
import subprocess
import threading
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from conftest import REPO
from storage.format.chunkfile import HEADER_SIZE, ChunkHeader
from storage.codecs.registry import ZstdCodec, decode_host
from storage.gpu.device import HostDevice
from storage.fs.directio import align_up
from storage.base.errors import EXIT_DAMAGED, DamageError
from storage.format.manifest import ChunkRef, Stream
from storage.tiers.memory import PinnedPool
from storage.format.packs import decode_index
from storage.repo.store import SnapshotStore
from storage.repo.tier import ChunkTier, TierWriter

CHUNK = 256 << 10
DAMAGE = ["flip", "truncate", "wrong-length", "forge"]
TIERS = ["store", "memory", "arrivals"]


def _datas() -> list[bytes]:
    """Six chunks: incompressible, text-like and half zeros, each twice (other seeds)."""
    out = []
    for seed in (1, 2):
        rng = np.random.default_rng(seed)
        out.append(rng.integers(0, 256, CHUNK, dtype=np.uint8).tobytes())
        out.append((b"the quick brown fox %d jumps over the lazy dog\n" % seed) * (CHUNK // 48) + bytes(CHUNK % 48))
        out.append(rng.integers(0, 256, CHUNK // 2, dtype=np.uint8).tobytes() + bytes(CHUNK // 2))
    return out


def _encode(data: bytes) -> tuple[str, bytes]:
    z = ZstdCodec().encode(memoryview(data))
    return ("zstd", bytes(z)) if len(z) < len(data) else ("raw", data)


def _write_all(w: TierWriter, frame: Any, datas: list[bytes], store_writer: Any = None) -> list[ChunkRef]:
    """DATAS written through W's tier interface (stored-addressed, as the GPU path writes); with
    STORE_WRITER (a SnapshotWriter) every other chunk raw-addressed instead, as the host path writes."""
    refs = []
    for i, data in enumerate(datas):
        codec, payload = _encode(data)
        if store_writer is not None and i % 2:
            cid, found = store_writer.find_raw(memoryview(data))
            assert found is None
            frame.view[HEADER_SIZE:HEADER_SIZE + len(payload)] = payload
            refs.append(store_writer.put_chunk(codec, len(data), frame.view, len(payload), raw_id=cid))
            continue
        land = w.landing(frame, len(payload))
        land.view[:] = payload
        refs.append(w.write(land, codec, len(data), len(payload)))
    w.add_stream(Stream("blob/0", {"type": "blob", "chunker": {"name": "fixed", "size": CHUNK}}, refs))
    return refs


def _damage_entry(entry: bytearray, how: str) -> bytearray:
    """ENTRY (a chunk file's bytes, as in a pack) damaged as HOW says; its length is kept, except for
    "truncate", which returns what is left."""
    header = ChunkHeader.unpack(bytes(entry[:64]), "0" * 64)
    if how == "flip":
        entry[HEADER_SIZE + header.stored_len // 2] ^= 0x55
    elif how == "truncate":
        return entry[:HEADER_SIZE + header.stored_len // 2]
    elif how == "wrong-length":
        entry[24:32] = (header.stored_len - 1).to_bytes(8, "little")
    elif how == "forge":
        payload = np.random.default_rng(77).integers(0, 256, header.stored_len, dtype=np.uint8).tobytes()
        forged = header.with_checksum(payload) if header.raw_id else header
        entry[:HEADER_SIZE + header.stored_len] = forged.pack().ljust(HEADER_SIZE, b"\0") + payload
    return entry


class Case:
    """One tier with DATAS written into it: `tier` to read (open() first), `damage(i, how)` before."""

    datas: list[bytes]
    refs: list[ChunkRef]
    tier: ChunkTier

    def damage(self, i: int, how: str) -> None:
        raise NotImplementedError

    def open(self) -> ChunkTier:
        return self.tier

    def close(self) -> None:
        pass


class StoreCase(Case):
    def __init__(self, tmp: Path) -> None:
        self.store = SnapshotStore(str(tmp / "store"))
        self.datas = _datas()
        frame = HostDevice().pinned(HEADER_SIZE + align_up(CHUNK) + HEADER_SIZE)
        with self.store.writer("t") as w:
            self.refs = _write_all(w, frame, self.datas, store_writer=w)
            w.commit()
        frame.close()
        self.tier = self.store

    def damage(self, i: int, how: str) -> None:
        [loc] = self.store.locate(self.refs[i].id or "", refresh=True)
        path = Path(self.store.path, "packs", loc.pack)
        with open(path, "r+b") as f:
            f.seek(loc.offset)
            entry = _damage_entry(bytearray(f.read(loc.length)), how)
            if how == "truncate":
                f.truncate(loc.offset + len(entry))
            else:
                f.seek(loc.offset)
                f.write(entry)


class MemoryCase(Case):
    def __init__(self, tmp: Path) -> None:
        self.pool = PinnedPool(HostDevice().pinned(64 * CHUNK))
        self.datas = _datas()
        with self.pool.writer("t") as w:
            self.refs = _write_all(w, None, self.datas)
            w.commit()
        self.tier = self.pool

    def damage(self, i: int, how: str) -> None:
        ref = self.refs[i]
        v = self.pool.read_verified(ref)
        off = v.addr - self.pool.buffer.ptr
        del v
        mem = self.pool.buffer.view
        if how == "flip":
            mem[off + ref.stored_len // 2] ^= 0x55
        elif how == "truncate":  # memory cannot be cut short: what is lost past the cut reads as zeros
            mem[off + ref.stored_len // 2:off + ref.stored_len] = bytes(ref.stored_len - ref.stored_len // 2)
        elif how == "wrong-length":  # the pool's record of the entry says another length
            e = self.pool._chunks[ref.id or ""]
            self.pool._chunks[ref.id or ""] = replace(e, ref=replace(e.ref, stored_len=ref.stored_len - 1))
        elif how == "forge":
            mem[off:off + ref.stored_len] = np.random.default_rng(77).integers(0, 256, ref.stored_len,
                                                                                dtype=np.uint8).tobytes()

    def close(self) -> None:
        self.pool.close()


class ArrivalsCase(Case):
    """Snapshot t written into store A, pushed to the local Swift; read from an empty store B while a
    RemoteFill brings it (the tier: ArrivingSource)."""

    def __init__(self, tmp: Path, endpoint: str, bucket: str) -> None:
        from storage.remote.backend import Deadline
        from storage.remote.client import Credentials, Remote, RemoteConfig
        from storage.remote.s3backend import S3Backend
        a = StoreCase(tmp / "A")
        self.datas, self.refs = a.datas, a.refs
        cfg = RemoteConfig.make("r", f"s3://{bucket}/contract-{uuid.uuid4().hex[:8]}", endpoint)
        self.remote = Remote(cfg, S3Backend(cfg.spec(), Credentials("test:tester", "testing"), Deadline()))
        self.remote.init()
        rep = self.remote.push(a.store, "t")
        assert rep.packs_sent == 1 and rep.chunks_sent == len(set(r.id for r in self.refs))
        self.b = SnapshotStore(str(tmp / "B"))
        self.fill: Any = None

    def damage(self, i: int, how: str) -> None:
        s3 = self.remote.backend
        [(pack, (_, ents))] = [(p, decode_index(p, s3.get(self.remote.index_key(p), 1 << 20) or b""))
                               for p in self.remote.pack_sizes()]
        [(off, length)] = [(o, n) for cid, o, n in ents if cid == self.refs[i].id]
        body = bytearray(s3.get(self.remote.pack_key(pack), 64 << 20) or b"")
        entry = _damage_entry(body[off:off + length], how)
        if how == "truncate":
            body = body[:off] + entry
        else:
            body[off:off + length] = entry
        s3.put(self.remote.pack_key(pack), bytes(body))

    def open(self) -> ChunkTier:
        from storage.remote.fill import ArrivingSource, RemoteFill
        self.fill = RemoteFill(self.remote, self.b, "t").__enter__()
        self.fill.start()
        self.tier = ArrivingSource(self.b, self.fill)
        return self.tier

    def close(self) -> None:
        if self.fill is not None:
            self.fill.__exit__(None, None, None)


@pytest.fixture(scope="module")
def swift() -> Iterator[tuple[str, str]]:
    from scripts.bench.bench_remote import drop_bucket
    if os.geteuid() != 0:
        pytest.skip("starting Swift needs root")
    p = subprocess.run([str(REPO / "scripts" / "setup" / "swift-setup.sh"), "start"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    endpoint, bucket = p.stdout.strip().splitlines()[-1], f"gpusnap-contract-{uuid.uuid4().hex[:8]}"
    yield endpoint, bucket
    drop_bucket(endpoint, bucket)


@pytest.fixture(params=TIERS)
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[[], Case]]:
    made: list[Case] = []

    def factory() -> Case:
        if request.param == "store":
            c: Case = StoreCase(tmp_path)
        elif request.param == "memory":
            c = MemoryCase(tmp_path)
        else:
            c = ArrivalsCase(tmp_path, *request.getfixturevalue("swift"))
        made.append(c)
        return c
    yield factory
    for c in made:
        c.close()


def _frame() -> Any:
    return HostDevice().pinned(HEADER_SIZE + align_up(CHUNK) + HEADER_SIZE)


def _read(tier: ChunkTier, ref: ChunkRef, frame: Any) -> bytes:
    """REF through TIER's one verified read, decoded as the header it returns says."""
    v = tier.read_verified(ref, frame)
    return bytes(decode_host(v.header.codec, v.payload, v.header.raw_len))


def test_write_has_read_round_trip(make: Callable[[], Case]) -> None:
    case = make()
    tier = case.open()
    frame = _frame()
    assert len({r.id for r in case.refs}) == len(case.datas)
    for ref, data in zip(case.refs, case.datas):
        assert _read(tier, ref, frame) == data
        assert tier.has(ref.id or "")  # arrived (for the remote tier), held (the others)
    for absent in ("0" * 64, "f" * 64, "not an id", (case.refs[0].id or "")[::-1]):
        assert not tier.has(absent)


@pytest.mark.parametrize("how", DAMAGE)
def test_damage_is_a_damage_error_and_returns_no_bytes(make: Callable[[], Case], how: str) -> None:
    case = make()
    # the last two entries: a stored-addressed chunk and (the directory store, the remote) a
    # raw-addressed one; damaged from the end, so that a cut at one leaves the other's entry to cut
    victims = [len(case.refs) - 2, len(case.refs) - 1]
    for i in reversed(victims):
        case.damage(i, how)
    tier = case.open()
    frame = _frame()
    for i in victims:
        with pytest.raises(DamageError) as e:
            _read(tier, case.refs[i], frame)
        assert e.value.exit_code == EXIT_DAMAGED, e.value
    for ref, data in zip(case.refs, case.datas):
        try:
            got = _read(tier, ref, frame)
        except DamageError:
            continue  # a truncated pack takes its later entries with it; a failed pull fails every read
        assert got == data, "a read returned bytes that are not the chunk's"


def test_concurrent_readers_each_get_exactly_the_chunks(make: Callable[[], Case]) -> None:
    case = make()
    tier = case.open()
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        frame = _frame()
        try:
            for _ in range(3):
                for ref, data in list(zip(case.refs, case.datas))[k % 3:] + list(zip(case.refs, case.datas))[:k % 3]:
                    assert _read(tier, ref, frame) == data
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            frame.close()

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
