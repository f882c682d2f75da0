"""One chunk file: its 4096-byte header, its content-derived id, writing it durably, reading it verified.

Two kinds (FORMAT.md, "Chunk files"): GSNPCHK1, stored-addressed (id = BLAKE3 of header[:32] + payload),
and GSNPCHK2, raw-addressed (id = BLAKE3 derived over the raw bytes; header[32:64] holds the stored
checksum). Guarantees kept here: read_chunk_file returns a payload only after its stored check passed
(GSNPCHK1: the hash equals the id; GSNPCHK2: it equals the stored checksum), and full_check returns raw
bytes only after they are bound to the id (GSNPCHK2: decoded, then the raw bytes derive the id); a
chunk file is opened relative to its
directory's fd with O_NOFOLLOW | O_NONBLOCK and used only if it is a regular file, so a link, a FIFO
or a device in its place is damage found at once, never followed and never waited on; a writer that
fails removes the partial file it was writing.
"""
from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass, replace

import blake3

from storage.codecs import delta
from storage.codecs.registry import CODEC_IDS, CODEC_NAMES, DELTA, CodecError, decode_host, decode_host_into, raw_entry_codecs
from storage.fs.directio import ALIGN, AlignedBuffer, align_up, read_into

from storage.base.errors import DamageError, GpusnapError
from storage.base.limits import MAX_RAW_CHUNK, MAX_STORED_CHUNK

MAGIC = b"GSNPCHK1"      # stored-addressed
MAGIC_RAW = b"GSNPCHK2"  # raw-addressed
RAW_ID_CONTEXT = "gpusnap 2026-11-30 chunk id v2: raw bytes"  # BLAKE3 key derivation: its own id space
HEADER_SIZE = ALIGN
_HDR = struct.Struct("<8sH6xQQ")  # magic, codec id, reserved, raw length, stored length
_BOUND = 32  # bytes of the header bound into the id (GSNPCHK1) or the stored checksum (GSNPCHK2)
_CHECKSUM = 32  # GSNPCHK2: header[32:64]


class ChunkError(DamageError):
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
    raw_id: bool = False         # GSNPCHK2: the id is derived from the raw bytes
    checksum: bytes = bytes(32)  # GSNPCHK2: BLAKE3 of bound() + payload (with_checksum fills it in)

    def bound(self) -> bytes:
        """The header's first 32 bytes: what the GSNPCHK1 id and the GSNPCHK2 checksum cover."""
        magic = MAGIC_RAW if self.raw_id else MAGIC
        return _HDR.pack(magic, CODEC_IDS[self.codec], self.raw_len, self.stored_len).ljust(_BOUND, b"\0")

    def pack(self) -> bytes:
        """The header bytes a file starts with (the rest of its 4096 bytes are zero)."""
        return self.bound() + self.checksum if self.raw_id else self.bound()

    def with_checksum(self, payload: bytes | memoryview) -> "ChunkHeader":
        """This GSNPCHK2 header with the stored checksum of PAYLOAD."""
        return replace(self, checksum=stored_digest(self, payload))

    def fits(self, ref_codec: str, ref_raw_len: int, ref_stored_len: int) -> bool:
        """Whether a file with this header can be what a manifest reference names: GSNPCHK1 exactly;
        GSNPCHK2 by raw length (the same raw bytes may be encoded otherwise: FORMAT.md)."""
        if self.raw_id:
            return self.raw_len == ref_raw_len
        return (self.codec, self.raw_len, self.stored_len) == (ref_codec, ref_raw_len, ref_stored_len)

    @classmethod
    def unpack(cls, data: bytes | memoryview, chunk_id: str) -> "ChunkHeader":
        """Parse the first 64 bytes of a chunk file (ChunkError when they are not a header)."""
        magic, codec_id, raw_len, stored_len = _HDR.unpack_from(data)
        if magic not in (MAGIC, MAGIC_RAW):
            raise ChunkError(chunk_id, "bad magic (not a gpusnap chunk, or overwritten)")
        if codec_id not in CODEC_NAMES:
            raise ChunkError(chunk_id, f"unknown codec id {codec_id}")
        codec = CODEC_NAMES[codec_id]
        if raw_len > MAX_RAW_CHUNK or stored_len > MAX_STORED_CHUNK:
            raise ChunkError(chunk_id, f"claims {raw_len} raw / {stored_len} stored bytes, more than any chunk may hold")
        if magic == MAGIC:
            if codec == DELTA:
                raise ChunkError(chunk_id, "stored-addressed chunk with the delta codec (deltas are raw-addressed)")
            return cls(codec, raw_len, stored_len)
        raw_codecs = raw_entry_codecs()  # the codecs a GSNPCHK2 file may use: the host codecs and the delta
        if codec not in raw_codecs:
            raise ChunkError(chunk_id, f"raw-addressed chunk with codec {codec!r} (only {', '.join(raw_codecs)})")
        if (stored_len > raw_len or (codec == "raw" and stored_len != raw_len) or raw_len > MAX_RAW_CHUNK
                or (codec == DELTA and stored_len < delta.MIN_PAYLOAD)):
            raise ChunkError(chunk_id, f"raw-addressed chunk of {stored_len} stored bytes for {raw_len} raw bytes")
        return cls(codec, raw_len, stored_len, True, bytes(data[_BOUND:_BOUND + _CHECKSUM]))


def chunk_id(header: ChunkHeader, payload: bytes | memoryview) -> str:
    """The GSNPCHK1 (stored-addressed) id of HEADER + PAYLOAD."""
    return stored_digest(header, payload).hex()


def stored_digest(header: ChunkHeader, payload: bytes | memoryview) -> bytes:
    """BLAKE3 of the header's first 32 bytes and PAYLOAD: the GSNPCHK1 id, the GSNPCHK2 stored checksum."""
    h = blake3.blake3(header.bound())
    h.update(payload)
    return h.digest()


def raw_chunk_id(data: bytes | memoryview) -> str:
    """The GSNPCHK2 (raw-addressed) id of the raw bytes DATA."""
    return blake3.blake3(data, derive_key_context=RAW_ID_CONTEXT).hexdigest()


def stored_check(header: ChunkHeader, payload: bytes | memoryview, cid: str) -> None:
    """The check that needs no decoding: ChunkError unless PAYLOAD is what was stored under CID."""
    digest = stored_digest(header, payload)
    if (digest != header.checksum) if header.raw_id else (digest.hex() != cid):
        raise ChunkError(cid, "content does not match its hash (corrupted)")


def full_check(header: ChunkHeader, payload: memoryview, cid: str,
               out: memoryview | None = None, base: "delta.BaseReader | None" = None) -> bytes | memoryview:
    """The raw bytes of chunk CID, bound to it: GSNPCHK1: the stored check, then decoding; GSNPCHK2:
    decoding (at most its raw length), then the raw bytes must derive CID (the id covers every byte,
    so the stored checksum is not needed). ChunkError when damaged. OUT: decode into it (nothing
    allocated; a `raw` payload is returned where it lies). BASE: how a delta entry's base is read
    (storage/codecs/delta.py); without it a delta entry is damage (bytes from outside the store)."""
    if not header.raw_id:
        stored_check(header, payload, cid)
    if header.codec == DELTA:
        try:
            data: bytes | memoryview = delta.decode(header.codec, header.raw_len, payload, cid, out, base)
        except delta.DeltaDamage as e:
            raise ChunkError(cid, e.what) from None
        if raw_chunk_id(data) != cid:
            raise ChunkError(cid, "decoded content does not match its hash (corrupted or forged)")
        return data
    try:
        data = (decode_host(header.codec, payload, header.raw_len) if out is None
                else decode_host_into(header.codec, payload, header.raw_len, out))
    except CodecError as e:
        if not header.raw_id:
            raise  # a GPU codec, or a verified payload that does not decode: not this chunk's damage
        raise ChunkError(cid, f"content does not decode (corrupted): {e}") from None
    if header.raw_id and raw_chunk_id(data) != cid:
        raise ChunkError(cid, "decoded content does not match its hash (corrupted or forged)")
    return data


def id_check(header: ChunkHeader, payload: memoryview, cid: str, base: "delta.BaseReader | None" = None) -> None:
    """Bind PAYLOAD to CID, the strongest check the host can make of any chunk: GSNPCHK1, the stored
    check (its id covers the stored bytes, whatever the codec); GSNPCHK2, the full check (decoded; a
    delta against its base as BASE reads it)."""
    if header.raw_id:
        full_check(header, payload, cid, base=base)
    else:
        stored_check(header, payload, cid)


def check_received(cid: str, ref_codec: str, ref_raw_len: int, ref_stored_len: int,
                   image: memoryview) -> ChunkHeader:
    """The header of IMAGE, a whole chunk file received from elsewhere (a remote object, an export
    archive's member, padding excluded), once it is chunk CID as a manifest references it (codec,
    raw and stored length) and passes id_check; ChunkError otherwise (nothing unverified is stored).
    A delta entry is refused here: bytes from outside the store never name a base (export and push
    expand deltas to plain entries, FORMAT.md "Delta entries")."""
    if len(image) < HEADER_SIZE:
        raise ChunkError(cid, f"is {len(image)} bytes, shorter than a chunk header")
    header = ChunkHeader.unpack(image[:_BOUND + _CHECKSUM], cid)
    if len(image) != HEADER_SIZE + header.stored_len:
        raise ChunkError(cid, f"is {len(image)} bytes, not {HEADER_SIZE + header.stored_len}")
    if not header.fits(ref_codec, ref_raw_len, ref_stored_len):
        raise ChunkError(cid, "has a header that disagrees with the manifest")
    id_check(header, image[HEADER_SIZE:], cid)
    return header


def max_stored_len(codec: str, raw_len: int, stored_len: int) -> int:
    """The most payload bytes a file named by the reference (CODEC, RAW_LEN, STORED_LEN) may hold:
    a GSNPCHK2 file may encode the raw bytes otherwise, never in more than RAW_LEN bytes."""
    return max(stored_len, raw_len) if codec in raw_entry_codecs() else stored_len


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


def reusable(dir_fd: int, cid: str, header: ChunkHeader) -> ChunkHeader | None:
    """The header of the chunk file CID in DIR_FD if a writer about to store HEADER may reuse it
    instead of writing it (FORMAT.md, "Damage and healing"): a regular file of at least its stored
    length whose first 32 bytes are HEADER's (GSNPCHK1), or a sane GSNPCHK2 header of HEADER's raw
    length (any host codec: the same raw bytes, possibly encoded otherwise). None otherwise."""
    try:
        fd = open_chunk(dir_fd, cid, direct=False)
    except (ChunkError, OSError):
        return None
    try:
        head = os.pread(fd, _BOUND + _CHECKSUM, 0)
        if len(head) < _BOUND + _CHECKSUM:
            return None
        if header.raw_id:
            try:
                got = ChunkHeader.unpack(head, cid)
            except (ChunkError, struct.error):
                return None
            if not got.raw_id or got.raw_len != header.raw_len:
                return None
        elif head[:_BOUND] == header.bound():
            got = header
        else:
            return None
        return got if os.fstat(fd).st_size >= HEADER_SIZE + got.stored_len else None
    except OSError:
        return None
    finally:
        os.close(fd)


def read_chunk_file(dir_fd: int, cid: str, buf: AlignedBuffer, direct: bool,
                    check: bool = True) -> tuple[ChunkHeader, memoryview]:
    """Read the chunk CID in the directory DIR_FD into BUF; returns its header and a view of its
    payload, after the stored check (unless not CHECK: the caller makes the full check instead)."""
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
    header = ChunkHeader.unpack(buf.view[:_BOUND + _CHECKSUM], cid)
    end = HEADER_SIZE + header.stored_len
    if got < end:
        raise ChunkError(cid, f"truncated ({got} bytes, header says {end})")
    payload = buf.view[HEADER_SIZE:end]
    if check:
        stored_check(header, payload, cid)
    return header, payload
