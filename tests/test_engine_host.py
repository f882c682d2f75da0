"""The GPU data path engine run in CI with host memory standing in for device memory (HostDevice).

Everything the engine does besides the CUDA calls: lanes borrowed and returned, chunks landed in the
lane frame (directory store) or straight in the memory tier's pool, zero chunks found by the
encoding's signature, raw when compression does not pay, restore verified into the target region,
damaged or missing chunks refused; and the memory tier's allocator and accounting.
"""
from __future__ import annotations

import ctypes
import random
from typing import Iterator
from pathlib import Path

import numpy as np
import pytest

from support.entries import chunk_entries, entry_of, ref_id
from storage.gpu.device import HostDevice, HostMemory, host_view
from storage.pipeline.gpu_engine import GpuEngine, GpuEngineError, Region
from storage.tiers.memory import Extents, MemoryTierError, PinnedPool
from storage.repo.store import SnapshotStore, StoreError

CHUNK = 1 << 20


def _bf16_weights(rng: np.random.Generator, n: int) -> bytes:
    return (rng.normal(0, 0.02, n // 2).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()


def _fill(mem: HostMemory, seed: int = 0) -> list[str]:
    """Chunk kinds laid out in MEM (1 MiB chunks): what codec each chunk should be stored with."""
    rng = np.random.default_rng(seed)
    kinds = ["zero", "raw", "zstd", "zero", "zstd", "raw", "zstd", "zero"]
    v = mem.view
    for i, k in enumerate(kinds):
        piece = {"zero": bytes(CHUNK), "raw": rng.bytes(CHUNK), "zstd": _bf16_weights(rng, CHUNK)}[k]
        v[i * CHUNK:(i + 1) * CHUNK] = piece
    tail = len(kinds) * CHUNK  # a short last chunk of text-like bytes
    v[tail:] = (b"gpusnap " * (len(v) // 8))[: len(v) - tail]
    return kinds + ["zstd"]


@pytest.fixture()
def dev() -> HostDevice:
    return HostDevice()


@pytest.fixture()
def region_mem() -> Iterator[HostMemory]:
    mem = HostMemory(8 * CHUNK + 100 * 4096)
    yield mem
    mem.close()


def _engine(dev: HostDevice, **kw: object) -> GpuEngine:
    return GpuEngine(dev, chunk_size=CHUNK, lanes=3, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("tier", ["store", "pool"])
def test_round_trip_codec_choice_and_zero_chunks(tmp_path: Path, dev: HostDevice, region_mem: HostMemory,
                                                 tier: str) -> None:
    kinds = _fill(region_mem)
    original = bytes(region_mem.view)
    region = Region("gpu/0", region_mem.ptr, region_mem.size)
    pool = PinnedPool(dev.pinned(32 * CHUNK)) if tier == "pool" else None
    st = SnapshotStore(str(tmp_path / "s")) if pool is None else None
    target = pool if pool is not None else st
    with _engine(dev) as eng:
        with target.writer("one") as w:  # type: ignore[union-attr]
            res = eng.checkpoint(w, [region])
            w.commit()
        m = target.load("one")  # type: ignore[union-attr]
        assert [c.codec for c in m.streams[0].chunks] == kinds
        assert res.extra["chunks_zero"] == 3 and res.raw_bytes == region_mem.size
        assert res.stored_bytes < region_mem.size - 3 * CHUNK  # zeros elided, zstd chunks smaller
        assert eng.lanes_free == eng.nlanes
        ctypes.memset(region_mem.ptr, 0xAB, region_mem.size)
        back = eng.restore(target, m, {"gpu/0": region})  # type: ignore[arg-type]
        assert bytes(region_mem.view) == original
        assert back.raw_bytes == region_mem.size and eng.lanes_free == eng.nlanes
    if pool is not None:
        assert pool.used == sum(-(-c.stored_len // 4096) * 4096 for c in m.streams[0].chunks if c.id)
        pool.close()
    assert dev.live_allocations == 0  # every lane's scratch and output buffers were freed


def test_raw_codec_engine_and_mismatched_codec(tmp_path: Path, dev: HostDevice, region_mem: HostMemory) -> None:
    _fill(region_mem)
    region = Region("gpu/0", region_mem.ptr, region_mem.size)
    st = SnapshotStore(str(tmp_path / "s"))
    with _engine(dev, codec="raw") as eng:
        with st.writer("raw") as w:
            eng.checkpoint(w, [region])
            w.commit()
        assert {c.codec for c in st.load("raw").streams[0].chunks} == {"raw"}  # no zero signature without a codec
    with _engine(dev) as eng:
        with st.writer("z") as w:
            eng.checkpoint(w, [region])
            w.commit()
    with _engine(dev, codec="raw") as eng, pytest.raises(GpuEngineError, match="raw-only"):
        eng.restore(st, st.load("z"), {"gpu/0": region})
    with pytest.raises(GpuEngineError, match="unknown codec"):
        GpuEngine(dev, codec="nvcomp-ans")


def test_pool_dedup_refcounts_and_replace(dev: HostDevice, region_mem: HostMemory) -> None:
    _fill(region_mem, seed=1)
    region = Region("gpu/0", region_mem.ptr, region_mem.size)
    with PinnedPool(dev.pinned(32 * CHUNK)) as pool, _engine(dev) as eng:
        with pool.writer("a") as w:
            first = eng.checkpoint(w, [region])
            w.commit()
        used = pool.used
        with pool.writer("b") as w:
            second = eng.checkpoint(w, [region])
            w.commit()
        assert second.stored_bytes == 0 and second.extra["chunks_dedup"] == first.extra["chunks_new"]
        assert pool.used == used
        # change one compressible chunk: only it is new
        region_mem.view[2 * CHUNK:2 * CHUNK + 8] = b"changed!"
        with pool.writer("b", replace=True) as w:
            third = eng.checkpoint(w, [region])
            w.commit()
        assert third.extra["chunks_new"] == 1
        pool.remove("a")
        assert pool.names() == ["b"]
        with pool.writer("c") as w, pytest.raises(MemoryTierError, match="already exists"):
            with pool.writer("b"):
                pass
        pool.remove("b")
        assert pool.usage()["used"] == 0 and pool.usage()["chunks"] == 0 and pool.usage()["free_ranges"] == 1


def test_pool_full_mid_checkpoint_keeps_nothing(dev: HostDevice, region_mem: HostMemory) -> None:
    """The tier fills up mid-snapshot: the error says so, no snapshot appears, every byte and lane is returned."""
    _fill(region_mem, seed=2)
    region = Region("gpu/0", region_mem.ptr, region_mem.size)
    with PinnedPool(dev.pinned(2 * CHUNK)) as pool, _engine(dev) as eng:
        with pytest.raises(MemoryTierError, match="full"):
            with pool.writer("big") as w:
                eng.checkpoint(w, [region])
                w.commit()
        assert pool.names() == [] and pool.used == 0 and eng.lanes_free == eng.nlanes
        # and the pool still works afterwards
        small = Region("gpu/0", region_mem.ptr, CHUNK * 3)
        with pool.writer("small") as w:
            eng.checkpoint(w, [small])
            w.commit()
        assert pool.names() == ["small"]


def test_corrupted_chunk_refuses_restore(tmp_path: Path, dev: HostDevice, region_mem: HostMemory) -> None:
    _fill(region_mem, seed=3)
    region = Region("gpu/0", region_mem.ptr, region_mem.size)
    st = SnapshotStore(str(tmp_path / "s"))
    with _engine(dev) as eng, PinnedPool(dev.pinned(32 * CHUNK)) as pool:
        with st.writer("c") as w:
            eng.checkpoint(w, [region])
            w.commit()
        victim = max(chunk_entries(tmp_path / "s"), key=lambda e: e.length)
        victim.flip(5000)
        with pytest.raises(StoreError, match="damaged"):
            eng.restore(st, st.load("c"), {"gpu/0": region})
        # a chunk file that is gone: refused before any byte of the target is written
        victim.remove()
        st = SnapshotStore(str(tmp_path / "s"))  # index files are written once: a new reader sees the change
        before = bytes(region_mem.view)
        with pytest.raises(StoreError, match="missing"):
            eng.restore(st, st.load("c"), {"gpu/0": region})
        assert bytes(region_mem.view) == before
        # the memory tier: one flipped bit in the pool's memory is caught by the id check
        with pool.writer("p") as w:
            eng.checkpoint(w, [region])
            w.commit()
        ref = next(c for c in pool.load("p").streams[0].chunks if c.codec == "zstd")
        addr = pool.read_verified(ref).addr
        host_view(addr, 1)[0] ^= 0x04
        with pytest.raises(MemoryTierError, match="damaged.*does not match"):
            eng.restore(pool, pool.load("p"), {"gpu/0": region})
        assert eng.lanes_free == eng.nlanes


def test_restore_refuses_small_or_unknown_targets(tmp_path: Path, dev: HostDevice, region_mem: HostMemory) -> None:
    _fill(region_mem, seed=4)
    region = Region("gpu/0", region_mem.ptr, region_mem.size)
    st = SnapshotStore(str(tmp_path / "s"))
    with _engine(dev) as eng:
        with st.writer("t") as w:
            eng.checkpoint(w, [region])
            w.commit()
        with pytest.raises(GpuEngineError, match="holds"):
            eng.restore(st, st.load("t"), {"gpu/0": Region("gpu/0", region.dev_ptr, region.size - 4096)})
        with pytest.raises(GpuEngineError, match="no target region"):
            eng.restore(st, st.load("t"), {"gpu/1": region})
    with GpuEngine(dev, chunk_size=CHUNK // 2, lanes=1) as small, pytest.raises(GpuEngineError, match="exceed"):
        small.restore(st, st.load("t"), {"gpu/0": region})


def test_extents_against_a_model() -> None:
    """Random allocs and frees: no overlap, accounting exact, everything coalesces back to one range."""
    rnd = random.Random(5)
    ext = Extents(1000 * 4096)
    live: dict[int, int] = {}
    off: int | None
    for _ in range(3000):
        if live and (rnd.random() < 0.45 or len(live) > 60):
            off = rnd.choice(list(live))
            ext.free(off, live.pop(off))
        else:
            n = rnd.randint(1, 40 * 4096)
            off = ext.alloc(n)
            if off is None:
                assert ext.largest_free < -(-n // 4096) * 4096
                continue
            size = -(-n // 4096) * 4096
            assert all(off + size <= o or o + s <= off for o, s in ((o, -(-s // 4096) * 4096) for o, s in live.items()))
            live[off] = n
        assert ext.used == sum(-(-n // 4096) * 4096 for n in live.values())
    for off, n in list(live.items()):
        ext.free(off, n)
    assert ext.used == 0 and ext.free_ranges == 1 and ext.largest_free == ext.capacity
    with pytest.raises(MemoryTierError, match="double free"):
        a = ext.alloc(4096)
        assert a is not None
        ext.free(a, 4096)
        ext.free(a, 4096)


def test_numa_helpers() -> None:
    """NUMA placement: the node count parses from sysfs; binding to a node that exists works, to one
    that does not is refused (not silently ignored). (Machines here have one node: the placement
    itself is not observable, and RegisteredBuffer only binds where there are several.)"""
    from storage.gpu.device import numa_nodes, prefer_node
    assert numa_nodes() >= 1
    mem = HostMemory(4 << 20)
    try:
        assert prefer_node(mem.ptr, mem.size, 0)
        assert not prefer_node(mem.ptr, mem.size, 63)
    finally:
        mem.close()


def test_pool_concurrent_writers_share_chunks(dev: HostDevice, region_mem: HostMemory) -> None:
    """Two engines checkpoint the same memory into one pool at the same time: both snapshots are
    whole, shared chunks are held once and counted twice, and removing both frees everything."""
    import threading
    _fill(region_mem, seed=6)
    region = Region("gpu/0", region_mem.ptr, region_mem.size)
    original = bytes(region_mem.view)
    errors: list[BaseException] = []
    with PinnedPool(dev.pinned(32 * CHUNK)) as pool:
        def one(name: str) -> None:
            try:
                with _engine(dev) as eng, pool.writer(name) as w:
                    eng.checkpoint(w, [region])
                    w.commit()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
        ts = [threading.Thread(target=one, args=(n,)) for n in ("x", "y")]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors and pool.names() == ["x", "y"]
        unique = {c.id: c.stored_len for c in pool.load("x").streams[0].chunks if c.id}
        assert pool.used == sum(-(-n // 4096) * 4096 for n in unique.values())
        with _engine(dev) as eng:
            ctypes.memset(region_mem.ptr, 0, region_mem.size)
            eng.restore(pool, pool.load("y"), {"gpu/0": region})
        assert bytes(region_mem.view) == original
        pool.remove("x")
        assert pool.used == sum(-(-n // 4096) * 4096 for n in unique.values())
        pool.remove("y")
        assert pool.used == 0


@pytest.mark.parametrize("direct", [False, True])
def test_no_byte_of_an_earlier_chunk_in_a_later_chunk_file(tmp_path: Path, dev: HostDevice, direct: bool) -> None:
    """Chunk A (random bytes: stored raw, so all of it passes through the lane's frame and output
    buffer), then a smaller chunk B through the same single lane: B's file (header, payload, padding
    to 4096) holds no run of A's bytes, written with O_DIRECT (whole aligned blocks) or without."""
    from support.stale_bytes import leaked_runs, word_index
    rng = np.random.default_rng(7)
    a_mem, b_mem = HostMemory(CHUNK), HostMemory(CHUNK)
    try:
        a_mem.view[:] = rng.bytes(CHUNK)
        b_mem.view[:] = bytes(CHUNK)
        b_mem.view[:CHUNK // 4] = _bf16_weights(rng, CHUNK // 4)  # compresses to well under A's length
        st = SnapshotStore(str(tmp_path / "s"))
        if direct and not st.direct:
            pytest.skip("this file system has no O_DIRECT")
        st._direct = direct  # noqa: SLF001 - the write path under test, both ways on one file system
        with GpuEngine(dev, chunk_size=CHUNK, lanes=1) as eng:
            for name, mem in (("a", a_mem), ("b", b_mem)):
                with st.writer(name) as w:
                    eng.checkpoint(w, [Region("gpu/0", mem.ptr, CHUNK)])
                    w.commit()
        (a,), (b,) = st.load("a").streams[0].chunks, st.load("b").streams[0].chunks
        assert a.codec == "raw" and b.codec == "zstd" and b.stored_len < CHUNK // 3
        data = entry_of(tmp_path / "s", ref_id(b)).read()  # its entry in a pack: always padded to 4096
        assert len(data) == 4096 + -(-b.stored_len // 4096) * 4096
        assert data[4096 + b.stored_len:] == bytes(len(data) - 4096 - b.stored_len)  # padding: zeros only
        assert leaked_runs(word_index(a_mem.view), data) == []
        assert leaked_runs(word_index(a_mem.view), a_mem.view[100:200]) != []  # the search finds a real run
    finally:
        a_mem.close()
        b_mem.close()
