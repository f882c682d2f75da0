"""The byte planes in C (storage/codecs/shufflelib.py) against numpy's, and the codec's payloads with and without them."""
from __future__ import annotations

import os
import shutil
import struct

import numpy as np
import pytest

from storage.codecs import registry as codecs

from storage.codecs import shufflelib
from storage.native import build

SIZES = [0, 1, 7, (1 << 18) - 1, (1 << 18) + 3, 1 << 21]  # elements: empty, odd, around a numpy step, 4 MiB


def _numpy_plane(a: np.ndarray, which: int, layout: int) -> np.ndarray:
    x: np.ndarray = a.astype(np.uint32)
    if layout == 2:
        x = ((x << 1) | (x >> 15)) & 0xFFFF
    return ((x >> 8) if which else (x & 0xFF)).astype(np.uint8)


def test_setup_built_the_library() -> None:
    # scripts/setup.sh builds it (the CI runs that first): the tests below then test the C path
    if os.environ.get("GPUSNAP_NO_NATIVE"):
        pytest.skip("$GPUSNAP_NO_NATIVE is set")
    assert shufflelib.available(), f"{shufflelib.LIBRARY} is not built or not loadable (python3 -m storage.native.build)"
    assert shufflelib.LIBRARY in build.build()  # newer than its source: kept as it is
    from sandbox.doctor import _host_codec
    assert _host_codec()["byte_planes"] == _host_codec()["page_counts"] == "C"  # and `gpusnap doctor` says so


@pytest.mark.parametrize("layout", [1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_planes_and_merge_match_numpy(layout: int, n: int) -> None:
    if not shufflelib.available():
        pytest.skip("the library is not built")
    a = np.random.default_rng(n + layout).integers(0, 1 << 16, n, dtype=np.uint16)
    planes = []
    for which in (0, 1):
        into = np.full(n, 0xAA, np.uint8)
        assert shufflelib.plane(a, which, into, layout)
        np.testing.assert_array_equal(into, _numpy_plane(a, which, layout))
        planes.append(into)
    out = np.zeros(n + 1, np.uint16)  # one element more: the call writes exactly N
    assert shufflelib.merge(planes[0], planes[1], out[:n], layout)
    np.testing.assert_array_equal(out[:n], a)
    assert out[n] == 0


def test_arrays_it_does_not_take_are_left_to_the_caller() -> None:
    if not shufflelib.available():
        pytest.skip("the library is not built")
    a = np.arange(64, dtype=np.uint16)
    into = np.zeros(64, np.uint8)
    assert not shufflelib.plane(a[::2], 0, into[:32], 2)              # strided
    assert not shufflelib.plane(a.astype(np.int16), 0, into, 2)       # signed
    assert not shufflelib.plane(a, 0, into[:63], 2)                   # sizes differ
    assert not shufflelib.plane(a, 0, a.view(np.uint8)[:64], 2)       # output overlaps the input
    ro = np.zeros(64, np.uint8)
    ro.flags.writeable = False
    assert not shufflelib.plane(a, 0, ro, 2)                          # read-only output
    assert not shufflelib.plane(a, 2, into, 2)                        # no such plane
    assert not shufflelib.merge(into, into, a, 3)                     # no such layout
    assert not shufflelib.merge(into, into[:63], a, 2)


@pytest.mark.parametrize("kind", ["weights", "random", "zeros"])
def test_codec_payloads_are_the_same_either_way(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(7)
    if kind == "weights":
        raw = (rng.standard_normal(1 << 20).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()
    elif kind == "random":
        raw = rng.integers(0, 256, 1 << 21, dtype=np.uint8).tobytes()
    else:
        raw = bytes(1 << 21)
    results = _payloads_either_way(codecs.Shuffle2Codec(), raw, monkeypatch)
    assert results[0] == results[1]


def _payloads_either_way(c: "codecs.Shuffle2Codec | codecs.Shuffle4Codec", raw: bytes,
                         monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """RAW's payload by C's planes, then by numpy's (the library taken away), each decoded back to RAW
    into a buffer and into a new one from read-only memory: the two payloads."""
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(shufflelib, "_lib", None)
        dst = memoryview(bytearray(len(raw) + 64))
        m = c.encode_into(memoryview(raw), dst)
        assert m is not None
        out = memoryview(bytearray(len(raw)))
        assert bytes(c.decode(dst[:m], len(raw), out)) == raw
        assert bytes(c.decode(memoryview(bytes(dst[:m])), len(raw))) == raw
        results.append(bytes(dst[:m]))
    return results


@pytest.mark.parametrize("native", [True, False])
def test_layout_1_payloads_still_decode(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layout 1 payload (an older writer's) decodes the same through numpy and through C."""
    if not native:
        monkeypatch.setattr(shufflelib, "_lib", None)
    raw = np.random.default_rng(3).integers(0, 1 << 16, 1 << 16, dtype=np.uint16)
    lo, hi = _numpy_plane(raw, 0, 1), _numpy_plane(raw, 1, 1)
    payload = codecs.Shuffle2Codec._HEAD.pack(1, 0, 0, lo.size) + lo.tobytes() + hi.tobytes()
    got = codecs.Shuffle2Codec().decode(memoryview(payload), raw.nbytes)
    assert bytes(got) == raw.tobytes()


def test_loader_refuses_links_and_files_others_may_write(tmp_path: "os.PathLike[str]") -> None:
    if not shufflelib.available():
        pytest.skip("the library is not built")
    lib = os.path.join(tmp_path, "lib.so")
    shutil.copy(shufflelib.LIBRARY, lib)
    os.chmod(lib, 0o755)
    assert shufflelib._load(lib) is not None
    os.chmod(lib, 0o775)
    assert shufflelib._load(lib) is None
    os.chmod(lib, 0o757)
    assert shufflelib._load(lib) is None
    os.chmod(lib, 0o755)
    link = os.path.join(tmp_path, "link.so")
    os.symlink(lib, link)
    assert shufflelib._load(link) is None
    assert shufflelib._load(os.path.join(tmp_path, "missing.so")) is None


@pytest.mark.parametrize("layout", [1, 2])
def test_merge_views_matches_numpy_and_refuses_what_it_cannot_take(layout: int) -> None:
    if not shufflelib.available():
        pytest.skip("the library is not built")
    a = np.random.default_rng(layout).integers(0, 1 << 16, 4099, dtype=np.uint16)
    lo, hi = bytearray(_numpy_plane(a, 0, layout).tobytes()), bytearray(_numpy_plane(a, 1, layout).tobytes())
    out = bytearray(2 * a.size + 2)  # two bytes more: the call writes exactly 2 * N
    assert shufflelib.merge_views(memoryview(lo), memoryview(hi), memoryview(out)[:2 * a.size], layout)
    assert bytes(out[:2 * a.size]) == a.tobytes() and out[-2:] == b"\0\0"
    mv = memoryview(out)[:2 * a.size]
    assert not shufflelib.merge_views(memoryview(bytes(lo)), memoryview(hi), mv, layout)     # read-only plane
    assert not shufflelib.merge_views(memoryview(lo), memoryview(hi), memoryview(bytes(mv)), layout)  # read-only out
    assert not shufflelib.merge_views(memoryview(lo)[:-1], memoryview(hi), mv, layout)       # lengths differ
    assert not shufflelib.merge_views(mv[:a.size], memoryview(hi), mv, layout)               # a plane inside the output
    assert not shufflelib.merge_views(memoryview(lo), memoryview(hi), mv, 3)                  # no such layout
    assert shufflelib.merge_views(memoryview(b""), memoryview(b""), memoryview(bytearray()), layout)  # nothing to do


def test_a_read_only_payload_still_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A payload in read-only memory (bytes) with a stored plane: the C merge cannot take it, numpy does."""
    raw = np.random.default_rng(5).integers(0, 1 << 16, 1 << 16, dtype=np.uint16).tobytes()
    c = codecs.Shuffle2Codec()
    payload = c.encode(memoryview(raw), which=(False, False))  # both planes stored as they are
    assert bytes(c.decode(memoryview(payload), len(raw))) == raw
    assert bytes(c.decode(memoryview(bytearray(payload)), len(raw))) == raw


def test_a_restore_does_not_load_numpy(tmp_path: "os.PathLike[str]") -> None:
    """The restore's process and its fill workers import the restore path and decode byte-plane chunks
    without numpy (~40 MB of libraries read cold, 0.1 s at each restore's start on the dev VM): a
    fresh interpreter imports them, decodes a chunk as the fill does (into a page-aligned buffer,
    verified against its id), and must not have loaded numpy."""
    if not shufflelib.available():
        pytest.skip("the library is not built")
    import subprocess
    import sys
    from storage.format.chunkfile import ChunkHeader, raw_chunk_id
    raw = (np.random.default_rng(9).standard_normal(1 << 20).astype(np.float32).view(np.uint32) >> 16
           ).astype(np.uint16).tobytes()
    payload = codecs.Shuffle2Codec().encode(memoryview(raw))
    path = os.path.join(tmp_path, "payload")
    with open(path, "wb") as f:
        f.write(payload)
    code = f"""
import sys
import cli.criu_cmd, sandbox.criu.snapshot, sandbox.criu.fill_procs, sandbox.criu.serve  # the restore's imports
from storage.format.chunkfile import ChunkHeader, full_check
from storage.fs.directio import AlignedBuffer
with AlignedBuffer({len(payload)}) as src, AlignedBuffer({len(raw)}) as dst:
    with open({path!r}, "rb") as f:
        f.readinto(src.view[:{len(payload)}])
    h = ChunkHeader("shuffle2-zstd", {len(raw)}, {len(payload)}, True)
    got = full_check(h, src.view[:{len(payload)}], {raw_chunk_id(raw)!r}, dst.view)
    assert len(got) == {len(raw)}
print("numpy" in sys.modules)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False", "numpy was loaded on the restore path"


def _bf16(n: int, seed: int) -> bytes:
    return (np.random.default_rng(seed).standard_normal(n).astype(np.float32).view(np.uint32) >> 16
            ).astype(np.uint16).tobytes()


def _planes_of(raw: bytes) -> tuple[memoryview, int, memoryview, int, int]:
    """A layout 2 payload of RAW with both planes as zstd frames: (plane 0, kind, plane 1, kind, layout)."""
    c = codecs.Shuffle2Codec()
    p = memoryview(bytearray(c.encode(memoryview(raw))))
    layout, k0, k1, n0 = codecs.Shuffle2Codec._HEAD.unpack_from(p)
    body = p[codecs.Shuffle2Codec._HEAD.size:]
    return body[:n0], k0, body[n0:], k1, layout


def test_decode_planes_in_one_call_and_what_it_refuses() -> None:
    from storage.codecs import zstdlib
    if not shufflelib.available() or not zstdlib.available():
        pytest.skip("the library or libzstd is not here")
    raw = _bf16(1 << 20, 11)
    p0, k0, p1, k1, layout = _planes_of(raw)
    assert k1 == 1  # the exponent plane is a frame (the mantissa's may be stored)
    h = len(raw) // 2
    scratch, out = memoryview(bytearray(2 * h)), memoryview(bytearray(len(raw) + 8))
    fn = zstdlib.DECOMPRESS_DCTX
    assert fn
    with zstdlib.dctx() as d:
        assert shufflelib.decode_planes(p0, k0, p1, k1, layout, scratch, out[:len(raw)], d, fn) == 0
        assert bytes(out[:len(raw)]) == raw and bytes(out[len(raw):]) == bytes(8)  # nothing past its end
        # what it leaves to the caller: a read-only plane, the output over a plane or the scratch, too
        # little scratch, a stored plane of another length, no context
        assert shufflelib.decode_planes(memoryview(bytes(p0)), k0, p1, k1, layout, scratch, out[:len(raw)], d, fn) is None
        both = memoryview(bytearray(len(raw) + len(p1)))
        both[len(raw):] = p1
        assert shufflelib.decode_planes(p0, k0, both[len(raw):], k1, layout, scratch, both[:len(raw)], d, fn) == 0
        assert shufflelib.decode_planes(p0, k0, both[len(raw) - 8:], k1, layout, scratch, both[:len(raw)], d, fn) is None
        assert shufflelib.decode_planes(p0, k0, p1, k1, layout, out[:h], out[:len(raw)], d, fn) is None
        assert shufflelib.decode_planes(p0, k0, p1, k1, layout, scratch[:h * (k0 + k1) - 1], out[:len(raw)], d, fn) is None
        assert shufflelib.decode_planes(p0[:-1] if k0 == 0 else p0, 0, p1, k1, layout, scratch, out[:len(raw)], d, fn) is None
        assert shufflelib.decode_planes(p0, k0, p1, k1, layout, scratch, out[:len(raw)], 0, fn) is None
        odd = memoryview(bytearray(len(raw) + 1))[1:]  # the output at an odd address: 2-byte stores want even
        assert shufflelib.decode_planes(p0, k0, p1, k1, layout, scratch, odd, d, fn) is None
        assert not shufflelib.merge_views(memoryview(bytearray(h)), memoryview(bytearray(h)), odd, layout)
        # a frame that decodes to fewer bytes than the plane: the call says which plane
        small = bytearray(h)
        n = zstdlib.Compressor().compress_into(memoryview(raw[:h // 2]), memoryview(small))
        assert n is not None
        assert shufflelib.decode_planes(p0, k0, memoryview(small)[:n], 1, layout, scratch, out[:len(raw)], d, fn) == -2


def test_a_damaged_frame_fails_as_the_codec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plane frame that passes its header checks but does not decode: the one-call path raises the
    codec's error, as the step-by-step path does."""
    from storage.codecs import zstdlib
    if not shufflelib.available() or not zstdlib.available():
        pytest.skip("the library or libzstd is not here")
    raw = _bf16(1 << 18, 12)
    payload = bytearray(codecs.Shuffle2Codec().encode(memoryview(raw)))
    payload[-40:-8] = bytes(32)  # inside the last plane's last block: its header still declares its size
    for native in (True, False):
        if not native:
            monkeypatch.setattr(shufflelib, "_lib", None)
        with pytest.raises(codecs.CodecError, match="does not decode"):
            codecs.Shuffle2Codec().decode(memoryview(payload), len(raw), memoryview(bytearray(len(raw))))


# ------------------------------------------------------------------ 4-byte planes (shuffle4-zstd)
def _fp32(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).normal(0, 0.02, n).astype(np.float32).tobytes()


@pytest.mark.parametrize("n", [0, 1, 7, (1 << 18) + 3, 1 << 20])
def test_four_planes_and_merge_match_numpy(n: int) -> None:
    if not shufflelib.available():
        pytest.skip("the library is not built")
    a = np.random.default_rng(n).integers(0, 1 << 32, n, dtype=np.uint32)
    planes = []
    for which in range(4):
        into = np.full(n, 0xAA, np.uint8)
        assert shufflelib.plane4(a, which, into)
        np.testing.assert_array_equal(into, (a >> np.uint32(8 * which)).astype(np.uint8))
        planes.append(into)
    out = np.zeros(n + 1, np.uint32)  # one element more: the call writes exactly N
    assert shufflelib.merge4(planes, out[:n])
    np.testing.assert_array_equal(out[:n], a)
    assert out[n] == 0
    if n:
        views = [memoryview(bytearray(p.tobytes())) for p in planes]
        o = bytearray(4 * n + 4)
        assert shufflelib.merge4_views(views, memoryview(o)[:4 * n])
        assert bytes(o[:4 * n]) == a.tobytes() and o[-4:] == bytes(4)


def test_four_plane_arrays_and_views_it_does_not_take_are_left_to_the_caller() -> None:
    if not shufflelib.available():
        pytest.skip("the library is not built")
    a = np.arange(64, dtype=np.uint32)
    into = np.zeros(64, np.uint8)
    assert not shufflelib.plane4(a[::2], 0, into[:32])                # strided
    assert not shufflelib.plane4(a.astype(np.int32), 0, into)         # signed
    assert not shufflelib.plane4(a, 0, into[:63])                     # sizes differ
    assert not shufflelib.plane4(a, 0, a.view(np.uint8)[:64])         # output overlaps the input
    assert not shufflelib.plane4(a, 4, into)                          # no such plane
    assert not shufflelib.plane4(np.frombuffer(bytearray(257), np.uint8)[1:].view(np.uint32), 0, into)  # unaligned
    p = [np.zeros(64, np.uint8) for _ in range(4)]
    assert not shufflelib.merge4(p[:3], a)                            # three planes
    assert not shufflelib.merge4([p[0], p[1], p[2], p[3][:63]], a)    # lengths differ
    assert not shufflelib.merge4([a.view(np.uint8)[:64], p[1], p[2], p[3]], a)  # a plane inside the output
    out = memoryview(bytearray(256))
    v = [memoryview(bytearray(64)) for _ in range(4)]
    assert not shufflelib.merge4_views([memoryview(bytes(64)), *v[1:]], out)      # read-only plane
    assert not shufflelib.merge4_views(v, memoryview(bytearray(257))[1:])         # unaligned output
    assert not shufflelib.merge4_views([out[:64], *v[1:]], out)                   # a plane inside the output
    assert not shufflelib.merge4_views(v, out[:252])                              # lengths differ


@pytest.mark.parametrize("kind", ["fp32", "random", "zeros", "bf16"])
def test_shuffle4_payloads_are_the_same_either_way(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C planes and numpy's give the same payload, and each decodes the other's, into a buffer or
    a new one, from writable or read-only memory."""
    raw = {"fp32": _fp32(1 << 19, 3), "random": np.random.default_rng(4).bytes(1 << 21),
           "zeros": bytes(1 << 21), "bf16": _bf16(1 << 20, 5)}[kind]
    results = _payloads_either_way(codecs.Shuffle4Codec(), raw, monkeypatch)
    assert results[0] == results[1]
    if kind == "fp32":  # the sign-and-exponent plane is a frame, the two mantissa planes are stored
        layout, *kinds = struct.unpack_from("<BBBBB", results[0])
        assert layout == 1 and kinds[3] == 1 and kinds[0] == kinds[1] == 0, kinds
        assert len(results[0]) < 0.86 * len(raw)


def _payload4(kinds: list[int], planes: list[bytes], lens: list[int] | None = None, layout: int = 1,
              pad: bytes = bytes(3)) -> memoryview:
    lens = [len(p) for p in planes[:3]] if lens is None else lens
    return memoryview(struct.pack("<BBBBB", layout, *kinds) + pad + struct.pack("<3Q", *lens) + b"".join(planes))


@pytest.mark.parametrize("native", [True, False])
def test_hostile_shuffle4_payloads_are_refused_within_their_raw_length(native: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import zstandard
    if not native:
        monkeypatch.setattr(shufflelib, "_lib", None)
    q = 1000
    plane = (bytes(range(256)) * 4)[:q]
    ok = _payload4([0, 0, 0, 0], [plane] * 4)
    assert len(codecs.decode_host("shuffle4-zstd", ok, 4 * q)) == 4 * q
    frame = zstandard.ZstdCompressor().compress(plane)
    assert bytes(codecs.decode_host("shuffle4-zstd", _payload4([0, 1, 0, 1], [plane, frame, plane, frame]), 4 * q)
                 ) == bytes(codecs.decode_host("shuffle4-zstd", ok, 4 * q))
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))  # 256 MiB of zeros in a few KiB
    cases = {
        "plane lengths past the payload": _payload4([0, 0, 0, 0], [plane] * 4, lens=[q, q, 10 ** 9]),
        "plane lengths that overflow 64 bits together": _payload4([0, 0, 0, 0], [plane] * 4, lens=[2 ** 64 - 1] * 3),
        "a stored plane of the wrong length": _payload4([0, 0, 0, 0], [plane[:-1], plane, plane, plane + b"x"]),
        "a zstd plane that decodes to more than its quarter": _payload4([0, 0, 0, 1], [plane, plane, plane, bomb]),
        "a zstd plane that decodes to less": _payload4(
            [0, 0, 0, 1], [plane, plane, plane, zstandard.ZstdCompressor().compress(plane[:-4])]),
        "an unknown plane kind": _payload4([0, 2, 0, 0], [plane] * 4),
        "layout 2 (not defined)": _payload4([0, 0, 0, 0], [plane] * 4, layout=2),
        "layout 0": _payload4([0, 0, 0, 0], [plane] * 4, layout=0),
        "a reserved byte set": _payload4([0, 0, 0, 0], [plane] * 4, pad=b"\0\1\0"),
        "a short header": memoryview(b"\x01\x00\x00"),
        "garbage for a zstd plane": _payload4([1, 0, 0, 0], [b"\x28\xb5\x2f\xfd" + bytes(50), plane, plane, plane]),
        "a zstd plane that does not declare its size": _payload4(
            [0, 0, 1, 0], [plane, plane, zstandard.ZstdCompressor(write_content_size=False).compress(plane), plane]),
        "a zstd plane declaring its quarter but holding more": _payload4(
            [0, 0, 0, 1], [plane, plane, plane, frame + zstandard.ZstdCompressor().compress(b"x" * 10)]),
    }
    for what, p in cases.items():
        with pytest.raises(codecs.CodecError):
            codecs.decode_host("shuffle4-zstd", p, 4 * q)
            pytest.fail(what)
        with pytest.raises(codecs.CodecError):
            codecs.decode_host_into("shuffle4-zstd", p, 4 * q, memoryview(bytearray(4 * q)))
    for bad_len in (4 * q + 2, 4 * q + 4, 1 << 40):  # not a multiple of 4; planes of another size; huge
        with pytest.raises(codecs.CodecError):
            codecs.decode_host("shuffle4-zstd", ok, bad_len)
    with pytest.raises(codecs.CodecError):
        codecs.decode_host_into("shuffle4-zstd", ok, 4 * q, memoryview(bytearray(4 * q - 4)))  # a short buffer
    with pytest.raises(codecs.CodecError):
        codecs.Shuffle4Codec().encode(memoryview(bytes(6)))  # not a multiple of 4


def test_a_hostile_payload_leaves_no_chunk_sized_scratch_behind() -> None:
    """Four zstd planes each declaring a quarter of 256 MiB but holding a block of one byte: refused, and
    the thread that decoded it keeps no plane buffer beyond KEEP (it used to keep raw_len, per thread)."""
    q = 64 << 20
    # a zstd frame header declaring q bytes (single segment, 4-byte content size), then one raw block of
    # one byte marked last: the header checks pass, the decode finds one byte where q were declared
    lie = b"\x28\xb5\x2f\xfd" + bytes([0xA0]) + struct.pack("<I", q) + bytes([0x09, 0x00, 0x00]) + b"x"
    c = codecs.Shuffle4Codec()
    payload = struct.pack("<BBBBB3x3Q", 1, 1, 1, 1, 1, len(lie), len(lie), len(lie)) + lie * 4
    with pytest.raises(codecs.CodecError):
        c.decode(memoryview(payload), 4 * q)
    buf = getattr(c._local, "buf", None)
    assert buf is None or len(buf) <= codecs._PlaneScratch.KEEP


def test_the_numpy_merge_works_a_block_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the C library the four planes are merged a block at a time (no temporary of the raw
    length): the same bytes, for lengths around a block."""
    monkeypatch.setattr(shufflelib, "_lib", None)
    c = codecs.Shuffle4Codec()
    for n in (4, 4 * c._BLOCK - 4, 4 * c._BLOCK + 12):
        raw = _fp32(n // 4, n)
        assert bytes(c.decode(memoryview(c.encode(memoryview(raw))), len(raw))) == raw
