"""Trust boundaries of `store put` and `store get` on real files: a manifest cannot make get write
outside DEST (or criu restore outside its staging), a tree changed between put's scan and its reads
is refused (never a silent swap, never a FIFO hang), owners and special bits follow tar's rules,
hard links stay links, and get fsyncs what it wrote before renaming it into place."""
from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

from conftest import GPUSNAP, REPO, Cli, pythonpath
from support.crafted import rewrite_manifest

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (owners, chown)")


def _outside(tmp_path: Path) -> tuple[Path, os.stat_result]:
    out = tmp_path / "outside"
    out.mkdir(mode=0o755)
    os.utime(out, ns=(10**18, 10**18))
    return out, out.stat()


def _stream(name: str, **attrs: object) -> dict:
    return {"name": name, "size": 0, "attrs": attrs, "chunks": []}


def _link_through(cli: Cli, store_dir: Path, tmp_path: Path, name: str, outside: Path, kind: str = "files",
                  child_first: bool = False) -> None:
    """Snapshot NAME: a real put, then streams x/l (symlink to OUTSIDE), x/l/pwned.txt (setuid, with the
    data chunk of a real file) and x/l/newdir (0777) added, checksum recomputed."""
    src = tmp_path / f"src-{name}"
    (src / "x").mkdir(parents=True)
    (src / "x" / "data").write_bytes(os.urandom(5000))
    cli.run("store", "put", name, str(src))

    def change(body: dict) -> None:
        data = next(s for s in body["streams"] if s["name"].endswith("/x/data"))
        base = data["name"].rsplit("/", 2)[0]
        evil = [_stream(f"{base}/x/l", type="symlink", target=str(outside), mode=0o777, mtime_ns=0),
                {**data, "name": f"{base}/x/l/pwned.txt", "attrs": {**data["attrs"], "mode": 0o4755, "uid": 0}},
                _stream(f"{base}/x/l/newdir", type="dir", mode=0o777, mtime_ns=0)]
        body["streams"] += evil[1:] + evil[:1] if child_first else evil
        body["meta"]["kind"] = kind
    rewrite_manifest(store_dir / "snapshots" / f"{name}.json", change)


def _untouched(outside: Path, before: os.stat_result) -> None:
    assert list(outside.iterdir()) == []
    after = outside.stat()
    assert (after.st_mode, after.st_mtime_ns) == (before.st_mode, before.st_mtime_ns)


@pytest.mark.parametrize("child_first", [False, True])
def test_link_through_manifest_is_damage_and_get_writes_nothing(cli: Cli, store_dir: Path, tmp_path: Path,
                                                                child_first: bool) -> None:
    outside, before = _outside(tmp_path)
    _link_through(cli, store_dir, tmp_path, "evil", outside, child_first=child_first)
    v = cli.run("store", "verify", "evil", check=False)
    assert v.returncode == 3 and "lies under" in v.stdout and "a symlink" in v.stdout, (v.stdout, v.stderr)
    dest = tmp_path / "dest"
    g = cli.run("store", "get", "evil", str(dest), check=False)
    assert g.returncode != 0 and "lies under" in g.stderr and len(g.stderr.splitlines()) == 1, g.stderr
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".dest")]
    _untouched(outside, before)


def test_sink_itself_never_writes_through_a_link(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """Defence in depth: a Manifest built in memory (no load-time check) still cannot escape DEST."""
    from storage.pipeline import put as pipeline
    from storage.archive.filetree import FileTreeError, FileTreeSink
    from storage.format.manifest import Manifest, Stream
    from storage.repo.store import SnapshotStore
    outside, before = _outside(tmp_path)
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(b"payload")
    cli.run("store", "put", "good", str(src))
    st = SnapshotStore(str(store_dir), create=False)
    good = st.load("good")
    f = next(s for s in good.streams if s.name == "src/f")
    evil = Manifest("evil", [Stream("x", {"type": "dir", "mode": 0o755}),
                             Stream("x/l", {"type": "symlink", "target": str(outside)}),
                             Stream("x/l/pwned", {"type": "file", "mode": 0o4755}, f.chunks),
                             Stream("x/l/d", {"type": "dir", "mode": 0o777})])
    dest = tmp_path / "dest"
    with pytest.raises(FileTreeError, match="link or not a directory"):
        pipeline.get(st, evil, FileTreeSink(str(dest)))
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".dest")]
    _untouched(outside, before)


@root_only
def test_criu_restore_staging_refuses_link_through(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    outside, before = _outside(tmp_path)
    _link_through(cli, store_dir, tmp_path, "evilcriu", outside, kind="criu")

    def as_criu(body: dict) -> None:
        body["meta"] = {"kind": "criu", "root_pid": 4194000, "pids": [4194000], "cuda_pids": [], "options": [],
                        "gpu_path": None, "criu": "4.1.1"}
    rewrite_manifest(store_dir / "snapshots" / "evilcriu.json", as_criu)
    stage = tmp_path / "stage"
    stage.mkdir()
    r = cli.run("criu", "restore", "evilcriu", "--staging", str(stage), check=False)
    assert r.returncode != 0 and "lies under" in r.stderr, r.stderr
    assert list(stage.iterdir()) == []
    _untouched(outside, before)


class _Paused:
    """`store put` as a real subprocess, held by the GPUSNAP_TEST_PAUSE_AFTER_SCAN hook between its scan
    and its reads."""

    def __init__(self, cli: Cli, tmp_path: Path, name: str, src: Path) -> None:
        self.hook = tmp_path / f"hook-{name}"
        self.hook.mkdir()
        env = {**os.environ, "PYTHONPATH": pythonpath(), "GPUSNAP_TEST_PAUSE_AFTER_SCAN": str(self.hook)}
        self.p = subprocess.Popen([*GPUSNAP, "--store", str(cli.store), "store", "put", name, str(src)], cwd=REPO,
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not (self.hook / "scanned").exists():
            assert self.p.poll() is None, self.p.communicate()
            assert time.monotonic() < deadline, "put never finished its scan"
            time.sleep(0.01)

    def go(self, timeout: float = 20) -> tuple[int, str]:
        (self.hook / "go").touch()
        _, err = self.p.communicate(timeout=timeout)  # a hang (FIFO read) fails here
        return self.p.returncode, err


@root_only
def test_put_refuses_a_directory_swapped_for_a_symlink_after_the_scan(cli: Cli, store_dir: Path,
                                                                     tmp_path: Path) -> None:
    secret = tmp_path / "rootonly"
    secret.mkdir(mode=0o700)
    (secret / "f.txt").write_text("root's secret\n")
    (secret / "f.txt").chmod(0o600)
    src = tmp_path / "userdir"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.txt").write_text("user data\n")
    put = _Paused(cli, tmp_path, "swap", src)
    (src / "sub").rename(src / "sub.old")
    (src / "sub").symlink_to(secret)
    rc, err = put.go()
    assert rc == 1 and f"{src}/sub changed while it was being stored" in err and len(err.splitlines()) == 1, err
    assert not (store_dir / "snapshots" / "swap.json").exists()


@root_only
def test_put_refuses_a_file_replaced_after_the_scan(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "userdir"
    src.mkdir()
    (src / "a.txt").write_text("what was scanned\n")
    (tmp_path / "other.txt").write_text("something else\n")
    put = _Paused(cli, tmp_path, "repl", src)
    os.replace(tmp_path / "other.txt", src / "a.txt")
    rc, err = put.go()
    assert rc == 1 and f"{src}/a.txt changed while it was being stored (replaced by another file)" in err, err
    assert not (store_dir / "snapshots" / "repl.json").exists()


@root_only
@pytest.mark.parametrize("how", ["grown", "truncated"])
def test_put_refuses_a_file_whose_size_changed_after_the_scan(cli: Cli, store_dir: Path, tmp_path: Path,
                                                               how: str) -> None:
    """The same file (same inode) grown or truncated between the scan and its read: what would be read
    is no file that existed as scanned, so the put fails naming it, and nothing is committed."""
    src = tmp_path / "userdir"
    src.mkdir()
    (src / "log.bin").write_bytes(os.urandom(100_000))
    put = _Paused(cli, tmp_path, how, src)
    with open(src / "log.bin", "r+b") as f:
        if how == "grown":
            f.seek(0, 2)
            f.write(b"appended after the scan")
        else:
            f.truncate(40_000)
    rc, err = put.go()
    assert rc == 1 and f"{src}/log.bin changed while it was being stored (100000 bytes when scanned" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (store_dir / "snapshots" / f"{how}.json").exists()


def test_put_refuses_a_fifo_swapped_in_and_does_not_hang(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "userdir"
    src.mkdir()
    (src / "data.bin").write_bytes(os.urandom(10000))
    put = _Paused(cli, tmp_path, "fifo", src)
    (src / "data.bin").unlink()
    os.mkfifo(src / "data.bin")
    t0 = time.monotonic()
    rc, err = put.go(timeout=20)
    assert rc == 1 and "was a file, now a FIFO" in err and str(src / "data.bin") in err, err
    assert time.monotonic() - t0 < 10
    assert not (store_dir / "snapshots" / "fifo.json").exists()


def test_put_stores_a_fifo_present_at_scan_without_opening_it(cli: Cli, tmp_path: Path) -> None:
    """A FIFO is an entry (as tar stores it): never opened, so no writer-less FIFO blocks the put."""
    src = tmp_path / "userdir"
    src.mkdir()
    os.mkfifo(src / "pipe")
    cli.run("store", "put", "f", str(src), timeout=30)
    assert [r["type"] for r in cli.json("store", "ls", "f") if r["path"] == "userdir/pipe"] == ["fifo"]


def _setuid_tree(tmp_path: Path) -> Path:
    src = tmp_path / "bin"
    src.mkdir()
    tool = src / "tool"
    tool.write_bytes(b"\x7fELF pretend\n")
    os.chown(tool, 1234, 1235)
    tool.chmod(0o6755)
    d = src / "shared"
    d.mkdir()
    os.chown(d, 1234, 1235)
    d.chmod(0o2775)
    return src


@root_only
def test_owner_and_setuid_restored_as_root(cli: Cli, tmp_path: Path) -> None:
    cli.run("store", "put", "s", str(_setuid_tree(tmp_path)))
    cli.run("store", "get", "s", str(tmp_path / "out"))
    st = (tmp_path / "out" / "bin" / "tool").stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1234, 1235, 0o6755)
    d = (tmp_path / "out" / "bin" / "shared").stat()
    assert (d.st_uid, d.st_gid, stat.S_IMODE(d.st_mode)) == (1234, 1235, 0o2775)


@root_only
def test_no_same_owner_strips_setuid_and_setgid(cli: Cli, tmp_path: Path) -> None:
    cli.run("store", "put", "s", str(_setuid_tree(tmp_path)))
    cli.run("store", "get", "s", str(tmp_path / "out"), "--no-same-owner")
    st = (tmp_path / "out" / "bin" / "tool").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)
    d = (tmp_path / "out" / "bin" / "shared").stat()
    assert (d.st_uid, stat.S_IMODE(d.st_mode)) == (0, 0o775)


@root_only
def test_setuid_without_recorded_owner_is_stripped(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """A version 1 manifest (no owners recorded), as written before owners were: a setuid file in it
    is not restored as a root-owned setuid binary."""
    cli.run("store", "put", "old", str(_setuid_tree(tmp_path)))

    def as_v1(body: dict) -> None:
        body["version"] = 1
        for s in body["streams"]:
            s["attrs"].pop("uid", None)
            s["attrs"].pop("gid", None)
    rewrite_manifest(store_dir / "snapshots" / "old.json", as_v1)
    cli.run("store", "get", "old", str(tmp_path / "out"))
    st = (tmp_path / "out" / "bin" / "tool").stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o755)


@root_only
def test_non_root_get_restores_no_owner_and_strips_what_is_not_its_own(tmp_path: Path, nobody_pythonpath: str) -> None:
    """`store get` run as an unprivileged user (setpriv to nobody): nothing is chowned, the setuid
    file of uid 1234 loses its special bits, a setuid file the user already owns keeps them."""
    import shutil
    import tempfile
    nobody = 65534
    top = Path(tempfile.mkdtemp(prefix="gpusnap-trust-"))
    try:
        top.chmod(0o755)
        src = _setuid_tree(top)
        mine = src / "mine"
        mine.write_bytes(b"nobody's own tool\n")
        os.chown(mine, nobody, nobody)
        mine.chmod(0o4755)
        cli = Cli(top / "store")
        cli.run("store", "put", "s", str(src))
        out = top / "restore"
        out.mkdir()
        for d in (cli.store, out):
            subprocess.run(["chown", "-R", f"{nobody}:{nobody}", str(d)], check=True)
        env = {**os.environ, "PYTHONPATH": nobody_pythonpath, "PYTHONDONTWRITEBYTECODE": "1"}
        p = subprocess.run(["setpriv", f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups", "--",
                            *GPUSNAP, "--store", str(cli.store), "store", "get", "s", str(out / "d")],
                           cwd="/", env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        tool, own = (out / "d" / "bin" / "tool").stat(), (out / "d" / "bin" / "mine").stat()
        assert (tool.st_uid, stat.S_IMODE(tool.st_mode)) == (nobody, 0o755)
        assert (own.st_uid, stat.S_IMODE(own.st_mode)) == (nobody, 0o4755)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_hard_links_stay_links(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "t"
    (src / "d").mkdir(parents=True)
    (src / "a").write_bytes(os.urandom(300_000))
    os.link(src / "a", src / "d" / "b")
    (src / "c").write_bytes(b"alone")
    info = cli.json("store", "put", "h", str(src))
    assert info["raw_bytes"] == 300_000 + 5  # the linked bytes are read once
    types = {s["name"]: s["type"] for s in cli.json("store", "inspect", "h")["streams"]}
    assert types["t/a"] == "file" and types["t/d/b"] == "hardlink"
    cli.run("store", "get", "h", str(tmp_path / "out"))
    a, b, c = (tmp_path / "out" / "t" / n for n in ("a", "d/b", "c"))
    assert a.stat().st_ino == b.stat().st_ino and a.stat().st_nlink == 2
    assert b.read_bytes() == (src / "a").read_bytes() and c.read_bytes() == b"alone"


def test_hard_link_to_a_missing_stream_is_damage(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "t"
    src.mkdir()
    (src / "a").write_bytes(b"x")
    cli.run("store", "put", "h", str(src))
    rewrite_manifest(store_dir / "snapshots" / "h.json",
                     lambda b: b["streams"].append(_stream("t/z", type="hardlink", target="../../etc/passwd")))
    v = cli.run("store", "verify", "h", check=False)
    assert v.returncode == 3 and "not an earlier file stream" in v.stdout


def test_v1_manifest_still_loads(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "t"
    src.mkdir()
    (src / "a").write_bytes(b"old data")
    cli.run("store", "put", "v1", str(src))
    rewrite_manifest(store_dir / "snapshots" / "v1.json", lambda b: b.update(version=1))
    assert cli.run("store", "verify", "v1").returncode == 0
    cli.run("store", "get", "v1", str(tmp_path / "out"))
    assert (tmp_path / "out" / "t" / "a").read_bytes() == b"old data"


def test_get_fsyncs_every_file_and_directory_before_the_rename(cli: Cli, tmp_path: Path) -> None:
    """Seen at the syscall level (strace): every restored file and directory is fsynced, and all of it
    happens before the rename that makes DEST appear; DEST's directory is fsynced after it."""
    src = tmp_path / "t"
    (src / "d1" / "d2").mkdir(parents=True)
    for i in range(5):
        (src / "d1" / f"f{i}").write_bytes(os.urandom(1000 + i))
    (src / "d1" / "d2" / "g").write_bytes(b"")
    cli.run("store", "put", "dur", str(src))
    log = tmp_path / "strace.log"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    subprocess.run(["strace", "-f", "-qq", "-e", "trace=fsync,rename,renameat,renameat2", "-o", str(log),
                    *GPUSNAP, "--store", str(cli.store), "store", "get", "dur", str(tmp_path / "out")],
                   cwd=REPO, env=env, check=True, capture_output=True)
    calls = [line.split(None, 1)[1] for line in log.read_text().splitlines() if " = " in line]
    ren = [i for i, c in enumerate(calls) if c.startswith("rename") and "out" in c]
    assert len(ren) == 1, calls
    before = [c for c in calls[:ren[0]] if "fsync" in c]  # `fsync(N) = 0` or a thread's `<... fsync resumed>`
    # 6 files + t, d1, d2 + the temporary root
    assert len(before) >= 10, calls
    assert any("fsync" in c for c in calls[ren[0] + 1:]), calls
