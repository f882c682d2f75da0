"""The store's promises under damage and failure: corruption named by verify and refused by get,
a full disk, kill -9 mid-put, concurrent writers, gc against a commit in progress."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import GPUSNAP, REPO, Cli, chunk_files, make_mixed_tree, pythonpath, small_tmpfs
from support.entries import chunk_entries, chunk_ids


@pytest.fixture
def stored(cli: Cli, tmp_path: Path) -> tuple[Cli, Path]:
    src = make_mixed_tree(tmp_path / "model", mb=12)
    cli.run("store", "put", "good", str(src))
    return cli, src


def _damage_and_check(cli: Cli, tmp_path: Path, expect: str) -> None:
    v = cli.run("store", "verify", "--json", check=False)
    assert v.returncode == 3, v.stderr
    import json
    rep = json.loads(v.stdout)
    assert not rep["ok"] and any(expect in p for p in rep["problems"]), rep["problems"]
    assert all(p.startswith("good") for p in rep["problems"])
    dest = tmp_path / "restored"
    g = cli.run("store", "get", "good", str(dest), check=False)
    assert g.returncode == 3 and expect in g.stderr and len(g.stderr.splitlines()) == 1, g.stderr
    assert not dest.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".restored")]  # no partial temp tree


def test_flipped_byte_in_chunk(stored: tuple[Cli, Path], store_dir: Path, tmp_path: Path) -> None:
    cli, _ = stored
    victim = max(chunk_entries(store_dir), key=lambda e: e.length)
    victim.flip_payload(1 / 3)
    _damage_and_check(cli, tmp_path, "corrupted")


def test_truncated_chunk(stored: tuple[Cli, Path], store_dir: Path, tmp_path: Path) -> None:
    cli, _ = stored
    victim = max(chunk_entries(store_dir), key=lambda e: e.offset)  # the last entry of its pack
    victim.truncate()
    _damage_and_check(cli, tmp_path, "truncated")


def test_missing_chunk(stored: tuple[Cli, Path], store_dir: Path, tmp_path: Path) -> None:
    cli, _ = stored
    chunk_entries(store_dir)[-1].remove()
    _damage_and_check(cli, tmp_path, "missing")


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_damaged_manifest(stored: tuple[Cli, Path], store_dir: Path, tmp_path: Path, how: str) -> None:
    cli, _ = stored
    m = store_dir / "snapshots" / "good.json"
    data = bytearray(m.read_bytes())
    if how == "flip":
        i = data.index(b'"size": ') + 8  # first digit of the first size
        data[i] = ord("7") if data[i] != ord("7") else ord("8")
        m.write_bytes(bytes(data))
        expect = "checksum"
    else:
        m.write_bytes(bytes(data[: len(data) // 2]))
        expect = "does not parse"
    _damage_and_check(cli, tmp_path, expect)
    # gc does not stop for a damaged snapshot: it keeps every chunk its manifest still mentions, says
    # so (exit 3) and goes on with the rest of the store
    before = {p.name for p in chunk_files(store_dir)}
    mentioned = {cid for cid in before if cid.encode() in m.read_bytes()}
    g = cli.run("store", "gc", "--json", check=False)
    assert g.returncode == 3 and any("went on" in d for d in json.loads(g.stdout)["damage"]), g.stdout
    after = {p.name for p in chunk_files(store_dir)}
    assert mentioned <= after and (how == "truncate" or after == before)


def test_disk_full_mid_put(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "24m") as mnt:
        cli = Cli(mnt / "store")
        keep = tmp_path / "keep"
        keep.write_bytes(np.random.default_rng(1).bytes(4 << 20))
        cli.run("store", "put", "keep", str(keep))
        kept = chunk_files(mnt / "store")
        big = tmp_path / "big"
        big.write_bytes(np.random.default_rng(2).bytes(40 << 20))
        p = cli.run("store", "put", "big", str(big), check=False)
        assert p.returncode == 1 and "no space left" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
        assert [r["name"] for r in cli.json("store", "ls")] == ["keep"]
        assert cli.json("store", "verify")["ok"]
        assert chunk_files(mnt / "store") == kept, "the failed writer removed the pack it was writing"
        assert not list((mnt / "store" / "tmp").iterdir())
        gc = cli.json("store", "gc")
        assert gc["chunks_removed"] == 0 and gc["packs_removed"] == 0
        cli.run("store", "get", "keep", str(tmp_path / "o"))
        assert (tmp_path / "o" / "keep").read_bytes() == keep.read_bytes()
        assert cli.json("store", "verify")["ok"]


def test_kill_9_mid_put_leaves_no_snapshot(cli: Cli, tmp_path: Path, store_dir: Path) -> None:
    rng = np.random.default_rng(5)
    block = bytearray(rng.bytes(4 << 20))
    cli.run("store", "init")
    rnd = random.Random(os.getpid())
    killed_before_commit = 0
    for attempt in range(3):
        big = tmp_path / f"big{attempt}"
        with open(big, "wb") as f:  # 48 distinct 4 MiB chunks, none shared with other attempts
            for i in range(48):
                block[:8] = (attempt * 1000 + i).to_bytes(8, "little")
                f.write(block)
        have = sum(p.stat().st_size for p in chunk_files(store_dir))
        kill_at = have + rnd.randint(1, 40) * (4 << 20)  # bytes of packs written, the open one included
        env = dict(os.environ, PYTHONPATH=pythonpath())
        p = subprocess.Popen([*GPUSNAP, "--store", str(store_dir), "store", "put", f"k{attempt}", str(big)],
                             env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline and \
                sum(p.stat().st_size for p in chunk_files(store_dir) if p.exists()) < kill_at:
            pass
        p.send_signal(signal.SIGKILL)
        p.wait()
        names = [r["name"] for r in cli.json("store", "ls")]
        if f"k{attempt}" not in names:
            killed_before_commit += 1
        else:  # it finished first: then it must be whole
            cli.run("store", "verify", f"k{attempt}")
    assert killed_before_commit >= 1, "the put always finished before the kill"
    assert cli.json("store", "verify")["ok"]
    leftovers = len(list((store_dir / "tmp").iterdir())) + len(chunk_files(store_dir))
    gc = cli.json("store", "gc")
    assert gc["chunks_removed"] + gc["packs_removed"] + gc["tmp_removed"] > 0 and leftovers > 0
    assert not list((store_dir / "tmp").iterdir())
    assert cli.json("store", "verify")["ok"]


def test_two_puts_of_the_same_name_one_wins(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "d"
    src.mkdir()
    (src / "r").write_bytes(np.random.default_rng(9).bytes(64 << 20))
    cli.run("store", "init")
    env = dict(os.environ, PYTHONPATH=pythonpath())
    procs = [subprocess.Popen([*GPUSNAP, "--store", str(cli.store), "store", "put", "same", str(src)], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 1], outs
    err = next(o[1] for p, o in zip(procs, outs) if p.returncode == 1)
    assert "being written by another process" in err or "already exists" in err or "created by another" in err
    assert cli.json("store", "verify")["ok"]
    cli.run("store", "get", "same", str(tmp_path / "o"))
    assert (tmp_path / "o" / "d" / "r").read_bytes() == (src / "r").read_bytes()


def test_gc_waits_for_a_commit_in_progress(cli: Cli, tmp_path: Path, store_dir: Path) -> None:
    """A put holds the store lock shared: gc (exclusive) cannot delete its not-yet-referenced chunks."""
    from storage.repo.store import SnapshotStore
    from storage.fs.directio import AlignedBuffer
    st = SnapshotStore(str(store_dir))
    buf = AlignedBuffer(8192)
    buf.view[4096:4196] = b"x" * 100
    with st.writer("inflight") as w:
        ref = w.put_chunk("raw", 100, buf.view, 100)
        p = cli.run("store", "gc", "--wait", "0.5", check=False)
        assert p.returncode == 1 and "busy" in p.stderr
        assert chunk_files(store_dir), "the chunk's pack is still being written"
        from storage.format.manifest import Stream
        w.add_stream(Stream("blob", {"type": "blob"}, [ref]))
        w.commit()
    assert cli.json("store", "gc")["chunks_removed"] == 0
    assert cli.json("store", "verify", "inflight")["ok"]
    buf.close()
