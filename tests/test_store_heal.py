"""The store heals itself and owns what it deletes: damaged chunks are never reused and are rewritten
by the next put or by repair; gc removes only what gpusnap made (dead owners, killed gets, stale locks)
and never follows a link; stray entries are reported, not fatal. Real files on the real disk, the
real CLI."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, Cli, chunk_files, make_mixed_tree, pythonpath, tree_digest
from support.entries import Entry, chunk_entries

HEX = "0123456789abcdef"


@pytest.fixture
def stored(cli: Cli, tmp_path: Path) -> tuple[Cli, Path]:
    src = make_mixed_tree(tmp_path / "model", mb=12)
    cli.run("store", "put", "good", str(src))
    return cli, src


def _flip(victim: Entry) -> None:
    victim.flip_payload(1 / 3)


def _biggest(store_dir: Path) -> Entry:
    return max(chunk_entries(store_dir), key=lambda e: e.length)


def _record(store_dir: Path, cid: str) -> dict:
    return json.loads((store_dir / "quarantine" / f"{cid}.json").read_text())


# ---- self-healing -----------------------------------------------------------------------------------

def test_flipped_chunk_quarantined_then_the_next_put_heals_every_snapshot(stored: tuple[Cli, Path],
                                                                           store_dir: Path, tmp_path: Path) -> None:
    cli, src = stored
    cli.run("store", "put", "twin", str(src))  # a second snapshot naming the same chunks
    victim = _biggest(store_dir)
    _flip(victim)
    v = cli.run("store", "verify", "--json", check=False)
    assert v.returncode == 3
    rep = json.loads(v.stdout)
    assert rep["quarantined"] == [victim.cid]
    assert {p.split(":")[0] for p in rep["problems"]} == {"good", "twin"}
    assert _record(store_dir, victim.cid)["entries"] == [[victim.path.name, victim.offset]]  # set aside in its pack
    g = cli.run("store", "get", "good", str(tmp_path / "no"), check=False)
    assert g.returncode == 3 and "corrupted" in g.stderr and "quarantine" in g.stderr, g.stderr
    put = json.loads(cli.run("store", "put", "again", str(src), "--json").stdout)
    assert put["chunks_new"] == 1 and put["new_bytes"] > 0, put
    assert [e.path for e in chunk_entries(store_dir) if e.cid == victim.cid] != [victim.path]  # a new copy
    assert cli.json("store", "verify")["ok"]
    for name in ("good", "twin", "again"):
        cli.run("store", "get", name, str(tmp_path / f"out-{name}"))
        assert tree_digest(tmp_path / f"out-{name}" / "model") == tree_digest(src)
    gc = cli.json("store", "gc")
    assert gc["quarantine_removed"] == 1 and not list((store_dir / "quarantine").iterdir())
    assert gc["packs_repacked"] == 1 and [e for e in chunk_entries(store_dir) if e.cid == victim.cid] != []
    assert len([e for e in chunk_entries(store_dir) if e.cid == victim.cid]) == 1  # the damaged entry went
    assert cli.json("store", "verify", "--read-data")["ok"]


def test_put_never_dedups_against_a_chunk_whose_header_or_length_is_wrong(stored: tuple[Cli, Path],
                                                                          store_dir: Path, tmp_path: Path) -> None:
    """No verify in between: the put itself sees the truncated chunk and writes it again."""
    cli, src = stored
    victim = max(chunk_entries(store_dir), key=lambda e: e.offset)  # the last entry of its pack
    victim.truncate()
    put = json.loads(cli.run("store", "put", "again", str(src), "--json").stdout)
    assert put["chunks_new"] == 1 and put["new_bytes"] > 0, put
    assert cli.json("store", "verify")["ok"]  # the new copy serves
    copy = next(e for e in chunk_entries(store_dir) if e.cid == victim.cid and e.path != victim.path)
    copy.flip(0)  # bad magic: neither copy may be reused now
    put = json.loads(cli.run("store", "put", "third", str(src), "--json").stdout)
    assert put["chunks_new"] == 1, put
    assert cli.json("store", "verify")["ok"]


def test_repair_from_the_source_files(stored: tuple[Cli, Path], store_dir: Path, tmp_path: Path) -> None:
    cli, src = stored
    victims = sorted(chunk_entries(store_dir), key=lambda e: e.length)[-2:]
    for v in victims:
        _flip(v)
    assert cli.run("store", "verify", check=False).returncode == 3
    bare = cli.run("store", "repair", "--json", check=False)  # nothing has the bytes: reported lost
    assert bare.returncode == 3
    lost = json.loads(bare.stdout)["lost"]
    assert lost and all("lost" in x and x.startswith("good: model/") for x in lost), lost
    r = cli.run("store", "repair", "--from", str(src), "--json")
    rep = json.loads(r.stdout)
    assert rep["ok"] and set(rep["repaired"]) == {v.cid for v in victims}, rep
    assert all(str(src) in where for where in rep["repaired"].values())
    assert cli.json("store", "verify")["ok"]
    cli.run("store", "get", "good", str(tmp_path / "o"))
    assert tree_digest(tmp_path / "o" / "model") == tree_digest(src)


def test_verify_repair_from_another_store_and_from_a_sound_quarantined_copy(stored: tuple[Cli, Path],
                                                                             store_dir: Path, tmp_path: Path) -> None:
    cli, src = stored
    mirror = Cli(tmp_path / "mirror")
    mirror.run("store", "put", "good", str(src))
    victim = _biggest(store_dir)
    _flip(victim)
    r = cli.run("store", "verify", "--repair", "--from", str(mirror.store), "--json")
    rep = json.loads(r.stdout)
    assert rep["ok"] and list(rep["repaired"].values()) == [f"store {mirror.store}"], rep
    assert cli.json("store", "verify")["ok"]
    # a chunk moved aside that is fine after all goes back where it belongs
    ents = chunk_entries(store_dir)
    other = next(e for e in ents if [x.cid for x in ents].count(e.cid) == 1)  # its only copy
    (store_dir / "quarantine").mkdir(exist_ok=True)
    (store_dir / "quarantine" / f"{other.cid}.json").write_text(json.dumps(
        {"id": other.cid, "why": "thought damaged", "entries": [[other.path.name, other.offset]]}))
    assert cli.run("store", "verify", check=False).returncode == 3
    rep = cli.json("store", "repair")
    assert rep["ok"] and rep["repaired"] == {other.cid: "quarantine/ (the copy there verifies)"}
    assert not (store_dir / "quarantine" / f"{other.cid}.json").exists() and cli.json("store", "verify")["ok"]


# ---- gc reclaims what it owns -----------------------------------------------------------------------

def _run_get_killed_at_commit(cli: Cli, name: str, dest: Path, sig: int) -> subprocess.CompletedProcess[str]:
    """`store get`, with the signal SIG delivered by the get itself at the exact point where every
    byte is written into the hidden staging tree and nothing is renamed yet."""
    prog = ("import os, signal, sys\n"
            "from storage.archive import filetree\n"
            f"filetree.FileTreeSink.commit = lambda self: os.kill(os.getpid(), {int(sig)})\n"
            "from cli import main\n"
            "main()\n")
    return subprocess.run([sys.executable, "-c", prog, "--store", str(cli.store), "store", "get", name, str(dest)],
                          env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_killed_get_leaves_a_tree_that_the_next_gc_removes(stored: tuple[Cli, Path], store_dir: Path,
                                                           tmp_path: Path) -> None:
    """SIGKILL: nothing the get can do; gc removes its tree. (A SIGTERM'd get cleans up itself:
    test_trust_second.py.)"""
    cli, src = stored
    dest = tmp_path / "restored"
    sig = signal.SIGKILL
    p = _run_get_killed_at_commit(cli, "good", dest, sig)
    assert p.returncode == -sig
    partial = [x for x in tmp_path.iterdir() if x.name.startswith(".restored.gpusnap-")]
    assert len(partial) == 1 and (partial[0] / "model" / "random.bin").exists() and not dest.exists()
    assert [x.name for x in (store_dir / "tmp").iterdir() if x.name.startswith("get.")]
    gc = cli.json("store", "gc")
    assert gc["gets_cleaned"] == 1 and gc["damage"] == [], gc
    assert not partial[0].exists() and not list((store_dir / "tmp").iterdir())
    cli.run("store", "get", "good", str(dest))  # and the name is free again
    assert tree_digest(dest / "model") == tree_digest(src)


def test_gc_leaves_a_live_gets_tree_and_a_link_in_its_place(stored: tuple[Cli, Path], store_dir: Path,
                                                           tmp_path: Path) -> None:
    from storage.fs.owner import boot_tag, start_time
    cli, _ = stored
    sleeper = subprocess.Popen(["sleep", "60"])
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep")
    try:
        live_tree = tmp_path / f".live.gpusnap-{sleeper.pid}"
        live_tree.mkdir()
        (live_tree / "f").write_text("partial")
        tok = f"{sleeper.pid}-{start_time(sleeper.pid)}-{boot_tag()}"
        (store_dir / "tmp" / f"get.{tok}.1.2").write_text(json.dumps(
            {"pid": sleeper.pid, "start": start_time(sleeper.pid), "boot": boot_tag(), "uid": os.geteuid(),
             "dest": str(tmp_path / "live"), "nonce": "1" * 32}))
        # a dead get's record whose staging path is a symlink to a directory of someone else's files
        dead = 4194301
        (tmp_path / f".linked.gpusnap-{dead}").symlink_to(victim)
        (store_dir / "tmp" / f"get.{dead}-1-{boot_tag()}.1.2").write_text(json.dumps(
            {"pid": dead, "start": 1, "boot": boot_tag(), "uid": os.geteuid(), "dest": str(tmp_path / "linked"),
             "nonce": "2" * 32}))
        p = cli.run("store", "gc", "--json", check=False)
        gc = json.loads(p.stdout)
        assert gc["in_use"] == 1 and gc["gets_cleaned"] == 0
        assert any("linked.gpusnap" in d for d in gc["damage"]) and p.returncode == 3, gc
        assert (live_tree / "f").read_text() == "partial"
        assert (victim / "precious").read_text() == "keep"
    finally:
        sleeper.kill()
        sleeper.wait()
    # its owner gone, the record goes; the tree stays: it carries no marker the record's get wrote
    gc = json.loads(cli.run("store", "gc", "--json", check=False).stdout)
    assert gc["gets_cleaned"] == 0 and (live_tree / "f").exists() and any("no marker" in d for d in gc["damage"]), gc
    assert not [x for x in (store_dir / "tmp").iterdir() if x.name.startswith("get.")]


def test_gc_reclaims_staging_of_dead_owners_keeps_live_ones_and_leaves_foreign_entries(cli: Cli, store_dir: Path) -> None:
    from storage.repo.store import SnapshotStore
    cli.run("store", "init")
    made = subprocess.run([sys.executable, "-c", "import sys; from storage.repo.store import SnapshotStore; "
                           "d = SnapshotStore(sys.argv[1]).new_staging_dir(); open(d + '/img', 'w').write('x'); "
                           "print(d)", str(store_dir)],
                          env={**os.environ, "PYTHONPATH": pythonpath()}, capture_output=True, text=True, check=True)
    dead_dir = Path(made.stdout.strip())
    assert dead_dir.parent == store_dir / "tmp" and (dead_dir / "img").exists()
    mine = Path(SnapshotStore(str(store_dir)).new_staging_dir())
    foreign = store_dir / "tmp" / "someones-dir"
    foreign.mkdir()
    p = cli.run("store", "gc", "--json")
    gc = json.loads(p.stdout)
    assert not dead_dir.exists() and gc["tmp_removed"] == 1
    assert mine.is_dir() and gc["in_use"] == 1
    assert foreign.is_dir() and any("someones-dir" in x for x in gc["left"])


def test_failed_put_removes_its_partial_chunk_file_at_once(tmp_path: Path) -> None:
    from conftest import small_tmpfs
    with small_tmpfs(tmp_path / "small", "16m") as mnt:
        cli = Cli(mnt / "store")
        big = tmp_path / "big"
        big.write_bytes(np.random.default_rng(2).bytes(40 << 20))
        p = cli.run("store", "put", "big", str(big), check=False)
        assert p.returncode == 1 and "no space left" in p.stderr
        assert not list((mnt / "store" / "tmp").iterdir())  # not even before gc


def test_lock_files_made_only_for_real_names_and_reclaimed(cli: Cli, tmp_path: Path, store_dir: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 5000)
    cli.run("store", "put", "a", str(f))
    cli.run("store", "put", "b", str(f))
    for args in (["rm", "nosuch"], ["get", "nosuch", str(tmp_path / "o")], ["inspect", "nosuch"],
                 ["verify", "nosuch"]):
        assert cli.run("store", *args, check=False).returncode == 1
    locks = sorted(p.name for p in (store_dir / "names").iterdir())
    assert "nosuch.lock" not in locks and "a.lock" in locks
    cli.run("store", "rm", "a")  # rm removes its name's lock file itself (held while removed)
    assert sorted(p.name for p in (store_dir / "names").iterdir()) == ["b.lock"]
    (store_dir / "names" / "a.lock").write_bytes(b"")  # one left by an older gpusnap: gc reclaims it
    gc = cli.json("store", "gc")
    assert gc["locks_removed"] == 1
    assert sorted(p.name for p in (store_dir / "names").iterdir()) == ["b.lock"]


# ---- the store never follows a link -----------------------------------------------------------------

def _victim_dir(root: Path, prefix: str) -> Path:
    victim = root / f"victim-{prefix}"
    victim.mkdir()
    for i in range(3):
        (victim / (prefix + HEX[i] * 62)).write_text("host file that looks like a chunk")
    (victim / "passwd").write_text("host file")
    return victim


def test_gc_with_store_directories_replaced_by_links_deletes_nothing_there(stored: tuple[Cli, Path],
                                                                           store_dir: Path, tmp_path: Path) -> None:
    cli, _ = stored
    used = {p.parent.name for p in chunk_files(store_dir)}
    xy = next(f"{i:02x}" for i in range(256) if f"{i:02x}" not in used)
    victims = [_victim_dir(tmp_path, xy)]
    shutil.rmtree(store_dir / "chunks" / xy)
    (store_dir / "chunks" / xy).symlink_to(victims[0])
    victims.append(_victim_dir(tmp_path, "tmp"))
    from storage.fs.owner import boot_tag
    (victims[1] / f"chunk.4194301-1-{boot_tag()}.1.2").write_text("looks like a dead writer's file")
    shutil.rmtree(store_dir / "tmp")
    (store_dir / "tmp").symlink_to(victims[1])
    before = {v: sorted(p.name for p in v.iterdir()) for v in victims}
    p = cli.run("store", "gc", "--json", check=False)
    assert p.returncode == 3, p.stderr
    gc = json.loads(p.stdout)
    assert any(f"chunks/{xy} is a symbolic link" in d for d in gc["damage"]), gc
    assert any("tmp is a symbolic link" in d for d in gc["damage"]), gc
    assert {v: sorted(p.name for p in v.iterdir()) for v in victims} == before
    assert cli.json("store", "ls")[0]["name"] == "good"  # reads go on around the damage


def test_a_fifo_in_place_of_a_chunk_is_damage_at_once(stored: tuple[Cli, Path], store_dir: Path,
                                                      tmp_path: Path) -> None:
    cli, _ = stored
    victim = _biggest(store_dir).path  # its pack
    victim.unlink()
    os.mkfifo(victim)
    t0 = time.monotonic()
    v = cli.run("store", "verify", "--json", check=False, timeout=30)
    assert v.returncode == 3 and any("FIFO" in p for p in json.loads(v.stdout)["problems"]), v.stdout
    g = cli.run("store", "get", "good", str(tmp_path / "o"), check=False, timeout=30)
    assert g.returncode == 3 and len(g.stderr.splitlines()) == 1 and not (tmp_path / "o").exists(), g.stderr
    assert time.monotonic() - t0 < 20
    # a symlink to a real, valid-looking file is damage too: it is never opened through the link
    shutil.rmtree(store_dir / "quarantine")
    os.unlink(victim)
    os.unlink(store_dir / "index" / victim.name)
    cli.run("store", "put", "good", str(tmp_path / "model"), "--replace")
    other = chunk_files(store_dir)[0]
    outside = tmp_path / "outside"
    shutil.copy(other, outside)
    other.unlink()
    other.symlink_to(outside)
    v = cli.run("store", "verify", "--json", check=False, timeout=30)
    assert any("symbolic link" in p for p in json.loads(v.stdout)["problems"]), v.stdout


def test_snapshots_dir_replaced_by_a_link_is_damage(stored: tuple[Cli, Path], store_dir: Path, tmp_path: Path) -> None:
    cli, _ = stored
    (store_dir / "snapshots").rename(tmp_path / "elsewhere")
    (store_dir / "snapshots").symlink_to(tmp_path / "elsewhere")
    p = cli.run("store", "ls", check=False)
    assert p.returncode == 3 and "snapshots is a symbolic link" in p.stderr, p.stderr
    assert cli.run("store", "gc", check=False).returncode == 3
    assert (tmp_path / "elsewhere" / "good.json").exists()


# ---- stray entries in snapshots/ ----------------------------------------------------------------------

STRAYS = [".x.json", "-bad.json", "has space.json", "d.json"]


def test_stray_entries_reported_never_fatal_and_removable(stored: tuple[Cli, Path], store_dir: Path,
                                                          tmp_path: Path) -> None:
    cli, src = stored
    snaps = store_dir / "snapshots"
    for s in STRAYS[:3]:
        (snaps / s).write_text("{}")
    (snaps / "d.json").mkdir()
    (snaps / "d.json" / "inner").write_text("x")
    rows = cli.json("store", "ls")
    assert [r["name"] for r in rows if "error" not in r] == ["good"]
    assert sorted(r["name"] for r in rows if r.get("stray")) == sorted(STRAYS)
    v = cli.run("store", "verify", "--json", check=False)
    rep = json.loads(v.stdout)
    assert v.returncode == 3 and rep["snapshots"] == ["good"] and rep["chunks_checked"] > 0
    assert all(any(s in p for p in rep["problems"]) for s in STRAYS), rep["problems"]
    cli.run("store", "put", "gone", str(tmp_path / "model" / "random.bin"))
    cli.run("store", "rm", "gone")
    g = cli.run("store", "gc", "--json", check=False)
    assert g.returncode == 3 and json.loads(g.stdout)["chunks_removed"] == 0  # random.bin's chunks live in good
    r = cli.run("store", "rm", "--json", "--", *STRAYS)
    assert len(json.loads(r.stdout)["removed"]) == 4
    assert sorted(p.name for p in snaps.iterdir()) == ["good.json"]
    assert cli.json("store", "verify")["ok"]
    assert cli.run("store", "gc").returncode == 0


# ---- the first hour: rm, read commands, inspect, permissions ------------------------------------------

def test_rm_removes_every_name_it_can_and_reports_the_rest(cli: Cli, tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"y" * 5000)
    for n in ("a", "b", "c"):
        cli.run("store", "put", n, str(f))
    p = cli.run("store", "rm", "a", "nosuch", "b", check=False)
    assert p.returncode == 1
    assert p.stdout.splitlines() == ["removed snapshot a", "removed snapshot b"]
    assert p.stderr.strip() == f"gpusnap: no snapshot named 'nosuch' in {cli.store}"
    assert [r["name"] for r in cli.json("store", "ls")] == ["c"]
    p = cli.run("store", "rm", "c", "ghost", "--json", check=False)
    assert p.returncode == 1
    out = json.loads(p.stdout)
    assert out["removed"] == ["snapshot c"] and [e["name"] for e in out["errors"]] == ["ghost"]


@pytest.mark.parametrize("args", [["ls"], ["inspect", "x"], ["verify"], ["get", "x", "/tmp/gpusnap-never"], ["gc"],
                                  ["rm", "x"], ["repair"]])
def test_read_commands_never_create_a_store(tmp_path: Path, args: list[str]) -> None:
    mistyped = tmp_path / "mistyped" / "path"
    p = Cli(mistyped).run("store", *args, check=False)
    assert p.returncode == 1 and f"no gpusnap store at {mistyped}" in p.stderr, p.stderr
    assert len(p.stderr.splitlines()) == 1
    assert not (tmp_path / "mistyped").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    p = Cli(empty).run("store", *args, check=False)
    assert p.returncode == 1 and "not a gpusnap store" in p.stderr and not list(empty.iterdir())


def test_inspect_counts_each_stored_chunk_once(cli: Cli, tmp_path: Path) -> None:
    block = np.random.default_rng(4).bytes(4 << 20)
    f = tmp_path / "twice.bin"
    f.write_bytes(block * 3)
    cli.run("store", "put", "t", str(f))
    info = cli.json("store", "inspect", "t")
    raw = info["codecs"]["raw"]
    assert raw["chunks"] == 3 and raw["unique_chunks"] == 1
    assert raw["stored_bytes"] == info["stored_bytes_unique"] == 4 << 20


def test_a_store_the_user_cannot_read_says_permission_denied(cli: Cli, tmp_path: Path) -> None:
    """A store the caller may not read says "permission denied", not "not a gpusnap store". Root reads
    everything, so the CLI runs as root without the two capabilities that bypass file permissions, on
    a store whose directory it may not enter (wherever this checkout sits: switching to another uid
    would need the checkout and its venv readable by that user, which a clone under 0700 is not)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root (and setpriv) to run the CLI without the file-permission capabilities")
    f = tmp_path / "f"
    f.write_bytes(b"z" * 5000)
    cli.run("store", "put", "s", str(f))
    drop = "-dac_override,-dac_read_search"
    os.chmod(cli.store, 0)
    try:
        for args in (["ls"], ["verify"], ["get", "s", str(tmp_path / "never")], ["gc"]):
            p = subprocess.run(["setpriv", f"--bounding-set={drop}", f"--inh-caps={drop}", sys.executable, "-m",
                                "cli", "--store", str(cli.store), "store", *args],
                               capture_output=True, text=True, env={**os.environ, "PYTHONPATH": pythonpath()},
                               cwd=REPO)
            assert p.returncode == 1 and "permission denied" in p.stderr, (args, p.stderr)
            assert "not a gpusnap store" not in p.stderr and len(p.stderr.splitlines()) == 1
    finally:
        os.chmod(cli.store, 0o700)
    assert not (tmp_path / "never").exists()


def test_put_into_a_store_whose_directories_are_links_writes_nothing_through_them(cli: Cli, store_dir: Path,
                                                                                   tmp_path: Path) -> None:
    cli.run("store", "init")
    f = tmp_path / "f"
    f.write_bytes(np.random.default_rng(8).bytes(1 << 20))
    victim = tmp_path / "victim"
    victim.mkdir()
    shutil.rmtree(store_dir / "tmp")
    (store_dir / "tmp").symlink_to(victim)
    p = cli.run("store", "put", "x", str(f), check=False)
    assert p.returncode == 3 and "tmp is a symbolic link" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert not list(victim.iterdir())
    (store_dir / "tmp").unlink()
    (store_dir / "tmp").mkdir(mode=0o700)
    for xy in {f"{i:02x}" for i in range(256)}:  # every chunk directory a link: whatever id the data gets
        shutil.rmtree(store_dir / "chunks" / xy)
        (store_dir / "chunks" / xy).symlink_to(victim)
    p = cli.run("store", "put", "x", str(f), check=False)
    assert p.returncode == 3 and "is a symbolic link" in p.stderr, p.stderr
    assert not list(victim.iterdir()) and not list((store_dir / "tmp").iterdir())
    assert cli.json("store", "ls") == []
    for xy in {f"{i:02x}" for i in range(256)}:
        (store_dir / "chunks" / xy).unlink()
        (store_dir / "chunks" / xy).mkdir(mode=0o700)
    for d in ("packs", "index"):  # the pack directories links: nothing written through them either
        shutil.rmtree(store_dir / d)
        (store_dir / d).symlink_to(victim)
        p = cli.run("store", "put", "x", str(f), check=False)
        assert p.returncode == 3 and f"{d} is a symbolic link" in p.stderr, p.stderr
        assert not list(victim.iterdir()) and not list((store_dir / "tmp").iterdir())
        (store_dir / d).unlink()
        (store_dir / d).mkdir(mode=0o700)
    assert cli.json("store", "ls") == []


def test_an_owner_is_alive_only_as_the_same_process_of_the_same_boot() -> None:
    from storage.fs.owner import ProcessOwner, boot_tag
    me = ProcessOwner.current()
    assert me.alive() and ProcessOwner.parse(me.token) == me
    assert not ProcessOwner(me.pid, me.start + 1, me.boot).alive()          # the pid, reused later
    other_boot = "0" * 8 if boot_tag() != "0" * 8 else "1" * 8
    assert not ProcessOwner(me.pid, me.start, other_boot).alive()            # the pid, after a reboot
    p = subprocess.Popen(["true"])
    p.wait()
    assert not ProcessOwner(p.pid, me.start, me.boot).alive()
    assert ProcessOwner.parse("12-x-abcdef01") is None and ProcessOwner.parse("12-3-abcdef0") is None


def test_verify_during_a_put_reports_damage_and_says_why_nothing_was_moved(stored: tuple[Cli, Path],
                                                                           store_dir: Path) -> None:
    from storage.repo.store import SnapshotStore
    cli, _ = stored
    victim = _biggest(store_dir)
    _flip(victim)
    with SnapshotStore(str(store_dir)).writer("busy"):  # holds the store lock shared, as a put does
        v = cli.run("store", "verify", "--json", check=False)
    rep = json.loads(v.stdout)
    assert v.returncode == 3 and rep["quarantined"] == [] and "busy" in rep["not_quarantined"], rep
    assert not (store_dir / "quarantine" / f"{victim.cid}.json").exists()
    assert json.loads(cli.run("store", "verify", "--json", check=False).stdout)["quarantined"] == [victim.cid]
