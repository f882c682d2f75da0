"""Trust, second pass (issue 26): forged gc records, hostile archives and imports, deep paths, a
SIGTERM'd get, big manifests for `ls`, hard links in `get --include`, a credentials file others can
read, put's scan racing a tight loop of swaps. Real files on the real disk, the real CLI."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from support.entries import chunk_ids
from conftest import REPO, Cli, make_mixed_tree, pythonpath, tree_digest
from support.crafted import checksum, resummarize, rewrite_manifest

DEAD_PID = 4194301


def _gpusnap(cli: Cli, *args: str, patch: str = "", timeout: float = 120) -> subprocess.Popen[str]:
    """The CLI as a child process, with PATCH (Python) run before it starts."""
    prog = f"import os, signal, sys, time\n{patch}\nfrom cli import main\nmain()\n"
    return subprocess.Popen([sys.executable, "-c", prog, "--store", str(cli.store), *args],
                            env={**os.environ, "PYTHONPATH": pythonpath()}, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _get_killed_at_commit(cli: Cli, name: str, dest: Path) -> None:
    p = _gpusnap(cli, "store", "get", name, str(dest), patch=(
        "from storage.archive import filetree\n"
        "filetree.FileTreeSink.commit = lambda self: os.kill(os.getpid(), signal.SIGKILL)\n"))
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL


# ---- 2. gc deletes a get's staging tree only if the get's marker proves it is the get's ---------

def _forge_get_record(store: Path, dest: Path, pid: int = DEAD_PID, **extra: object) -> Path:
    from storage.fs.owner import boot_tag
    rec = store / "tmp" / f"get.{pid}-1-{boot_tag()}.1.2"
    rec.write_text(json.dumps({"pid": pid, "start": 1, "boot": boot_tag(), "uid": os.geteuid(),
                               "dest": str(dest), "nonce": "0" * 32, **extra}))
    return rec


def test_forged_get_record_deletes_nothing_outside_the_store(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    cli.run("store", "init")
    elsewhere = tmp_path / "elsewhere"
    staging = elsewhere / f".x.gpusnap-{DEAD_PID}"
    (staging / "sub").mkdir(parents=True)
    (staging / "sub" / "precious").write_text("keep")
    rec = _forge_get_record(store_dir, elsewhere / "x")
    p = cli.run("store", "gc", "--json", check=False)
    gc = json.loads(p.stdout)
    assert p.returncode == 3 and gc["gets_cleaned"] == 0, gc
    assert any(".x.gpusnap-" in d and "no marker" in d for d in gc["damage"]), gc
    assert (staging / "sub" / "precious").read_text() == "keep"
    assert not rec.exists()   # the record is removed, reported
    # a record with no nonce at all (what earlier versions wrote, or a forger) touches nothing either
    rec = _forge_get_record(store_dir, elsewhere / "x", nonce=None)
    gc = json.loads(cli.run("store", "gc", "--json", check=False).stdout)
    assert gc["gets_cleaned"] == 0 and (staging / "sub" / "precious").exists() and not rec.exists()


def test_forged_get_record_naming_another_stores_get_deletes_nothing(cli: Cli, store_dir: Path,
                                                                     tmp_path: Path) -> None:
    other = Cli(tmp_path / "other")
    src = make_mixed_tree(tmp_path / "model", mb=2)
    other.run("store", "put", "snap", str(src))
    cli.run("store", "init")
    dest = tmp_path / "restored"
    _get_killed_at_commit(other, "snap", dest)
    partial = [x for x in tmp_path.iterdir() if x.name.startswith(".restored.gpusnap-")]
    assert len(partial) == 1
    pid = int(partial[0].name.rsplit("-", 1)[1])
    _forge_get_record(store_dir, dest, pid=pid)
    gc = json.loads(cli.run("store", "gc", "--json", check=False).stdout)
    assert gc["gets_cleaned"] == 0 and partial[0].exists(), gc
    # the store whose get it was removes it: its record's nonce matches the tree's marker
    gc = other.json("store", "gc")
    assert gc["gets_cleaned"] == 1 and gc["damage"] == [] and not partial[0].exists(), gc


# ---- 7. deep paths bounded at load; trees walked without recursion; SIGTERM cleans up -------------

def _deep(root: Path, depth: int) -> Path:
    """ROOT/d/d/.../d (DEPTH levels) with a file at the bottom, made through fds (no path is that long)."""
    root.mkdir()
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd))
    finally:
        os.close(fd)
    return root


def _remove(tree: Path) -> None:
    from storage.fs.treewalk import remove_tree
    fd = os.open(tree.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        remove_tree(fd, tree.name, str(tree))
    finally:
        os.close(fd)


def test_manifest_with_a_4000_level_path_is_refused_at_load(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    from storage.base.names import STREAM_DEPTH_MAX
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("x")
    cli.run("store", "put", "deep", str(src))

    def change(body: dict) -> None:
        deep = "src/" + "/".join(["d"] * 4000)
        body["streams"] += [{"name": "/".join(deep.split("/")[:i]), "size": 0, "chunks": [],
                             "attrs": {"type": "dir", "mode": 0o755}} for i in range(2, 4002)]
    rewrite_manifest(store_dir / "snapshots" / "deep.json", change)
    t0 = time.monotonic()
    g = cli.run("store", "get", "deep", str(tmp_path / "out"), check=False, timeout=60)
    assert g.returncode != 0 and f"the limit is {STREAM_DEPTH_MAX}" in g.stderr, g.stderr
    assert len(g.stderr.splitlines()) == 1 and time.monotonic() - t0 < 30
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]
    v = cli.run("store", "verify", check=False)
    assert v.returncode == 3 and "Traceback" not in v.stderr + v.stdout


def test_put_refuses_a_tree_deeper_than_the_limit_in_one_line(cli: Cli, tmp_path: Path) -> None:
    src = _deep(tmp_path / "src", 3000)
    try:
        p = cli.run("store", "put", "deep", str(src), check=False, timeout=120)
    finally:
        _remove(src)  # pytest's own clean-up of tmp_path recurses (and would fail other suites' sessions)
    assert p.returncode == 1 and "components deep" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert "Traceback" not in p.stderr


def test_gc_removes_a_killed_gets_tree_of_any_depth(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    """A get killed at commit; then its tree is made 5000 levels deep (as its owner could): gc removes it
    all without a RecursionError, and on the first run."""
    src = make_mixed_tree(tmp_path / "model", mb=2)
    cli.run("store", "put", "snap", str(src))
    dest = tmp_path / "restored"
    _get_killed_at_commit(cli, "snap", dest)
    (partial,) = [x for x in tmp_path.iterdir() if x.name.startswith(".restored.gpusnap-")]
    _deep(partial / "deep", 5000)
    try:
        gc = cli.json("store", "gc")
    finally:
        if partial.exists():
            _remove(partial)
    assert gc["gets_cleaned"] == 1 and gc["damage"] == [] and not partial.exists(), gc


def test_sigtermed_get_removes_its_hidden_tree_and_record(cli: Cli, store_dir: Path, tmp_path: Path) -> None:
    src = make_mixed_tree(tmp_path / "model", mb=8)
    cli.run("store", "put", "snap", str(src))
    dest = tmp_path / "restored"
    # the get stops (in the main thread, as a slow disk would) once its first file is open
    p = subprocess.Popen(
        [sys.executable, "-c",
         "import os, time\nfrom storage.archive import filetree\norig = filetree.FileTreeSink.open\n"
         "def slow(self, spec):\n    w = orig(self, spec)\n    if w is not None:\n"
         "        open(os.environ['MARK'], 'w').close()\n        time.sleep(60)\n    return w\n"
         "filetree.FileTreeSink.open = slow\nfrom cli import main\nmain()\n",
         "--store", str(cli.store), "store", "get", "snap", str(dest)],
        env={**os.environ, "PYTHONPATH": pythonpath(), "MARK": str(tmp_path / "opened")}, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "opened").exists():
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.05)
    assert [x for x in tmp_path.iterdir() if x.name.startswith(".restored.gpusnap-")]
    assert [x for x in (store_dir / "tmp").iterdir() if x.name.startswith("get.")]
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "terminated" in err and len(err.splitlines()) == 1, err
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".restored")] and not dest.exists()
    assert not [x for x in (store_dir / "tmp").iterdir() if x.name.startswith("get.")]


# ---- 5. an archive claiming a huge chunk: refused before anything that size is allocated ----------

def _capped(cli: Cli, cap: "object", *args: str, stdin: bytes | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "cli", "--store", str(cli.store), *args], input=stdin,
                          capture_output=True, cwd=REPO, env={**os.environ, "PYTHONPATH": pythonpath()},
                          preexec_fn=cap.enter, timeout=timeout)  # type: ignore[attr-defined]


def _tar(members: list[tuple[str, bytes]], sizes: dict[str, int] | None = None) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _huge_chunk_archive(cli: Cli, tmp_path: Path, magic: bytes, raw_len: int) -> bytes:
    """An export archive (uncompressed tar) whose one chunk claims RAW_LEN raw bytes; its id is right."""
    import struct
    import blake3
    import zstandard
    from storage.format.chunkfile import RAW_ID_CONTEXT
    src = tmp_path / "small"
    src.mkdir()
    (src / "f").write_bytes(b"x" * 100)
    cli.run("store", "put", "small", str(src))
    body = json.loads((cli.store / "snapshots" / "small.json").read_bytes())
    body.pop("checksum")
    payload = zstandard.ZstdCompressor().compress(b"\0" * 4096)
    head = struct.pack("<8sH6xQQ", magic, 1, raw_len, len(payload))
    if magic == b"GSNPCHK1":
        cid = blake3.blake3(head + payload).hexdigest()
    else:
        cid = blake3.blake3(b"whatever", derive_key_context=RAW_ID_CONTEXT).hexdigest()
        head += blake3.blake3(head + payload).digest()
    header = head.ljust(4096, b"\0")
    f = next(s for s in body["streams"] if s["name"] == "small/f")
    f["chunks"], f["size"] = [[cid, raw_len, "zstd", len(payload)]], raw_len
    body["name"] = "huge"
    resummarize(body)
    body["checksum"] = checksum(body)
    return _tar([("gpusnap-export.json", json.dumps({"format": "gpusnap-export", "version": 2,
                                                      "snapshot": "huge"}).encode()),
                 ("manifest.json", json.dumps(body).encode()), (f"chunks/{cid}", header + payload)])


@pytest.mark.parametrize("magic", [b"GSNPCHK1", b"GSNPCHK2"])
def test_import_of_an_archive_claiming_a_6_gib_chunk_is_damage_in_one_line(cli: Cli, tmp_path: Path,
                                                                          magic: bytes) -> None:
    from support.memcap import memory_cgroup
    archive = _huge_chunk_archive(cli, tmp_path, magic, 6 << 30)
    assert len(archive) < 200_000
    with memory_cgroup(512 << 20) as cap:
        p = _capped(cli, cap, "store", "import", "-", stdin=archive)
    err = p.stderr.decode()
    assert p.returncode == 3 and len(err.splitlines()) == 1 and "Traceback" not in err, (p.returncode, err)
    assert "huge" not in cli.run("store", "ls").stdout


# ---- 6. an import with a member under a symlink member is refused whole; gc goes on past damage ---

def test_podman_import_with_a_member_under_a_symlink_is_refused_whole(cli: Cli, store_dir: Path,
                                                                      tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name, data in (("config.dump", b"{}"), ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("checkpoint")
        link.type, link.linkname = tarfile.SYMTYPE, str(outside)
        t.addfile(link)
        info = tarfile.TarInfo("checkpoint/pages-1.img")
        info.size = 8192
        t.addfile(info, io.BytesIO(os.urandom(8192)))
    archive = tmp_path / "evil.tar"
    archive.write_bytes(out.getvalue())
    cli.run("store", "init")
    p = cli.run("import", "podman", str(archive), "evil", check=False)
    assert p.returncode != 0 and "lies under" in p.stderr and len(p.stderr.splitlines()) == 1, p.stderr
    assert cli.json("store", "ls") == [] and list(outside.iterdir()) == []
    assert cli.json("store", "verify")["ok"]


def test_gc_goes_on_past_a_damaged_snapshot_and_keeps_what_it_names(cli: Cli, store_dir: Path,
                                                                   tmp_path: Path) -> None:
    a, b = make_mixed_tree(tmp_path / "a", mb=2, seed=1), make_mixed_tree(tmp_path / "b", mb=2, seed=2)
    cli.run("store", "put", "keep", str(a))
    cli.run("store", "put", "gone", str(b))
    bad = store_dir / "snapshots" / "keep.json"
    named = set(__import__("re").findall(r"[0-9a-f]{64}", bad.read_text())) & chunk_ids(store_dir)
    assert named  # (the checksum is 64 hex digits too: only ids of stored chunks count)
    bad.write_text(bad.read_text().replace('"version": 2', '"version": 2, "x": 1', 1))  # fails its checksum
    cli.run("store", "rm", "gone")
    p = cli.run("store", "gc", "--json", check=False)
    gc = json.loads(p.stdout)
    assert p.returncode == 3 and gc["chunks_removed"] > 0, (p.stdout, p.stderr)
    assert any("'keep' is damaged" in d and "went on" in d for d in gc["damage"]), gc
    left = chunk_ids(store_dir)
    assert named <= left


# ---- 8. get --include of only a hard link; ls of a manifest with 1,000,000 streams ---------------

def test_get_include_of_only_a_hard_link_restores_the_file(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    data = os.urandom(100_000)
    (src / "a" / "first").write_bytes(data)
    os.link(src / "a" / "first", src / "second")
    cli.run("store", "put", "links", str(src))
    kinds = {s["name"]: s["attrs"]["type"] for s in json.loads((cli.store / "snapshots" / "links.json").read_text())["streams"]}
    assert kinds["src/second"] == "hardlink" and kinds["src/a/first"] == "file", kinds
    out = tmp_path / "out"
    g = cli.run("store", "get", "links", str(out), "--include", "src/second", check=False)
    assert g.returncode == 0, g.stderr
    assert (out / "src" / "second").read_bytes() == data and not (out / "src" / "a").exists()
    both = tmp_path / "both"
    cli.run("store", "get", "links", str(both), "--include", "src/*", "--include", "src/a/*")
    assert os.stat(both / "src" / "second").st_ino == os.stat(both / "src" / "a" / "first").st_ino


# ---- not yet tried: put's scan and reads under a tight loop of swaps -----------------------------

def test_put_under_a_tight_loop_of_swaps_never_follows_and_records_what_it_read(cli: Cli, tmp_path: Path) -> None:
    """A file and a directory of the tree are swapped (renameat2 RENAME_EXCHANGE, atomic) with symlinks
    to a secret as fast as a thread can, while puts run: each put fails naming the path or stores a
    consistent tree, and no stored byte is the secret's."""
    import ctypes
    import threading
    libc = ctypes.CDLL(None, use_errno=True)
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key").write_bytes(b"SECRET!!" * 4096)
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    legit = os.urandom(200_000)
    (src / "f").write_bytes(legit)
    (src / "d" / "x").write_bytes(b"dir data")
    (src / "other").write_bytes(os.urandom(300_000))
    alt = tmp_path / "alt"
    alt.mkdir()
    (alt / "f").symlink_to(secret / "key")
    (alt / "d").symlink_to(secret)
    cli.run("store", "init")  # a put refuses before it makes the store: every put may be refused here
    stop = threading.Event()
    swaps = [0]

    def swap() -> None:
        while not stop.is_set():
            for n in ("f", "d"):
                r = libc.renameat2(-100, str(src / n).encode(), -100, str(alt / n).encode(), 2)  # RENAME_EXCHANGE
                assert r == 0, ctypes.get_errno()
                swaps[0] += 1

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    results = {"stored": 0, "refused": 0}
    try:
        for i in range(8):
            p = cli.run("store", "put", f"s{i}", str(src), check=False)
            if p.returncode == 0:
                results["stored"] += 1
            else:
                assert p.returncode == 1 and "changed while it was being stored" in p.stderr \
                    and len(p.stderr.splitlines()) == 1, p.stderr
                results["refused"] += 1
    finally:
        stop.set()
        t.join()
    assert swaps[0] > 100
    for i in range(8):
        if not (cli.store / "snapshots" / f"s{i}.json").exists():
            continue
        out = tmp_path / f"out{i}"
        cli.run("store", "get", f"s{i}", str(out))
        for dirpath, _, files in os.walk(out):
            for name in files:
                data = (Path(dirpath) / name).read_bytes() if not (Path(dirpath) / name).is_symlink() else b""
                assert b"SECRET!!" not in data, (dirpath, name)
        f = out / "src" / "f"
        assert (f.is_symlink() and os.readlink(f) == str(secret / "key")) or f.read_bytes() == legit
        d = out / "src" / "d"
        assert (d.is_symlink() and os.readlink(d) == str(secret)) or (d / "x").read_bytes() == b"dir data"
    assert cli.json("store", "verify")["ok"]


def test_ls_of_a_manifest_with_a_million_streams_reads_only_its_summary(cli: Cli, store_dir: Path,
                                                                      tmp_path: Path) -> None:
    from storage.format.manifest import Manifest, Stream
    from support.memcap import memory_cgroup
    small = tmp_path / "small"
    small.mkdir()
    (small / "f").write_text("x")
    cli.run("store", "put", "small", str(small))
    n = 1_000_000
    m = Manifest("big", [Stream("d", {"type": "dir", "mode": 0o755})] +
                 [Stream(f"d/f{i}", {"type": "file", "mode": 0o644}) for i in range(n - 1)], {"kind": "files"},
                 tags=("many",))
    (store_dir / "snapshots" / "big.json").write_bytes(m.dumps())
    del m
    with memory_cgroup(512 << 20) as cap:
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "-m", "cli", "--store", str(store_dir), "store", "ls", "--json"],
                           capture_output=True, text=True, cwd=REPO, preexec_fn=cap.enter, timeout=120,
                           env={**os.environ, "PYTHONPATH": pythonpath()})
        took, peak = time.monotonic() - t0, cap.peak()
    assert p.returncode == 0, p.stderr
    rows = {r["name"]: r for r in json.loads(p.stdout)}
    assert rows["big"]["streams"] == n and rows["big"]["tags"] == ["many"] and rows["small"]["streams"] == 2, rows
    assert took < 10 and peak < 200 << 20, (took, peak)
    t = json.loads(cli.run("store", "ls", "--tag", "many", "--json").stdout)
    assert [r["name"] for r in t] == ["big"]
