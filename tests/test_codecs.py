"""The codec registry and the host codecs: every host codec round-trips the five kinds of data the
benchmark measures, the choice keeps raw what does not pay and picks shuffle2-zstd for 2-byte floats and
shuffle4-zstd for 4-byte ones,
hostile payloads are refused with CodecError without producing (or allocating) more than the raw
length they are decoded for, and a put of bf16 weights stores shuffle2-zstd chunks that get, verify
--read-data and a flipped byte treat like every other chunk. The CPU-only run of
scripts/bench/bench_codecs.py is checked here too; its nvCOMP rows in tests/test_codecs_gpu.py."""
from __future__ import annotations

import json
import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import zstandard

from conftest import Cli, chunk_files, tree_digest
from scripts.bench import bench_codecs
from storage.codecs import registry as C
from storage.format.chunkfile import HEADER_SIZE

KINDS = ("weights", "fp32", "kv30", "random", "text")
N = 4 << 20


@pytest.fixture(scope="module")
def data() -> dict[str, bytes]:
    return {k: bench_codecs.make_data(k, N).tobytes() for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("codec", ["raw", "zstd", "shuffle2-zstd", "shuffle4-zstd"])
def test_every_host_codec_round_trips(data: dict[str, bytes], kind: str, codec: str) -> None:
    raw = data[kind]
    e = C.entry(codec)
    assert e.where == "host" and e.encode is not None
    payload = e.encode(memoryview(raw))
    assert bytes(C.decode_host(codec, memoryview(payload), len(raw))) == raw
    out = bytearray(len(raw) + 100)
    got = C.decode_host_into(codec, memoryview(payload), len(raw), memoryview(out))
    assert len(got) == len(raw) and bytes(got) == raw


def test_the_choice(data: dict[str, bytes]) -> None:
    ch = C.HostCodecChooser()
    chosen = {k: ch.encode(memoryview(v)) for k, v in data.items()}
    assert chosen["weights"].codec == "shuffle2-zstd" and len(chosen["weights"].payload) < N / 1.4
    # fp32 weights: four byte planes, ~0.84 of the bytes where zstd keeps ~0.93 and two planes ~0.89
    assert chosen["fp32"].codec == "shuffle4-zstd" and len(chosen["fp32"].payload) < 0.86 * N
    assert chosen["kv30"].codec == "shuffle2-zstd" and len(chosen["kv30"].payload) < N / 4
    assert chosen["random"].codec == "raw"
    assert chosen["text"].codec == "zstd"
    for k, e in chosen.items():
        assert bytes(C.decode_host(e.codec, memoryview(e.payload), N)) == data[k]
        assert len(e.payload) <= C.PAYS_OFF_RATIO * N or e.codec == "raw"
    # layout 2 (FORMAT.md, "Codec ids"): the mantissa-and-sign plane of weights is noise, stored as it
    # is, never compressed; the exponent plane is compressed
    assert struct.unpack_from("<BBB", bytes(chosen["weights"].payload[:3])) == (2, 0, 1)
    # an odd length never takes the 2-byte codec, nor a length of 4k + 2 the 4-byte one; shuffle off, zstd only
    assert ch.encode(memoryview(data["weights"][:N - 1])).codec in ("zstd", "raw")
    assert ch.encode(memoryview(data["fp32"][:N - 2])).codec in ("zstd", "raw", "shuffle2-zstd")
    assert C.HostCodecChooser(shuffle=False).encode(memoryview(data["fp32"])).codec == "zstd"
    assert C.HostCodecChooser(shuffle=False).encode(memoryview(data["weights"])).codec == "zstd"
    assert C.HostCodecChooser(compress=False).encode(memoryview(data["weights"])).codec == "raw"


def test_the_estimate_and_the_bounded_encode(data: dict[str, bytes]) -> None:
    """estimate (a dump with a parent weighs deltas against it) is the sample's ratio: within 5% of
    the real encoding of bf16 weights, within 20% for text (the sample has no long-range repeats:
    it guesses high), the raw length where the chunk would be stored raw; and
    encode_within (a delta's XOR) picks byte planes for bf16, zstd for text, and refuses a room too
    small rather than cutting a payload short."""
    ch = C.HostCodecChooser()
    for kind in ("weights", "random", "text"):
        v = memoryview(data[kind])
        codec, m = ch.encode_into(v, memoryview(bytearray(N)))
        est = ch.estimate(v)
        tol = 0.2 if kind == "text" else 0.05
        assert (est == N) if codec == "raw" else abs(est - m) <= tol * m, (kind, codec, m, est)
    out = memoryview(bytearray(N))
    # a delta's XOR is never shuffle4-zstd (FORMAT.md, "Delta entries": its byte 2 says zstd or shuffle2)
    for kind, want in (("weights", "shuffle2-zstd"), ("text", "zstd"), ("fp32", "zstd")):
        got = ch.encode_within(memoryview(data[kind]), out)
        assert got is not None and got[0] == want, (kind, got)
        assert bytes(C.decode_host(got[0], out[:got[1]], N)) == data[kind]
        assert ch.encode_within(memoryview(data[kind]), out[:got[1] - 1]) is None


def test_a_small_chunk_probed_whole_is_compressed(data: dict[str, bytes]) -> None:
    """A chunk of up to 256 KiB is probed whole, not sampled: its zstd probe has room for all of it,
    so text of an odd length (no byte planes) that compresses is stored zstd, not raw (the probe's
    room once held 68 KiB, and a 200 KiB chunk compressing to 80 KiB came out raw)."""
    ch = C.HostCodecChooser()
    for n in (100 << 10, (200 << 10) + 1, (256 << 10) - 1):
        text = memoryview(data["text"][:n])
        want = len(zstandard.ZstdCompressor(level=1).compress(text))
        assert want < 0.9 * n
        assert ch.encode_into(text, memoryview(bytearray(n))) == ("zstd", want), n
        assert ch.estimate(text) == want, n


def _payload(k0: int, k1: int, p0: bytes, p1: bytes, n0: int | None = None, layout: int = 2) -> memoryview:
    return memoryview(struct.pack("<BBB5xQ", layout, k0, k1, len(p0) if n0 is None else n0) + p0 + p1)


def _elements(n: int) -> np.ndarray:
    """N 2-byte elements with every bit pattern in the corners: all 65536 values, then random ones."""
    rng = np.random.default_rng(11)
    return np.concatenate([np.arange(65536, dtype="<u2"), rng.integers(0, 65536, n, dtype="<u2")])


def test_layout_1_payloads_are_read_and_layout_2_is_the_rotated_split() -> None:
    """Layout 1 (the bytes as they are) is what stores before version 6 hold: still decoded. Layout 2
    is each element rotated left one bit, then split: byte for byte what FORMAT.md says, in planes
    stored as they are and as zstd frames, across a step boundary of the split and the merge."""
    a = _elements(C.Shuffle2Codec._BLOCK + 12345)
    raw = a.tobytes()
    lo1, hi1 = (a & 0xFF).astype(np.uint8).tobytes(), (a >> 8).astype(np.uint8).tobytes()
    for k0, k1 in ((0, 0), (1, 1), (0, 1)):
        p0 = zstandard.ZstdCompressor().compress(lo1) if k0 else lo1
        p1 = zstandard.ZstdCompressor().compress(hi1) if k1 else hi1
        assert bytes(C.decode_host("shuffle2-zstd", _payload(k0, k1, p0, p1, layout=1), len(raw))) == raw
    rot = ((a.astype(np.uint32) << 1) | (a >> 15)).astype("<u2")
    lo2, hi2 = (rot & 0xFF).astype(np.uint8).tobytes(), (rot >> 8).astype(np.uint8).tobytes()
    for which in ((False, False), (True, True), (False, True)):
        p = memoryview(C.Shuffle2Codec().encode(memoryview(raw), which))
        layout, k0, k1, n0 = C.Shuffle2Codec._HEAD.unpack_from(p)
        body = p[C.Shuffle2Codec._HEAD.size:]
        planes = [bytes(body[:n0]), bytes(body[n0:])]
        got = [zstandard.ZstdDecompressor().decompress(q) if k else q for k, q in zip((k0, k1), planes)]
        assert layout == 2 and got == [lo2, hi2], which
        assert bytes(C.decode_host("shuffle2-zstd", p, len(raw))) == raw
        out = bytearray(len(raw) + 7)
        assert bytes(C.decode_host_into("shuffle2-zstd", p, len(raw), memoryview(out))) == raw


def test_layout_2_stores_bf16_in_fewer_bytes_than_layout_1(data: dict[str, bytes]) -> None:
    """What layout 2 is for: bf16 weights and KV blocks in fewer bytes than the plain byte split."""
    sh = C.Shuffle2Codec()
    for kind in ("weights", "kv30"):
        raw = memoryview(data[kind])
        planes = np.empty(len(raw), np.uint8)
        sizes = {}
        for layout in (1, 2):
            sh.split(raw, planes, layout)
            h = len(raw) // 2
            sizes[layout] = sum(min(h, len(sh.zstd.encode(planes[i * h:(i + 1) * h].data))) for i in (0, 1))
        assert sizes[2] < 0.995 * sizes[1], (kind, sizes)


def test_hostile_shuffle2_payloads_are_refused_within_their_raw_length() -> None:
    h = 1000
    plane = bytes(range(256)) * 4
    ok = _payload(0, 0, plane[:h], plane[:h])
    assert len(C.decode_host("shuffle2-zstd", ok, 2 * h)) == 2 * h
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))  # 256 MiB of zeros in a few KiB
    cases = {
        "plane 0 longer than the payload": _payload(0, 0, plane[:h], plane[:h], n0=10 ** 9),
        "a stored plane of the wrong length": _payload(0, 0, plane[:h - 1], plane[:h + 1]),
        "a zstd plane that decodes to more than its half": _payload(1, 0, bomb, plane[:h]),
        "an unknown plane kind": _payload(7, 0, plane[:h], plane[:h]),
        "an unknown layout": memoryview(b"\x03" + bytes(ok[1:])),
        "layout 0": memoryview(b"\x00" + bytes(ok[1:])),
        "a short header": memoryview(b"\x01\x00"),
        "garbage for a zstd plane": _payload(1, 0, b"\x28\xb5\x2f\xfd" + bytes(50), plane[:h]),
        "a zstd plane that does not declare its size": _payload(
            1, 0, zstandard.ZstdCompressor(write_content_size=False).compress(plane[:h]), plane[:h]),
        "a zstd plane declaring its half but holding more": _payload(
            1, 0, zstandard.ZstdCompressor().compress(plane[:h]) + zstandard.ZstdCompressor().compress(b"x" * 10),
            plane[:h]),
    }
    for what, p in cases.items():
        with pytest.raises(C.CodecError):
            C.decode_host("shuffle2-zstd", p, 2 * h)
            pytest.fail(what)
        with pytest.raises(C.CodecError):
            C.decode_host_into("shuffle2-zstd", p, 2 * h, memoryview(bytearray(2 * h)))
    with pytest.raises(C.CodecError):
        C.decode_host("shuffle2-zstd", ok, 2 * h + 1)  # odd raw length
    with pytest.raises(C.CodecError):
        C.decode_host("zstd", memoryview(bomb), 1 << 20)  # zstd alone: bounded the same way
    with pytest.raises(C.CodecError):
        C.decode_host_into("zstd", memoryview(bomb), 1 << 20, memoryview(bytearray(1 << 20)))


def test_one_registry_with_the_format_ids() -> None:
    fmt = (Path(__file__).resolve().parents[1] / "storage" / "FORMAT.md").read_text()
    table = dict((n, int(i)) for i, n in re.findall(r"^\| (\d+) \| `([a-z0-9-]+)` \|", fmt, re.M))
    assert table == C.FORMAT_IDS
    assert {0: "raw", 1: "zstd", 16: "nvcomp-ans", 17: "nvcomp-bitcomp", 18: "nvcomp-lz4"}.items() <= C.CODEC_NAMES.items()
    assert {"raw", "zstd", "shuffle2-zstd", "shuffle4-zstd"} == {e.name for e in C.CODECS.values() if e.where == "host"}
    assert set(C.raw_entry_codecs()) == {"raw", "zstd", "shuffle2-zstd", "shuffle4-zstd", C.DELTA}  # the delta decodes only against its bases
    with pytest.raises(C.CodecError, match="delta"):
        C.decode_host(C.DELTA, memoryview(b"x"), 1)
    gpu = {e.name for e in C.CODECS.values() if e.where == "gpu"}
    assert gpu == (set(C.NVCOMP_ALGORITHMS) if C.nvcomp_importable() else set())
    with pytest.raises(C.CodecError, match="not id"):
        C.register(C.CodecEntry(4, "zstd", "host"))
    with pytest.raises(C.CodecError, match="GPU path"):
        C.decode_host("nvcomp-ans", memoryview(b"x"), 1)
    with pytest.raises(C.CodecError, match="unknown"):
        C.decode_host("lzma", memoryview(b"x"), 1)


def test_a_put_of_bf16_weights_stores_shuffle2_chunks_and_checks_them(cli: Cli, store_dir: Path,
                                                                       tmp_path: Path) -> None:
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bf16").write_bytes(bench_codecs.make_data("weights", 8 << 20).tobytes())
    (src / "kv.bin").write_bytes(bench_codecs.make_data("kv30", 8 << 20, seed=3).tobytes())
    put = cli.json("store", "put", "m", str(src))
    assert put["stored_bytes"] < 0.5 * put["bytes"] if "stored_bytes" in put else True, put
    man = json.loads((store_dir / "snapshots" / "m.json").read_text())
    codecs = {c[2] for s in man["streams"] for c in s.get("chunks", [])}
    assert codecs == {"shuffle2-zstd"}, codecs
    g = _got_then_damaged(cli, store_dir, tmp_path, src)
    assert g.returncode != 0 and not (tmp_path / "out2").exists(), g.stderr


def _got_then_damaged(cli: Cli, store_dir: Path, tmp_path: Path, src: Path) -> "subprocess.CompletedProcess[str]":
    """Snapshot m of SRC got back whole and verified with --read-data; then a payload byte of its
    largest pack flipped: the `get` that follows (the caller says what it must give)."""
    cli.run("store", "get", "m", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "model") == tree_digest(src)
    assert cli.json("store", "verify", "--read-data")["ok"]
    victim = max(chunk_files(store_dir), key=lambda p: p.stat().st_size)
    b = bytearray(victim.read_bytes())
    b[HEADER_SIZE + 40] ^= 0x08
    victim.write_bytes(bytes(b))
    return cli.run("store", "get", "m", str(tmp_path / "out2"), check=False)


def test_a_put_of_fp32_weights_stores_shuffle4_chunks_and_checks_them(cli: Cli, store_dir: Path,
                                                                        tmp_path: Path) -> None:
    """fp32 weights are stored as four byte planes; get, verify --read-data and a flipped byte treat
    those chunks like every other, and the store says version 7 (a gpusnap that knows only 6 refuses it)."""
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.fp32").write_bytes(bench_codecs.make_data("fp32", 8 << 20).tobytes())
    put = cli.json("store", "put", "m", str(src))
    man = json.loads((store_dir / "snapshots" / "m.json").read_text())
    codecs = {c[2] for s in man["streams"] for c in s.get("chunks", [])}
    assert codecs == {"shuffle4-zstd"}, codecs
    assert sum(p.stat().st_size for p in chunk_files(store_dir)) < 0.87 * (8 << 20), put
    info = json.loads((store_dir / "gpusnap-store.json").read_text())
    assert info["version"] == 8 and info["requires"] == ["codec:shuffle4-zstd"], info
    g = _got_then_damaged(cli, store_dir, tmp_path, src)
    assert g.returncode == 3 and not (tmp_path / "out2").exists(), g.stderr


def test_bench_codecs_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    assert bench_codecs.main(["--mib", "8", "--no-gpu", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    got = {(r["data"], r["codec"]) for r in rows}
    assert {(k, c) for k in KINDS for c in ("zstd-1", "shuffle2-zstd", "shuffle4-zstd", "auto")} <= got
    assert all(r["exact"] and r["ratio"] >= 1.0 and r["encode_gbps"] > 0 for r in rows)
    w = {r["codec"]: r for r in rows if r["data"] == "weights"}
    assert w["shuffle2-zstd"]["ratio"] > 1.4 > w["zstd-1"]["ratio"]
    f = {r["codec"]: r for r in rows if r["data"] == "fp32"}
    assert f["shuffle4-zstd"]["ratio"] > 1.16 > 1.1 > f["zstd-1"]["ratio"]
    assert f["auto"]["ratio"] == f["shuffle4-zstd"]["ratio"]


def test_a_version_5_store_of_layout_1_chunks_is_read_and_becomes_version_8(
        cli: Cli, store_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written before layout 2 (version 5, every byte-plane chunk layout 1) is read by this
    version byte for byte, verified with its data, and becomes version 8 (WRITE_VERSION) with the first chunk written
    to it; the chunks it already held stay layout 1 and are still read."""
    from storage.pipeline import put as pipeline
    from storage.archive.filetree import FileTreeSource
    from storage.repo.store import SnapshotStore
    from support.entries import chunk_entries
    src = tmp_path / "model"
    src.mkdir()
    (src / "w.bin").write_bytes(bench_codecs.make_data("weights", 8 << 20).tobytes())
    monkeypatch.setattr(C._SHUFFLE2, "LAYOUT", 1)  # as the writers before version 6 wrote
    st = SnapshotStore(str(store_dir), create=True)
    with st.writer("old") as w:
        pipeline.put(w, FileTreeSource([str(src)]), workers=2)
        w.commit()
    monkeypatch.undo()
    marker = store_dir / "gpusnap-store.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": 5}))
    layouts = {e.read()[HEADER_SIZE] for e in chunk_entries(store_dir)}
    assert layouts == {1}, layouts  # every entry a layout 1 shuffle2-zstd payload
    cli.run("store", "get", "old", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "model") == tree_digest(src)
    assert cli.json("store", "verify", "--read-data")["ok"]
    assert json.loads(marker.read_text())["version"] == 5  # reading changes nothing
    (src / "w2.bin").write_bytes(bench_codecs.make_data("weights", 4 << 20, seed=9).tobytes())
    cli.run("store", "put", "new", str(src))
    assert json.loads(marker.read_text())["version"] == 8
    assert {e.read()[HEADER_SIZE] for e in chunk_entries(store_dir)} == {1, 2}
    for name in ("old", "new"):
        cli.run("store", "get", name, str(tmp_path / f"o-{name}"))
    assert (tmp_path / "o-old" / "model" / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    assert tree_digest(tmp_path / "o-new" / "model") == tree_digest(src)


def test_the_sample_pieces_start_on_an_element(data: dict[str, bytes]) -> None:
    """A chunk whose length is a multiple of 4 but not of 16: the sample's pieces start on an element
    all the same (a piece starting inside one read its planes mixed, and fp32 went to zstd at 0.92)."""
    ch = C.HostCodecChooser()
    for extra in (4, 8, 12):
        n = (1 << 20) + extra
        raw = memoryview(data["fp32"][:n])
        assert ch.encode(raw).codec == "shuffle4-zstd", extra
