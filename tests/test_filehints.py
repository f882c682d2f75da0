"""The mapped files warmed for CRIU before the split fill's reads (sandbox.criu.filehints): what is planned
from the images, that a hostile snapshot's paths open nothing but regular files, and the deadline."""
from __future__ import annotations

import os
import struct
import threading
import time
from pathlib import Path

import pytest

from sandbox.criu import filehints, split
from support.criu_records import MAGICS, msg, rec, uint, varint

_varint, _rec, _msg, _int = varint, rec, msg, uint


def _files(entries: list[tuple[int, int, bytes]]) -> bytes:
    """A files.img: FileEntry (type, id, reg {id, flags, pos, fown, name, size}) per (type, id, name)."""
    out = MAGICS
    for kind, fid, name in entries:
        reg = _int(1, fid) + _int(2, 0) + _int(3, 0) + _msg(5, b"\x08\x00\x10\x00") + _msg(6, name) + _int(8, 1234)
        out += _rec(_int(1, kind) + _int(2, fid) + _msg(3, reg))
    return out


FILE_PRIV, ANON = 0x41, 0x201


def _mm(areas: list[tuple[int, int, int, int, int]]) -> bytes:
    """An mm image: MmEntry {1: start code, 14: VmaEntry {start, end, pgoff, shmid, prot, flags, status}}
    per (start, end, pgoff, shmid, status)."""
    body = _int(1, 0x400000)
    for a, b, pgoff, shmid, status in areas:
        body += _msg(14, _int(1, a) + _int(2, b) + _int(3, pgoff) + _int(4, shmid) + _int(5, 3) + _int(6, 2)
                     + _int(7, status) + _int(8, 1))
    return MAGICS + _rec(body)


def _pagemap(entries: list[tuple[int, int]]) -> split.Pagemap:
    data = MAGICS + _rec(_int(1, 1)) + b"".join(_rec(_int(1, a) + _int(2, n) + _int(4, 4)) for a, n in entries)
    return split.parse_pagemap(data)


def test_files_img_gives_the_regular_files_by_id_and_only_absolute_paths() -> None:
    data = _files([(1, 1, b"/usr/lib/libc.so.6"), (1, 2, b"relative/lib.so"), (2, 3, b"/not/a/regular/entry"),
                   (1, 4, b"/with\0nul"), (1, 5, b"/" + b"x" * filehints.MAX_PATH), (1, 6, b"/opt/m\xffodel.so")])
    paths = filehints.reg_paths(data)
    assert paths == {1: ("/usr/lib/libc.so.6", 1234), 6: ("/opt/m\udcffodel.so", 1234)}, paths


@pytest.mark.parametrize("data,why", [
    (MAGICS + struct.pack("<I", 100) + b"\x08\x01", "truncated record"),
    (MAGICS + _rec(_int(1, 1) + b"\x1a\x50" + b"\x00" * 3), "truncated field"),
    (MAGICS + b"\x01\x00", "truncated record"),
    (MAGICS + b"\x00" * (filehints.MAX_FILES_IMG + 1), "more than the"),
])
def test_a_hostile_files_img_is_refused_with_its_reason(data: bytes, why: str) -> None:
    with pytest.raises(filehints.FileHintError, match=why):
        filehints.reg_paths(data)


def test_the_plan_reads_each_mapped_file_s_head_and_the_bytes_behind_its_dumped_pages() -> None:
    P = 4096
    mm = _mm([(0x10000, 0x14000, 0, 1, FILE_PRIV),              # lib 1 text: no dumped page
              (0x14000, 0x18000, 0x20000, 1, FILE_PRIV),        # lib 1 data at file offset 0x20000: 2 dumped pages
              (0x20000, 0x40000, 0, 0, ANON),                   # the heap: not a file
              (0x50000, 0x52000, 0x1000, 2, FILE_PRIV),         # lib 2: one dumped page
              (0x60000, 0x61000, 0, 9, FILE_PRIV)])             # a file files.img does not name
    pm = _pagemap([(0x15000, 2), (0x20000, 8), (0x51000, 1), (0x60000, 1)])
    hints = filehints.plan({1: ("/lib/one.so", None), 2: ("/lib/two.so", 99)}, [(filehints.file_areas(mm), pm)])
    assert [(h.path, h.ranges) for h in hints] == [
        ("/lib/one.so", ((0, filehints.HEAD), (0x20000 + 0x1000, 2 * P))),  # area start + pgoff
        ("/lib/two.so", ((0, filehints.HEAD),)),  # its page, at file offset 0x2000, lies inside the head
    ], hints


def test_the_plan_is_bounded_in_files_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    areas = [(0x100000 * (k + 1), 0x100000 * (k + 1) + 0x10000, 0x100000, k + 1, FILE_PRIV) for k in range(10)]
    mm = _mm(areas)
    pm = _pagemap([(a, 16) for a, *_ in areas])
    paths: dict[int, tuple[str, int | None]] = {k + 1: (f"/lib/{k}.so", None) for k in range(10)}
    monkeypatch.setattr(filehints, "MAX_FILES", 4)
    hints = filehints.plan(paths, [(filehints.file_areas(mm), pm)])
    assert [h.path for h in hints] == [f"/lib/{k}.so" for k in range(4)], "the first files met, at most MAX_FILES"
    monkeypatch.setattr(filehints, "MAX_BYTES", filehints.HEAD + 5 * 4096)
    hints = filehints.plan(paths, [(filehints.file_areas(mm), pm)])
    assert sum(h.nbytes for h in hints) == filehints.HEAD + 5 * 4096, hints
    assert hints[0].ranges == ((0, filehints.HEAD), (0x100000, 5 * 4096)), hints[0]


def test_a_crafted_plan_stays_linear_and_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Areas and pagemap entries that overlap (CRIU writes neither) give no plan at all, where a sweep
    would otherwise be quadratic; offsets past any file's are dropped; ranges are capped."""
    n = 4000
    mm = _mm([(0x100000 + k * 0x2000, 0x100000 + k * 0x2000 + 0x1000, 0, 1, FILE_PRIV) for k in range(n)])
    long_one = [(0x100000, n * 2), *[(0x100000 + k * 0x2000, 1) for k in range(1, n)]]
    t0 = time.monotonic()
    with pytest.raises(filehints.FileHintError, match="entries out of order or overlapping"):
        filehints.plan({1: ("/lib/x.so", None)}, [(filehints.file_areas(mm), _pagemap(long_one))])
    with pytest.raises(filehints.FileHintError, match="entries out of order"):
        filehints.plan({1: ("/lib/x.so", None)}, [(filehints.file_areas(mm), _pagemap([(0x200000, 1), (0x100000, 1)]))])
    assert time.monotonic() - t0 < 5
    with pytest.raises(filehints.FileHintError, match="areas overlap"):
        filehints.file_areas(_mm([(0x10000, 0x20000, 0, 1, FILE_PRIV), (0x18000, 0x30000, 0, 2, FILE_PRIV)]))
    huge = _mm([(0x10000, 0x11000, (1 << 63) - 0x1000, 1, FILE_PRIV)])
    hints = filehints.plan({1: ("/lib/x.so", None)}, [(filehints.file_areas(huge), _pagemap([(0x10000, 1)]))])
    assert hints[0].ranges == ((0, filehints.HEAD),), "an offset past any file's is dropped"
    monkeypatch.setattr(filehints, "MAX_RANGES", 10)
    apart = [(0x100000 + k * 0x2000, 1) for k in range(n)]
    hints = filehints.plan({1: ("/lib/x.so", None)}, [(filehints.file_areas(mm), _pagemap(apart))])
    assert len(hints[0].ranges) <= 10, hints


def test_an_mm_image_cut_short_gives_no_plan() -> None:
    mm = _mm([(0x10000, 0x14000, 0, 1, FILE_PRIV)])
    with pytest.raises(filehints.FileHintError):
        filehints.file_areas(mm[:-3])


def _cached(path: Path) -> bool:
    """Whether PATH's first page is in the page cache (mincore over a mapping of it)."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, 4096, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = (ctypes.c_ubyte * 1)()
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(4096), vec) == 0, ctypes.get_errno()
            return bool(vec[0] & 1)
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(4096))
    finally:
        os.close(fd)


def test_warm_reads_regular_files_and_opens_nothing_else(tmp_path: Path) -> None:
    """A hostile snapshot names a FIFO (an open for reading would wait for a writer), a link to a
    regular file, a directory, a device and a missing file: none is opened for reading, none holds
    the warming up; the regular file is read into the page cache."""
    reg = tmp_path / "lib.so"
    reg.write_bytes(os.urandom(256 << 10))
    fd = os.open(reg, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: the warming puts it back
    os.close(fd)
    assert not _cached(reg)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.so"
    link.symlink_to(reg)
    hints = [filehints.Hint(str(p), ((0, filehints.HEAD), (128 << 10, 8192)))
             for p in (fifo, link, tmp_path, Path("/dev/zero"), tmp_path / "missing", reg)]
    t0 = time.monotonic()
    progress: dict[str, float] = {}
    files, got = filehints.warm(hints, progress=progress)
    assert time.monotonic() - t0 < 5
    assert files == 1 and got == filehints.HEAD + 8192, (files, got)
    assert _cached(reg)
    # the report says why each was passed over: the FIFO, the directory and the link (looked up
    # without following it: the link itself) are no regular files, the missing file fails the
    # lookup, /dev is no data file system's mount
    assert {k: v for k, v in progress.items() if k.startswith("passed_over_")} == {
        "passed_over_kind": 3, "passed_over_lookup": 1, "passed_over_mount": 1}, progress


def test_warm_reads_only_files_of_data_file_systems_reached_without_a_link(tmp_path: Path) -> None:
    """Files whose reads may consume or act (procfs, sysfs: /proc/kmsg, trace pipes) are never read,
    nor a path through a link in any component (a /proc/PID/root detour, a tenant's symlinked
    directory), nor a file whose size is not the one recorded (CRIU refuses it too)."""
    reg = tmp_path / "real" / "lib.so"
    reg.parent.mkdir()
    reg.write_bytes(os.urandom(128 << 10))
    (tmp_path / "via").symlink_to(tmp_path / "real")
    me = f"/proc/{os.getpid()}/root{reg}"
    cases = ["/proc/self/status", "/proc/kmsg", "/sys/kernel/mm/transparent_hugepage/enabled",
             str(tmp_path / "via" / "lib.so"), me]
    files, got = filehints.warm([filehints.Hint(p, ((0, 4096),)) for p in cases])
    assert (files, got) == (0, 0)
    progress: dict[str, float] = {}
    assert filehints.warm([filehints.Hint(str(reg), ((0, 4096),), size=(128 << 10) + 1)], progress=progress) == (0, 0)
    assert progress.get("passed_over_size") == 1, progress
    assert filehints.warm([filehints.Hint(str(reg), ((0, 4096), (1 << 40, 4096)), size=128 << 10)]) == (1, 4096)


def test_warm_holds_few_files_open_and_none_after(tmp_path: Path) -> None:
    """However many files a snapshot names, at most OPEN_MOST are open at once, none when it returns."""
    paths = []
    for k in range(3 * filehints.OPEN_MOST):
        p = tmp_path / f"f{k}"
        p.write_bytes(b"x" * 8192)
        paths.append(p)
    before = len(os.listdir("/proc/self/fd"))
    most = [0]
    real = filehints.open_data_file

    def counting(path: str, size: int | None = None, mounts: dict | None = None,
                 why: list | None = None) -> tuple[int, int] | None:
        most[0] = max(most[0], len(os.listdir("/proc/self/fd")) - before)
        return real(path, size, mounts, why)
    import unittest.mock
    with unittest.mock.patch.object(filehints, "open_data_file", counting):
        assert filehints.warm([filehints.Hint(str(p), ((0, 8192),)) for p in paths]) == (len(paths), 8192 * len(paths))
    assert most[0] <= filehints.OPEN_MOST + 2, most
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_leased_file_is_passed_over_not_waited_for(tmp_path: Path) -> None:
    """A tenant's write lease on a file it names would hold a reader's open for the lease-break time
    (45 s by default): the open does not wait. (The holder, a process of its own here, is told of
    the break by SIGIO, as the kernel does for any reader.)"""
    import subprocess
    import sys
    reg = tmp_path / "leased.so"
    reg.write_bytes(b"y" * 8192)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, signal, sys, time\n"
        "signal.signal(signal.SIGIO, lambda *a: None)\n"
        f"fd = os.open({str(reg)!r}, os.O_WRONLY)\n"
        "try:\n    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)\nexcept OSError as e:\n"
        "    print('no', e, flush=True); sys.exit(0)\n"
        "print('held', flush=True)\ntime.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        said = holder.stdout.readline().strip()
        if said != "held":
            pytest.skip(f"no lease here: {said}")
        t0 = time.monotonic()
        assert filehints.warm([filehints.Hint(str(reg), ((0, 8192),))]) == (0, 0)
        assert time.monotonic() - t0 < 5
    finally:
        holder.kill()
        holder.wait()


def test_warm_within_gives_up_at_its_deadline_and_never_piles_up_stuck_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that does not answer (a stalled mount: here a warm that ignores its stop until let go)
    holds the restore no longer than the deadline, the report says what was done by then; while that
    thread is held up, the next restore warms nothing (busy) instead of leaving another thread and its
    descriptors behind; once it ends, warming works again."""
    release = threading.Event()
    calls = []

    def stuck(hints: object, stop: object, progress: dict) -> tuple[int, int]:
        calls.append(1)
        progress.update(files=3, bytes=12288)
        release.wait(30)
        return 3, 12288
    monkeypatch.setattr(filehints, "warm", stuck)
    t0 = time.monotonic()
    out = filehints.warm_within([filehints.Hint("/x", ((0, 1),))], deadline_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2, out
    assert out["timed_out"] == 1 and out["busy"] == 0 and (out["files"], out["bytes"]) == (3, 12288), out
    again = filehints.warm_within([filehints.Hint("/x", ((0, 1),))], deadline_s=0.2)
    assert again["busy"] == 1 and again["files"] == 0 and len(calls) == 1, again
    release.set()
    for _ in range(100):
        if not any(t.name == "gpusnap-criu-files" and t.is_alive() for t in threading.enumerate()):
            break
        time.sleep(0.02)
    third = filehints.warm_within([filehints.Hint("/x", ((0, 1),))], deadline_s=2)
    assert third["busy"] == 0 and third["timed_out"] == 0 and len(calls) == 2, third


def test_paths_through_mounts_other_than_data_file_systems_are_not_looked_up() -> None:
    """An automount, a FUSE or network mount or procfs on the way is never entered (a lookup there may
    wait or act); nor a path with "..", "." or an empty component."""
    mounts = {"/": "ext4", "/proc": "proc", "/home/t/fuse": "fuse.sshfs", "/net": "autofs", "/opt": "xfs",
              "/srv/nfs": "nfs4", "/dev/shm": "tmpfs"}
    ok = ["/usr/lib/libc.so.6", "/opt/torch/lib/libtorch.so", "/dev/shm/x.so"]
    refused = ["/proc/kmsg", "/home/t/fuse/lib.so", "/net/host/lib.so", "/srv/nfs/a.so", "/usr/../proc/kmsg",
               "/usr/./lib/x.so", "/usr//lib/x.so", "relative.so", "/home/t/fuse"]
    assert all(filehints.through_data_mounts(p, mounts) for p in ok)
    assert not any(filehints.through_data_mounts(p, mounts) for p in refused)
    assert not filehints.through_data_mounts("/usr/lib/x.so", {"/": "nfs"})
    real = filehints._mounts()
    assert "/" in real and filehints.through_data_mounts("/proc/self/status", real) is False


def test_files_img_keeps_only_the_files_the_areas_map() -> None:
    data = _files([(1, 1, b"/a.so"), (1, 2, b"/b.so"), (1, 3, b"/c.so")])
    assert filehints.reg_paths(data, {2, 9}) == {2: ("/b.so", 1234)}


def test_the_hints_can_be_turned_off_and_a_bad_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUSNAP_CRIU_FILE_HINTS", "0")
    assert not filehints.hints_on()
    monkeypatch.setenv("GPUSNAP_CRIU_FILE_HINTS", "2")
    with pytest.raises(filehints.FileHintError, match="GPUSNAP_CRIU_FILE_HINTS='2': expected 0 or 1"):
        filehints.hints_on()
    monkeypatch.delenv("GPUSNAP_CRIU_FILE_HINTS")
    assert filehints.hints_on()
