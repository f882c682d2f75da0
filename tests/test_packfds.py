"""Packs held open for a store's threads (storage/fs/packfds.py): opened once, closed only when no one holds them."""
from __future__ import annotations

import os
import threading

import pytest

from storage.format.chunkfile import ChunkError
from storage.fs.packfds import PackFds


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Opener:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, pack: str, cid: str) -> int:
        with self.lock:
            self.calls.append(pack)
        if pack == "bad":
            raise ChunkError(cid, "its pack bad… is a symbolic link, not a pack file")
        return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)


def test_a_pack_is_opened_once_and_closed_when_forgotten() -> None:
    before = open_fds()
    op = Opener()
    fds = PackFds(op)
    with fds.held():
        for _ in range(5):
            with fds.borrowed("p1", "c") as fd:
                assert os.fstat(fd)  # open
        assert op.calls == ["p1"]
        assert len(fds) == 1 and open_fds() == before + 1
        fds.forget()
        assert len(fds) == 0 and open_fds() == before


def test_idle_packs_beyond_the_bound_are_closed_least_recent_first() -> None:
    before = open_fds()
    op = Opener()
    fds = PackFds(op, most=2)
    held = fds.held()
    held.__enter__()
    for p in ("a", "b", "c", "a", "d"):
        with fds.borrowed(p, "c"):
            pass
    assert len(fds) == 2 and open_fds() == before + 2
    with fds.borrowed("a", "c"):  # kept: used after b and c
        pass
    assert op.calls == ["a", "b", "c", "a", "d"]  # c closed a, a closed b, d closed c: the last "a" found it open
    held.__exit__(None, None, None)  # the last block ends: every pack closed
    assert len(fds) == 0 and open_fds() == before


def test_outside_a_held_block_each_borrow_opens_and_closes() -> None:
    before = open_fds()
    op = Opener()
    fds = PackFds(op)
    for _ in range(3):
        with fds.borrowed("p", "c") as fd:
            assert os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"
            assert open_fds() == before + 1
        assert open_fds() == before and len(fds) == 0  # a store left alive holds nothing open
    assert op.calls == ["p", "p", "p"]
    with fds.held(), fds.held():  # nested: closed when the outer one ends
        with fds.borrowed("p", "c"):
            pass
        assert len(fds) == 1
    assert len(fds) == 0 and open_fds() == before


def test_a_held_pack_is_never_closed_under_its_borrower() -> None:
    before = open_fds()
    fds = PackFds(Opener(), most=1)
    with fds.held(), fds.borrowed("held", "c") as fd:
        for p in ("x", "y", "z"):  # evictions while "held" is in use
            with fds.borrowed(p, "c"):
                pass
        fds.forget()               # and a forget
        os.fstat(fd)               # still this thread's open file
        assert os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"
    assert open_fds() == before    # closed by its last borrower


def test_an_unopenable_pack_raises_and_is_not_kept() -> None:
    op = Opener()
    fds = PackFds(op)
    for _ in range(2):
        with pytest.raises(ChunkError, match="symbolic link"):
            with fds.borrowed("bad", "c"):
                pass
    assert op.calls == ["bad", "bad"] and len(fds) == 0


def test_many_threads_share_one_fd_per_pack() -> None:
    before = open_fds()
    op = Opener()
    fds = PackFds(op, most=4)
    seen: dict[str, set[int]] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for k in range(200):
                p = f"p{(i + k) % 6}"
                with fds.borrowed(p, "c") as fd:
                    assert os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"
                    with lock:
                        seen.setdefault(p, set()).add(fd)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    with fds.held():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert len(fds) <= 4 and 0 < len(op.calls) < 16 * 200  # shared: far fewer opens than reads
    assert open_fds() == before  # every fd opened (those that lost a race too) closed


def test_a_dropped_pack_is_closed_now_or_by_its_borrower() -> None:
    before = open_fds()
    fds = PackFds(Opener())
    with fds.held():
        with fds.borrowed("gone", "c"):
            pass
        fds.drop("gone")
        assert len(fds) == 0 and open_fds() == before
        with fds.borrowed("held", "c") as fd:
            fds.drop("held")
            assert os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"
        assert open_fds() == before


def test_an_fd_opened_across_a_forget_is_not_kept() -> None:
    """A thread that opened a pack before the index was loaded again must not cache that fd after it."""
    before = open_fds()
    fds: PackFds

    def opener(pack: str, cid: str) -> int:
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        fds.forget()  # the index refreshed while this open ran
        return fd

    fds = PackFds(opener)
    with fds.held():
        with fds.borrowed("p", "c") as fd:
            assert os.readlink(f"/proc/self/fd/{fd}") == "/dev/null"
        assert len(fds) == 0 and open_fds() == before


def test_a_store_and_its_open_packs_go_when_it_is_dropped(tmp_path: "os.PathLike[str]") -> None:
    import gc
    import subprocess
    import sys
    import weakref

    from storage.format.packs import Loc
    from storage.repo.store import SnapshotStore

    store, src = os.path.join(tmp_path, "s"), os.path.join(tmp_path, "f")
    with open(src, "wb") as f:
        f.write(os.urandom(1 << 20))
    subprocess.run([sys.executable, "-m", "cli", "--store", store, "store", "init"], check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "cli", "--store", store, "store", "put", "one", src], check=True,
                   capture_output=True)
    index = SnapshotStore(store).refresh_index()
    pack, ents = next(iter(index.entries.items()))
    cid, off, length = ents[0]
    gc.collect()
    before = open_fds()
    refs = []
    for i in range(20):
        s = SnapshotStore(store)
        if i % 2:  # a store that was holding its packs, left alive after
            with s.holding_packs():
                assert s.entry_kind(cid, Loc(pack, off, length)) is None  # a full entry, through a held fd
                assert len(s._pack_fds) == 1
        else:
            assert s.entry_kind(cid, Loc(pack, off, length)) is None
        assert len(s._pack_fds) == 0 and open_fds() == before  # nothing open once no block holds them
        refs.append(weakref.ref(s))
        del s
    gc.collect()
    assert all(r() is None for r in refs)  # nothing (a finalizer's opener) kept them alive
    assert open_fds() == before
