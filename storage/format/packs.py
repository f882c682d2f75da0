"""Pack files and their index (store format v3): chunks appended to large files, found through an index.

Guarantees kept here (FORMAT.md, "Pack files and the index"):
- a pack is fsynced (and packs/ fsynced) before its index is written; an index file is written to
  tmp/, fsynced, renamed into index/ and index/ fsynced; so an indexed pack is always complete and
  durable, and a pack without an index is garbage that no reader ever looks at;
- every index file is validated before any of it is used (size bound, checksum, its pack's name,
  aligned, ascending, non-overlapping records inside the recorded pack length); a read through an
  index entry never goes outside its pack (the pack's real size is checked) and never reads more
  than the caller's buffer, which the manifest's reference sizes;
- an entry's bytes are those of a chunk file, so it passes the same stored and full checks;
- pack and index files are opened relative to checked directory fds with O_NOFOLLOW | O_NONBLOCK and
  used only if they are regular files.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import blake3

from storage.format.chunkfile import HEADER_SIZE, MAX_RAW_CHUNK, ChunkError, ChunkHeader, file_kind
from storage.fs.directio import ALIGN, AlignedBuffer, address_of, align_up, copy_into, read_into, write_all, write_all_direct
from storage.format.storedir import StoreDamage
from storage.base.pausepoint import pause_at

PACK_TARGET = 128 << 20      # a pack is closed once it holds this many bytes (FORMAT.md)
REPACK_BELOW = 0.5           # gc repacks a pack whose live bytes are below this fraction of its length
INDEX_MAX = 16 << 20         # the largest index file loaded
PACK_MAX = 4 << 30           # the largest pack length an index may record
ENTRY_MIN = 2 * ALIGN        # a header and one block
ENTRY_MAX = HEADER_SIZE + MAX_RAW_CHUNK
PACK_NAME = re.compile(r"[0-9a-f]{32}")
_IDX_MAGIC = b"GSNPIDX1"
_IDX_HEAD = struct.Struct("<8s16sQQ24x")  # magic, pack id, entry count, pack length
_IDX_REC = struct.Struct("<32sQQ")         # chunk id, offset, length
_SUM = 32
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
PAUSE_ENV = "GPUSNAP_TEST_PAUSE_PACK"  # test hook, see pause


class IndexDamage(StoreDamage):
    """An index file that is not what FORMAT.md says an index is."""


@dataclass(frozen=True)
class Loc:
    """Where one chunk entry lies: pack P, byte offset and length (header and padding included)."""

    pack: str
    offset: int
    length: int


def pause(stage: str) -> None:
    """Test hook: with GPUSNAP_TEST_PAUSE_PACK=STAGE:FILE, write our pid to FILE and wait until it is
    removed (the first time STAGE is reached in this process), so a test can kill -9 the writer at
    exactly that step: `pack-partial` (a chunk appended, the pack not closed), `pack-synced` (the pack
    fsynced, not yet indexed), `indexed` (the index durable, the manifest not written)."""
    pause_at(PAUSE_ENV, stage)


# ---- index files ------------------------------------------------------------------------------
def encode_index(pack: str, pack_len: int, entries: list[tuple[str, int, int]]) -> bytes:
    """The index file of PACK (its length PACK_LEN) holding ENTRIES (id, offset, length) in offset order."""
    body = bytearray(_IDX_HEAD.pack(_IDX_MAGIC, bytes.fromhex(pack), len(entries), pack_len))
    for cid, off, length in sorted(entries, key=lambda e: e[1]):
        body += _IDX_REC.pack(bytes.fromhex(cid), off, length)
    return bytes(body) + blake3.blake3(body).digest()


def decode_index(name: str, data: bytes) -> tuple[int, list[tuple[str, int, int]]]:
    """(pack length, [(id, offset, length)]) of the index file NAME holding DATA; IndexDamage unless
    it passes every check of FORMAT.md ("Validation on load")."""
    where = f"index/{name}"
    if len(data) < _IDX_HEAD.size + _SUM or (len(data) - _IDX_HEAD.size - _SUM) % _IDX_REC.size:
        raise IndexDamage(f"{where}: {len(data)} bytes is not the size of an index file")
    body, digest = data[:-_SUM], data[-_SUM:]
    if blake3.blake3(body).digest() != digest:
        raise IndexDamage(f"{where}: content does not match its checksum (corrupted)")
    magic, pid, count, pack_len = _IDX_HEAD.unpack_from(body)
    if magic != _IDX_MAGIC:
        raise IndexDamage(f"{where}: bad magic (not a gpusnap index)")
    if pid.hex() != name:
        raise IndexDamage(f"{where}: names pack {pid.hex()}, not {name}")
    if count != (len(body) - _IDX_HEAD.size) // _IDX_REC.size or pack_len > PACK_MAX:
        raise IndexDamage(f"{where}: entry count {count} or pack length {pack_len} out of bounds")
    out: list[tuple[str, int, int]] = []
    end = 0
    for i in range(count):
        raw, off, length = _IDX_REC.unpack_from(body, _IDX_HEAD.size + i * _IDX_REC.size)
        if (off % ALIGN or length % ALIGN or not ENTRY_MIN <= length <= ENTRY_MAX or off < end
                or off + length > pack_len):
            raise IndexDamage(f"{where}: entry {i} (offset {off}, length {length}) is not a valid entry "
                              f"of a pack of {pack_len} bytes")
        end = off + length
        out.append((raw.hex(), off, length))
    return pack_len, out


def read_small(dir_fd: int, name: str, limit: int, where: str) -> bytes:
    """The regular file NAME in DIR_FD, at most LIMIT bytes (IndexDamage otherwise: a link or
    anything else in its place included; FileNotFoundError where it is gone)."""
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)  # FileNotFoundError where it is gone
    if not stat.S_ISREG(st.st_mode):  # a link, device, FIFO, socket or directory in its place: never opened
        raise IndexDamage(f"{where} is {file_kind(st.st_mode)}, not an index file")
    try:
        fd = os.open(name, _READ, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EACCES):  # swapped for one since
            raise IndexDamage(f"{where} cannot be opened as an index file: {e.strerror or e}") from None
        raise  # gone (FileNotFoundError), or this host's trouble (no files left, I/O): not the store's damage
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IndexDamage(f"{where} is {file_kind(st.st_mode)}, not an index file")
        if st.st_size > limit:
            raise IndexDamage(f"{where} is {st.st_size} bytes, more than an index file may be ({limit})")
        chunks = []
        left = limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
        data = b"".join(chunks)
        if len(data) > limit:
            raise IndexDamage(f"{where} grew beyond {limit} bytes while being read")
        return data
    finally:
        os.close(fd)


@dataclass
class PackIndex:
    """Every index file of a store, loaded and validated: chunk id -> its entries."""

    locs: dict[str, list[Loc]] = field(default_factory=dict)
    packs: dict[str, int] = field(default_factory=dict)         # pack -> length the index records
    entries: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)  # pack -> its entries
    damage: dict[str, str] = field(default_factory=dict)        # index file name -> what is wrong
    skip: set[tuple[str, int]] = field(default_factory=set)     # (pack, offset) quarantined

    def refresh(self, index_fd: int) -> None:
        """Load the index files not loaded yet; forget those that are gone (a gc removed them)."""
        names = set()
        with os.scandir(index_fd) as it:
            for e in it:
                if PACK_NAME.fullmatch(e.name):
                    names.add(e.name)
        for gone in [p for p in self.packs if p not in names]:
            self._drop(gone)
        for gone in [p for p in self.damage if p not in names]:
            del self.damage[gone]
        for name in sorted(names - self.packs.keys() - self.damage.keys()):
            try:
                pack_len, ents = decode_index(name, read_small(index_fd, name, INDEX_MAX, f"index/{name}"))
            except IndexDamage as e:
                self.damage[name] = str(e)
                continue
            except FileNotFoundError:
                continue
            self.add(name, pack_len, ents)

    def add(self, pack: str, pack_len: int, ents: list[tuple[str, int, int]]) -> None:
        self.packs[pack] = pack_len
        self.entries[pack] = ents
        for cid, off, length in ents:
            self.locs.setdefault(cid, []).append(Loc(pack, off, length))

    def _drop(self, pack: str) -> None:
        for cid, _, _ in self.entries.pop(pack, []):
            left = [loc for loc in self.locs.get(cid, []) if loc.pack != pack]
            if left:
                self.locs[cid] = left
            else:
                self.locs.pop(cid, None)
        self.packs.pop(pack, None)

    def find(self, cid: str) -> list[Loc]:
        """The entries of CID, quarantined ones left out (the order a reader tries them in)."""
        return [loc for loc in self.locs.get(cid, ()) if (loc.pack, loc.offset) not in self.skip]


def write_index(tmp_fd: int, index_fd: int, tmp_name: str, pack: str, pack_len: int,
                entries: list[tuple[str, int, int]]) -> None:
    """Write index/PACK durably: to tmp/TMP_NAME, fsynced, renamed, index/ fsynced."""
    data = encode_index(pack, pack_len, entries)
    fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                 dir_fd=tmp_fd)
    try:
        write_all(fd, memoryview(data), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        _unlink(tmp_fd, tmp_name)
        raise
    os.close(fd)
    try:
        os.rename(tmp_name, pack, src_dir_fd=tmp_fd, dst_dir_fd=index_fd)
    except BaseException:
        _unlink(tmp_fd, tmp_name)
        raise
    os.fsync(index_fd)


def _unlink(dir_fd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


# ---- reading entries ------------------------------------------------------------------------
def open_pack(packs_fd: int, pack: str, cid: str, direct: bool = False) -> int:
    """Pack PACK opened read-only (DIRECT: with O_DIRECT, where the file system takes it; else
    buffered); ChunkError (naming CID) unless it is a regular file."""
    try:
        try:
            fd = os.open(pack, _READ | (os.O_DIRECT if direct else 0), dir_fd=packs_fd)
        except OSError as e:
            if not (direct and e.errno == errno.EINVAL):
                raise
            fd = os.open(pack, _READ, dir_fd=packs_fd)  # a file system without O_DIRECT: buffered
    except FileNotFoundError:
        raise ChunkError(cid, f"missing (its pack {pack[:12]}… is gone)") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ChunkError(cid, f"its pack {pack[:12]}… is a symbolic link, not a pack file") from None
        raise ChunkError(cid, f"its pack {pack[:12]}… cannot be opened: {e.strerror or e}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ChunkError(cid, f"its pack {pack[:12]}… is {file_kind(st.st_mode)}, not a pack file")
    return fd


def read_entry(fd: int, loc: Loc, pack_len: int, cid: str, buf: AlignedBuffer) -> tuple[ChunkHeader, memoryview]:
    """Read the entry LOC of the open pack FD into BUF: its header and a view of its payload (not yet
    checked: the caller makes the stored or the full check). ChunkError when the entry cannot be CID's."""
    if loc.length > buf.size:
        raise ChunkError(cid, f"its index entry is {loc.length} bytes, larger than the snapshot's chunk")
    got = read_into(fd, buf.view[:loc.length], loc.offset)  # a read at or past the end returns short
    if got < loc.length:
        raise ChunkError(cid, f"truncated ({got} of its {loc.length} bytes in pack {loc.pack[:12]}…; "
                         f"the index says the pack is {pack_len} bytes)")
    return parse_entry(buf.view[:loc.length], cid)


def parse_entry(view: memoryview, cid: str) -> tuple[ChunkHeader, memoryview]:
    """The header and payload of the entry bytes VIEW (the header's stored length must fit in it)."""
    try:
        header = ChunkHeader.unpack(view[:64], cid)
    except struct.error:
        raise ChunkError(cid, "truncated (shorter than its header)") from None
    if HEADER_SIZE + header.stored_len > len(view):
        raise ChunkError(cid, f"its entry is {len(view)} bytes, its header says {HEADER_SIZE + header.stored_len}")
    return header, view[HEADER_SIZE:HEADER_SIZE + header.stored_len]


# ---- writing ---------------------------------------------------------------------------------
def _write_direct(fd: int, view: memoryview, offset: int) -> None:
    """directio.write_all_direct into a pack; a refused write (EINVAL) names the settings that write
    packs through the page cache instead."""
    try:
        write_all_direct(fd, view, offset)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise OSError(e.errno, "the file system refused a direct (O_DIRECT) write into a pack; "
                          "GPUSNAP_PUT_DIRECT=0 (store put) or GPUSNAP_DUMP_DIRECT=0 (dumps) write packs "
                          "through the page cache") from None
        raise


class _OpenPack:
    def __init__(self, name: str, fd: int, direct: bool) -> None:
        self.name = name
        self.fd = fd
        self.direct = direct  # opened with O_DIRECT: every entry of it is written so
        self.end = 0
        self.entries: list[tuple[str, int, int]] = []
        self.headers: dict[str, ChunkHeader] = {}
        self.inflight = 0
        self.closed = False
        self.done = threading.Condition()


class PackWriter:
    """The pack stage of one writer: chunks handed to append() go to the open pack, written where they
    lie with one large write each, no fsync per chunk; a full pack is closed (fsynced, indexed) by the
    thread whose chunk filled it, while the other producers go on into the next pack.

    ON_INDEXED(pack, pack_len, entries) is called once a pack's index is durable (the store adds it to
    its in-memory index); ON_APPENDED(cid, loc) once an entry's bytes are in its pack (readers of this
    process may read it from there before it is indexed: a pull that serves arriving chunks);
    ON_DROPPED(pack) when an open pack is removed. BEFORE_APPEND(header) before each entry is written (the
    store lists the entry's codec in its marker first: FORMAT.md, "The marker's `requires`").

    DIRECT: every pack of this writer is opened with O_DIRECT and every entry written through it (an
    entry whose frame is not page-aligned, which no caller in the tree makes today, is copied into an
    aligned buffer first), so their bytes do not pass through the page cache (the store's dedup
    lookups read an entry's header through it: a few pages). Where packs/
    refuses O_DIRECT at open (another file system mounted there than the one the store probed), the
    writer goes on buffered from that pack on. A pack is never written both ways: on a kernel with
    pages larger than 4 KiB a buffered entry would share a page with a direct one, and the dirty page
    written back could carry stale bytes over the direct entry."""

    def __init__(self, packs_fd: int, index_fd: int, tmp_fd: int, tmp_name: Callable[[], str],
                 on_indexed: Callable[[str, int, list[tuple[str, int, int]]], None],
                 on_appended: Callable[[str, Loc], None] | None = None,
                 on_dropped: Callable[[str], None] | None = None, target: int = PACK_TARGET,
                 direct: bool = False, before_append: Callable[[ChunkHeader], None] | None = None) -> None:
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.packs_fd, self.index_fd, self.tmp_fd = packs_fd, index_fd, tmp_fd
        self.tmp_name = tmp_name
        self.on_indexed = on_indexed
        self.on_appended = on_appended
        self.on_dropped = on_dropped
        self.before_append = before_append
        self.target = target
        self._lock = threading.Lock()
        self._open: _OpenPack | None = None
        self.sealed: list[str] = []
        self.write_s = 0.0   # thread-seconds in the pack writes
        self.sync_s = 0.0    # thread-seconds closing packs (fsync + index)

    def _new_pack(self) -> _OpenPack:
        name = secrets.token_hex(16)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.direct:
            try:
                return _OpenPack(name, os.open(name, flags | os.O_DIRECT, 0o600, dir_fd=self.packs_fd), True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # (the open failed: nothing was created)
        return _OpenPack(name, os.open(name, flags, 0o600, dir_fd=self.packs_fd), False)

    def pending(self, cid: str) -> ChunkHeader | None:
        """The header of CID if this writer's open pack already holds it."""
        with self._lock:
            p = self._open
            return None if p is None else p.headers.get(cid)

    def append(self, cid: str, header: ChunkHeader, frame: memoryview) -> Loc:
        """Append chunk CID (HEADER, its payload at FRAME[HEADER_SIZE:]) to the open pack; FRAME must
        have room to the next 4096-byte boundary after the payload (the header and the zero padding are
        filled in place, so the entry is one write of bytes already in memory)."""
        if self.before_append is not None:
            self.before_append(header)  # the store's marker lists the entry's codec before its bytes land
        n = header.stored_len
        total = HEADER_SIZE + align_up(n)
        hdr = header.pack()
        frame[:len(hdr)] = hdr
        frame[len(hdr):HEADER_SIZE] = bytes(HEADER_SIZE - len(hdr))
        frame[HEADER_SIZE + n:total] = bytes(total - HEADER_SIZE - n)
        with self._lock:
            if self._open is None:
                self._open = self._new_pack()
            p = self._open
            off = p.end
            p.end += total
            p.inflight += 1
            full = p.end >= self.target
            if full:
                p.closed = True
                self._open = None
        t0 = time.perf_counter()
        bounce: AlignedBuffer | None = None
        try:
            data = frame[:total]
            if not p.direct:
                write_all(p.fd, data, off)
            else:
                if address_of(data) % ALIGN:
                    bounce = AlignedBuffer(total)
                    copy_into(bounce.view, data)
                    data = bounce.view[:total]
                _write_direct(p.fd, data, off)
        except BaseException:
            with p.done:
                p.inflight -= 1
                p.entries.append(("", off, -1))  # a hole: the pack must not be indexed
                p.done.notify_all()
            raise
        finally:
            if bounce is not None:
                del data
                bounce.close()
        dt = time.perf_counter() - t0
        with p.done:
            p.entries.append((cid, off, total))
            p.inflight -= 1
            p.done.notify_all()
        with self._lock:
            self.write_s += dt
            p.headers[cid] = header
        loc = Loc(p.name, off, total)
        if self.on_appended is not None:
            self.on_appended(cid, loc)
        pause("pack-partial")
        if full:
            self._seal(p)
        return loc

    def _seal(self, p: _OpenPack) -> None:
        t0 = time.perf_counter()
        with p.done:
            while p.inflight:
                p.done.wait()
        try:
            if any(length < 0 for _, _, length in p.entries):
                raise OSError(errno.EIO, "a chunk write into the pack failed")
            os.fsync(p.fd)
            os.fsync(self.packs_fd)
            pause("pack-synced")
            ents = sorted(p.entries, key=lambda e: e[1])
            write_index(self.tmp_fd, self.index_fd, self.tmp_name(), p.name, p.end, ents)
        except BaseException:
            _unlink(self.packs_fd, p.name)  # not indexed: nothing can need it (a full disk, an I/O error)
            if self.on_dropped is not None:
                self.on_dropped(p.name)
            raise
        finally:
            os.close(p.fd)
            p.fd = -1
        self.on_indexed(p.name, p.end, ents)
        with self._lock:
            self.sealed.append(p.name)
            self.sync_s += time.perf_counter() - t0
        pause("indexed")

    def flush(self) -> None:
        """Close and index the open pack now (commit, or a chunk-reference log about to name chunks)."""
        with self._lock:
            p = self._open
            if p is None:
                return
            p.closed = True
            self._open = None
        if p.entries or p.inflight:
            self._seal(p)
        else:
            os.close(p.fd)
            _unlink(self.packs_fd, p.name)
            if self.on_dropped is not None:
                self.on_dropped(p.name)

    def abort(self) -> None:
        """Remove the open pack (not indexed: nothing names it); closed packs stay for gc."""
        with self._lock:
            p = self._open
            self._open = None
        if p is not None:
            with p.done:
                while p.inflight:
                    p.done.wait()
            os.close(p.fd)
            _unlink(self.packs_fd, p.name)
            if self.on_dropped is not None:
                self.on_dropped(p.name)


def coalesce(locs: Iterable[tuple[int, Loc]], gap: int = 0, most: int = 64 << 20) -> list[list[tuple[int, Loc]]]:
    """Group (key, Loc) pairs into runs of adjacent entries of one pack (at most MOST bytes a run), in
    the order given: each run is one large read."""
    runs: list[list[tuple[int, Loc]]] = []
    for k, loc in locs:
        if runs:
            last = runs[-1][-1][1]
            first = runs[-1][0][1]
            if (last.pack == loc.pack and 0 <= loc.offset - (last.offset + last.length) <= gap
                    and loc.offset + loc.length - first.offset <= most):
                runs[-1].append((k, loc))
                continue
        runs.append([(k, loc)])
    return runs
