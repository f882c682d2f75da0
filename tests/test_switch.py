"""What a restic or borg user expects when switching (issue 60), through the real CLI: POSIX ACLs kept,
global --json, hard-link names, name templates and `latest`, retention by age and tag, an automatic
parent, --skip-damaged, verify --quick, exit codes, aligned listings."""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from conftest import GPUSNAP, Cli

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (setpriv to another user)")
have_acl = pytest.mark.skipif(shutil.which("setfacl") is None, reason="setfacl (Debian's acl package) missing")
NOBODY = 65534


def _getfacl(path: Path) -> list[str]:
    """The ACL entries of PATH as getfacl prints them (without the comment header)."""
    out = subprocess.run(["getfacl", "--omit-header", "--absolute-names", "--numeric", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return [ln for ln in out.splitlines() if ln]


def _acl_tree(root: Path) -> Path:
    src = root / "data"
    (src / "sub").mkdir(parents=True)
    (src / "f").write_text("secret\n")
    (src / "plain").write_text("no acl\n")
    subprocess.run(["setfacl", "-m", f"u:{NOBODY}:r,g:{NOBODY}:rw", str(src / "f")], check=True)
    subprocess.run(["setfacl", "-d", "-m", f"u:{NOBODY}:rx", str(src / "sub")], check=True)
    subprocess.run(["setfacl", "-m", f"g:{NOBODY}:rx", str(src / "sub")], check=True)
    return src


def _check_acls(src: Path, out: Path) -> None:
    for rel in ("f", "plain", "sub"):
        assert _getfacl(out / rel) == _getfacl(src / rel), rel
    assert f"user:{NOBODY}:r--" in _getfacl(out / "f")
    assert f"default:user:{NOBODY}:r-x" in _getfacl(out / "sub")
    assert not any(ln.startswith("user:") and ln != "user::rw-" for ln in _getfacl(out / "plain"))


@have_acl
def test_acls_access_and_default_round_trip(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = _acl_tree(tmp_path)
    cli.run("store", "put", "s", str(src))
    body = json.loads((store_dir / "snapshots" / "s.json").read_text())
    assert body["version"] == 4  # ACLs: version 4, older readers refuse it by its version
    xa = {s["name"]: s["attrs"].get("xattrs", {}) for s in body["streams"]}
    assert "system.posix_acl_access" in xa["data/f"] and "system.posix_acl_default" in xa["data/sub"]
    assert not any(n.startswith("system.") for n in xa["data/plain"])
    cli.run("store", "get", "s", str(tmp_path / "out"))
    _check_acls(src, tmp_path / "out" / "data")
    # a file made later under the restored directory inherits its default ACL, as under the original
    (tmp_path / "out" / "data" / "sub" / "new").write_text("x")
    assert f"user:{NOBODY}:r-x" in " ".join(_getfacl(tmp_path / "out" / "data" / "sub" / "new"))
    # --no-xattrs keeps none (and the manifest stays version 2)
    cli.run("store", "put", "bare", str(src), "--no-xattrs")
    assert json.loads((store_dir / "snapshots" / "bare.json").read_text())["version"] == 2


_GOOD_ACL = b"\x02\x00\x00\x00" + b"".join(  # user::rw- group::r-- other::r--
    t.to_bytes(2, "little") + p.to_bytes(2, "little") + b"\xff\xff\xff\xff" for t, p in ((1, 6), (4, 4), (0x20, 4)))


@have_acl
@pytest.mark.parametrize("stream,name,value,why", [
    ("data/f", "system.posix_acl_access", b"\x02\x00\x00\x00\x40\x00\x07\x00\xff\xff\xff\xff", "unknown tag"),
    ("data/f", "system.posix_acl_access", _GOOD_ACL[:-3], "bad length"),
    ("data/plain", "system.posix_acl_default", _GOOD_ACL, "on a file"),
    ("data/plain", "system.nfs4_acl", _GOOD_ACL, "bad xattr"),
])
def test_a_malformed_acl_is_damage(cli: Cli, store_dir: Path, tmp_path: Path, stream: str, name: str,
                                   value: bytes, why: str) -> None:
    from support.crafted import rewrite_manifest
    src = _acl_tree(tmp_path)
    cli.run("store", "put", "s", str(src))

    def spoil(body: dict) -> None:
        for s in body["streams"]:
            if s["name"] == stream:
                s["attrs"].setdefault("xattrs", {})[name] = base64.b64encode(value).decode()
    rewrite_manifest(store_dir / "snapshots" / "s.json", spoil)
    p = cli.run("store", "get", "s", str(tmp_path / "out"), check=False)
    assert p.returncode == 3 and why in p.stderr, p.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture
def user_top() -> Iterator[Path]:
    top = Path(tempfile.mkdtemp(prefix="gpusnap-switch-"))
    top.chmod(0o755)
    try:
        yield top
    finally:
        shutil.rmtree(top, ignore_errors=True)


@root_only
@have_acl
def test_acls_round_trip_as_a_user(user_top: Path, nobody_pythonpath: str) -> None:
    """Put and get run as an unprivileged user (setpriv to nobody) on that user's own files."""
    src = _acl_tree(user_top)
    subprocess.run(["chown", "-R", f"{NOBODY}:{NOBODY}", str(src)], check=True)
    (user_top / "work").mkdir()
    os.chown(user_top / "work", NOBODY, NOBODY)
    env = {**os.environ, "PYTHONPATH": nobody_pythonpath, "PYTHONDONTWRITEBYTECODE": "1"}
    store = user_top / "work" / "store"

    def as_nobody(*args: str) -> None:
        p = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                            *GPUSNAP, "--store", str(store), *args], cwd="/", env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
    as_nobody("store", "put", "s", str(src))
    as_nobody("store", "get", "s", str(user_top / "work" / "out"))
    out = user_top / "work" / "out" / "data"
    assert (out / "f").stat().st_uid == NOBODY
    _check_acls(src, out)


def test_json_is_accepted_before_the_command(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    (src / "f").write_text("x")
    cli.run("store", "put", "s", str(src))
    rows = json.loads(cli.run("--json", "store", "ls").stdout)
    assert [r["name"] for r in rows] == ["s"]
    assert json.loads(cli.run("--json", "store", "ls", "s").stdout)[1]["path"] == "data/f"
    p = cli.run("--json", "store", "inspect", "missing", check=False)  # errors too, as JSON on stdout
    assert p.returncode == 1 and json.loads(p.stdout)["exit_code"] == 1
    assert "s" in cli.run("store", "ls").stdout and not cli.run("store", "ls").stdout.startswith("[")


def test_cat_and_ls_of_every_name_of_a_hard_linked_file(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "data"
    (src / "d").mkdir(parents=True)
    (src / "a").write_bytes(b"linked bytes\n" * 1000)
    os.chmod(src / "a", 0o640)
    os.link(src / "a", src / "d" / "b")
    cli.run("store", "put", "s", str(src))
    for name in ("data/a", "data/d/b"):
        p = subprocess.run([*GPUSNAP, "--store", str(cli.store), "store", "cat", "s", name], capture_output=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                           cwd=Path(__file__).resolve().parents[1])
        assert p.returncode == 0 and p.stdout == b"linked bytes\n" * 1000, p.stderr
    rows = {r["path"]: r for r in cli.json("store", "ls", "s")}
    assert rows["data/d/b"]["type"] == "hardlink" and rows["data/d/b"]["target"] == "data/a"
    assert (rows["data/d/b"]["mode"], rows["data/d/b"]["size"]) == (0o640, 13000)
    line = next(ln for ln in cli.run("store", "ls", "s").stdout.splitlines() if "data/d/b" in ln)
    assert line.startswith("-rw-r-----") and "13000" in line and "hard link of data/a" in line and "?" not in line


def test_name_templates_and_latest(cli: Cli, tmp_path: Path) -> None:
    import re
    import socket
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "f").write_text(d.name)
    r = cli.json("store", "put", "n-{now}-{hostname}", str(a), "--tag", "nightly")
    host = re.sub(r"[^A-Za-z0-9_.+=@-]", "-", socket.gethostname())
    assert re.fullmatch(rf"n-\d{{4}}-\d\d-\d\dT\d\d-\d\d-\d\d-{re.escape(host)}", r["name"]), r["name"]
    assert re.fullmatch(r"u-\d{8}", cli.json("store", "put", "u-{utcnow:%Y%m%d}", str(a))["name"])
    cli.run("store", "put", "second", str(b))
    # latest: the newest of this host; --path and --tag narrow it
    assert cli.run("store", "cat", "latest", "b/f").stdout == "b"
    assert cli.json("store", "inspect", "latest")["name"] == "second"
    assert cli.json("store", "inspect", "latest", "--path", str(a))["name"].startswith("u-")
    assert cli.json("store", "inspect", "latest", "--tag", "nightly")["name"] == r["name"]
    assert [x["path"] for x in cli.json("store", "ls", "latest", "--tag", "nightly")] == ["a", "a/f"]
    assert cli.json("store", "inspect", "latest", "--host", "*")["name"] == "second"
    cli.run("store", "get", "latest", str(tmp_path / "out"), "--path", str(a), "--tag", "nightly")
    assert (tmp_path / "out" / "a" / "f").read_text() == "a"
    p = cli.run("store", "get", "latest", str(tmp_path / "none"), "--host", "elsewhere", check=False)
    assert p.returncode == 1 and "no files snapshot for `latest`" in p.stderr
    p = cli.run("store", "inspect", "second", "--tag", "nightly", check=False)
    assert p.returncode == 2  # --tag with a plain name: a usage error
    # bad templates and names: usage errors (2), nothing made
    for bad in ("x-{nope}", "latest", "{now:%H:%M}", "../x"):
        p = cli.run("store", "put", bad, str(a), check=False)
        assert p.returncode == 2, (bad, p.stderr)
    assert len(cli.json("store", "ls")) == 3


def test_forget_keep_within_and_keep_tag(cli: Cli, store_dir: Path) -> None:
    from support.archive import committed_snapshot as _snap
    times = {"a": "2026-11-30T10:00:00+00:00", "b": "2026-11-29T11:00:00+00:00", "c": "2026-11-29T09:00:00+00:00",
             "d": "2026-10-15T12:00:00+00:00", "e": "2026-09-01T12:00:00+00:00"}
    for n, t in times.items():
        _snap(store_dir, n, t, n.encode(), tags=("release", "llama") if n == "d" else ("llama",) if n == "e" else ())
    # within 1d of the newest (a, 11-30 10:00): a and b (11-29 11:00), not c (11-29 09:00)
    plan = cli.json("store", "forget", "--keep-within", "1d", "--dry-run")
    assert sorted(k["name"] for k in plan["keep"]) == ["a", "b"] and sorted(plan["remove"]) == ["c", "d", "e"]
    assert dict((k["name"], k["reasons"]) for k in plan["keep"])["b"] == ["within 1d"]
    # months by the calendar: 2m before 11-30 is 09-30, so d (10-15) is in, e (09-01) out
    plan = cli.json("store", "forget", "--keep-within", "2m", "--dry-run")
    assert sorted(plan["remove"]) == ["e"]
    # --keep-tag: every snapshot carrying the tag (with commas: all of them)
    plan = cli.json("store", "forget", "--keep-last", "1", "--keep-tag", "release,llama", "--dry-run")
    assert sorted(k["name"] for k in plan["keep"]) == ["a", "d"]
    plan = cli.json("store", "forget", "--keep-tag", "llama", "--keep-within", "1h", "--dry-run")
    assert sorted(k["name"] for k in plan["keep"]) == ["a", "d", "e"]
    out = cli.run("store", "forget", "--keep-within", "1d", "--keep-tag", "llama")
    assert "remove c" in out.stdout
    assert sorted(r["name"] for r in cli.json("store", "ls")) == ["a", "b", "d", "e"]
    for bad in ("1x", "", "5", "1d2y"):
        p = cli.run("store", "forget", "--keep-within", bad, check=False)
        assert p.returncode == 2 and "duration" in p.stderr, (bad, p.stderr)
    p = cli.run("store", "forget", "--keep-tag", "bad tag", check=False)
    assert p.returncode == 2


def test_put_chooses_its_parent_and_skips_unchanged_files(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    import random
    src, other = tmp_path / "data", tmp_path / "other"
    src.mkdir()
    other.mkdir()
    rnd = random.Random(5)
    for i in range(4):
        (src / f"f{i}").write_bytes(rnd.randbytes(3 << 20))
    (other / "x").write_bytes(b"x")
    import time
    time.sleep(2.2)  # a file changed within 2 s of its scan is not cached (files_cache.RACY_NS)
    first = cli.json("store", "put", "b1", str(src))
    assert first["parent"] is None
    cli.run("store", "put", "o1", str(other))  # newer, but of other paths: not b1's successor's parent
    with open(src / "f2", "r+b") as f:  # a small write in one file
        f.seek(1 << 20)
        f.write(b"changed" * 100)
    time.sleep(2.2)
    r = cli.json("store", "put", "b2", str(src))
    assert r["parent"] == "b1" and r["files_unchanged"] == 3
    assert r["new_bytes"] < 64 << 10, r["new_bytes"]  # a delta of the changed chunk, not the 3 MB file
    assert "parent b2" in cli.run("store", "put", "b2x", str(src)).stdout  # the newest of the same paths
    # an identical re-backup reads no file (the files cache) and writes nothing
    same = cli.json("store", "put", "b3", str(src))
    assert same["files_unchanged"] == 4 and same["new_bytes"] == 0 and same["stages"].get("read", {}).get("bytes", 0) == 0
    # --no-parent: every changed chunk whole; --parent latest: the newest of the same paths
    with open(src / "f1", "r+b") as f:
        f.write(b"again" * 100)
    whole = cli.json("store", "put", "b4", str(src), "--no-parent")
    assert whole["parent"] is None and whole["new_bytes"] > 1 << 20
    assert cli.json("store", "put", "b5", str(src), "--parent", "latest")["parent"] == "b4"
    p = cli.run("store", "put", "b6", str(src), "--parent", "b1", "--no-parent", check=False)
    assert p.returncode == 2
    cli.run("store", "get", "b4", str(tmp_path / "out"))
    assert (tmp_path / "out" / "data" / "f1").read_bytes() == (src / "f1").read_bytes()
    assert cli.run("store", "verify").returncode == 0


def _damaged_store(cli: Cli, store_dir: Path, tmp_path: Path) -> tuple[Path, str]:
    """A snapshot of four files and a hard link to one of them, one pack entry of that file flipped;
    returns the source tree and the damaged file's stream name."""
    import random
    from support.entries import chunk_entries
    src = tmp_path / "data"
    src.mkdir()
    rnd = random.Random(7)
    for i in range(4):
        (src / f"f{i}").write_bytes(rnd.randbytes(200_000 + i))
    os.link(src / "f2", src / "f2-link")
    cli.run("store", "put", "s", str(src))
    ids = {s["name"]: s for s in cli.json("store", "inspect", "s")["streams"]}
    assert ids["data/f2"]["chunks"] == 1
    body = json.loads((store_dir / "snapshots" / "s.json").read_text())
    cid = next(x for x in body["streams"] if x["name"] == "data/f2")["chunks"][0][0]
    next(e for e in chunk_entries(store_dir) if e.cid == cid).flip_payload(0.5)
    return src, "data/f2"


def test_get_skip_damaged_salvages_the_sound_files(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src, bad = _damaged_store(cli, store_dir, tmp_path)
    p = cli.run("store", "get", "s", str(tmp_path / "all"), check=False)
    assert p.returncode == 3 and not (tmp_path / "all").exists()  # all or nothing by default
    p = cli.run("store", "get", "s", str(tmp_path / "out"), "--skip-damaged", check=False)
    assert p.returncode == 3, p.stderr
    err = p.stderr.splitlines()
    assert "gpusnap: damaged, not restored: data/f2" in err and "gpusnap: damaged, not restored: data/f2-link" in err
    out = tmp_path / "out" / "data"
    assert sorted(x.name for x in out.iterdir()) == ["f0", "f1", "f3"]
    for n in ("f0", "f1", "f3"):
        assert (out / n).read_bytes() == (src / n).read_bytes()
    rep = json.loads(cli.run("store", "get", "s", str(tmp_path / "out2"), "--skip-damaged", "--json",
                             check=False).stdout)
    assert rep["damaged_not_restored"] == ["data/f2", "data/f2-link"]
    # a sound snapshot: --skip-damaged restores all and exits 0
    cli.run("store", "put", "t", str(tmp_path / "out"))
    assert cli.json("store", "get", "t", str(tmp_path / "t"), "--skip-damaged")["damaged_not_restored"] == []


def test_verify_quick_checks_structure_without_reading_chunks(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    from support.entries import chunk_entries
    _damaged_store(cli, store_dir, tmp_path)
    q = cli.json("store", "verify", "--quick")
    assert q["ok"] and q["quick"] and q["chunks_checked"] == 0 and q["bytes_checked"] == 0  # rot is not its job
    assert "none read" in cli.run("store", "verify", "--quick").stdout
    full = cli.run("store", "verify", check=False)
    assert full.returncode == 3
    # a missing chunk and a damaged manifest are structure: found
    body = json.loads((store_dir / "snapshots" / "s.json").read_text())
    cid = next(x for x in body["streams"] if x["name"] == "data/f0")["chunks"][0][0]
    next(e for e in chunk_entries(store_dir) if e.cid == cid).remove()
    p = cli.run("store", "verify", "--quick", check=False)
    assert p.returncode == 3 and "data/f0" in p.stdout and "missing" in p.stdout, p.stdout
    (store_dir / "snapshots" / "s.json").write_text("{")
    p = cli.run("store", "verify", "--quick", check=False)
    assert p.returncode == 3 and "does not parse" in p.stdout, p.stdout
    p = cli.run("store", "verify", "--quick", "--read-data", check=False)
    assert p.returncode == 2


def test_ls_columns_align_and_every_kind_is_accepted(cli: Cli, tmp_path: Path) -> None:
    import re
    from cli.common import SNAPSHOT_KINDS
    from sandbox.containers.checkpoint_archive import CheckpointKind
    from sandbox.ops.snapshot_meta import SnapshotKind
    assert set(SNAPSHOT_KINDS) == {k.value for k in SnapshotKind} | {k.value for k in CheckpointKind}
    src = tmp_path / "data"
    src.mkdir()
    (src / "f").write_text("x")
    cli.run("store", "put", "a-rather-long-snapshot-name-for-the-columns", str(src))
    cli.run("store", "put", "s", str(src))
    lines = cli.run("store", "ls").stdout.splitlines()
    assert lines[0].split() == ["NAME", "KIND", "SIZE", "STREAMS", "CREATED", "HOST", "PATHS"]
    starts = [ln.index("files") for ln in lines[1:]]
    assert starts == [lines[0].index("KIND")] * 2  # aligned however long the names
    for ln in lines[1:]:
        assert re.search(r"  \d{4}-\d\d-\d\d \d\d:\d\d:\d\d  ", ln) and ln.endswith(str(src)), ln
    assert all(r["paths"] == [str(src)] for r in cli.json("store", "ls"))
    for kind in SNAPSHOT_KINDS:
        p = cli.run("store", "ls", "--kind", kind)
        assert p.returncode == 0
        cli.run("store", "forget", "--kind", kind, "--keep-last", "1", "--dry-run")
    assert [r["name"] for r in cli.json("store", "ls", "--kind", "podman-checkpoint")] == []


def test_adding_the_same_remote_twice_is_no_error(cli: Cli, tmp_path: Path) -> None:
    from support.hostile_remote import CREDS, Hostile
    server = Hostile(tmp_path)
    try:
        cli.run("store", "init")
        args = ("remote", "add", "r", "s3://bkt/p", "--endpoint", server.endpoint)
        cli.run(*args, env=CREDS)
        p = cli.run(*args, env=CREDS)  # as written again, e.g. a re-run of the README's remote block
        assert "(already so)" in p.stdout
        p = cli.run("remote", "add", "r", "s3://bkt/other", "--endpoint", server.endpoint, env=CREDS, check=False)
        assert p.returncode == 1 and "another configuration" in p.stderr
        assert [r["url"] for r in cli.json("remote", "list")] == ["s3://bkt/p"]
    finally:
        server.close()


def test_exit_codes_and_report_figures(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "data"
    src.mkdir()
    (src / "f").write_text("tiny")
    out = cli.run("store", "put", "s", str(src)).stdout
    assert "GB/s" not in out.splitlines()[0]  # no `(0.00 GB/s)` for a put that is all start-up
    for args in (("store", "get", "../x", str(tmp_path / "o")), ("store", "inspect", "a/b"), ("store", "cat", ".x", "f"),
                 ("store", "forget"), ("store", "forget", "--keep-within", "3x"), ("store", "ls", "s", "--kind", "gpu")):
        p = cli.run(*args, check=False)
        assert p.returncode == 2, (args, p.returncode, p.stderr)
    cli.run("store", "rm", "s")
    gc = cli.run("store", "gc").stdout
    assert gc.startswith("freed ") and "unreferenced chunks removed" in gc and "never indexed" in gc
