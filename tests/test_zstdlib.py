"""storage/zstdlib.py: libzstd into the caller's buffers, against hostile payloads and python-zstandard's frames."""
from __future__ import annotations

import os
import threading

import pytest
import zstandard

from storage import zstdlib
from storage.codecs import HostCodecChooser, decode_host_into

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
