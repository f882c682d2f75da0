"""Split restore: CRIU restores the small part of each process's memory, gpusnap fills the large runs.

CRIU restores pages on one thread (~2 GB/s), and on the host-staged GPU path most of a process's
image is the driver's host copy of GPU memory. A pagemap image lists each run of dumped pages
(vaddr, page count, flags); its page image holds the present runs' bytes back to back. Here the
runs (records contiguous in memory and in the image) of at least `min_bytes` (by default one page)
that lie in a process's private anonymous areas (its mm image says which: not the vDSO, whose ELF
CRIU reads while it restores, nor a file's private copy, shared or other special areas, nor an area
holding a thread's stack pointer or alternate signal stack, where the kernel writes a pending
signal's frame before the task stops: its core image says where; runs in
read-only areas or at addresses a parent and child both have pages at only from CAUTIOUS_MIN,
$GPUSNAP_CRIU_SPLIT_SHARED_MIN) are *moved*: the pagemap served to
CRIU leaves them out (CRIU then maps their areas with no content) and the page image served to CRIU
skips their bytes; CRIU
restores the tree left stopped (--leave-stopped), and a `Filler` writes the moved runs straight into
the stopped processes from many threads, each through /proc/PID/mem opened before the first byte
and bound to the process that was checked (pin_memory; chunks verified and decoded in
parallel, fetched from the store while CRIU still runs; all-zero chunks are skipped: the fresh
mapping already reads as zero). Then the tree is continued. No process runs before every byte of it is
back; the fill may complete some processes first (fill_phases), each continued as soon as its own runs
are in (the caller then starts its GPU copy while the fill goes on with the others).

Pagemap format (CRIU 4): two u32 magics, then records of a u32 length and a protobuf: first
PagemapHead {1: pages_id}, then PagemapEntry {1: vaddr, 2: nr_pages (u32), 3: in_parent, 4: flags,
5: nr_pages (u64, CRIU >= 4.2, which then writes 0 in field 2)}. Records the split does not move are
passed to CRIU byte for byte. A pagemap whose present pages do not add up to its page image's size is
not understood (a format this module does not know): then nothing is split and `choose` says why.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import os
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, Union

from sandbox.criu.restored import boot_ticks
from sandbox.host.processes import memory_identity
from storage.api import AlignedBuffer, copy_into
from storage.api import GpusnapError
from storage.api import ChunkRef, Stream
from storage.api import Stages
from storage.api import Want

PAGE = 4096
PE_PARENT, PE_LAZY, PE_PRESENT = 1, 2, 4
_LEN = struct.Struct("<I")
_MAGICS = 8
PAGEMAP_NAME = re.compile(r"pagemap-([1-9][0-9]{0,9})\.img")  # ASCII digits as CRIU writes a pid: one name per pid
DEFAULT_MIN = PAGE  # every run of private anonymous memory (BENCHMARKS.md section 34: a heap of thousands of
                    # mappings, which no run of the first default, 64 MiB, reached, restored in well under half
                    # the time; one 3 GiB buffer of weights in 0.85-0.96x)


class SplitError(GpusnapError):
    """A pagemap that cannot be parsed, or a moved run that could not be written into its process."""


@dataclass(frozen=True)
class Entry:
    vaddr: int
    nr_pages: int
    flags: int
    record: bytes          # the record as stored (length prefix included), passed on unchanged
    offset: int | None     # where its bytes start in the page image (None: not in this image)

    @property
    def nbytes(self) -> int:
        return self.nr_pages * PAGE


@dataclass(frozen=True)
class Pagemap:
    head: bytes            # the magics and the PagemapHead record
    pages_id: int
    entries: tuple[Entry, ...]


def read_varint(data: bytes, i: int, max_shift: int = 70) -> tuple[int, int] | None:
    """The protobuf varint at DATA[I:] (its bytes' shifts below MAX_SHIFT: 70 for 64-bit fields, 35
    for 32-bit ones) and the index after it; None when it is malformed or cut short. Shared with the
    streamer's request parser."""
    v, shift = 0, 0
    while i < len(data) and shift < max_shift:
        c = data[i]
        v |= (c & 0x7F) << shift
        i += 1
        if not c & 0x80:
            return v, i
        shift += 7
    return None


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = read_varint(b, i)
    if r is None:
        raise SplitError("pagemap: malformed varint")
    return r


def _fields(body: bytes, i: int = 0, end: int | None = None) -> dict[int, int]:
    """The varint fields of the protobuf record BODY[I:END] (CRIU's pagemap and head records: wire type
    0 only), by number. One loop, no call per varint: a restore parses every pagemap entry of the
    tree (tens of thousands for a CUDA process) before CRIU starts."""
    end = len(body) if end is None else end
    out: dict[int, int] = {}
    while i < end:
        vals = [0, 0]
        for k in (0, 1):
            v, shift = 0, 0
            while True:
                if i >= end or shift >= 70:
                    raise SplitError("pagemap: malformed varint")
                c = body[i]
                i += 1
                v |= (c & 0x7F) << shift
                if c < 0x80:
                    break
                shift += 7
            vals[k] = v
            if k == 0 and v & 7 != 0:
                raise SplitError(f"pagemap: unexpected wire type {v & 7}")
        out[vals[0] >> 3] = vals[1]
    return out


MAX_PAGEMAP_BYTES = 64 << 20  # CRIU's records cover up to ~1 MiB of pages each: ~25 MB for a 1 TB process
USER_SPACE_END = 1 << 57       # no user address reaches this (5-level paging)


def parse_pagemap(data: bytes) -> Pagemap:
    """A pagemap image (bytes from the store: checked, not trusted): at most MAX_PAGEMAP_BYTES, every
    record of at least one page, page-aligned and inside user space; SplitError otherwise."""
    if len(data) > MAX_PAGEMAP_BYTES:
        raise SplitError(f"pagemap: {len(data)} bytes, more than the {MAX_PAGEMAP_BYTES} a real one needs")
    if len(data) < _MAGICS + _LEN.size:
        raise SplitError("pagemap: too short")
    i = _MAGICS
    (n,) = _LEN.unpack_from(data, i)
    head_end = i + _LEN.size + n
    if head_end > len(data):
        raise SplitError("pagemap: truncated head")
    pages_id = _fields(data, i + _LEN.size, head_end).get(1, 0)
    entries, i, off = [], head_end, 0
    while i < len(data):
        if i + _LEN.size > len(data):
            raise SplitError("pagemap: truncated record")
        (n,) = _LEN.unpack_from(data, i)
        end = i + _LEN.size + n
        if end > len(data):
            raise SplitError("pagemap: truncated record")
        f = _fields(data, i + _LEN.size, end)
        flags = f.get(4, PE_PARENT if f.get(3) else PE_PRESENT)
        nr = f[5] if 5 in f else f.get(2, 0)  # CRIU 4.2 writes the 64-bit count in field 5, 0 in field 2
        vaddr = f.get(1, 0)
        if 5 not in f and nr >= 1 << 32:  # field 2 is CRIU's uint32: it would read only the low bits
            raise SplitError(f"pagemap: a record of {nr} pages in a 32-bit field")
        if nr <= 0 or vaddr % PAGE or vaddr + nr * PAGE > USER_SPACE_END:
            raise SplitError(f"pagemap: a record of {nr} pages at {vaddr:#x}")
        present = bool(flags & PE_PRESENT) and not flags & PE_PARENT
        entries.append(Entry(vaddr, nr, flags, data[i:end], off if present else None))
        if present:
            off += nr * PAGE
        i = end
    return Pagemap(data[:head_end], pages_id, tuple(entries))


def pstree_records(data: bytes) -> list[tuple[int, int]]:
    """(pid, ppid) of every process a CRIU pstree image lists (PstreeEntry {1: pid, 2: ppid, 3: pgid,
    4: sid, 5: threads}, framed as a pagemap is): every process CRIU dumped, children forked while it
    froze the tree included."""
    return [(pid, ppid) for pid, ppid, _ in _pstree(data)]


def pstree_threads(data: bytes) -> dict[int, list[int]]:
    """Each process's threads (their ids, the process's own first where CRIU lists it) as a CRIU
    pstree image lists them: whose core images (core-TID.img) say where each thread's stack is. Not
    checked here: CRIU 4.2.1 lists a number that is no thread id for a zombie (its threads are gone),
    and an id no core image has stops the split (process_stacks) for a process whose pages it fills."""
    return {pid: threads or [pid] for pid, _, threads in _pstree(data)}


def _pstree(data: bytes) -> list[tuple[int, int, list[int]]]:
    out, i = [], _MAGICS
    while i + _LEN.size <= len(data):
        (n,) = _LEN.unpack_from(data, i)
        end = i + _LEN.size + n
        if end > len(data):
            raise SplitError("pstree: truncated record")
        j, pid, ppid, threads = i + _LEN.size, None, 0, []
        while j < end:
            key, j = _varint(data, j)
            if key & 7 == 2 and key >> 3 == 5:  # threads, packed (proto3 writers; CRIU writes them unpacked)
                ln, j = _varint(data, j)
                k, stop = j, j + ln
                if stop > end:
                    raise SplitError("pstree: truncated threads")
                while k < stop:
                    t, k = _varint(data, k)
                    threads.append(t)
                j = stop
                continue
            if key & 7 != 0:
                raise SplitError(f"pstree: unexpected wire type {key & 7}")
            v, j = _varint(data, j)
            if key >> 3 == 1:
                pid = v
            elif key >> 3 == 2:
                ppid = v
            elif key >> 3 == 5:
                threads.append(v)
        if pid is None or not 0 < pid < 1 << 22:
            raise SplitError("pstree: a record without a valid pid")
        out.append((pid, ppid if 0 < ppid < 1 << 22 else 0, threads))
        i = end
    return out


# Where the kernel writes into a restored process before gpusnap's fill is done. `criu restore
# --leave-stopped` lets each task return from CRIU's restorer with a stop pending; a handled signal
# pending too (one that came while CRIU had the tree frozen, or a SIGCHLD from a zombie CRIU restores)
# is taken first when the signal's number is lower than SIGSTOP's: the kernel writes its frame (the
# registers to go back to) below the thread's stack pointer, or on its alternate signal stack, and
# only then does the task stop. A fill that wrote the dumped bytes of that stack afterwards would
# overwrite the frame, and the handler would return into whatever the stack held at the dump (a
# forking server whose SIGCHLD was pending crashed so). So each area holding a thread's stack pointer
# or its alternate signal stack stays with CRIU, which restores it before the task runs.
MAX_CORE_BYTES = 1 << 20      # a thread's registers, extended state and signal handlers: ~20 KB
FRAMES_BELOW_SP = 256 << 10   # where the frames go: below the stack pointer (x86-64: past a 128-byte red
                              # zone), up to ~12 KB each with AMX state, nested for each pending signal
                              # under SIGSTOP's number: the areas this range touches stay, not only sp's
MAX_THREADS = 1 << 16         # threads of the processes whose pages are served, all together
MAX_PSTREE_BYTES = 16 << 20   # ~20 bytes a process: ~800,000 processes, far more than any tree CRIU dumps
MARCH_X86_64, MARCH_AARCH64 = 1, 3
SS_DISABLE = 2


def _one_record(data: bytes, what: str, most: int) -> tuple[int, int]:
    """Where the one record of a CRIU image holding one (mm, core: magics, a u32 length, the record)
    starts and ends in DATA, checked: at most MOST bytes, not cut short (SplitError naming WHAT)."""
    if len(data) > most:
        raise SplitError(f"{what}: {len(data)} bytes, more than the {most} a real one needs")
    if len(data) < _MAGICS + _LEN.size:
        raise SplitError(f"{what}: too short")
    (n,) = _LEN.unpack_from(data, _MAGICS)
    start, end = _MAGICS + _LEN.size, _MAGICS + _LEN.size + n
    if end > len(data):
        raise SplitError(f"{what}: truncated record")
    return start, end


def _message(data: bytes, i: int, end: int, want: int) -> tuple[int, int] | None:
    """The span (start, end) of field WANT (a message: wire type 2) in DATA[I:END]; SplitError where it
    comes more than once (a protobuf reader merges the copies: this one would see only one of them)."""
    found = None
    while i < end:
        key, i = _varint(data, i)
        if key & 7 == 2:
            ln, i = _varint(data, i)
            if i + ln > end:
                raise SplitError("core: truncated field")
            if key >> 3 == want:
                if found is not None:
                    raise SplitError(f"core: field {want} more than once")
                found = (i, i + ln)
            i += ln
        else:
            i = _skip_field(data, i, key & 7)
            if i > end:
                raise SplitError("core: truncated field")
    return found


def _ints(data: bytes, span: tuple[int, int]) -> dict[int, int]:
    """The varint fields of the message at SPAN, by number (other wire types skipped)."""
    i, end = span
    out: dict[int, int] = {}
    while i < end:
        key, i = _varint(data, i)
        if key & 7 == 0:
            v, i = _varint(data, i)
            if v >> 64:  # CRIU's reader keeps the low 64 bits: this would see another number
                raise SplitError(f"core: field {key >> 3} is more than 64 bits")
            out[key >> 3] = v
        else:
            i = _skip_field(data, i, key & 7)
            if i > end:
                raise SplitError("core: truncated field")
    return out


def thread_stacks(data: bytes) -> list[tuple[int, int]]:
    """Where the kernel may write a signal frame for one thread before its stop (above): from its CRIU
    core image (CoreEntry {1: mtype, 2: thread_info (x86-64) {2: gpregs {20: sp}}, 8: ti_aarch64
    {3: gpregs {2: sp}}, 5: thread_core {7: sas {1: ss_sp, 2: ss_size, 3: ss_flags}}}, framed as a
    pagemap is), the range [sp - FRAMES_BELOW_SP, sp] and, when one is set up, the alternate signal stack. Bytes
    from the store, checked (SplitError): an architecture or a record this does not know means the
    split cannot know where the stacks are."""
    start, end = _one_record(data, "core", MAX_CORE_BYTES)
    march = _ints(data, (start, end)).get(1)
    where = {MARCH_X86_64: (2, 2, 20), MARCH_AARCH64: (8, 3, 2)}.get(march or 0)
    if where is None:
        raise SplitError(f"core: architecture {march} is not one the split knows")
    ti = _message(data, start, end, where[0])
    regs = _message(data, *ti, where[1]) if ti is not None else None
    sp = _ints(data, regs).get(where[2]) if regs is not None else None
    if sp is None:
        raise SplitError("core: no stack pointer")
    out = [(max(0, sp - FRAMES_BELOW_SP), sp + 1)]
    tc = _message(data, start, end, 5)
    sas = _message(data, *tc, 7) if tc is not None else None
    if sas is not None:
        f = _ints(data, sas)
        ss_sp, ss_size = f.get(1, 0), f.get(2, 0)
        if ss_size and not f.get(3, 0) & SS_DISABLE:
            out.append((ss_sp, ss_sp + ss_size))
    return out


# CRIU's VMA status bits (criu/include/image.h): which areas the split may fill. Only the pages of
# ordinary private memory move; CRIU needs the others' contents while it restores (the vDSO, whose
# ELF it reads to decide how to remap it) or maps them itself (shared memory, SysV IPC, AIO rings,
# sockets). An area CRIU marks as a stack stays with CRIU too (CRIU 4.2.1 marked none of the
# project's processes' areas so: their stacks are ordinary private memory to it); so does every area
# holding a thread's stack pointer or alternate signal stack (thread_stacks: the kernel may write a
# signal frame there before the task stops).
VMA_REGULAR, VMA_STACK, VMA_VSYSCALL, VMA_VDSO = 1 << 0, 1 << 1, 1 << 2, 1 << 3
VMA_FILE_PRIVATE, VMA_FILE_SHARED, VMA_ANON_SHARED, VMA_ANON_PRIVATE = 1 << 6, 1 << 7, 1 << 8, 1 << 9
VMA_SPECIAL = (VMA_STACK | VMA_VSYSCALL | VMA_VDSO | VMA_FILE_PRIVATE | VMA_FILE_SHARED | VMA_ANON_SHARED
               | (1 << 10) | (1 << 11) | (1 << 12) | (1 << 13) | (1 << 14) | (1 << 15) | (1 << 16) | (1 << 17)
               | (1 << 27) | (1 << 30) | (1 << 31))
# (SysV IPC, socket, vvar, AIO ring, memfd, shadow stack, guard, uprobes, a plugin's area, premapped,
# unsupported.) A file's private copy stays with CRIU too: the fill skips all-zero chunks because a
# fresh anonymous mapping reads as zero, and a file mapping reads as the file.
MAP_SHARED, MAP_HUGETLB, PROT_WRITE = 0x01, 0x40000, 0x2
MM_NAME = re.compile(r"mm-([1-9][0-9]{0,9})\.img")
MAX_MM_BYTES = 16 << 20  # 65530 areas (the kernel's default map count) take ~3 MB
# all pagemaps (or mm images) of one snapshot together: planning holds them parsed at once, ~40x their
# bytes for pagemaps of one-page records; real ones take ~25 MB for 1 TB of processes
MAX_PAGEMAPS_TOTAL = MAX_PAGEMAP_BYTES
MAX_MMS_TOTAL = 4 * MAX_MM_BYTES


def images_too_large(sizes: dict[str, int]) -> str | None:
    """Why the pagemaps and mm images of SIZES (image name -> bytes) are not read for a split (None:
    they may be): one larger than a real one needs, or all of them together more than real ones add
    up to (a forged snapshot of many large ones would cost planning gigabytes of memory)."""
    for n, size in sorted(sizes.items()):
        if (PAGEMAP_NAME.fullmatch(n) and size > MAX_PAGEMAP_BYTES) or (MM_NAME.fullmatch(n) and size > MAX_MM_BYTES):
            return (f"{n} is {size} bytes, more than a real {'pagemap' if n.startswith('pagemap') else 'mm image'} "
                    "needs; CRIU restored every page")
    for pattern, most, what in ((PAGEMAP_NAME, MAX_PAGEMAPS_TOTAL, "pagemaps"), (MM_NAME, MAX_MMS_TOTAL, "mm images")):
        total = sum(size for n, size in sizes.items() if pattern.fullmatch(n))
        if total > most:
            return f"the {what} add up to {total} bytes, more than real ones need ({most}); CRIU restored every page"
    return None
ENGAGE_MIN = 16 << 20    # the split engages when it moves this much, or a hundredth of the pages if that is less
CAUTIOUS_MIN = 64 << 20  # runs that may be shared with a parent or child, or lie in a read-only area: the
                         # split's first rule (only runs this large move), which kept such pages with CRIU
                         # ($GPUSNAP_CRIU_SPLIT_SHARED_MIN)


def movable(status: int, flags: int = 0) -> bool:
    """Whether the pages of an area of this CRIU status and mmap flags may be filled by gpusnap:
    ordinary private anonymous memory (the heap included), not huge-page-backed."""
    return bool(status & VMA_REGULAR) and bool(status & VMA_ANON_PRIVATE) and not status & VMA_SPECIAL \
        and not flags & (MAP_SHARED | MAP_HUGETLB)


def _skip_field(data: bytes, i: int, wire: int) -> int:
    if wire == 0:
        return _varint(data, i)[1]
    if wire == 1:
        return i + 8
    if wire == 5:
        return i + 4
    if wire == 2:
        n, i = _varint(data, i)
        return i + n
    raise SplitError(f"mm: unexpected wire type {wire}")


def process_stacks(pids: "Sequence[int]", threads: dict[int, list[int]],
                   core: Callable[[str], bytes | None]) -> tuple[dict[int, list[tuple[int, int]]], str | None]:
    """thread_stacks of every thread of each of PIDS (THREADS: pstree_threads; CORE(name): a core
    image's bytes, None where the snapshot lacks it; it may raise SplitError), by pid; with the reason the split cannot go on
    where an image is missing or not understood (then the dict is empty)."""
    out: dict[int, list[tuple[int, int]]] = {}
    if sum(len(set(threads.get(pid, [pid]))) for pid in set(pids)) > MAX_THREADS:
        return {}, f"the processes list more than {MAX_THREADS} threads; CRIU restored every page"
    for pid in pids:
        ranges: list[tuple[int, int]] = []
        for tid in dict.fromkeys(threads.get(pid, [pid])):  # each once, in order
            name = f"core-{tid}.img"
            try:
                data = core(name)
                if data is None:
                    return {}, f"the snapshot lacks {name}; CRIU restored every page"
                ranges += thread_stacks(data)
            except SplitError as e:
                return {}, f"{name} is not understood ({e}); CRIU restored every page"
        out[pid] = ranges
    return out, None


def vma_fields(data: bytes) -> Iterator[dict[int, int]]:
    """The varint fields, by number, of each VmaEntry of a CRIU mm image (MmEntry {14: repeated
    VmaEntry}, framed as a pagemap is), in the image's order; SplitError where it is cut short or
    malformed (bytes from the store)."""
    i, end = _one_record(data, "mm", MAX_MM_BYTES)
    while i < end:
        key, i = _varint(data, i)
        if key >> 3 != 14 or key & 7 != 2:
            i = _skip_field(data, i, key & 7)
            continue
        ln, i = _varint(data, i)
        vend = i + ln
        if vend > end:
            raise SplitError("mm: truncated area")
        f: dict[int, int] = {}
        while i < vend:
            k, i = _varint(data, i)
            if k & 7 == 0:
                f[k >> 3], i = _varint(data, i)
            else:
                i = _skip_field(data, i, k & 7)
        if i != vend:
            raise SplitError("mm: malformed area")
        yield f
    if i != end:
        raise SplitError("mm: malformed record")


def mm_areas(data: bytes, kept: "Sequence[tuple[int, int]]" = (),
             pinned_out: list[tuple[int, int]] | None = None) -> list[tuple[int, int, bool]]:
    """The areas of a CRIU mm image (MmEntry {14: repeated VmaEntry {1: start, 2: end, 5: prot,
    6: flags, 7: status}}, framed as a pagemap is) whose pages the split may fill (movable, and not
    touching any of the ranges KEPT: the process's thread stacks, thread_stacks), as sorted (start,
    end, writable), adjacent ones of the same writability joined; PINNED_OUT, where given, gets the
    (start, end) of each area that would move but for KEPT. Bytes from the store: checked, not
    trusted (SplitError): no two areas of the image, movable or not, may overlap."""
    every: list[tuple[int, int, int, int, int]] = []
    for f in vma_fields(data):
        start, stop = f.get(1, 0), f.get(2, 0)
        if start % PAGE or stop % PAGE or not start < stop or stop >= 1 << 64:
            # (past 64 bits CRIU, reading uint64, would see another address than this check did)
            raise SplitError(f"mm: an area {start:#x}-{stop:#x}")
        every.append((start, stop, f.get(5, 0), f.get(6, 0), f.get(7, 0)))
    every.sort()
    pinned: set[int] = set()  # the areas a kept range touches: one sweep over both, sorted (kept merged)
    merged: list[list[int]] = []
    for lo, hi in sorted(kept):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    k = 0
    for lo, hi in merged:
        while k < len(every) and every[k][1] <= lo:
            k += 1
        j = k
        while j < len(every) and every[j][0] < hi:
            pinned.add(j)
            j += 1
    joined: list[tuple[int, int, bool]] = []
    for k, (a, b, prot, flags, status) in enumerate(every):
        if k and a < every[k - 1][1]:
            raise SplitError(f"mm: areas overlap at {a:#x}")
        if not movable(status, flags):  # (the kernel's vsyscall page lies past user space, and never moves)
            continue
        if k in pinned:
            if pinned_out is not None:
                pinned_out.append((a, b))
            continue
        if b > USER_SPACE_END:
            raise SplitError(f"mm: an area {a:#x}-{b:#x} past user space")
        w = bool(prot & PROT_WRITE)
        if joined and a == joined[-1][1] and joined[-1][2] == w:
            joined[-1] = (joined[-1][0], b, w)
        else:
            joined.append((a, b, w))
    return joined


def outside(pm: Pagemap, areas: list[tuple[int, int, bool]]) -> tuple[set[int], set[int]]:
    """The present entries of PM (their indices) not wholly inside one of AREAS (mm_areas), which stay
    with CRIU, and those inside a read-only one (the split's cautious rule: CAUTIOUS_MIN)."""
    starts = [a for a, _, _ in areas]
    out, read_only = set(), set()
    for k, e in enumerate(pm.entries):
        if e.offset is None:
            continue
        j = bisect.bisect_right(starts, e.vaddr) - 1
        if j < 0 or e.vaddr + e.nbytes > areas[j][1]:
            out.add(k)
        elif not areas[j][2]:
            read_only.add(k)
    return out, read_only


def overlapping(a: _Present, b: _Present) -> tuple[set[int], set[int]]:
    """The entries of A and of B (present lists, by address) whose pages lie at addresses the other
    process has pages at too: only there can a parent and a child share pages copy-on-write."""
    sa: set[int] = set()
    sb: set[int] = set()
    i = j = 0
    while i < len(a) and j < len(b):
        if max(a[i][0], b[j][0]) < min(a[i][1], b[j][1]):
            sa.add(a[i][3])
            sb.add(b[j][3])
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return sa, sb


def pstree_pids(data: bytes) -> list[int]:
    """The pids a CRIU pstree image lists (pstree_records)."""
    return [pid for pid, _ in pstree_records(data)]


@dataclass(frozen=True)
class Run:
    """Pages contiguous in memory and in the page image (CRIU writes at most a pipe's worth of
    pages per pagemap record, ~1 MiB, so a large area is many records)."""
    vaddr: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """One process's split: the pagemap CRIU gets, the page-image ranges it gets, the runs moved."""
    pid: int
    pages_image: str
    pagemap: bytes
    kept: tuple[tuple[int, int], ...]      # (offset, length) in the page image, in order
    moved: tuple[Run, ...]
    cow_kept: int = 0                      # bytes left to CRIU because a parent or child shares them (cow_shared)
    stack_kept: int = 0                    # bytes left to CRIU because a thread's stack is in their area

    @property
    def moved_bytes(self) -> int:
        return sum(r.nbytes for r in self.moved)


def _runs(entries: tuple[Entry, ...], skip: "set[int] | frozenset[int]" = frozenset()) -> list[list[Entry]]:
    """The present entries grouped into runs contiguous in memory and in the page image; the entries
    whose index is in SKIP are in none (they stay with CRIU, and a run ends at them)."""
    runs: list[list[Entry]] = []
    for k, e in enumerate(entries):
        if e.offset is None:
            continue
        if k in skip:
            runs.append([])  # ends the run before it
            continue
        last = runs[-1][-1] if runs and runs[-1] else None
        if last is not None and last.offset is not None and e.vaddr == last.vaddr + last.nbytes \
                and e.offset == last.offset + last.nbytes:
            runs[-1].append(e)
        else:
            runs.append([e])
    return [r for r in runs if r]


def _cut(pm: Pagemap, runs: list[list[Entry]], careful: "set[int]") -> list[tuple[list[Entry], bool]]:
    """RUNS cut where an entry's membership of CAREFUL (entry indices) changes: (run, careful)."""
    if not careful:
        return [(r, False) for r in runs]
    index = {id(e): k for k, e in enumerate(pm.entries)}
    out: list[tuple[list[Entry], bool]] = []
    for r in runs:
        for c, part in itertools.groupby(r, key=lambda e: index[id(e)] in careful):
            out.append((list(part), c))
    return out


def plan(name: str, data: bytes, min_bytes: int) -> Plan | None:
    """The split of pagemap image NAME (DATA), or None when no run is large enough to move."""
    if PAGEMAP_NAME.fullmatch(name) is None or min_bytes <= 0:
        return None
    pm = parse_pagemap(data)
    return _plan(name, pm, _runs(pm.entries), min_bytes)


def _plan(name: str, pm: Pagemap, runs: list[list[Entry]], min_bytes: int,
          skip: "set[int] | frozenset[int]" = frozenset()) -> Plan | None:
    """plan() of a parsed pagemap PM whose RUNS are known (choose parses each pagemap once); SKIP: the
    entries left to CRIU whatever their size (their index; _runs left them out of RUNS)."""
    m = PAGEMAP_NAME.fullmatch(name)
    assert m is not None
    big = [r for r in runs if sum(e.nbytes for e in r) >= min_bytes]
    if not big:
        return None
    moved = tuple(Run(r[0].vaddr, r[0].offset or 0, sum(e.nbytes for e in r)) for r in big)
    gone = {id(e) for r in big for e in r}
    keep = [e for e in pm.entries if id(e) not in gone]
    kept: list[tuple[int, int]] = []
    for e in keep:
        if e.offset is None:
            continue
        if kept and kept[-1][0] + kept[-1][1] == e.offset:
            kept[-1] = (kept[-1][0], kept[-1][1] + e.nbytes)
        else:
            kept.append((e.offset, e.nbytes))
    return Plan(int(m.group(1)), f"pages-{pm.pages_id}.img", pm.head + b"".join(e.record for e in keep),
                tuple(kept), moved, sum(e.nbytes for k, e in enumerate(pm.entries) if k in skip and e.offset is not None))


def _inside(pm: Pagemap, spans: list[tuple[int, int]]) -> int:
    """The present bytes of PM's records that lie in SPANS (sorted, disjoint areas)."""
    if not spans:
        return 0
    starts = [a for a, _ in spans]
    n = 0
    for e in pm.entries:
        j = bisect.bisect_right(starts, e.vaddr) - 1
        if e.offset is not None and j >= 0 and e.vaddr < spans[j][1]:
            n += e.nbytes
    return n


def present_bytes(pm: Pagemap) -> int:
    """How many bytes of its page image PM's records name."""
    return sum(e.nbytes for e in pm.entries if e.offset is not None)


def cow_shared(child: Pagemap, parent: Pagemap, cstream: Stream, pstream: Stream) -> tuple[set[int], set[int]]:
    """The entries (indices) of CHILD's and of PARENT's pagemap that hold pages the two processes share
    copy-on-write: present in both at the same address with the same bytes, known from the page
    images' chunks (CSTREAM, PSTREAM): the same non-zero chunk, at the same offset in it.

    CRIU keeps such pages shared: it restores the parent's before it forks the child, and a page of
    the child equal to the one it inherited is left shared, not written. Pages the split moves are
    written after every process exists, each into its own memory, so a tree of forked workers that
    shared their weights would come back with a private copy in every worker. So these entries stay
    with CRIU in both processes. Only where the bytes are equal: anything else is the child's own
    (CRIU writes it too) or a coincidence of addresses (an exec'd child), and a lying manifest can only
    move this line (more to CRIU, or more copies), never give a process another's bytes."""
    return _shared(_present(child), _present(parent), cstream, pstream, chunk_starts(cstream), chunk_starts(pstream))


def _shared(cl: _Present | None, pl: _Present | None, cstream: Stream, pstream: Stream,
            cst: tuple[list[int], int], pst: tuple[list[int], int]) -> tuple[set[int], set[int]]:
    """cow_shared of two pagemaps' present entries (_present) and their streams' chunk_starts. Linear
    in entries and chunks: the overlaps are disjoint, and each step reaches a chunk's end."""
    if cl is None or pl is None:
        return set(), set()  # overlapping records: not CRIU's (it never writes them); nothing is kept back
    (cstarts, cend), (pstarts, pend) = cst, pst
    cshared: set[int] = set()
    pshared: set[int] = set()
    i = j = 0
    while i < len(cl) and j < len(pl):
        cv, ce, co, ck = cl[i]
        pv, pe, po, pk = pl[j]
        a, b = max(cv, pv), min(ce, pe)
        if a < b and not (ck in cshared and pk in pshared):
            c_off, p_off = co + (a - cv), po + (a - pv)
            while a < b:
                ci = bisect.bisect_right(cstarts, c_off) - 1
                pi = bisect.bisect_right(pstarts, p_off) - 1
                if ci < 0 or pi < 0 or c_off >= cend or p_off >= pend:
                    break  # past a page image's end: not what the pagemap says (choose refuses that earlier)
                cc, pc = cstream.chunks[ci], pstream.chunks[pi]
                step = min(b - a, cstarts[ci] + cc.raw_len - c_off, pstarts[pi] + pc.raw_len - p_off)
                if step <= 0:
                    break
                if cc.id is not None and not cc.is_zero and cc.id == pc.id and not pc.is_zero \
                        and c_off - cstarts[ci] == p_off - pstarts[pi]:
                    cshared.add(ck)
                    pshared.add(pk)
                    break  # the two entries are marked: the rest of this overlap says nothing more
                a, c_off, p_off = a + step, c_off + step, p_off + step
        if ce <= pe:
            i += 1
        else:
            j += 1
    return cshared, pshared


_Present = list[tuple[int, int, int, int]]


def _present(pm: Pagemap) -> _Present | None:
    """PM's present entries as (start, end, image offset, index), by address; None when two overlap."""
    out = sorted((e.vaddr, e.vaddr + e.nbytes, e.offset, k) for k, e in enumerate(pm.entries) if e.offset is not None)
    if any(out[i][0] < out[i - 1][1] for i in range(1, len(out))):
        return None
    return out


def choose(pagemaps: dict[str, bytes], page_sizes: dict[str, int],
           min_bytes: int, parents: dict[int, int] | None = None,
           streams: dict[str, Stream] | None = None,
           mms: dict[str, bytes] | None = None,
           cautious_min: int = CAUTIOUS_MIN,
           stacks: dict[int, list[tuple[int, int]]] | None = None) -> tuple[dict[str, Plan], str | None]:
    """The splits of PAGEMAPS (pagemap image name -> its bytes; PAGE_SIZES: page image name -> its
    size), by page image, and when there is none, why (for the restore report): the split is off, a
    pagemap is not understood (its records do not add up to its page image: nothing is split then,
    CRIU restores everything), or no run is large enough. PARENTS (pid -> ppid, the pstree image) and
    STREAMS (page image name -> its stream): the entries a process shares with its parent stay with
    CRIU in both (cow_shared). MMS (mm image name -> its bytes): only pages inside a process's
    ordinary private areas move (mm_areas; a process without its mm image moves none); None: every
    area counts as ordinary (callers that built the pagemaps themselves). CAUTIOUS_MIN: the size from
    which runs at addresses a parent and its child both have pages at, and runs in read-only areas,
    move too (0: never): below it CRIU keeps them, shared where they were. STACKS (pid -> its threads'
    thread_stacks): the areas they touch stay with CRIU (with MMS, every process whose pages are served
    must have its entry: else nothing is split)."""
    if min_bytes <= 0:
        return {}, "the split is off (GPUSNAP_CRIU_SPLIT_MIN=0)"
    areas: dict[int, list[tuple[int, int, bool]]] | None = None
    pinned: dict[int, list[tuple[int, int]]] = {}  # by pid: the areas kept with CRIU for a thread's stack
    if mms is not None:
        areas = {}
        wanted = {int(m.group(1)) for m in map(PAGEMAP_NAME.fullmatch, pagemaps) if m is not None}
        for name in sorted(mms):
            mm = MM_NAME.fullmatch(name)
            if mm is None or int(mm.group(1)) not in wanted:  # only the processes whose pages are served
                continue
            if stacks is not None and int(mm.group(1)) not in stacks:
                return {}, f"where the threads of process {mm.group(1)} have their stacks is not known; CRIU restored every page"
            try:
                areas[int(mm.group(1))] = mm_areas(mms[name], stacks.get(int(mm.group(1)), ()) if stacks else (),
                                                   pinned.setdefault(int(mm.group(1)), []))
            except SplitError as e:
                return {}, f"{name} is not understood ({e}); CRIU restored every page"
    parsed: dict[int, tuple[str, Pagemap]] = {}
    naming: dict[str, str] = {}  # page image -> the pagemap naming it
    for name in sorted(pagemaps):
        m = PAGEMAP_NAME.fullmatch(name)
        if m is None:
            continue
        try:
            pm = parse_pagemap(pagemaps[name])
        except SplitError as e:
            return {}, f"{name} is not understood ({e}); CRIU restored every page"
        image = f"pages-{pm.pages_id}.img"
        if image not in page_sizes:
            return {}, f"{name} names {image}, which the snapshot lacks; CRIU restored every page"
        named = present_bytes(pm)
        if named != page_sizes[image]:
            return {}, (f"{name} names {named} bytes of {image}, which holds {page_sizes[image]}: a pagemap "
                        "format gpusnap does not know; CRIU restored every page")
        if image in naming:  # a plan is made per page image: one of the two would go unplanned
            return {}, f"{naming[image]} and {name} both name {image}; CRIU restored every page"
        naming[image] = name
        parsed[int(m.group(1))] = (name, pm)
    # For each child and its parent: the entries both hold with the same bytes (cow_shared) stay with CRIU
    # in both (SKIP); and the entries at addresses the other also has pages at are cautious: they move
    # only in runs of CAUTIOUS_MIN (the split's first rule), since they may share pages copy-on-write that
    # cow_shared sees only where a whole chunk is equal. Entries in read-only areas are cautious too
    # (written through /proc/PID/mem; below).
    skip: dict[int, set[int]] = {}
    cautious: dict[int, set[int]] = {}
    present: dict[int, _Present | None] = {}  # each pagemap sorted once, however many children it has
    starts: dict[str, tuple[list[int], int]] = {}
    for pid, (_, pm) in parsed.items():
        ppid = (parents or {}).get(pid, 0)
        if ppid not in parsed or ppid == pid:
            continue
        ppm = parsed[ppid][1]
        for p, mp in ((pid, pm), (ppid, ppm)):
            if p not in present:
                present[p] = _present(mp)
        cp, pp = present[pid], present[ppid]
        if cp is None or pp is None:  # overlapping records (not CRIU's): every entry is cautious
            cautious.setdefault(pid, set()).update(range(len(pm.entries)))
            cautious.setdefault(ppid, set()).update(range(len(ppm.entries)))
        else:
            mine, theirs = overlapping(cp, pp)
            cautious.setdefault(pid, set()).update(mine)
            cautious.setdefault(ppid, set()).update(theirs)
        cname, pname = f"pages-{pm.pages_id}.img", f"pages-{ppm.pages_id}.img"
        cs, ps = (streams.get(cname), streams.get(pname)) if streams is not None else (None, None)
        if cs is None or ps is None:
            continue
        for n, st in ((cname, cs), (pname, ps)):
            if n not in starts:
                starts[n] = chunk_starts(st)
        mine, theirs = _shared(cp, pp, cs, ps, starts[cname], starts[pname])
        skip.setdefault(pid, set()).update(mine)
        skip.setdefault(ppid, set()).update(theirs)
    plans: dict[str, Plan] = {}
    largest = 0
    for pid, (name, pm) in sorted(parsed.items()):
        stay = set(skip.get(pid, ()))
        careful = cautious.get(pid, set())
        if areas is not None:
            out, read_only = outside(pm, areas.get(pid, []))  # areas CRIU must fill itself, read-only ones
            stay |= out
            careful = careful | read_only
        runs = _cut(pm, _runs(pm.entries, stay), careful)
        largest = max([largest] + [sum(e.nbytes for e in r) for r, _ in runs])
        big = [r for r, c in runs if (not c or cautious_min > 0)
               and sum(e.nbytes for e in r) >= (max(min_bytes, cautious_min) if c else min_bytes)]
        pl = _plan(name, pm, big, PAGE, skip.get(pid, frozenset()))
        if pl is not None:
            plans[pl.pages_image] = dataclasses.replace(pl, stack_kept=_inside(pm, pinned.get(pid, [])))
    moved, total = sum(pl.moved_bytes for pl in plans.values()), sum(present_bytes(pm) for _, pm in parsed.values())
    if plans and moved < min(ENGAGE_MIN, total // 100):
        # (a forked tree whose memory stays with CRIU moved a few pages, and paid for a stopped restore
        # and the fill for nothing: 8 KiB of 4.4 GB)
        return {}, (f"the split would move only {moved} of {total} bytes; CRIU restored every page")
    if not plans:
        shared = sum(e.nbytes for pid, (_, pm) in parsed.items() for k, e in enumerate(pm.entries)
                     if k in skip.get(pid, ()) and e.offset is not None)
        return {}, (f"no run of pages is at least {min_bytes} bytes (the largest is {largest})"
                    + (f"; {shared} bytes that parent and child processes share stay with CRIU, which keeps them "
                       "shared" if shared else ""))
    return plans, None


def chunk_starts(stream: Stream) -> tuple[list[int], int]:
    """Where each chunk of STREAM starts, and the stream's length (for pieces)."""
    starts, off = [], 0
    for c in stream.chunks:
        starts.append(off)
        off += c.raw_len
    return starts, off


def pieces(stream: Stream, ranges: tuple[tuple[int, int], ...] | None,
           at: tuple[list[int], int] | None = None) -> list[tuple[int, ChunkRef, int, int]]:
    """(chunk index, chunk, start, end within the chunk) covering RANGES of STREAM in order (None: all).
    AT: chunk_starts(STREAM), for a caller asking of one stream many times (the split fill: once per
    run, and a plan has hundreds)."""
    if ranges is None:
        return [(i, c, 0, c.raw_len) for i, c in enumerate(stream.chunks)]
    starts_, off = at if at is not None else chunk_starts(stream)
    out: list[tuple[int, ChunkRef, int, int]] = []
    import bisect
    for lo, ln in ranges:
        hi = lo + ln
        if hi > off:
            raise SplitError(f"{stream.name}: the pagemap names bytes past the image's end ({hi} > {off})")
        i = max(0, bisect.bisect_right(starts_, lo) - 1)
        while lo < hi:
            c, s = stream.chunks[i], starts_[i]
            e = min(hi, s + c.raw_len)
            out.append((i, c, lo - s, e - s))
            lo = e
            i += 1
    return out


def open_mem(pid: int) -> int:
    """PID's memory (/proc/PID/mem) opened for writing. The descriptor stays bound to the memory of
    the process as it is now: after an exec or the process's end, a write through it reaches nothing
    (write_pinned then fails), whatever the pid comes to name."""
    try:
        return os.open(f"/proc/{pid}/mem", os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SplitError(f"opening the memory of pid {pid}: {e.strerror}") from None


def write_pinned(fd: int, pid: int, addr: int, data: memoryview) -> None:
    """DATA at ADDR through FD (open_mem(PID)); fails, never loops, once the memory FD was opened on is
    gone (the process exited or exec'd: the kernel then writes nothing)."""
    done = 0
    try:
        while done < len(data):
            r = os.pwrite(fd, data[done:], addr + done)
            if r <= 0:
                raise SplitError(f"pid {pid} is no longer the process this restore made (it exited or "
                                 "ran another program); the restore is stopped")
            done += r
    except OSError as e:
        raise SplitError(f"writing into pid {pid} at {addr + done:#x}: {e.strerror}") from None


Key = Union[str, tuple[str, int]]  # a chunk id, or (image, index) of an all-zero chunk
Target = tuple[int, int, int, int]  # (pid, address, lo, hi): the chunk's bytes [lo, hi) go to pid at address
Job = tuple[ChunkRef, list[Target]]  # a chunk, and every place its bytes are written


def check_pids(jobs: dict[Key, Job], pids_ok: Callable[[int], bool]) -> dict[int, tuple[int, ...]]:
    """Before any byte is written: every pid JOBS write into must be one CRIU restored (PIDS_OK). Returns
    each one's identity as checked (processes.memory_identity: its start time in clock ticks since
    boot, where its program's stack and arguments lie): with its pid, what pin_memory binds the writes
    to. Every one checked started at least two ticks before the check began (the check is made again
    a little later where one started just now), so no process started after it has the pid and the
    identity of one checked. One that ran another program since has moved what the identity records,
    except where the program's own code put it back (an unprivileged one: personality's
    ADDR_NO_RANDOMIZE, prctl PR_SET_MM_MAP); a setuid, setgid or file-capability program always gets
    a fresh layout."""
    pids = sorted({t[0] for _, targets in jobs.values() for t in targets})
    while True:
        began = boot_ticks()
        checked: dict[int, tuple[int, ...]] = {}
        for pid in pids:
            before = memory_identity(pid)
            if before is None or not pids_ok(pid) or memory_identity(pid) != before:
                raise SplitError(f"pid {pid} of the snapshot was not restored by CRIU")
            checked[pid] = before
        if max((ident[0] for ident in checked.values()), default=0) < began - 1:
            return checked
        time.sleep(0.03)  # three ticks at the usual 100 Hz; then checked again


def pin_memory(checked: dict[int, tuple[int, ...]]) -> dict[int, int]:
    """/proc/PID/mem of every pid CHECKED names (check_pids' identities), opened for writing and bound
    to the process and program that were checked: the pid's identity read after the open must be the
    one checked. That process started before the check and still holds the pid after the open, so it
    held it at the open, running the program checked or (check_pids) an unprivileged one of its own
    that made itself look the same: the descriptor reaches that process's memory and nobody else's,
    whatever the pid comes to name or run later (write_pinned then fails). pid -> descriptor;
    SplitError (none left open) otherwise. The soft limit on open files is raised toward the hard one
    where the tree needs more."""
    _room_for(len(checked))
    mem: dict[int, int] = {}
    try:
        for pid, ident in checked.items():
            mem[pid] = open_mem(pid)
            if memory_identity(pid) != ident:
                raise SplitError(f"pid {pid} is no longer the process this restore made (it ended or ran "
                                 "another program); the restore is stopped")
        return mem
    except BaseException:
        for fd in mem.values():
            os.close(fd)
        raise


def _room_for(n: int) -> None:
    """N more open files than now fit under the soft limit (raised toward the hard one if not)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = len(os.listdir("/proc/self/fd")) + n + 64
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            pass  # the open that does not fit fails the fill, one line


def fill_jobs(plans: list[Plan], streams: dict[str, Stream]) -> dict[Key, Job]:
    """Every chunk the moved runs of PLANS use, once (processes forked from one another share pages),
    with every place it is written: by chunk id, an all-zero chunk by its place."""
    jobs: dict[Key, Job] = {}
    for p in plans:
        s = streams[p.pages_image]
        at = chunk_starts(s)  # once per image: a plan has many runs
        for run in p.moved:
            addr = run.vaddr
            for i, c, lo, hi in pieces(s, ((run.offset, run.nbytes),), at):
                key = c.id if c.id is not None else (p.pages_image, i)
                jobs.setdefault(key, (c, []))[1].append((p.pid, addr, lo, hi))
                addr += hi - lo
    return jobs

def fill_phases(jobs: dict[Key, Job], first: "Sequence[int]") -> dict[Key, int]:
    """The phase of each chunk of JOBS when the processes FIRST are to be complete one after the other,
    in that order: the rank in FIRST of the first of them the chunk is written into (len(FIRST) for a
    chunk only other processes use). Process FIRST[i] has every moved run once phases 0..i are written."""
    if len(set(first)) != len(first):
        raise SplitError(f"fill_first names a process twice: {list(first)}")
    rank = {p: i for i, p in enumerate(first)}
    last = len(first)
    return {k: min((rank.get(t[0], last) for t in targets), default=last) for k, (_, targets) in jobs.items()}


# Reads every wanted chunk (in any order, from any number of threads) and calls DELIVER(want, data)
# with its verified, decoded bytes, valid only during the call; stops early when STOP() says so; raises
# the first failure. For a local store: storage.repo.readstage.read_chunks in pack order.
ReadAll = Callable[[list[Want], Callable[[Want, memoryview], None], Callable[[], bool]], None]


class Filler:
    """The moved runs of PLANS, read from the moment the plan is known and written once CRIU has made
    the processes; a context manager.

    CRIU restores only the small part (seconds), so the store reads of the large part would
    otherwise wait for it: READ (see ReadAll) starts at once in a thread of its own, over every
    distinct non-zero chunk. Until `write` is called, each delivered chunk is copied into a held
    buffer (at most BUDGET bytes of them; then the read waits); from then on, held chunks are written
    into the stopped processes by WORKERS threads while newly delivered ones are written by the
    thread that delivers them, through /proc/PID/mem opened before the first write and bound to
    the process checked (see `write`), straight from the read stage's buffer. A
    chunk used at several places (processes forked from one another share pages) is read once.
    All-zero chunks are neither read nor written: the fresh mapping already reads as zero. Closing
    before `write` stops the read. With PHASES (fill_phases), the chunks of phase 0 are read first,
    then those of phase 1, and so on, and `write` says when each phase is written, in order."""

    def __init__(self, jobs: "dict[Key, Job]", read: ReadAll, workers: int, budget: int,
                 stages: Stages | None = None, phases: dict[Key, int] | None = None, nphases: int | None = None) -> None:
        """JOBS: fill_jobs(plans, streams), or a share of them (sandbox.criu.fill_procs). NPHASES: how
        many phases there are (default: the highest of PHASES, plus one); each is said, even empty."""
        self.workers = workers
        self.stages = stages if stages is not None else Stages()
        self.jobs = jobs
        self._phase = phases or {}
        n = max(self._phase.values(), default=-1) + 1 if nphases is None else nphases
        if any(not 0 <= p < n for p in self._phase.values()):
            raise SplitError("a chunk's phase is out of range")
        self._left = [0] * n  # chunks not yet written, per phase
        self._mem: dict[int, int] = {}  # pid -> its memory, pinned by `write` (pin_memory)
        for k, (ref, _) in jobs.items():
            if not ref.is_zero and self._left:
                self._left[self._phase.get(k, 0)] += 1
        self._next_phase = 0
        self._on_phase: Callable[[int], None] | None = None
        self._phase_lock = threading.Lock()  # phases said in order, by one thread at a time
        self._out_size = max(1, max((ref.raw_len for ref, _ in jobs.values()), default=1))  # a hostile 0 divides nothing
        self.max_held = max(2, budget // self._out_size)
        self._held: list[AlignedBuffer] = []       # every held buffer made (closed at the end)
        self._free: list[AlignedBuffer] = []
        self._pending: list[tuple[Key, AlignedBuffer]] = []  # delivered before `write`
        self._cond = threading.Condition()
        self._go = False
        self._closing = False
        self._written = 0
        self._error: BaseException | None = None
        wants = sorted((Want(k, ref, self._phase.get(k, 0)) for k, (ref, _) in jobs.items() if not ref.is_zero),
                       key=lambda w: w.group)
        self._reader = threading.Thread(target=self._read, args=(read, wants), name="gpusnap-fill-read",
                                        daemon=True)
        self._reader.start()

    def _ref(self, key: Key) -> ChunkRef:
        return self.jobs[key][0]

    def _read(self, read: ReadAll, wants: list[Want]) -> None:
        try:
            read(wants, self._deliver, lambda: self._closing)
        except BaseException as e:  # noqa: BLE001 - raised by write()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def _deliver(self, want: Want, data: memoryview) -> None:
        """A verified chunk from the read stage: written now once `write` began, else held."""
        key = want.key
        with self._cond:
            self._cond.wait_for(lambda: self._go or self._closing or bool(self._free)
                                or len(self._held) < self.max_held)
            if self._closing:
                raise SplitError("the split restore was stopped")
            buf = None
            if not self._go:
                if self._free:
                    buf = self._free.pop()
                else:
                    buf = AlignedBuffer(self._out_size)
                    self._held.append(buf)
        if buf is None:
            self._put(key, data)
            return
        t0 = time.perf_counter()
        copy_into(buf.view, data)
        self.stages.add("hold", time.perf_counter() - t0, len(data))
        with self._cond:
            if not self._go:
                self._pending.append((key, buf))
                return
        try:  # `write` began while this one was copied
            self._put(key, buf.view[:len(data)])
        finally:
            self._give_back(buf)

    def _give_back(self, buf: AlignedBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify_all()

    def _put(self, key: Key, data: memoryview) -> None:
        """DATA (KEY's bytes) written at every place KEY's chunk is used."""
        targets = self.jobs[key][1]
        t0 = time.perf_counter()
        for pid, addr, lo, hi in targets:  # through the memory pinned before the first byte (write)
            write_pinned(self._mem[pid], pid, addr, data[lo:hi])
        n = sum(hi - lo for _, _, lo, hi in targets)
        self.stages.add("write", time.perf_counter() - t0, n)
        with self._cond:
            self._written += n
        if self._left:
            with self._phase_lock:
                self._left[self._phase.get(key, 0)] -= 1
                self._phases_done()

    def _phases_done(self) -> None:
        """ON_PHASE told of every phase now written whose earlier phases are (under _phase_lock)."""
        while self._next_phase < len(self._left) and self._left[self._next_phase] == 0:
            p, self._next_phase = self._next_phase, self._next_phase + 1
            if self._on_phase is not None:
                self._on_phase(p)

    def write(self, pids_ok: Callable[[int], bool], on_phase: Callable[[int], None] | None = None,
              checked: dict[int, tuple[int, ...]] | None = None) -> dict[str, int]:
        """Every moved run written into its (stopped) process; PIDS_OK(pid) says a planned pid is one
        CRIU restored (CHECKED: check_pids' answer where the caller checked them; a fill worker's
        parent did). ON_PHASE(p) is called (from a fill thread) once phases 0..p are all written,
        for each phase in order. Returns bytes written / skipped as zero.

        A restored process can end while the fill writes (its own timer, a signal from another of the
        tree once the caller lets one run after its phase), and its pid be taken again. So every
        chunk is written through the process's memory opened here and bound to the process that was
        checked (pin_memory), before any byte is written: a pid checked can only ever get its own
        bytes, into the memory that was checked, never a process that took its pid since."""
        if checked is None:
            checked = check_pids(self.jobs, pids_ok)
        mine = {t[0] for ref, targets in self.jobs.values() if not ref.is_zero for t in targets}
        if not mine <= checked.keys():
            raise SplitError(f"pids {sorted(mine - checked.keys())} were not checked before the fill")
        if self._mem:
            raise SplitError("the fill was written already")
        self._mem = pin_memory({pid: checked[pid] for pid in sorted(mine)})
        with self._phase_lock:
            self._on_phase = on_phase
            self._phases_done()  # phases with nothing to read
        with self._cond:
            self._go = True
            held, self._pending = self._pending, []
            self._cond.notify_all()
        held.sort(key=lambda kb: self._phase.get(kb[0], 0))  # phase 0 first (stable: delivery order within)

        def one(item: tuple[Key, AlignedBuffer]) -> None:
            key, buf = item
            try:
                self._put(key, buf.view[:self._ref(key).raw_len])
            finally:
                self._give_back(buf)

        try:
            with ThreadPoolExecutor(self.workers, thread_name_prefix="gpusnap-fill") as ex:
                for _ in ex.map(one, held):
                    pass
        except BaseException:
            self._stop()  # the first failure ends the fill: nothing more is read
            self._reader.join()  # nor written: the caller kills the tree next, and its pids may be taken again
            raise
        self._reader.join()
        if self._error is not None:
            raise self._error
        if self._next_phase != len(self._left):
            raise SplitError(f"the fill wrote everything but said only {self._next_phase} of {len(self._left)} phases")
        zero = sum(hi - lo for ref, targets in self.jobs.values() if ref.is_zero for _, _, lo, hi in targets)
        return {"written": self._written, "zero_skipped": zero}

    def _stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()

    def close(self) -> None:
        self._stop()
        self._reader.join()
        for fd in self._mem.values():
            os.close(fd)
        self._mem.clear()
        for buf in self._held:
            buf.close()
        self._held.clear()
        self._free.clear()

    def __enter__(self) -> "Filler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
