"""CPU codecs for chunk payloads (raw, zstd) and the per-chunk choice between them.

Each codec is a tiny object with encode/decode, named and numbered as in FORMAT.md. GPU codecs
(nvCOMP) share the numbering and live in storage/gpu_engine.py so that this module imports without a GPU.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zstandard

# Numbering is part of the on-disk format (FORMAT.md); never reuse an id.
from .errors import GpusnapError

CODEC_IDS: dict[str, int] = {"raw": 0, "zstd": 1, "nvcomp-ans": 16, "nvcomp-bitcomp": 17, "nvcomp-lz4": 18}
CODEC_NAMES: dict[int, str] = {v: k for k, v in CODEC_IDS.items()}
ZERO = "zero"  # not a codec id: a chunk reference with no file

# A chunk whose compressed size is above this fraction of its raw size is stored raw: the CPU time
# spent decompressing it later would buy almost nothing.
PAYS_OFF_RATIO = 0.97
_SAMPLE = 64 * 1024


def _zstd() -> ModuleType:
    """The zstandard module, imported on first use (a listing or --help never needs it)."""
    import zstandard
    return zstandard


class CodecError(GpusnapError):
    """A payload that does not decode, or a codec this build does not know."""


class Codec(Protocol):
    name: str

    def encode(self, data: memoryview) -> bytes | memoryview: ...

    def decode(self, payload: memoryview, raw_len: int) -> bytes | memoryview: ...


class RawCodec:
    name = "raw"

    def encode(self, data: memoryview) -> memoryview:
        return data

    def decode(self, payload: memoryview, raw_len: int) -> memoryview:
        if len(payload) != raw_len:
            raise CodecError(f"raw payload is {len(payload)} bytes, expected {raw_len}")
        return payload


class ZstdCodec:
    """zstd, one frame per chunk. Compressor objects are not thread-safe: one per thread."""

    name = "zstd"

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self._local = threading.local()

    def _cctx(self) -> zstandard.ZstdCompressor:
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = _zstd().ZstdCompressor(level=self.level, write_content_size=True)
        return c

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = _zstd().ZstdDecompressor()
        return d

    def encode(self, data: memoryview) -> bytes:
        return self._cctx().compress(data)

    def decode(self, payload: memoryview, raw_len: int) -> bytes:
        try:
            out = self._dctx().decompress(payload, max_output_size=raw_len)
        except _zstd().ZstdError as e:
            raise CodecError(f"zstd payload does not decode: {e}") from None
        if len(out) != raw_len:
            raise CodecError(f"zstd payload decoded to {len(out)} bytes, expected {raw_len}")
        return out


@dataclass(frozen=True)
class Encoded:
    codec: str
    payload: bytes | memoryview


class HostCodecChooser:
    """Picks the codec for each host chunk: zstd when it pays, raw when it does not.

    A 64 KiB sample is compressed first so that incompressible data (random, encrypted, already
    compressed) costs one small probe instead of a full compression pass.
    """

    def __init__(self, level: int = 1, compress: bool = True) -> None:
        self.zstd = ZstdCodec(level)
        self.raw = RawCodec()
        self.compress = compress

    def encode(self, data: memoryview) -> Encoded:
        if not self.compress or len(data) < 512:
            return Encoded("raw", data)
        if len(data) > 4 * _SAMPLE:
            sample = data[:_SAMPLE]
            if len(self.zstd.encode(sample)) > PAYS_OFF_RATIO * len(sample):
                return Encoded("raw", data)
        payload = self.zstd.encode(data)
        if len(payload) > PAYS_OFF_RATIO * len(data):
            return Encoded("raw", data)
        return Encoded("zstd", payload)


_ZSTD = ZstdCodec()
_HOST_DECODERS: dict[str, Codec] = {"raw": RawCodec(), "zstd": _ZSTD}


def decode_host_into(codec: str, payload: memoryview, raw_len: int, out: memoryview) -> memoryview:
    """PAYLOAD decoded with no allocation: a `raw` payload is its own bytes (the view returned is
    PAYLOAD), a `zstd` one is decoded into OUT (at least RAW_LEN bytes); other host codecs through
    decode_host and a copy into OUT."""
    if codec == "raw":
        if len(payload) != raw_len:
            raise CodecError(f"raw payload of {len(payload)} bytes, expected {raw_len}")
        return payload
    if codec == "zstd":
        dst = out[:raw_len]
        try:
            # the calling thread's own decompressor (they are not thread-safe)
            reader = _ZSTD._dctx().stream_reader(payload, read_size=max(1, len(payload)), read_across_frames=False)
            done = 0
            while done < raw_len:
                n = reader.readinto(dst[done:])
                if n == 0:
                    break
                done += n
            extra = reader.read(1)
        except _zstd().ZstdError as e:
            raise CodecError(f"zstd payload does not decode: {e}") from None
        if extra:
            raise CodecError(f"zstd payload decodes to more than the {raw_len} bytes expected")
        if done != raw_len:
            raise CodecError(f"zstd payload decoded to {done} bytes, expected {raw_len}")
        return dst
    data = decode_host(codec, payload, raw_len)
    out[:raw_len] = data
    return out[:raw_len]


def decode_host(codec: str, payload: memoryview, raw_len: int) -> bytes | memoryview:
    """Decode a chunk payload on the CPU; GPU codecs are decoded by storage.gpu_engine."""
    dec = _HOST_DECODERS.get(codec)
    if dec is None:
        if codec in CODEC_IDS:
            raise CodecError(f"chunk codec {codec!r} needs the GPU path (nvCOMP) to decode")
        raise CodecError(f"unknown chunk codec {codec!r}")
    return dec.decode(payload, raw_len)
