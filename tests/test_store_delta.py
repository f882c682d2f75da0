"""Delta entries (FORMAT.md, "Delta entries"): a second snapshot of a weights-like image with 5% of its
64 KiB blocks rewritten at random places, taken with a parent, stores about the changed bytes; every
reader (get, cat, the read stage in pack order, verify full and sampled, export/import, repair, the
remote tier) reconstructs it bit for bit; damage of a base is damage of its deltas; gc keeps a base a
live delta names; kill -9 at each new write step leaves a store that verifies; a real `criu dump`
twice and a restore. Real files on the real disk, the real CLI, real CRIU and Swift."""
from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from storage.codecs import delta
from storage.format.chunkfile import HEADER_SIZE, ChunkHeader, check_received, raw_chunk_id
from storage.codecs.registry import CODEC_IDS, DELTA, Shuffle2Codec
from storage.base.errors import DamageError
from storage.format.manifest import Stream
from storage.pipeline.put import page_keys
from storage.repo.readstage import Want, read_chunks
from storage.repo.store import SnapshotStore
from support.entries import Entry, chunk_entries
from support.model_bytes import BLOCK, kv_pool as _kv_pool, weights
from support.store_faults import killed_at

MB = 80  # the image: 80 MiB of bf16-like weights (1280 blocks; 64 of them change)


def change_5_percent(data: bytes, seed: int) -> tuple[bytes, int]:
    """DATA with 5% of its 64 KiB blocks rewritten at random places; (new bytes, bytes changed)."""
    rng = np.random.default_rng(seed)
    out = bytearray(data)
    blocks = len(data) // BLOCK
    picked = rng.choice(blocks, blocks // 20, replace=False)
    for b in picked:
        out[b * BLOCK:(b + 1) * BLOCK] = weights(rng, BLOCK)
    return bytes(out), len(picked) * BLOCK


@pytest.fixture(scope="module")
def images() -> tuple[bytes, bytes, int]:
    a = weights(np.random.default_rng(3), MB << 20)
    b, changed = change_5_percent(a, 11)
    return a, b, changed


def _write(d: Path, data: bytes) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "pages-1.img").write_bytes(data)
    return d


def delta_entries(store: Path) -> list[Entry]:
    return [e for e in chunk_entries(store) if struct.unpack_from("<H", e.read()[:10], 8)[0] == CODEC_IDS[DELTA]]


def pack_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in (store / "packs").iterdir())


def _two(cli: Cli, tmp: Path, images: tuple[bytes, bytes, int], parent: bool = True) -> dict[str, Any]:
    """Snapshots a (the image) and b (5% changed), b with a as its parent; b's put report."""
    a, b, _ = images
    src = _write(tmp / "img", a)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    _write(src, b)
    return cli.json("store", "put", "b", str(src), "--chunker", "pages", "--no-cache",
                    *(("--parent", "a") if parent else ("--no-parent",)))


def test_second_snapshot_with_a_parent_stores_about_the_changed_bytes(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                       images: tuple[bytes, bytes, int]) -> None:
    a, b, changed = images
    src = _write(tmp_path / "img", a)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    before = pack_bytes(store_dir)
    _write(src, b)
    rep = cli.json("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a")
    grown = pack_bytes(store_dir) - before
    deltas = delta_entries(store_dir)
    assert deltas and rep["chunks_new"] == len(deltas), rep  # every changed chunk went in as a delta
    # the payloads: at most 1.1x the changed bytes (XOR of the changed blocks, zstd'd)
    assert rep["new_bytes"] <= 1.1 * changed, (rep["new_bytes"], changed)
    # on disk: plus each entry's 4096-byte header and its padding to 4096 (< 8 KiB an entry)
    assert grown <= 1.1 * changed + 8192 * rep["chunks_new"], (grown, changed, rep["chunks_new"])
    assert "delta-base" in rep["stages"] and "delta" in rep["stages"], rep["stages"]
    info = json.loads((store_dir / "gpusnap-store.json").read_text())
    assert info["version"] == 8 and "codec:xor-zstd" in info["requires"], info
    # bf16 weights XOR bf16 weights: the high bytes (sign, exponent) mostly agree, so the XOR is
    # stored as byte planes (the table's byte 2), every one of these deltas
    assert all(e.read()[HEADER_SIZE + 2] == 1 for e in deltas), [e.read()[HEADER_SIZE + 2] for e in deltas]
    # without a parent the same change costs far more: nearly every chunk of the image again
    other = Cli(tmp_path / "other")
    plain = _two(other, tmp_path / "o", images, parent=False)
    assert plain["new_bytes"] >= 4 * changed, (plain["new_bytes"], changed)
    assert not delta_entries(tmp_path / "other")
    # no delta: the marker is version 8 all the same, its requires without the delta codec
    other_marker = json.loads((tmp_path / "other" / "gpusnap-store.json").read_text())
    assert other_marker["version"] == 8 and "codec:xor-zstd" not in other_marker["requires"], other_marker
    assert not SnapshotStore(str(tmp_path / "other")).may_hold_deltas()
    assert SnapshotStore(str(store_dir)).may_hold_deltas()
    # a version 6/7 marker whose deltas is anything but true or false is damage: one line, exit 3
    (tmp_path / "other" / "gpusnap-store.json").write_text(json.dumps({**other_marker, "version": 7, "deltas": "yes"}))
    r = other.run("store", "ls", check=False)
    assert r.returncode == 3 and "deltas is 'yes'" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_delta_snapshot_reads_back_through_every_reader(cli: Cli, store_dir: Path, tmp_path: Path,
                                                          images: tuple[bytes, bytes, int]) -> None:
    a, b, _ = images
    _two(cli, tmp_path, images)
    assert delta_entries(store_dir)
    for name, data in (("a", a), ("b", b)):
        cli.run("store", "get", name, str(tmp_path / f"out-{name}"))
        assert (tmp_path / f"out-{name}" / "img" / "pages-1.img").read_bytes() == data
    cat = subprocess.run([*GPUSNAP, "--store", str(store_dir), "store", "cat", "b", "img/pages-1.img"], cwd=REPO,
                         env={**os.environ, "PYTHONPATH": pythonpath()}, capture_output=True, timeout=300)
    assert cat.returncode == 0 and cat.stdout == b, cat.stderr
    # the read stage in pack order (the split fill's order), full check, into its own buffers
    st = SnapshotStore(str(store_dir), create=False)
    m = st.load("b")
    s = next(x for x in m.streams if x.name == "img/pages-1.img")
    offs = np.cumsum([0] + [c.raw_len for c in s.chunks])
    got = bytearray(len(b))

    def put(w: Want, data: Any) -> None:
        got[w.key:w.key + w.ref.raw_len] = bytes(data)

    read_chunks(st, [Want(int(o), c) for o, c in zip(offs, s.chunks) if not c.is_zero], put,
                stages=_Nothing(), decoders=2, order="pack")
    assert bytes(got) == b
    for args in ((), ("--read-data",), ("--read-data-subset", "50%")):
        rep = cli.json("store", "verify", *args)
        assert rep["ok"], rep
    # export writes each delta whole; the importing store has no delta and reads the same bytes
    arch = tmp_path / "b.tar.zst"
    cli.run("store", "export", "b", str(arch))
    other = Cli(tmp_path / "imported")
    other.run("store", "import", str(arch))
    assert not delta_entries(tmp_path / "imported")
    other.run("store", "get", "b", str(tmp_path / "imp"))
    assert (tmp_path / "imp" / "img" / "pages-1.img").read_bytes() == b
    assert other.json("store", "verify", "--read-data")["ok"]


class _Nothing:
    def add(self, stage: str, seconds: float, nbytes: int) -> None:
        pass


def _a_base(store_dir: Path) -> str:
    """The id of a chunk of snapshot a that a delta of b names as its base."""
    st = SnapshotStore(str(store_dir), create=False)
    bases = st.delta_bases(st.load("b").chunk_ids())
    assert bases
    return sorted(next(iter(bases.values())))[0]


def test_a_flipped_byte_in_a_base_damages_both_snapshots(cli: Cli, store_dir: Path, tmp_path: Path,
                                                          images: tuple[bytes, bytes, int]) -> None:
    _two(cli, tmp_path, images)
    base = _a_base(store_dir)
    next(e for e in chunk_entries(store_dir) if e.cid == base).flip_payload(0.5)
    for name in ("a", "b"):
        r = cli.run("store", "get", name, str(tmp_path / f"x-{name}"), check=False)
        assert r.returncode == 3 and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
        assert not (tmp_path / f"x-{name}").exists()
    r = cli.run("store", "verify", "--json", check=False)
    rep = json.loads(r.stdout)
    assert r.returncode == 3 and not rep["ok"]
    named = {p.split(":", 1)[0] for p in rep["problems"]}
    assert named == {"a", "b"}, rep["problems"]
    assert any(p.startswith("b:") and delta.BASE_WHY in p for p in rep["problems"]), rep["problems"]
    assert rep["quarantined"] == [base], rep  # the base set aside; its deltas are sound, not moved
    listed = {s["name"]: s for s in cli.json("store", "ls")}
    assert listed["a"].get("damaged_chunks") and listed["b"].get("damaged_chunks"), listed
    assert cli.run("store", "get", "b", str(tmp_path / "y"), check=False).returncode == 3


def test_a_delta_whose_base_is_missing_or_itself_a_delta_is_damage(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                    images: tuple[bytes, bytes, int]) -> None:
    a, b, _ = images
    _two(cli, tmp_path, images)
    st = SnapshotStore(str(store_dir), create=False)
    mb = st.load("b")
    d_id = sorted(st.delta_bases(mb.chunk_ids()))[0]
    # a delta (made by hand, as only someone writing the store could) whose base is a delta: exit 3
    d_ref = next(c for s in mb.streams for c in s.chunks if c.id == d_id)
    d_raw = bytes(st.read_raw(d_ref, _buf(st, mb)))
    raw = bytes(x ^ 0x5A for x in d_raw[:1 << 20])
    segs = [delta.Segment(d_id, 0, len(raw))]
    scratch, dst = memoryview(bytearray(len(raw))), memoryview(bytearray(HEADER_SIZE + len(raw) + 8192))
    m = delta.encode_into(memoryview(raw), segs, {d_id: d_raw}, scratch, dst[HEADER_SIZE:])
    assert m is not None
    with st.writer("forged", replace=False, meta={"kind": "files", "paths": ["/x"]}) as w:
        ref = w.put_delta(len(raw), dst, m, raw_chunk_id(raw))
        s = Stream("x", {"type": "file", "mode": 0o600, "mtime_ns": 0, "chunker": {"name": "fixed", "size": 1 << 20}})
        s.chunks.append(ref)
        w.add_stream(s)
        w.commit()
    r = cli.run("store", "get", "forged", str(tmp_path / "f"), check=False)
    assert r.returncode == 3 and "itself a delta" in r.stderr, r.stderr
    r = cli.run("store", "verify", "forged", "--read-data", check=False)
    assert r.returncode == 3 and "itself a delta" in r.stdout + r.stderr
    # a base that is missing (its entry gone from its pack's index): the delta is damage, exit 3
    base = _a_base(store_dir)
    next(e for e in chunk_entries(store_dir) if e.cid == base).remove()
    r = cli.run("store", "get", "b", str(tmp_path / "g"), check=False)
    assert r.returncode == 3 and "delta base" in r.stderr and "missing" in r.stderr, r.stderr
    r = cli.run("store", "verify", "b", "--json", check=False)
    assert r.returncode == 3 and delta.BASE_WHY in r.stdout, r.stdout


def test_a_delta_whose_base_is_larger_than_the_limit_is_damage(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    big = np.random.default_rng(5).bytes(6 << 20)  # one chunk of 6 MiB: more than a 4 KiB delta's base may be
    (tmp_path / "big").write_bytes(big)
    cli.run("store", "put", "big", str(tmp_path / "big"), "--chunk-size", "8M")
    st = SnapshotStore(str(store_dir), create=False)
    bid = next(iter(st.load("big").chunk_ids()))
    raw = bytes(x ^ 1 for x in big[:4096])
    segs = [delta.Segment(bid, 0, 4096)]
    scratch, dst = memoryview(bytearray(4096)), memoryview(bytearray(HEADER_SIZE + 8192))
    m = delta.encode_into(memoryview(raw), segs, {bid: big}, scratch, dst[HEADER_SIZE:])
    assert m is not None
    with st.writer("small", replace=False, meta={"kind": "files", "paths": ["/x"]}) as w:
        s = Stream("x", {"type": "file", "mode": 0o600, "mtime_ns": 0, "chunker": {"name": "fixed", "size": 4096}})
        s.chunks.append(w.put_delta(4096, dst, m, raw_chunk_id(raw)))
        w.add_stream(s)
        w.commit()
    r = cli.run("store", "get", "small", str(tmp_path / "o"), check=False)
    assert r.returncode == 3 and "more than a delta's base may" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def _buf(st: SnapshotStore, m: Any) -> Any:
    from storage.fs.directio import AlignedBuffer
    return AlignedBuffer(st.chunk_buffer_size([m]))


def test_hostile_delta_payloads_are_one_line_damage(tmp_path: Path) -> None:
    cid = "ab" * 32
    ok_raw = bytes(range(256)) * 16
    for what, payload, raw_len in (
            ("no segments", struct.pack("<H6x", 0) + bytes(64), 4096),
            ("too many segments", struct.pack("<H6x", delta.MAX_SEGMENTS + 1) + bytes(64), 4096),
            ("a reference longer than the chunk", struct.pack("<H6x", 1) + struct.pack("<32sQQ", b"\1" * 32, 0, 8192)
             + bytes(16), 4096),
            ("a frame decoding to more than raw_len", struct.pack("<H6x", 1) + struct.pack("<32sQQ", bytes(32), 0, 16)
             + _zstd(ok_raw * 2), len(ok_raw)),
            ("an unknown encoding of the XOR", struct.pack("<HB5x", 1, 2) + struct.pack("<32sQQ", bytes(32), 0, 16)
             + _zstd(ok_raw), len(ok_raw)),
            ("a reserved byte set", struct.pack("<HB4xB", 1, 0, 1) + struct.pack("<32sQQ", bytes(32), 0, 16)
             + _zstd(ok_raw), len(ok_raw)),
            ("a zstd frame where byte planes are said to be", struct.pack("<HB5x", 1, 1)
             + struct.pack("<32sQQ", bytes(32), 0, 16) + _zstd(ok_raw), len(ok_raw)),
            ("byte planes where a zstd frame is said to be", struct.pack("<H6x", 1)
             + struct.pack("<32sQQ", bytes(32), 0, 16) + Shuffle2Codec().encode(memoryview(ok_raw)), len(ok_raw))):
        with pytest.raises(delta.DeltaDamage) as e:
            delta.decode(DELTA, raw_len, memoryview(payload), cid, None, lambda b, most: bytes(most and 16))
        assert "\n" not in str(e.value), what
    # both encodings of the XOR decode (a zstd frame: what every delta of a version 4 store holds)
    for how, xor in ((0, _zstd(ok_raw)), (1, Shuffle2Codec().encode(memoryview(ok_raw)))):
        good = struct.pack("<HB5x", 1, how) + struct.pack("<32sQQ", bytes(32), 0, 16) + xor
        assert bytes(delta.decode(DELTA, len(ok_raw), memoryview(good), cid, None, lambda b, most: bytes(16))) == ok_raw
    # a delta entry from outside the store (an archive member, a remote object) is refused
    payload = struct.pack("<H6x", 1) + struct.pack("<32sQQ", bytes(32), 0, 16) + _zstd(ok_raw)
    h = ChunkHeader(DELTA, len(ok_raw), len(payload), raw_id=True).with_checksum(payload)
    image = memoryview(h.pack().ljust(HEADER_SIZE, b"\0") + payload)
    with pytest.raises(DamageError, match="not accepted here"):
        check_received(raw_chunk_id(ok_raw), "zstd", len(ok_raw), len(payload), image)


def _zstd(data: bytes) -> bytes:
    import zstandard
    return zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data)


def test_a_version_4_store_is_read_and_becomes_version_8_with_its_next_write(
        cli: Cli, store_dir: Path, tmp_path: Path, images: tuple[bytes, bytes, int]) -> None:
    """A store whose marker says 4 (deltas whose XOR is one zstd frame) is read as it is; the first
    chunk written to it now makes it 8 first, the delta codec in its requires (a gpusnap that knows only
    4 to 7 then refuses it)."""
    a, b, _ = images
    _two(cli, tmp_path, images)
    marker = store_dir / "gpusnap-store.json"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "version": 4}))
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b
    assert json.loads(marker.read_text())["version"] == 4  # reading changes nothing
    c, _ = change_5_percent(b, 12)
    _write(tmp_path / "img", c)
    rep = cli.json("store", "put", "c", str(tmp_path / "img"), "--chunker", "pages", "--no-cache", "--parent", "b")
    # a version 4 or 5 store may hold deltas: version 8 keeps saying so
    now = json.loads(marker.read_text())
    assert rep["chunks_new"] and now["version"] == 8 and "codec:xor-zstd" in now["requires"], (rep, now)
    cli.run("store", "get", "c", str(tmp_path / "out2"))
    assert (tmp_path / "out2" / "img" / "pages-1.img").read_bytes() == c
    marker.write_text(json.dumps({**info, "version": 9}))  # a version from the future is refused, one line
    r = cli.run("store", "get", "c", str(tmp_path / "out3"), check=False)
    assert r.returncode != 0 and "v9 is not gpusnap-store v8 or older" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_marker_never_goes_down(tmp_path: Path) -> None:
    """A writer that opened the store at version 3 and needs the delta codec listed later never writes
    over what another writer listed meanwhile (the marker is read again under a flock of the store
    directory and the union written), and one that finds a version it does not know refuses in one
    line instead of writing to it."""
    from storage.repo.store import StoreError
    SnapshotStore(str(tmp_path / "s"), create=True)
    a = SnapshotStore(str(tmp_path / "s"))
    b = SnapshotStore(str(tmp_path / "s"))
    marker = tmp_path / "s" / "gpusnap-store.json"
    assert a.version == b.version == 3
    b.upgrade(needs=("codec:zstd",))
    a.upgrade(deltas=True)
    info = json.loads(marker.read_text())
    assert info["version"] == 8 and info["requires"] == ["codec:xor-zstd", "codec:zstd"], info
    assert a.version == 8 and a.deltas and a.requires == {"codec:xor-zstd", "codec:zstd"}
    b.upgrade(needs=("codec:raw",))  # b's view was stale: it keeps what a listed
    assert json.loads(marker.read_text())["requires"] == ["codec:raw", "codec:xor-zstd", "codec:zstd"]
    c = SnapshotStore(str(tmp_path / "s"))
    c.version = 3  # as if opened before the next line
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "version": 9}))
    with pytest.raises(StoreError, match="v9 .* is not gpusnap-store v8 or older"):
        c.upgrade(deltas=True)
    assert json.loads(marker.read_text())["version"] == 9


def test_a_chunk_set_aside_after_its_real_encoding_counts_once(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """The first chunk of a stream whose delta loses against its real plain encoding is set aside and
    tried again at the end: it is encoded again there, but counted once (chunks_compressed equals
    chunks_new, the compress stage's bytes are the new chunks' raw bytes), and what it took is
    counted as stored plain. (Text: its sample guesses the encoding high, so the delta is weighed
    against the real one.)"""
    r = np.random.default_rng(7)
    words = [bytes(r.integers(97, 123, int(r.integers(2, 9)), dtype=np.uint8)) for _ in range(3000)]

    def text(n: int) -> bytes:
        return b" ".join(words[i] for i in r.integers(0, len(words), n // 4))[:n]
    c = 4 << 20
    a = text(c) + text(c)
    b = bytearray(a)
    for p in range(0, c, 4096):
        if r.random() < 0.4:
            b[p:p + 4096] = text(4096)  # 40% of the first chunk's pages rewritten, the second unchanged
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "f").write_bytes(a)
    cli.run("store", "put", "a", str(tmp_path / "img"), "--workers", "1")
    (tmp_path / "img" / "f").write_bytes(bytes(b))
    rep = cli.json("store", "put", "b", str(tmp_path / "img"), "--workers", "1", "--no-cache", "--parent", "a")
    st = rep["stages"]
    assert "delta:set aside" in st and "delta:lost" in st, st  # the path this test is about
    assert rep["chunks_new"] == rep["chunks_compressed"] == 1, rep
    assert st["compress"]["bytes"] == c, st  # the one new chunk's raw bytes, once
    stored = st.get("delta:stored plain", {}).get("bytes", 0) + st.get("delta:stored as deltas", {}).get("bytes", 0)
    assert stored == rep["new_bytes"], (stored, rep["new_bytes"], st)
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "f").read_bytes() == bytes(b)


def test_gc_keeps_a_base_while_a_delta_names_it_and_reclaims_both(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                   images: tuple[bytes, bytes, int]) -> None:
    _, b, _ = images
    _two(cli, tmp_path, images)
    cli.run("store", "rm", "a")
    gc = cli.json("store", "gc")
    assert not gc["damage"], gc
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b
    assert cli.json("store", "verify", "--read-data")["ok"]
    gc = cli.json("store", "gc")  # and again: the repack of a's dead chunks kept b's bases
    cli.run("store", "get", "b", str(tmp_path / "out2"))
    assert (tmp_path / "out2" / "img" / "pages-1.img").read_bytes() == b
    cli.run("store", "rm", "b")
    gc = cli.json("store", "gc")
    assert not chunk_entries(store_dir) and not list((store_dir / "packs").iterdir()), gc


@pytest.mark.parametrize("stage", ["delta-marker", "pack-partial", "pack-synced", "indexed"])
def test_kill_9_at_each_delta_write_step_leaves_a_store_that_verifies(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                        images: tuple[bytes, bytes, int],
                                                                        stage: str) -> None:
    a, b, _ = images
    src = _write(tmp_path / "img", a)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    _write(src, b)
    put_b = ["store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a"]
    killed_at(store_dir, put_b, stage, tmp_path)
    assert [r["name"] for r in cli.json("store", "ls")] == ["a"]
    assert cli.json("store", "verify", "--read-data")["ok"]
    gc = cli.json("store", "gc")
    assert not gc["damage"], gc
    assert not delta_entries(store_dir)  # what the kill left (indexed or not) no snapshot names: gone
    assert cli.json("store", "verify", "--read-data")["ok"]
    cli.run("store", "get", "a", str(tmp_path / "oa"))
    assert (tmp_path / "oa" / "img" / "pages-1.img").read_bytes() == a
    again = cli.json(*put_b)
    assert again["chunks_new"] and delta_entries(store_dir), again
    cli.run("store", "get", "b", str(tmp_path / "ob"))
    assert (tmp_path / "ob" / "img" / "pages-1.img").read_bytes() == b


def test_a_chunk_stored_as_a_delta_of_a_delta_is_based_on_the_full_chunk(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                         images: tuple[bytes, bytes, int]) -> None:
    """Depth 1: a third snapshot whose parent's chunks are deltas bases on the grandparent's full chunks."""
    _, b, changed = images
    _two(cli, tmp_path, images)
    c, _ = change_5_percent(b, 12)
    _write(tmp_path / "img", c)
    rep = cli.json("store", "put", "c", str(tmp_path / "img"), "--chunker", "pages", "--no-cache", "--parent", "b")
    st = SnapshotStore(str(store_dir), create=False)
    bases = st.delta_bases(st.load("c").chunk_ids())
    assert bases and all(st.entry_segments(x, st.locate(x)[0]) is None for bs in bases.values() for x in bs)
    assert rep["new_bytes"] <= 2.2 * changed, rep  # the XOR holds both rounds of changes: still small
    cli.run("store", "get", "c", str(tmp_path / "oc"))
    assert (tmp_path / "oc" / "img" / "pages-1.img").read_bytes() == c
    cli.run("store", "rm", "a", "b")
    cli.json("store", "gc")
    assert cli.json("store", "verify", "--read-data")["ok"]
    cli.run("store", "get", "c", str(tmp_path / "oc2"))
    assert (tmp_path / "oc2" / "img" / "pages-1.img").read_bytes() == c


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    from scripts.bench.bench_remote import drop_bucket
    from support.swift import RUN, swift_start
    ep = swift_start()
    yield ep
    drop_bucket(ep, f"gpusnap-test-{RUN}")


def test_push_sends_deltas_whole_and_a_pull_reads_them_back(tmp_path: Path, endpoint: str,
                                                            images: tuple[bytes, bytes, int]) -> None:
    from support.swift import Node, url_for
    url = url_for("delta-push-pull")
    a, b = Node(tmp_path / "A", endpoint, url), Node(tmp_path / "B", endpoint, url)
    _two(a.cli, tmp_path, images)
    assert delta_entries(tmp_path / "A")
    pushed = a.json("push", "b")
    assert pushed["chunks_sent"] == pushed["chunks_total"] > 0, pushed
    assert a.json("remote", "verify", "--read-data")["ok"]
    b.json("pull", "b")
    assert not delta_entries(tmp_path / "B")  # the remote holds no delta: nothing there names a base
    b.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == images[1]
    assert b.json("store", "verify", "--read-data")["ok"]
    # a pushed delta snapshot is whole on the remote even once its parent is gone locally
    a.run("store", "rm", "a")
    a.json("store", "gc")
    pushed = a.json("push", "b")
    assert pushed["already_there"], pushed


class _Weights:
    """tests/support/delta_workload.py: a process holding MiB of weights-like memory, in its own session."""

    def __init__(self, tmp: Path, mib: int) -> None:
        import sys
        self.dir = tmp / "wl"
        self.dir.mkdir()
        self.log = open(tmp / "wl.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / "delta_workload.py"),
                                      str(self.dir), str(mib)], stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=self.log, start_new_session=True, cwd="/")
        self.pid = json.loads(self._wait("ready", 60))["pid"]

    def _wait(self, name: str, timeout: float = 60) -> str:
        p = self.dir / name
        deadline = time.monotonic() + timeout
        while not p.exists():
            assert time.monotonic() < deadline, f"the workload did not write {name}"
            time.sleep(0.02)
        text = p.read_text()
        p.unlink()
        return text

    def ask(self, cmd: str, answer: str) -> dict:
        # whole or not at all: the workload polls for `cmd`, and one that read it between the create
        # and the write saw an empty command (the CI failure of 29c6fbe's clean clone: the workload
        # died on it and never answered)
        (self.dir / "cmd.tmp").write_text(cmd)
        os.rename(self.dir / "cmd.tmp", self.dir / "cmd")
        return json.loads(self._wait(answer))

    def close(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


@pytest.mark.root
@pytest.mark.parametrize("restore_env", [{}, {"GPUSNAP_CRIU_SPLIT_MIN": str(8 << 20), "GPUSNAP_CRIU_SPLIT_SHARED_MIN": str(8 << 20),
                                                      "GPUSNAP_FILL_PROCS": "2"}],
                         ids=["default", "split-fill-in-2-workers"])
def test_criu_dump_twice_stores_the_changed_blocks_and_restores(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                restore_env: dict[str, str]) -> None:
    """...and the delta snapshot restores, with the split fill in worker processes too (they read
    the bases of their deltas through the store)."""
    from support.criu import require_criu
    require_criu()
    wl = _Weights(tmp_path, 96)
    try:
        first = cli.json("criu", "dump", "--leave-running", str(wl.pid), "w1")
        assert first["parent"] is None, first
        changed = wl.ask("change 5", "changed.json")["bytes"]
        second = cli.json("criu", "dump", "--leave-running", "--parent", "w1", str(wl.pid), "w2")
        assert second["parent"] == "w1", second
        unnamed = cli.json("criu", "dump", "--leave-running", str(wl.pid), "w3")
        assert unnamed["parent"] is None, unnamed  # never guessed (by root pid or otherwise)
        os.kill(wl.pid, signal.SIGKILL)
        wl.proc.wait(timeout=30)
        # the changed blocks, plus what the interpreter itself touched between the dumps (its heap,
        # stacks, small images: under 2 MiB here, stored as they are)
        assert second["new_bytes"] <= 1.1 * changed + (2 << 20), (second["new_bytes"], changed, first["new_bytes"])
        print(f"criu dump: {changed} bytes changed, {second['new_bytes']} stored (first dump {first['new_bytes']})")
        assert delta_entries(store_dir)
        assert cli.json("store", "verify", "--read-data")["ok"]
        r = json.loads(cli.run("criu", "restore", "w2", "--json", env=restore_env).stdout)
        assert r["restored_pid"] == wl.pid
        if restore_env:
            assert r["stages"]["served"]["fill_memory"]["procs"] == 2, r["stages"]["served"].get("fill_memory")
        assert wl.ask("report", "report.json")["memory_ok"]
    finally:
        wl.close()


def test_repair_rewrites_a_damaged_base_and_heals_its_deltas(cli: Cli, store_dir: Path, tmp_path: Path,
                                                             images: tuple[bytes, bytes, int]) -> None:
    import shutil
    _, b, _ = images
    _two(cli, tmp_path, images)
    shutil.copytree(store_dir, tmp_path / "copy")  # another store holding the same chunks (and deltas)
    base = _a_base(store_dir)
    cli.run("store", "rm", "a")  # the base is now named by no manifest, only by b's deltas
    next(e for e in chunk_entries(store_dir) if e.cid == base).flip_payload(0.3)
    assert cli.run("store", "get", "b", str(tmp_path / "x"), check=False).returncode == 3
    rep = cli.json("store", "repair", "--from", str(tmp_path / "copy"))
    assert rep["ok"] and base in rep["repaired"], rep
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b
    assert cli.json("store", "verify", "--read-data")["ok"]
    # without a source the base is lost, and with it the delta that needs it: exit 3, named
    next(e for e in chunk_entries(store_dir) if e.cid == base and not _quarantined(store_dir, e)).flip_payload(0.3)
    r = cli.run("store", "repair", "--json", check=False)
    rep = json.loads(r.stdout)
    assert r.returncode == 3 and any(delta.BASE_WHY in p for p in rep["lost"]), rep


def _quarantined(store: Path, e: Entry) -> bool:
    rec = store / "quarantine" / f"{e.cid}.json"
    return rec.exists() and [e.path.name, e.offset] in json.loads(rec.read_text()).get("entries", [])


def test_pages_mapped_before_the_changes_move_the_bases_with_them(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                  images: tuple[bytes, bytes, int]) -> None:
    """A process that mapped 78 pages before its changed blocks: every later byte of its page image
    moved; the dump finds the parent's bytes where they went (a shift learned, the mixed chunk)."""
    a, b, changed = images
    inserted = weights(np.random.default_rng(8), 78 * 4096)
    at = (5 << 20) + 3 * 4096
    moved = b[:at] + inserted + b[at:]
    src = _write(tmp_path / "img", a)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    _write(src, moved)
    rep = cli.json("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a")
    assert rep["new_bytes"] <= 1.1 * (changed + len(inserted)), (rep["new_bytes"], changed, len(inserted))
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == moved


def test_a_kv_pool_moved_by_pages_mapped_before_it_finds_its_parent(cli: Cli, store_dir: Path,
                                                                    tmp_path: Path) -> None:
    """The MoE workload's second dump, in miniature: weights, then a KV pool 30% filled, then more
    weights; between the dumps the process mapped pages before the pool and before the last weights
    (the page image moves by a different shift in each region) and filled 5% more of the pool's
    blocks, so every chunk of the pool changed and none of them is found unchanged to learn the
    shift from. The dump finds the parent's bytes where they went (searching the parent's pages near
    the place) and stores about the changed and the mapped bytes."""
    rng = np.random.default_rng(21)
    w1, w2 = weights(rng, 16 << 20), weights(rng, 16 << 20)
    pool = _kv_pool(rng, 48 << 20, 0.30)
    a = w1 + bytes(pool) + w2
    empty = [b for b in range(len(pool) // BLOCK) if not any(pool[b * BLOCK:b * BLOCK + 64])]
    changed = 0
    for b in rng.choice(empty, (len(pool) // BLOCK) // 20, replace=False):
        pool[b * BLOCK:(b + 1) * BLOCK] = weights(rng, BLOCK)
        changed += BLOCK
    ins1, ins2 = weights(rng, 298 * 4096), weights(rng, 695 * 4096)
    b = w1 + ins1 + bytes(pool) + ins2 + w2
    src = _write(tmp_path / "img", a)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    _write(src, b)
    (src / "pages-2.img").write_bytes(weights(rng, 1 << 20))  # an image the parent has not: stored plain
    rep = cli.json("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a")
    plain = Cli(tmp_path / "plain").json("store", "put", "p", str(src), "--chunker", "pages", "--no-cache")
    mapped = len(ins1) + len(ins2) + (1 << 20)
    assert plain["new_bytes"] > 2 * (changed + mapped)  # without a parent: the whole pool again
    assert rep["new_bytes"] <= 1.1 * (changed + mapped), (rep["new_bytes"], changed, mapped)
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b


@pytest.mark.parametrize("lookup", ["1", "0"])
def test_a_process_whose_pages_moved_to_another_image_finds_its_parent(cli: Cli, store_dir: Path,
                                                                        tmp_path: Path, lookup: str) -> None:
    """CRIU numbers page images in the order it dumps them: on the H200 a process's pages were
    pages-8.img in the first dump and pages-9.img in the second, moved by 1.5 GB, while pages-8.img
    of the second was a small image of something else. The second dump places each new stream's
    bytes in whichever parent stream its unchanged chunks were found, at that shift (here 40 MiB,
    beyond the search's reach), and places the pool's chunks (every one changed) by their lengths:
    three cuts in a row that are the parent's. So the pool is stored as deltas, not again. With the
    parent's page keys looked up (LOOKUP 1) the places are found at the first try; without them (a
    parent written before page keys) by the chunks set aside and tried again at the end."""
    rng = np.random.default_rng(23)
    w1, w2, w3 = weights(rng, 16 << 20), weights(rng, 8 << 20), weights(rng, 8 << 20)
    pool = _kv_pool(rng, 48 << 20, 0.30)
    first = {"pages-1.img": w1 + bytes(pool) + w2, "pages-2.img": w3}
    empty = [b for b in range(len(pool) // BLOCK) if not any(pool[b * BLOCK:b * BLOCK + 64])]
    changed = 0
    for b in rng.choice(empty, (len(pool) // BLOCK) // 20, replace=False):
        pool[b * BLOCK:(b + 1) * BLOCK] = weights(rng, BLOCK)
        changed += BLOCK
    other = weights(rng, 1 << 20)
    second = {"pages-1.img": other, "pages-3.img": w3 + bytes(40 << 20) + w1 + bytes(pool) + w2}
    src = tmp_path / "img"
    src.mkdir()
    for name, data in first.items():
        (src / name).write_bytes(data)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    for name in first:
        (src / name).unlink()
    for name, data in second.items():
        (src / name).write_bytes(data)
    rep = json.loads(cli.run("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a",
                             "--json", env={"GPUSNAP_PAGE_LOOKUP": lookup}).stdout)
    plain = Cli(tmp_path / "plain").json("store", "put", "p", str(src), "--chunker", "pages", "--no-cache")
    assert plain["new_bytes"] > 2 * (changed + len(other))  # without a parent: the whole pool again
    # the changed blocks and the unrelated image: without the lookup, the first chunks of w1's region
    # after the gap are tried again at the end of the put, once w1's unchanged chunks said where it went
    assert rep["new_bytes"] <= 1.1 * (changed + len(other)), (rep["new_bytes"], changed, len(other))
    if lookup == "0":
        assert rep["stages"]["delta:won when tried again"]["bytes"] > 0, rep["stages"]
    else:
        assert rep["stages"]["delta-lookup"]["bytes"] > 0, rep["stages"]
    assert rep["stages"]["delta:won"]["bytes"] >= len(pool) // 2, rep["stages"]
    cli.run("store", "get", "b", str(tmp_path / "out"))
    for name, data in second.items():
        assert (tmp_path / "out" / "img" / name).read_bytes() == data


def test_the_moe_trees_second_dump_finds_its_pages_where_they_moved(cli: Cli, store_dir: Path) -> None:
    """The weights-dominated two-process tree (scripts/workloads/moe_workload.py, numpy in place of
    device memory) dumped, restored, 5% of its KV blocks filled, dumped again with --parent: its page
    images moved by several shifts (areas mapped at several places) and every chunk of the KV pools
    changed. What the second dump stores is at most 1.5x the pages that are new (found nowhere in
    the parent's image of the same name); before the dump searched the parent's pages near a chunk's
    place it was ~4.6x. The restored tree checks its own memory after the restore."""
    from scripts.workloads.workload_control import Workload
    from support.criu import require_criu
    require_criu()
    with Workload(0.3, detached=True, script="moe_workload.py", extra=("--device", "cpu"), timeout=120) as w:
        cli.run("criu", "dump", str(w.pid), "m1")
        w.reap()
        cli.run("criu", "restore", "m1")
        assert w.cmd("verify")["ok"]
        w.cmd("mutate 5")
        second = cli.json("criu", "dump", "--leave-running", "--parent", "m1", str(w.pid), "m2")
        assert second["parent"] == "m1"
        assert w.cmd("verify")["ok"]
    def cat(snap: str, name: str) -> bytes:
        p = subprocess.run([*GPUSNAP, "--store", str(store_dir), "store", "cat", snap, name], capture_output=True,
                           cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=120)
        return p.stdout if p.returncode == 0 else b""

    new_pages = 0
    zero = int(page_keys(bytes(4096))[0])
    for e in cli.json("store", "ls", "m2"):
        name = e["path"]
        if "/pages-" not in name:
            continue
        now = page_keys(cat("m2", name))
        before = set(page_keys(cat("m1", name)).tolist())
        new_pages += sum(1 for k in now.tolist() if k != zero and k not in before)
    assert new_pages > 0
    assert second["new_bytes"] <= 1.5 * new_pages * 4096, (second["new_bytes"], new_pages * 4096)
    assert cli.json("store", "verify", "--read-data")["ok"]


def test_a_delta_naming_more_base_bytes_than_a_delta_may_is_refused_before_all_are_held() -> None:
    """A hostile table naming many large distinct bases: the reader stops (one-line damage) once the
    bases read hold more than delta.bases_limit together, instead of holding all of them at once."""
    raw_len = 4096
    ids = [bytes([i]) * 32 for i in range(1, 9)]
    segs = b"".join(struct.pack("<32sQQ", b, 0, 512) for b in ids)
    payload = struct.pack("<H6x", len(ids)) + segs + _zstd(bytes(raw_len))
    read: list[str] = []

    def base(bid: str, most: int) -> bytes:
        read.append(bid)
        return bytes(most)  # each base as large as a base of this delta may be

    with pytest.raises(delta.DeltaDamage, match="more than") as e:
        delta.decode(DELTA, raw_len, memoryview(payload), "cd" * 32, None, base)
    assert "\n" not in str(e.value)
    assert len(read) == 3  # two bases at their limit fit; the third is where it stops


def test_xored_refuses_a_reference_no_reader_would_take() -> None:
    """The writer cuts a new delta's reference from its parent's entries (a parent delta's table
    among them): a segment that reads past its base, or bases holding more than a delta's may, is
    refused there (ValueError: the candidate is dropped), never written for readers to refuse."""
    base = bytes(4096)
    data = memoryview(bytes(4096))
    with pytest.raises(ValueError, match="past its base"):
        delta.xored(data, [delta.Segment("ab" * 32, 8192, 4096)], {"ab" * 32: base}, memoryview(bytearray(4096)))
    big: dict[str, bytes | memoryview] = {c * 32: bytes(delta.base_limit(4096)) for c in ("a1", "b2", "c3")}
    segs = [delta.Segment(k, 0, 1024) for k in big] + [delta.Segment(None, 0, 1024)]
    with pytest.raises(ValueError, match="more than"):
        delta.xored(data, segs, big, memoryview(bytearray(4096)))


def test_gc_deletes_nothing_while_a_pack_index_is_damaged_in_a_store_with_deltas(
        cli: Cli, store_dir: Path, tmp_path: Path, images: tuple[bytes, bytes, int]) -> None:
    """A damaged index's pack may hold deltas whose bases lie in other packs: gc stops, nothing is
    deleted, and once the index is whole again every delta still finds its bases."""
    _, b, _ = images
    _two(cli, tmp_path, images)
    cli.run("store", "rm", "a")
    saved = {}
    for name in {e.path.name for e in delta_entries(store_dir)}:
        idx = store_dir / "index" / name
        saved[idx] = idx.read_bytes()
        bad = bytearray(saved[idx])
        bad[len(bad) // 2] ^= 0xFF
        idx.write_bytes(bytes(bad))
    assert saved
    before = pack_bytes(store_dir)
    gc = cli.run("store", "gc", check=False)
    assert gc.returncode != 0 and "nothing deleted" in gc.stderr, gc.stderr
    assert pack_bytes(store_dir) == before
    for idx, data in saved.items():
        idx.write_bytes(data)
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b


def test_gc_deletes_nothing_when_it_cannot_tell_whether_an_entry_is_a_delta(
        cli: Cli, store_dir: Path, tmp_path: Path, images: tuple[bytes, bytes, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry whose header cannot be read while gc closes over the bases (EMFILE here): gc stops
    with nothing deleted, rather than taking it for a full entry and freeing a delta's bases."""
    import errno
    import sys
    import storage.repo.store as store_mod
    from storage.maintenance import gc as gc_mod
    _, b, _ = images
    _two(cli, tmp_path, images)
    cli.run("store", "rm", "a")
    real = store_mod.open_pack

    def called_from(name: str) -> bool:  # entry_kind opens through the store's PackFds: a few frames up
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_name == name:
                return True
            f = f.f_back  # type: ignore[assignment]
        return False

    def flaky(packs: int, pack: str, cid: str) -> int:
        if called_from("entry_kind"):
            raise OSError(errno.EMFILE, "Too many open files")
        return real(packs, pack, cid)

    monkeypatch.setattr(store_mod, "open_pack", flaky)
    with pytest.raises(gc_mod.GcStopped, match="nothing deleted"):
        gc_mod.collect(SnapshotStore(str(store_dir), create=False))
    monkeypatch.setattr(store_mod, "open_pack", real)
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b
    rep = gc_mod.collect(SnapshotStore(str(store_dir), create=False))  # a gc that can read runs through
    assert not rep.damage, rep
    cli.run("store", "get", "b", str(tmp_path / "out2"))  # a's chunks that b's deltas name were kept


def test_an_unrelated_parent_costs_a_put_little(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """A parent that is not this data's (new bytes throughout): after the first attempts fail, only one
    new chunk in 16 is tried as a delta, so the search for bases stays a small part of the put."""
    rng = np.random.default_rng(5)
    src = _write(tmp_path / "img", weights(rng, 16 << 20))
    cli.run("store", "put", "a", str(src), "--chunker", "pages", "--chunk-size", "128K")
    _write(src, weights(rng, 64 << 20))
    rep = cli.json("store", "put", "b", str(src), "--chunker", "pages", "--chunk-size", "128K", "--no-cache",
                   "--parent", "a")
    chunks = rep["new_chunks"] if "new_chunks" in rep else (64 << 20) // (96 << 10)
    searched = rep["stages"].get("delta-search", {}).get("bytes", 0)
    assert chunks > 300, rep
    assert searched <= (32 + chunks // 16 + 8) * (128 << 10), (searched, chunks)
    cli.run("store", "get", "b", str(tmp_path / "out"))


def test_page_differences_counts_every_differing_byte_of_every_page() -> None:
    """The per-page counts the candidates are scored and mixed by: exact for sparse and dense XORs,
    pages whose differing bytes sit in one word only, and a last partial page."""
    rng = np.random.default_rng(31)
    for n, dense in ((64 * 4096, 0.02), (64 * 4096 + 1000, 0.5), (3000, 1.0), (0, 0.0)):
        x = np.zeros(n, np.uint8)
        hit = rng.random(n) < dense
        x[hit] = rng.integers(1, 256, int(hit.sum()), dtype=np.uint8)
        if n >= 4096 * 4:
            x[2 * 4096 + 4095] = 7  # one byte in the last word of a page
        want = [int(np.count_nonzero(x[i:i + 4096])) for i in range(0, n, 4096)]
        assert delta.page_differences(memoryview(x.tobytes())).tolist() == want


def test_a_candidate_failing_half_way_never_leaves_its_xor_for_another(tmp_path: Path) -> None:
    """A hostile parent (another node's manifest) whose stream claims a chunk longer than it holds: the
    candidate reading it fails after the chunk before it was XORed in. The scratch must not then be
    taken for the XOR of the candidate chosen (it held N XOR A under the table of P: a delta that
    decodes to other bytes, which a later put of the same bytes would have deduplicated onto)."""
    from storage.pipeline import put as pipeline
    from storage.fs.directio import AlignedBuffer
    from storage.archive.filetree import FileTreeSource
    from storage.format.manifest import ChunkRef, Manifest
    cs = 256 << 10
    rng = np.random.default_rng(1)
    new = rng.integers(0, 256, cs, dtype=np.uint8)
    p = new.copy()
    flip = rng.random(cs) < 0.4
    p[flip] ^= rng.integers(1, 256, int(flip.sum()), dtype=np.uint8)  # the same place, 40% changed
    src = tmp_path / "one" / "src"
    src.mkdir(parents=True)
    for name, arr in (("p", p), ("a", new[:cs - 4096]), ("b", rng.integers(0, 256, 1024, dtype=np.uint8))):
        (src / name).write_bytes(arr.tobytes())
    st = SnapshotStore(str(tmp_path / "store"))
    with FileTreeSource([str(src)]) as s, st.writer("a") as w:
        pipeline.put(w, s, chunk_size=cs, workers=2)
        w.commit()
    by = {s.name.rsplit("/", 1)[-1]: s for s in st.load("a").streams}
    b = by["b"].chunks[0]
    hostile = Manifest("a", [Stream(by["p"].name, dict(by["p"].attrs),
                                    [by["p"].chunks[0], by["a"].chunks[0], ChunkRef(b.id, 8192, b.codec, b.stored_len)])])
    src2 = tmp_path / "two" / "src"
    src2.mkdir(parents=True)
    (src2 / "p").write_bytes(new.tobytes())
    with FileTreeSource([str(src2)]) as s, st.writer("b") as w:
        pipeline.put(w, s, chunk_size=cs, workers=2, parent=hostile)
        mb = w.commit()
    ref = next(c for s in mb.streams for c in s.chunks if c.id)
    assert bytes(st.read_raw(ref, AlignedBuffer(1 << 20))) == new.tobytes()


def test_a_base_asked_for_by_many_threads_at_once_is_read_once(tmp_path: Path) -> None:
    """SnapshotStore.delta_base: threads asking for the same base while one reads it wait for that read
    (a dump's neighbouring chunks share parent chunks); a read that fails lets the next asker read it
    itself, so every asker gets the failure and none waits for ever; the cache keeps what was read."""
    import threading
    import time as _time
    from storage.format.chunkfile import ChunkError
    st = SnapshotStore(str(tmp_path / "s"))
    reads: list[str] = []
    fail = {"bad"}

    def slow_read(bid: str, most: int) -> memoryview:
        reads.append(bid)
        _time.sleep(0.2)
        if bid in fail:
            raise ChunkError(bid, "unreadable")
        return memoryview(bid.encode() * 10)

    st._read_base = slow_read  # type: ignore[method-assign]
    got: list[object] = []

    def ask(bid: str) -> None:
        try:
            got.append(st.delta_base(bid, 1 << 20))
        except ChunkError as e:
            got.append(e)

    threads = [threading.Thread(target=ask, args=("good",)) for _ in range(8)]
    threads += [threading.Thread(target=ask, args=("bad",)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert reads.count("good") == 1  # one read, seven waited for it
    assert reads.count("bad") == 3   # each failed read let the next asker try
    assert sum(1 for g in got if g == b"good" * 10) == 8 and sum(1 for g in got if isinstance(g, ChunkError)) == 3
    assert st.delta_base("good", 1 << 20) == b"good" * 10 and reads.count("good") == 1  # cached
    with pytest.raises(ChunkError):
        st.delta_base("good", 4)  # a cached base beyond a delta's limit is still damage
    from storage.repo.store import BASE_CACHE, base_cache_bytes
    assert BASE_CACHE <= base_cache_bytes() <= 1 << 30
    st.keep_bases(1)  # never below the floor
    assert st._bases_most == BASE_CACHE


def test_a_marker_that_hides_deltas_does_not_cost_a_delta_its_bases(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                   images: tuple[bytes, bytes, int]) -> None:
    """gc reads entry headers for delta bases only where the marker says deltas may be there; a marker
    that says otherwise (written by hand, or by a buggy writer) while a manifest names a delta must
    not let gc delete the bases: the manifests' own references say deltas are there."""
    _, b, _ = images
    _two(cli, tmp_path, images)
    cli.run("store", "rm", "a")  # b's delta bases are now named only through b's deltas
    marker = store_dir / "gpusnap-store.json"
    info = json.loads(marker.read_text())
    info["requires"].remove("codec:xor-zstd")  # the one entry that says deltas may be there
    marker.write_text(json.dumps(info))
    cli.run("store", "gc")
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b
    assert cli.json("store", "verify", "--read-data")["ok"]
