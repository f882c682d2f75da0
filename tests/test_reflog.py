"""The chunk-reference log (storage.repo.reflog) read back after any cut: a region's list is complete only
with its end line, every index and the right total; a torn or altered line is skipped and counted,
never trusted; a reference is written only after the writer's durability callback ran for it."""
from __future__ import annotations

import os
from pathlib import Path

from storage.repo import reflog
from storage.format.manifest import ChunkRef
from support.entries import ref_id

A = ChunkRef("a" * 64, 100, "zstd", 40)
B = ChunkRef("b" * 64, 50, "raw", 50)
Z = ChunkRef(None, 100, "zero", 0)


def write(tmp: Path, durable: list[list[str]] | None = None) -> bytes:
    seen = durable if durable is not None else []
    with reflog.RefLogWriter(str(tmp), "0" * 32, lambda refs: seen.append([ref_id(r) for r in refs]), batch=2) as w:
        w.region("gpu/7/0", 250, 3, 100)
        w.chunk("gpu/7/0", 2, B)          # lanes finish in any order
        w.chunk("gpu/7/0", 0, A)
        w.chunk("gpu/7/0", 1, Z)
        w.end("gpu/7/0")
        w.group("7", ["gpu/7/0"])
    return (tmp / ("0" * 32 + reflog.SUFFIX)).read_bytes()


def test_complete_log_gives_the_stream_in_order(tmp_path: Path) -> None:
    durable: list[list[str]] = []
    log = reflog.parse(write(tmp_path, durable))
    assert log.bad_lines == 0 and log.group_problem("7", "gpu/7/") is None
    (s,) = log.streams(["7"])
    assert s.name == "gpu/7/0" and s.chunks == [A, Z, B] and s.size == 250
    assert log.ids == {A.id, B.id}
    assert [i for batch in durable for i in batch] == [B.id, A.id], "each stored chunk made durable before its line"


def test_every_cut_is_complete_or_known_incomplete(tmp_path: Path) -> None:
    data = write(tmp_path)
    full_at = data.index(b'"k":"group"')
    for cut in range(len(data)):
        log = reflog.parse(data[:cut])
        why = log.group_problem("7", "gpu/7/")
        if cut < data.index(b"\n", full_at):
            assert why is not None, cut
        else:
            assert why is None
        assert log.bad_lines <= 1


def test_an_altered_line_is_skipped_and_the_region_incomplete(tmp_path: Path) -> None:
    data = bytearray(write(tmp_path))
    at = data.index(b'"i":0')
    data[at + 4] = ord("1")               # chunk 0 claims to be chunk 1: the CRC no longer checks
    log = reflog.parse(bytes(data))
    assert log.bad_lines == 1
    why = log.group_problem("7", "gpu/7/")
    assert why == "gpu/7/0: 2 of 3 chunks recorded (250 bytes), the stream did not finish"


def test_lengths_that_do_not_add_up_are_refused(tmp_path: Path) -> None:
    with reflog.RefLogWriter(str(tmp_path), "1" * 32, lambda refs: None) as w:
        w.region("gpu/8/0", 999, 1, 100)
        w.chunk("gpu/8/0", 0, A)
        w.end("gpu/8/0")
        w.group("8", ["gpu/8/0"])
    log = reflog.read(str(tmp_path), "1" * 32)
    assert log is not None and "do not add up" in (log.group_problem("8", "gpu/8/") or "")


def test_pinned_only_while_the_record_exists_and_never_through_a_link(tmp_path: Path) -> None:
    write(tmp_path)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert reflog.pinned(fd) == set(), "a log without its OP.json names nothing"
        (tmp_path / ("0" * 32 + ".json")).write_text("{}")
        assert reflog.pinned(fd) == {A.id, B.id}
        os.symlink("/etc/passwd", tmp_path / ("2" * 32 + reflog.SUFFIX))
        (tmp_path / ("2" * 32 + ".json")).write_text("{}")
        try:
            reflog.pinned(fd)
        except reflog.RefLogError as e:
            assert "2" * 32 in str(e)
        else:
            raise AssertionError("a log that is a link must stop the caller (gc deletes nothing)")
    finally:
        os.close(fd)
