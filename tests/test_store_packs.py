"""Store format v3 (FORMAT.md, "Pack files and the index"): kill -9 at each step of the pack write
order leaves a store that verifies, loses nothing committed, and whose leftovers gc reclaims; hostile
index files never make a read leave its pack or allocate beyond what the snapshot needs; gc repacks
packs that are mostly dead; a version 2 store (one file per chunk) is read, then migrated. Real
files on the real disk, the real CLI, a real SIGKILL."""
from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import Cli, chunk_files, make_mixed_tree, tree_digest
from storage.format.packs import decode_index, encode_index
from support.entries import chunk_entries, chunk_ids, ref_id, to_chunk_files
from support.pagecache import cold_store, resident_bytes, resident_in
from support.store_faults import killed_at


def _distinct(path: Path, chunks: int, seed: int) -> Path:
    """CHUNKS distinct 4 MiB chunks of incompressible bytes."""
    block = bytearray(np.random.default_rng(seed).bytes(4 << 20))
    with open(path, "wb") as f:
        for i in range(chunks):
            block[:8] = (seed * 1000 + i).to_bytes(8, "little")
            f.write(block)
    return path


@pytest.mark.parametrize("stage", ["pack-partial", "pack-synced", "indexed"])
def test_kill_9_at_each_pack_write_step(cli: Cli, store_dir: Path, tmp_path: Path, stage: str) -> None:
    keep_src = make_mixed_tree(tmp_path / "keep", mb=8)
    cli.run("store", "put", "keep", str(keep_src))
    kept_packs, kept_ids = chunk_files(store_dir), chunk_ids(store_dir)
    big = _distinct(tmp_path / "big", 12, seed=stage.__len__())
    killed_at(store_dir, ["store", "put", "k", str(big)], stage, tmp_path)
    # nothing committed is lost, nothing half-written is visible
    assert [r["name"] for r in cli.json("store", "ls")] == ["keep"]
    assert cli.json("store", "verify", "--read-data")["ok"]
    cli.run("store", "get", "keep", str(tmp_path / "o1"))
    assert tree_digest(tmp_path / "o1" / "keep") == tree_digest(keep_src)
    left = set(chunk_files(store_dir)) - set(kept_packs)
    assert left, "the killed put left its pack"
    indexed = {p.name for p in (store_dir / "index").iterdir()}
    if stage == "indexed":
        assert {p.name for p in left} <= indexed  # a durable, indexed pack no manifest names
        # ... whose chunks the next put reuses instead of writing them again
        again = cli.json("store", "put", "k2", str(big))
        assert again["chunks_dedup"] > 0, again
        cli.run("store", "rm", "k2")
    else:
        assert not {p.name for p in left} & indexed  # never indexed: garbage, never damage
    gc = cli.json("store", "gc")
    assert gc["packs_removed"] >= 1 and not gc["damage"], gc
    assert chunk_files(store_dir) == kept_packs and chunk_ids(store_dir) == kept_ids
    assert {p.name for p in (store_dir / "index").iterdir()} == {p.name for p in kept_packs}
    assert not list((store_dir / "tmp").iterdir())
    assert cli.json("store", "verify", "--read-data")["ok"]
    # and the store takes the same put again, whole
    cli.run("store", "put", "k", str(big))
    cli.run("store", "get", "k", str(tmp_path / "o2"))
    assert (tmp_path / "o2" / "big").read_bytes() == big.read_bytes()


def test_one_fsync_per_pack_and_packs_of_the_target_size(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """A put of 40 distinct chunks (160 MiB) writes two packs (128 MiB target), each indexed."""
    big = _distinct(tmp_path / "big", 40, seed=3)
    put = cli.json("store", "put", "b", str(big))
    assert put["chunks_new"] == 40
    packs = chunk_files(store_dir)
    assert len(packs) == 2 and max(p.stat().st_size for p in packs) >= 128 << 20
    assert sorted(p.name for p in (store_dir / "index").iterdir()) == sorted(p.name for p in packs)
    assert not any((store_dir / "chunks").glob("*/*"))  # nothing written one file per chunk
    # read back through the read stage (runs of adjacent entries, each run's buffer reused only once
    # every entry of it is written), a few times: every byte where it belongs
    for n in range(3):
        got = json.loads(cli.run("store", "get", "b", str(tmp_path / f"o{n}"), "--json").stdout)
        assert (tmp_path / f"o{n}" / "big").read_bytes() == big.read_bytes()
        assert got["stages"]["read"]["bytes"] >= 40 * (4 << 20)


def _rewrite_index(store: Path, edit) -> Path:
    idx = next((store / "index").iterdir())
    pack_len, ents = decode_index(idx.name, idx.read_bytes())
    pack_len, ents = edit(pack_len, ents)
    idx.write_bytes(encode_index(idx.name, pack_len, ents))  # a sound checksum: only the checks below stop it
    return idx


@pytest.mark.parametrize("forgery", ["past-the-pack", "huge-entry", "overlap", "bad-checksum", "oversized-file",
                                     "other-pack"])
def test_a_hostile_index_is_damage_never_a_read_outside_its_pack(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                 forgery: str) -> None:
    src = make_mixed_tree(tmp_path / "m", mb=8)
    cli.run("store", "put", "m", str(src))
    pack = chunk_files(store_dir)[0]
    size = pack.stat().st_size
    if forgery == "past-the-pack":  # the index claims a longer pack and an entry beyond its end
        _rewrite_index(store_dir, lambda n, e: (n + (64 << 20), e[:-1] + [(e[-1][0], n + (32 << 20), e[-1][2])]))
        expect = "truncated"
    elif forgery == "huge-entry":  # an entry of 1 GiB: never allocated, never read
        _rewrite_index(store_dir, lambda n, e: ((2 << 30), e[:-1] + [(e[-1][0], e[-1][1], 1 << 30)]))
        expect = "larger than the snapshot's chunk"
    elif forgery == "overlap":
        _rewrite_index(store_dir, lambda n, e: (n, e + [(e[0][0], e[0][1], e[0][2])]))
        expect = "not a valid entry"
    elif forgery == "bad-checksum":
        idx = next((store_dir / "index").iterdir())
        b = bytearray(idx.read_bytes())
        b[70] ^= 1
        idx.write_bytes(bytes(b))
        expect = "checksum"
    elif forgery == "oversized-file":
        idx = next((store_dir / "index").iterdir())
        with open(idx, "ab") as f:
            f.truncate(17 << 20)
        expect = "more than an index file may be"
    else:  # an index naming another pack than its own name
        idx = next((store_dir / "index").iterdir())
        b = bytearray(idx.read_bytes())
        b[8:24] = bytes(16)
        body = bytes(b[:-32])
        import blake3
        idx.write_bytes(body + blake3.blake3(body).digest())
        expect = "names pack"
    v = cli.run("store", "verify", "--json", check=False, timeout=60)
    assert v.returncode == 3, v.stdout
    g = cli.run("store", "get", "m", str(tmp_path / "o"), check=False, timeout=60)
    assert g.returncode == 3 and len(g.stderr.splitlines()) == 1 and not (tmp_path / "o").exists(), g.stderr
    gc = cli.run("store", "gc", "--json", check=False)
    report = json.loads(gc.stdout)
    assert pack.exists() and pack.stat().st_size == size, "gc deletes nothing an index it cannot trust may name"
    if forgery in ("overlap", "bad-checksum", "oversized-file", "other-pack"):
        assert gc.returncode == 3 and any(expect in d for d in report["damage"]), report
    else:
        assert any(expect in p for p in json.loads(v.stdout)["problems"]), v.stdout


def test_gc_repacks_a_mostly_dead_pack_and_keeps_what_snapshots_name(cli: Cli, store_dir: Path,
                                                                      tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    _distinct(d / "small", 2, seed=5)
    _distinct(d / "large", 10, seed=6)
    cli.run("store", "put", "both", str(d))          # one pack: 2 + 10 chunks
    cli.run("store", "put", "small", str(d / "small"))  # all found present: no new pack
    [pack] = chunk_files(store_dir)
    cli.run("store", "rm", "both")
    gc = cli.json("store", "gc")
    assert gc["packs_repacked"] == 1 and gc["chunks_removed"] == 10, gc
    [new] = chunk_files(store_dir)
    assert new != pack and not pack.exists() and len(chunk_entries(store_dir)) == 2
    assert new.stat().st_size < 10 << 20
    assert cli.json("store", "verify", "--read-data")["ok"]
    cli.run("store", "get", "small", str(tmp_path / "o"))
    assert (tmp_path / "o" / "small").read_bytes() == (d / "small").read_bytes()
    # a pack all dead goes whole, one all alive stays as it is
    cli.run("store", "put", "large", str(d / "large"))
    cli.run("store", "put", "mix", str(d))
    [alive] = [p for p in chunk_files(store_dir) if p != new]
    cli.run("store", "rm", "small", "mix")
    gc = cli.json("store", "gc")
    assert gc["packs_repacked"] == 0 and gc["packs_removed"] == 1 and chunk_files(store_dir) == [alive], gc
    assert cli.json("store", "verify", "--read-data")["ok"]


def test_gc_keeps_chunks_a_journaled_operation_names(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """A chunk-reference log of an operation still in the journal pins its chunks in their pack."""
    from storage.repo.store import SnapshotStore
    from storage.fs.directio import AlignedBuffer
    st = SnapshotStore(str(store_dir))
    buf = AlignedBuffer(8192 + 4096)
    buf.view[4096:4096 + 5000] = os.urandom(5000)
    with st.writer("w") as w:
        ref = w.put_chunk("raw", 5000, buf.view, 5000)
        w.sync_chunks([ref])  # closed and indexed, as the GPU path does before logging it
    buf.close()
    assert ref.id in chunk_ids(store_dir)
    jdir = store_dir / "journal"
    jdir.mkdir(mode=0o700)
    op = "a" * 32
    (jdir / f"{op}.json").write_text(json.dumps({"op": op, "kind": "gpu-checkpoint", "stage": "dumping",
                                                 "owner": {"pid": 999999, "start": 1}}))
    line = json.dumps({"k": "chunk", "stream": "gpu/1/0", "i": 0, "ref": ref.to_json()}, separators=(",", ":"))
    import zlib
    (jdir / f"{op}.refs").write_text(f"{zlib.crc32(line.encode()):08x} {line}\n")
    from storage.maintenance.gc import collect
    g = collect(SnapshotStore(str(store_dir)))
    assert g.packs_removed == 0 and ref.id in chunk_ids(store_dir), g
    (jdir / f"{op}.json").unlink()
    g = collect(SnapshotStore(str(store_dir)))
    assert g.packs_removed == 1 and ref.id not in chunk_ids(store_dir)


def test_a_version_2_store_is_read_then_migrated_into_packs(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "m", mb=12)
    cli.run("store", "put", "old", str(src), "--chunk-size", "1M")
    ids = chunk_ids(store_dir)
    to_chunk_files(store_dir, 2)
    assert not (store_dir / "packs").exists() and len(chunk_files(store_dir)) == len(ids)
    assert cli.json("store", "verify", "--read-data")["ok"]  # read as it is, no upgrade
    cli.run("store", "get", "old", str(tmp_path / "o1"))
    assert tree_digest(tmp_path / "o1" / "m") == tree_digest(src)
    assert json.loads((store_dir / "gpusnap-store.json").read_text())["version"] == 2
    # a new snapshot of the same bytes finds them in the chunk files (dedup looks there, not only in
    # packs): it writes no pack entry (the upgrade to version 3 makes packs/, which stays empty)
    cli.run("store", "put", "again", str(src), "--chunk-size", "1M")
    assert not any(p.parent.name == "packs" for p in chunk_files(store_dir))
    cli.run("store", "rm", "again")
    # one damaged chunk file stays where it is (evidence), the rest move
    victim = next(e for e in chunk_entries(store_dir) if e.length > 8192)
    victim.flip_payload(0.5)
    r = cli.run("store", "migrate", "--json", check=False)
    assert r.returncode == 3, r.stderr
    rep = json.loads(r.stdout)
    assert rep["moved"] == len(ids) - 1 and len(rep["left"]) == 1 and victim.cid in rep["left"][0], rep
    info = json.loads((store_dir / "gpusnap-store.json").read_text())
    # version 8, requires computed from what it holds: its codecs, and chunk files still there (the victim)
    assert info["version"] == 8 and "feature:chunk-files" in info["requires"], info
    assert [p for p in chunk_files(store_dir) if p.parent.parent.name == "chunks"] == [victim.path]
    assert chunk_ids(store_dir) == ids
    # repair from the source puts the damaged one into a pack too
    cli.run("store", "repair", "--from", str(src))
    cli.run("store", "gc")
    assert cli.json("store", "migrate")["moved"] == 0
    assert all(p.parent.name == "packs" for p in chunk_files(store_dir)) and chunk_ids(store_dir) == ids
    assert "feature:chunk-files" not in json.loads((store_dir / "gpusnap-store.json").read_text())["requires"]
    assert cli.json("store", "verify", "--read-data")["ok"]
    cli.run("store", "get", "old", str(tmp_path / "o2"))
    assert tree_digest(tmp_path / "o2" / "m") == tree_digest(src)


def test_migrate_leaves_a_forged_raw_addressed_chunk_file_whose_checksum_matches(cli: Cli, store_dir: Path,
                                                                                  tmp_path: Path) -> None:
    """A GSNPCHK2 chunk file rewritten by hand: other raw bytes of the same length, its stored checksum
    computed anew over them, so that the stored check passes. Migrate makes the full check (decoded,
    the raw bytes must derive the id) before it moves a chunk: that file stays where it is (evidence),
    named, exit 3; nothing of it reaches a pack."""
    from storage.format.chunkfile import HEADER_SIZE, ChunkHeader
    src = make_mixed_tree(tmp_path / "m", mb=6)
    cli.run("store", "put", "old", str(src), "--chunk-size", "1M")
    ids = chunk_ids(store_dir)
    to_chunk_files(store_dir, 2)
    victim = max(chunk_entries(store_dir), key=lambda e: e.length)
    assert victim.read()[:8] == b"GSNPCHK2"
    raw_len = struct.unpack_from("<Q", victim.read(), 16)[0]
    forged = os.urandom(raw_len)
    header = ChunkHeader("raw", raw_len, raw_len, raw_id=True).with_checksum(forged)
    victim.write(header.pack().ljust(HEADER_SIZE, b"\0") + forged)
    assert cli.json("store", "verify")["ok"], "the stored check alone cannot tell the forgery"
    r = cli.run("store", "migrate", "--json", check=False)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stdout + r.stderr
    rep = json.loads(r.stdout)
    assert rep["moved"] == len(ids) - 1 and len(rep["left"]) == 1, rep
    assert victim.cid in rep["left"][0] and "does not match its hash" in rep["left"][0], rep
    assert [p for p in chunk_files(store_dir) if p.parent.parent.name == "chunks"] == [victim.path]
    assert victim.path.read_bytes()[HEADER_SIZE:] == forged  # left as it was: evidence
    assert not any(e.in_pack for e in chunk_entries(store_dir) if e.cid == victim.cid)
    g = cli.run("store", "get", "old", str(tmp_path / "o"), check=False)
    assert g.returncode == 3 and not (tmp_path / "o").exists(), g.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
@pytest.mark.parametrize("prefetch,later", [(0, False), (1 << 30, False), (1 << 30, True)])
def test_the_read_stage_prefetch_keeps_the_disk_busy_while_delivery_waits(tmp_path: Path, prefetch: int,
                                                                          later: bool) -> None:
    """With PREFETCH, the packs are read into the page cache while DELIVER holds the stage up;
    without it, no further than the stage's buffers. LATER: the prefetch waits for its event (the
    split fill's: CRIU is done) and reads ahead only once it is set."""
    import threading
    from storage.pipeline import put as pipeline
    from storage.repo.readstage import Want, read_chunks
    st, refs = cold_store(tmp_path, 192 << 20)  # incompressible: 192 MiB of packs
    gate, got, seen = threading.Event(), [], []
    start = threading.Event() if later else None

    def deliver(want, data) -> None:
        gate.wait(30)
        got.append(len(data))

    th = threading.Thread(target=read_chunks, args=(st, [Want(i, c) for i, c in enumerate(refs)], deliver),
                          kwargs=dict(stages=pipeline.Stages(), decoders=2, readers=1, order="pack", prefetch=prefetch,
                                      prefetch_from=start))
    th.start()
    try:
        if start is not None:
            time.sleep(2)
            held_back = resident_bytes(tmp_path / "store" / "packs")
            assert held_back < 100 << 20, held_back  # not read ahead before its event
            start.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            seen.append(resident_bytes(tmp_path / "store" / "packs"))
            if seen[-1] > 140 << 20:
                break
            time.sleep(0.2)
    finally:
        gate.set()
        th.join()
    assert sum(got) == sum(c.raw_len for c in refs)  # every chunk delivered, checked, once
    if prefetch:
        assert max(seen) > 140 << 20, seen  # the disk kept reading while delivery waited
    else:
        assert max(seen) < 100 << 20, seen  # the stage's own buffers (3 runs of 16 MiB) and the kernel's readahead


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_read_ahead_puts_the_named_chunks_in_the_page_cache(tmp_path: Path) -> None:
    """readstage.read_ahead (what CRIU will read, asked of the disk before the split fill's reads):
    the named chunks' pack entries become resident, the others stay on disk."""
    from storage.repo.readstage import read_ahead
    st, refs = cold_store(tmp_path, 96 << 20)
    before = resident_bytes(tmp_path / "store" / "packs")
    third = refs[:len(refs) // 3]
    asked = read_ahead(st, third)
    want = sum(c.stored_len for c in third)
    assert want <= asked < want + (1 << 20) * len(third)  # the entries named, each with its header
    deadline = time.monotonic() + 10
    while resident_bytes(tmp_path / "store" / "packs") - before < want and time.monotonic() < deadline:
        time.sleep(0.1)
    resident = resident_bytes(tmp_path / "store" / "packs") - before
    # the third asked for (+ the kernel's own readahead), not all; WILLNEED is a hint the kernel may
    # drop pages of under memory pressure (a CI run saw 32.8 of 33.6 MB arrive)
    assert want * 0.9 <= resident < want + (40 << 20), (want, resident)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_read_ahead_resident_returns_once_the_chunks_are_in_the_page_cache(tmp_path: Path) -> None:
    """read_ahead(resident=True), as the split restore asks for CRIU's chunks before the fill's reads
    begin: when it returns, the named entries are in the page cache (no waiting), the others are not."""
    from storage.format.manifest import ChunkRef
    from storage.repo.readstage import read_ahead
    st, refs = cold_store(tmp_path, 96 << 20)
    third, rest = refs[:len(refs) // 3], refs[len(refs) // 3:]

    def resident(ref: ChunkRef) -> tuple[int, int]:
        loc = st.locate(ref.id)[0]
        return resident_in(tmp_path / "store" / "packs" / loc.pack, loc.offset, loc.length), loc.length
    # what the drop left in memory (pages under writeback, the odd page) is not counted for read_ahead
    others_before = sum(resident(r)[0] for r in rest)
    read_ahead(st, third, resident=True)
    named = [resident(r) for r in third]
    assert all(got == length for got, length in named), named  # every page of every named entry
    others = sum(resident(r)[0] for r in rest) - others_before
    assert others < 40 << 20, others  # the others: at most the kernel's own readahead past the third


def test_dedup_skips_only_chunk_directories_that_are_empty(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """The dedup lookup (SnapshotStore.present) remembers chunks/XY directories it found empty and
    skips them; a directory holding chunk files is looked into every time: a miss there is not taken
    for emptiness, and the file that is there is still found."""
    from storage.format.chunkfile import ChunkHeader
    from storage.repo.store import SnapshotStore
    src = make_mixed_tree(tmp_path / "m", mb=4)
    cli.run("store", "put", "old", str(src), "--chunk-size", "1M")
    to_chunk_files(store_dir, 2)
    e = next(e for e in chunk_entries(store_dir) if not e.in_pack)
    st = SnapshotStore(str(store_dir))
    head = ChunkHeader.unpack(e.read()[:4096], e.cid)
    want = ChunkHeader("raw", head.raw_len, head.raw_len, raw_id=True)
    xy = e.cid[:2]
    empty = next(f"{i:02x}" for i in range(256) if not any((store_dir / "chunks" / f"{i:02x}").iterdir()))
    with st.subdir("chunks") as chunks:
        miss = xy + ("0" if e.cid[2] != "0" else "1") + e.cid[3:]  # another id in the same directory
        assert st.present(miss, want, chunks, None) is None
        assert xy not in st._no_chunk_files
        got = st.present(e.cid, want, chunks, None)
        assert got is not None and got.raw_len == head.raw_len
        assert st.present(empty + e.cid[2:], want, chunks, None) is None
        assert empty in st._no_chunk_files


def test_read_into_direct_stops_at_the_end_of_a_file_inside_a_block(tmp_path: Path) -> None:
    """An O_DIRECT read that meets the end of a file returns what is there, and reads no further (a
    read from an offset inside a block would be refused)."""
    from storage.fs.directio import ALIGN, AlignedBuffer, read_into_direct
    p = tmp_path / "f"
    data = os.urandom(3 * ALIGN + 123)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    buf = AlignedBuffer(8 * ALIGN)
    try:
        assert read_into_direct(fd, buf.view[:8 * ALIGN], 0) == len(data)
        assert bytes(buf.view[:len(data)]) == data
        assert read_into_direct(fd, buf.view[:ALIGN], 2 * ALIGN) == ALIGN
        assert bytes(buf.view[:ALIGN]) == data[2 * ALIGN:3 * ALIGN]
        assert read_into_direct(fd, buf.view[:2 * ALIGN], 4 * ALIGN) == 0  # past the end
    finally:
        os.close(fd)
        buf.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_get_reads_packs_past_the_page_cache_and_writes_the_same_bytes(cli: Cli, store_dir: Path,
                                                                      tmp_path: Path) -> None:
    """`store get` reads packs with O_DIRECT by default: the tree comes back byte for byte (entries
    at offsets inside a block, packs that end inside one), and the packs are not left in the page
    cache; GPUSNAP_GET_DIRECT=0 reads them through it, to the same bytes."""
    src = make_mixed_tree(tmp_path / "m", mb=24)
    (src / "odd.bin").write_bytes(os.urandom((1 << 20) + 4097))  # pack entries of odd lengths
    cli.run("store", "put", "a", str(src), "--chunk-size", "1M")
    packs = store_dir / "packs"
    for direct, name in (("1", "o1"), ("0", "o0")):
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        cli.run("store", "get", "a", str(tmp_path / name), env={"GPUSNAP_GET_DIRECT": direct})
        assert tree_digest(tmp_path / name / "m") == tree_digest(src)
        resident = resident_bytes(packs)
        total = sum(p.stat().st_size for p in packs.iterdir())
        if direct == "1":
            assert resident < total // 4, (resident, total)
        else:
            assert resident > total // 2, (resident, total)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_put_writes_packs_past_the_page_cache_unless_told(cli: Cli, store_dir: Path, tmp_path: Path,
                                                          direct: str) -> None:
    """`store put` writes its packs with O_DIRECT by default: none of them is left in the page cache,
    and the store verifies and gives the tree back byte for byte (entries of odd lengths);
    GPUSNAP_PUT_DIRECT=0 writes them through the page cache."""
    from storage.fs.directio import direct_io_supported
    if direct == "1" and not direct_io_supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    src = make_mixed_tree(tmp_path / "m", mb=24)
    (src / "odd.bin").write_bytes(os.urandom((1 << 20) + 4097))
    report = json.loads(cli.run("store", "put", "a", str(src), "--chunk-size", "1M", "--json",
                                env={"GPUSNAP_PUT_DIRECT": direct}).stdout)
    assert report["pack_writes"] == ("direct" if direct == "1" else "buffered")
    packs = store_dir / "packs"
    total = sum(p.stat().st_size for p in packs.iterdir())
    resident = resident_bytes(packs)
    if direct == "1":
        assert resident == 0, (resident, total)
    else:
        assert resident > total // 2, (resident, total)
    cli.run("store", "verify", "--read-data")
    cli.run("store", "get", "a", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "m") == tree_digest(src)


def test_a_bad_direct_setting_is_refused_before_anything_is_written(cli: Cli, store_dir: Path,
                                                                   tmp_path: Path) -> None:
    """GPUSNAP_PUT_DIRECT / GPUSNAP_GET_DIRECT take 0 or 1; anything else is one line and exit 1, with
    no snapshot made and nothing written where the get was to go."""
    src = make_mixed_tree(tmp_path / "m", mb=2)
    p = cli.run("store", "put", "a", str(src), check=False, env={"GPUSNAP_PUT_DIRECT": "no"})
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "GPUSNAP_PUT_DIRECT='no': expected 0 or 1" in p.stderr
    assert "a" not in cli.run("store", "ls").stdout.split()
    cli.run("store", "put", "a", str(src))
    p = cli.run("store", "get", "a", str(tmp_path / "out"), check=False, env={"GPUSNAP_GET_DIRECT": "2"})
    assert p.returncode == 1 and "GPUSNAP_GET_DIRECT='2': expected 0 or 1" in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()


def test_packs_fall_back_to_buffered_where_packs_dir_refuses_o_direct(tmp_path: Path) -> None:
    """A writer asked for direct packs whose packs/ refuses O_DIRECT at open (here: every open with the
    flag refused, as ramfs or another mount there does) writes them buffered, and they read back; a
    direct write refused later is an error that names the way out, and its pack is removed."""
    from unittest import mock

    from storage.format.chunkfile import HEADER_SIZE as HS, ChunkHeader
    from storage.format.packs import PackWriter, parse_entry
    root = tmp_path / "s"
    for d in ("packs", "index", "tmp"):
        (root / d).mkdir(parents=True)
    fds = {d: os.open(root / d, os.O_RDONLY | os.O_DIRECTORY) for d in ("packs", "index", "tmp")}
    real_open = os.open

    def no_direct(path: object, flags: int, *a: object, **k: object) -> int:
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a, **k)  # type: ignore[arg-type]

    got: dict[str, tuple[int, list[tuple[str, int, int]]]] = {}
    pw = PackWriter(fds["packs"], fds["index"], fds["tmp"], lambda: "idx-0",
                    lambda pack, n, ents: got.update({pack: (n, ents)}), direct=True)
    payload = os.urandom(10000)
    frame = memoryview(bytearray(HS + 12288))
    frame[HS:HS + len(payload)] = payload
    with mock.patch("storage.format.packs.os.open", no_direct):
        pw.append("ab" * 32, ChunkHeader("raw", len(payload), len(payload)), frame)
        pw.flush()
    for fd in fds.values():
        os.close(fd)
    assert not pw.direct
    (pack, (n, ents)), = got.items()
    # a direct write refused mid-pack is an error that says what to do, and the pack is never indexed
    from storage.fs.directio import direct_io_supported
    if direct_io_supported(str(tmp_path)):
        fds = {d: os.open(root / d, os.O_RDONLY | os.O_DIRECTORY) for d in ("packs", "index", "tmp")}
        pw2 = PackWriter(fds["packs"], fds["index"], fds["tmp"], lambda: "idx-1",
                         lambda pack, n, ents: got.update({pack: (n, ents)}), direct=True)
        with mock.patch("storage.fs.directio.os.pwrite", side_effect=OSError(22, "Invalid argument")):
            with pytest.raises(OSError, match="GPUSNAP_PUT_DIRECT=0 .* or GPUSNAP_DUMP_DIRECT=0"):
                pw2.append("cd" * 32, ChunkHeader("raw", len(payload), len(payload)), frame)
        # a direct write that stops short inside a block cannot go on there: EIO (or ENOSPC on a full disk)
        with mock.patch("storage.fs.directio.os.pwrite", return_value=100):
            with pytest.raises(OSError, match="stopped short") as short:
                pw2.append("ce" * 32, ChunkHeader("raw", len(payload), len(payload)), frame)
        assert short.value.errno == 5
        pw2.abort()
        for fd in fds.values():
            os.close(fd)
        assert list(got) == [pack] and sorted(p.name for p in (root / "packs").iterdir()) == [pack]
    data = (root / "packs" / pack).read_bytes()
    assert len(data) == n and bytes(parse_entry(memoryview(data)[ents[0][1]:], "ab" * 32)[1]) == payload


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_many_producers_filling_small_packs_index_every_entry_once(tmp_path: Path, direct: bool) -> None:
    """PackWriter under contention: 8 producers append 1,600 entries into packs of ~64 KiB, so packs
    fill and close all the time while others append; after flush() every entry is in exactly one
    indexed pack, each index file matches its pack's length, and every entry reads back. A close of
    a pack must never be skipped or waited for before it exists (a background close tried on
    2026-12-03 failed exactly here on the H200). Direct: the packs opened with O_DIRECT, and the
    producers' frames (bytearrays, not page-aligned) copied into aligned buffers on the way."""
    import threading

    from storage.format.chunkfile import ChunkHeader
    from storage.fs.directio import align_up, direct_io_supported
    from storage.format.packs import PackWriter, parse_entry
    from storage.format.chunkfile import HEADER_SIZE as HS
    if direct and not direct_io_supported(str(tmp_path)):
        pytest.skip("this file system refuses O_DIRECT")
    root = tmp_path / "s"
    for d in ("packs", "index", "tmp"):
        (root / d).mkdir(parents=True)
    fds = {d: os.open(root / d, os.O_RDONLY | os.O_DIRECTORY) for d in ("packs", "index", "tmp")}
    indexed: dict[str, tuple[int, list[tuple[str, int, int]]]] = {}
    lock = threading.Lock()
    counter = iter(range(10 ** 6))

    def on_indexed(pack: str, length: int, ents: list[tuple[str, int, int]]) -> None:
        with lock:
            assert pack not in indexed
            indexed[pack] = (length, ents)

    pw = PackWriter(fds["packs"], fds["index"], fds["tmp"], lambda: f"idx-{next(counter)}", on_indexed,
                    target=64 << 10, direct=direct)
    assert pw.direct == direct
    errors: list[BaseException] = []
    payloads: dict[str, bytes] = {}

    def producer(k: int) -> None:
        try:
            for i in range(200):
                payload = os.urandom(100 + (i * 37 + k) % 5000)
                cid = f"{k:02x}{i:062x}"
                payloads[cid] = payload
                header = ChunkHeader("raw", len(payload), len(payload))
                frame = memoryview(bytearray(HS + align_up(len(payload))))
                frame[HS:HS + len(payload)] = payload
                pw.append(cid, header, frame)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pw.flush()
    for fd in fds.values():
        os.close(fd)
    assert not errors, errors
    names = [c for _, (_, ents) in indexed.items() for c, _, _ in ents]
    assert len(names) == len(set(names)) == 8 * 200
    assert sorted(p.name for p in (root / "packs").iterdir()) == sorted(indexed)
    for pack, (length, ents) in indexed.items():
        assert (root / "packs" / pack).stat().st_size == length
        assert decode_index(pack, (root / "index" / pack).read_bytes()) == (length, sorted(ents, key=lambda e: e[1]))
        data = (root / "packs" / pack).read_bytes()
        for cid, off, n in ents:
            header, payload = parse_entry(memoryview(data)[off:off + n], cid)
            assert bytes(payload) == payloads[cid] and header.raw_len == len(payloads[cid])
    assert len(indexed) > 20  # the packs filled and closed many times while others appended


def test_the_read_stage_in_pack_order_reads_a_lower_group_first(tmp_path: Path) -> None:
    """ORDER "pack" with Want.group (the split fill completing one process before the next): every
    chunk of group 0 is delivered before any of group 1, each group in pack order, whatever the
    order of the wants; every chunk checked and delivered once."""
    from storage.pipeline import put as pipeline
    from storage.archive.filetree import FileTreeSource
    from storage.repo.readstage import Want, read_chunks
    from storage.repo.store import SnapshotStore
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob").write_bytes(os.urandom(40 << 20))
    st = SnapshotStore(str(tmp_path / "store"))
    with st.writer("a") as w:
        pipeline.put(w, FileTreeSource([str(src)]), workers=1)
        w.commit()
    refs = [c for s in st.load("a").streams for c in s.chunks if not c.is_zero]
    assert len(refs) >= 8
    at = {c.id: (st.locate(ref_id(c))[0].pack, st.locate(ref_id(c))[0].offset) for c in refs}
    wants = [Want(i, c, group=0 if i % 3 else 1) for i, c in enumerate(refs)]
    got: list[int] = []
    read_chunks(st, list(reversed(wants)), lambda w, data: got.append(w.key), stages=pipeline.Stages(),
                decoders=1, readers=1, order="pack")
    assert sorted(got) == list(range(len(refs)))
    groups = [wants[i].group for i in got]
    assert groups == sorted(groups), groups
    for g in (0, 1):
        places = [at[refs[i].id] for i in got if wants[i].group == g]
        assert places == sorted(places)


def test_the_read_stage_enters_its_gate_around_every_pack_read(tmp_path: Path) -> None:
    """GATE (the split fill's workers sharing reads in flight): with four readers and a gate that lets
    one through at a time, never two pack reads at once; every chunk still delivered once, and the
    waits reported as stage "read:wait-gate"."""
    import threading
    from contextlib import contextmanager
    from storage.pipeline import put as pipeline
    from storage.archive.filetree import FileTreeSource
    from storage.repo.readstage import RUN_MAX, Want, read_chunks
    from storage.repo.store import SnapshotStore
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob").write_bytes(os.urandom(6 * RUN_MAX))
    st = SnapshotStore(str(tmp_path / "store"))
    with st.writer("a") as w:
        pipeline.put(w, FileTreeSource([str(src)]), workers=1)
        w.commit()
    refs = [c for s in st.load("a").streams for c in s.chunks if not c.is_zero]
    one, inside, most, entered = threading.Lock(), [0], [0], [0]
    count = threading.Lock()

    @contextmanager
    def gate():
        with one:
            with count:
                inside[0] += 1
                entered[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.01)  # long enough for the other readers to try
            try:
                yield
            finally:
                with count:
                    inside[0] -= 1

    got: list[int] = []
    stages = pipeline.Stages()
    read_chunks(st, [Want(i, c) for i, c in enumerate(refs)], lambda w, data: got.append(w.key), stages=stages,
                decoders=2, readers=4, order="pack", gate=gate)
    assert sorted(got) == list(range(len(refs)))
    assert most[0] == 1 and entered[0] >= 6, (most, entered)  # one run of at most RUN_MAX per gate
    assert stages.table()["read:wait-gate"]["thread_seconds"] > 0


def test_read_tokens_let_as_many_reads_through_as_they_hold_across_processes() -> None:
    """ReadTokens(2) shared by four processes: never more than two inside `held` at once, and every
    token back in the pipe at the end."""
    import multiprocessing as mp
    from sandbox.criu.fill_procs import ReadTokens, held
    tokens = ReadTokens(2)
    r, w = tokens.fds()
    inside = mp.Value("i", 0)
    most = mp.Value("i", 0)

    def worker() -> None:
        for _ in range(20):
            with held(r, w):
                with inside.get_lock():
                    inside.value += 1
                    most.value = max(most.value, inside.value)
                time.sleep(0.002)
                with inside.get_lock():
                    inside.value -= 1

    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=worker) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    try:
        assert most.value == 2, most.value
        os.set_blocking(r, False)
        assert os.read(r, 16) == b"tt", "both tokens back"
    finally:
        tokens.close()


def test_a_fill_job_names_its_read_tokens_as_two_pipes_or_is_refused(tmp_path: Path) -> None:
    """A worker takes a job's "tokens" only as two different descriptors past stdio that are pipes."""
    from sandbox.criu.fill_procs import ReadTokens, _token_pipe
    tokens = ReadTokens(1)
    r, w = tokens.fds()
    f = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        assert _token_pipe([r, w])
        for bad in ([r, r], [r], [0, w], [r, f], [r, 9999], "3,4", [r, float(w)], [r, True]):
            assert not _token_pipe(bad), bad
    finally:
        os.close(f)
        tokens.close()
