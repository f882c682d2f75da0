"""storage/codecs/zstdlib.py: libzstd into the caller's buffers, against hostile payloads and python-zstandard's frames."""
from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import zstandard

from storage.codecs import zstdlib
from storage.codecs.registry import HostCodecChooser, decode_host_into

pytestmark = pytest.mark.skipif(not zstdlib.available(), reason="libzstd not found on this machine")

RAW = (b"gpusnap keeps the workload first " * 40000)[:1 << 20]


def _guarded(n: int) -> tuple[bytearray, memoryview]:
    """A buffer of N bytes between two 4 KiB guards of 0xA5 (what must never be written)."""
    whole = bytearray(b"\xa5" * (n + 8192))
    return whole, memoryview(whole)[4096:4096 + n]


def _guards_intact(whole: bytearray, n: int) -> bool:
    return whole[:4096] == b"\xa5" * 4096 and whole[4096 + n:] == b"\xa5" * 4096


def test_frames_interoperate_both_ways() -> None:
    c = zstdlib.Compressor(1)
    out = memoryview(bytearray(len(RAW)))
    m = c.compress_into(memoryview(RAW), out)
    assert m is not None and m < len(RAW) // 10
    assert zstandard.ZstdDecompressor().decompress(bytes(out[:m])) == RAW  # our frame, their decoder
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(RAW)
    whole, dst = _guarded(len(RAW))
    assert zstdlib.decompress_into(memoryview(frame), dst) == len(RAW)  # their frame, our decoder
    assert bytes(dst) == RAW and _guards_intact(whole, len(RAW))


def test_compress_that_does_not_fit_is_none_not_truncated() -> None:
    rnd = os.urandom(256 << 10)
    assert zstdlib.Compressor(1).compress_into(memoryview(rnd), memoryview(bytearray(200 << 10))) is None
    assert zstdlib.Compressor(1).compress_into(memoryview(rnd), memoryview(bytearray(0))) is None


@pytest.mark.parametrize("case", ["truncated", "two-frames", "no-size", "declares-more", "declares-less",
                                  "garbage", "flipped", "empty"])
def test_hostile_payloads_are_refused_and_nothing_is_written_outside(case: str) -> None:
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(RAW)
    n = len(RAW)
    payload = {
        "truncated": frame[:len(frame) // 2],
        "two-frames": frame + frame,
        "no-size": zstandard.ZstdCompressor(level=1, write_content_size=False).compress(RAW),
        "declares-more": zstandard.ZstdCompressor(level=1).compress(RAW + b"x" * 4096),
        "declares-less": zstandard.ZstdCompressor(level=1).compress(RAW[:-4096]),
        "garbage": os.urandom(4096),
        "flipped": frame[:40] + bytes([frame[40] ^ 0xFF]) + frame[41:],
        "empty": b"",
    }[case]
    whole, dst = _guarded(n)
    try:
        zstdlib.decompress_into(memoryview(payload), dst)
        ok = True
    except zstdlib.ZstdLibError:
        ok = False
    assert _guards_intact(whole, n)
    if case == "flipped" and ok:  # a flipped literal byte may still decode: then the bytes differ,
        assert bytes(dst) != RAW   # and the chunk's id check (chunkfile.full_check) is what refuses it
    else:
        assert not ok, case


def test_threads_share_contexts_safely() -> None:
    ch = HostCodecChooser()
    datas = [os.urandom(64) * (1 << 14) for _ in range(8)]  # 1 MiB each, compressible, distinct
    errors: list[str] = []

    def work(i: int) -> None:
        out = memoryview(bytearray(len(datas[i])))
        back = memoryview(bytearray(len(datas[i])))
        for _ in range(20):
            codec, m = ch.encode_into(memoryview(datas[i]), out)
            got = decode_host_into(codec, out[:m] if codec != "raw" else memoryview(datas[i]), len(datas[i]), back)
            if bytes(got) != datas[i]:
                errors.append(f"thread {i}: {codec} did not round-trip")

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors


def _padded_frame(content: bytes, empty_blocks: int) -> bytes:
    """One zstd frame declaring len(CONTENT) bytes: EMPTY_BLOCKS empty raw blocks, then CONTENT as one raw
    block (RFC 8878: magic, a header with an 8-byte content size and no window descriptor: single
    segment; each block a 3-byte header of last flag, type 0 = raw, and size)."""
    assert len(content) < 1 << 21
    head = (0xFD2FB528).to_bytes(4, "little") + bytes([0b11100000]) + len(content).to_bytes(8, "little")
    last = (1 | (len(content) << 3)).to_bytes(3, "little")
    return head + b"\0\0\0" * empty_blocks + last + content


def test_a_frame_of_countless_empty_blocks_is_walked_without_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    """A crafted frame the size of its bytes to walk (here ~3 MB of empty blocks before 4 KiB of content):
    check_frame still accepts it as the one frame it is, and decodes it right; past QUICK_SPAN_MOST bytes
    its walk goes through the handle that gives the GIL up (what costs ~1 ns a byte must not stall every
    other thread)."""
    content = os.urandom(4096)
    frame = memoryview(bytearray(_padded_frame(content, 1 << 20)))
    assert len(frame) > zstdlib.QUICK_SPAN_MOST
    walked: list[int] = []

    class Quick:  # the GIL-keeping handle, telling which sizes it was asked to walk
        def __getattr__(self, name: str) -> object:
            f = getattr(quick, name)
            if name != "ZSTD_findFrameCompressedSize":
                return f
            def walk(src: Any, m: Any) -> Any:
                walked.append(m)
                return f(src, m)
            return walk
    quick = zstdlib._Q
    monkeypatch.setattr(zstdlib, "_Q", Quick())
    zstdlib.check_frame(frame, len(content))
    assert walked == []  # the large frame went through the handle that gives the GIL up
    small = memoryview(bytearray(_padded_frame(content, 8)))
    zstdlib.check_frame(small, len(content))
    assert walked == [len(small)]  # a small one through the quick handle
    out = memoryview(bytearray(len(content)))
    assert zstdlib.decompress_into(frame, out) == len(content) and bytes(out) == content
    with pytest.raises(zstdlib.ZstdLibError, match="exactly one frame"):
        zstdlib.check_frame(memoryview(bytearray(bytes(frame) + b"\0")), len(content))  # a byte after it


def _both(payload: bytes, n: int) -> tuple[object, object]:
    """What the libzstd path and the path without it (python-zstandard behind check_frame_py) make of
    PAYLOAD: the bytes, or the error class."""
    from unittest import mock
    from storage.codecs.registry import CodecError, ZstdCodec
    out: list[object] = []
    for lib in (True, False):
        with mock.patch.object(zstdlib, "available", lambda: lib):
            try:
                out.append(bytes(ZstdCodec().decode_into(memoryview(payload), n, memoryview(bytearray(n)))))
            except CodecError:
                out.append(CodecError)
    return out[0], out[1]


def test_both_decode_paths_take_exactly_the_same_frame_shapes() -> None:
    """Issue 58: one rule for what a zstd payload must be, on both paths: exactly one zstd frame (never a
    skippable one), declaring exactly the expected size, nothing before or after it. Before, the path
    without libzstd took frames without a declared size, trailing bytes, a second frame, and ran out of
    memory on some malformed ones."""
    raw = os.urandom(3000) + bytes(60000)
    good = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(raw)
    no_size = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(raw)
    with_sum = zstandard.ZstdCompressor(level=3, write_content_size=True, write_checksum=True).compress(raw)
    skippable = (0x184D2A50).to_bytes(4, "little") + (0).to_bytes(4, "little")
    reserved = bytearray(good)
    reserved[4] |= 0x08
    cases = {
        "good": (good, len(raw), raw), "checksummed": (with_sum, len(raw), raw),
        "no declared size": (no_size, len(raw), None), "trailing byte": (good + b"\0", len(raw), None),
        "two frames": (good + good, len(raw), None), "cut short": (good[:-3], len(raw), None),
        "skippable first": (skippable + good, len(raw), None), "only skippable, n=0": (skippable, 0, None),
        "reserved header bit": (bytes(reserved), len(raw), None), "wrong size": (good, len(raw) - 1, None),
        "bad checksum": (with_sum[:-1] + bytes([with_sum[-1] ^ 1]), len(raw), None),
    }
    for what, (payload, n, want) in cases.items():
        lib, py = _both(payload, n)
        assert lib == py, what
        assert (lib == want) if want is not None else not isinstance(lib, bytes), what


def test_frame_layout_reads_what_libzstd_reads() -> None:
    """zstdlib.frame_layout (pure Python) gives the declared size and frame length libzstd gives, over
    frames of every header shape (single segment or not, 1/2/4/8-byte sizes, checksums, dictionary ids)."""
    import ctypes
    for n in (0, 1, 255, 256, 65791, 65792, 200000):
        raw = bytes(range(256)) * (n // 256) + bytes(n % 256)
        variants: list[dict[str, Any]] = [{}, {"write_checksum": True}, {"write_content_size": False},
                                          {"write_dict_id": False}]
        for params in variants:
            frame = zstandard.ZstdCompressor(level=1, **params).compress(raw)
            buf = ctypes.create_string_buffer(frame, len(frame))
            declared = zstdlib._Q.ZSTD_getFrameContentSize(ctypes.addressof(buf), len(frame))
            span = zstdlib._Q.ZSTD_findFrameCompressedSize(ctypes.addressof(buf), len(frame))
            want = None if declared in (zstdlib._UNKNOWN, zstdlib._ERROR) else declared
            assert zstdlib.frame_layout(memoryview(frame)) == (want, span), (n, params)
