"""GPU tests (marker `gpu`): nvCOMP payloads are a function of the chunk's bytes alone.

Equal memory gives equal payloads whatever the lane's buffers held before (so a second snapshot of
unchanged GPU memory dedups with the default codec), and no byte of an earlier chunk reaches a later
chunk file. Skipped where there is no GPU (conftest.py).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from support.entries import entry_of, ref_id
from support.stale_bytes import leaked_runs, word_index
from support.gpu_results import GB, record

pytestmark = pytest.mark.gpu

MB = 1 << 20


def _model_bytes(seed: int, n: int) -> np.ndarray:
    """A quarter zeros, half bf16 weights, a quarter small integers."""
    rng = np.random.default_rng(seed)
    q = n // 4
    w = (rng.normal(0, 0.02, q).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return np.concatenate([np.zeros(q, np.uint8), w, rng.integers(0, 50, q // 4, dtype=np.int32).view(np.uint8)])


@contextmanager
def _on_device(dev, data: np.ndarray) -> Iterator[int]:
    from storage.gpu.device import check_cuda, cuda_driver
    ptr = dev.alloc(data.nbytes)
    try:
        check_cuda(cuda_driver().cuMemcpyHtoD(ptr, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")
        yield ptr
    finally:
        dev.free(ptr)


def _payload(eng, lane, ptr: int, n: int) -> bytes:
    """What the engine stores for N bytes at PTR, encoded on LANE (its codec's payload, or raw)."""
    from storage.format.chunkfile import HEADER_SIZE
    _codec, src, m = eng._encode(lane, ptr, n)
    eng._d2h(lane, lane.frame.ptr + HEADER_SIZE, src, m)
    return bytes(lane.frame.view[HEADER_SIZE:HEADER_SIZE + m])


@pytest.mark.parametrize("codec", ["nvcomp-ans", "nvcomp-bitcomp", "nvcomp-lz4"])
def test_same_bytes_give_the_same_payload_whatever_the_buffers_held(codec: str) -> None:
    """X, then other bytes Y, then X again with the lane's output buffer full of garbage, then X on
    a fresh lane after another lane's encodes: every payload of X is byte-identical, and holds no run of
    the garbage pattern."""
    from storage.gpu.device import check_cuda, cuda_driver
    from storage.pipeline.gpu_engine import GpuEngine
    n = 64 * MB
    d = cuda_driver()
    with GpuEngine(codec=codec, lanes=2, chunk_size=n) as eng, \
            _on_device(eng.dev, _model_bytes(1, n)) as x, _on_device(eng.dev, _model_bytes(2, n)) as y:
        with eng._lane() as lane:
            first = _payload(eng, lane, x, n)
            _payload(eng, lane, y, n)
            check_cuda(d.cuMemsetD32Async(lane.out, 0xA5C3E1F7, lane.out_cap // 4, lane.stream), "cuMemsetD32Async")
            lane.sync()
            again = _payload(eng, lane, x, n)
        with eng._lane() as other:  # the second lane: its buffers and codec saw nothing yet
            _payload(eng, other, y, n)
            fresh = _payload(eng, other, x, n)
        assert len(first) < n * 0.97, "X must compress, or the test proves nothing about nvCOMP"
        assert again == first and fresh == first
        assert bytes.fromhex("f7e1c3a5" * 2) not in first
        record("nvcomp_stable", {"codec": codec, "payload": len(first)})


def test_recheckpoint_of_unchanged_memory_writes_under_1_percent_with_the_default_codec(tmp_path: Path) -> None:
    """Default codec (ANS), default lanes: snapshot, checkpoint other memory through the same lanes,
    snapshot the unchanged memory again: under 1% of the first snapshot's bytes are new; it restores."""
    from storage.pipeline.gpu_engine import GpuEngine, Region
    from storage.repo.store import SnapshotStore
    from scripts.workloads.workload_control import Workload, ipc_region
    st = SnapshotStore(str(tmp_path / "s"))
    with Workload(GB, mix="realistic", seed=8) as w, GpuEngine() as eng, ipc_region(w.info["ipc"]) as ptr, \
            _on_device(eng.dev, np.random.default_rng(5).integers(0, 256, 512 * MB, dtype=np.uint8)) as other:
        assert eng.codec == "nvcomp-ans"
        region = Region("gpu/0", ptr, w.size)
        with st.writer("d1") as wr:
            first = eng.checkpoint(wr, [region])
            wr.commit()
        with st.writer("other") as wr:  # other bytes through every lane's buffers and scratch
            eng.checkpoint(wr, [Region("gpu/0", other, 512 * MB)])
            wr.commit()
        with st.writer("d2") as wr:
            second = eng.checkpoint(wr, [region])
            wr.commit()
        ids = [[c.id for c in st.load(s).streams[0].chunks] for s in ("d1", "d2")]
        record("ans_dedup", {"gb": w.size / 1e9, "first": first.stored_bytes, "second": second.stored_bytes,
                             "chunks": len(ids[0]), "equal_ids": sum(a == b for a, b in zip(*ids)),
                             "lanes": eng.nlanes})
        assert first.stored_bytes > 0
        assert second.stored_bytes < 0.01 * first.stored_bytes, (first.stored_bytes, second.stored_bytes)
        assert w.cmd("clear")["ok"] and not w.verify()
        eng.restore(st, st.load("d2"), {"gpu/0": region})
        assert w.verify()


def test_no_byte_of_an_earlier_snapshot_in_a_later_snapshots_chunk_files(tmp_path: Path) -> None:
    """Random bytes A (their runs recognisable anywhere), then model-like bytes B, through one lane
    (so B's encodes reuse the output buffer, nvCOMP scratch and host frame that held A): no chunk file
    of B (header, payload, padding) holds a run of A's bytes."""
    from storage.pipeline.gpu_engine import GpuEngine, Region
    from storage.repo.store import SnapshotStore
    n, chunk = 64 * MB, 16 * MB
    a_bytes = np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)
    st = SnapshotStore(str(tmp_path / "s"))
    with GpuEngine(lanes=1, chunk_size=chunk) as eng, _on_device(eng.dev, a_bytes) as a, \
            _on_device(eng.dev, _model_bytes(3, n)) as b:
        for name, ptr in (("a", a), ("b", b)):
            with st.writer(name) as wr:
                eng.checkpoint(wr, [Region("gpu/0", ptr, n)])
                wr.commit()
    words = word_index(a_bytes.tobytes())
    refs = [c for c in st.load("b").streams[0].chunks if c.id]
    assert refs and all(c.codec == "nvcomp-ans" for c in refs)
    found = {}
    for c in refs:
        data = entry_of(tmp_path / "s", ref_id(c)).read()
        assert not any(data[4096 + c.stored_len:]), "padding past the payload must be zeros"
        runs = leaked_runs(words, data)
        if runs:
            found[ref_id(c)[:16]] = runs[:4]
    record("stale_bytes", {"chunks_b": len(refs), "leaks": found, "direct": st.direct})
    assert found == {}
    assert leaked_runs(words, a_bytes[4096:4196].tobytes())  # the search does find a real run
