"""CRIU's images streamed through gpusnap's image streamer (`criu --stream`), against the real CRIU 4.x:
dump and restore of a process tree, the split restore, either path restoring what the other dumped,
and kill -9 of either side mid-stream leaving the workload running or restorable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, cast

import pytest
from conftest import GPUSNAP, REPO, Cli, chunk_files, pythonpath
from support.criu import Tree, _state, children_of as _children, criu_of as _criu_of, healthy, pids_with
from support.criu_records import MAGICS, msg, rec, varint
from support.entries import ref_id

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("need_criu")]

STREAM = {"GPUSNAP_CRIU_IMAGES": "stream"}
STAGING = {"GPUSNAP_CRIU_IMAGES": "staging"}
SPLIT = {**STREAM, "GPUSNAP_CRIU_SPLIT_MIN": str(8 << 20),  # the 24-48 MiB areas move, the rest stays with CRIU
         "GPUSNAP_CRIU_SPLIT_SHARED_MIN": str(8 << 20)}  # (the forked tree's child has its copy at the parent's addresses)
NO_SPLIT = {**STREAM, "GPUSNAP_CRIU_SPLIT_MIN": "0"}
SPLIT_PROCS = {**SPLIT, "GPUSNAP_FILL_PROCS": "3"}  # the fill in worker processes (sandbox/criu/fill_procs.py)
ENCODERS = {**STREAM, "GPUSNAP_ENCODE_PROCS": "2"}  # the dump's chunk work in processes (storage/pipeline/encodeprocs.py)


def cli_json(cli: Cli, env: dict[str, str], *args: str) -> dict:
    return json.loads(cli.run(*args, "--json", env=env).stdout)


def _until(done: Callable[[], object], why: str, within: float = 10.0, step: float = 0.02) -> None:
    """Wait until DONE() is true; fail with WHY after WITHIN seconds (0: it must be true now)."""
    deadline = time.monotonic() + within
    while not done():
        assert time.monotonic() < deadline, why
        time.sleep(step)


def _tree_gone(tree: Tree) -> bool:
    """Neither process of TREE is left (a zombie counts as gone)."""
    return not any(os.path.exists(f"/proc/{p}") and _state(p) != "Z" for p in (tree.pid, tree.child))


def _refused_then_restored(cli: Cli, name: str, env: dict[str, str], says: str, killed_within: float) -> None:
    """A tree dumped as NAME; its restore with ENV fails in one line naming SAYS, leaving none of the
    tree (within KILLED_WITHIN seconds); then the snapshot restores with the fill in workers."""
    tree = Tree(mb=48)
    try:
        cli_json(cli, STREAM, "criu", "dump", str(tree.pid), name)
        tree.reap()
        r = cli.run("criu", "restore", name, env=env, check=False)
        assert r.returncode != 0 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        _until(lambda: _tree_gone(tree), "the half-filled tree is killed", within=killed_within)
        ok = cli_json(cli, SPLIT_PROCS, "criu", "restore", name)
        assert ok["restored_pid"] == tree.pid and healthy(tree.report())
    finally:
        tree.kill()


def test_doctor_advises_the_pipe_limit_only_where_it_caps_crius_page_pipes() -> None:
    """doctor's "dump pipes" line says what the kernel allows; where fs.pipe-max-size holds CRIU's page
    pipes below their size it adds a note with the sysctl to set, and says nothing more where it does not."""
    from sandbox import doctor
    from sandbox.criu.protocol import CRIU_PAGE_PIPE
    capped = {"pipe_max_size": 1 << 20, "cap_sys_resource": False, "dump_pipe": 16 << 20,
              "dump_pipe_allowed": 1 << 20, "criu_page_pipe": 1 << 20}
    line = doctor._render_pipes(capped)
    assert line.startswith("dump pipes           1 MiB of the 16 MiB asked") and "fs.pipe-max-size 1 MiB" in line, line
    assert f"sysctl -w fs.pipe-max-size={64 << 20}" in line, line
    free = {**capped, "pipe_max_size": 64 << 20, "dump_pipe_allowed": 16 << 20, "criu_page_pipe": CRIU_PAGE_PIPE}
    assert "note:" not in doctor._render_pipes(free)
    assert "note:" not in doctor._render_pipes({**capped, "cap_sys_resource": True, "criu_page_pipe": CRIU_PAGE_PIPE})
    bad = {**capped, "dump_pipe": "GPUSNAP_DUMP_PIPE='x' is not a number"}
    assert doctor._render_pipes(bad) == "dump pipes           GPUSNAP_DUMP_PIPE='x' is not a number"


def test_a_dump_pipe_is_grown_to_the_largest_size_the_kernel_allows() -> None:
    """recv_pipe grows CRIU's pipe to the size asked for, else to the largest of its halves the kernel
    allows: with fs.pipe-max-size at 4 MiB (and no CAP_SYS_RESOURCE, as on the machines measured) a
    64 MiB request ends at 4 MiB, not at the 1 MiB floor."""
    import fcntl
    import socket
    from sandbox.criu.protocol import PIPE_SIZE, cap_sys_resource, recv_pipe
    sysctl = "/proc/sys/fs/pipe-max-size"
    try:
        before = open(sysctl).read().strip()
        with open(sysctl, "w") as f:
            f.write(str(4 << 20))
    except OSError as e:
        pytest.skip(f"{sysctl} cannot be set here: {e}")
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    r, w = os.pipe()
    try:
        socket.send_fds(a, [b"x"], [r])
        got = recv_pipe(b, writable=False, size=64 << 20)
        size = fcntl.fcntl(got, 1032)  # F_GETPIPE_SZ
        os.close(got)
        assert size == ((64 << 20) if cap_sys_resource() else 4 << 20), size
        assert size >= PIPE_SIZE
        socket.send_fds(a, [b"x"], [w])  # the wrong direction: refused, closed
        with pytest.raises(Exception, match="other than the expected pipe end"):
            recv_pipe(b, writable=False)
    finally:
        with open(sysctl, "w") as f:
            f.write(before)
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_protocol_rejects_names_that_are_paths() -> None:
    from sandbox.criu.protocol import StreamerError, encode_request, parse_request
    assert parse_request(encode_request("pages-1.img")[4:]) == "pages-1.img"
    for bad in ("../inventory.img", "a/b.img", "", "streamer-serve.sock", ".hidden"):
        with pytest.raises(StreamerError):
            parse_request(encode_request(bad)[4:])
    with pytest.raises(StreamerError):
        parse_request(b"\x0a\x20abc")  # a length past the message's end


_PAGEMAP_MAGICS, _varint, _rec = MAGICS, varint, rec


def _entry(vaddr: int, nr: int, flags: int = 4) -> bytes:
    """A PagemapEntry record (vaddr, nr_pages, flags; 4 is PE_PRESENT)."""
    return _rec(b"\x08" + _varint(vaddr) + b"\x10" + _varint(nr) + b"\x20" + _varint(flags))


def _pm(pages_id: int, entries: list[tuple[int, int]]) -> bytes:
    """A pagemap image: head PAGES_ID, then (vaddr, pages) records, all present."""
    return _PAGEMAP_MAGICS + _rec(b"\x08" + _varint(pages_id)) + b"".join(_entry(a, n) for a, n in entries)


def test_pagemap_split_plan_keeps_small_runs_and_offsets() -> None:
    from sandbox.criu import split
    assert split.PE_PRESENT == 4

    # a 2 MiB area written as two 1 MiB records (CRIU's pipe-sized records) is one run
    data = _pm(7, [(0x1000, 2), (0x100000, 256), (0x200000, 256)]) + _entry(0x400000, 1, split.PE_PARENT) \
        + _entry(0x800000, 3)
    pl = split.plan("pagemap-42.img", data, 2 << 20)
    assert pl is not None and pl.pid == 42 and pl.pages_image == "pages-7.img"
    assert pl.moved == (split.Run(0x100000, 2 * 4096, 512 * 4096),) and pl.moved_bytes == 512 * 4096
    assert pl.kept == ((0, 2 * 4096), (514 * 4096, 3 * 4096))  # the parent run has no bytes here
    again = split.parse_pagemap(pl.pagemap)
    assert [e.vaddr for e in again.entries] == [0x1000, 0x400000, 0x800000]
    assert split.plan("pagemap-42.img", data, 3 << 20) is None
    assert split.plan("pagemap-shmem-3.img", data, 1 << 20) is None


@pytest.mark.parametrize("body,why", [
    (b"\x08\x80", "malformed varint"),                   # a varint cut short by the record's end
    (b"\x08" + b"\xff" * 11 + b"\x01", "malformed varint"),  # longer than 64 bits
    (b"\x0a\x01\x00", "unexpected wire type 2"),         # a length-delimited field: none in a pagemap
    (b"\x08", "malformed varint"),                       # a key with no value
    (b"\x08\x80\x20\x10\x00\x20\x01", "a record of 0 pages"),  # names no page
    (b"\x08\x81\x20\x10\x01\x20\x01", "a record of 1 pages at 0x1001"),  # not page-aligned
    (b"\x08" + bytes([0x80] * 9) + b"\x01" + b"\x10\x01\x20\x01", "a record of 1 pages at 0x8000000000000000"),  # past user space
])
def test_a_hostile_pagemap_record_is_refused_with_its_reason(body: bytes, why: str) -> None:
    """A pagemap comes from the store (another node's, maybe): a record that is not well-formed
    protobuf of varints is refused (the split is skipped or the restore fails), never read past."""
    import struct

    from sandbox.criu import split
    head = b"\x19\x43\x56\x54\x25\x40\x08\x56" + struct.pack("<I", 2) + b"\x08\x01"
    good = struct.pack("<I", 7) + b"\x08\x80\x20\x10\x02\x20\x01"  # vaddr 4096, 2 pages, present
    assert [(e.vaddr, e.nr_pages) for e in split.parse_pagemap(head + good).entries] == [(4096, 2)]
    with pytest.raises(split.SplitError, match=why):
        split.parse_pagemap(head + good + struct.pack("<I", len(body)) + body)


def test_pagemap_of_criu_4_2_counts_pages_in_field_5_and_a_mismatch_skips_the_split() -> None:
    """CRIU 4.2 writes each record's page count in field 5 (64-bit) and 0 in field 2; the records
    below are as CRIU 4.2.1 wrote them here (one 8 KiB record, one 1 MiB record, PE_LAZY|PE_PRESENT).
    A pagemap whose records do not add up to its page image is not split, and the reason says so."""
    import struct

    from sandbox.criu import split

    head = b"\x19\x43\x56\x54\x25\x40\x08\x56" + struct.pack("<I", 2) + b"\x08\x01"
    small = bytes.fromhex("0e0000000880e0d1afb0c815100020042802")               # 2 pages
    big = [bytes.fromhex("0f0000000880c0daf1b1c81510002006288002"),            # 256 pages
           bytes.fromhex("0f0000000880c09af2b1c81510002006288002")]            # the next 1 MiB
    data = head + small + b"".join(big)
    pm = split.parse_pagemap(data)
    assert [e.nr_pages for e in pm.entries] == [2, 256, 256] and split.present_bytes(pm) == (2 + 512) * 4096
    plans, why = split.choose({"pagemap-9.img": data}, {"pages-1.img": (2 + 512) * 4096}, 2 << 20)
    assert why is None and plans["pages-1.img"].moved_bytes == 512 * 4096
    plans, why = split.choose({"pagemap-9.img": data}, {"pages-1.img": 99 << 20}, 2 << 20)
    assert plans == {} and why is not None and "format gpusnap does not know" in why, why
    plans, why = split.choose({"pagemap-9.img": data}, {"pages-1.img": (2 + 512) * 4096}, 4 << 20)
    assert plans == {} and why is not None and "the largest is 2097152" in why, why
    assert split.choose({"pagemap-9.img": data}, {}, 0) == ({}, "the split is off (GPUSNAP_CRIU_SPLIT_MIN=0)")


def _mm(areas: list[tuple[int, ...]], extra: bytes = b"") -> bytes:
    """An mm image: an MmEntry whose field 14 lists (start, end, status[, prot[, flags]]) areas (prot
    read+write and flags MAP_PRIVATE|MAP_ANONYMOUS unless given), after a few other fields as CRIU
    writes them (start code, saved auxv), and EXTRA inside the first area."""
    def area(a: int, b: int, st: int, prot: int = 3, flags: int = 0x22, *, more: bytes = b"") -> bytes:
        body = (b"\x08" + _varint(a) + b"\x10" + _varint(b) + b"\x18\x00\x20\x00\x28" + _varint(prot) + b"\x30"
                + _varint(flags) + b"\x38" + _varint(st) + b"\x40\x01" + more)
        return b"\x72" + _varint(len(body)) + body
    body = b"\x08" + _varint(0x400000) + b"\x68\x21\x68\x06" + b"".join(
        area(*a, more=extra if k == 0 else b"") for k, a in enumerate(areas))
    return _PAGEMAP_MAGICS + _rec(body)


ANON, FILE_PRIV, VDSO, VVAR, VSYSCALL = 0x201, 0x41, 0x209, 0x1201, 0x204


def test_mm_areas_are_the_ordinary_private_anonymous_ones_joined() -> None:
    """The split fills only pages of ordinary private anonymous memory (the heap included): the vDSO,
    vvar, vsyscall, a file's private copy (a skipped zero chunk would read as the file there), shared,
    huge-page and other special areas stay with CRIU. Adjacent fillable areas of the same writability
    join; the vsyscall page past user space is allowed (never filled)."""
    from sandbox.criu import split
    mm = _mm([(0x10000, 0x20000, ANON), (0x20000, 0x30000, ANON | 0x20), (0x30000, 0x34000, ANON, 1),
              (0x34000, 0x38000, FILE_PRIV), (0x40000, 0x42000, VDSO), (0x42000, 0x48000, VVAR),
              (0x50000, 0x60000, ANON, 3, 0x21), (0x60000, 0x61000, ANON, 3, 0x40022),
              (0x70000, 0x71000, ANON | (1 << 27)), (0xffffffffff600000, 0xffffffffff601000, VSYSCALL)],
             extra=b"\x48\x80\x01\x50\x02")
    assert split.mm_areas(mm) == [(0x10000, 0x30000, True), (0x30000, 0x34000, False)]
    pm = split.parse_pagemap(_pm(1, [(0x10000, 32), (0x30000, 2), (0x34000, 2), (0x40000, 2), (0x50000, 16)]))
    # (entry 0 ends at the area's end; the read-only one is cautious; the file's copy, vDSO and shared stay)
    assert split.outside(pm, split.mm_areas(mm)) == ({2, 3, 4}, {1})


@pytest.mark.parametrize("mm,why", [
    (_PAGEMAP_MAGICS + b"\x01", "too short"),
    (_PAGEMAP_MAGICS + _rec(b"\x72\x40\x08\x00"), "truncated area"),
    (_mm([(0x10000, 0x10000, 0x201)]), "an area 0x10000-0x10000"),
    (_mm([(0x10800, 0x20000, 0x201)]), "an area 0x10800-0x20000"),
    (_mm([(0x10000, 0x30000, 0x201), (0x20000, 0x40000, 0x201)]), "areas overlap at 0x20000"),
    (_mm([(0x10000, 0x30000, 0x201), (0x10000, 0x12000, VDSO)]), "areas overlap at 0x10000"),  # a vDSO hidden under
    (_mm([(0xffffffffff600000, 0xffffffffff601000, 0x201)]), "past user space"),
    (_PAGEMAP_MAGICS + _rec(b"\x7b"), "unexpected wire type 3"),
])
def test_a_hostile_mm_image_is_refused_with_its_reason(mm: bytes, why: str) -> None:
    from sandbox.criu import split
    with pytest.raises(split.SplitError, match=why):
        split.mm_areas(mm)


_msg = msg


def _core(sp: int, march: int = 1, sas: tuple[int, int, int] | None = None) -> bytes:
    """A core image: its architecture, a stack pointer where that architecture keeps it, and an
    alternate signal stack (ss_sp, ss_size, ss_flags) when given; fields the split ignores around them."""
    regs = (b"\x08\x07" + _varint(20 << 3) + _varint(sp) if march == 1 else b"\x08\x07" + b"\x10" + _varint(sp))
    ti = (b"\x08\x00" + _msg(2, regs) + _msg(3, b"\x08\x01")) if march == 1 else (b"\x08\x00\x10\x00" + _msg(3, regs))
    thread_core = b"\x08\x00\x10\x18" + (_msg(7, b"\x08" + _varint(sas[0]) + b"\x10" + _varint(sas[1]) + b"\x18"
                                                  + _varint(sas[2])) if sas else b"")
    body = b"\x08" + _varint(march) + _msg(2 if march == 1 else 8, ti) + _msg(3, b"\x08\x01") + _msg(5, thread_core)
    return _PAGEMAP_MAGICS + _rec(body)


def test_the_areas_where_a_thread_takes_a_signal_stay_with_criu() -> None:
    """A handled signal pending at the dump is delivered, once restored, before the stop CRIU leaves
    pending: its frame is written below the thread's stack pointer or on its alternate signal stack,
    and a fill afterwards would overwrite it. So the areas holding each thread's stack pointer and
    enabled alternate stack stay with CRIU (x86-64 and aarch64 cores; a disabled alternate stack does
    not count), the other areas still move; a thread's core image missing, or one of an architecture
    or shape not known, stops the split with its reason."""
    from sandbox.criu import split
    below = split.FRAMES_BELOW_SP  # the frames go below the stack pointer: the areas of that range stay
    assert split.thread_stacks(_core(0x7ffe0001f888)) == [(0x7ffe0001f888 - below, 0x7ffe0001f889)]
    assert split.thread_stacks(_core(0x20100, march=3, sas=(0x50000, 0x8000, 0))) == [(0, 0x20101),
                                                                                      (0x50000, 0x58000)]
    assert split.thread_stacks(_core(0x80100, sas=(0x50000, 0x8000, split.SS_DISABLE))) == [(0x80100 - below, 0x80101)]
    twice = _core(0x1000)
    twice = twice[:8] + _rec(twice[12:] + _msg(5, b"\x08\x00"))  # a second thread_core hiding the first's
    for bad, expected in ((_core(0x1000, march=5), "architecture 5"), (_core(0x1000)[:20], "truncated"),
                          (_PAGEMAP_MAGICS + _rec(b"\x08\x01"), "no stack pointer"),
                          (_core((1 << 64) + 0x7ffe0001f888), "more than 64 bits"),  # CRIU would read the low 64
                          (twice, "field 5 more than once"),
                          (_PAGEMAP_MAGICS + b"\x00" * (split.MAX_CORE_BYTES), "more than")):
        with pytest.raises(split.SplitError, match=expected):
            split.thread_stacks(bad)
    mm = _mm([(0x10000, 0x20000, ANON), (0x20000, 0x30000, ANON | 0x20), (0x40000, 0x48000, ANON),
              (0x50000, 0x58000, ANON), (0x60000, 0x70000, ANON)])
    # the stack pointer in the second area (joined with the first when nothing is kept), an alternate
    # stack over the fourth: those two stay; a range in a gap between areas keeps nothing
    assert split.mm_areas(mm) == [(0x10000, 0x30000, True), (0x40000, 0x48000, True), (0x50000, 0x58000, True),
                                  (0x60000, 0x70000, True)]
    kept = [(0x2f888, 0x2f889), (0x50000, 0x58000), (0x38000, 0x39000)]
    assert split.mm_areas(mm, kept) == [(0x10000, 0x20000, True), (0x40000, 0x48000, True), (0x60000, 0x70000, True)]
    # a stack pointer at an area's very end (an empty stack): the frame goes into that area, which stays
    assert split.mm_areas(mm, [(0x48000 - 0x1000, 0x48001)]) == [(0x10000, 0x30000, True), (0x50000, 0x58000, True),
                                                                 (0x60000, 0x70000, True)]
    # many kept ranges, unsorted and overlapping, against many areas: one sweep, the same answer as one by one
    many = _mm([(0x100000 + k * 0x2000, 0x101000 + k * 0x2000, ANON) for k in range(3000)])
    ranges = [(0x100000 + k * 0x6000 + 0x800, 0x100000 + k * 0x6000 + 0x900) for k in range(999, -1, -1)] * 2
    left = split.mm_areas(many, ranges)
    assert len(left) == 2000 and all((a - 0x100000) % 0x6000 != 0 for a, _, _ in left)
    # two threads (pstree lists them, unpacked as CRIU writes them), one core each; the split keeps both stacks
    ps = _PAGEMAP_MAGICS + _rec(b"\x08\x09\x10\x01\x18\x09\x20\x09\x28\x09\x28\x0b")
    threads = split.pstree_threads(ps)
    assert threads == {9: [9, 11]} and split.pstree_records(ps) == [(9, 1)]
    # a zombie child, as CRIU 4.2.1 writes one (a number that is no thread id): listed, never in the way
    zombie = ps + _rec(b"\x08\xce\x07\x10\x09\x18\x09\x20\x09\x28\x80\xc1\x97\xa3\x01")
    assert split.pstree_records(zombie) == [(9, 1), (974, 9)] and split.pstree_threads(zombie)[9] == [9, 11]
    cores = {"core-9.img": _core(0x2f888), "core-11.img": _core(0x47000, sas=(0x50000, 0x8000, 0))}
    stacks, why = split.process_stacks([9], threads, cores.get)
    assert why is None and stacks == {9: [(0, 0x2f889), (0x47000 - below, 0x47001), (0x50000, 0x58000)]}
    pmap = _pm(1, [(0x10000, 16), (0x20000, 16), (0x40000, 8), (0x50000, 8), (0x60000, 16)])
    sizes = {"pages-1.img": 64 * 4096}
    stacks = {9: [(0x2f888 - 0x1000, 0x2f889), (0x47000 - 0x1000, 0x47001), (0x50000, 0x58000)]}  # (narrower)
    plans, why = split.choose({"pagemap-9.img": pmap}, sizes, 4096, mms={"mm-9.img": mm}, stacks=stacks)
    assert why is None and plans["pages-1.img"].moved == (split.Run(0x10000, 0, 16 * 4096), split.Run(0x60000, 48 * 4096, 16 * 4096))
    assert plans["pages-1.img"].stack_kept == 32 * 4096, "the report says what the stack rule kept with CRIU"
    stacks, why = split.process_stacks([9], threads, {"core-9.img": cores["core-9.img"]}.get)
    assert stacks == {} and why == "the snapshot lacks core-11.img; CRIU restored every page"
    stacks, why = split.process_stacks([9], threads, {**cores, "core-11.img": _core(1, march=4)}.get)
    assert stacks == {} and why is not None and "core-11.img is not understood (core: architecture 4" in why, why
    plans, why = split.choose({"pagemap-9.img": pmap}, sizes, 4096, mms={"mm-9.img": mm}, stacks={})
    assert plans == {} and why is not None and "where the threads of process 9 have their stacks is not known" in why, why
    # a pstree listing more threads than any tree has: not read one by one, the split is off
    stacks, why = split.process_stacks([9], {9: list(range(1, split.MAX_THREADS + 2))}, cores.get)
    assert stacks == {} and why is not None and f"more than {split.MAX_THREADS} threads" in why, why


def test_the_split_moves_no_page_outside_a_process_s_ordinary_private_areas() -> None:
    """With the mm images, a run the size threshold would move stays with CRIU where it is not wholly in
    an ordinary private area (here a vDSO of 2 pages at a threshold of one page: CRIU reads the vDSO's
    ELF while it restores, and failed with "vdso: Invalid ELF magic" when the split took it); a process
    whose mm image is absent moves nothing; a hostile mm image stops the split, with its reason; an
    mm image under a name CRIU never writes (non-ASCII digits) is not taken for the process's own."""
    from sandbox.criu import split
    pmap = _pm(1, [(0x10000, 16), (0x40000, 2)])
    sizes = {"pages-1.img": 18 * 4096}
    mm = _mm([(0x10000, 0x20000, ANON), (0x40000, 0x42000, VDSO)])
    plans, why = split.choose({"pagemap-9.img": pmap}, sizes, 4096, mms={"mm-9.img": mm})
    assert why is None and plans["pages-1.img"].moved == (split.Run(0x10000, 0, 16 * 4096),)
    assert plans["pages-1.img"].kept == ((16 * 4096, 2 * 4096),) and plans["pages-1.img"].cow_kept == 0
    plans, why = split.choose({"pagemap-9.img": pmap}, sizes, 4096)  # no mm images given: sizes alone
    assert plans["pages-1.img"].moved_bytes == 18 * 4096
    plans, why = split.choose({"pagemap-9.img": pmap}, sizes, 4096, mms={"mm-8.img": mm})
    assert plans == {} and why is not None and "no run of pages" in why, why
    plans, why = split.choose({"pagemap-9.img": pmap}, sizes, 4096, mms={"mm-9.img": mm[:-3]})
    assert plans == {} and why is not None and "mm-9.img is not understood" in why, why
    everything = _mm([(0x10000, 0x20000, ANON), (0x40000, 0x42000, ANON)])
    plans, why = split.choose({"pagemap-9.img": pmap}, sizes, 4096,
                              mms={"mm-9.img": mm, "mm-\u0669.img": everything, "mm-09.img": everything})
    assert plans["pages-1.img"].moved_bytes == 16 * 4096, "the vDSO stays with CRIU"
    assert split.PAGEMAP_NAME.fullmatch("pagemap-\u0669.img") is None and split.PAGEMAP_NAME.fullmatch("pagemap-09.img") is None


def test_pages_a_parent_and_child_may_share_and_read_only_pages_keep_the_first_rule() -> None:
    """At a one-page threshold, a child's runs at addresses its parent also has pages at move only when
    they are 64 MiB or more (the split's first rule, under which CRIU kept the smaller ones shared
    copy-on-write: cow_shared sees sharing only where a whole chunk is equal), in both processes; so do
    runs in read-only areas. Runs at addresses only one of them has move at any size."""
    from sandbox.criu import split
    parent = _pm(1, [(0x100000, 16), (0x200000, 4), (0x300000, 2)])
    child = _pm(2, [(0x100000, 16), (0x400000, 4)])
    mm_p = _mm([(0x100000, 0x110000, ANON), (0x200000, 0x204000, ANON), (0x300000, 0x302000, ANON, 1)])
    mm_c = _mm([(0x100000, 0x110000, ANON), (0x400000, 0x404000, ANON)])
    sizes = {"pages-1.img": 22 * 4096, "pages-2.img": 20 * 4096}
    plans, why = split.choose({"pagemap-10.img": parent, "pagemap-11.img": child}, sizes, 4096,
                              parents={11: 10}, mms={"mm-10.img": mm_p, "mm-11.img": mm_c})
    assert why is None
    assert plans["pages-1.img"].moved == (split.Run(0x200000, 16 * 4096, 4 * 4096),)  # not the shared, not the read-only
    assert plans["pages-2.img"].moved == (split.Run(0x400000, 16 * 4096, 4 * 4096),)
    plans, why = split.choose({"pagemap-10.img": parent, "pagemap-11.img": child}, sizes, 4096,
                              mms={"mm-10.img": mm_p, "mm-11.img": mm_c})  # unrelated processes: the common addresses move
    assert plans["pages-2.img"].moved_bytes == 20 * 4096 and plans["pages-1.img"].moved_bytes == 20 * 4096


def _reads(streams, fetch):
    """A split.ReadAll over FETCH(stream, index, ref) -> bytes, one chunk after the other in one thread
    (the read stage's own read-ahead is tested with the store in tests/test_store_packs.py)."""
    where = {c.id: (s, i) for s in streams.values() for i, c in enumerate(s.chunks) if c.id is not None}

    def read(wants, deliver, stop):
        for w in wants:
            if stop():
                return
            s, i = where[w.ref.id]
            deliver(w, memoryview(fetch(s, i, w.ref)))

    return read


def _filler_case(nchunks: int, chunk: int, fetch, budget: int):
    """A Filler whose one moved run is a buffer of this very process (written through our own /proc/self/mem)."""
    import ctypes
    from sandbox.criu import split
    from storage.format.manifest import ChunkRef, Stream
    target = ctypes.create_string_buffer(nchunks * chunk)
    refs = [ChunkRef(None, chunk, "zero", 0) if i == 1 else ChunkRef(f"{i:064x}", chunk, "raw", chunk) for i in range(nchunks)]
    streams = {"pages-1.img": Stream("pages-1.img", {"type": "file"}, refs)}
    plan = split.Plan(os.getpid(), "pages-1.img", b"", (), (split.Run(ctypes.addressof(target), 0, nchunks * chunk),))
    return target, split.Filler(split.fill_jobs([plan], streams), _reads(streams, fetch), 4, budget)


def test_a_fill_job_of_zero_raw_bytes_is_not_a_division_by_zero() -> None:
    """A hostile manifest may name a (non-zero) chunk of 0 raw bytes; when it is a fill worker's only
    job, the Filler sizes its held buffers from it: that must not raise ZeroDivisionError (a
    traceback-like line instead of the read's own verdict on the chunk)."""
    from sandbox.criu import split
    from storage.format.manifest import ChunkRef
    got: list[int] = []

    def read(wants, deliver, stop) -> None:
        got.append(len(wants))
    f = split.Filler({f"{1:064x}": (ChunkRef(f"{1:064x}", 0, "raw", 0), [])}, read, 1, 1 << 20)
    f.close()
    assert f.max_held >= 2 and got == [1]


def test_split_filler_reads_ahead_within_its_budget_and_writes_every_byte() -> None:
    import threading
    import time
    chunk, n = 64 << 10, 24
    lock, state = threading.Lock(), {"fetched": 0}

    def fetch(s, i, ref):
        with lock:
            state["fetched"] += 1
        return bytes([i]) * ref.raw_len

    target, filler = _filler_case(n, chunk, fetch, budget=3 * (chunk + 4096))
    with filler:
        deadline = time.monotonic() + 5
        while state["fetched"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # reading ahead before anyone writes, but no further than the budget allows:
        assert state["fetched"] == 4  # three chunks held, the fourth read and waiting to be
        stats = filler.write(lambda pid: True)
    assert stats == {"written": (n - 1) * chunk, "zero_skipped": chunk}
    assert state["fetched"] == n - 1  # the zero chunk is never fetched
    for i in range(n):
        want = 0 if i == 1 else i
        assert target.raw[i * chunk:(i + 1) * chunk] == bytes([want]) * chunk, i


def test_split_filler_stops_at_the_first_damaged_chunk() -> None:
    from storage.base.errors import GpusnapError
    chunk, n = 64 << 10, 40
    fetched: list[int] = []

    class Damaged(GpusnapError):
        pass

    def fetch(s, i, ref):
        fetched.append(i)
        if i == 5:
            raise Damaged("chunk 5 is damaged")
        return bytes(ref.raw_len)

    _target, filler = _filler_case(n, chunk, fetch, budget=2 * (chunk + 4096))
    with filler, pytest.raises(Damaged, match="chunk 5"):
        filler.write(lambda pid: True)
    assert max(fetched) < n - 1, fetched  # nothing much past the failure was read


def test_split_filler_fetches_a_chunk_shared_by_two_images_once() -> None:
    """A forked child's page image names its parent's chunks: each is fetched once, written into both."""
    import ctypes
    from sandbox.criu import split
    from storage.format.manifest import ChunkRef, Stream
    chunk, n = 64 << 10, 6
    targets = [ctypes.create_string_buffer(n * chunk) for _ in range(2)]
    refs = [ChunkRef(f"{i:064x}", chunk, "raw", chunk) for i in range(n)]
    streams = {f"pages-{k}.img": Stream(f"pages-{k}.img", {"type": "file"}, refs) for k in (1, 2)}
    plans = [split.Plan(os.getpid(), f"pages-{k}.img", b"", (), (split.Run(ctypes.addressof(targets[k - 1]), 0, n * chunk),))
             for k in (1, 2)]
    fetched: list[int] = []

    def fetch(s, i, ref):
        fetched.append(i)
        return bytes([i + 1]) * chunk

    with split.Filler(split.fill_jobs(plans, streams), _reads(streams, fetch), 3, 4 * (chunk + 4096)) as filler:
        stats = filler.write(lambda pid: True)
    assert sorted(fetched) == list(range(n)) and stats["written"] == 2 * n * chunk
    for t in targets:
        assert t.raw == b"".join(bytes([i + 1]) * chunk for i in range(n))


def test_split_filler_completes_one_phase_before_the_next_and_says_when_each_is_written() -> None:
    """Phases (the split fill completing one process before the next): every chunk of phase 0 is read
    before any of phase 2, on_phase(p) comes once phases 0..p are written, in order (an empty phase
    too), and when it says phase 0 is written, every byte of phase 0 is in its place."""
    import ctypes
    from sandbox.criu import split
    from storage.format.manifest import ChunkRef, Stream
    chunk, n = 64 << 10, 8
    bufs = [ctypes.create_string_buffer(n * chunk) for _ in range(2)]
    refs = [[ChunkRef(f"{k}{i:063x}", chunk, "raw", chunk) for i in range(n)] for k in (1, 2)]
    refs[1][3] = ChunkRef(None, chunk, "zero", 0)
    streams = {f"pages-{k}.img": Stream(f"pages-{k}.img", {"type": "file"}, refs[k - 1]) for k in (1, 2)}
    plans = [split.Plan(os.getpid(), f"pages-{k}.img", b"", (), (split.Run(ctypes.addressof(bufs[k - 1]), 0, n * chunk),))
             for k in (1, 2)]
    jobs = split.fill_jobs(plans, streams)
    # the second image's chunks first (phase 0), the first's last (phase 2): phase 1 has nothing
    phases = {k: (0 if (isinstance(k, str) and k[0] == "2") or isinstance(k, tuple) else 2) for k in jobs}
    fetched: list[str] = []
    said: list[tuple[int, bytes, bytes]] = []

    def fetch(s, i, ref):
        fetched.append(ref.id[0])
        return bytes([int(ref.id[0]) * 16 + i]) * chunk

    def on_phase(p: int) -> None:
        said.append((p, bytes(bufs[1].raw), bytes(bufs[0].raw)))

    with split.Filler(jobs, _reads(streams, fetch), 3, 2 * (chunk + 4096), phases=phases) as filler:
        stats = filler.write(lambda pid: True, on_phase)
    assert fetched == ["2"] * (n - 1) + ["1"] * n, fetched  # phase 0's chunks all read first
    assert [p for p, *_ in said] == [0, 1, 2]
    want2 = b"".join(bytes(chunk) if i == 3 else bytes([32 + i]) * chunk for i in range(n))
    want1 = b"".join(bytes([16 + i]) * chunk for i in range(n))
    assert said[0][1] == want2, "phase 0 said written before all its bytes were in place"
    assert said[2][1] == want2 and said[2][2] == want1
    assert stats == {"written": (2 * n - 1) * chunk, "zero_skipped": chunk}


def test_fill_phases_rank_a_shared_chunk_by_its_first_process_and_shares_keep_the_phases_apart() -> None:
    """fill_phases: a chunk is in the phase of the earliest of FIRST it is written into (the others'
    last); shares(...) cuts each phase across the workers, so each worker writes phase 0 first."""
    from sandbox.criu import fill_procs, split
    from storage.format.manifest import ChunkRef
    mib = 1 << 20

    def ref(i: int) -> ChunkRef:
        return ChunkRef(f"{i:064x}", mib, "raw", mib)

    # chunk i: in pid 10 for i < 12, in pid 20 for 8 <= i < 20 (8..11 shared), in pid 30 for i >= 20
    jobs: dict[split.Key, split.Job] = {ref_id(ref(i)): (ref(i), [(p, 0, 0, mib) for p, lo, hi in ((10, 0, 12), (20, 8, 20), (30, 20, 24)) if lo <= i < hi])
            for i in range(24)}
    ph = split.fill_phases(jobs, (20, 10))
    assert [ph[ref_id(ref(i))] for i in range(24)] == [1] * 8 + [0] * 12 + [2] * 4
    where: dict[split.Key, tuple[str, int]] = {ref_id(ref(i)): ("p", (23 - i) * mib) for i in range(24)}  # on disk in reverse
    parts = fill_procs.shares(jobs, where.__getitem__, 3, mib, ph)
    assert len(parts) == 3
    for part in parts:
        seq = [ph[k] for k in part]
        assert seq == sorted(seq) and set(seq) == {0, 1, 2}, seq  # every worker has its part of each phase, in order
        for p in (0, 1, 2):  # and each part in pack order
            offs = [where[k][1] for k in part if ph[k] == p]
            assert offs == sorted(offs)
    assert sorted(k for part in parts for k in part) == sorted(jobs)


def test_split_writes_only_into_processes_the_restore_made() -> None:
    """A page image names its process by pid: the fill writes only into one of the snapshot's pids
    that started after the restore began, never into a process that was already there."""
    from sandbox.criu.restored import boot_ticks, restored_by_criu
    mine = os.getpid()  # started long before
    born_after = boot_ticks()
    assert not restored_by_criu(mine, [mine], born_after)
    time.sleep(0.05)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert restored_by_criu(child.pid, [child.pid], born_after)
        assert not restored_by_criu(child.pid, [mine], born_after)  # not one of the snapshot's pids
    finally:
        child.kill()
        child.wait()
    assert not restored_by_criu(child.pid, [child.pid], born_after)  # gone


def test_read_order_is_what_criu_reads_first_then_what_the_split_fills() -> None:
    """What a restore from a remote fetches first: the inventory and the process tree, the other
    small images (smallest first), each page image's ranges CRIU reads (by image number), and only
    then the runs the split writes after CRIU."""
    from sandbox.criu import split
    from sandbox.criu.serve import read_order
    from storage.format.manifest import ChunkRef, Stream

    def ref(tag: str, n: int = 4096) -> ChunkRef:
        return ChunkRef(tag * 64, n, "raw", n)

    def img(*chunks: ChunkRef) -> Stream:
        return Stream("images/x", {"type": "file"}, list(chunks))

    images = {"core-1.img": img(ref("c", 100)), "mm-1.img": img(ref("d", 50)), "pstree.img": img(ref("b", 200)),
              "inventory.img": img(ref("a", 300)),
              "pages-2.img": img(ref("e")), "pages-1.img": img(ref("1"), ref("2", 8192), ref("3", 8192), ref("4"))}
    plan = split.Plan(1, "pages-1.img", b"", kept=((0, 4096), (20480, 4096)), moved=(split.Run(0x7000, 4096, 16384),))
    assert [ref_id(c)[0] for c in read_order(images, None)] == list("abdc")
    assert [ref_id(c)[0] for c in read_order(images, {"pages-1.img": plan})] == list("abdc14e23")
    assert [ref_id(c)[0] for c in read_order(images, {})] == list("abdc1234e")


@pytest.mark.parametrize("dump_env,restore_env", [(STREAM, SPLIT), (STREAM, SPLIT_PROCS), (STREAM, NO_SPLIT), (ENCODERS, SPLIT),
                                               (STREAM, {**SPLIT_PROCS, "GPUSNAP_FILL_READERS": "6", "GPUSNAP_WAKE_PROBE": "1"}),
                                               (STREAM, {**SPLIT_PROCS, "GPUSNAP_FILL_READERS": "1"}),
                                               (STREAM, {**SPLIT_PROCS, "GPUSNAP_FILL_READERS": "6", "GPUSNAP_FILL_READERS_EARLY": "1"}),
                                               (STREAM, {**SPLIT_PROCS, "GPUSNAP_FILL_PREFETCH_EARLY": "1"}),
                                               (STREAM, {**SPLIT, "GPUSNAP_FILL_PREFETCH_EARLY": "1"}),
                                               ({**STREAM, "GPUSNAP_FD_READ": "python"}, SPLIT),
                                               ({**STREAM, "GPUSNAP_DUMP_DIRECT": "1"}, SPLIT),
                                               ({**STREAM, "GPUSNAP_DUMP_DIRECT": "0"}, SPLIT)],
                         ids=["split", "split-in-3-processes", "criu-restores-all", "dumped-by-encoder-processes",
                              "split-in-3-processes-2-reads-each", "split-in-3-processes-taking-turns-at-1-read",
                              "split-in-3-processes-1-read-while-criu-runs", "split-in-3-processes-read-ahead-while-criu-runs",
                              "split-read-ahead-while-criu-runs", "dump-read-by-pythons-loop", "dump-packs-direct",
                              "dump-packs-buffered"])
def test_stream_dump_and_restore_of_a_tree(cli: Cli, store_dir: Path, dump_env: dict[str, str], restore_env: dict[str, str]) -> None:
    tree = Tree(mb=48)
    try:
        assert healthy(tree.report())
        d = cli_json(cli, dump_env, "criu", "dump", str(tree.pid), "s1")
        assert d["images_path"] == "stream" and d["raw_bytes"] >= 48 << 20
        if dump_env.get("GPUSNAP_FD_READ") == "python":
            assert d["pipe_reads"] == "Python (GPUSNAP_FD_READ=python)"
        elif not os.environ.get("GPUSNAP_NO_NATIVE"):
            assert d["pipe_reads"] == "C"  # the C loop, built by setup
        # the packs past the page cache where asked, or by default where the host hands free memory back
        # to its hypervisor (sandbox.host.dumpwrites), and where the store's file system takes O_DIRECT
        from sandbox.host.hugepages import free_page_reporting
        from storage.fs.directio import direct_io_supported
        from support.pagecache import resident_bytes
        asked = dump_env.get("GPUSNAP_DUMP_DIRECT", "1" if free_page_reporting() is not None else "0")
        direct = asked == "1" and direct_io_supported(str(store_dir / "tmp"))
        assert d["pack_writes"] == ("direct" if direct else "buffered"), d
        if direct:
            assert resident_bytes(store_dir / "packs") == 0
        if dump_env is ENCODERS:  # new chunks were encoded (and their stored checksums computed) in the processes
            assert d["stages"]["checksum"]["bytes"] > 0, d["stages"]
        elif (os.cpu_count() or 1) < 8 and "GPUSNAP_ENCODE_PROCS" not in os.environ:
            assert "checksum" not in d["stages"], "no encoder process on a machine of fewer than 8 cores by default"
        # the ingest ran while CRIU wrote: every raw byte came through CRIU's pipe into the pipeline, none
        # from a staged copy. (Not a timing check: at 48 MiB the tail after CRIU, the last chunks and
        # the fsyncs, took 0.26 s against CRIU's 0.19 s on a loaded CI machine; the benchmarks measure
        # the overlap: 0.2 s after a 15.6 s dump of 24 GB on the H200.)
        followed = cli.json("store", "inspect", "s1")["meta"]["ingested_while_dumping"]
        assert any(f.startswith("pages-") for f in followed), followed
        tree.reap()
        assert not tree.alive(), "the tree is killed once the snapshot is committed"
        assert not list((store_dir / "tmp").iterdir())
        assert cli.json("store", "verify", "s1")["ok"]
        r = cli_json(cli, restore_env, "criu", "restore", "s1")
        assert r["images_path"] == "stream" and r["restored_pid"] == tree.pid
        served = r["stages"]["served"]
        # where CRIU's feeds waited: for a decoded chunk, for a thread of the pool, for CRIU to read (the
        # bytes written from chunks: part of what CRIU was served, whose zeros and rewritten images are not)
        feed = served["stages"]
        assert 0 < feed["feed:write"]["bytes"] <= served["bytes"], (feed, served["bytes"])
        assert {"feed:wait", "feed:queued"} <= set(feed), feed
        # how late gpusnap's threads woke while CRIU ran: only where asked for (it wakes 200 times a second)
        if restore_env.get("GPUSNAP_WAKE_PROBE") == "1":
            assert served["criu_wake_late"]["wakes"] > 0 and served["criu_wake_late"]["late_s"] >= 0, served
        else:
            assert "criu_wake_late" not in served
        if restore_env is not NO_SPLIT:
            assert served["moved_bytes"] >= 48 << 20 and served["split"]["written"] >= 48 << 20, served
            assert "split_fill" in r["seconds"] and "split_skipped_because" not in served
            assert served["fill_memory"]["procs"] == (3 if "GPUSNAP_FILL_PROCS" in restore_env else 1), served["fill_memory"]
            from sandbox.criu.fill_procs import FILL_READERS
            reads = int(restore_env.get("GPUSNAP_FILL_READERS", FILL_READERS))
            early = min(reads, int(restore_env.get("GPUSNAP_FILL_READERS_EARLY", reads)))
            assert served["fill_memory"]["readers"] == reads, served["fill_memory"]
            assert served["fill_memory"]["readers_early"] == early, served["fill_memory"]
            assert served["fill_memory"]["prefetch_early"] == int(restore_env.get("GPUSNAP_FILL_PREFETCH_EARLY", 0))
            # reads that do not share out evenly among the worker processes, or fewer while CRIU ran: the
            # workers took turns (ReadTokens), and said how long they waited; in one process the gate
            # (EarlyGate) held the fill's own readers to EARLY while CRIU ran
            procs = served["fill_memory"]["procs"]
            assert ("read:wait-gate" in served["stages"]) == bool(reads % procs or early < reads), served["stages"]
            assert served["stages"]["decompress+verify"]["bytes"] > 0, "the workers' stages reach the report"
            # the files the tree maps (the interpreter, its libraries) were read for CRIU before the fill's
            # reads: their heads and the pages behind every dumped page of their private copies
            hints = served["file_hints"]
            assert hints["files"] >= 3 and hints["bytes"] >= 3 * 4096 and not hints["timed_out"] and not hints["busy"], hints
            assert served["stages"]["criu-first files"]["bytes"] == hints["bytes"], served["stages"]
        else:
            assert served["moved_bytes"] == 0 and "split" not in served
            assert served["split_skipped_because"] == "the split is off (GPUSNAP_CRIU_SPLIT_MIN=0)"
        after = tree.report()
        assert healthy(after), after
        assert _state(tree.pid) in ("S", "R"), "the tree runs (not left stopped) after the restore"
    finally:
        tree.kill()


def test_a_tree_of_many_mappings_of_mixed_data_is_filled_by_the_split_at_the_default(cli: Cli, store_dir: Path) -> None:
    """A server's heap is thousands of mappings, not one buffer: at the default threshold the split
    fills them (the vDSO and other special areas stay with CRIU, and so do runs under 64 MiB at
    addresses parent and child both have pages at: they may be shared), written zeros are skipped, and
    every process checks its memory after the restore. The child's memory is its own at other
    addresses, as a spawned worker's is."""
    tree = Tree(mb=64, data="mixed", sharing="own")
    try:
        maps = sum(1 for _ in open(f"/proc/{tree.pid}/maps"))
        assert maps > 100, maps  # the workload's regions and their guard pages
        assert healthy(tree.report())
        d = cli_json(cli, STREAM, "criu", "dump", str(tree.pid), "mx")
        tree.reap()
        r = cli_json(cli, STREAM, "criu", "restore", "mx")
        served = r["stages"]["served"]
        assert "split_skipped_because" not in served, served
        # both processes' 64 MiB moved (at the first default, 64 MiB, nothing did: no run of this tree is
        # that large); the interpreter's heap the child inherited stays with CRIU in both
        assert served["moved_bytes"] >= 128 << 20, (served["moved_bytes"], d["raw_bytes"])
        assert served["split"]["zero_skipped"] > 0, served["split"]
        after = tree.report()
        assert healthy(after), after
    finally:
        tree.kill()


def test_a_fill_worker_meeting_a_damaged_chunk_fails_the_restore_as_damage(cli: Cli, store_dir: Path) -> None:
    """A chunk of the moved runs damaged in its pack: the worker process that reads it reports damage,
    the restore exits 3 with one line, and the tree CRIU made is killed (nothing runs half-filled)."""
    from support.entries import chunk_entries
    tree = Tree(mb=48)
    try:
        cli_json(cli, STREAM, "criu", "dump", str(tree.pid), "dmg")
        tree.reap()
        victim = max(chunk_entries(store_dir), key=lambda e: e.length)  # a page chunk of the 48 MiB areas
        data = bytearray(victim.read())
        data[len(data) // 2] ^= 0xFF
        victim.write(bytes(data))
        r = cli.run("criu", "restore", "dmg", env=SPLIT_PROCS, check=False)
        assert r.returncode == 3 and "damaged" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
        _until(lambda: _tree_gone(tree), "the half-filled tree is killed, all of it", step=0.05)
    finally:
        tree.kill()


def _large_areas(pid: int) -> dict[int, str]:
    """PID's private writable anonymous mappings of 8 MiB or more (where the split fill writes; not the
    heap or the stack, which change as it runs), hashed by start."""
    import hashlib
    out = {}
    with open(f"/proc/{pid}/maps") as f, open(f"/proc/{pid}/mem", "rb") as mem:
        for line in f:
            if len(line.split()) > 5:  # a file, [heap], [stack], ...
                continue
            rng, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in rng.split("-"))
            if perms.startswith("rw") and perms.endswith("p") and hi - lo >= 8 << 20:
                mem.seek(lo)
                out[lo] = hashlib.sha256(mem.read(hi - lo)).hexdigest()
    return out


@pytest.mark.parametrize("restore_env", [SPLIT, SPLIT_PROCS], ids=["split", "split-in-3-processes"])
def test_a_process_of_fill_first_runs_as_soon_as_its_own_runs_are_in(cli: Cli, store_dir: Path, restore_env: dict[str, str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """RestoreRun.fill_first (what lets a CUDA process's GPU state come back while the fill goes on):
    the child's moved runs are written first; it is continued and on_filled(child) called while the
    fill still holds its parent stopped; then the whole tree runs, its memory intact."""
    import dataclasses
    from sandbox.criu import restore
    from sandbox.criu.runner import Criu
    from sandbox.criu.snapshot import _restore_run
    from sandbox.ops.snapshot_meta import CriuMeta
    from storage.repo.store import SnapshotStore
    tree = Tree(mb=48)
    try:
        cli_json(cli, STREAM, "criu", "dump", str(tree.pid), "s1")
        tree.reap()
        _until(lambda: not any(os.path.exists(f"/proc/{p}") for p in (tree.pid, tree.child)), "the dumped tree is gone")
        for k, v in restore_env.items():
            monkeypatch.setenv(k, v)
        store = SnapshotStore(str(store_dir), create=False)
        m = store.load("s1")
        stage = store_dir.parent / "stage"
        stage.mkdir(mode=0o700)
        run = _restore_run(Criu(), store, m, CriuMeta.of(m), str(stage), None, None, ())
        seen: list[tuple[int, str]] = []
        at_filled: dict[int, str] = {}

        def filled(pid: int) -> None:
            seen.append((pid, _state(tree.pid)))
            assert pid == tree.child
            at_filled.update(_large_areas(pid))  # its memory as it was when it was let run

        secs, info = restore.streamed(dataclasses.replace(run, fill_first=(tree.child,), on_filled=filled))
        assert seen == [(tree.child, "T")], seen  # once, while the parent was still held for the fill
        assert f"filled_{tree.child}" in info["monotonic"]
        assert info["monotonic"][f"filled_{tree.child}"] <= info["monotonic"]["fill_done"]
        assert info["fill_memory"]["procs"] == (1 if restore_env is SPLIT else 3)
        assert healthy(tree.report())
        assert _state(tree.pid) in ("S", "R") and _state(tree.child) in ("S", "R")
        assert at_filled and at_filled == _large_areas(tree.child), "the child ran before its memory was all in"
    finally:
        tree.kill()
        while True:  # the restored root is this process's child (CRIU's subreaper): reap it
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    break
            except ChildProcessError:
                break


@pytest.mark.parametrize("dump_env,restore_env", [(STREAM, STAGING), (STAGING, SPLIT)],
                         ids=["stream-then-staging", "staging-then-stream"])
def test_either_path_restores_what_the_other_dumped(cli: Cli, dump_env: dict, restore_env: dict) -> None:
    tree = Tree(mb=24)
    try:
        d = cli_json(cli, dump_env, "criu", "dump", str(tree.pid), "x")
        assert d["images_path"] == dump_env["GPUSNAP_CRIU_IMAGES"]
        tree.reap()
        r = cli_json(cli, restore_env, "criu", "restore", "x")
        assert r["images_path"] == restore_env["GPUSNAP_CRIU_IMAGES"]
        assert healthy(tree.report())
    finally:
        tree.kill()


def _start(cli: Cli, env: dict[str, str], *args: str) -> subprocess.Popen:
    e = {**os.environ, "PYTHONPATH": pythonpath(), **env}
    return subprocess.Popen([*GPUSNAP, "--store", str(cli.store), *args], cwd=REPO, env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.05)


def _mid_dump(cli: Cli, store_dir: Path, proc: subprocess.Popen) -> int:
    """Wait until the page data is flowing (chunks landing in the store); CRIU's pid."""
    criu = _criu_of(proc)
    deadline = time.monotonic() + 60
    while not chunk_files(store_dir) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.005)
    return criu


@pytest.mark.parametrize("victim", ["gpusnap", "criu", "gpusnap-with-encoders"])
def test_kill_9_mid_dump_leaves_the_tree_running(cli: Cli, store_dir: Path, victim: str) -> None:
    tree = Tree(mb=384, detached=True)
    try:
        proc = _start(cli, ENCODERS if victim.endswith("encoders") else STREAM, "criu", "dump", str(tree.pid), "k")
        criu = _mid_dump(cli, store_dir, proc)
        if victim.endswith("encoders"):
            _until(lambda: len(_children(proc.pid)) >= 3, "CRIU and both encoder processes are children of the dump", within=30)
        encoders = [p for p in _children(proc.pid) if p != criu]
        os.kill(proc.pid if victim.startswith("gpusnap") else criu, signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode != 0
        _wait_gone(criu)
        for pid in encoders:  # they die with the dump (PR_SET_PDEATHSIG), or end with its pipes
            _wait_gone(pid)
            assert not os.path.exists(f"/proc/{pid}") or _state(pid) == "Z", f"encoder {pid} outlived the dump"
        if victim.endswith("encoders"):
            assert len(encoders) >= 2, encoders
        assert tree.alive() and _state(tree.pid) in ("S", "R"), _state(tree.pid)
        assert healthy(tree.report()), "the tree runs on, intact"
        assert cli.json("store", "ls") == [], "nothing half-written was committed"
        if victim.startswith("gpusnap"):  # its journal record waits for recover, which finds the tree running
            assert cli.json("recover")["ok"]
            assert healthy(tree.report())
        # and it is still restorable: a new dump and restore through the stream
        cli_json(cli, STREAM, "criu", "dump", str(tree.pid), "k2")
        _wait_gone(tree.pid)
        cli_json(cli, SPLIT, "criu", "restore", "k2")
        assert healthy(tree.report())
    finally:
        tree.kill()


def _rchar(pid: int) -> int:
    try:
        io = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except OSError:
        return 0
    return int(io["rchar"])


def _wait_read(pid: int, nbytes: int, timeout: float = 60) -> None:
    """Until CRIU (PID) and the tasks it forks have read NBYTES (rchar: pipe reads count; each task
    reads its own pages)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            raise AssertionError("CRIU finished before it could be interrupted")
        if _rchar(pid) + sum(_rchar(c) for c in _children(pid)) >= nbytes:
            return
        time.sleep(0.002)
    raise AssertionError("CRIU did not read its images")


@pytest.mark.parametrize("victim", ["gpusnap", "criu"])
def test_kill_9_mid_restore_leaves_the_snapshot_restorable(cli: Cli, store_dir: Path, victim: str) -> None:
    tree = Tree(mb=384, detached=True)
    try:
        cli_json(cli, STREAM, "criu", "dump", str(tree.pid), "r")
        _wait_gone(tree.pid)
        proc = _start(cli, NO_SPLIT, "criu", "restore", "r")
        criu = _criu_of(proc)
        _wait_read(criu, 64 << 20)  # mid-stream: CRIU has read 64 of the ~400 MiB
        os.kill(proc.pid if victim == "gpusnap" else criu, signal.SIGKILL)
        proc.communicate(timeout=60)
        _wait_gone(criu)
        assert proc.returncode != 0, "the restore must fail"
        for p in (tree.pid, tree.child):  # no half-restored task is left holding the snapshot's pids
            _wait_gone(p, timeout=10)
            assert not os.path.exists(f"/proc/{p}") or _state(p) == "Z", (p, _state(p))
        assert cli.json("store", "verify", "r")["ok"]
        if victim.startswith("gpusnap"):  # its journal record waits for recover (nothing of the restore runs)
            assert cli.json("recover")["ok"]
        r = cli_json(cli, SPLIT, "criu", "restore", "r")
        assert r["restored_pid"] == tree.pid
        assert healthy(tree.report())
    finally:
        tree.kill()


def test_split_restore_fills_a_read_only_area(cli: Cli) -> None:
    """A large run in a read-only mapping (process_vm_writev refuses it) is written through
    /proc/PID/mem instead; the process finds its bytes intact."""
    import json as _json
    import tempfile
    d = Path(tempfile.mkdtemp(prefix="gpusnap-rodata-"))
    p = subprocess.Popen([sys.executable,
                          str(REPO / "tests" / "support" / "criu_rodata.py"), str(d)], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, cwd="/")
    try:
        deadline = time.monotonic() + 30
        while not (d / "ready").exists():
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        pid = _json.loads((d / "ready").read_text())["pid"]
        cli_json(cli, STREAM, "criu", "dump", str(pid), "ro")
        p.wait(timeout=30)
        r = cli_json(cli, SPLIT, "criu", "restore", "ro")
        assert r["stages"]["served"]["moved_bytes"] >= 24 << 20
        (d / "cmd").write_text("report")
        deadline = time.monotonic() + 20
        while not (d / "report.json").exists():
            assert time.monotonic() < deadline, "the restored process did not answer"
            time.sleep(0.02)
        assert _json.loads((d / "report.json").read_text()) == {"ok": True, "pid": pid}
    finally:
        for q in (p.pid,):
            try:
                os.kill(q, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def test_fill_workers_import_nothing_from_the_working_directory(tmp_path: Path) -> None:
    """The fill's worker processes run as root: a `sandbox` package planted in the directory gpusnap
    was started from (one a user may control) is never imported by them."""
    from sandbox.criu import fill_procs
    from storage.fs import isolated
    planted = tmp_path / "sandbox" / "criu"
    planted.mkdir(parents=True)
    (tmp_path / "sandbox" / "__init__.py").write_text("")
    (planted / "__init__.py").write_text("")
    (planted / "fill_procs.py").write_text("import sys\nprint('PLANTED')\nsys.exit(0)\n")
    # gpusnap started as `python -m` from the planted directory (so it is first on gpusnap's own path),
    # the worker even run from there (FillProcs runs them from /)
    import sys as _sys
    old_cwd, old_path = os.getcwd(), list(_sys.path)
    os.chdir(tmp_path)
    _sys.path.insert(0, str(tmp_path))
    try:
        argv = fill_procs.worker_argv()
    finally:
        os.chdir(old_cwd)
        _sys.path[:] = old_path
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}  # ignored too: the worker runs isolated (-I)
    p = subprocess.run(argv, input="", capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    assert "PLANTED" not in p.stdout and p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert str(tmp_path) not in isolated.module_path()


def test_only_the_tree_criu_restored_counts_as_this_restores_processes() -> None:
    """A snapshot's pid list and page maps are the snapshot author's: the fill writes, and the restore
    signals and journals, only processes of the tree under the pidfile's root that the process tree
    image lists, started after the restore began, processes not threads, not gpusnap itself."""
    import threading

    from sandbox.criu.restore import restored_tree
    from sandbox.criu.restored import boot_ticks, in_restored_tree
    born_after = boot_ticks() - 1
    root = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    other = subprocess.Popen(["sleep", "60"])  # started after too, but no part of the tree
    seen: list[int] = []
    def note_and_wait() -> None:
        seen.append(threading.get_native_id())
        time.sleep(1)
    t = threading.Thread(target=note_and_wait)
    t.start()
    kids: list[int] = []
    try:
        def children() -> list[int]:
            kids[:] = [int(x) for x in open(f"/proc/{root.pid}/task/{root.pid}/children").read().split()]
            return kids
        _until(children, "the shell forked its child")
        child = kids[0]
        for p in (root.pid, child):
            os.kill(p, signal.SIGSTOP)
        _until(lambda: _state(child) == "T" and _state(root.pid) == "T", "the tree stopped")
        listed = [root.pid, child, other.pid, seen[0], os.getpid()]  # what a hostile image could list
        assert restored_tree(root.pid, listed, born_after) == [root.pid, child]
        assert in_restored_tree(child, root.pid, listed, born_after, stopped=True)
        assert not in_restored_tree(child, root.pid, [root.pid], born_after), "not in the process tree image"
        assert not in_restored_tree(child, root.pid, listed, boot_ticks() + 1000), "started before the restore"
        os.kill(child, signal.SIGCONT)
        _until(lambda: _state(child) != "T", "the child continued")
        assert not in_restored_tree(child, root.pid, listed, born_after, stopped=True), "the fill wants it stopped"
        assert not in_restored_tree(root.pid, 0, listed, born_after), "no root: nothing is this restore's"
    finally:
        t.join()
        for pid in kids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in (root, other):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name,value", [("GPUSNAP_FILL_PROCS", "many"), ("GPUSNAP_FILL_READERS", "0"),
                                        ("GPUSNAP_FILL_READERS_EARLY", "0"), ("GPUSNAP_CRIU_SPLIT_SHARED_MIN", "-1"),
                                        ("GPUSNAP_FILL_PREFETCH_EARLY", "yes"), ("GPUSNAP_CRIU_FILE_HINTS", "2"),
                                        ("GPUSNAP_WILLNEED_STEP", "1")])
def test_a_bad_fill_setting_fails_the_restore_before_criu_starts(cli: Cli, store_dir: Path, name: str, value: str) -> None:
    """A fill setting that is not a number in its range: one line naming it, nothing restored, nothing
    left behind (no fill worker, no stopped process), and the snapshot restores once it is fixed."""
    _refused_then_restored(cli, "bad", {**SPLIT, name: value}, name, killed_within=0)


@pytest.mark.parametrize("name,value", [("GPUSNAP_ENCODE_PROCS", "lots"), ("GPUSNAP_DUMP_PIPE", "4096"),
                                        ("GPUSNAP_DUMP_PIPE", "64M"), ("GPUSNAP_FD_READ", "fast"),
                                        ("GPUSNAP_DUMP_DIRECT", "yes")])
def test_a_bad_dump_setting_fails_the_dump_before_anything_is_frozen(cli: Cli, store_dir: Path, name: str,
                                                                     value: str) -> None:
    """A dump setting that is not a number in its range: one line naming it, exit 1, nothing
    committed, the tree never stopped; the dump succeeds once the setting is fixed."""
    tree = Tree(mb=8)
    try:
        r = cli.run("criu", "dump", str(tree.pid), "bad", env={**STREAM, name: value}, check=False)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{name}='{value}'" in r.stderr, r.stderr
        assert cli.json("store", "ls") == [] and _state(tree.pid) in ("S", "R") and healthy(tree.report())
        cli_json(cli, ENCODERS, "criu", "dump", str(tree.pid), "good")
        tree.reap()
        cli_json(cli, SPLIT, "criu", "restore", "good")
        assert healthy(tree.report())
    finally:
        tree.kill()


def test_fill_workers_that_do_not_finish_in_time_fail_the_restore(cli: Cli, store_dir: Path) -> None:
    """GPUSNAP_FILL_TIMEOUT: workers that have not answered by then (a store that stopped answering,
    here a limit no fill can meet) fail the restore in one line, the half-filled tree killed; the
    snapshot restores afterwards."""
    _refused_then_restored(cli, "slow", {**SPLIT_PROCS, "GPUSNAP_FILL_TIMEOUT": "0.000001"}, "GPUSNAP_FILL_TIMEOUT",
                           killed_within=10)


def test_early_reads_are_the_small_images_then_the_page_images_in_criu_order_within_the_budget() -> None:
    """What the disk reads while a restore plans (serve.early_reads): the small images as CRIU reads
    them, then each page image's chunks by image number, zeros left out, cut where the budget ends."""
    from sandbox.criu.serve import early_reads
    from storage.format.manifest import ChunkRef, Stream

    def ref(tag: str, n: int = 4096) -> ChunkRef:
        return ChunkRef(tag * 64, n, "raw", n)

    def img(*chunks: ChunkRef) -> Stream:
        return Stream("images/x", {"type": "file"}, list(chunks))

    zero = ChunkRef(None, 4096, "zero", 0)
    assert zero.is_zero
    images = {"pstree.img": img(ref("b", 200)), "inventory.img": img(ref("a", 300)),
              "pages-2.img": img(ref("e"), ref("f")), "pages-1.img": img(ref("1"), zero, ref("2"), ref("3"))}
    assert [ref_id(c)[0] for c in early_reads(images, 1 << 30)] == list("ab123ef")
    assert [ref_id(c)[0] for c in early_reads(images, 3 * 4096)] == list("ab123")
    assert [ref_id(c)[0] for c in early_reads(images, 4096 + 4095)] == list("ab1")
    assert [ref_id(c)[0] for c in early_reads(images, 0)] == list("ab")  # planning reads the small images anyway
    assert [ref_id(c)[0] for c in early_reads(images, 1 << 30, refs_most=4)] == list("ab12")  # a count bound too
    tiny = {"pages-1.img": img(*[ref(str(i % 10), 0) for i in range(100)])}  # lengths that claim nothing
    assert len(early_reads(tiny, 10 * 4096)) == 10  # each counted as a page at least


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
@pytest.mark.parametrize("mode", ["child", "thread"])
def test_early_reads_fill_the_page_cache_until_stopped(tmp_path: Path, mode: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """EarlyReads: the named pack entries become resident while the restore plans; stop() returns at
    once and nothing more is asked for after it. Its reads are a child process's by default, a
    thread's where no child can start ($GPUSNAP_EARLY_READS=thread: the same path)."""
    monkeypatch.setenv("GPUSNAP_EARLY_READS", mode)
    from sandbox.criu.serve import EarlyReads
    from storage.pipeline.put import Stages
    from support.pagecache import cold_store, resident_bytes
    st, refs = cold_store(tmp_path, 96 << 20)
    packs = tmp_path / "store" / "packs"
    want = sum(c.stored_len for c in refs)
    stages = Stages()
    early = EarlyReads(st, refs, stages)
    # the disk's own pace (this VM's disk has minutes when 96 MiB take more than 20 s: a CI run met one)
    deadline = time.monotonic() + 90
    while resident_bytes(packs) < want and time.monotonic() < deadline:
        time.sleep(0.05)
    early.stop()
    assert resident_bytes(packs) >= want, (resident_bytes(packs), want)
    assert stages.nbytes["early read"] >= want  # reported as a stage of the restore
    if mode == "child":  # and the child's own reading, whose rate is the disk's
        assert stages.nbytes["early read:disk"] == stages.nbytes["early read"]
        assert 0 < stages.seconds["early read:disk"] <= stages.seconds["early read"]


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_early_reads_stopped_partway_ask_for_nothing_more(tmp_path: Path) -> None:
    """Stopped while it reads (the restore's planning is done): stop() returns with the thread ended,
    and from then on no more of the store comes into the page cache."""
    import threading
    from sandbox.criu.serve import EarlyReads
    from storage.pipeline.put import Stages
    from support.pagecache import cold_store, resident_bytes
    st, refs = cold_store(tmp_path, 384 << 20)
    packs = tmp_path / "store" / "packs"
    early = EarlyReads(st, refs, Stages())
    deadline = time.monotonic() + 10
    while resident_bytes(packs) < 8 << 20 and time.monotonic() < deadline:
        time.sleep(0.005)
    early.stop()
    assert not [t for t in threading.enumerate() if t.name == "gpusnap-early-read"]  # nothing reads any more
    first = resident_bytes(packs)
    assert 8 << 20 <= first < sum(c.stored_len for c in refs), first


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_early_reads_keep_the_disk_busy_beside_pure_python_planning(tmp_path: Path) -> None:
    """The restore plans in pure Python (the split's choice) while the early reads run: they must
    still get the disk's bytes in. Asking WILLNEED 128 KiB at a time, the thread got 11 MB of a cold
    store into the page cache in 0.4 s beside such a loop here (806 MB beside an idle one); its own
    16 MiB reads, with the short switch interval, get hundreds. The interval is put back at the stop."""
    import sys
    from sandbox.criu.serve import EarlyReads
    from storage.pipeline.put import Stages
    from support.pagecache import cold_store, resident_bytes
    st, refs = cold_store(tmp_path, 768 << 20)
    before = sys.getswitchinterval()
    early = EarlyReads(st, refs, Stages())
    t0, x = time.monotonic(), 0
    while time.monotonic() - t0 < 0.4:
        for i in range(10000):  # holds the GIL, as split.choose does
            x += i
    early.stop()
    assert sys.getswitchinterval() == before
    got = resident_bytes(tmp_path / "store" / "packs")
    assert got >= 64 << 20, got  # the old way got 9 MB here; this needs a disk of 160 MB/s
    # two at once (two restores in one process): the interval stays short until the last one stops
    a, b = EarlyReads(st, [], Stages()), EarlyReads(st, [], Stages())
    assert sys.getswitchinterval() < before
    a.stop()
    a.stop()
    assert sys.getswitchinterval() < before
    b.stop()
    assert sys.getswitchinterval() == before


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_early_reads_of_a_damaged_store_stay_quiet(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The early reads are a hint: a store whose index cannot be read (here a symlink, refused) makes
    them end without a word; the restore's own reads are what report it."""
    from sandbox.criu.serve import EarlyReads
    from storage.format.manifest import ChunkRef
    from storage.pipeline.put import Stages
    from storage.base.errors import DamageError
    from storage.repo.store import SnapshotStore
    root = tmp_path / "s"
    SnapshotStore(str(root))
    assert (root / "index").is_dir()
    (root / "index").rename(tmp_path / "index-elsewhere")
    (root / "index").symlink_to(tmp_path / "index-elsewhere")
    st = SnapshotStore(str(root))
    stages = Stages()
    early = EarlyReads(st, [ChunkRef("a" * 64, 4096, "raw", 4096)], stages)
    early.stop()
    assert "early read" not in stages.nbytes
    assert "Exception" not in capfd.readouterr().err
    with pytest.raises(DamageError):
        st.refresh_index()  # what the restore's own check meets: damage, exit 3


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_early_reads_stopped_at_once_leave_the_rest_on_disk(tmp_path: Path) -> None:
    """A restore whose planning is quick stops the early reads before CRIU's own are queued: what was
    not asked for by then stays on disk (the reads never compete with CRIU's)."""
    import threading
    from sandbox.criu.serve import EarlyReads
    from storage.pipeline.put import Stages
    from support.pagecache import cold_store, resident_bytes
    st, refs = cold_store(tmp_path, 256 << 20)
    packs = tmp_path / "store" / "packs"
    early = EarlyReads(st, refs, Stages())
    early.stop()
    assert not [t for t in threading.enumerate() if t.name == "gpusnap-early-read"]
    assert resident_bytes(packs) < 128 << 20  # stopped at once: a few of its 16 MiB reads at most


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_read_ahead_opens_each_pack_once_and_bounds_the_fds_it_holds(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The early reads of a restore go in CRIU's order, a chunk or two per read, across many packs:
    a pack is opened once while it is read (not per read: each open and close was as many GIL
    handoffs as the read itself), at most MOST at once, every one closed at the end."""
    import random
    from storage.pipeline import put as pipeline
    from storage.repo import readstage
    from storage.archive.filetree import FileTreeSource
    from storage.repo.store import SnapshotStore
    from support.pagecache import resident_bytes
    st = SnapshotStore(str(tmp_path / "store"))
    for k in range(3):  # three snapshots, three packs
        src = tmp_path / f"src{k}"
        src.mkdir()
        (src / "blob").write_bytes(os.urandom(24 << 20))
        with st.writer(f"s{k}") as w:
            pipeline.put(w, FileTreeSource([str(src)]), workers=2, chunk_size=1 << 20)
            w.commit()
    refs = [c for k in range(3) for s in st.load(f"s{k}").streams for c in s.chunks if not c.is_zero]
    assert len({st.locate(ref_id(c))[0].pack for c in refs}) == 3
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")
    order = sorted(refs, key=lambda c: st.locate(ref_id(c))[0].pack)  # pack by pack: each opened once
    mixed = list(refs)
    random.Random(3).shuffle(mixed)  # scattered over the packs, as a restore's may be
    opened: list[str] = []
    real = readstage.open_pack

    def counting(packs: int, pack: str, cid: str) -> int:
        opened.append(pack)
        return real(packs, pack, cid)
    monkeypatch.setattr(readstage, "open_pack", counting)
    fds_before = len(os.listdir("/proc/self/fd"))
    want = sum(c.stored_len for c in refs)
    assert readstage.read_ahead(st, order, resident=True, advise=False, step=16 << 20) >= want
    assert len(opened) == 3
    assert resident_bytes(tmp_path / "store" / "packs") >= want
    monkeypatch.setattr(readstage._PackFds, "MOST", 2)  # fewer than the packs: the oldest closed, opened again
    opened.clear()
    assert readstage.read_ahead(st, mixed, resident=True, advise=False, step=16 << 20) >= want
    assert 3 <= len(opened) < len(mixed)
    assert len(os.listdir("/proc/self/fd")) == fds_before  # nothing left open


_VICTIM = r"""
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
size = int(sys.argv[2])
if sys.argv[1] == "restored":
    addr = libc.mmap(None, size, 3, 0x22, -1, 0)
else:  # the program run in its place, its memory where the restored one's was (MAP_FIXED_NOREPLACE)
    addr = libc.mmap(int(sys.argv[3]), size, 3, 0x22 | 0x100000, -1, 0)
    assert addr == int(sys.argv[3]), "could not map at the same address"
print(addr, flush=True)
for line in sys.stdin:
    if line.strip() == "exec":
        os.execv(sys.executable, [sys.executable, "-c", __VICTIM__, "victim", str(size), str(addr)])
    if line.strip() == "zeros":
        print(ctypes.string_at(addr, size).count(0) == size, flush=True)
"""


def test_a_process_that_runs_another_program_mid_fill_gets_none_of_the_later_bytes() -> None:
    """Once the fill lets a process run (its phase written, fill_first), the tree's code runs while
    gpusnap, root, still writes into the others: one of them continued by it could run another
    program (a setuid one) at the same addresses. Every chunk after phase 0 goes through the memory
    opened before any process ran, so the fill fails and the new program gets nothing."""
    import ctypes
    from sandbox.criu import split
    from storage.format.manifest import ChunkRef, Stream
    chunk, n = 64 << 10, 32
    src = _VICTIM.replace("__VICTIM__", repr(_VICTIM))
    proc = subprocess.Popen([sys.executable, "-c", src, "restored", str(n * chunk)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        addr = int(proc.stdout.readline())
        mine = ctypes.create_string_buffer(n * chunk)
        refs = [[ChunkRef(f"{k}{i:063x}", chunk, "raw", chunk) for i in range(n)] for k in (1, 2)]
        streams = {f"pages-{k}.img": Stream(f"pages-{k}.img", {"type": "file"}, refs[k - 1]) for k in (1, 2)}
        plans = [split.Plan(os.getpid(), "pages-1.img", b"", (), (split.Run(ctypes.addressof(mine), 0, n * chunk),)),
                 split.Plan(proc.pid, "pages-2.img", b"", (), (split.Run(addr, 0, n * chunk),))]
        jobs = split.fill_jobs(plans, streams)
        phases = split.fill_phases(jobs, (os.getpid(), proc.pid))

        import threading
        execd = threading.Event()

        def on_phase(p: int) -> None:
            assert proc.stdin is not None and proc.stdout is not None
            if p == 0:  # phase 0 (this process) written: the other one runs another program in its place
                proc.stdin.write("exec\n")
                proc.stdin.flush()
                int(proc.stdout.readline())  # mapped where the restored one's memory was
                execd.set()

        def fetch(s, i, ref):  # phase 1's chunks come once the other program is there (a slow disk)
            if ref.id[0] == "2":
                assert execd.wait(30)
            return bytes([7]) * chunk

        with split.Filler(jobs, _reads(streams, fetch), 1, 2 * (chunk + 4096),
                          phases=phases, nphases=3) as filler:
            with pytest.raises(split.SplitError, match="no longer the process this restore made"):
                filler.write(lambda pid: True, on_phase)
        assert mine.raw == bytes([7]) * (n * chunk)  # phase 0 went in whole
        proc.stdin.write("zeros\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "True", "a byte of the snapshot reached the other program"
    finally:
        proc.kill()
        proc.wait()


def _fake_workers(scripts: list[str], nphases: int):
    """FillProcs over workers that print what SCRIPTS say (the protocol's other side, hostile or broken)."""
    from sandbox.criu.fill_procs import FillProcs
    from storage.repo.store import SnapshotStore

    class _Store:
        @staticmethod
        def error(msg: str) -> Exception:
            return RuntimeError(msg)

    fp = FillProcs.__new__(FillProcs)
    fp.procs = [subprocess.Popen([sys.executable, "-c", s], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
                for s in scripts]
    fp.phases, fp.nphases, fp.timeout, fp.store, fp._closed = {}, nphases, 20.0, cast("SnapshotStore", _Store()), False
    return fp


_DONE = 'import json; print(json.dumps({"written": 1, "zero_skipped": 0, "stages": {}}), flush=True)'


@pytest.mark.parametrize("said,why", [
    ('print(\'{"phase": true}\', flush=True)', "said phase True"),
    ('print(\'{"phase": 7}\', flush=True)', "said phase 7"),
    # one write (atomic on a pipe): print() writes the text and its newline apart, and had the line
    # ended in a second read, phase 1 would rightly have been told before the duplicate came
    ('import os; os.write(1, b\'{"phase": 1}\\n{"phase": 1}\\n\')', "said phase 1 after 1"),
    ('import sys; sys.stdout.write(\'{"phase": 0}\'); sys.stdout.flush()', "died"),  # no newline, then EOF
    ('print(\'{"written": "lots"}\', flush=True)', "died"),
])
def test_fill_workers_saying_what_the_protocol_does_not_fail_the_fill_and_tell_no_phase(said: str, why: str) -> None:
    told: list[int] = []
    fp = _fake_workers([said, _DONE], nphases=3)
    from sandbox.criu.split import SplitError
    with pytest.raises(SplitError, match=why):
        fp._results(told.append)
    assert told == [], told  # no process was let run on a worker's bad word
    fp.close()


def test_a_bad_word_after_a_told_phase_fails_the_fill_and_tells_nothing_more(tmp_path: Path) -> None:
    told: list[int] = []
    said = tmp_path / "answered"  # the other worker has answered: phase 0 is then every worker's
    late = ('import os, time; os.write(1, b\'{"phase": 0}\\n\')\n'
            f'while not os.path.exists({str(said)!r}): time.sleep(0.01)\n'
            'time.sleep(1); os.write(1, b\'{"phase": 0}\\n\'); time.sleep(5)')
    fp = _fake_workers([late, _DONE + f"; open({str(said)!r}, 'w').close()"], nphases=3)
    from sandbox.criu.split import SplitError
    with pytest.raises(SplitError, match="said phase 0 after 0"):
        fp._results(told.append)
    assert told == [0], told  # phase 0 was every worker's before the bad word; nothing after it
    fp.close()


def test_fill_workers_phases_are_told_once_every_worker_is_past_them_lines_split_or_joined() -> None:
    told: list[int] = []
    slow = ('import json, sys, time; w = sys.stdout.write\n'
            'w(\'{"pha\'); sys.stdout.flush(); time.sleep(0.3); w(\'se": 0}\\n{"phase": 1}\\n\'); sys.stdout.flush()\n'
            'time.sleep(0.3); ' + _DONE)
    fast = 'print(\'{"phase": 0}\\n{"phase": 1}\\n{"phase": 2}\', flush=True); import time; time.sleep(1); ' + _DONE
    fp = _fake_workers([slow, fast], nphases=3)
    out = fp._results(told.append)
    assert told == [0, 1, 2] and [r["written"] for r in out] == [1, 1]
    fp.close()


def test_a_failed_fill_kills_what_the_running_tree_double_forked_away() -> None:
    """kill_restored, with this process as the subreaper (as during a fill that let processes run):
    a process that keeps double-forking (each grandchild orphaned at once, out of the tree) leaves
    nothing behind; a helper of ours (KEEP) is left alone."""
    from sandbox.criu.restore import kill_restored
    from sandbox.criu.restored import adopting_orphans, boot_ticks
    from sandbox.host.processes import Proc, children_of
    marker = f"gpusnap-escaper-{os.getpid()}"
    src = ("import os, sys, time\n"
           "while True:\n"
           "    if os.fork() == 0:\n"
           "        if os.fork() == 0:\n"
           "            time.sleep(60); os._exit(0)\n"
           "        os._exit(0)\n"
           "    os.wait()\n"
           "    time.sleep(0.005)\n")
    born_after = boot_ticks()
    time.sleep(0.02)
    with adopting_orphans():
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        p = subprocess.Popen([sys.executable, "-c", src, marker])
        try:
            _until(lambda: len(children_of(os.getpid())) > 8, "orphans have come to us", within=30)
            root = Proc.of(p.pid)
            assert root is not None
            killed = kill_restored((root,), born_after, keep={helper.pid})
            assert p.pid in killed and helper.pid not in killed and helper.poll() is None

            def left() -> list[int]:
                return [q for q in pids_with(marker.encode()) if _state(q) not in ("Z", "gone")]
            assert len(killed) > 5, killed
            _until(lambda: not left(), "every double-forked process is gone", within=10)
        finally:
            for q in (p, helper):
                q.kill()
                q.wait()


def test_killing_a_tree_kills_what_its_running_processes_fork_meanwhile() -> None:
    """kill_with_descendants (a failed fill whose tree had processes running early): a process that
    keeps forking leaves nothing behind, not even children reparented while it is killed."""
    from sandbox.host.processes import Proc, kill_with_descendants, process_tree
    marker = f"gpusnap-forker-{os.getpid()}"
    src = ("import os, sys, time\n"
           "while True:\n"
           "    if os.fork() == 0:\n"
           "        time.sleep(60); os._exit(0)\n"
           "    time.sleep(0.005)\n")
    p = subprocess.Popen([sys.executable, "-c", src, marker], start_new_session=True)
    try:
        _until(lambda: len(process_tree(p.pid)) > 6, "the forker has forked", within=30)
        root = Proc.of(p.pid)
        assert root is not None
        killed = kill_with_descendants((root,))
        assert p.pid in killed and len(killed) > 5, killed
        p.wait(timeout=10)

        _until(lambda: not [q for q in pids_with(marker.encode()) if _state(q) != "Z"], "every forked process is gone",
               within=10)
    finally:
        p.kill()
        p.wait()


def test_a_failed_fill_without_early_processes_kills_only_the_tree() -> None:
    """kill_restored with no subreaper time (keep=None: nothing of the tree ran): the tree and its
    descendants, never another child of this process started meanwhile."""
    from sandbox.criu.restore import kill_restored
    from sandbox.criu.restored import boot_ticks
    from sandbox.host.processes import Proc, process_tree
    born_after = boot_ticks()
    time.sleep(0.02)
    tree = subprocess.Popen([sys.executable, "-c", "import os, time\nif os.fork() == 0: time.sleep(60)\ntime.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _until(lambda: len(process_tree(tree.pid)) == 2, "the tree has forked", within=30)
        root = Proc.of(tree.pid)
        assert root is not None
        killed = kill_restored((root,), born_after, keep=None)
        assert tree.pid in killed and len(killed) == 2 and other.poll() is None, killed
    finally:
        for q in (tree, other):
            q.kill()
            q.wait()


def test_wait_stopped_waits_for_a_pending_stop_and_names_what_never_stopped() -> None:
    """`criu restore --leave-stopped` returns with the stop still pending in each task (it sends SIGSTOP,
    then detaches): the fill's check that the tree is stopped waits for it (CI once saw the check run first)."""
    import threading
    from sandbox.criu.restored import wait_stopped
    late = subprocess.Popen(["sleep", "30"])
    never = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["true"])
    try:
        _until(lambda: _state(zombie.pid) == "Z", "the child is a zombie")
        t0 = time.monotonic()
        assert wait_stopped([zombie.pid], timeout=5.0) == []  # CRIU restores a zombie as one: never stopped
        assert time.monotonic() - t0 < 1.0
        timer = threading.Timer(0.3, os.kill, (late.pid, signal.SIGSTOP))
        timer.start()
        t0 = time.monotonic()
        assert wait_stopped([late.pid], timeout=5.0) == []
        assert 0.25 <= time.monotonic() - t0 < 5.0
        t0 = time.monotonic()
        assert wait_stopped([late.pid, never.pid, 2 ** 22 + 7], timeout=0.5) == [never.pid]  # a gone pid is not waited for
        assert time.monotonic() - t0 >= 0.5
    finally:
        for p in (late, never, zombie):
            p.kill()
            p.wait()


def test_pages_a_child_shares_with_its_parent_stay_with_criu_in_both() -> None:
    """choose with the process tree: where parent and child hold the same bytes at the same address
    (the same chunk of each page image, at the same offset in it) both entries stay with CRIU, which
    restores the parent's before the fork and leaves the child's shared; bytes that differ, zero
    chunks and a shift inside the chunk are the split's as before."""
    from sandbox.criu import split
    from storage.format.manifest import ChunkRef, Stream
    MB = 1 << 20
    P = MB // 4096  # pages per MiB

    def ref(cid: str | None, n: int = MB) -> ChunkRef:
        return ChunkRef(None, n, "zero", 0) if cid is None else ChunkRef(cid * 64, n, "zstd", n // 2)
    # parent: 4 MiB at 0x10000000 (chunks a b c d) and 2 MiB at 0x40000000 (e f)
    # child: the same 4 MiB area with a, b (shared), X (its own), d shifted by a page; the 2 MiB area
    # is zeros in both; and 3 MiB of its own at 0x70000000
    parent = _pm(1, [(0x10000000, P), (0x10000000 + MB, P), (0x10000000 + 2 * MB, P), (0x10000000 + 3 * MB, P),
                     (0x40000000, 2 * P)])
    child = _pm(2, [(0x10000000, P), (0x10000000 + MB, P), (0x10000000 + 2 * MB, P), (0x10000000 + 3 * MB, P),
                    (0x40000000, 2 * P), (0x70000000, 3 * P)])
    pstream = Stream("pages-1.img", {}, [ref("a"), ref("b"), ref("c"), ref("d"), ref(None), ref(None)])
    cstream = Stream("pages-2.img", {}, [ref("a"), ref("b"), ref("9"), ref("0", 4096), ref("d", MB - 4096),
                                     ref(None), ref(None), ref("8", 3 * MB)])
    sizes = {"pages-1.img": 6 * MB, "pages-2.img": 9 * MB}
    maps = {"pagemap-100.img": parent, "pagemap-101.img": child}
    streams = {"pages-1.img": pstream, "pages-2.img": cstream}
    # (CAUTIOUS_MIN at a MiB as well: the runs at addresses both have pages at move from that size too)
    plans, why = split.choose(maps, sizes, MB, parents={100: 1, 101: 100}, streams=streams, cautious_min=MB)
    assert why is None
    pp, cp = plans["pages-1.img"], plans["pages-2.img"]
    assert pp.cow_kept == 2 * MB and cp.cow_kept == 2 * MB
    # the parent: a and b with CRIU; c, d (one run) and the zeros moved
    assert [(r.vaddr, r.nbytes) for r in pp.moved] == [(0x10000000 + 2 * MB, 2 * MB), (0x40000000, 2 * MB)]
    assert pp.kept == ((0, 2 * MB),)
    assert [(r.vaddr, r.nbytes) for r in cp.moved] == [(0x10000000 + 2 * MB, 2 * MB), (0x40000000, 2 * MB),
                                                      (0x70000000, 3 * MB)]
    assert [e.vaddr for e in split.parse_pagemap(cp.pagemap).entries] == [0x10000000, 0x10000000 + MB]
    # a hostile child pagemap of records that overlap (CRIU never writes them): nothing is kept back,
    # and the check costs no walk per record
    import time as _t
    many = _pm(2, [(0x10000000, P)] * 20000)
    t0 = _t.perf_counter()
    assert split.cow_shared(split.parse_pagemap(many), split.parse_pagemap(parent),
                            Stream("pages-2.img", {}, [ref("a", 20000 * MB)]), pstream) == (set(), set())
    assert _t.perf_counter() - t0 < 2.0
    # without the tree (or with processes that are not parent and child) nothing is kept back
    for parents in (None, {100: 1, 101: 1}):
        plans, _ = split.choose(maps, sizes, MB, parents=parents, streams=streams, cautious_min=MB)
        assert plans["pages-1.img"].cow_kept == 0 and len(plans["pages-1.img"].moved) == 2
    # at the default CAUTIOUS_MIN (64 MiB) the child's and the parent's runs at common addresses stay with
    # CRIU whatever their bytes; the child's own 3 MiB elsewhere move
    plans, _ = split.choose(maps, sizes, MB, parents={100: 1, 101: 100}, streams=streams)
    assert "pages-1.img" not in plans and [(r.vaddr, r.nbytes) for r in plans["pages-2.img"].moved] == [(0x70000000, 3 * MB)]


def test_the_split_does_not_engage_to_move_a_few_pages() -> None:
    """A split costs a stopped restore and the fill: where it would move less than a hundredth of the
    pages (and less than 16 MiB), CRIU restores every page, and the report says why."""
    from sandbox.criu import split
    P = (1 << 20) // 4096
    pm = _pm(1, [(0x10000000, 40 * P), (0x20000000, 2)])  # 40 MiB, then 2 pages
    sizes = {"pages-1.img": 40 * (1 << 20) + 8192}
    plans, why = split.choose({"pagemap-9.img": pm}, sizes, 4096, mms={"mm-9.img": _mm([(0x20000000, 0x20002000, ANON)])})
    assert plans == {} and why == f"the split would move only 8192 of {sizes['pages-1.img']} bytes; CRIU restored every page"
    small = _pm(1, [(0x20000000, 2), (0x30000000, 14)])  # 64 KiB in all: 2 pages of it are more than a hundredth
    plans, why = split.choose({"pagemap-9.img": small}, {"pages-1.img": 16 * 4096}, 4096,
                              mms={"mm-9.img": _mm([(0x20000000, 0x20002000, ANON)])})
    assert why is None and plans["pages-1.img"].moved_bytes == 8192


@pytest.mark.parametrize("sharing", ["cow", "half"])
def test_a_tree_of_forked_workers_keeps_its_shared_memory_shared(cli: Cli, store_dir: Path, sharing: str) -> None:
    """A parent and a child that share their memory copy-on-write (a server's forked workers and
    their weights) come back sharing it, as after plain CRIU: the pages stay with CRIU, the tree's
    proportional memory is what it was, not doubled by a private copy in each process. With half
    shared and half the child's own, the fill still writes the other half of each."""
    def pss(pids: tuple[int, int]) -> int:
        total = 0
        for p in pids:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
        return total << 10
    tree = Tree(mb=96, sharing=sharing)
    try:
        assert healthy(tree.report())  # the child answers once its own half is written: its memory is settled
        before = pss((tree.pid, tree.child))
        cli_json(cli, STREAM, "criu", "dump", str(tree.pid), "s1")
        tree.reap()
        _until(lambda: _tree_gone(tree), "the dumped tree is gone")
        r = cli_json(cli, SPLIT, "criu", "restore", "s1")
        assert healthy(tree.report())
        served = r["stages"]["served"]
        if sharing == "cow":
            assert served["moved_bytes"] == 0 and "share stay with CRIU" in served["split_skipped_because"], served
        else:  # about 48 MiB shared in each process with CRIU, the other 48 MiB of each moved
            assert 2 * (40 << 20) <= served["cow_kept_bytes"] <= 2 * (56 << 20), served["cow_kept_bytes"]
            assert served["moved_bytes"] >= 2 * (40 << 20) and served["split"]["written"] >= 2 * (40 << 20), served
        after = pss((tree.pid, tree.child))
        assert after < before + (32 << 20), f"proportional memory {before >> 20} MiB before, {after >> 20} MiB after"
        # CRIU read both copies (~48 chunks of 4 MiB; ~24 with half moved): decoded into buffers reused a window
        # ahead (two feeds at most at once: a pagemap and its pages), not one new buffer per chunk
        # (on a 2-core host the window is 4: at most 12 buffers)
        assert 1 <= served["feed_buffers"] <= 2 * (served["window"] + 1) + 2, served
        assert served["bytes"] >= (2 if sharing == "cow" else 1) * (90 << 20), served
    finally:
        tree.kill()


def test_early_reads_run_from_acceptance_and_stop_before_a_failed_restore_is_undone(
        cli: Cli, store_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The early reads start once a restore is accepted (before the serve side exists); a failure after
    that stops them before the undo runs: no reader thread or child left, the switch interval back."""
    import threading
    from sandbox.criu import restore as restore_mod
    from sandbox.criu import snapshot as snapshot_mod
    from sandbox.ops import operations
    from storage.repo.store import SnapshotStore
    tree = Tree(32)
    try:
        cli_json(cli, {}, "criu", "dump", str(tree.pid), "early")
        tree.reap()
        seen: dict[str, object] = {}

        def reading() -> bool:
            return any(t.name == "gpusnap-early-read" and t.is_alive() for t in threading.enumerate())

        def failing(run: restore_mod.RestoreRun, **kw: object) -> None:
            seen["early at the serve side"] = run.early is not None and reading()
            raise OSError(5, "the serve side failed (a test)")
        real_undo = operations.operation_for

        def undo_of(rec: object, ctx: object) -> object:
            seen["reading at the undo"] = reading()
            return real_undo(rec, ctx)  # type: ignore[arg-type]
        monkeypatch.setattr(restore_mod, "streamed", failing)
        monkeypatch.setattr(operations, "operation_for", undo_of)
        before = sys.getswitchinterval()
        with pytest.raises(OSError, match="a test"):
            snapshot_mod.criu_restore(SnapshotStore(str(store_dir), create=False), "early")
        assert seen == {"early at the serve side": True, "reading at the undo": False}, seen
        assert not reading() and sys.getswitchinterval() == before
        from sandbox.host.processes import children_of
        assert children_of(os.getpid()) == [], "a reader child outlived the failed restore"
        # the snapshot is untouched: it restores
        ok = cli_json(cli, {}, "criu", "restore", "early")
        assert ok["restored_pid"] == tree.pid and healthy(tree.report())
    finally:
        tree.kill()


def test_the_early_gate_holds_the_fills_reads_to_its_count_until_opened() -> None:
    """While CRIU runs, the in-process fill keeps at most GPUSNAP_FILL_READERS_EARLY reads in flight (each
    of CRIU's own small reads waits behind every read queued on the disk); open() lets every reader
    through, and wakes those waiting (the fill stopping opens it too, so none stays held)."""
    import threading

    from sandbox.criu.fill_procs import EarlyGate
    gate = EarlyGate(1)
    inside, most = [0], [0]
    lock = threading.Lock()
    release = threading.Event()

    def read() -> None:
        with gate.held():
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            release.wait(5)
            with lock:
                inside[0] -= 1

    ts = [threading.Thread(target=read) for _ in range(4)]
    for t in ts:
        t.start()
    time.sleep(0.2)
    assert inside[0] == 1 and most[0] == 1, "one read in flight while the gate is shut"
    gate.open()
    deadline = time.monotonic() + 5
    while inside[0] < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert inside[0] == 4, "every waiting reader let through once it opens"
    release.set()
    for t in ts:
        t.join(5)
    assert not any(t.is_alive() for t in ts)


def test_fill_workers_get_the_held_back_read_tokens_once_criu_is_done() -> None:
    """Worker processes share reads through a pipe of tokens: EARLY of them while CRIU runs, the rest
    given out by the parent when CRIU is done (write) or the fill stops (close), once."""
    from sandbox.criu.fill_procs import FillProcs, ReadTokens
    tokens = ReadTokens(1)
    fp = FillProcs.__new__(FillProcs)
    fp._later, fp._more, fp._closed, fp.procs = 3, os.dup(tokens.w), False, []
    try:
        os.set_blocking(tokens.r, False)
        assert os.read(tokens.r, 64) == b"t"  # one token while CRIU runs
        fp._all_reads()
        assert os.read(tokens.r, 64) == b"ttt"  # the other three, once
        fp._all_reads()
        fp.close()
        try:
            got = os.read(tokens.r, 64)
        except BlockingIOError:
            got = b""
        assert got == b"", "given out once, not again at close"
    finally:
        tokens.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace of its own and ns_last_pid need root")
@pytest.mark.parametrize("when", ["during", "before-pin", "exec"])
def test_a_process_that_ends_during_the_fill_never_gets_its_pid_taker_written(when: str) -> None:
    """A restored process ends while the fill runs (or between the pid check and the pinning of its
    memory), is reaped at once, and another process takes its pid: the fill stops, and the newcomer's
    memory holds its own bytes, not the snapshot's; one continued after the check that runs another
    program before the pinning is refused too (tests/support/fill_pid_reuse.py)."""
    p = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable,
                        str(REPO / "tests" / "support" / "fill_pid_reuse.py"), when],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if when == "exec":
        assert out["exec"] == os.path.realpath("/bin/sleep"), out  # it did run another program, as the scenario needs
        assert out["fill"].startswith("SplitError") and "ran another program" in out["fill"], out
        return
    assert out["newcomer"] == out["victim"], out  # the pid was taken again, as the scenario needs
    assert out["fill"].startswith("SplitError") and "no longer the process this restore made" in out["fill"], out
    assert out["newcomer_memory"] == "HOSTPROCHOSTPROC", out


def test_a_fill_workers_go_line_names_every_pid_with_its_identity_or_is_refused() -> None:
    from sandbox.criu.fill_procs import _checked_pids
    from sandbox.criu.split import SplitError
    assert _checked_pids(' {"41": [1200, 7, 9], "42": [1201, 8, 10]}') == {41: (1200, 7, 9), 42: (1201, 8, 10)}
    for bad in ("", " []", ' {"x": [1]}', ' {"41": ["soon"]}', ' {"0": [5]}', ' {"41": [-1]}', ' {"41": []}',
                ' {"41": 1200}', " {"):
        with pytest.raises(SplitError, match="go line"):
            _checked_pids(bad)


def test_pagemaps_and_mm_images_too_large_one_by_one_or_together_are_not_read_for_a_split() -> None:
    from sandbox.criu import split
    real = {"pagemap-10.img": 4 << 20, "pagemap-11.img": 1 << 20, "mm-10.img": 1 << 20, "pages-1.img": 40 << 30}
    assert split.images_too_large(real) is None
    one = {**real, "pagemap-12.img": split.MAX_PAGEMAP_BYTES + 1}
    assert "pagemap-12.img is" in (split.images_too_large(one) or "")
    # many, each within its bound: a forged snapshot's way to make planning hold gigabytes
    many = {f"pagemap-{100 + i}.img": split.MAX_PAGEMAP_BYTES // 4 for i in range(5)}
    assert "the pagemaps add up to" in (split.images_too_large(many) or "")
    mms = {f"mm-{100 + i}.img": split.MAX_MM_BYTES for i in range(5)}
    assert "the mm images add up to" in (split.images_too_large(mms) or "")
    assert split.images_too_large({"pages-1.img": 1 << 40}) is None  # page images are not planned from


def test_image_fields_criu_would_read_otherwise_than_the_split_are_refused() -> None:
    """Values a forged image can spell but CRIU reads in fewer bits (a uint32 page count, a uint64
    address), and two pagemaps naming one page image: the split refuses them, never plans on what
    CRIU would see differently."""
    from sandbox.criu import split
    with pytest.raises(split.SplitError, match="32-bit field"):
        split.parse_pagemap(_pm(1, [(0x100000, (1 << 32) + 1)]))  # CRIU would read 1 page
    a, b = 0x10000000, 0x10100000
    with pytest.raises(split.SplitError, match="an area"):  # CRIU would read it at A, over the area the fill moves
        split.mm_areas(_mm([(a, b, ANON), ((1 << 64) + a, (1 << 64) + b, 0x81, 3, 0x01)]))
    assert split.mm_areas(_mm([(a, b, ANON)])) == [(a, b, True)]
    plans, why = split.choose({"pagemap-10.img": _pm(1, [(0x100000, 16)]), "pagemap-11.img": _pm(1, [(0x900000, 16)])},
                              {"pages-1.img": 16 * 4096}, 4096)
    assert plans == {} and why is not None and "both name pages-1.img" in why, why


def test_a_fill_given_identities_writes_only_into_the_processes_they_name() -> None:
    """Filler.write with the parent's check (a fill worker's way): a start time or program layout
    that is not the process's own, or a pid the check did not cover, and nothing is written."""
    from sandbox.criu import split
    from sandbox.host.processes import memory_identity
    chunk, n = 64 << 10, 4
    me = memory_identity(os.getpid())
    assert me is not None
    for checked, why in (({os.getpid(): (me[0] + 1, *me[1:])}, "no longer the process this restore made"),
                         ({os.getpid(): (*me[:-1], me[-1] + 4096)}, "ran another program"),
                         ({os.getpid() + 1: me}, "were not checked before the fill")):
        target, filler = _filler_case(n, chunk, lambda s, i, ref: b"\x07" * ref.raw_len, budget=8 * (chunk + 4096))
        with filler:
            with pytest.raises(split.SplitError, match=why):
                filler.write(lambda pid: True, checked=checked)
        assert target.raw == bytes(n * chunk), "not a byte written"
    target, filler = _filler_case(n, chunk, lambda s, i, ref: b"\x07" * ref.raw_len, budget=8 * (chunk + 4096))
    with filler:
        assert filler.write(lambda pid: False, checked={os.getpid(): me})["written"] == (n - 1) * chunk
