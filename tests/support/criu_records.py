"""CRIU image records built by hand for the parsers' tests: magics, protobuf varints and fields, the
u32-length framing of each record."""
from __future__ import annotations

import struct

MAGICS = b"\x19\x43\x56\x54\x25\x40\x08\x56"  # an image's two magics (any: the parsers skip them)


def varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b, x = x & 0x7F, x >> 7
        out.append(b | (0x80 if x else 0))
        if not x:
            return bytes(out)


def rec(body: bytes) -> bytes:
    """A record of a CRIU image: its u32 length, then its protobuf."""
    return struct.pack("<I", len(body)) + body


def msg(field: int, body: bytes) -> bytes:
    """Field FIELD holding a message (wire type 2)."""
    return varint(field << 3 | 2) + varint(len(body)) + body


def uint(field: int, v: int) -> bytes:
    """Field FIELD holding a varint (wire type 0)."""
    return varint(field << 3) + varint(v)
