"""The Backend contract (storage/remote/backend.py): every backend, the S3 one against the local Swift
(scripts/setup/swift-setup.sh) and the file:// one against a directory, keeps the same guarantees:
whole objects, bounded reads, exact ranges, ordered bounded listings, one error family, deadlines.
Then the wrappers (retries, rate limits, listing bounds) and what only a shared directory can do to a
reader (links, FIFOs, directories planted in place of objects)."""
from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest

from conftest import REPO
from storage.remote.backend import (Backend, BackendDamage, BackendError, BackendSpec, BackendUnavailable, Deadline,
                                    ObjectInfo, Page, RateLimited, Retrying, list_keys)
from storage.remote.registry import open_backend
from storage.remote.credentials import Credentials

SWIFT_CREDS = Credentials("test:tester", "testing")


@pytest.fixture(scope="module")
def swift() -> Iterator[tuple[str, str]]:
    from scripts.bench.bench_remote import drop_bucket
    if os.geteuid() != 0:
        pytest.skip("starting Swift needs root")
    p = subprocess.run([str(REPO / "scripts" / "setup" / "swift-setup.sh"), "start"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    endpoint, bucket = p.stdout.strip().splitlines()[-1], f"gpusnap-backend-{uuid.uuid4().hex[:8]}"
    yield endpoint, bucket
    drop_bucket(endpoint, bucket)


@pytest.fixture(params=["s3", "file"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A fresh, empty backend of each kind, through the registry (so with the retry wrapper around it)."""
    dl = Deadline(300)
    if request.param == "s3":
        from storage.remote.s3backend import S3Backend
        endpoint, bucket = request.getfixturevalue("swift")
        spec = BackendSpec("c", f"s3://{bucket}/{uuid.uuid4().hex[:8]}", endpoint)
        b: Backend = Retrying(S3Backend(spec, SWIFT_CREDS, dl), dl)
    else:
        b = open_backend(BackendSpec("c", f"file://{tmp_path / 'share'}"), dl)
    b.ensure()
    yield b
    b.close()


def test_put_get_stat_delete(backend: Backend) -> None:
    assert backend.get("snapshots/x.json", 1 << 20) is None and backend.stat("snapshots/x.json") is None
    backend.put("snapshots/x.json", b"hello")
    assert backend.get("snapshots/x.json", 1 << 20) == b"hello"
    info = backend.stat("snapshots/x.json")
    assert info is not None and info.size == 5 and abs(info.mtime - backend.now()) < 120
    backend.put("snapshots/x.json", memoryview(b"replaced, longer"))  # a put replaces the whole object
    assert backend.get("snapshots/x.json", 1 << 20) == b"replaced, longer"
    backend.delete("snapshots/x.json")
    backend.delete("snapshots/x.json")  # deleting what is not there is no error
    assert backend.get("snapshots/x.json", 1 << 20) is None
    assert backend.stats.requests > 0 and backend.stats.bytes_sent >= 21 and backend.stats.bytes_received >= 21


def test_reads_are_bounded_by_the_callers_limit(backend: Backend) -> None:
    data = os.urandom(3 << 20)
    backend.put("packs/" + "a" * 32, data)
    with pytest.raises(BackendDamage, match="claims|past"):
        backend.get("packs/" + "a" * 32, (3 << 20) - 1)
    with pytest.raises(BackendDamage):
        backend.get_into("packs/" + "a" * 32, memoryview(bytearray(1 << 20)))
    buf = bytearray(3 << 20)
    assert backend.get_into("packs/" + "a" * 32, memoryview(buf)) == 3 << 20 and bytes(buf) == data
    pieces: list[bytes] = []
    assert backend.get_stream("packs/" + "a" * 32, 3 << 20, pieces.append)
    assert b"".join(pieces) == data and all(len(p) <= 1 << 20 for p in pieces)
    assert not backend.get_stream("packs/" + "b" * 32, 3 << 20, pieces.append)


def test_range_reads_are_exact(backend: Backend) -> None:
    data = os.urandom(1 << 20)
    key = "packs/" + "c" * 32
    backend.put(key, data)
    buf = memoryview(bytearray(8192))
    assert backend.get_range_into(key, 4096, 8192, buf) == 8192 and bytes(buf) == data[4096:4096 + 8192]
    with pytest.raises(BackendDamage, match="shorter"):
        backend.get_range_into(key, (1 << 20) - 4096, 8192, buf)  # runs past the end
    with pytest.raises(BackendDamage):
        backend.get_range_into(key, 2 << 20, 4096, buf)  # starts past the end
    assert backend.get_range_into("packs/" + "d" * 32, 0, 4096, buf) is None


def test_listing_is_ordered_paged_and_within_its_prefix(backend: Backend) -> None:
    keys = [f"index/{i:032x}" for i in range(1010)]  # more than one page of 1000

    def put(ks: list[str]) -> None:
        for k in ks:
            backend.put(k, b"x" * (len(k) % 7))
    threads = [threading.Thread(target=put, args=(keys[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    backend.put("indexes-not", b"y")
    backend.put("chunks/ab/" + "ab" * 32, b"z")
    listed = list(list_keys(backend, "index/", Deadline(120)))
    assert [o.key for o in listed] == keys
    assert all(o.size == len(o.key) % 7 for o in listed)
    first = backend.list_page("index/", None)
    assert len(first.items) <= 1000 and first.next is not None
    assert [o.key for o in list_keys(backend, "chunks/", Deadline(60))] == ["chunks/ab/" + "ab" * 32]
    assert list(list_keys(backend, "locks/", Deadline(60))) == []
    with pytest.raises(BackendDamage, match="past 1000 keys"):
        list(list_keys(backend, "index/", Deadline(60), max_keys=1000))


def test_a_passed_deadline_makes_no_request(backend: Backend) -> None:
    dl = Deadline(0.01)
    time.sleep(0.05)
    before = backend.stats.requests
    for call in (lambda: backend.get("x.json", 10, dl), lambda: backend.put("x.json", b"1", dl),
                 lambda: backend.stat("x.json", dl), lambda: backend.list_page("", None, dl)):
        with pytest.raises(BackendUnavailable, match="deadline"):
            call()
    assert backend.stats.requests == before


def test_bad_urls_are_refused() -> None:
    from storage.remote.registry import check_url
    for url in ("s3://", "file://relative/x", "file:///a/../b", "ftp://x/y", "file:///"):
        with pytest.raises(BackendError):
            check_url(url)
    assert check_url("file:///a/b/") == "file:///a/b" and check_url("s3://bkt/p/q/") == "s3://bkt/p/q"


# ---- the wrappers, over the file:// backend ------------------------------------------------------
class Flaky:
    """A file:// backend whose first N calls fail as an unreachable server's would."""

    def __init__(self, inner: Backend, fails: int) -> None:
        self.inner, self.fails = inner, fails
        self.who, self.url, self.stats = inner.who, inner.url, inner.stats
        self.calls = 0

    def __getattr__(self, name: str) -> Callable[..., object]:
        fn = getattr(self.inner, name)

        def call(*a: object, **kw: object) -> object:
            self.calls += 1
            if self.calls <= self.fails:
                raise BackendUnavailable(f"{self.who}: down (call {self.calls})")
            return fn(*a, **kw)
        return call


def _file(tmp_path: Path) -> Backend:
    from storage.remote.filebackend import FileBackend
    b = FileBackend(BackendSpec("w", f"file://{tmp_path / 'share'}"), Deadline(60))
    b.ensure()
    return b


def test_retrying_retries_unavailable_within_its_attempts_and_deadline(tmp_path: Path) -> None:
    inner = _file(tmp_path)
    inner.put("a.json", b"1")
    flaky = Flaky(inner, 2)
    assert Retrying(flaky, Deadline(60), attempts=3).get("a.json", 10) == b"1"  # type: ignore[arg-type]
    assert flaky.calls == 3
    with pytest.raises(BackendUnavailable, match="down"):
        Retrying(Flaky(inner, 5), Deadline(60), attempts=3).get("a.json", 10)  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable):
        Retrying(Flaky(inner, 10 ** 6), Deadline(1.0), attempts=10 ** 6).get("a.json", 10)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 3
    t0 = time.monotonic()  # and none once the call has failed for its retry budget
    with pytest.raises(BackendUnavailable):
        Retrying(Flaky(inner, 10 ** 6), Deadline(60), attempts=10 ** 6, budget_s=0.5).get("a.json", 10)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 6
    damage = Flaky(inner, 0)
    inner.put("b.json", b"12345")
    with pytest.raises(BackendDamage):
        Retrying(damage, Deadline(60), attempts=5).get("b.json", 2)  # type: ignore[arg-type]
    assert damage.calls == 1  # damage is never retried


def test_rate_limited_spaces_requests(tmp_path: Path) -> None:
    b = RateLimited(_file(tmp_path), rps=20)
    t0 = time.monotonic()
    for _ in range(21):
        b.stat("nothing.json")
    assert time.monotonic() - t0 >= 0.9
    slow = RateLimited(_file(tmp_path), bps=1 << 20)
    t0 = time.monotonic()
    slow.put("big.bin", bytes(1 << 20))
    slow.put("big.bin", bytes(1 << 20))
    assert time.monotonic() - t0 >= 0.9


class Endless:
    """A backend whose listing says every page is truncated: new keys each page, or the same page."""

    def __init__(self, same: bool) -> None:
        self.who, self.url, self.same, self.pages = "remote 'e'", "x://", same, 0

    def list_page(self, prefix: str, token: str | None, deadline: Deadline | None = None) -> Page:
        self.pages += 1
        n = 0 if self.same else self.pages
        return Page([ObjectInfo(f"{prefix}{n:08d}{i:04d}", 1, 0.0) for i in range(1000)], str(n + 1))


def test_a_listing_that_never_ends_stops_bounded() -> None:
    e = Endless(same=False)
    t0 = time.monotonic()
    with pytest.raises(BackendDamage, match="goes on past"):
        for _ in list_keys(e, "index/", Deadline(60)):  # type: ignore[arg-type]
            pass
    assert e.pages <= 251 and time.monotonic() - t0 < 30
    with pytest.raises(BackendDamage, match="out of order"):
        list(list_keys(Endless(same=True), "index/", Deadline(60)))  # type: ignore[arg-type]


# ---- what only a shared directory can plant ----------------------------------------------------
def test_file_backend_never_follows_or_blocks_on_planted_entries(tmp_path: Path) -> None:
    b = _file(tmp_path)
    root = tmp_path / "share"
    secret = tmp_path / "secret"
    secret.write_bytes(b"root-only")
    b.put("snapshots/ok.json", b"{}")
    (root / "snapshots" / "link.json").symlink_to(secret)
    os.mkfifo(root / "snapshots" / "fifo.json")
    (root / "snapshots" / "dir.json").mkdir()
    for key, what in (("link.json", "symbolic link"), ("fifo.json", "FIFO"), ("dir.json", "directory")):
        t0 = time.monotonic()
        with pytest.raises(BackendDamage, match=what):
            b.get(f"snapshots/{key}", 1 << 20)
        with pytest.raises(BackendDamage, match=what):
            b.stat(f"snapshots/{key}")
        assert time.monotonic() - t0 < 5
    # only regular files are listed
    assert [o.key for o in list_keys(b, "snapshots/", Deadline(10))] == ["snapshots/ok.json"]
    # a directory on the way swapped for a link: not followed, for reads and for writes
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / ("e" * 32)).write_bytes(b"planted")
    os.rename(root / "packs", root / "packs.old") if (root / "packs").exists() else None
    (root / "packs").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BackendDamage, match="link is never followed"):
        b.get("packs/" + "e" * 32, 1 << 20)
    with pytest.raises(BackendDamage):
        b.put("packs/" + "f" * 32, b"x")
    assert not (tmp_path / "elsewhere" / ("f" * 32)).exists()
    # a put over a planted link replaces the link, never writes through it
    (root / "snapshots" / "over.json").symlink_to(secret)
    b.put("snapshots/over.json", b"new")
    assert secret.read_bytes() == b"root-only" and b.get("snapshots/over.json", 10) == b"new"
    for bad in ("../x", "a//b", ".hidden", "a/./b"):
        with pytest.raises(BackendError):
            b.get(bad, 10)
    assert not list((root / "tmp").iterdir())  # no temp left behind by the writes


def test_file_backend_root_behind_a_planted_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "share").symlink_to(tmp_path / "real")
    b = open_backend(BackendSpec("w", f"file://{tmp_path / 'share'}"), Deadline(10))
    with pytest.raises(BackendDamage):
        b.ensure()
    assert not list((tmp_path / "real").iterdir())


def test_remote_add_resolves_a_file_path_once(tmp_path: Path) -> None:
    """`remote add` records a file:// path with its links resolved (the operator's choice, followed
    once); the backend then walks that real path without following anything."""
    from storage.remote.client import remote_config
    (tmp_path / "real").mkdir()
    (tmp_path / "via").symlink_to(tmp_path / "real")
    cfg = remote_config("r", f"file://{tmp_path / 'via'}/x")
    assert cfg.url == f"file://{tmp_path.resolve() / 'real' / 'x'}" and cfg.endpoint is None
    b = open_backend(cfg.spec(), Deadline(10))
    b.ensure()
    b.put("gpusnap-remote.json", b"{}")
    assert (tmp_path / "real" / "x" / "gpusnap-remote.json").read_bytes() == b"{}"
    with pytest.raises(BackendError, match="endpoint"):
        remote_config("r", "s3://bkt/p")
    with pytest.raises(BackendError, match="no --endpoint"):
        remote_config("r", f"file://{tmp_path}/y", endpoint="http://127.0.0.1:1")
