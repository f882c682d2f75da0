"""Keeping many snapshots: retention, stats, tags, partial restore, cat, export/import, diff, locks.

Real store on the real disk, the real CLI in a subprocess; creation times set through the writer's
`created` attribute (the test hook the issue asks for), never by waiting."""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import io
from pathlib import Path

import pytest
import zstandard

from conftest import REPO, Cli, chunk_files, make_mixed_tree, pythonpath, tree_digest
from support.archive import committed_snapshot as _snap
from support.entries import chunk_entries, chunk_ids

from storage.repo.store import SnapshotStore


def test_forget_follows_restic_rules(cli: Cli, store_dir: Path) -> None:
    times = {  # name -> creation time (UTC)
        "a": "2026-11-30T10:00:00+00:00", "b": "2026-11-30T09:00:00+00:00", "c": "2026-11-29T23:00:00+00:00",
        "d": "2026-11-29T08:00:00+00:00", "e": "2026-11-27T12:00:00+00:00", "f": "2026-11-20T12:00:00+00:00",
    }
    for n, t in times.items():
        _snap(store_dir, n, t, n.encode())
    _snap(store_dir, "a.gpu", "2026-11-30T10:00:01+00:00", b"gpu-a", kind="gpu")   # companion of a
    _snap(store_dir, "d.gpu", "2026-11-29T08:00:01+00:00", b"gpu-d", kind="gpu")   # companion of d
    # keep-last 1 keeps a; keep-daily 3 keeps the newest of 11-30 (a), 11-29 (c), 11-27 (e)
    plan = cli.json("store", "forget", "--keep-last", "1", "--keep-daily", "3", "--dry-run")
    kept = {k["name"]: k["reasons"] for k in plan["keep"]}
    assert kept == {"a": ["last 1", "daily 1"], "c": ["daily 2"], "e": ["daily 3"], "a.gpu": ["companion of a"]}
    assert sorted(plan["remove"]) == ["b", "d", "d.gpu", "f"] and plan["removed"] == []
    assert len(cli.json("store", "ls")) == 8  # dry run removed nothing
    cli.run("store", "forget", "--keep-last", "1", "--keep-daily", "3", "--prune")
    assert sorted(r["name"] for r in cli.json("store", "ls")) == ["a", "a.gpu", "c", "e"]
    assert cli.run("store", "verify").returncode == 0
    # no rule: refuse rather than forget everything
    p = cli.run("store", "forget", check=False)
    assert p.returncode == 2 and "no --keep-" in p.stderr


def test_forget_filters_by_tag_and_keeps_a_snapshot_in_use(cli: Cli, store_dir: Path) -> None:
    _snap(store_dir, "n1", "2026-11-01T00:00:00+00:00", b"1", tags=("nightly",))
    _snap(store_dir, "n2", "2026-11-02T00:00:00+00:00", b"2", tags=("nightly",))
    _snap(store_dir, "n3", "2026-11-03T00:00:00+00:00", b"3", tags=("nightly",))
    _snap(store_dir, "other", "2026-10-01T00:00:00+00:00", b"o")
    # another process holds n2's name lock (a write in progress): forget must keep it
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(store_dir / 'names' / 'n2.lock')!r}, os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        p = cli.run("store", "forget", "--tag", "nightly", "--keep-last", "1", "--json", check=False)
        assert p.returncode == 1
        import json
        rep = json.loads(p.stdout)
        assert rep["removed"] == ["n1"] and rep["not_removed"][0].startswith("n2:")
        names = sorted(r["name"] for r in cli.json("store", "ls"))
        assert names == ["n2", "n3", "other"]           # untagged 'other' untouched by the policy
        # lock status names the live holder; break-lock refuses it
        st = cli.json("store", "lock", "status")
        n2 = next(r for r in st if r["name"] == "n2")
        assert n2["held"] and n2["holders"][0]["pid"] == holder.pid
        p = cli.run("store", "break-lock", "n2", check=False)
        assert p.returncode == 1 and f"pid {holder.pid}" in p.stderr
        assert (store_dir / "names" / "n2.lock").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder is gone: its lock file can be broken now
    assert cli.json("store", "break-lock", "n2")["removed"] == [str(store_dir / "names" / "n2.lock")]


def test_tags_and_ls_filters(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "x").write_bytes(b"hello")
    cli.run("store", "put", "t1", str(d), "--tag", "model=llama", "--tag", "prod")
    cli.run("store", "put", "t2", str(d), "--tag", "prod")
    _snap(store_dir, "old", "2020-01-01T00:00:00+00:00", b"o")
    assert [r["name"] for r in cli.json("store", "ls", "--tag", "prod", "--tag", "model=llama")] == ["t1"]
    assert sorted(r["name"] for r in cli.json("store", "ls", "--tag", "prod")) == ["t1", "t2"]
    assert sorted(r["name"] for r in cli.json("store", "ls", "--since", "7d")) == ["t1", "t2"]
    row = next(r for r in cli.json("store", "ls") if r["name"] == "t1")
    assert row["tags"] == ["model=llama", "prod"] and row["host"] == os.uname().nodename
    info = cli.json("store", "inspect", "t1")
    assert info["name"] == "t1"
    p = cli.run("store", "put", "t3", str(d), "--tag", "bad tag", check=False)
    assert p.returncode == 1 and "bad tag" in p.stderr and not (store_dir / "snapshots" / "t3.json").exists()


def test_stats_add_up_and_predict_what_rm_frees(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    base = make_mixed_tree(tmp_path / "base", mb=16, seed=1)
    cli.run("store", "put", "one", str(base))
    big = base / "extra.bin"
    big.write_bytes(os.urandom(3 << 20))
    cli.run("store", "put", "two", str(base))
    rep = cli.json("store", "stats")
    per = {s["name"]: s for s in rep["snapshots"]}
    for s in per.values():
        assert s["unique_bytes"] + s["shared_bytes"] == s["stored_bytes"]
        assert sum(c["stored_bytes"] for c in s["codecs"].values()) == s["stored_bytes"]
    assert per["two"]["unique_bytes"] >= (3 << 20) - 4096 and per["one"]["unique_chunks"] == 0
    repo = rep["repository"]
    assert repo["chunks"] == len(chunk_ids(store_dir))
    assert repo["stored_bytes"] == per["one"]["shared_bytes"] + per["two"]["unique_bytes"]
    only_two = cli.json("store", "stats", "two")["snapshots"]
    assert [s["name"] for s in only_two] == ["two"]
    cli.run("store", "rm", "two")
    gc = cli.json("store", "gc")
    assert gc["chunks_removed"] == per["two"]["unique_chunks"] and gc["packs_removed"] == 1


def test_partial_get_and_cat_are_exact_and_verified(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "src", mb=12, seed=2)
    cli.run("store", "put", "s", str(src))
    streams = [s["name"] for s in cli.json("store", "inspect", "s")["streams"] if s["type"] == "file"]
    # a file with data (not all zeros: zero chunks have no file to damage below)
    one = next(n for n in reversed(streams) if (src / n.split("/", 1)[1]).read_bytes().strip(b"\0"))
    out = tmp_path / "out"
    cli.run("store", "get", "s", str(out), "--include", one)
    got = [p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()]
    assert got == [one]
    rel = one.split("/", 1)[1]
    assert (out / one).read_bytes() == (src / rel).read_bytes()
    p = subprocess.run([*sys_gpusnap(), "--store", str(store_dir), "store", "cat", "s", one], capture_output=True,
                       env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO)
    assert p.returncode == 0 and p.stdout == (src / rel).read_bytes()
    assert cli.run("store", "get", "s", str(tmp_path / "none"), "--include", "nomatch*", check=False).returncode == 1
    # a damaged chunk stops cat with exit 3
    for e in chunk_entries(store_dir):
        e.flip(4096)        # the first payload byte (after the 4 KiB header)
    bad = subprocess.run([*sys_gpusnap(), "--store", str(store_dir), "store", "cat", "s", one], capture_output=True,
                         env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO)
    assert bad.returncode == 3 and b"corrupted" in bad.stderr


def sys_gpusnap() -> list[str]:
    return [sys.executable, "-m", "cli"]


def test_export_import_round_trip_and_forgery_refused(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "src", mb=12, seed=3)
    cli.run("store", "put", "x", str(src), "--tag", "keep")
    arc = tmp_path / "x.gsnap"
    cli.run("store", "export", "x", str(arc))
    other = Cli(tmp_path / "store-b")
    rep = other.json("store", "import", str(arc))
    assert rep["name"] == "x"
    a, b = SnapshotStore(str(store_dir)).load("x"), SnapshotStore(str(other.store)).load("x")
    assert a.dumps() == b.dumps()       # same manifest, creation time and tags included
    other.run("store", "get", "x", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "src") == tree_digest(src)
    assert other.run("store", "verify").returncode == 0
    # a forged chunk (bytes changed, archive re-packed) is refused and nothing becomes visible
    raw = zstandard.ZstdDecompressor().stream_reader(arc.open("rb")).read()
    tin = tarfile.open(fileobj=io.BytesIO(raw))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read()  # type: ignore[union-attr]
            if m.name.startswith("chunks/") and m.size > 5000:
                data = data[:-1] + bytes([data[-1] ^ 1])
            tout.addfile(m, io.BytesIO(data))
    forged = tmp_path / "forged.gsnap"
    forged.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    third = Cli(tmp_path / "store-c")
    p = third.run("store", "import", str(forged), check=False)
    assert p.returncode == 3 and "does not match its id" in p.stderr
    assert third.json("store", "ls") == []
    # a truncated archive too
    short = tmp_path / "short.gsnap"
    short.write_bytes(arc.read_bytes()[: len(arc.read_bytes()) // 2])
    p = third.run("store", "import", str(short), check=False)
    assert p.returncode == 3 and third.json("store", "ls") == []


@pytest.mark.root
def test_diff_of_two_criu_snapshots_names_changed_page_images(cli: Cli) -> None:
    if os.geteuid() != 0:
        pytest.skip("CRIU needs root")
    from support.criu import Tree
    t = Tree(mb=16)
    try:
        cli.run("criu", "dump", str(t.pid), "c1", "--leave-running")
        t.report()  # the tree runs on and touches its memory
        cli.run("criu", "dump", str(t.pid), "c2", "--leave-running")
    finally:
        t.kill()
    d = cli.json("store", "diff", "c1", "c2")
    changed = {c["name"]: c for c in d["changes"] if c["change"] == "changed"}
    pages = [n for n in changed if n.rsplit("/", 1)[-1].startswith("pages-")]
    assert pages, d
    total = sum(c["size_b"] for c in changed.values())
    assert 0 < d["changed_bytes"] < total
    same = cli.json("store", "diff", "c1", "c1")
    assert same["changes"] == [] and same["changed_bytes"] == 0


def test_sampled_verify_reads_a_fresh_subset_and_finds_a_flipped_chunk(cli: Cli, store_dir: Path,
                                                                        tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):   # 40 distinct, incompressible chunks
        (src / f"f{i}").write_bytes(os.urandom(70_000))
    cli.run("store", "put", "s", str(src))
    total = len(chunk_entries(store_dir))
    assert total == 40 and len(chunk_files(store_dir)) == 1  # one pack
    rep = cli.json("store", "verify", "--read-data-subset", "25%")
    assert rep["chunks_checked"] == 10 and rep["chunks_unchecked"] == 30 and rep["chunks_total"] == 40
    victim = chunk_entries(store_dir)[17]
    victim.flip(4096)
    # each run reads a new random quarter: the flipped chunk is found within a bounded number of runs
    # (missed 30 times in a row with probability 0.75^30 < 0.0002)
    for run in range(30):
        p = cli.run("store", "verify", "--read-data-subset", "25%", "--json", check=False)
        if p.returncode == 3:
            break
        assert p.returncode == 0, p.stderr
    else:
        raise AssertionError("sampled verify never found the flipped chunk in 30 runs")
    import json
    assert any(victim.cid[:16] in pr for pr in json.loads(p.stdout)["problems"])
    # a time limit of zero reads nothing and says so; a bad percentage is a usage error
    rep0 = cli.run("store", "verify", "--max-duration", "0", "--json", check=False)
    assert json.loads(rep0.stdout)["chunks_checked"] == 0
    assert cli.run("store", "verify", "--read-data-subset", "0%", check=False).returncode == 2


def test_commands_that_change_the_store_wait_for_recover(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """An operation whose gpusnap died (a journal record with a dead owner): put, rm and gc refuse with
    exit 5 until `gpusnap recover` has handled it; read commands still work."""
    cli.run("store", "init")
    d = tmp_path / "d"
    d.mkdir()
    (d / "x").write_bytes(b"x")
    cli.run("store", "put", "before", str(d))
    prog = ("import os, sys, time\nfrom sandbox.ops import journal\n"
            "with journal.operation(sys.argv[1], journal.OpKind.CRIU_RESTORE, 'before') as op:\n"
            "    print('recorded', flush=True)\n    time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", prog, str(store_dir)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": pythonpath()})
    assert p.stdout is not None and p.stdout.readline().strip() == "recorded"
    p.kill()
    p.wait()
    for args in (("store", "put", "after", str(d)), ("store", "rm", "before"), ("store", "gc")):
        r = cli.run(*args, check=False)
        assert r.returncode == 5 and "gpusnap recover" in r.stderr, (args, r.stderr)
    assert [r["name"] for r in cli.json("store", "ls")] == ["before"]
    cli.run("recover")
    cli.run("store", "put", "after", str(d))
    cli.run("store", "rm", "before")
