"""One chunk file: its 4096-byte header, its content-derived id, writing it durably, reading it verified.

Guarantees kept here: read_chunk_file returns a payload only after BLAKE3(header[:32] + payload)
equals the id the caller asked for (FORMAT.md, "Chunk files"); a chunk file is opened relative to its
directory's fd with O_NOFOLLOW | O_NONBLOCK and used only if it is a regular file, so a link, a FIFO
or a device in its place is damage found at once, never followed and never waited on; a writer that
fails removes the partial file it was writing.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass

import blake3

from .codecs import CODEC_IDS, CODEC_NAMES
from .directio import ALIGN, AlignedBuffer, align_up, read_into, write_all

from .errors import GpusnapError

MAGIC = b"GSNPCHK1"
HEADER_SIZE = ALIGN
_HDR = struct.Struct("<8sH6xQQ")  # magic, codec id, reserved, raw length, stored length
_BOUND = 32  # bytes of the header bound into the id


class ChunkError(GpusnapError):
    """A chunk file that is missing, short, malformed or does not match its id."""

    def __init__(self, chunk_id: str, what: str) -> None:
        super().__init__(f"chunk {chunk_id[:16]}…: {what}")
        self.chunk_id = chunk_id
        self.what = what


@dataclass(frozen=True)
class ChunkHeader:
    codec: str
    raw_len: int
    stored_len: int

    def pack(self) -> bytes:
        return _HDR.pack(MAGIC, CODEC_IDS[self.codec], self.raw_len, self.stored_len).ljust(_BOUND, b"\0")

    @classmethod
    def unpack(cls, data: bytes | memoryview, chunk_id: str) -> "ChunkHeader":
        magic, codec_id, raw_len, stored_len = _HDR.unpack_from(data)
        if magic != MAGIC:
            raise ChunkError(chunk_id, "bad magic (not a gpusnap chunk, or overwritten)")
        if codec_id not in CODEC_NAMES:
            raise ChunkError(chunk_id, f"unknown codec id {codec_id}")
        return cls(CODEC_NAMES[codec_id], raw_len, stored_len)


def chunk_id(header: ChunkHeader, payload: bytes | memoryview) -> str:
    h = blake3.blake3(header.pack())
    h.update(payload)
    return h.hexdigest()


def write_chunk_file(dir_fd: int, name: str, header: ChunkHeader, frame: memoryview, direct: bool) -> None:
    """Write a new chunk file NAME in the directory DIR_FD from FRAME and fsync it; on failure (a full
    disk) the partial file is removed before the error is raised.

    FRAME is a buffer laid out like the file: the payload already sits at FRAME[HEADER_SIZE:], and
    FRAME has room up to the next ALIGN boundary after it. The header and the zero padding are filled
    in place, so the payload is never copied and one write carries the whole file (O_DIRECT needs
    aligned address, offset and length: pass an aligned frame when DIRECT).
    """
    n = header.stored_len
    end = HEADER_SIZE + n
    total = HEADER_SIZE + align_up(n)
    hdr = header.pack()
    frame[:len(hdr)] = hdr
    frame[len(hdr):HEADER_SIZE] = bytes(HEADER_SIZE - len(hdr))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
    fd = os.open(name, flags, 0o600, dir_fd=dir_fd)
    try:
        if direct:
            frame[end:total] = bytes(total - end)  # never leak stale buffer bytes into the padding
            write_all(fd, frame[:total], 0)
        else:
            write_all(fd, frame[:end], 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.close(fd)


_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def open_chunk(dir_fd: int, cid: str, direct: bool) -> int:
    """The chunk file CID in DIR_FD opened read-only; ChunkError unless it is a regular file."""
    st = None
    try:
        st = os.stat(cid, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):  # never open a FIFO or a device: opening one can block or act
            raise ChunkError(cid, f"is {file_kind(st.st_mode)}, not a chunk file")
        try:
            fd = os.open(cid, _READ | (os.O_DIRECT if direct else 0), dir_fd=dir_fd)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            fd = os.open(cid, _READ, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ChunkError(cid, "missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ChunkError(cid, "is a symbolic link, not a chunk file") from None
        raise
    got = os.fstat(fd)
    if not stat.S_ISREG(got.st_mode) or (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise ChunkError(cid, "was replaced while being opened")
    return fd


def file_kind(mode: int) -> str:
    for test, what in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return what
    return "not a regular file"


def header_matches(dir_fd: int, cid: str, header: ChunkHeader) -> bool:
    """True if the chunk file CID in DIR_FD is a regular file with HEADER's first bytes and at least
    its stored length (the check a writer makes before it reuses a chunk instead of writing it)."""
    try:
        fd = open_chunk(dir_fd, cid, direct=False)
    except (ChunkError, OSError):
        return False
    try:
        return (os.fstat(fd).st_size >= HEADER_SIZE + header.stored_len
                and os.pread(fd, _BOUND, 0) == header.pack())
    except OSError:
        return False
    finally:
        os.close(fd)


def read_chunk_file(dir_fd: int, cid: str, buf: AlignedBuffer, direct: bool) -> tuple[ChunkHeader, memoryview]:
    """Read and verify the chunk CID in the directory DIR_FD into BUF; returns its header and a view
    of its payload."""
    fd = open_chunk(dir_fd, cid, direct)
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_SIZE:
            raise ChunkError(cid, f"truncated ({size} bytes, shorter than its header)")
        want = align_up(size)
        if want > buf.size:
            raise ChunkError(cid, f"is {size} bytes, larger than any chunk this store writes")
        got = read_into(fd, buf.view[:want], 0)
    finally:
        os.close(fd)
    header = ChunkHeader.unpack(buf.view[:_BOUND], cid)
    end = HEADER_SIZE + header.stored_len
    if got < end:
        raise ChunkError(cid, f"truncated ({got} bytes, header says {end})")
    payload = buf.view[HEADER_SIZE:end]
    if chunk_id(header, payload) != cid:
        raise ChunkError(cid, "content does not match its hash (corrupted)")
    return header, payload
