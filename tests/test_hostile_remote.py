"""A hostile remote (issue 26, item 4): an S3 server on 127.0.0.1 (tests/support/hostile_s3.py) that
sends endless bodies, claims 2^40 bytes, omits Content-Length, answers range reads of packs with the
wrong length (or ignores them), serves forged index objects or runs its clock far off; and a file://
remote (a shared directory) whose other writers plant the same: FIFOs, links to /dev/zero, sparse
files of 2^40 bytes, forged index files, packs cut short. The tests that apply to both run against
both (`server` is parametrized); those about HTTP answers run against the S3 server only. Every gpusnap
command runs inside a 512 MiB memory cgroup, so a read without a bound is killed there (and fails the
test) instead of hurting the machine; each must fail in one line, or work where the data is sound."""
from __future__ import annotations

import json
import signal
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest


from conftest import REPO, Cli, make_mixed_tree, pythonpath, tree_digest
from support.hostile_remote import CREDS, Hostile
from support.memcap import MemCap, memory_cgroup

CAP = 512 << 20


class HostileDir:
    """A file:// remote in ROOT that its other writers tamper with: `set` plants, for each key (or
    "~X": every file whose key contains X) a behaviour: "endless" (a link to /dev/zero, or for the
    marker a FIFO), "huge" (a sparse file of 2^40 bytes)."""
    kind = "file"

    def __init__(self, tmp: Path) -> None:
        self.root = tmp / "share"
        self.remote_args = [f"file://{self.root}"]

    def set(self, behaviours: dict[str, object]) -> None:
        for suffix, how in behaviours.items():
            paths = ([p for p in self.root.rglob("*") if p.is_file() and suffix[1:] in f"/{p.relative_to(self.root)}"]
                     if suffix.startswith("~") else [self.root / suffix])
            for p in paths:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.unlink(missing_ok=True)
                if how == "endless":
                    if p.name == "gpusnap-remote.json":
                        os.mkfifo(p)
                    else:
                        p.symlink_to("/dev/zero")
                elif how == "huge":
                    with open(p, "wb") as f:
                        f.truncate(1 << 40)
                else:
                    raise AssertionError(f"no file:// behaviour {how!r}")

    def keys(self, prefix: str) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*")
                      if p.is_file() and str(p.relative_to(self.root)).startswith(prefix))

    def read(self, key: str) -> bytes:
        return (self.root / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        (self.root / key).write_bytes(data)

    def close(self) -> None:
        pass


AnyHostile = Hostile | HostileDir


@pytest.fixture(params=["s3", "file"])
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[AnyHostile]:
    h: AnyHostile = Hostile(tmp_path) if request.param == "s3" else HostileDir(tmp_path)
    yield h
    h.close()


def s3_only(server: AnyHostile) -> Hostile:
    """SERVER where the test is about HTTP answers (lengths, ranges, clocks) a directory cannot give."""
    if not isinstance(server, Hostile):
        pytest.skip("about HTTP answers: a file:// remote has no equivalent")
    return server


@pytest.fixture
def cap() -> Iterator[MemCap]:
    with memory_cgroup(CAP) as c:
        yield c


def run(cli: Cli, cap: MemCap, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", "--store", str(cli.store), *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120, preexec_fn=cap.enter,
                          env={**os.environ, "PYTHONPATH": pythonpath(), **CREDS, **(env or {})})


def one_line_failure(p: subprocess.CompletedProcess[str]) -> str:
    assert p.returncode not in (0, -9, 137), (p.returncode, p.stderr[-2000:])
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return p.stderr


@pytest.mark.parametrize("how", ["endless", "huge"])
def test_a_hostile_marker_fails_remote_add_in_one_line(server: AnyHostile, cap: MemCap, tmp_path: Path, how: str) -> None:
    cli = Cli(tmp_path / "A")
    cli.run("store", "init")
    server.set({"gpusnap-remote.json": how})
    err = one_line_failure(run(cli, cap, "remote", "add", "r", *server.remote_args))
    assert "gpusnap-remote.json" in err and ("past" in err or "claims" in err or "FIFO" in err), err
    assert cap.peak() < CAP


@pytest.fixture
def pushed(server: AnyHostile, cap: MemCap, tmp_path: Path) -> tuple[Cli, Cli, Path]:
    """Node A pushed snapshot `snap` to the hostile server (behaving, so far); node B knows the remote."""
    a, b = Cli(tmp_path / "A"), Cli(tmp_path / "B")
    src = make_mixed_tree(tmp_path / "model", mb=6)
    a.run("store", "put", "snap", str(src))
    for n in (a, b):
        n.run("store", "init")
        p = run(n, cap, "remote", "add", "r", *server.remote_args)
        assert p.returncode == 0, p.stderr
    p = run(a, cap, "push", "snap")
    assert p.returncode == 0, p.stderr
    return a, b, src


@pytest.mark.parametrize("how", ["endless", "huge"])
def test_a_hostile_manifest_fails_pull_and_push_replace_in_one_line(pushed: tuple[Cli, Cli, Path], server: AnyHostile,
                                                                   cap: MemCap, how: str) -> None:
    a, b, _ = pushed
    server.set({"snapshots/snap.json": how})
    err = one_line_failure(run(b, cap, "pull", "snap"))
    assert "snap.json" in err, err
    one_line_failure(run(a, cap, "push", "--replace", "snap"))
    assert b.json("store", "ls") == []
    assert cap.peak() < CAP


@pytest.mark.parametrize("what", ["packs", "index"])
@pytest.mark.parametrize("how", ["endless", "huge"])
def test_a_hostile_pack_or_index_object_fails_pull_in_one_line(pushed: tuple[Cli, Cli, Path], server: AnyHostile,
                                                               cap: MemCap, how: str, what: str) -> None:
    _, b, _ = pushed
    server.set({f"~/{what}/": how})
    one_line_failure(run(b, cap, "pull", "snap"))
    assert b.json("store", "ls") == []
    assert cap.peak() < CAP


@pytest.mark.parametrize("how", ["rangelong", "rangeshort", "norange"])
def test_a_range_answer_of_the_wrong_length_is_damage(pushed: tuple[Cli, Cli, Path], server: AnyHostile, cap: MemCap,
                                                      how: str) -> None:
    """Range reads of packs answered with more or fewer bytes than asked, or with the whole pack (a
    server that ignores Range): refused before the body is used; pull and verify say damage (exit 3)."""
    _, b, _ = pushed
    s3_only(server).set({"~/packs/": how})
    one_entry = {"GPUSNAP_REMOTE_RANGE_MAX": "1"}  # a range of one entry each, so never the whole pack
    p = run(b, cap, "pull", "snap", env=one_entry)
    err = one_line_failure(p)
    assert p.returncode == 3 and "bytes for the" in err and "fetched twice" in err, err
    assert b.json("store", "ls") == [] and not list((b.store / "tmp").iterdir())
    v = run(b, cap, "remote", "verify", "--read-data", env=one_entry)
    assert v.returncode == 3 and "bytes for the" in v.stdout, (v.stdout, v.stderr)
    assert cap.peak() < CAP


def _pack_and_index(server: AnyHostile) -> tuple[str, bytes, bytes]:
    """The one pack's key, its bytes and its index object, read behind gpusnap's back."""
    [idx] = server.keys("index/")
    key = idx.replace("index/", "packs/")
    return key, server.read(key), server.read(idx)


def test_a_forged_index_object_is_refused_whole(pushed: tuple[Cli, Cli, Path], server: AnyHostile, cap: MemCap) -> None:
    """Index objects that are not what they claim: a flipped byte (checksum), one that names another
    pack, one whose entries point past its pack: each refused before any entry is used, one line, exit 3."""
    from storage.format.packs import decode_index, encode_index
    _, b, _ = pushed
    key, _, index = _pack_and_index(server)
    pack = key.rsplit("/", 1)[1]
    pack_len, ents = decode_index(pack, index)
    flipped = bytearray(index)
    flipped[70] ^= 1
    past = [(cid, off + pack_len, n) for cid, off, n in ents]  # checksum sound, entries beyond the pack length
    for forged, says in ((bytes(flipped), "checksum"), (encode_index("1" * 32, pack_len, ents), "names pack"),
                         (encode_index(pack, pack_len, past), "not a valid entry")):
        server.write(key.replace("packs/", "index/"), forged)
        v = run(b, cap, "remote", "verify")
        assert v.returncode == 3 and says in v.stdout, (v.stdout, v.stderr)
        p = run(b, cap, "pull", "snap")
        assert p.returncode == 3 and "missing on the remote" in one_line_failure(p)
        assert b.json("store", "ls") == []
    server.write(key.replace("packs/", "index/"), index)
    assert run(b, cap, "pull", "snap").returncode == 0
    assert cap.peak() < CAP


def test_a_pack_shorter_than_its_index_says_is_damage(pushed: tuple[Cli, Cli, Path], server: AnyHostile,
                                                      cap: MemCap) -> None:
    """A pack cut short behind a sound index: seen from the listing by verify and pull (one line, exit 3,
    nothing fetched into the store), and, when the listing is not consulted, by the range read itself."""
    a, b, _ = pushed
    key, body, _ = _pack_and_index(server)
    server.write(key, body[:len(body) // 2])
    v = run(b, cap, "remote", "verify")
    assert v.returncode == 3 and "bytes on the remote" in v.stdout, (v.stdout, v.stderr)
    p = run(b, cap, "pull", "snap")
    assert p.returncode == 3 and "shorter than its index says" in one_line_failure(p)
    assert b.json("store", "ls") == [] and not list((b.store / "tmp").iterdir())
    v = run(b, cap, "remote", "verify", "--read-data")
    assert v.returncode == 3, (v.stdout, v.stderr)
    again = run(a, cap, "push", "snap")  # the next push sends its chunks again, into a new pack
    assert again.returncode == 0, again.stderr
    assert run(b, cap, "pull", "snap").returncode == 0


def test_objects_without_a_content_length_are_read_bounded_and_work(pushed: tuple[Cli, Cli, Path], server: AnyHostile,
                                                                    cap: MemCap, tmp_path: Path) -> None:
    _, b, src = pushed
    s3_only(server).set({".json": "nolength", "~/packs/": "nolength", "~/index/": "nolength"})
    p = run(b, cap, "pull", "snap")
    assert p.returncode == 0, p.stderr
    b.run("store", "get", "snap", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "model") == tree_digest(src)
    p = run(b, cap, "remote", "verify")
    assert "Traceback" not in p.stderr and "ContentLength" not in p.stderr, p.stderr


# ---- a server clock far off: lock staleness is never judged by the server's clock alone ------------

@pytest.mark.parametrize("clock", [{"clock_offset_s": 365 * 86400}, {"date_offset_s": 7200},
                                   {"date_offset_s": -7200}])
def test_a_server_clock_far_off_never_makes_a_live_push_lock_stale(pushed: tuple[Cli, Cli, Path], server: AnyHostile,
                                                                   cap: MemCap, tmp_path: Path,
                                                                   clock: dict[str, int]) -> None:
    a, b, _ = pushed
    s3_only(server).set(clock)
    src2 = make_mixed_tree(tmp_path / "model2", mb=6, seed=7)
    a.run("store", "put", "snap2", str(src2))
    pause = tmp_path / "paused"
    fast = {"GPUSNAP_REMOTE_LOCK_REFRESH_S": "2"}
    push = subprocess.Popen([sys.executable, "-m", "cli", "--store", str(a.store), "push", "snap2"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap.enter,
                            env={**os.environ, "PYTHONPATH": pythonpath(), **CREDS, **fast,
                                 "GPUSNAP_TEST_PAUSE_TRANSFER": f"1:{pause}"})
    try:
        deadline = time.monotonic() + 60
        while not pause.exists():
            assert time.monotonic() < deadline and push.poll() is None, push.stderr.read() if push.stderr else ""
            time.sleep(0.05)
        time.sleep(3)  # at least one refresh of the push's lock
        g = run(b, cap, "remote", "gc", "--json", env=fast)
        assert g.returncode != 0 and "locked by a running push" in g.stderr, (g.stdout, g.stderr)
    finally:
        pause.unlink(missing_ok=True)
        _, err = push.communicate(timeout=120)
    assert push.returncode == 0, err
    p = run(b, cap, "pull", "snap2")
    assert p.returncode == 0, p.stderr


# ---- not yet tried: a local gc racing a push and a pull ------------------------------------------

@pytest.mark.parametrize("direction", ["push", "pull"])
def test_local_gc_racing_a_push_or_a_pull_deletes_nothing_they_need(pushed: tuple[Cli, Cli, Path], server: AnyHostile,
                                                                    cap: MemCap, tmp_path: Path,
                                                                    direction: str) -> None:
    a, b, src = pushed
    if direction == "push":
        src2 = make_mixed_tree(tmp_path / "model2", mb=6, seed=9)
        a.run("store", "put", "snap2", str(src2))
        node, args, name = a, ["push", "snap2"], "snap2"
    else:
        node, args, name = b, ["pull", "snap"], "snap"
    pause = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-m", "cli", "--store", str(node.store), *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap.enter,
                            env={**os.environ, "PYTHONPATH": pythonpath(), **CREDS,
                                 "GPUSNAP_TEST_PAUSE_TRANSFER": f"1:{pause}"})
    try:
        deadline = time.monotonic() + 60
        while not pause.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        g = node.run("store", "gc", "--wait", "2", "--json", check=False)
        assert g.returncode != 0 and len(g.stderr.splitlines()) == 1, (g.stdout, g.stderr)  # busy: waits its turn
    finally:
        pause.unlink(missing_ok=True)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert node.json("store", "gc")["chunks_removed"] == 0
    out = tmp_path / "out"
    (b if direction == "pull" else a).run("store", "get", name, str(out))
    if direction == "pull":
        assert tree_digest(out / "model") == tree_digest(src)
    p = run(b, cap, "pull", "snap2") if direction == "push" else None
    assert p is None or p.returncode == 0, p.stderr if p else ""


# ---- issue 58: a remote cannot exhaust memory or time; a planted FIFO blocks nothing ---------------

def _big_index_objects(server: AnyHostile, k: int) -> None:
    """K sound index objects of 16 MiB each (~350 k entries naming chunks nobody has), beside the
    pushed snapshot's own: what a pull or a push must not hold whole."""
    import blake3
    import numpy as np
    from storage.format.packs import _IDX_HEAD, _IDX_MAGIC, _IDX_REC, _SUM, ENTRY_MIN, INDEX_MAX
    n = (INDEX_MAX - _IDX_HEAD.size - _SUM) // _IDX_REC.size
    recs = np.zeros(n, dtype=[("id", "S32"), ("off", "<u8"), ("len", "<u8")])
    recs["id"] = [os.urandom(32) for _ in range(n)]
    recs["off"] = np.arange(n, dtype=np.uint64) * ENTRY_MIN
    recs["len"] = ENTRY_MIN
    body_recs = recs.tobytes()
    for _ in range(k):
        pack = os.urandom(16).hex()
        body = _IDX_HEAD.pack(_IDX_MAGIC, bytes.fromhex(pack), n, n * ENTRY_MIN) + body_recs
        data = body + blake3.blake3(body).digest()
        assert len(data) <= INDEX_MAX
        server.write(f"index/{pack}", data) if isinstance(server, Hostile) else _write_file(server, f"index/{pack}", data)


def _write_file(server: HostileDir, key: str, data: bytes) -> None:
    (server.root / key).parent.mkdir(parents=True, exist_ok=True)
    server.write(key, data)


def test_n4_many_large_index_objects_cost_a_pull_and_a_push_no_memory(pushed: tuple[Cli, Cli, Path],
                                                                     server: AnyHostile, tmp_path: Path) -> None:
    """N4: a remote holding K sound 16 MiB index objects that the pulled snapshot does not need. Each
    used to be held whole and decoded (~175 MiB apiece): pull and push were OOM-killed. Now they are
    streamed and only the wanted entries kept: both work well inside a 384 MiB cgroup."""
    a, b, src = pushed
    _big_index_objects(server, 6)
    with memory_cgroup(384 << 20) as small:
        p = run(b, small, "pull", "snap", "--jobs", "8")
        assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
        src2 = make_mixed_tree(tmp_path / "model2", mb=2, seed=5)
        a.run("store", "put", "snap2", str(src2))
        p = run(a, small, "push", "snap2", "--jobs", "8")
        assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
        p = run(b, small, "remote", "verify", "--jobs", "8")
        assert p.returncode == 0, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
        assert 0 < small.peak() < 384 << 20
    b.run("store", "get", "snap", str(tmp_path / "out"))
    assert tree_digest(tmp_path / "out" / "model") == tree_digest(src)


def test_n5_a_listing_that_never_ends_stops_in_one_line_and_leaves_no_lock(pushed: tuple[Cli, Cli, Path],
                                                                         server: AnyHostile, cap: MemCap) -> None:
    """N5: a listing that goes on forever (an S3 server whose every page says IsTruncated with 1,000
    new keys; a shared directory with more entries than any remote holds): pull and remote gc used to
    run until killed, memory growing, leaving their lock object. Now the listing stops at its bound:
    one line, bounded memory, and the lock object is removed."""
    _, b, _ = pushed
    bound = {"GPUSNAP_REMOTE_LIST_MAX_KEYS": "20000"}
    if isinstance(server, Hostile):
        server.set({"list_forever": "index/"})
    else:
        for i in range(20001):
            (server.root / "index" / f"{i:032x}").write_bytes(b"")
    for args in (["pull", "snap"], ["remote", "gc"]):
        t0 = time.monotonic()
        err = one_line_failure(run(b, cap, *args, env=bound))
        assert "goes on past 20000 keys" in err and time.monotonic() - t0 < 100, err
    server.set({})
    assert server.keys("locks/") == []
    assert b.json("store", "ls") == []
    assert cap.peak() < CAP


def test_deadline_ends_a_pull_from_a_silent_server(pushed: tuple[Cli, Cli, Path], server: AnyHostile,
                                                   cap: MemCap) -> None:
    """A server that accepts the range reads of packs and never answers used to hold a pull for
    read-timeout x attempts (361 s seen). With --deadline 6 the pull ends within seconds of it: one
    line, exit 4 (unavailable), nothing committed, no lock object left."""
    _, b, _ = pushed
    s3_only(server).set({"~/packs/": "silent"})
    t0 = time.monotonic()
    p = run(b, cap, "pull", "snap", "--deadline", "6", env={"GPUSNAP_S3_MAX_ATTEMPTS": "5"})
    took = time.monotonic() - t0
    err = one_line_failure(p)
    assert p.returncode == 4 and took < 25, (p.returncode, took, err)
    assert b.json("store", "ls") == [] and not list((b.store / "tmp").iterdir())
    server.set({})
    assert server.keys("locks/") == []
    p = run(b, cap, "pull", "snap", env={"GPUSNAP_REMOTE_DEADLINE_S": "60"})
    assert p.returncode == 0, p.stderr


def test_sigterm_of_a_pull_removes_its_lock(pushed: tuple[Cli, Cli, Path], server: AnyHostile, cap: MemCap,
                                            tmp_path: Path) -> None:
    """A pull stopped with SIGTERM unwinds (exit 143): nothing committed and its lock object removed; one
    killed with SIGKILL leaves a lock that expires: `remote gc` removes it once it is older than the
    stale time (GPUSNAP_REMOTE_LOCK_STALE_S) and unrefreshed while watched."""
    _, b, _ = pushed
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pause = tmp_path / f"paused-{sig}"
        proc = subprocess.Popen([sys.executable, "-m", "cli", "--store", str(b.store), "pull", "snap", "--jobs", "1"],
                                cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap.enter,
                                env={**os.environ, "PYTHONPATH": pythonpath(), **CREDS, "GPUSNAP_REMOTE_RANGE_MAX": "1",
                                     "GPUSNAP_TEST_PAUSE_TRANSFER": f"1:{pause}"})  # held after its first chunk of several
        try:
            deadline = time.monotonic() + 60
            while not pause.exists():
                assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
                time.sleep(0.05)
            assert len(server.keys("locks/")) == 1
            proc.send_signal(sig)
            time.sleep(0.5)
        finally:
            pause.unlink(missing_ok=True)
            _, err = proc.communicate(timeout=60)
        assert b.json("store", "ls") == []
        if sig == signal.SIGTERM:
            assert proc.returncode == 143 and "terminated" in err, (proc.returncode, err)
            assert server.keys("locks/") == []
    assert len(server.keys("locks/")) == 1  # SIGKILL: left behind
    time.sleep(2.1)
    g = run(b, cap, "remote", "gc", "--json", env={"GPUSNAP_REMOTE_LOCK_STALE_S": "1",
                                                   "GPUSNAP_REMOTE_LOCK_REFRESH_S": "0.5"})
    assert g.returncode == 0 and json.loads(g.stdout)["stale_locks_removed"] == 1, (g.stdout, g.stderr)
    assert server.keys("locks/") == []


def test_n7_a_fifo_as_credentials_or_config_blocks_nothing(tmp_path: Path) -> None:
    """N7: `remotes/NAME.json` naming a FIFO as its credentials file, an operator passing one to
    `remote add`, or a FIFO planted as remotes/NAME.json itself: each used to block `remote ls`, `pull`
    and `remote add` forever (opened before the checks, without O_NONBLOCK). Now: one line at once."""
    cli = Cli(tmp_path / "A")
    cli.run("store", "init")
    fifo = tmp_path / "creds.fifo"
    os.mkfifo(fifo, 0o600)
    no_creds = {k: v for k, v in os.environ.items() if not k.startswith(("GPUSNAP_S3_", "AWS_"))}
    no_creds["PYTHONPATH"] = pythonpath()

    def gpusnap(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cli", "--store", str(cli.store), *args], capture_output=True,
                              text=True, cwd=REPO, timeout=20, env=no_creds)
    p = gpusnap("remote", "add", "r", "s3://bkt/p", "--endpoint", "http://127.0.0.1:9", "--credentials-file", str(fifo))
    assert p.returncode != 0 and "not a regular file" in one_line_failure(p)
    remotes = cli.store / "remotes"
    remotes.mkdir(exist_ok=True)
    (remotes / "r.json").write_text(json.dumps({"name": "r", "url": "s3://bkt/p", "endpoint": "http://127.0.0.1:9",
                                                "region": "us-east-1", "credentials_file": str(fifo)}))
    for args in (["remote", "ls", "r"], ["pull", "snap", "r"]):
        p = gpusnap(*args)
        assert "not a regular file" in one_line_failure(p), p.stderr
    (remotes / "r.json").unlink()
    os.mkfifo(remotes / "r.json", 0o600)
    for args in (["remote", "ls", "r"], ["remote", "list"], ["push", "snap", "r"]):
        p = gpusnap(*args)
        assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
