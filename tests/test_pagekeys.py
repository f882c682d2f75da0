"""Page keys (FORMAT.md, "Page keys"): a page-cut stream records a content-chosen sample of its pages'
keys; a later put with that snapshot as its parent finds a changed chunk's pages wherever they lay
(any distance, any stream), where the nearby search cannot; a record of any other form makes the
manifest damage (exit 3). Real files on the real disk, the real CLI."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import Cli
from storage.codecs import pagekeys
from support.crafted import rewrite_manifest
from support.model_bytes import BLOCK, kv_pool as _kv_pool, weights

PAGE = 4096


def test_a_page_is_sampled_by_its_content_wherever_it_lies() -> None:
    rng = np.random.default_rng(5)
    data = weights(rng, 8 << 20)
    at, kept = pagekeys.sampled(data)
    assert 2048 // 64 < len(at) < 2048 // 16  # about one page in 32
    moved = bytes(3 * PAGE) + data  # the same pages three pages later
    at2, kept2 = pagekeys.sampled(moved)
    assert at2.tolist() == (at + 3).tolist() and kept2.tolist() == kept.tolist()
    assert len(pagekeys.sampled(bytes(1 << 20))[0]) == 0  # zero pages are never sampled


def test_a_put_records_what_check_accepts_and_the_index_finds_a_page() -> None:
    rng = np.random.default_rng(6)
    data = weights(rng, 4 << 20)
    c = pagekeys.Collector()
    c.add("img", 2 << 20, memoryview(data)[2 << 20:])  # workers add chunks in any order
    c.add("img", 0, memoryview(data)[:2 << 20])
    rec = c.record("img")
    assert pagekeys.check(rec, len(data)) == ""
    at, _ = pagekeys.load(rec, len(data))
    assert at.tolist() == pagekeys.sampled(data)[0].tolist()


def test_page_index_votes_for_where_a_moved_region_lay() -> None:
    rng = np.random.default_rng(7)
    a, b = weights(rng, 4 << 20), weights(rng, 4 << 20)
    rec = pagekeys.Collector()
    rec.add("p1", 0, memoryview(a))
    rec2 = pagekeys.Collector()
    rec2.add("p2", 0, memoryview(b))
    index = pagekeys.PageIndex([("p1", rec.record("p1"), len(a)), ("p2", rec2.record("p2"), len(b))])
    # b's second MiB, now at offset 100 MiB of a new stream: its place is p2, shift 1 MiB - 100 MiB
    piece = memoryview(b)[1 << 20:2 << 20]
    assert index.places(piece, 100 << 20)[0] == ("p2", (1 << 20) - (100 << 20))
    assert index.places(memoryview(weights(rng, 1 << 20)), 0) == []  # pages the parent never had


@pytest.mark.parametrize("bad", [
    {"key": "strided8", "every": 32, "at": "AAAAAA==", "keys": ""},                      # lengths differ
    {"every": 32, "at": "", "keys": ""},                                                 # no key name
    {"key": "strided8", "every": 32, "at": "not base64!", "keys": ""},
    {"key": "strided8", "every": 32, "at": base64.b64encode(np.array([5, 3], "<u4").tobytes()).decode(),
     "keys": base64.b64encode(np.array([1, 2], "<u4").tobytes()).decode()},             # out of order
    {"key": "strided8", "every": 32, "at": base64.b64encode(np.array([3, 3], "<u4").tobytes()).decode(),
     "keys": base64.b64encode(np.array([1, 2], "<u4").tobytes()).decode()},             # a page twice
    {"key": "strided8", "every": 32, "at": "AAAA", "keys": "AAAA"},                      # not whole uint32s
    {"key": "strided8", "every": 32, "at": base64.b64encode(np.array([1 << 30], "<u4").tobytes()).decode(),
     "keys": "AAAAAA=="},                                                                # beyond the stream
    {"key": "strided8", "every": 32, "at": "", "keys": "", "extra": 1},
    "strided8",
])
def test_a_manifest_with_page_keys_of_another_form_is_damage(cli: Cli, store_dir: Path, tmp_path: Path,
                                                            bad: object) -> None:
    src = tmp_path / "img"
    src.mkdir()
    (src / "pages-1.img").write_bytes(weights(np.random.default_rng(8), 1 << 20))
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    good = cli.run("store", "get", "a", str(tmp_path / "ok"))
    assert good.returncode == 0

    def change(body: dict) -> None:
        s = next(s for s in body["streams"] if s["name"].endswith("pages-1.img"))
        assert "pagekeys" in s["attrs"]  # what the put recorded
        s["attrs"]["pagekeys"] = bad
    rewrite_manifest(store_dir / "snapshots" / "a.json", change)
    p = cli.run("store", "get", "a", str(tmp_path / "out"), check=False)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "page keys" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "out").exists()


def test_a_kv_pool_laid_out_again_far_from_where_it_was_is_stored_as_deltas(cli: Cli, store_dir: Path,
                                                                           tmp_path: Path) -> None:
    """A restored process's memory laid out again: the KV pool (every chunk changed: 5% more of its
    blocks filled) comes back in 2 MiB pieces in another order, most of them further than the nearby
    search reaches (16 MiB), after the weights it followed. No unchanged chunk says where a piece went
    and the chunks' lengths are not the parent's; only the parent's page keys name the places. The
    second put stores about the changed bytes, as deltas (0.97x when this test was written); with the
    lookup off (GPUSNAP_PAGE_LOOKUP=0) the same put stored 4.0x."""
    rng = np.random.default_rng(31)
    w = weights(rng, 8 << 20)
    pool = _kv_pool(rng, 96 << 20, 0.30)
    a = w + bytes(pool)
    empty = [b for b in range(len(pool) // BLOCK) if not any(pool[b * BLOCK:b * BLOCK + 64])]
    changed = 0
    for blk in rng.choice(empty, (len(pool) // BLOCK) // 20, replace=False):
        pool[blk * BLOCK:(blk + 1) * BLOCK] = weights(rng, BLOCK)
        changed += BLOCK
    piece = 2 << 20
    order = rng.permutation(len(pool) // piece)
    b = w + b"".join(bytes(pool[i * piece:(i + 1) * piece]) for i in order)
    src = tmp_path / "img"
    src.mkdir()
    (src / "pages-1.img").write_bytes(a)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    (src / "pages-1.img").write_bytes(b)
    rep = cli.json("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a")
    assert rep["stages"]["delta-lookup"]["bytes"] > 0, rep["stages"]
    assert rep["new_bytes"] <= 1.3 * changed, (rep["new_bytes"], changed, rep["stages"])
    other = Cli(tmp_path / "other")  # the same two puts with the lookup off, in a store of their own
    (src / "pages-1.img").write_bytes(a)
    other.run("store", "put", "a", str(src), "--chunker", "pages")
    (src / "pages-1.img").write_bytes(b)
    off = json.loads(other.run("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a",
                               "--json", env={"GPUSNAP_PAGE_LOOKUP": "0"}).stdout)
    assert "delta-lookup" not in off["stages"] and off["new_bytes"] > 2 * changed, off["new_bytes"]
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == b


def _one_block_after_a_forged_parent(cli: Cli, store_dir: Path, tmp_path: Path, seed: int, records: Any) -> dict:
    """Snapshot a (weights, page-cut), its page keys records replaced by RECORDS(old) (None: removed),
    then b, the same bytes with one 64 KiB block rewritten, put with a as its parent: b's report. a
    still reads back whole, and the store verifies."""
    rng = np.random.default_rng(seed)
    a = weights(rng, 16 << 20)
    src = tmp_path / "img"
    src.mkdir()
    (src / "pages-1.img").write_bytes(a)
    cli.run("store", "put", "a", str(src), "--chunker", "pages")

    def change(body: dict) -> None:
        for s in body["streams"]:
            if "pagekeys" in s["attrs"]:
                new = records(s["attrs"]["pagekeys"])
                if new is None:
                    del s["attrs"]["pagekeys"]
                else:
                    s["attrs"]["pagekeys"] = new
    rewrite_manifest(store_dir / "snapshots" / "a.json", change)
    cli.run("store", "get", "a", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == a
    b = bytearray(a)
    b[5 << 20:(5 << 20) + BLOCK] = weights(rng, BLOCK)
    (src / "pages-1.img").write_bytes(bytes(b))
    rep: dict = cli.json("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a")
    assert cli.json("store", "verify", "--read-data")["ok"]
    return rep


def test_a_parent_without_page_keys_still_gives_deltas(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """A parent written before page keys existed (its records removed here): the nearby search alone."""
    rep = _one_block_after_a_forged_parent(cli, store_dir, tmp_path, 32, lambda old: None)
    assert "delta-lookup" not in rep["stages"]
    assert rep["new_bytes"] <= 2 * BLOCK, rep["new_bytes"]


def test_the_key_is_the_one_format_md_writes() -> None:
    """FORMAT.md's key, computed by hand for pages of random words: another implementation reading
    the record must get the same keys."""
    import struct
    rng = np.random.default_rng(1)
    for _ in range(4):
        page = rng.integers(0, 2**63, PAGE // 8, dtype=np.uint64).tobytes()
        w = struct.unpack("<512Q", page)
        want = sum(w[64 * j] * (((2 * j + 1) * 0x9E3779B97F4A7C15) % 2**64) for j in range(8)) % 2**64
        assert int(pagekeys.keys(page)[0]) == want
        sampled = 0 < want < 2**59
        at, kept = pagekeys.sampled(page)
        assert at.tolist() == ([0] if sampled else [])
        assert kept.tolist() == ([(want >> 27) & 0xFFFFFFFF] if sampled else [])


@pytest.mark.parametrize("other", [{"key": "strided8", "every": 16, "at": "x", "keys": ""},
                                   {"key": "strided8", "every": 32.0, "at": "", "keys": ""},
                                   {"key": "sha256-16", "every": 8, "pages": []}])
def test_page_keys_of_another_kind_are_kept_and_ignored(cli: Cli, store_dir: Path, tmp_path: Path,
                                                       other: dict) -> None:
    """A later writer's record (another key or sampling): a hint this reader does not compute, so it is
    neither damage (the snapshot reads back) nor used (a put with it as parent has no lookup)."""
    rep = _one_block_after_a_forged_parent(cli, store_dir, tmp_path, 9, lambda old: other)
    assert "delta-lookup" not in rep["stages"] and rep["new_bytes"] <= 2 * BLOCK, rep


def test_page_keys_on_a_stream_of_zero_chunks_name_no_place(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """A forged parent whose all-zero stream carries the keys of another stream's pages: no candidate
    can be cut from a stream of zero chunks, so its record is not indexed; the put with that parent
    succeeds and stores the right bytes (it crashed with a KeyError before the index took only the
    streams a delta can be cut from)."""
    rng = np.random.default_rng(10)
    new = weights(rng, 4 << 20)
    src = tmp_path / "img"
    src.mkdir()
    (src / "pages-1.img").write_bytes(weights(rng, 4 << 20))
    (src / "zero.img").write_bytes(bytes(4 << 20))
    cli.run("store", "put", "a", str(src), "--chunker", "pages")
    c = pagekeys.Collector()
    c.add("x", 0, memoryview(new))
    forged = c.record("x")

    def change(body: dict) -> None:
        z = next(s for s in body["streams"] if s["name"].endswith("zero.img"))
        assert all(ch[2] == "zero" for ch in z["chunks"])
        z["attrs"]["pagekeys"] = forged
    rewrite_manifest(store_dir / "snapshots" / "a.json", change)
    (src / "pages-1.img").write_bytes(new)
    p = cli.run("store", "put", "b", str(src), "--chunker", "pages", "--no-cache", "--parent", "a", check=False)
    assert p.returncode == 0, p.stderr
    cli.run("store", "get", "b", str(tmp_path / "out"))
    assert (tmp_path / "out" / "img" / "pages-1.img").read_bytes() == new


def _all_sampled(n_pages: int) -> bytes:
    """N_PAGES distinct pages, each crafted so that it is sampled (the key is linear in the words keyed:
    the first word is solved for a key with its top bits clear), as a hostile tenant could write."""
    rng = np.random.default_rng(12)
    words = rng.integers(0, 2**63, (n_pages, PAGE // 8), dtype=np.uint64)
    m = [((2 * j + 1) * 0x9E3779B97F4A7C15) % 2**64 for j in range(8)]
    inv0 = pow(m[0], -1, 2**64)
    for i in range(n_pages):
        rest = sum(int(words[i, 64 * j]) * m[j] for j in range(1, 8)) % 2**64
        target = (i + 1) << 20  # distinct, non-zero, below 2**59
        words[i, 0] = ((target - rest) * inv0) % 2**64
    return words.tobytes()


def test_a_stream_crafted_so_every_page_is_sampled_keeps_a_bounded_record() -> None:
    data = _all_sampled(4096)  # 16 MiB
    assert len(pagekeys.sampled(data)[0]) == 4096
    c = pagekeys.Collector()
    for off in range(0, len(data), 4 << 20):
        c.add("s", off, memoryview(data)[off:off + (4 << 20)])
    at, _ = pagekeys.load(c.record("s"), len(data))
    assert len(at) <= 2 * 4096 // pagekeys.EVERY + 16, len(at)
    assert at[0] == 0 and at[-1] == 4095  # spread over the whole stream
    same = np.frombuffer(data[:PAGE] * 1024, dtype=np.uint8)  # one sampled page repeated: one entry per chunk
    c2 = pagekeys.Collector()
    c2.add("r", 0, same.data)
    assert len(pagekeys.load(c2.record("r"), len(same))[0]) == 1


def _many_streams(st: Any, name: str, n: int, attrs: dict) -> None:
    """Commit snapshot NAME of N one-chunk blob streams with ATTRS (the library's writer)."""
    from storage.fs.directio import AlignedBuffer
    from storage.format.manifest import Stream
    buf = AlignedBuffer(8192 + 4096)
    try:
        buf.view[4096:4096 + 5000] = bytes(range(256)) * 19 + bytes(136)
        with st.writer(name) as w:
            for i in range(n):
                s = Stream(f"f{i}", {"type": "blob", **attrs})
                s.chunks.append(w.put_chunk("raw", 5000, buf.view, 5000))
                w.add_stream(s)
            w.commit()
    finally:
        buf.close()


def test_a_manifest_larger_than_any_reader_loads_is_never_written(store_dir: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer refuses what no reader would load (MAX_MANIFEST), one line, nothing visible; page keys,
    hints only, give way first; a retag that would grow a manifest past the limit leaves it as it was."""
    import storage.base.limits as limits
    from storage.format.manifest import ManifestTooLarge
    from storage.repo.store import SnapshotStore
    from storage.repo.tagging import retag
    st = SnapshotStore(str(store_dir))
    _many_streams(st, "small", 3, {})
    before = (store_dir / "snapshots" / "small.json").read_bytes()
    monkeypatch.setattr(limits, "MAX_MANIFEST", 4096)
    with pytest.raises(ManifestTooLarge, match="more than any manifest may be"):
        _many_streams(st, "big", 200, {})
    assert not (store_dir / "snapshots" / "big.json").exists()
    # the same streams' chunk lists fit; their page keys do not: committed without them
    c = pagekeys.Collector()
    c.add("x", 0, memoryview(_all_sampled(1)))
    monkeypatch.setattr(limits, "MAX_MANIFEST", len(before) + 30)  # "hinted" is one byte longer than "small"
    _many_streams(st, "hinted", 3, {"pagekeys": c.record("x")})
    m = st.load("hinted")
    assert all("pagekeys" not in s.attrs for s in m.streams)
    monkeypatch.setattr(limits, "MAX_MANIFEST", len(before) + 8)
    with pytest.raises(ManifestTooLarge, match="nothing was retagged"):
        retag(st, "small", add=["a-long-tag-that-does-not-fit"])
    assert (store_dir / "snapshots" / "small.json").read_bytes() == before
