"""Raw-addressed chunks (FORMAT.md, GSNPCHK2): a put of unchanged data hashes and finds its chunks
without compressing them; version 1 stores (GSNPCHK1 only) still read, verify and restore, and are
upgraded by the first raw-addressed write; a forged GSNPCHK2 file (sound stored checksum, other raw
bytes) is damage for every reader of raw bytes and for `verify --read-data`. Real files on the real
disk, the real CLI."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
import zstandard

from conftest import Cli, chunk_files, make_mixed_tree, tree_digest
from support.entries import Entry, chunk_entries, to_chunk_files
from storage.pipeline import put as pipeline
from storage.codecs.registry import CODEC_NAMES
from storage.format.chunkfile import HEADER_SIZE, MAGIC, MAGIC_RAW, ChunkHeader, chunk_id, raw_chunk_id
from storage.codecs.registry import Shuffle2Codec, decode_host
from storage.archive.filetree import FileTreeSource
from storage.repo.store import SnapshotStore


def _magic(e: Entry) -> bytes:
    return e.read()[:8]


def _marker_version(store: Path) -> int:
    return json.loads((store / "gpusnap-store.json").read_text())["version"]


def test_second_put_of_unchanged_data_compresses_and_writes_nothing(cli: Cli, store_dir: Path,
                                                                    tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "model", mb=12)
    first = cli.json("store", "put", "a", str(src), "--chunk-size", "1M")
    assert first["chunks_compressed"] == first["chunks_new"] > 0, first
    assert {_magic(e) for e in chunk_entries(store_dir)} == {MAGIC_RAW}
    assert _marker_version(store_dir) == 8  # a store written by this version (FORMAT.md, "Store versions")
    # --no-parent: this is about raw-addressed ids alone (a parent would store the changed chunk as a delta)
    second = cli.json("store", "put", "b", str(src), "--chunk-size", "1M", "--no-parent")
    assert second["chunks_compressed"] == 0 and second["chunks_new"] == 0 and second["new_bytes"] == 0, second
    assert second["chunks_dedup"] == first["chunks_new"] and second["chunks_zero"] == first["chunks_zero"]
    # one chunk's worth of bytes changed: that chunk alone is compressed and written
    w = src / "weights.bf16"
    data = bytearray(w.read_bytes())
    data[100:200] = bytes(range(100))
    w.write_bytes(bytes(data))
    third = cli.json("store", "put", "c", str(src), "--chunk-size", "1M", "--no-parent")
    assert third["chunks_compressed"] == third["chunks_new"] == 1, third
    for name in ("a", "b", "c"):
        cli.run("store", "get", name, str(tmp_path / f"out-{name}"))
    assert tree_digest(tmp_path / "out-c" / "model") == tree_digest(src)
    assert (tmp_path / "out-a" / "model" / "weights.bf16").read_bytes() != data
    assert cli.json("store", "verify", "--read-data")["ok"]


class _StoredAddressed:
    """A writer as the GPU path and every version before store version 2 used it: GSNPCHK1 only."""

    def __init__(self, w: Any) -> None:
        self._w = w

    def __getattr__(self, name: str) -> Any:
        return getattr(self._w, name)

    def find_raw(self, data: memoryview) -> tuple[str, None]:
        return "", None

    def put_chunk(self, codec: str, raw_len: int, frame: memoryview, stored_len: int, raw_id: str | None = None) -> Any:
        return self._w.put_chunk(codec, raw_len, frame, stored_len)


def _version_1_store(path: Path, src: Path, name: str) -> None:
    st = SnapshotStore(str(path))
    with st.writer(name) as w, FileTreeSource([str(src)]) as source:
        pipeline.put(_StoredAddressed(w), source, chunk_size=1 << 20)  # type: ignore[arg-type]
        w.commit()
    to_chunk_files(path, 1)


def test_a_version_1_store_reads_verifies_restores_then_is_upgraded_and_mixed(cli: Cli, store_dir: Path,
                                                                              tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "model", mb=8)
    _version_1_store(store_dir, src, "old")
    old_chunks = chunk_files(store_dir)
    assert all(p.parent.parent.name == "chunks" for p in old_chunks)  # one file per chunk
    assert old_chunks and {_magic(e) for e in chunk_entries(store_dir)} == {MAGIC} and _marker_version(store_dir) == 1
    assert [s["name"] for s in cli.json("store", "ls")] == ["old"]
    assert cli.json("store", "verify")["ok"] and cli.json("store", "verify", "--read-data")["ok"]
    cli.run("store", "get", "old", str(tmp_path / "o1"))
    assert tree_digest(tmp_path / "o1" / "model") == tree_digest(src)
    assert _marker_version(store_dir) == 1  # reading never upgrades
    # a put finds only raw-addressed chunks: the same data is stored once more, raw-addressed
    put = cli.json("store", "put", "new", str(src), "--chunk-size", "1M")
    assert put["chunks_new"] == len(old_chunks) and put["chunks_compressed"] == put["chunks_new"], put
    assert _marker_version(store_dir) == 8  # upgraded by its first pack; the old chunk files stay and are read
    req = json.loads((store_dir / "gpusnap-store.json").read_text())["requires"]
    held = {"codec:" + CODEC_NAMES[struct.unpack_from("<H", e.read()[:10], 8)[0]] for e in chunk_entries(store_dir)}
    assert set(req) == held | {"feature:chunk-files"}, req  # what it held and what the put added
    assert {_magic(e) for e in chunk_entries(store_dir)} == {MAGIC, MAGIC_RAW}
    assert set(old_chunks) <= set(chunk_files(store_dir))
    assert cli.json("store", "verify", "--read-data")["ok"]
    for name in ("old", "new"):
        cli.run("store", "get", name, str(tmp_path / f"o-{name}"))
        assert tree_digest(tmp_path / f"o-{name}" / "model") == tree_digest(src)
    cli.run("store", "rm", "old")
    gc = cli.json("store", "gc")
    assert {_magic(e) for e in chunk_entries(store_dir)} == {MAGIC_RAW}, gc
    assert not (store_dir / "chunks").exists() or not any((store_dir / "chunks").glob("*/*"))


def test_a_store_of_an_unknown_version_is_refused(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    cli.run("store", "init")
    marker = json.loads((store_dir / "gpusnap-store.json").read_text())
    (store_dir / "gpusnap-store.json").write_text(json.dumps({**marker, "version": 9}))
    r = cli.run("store", "ls", check=False)
    assert r.returncode != 0 and "v9 is not gpusnap-store v8 or older" in r.stderr, r.stderr


def _forge(victim: Entry, codec: str) -> None:
    """Replace VICTIM's payload by an encoding of other raw bytes of the same length, with a stored
    checksum that matches: what only someone writing the store's files by hand can make."""
    data = victim.read()
    hdr = ChunkHeader.unpack(data[:64], victim.cid)
    assert hdr.raw_id
    raw = np.random.default_rng(7).normal(0, 0.02, hdr.raw_len // 2).astype(np.float32)
    raw_bytes = (raw.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    payload = (raw_bytes if codec == "raw" else Shuffle2Codec().encode(memoryview(raw_bytes)) if codec == "shuffle2-zstd"
               else zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw_bytes))
    forged = ChunkHeader(codec, hdr.raw_len, len(payload), raw_id=True)
    forged = forged.with_checksum(payload)
    victim.write(forged.pack().ljust(HEADER_SIZE, b"\0") + payload)


@pytest.mark.parametrize("codec", ["raw", "zstd", "shuffle2-zstd"])
def test_a_forged_raw_addressed_chunk_is_damage_for_readers_and_verify_read_data(cli: Cli, store_dir: Path,
                                                                                 tmp_path: Path, codec: str) -> None:
    src = make_mixed_tree(tmp_path / "model", mb=6)
    cli.run("store", "put", "m", str(src), "--chunk-size", "1M")
    victim = max(chunk_entries(store_dir), key=lambda e: e.length)
    _forge(victim, codec)
    # the stored check alone cannot see it (its checksum is sound): that is what --read-data is for
    assert cli.json("store", "verify")["ok"]
    g = cli.run("store", "get", "m", str(tmp_path / "out"), check=False)
    assert g.returncode != 0 and "does not match its hash" in g.stderr, g.stderr
    assert not (tmp_path / "out").exists()
    r = cli.run("store", "verify", "--read-data", "--json", check=False)
    assert r.returncode == 3, r.stdout
    rep = json.loads(r.stdout)
    assert rep["quarantined"] == [victim.cid] and (store_dir / "quarantine" / f"{victim.cid}.json").exists(), rep
    # the next put of the true bytes writes the chunk again
    put = cli.json("store", "put", "m2", str(src), "--chunk-size", "1M")
    assert put["chunks_new"] == 1, put
    cli.run("store", "get", "m", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "model") == tree_digest(src)


def test_verify_without_read_data_finds_a_flipped_byte_of_a_raw_addressed_chunk(cli: Cli, store_dir: Path,
                                                                                tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "model", mb=6)
    cli.run("store", "put", "m", str(src))
    for victim in chunk_entries(store_dir):
        assert _magic(victim) == MAGIC_RAW
        victim.flip(HEADER_SIZE + 10)
        r = cli.run("store", "verify", "--json", check=False)
        assert r.returncode == 3 and "corrupted" in r.stdout, r.stdout
        assert json.loads(r.stdout)["quarantined"] == [victim.cid]
        cli.run("store", "put", "heal", str(src), "--replace")
        assert cli.json("store", "verify")["ok"]


def test_raw_ids_are_their_own_id_space() -> None:
    """A raw chunk whose bytes are a GSNPCHK1 file's bound header and payload does not get its id."""
    payload = b"some stored bytes" * 100
    header = ChunkHeader("raw", len(payload), len(payload))
    stored_id = chunk_id(header, payload)
    assert raw_chunk_id(header.bound() + payload) != stored_id
    assert blake3.blake3(header.bound() + payload).hexdigest() == stored_id
    assert raw_chunk_id(payload) != blake3.blake3(payload).hexdigest()


def test_a_raw_addressed_chunk_encoded_otherwise_than_the_manifest_says_still_reads(cli: Cli, store_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """The same raw bytes encoded by another codec or zstd level (as another host or a later put may):
    the id binds the raw bytes, so readers take codec and length from the file (FORMAT.md)."""
    src = make_mixed_tree(tmp_path / "model", mb=6)
    # text-like bytes, which the host stores as zstd-1: zstd-19 of them is shorter and fits the entry
    (src / "notes.txt").write_bytes(b"".join(b"line %d of some notes, " % i for i in range(60000)))
    cli.run("store", "put", "m", str(src), "--chunk-size", "1M")

    def reencoded(e: Any) -> tuple[ChunkHeader, bytes, bytes] | None:
        """E's header, raw bytes and a zstd-19 payload of them, if that payload fits in E's entry."""
        data = e.read()
        hdr = ChunkHeader.unpack(data[:64], e.cid)
        if hdr.codec == "raw":
            return None
        raw = bytes(decode_host(hdr.codec, memoryview(data)[HEADER_SIZE:HEADER_SIZE + hdr.stored_len], hdr.raw_len))
        payload = zstandard.ZstdCompressor(level=19, write_content_size=True).compress(raw)
        return (hdr, raw, payload) if HEADER_SIZE + len(payload) <= len(data) else None

    victim, (hdr, raw, payload) = next((e, r) for e in chunk_entries(store_dir) if (r := reencoded(e)) is not None)
    assert raw_chunk_id(raw) == victim.cid
    assert len(payload) != hdr.stored_len
    other = ChunkHeader("zstd", hdr.raw_len, len(payload), raw_id=True).with_checksum(payload)
    victim.write(other.pack().ljust(HEADER_SIZE, b"\0") + payload)  # shorter: it fits in its entry
    assert cli.json("store", "verify")["ok"] and cli.json("store", "verify", "--read-data")["ok"]
    cli.run("store", "get", "m", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "model") == tree_digest(src)
    # a put of the same data reuses that file as it is and records what it holds
    again = cli.json("store", "put", "m2", str(src), "--chunk-size", "1M")
    assert again["chunks_new"] == 0 and again["chunks_compressed"] == 0, again
    refs = [c for s in SnapshotStore(str(store_dir)).load("m2").streams for c in s.chunks if c.id == victim.cid]
    assert refs and all((c.codec, c.stored_len) == ("zstd", len(payload)) for c in refs)
    # but a raw length other than the reference's is damage
    wrong = ChunkHeader("zstd", hdr.raw_len + 1, len(payload), raw_id=True).with_checksum(payload)
    victim.write(wrong.pack().ljust(HEADER_SIZE, b"\0") + payload)
    v = cli.run("store", "verify", "--json", check=False)
    assert v.returncode == 3 and "disagrees with the manifest" in v.stdout, v.stdout
