"""What a restic/borg user misses in the second hour (issue 25), through the real CLI: listing a
snapshot's files, inspect's metadata, --version, retagging, damage marks in `store ls`, stats that
tell zeros from dedup, FIFOs and excludes, xattrs, the files cache, reports and words."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from support.entries import chunk_entries
from conftest import GPUSNAP, REPO, Cli, make_mixed_tree, pythonpath


def _tree(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.txt").write_text("alpha\n")
    (root / "b.bin").write_bytes(os.urandom(300_000))
    (root / "l").symlink_to("sub/a.txt")
    return root


# ------------------------------------------------------------------------------------------- item 1
def test_ls_lists_a_snapshots_files_and_errors_point_to_it(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "data")
    os.chmod(src / "sub" / "a.txt", 0o640)
    cli.run("store", "put", "s", str(src))
    text = cli.run("store", "ls", "s").stdout.splitlines()
    assert text[0].split() == ["MODE", "OWNER", "SIZE", "PATH"]
    rows = {r["path"]: r for r in cli.json("store", "ls", "s")}
    assert set(rows) == {"data", "data/sub", "data/sub/a.txt", "data/b.bin", "data/l"}
    assert rows["data/b.bin"]["size"] == 300_000 and rows["data/sub/a.txt"]["mode"] == 0o640
    assert rows["data/l"]["type"] == "symlink" and rows["data/l"]["target"] == "sub/a.txt"
    assert any(line.startswith("-rw-r-----") and line.endswith("data/sub/a.txt") for line in text)
    assert any(line.startswith("l") and line.endswith("data/l -> sub/a.txt") for line in text)
    assert [r["path"] for r in cli.json("store", "ls", "s", "data/sub")] == ["data/sub", "data/sub/a.txt"]
    assert [r["path"] for r in cli.json("store", "ls", "s", "/data/sub/")] == ["data/sub", "data/sub/a.txt"]
    p = cli.run("store", "ls", "s", "data/su", check=False)
    assert p.returncode == 1 and "`gpusnap store ls s`" in p.stderr
    # inspect names the streams; get --include and cat point to `store ls NAME`
    assert "data/sub/a.txt" in cli.run("store", "inspect", "s").stdout
    p = cli.run("store", "get", "s", str(tmp_path / "out"), "--include", "sub/*", check=False)
    assert p.returncode == 1 and "`gpusnap store ls s` lists them" in p.stderr
    p = cli.run("store", "cat", "s", "a.txt", check=False)
    assert p.returncode == 1 and "`gpusnap store ls s` lists them" in p.stderr
    cli.run("store", "get", "s", str(tmp_path / "out"), "--include", "data/sub/*")
    assert (tmp_path / "out" / "data" / "sub" / "a.txt").read_text() == "alpha\n"
    assert not (tmp_path / "out" / "data" / "b.bin").exists()
    helptext = " ".join(cli.run("store", "get", "--help").stdout.split())
    assert "start at the top directory" in helptext and "--include 'data/models/*'" in helptext


# ------------------------------------------------------------------------------------------- item 2
def test_inspect_shows_tags_host_version_and_version_flag(cli: Cli, tmp_path: Path) -> None:
    from importlib.metadata import version
    src = _tree(tmp_path / "data")
    cli.run("store", "put", "s", str(src), "--tag", "nightly", "--tag", "model=x")
    info = cli.json("store", "inspect", "s")
    assert info["tags"] == ["nightly", "model=x"] and info["host"] == os.uname().nodename
    assert info["gpusnap_version"] == version("gpusnap")
    text = cli.run("store", "inspect", "s").stdout
    assert "nightly, model=x" in text and os.uname().nodename in text and f"gpusnap {version('gpusnap')}" in text
    p = cli.run("--version")
    assert p.stdout.strip() == f"gpusnap {version('gpusnap')}"


# ------------------------------------------------------------------------------------------- item 3
def test_tags_change_after_creation_atomically(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = _tree(tmp_path / "data")
    cli.run("store", "put", "s", str(src), "--tag", "nightly")
    before = json.loads((store_dir / "snapshots" / "s.json").read_text())
    ino = (store_dir / "snapshots" / "s.json").stat().st_ino
    rows = cli.json("store", "tag", "s", "--add", "release", "--add", "nightly", "--remove", "absent")
    assert rows == [{"name": "s", "old_tags": ["nightly"], "tags": ["nightly", "release"], "changed": True}]
    after = json.loads((store_dir / "snapshots" / "s.json").read_text())
    assert (store_dir / "snapshots" / "s.json").stat().st_ino != ino  # a new file renamed into place
    for key in ("created", "host", "gpusnap_version", "meta", "streams", "name"):
        assert after[key] == before[key], key
    assert after["checksum"] != before["checksum"]
    cli.run("store", "verify", "s")  # the rewritten manifest loads: its checksum is valid
    assert cli.json("store", "tag", "s", "--remove", "nightly")[0]["tags"] == ["release"]
    assert cli.json("store", "tag", "s", "--set", "a", "--set", "b")[0]["tags"] == ["a", "b"]
    assert [r["name"] for r in cli.json("store", "ls", "--tag", "b")] == ["s"]
    assert cli.json("store", "tag", "s", "--set", "")[0]["tags"] == []
    assert cli.run("store", "tag", "s", "--set", "a", "--add", "c", check=False).returncode == 2
    assert cli.run("store", "tag", "s", check=False).returncode == 2
    p = cli.run("store", "tag", "s", "--add", "bad tag", check=False)
    assert p.returncode == 1 and "bad tag" in p.stderr
    assert cli.run("store", "tag", "nope", "--add", "x", check=False).returncode == 1
    assert list((store_dir / "tmp").iterdir()) == []
    assert "Changing tags" in (REPO / "storage" / "FORMAT.md").read_text() or \
        "store tag NAME" in (REPO / "storage" / "FORMAT.md").read_text()


# ------------------------------------------------------------------------------------------- item 4
def test_ls_marks_snapshots_with_damaged_chunks_until_repaired(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    (src / "r.bin").write_bytes(os.urandom(1 << 20))
    other = tmp_path / "other"
    other.mkdir()
    (other / "o.bin").write_bytes(os.urandom(1 << 20))
    cli.run("store", "put", "hit", str(src))
    cli.run("store", "put", "whole", str(other))
    hit_ids = {c[0] for s in json.loads((store_dir / "snapshots" / "hit.json").read_text())["streams"]
               for c in s["chunks"] if c[0]}
    victim = next(e for e in chunk_entries(store_dir) if e.cid in hit_ids)  # a pack entry or a chunk file
    victim.flip(4096 + 100)
    assert {r["name"]: r["damaged_chunks"] for r in cli.json("store", "ls")} == {"hit": 0, "whole": 0}
    assert cli.run("store", "verify", check=False).returncode == 3
    rows = {r["name"]: r for r in cli.json("store", "ls")}
    assert rows["hit"]["damaged_chunks"] == 1 and rows["whole"]["damaged_chunks"] == 0
    line = next(x for x in cli.run("store", "ls").stdout.splitlines() if x.startswith("hit "))
    assert "DAMAGED" in line and "store repair" in line
    assert "DAMAGED" not in next(x for x in cli.run("store", "ls").stdout.splitlines() if x.startswith("whole "))
    # a forged record is validated on load: garbage or a link is no record, never an error
    rec = store_dir / "damaged.json"
    saved = rec.read_bytes()
    rec.write_bytes(b'{"format": "gpusnap-damage", "version": 1, "chunks": {"../x": {}}}')
    assert cli.json("store", "ls")[0]["damaged_chunks"] == 0
    rec.unlink()
    rec.symlink_to("/etc/passwd")
    assert cli.json("store", "ls")[0]["damaged_chunks"] == 0
    rec.unlink()
    rec.write_bytes(saved)
    cli.run("store", "repair", "--from", str(src))
    assert {r["name"]: r["damaged_chunks"] for r in cli.json("store", "ls")} == {"hit": 0, "whole": 0}
    assert not rec.exists()
    # a later verify that finds the chunk whole clears the mark too
    rec.write_bytes(saved)
    assert cli.json("store", "ls")[0]["damaged_chunks"] == 1
    cli.run("store", "verify")
    assert cli.json("store", "ls")[0]["damaged_chunks"] == 0


# ------------------------------------------------------------------------------------------- item 5
def test_stats_report_zeros_apart_from_dedup(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    (src / "r.bin").write_bytes(os.urandom(4 << 20))
    (src / "z.bin").write_bytes(bytes(8 << 20))
    cli.run("store", "put", "a", str(src))
    one = cli.json("store", "stats")
    a = one["snapshots"][0]
    assert a["zero_bytes"] == 8 << 20 and a["dedup_bytes"] == 0 and a["dedup_ratio"] == 1.0
    assert one["repository"]["dedup_ratio"] == 1.0 and one["repository"]["zero_bytes"] == 8 << 20
    text = cli.run("store", "stats").stdout
    assert "(1.00x)" in text and "zeros elided" in text and "3.00x" not in text
    (src / "copy.bin").write_bytes((src / "r.bin").read_bytes())
    cli.run("store", "put", "b", str(src))
    rep = cli.json("store", "stats")
    b = next(s for s in rep["snapshots"] if s["name"] == "b")
    assert b["dedup_bytes"] == 4 << 20 and b["dedup_ratio"] == 2.0
    repo = rep["repository"]
    assert repo["referenced_bytes"] == 12 << 20 and repo["distinct_raw_bytes"] == 4 << 20
    assert repo["dedup_bytes"] == 8 << 20 and repo["dedup_ratio"] == 3.0


# ------------------------------------------------------------------------------------------- item 6
def test_put_stores_fifos_skips_sockets_and_excludes(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    import socket
    import stat
    src = tmp_path / "data"
    (src / "d").mkdir(parents=True)
    os.mkfifo(src / "d" / "pipe", 0o640)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(src / "d" / "sock"))
    (src / "d" / "keep.txt").write_text("k")
    (src / "d" / "x.o").write_text("o")
    (src / "cache").mkdir()
    (src / "cache" / "big").write_bytes(b"c" * 1000)
    (src / "d" / "notes.tmp").write_text("t")
    pats = tmp_path / "excl"
    pats.write_text("# build output\n\n*.tmp\n")
    try:
        # a writer holding the FIFO open would block a put that opened it: the put must not open it
        p = cli.run("store", "put", "s", str(src), "--exclude", "*.o", "--exclude", "data/cache",
                    "--exclude-file", str(pats), "--json", timeout=60)
    finally:
        sock.close()
    rep = json.loads(p.stdout)
    assert rep["excluded"] == 3 and len(rep["skipped"]) == 1 and "socket" in rep["skipped"][0]
    assert "note: skipped" in p.stderr and "sock" in p.stderr
    paths = {r["path"]: r for r in cli.json("store", "ls", "s")}
    assert set(paths) == {"data", "data/d", "data/d/keep.txt", "data/d/pipe"}
    assert paths["data/d/pipe"]["type"] == "fifo" and paths["data/d/pipe"]["mode"] == 0o640
    assert any(x.startswith("prw-r-----") for x in cli.run("store", "ls", "s").stdout.splitlines())
    out = tmp_path / "out"
    cli.run("store", "get", "s", str(out))
    st = (out / "data" / "d" / "pipe").lstat()
    assert stat.S_ISFIFO(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640
    assert st.st_mtime_ns == (src / "d" / "pipe").lstat().st_mtime_ns
    assert (out / "data" / "d" / "keep.txt").read_text() == "k"
    # devices are still refused, naming --exclude
    if os.geteuid() == 0:
        dev = tmp_path / "devs"
        dev.mkdir()
        os.mknod(dev / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        p = cli.run("store", "put", "dev", str(dev), check=False)
        assert p.returncode == 1 and "--exclude" in p.stderr
        cli.run("store", "put", "dev", str(dev), "--exclude", "null")


# ------------------------------------------------------------------------------------------- item 7
def test_xattrs_kept_and_restored_with_owners_and_links(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    f = src / "f"
    f.write_text("x")
    os.link(f, src / "f2")
    os.setxattr(f, "user.color", b"blue")
    os.setxattr(src, "user.dir", b"\x00\x01binary")
    if os.geteuid() == 0:
        os.setxattr(f, "trusted.t", b"secret")
        os.chown(f, 1234, 5678)
    cli.run("store", "put", "s", str(src))
    m = json.loads((store_dir / "snapshots" / "s.json").read_text())
    assert m["version"] == 3
    out = tmp_path / "out"
    cli.run("store", "get", "s", str(out))
    g = out / "data" / "f"
    assert os.getxattr(g, "user.color") == b"blue"
    assert os.getxattr(out / "data", "user.dir") == b"\x00\x01binary"
    assert (out / "data" / "f2").stat().st_ino == g.stat().st_ino
    if os.geteuid() == 0:
        assert os.getxattr(g, "trusted.t") == b"secret" and (g.stat().st_uid, g.stat().st_gid) == (1234, 5678)
        # without owners, the privileged namespaces are not restored
        cli.run("store", "get", "s", str(tmp_path / "out2"), "--no-same-owner")
        assert "trusted.t" not in os.listxattr(tmp_path / "out2" / "data" / "f")
        assert os.getxattr(tmp_path / "out2" / "data" / "f", "user.color") == b"blue"
    # --no-xattrs stores none, and a manifest without them is version 2 (older readers take it)
    cli.run("store", "put", "plain", str(src), "--no-xattrs")
    assert json.loads((store_dir / "snapshots" / "plain.json").read_text())["version"] == 2
    # bounded on load: an oversized or foreign-namespace xattr is damage, refused before any write
    import base64
    import blake3
    for bad in ({"system.posix_acl_access": "AA=="}, {"user.big": base64.b64encode(bytes(70 << 10)).decode()}):
        body = json.loads((store_dir / "snapshots" / "s.json").read_text())
        body["name"] = "forged"
        body["streams"][0]["attrs"]["xattrs"] = bad
        body.pop("checksum")
        body["checksum"] = blake3.blake3(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        (store_dir / "snapshots" / "forged.json").write_text(json.dumps(body))
        p = cli.run("store", "get", "forged", str(tmp_path / "never"), check=False)
        assert p.returncode != 0 and "damaged" in p.stderr and "xattr" in p.stderr, p.stderr
        assert not (tmp_path / "never").exists()


# ------------------------------------------------------------------------------------------- item 8
def _read_bytes(rep: dict) -> int:
    return int(rep["stages"].get("read", {}).get("bytes", 0))


def test_files_cache_skips_unchanged_files_and_survives_forgery(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    for i in range(4):
        (src / f"f{i}").write_bytes(os.urandom(1 << 20))
        os.utime(src / f"f{i}", ns=(1_700_000_000 * 10**9,) * 2)
    import time
    time.sleep(2.2)  # a file changed within 2 s of its scan is not cached (files_cache.RACY_NS)
    first = cli.json("store", "put", "a", str(src))
    assert first["files_unchanged"] == 0 and _read_bytes(first) == 4 << 20
    time_ok = cli.json("store", "put", "b", str(src))
    assert time_ok["files_unchanged"] == 4 and _read_bytes(time_ok) == 0
    ma = json.loads((store_dir / "snapshots" / "a.json").read_text())["streams"]
    mb = json.loads((store_dir / "snapshots" / "b.json").read_text())["streams"]
    assert [s["chunks"] for s in ma] == [s["chunks"] for s in mb]
    # a file rewritten with the same size and mtime: its ctime changed, so it is read again
    (src / "f1").write_bytes(os.urandom(1 << 20))
    os.utime(src / "f1", ns=(1_700_000_000 * 10**9,) * 2)
    c = cli.json("store", "put", "c", str(src))
    assert c["files_unchanged"] == 3 and _read_bytes(c) == 1 << 20
    cli.run("store", "get", "c", str(tmp_path / "outc"))
    assert (tmp_path / "outc" / "data" / "f1").read_bytes() == (src / "f1").read_bytes()
    # --force and --no-cache read everything
    assert _read_bytes(cli.json("store", "put", "d", str(src), "--force")) == 4 << 20
    assert _read_bytes(cli.json("store", "put", "e", str(src), "--no-cache")) == 4 << 20
    # a cache naming a chunk the store lacks (gc'd, or forged), or one that does not check: a re-read
    cache = store_dir / "files-cache.json"
    body = json.loads(cache.read_text())
    import blake3
    for path, e in body["entries"].items():
        e["chunks"][0][0] = "ab" * 32
    body["checksum"] = blake3.blake3(json.dumps(body["entries"], sort_keys=True, separators=(",", ":"))
                                     .encode()).hexdigest()
    cache.write_text(json.dumps(body))
    f = cli.json("store", "put", "f", str(src))
    assert f["files_unchanged"] == 0 and _read_bytes(f) == 4 << 20
    for forged in (b"{not json", json.dumps({**body, "checksum": "0" * 64}).encode()):
        cache.write_bytes(forged)
        g = cli.json("store", "put", "g", str(src), "--replace")
        assert g["files_unchanged"] == 0 and _read_bytes(g) == 4 << 20
    cache.unlink()
    cache.symlink_to(tmp_path / "elsewhere")
    h = cli.json("store", "put", "h", str(src))
    assert h["files_unchanged"] == 0
    cli.run("store", "verify")
    for n in ("f", "g", "h"):
        out = tmp_path / f"out{n}"
        cli.run("store", "get", n, str(out))
        for i in range(4):
            assert (out / "data" / f"f{i}").read_bytes() == (src / f"f{i}").read_bytes()


# ------------------------------------------------------------------------------------------- item 9
_HEAVY = ("numpy", "zstandard", "boto3", "botocore", "rich", "cuda", "pyroute2")


def _imported(args: list[str]) -> set[str]:
    p = subprocess.run([*GPUSNAP[:1], "-X", "importtime", *GPUSNAP[1:], *args], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}


def test_help_and_ls_import_only_what_they_need(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "data")
    cli.run("store", "put", "s", str(src))
    for args in (["--help"], ["store", "--help"], ["--store", str(cli.store), "store", "ls"],
                 ["--store", str(cli.store), "store", "ls", "s"]):
        heavy = {m for m in _imported(args) if m.split(".")[0] in _HEAVY}
        assert heavy == set(), (args, sorted(heavy))
    assert (REPO / "scripts" / "bench" / "bench_startup.py").is_file()


def test_lazy_listing_matches_the_commands() -> None:
    """The short helps `--help` lists without importing a command are each command's own."""
    import click
    import cli as top
    from cli import store_cmd
    for group in (top.main, store_cmd.store):
        cmds = group.load_all()
        for name, (_, _, short) in group.lazy.items():
            c = cmds[name]
            want = c.get_short_help_str(limit=150)
            assert short == want or (short.endswith("...") and want.startswith(short[:-3].rstrip())), (name, short, want)
        assert isinstance(cmds[next(iter(cmds))], click.Command)


# --------------------------------------------------------------------------------------- items 10-14
def test_reports_carry_the_whole_wall_time(cli: Cli, tmp_path: Path) -> None:
    src = _tree(tmp_path / "data")
    for args in (["store", "put", "s", str(src)], ["store", "get", "s", str(tmp_path / "out")]):
        rep = cli.json(*args)
        w = rep["wall"]
        assert w["total_s"] >= w["stages_s"] > 0 and w["startup_s"] > 0
        assert set(w["waits_s"]) >= {"locks"} and w["other_s"] >= 0
        assert abs(w["total_s"] - (w["startup_s"] + w["stages_s"] + sum(w["waits_s"].values()) + w["other_s"])) < 0.05
    text = cli.run("store", "put", "t", str(src)).stdout
    assert "wall " in text and "start-up" in text and "in the stages" in text


def test_help_words_match_behaviour(cli: Cli) -> None:
    run_help = " ".join(cli.run("runsc", "run", "--help").stdout.split())
    assert "store is never mounted" in run_help and "agent and the store" not in run_help
    for cmd in ("dump", "restore"):
        h = " ".join(cli.run("criu", cmd, "--help").stdout.split())
        assert "By default" in h and "stream" in h and "GPUSNAP_CRIU_IMAGES=staging" in h, h


@pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")
def test_criu_reports_and_the_pid_in_use_message(cli: Cli, store_dir: Path) -> None:
    from sandbox.criu.runner import find_criu
    if not find_criu():
        pytest.fail("CRIU >= 4 not installed: run scripts/setup.sh")
    from support.criu import Tree
    t = Tree()
    try:
        t.report()
        dump = cli.json("criu", "dump", str(t.pid), "c1", "--leave-running")
        assert dump["raw_bytes"] > 0 and "restored_pid" not in dump and dump["wall"]["total_s"] > 0
        p = cli.run("criu", "restore", "c1", check=False)
        assert p.returncode != 0 and "in use" in p.stderr and "namespace" not in p.stderr, p.stderr
        t.kill()
        t.reap()
        r = cli.json("criu", "restore", "c1")
        assert r["restored_pid"] == t.pid
        for dump_field in ("raw_bytes", "new_bytes", "dedup_bytes"):
            assert dump_field not in r
        if r["images_path"] == "stream":
            assert "absent_images" in r["stages"]["served"] and "refused" not in r["stages"]["served"]
        assert r["wall"]["total_s"] >= r["wall"]["stages_s"]
    finally:
        t.close()


# ------------------------------------------------------------------------------------------ item 16
def test_remote_words_as_git_and_restic_read_them(tmp_path: Path) -> None:
    from support.swift import CREDS, Node, drop_bucket, swift_start
    endpoint = swift_start()
    bucket = f"gpusnap-test-h2-{os.getpid()}"
    url = f"s3://{bucket}/words"
    try:
        a = Node(tmp_path / "A", endpoint, url)  # `remote add r URL`
        p = a.run("remote", "add", "r", f"s3://{bucket}/other", "--endpoint", endpoint, check=False)
        assert p.returncode == 1 and "--replace" in p.stderr and "already exists" in p.stderr
        assert a.json("remote", "list")[0]["url"] == url
        a.run("remote", "add", "r", f"s3://{bucket}/words2", "--endpoint", endpoint, "--replace")
        a.run("remote", "add", "r2", url, "--endpoint", endpoint)
        listed = a.run("remote", "list").stdout.splitlines()
        assert listed[0].split() == ["NAME", "URL", "ENDPOINT"] and [x.split()[0] for x in listed[1:]] == ["r", "r2"]
        src = _tree(tmp_path / "data")
        a.run("store", "put", "s1", str(src))
        a.run("push", "s1", "r2")
        ls = a.run("remote", "ls", "r2").stdout.splitlines()
        assert ls[0].split() == ["NAME", "KIND", "SIZE", "CREATED"] and ls[1].startswith("s1 ")
        p = a.run("remote", "rm", "s1", "r2", check=False)
        assert p.returncode == 2 and "remote forget" in p.stderr and "remote remove" in p.stderr
        assert [r["name"] for r in a.json("remote", "ls", "r2")] == ["s1"]  # nothing was deleted
        a.run("remote", "forget", "s1", "r2")
        assert a.json("remote", "ls", "r2") == []
        a.run("remote", "remove", "r2")
        assert [r["name"] for r in a.json("remote", "list")] == ["r"]
        p = a.run("remote", "remove", "r2", check=False)
        assert p.returncode == 1 and "no remote named" in p.stderr
        assert a.json("store", "ls")[0]["name"] == "s1"  # removing a remote touches no snapshot
        assert CREDS
    finally:
        drop_bucket(endpoint, bucket)


# ------------------------------------------------------------------------------------------ item 17
def test_export_refuses_a_terminal_and_pipes_close_quietly(cli: Cli, tmp_path: Path) -> None:
    import pty
    src = tmp_path / "data"
    src.mkdir()
    (src / "big").write_bytes(os.urandom(8 << 20))
    cli.run("store", "put", "s", str(src))
    master, slave = pty.openpty()
    try:
        p = subprocess.run([*GPUSNAP, "--store", str(cli.store), "store", "export", "s"], stdout=slave,
                           stderr=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath()},
                           timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    assert p.returncode == 2 and b"terminal" in p.stderr
    for args in (["store", "export", "s"], ["store", "cat", "s", "data/big"], ["--help"]):
        argv = " ".join([*GPUSNAP, "--store", str(cli.store), *args])
        sh = subprocess.run(["bash", "-c", f"set -o pipefail; {argv} | head -c 10 >/dev/null"], capture_output=True,
                            text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath()}, timeout=60)
        assert sh.stderr == "" and sh.returncode in (0, 141), (args, sh.returncode, sh.stderr)


def test_verify_subset_takes_n_of_t(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    (src / "r").write_bytes(os.urandom(40 << 20))
    cli.run("store", "put", "s", str(src), "--chunk-size", "1M")
    total = 0
    for n in (1, 2, 3):
        rep = cli.json("store", "verify", "--read-data-subset", f"{n}/3")
        assert rep["ok"] and rep["chunks_checked"] + rep["chunks_unchecked"] == rep["chunks_total"] == 40
        total += rep["chunks_checked"]
    assert total == 40  # the three groups cover every chunk exactly once
    again = cli.json("store", "verify", "--read-data-subset", "2/3")["chunks_checked"]
    assert again == cli.json("store", "verify", "--read-data-subset", "2/3")["chunks_checked"]  # fixed groups
    for bad in ("0/3", "4/3", "x/3", "1/0"):
        assert cli.run("store", "verify", "--read-data-subset", bad, check=False).returncode == 2
    assert cli.json("store", "verify", "--read-data-subset", "50%")["chunks_checked"] == 20


def test_nonroot_criu_dump_exits_4_and_makes_nothing(tmp_path: Path, nobody_pythonpath: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a command as nobody")
    store = tmp_path / "st"
    tmp_path.chmod(0o777)
    p = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *GPUSNAP,
                        "--store", str(store), "criu", "dump", str(os.getpid()), "x"], capture_output=True, text=True,
                       cwd="/", env={**os.environ, "PYTHONPATH": nobody_pythonpath}, timeout=60)
    assert p.returncode == 4 and "needs root" in p.stderr, (p.returncode, p.stderr)
    assert not store.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="CRIU needs root")
def test_failed_dump_leaves_no_name_lock_and_lock_status_lists_held_locks(cli: Cli, store_dir: Path,
                                                                            tmp_path: Path) -> None:
    src = _tree(tmp_path / "data")
    cli.run("store", "put", "s", str(src))
    # a dump that fails (no such process) after the store exists
    p = cli.run("criu", "dump", "4194000", "failed", check=False)
    assert p.returncode != 0
    assert not (store_dir / "names" / "failed.lock").exists()
    # a put that fails while it holds its name's lock (a file removed between scan and read)
    pause = tmp_path / "pause"
    pause.mkdir()
    e = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE_AFTER_SCAN": str(pause)}
    proc = subprocess.Popen([*GPUSNAP, "--store", str(store_dir), "store", "put", "s2", str(src), "--no-cache"], cwd=REPO, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    import time
    deadline = time.monotonic() + 60
    while not (pause / "scanned").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    (src / "b.bin").unlink()
    (pause / "go").touch()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "changed while" in err, err
    assert not (store_dir / "names" / "s2.lock").exists()
    assert cli.json("store", "lock", "status") == []
    assert cli.run("store", "lock", "status").stdout.strip() == "no locks held"
    every = cli.json("store", "lock", "status", "--all")
    assert {r["name"] for r in every} == {None, "s"} and not any(r["held"] for r in every)
