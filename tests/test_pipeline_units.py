"""Units of the pipeline that need no disk: zero test, content-defined page cuts, codec choice, pool."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from storage.codecs.registry import CodecError, HostCodecChooser, decode_host
from storage.fs.directio import BufferPool, DirectIOError
from storage.pipeline.put import PAGE, cdc_params, is_zero, page_cuts


def test_is_zero() -> None:
    z = bytearray(1 << 20)
    assert is_zero(memoryview(z))
    for pos in (0, 63, 64, 4097, len(z) - 1):
        z[pos] = 1
        assert not is_zero(memoryview(z)), pos
        z[pos] = 0
    assert is_zero(memoryview(bytearray(13)))


def _chunks(data: bytes, max_len: int = 4 << 20) -> list[bytes]:
    cuts = page_cuts(memoryview(data), max_len)
    ends = cuts + ([len(data)] if not cuts or cuts[-1] < len(data) else [])
    out, prev = [], 0
    for c in ends:
        out.append(data[prev:c])
        prev = c
    return out


def test_page_cuts_bounds_and_alignment() -> None:
    data = np.random.default_rng(1).bytes(32 << 20)
    cuts = page_cuts(memoryview(data), 4 << 20)
    assert cuts and all(c % PAGE == 0 for c in cuts)
    gaps = np.diff([0] + cuts)
    least = cdc_params(4 << 20)[0]
    assert gaps.min() >= least and gaps.max() <= 4 << 20
    assert least < gaps.mean() < 3.5 * (1 << 20) and (gaps < 4 << 20).mean() > 0.9  # content-defined, not at the limits


def test_page_cuts_resynchronize_after_inserted_pages() -> None:
    """Pages inserted near the start change only the chunks around them, as CRIU images need."""
    rng = np.random.default_rng(2)
    data = rng.bytes(48 << 20)  # ~20 chunks of ~2.5 MiB: all but the one or two around the insertion stay
    shifted = data[: 3 << 20] + rng.bytes(5 * PAGE) + data[3 << 20:]
    a, b = set(_chunks(data)), set(_chunks(shifted))
    shared = sum(len(c) for c in a & b)
    assert shared > 0.8 * len(data)


def test_page_cuts_zero_pages_and_small_inputs() -> None:
    assert page_cuts(memoryview(bytes(100)), 4 << 20) == []
    cuts = page_cuts(memoryview(bytes(8 << 20)), 4 << 20)
    assert cuts and all(c % PAGE == 0 for c in cuts)


def test_codec_choice() -> None:
    ch = HostCodecChooser()
    rnd = memoryview(os.urandom(1 << 20))
    assert ch.encode(rnd).codec == "raw"
    text = memoryview(b"gpusnap " * 100000)
    enc = ch.encode(text)
    assert enc.codec == "zstd" and len(enc.payload) < len(text) // 10
    assert bytes(decode_host("zstd", memoryview(enc.payload), len(text))) == bytes(text)
    with pytest.raises(CodecError, match="decoded to"):
        decode_host("zstd", memoryview(enc.payload), len(text) + 1)
    with pytest.raises(CodecError, match="GPU path"):
        decode_host("nvcomp-ans", memoryview(b"x"), 1)
    with pytest.raises(CodecError, match="unknown"):
        decode_host("lzma", memoryview(b"x"), 1)
    assert HostCodecChooser(compress=False).encode(text).codec == "raw"


def test_buffer_pool_accounting_and_backpressure() -> None:
    with BufferPool(2, 10000) as pool:
        assert pool.size % 4096 == 0
        a, b = pool.acquire(), pool.acquire()
        with pytest.raises(DirectIOError):
            pool.acquire(timeout=0.05)  # all in use: the reader would block here
        got = []
        t = threading.Thread(target=lambda: got.append(pool.acquire(timeout=5)))
        t.start()
        pool.release(a)
        t.join()
        assert got == [a]
        pool.release(b)
        pool.release(got[0])
        with pool.borrowed() as c:
            assert c in (a, b)


def test_large_page_images_read_by_several_producers(tmp_path, monkeypatch) -> None:
    """A page image larger than two segments is cut by several producers at once: byte-exact back,
    a cut at every segment boundary, and a second put after pages were inserted near the start still
    dedups (the forced cuts cost at most a chunk or two per segment)."""
    from storage.pipeline import put as pipeline
    from storage.archive.filetree import FileTreeSink, FileTreeSource
    from storage.repo.store import SnapshotStore
    monkeypatch.setattr(pipeline, "SEGMENT", 16 << 20)
    rng = np.random.default_rng(9)
    img = tmp_path / "images"
    img.mkdir()
    pages = rng.bytes(40 << 20) + bytes(16 << 20) + rng.bytes(24 << 20)
    (img / "pages-1.img").write_bytes(pages)
    st = SnapshotStore(str(tmp_path / "store"))
    with st.writer("a") as w:
        first = pipeline.put(w, FileTreeSource([str(img)]), chunker="pages", chunk_size=1 << 20, workers=8)
        w.commit()
    stream = next(s for s in st.load("a").streams if s.name == "images/pages-1.img")
    ends = np.cumsum([c.raw_len for c in stream.chunks])
    assert all(b in set(ends.tolist()) for b in range(16 << 20, len(pages), 16 << 20)), "a cut at every segment end"
    pipeline.get(st, st.load("a"), FileTreeSink(str(tmp_path / "out")))
    assert (tmp_path / "out" / "images" / "pages-1.img").read_bytes() == pages
    (img / "pages-1.img").write_bytes(pages[:PAGE * 100] + rng.bytes(3 * PAGE) + pages[PAGE * 100:])
    with st.writer("b") as w:
        second = pipeline.put(w, FileTreeSource([str(img)]), chunker="pages", chunk_size=1 << 20, workers=8)
        w.commit()
    assert second.stored_bytes < 0.25 * first.stored_bytes, (first.stored_bytes, second.stored_bytes)


def test_decode_host_into_decodes_in_place_and_refuses_what_does_not_fit() -> None:
    import zstandard
    from storage.codecs.registry import CodecError, decode_host_into
    raw = (b"gpusnap " * 70000)[:500000]
    out = memoryview(bytearray(600000))
    frame = zstandard.ZstdCompressor(level=1).compress(raw)
    got = decode_host_into("zstd", memoryview(frame), len(raw), out)
    assert bytes(got) == raw and got.obj is out.obj  # into OUT, nothing allocated for the bytes
    payload = memoryview(raw)
    assert decode_host_into("raw", payload, len(raw), out) is payload  # a raw chunk is used where it was read
    with pytest.raises(CodecError, match="more than"):
        decode_host_into("zstd", memoryview(frame), len(raw) - 1, out)
    with pytest.raises(CodecError, match="decoded to"):
        decode_host_into("zstd", memoryview(frame), len(raw) + 1, out)
    with pytest.raises(CodecError):
        decode_host_into("zstd", memoryview(frame[: len(frame) // 2]), len(raw), out)
    with pytest.raises(CodecError, match="raw payload"):
        decode_host_into("raw", payload[:10], len(raw), out)


def test_put_workers_are_bounded_and_can_be_set(monkeypatch) -> None:
    from storage.pipeline import put as pipeline
    monkeypatch.delenv("GPUSNAP_PUT_WORKERS", raising=False)
    assert 2 <= pipeline.put_workers() <= pipeline.PUT_WORKERS_MOST
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert pipeline.put_workers() == pipeline.PUT_WORKERS_MOST  # more threads only add GIL handoffs
    monkeypatch.setenv("GPUSNAP_PUT_WORKERS", "12")
    assert pipeline.put_workers() == 12
    for bad in ("lots", "\u00b2", "0", "-3"):  # not a count (a superscript passes str.isdigit): the default
        monkeypatch.setenv("GPUSNAP_PUT_WORKERS", bad)
        assert pipeline.put_workers() == pipeline.PUT_WORKERS_MOST


@pytest.mark.parametrize("which", [(True, True), (False, True), (True, False), (False, False)])
def test_shuffle2_planes_split_straight_into_the_payload_round_trip(which) -> None:
    from storage.codecs.registry import _SHUFFLE2
    rng = np.random.default_rng(5)
    w = (rng.normal(0, 0.02, 1 << 18).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    for data in (w.tobytes(), bytes(1 << 16), rng.integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()):
        dst = memoryview(bytearray(len(data) + 64))
        m = _SHUFFLE2.encode_into(memoryview(data), dst, which)
        assert m is not None
        assert bytes(decode_host("shuffle2-zstd", dst[:m], len(data))) == data
        # a small destination: refused, or a whole payload that fits it (never one cut short)
        small = dst[:len(data) // 4]
        m = _SHUFFLE2.encode_into(memoryview(data), small, which)
        if m is not None:
            assert m <= len(small) and bytes(decode_host("shuffle2-zstd", small[:m], len(data))) == data
        if not any(which):  # both planes as they are cannot fit in a quarter
            assert m is None
