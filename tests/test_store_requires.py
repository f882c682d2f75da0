"""The store marker's `requires` (FORMAT.md, "The marker's `requires`"): codecs are registry entries,
not store versions; a gpusnap refuses exactly the stores naming a codec or feature it lacks; stores
written by version 7 migrate to it and read back bit for bit."""
from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tarfile
from pathlib import Path
from typing import Iterator

import pytest

from conftest import Cli
from storage.archive.filetree import FileTreeSink, FileTreeSource
from storage.codecs import registry as C
from storage.pipeline import put as pipeline
from storage.repo.store import WRITE_VERSION, SnapshotStore

DATA = Path(__file__).resolve().parent / "data"
TOY_ID = 200  # no id the format assigned (FORMAT.md, "Codec ids")


class ToyConst:
    """A toy codec: a chunk that is one non-zero byte repeated is stored as that byte (1-byte payload)."""

    name = "toy-const"
    width = 1
    probe_above: float | None = None

    @staticmethod
    def _const(data: memoryview) -> int | None:
        b = bytes(data[:1])
        return b[0] if b and b[0] and bytes(data) == b * len(data) else None

    def probe(self, data: memoryview) -> tuple[tuple[bool, ...], int]:
        return ((True,), 1) if self._const(data) is not None else ((False,), len(data))

    def encode_into(self, data: memoryview, dst: memoryview, which: tuple[bool, ...]) -> int | None:
        c = self._const(data)
        if c is None or not len(dst):
            return None
        dst[0] = c
        return 1

    def encode(self, data: memoryview) -> bytes:
        c = self._const(data)
        if c is None:
            raise C.CodecError("toy-const: not one repeated byte")
        return bytes([c])

    @staticmethod
    def decode(payload: memoryview, raw_len: int, out: memoryview | None = None) -> bytes | memoryview:
        if len(payload) != 1 or raw_len < 1:
            raise C.CodecError("toy-const payload is one byte")
        whole = bytes(payload) * raw_len
        if out is None:
            return whole
        out[:raw_len] = whole
        return out[:raw_len]


@pytest.fixture
def toy() -> Iterator[ToyConst]:
    codec = ToyConst()
    C.register(C.CodecEntry(TOY_ID, codec.name, "host", codec.encode, codec.decode, choosable=codec))
    try:
        yield codec
    finally:
        C.unregister(codec.name)


def _marker(store: Path) -> dict:
    return json.loads((store / "gpusnap-store.json").read_text())


def _entry_codecs(store: Path) -> set[int]:
    """The codec id of every entry in the store's packs (read from their headers)."""
    got = set()
    for p in (store / "packs").iterdir():
        b, off = p.read_bytes(), 0
        while off < len(b):
            _, cid, _, stored = struct.unpack_from("<8sH6xQQ", b, off)
            got.add(cid)
            off += 4096 + -(-stored // 4096) * 4096
    return got


def test_a_toy_codec_added_through_the_registry_round_trips_without_a_version_change(
        toy: ToyConst, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_ENCODE_PROCS", "0")  # encoder processes have only the format's codecs
    src = tmp_path / "src"
    src.mkdir()
    (src / "log.txt").write_bytes(b"".join(b"line %d ok\n" % (i % 97) for i in range(60000)))
    store = tmp_path / "store"
    st = SnapshotStore(str(store), create=True)
    with st.writer("before") as w:
        pipeline.put(w, FileTreeSource([str(src)]), workers=2)
        w.commit()
    before = _marker(store)
    assert before["version"] == WRITE_VERSION == 8 and "codec:toy-const" not in before["requires"], before
    (src / "ones.bin").write_bytes(b"\x41" * (3 << 20))  # what the toy codec takes
    with st.writer("after") as w:
        pipeline.put(w, FileTreeSource([str(src)]), workers=2)
        w.commit()
    after = _marker(store)
    assert after["version"] == before["version"], after  # no bump: the codec joined `requires`
    assert set(after["requires"]) == set(before["requires"]) | {"codec:toy-const"}, after
    assert after["created"] == before["created"]
    refs = [c for s in st.load("after").streams for c in s.chunks]
    assert {c.codec for c in refs if c.raw_len} >= {"toy-const"}, refs
    assert TOY_ID in _entry_codecs(store)
    # read back in this process (the codec registered), every chunk verified
    fresh = SnapshotStore(str(store), create=False)
    pipeline.get(fresh, fresh.load("after"), FileTreeSink(str(tmp_path / "out")))
    for f in ("log.txt", "ones.bin"):
        assert (tmp_path / "out" / "src" / f).read_bytes() == (src / f).read_bytes()
    # a gpusnap without the codec (the CLI, a process of its own) refuses this store in one line,
    # and still opens a store that does not name it
    r = Cli(store).run("store", "ls", check=False)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "requires codec:toy-const" in r.stderr and "does not know" in r.stderr, r.stderr
    other = tmp_path / "other"
    o = SnapshotStore(str(other), create=True)
    with o.writer("plain") as w:
        pipeline.put(w, FileTreeSource([str(src / "log.txt")]), workers=2)
        w.commit()
    assert [s["name"] for s in Cli(other).json("store", "ls")] == ["plain"]


REFUSED = [
    (["codec:zstd", "codec:lzma-2030"], "requires codec:lzma-2030, which this gpusnap does not know"),
    (["feature:encrypted-packs"], "requires feature:encrypted-packs, which this gpusnap does not know"),
    ("codec:zstd", "unreadable store marker: requires is str, not a list"),
    (["codec:zstd", "codec:zstd"], "unreadable store marker: requires names an entry twice"),
    (["zstd"], "unreadable store marker: requires entry 'zstd' is not codec:NAME or feature:NAME"),
]


def test_a_store_whose_requires_this_gpusnap_lacks_is_refused_in_one_line(
        cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "f"
    src.write_bytes(b"hello " * 1000)
    cli.run("store", "put", "s", str(src))
    info = _marker(store_dir)
    assert info["version"] == 8
    (store_dir / "gpusnap-store.json").write_text(json.dumps({**info, "version": 9}))
    future = cli.run("store", "ls", check=False)  # the exit code of every other format refusal
    assert future.returncode != 0 and "v9 is not gpusnap-store v8 or older" in future.stderr
    for requires, says in REFUSED:
        (store_dir / "gpusnap-store.json").write_text(json.dumps({**info, "requires": requires}))
        for args in (("store", "ls"), ("store", "get", "s", str(tmp_path / "out"))):
            r = cli.run(*args, check=False)
            assert r.returncode == future.returncode, (args, r.returncode, r.stderr)
            assert says in r.stderr and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not (tmp_path / "out").exists()
        assert _marker(store_dir)["requires"] == requires  # nothing changed
    r = cli.run("store", "put", "t", str(src), check=False)  # a writer refuses it too, writing nothing
    assert r.returncode == future.returncode and REFUSED[-1][1] in r.stderr, r.stderr
    assert not (store_dir / "snapshots" / "t.json").exists()
    (store_dir / "gpusnap-store.json").write_text(json.dumps(info))
    cli.run("store", "get", "s", str(tmp_path / "out"))
    assert (tmp_path / "out" / "f").read_bytes() == src.read_bytes()


def _digests(out: Path, names: tuple[str, ...]) -> set[str]:
    return {f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {n}/model/{p.name}"
            for n in names for p in sorted((out / n / "model").iterdir())}


def _packs(store: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for d in ("packs", "index") for p in sorted((store / d).iterdir())}


def test_a_version_7_store_opens_migrates_and_reads_back_bit_for_bit(tmp_path: Path) -> None:
    """tests/data/store-v7.tar.gz was written by store version 7 (commit b864b72, make_store_v7.py)."""
    with tarfile.open(DATA / "store-v7.tar.gz") as t:
        t.extractall(tmp_path)  # our own fixture (tests/data/README.md)
    store = tmp_path / "store-v7"
    for d in ("tmp", "names", "chunks"):
        (store / d).mkdir(exist_ok=True)
    old = _marker(store)
    assert old["version"] == 7 and old["deltas"] is True and "requires" not in old, old
    want = set((DATA / "store-v7.sha256").read_text().splitlines())
    cli = Cli(store)
    names = ("first", "second")
    packs = _packs(store)

    def read_back(tag: str) -> None:
        (tmp_path / tag).mkdir()
        for n in names:
            cli.run("store", "get", n, str(tmp_path / tag / n))
        assert _digests(tmp_path / tag, names) == want
        assert cli.json("store", "verify", "--read-data")["ok"]

    assert [s["name"] for s in cli.json("store", "ls")] == list(names)
    read_back("as-7")
    assert _marker(store) == old  # reading changes nothing
    rep = cli.json("store", "migrate")
    assert rep["moved"] == 0 and not rep["left"], rep
    new = _marker(store)
    # requires computed from the entries it holds (every codec version 7 wrote, deltas included)
    assert new == {"format": "gpusnap-store", "version": 8, "created": old["created"],
                   "requires": ["codec:raw", "codec:shuffle2-zstd", "codec:shuffle4-zstd", "codec:xor-zstd",
                                "codec:zstd"]}, new
    assert {"codec:" + C.CODEC_NAMES[i] for i in _entry_codecs(store)} == set(new["requires"])
    assert _packs(store) == packs  # no entry rewritten
    read_back("as-8")
    assert SnapshotStore(str(store), create=False).may_hold_deltas()
    # a write after the migration keeps the version and adds nothing it does not use
    extra = tmp_path / "extra"
    extra.write_bytes(b"x" * 100000)
    cli.run("store", "put", "third", str(extra))
    assert _marker(store) == new
    shutil.rmtree(tmp_path / "as-7")


def test_the_first_write_migrates_a_version_7_store_too(tmp_path: Path) -> None:
    """No `store migrate` needed: a put to a version 7 store makes it version 8 before its first pack
    entry, requires holding what was there and what the put added."""
    with tarfile.open(DATA / "store-v7.tar.gz") as t:
        t.extractall(tmp_path)  # our own fixture (tests/data/README.md)
    store = tmp_path / "store-v7"
    for d in ("tmp", "names", "chunks"):
        (store / d).mkdir(exist_ok=True)
    # as if the store held no delta: the marker's word (deltas) and the entries both count
    cli = Cli(store)
    cli.run("store", "rm", "second")
    cli.run("store", "put", "text", str(DATA / "README.md"))
    info = _marker(store)
    assert info["version"] == 8 and "deltas" not in info
    assert {"codec:xor-zstd", "codec:zstd", "codec:shuffle4-zstd"} <= set(info["requires"]), info
    (tmp_path / "o").mkdir()
    cli.run("store", "get", "first", str(tmp_path / "o" / "first"))
    assert _digests(tmp_path / "o", ("first",)) == {
        line for line in (DATA / "store-v7.sha256").read_text().splitlines() if "  first/" in line}
