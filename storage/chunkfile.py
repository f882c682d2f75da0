"""One chunk file: its 4096-byte header, its content-derived id, writing it durably, reading it verified.

Guarantee kept here: read_chunk returns a payload only after BLAKE3(header[:32] + payload) equals
the id the caller asked for (FORMAT.md, "Chunk files").
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import blake3

from .codecs import CODEC_IDS, CODEC_NAMES
from .directio import ALIGN, AlignedBuffer, align_up, open_for_read, open_for_write, read_into, write_all

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


def write_chunk_file(path: str, header: ChunkHeader, frame: memoryview, direct: bool) -> None:
    """Write a new chunk file at PATH from FRAME and fsync it.

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
    fd = open_for_write(path, direct)
    try:
        if direct:
            frame[end:total] = bytes(total - end)  # never leak stale buffer bytes into the padding
            write_all(fd, frame[:total], 0)
        else:
            write_all(fd, frame[:end], 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_chunk_file(path: str, cid: str, buf: AlignedBuffer, direct: bool) -> tuple[ChunkHeader, memoryview]:
    """Read and verify the chunk CID at PATH into BUF; returns its header and a view of its payload."""
    try:
        fd, _ = open_for_read(path, direct)
    except FileNotFoundError:
        raise ChunkError(cid, "missing") from None
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
