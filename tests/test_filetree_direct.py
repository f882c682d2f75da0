"""A large file that is not in the page cache is read past it (O_DIRECT) by `store put`, with the same
bytes as a buffered read; a cached one, an unaligned read and a file system without direct I/O keep
buffered reads (storage/archive/filetree.py, _FdReader)."""
from __future__ import annotations

import fcntl
import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from conftest import Cli
from storage.fs.directio import AlignedBuffer
from storage.archive.filetree import DIRECT_MIN, _FdReader

SIZE = DIRECT_MIN + 3 * 4096 + 1234  # not a multiple of the alignment: the last read ends inside a block


def _write(path: Path, size: int = SIZE) -> bytes:
    data = hashlib.shake_256(b"weights").digest(size)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return data


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _direct_flag(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@contextmanager
def _cold(path: Path) -> Iterator[tuple[int, _FdReader]]:
    """PATH evicted from the page cache, opened, and a reader of it that chose direct reads (else the
    test is skipped: a kernel that cannot say what is cached, or a file system without O_DIRECT)."""
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        r = _FdReader(fd, SIZE)
        if not r.direct:
            pytest.skip("this kernel or file system cannot say what is cached, or refuses O_DIRECT")
        yield fd, r
    finally:
        os.close(fd)


def _read_all(r: _FdReader, buf: AlignedBuffer, step: int) -> bytes:
    out = bytearray()
    while True:
        n = r.readinto(buf.view[:step])
        out += buf.view[:n]
        if n < step:
            return bytes(out)


def test_a_cold_large_file_is_read_direct_with_the_same_bytes(tmp_path: Path) -> None:
    p = tmp_path / "w.bin"
    data = _write(p)
    with _cold(p) as (fd, r), AlignedBuffer(4 << 20) as buf:
        assert _direct_flag(fd)
        first = r.readinto(buf.view)
        assert first == 4 << 20 and r.direct and bytes(buf.view) == data[:first], "an aligned read: direct"
        got = bytes(buf.view) + _read_all(r, buf, 4 << 20)
    assert got == data, "the same bytes, the tail (a short direct read, then buffered to the end) included"


def test_asking_what_is_cached_changes_nothing(tmp_path: Path) -> None:
    """The cold test has no side effect: a second reader of the same cold file reads it direct too
    (probing reads would have started the kernel's read-ahead and made it look cached)."""
    p = tmp_path / "w.bin"
    _write(p)
    with _cold(p) as (fd, _):
        assert _FdReader(fd, SIZE).direct and _FdReader(fd, SIZE).direct


def test_a_direct_read_that_would_wait_goes_on_buffered(tmp_path: Path) -> None:
    """Dirty pages in the range a direct read asks for (a tenant writing its file while it is stored):
    the read, asked with RWF_NOWAIT, does not wait for their write-back (which a tenant can slow down,
    as it can hold the inode's lock): the reader goes on buffered and returns the bytes as they are
    now."""
    p = tmp_path / "w.bin"
    data = bytearray(_write(p))
    got = bytearray()
    with _cold(p) as (_, r), AlignedBuffer(4 << 20) as buf:
        with open(p, "r+b") as f:  # dirty a page 20 MiB in, not written back
            f.seek(20 << 20)
            f.write(b"tenant" * 100)
            data[20 << 20:(20 << 20) + 600] = b"tenant" * 100
        for _ in range(6):  # 24 MiB: past the dirty page, far from the file's end
            got += buf.view[:r.readinto(buf.view)]
        assert not r.direct, "the read that met the dirty page went on buffered"
        got += _read_all(r, buf, 4 << 20)
    assert bytes(got) == bytes(data)


def test_a_cached_file_small_file_and_unaligned_read_stay_buffered(tmp_path: Path) -> None:
    p = tmp_path / "w.bin"
    data = _write(p)
    p.read_bytes()  # in the page cache now
    fd = os.open(p, os.O_RDONLY)
    try:
        assert not _FdReader(fd, SIZE).direct and not _direct_flag(fd), "a cached file is read from the cache"
        assert not _FdReader(fd, DIRECT_MIN - 4096).direct, "a small file is not worth it"
    finally:
        os.close(fd)
    with _cold(p) as (fd, r), AlignedBuffer(8 << 20) as buf:
        first = r.readinto(buf.view[:1 << 20])
        assert r.direct and bytes(buf.view[:first]) == data[:first]
        odd = r.readinto(buf.view[1:1 + 5000])  # an unaligned buffer and length: buffered from here on
        assert not r.direct and not _direct_flag(fd) and bytes(buf.view[1:1 + odd]) == data[first:first + odd]
        rest = _read_all(r, buf, 4 << 20)
    assert data[:first + odd] + rest == data


def test_store_put_of_a_cold_file_round_trips(cli: Cli, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    data = _write(src / "weights.bin")
    (src / "small").write_bytes(b"x" * 5000)
    _evict(src / "weights.bin")
    cli.run("store", "put", "s", str(src))
    cli.run("store", "get", "s", str(tmp_path / "out"))
    assert (tmp_path / "out" / "src" / "weights.bin").read_bytes() == data
    assert (tmp_path / "out" / "src" / "small").read_bytes() == b"x" * 5000
    assert cli.json("store", "verify", "s")["ok"]
